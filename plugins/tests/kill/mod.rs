//! Kill-and-resume with replay on, shared by the CPU (test double) and CUDA test binaries: the test
//! re-runs itself (its own name, `--exact`) as a child process with the `PTL_KILL_*` variables set;
//! that process runs the fit, which the parent SIGKILLs. The device comes from the calling binary.

use ptl_autograd::Device;
use ptl_plugins::replay_shortfalls;
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

pub const KILL_EPOCHS: usize = 6;
const KILL_BATCHES: usize = 5;

/// The fit a child process runs: `replay` over the killed run's folder, resuming from its
/// `last.ckpt` when there is one.
fn kill_cfg(dev: Device, data: &std::path::Path, save: &std::path::Path, replay: &str, nbs: usize) -> PoseTrainConfig {
    let last = save.join("weights/last.ckpt");
    PoseTrainConfig {
        data: data.to_path_buf(),
        epochs: KILL_EPOCHS,
        batch: 2,
        imgsz: 64,
        seed: 7,
        device: dev,
        // bf16 autocast on the GPU; the CPU (CI) runs fp32, which is several times faster there.
        precision: if dev.is_cuda() { Precision::Bf16Mixed } else { Precision::F32 },
        workers: Some(2),
        max_batches: Some(KILL_BATCHES),
        nbs,
        optimizer: "MuSGD".into(),
        close_mosaic: 2,
        plots: false,
        progress: false,
        gpu_time: false,
        exist_ok: true,
        replay: replay.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect(),
        resume: last.exists().then_some(last),
        save_dir: save.to_path_buf(),
        ..PoseTrainConfig::default()
    }
}

/// In a child process (the `PTL_KILL_*` variables set): its fit on `dev`; `false` in the parent.
fn ran_as_child(dev: Device) -> bool {
    let Ok(save) = std::env::var("PTL_KILL_SAVE") else { return false };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set although PTL_KILL_SAVE is"));
    let data = std::path::PathBuf::from(var("PTL_KILL_DATA"));
    let nbs = var("PTL_KILL_NBS").parse().expect("PTL_KILL_NBS is a number");
    fit(&kill_cfg(dev, &data, std::path::Path::new(&save), &var("PTL_KILL_REPLAY"), nbs), vec![]).expect("child fit");
    true
}

/// A child process running test `test` of this binary over `save`.
/// How the killed fits run: the replay plugins and the nominal batch size (2 = an optimizer step
/// every batch; 64, the default, one in 32 at batch 2).
#[derive(Clone, Copy)]
pub struct KillRun<'a> {
    pub replay: &'a str,
    pub nbs: usize,
}

fn spawn_child(
    test: &str,
    data: &std::path::Path,
    save: &std::path::Path,
    run: (&str, usize),
    log: &std::path::Path,
) -> std::process::Child {
    let (replay, nbs) = run;
    let out = std::fs::File::create(log).expect("child log");
    std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env("PTL_KILL_DATA", data)
        .env("PTL_KILL_SAVE", save)
        .env("PTL_KILL_REPLAY", replay)
        .env("PTL_KILL_NBS", nbs.to_string())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .spawn()
        .expect("start the child fit")
}

/// The body of test `test` on `dev` (`tag` names the device in the scratch folder): an
/// uninterrupted native child, three SIGKILLed `run.replay` children each killed after a new
/// checkpoint, a final resume; its hashes equal native and every region of `plugins` replayed
/// every call after its warm-up. In a child process it is that child's fit instead.
pub fn killed_and_resumed_ends_with_the_native_hashes(test: &str, tag: &str, dev: Device, run: KillRun<'_>, plugins: &[&str]) {
    if ran_as_child(dev) {
        return;
    }
    use std::time::{Duration, Instant};
    let root = std::env::temp_dir().join(format!("ptl-{tag}-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let data = ptl_test_support::pose_dataset(&root, 16, 4);
    let summary = |save: &std::path::Path| -> ptl_trainer::fit::RunSummary {
        let p = save.join("summary.json");
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).expect("summary")
    };
    // Uninterrupted native reference, in a child process too (same start-up as the killed ones).
    let native_dir = root.join("native");
    let t0 = Instant::now();
    let st = spawn_child(test, &data, &native_dir, ("", run.nbs), &root.join("native.log")).wait().expect("native child");
    assert!(st.success(), "native child failed: see {}", root.join("native.log").display());
    let reference_s = t0.elapsed().as_secs_f64();
    let native = summary(&native_dir);

    let killed = root.join("killed");
    let last = killed.join("weights/last.ckpt");
    let epochs_done = || -> i64 {
        if last.exists() {
            ptl_trainer::fit::read_manifest(&last).map(|m| m.loop_state.epoch + 1).unwrap_or(-1)
        } else {
            0
        }
    };
    // Each kill lands after the run has written a checkpoint beyond the previous one (so every
    // resume continues a checkpoint), a little later each time, mid-epoch or mid-save.
    let mut landed = Vec::new();
    // Set when a process finished the run before its kill moment: the epoch it had resumed at.
    let mut finished_from = None;
    for i in 0..3 {
        let log = root.join(format!("killed-{i}.log"));
        let before = epochs_done();
        let mut child = spawn_child(test, &data, &killed, (run.replay, run.nbs), &log);
        let deadline = Instant::now() + Duration::from_secs_f64(reference_s * 3.0 + 30.0);
        while epochs_done() <= before && child.try_wait().expect("poll").is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_secs_f64(reference_s / KILL_EPOCHS as f64 * (0.05 + 0.1 * i as f64)));
        if let Some(st) = child.try_wait().expect("poll") {
            assert!(st.success(), "child {i} failed: see {}", log.display());
            finished_from = Some(before.max(0) as usize);
            break;
        }
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let epochs = epochs_done();
        assert!(epochs >= 0, "the last.ckpt left by kill {i} does not read");
        landed.push(epochs);
        println!("kill {i}: last.ckpt holds {epochs} of {KILL_EPOCHS} epochs");
    }
    assert!(landed.iter().any(|&e| e > 0 && (e as usize) < KILL_EPOCHS), "no kill landed mid-run after a checkpoint: {landed:?}");
    let resumed_from = match finished_from {
        Some(from) => from,
        None => {
            let from = epochs_done() as usize;
            let log = root.join("killed-final.log");
            let st = spawn_child(test, &data, &killed, (run.replay, run.nbs), &log).wait().expect("final child");
            assert!(st.success(), "the final resumed child failed: see {}", log.display());
            from
        }
    };
    let s = summary(&killed);
    assert_eq!(s.hashes, native.hashes, "killed and resumed with replay ≡ uninterrupted native");
    let steps = ((KILL_EPOCHS - resumed_from) * KILL_BATCHES) as u64;
    for plugin in plugins {
        // A plugin called per optimizer step is checked with a step every batch (nbs = batch).
        let per_step = s.replay_cadence.get(*plugin) == Some(&ptl_trainer::fit::ReplayCadence::PerOptimizerStep);
        assert!(!per_step || run.nbs == 2, "{plugin}: check it with nbs = batch = 2");
        let short = replay_shortfalls(&s, plugin, steps, &[]);
        assert!(short.is_empty(), "{plugin} over the last {steps} steps: {short:?}");
    }
    println!("ok {tag} kill-and-resume: kills left {landed:?} epochs; the last process resumed at epoch {resumed_from}, hashes = native");
    let _ = std::fs::remove_dir_all(&root);
}

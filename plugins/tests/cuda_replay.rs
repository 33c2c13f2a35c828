//! Real CUDA graphs in real fits: native vs `replay=feature` vs `replay=feature,stem` in every
//! precision — identical hashes, and every region replayed on every step after its warm-up.
//! Without a usable GPU the test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use ptl_autograd::Device;
use ptl_plugins::{replay_shortfalls, PieceReplay};
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

fn gpu() -> Option<Device> {
    ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
}

#[test]
fn cuda_replay_equals_native_in_every_precision() {
    let Some(dev) = gpu() else { return };
    assert_eq!((PieceReplay::FEATURE, PieceReplay::STEM), ("feature", "stem"));
    let dir = std::env::temp_dir().join(format!("ptl-cuda-replay-{}", std::process::id()));
    let data = ptl_data::synth_generate(&ptl_data::SynthOptions {
        out: dir.join("ds"),
        train: 40,
        background: 10,
        val: 4,
        imgsz: 64,
        seed: 5,
        ..Default::default()
    })
    .expect("dataset")
    .yaml;
    for precision in [Precision::F32, Precision::Bf16Mixed, Precision::F16Mixed] {
        let run = |replay: &[&str]| {
            let cfg = PoseTrainConfig {
                data: data.clone(),
                epochs: 1,
                batch: 2,
                imgsz: 64,
                seed: 3,
                device: dev,
                precision,
                workers: Some(2),
                optimizer: "MuSGD".into(),
                close_mosaic: 0,
                plots: false,
                progress: false,
                gpu_time: false,
                exist_ok: true,
                replay: replay.iter().map(|s| s.to_string()).collect(),
                save_dir: dir.join(format!("{}-{}", precision.name(), replay.join("+"))),
                ..PoseTrainConfig::default()
            };
            fit(&cfg, vec![]).expect("fit")
        };
        let native = run(&[]);
        let feature = run(&["feature"]);
        let both = run(&["feature", "stem"]);
        assert_eq!(feature.hashes, native.hashes, "{}: replay=feature", precision.name());
        assert_eq!(both.hashes, native.hashes, "{}: replay=feature,stem", precision.name());
        let steps = 20u64;
        for (s, plugin, regions) in [(&feature, "feature", 1), (&both, "feature", 1), (&both, "stem", 18)] {
            assert_eq!(s.replay_counters[plugin].as_object().map(|c| c.len()), Some(regions), "{}: {plugin}", precision.name());
            let short = replay_shortfalls(s, plugin, steps, &[]);
            assert!(short.is_empty(), "{}: {short:?}", precision.name());
        }
        println!("ok cuda replay {}: {}", precision.name(), both.plugins.join(" || ").chars().take(300).collect::<String>());
    }
}

// ---- kill-and-resume with replay on ------------------------------------------------------------

const KILL_EPOCHS: usize = 6;
const KILL_BATCHES: usize = 5;

/// The fit a child process runs: `replay` over the killed run's folder, resuming from its
/// `last.ckpt` when there is one.
fn kill_cfg(dev: Device, data: &std::path::Path, save: &std::path::Path, replay: &str) -> PoseTrainConfig {
    let last = save.join("weights/last.ckpt");
    PoseTrainConfig {
        data: data.to_path_buf(),
        epochs: KILL_EPOCHS,
        batch: 2,
        imgsz: 64,
        seed: 7,
        device: dev,
        precision: Precision::Bf16Mixed,
        workers: Some(2),
        max_batches: Some(KILL_BATCHES),
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

/// Not a test of its own: the fit of one child process of
/// [`cuda_replayed_fit_killed_and_resumed_ends_with_the_native_hashes`] (which runs it with
/// `--ignored --exact` and the `PTL_KILL_*` variables).
#[test]
#[ignore = "helper: the child process of the kill-and-resume test"]
fn kill_resume_child() {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set: run through the kill-and-resume test"));
    let dev = gpu().expect("the parent saw a GPU");
    let (data, save) = (std::path::PathBuf::from(var("PTL_KILL_DATA")), std::path::PathBuf::from(var("PTL_KILL_SAVE")));
    fit(&kill_cfg(dev, &data, &save, &var("PTL_KILL_REPLAY")), vec![]).expect("child fit");
}

/// A `kill_resume_child` process over `save`.
fn spawn_child(data: &std::path::Path, save: &std::path::Path, replay: &str, log: &std::path::Path) -> std::process::Child {
    let out = std::fs::File::create(log).expect("child log");
    std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--ignored", "--exact", "kill_resume_child", "--nocapture", "--test-threads=1"])
        .env("PTL_KILL_DATA", data)
        .env("PTL_KILL_SAVE", save)
        .env("PTL_KILL_REPLAY", replay)
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .spawn()
        .expect("start the child fit")
}

/// SIGKILLs a `replay=feature,stem` bf16 fit three times mid-run (CUDA graphs live), each time after
/// it wrote a new checkpoint, resumes it from `last.ckpt` each time, and lets the last process finish: its hashes equal an uninterrupted native
/// fit's, and the last process's regions replayed every step after their warm-up.
#[test]
fn cuda_replayed_fit_killed_and_resumed_ends_with_the_native_hashes() {
    if gpu().is_none() {
        return;
    }
    use std::time::{Duration, Instant};
    let root = std::env::temp_dir().join(format!("ptl-cuda-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let data = ptl_data::synth_generate(&ptl_data::SynthOptions {
        out: root.join("ds"),
        train: 16,
        background: 4,
        val: 4,
        imgsz: 64,
        seed: 5,
        ..Default::default()
    })
    .expect("dataset")
    .yaml;
    let summary = |save: &std::path::Path| -> ptl_trainer::fit::RunSummary {
        let p = save.join("summary.json");
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).expect("summary")
    };
    // Uninterrupted native reference, in a child process too (same start-up as the killed ones).
    let native_dir = root.join("native");
    let t0 = Instant::now();
    let st = spawn_child(&data, &native_dir, "", &root.join("native.log")).wait().expect("native child");
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
        let mut child = spawn_child(&data, &killed, "feature,stem", &log);
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
            let st = spawn_child(&data, &killed, "feature,stem", &log).wait().expect("final child");
            assert!(st.success(), "the final resumed child failed: see {}", log.display());
            from
        }
    };
    let s = summary(&killed);
    assert_eq!(s.hashes, native.hashes, "killed and resumed with replay ≡ uninterrupted native");
    let steps = ((KILL_EPOCHS - resumed_from) * KILL_BATCHES) as u64;
    for (plugin, regions) in [("feature", 1), ("stem", 18)] {
        assert_eq!(s.replay_counters[plugin].as_object().map(|c| c.len()), Some(regions), "{plugin}");
        let short = replay_shortfalls(&s, plugin, steps, &[]);
        assert!(short.is_empty(), "{plugin} over the last {steps} steps: {short:?}");
    }
    println!("ok cuda kill-and-resume: kills left {landed:?} epochs; the last process resumed at epoch {resumed_from}, hashes = native");
    let _ = std::fs::remove_dir_all(&root);
}

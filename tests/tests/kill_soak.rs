//! Kill soak of `ptl train`: a run SIGKILLed at 20 pseudo-random moments and resumed from
//! `weights/last.ckpt` after each kill ends with exactly the uninterrupted run's hashes (model,
//! optimizer, scheduler, EMA, loss sequence), and every `last.ckpt` left behind by a kill loads.
//!
//! Run with `--nocapture` to see where the kills landed.

mod common;

use std::fs::File;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use ptl_autograd::Device;
use ptl_trainer::fit::load_checkpoint;

use common::Running;

const EPOCHS: usize = 20;
const KILLS: usize = 20;
/// Seed of the kill moments.
const KILL_SEED: u64 = 0x5eed_c1a5;

/// SplitMix64: a fixed, dependency-free sequence of kill delays.
struct SplitMix(u64);

impl SplitMix {
    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as f64 / 2f64.powi(64)
    }
}

/// Starts `ptl ARGS` with stdout and stderr going to `log`.
fn spawn(args: &[String], log: &Path) -> Running {
    let out = File::create(log).expect("log file");
    let err = out.try_clone().expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_ptl-ext"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("start ptl");
    Running(Some(child))
}

/// Waits for the child up to `limit`; `None` if it is still running then.
fn wait_for(r: &mut Running, limit: Duration) -> Option<ExitStatus> {
    let child = r.0.as_mut().expect("child");
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("poll ptl") {
            r.0 = None;
            return Some(s);
        }
        if start.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGKILLs the child (`Child::kill`) and reaps it.
fn kill(r: &mut Running) {
    let mut child = r.0.take().expect("child");
    child.kill().expect("SIGKILL ptl");
    let _ = child.wait();
}

/// The training command (same keys for the fresh run and every resume). nbs 6 ⇒ accumulate 3
/// over 4 batches per epoch, so optimizer steps straddle epoch boundaries and most checkpoints
/// hold pending gradients.
fn train_args(data: &Path, project: &Path) -> Vec<String> {
    let mut a: Vec<String> =
        ["train", &format!("data={}", data.display()), &format!("epochs={EPOCHS}")].iter().map(|s| s.to_string()).collect();
    a.extend(["batch=2", "imgsz=64", "seed=11", "optimizer=SGD", "nbs=6", "workers=0", "plots=false"].iter().map(|s| s.to_string()));
    a.push(format!("save_dir={}", project.display()));
    a.extend(["--device".to_string(), "cpu".to_string()]);
    a
}

fn hashes(project: &Path) -> serde_json::Value {
    common::summary(project)["hashes"].clone()
}

/// Data rows of `results.csv` (0 when absent).
fn csv_rows(project: &Path) -> usize {
    std::fs::read_to_string(project.join("results.csv")).map_or(0, |t| t.lines().count().saturating_sub(1))
}

/// The `epoch` column of `results.csv`, one entry per data row.
fn csv_epochs(project: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(project.join("results.csv")).unwrap_or_default();
    text.lines().skip(1).map(|l| l.split(',').next().unwrap_or("").trim_end_matches(".000000").to_string()).collect()
}

/// Epochs completed according to `last.ckpt` (which must load), 0 when there is none yet.
fn completed_epochs(last: &Path) -> usize {
    if !last.exists() {
        return 0;
    }
    let ck = load_checkpoint(last, Device::Cpu).unwrap_or_else(|e| panic!("{} left by a kill does not load: {e}", last.display()));
    (ck.manifest.loop_state.epoch + 1) as usize
}

/// SIGKILL at 20 seeded moments (0.2 s to 0.2 s + 2 epochs after each start), resume after each
/// from `last.ckpt` with the same keys (fresh start while there is none), then let a run finish:
/// its hashes equal the uninterrupted run's.
#[test]
fn sigkill_and_resume_gives_the_uninterrupted_hashes() {
    let t0 = Instant::now();
    let root = std::env::temp_dir().join(format!("ptl-kill-soak-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).expect("soak folder");
    let data = root.join("data");
    let synth: Vec<String> =
        ["data", "synth", "--out", &data.display().to_string()].iter().chain(&common::SYNTH_OPTIONS).map(|s| s.to_string()).collect();
    let status = wait_for(&mut spawn(&synth, &logs.join("synth.log")), Duration::from_secs(60));
    assert!(status.is_some_and(|s| s.success()), "ptl data synth failed (see {})", logs.display());
    let yaml = data.join("data.yaml");

    // Uninterrupted reference.
    let p1 = root.join("P1");
    let started = Instant::now();
    let status = wait_for(&mut spawn(&train_args(&yaml, &p1), &logs.join("P1.log")), Duration::from_secs(170));
    assert!(status.is_some_and(|s| s.success()), "uninterrupted run failed (see {})", logs.join("P1.log").display());
    let reference_s = started.elapsed().as_secs_f64();
    let reference = hashes(&p1);
    let max_delay = 0.2 + 2.0 * reference_s / EPOCHS as f64;

    // Killed and resumed run.
    let p2 = root.join("P2");
    let last = p2.join("weights").join("last.ckpt");
    let mut rng = SplitMix(KILL_SEED);
    // (delay, epochs checkpointed when the kill landed)
    let mut landed: Vec<(f64, usize)> = Vec::new();
    let mut between_row_and_ckpt = 0;
    let mut extra_rows = 0;
    let mut runs = 0;
    loop {
        runs += 1;
        let mut args = train_args(&yaml, &p2);
        if last.exists() {
            args.push(format!("resume={}", last.display()));
        }
        let log = logs.join(format!("P2-{runs:02}.log"));
        let mut child = spawn(&args, &log);
        let limit = if landed.len() < KILLS { 0.2 + rng.next_f64() * (max_delay - 0.2) } else { 170.0 };
        if let Some(status) = wait_for(&mut child, Duration::from_secs_f64(limit)) {
            assert!(status.success(), "run {runs} failed: {status} (see {})", log.display());
            break;
        }
        assert!(landed.len() < KILLS, "the final run did not finish in time (see {})", log.display());
        kill(&mut child);
        let done = completed_epochs(&last);
        // A kill after an epoch's results.csv row and before its checkpoint: the resumed run
        // appends that epoch's row again.
        let rows = csv_rows(&p2);
        let extra = rows.saturating_sub(done);
        if extra > extra_rows {
            between_row_and_ckpt += 1;
        }
        extra_rows = extra;
        landed.push((limit, done));
    }
    let resumed = hashes(&p2);

    println!(
        "kill soak: {} kills landed over {runs} runs ({EPOCHS} epochs, reference run {reference_s:.1} s, delays 0.2–{max_delay:.2} s), {:.1} s in all",
        landed.len(),
        t0.elapsed().as_secs_f64()
    );
    for (i, &(d, done)) in landed.iter().enumerate() {
        let at = match done {
            0 => "epoch 0 (no checkpoint yet)".to_string(),
            d if d >= EPOCHS => format!("after epoch {} (final checkpoint written)", EPOCHS - 1),
            d => format!("epoch {d} (epochs 0–{} checkpointed)", d - 1),
        };
        println!("  kill {:2}: after {d:.2} s, in {at}", i + 1);
    }
    println!(
        "  results.csv: {} rows for {EPOCHS} epochs ({between_row_and_ckpt} kills landed between an epoch's row and its checkpoint); \
         epoch column: {}",
        csv_rows(&p2),
        csv_epochs(&p2).join(" ")
    );
    assert!(landed.iter().any(|&(_, done)| done > 0), "no kill landed after a checkpoint: no resume was tested");
    assert_eq!(
        resumed,
        reference,
        "hashes after {} kills and resumes differ from the uninterrupted run's (runs and logs kept in {})",
        landed.len(),
        root.display()
    );
    // results.csv follows the checkpoints: one row per epoch, in order, whatever the kills hit.
    let want: Vec<String> = (1..=EPOCHS).map(|e| e.to_string()).collect();
    assert_eq!(csv_epochs(&p2), want, "results.csv rows after the kills (logs kept in {})", root.display());
    let _ = std::fs::remove_dir_all(&root);
}

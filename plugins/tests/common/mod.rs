//! What the plugin test binaries share: a small synthetic dataset and a tiny CPU fit.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ptl_trainer::pose::PoseTrainConfig;

const PREFIX: &str = "ptl-plugins-tests";

/// This test process's folder under the temporary directory, `<tmp>/ptl-plugins-tests-<pid>`: every run of
/// the tests writes into it. A tiny fit leaves ~100 MB of checkpoints, so when the folder is first
/// made the ones of earlier, finished test processes are removed (Linux: a process is finished when
/// `/proc/<pid>` is gone; elsewhere nothing is removed).
fn process_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let tmp = std::env::temp_dir();
        let me = std::process::id();
        let finished = |pid: u32| Path::new("/proc/self").exists() && !Path::new("/proc").join(pid.to_string()).exists();
        for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.strip_prefix(PREFIX).and_then(|p| p.strip_prefix('-')).and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| p != me && finished(p)) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        tmp.join(format!("{PREFIX}-{me}"))
    })
}

/// A fresh folder `name` inside this process's folder (what an earlier test of the same name
/// left is removed).
pub fn scratch(name: &str) -> PathBuf {
    let d = process_root().join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A synthetic dataset of 8 + 2 background training images at 64 px, made once per process.
pub fn dataset() -> PathBuf {
    static YAML: OnceLock<PathBuf> = OnceLock::new();
    YAML.get_or_init(|| {
        let dir = scratch("data");
        let opts =
            ptl_data::SynthOptions { out: dir, train: 8, background: 2, val: 2, imgsz: 64, seed: 3, threads: 1, ..Default::default() };
        ptl_data::synth_generate(&opts).expect("synthetic dataset").yaml
    })
    .clone()
}

/// Two epochs of three batches of 2 at 64 px with SGD, replaying through `replay`.
pub fn tiny(save: &str, replay: &[&str]) -> PoseTrainConfig {
    PoseTrainConfig {
        data: dataset(),
        epochs: 2,
        batch: 2,
        imgsz: 64,
        seed: 11,
        workers: Some(0),
        max_batches: Some(3),
        timing_warmup_steps: 0,
        save_dir: scratch(save),
        plots: false,
        progress: false,
        optimizer: "SGD".into(),
        replay: replay.iter().map(|s| s.to_string()).collect(),
        exist_ok: true,
        ..PoseTrainConfig::default()
    }
}

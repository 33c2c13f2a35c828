//! What ptl's test binaries share (a dev-dependency only): one scratch folder per test process, and
//! the tiny synthetic pose dataset the CPU fit tests train on.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const PREFIX: &str = "ptl-tests";

/// This test process's folder under the temporary directory, `<tmp>/ptl-tests-<pid>`: every run of
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

/// 8 pose images + 2 backgrounds for training and 2 for validation at 64 px, generated once per
/// test process; its `data.yaml`.
pub fn tiny_dataset() -> PathBuf {
    static YAML: OnceLock<PathBuf> = OnceLock::new();
    YAML.get_or_init(|| {
        let opts = ptl_data::SynthOptions {
            out: scratch("data"),
            train: 8,
            background: 2,
            val: 2,
            imgsz: 64,
            seed: 3,
            threads: 1,
            ..Default::default()
        };
        ptl_data::synth_generate(&opts).expect("synthetic dataset").yaml
    })
    .clone()
}

/// A 64 px synthetic pose dataset of `train` images (`background` of them empty) and 4 validation
/// images in `dir/ds`, seed 5: the CUDA replay and kill-and-resume fits' data; its `data.yaml`.
pub fn pose_dataset(dir: &Path, train: usize, background: usize) -> PathBuf {
    let opts = ptl_data::SynthOptions { out: dir.join("ds"), train, background, val: 4, imgsz: 64, seed: 5, ..Default::default() };
    ptl_data::synth_generate(&opts).expect("synthetic dataset").yaml
}

//! What the CPU fit tests share: a 64-px synthetic dataset and a tiny fit configuration.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ptl_trainer::pose::PoseTrainConfig;

/// 8 pose images + 2 backgrounds for training and 2 for validation at 64 px, generated once per
/// test process; its `data.yaml`.
pub fn dataset() -> PathBuf {
    static YAML: OnceLock<PathBuf> = OnceLock::new();
    YAML.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ptl-trainer-data-{}", std::process::id()));
        let opts =
            ptl_data::SynthOptions { out: dir, train: 8, background: 2, val: 2, imgsz: 64, seed: 3, threads: 1, ..Default::default() };
        ptl_data::synth_generate(&opts).expect("synthetic dataset").yaml
    })
    .clone()
}

/// 2 epochs of 2 batches of 2 images at 64 px, SGD, on the training thread, saved to `save_dir`.
pub fn tiny_in(save_dir: &Path) -> PoseTrainConfig {
    PoseTrainConfig {
        data: dataset(),
        epochs: 2,
        batch: 2,
        imgsz: 64,
        seed: 11,
        workers: Some(0),
        max_batches: Some(2),
        timing_warmup_steps: 0,
        save_dir: save_dir.to_path_buf(),
        plots: false,
        progress: false,
        optimizer: "SGD".into(),
        ..PoseTrainConfig::default()
    }
}

//! What the CPU fit tests share: a 64-px synthetic dataset and a tiny fit configuration.

use std::path::{Path, PathBuf};

use ptl_trainer::pose::PoseTrainConfig;

pub use ptl_test_support::scratch;

/// The tiny synthetic dataset (`ptl_test_support::tiny_dataset`).
pub fn dataset() -> PathBuf {
    ptl_test_support::tiny_dataset()
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

//! What the plugin test binaries share: a small synthetic dataset and a tiny CPU fit.

use std::path::PathBuf;

use ptl_trainer::pose::PoseTrainConfig;

pub use ptl_test_support::scratch;

/// The tiny synthetic dataset (`ptl_test_support::tiny_dataset`).
pub fn dataset() -> PathBuf {
    ptl_test_support::tiny_dataset()
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

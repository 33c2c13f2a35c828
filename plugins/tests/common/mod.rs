//! What the plugin test binaries share: a small synthetic dataset, a tiny CPU fit and the base CUDA fit.
#![allow(dead_code)] // each test binary uses a part

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

/// The 64 px CUDA fit the CUDA fit tests start from: one epoch of batches of 2 on `data`, MuSGD,
/// `seed`, two loader workers, mosaic kept, no plots, progress or GPU trace, `replay` into `save`.
pub fn cuda_fit_cfg(
    data: &std::path::Path,
    dev: ptl_autograd::Device,
    seed: u64,
    replay: &[&str],
    save: std::path::PathBuf,
) -> PoseTrainConfig {
    PoseTrainConfig {
        data: data.to_path_buf(),
        epochs: 1,
        batch: 2,
        imgsz: 64,
        seed,
        device: dev,
        workers: Some(2),
        optimizer: "MuSGD".into(),
        close_mosaic: 0,
        plots: false,
        progress: false,
        gpu_time: false,
        exist_ok: true,
        replay: replay.iter().map(|s| s.to_string()).collect(),
        save_dir: save,
        ..PoseTrainConfig::default()
    }
}

/// Writes `people` small people (box and 17 visible keypoints) into a label file, in a grid.
pub fn write_people(label: &std::path::Path, people: usize) {
    let mut lines = String::new();
    for p in 0..people {
        let (cx, cy) = (0.15 + 0.23 * (p % 4) as f64, 0.15 + 0.23 * (p / 4) as f64);
        lines.push_str(&format!("0 {cx:.4} {cy:.4} 0.1500 0.1800"));
        for k in 0..17 {
            let (dx, dy) = (((k % 5) as f64 - 2.0) * 0.02, ((k / 5) as f64 - 1.5) * 0.03);
            lines.push_str(&format!(" {:.4} {:.4} 2", cx + dx, cy + dy));
        }
        lines.push('\n');
    }
    std::fs::write(label, lines).expect("label file");
}

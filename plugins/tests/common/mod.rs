//! What the plugin test binaries share: a small synthetic dataset and a tiny CPU fit.

use std::path::PathBuf;
use std::sync::OnceLock;

use ptl_trainer::pose::PoseTrainConfig;

/// A synthetic dataset of 8 + 2 background training images at 64 px, made once per process.
pub fn dataset() -> PathBuf {
    static YAML: OnceLock<PathBuf> = OnceLock::new();
    YAML.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ptl-plugins-data-{}", std::process::id()));
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
        save_dir: std::env::temp_dir().join(format!("ptl-plugins-fit-{save}-{}", std::process::id())),
        plots: false,
        progress: false,
        optimizer: "SGD".into(),
        replay: replay.iter().map(|s| s.to_string()).collect(),
        exist_ok: true,
        ..PoseTrainConfig::default()
    }
}

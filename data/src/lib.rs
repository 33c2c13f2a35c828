//! `ptl-data`: pose datasets for YOLO26n-pose training, following docs/data.md (Ultralytics 8.4.190 behaviour).
//!
//! * Sources: Ultralytics layout (dataset yaml + `images/` + `labels/*.txt`) via [`PoseDataset::open_yaml`], COCO
//!   keypoints JSON via [`PoseDataset::from_coco`], and the synthetic generator [`synth::generate`].
//! * Images are decoded once (JPEG/PNG, EXIF orientation), resized so the long side is `imgsz`, and kept in RAM;
//!   optionally cached on disk ([`cache`]).
//! * Training: [`TrainLoader`] builds batches deterministically from (seed, epoch, batch) — mosaic, random affine,
//!   HSV, flips, format — and [`Prefetcher`] prepares them ahead on worker threads. Validation: [`ValLoader`]
//!   (rect batches, letterbox).
//! * HSV: [`hsv`] holds the CPU reference, a pure per-pixel function; with the `cuda` feature (default)
//!   `device_hsv::apply_hsv_device` applies a whole uploaded batch in one kernel launch, byte-identical.
//!
//! Write a small synthetic set, open it and build the first training batch:
//!
//! ```
//! use std::sync::Arc;
//! use ptl_data::{synth_generate, OpenOptions, PoseDataset, SynthOptions, TrainConfig, TrainLoader};
//!
//! # fn main() -> ptl_data::Result<()> {
//! let dir = std::env::temp_dir().join(format!("ptl-data-doc-{}", std::process::id()));
//! let set = synth_generate(&SynthOptions { out: dir.clone(), train: 4, background: 1, val: 1, imgsz: 64, ..Default::default() })?;
//! let train = PoseDataset::open_yaml(&set.yaml, "train", &OpenOptions { imgsz: 64, ..Default::default() })?;
//! assert_eq!(train.len(), 4);
//! let loader = TrainLoader::new(Arc::new(train), TrainConfig { batch: 2, seed: 0, epochs: 1, ..Default::default() })?;
//! let batch = loader.build_batch(0, 0)?; // epoch 0, batch 0: mosaic, affine, HSV, flips
//! assert_eq!(batch.shape, [2, 3, 64, 64]); // u8 RGB, with its objects' boxes and keypoints
//! assert_eq!(batch.bboxes.len(), 4 * batch.batch_idx.len());
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
pub mod augment;
pub mod cache;
pub mod canvas;
pub mod coco;
pub mod config;
pub mod dataset;
#[cfg(feature = "cuda")]
pub mod device_hsv;
pub mod error;
#[doc(hidden)]
pub mod fuzz;
pub mod hsv;
pub mod image;
pub mod labels;
pub mod loader;
pub mod rng;
pub mod synth;

pub use augment::AugmentConfig;
pub use config::DatasetConfig;
pub use dataset::{OpenOptions, PoseDataset, ScanReport, SkipReason};
pub use error::{DataError, Result};
pub use hsv::{apply_hsv_batch_rgb_nchw, apply_hsv_bgr_hwc, HsvGains, HsvLut};
pub use labels::KptShape;
pub use loader::{Batch, BatchStage, PrefetchPlan, Prefetcher, RatioPad, Shard, TrainConfig, TrainLoader, ValLoader};
pub use synth::{ensure as synth_ensure, generate as synth_generate, SynthOptions, SynthStats};

/// The most threads a thread-count setting may ask for: four per core, and at least 8 (so
/// Ultralytics' default of 8 loader workers is accepted on any machine). More would only make the
/// threads fight for cores — and a large number exhausts memory and process limits.
pub fn thread_limit() -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (4 * cores).max(8)
}

/// Refuses a thread count above [`thread_limit`], naming the setting.
pub fn check_threads(setting: &str, n: usize) -> Result<()> {
    let limit = thread_limit();
    if n > limit {
        return Err(DataError::Invalid(format!(
            "{setting} {n} is more than the {limit} threads this machine can use (4 per core; 0 = all cores)"
        )));
    }
    Ok(())
}

//! `ptl-data`: pose datasets for YOLO26n-pose training, following data.md (Ultralytics 8.4.190 behaviour).
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

pub mod augment;
pub mod cache;
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
pub use loader::{Batch, BatchStage, PrefetchPlan, Prefetcher, RatioPad, TrainConfig, TrainLoader, ValLoader};
pub use synth::{ensure as synth_ensure, generate as synth_generate, SynthOptions, SynthStats};

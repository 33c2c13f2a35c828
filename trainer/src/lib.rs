//! ptl-trainer: loss, fit loop and validation for YOLO26n-pose.
//!
//! The metrics part works on plain host vectors with explicit shapes so that
//! it does not depend on the tensor library: the fit loop converts its device
//! tensors to `Vec<f32>` and feeds them here.
//!
//! A fit reports through the [`log`](https://docs.rs/log) facade — its per-epoch table at
//! `info`, what it decided for you (another run folder, AutoBatch's batch, a skipped epoch) at
//! `info` or `warn` — so the program decides what is shown: the `ptl` command line prints them
//! to stderr (`-q`: warnings only); a program of your own installs any `log` logger.
//!
//! Train from Rust code — the settings are `ptl train`'s keys (`PoseTrainConfig::set` takes them
//! as text too):
//!
//! ```
//! use ptl_trainer::pose::{fit, PoseTrainConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::env::temp_dir().join(format!("ptl-trainer-doc-{}", std::process::id()));
//! let set = ptl_data::synth_generate(&ptl_data::SynthOptions {
//!     out: dir.join("data"), train: 4, background: 0, val: 2, imgsz: 64, ..Default::default()
//! })?;
//! let mut cfg = PoseTrainConfig { data: set.yaml, epochs: 1, batch: 2, imgsz: 64, save_dir: dir.join("run"), ..Default::default() };
//! cfg.set("optimizer", "SGD")?;
//! cfg.set("plots", "false")?;
//! let summary = fit(&cfg, vec![])?; // callbacks: ptl_trainer::fit::Callback
//! assert_eq!(summary.epochs, 1);
//! assert!(summary.metrics_per_epoch.len() == 1 && dir.join("run/weights/last.ckpt").exists());
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
pub mod distributed;
pub mod error;
pub mod fit;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod pose;

pub use error::{Result, TrainerError};

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

pub mod error;
pub mod fit;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod pose;

pub use error::{Result, TrainerError};

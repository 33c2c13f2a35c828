//! ptl-trainer: loss, fit loop and validation for YOLO26n-pose.
//!
//! The metrics part works on plain host vectors with explicit shapes so that
//! it does not depend on the tensor library: the fit loop converts its device
//! tensors to `Vec<f32>` and feeds them here.

pub mod error;
pub mod fit;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod pose;

pub use error::{Result, TrainerError};

//! # ptl-heads
//!
//! The YOLO26-pose network (model.md): building blocks ([`nn`], [`blocks`]), the backbone and
//! neck ([`model`]), the `Pose26` head with its 18 individually addressable stems ([`head`]), the
//! RealNVP flow of the RLE loss ([`flow`]), anchors and decoding ([`decode`]), and a model
//! summary ([`summary`]). Parameter and buffer names are exactly the reference `state_dict()`
//! names (`model.0.conv.weight`, …, `model.23.one2one_cv4_sigma.2.bias`).

pub mod blocks;
pub mod decode;
pub mod error;
pub mod flow;
pub mod head;
pub mod model;
pub mod nn;
pub mod summary;

pub use decode::{decode_boxes, decode_kpts, decode_predictions, make_anchors};
pub use error::{HeadsError, Result};
pub use flow::RealNvp;
pub use head::{Branch, BranchOutput, HeadOutput, Pose26, StemKind, StemRef};
pub use model::{ModelConfig, PoseModel, Prediction, Scale};
pub use nn::{autocast, AutocastGuard};
pub use summary::ModelSummary;

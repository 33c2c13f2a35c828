//! # ptl-heads
//!
//! The YOLO26-pose network (model.md): building blocks ([`nn`], [`blocks`]), the backbone and
//! neck, the `Pose26` head with its 18 individually addressable stems ([`head`]), the RealNVP flow
//! of the RLE loss ([`flow`]), anchors and decoding ([`decode`]), and a model summary.
//! Parameter and buffer names are exactly the reference `state_dict()` names.

pub mod error;
pub mod flow;
pub mod nn;

pub use error::{HeadsError, Result};
pub use flow::RealNvp;

//! # ptl-heads
//!
//! The YOLO26-pose network (docs/model.md): building blocks ([`nn`], [`blocks`]), the backbone and
//! neck ([`model`]), the `Pose26` head with its 18 individually addressable stems ([`head`]), the
//! RealNVP flow of the RLE loss ([`flow`]), anchors and decoding ([`decode`]), and a model
//! summary ([`summary`]). Parameter and buffer names are exactly the reference `state_dict()`
//! names (`model.0.conv.weight`, …, `model.23.one2one_cv4_sigma.2.bias`).
//!
//! ```
//! use ptl_autograd::{DType, Device, Module, Tensor};
//! use ptl_heads::{Branch, ModelConfig, ModelSummary, PoseModel, Scale, StemKind};
//!
//! # fn main() -> ptl_heads::Result<()> {
//! // nc = 1 "person", 17×3 keypoints, scale n; PyTorch-default init from a Philox seed.
//! let mut model = PoseModel::new(ModelConfig { nc: 1, kpt_shape: (17, 3), scale: Scale::N }, Device::Cpu, 0)?;
//! assert_eq!(model.num_params(), 3_679_464);
//! // model.load_safetensors(Path::new(".../weights.safetensors"))?;  // reference names, strict
//!
//! // Training forward: raw outputs of both branch sets (o2o on detached features).
//! let x = Tensor::zeros(vec![1, 3, 64, 64], DType::F32, Device::Cpu)?;
//! let out = model.forward(&x)?;
//! assert_eq!(out.one2many.kpts.dims(), &[1, 51, 84]); // 8·8 + 4·4 + 2·2 anchors
//! assert!(out.one2one.kpts_sigma.is_some());
//!
//! // Stems are addressable and callable on their own.
//! let stem = model.head().stem(Branch::OneToOne, 2, StemKind::Point).expect("stem");
//! assert_eq!(stem.forward(&out.feats[2])?.dims(), &[1, 85, 2, 2]);
//!
//! // The flow of the RLE loss.
//! let e = Tensor::zeros(vec![5, 2], DType::F32, Device::Cpu)?;
//! assert_eq!(model.head().flow_model.log_prob(&e)?.dims(), &[5]);
//!
//! // Eval: decoded o2m output (cx, cy, w, h px, sigmoid score, 17 × (x px, y px, sigmoid v)).
//! model.set_training(false);
//! let pred = model.predict(&x)?;
//! assert_eq!(pred.decoded.dims(), &[1, 56, 84]);
//! println!("{}", ModelSummary::new(&model, 640));
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
pub mod blocks;
pub mod decode;
pub mod error;
pub mod flow;
pub mod head;
pub mod model;
pub mod nn;
pub mod pieces;
pub mod summary;

pub use decode::{decode_boxes, decode_boxes_grid, decode_kpts, decode_kpts_grid, decode_predictions, make_anchors};
pub use error::{HeadsError, Result};
pub use flow::RealNvp;
pub use head::{Branch, BranchOutput, HeadOutput, Pose26, StemKind, StemRef};
pub use model::{ModelConfig, PoseModel, Prediction, Scale};
pub use pieces::{NativeRunner, Piece, PieceBody, PieceRunner, PieceSurface};
pub use summary::ModelSummary;

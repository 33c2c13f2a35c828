//! YOLO26-pose training loss (docs/loss.md): anchors, the pose task-aligned assigner, the six loss
//! terms of one branch ([`PoseLoss26`]) and the two-branch criterion ([`E2ELoss`]).
//!
//! * Everything differentiable is written with `ptl-autograd` ops on the predictions' device, so
//!   gradients reach the raw head outputs and the RealNVP flow.
//! * The assigner ([`assigner`]) is a **deliberate first version on host `f32` vectors**: it runs
//!   under `no_grad`, reads the detached predictions once per branch (one device→host sync) and
//!   reproduces the reference's float32 arithmetic order where thresholds and ties decide
//!   assignments. Its results (fg indices, targets) go back to the predictions' device as small
//!   tensors. A tensor-op version for the GPU can replace it behind the same [`Assignment`] type.
//! * Top-k ties are broken by the lowest anchor index (docs/loss.md §2.4).
//! * Predictions are copied to the host only at candidate anchors (candidates depend on the
//!   targets alone); NaN/inf in any output is caught by one device-side sum and reported as
//!   [`TrainerError::NonFinite`](crate::TrainerError::NonFinite) naming the tensor and element.
//!
//! ```
//! use ptl_autograd::{Device, Rng, Tensor};
//! use ptl_heads::{nn::Init, RealNvp};
//! use ptl_trainer::loss::{Anchors, BranchOutputs, E2ELoss, LossConfig, TargetBatch};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::Cpu;
//! let cfg = LossConfig::default();
//! let anchors = Anchors::from_image_hw((64, 64), &cfg.strides)?; // A = 64 + 16 + 4
//! let a = anchors.len();
//! let out = |c: usize, v: f32| -> ptl_autograd::Result<Tensor> {
//!     Tensor::full((1, c, a), f64::from(v), ptl_autograd::DType::F32, dev)?.requires_grad_(true)
//! };
//! // Raw training-mode outputs of one branch set (the model's HeadOutput provides these).
//! let o2m = BranchOutputs { boxes: out(4, 1.0)?, scores: out(1, -2.0)?, kpts: out(51, 0.0)?, kpts_sigma: Some(out(34, 0.0)?) };
//! let o2o = o2m.clone();
//! // One person: normalised (cx, cy, w, h) and 17 keypoints (x, y, v).
//! let kp: Vec<f32> = (0..17).flat_map(|k| [0.4 + 0.01 * k as f32, 0.5, 2.0]).collect();
//! let targets = TargetBatch { batch_idx: vec![0.0], cls: vec![0.0], bboxes: vec![0.5, 0.5, 0.4, 0.6], keypoints: kp, nkpt: 17 };
//! let flow = RealNvp::new(&mut Init { rng: &mut Rng::new(0), device: dev })?;
//! let mut criterion = E2ELoss::new(cfg, 100); // 100 epochs: weights 0.8/0.2 → 0.1/0.9
//! let loss = criterion.loss(&o2m, &o2o, &targets, &anchors, Some(&flow))?;
//! loss.total.backward()?; // gradients reach the raw outputs and the flow
//! println!("{:?}", loss.items); // o2o [box, pose, kobj, cls, l1, rle], what the trainer logs
//! criterion.update(); // once at the end of every epoch
//! # Ok(()) }
//! ```

pub mod anchors;
pub mod assign_dense;
#[cfg(feature = "cuda")]
pub mod assign_fused;
pub mod assigner;
pub mod boxes;
pub mod branch;
#[cfg(feature = "cuda")]
pub mod ciou_fused;
pub mod dense;
#[cfg(feature = "cuda")]
mod device_kernels;
pub mod e2e;
#[cfg(feature = "cuda")]
pub mod flow_fused;
#[cfg(feature = "cuda")]
pub mod kpt_fused;
pub mod targets;
pub mod terms;

pub use anchors::Anchors;
pub use assigner::{assign, candidate_sets, AssignInputs, AssignParams, Assignment, CandidateSets};
pub use branch::{BranchLoss, BranchOutputs, PoseLoss26};
pub use e2e::{DeferredItems, E2ELoss, ForwardBody, LossOutput, LossRoute, StepBody, StepPrepare};
pub use targets::TargetBatch;

use ptl_autograd::Tensor;

/// COCO OKS sigmas (docs/loss.md §6), float32 as the reference stores them.
pub const OKS_SIGMA: [f32; 17] =
    [0.026, 0.025, 0.025, 0.035, 0.035, 0.079, 0.079, 0.072, 0.072, 0.062, 0.062, 0.107, 0.107, 0.087, 0.087, 0.089, 0.089];

/// RLE per-keypoint weights for COCO keypoints (docs/loss.md §6).
pub const RLE_WEIGHT: [f32; 17] = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.2, 1.2, 1.5, 1.5, 1.0, 1.0, 1.2, 1.2, 1.5, 1.5];

/// Names of the six logged loss items, in slot order.
pub const LOSS_NAMES: [&str; 6] = ["box_loss", "pose_loss", "kobj_loss", "cls_loss", "l1_loss", "rle_loss"];

/// The flow's density in the RLE term: `log_prob(e)` for `e` of shape (N, 2) → (N,).
///
/// Implemented by the model's RealNVP (`ptl_heads::RealNvp`); kept as a trait so the loss does not
/// depend on how the flow is built.
pub trait FlowLogProb {
    /// log φ of each error 2-vector in `e`.
    fn log_prob(&self, e: &Tensor) -> crate::error::Result<Tensor>;
}

impl FlowLogProb for ptl_heads::RealNvp {
    /// On CUDA the fused kernels of [`flow_fused`]; elsewhere the composed ops.
    fn log_prob(&self, e: &Tensor) -> crate::error::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(lp) = flow_fused::log_prob(self, e)? {
            return Ok(lp);
        }
        ptl_heads::RealNvp::log_prob(self, e).map_err(|err| match err {
            ptl_heads::HeadsError::Tensor(t) => crate::error::TrainerError::Tensor(t),
            other => crate::error::TrainerError::InvalidArgument { what: "flow.log_prob", reason: other.to_string() },
        })
    }
}

/// Loss hyper-parameters (gains and keypoint constants).
#[derive(Clone, Debug, PartialEq)]
pub struct LossConfig {
    /// Box CIoU gain (7.5).
    pub box_gain: f64,
    /// Keypoint location gain (12).
    pub pose_gain: f64,
    /// Keypoint visibility gain (1).
    pub kobj_gain: f64,
    /// Classification gain (0.5).
    pub cls_gain: f64,
    /// The "dfl" gain, used by the box-side L1 term when reg_max = 1.
    pub l1_gain: f64,
    /// RLE gain (1).
    pub rle_gain: f64,
    /// Number of classes.
    pub nc: usize,
    /// Number of keypoints (17 for COCO).
    pub nkpt: usize,
    /// Per-keypoint OKS sigmas (length `nkpt`).
    pub sigmas: Vec<f32>,
    /// Per-keypoint RLE weights (length `nkpt`).
    pub rle_weights: Vec<f32>,
    /// Level strides (P3, P4, P5).
    pub strides: Vec<f64>,
    /// Assign and compute the terms with fixed shapes on the predictions' device
    /// ([`assign_dense`], [`dense`]: no host read, or one for the items) instead of the host
    /// assigner. Off in this struct's default; fits turn it on on a GPU (`loss_assigner=auto`).
    pub dense_assignment: bool,
}

impl Default for LossConfig {
    fn default() -> Self {
        LossConfig {
            box_gain: 7.5,
            pose_gain: 12.0,
            kobj_gain: 1.0,
            cls_gain: 0.5,
            l1_gain: 1.5,
            rle_gain: 1.0,
            nc: 1,
            nkpt: 17,
            sigmas: OKS_SIGMA.to_vec(),
            rle_weights: RLE_WEIGHT.to_vec(),
            strides: vec![8.0, 16.0, 32.0],
            dense_assignment: false,
        }
    }
}

impl LossConfig {
    /// Config for a keypoint count other than 17: sigmas 1/K and RLE weights 1 unless given.
    pub fn with_keypoints(nkpt: usize, sigmas: Option<Vec<f32>>) -> LossConfig {
        let base = LossConfig::default();
        if nkpt == 17 {
            return LossConfig { sigmas: sigmas.unwrap_or(base.sigmas.clone()), ..base };
        }
        LossConfig { nkpt, sigmas: sigmas.unwrap_or_else(|| vec![1.0 / nkpt as f32; nkpt]), rle_weights: vec![1.0; nkpt], ..base }
    }
}

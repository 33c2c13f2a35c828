//! Validation metrics that reproduce Ultralytics 8.4.190 (`PoseValidator`) and pycocotools' COCOeval.
//!
//! Pipeline for training-time validation (docs/metrics.md §§1–6):
//! 1. post-process the head output: [`nms::non_max_suppression`] (o2m branch, default) or
//!    [`e2e::decode_o2o`] + [`e2e::topk`] + [`e2e::postprocess`] (o2o branch, `nms=False`);
//! 2. scale ground truth to input pixels with [`GroundTruth::from_normalized`];
//! 3. feed both to [`PoseValidator::update`] per image and call [`PoseValidator::compute`].
//!
//! All inputs are plain host vectors with explicit shapes (no tensor-library dependency).

pub mod ap;
pub mod coco;
pub mod confusion;
pub mod e2e;
pub mod iou;
pub mod matching;
pub mod nms;
pub mod oks;
pub mod types;
pub mod validator;

pub use ap::{ap_per_class, compute_ap, ApPerClass};
pub use e2e::{decode_o2o, postprocess as e2e_postprocess, topk as e2e_topk};
pub use iou::box_iou;
pub use matching::match_predictions;
pub use nms::{non_max_suppression, NmsConfig, NmsOutput};
pub use oks::{coco_sigmas, default_sigmas, kpt_oks};
pub use types::{Detections, GroundTruth};
pub use validator::{MetricSet, PoseMetrics, PoseValidator, TpMatrices};

/// Number of IoU/OKS thresholds (0.50:0.05:0.95).
pub const NUM_THRESHOLDS: usize = 10;

/// `torch.linspace(0.5, 0.95, 10)` in float32, computed the way torch's CPU kernel does
/// (start + i·step for the first half, end − (n−1−i)·step for the second) so that
/// threshold comparisons agree bit-for-bit with the reference.
pub fn iou_thresholds() -> [f32; NUM_THRESHOLDS] {
    let (start, end, n) = (0.5f32, 0.95f32, NUM_THRESHOLDS);
    let step = (end - start) / (n as f32 - 1.0);
    let half = n / 2;
    let mut out = [0f32; NUM_THRESHOLDS];
    for (i, o) in out.iter_mut().enumerate() {
        *o = if i < half { start + step * i as f32 } else { end - step * (n - 1 - i) as f32 };
    }
    out
}

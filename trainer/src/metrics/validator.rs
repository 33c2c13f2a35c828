//! Accumulator over a validation set: `update` per image, then `compute` (docs/metrics.md §§4–6).

use super::ap::{ap_per_class, ApPerClass};
use super::iou::box_iou;
use super::matching::match_predictions;
use super::oks::{default_sigmas, kpt_oks};
use super::types::{Detections, GroundTruth};
use super::NUM_THRESHOLDS;
use crate::error::{Result, TrainerError};

/// Per-image match result (what Ultralytics calls `tp` and `tp_p`), returned by `update`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TpMatrices {
    /// Box matches per detection and threshold.
    pub tp_box: Vec<[bool; NUM_THRESHOLDS]>,
    /// Pose (OKS) matches per detection and threshold.
    pub tp_pose: Vec<[bool; NUM_THRESHOLDS]>,
}

/// Metrics of one similarity type (box or pose), like Ultralytics' `Metric`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricSet {
    /// Per-class internals (curves, per-class P/R/F1/AP).
    pub per_class: ApPerClass,
    /// Mean precision over classes with targets.
    pub mp: f64,
    /// Mean recall.
    pub mr: f64,
    /// mAP at IoU/OKS 0.5.
    pub map50: f64,
    /// mAP at 0.75.
    pub map75: f64,
    /// mAP over 0.50:0.95.
    pub map: f64,
}

impl MetricSet {
    fn from_ap(pc: ApPerClass) -> Self {
        let mean = |v: &[f64]| {
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let col = |t: usize| pc.ap.iter().map(|a| a[t]).collect::<Vec<_>>();
        let all: Vec<f64> = pc.ap.iter().flatten().copied().collect();
        MetricSet { mp: mean(&pc.p), mr: mean(&pc.r), map50: mean(&col(0)), map75: mean(&col(5)), map: mean(&all), per_class: pc }
    }

    /// Ultralytics `Metric.fitness` with weights (0, 0, 0, 1): mAP50-95 (NaN counted as 0).
    pub fn fitness(&self) -> f64 {
        let v = [self.mp, self.mr, self.map50, self.map];
        let w = [0.0, 0.0, 0.0, 1.0];
        v.iter().zip(w).map(|(v, w)| if v.is_nan() { 0.0 } else { v * w }).sum()
    }
}

/// Box and pose metrics plus fitness (Ultralytics `PoseMetrics`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoseMetrics {
    /// Box metrics, keys `(B)`.
    pub box_metrics: MetricSet,
    /// Pose metrics, keys `(P)`.
    pub pose_metrics: MetricSet,
    /// mAP50-95(B) + mAP50-95(P): selects best.pt and drives early stopping.
    pub fitness: f64,
}

impl PoseMetrics {
    /// `results_dict` after an official COCO evaluation (docs/metrics.md §7): mAP50 / mAP50-95 of box
    /// and pose replaced by COCOeval's AP50 / AP (stats 1 and 0), fitness = 0.9·AP + 0.1·AP50 of
    /// the last evaluated type (keypoints). P and R stay the validator's.
    pub fn coco_results_dict(&self, bbox_stats: &[f64], kpt_stats: &[f64]) -> Result<Vec<(&'static str, f64)>> {
        if bbox_stats.len() < 2 || kpt_stats.len() < 2 {
            return Err(TrainerError::InvalidArgument {
                what: "coco stats",
                reason: "need at least AP and AP50 for bbox and keypoints".into(),
            });
        }
        let mut d = self.results_dict();
        for (k, v) in d.iter_mut() {
            *v = match *k {
                "metrics/mAP50(B)" => bbox_stats[1],
                "metrics/mAP50-95(B)" => bbox_stats[0],
                "metrics/mAP50(P)" => kpt_stats[1],
                "metrics/mAP50-95(P)" => kpt_stats[0],
                "fitness" => 0.9 * kpt_stats[0] + 0.1 * kpt_stats[1],
                _ => *v,
            };
        }
        Ok(d)
    }

    /// The metric keys and values in Ultralytics' `results_dict` order.
    pub fn results_dict(&self) -> Vec<(&'static str, f64)> {
        let (b, p) = (&self.box_metrics, &self.pose_metrics);
        vec![
            ("metrics/precision(B)", b.mp),
            ("metrics/recall(B)", b.mr),
            ("metrics/mAP50(B)", b.map50),
            ("metrics/mAP50-95(B)", b.map),
            ("metrics/precision(P)", p.mp),
            ("metrics/recall(P)", p.mr),
            ("metrics/mAP50(P)", p.map50),
            ("metrics/mAP50-95(P)", p.map),
            ("fitness", self.fitness),
        ]
    }
}

/// Validation accumulator (Ultralytics `PoseValidator.update_metrics` + `get_stats`).
///
/// Feed each image's post-processed detections (descending score) and its GT in the same
/// input-pixel space; then [`compute`](Self::compute). Reusable across epochs via [`reset`](Self::reset).
///
/// ```
/// use ptl_trainer::metrics::{non_max_suppression, GroundTruth, NmsConfig, PoseValidator};
///
/// let (nc, nk, n) = (1, 17, 2);
/// // Decoded o2m output of one image, (4 + nc + 3·nk, n) channel-major (here: zeros + 2 scores).
/// let mut pred = vec![0f32; (4 + nc + 3 * nk) * n];
/// pred[..4 * n].copy_from_slice(&[32.0, 96.0, 32.0, 96.0, 20.0, 20.0, 20.0, 20.0]);
/// pred[4 * n..5 * n].copy_from_slice(&[0.9, 0.6]);
/// let dets = non_max_suppression(&pred, n, nc, nk, &NmsConfig::default())?.detections;
/// // Targets of that image in the training-batch layout (normalised), input 128×128.
/// let gt = GroundTruth::from_normalized(&[0.25, 0.25, 0.15625, 0.15625], &[0.0], &[0.0; 51], nk, 128, 128)?;
/// let mut v = PoseValidator::new(nk)?;
/// v.update(&dets, &gt)?;
/// let m = v.compute();
/// assert!(m.box_metrics.map50 > 0.9);
/// for (key, value) in m.results_dict() {
///     println!("{key}: {value:.5}");
/// }
/// # Ok::<(), ptl_trainer::TrainerError>(())
/// ```
#[derive(Clone, Debug)]
pub struct PoseValidator {
    nk: usize,
    sigmas: Vec<f32>,
    single_cls: bool,
    tp_box: Vec<[bool; NUM_THRESHOLDS]>,
    tp_pose: Vec<[bool; NUM_THRESHOLDS]>,
    conf: Vec<f32>,
    pred_cls: Vec<usize>,
    target_cls: Vec<usize>,
    seen: usize,
}

impl PoseValidator {
    /// Validator for `nk` keypoints with the default sigmas (COCO for 17, else `1/nk`).
    pub fn new(nk: usize) -> Result<Self> {
        Self::with_sigmas(default_sigmas(nk))
    }

    /// Validator with explicit OKS sigmas (dataset `kpt_oks_sigmas`).
    pub fn with_sigmas(sigmas: Vec<f32>) -> Result<Self> {
        if sigmas.is_empty() {
            return Err(TrainerError::InvalidArgument { what: "sigmas", reason: "at least one keypoint is required".into() });
        }
        if let Some(s) = sigmas.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(TrainerError::InvalidArgument { what: "sigmas", reason: format!("sigma must be finite and > 0, got {s}") });
        }
        Ok(PoseValidator {
            nk: sigmas.len(),
            sigmas,
            single_cls: false,
            tp_box: Vec::new(),
            tp_pose: Vec::new(),
            conf: Vec::new(),
            pred_cls: Vec::new(),
            target_cls: Vec::new(),
            seen: 0,
        })
    }

    /// Treat every prediction and GT as class 0 (`single_cls=True`).
    pub fn single_cls(mut self, on: bool) -> Self {
        self.single_cls = on;
        self
    }

    /// Forget everything accumulated (start of a new validation pass).
    pub fn reset(&mut self) {
        self.tp_box.clear();
        self.tp_pose.clear();
        self.conf.clear();
        self.pred_cls.clear();
        self.target_cls.clear();
        self.seen = 0;
    }

    /// Images seen since the last reset.
    pub fn seen(&self) -> usize {
        self.seen
    }

    /// Match one image and accumulate its statistics; returns its `tp` / `tp_p` matrices.
    pub fn update(&mut self, pred: &Detections, gt: &GroundTruth) -> Result<TpMatrices> {
        pred.validate()?;
        gt.validate()?;
        for (what, nk) in [("detection keypoints", pred.nk), ("gt keypoints", gt.nk)] {
            if nk != self.nk {
                return Err(TrainerError::InvalidArgument { what, reason: format!("validator expects {} keypoints, got {nk}", self.nk) });
            }
        }
        let map_cls = |c: &usize| if self.single_cls { 0 } else { *c };
        let pcls: Vec<usize> = pred.classes.iter().map(map_cls).collect();
        let gcls: Vec<usize> = gt.classes.iter().map(map_cls).collect();
        let (n, m) = (pred.len(), gt.len());
        let mut tpm = TpMatrices { tp_box: vec![[false; NUM_THRESHOLDS]; n], tp_pose: vec![[false; NUM_THRESHOLDS]; n] };
        if n > 0 && m > 0 {
            let iou = box_iou(&gt.boxes, &pred.boxes);
            tpm.tp_box = match_predictions(&pcls, &gcls, &iou)?;
            let oks = kpt_oks(&gt.keypoints, &pred.keypoints, &gt.oks_areas(), &self.sigmas)?;
            tpm.tp_pose = match_predictions(&pcls, &gcls, &oks)?;
        }
        self.seen += 1;
        self.tp_box.extend_from_slice(&tpm.tp_box);
        self.tp_pose.extend_from_slice(&tpm.tp_pose);
        self.conf.extend_from_slice(&pred.scores);
        self.pred_cls.extend(pcls);
        self.target_cls.extend(gcls);
        Ok(tpm)
    }

    /// Box and pose metrics over everything accumulated so far.
    pub fn compute(&self) -> PoseMetrics {
        // The accumulator keeps tp/conf/pred_cls the same length and finite (checked in
        // `update`), so `ap_per_class` cannot fail here; fall back to empty stats regardless.
        let b = ap_per_class(&self.tp_box, &self.conf, &self.pred_cls, &self.target_cls).unwrap_or_default();
        let p = ap_per_class(&self.tp_pose, &self.conf, &self.pred_cls, &self.target_cls).unwrap_or_default();
        let box_metrics = MetricSet::from_ap(b);
        let pose_metrics = MetricSet::from_ap(p);
        let fitness = pose_metrics.fitness() + box_metrics.fitness();
        PoseMetrics { box_metrics, pose_metrics, fitness }
    }
}

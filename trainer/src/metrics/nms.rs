//! Default post-processing: class-aware NMS on the decoded o2m output (docs/metrics.md §1.1).
//!
//! Mirrors Ultralytics' `non_max_suppression` with torchvision's CPU `nms`; all ties are
//! broken by the lower candidate index (stable sorts), which is what torchvision's stable
//! score sort does.

use super::iou::nms_iou;
use super::types::Detections;
use crate::error::{check_finite, check_len, Result, TrainerError};

/// NMS settings. [`Default`] gives the validation defaults (conf 0.001, IoU 0.7, 300 detections).
#[derive(Clone, Debug, PartialEq)]
pub struct NmsConfig {
    /// Candidates need a class score strictly above this (0.001 validation, 0.25 prediction).
    pub conf_thres: f32,
    /// A box is suppressed when its IoU with a kept higher-scoring box is strictly above this.
    pub iou_thres: f64,
    /// Detections kept per image.
    pub max_det: usize,
    /// Candidates kept (highest scores) before NMS.
    pub max_nms: usize,
    /// Class offset in pixels that separates classes in class-aware NMS.
    pub max_wh: f32,
    /// Class-agnostic NMS (also used with `single_cls`).
    pub agnostic: bool,
    /// One row per (box, class) above threshold when nc > 1 (the validator's setting).
    pub multi_label: bool,
    /// Only these classes are kept (Ultralytics' `classes=`; empty: every class).
    pub classes: Vec<usize>,
}

impl Default for NmsConfig {
    fn default() -> Self {
        NmsConfig {
            conf_thres: 0.001,
            iou_thres: 0.7,
            max_det: 300,
            max_nms: 30_000,
            max_wh: 7680.0,
            agnostic: false,
            multi_label: true,
            classes: Vec::new(),
        }
    }
}

impl NmsConfig {
    /// Ultralytics raises a default `max_det` to the largest per-image GT count of the dataset.
    pub fn with_max_gt(mut self, max_gt_per_image: usize) -> Self {
        self.max_det = self.max_det.max(max_gt_per_image);
        self
    }

    fn check(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.conf_thres) {
            return Err(TrainerError::InvalidArgument {
                what: "conf_thres",
                reason: format!("must be in [0, 1], got {}", self.conf_thres),
            });
        }
        if !(0.0..=1.0).contains(&self.iou_thres) {
            return Err(TrainerError::InvalidArgument { what: "iou_thres", reason: format!("must be in [0, 1], got {}", self.iou_thres) });
        }
        Ok(())
    }
}

/// NMS result for one image.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NmsOutput {
    /// Kept detections in descending score order.
    pub detections: Detections,
    /// Candidate (anchor) index of each kept detection.
    pub keep: Vec<usize>,
}

/// NMS for one image.
///
/// `pred`: (4 + nc + 3·nk, n) channel-major, rows = (cx, cy, w, h) px, nc sigmoid class scores,
/// nk × (x, y, v) decoded keypoints — the layout of the model's default eval output.
pub fn non_max_suppression(pred: &[f32], n: usize, nc: usize, nk: usize, cfg: &NmsConfig) -> Result<NmsOutput> {
    cfg.check()?;
    if nc == 0 {
        return Err(TrainerError::InvalidArgument { what: "nc", reason: "at least one class is required".into() });
    }
    let ch = 4 + nc + 3 * nk;
    check_len("nms input", pred, &[ch, n])?;
    check_finite("nms input", pred)?;
    let at = |c: usize, i: usize| pred[c * n + i];
    let multi_label = cfg.multi_label && nc > 1;

    // Candidate rows: (box xyxy, score, class, anchor index).
    let mut rows: Vec<([f32; 4], f32, usize, usize)> = Vec::new();
    for i in 0..n {
        let mut best = (f32::NEG_INFINITY, 0usize);
        for c in 0..nc {
            let s = at(4 + c, i);
            if s > best.0 {
                best = (s, c);
            }
        }
        if best.0 <= cfg.conf_thres {
            continue;
        }
        let (cx, cy, dw, dh) = (at(0, i), at(1, i), at(2, i) / 2.0, at(3, i) / 2.0);
        let b = [cx - dw, cy - dh, cx + dw, cy + dh];
        if multi_label {
            for c in 0..nc {
                let s = at(4 + c, i);
                if s > cfg.conf_thres {
                    rows.push((b, s, c, i));
                }
            }
        } else {
            rows.push((b, best.0, best.1, i));
        }
    }
    // Ultralytics filters the candidates by class before NMS.
    if !cfg.classes.is_empty() {
        rows.retain(|r| cfg.classes.contains(&r.2));
    }
    if rows.len() > cfg.max_nms {
        rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        rows.truncate(cfg.max_nms);
    }

    // Greedy NMS on class-offset boxes, order = stable descending score.
    let shifted: Vec<[f32; 4]> = rows
        .iter()
        .map(|(b, _, c, _)| {
            let off = if cfg.agnostic { 0.0 } else { *c as f32 * cfg.max_wh };
            [b[0] + off, b[1] + off, b[2] + off, b[3] + off]
        })
        .collect();
    let areas: Vec<f32> = shifted.iter().map(|b| (b[2] - b[0]) * (b[3] - b[1])).collect();
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| rows[b].1.total_cmp(&rows[a].1));
    let mut suppressed = vec![false; rows.len()];
    let mut kept = Vec::new();
    for (oi, &i) in order.iter().enumerate() {
        if suppressed[i] {
            continue;
        }
        kept.push(i);
        for &j in &order[oi + 1..] {
            if !suppressed[j] && f64::from(nms_iou(&shifted[i], areas[i], &shifted[j], areas[j])) > cfg.iou_thres {
                suppressed[j] = true;
            }
        }
    }
    kept.truncate(cfg.max_det);

    let mut out = NmsOutput { detections: Detections::empty(nk), keep: Vec::with_capacity(kept.len()) };
    for i in kept {
        let (b, s, c, a) = rows[i];
        let d = &mut out.detections;
        d.boxes.push(b);
        d.scores.push(s);
        d.classes.push(c);
        d.keypoints.extend((0..3 * nk).map(|k| at(4 + nc + k, a)));
        out.keep.push(a);
    }
    Ok(out)
}

/// NMS for a batch `(batch, 4 + nc + 3·nk, n)`.
pub fn non_max_suppression_batch(pred: &[f32], batch: usize, n: usize, nc: usize, nk: usize, cfg: &NmsConfig) -> Result<Vec<NmsOutput>> {
    let per = (4 + nc + 3 * nk) * n;
    check_len("nms batch input", pred, &[batch, 4 + nc + 3 * nk, n])?;
    if per == 0 {
        return Ok(vec![NmsOutput::default(); batch]);
    }
    pred.chunks_exact(per).map(|img| non_max_suppression(img, n, nc, nk, cfg)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(rows: &[[f32; 5]]) -> Vec<f32> {
        // channel-major (5, n), nk = 0
        let n = rows.len();
        let mut v = vec![0f32; 5 * n];
        for (i, r) in rows.iter().enumerate() {
            for c in 0..5 {
                v[c * n + i] = r[c];
            }
        }
        v
    }

    /// `classes`: candidates of other classes are dropped before NMS, so a box of a kept class
    /// that a higher-scoring box of a dropped class would not suppress anyway stays as it was.
    #[test]
    fn a_class_filter_keeps_only_those_classes() {
        // Two classes: rows (cx, cy, w, h, score0, score1), nk = 0.
        let rows = [[50.0, 50.0, 20.0, 20.0, 0.9, 0.1], [51.0, 50.0, 20.0, 20.0, 0.2, 0.8], [200.0, 200.0, 10.0, 10.0, 0.6, 0.3]];
        let n = rows.len();
        let mut p = vec![0f32; 6 * n];
        for (i, r) in rows.iter().enumerate() {
            for c in 0..6 {
                p[c * n + i] = r[c];
            }
        }
        let cfg = NmsConfig { multi_label: false, ..NmsConfig::default() };
        let all = non_max_suppression(&p, n, 2, 0, &cfg).unwrap();
        assert_eq!(all.keep, [0, 1, 2], "class-aware: the overlapping boxes differ in class");
        let only1 = non_max_suppression(&p, n, 2, 0, &NmsConfig { classes: vec![1], ..cfg.clone() }).unwrap();
        assert_eq!((only1.keep.as_slice(), only1.detections.classes.as_slice()), ([1].as_slice(), [1].as_slice()));
        let only0 = non_max_suppression(&p, n, 2, 0, &NmsConfig { classes: vec![0], ..cfg }).unwrap();
        assert_eq!(only0.keep, [0, 2]);
    }

    #[test]
    fn suppresses_overlap_keeps_order_and_ties() {
        let p = cand(&[
            [50.0, 50.0, 20.0, 20.0, 0.5],
            [51.0, 50.0, 20.0, 20.0, 0.9],
            [200.0, 200.0, 10.0, 10.0, 0.5],
            [300.0, 300.0, 10.0, 10.0, 0.0005],
        ]);
        let o = non_max_suppression(&p, 4, 1, 0, &NmsConfig::default()).unwrap();
        assert_eq!(o.keep, vec![1, 2]);
        // tie: equal scores keep the lower index first
        let p = cand(&[[0.0, 0.0, 2.0, 2.0, 0.5], [100.0, 0.0, 2.0, 2.0, 0.5]]);
        let o = non_max_suppression(&p, 2, 1, 0, &NmsConfig::default()).unwrap();
        assert_eq!(o.keep, vec![0, 1]);
    }

    #[test]
    fn nan_is_error() {
        let p = cand(&[[f32::NAN, 0.0, 2.0, 2.0, 0.5]]);
        assert!(matches!(non_max_suppression(&p, 1, 1, 0, &NmsConfig::default()), Err(TrainerError::NonFinite { .. })));
    }
}

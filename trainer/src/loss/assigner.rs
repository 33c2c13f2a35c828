//! Pose task-aligned assigner (loss.md §2), on host float32 vectors.
//!
//! Deliberate first version: the assignment decides discrete things (candidate tests with strict
//! inequalities, top-k order, argmax ties), so it is written as plain loops in `f32` that follow
//! the reference's arithmetic order. It runs once per branch on detached predictions copied to
//! the host. Ties in top-k are broken by the lowest anchor index, argmax ties by the lowest GT
//! index; the result is deterministic and independent of thread count.

use super::boxes::ciou_f32;
use super::targets::PaddedTargets;
use crate::error::{Result, TrainerError};

/// Assigner hyper-parameters.
#[derive(Clone, Debug)]
pub struct AssignParams {
    pub topk: usize,
    /// Second filter (o2o: 1); equal to `topk` disables it.
    pub topk2: usize,
    pub alpha: f64,
    pub beta: f64,
    pub eps: f32,
    /// Sides below this are enlarged to it for the in-box test (16 px).
    pub size_floor: f32,
    /// Level range (lo, hi) in strides.
    pub level_range: (f32, f32),
    /// Smallest and largest stride (their levels are open-ended in the gate).
    pub min_stride: f32,
    pub max_stride: f32,
    /// OKS sigmas (length K).
    pub sigmas: Vec<f32>,
    /// OKS area factor (0.53).
    pub area_factor: f32,
}

impl AssignParams {
    /// Parameters of the reference's `PoseTaskAlignedAssigner` for the given top-k values.
    pub fn pose(topk: usize, topk2: usize, strides: &[f64], sigmas: &[f32]) -> AssignParams {
        let min_stride = strides.iter().copied().fold(f64::INFINITY, f64::min) as f32;
        let max_stride = strides.iter().copied().fold(0.0, f64::max) as f32;
        let size_floor = if strides.len() > 1 { strides[1] as f32 } else { min_stride };
        AssignParams {
            topk,
            topk2,
            alpha: 0.5,
            beta: 6.0,
            eps: 1e-9,
            size_floor,
            level_range: (2.0, 12.0),
            min_stride,
            max_stride,
            sigmas: sigmas.to_vec(),
            area_factor: 0.53,
        }
    }
}

/// Host inputs of one assignment (all detached, pixels).
pub struct AssignInputs<'a> {
    pub batch_size: usize,
    pub num_anchors: usize,
    pub nc: usize,
    /// (B, A, nc) sigmoid scores.
    pub scores: &'a [f32],
    /// (B, A, 4) predicted xyxy boxes in pixels.
    pub boxes: &'a [f32],
    /// (B, A, K, 2) predicted keypoints in pixels.
    pub kpts: &'a [f32],
    /// (A, 2) anchor centres in pixels.
    pub anchors_px: &'a [f32],
    /// (A,) anchor strides.
    pub strides: &'a [f32],
    pub targets: &'a PaddedTargets,
}

/// Result of one assignment.
#[derive(Clone, Debug, Default)]
pub struct Assignment {
    pub batch_size: usize,
    pub num_anchors: usize,
    pub max_boxes: usize,
    pub nc: usize,
    /// (B, A) foreground anchors.
    pub fg_mask: Vec<bool>,
    /// (B, A) per-image GT index (0 for background).
    pub target_gt_idx: Vec<usize>,
    /// (B, A) class of the assigned GT.
    pub target_labels: Vec<usize>,
    /// (B, A, 4) assigned GT box, xyxy pixels.
    pub target_bboxes: Vec<f32>,
    /// (B, A, nc) soft class targets.
    pub target_scores: Vec<f32>,
    /// (B, M, A) candidates (in-box ∧ level gate, after fallback), debugging.
    pub candidates: Vec<bool>,
    /// (B, M, A) overlaps (OKS / clamped CIoU) on candidates, 0 elsewhere.
    pub overlaps: Vec<f32>,
    /// (B, M, A) alignment metric on candidates, 0 elsewhere.
    pub align_metric: Vec<f32>,
    /// (image, gt) pairs whose level gate left no candidate (ungated fallback used).
    pub gate_fallbacks: Vec<(usize, usize)>,
    /// Anchors claimed by several GTs before conflict resolution.
    pub n_conflicts: usize,
}

impl Assignment {
    /// Flat indices b·A + a of the foreground anchors, in order.
    pub fn fg_indices(&self) -> Vec<usize> {
        self.fg_mask.iter().enumerate().filter(|(_, &f)| f).map(|(i, _)| i).collect()
    }

    /// Sum of all target scores (before the max(·, 1) of loss.md §2.7).
    pub fn target_scores_sum(&self) -> f32 {
        // torch sums a float32 tensor with pairwise/vectorised accumulation; f64 then rounding
        // is at least as accurate.
        self.target_scores.iter().map(|&v| f64::from(v)).sum::<f64>() as f32
    }
}

fn pow_f32(x: f32, p: f64) -> f32 {
    if p == 0.5 {
        x.sqrt()
    } else if p == 1.0 {
        x
    } else if p == 2.0 {
        x * x
    } else {
        f64::from(x).powf(p) as f32
    }
}

/// Lowest-index-first top-k of `v` (indices of the k largest values).
fn topk_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    // Stable sort by descending value keeps the lower index first among equal values.
    idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap_or(std::cmp::Ordering::Equal));
    idx.truncate(k.min(v.len()));
    idx
}

/// Runs the pose task-aligned assigner (loss.md §2).
pub fn assign(inp: &AssignInputs<'_>, p: &AssignParams) -> Result<Assignment> {
    let (bs, na, nc) = (inp.batch_size, inp.num_anchors, inp.nc);
    let t = inp.targets;
    let (m, nk) = (t.max_boxes, t.nkpt);
    let shape_err = |what: &'static str, shape: &[usize], got: usize| Err(TrainerError::shape(what, shape, got));
    if inp.scores.len() != bs * na * nc {
        return shape_err("assigner scores", &[bs, na, nc], inp.scores.len());
    }
    if inp.boxes.len() != bs * na * 4 {
        return shape_err("assigner boxes", &[bs, na, 4], inp.boxes.len());
    }
    if inp.kpts.len() != bs * na * nk * 2 {
        return shape_err("assigner keypoints", &[bs, na, nk, 2], inp.kpts.len());
    }
    if inp.anchors_px.len() != na * 2 || inp.strides.len() != na {
        return shape_err("assigner anchors", &[na, 2], inp.anchors_px.len());
    }
    if p.sigmas.len() != nk {
        return Err(TrainerError::InvalidArgument {
            what: "assigner sigmas",
            reason: format!("{} sigmas for {nk} keypoints", p.sigmas.len()),
        });
    }
    let mut out = Assignment {
        batch_size: bs,
        num_anchors: na,
        max_boxes: m,
        nc,
        fg_mask: vec![false; bs * na],
        target_gt_idx: vec![0; bs * na],
        target_labels: vec![0; bs * na],
        target_bboxes: vec![0.0; bs * na * 4],
        target_scores: vec![0.0; bs * na * nc],
        candidates: vec![false; bs * m * na],
        overlaps: vec![0.0; bs * m * na],
        align_metric: vec![0.0; bs * m * na],
        gate_fallbacks: vec![],
        n_conflicts: 0,
    };
    if m == 0 {
        // Reference: all-background targets (labels = nc there; unused because fg is empty).
        return Ok(out);
    }
    let eps = p.eps;
    let half = |x: f32| x / 2.0;
    for b in 0..bs {
        // mask_pos (M, A) as 0/1 floats so the argmax rules below mirror the reference.
        let mut mask_pos = vec![0u8; m * na];
        for g in 0..m {
            if !t.mask[b * m + g] {
                continue;
            }
            let gb = &t.boxes[(b * m + g) * 4..(b * m + g) * 4 + 4];
            let label = t.labels[b * m + g];
            let cls = if label >= 0.0 && (label as usize) < nc {
                label as usize
            } else {
                return Err(TrainerError::InvalidArgument { what: "targets.cls", reason: format!("class {label} outside 0..{nc}") });
            };
            // §2.1 in-box test with the size floor: xyxy → xywh → floor → xyxy.
            let (cx, cy) = ((gb[0] + gb[2]) / 2.0, (gb[1] + gb[3]) / 2.0);
            let (mut w, mut h) = (gb[2] - gb[0], gb[3] - gb[1]);
            if w < p.size_floor {
                w = p.size_floor;
            }
            if h < p.size_floor {
                h = p.size_floor;
            }
            let (hw, hh) = (half(w), half(h));
            let (x1, y1, x2, y2) = (cx - hw, cy - hh, cx + hw, cy + hh);
            let side = ((gb[2] - gb[0]) * (gb[3] - gb[1])).sqrt();
            let row = (b * m + g) * na;
            let mut in_box = vec![false; na];
            let mut any_gated = false;
            for (j, ib) in in_box.iter_mut().enumerate() {
                let (ax, ay) = (inp.anchors_px[2 * j], inp.anchors_px[2 * j + 1]);
                let inside = ax - x1 > eps && ay - y1 > eps && x2 - ax > eps && y2 - ay > eps;
                *ib = inside;
                if inside {
                    let s = inp.strides[j];
                    let lo_ok = side >= p.level_range.0 * s || s == p.min_stride;
                    let hi_ok = side <= p.level_range.1 * s || s == p.max_stride;
                    if lo_ok && hi_ok {
                        out.candidates[row + j] = true;
                        any_gated = true;
                    }
                }
            }
            if !any_gated && in_box.iter().any(|&v| v) {
                out.gate_fallbacks.push((b, g));
                out.candidates[row..row + na].copy_from_slice(&in_box);
            }
            // §2.2 overlaps and §2.3 metric on candidates.
            let gk = &t.kpts[(b * m + g) * nk * 3..(b * m + g + 1) * nk * 3];
            let nvis = (0..nk).filter(|&k| gk[3 * k + 2] > 0.0).count();
            let area = (gb[2] - gb[0]) * (gb[3] - gb[1]) * p.area_factor;
            let denom: Vec<f32> = p
                .sigmas
                .iter()
                .map(|&s| {
                    let two_s = 2.0 * s;
                    two_s * two_s * (area + eps) * 2.0
                })
                .collect();
            for j in 0..na {
                if !out.candidates[row + j] {
                    continue;
                }
                let ov = if nvis > 0 {
                    let pk = &inp.kpts[(b * na + j) * nk * 2..(b * na + j + 1) * nk * 2];
                    let mut acc = 0f32;
                    for k in 0..nk {
                        if gk[3 * k + 2] > 0.0 {
                            let dx = pk[2 * k] - gk[3 * k];
                            let dy = pk[2 * k + 1] - gk[3 * k + 1];
                            let d = dx * dx + dy * dy;
                            acc += (-(d / denom[k])).exp();
                        }
                    }
                    acc / nvis as f32
                } else {
                    let pb = &inp.boxes[(b * na + j) * 4..(b * na + j) * 4 + 4];
                    ciou_f32([gb[0], gb[1], gb[2], gb[3]], [pb[0], pb[1], pb[2], pb[3]]).max(0.0)
                };
                let score = inp.scores[(b * na + j) * nc + cls];
                out.overlaps[row + j] = ov;
                out.align_metric[row + j] = pow_f32(score, p.alpha) * pow_f32(ov, p.beta);
            }
            // §2.4 top-k over all anchors, kept where candidate.
            for j in topk_indices(&out.align_metric[row..row + na], p.topk) {
                if out.candidates[row + j] {
                    mask_pos[g * na + j] = 1;
                }
            }
        }
        // §2.5 conflict resolution by max overlap.
        let ov_b = &out.overlaps[b * m * na..(b + 1) * m * na];
        for j in 0..na {
            let claims: usize = (0..m).map(|g| mask_pos[g * na + j] as usize).sum();
            if claims > 1 {
                out.n_conflicts += 1;
                let mut best = 0;
                for g in 1..m {
                    if ov_b[g * na + j] > ov_b[best * na + j] {
                        best = g;
                    }
                }
                for g in 0..m {
                    mask_pos[g * na + j] = u8::from(g == best);
                }
            }
        }
        let al_b = &out.align_metric[b * m * na..(b + 1) * m * na];
        // §2.6 second filter.
        if p.topk2 != p.topk {
            for g in 0..m {
                let masked: Vec<f32> = (0..na).map(|j| al_b[g * na + j] * f32::from(mask_pos[g * na + j])).collect();
                let keep = topk_indices(&masked, p.topk2);
                let mut sel = vec![false; na];
                for j in keep {
                    sel[j] = true;
                }
                for (j, s) in sel.iter().enumerate() {
                    if !s {
                        mask_pos[g * na + j] = 0;
                    }
                }
            }
        }
        // §2.7 targets and normalisation.
        let mut pos_align = vec![0f32; m];
        let mut pos_ov = vec![0f32; m];
        for g in 0..m {
            for j in 0..na {
                if mask_pos[g * na + j] != 0 {
                    pos_align[g] = pos_align[g].max(al_b[g * na + j]);
                    pos_ov[g] = pos_ov[g].max(ov_b[g * na + j]);
                }
            }
        }
        for j in 0..na {
            let mut gi = None;
            for g in 0..m {
                if mask_pos[g * na + j] != 0 {
                    gi = Some(g);
                    break;
                }
            }
            let Some(g) = gi else { continue };
            let a = b * na + j;
            out.fg_mask[a] = true;
            out.target_gt_idx[a] = g;
            let cls = t.labels[b * m + g] as usize;
            out.target_labels[a] = cls;
            out.target_bboxes[a * 4..a * 4 + 4].copy_from_slice(&t.boxes[(b * m + g) * 4..(b * m + g) * 4 + 4]);
            let norm = al_b[g * na + j] * pos_ov[g] / (pos_align[g] + eps);
            out.target_scores[a * nc + cls] = norm;
        }
    }
    Ok(out)
}

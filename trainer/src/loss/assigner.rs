//! Pose task-aligned assigner (docs/loss.md §2), on host float32 vectors.
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
    /// Anchors each ground truth takes.
    pub topk: usize,
    /// Second filter (o2o: 1); equal to `topk` disables it.
    pub topk2: usize,
    /// Exponent of the score in the alignment (0.5).
    pub alpha: f64,
    /// Exponent of the overlap in the alignment (6).
    pub beta: f64,
    /// Small constant of the normalisation (1e-9).
    pub eps: f32,
    /// Sides below this are enlarged to it for the in-box test (16 px).
    pub size_floor: f32,
    /// Level range (lo, hi) in strides.
    pub level_range: (f32, f32),
    /// Smallest and largest stride (their levels are open-ended in the gate).
    pub min_stride: f32,
    /// The largest stride.
    pub max_stride: f32,
    /// OKS sigmas (length K).
    pub sigmas: Vec<f32>,
    /// OKS area factor (0.53).
    pub area_factor: f32,
    /// Also return the dense (B, M, A) candidates / overlaps / metric (tests, debugging).
    pub debug: bool,
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
            debug: false,
        }
    }
}

/// Host inputs of one assignment (all detached, pixels).
///
/// The assigner reads predictions only at candidate anchors, so they come as compact rows:
/// `rows[b·A + a]` is the row of anchor a of image b in `scores`/`boxes`/`kpts`, or
/// [`NOT_LOADED`] where the anchor is no candidate of any GT of that image.
pub struct AssignInputs<'a> {
    /// Images.
    pub batch_size: usize,
    /// Anchors per image.
    pub num_anchors: usize,
    /// Classes.
    pub nc: usize,
    /// (B·A,) row of each anchor in the compact arrays.
    pub rows: &'a [u32],
    /// (U, nc) sigmoid scores.
    pub scores: &'a [f32],
    /// (U, 4) predicted xyxy boxes in pixels.
    pub boxes: &'a [f32],
    /// (U, K, 2) predicted keypoints in pixels.
    pub kpts: &'a [f32],
    /// (A,) anchor strides.
    pub strides: &'a [f32],
    /// The padded targets.
    pub targets: &'a PaddedTargets,
    /// Candidate anchors of every GT slot (from [`candidate_sets`]).
    pub candidates: &'a CandidateSets,
}

/// Row marker of an anchor whose predictions were not loaded.
pub const NOT_LOADED: u32 = u32::MAX;

/// Candidate anchors per GT slot (docs/loss.md §2.1): in-box with the size floor, level gate,
/// ungated fallback. Depends on targets and anchors only, not on predictions.
#[derive(Clone, Debug, Default)]
pub struct CandidateSets {
    /// (B·M) ascending anchor lists (empty for padding slots).
    pub per_gt: Vec<Vec<usize>>,
    /// (image, gt) pairs whose level gate left no candidate.
    pub gate_fallbacks: Vec<(usize, usize)>,
}

impl CandidateSets {
    /// Sorted flat indices b·A + a of every anchor that is a candidate of some GT of its image.
    pub fn union(&self, batch_size: usize, max_boxes: usize, num_anchors: usize) -> Vec<usize> {
        let mut mark = vec![false; batch_size * num_anchors];
        for b in 0..batch_size {
            for g in 0..max_boxes {
                for &j in &self.per_gt[b * max_boxes + g] {
                    mark[b * num_anchors + j] = true;
                }
            }
        }
        mark.iter().enumerate().filter(|(_, &m)| m).map(|(i, _)| i).collect()
    }
}

/// Candidate sets of all GT slots (docs/loss.md §2.1), in float32 as the reference computes them.
/// `anchors_px` (A, 2) anchor centres in pixels, `strides` (A,).
pub fn candidate_sets(t: &PaddedTargets, anchors_px: &[f32], strides: &[f32], p: &AssignParams) -> Result<CandidateSets> {
    let na = strides.len();
    if anchors_px.len() != 2 * na {
        return Err(TrainerError::shape("assigner anchors", &[na, 2], anchors_px.len()));
    }
    let (bs, m) = (t.batch_size, t.max_boxes);
    let eps = p.eps;
    let mut out = CandidateSets { per_gt: vec![Vec::new(); bs * m], gate_fallbacks: vec![] };
    for b in 0..bs {
        for g in 0..m {
            if !t.mask[b * m + g] {
                continue;
            }
            let gb = &t.boxes[(b * m + g) * 4..(b * m + g) * 4 + 4];
            // xyxy → xywh → floor → xyxy (float32).
            let (cx, cy) = ((gb[0] + gb[2]) / 2.0, (gb[1] + gb[3]) / 2.0);
            let (mut w, mut h) = (gb[2] - gb[0], gb[3] - gb[1]);
            if w < p.size_floor {
                w = p.size_floor;
            }
            if h < p.size_floor {
                h = p.size_floor;
            }
            let (hw, hh) = (w / 2.0, h / 2.0);
            let (x1, y1, x2, y2) = (cx - hw, cy - hh, cx + hw, cy + hh);
            let side = ((gb[2] - gb[0]) * (gb[3] - gb[1])).sqrt();
            let mut in_box = Vec::new();
            for j in 0..na {
                let (ax, ay) = (anchors_px[2 * j], anchors_px[2 * j + 1]);
                if ax - x1 > eps && ay - y1 > eps && x2 - ax > eps && y2 - ay > eps {
                    in_box.push(j);
                }
            }
            let gated: Vec<usize> = in_box
                .iter()
                .copied()
                .filter(|&j| {
                    let s = strides[j];
                    (side >= p.level_range.0 * s || s == p.min_stride) && (side <= p.level_range.1 * s || s == p.max_stride)
                })
                .collect();
            out.per_gt[b * m + g] = if gated.is_empty() && !in_box.is_empty() {
                out.gate_fallbacks.push((b, g));
                in_box
            } else {
                gated
            };
        }
    }
    Ok(out)
}

/// Result of one assignment.
#[derive(Clone, Debug, Default)]
pub struct Assignment {
    /// Images.
    pub batch_size: usize,
    /// Anchors per image.
    pub num_anchors: usize,
    /// Ground-truth slots per image.
    pub max_boxes: usize,
    /// Classes.
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
    /// (B, M, A) candidates (in-box ∧ level gate, after fallback); empty unless `debug`.
    pub candidates: Vec<bool>,
    /// (B, M, A) overlaps (OKS / clamped CIoU) on candidates, 0 elsewhere; empty unless `debug`.
    pub overlaps: Vec<f32>,
    /// (B, M, A) alignment metric on candidates, 0 elsewhere; empty unless `debug`.
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

    /// Sum of all target scores (before the max(·, 1) of docs/loss.md §2.7).
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

/// Top-k over a row of A non-negative metrics where only the listed `anchors` (ascending) may be
/// non-zero (`vals` aligned with them): returns the selected anchors that are in `anchors`.
///
/// Order = value descending, anchor index ascending among equal values (ties broken by the lowest
/// index, docs/loss.md §2.4). Zero-valued picks are the lowest-index zeros of the full row, so a
/// listed anchor with value 0 is selected only if it is among them — exactly what a dense top-k
/// with this tie rule selects, without materialising the row.
fn sparse_topk(anchors: &[usize], vals: &[f32], na: usize, k: usize, scratch: &mut [bool]) -> Vec<usize> {
    let k = k.min(na);
    let mut pos: Vec<(f32, usize)> = anchors.iter().zip(vals).filter(|(_, &v)| v > 0.0).map(|(&j, &v)| (v, j)).collect();
    // Stable sort on ascending-index input keeps the lower index first among equal values.
    pos.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
    pos.truncate(k);
    let mut sel: Vec<usize> = pos.iter().map(|&(_, j)| j).collect();
    let mut need = k - sel.len();
    if need > 0 {
        // Mark every positive-valued anchor: the rest of the row is zeros.
        for (&j, &v) in anchors.iter().zip(vals) {
            if v > 0.0 {
                scratch[j] = true;
            }
        }
        let mut j = 0;
        while need > 0 && j < na {
            if !scratch[j] {
                need -= 1;
                if anchors.binary_search(&j).is_ok() {
                    sel.push(j);
                }
            }
            j += 1;
        }
        for (&j, &v) in anchors.iter().zip(vals) {
            if v > 0.0 {
                scratch[j] = false;
            }
        }
    }
    sel
}

/// Candidates of one GT with their overlaps and metrics (ascending anchor order), and its
/// positive anchors.
#[derive(Default)]
struct GtRow {
    cands: Vec<usize>,
    ov: Vec<f32>,
    al: Vec<f32>,
    pos: Vec<usize>,
}

impl GtRow {
    fn lookup(&self, j: usize) -> (f32, f32) {
        match self.cands.binary_search(&j) {
            Ok(i) => (self.ov[i], self.al[i]),
            Err(_) => (0.0, 0.0),
        }
    }
}

/// Runs the pose task-aligned assigner (docs/loss.md §2).
pub fn assign(inp: &AssignInputs<'_>, p: &AssignParams) -> Result<Assignment> {
    let (bs, na, nc) = (inp.batch_size, inp.num_anchors, inp.nc);
    let t = inp.targets;
    let (m, nk) = (t.max_boxes, t.nkpt);
    let shape_err = |what: &'static str, shape: &[usize], got: usize| Err(TrainerError::shape(what, shape, got));
    let u = inp.scores.len() / nc.max(1);
    if inp.scores.len() != u * nc {
        return shape_err("assigner scores", &[u, nc], inp.scores.len());
    }
    if inp.boxes.len() != u * 4 {
        return shape_err("assigner boxes", &[u, 4], inp.boxes.len());
    }
    if inp.kpts.len() != u * nk * 2 {
        return shape_err("assigner keypoints", &[u, nk, 2], inp.kpts.len());
    }
    if inp.rows.len() != bs * na || inp.strides.len() != na {
        return shape_err("assigner rows", &[bs, na], inp.rows.len());
    }
    if inp.candidates.per_gt.len() != bs * m {
        return shape_err("assigner candidates", &[bs, m], inp.candidates.per_gt.len());
    }
    if t.batch_size != bs {
        return shape_err("assigner targets", &[bs, m], t.batch_size * m);
    }
    if p.sigmas.len() != nk {
        return Err(TrainerError::InvalidArgument {
            what: "assigner sigmas",
            reason: format!("{} sigmas for {nk} keypoints", p.sigmas.len()),
        });
    }
    let dense = if p.debug { bs * m * na } else { 0 };
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
        candidates: vec![false; dense],
        overlaps: vec![0.0; dense],
        align_metric: vec![0.0; dense],
        gate_fallbacks: inp.candidates.gate_fallbacks.clone(),
        n_conflicts: 0,
    };
    if m == 0 {
        // Reference: all-background targets.
        return Ok(out);
    }
    let eps = p.eps;
    let mut scratch = vec![false; na];
    let mut claims = vec![0u16; na];
    for b in 0..bs {
        let mut rows: Vec<GtRow> = Vec::with_capacity(m);
        for g in 0..m {
            let mut row = GtRow::default();
            if !t.mask[b * m + g] {
                rows.push(row);
                continue;
            }
            let gb = &t.boxes[(b * m + g) * 4..(b * m + g) * 4 + 4];
            let label = t.labels[b * m + g];
            if !(label >= 0.0 && (label as usize) < nc) {
                return Err(TrainerError::InvalidArgument { what: "targets.cls", reason: format!("class {label} outside 0..{nc}") });
            }
            let cls = label as usize;
            // §2.1 candidates (computed up front, prediction-independent).
            row.cands = inp.candidates.per_gt[b * m + g].clone();
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
            row.ov.reserve(row.cands.len());
            row.al.reserve(row.cands.len());
            for &j in &row.cands {
                let r = inp.rows[b * na + j];
                if r == NOT_LOADED || r as usize >= u {
                    return Err(TrainerError::InvalidArgument {
                        what: "assigner rows",
                        reason: format!("predictions of candidate anchor {j} of image {b} were not loaded"),
                    });
                }
                let r = r as usize;
                let ov = if nvis > 0 {
                    let pk = &inp.kpts[r * nk * 2..(r + 1) * nk * 2];
                    let mut acc = 0f32;
                    for k in 0..nk {
                        if gk[3 * k + 2] > 0.0 {
                            let dx = pk[2 * k] - gk[3 * k];
                            let dy = pk[2 * k + 1] - gk[3 * k + 1];
                            acc += (-((dx * dx + dy * dy) / denom[k])).exp();
                        }
                    }
                    acc / nvis as f32
                } else {
                    let pb = &inp.boxes[r * 4..r * 4 + 4];
                    ciou_f32([gb[0], gb[1], gb[2], gb[3]], [pb[0], pb[1], pb[2], pb[3]]).max(0.0)
                };
                let score = inp.scores[r * nc + cls];
                row.ov.push(ov);
                row.al.push(pow_f32(score, p.alpha) * pow_f32(ov, p.beta));
            }
            // §2.4 top-k over all anchors, kept where candidate.
            row.pos = sparse_topk(&row.cands, &row.al, na, p.topk, &mut scratch);
            rows.push(row);
        }
        // §2.5 conflict resolution: a column claimed twice becomes one-hot at argmax_g overlap.
        for r in &rows {
            for &j in &r.pos {
                claims[j] += 1;
            }
        }
        let mut conflicted: Vec<usize> = rows.iter().flat_map(|r| r.pos.iter().copied()).filter(|&j| claims[j] > 1).collect();
        conflicted.sort_unstable();
        conflicted.dedup();
        for r in &rows {
            for &j in &r.pos {
                claims[j] = 0;
            }
        }
        out.n_conflicts += conflicted.len();
        for &j in &conflicted {
            let mut best = 0;
            let mut best_ov = rows[0].lookup(j).0;
            for (g, r) in rows.iter().enumerate().skip(1) {
                let o = r.lookup(j).0;
                if o > best_ov {
                    best = g;
                    best_ov = o;
                }
            }
            for (g, r) in rows.iter_mut().enumerate() {
                let at = r.pos.iter().position(|&x| x == j);
                match (g == best, at) {
                    (true, None) => r.pos.push(j),
                    (false, Some(i)) => {
                        r.pos.remove(i);
                    }
                    _ => {}
                }
            }
        }
        // §2.6 second filter: per GT, top-`topk2` of the metric masked by the positives.
        if p.topk2 != p.topk {
            for r in rows.iter_mut() {
                let mut pos = std::mem::take(&mut r.pos);
                pos.sort_unstable();
                let vals: Vec<f32> = pos.iter().map(|&j| r.lookup(j).1).collect();
                r.pos = sparse_topk(&pos, &vals, na, p.topk2, &mut scratch);
            }
        }
        // §2.7 targets and normalisation.
        for (g, r) in rows.iter().enumerate() {
            if r.pos.is_empty() {
                continue;
            }
            let (mut pos_al, mut pos_ov) = (0f32, 0f32);
            for &j in &r.pos {
                let (o, a) = r.lookup(j);
                pos_al = pos_al.max(a);
                pos_ov = pos_ov.max(o);
            }
            let cls = t.labels[b * m + g] as usize;
            for &j in &r.pos {
                let a = b * na + j;
                out.fg_mask[a] = true;
                out.target_gt_idx[a] = g;
                out.target_labels[a] = cls;
                out.target_bboxes[a * 4..a * 4 + 4].copy_from_slice(&t.boxes[(b * m + g) * 4..(b * m + g) * 4 + 4]);
                out.target_scores[a * nc + cls] = r.lookup(j).1 * pos_ov / (pos_al + eps);
            }
        }
        if p.debug {
            for (g, r) in rows.iter().enumerate() {
                let base = (b * m + g) * na;
                for (i, &j) in r.cands.iter().enumerate() {
                    out.candidates[base + j] = true;
                    out.overlaps[base + j] = r.ov[i];
                    out.align_metric[base + j] = r.al[i];
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dense reference: sort the full row by (value desc, index asc), take k, keep listed anchors.
    fn dense_topk(anchors: &[usize], vals: &[f32], na: usize, k: usize) -> Vec<usize> {
        let mut row = vec![0f32; na];
        for (&j, &v) in anchors.iter().zip(vals) {
            row[j] = v;
        }
        let mut idx: Vec<usize> = (0..na).collect();
        idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        let mut sel: Vec<usize> = idx.into_iter().take(k.min(na)).filter(|j| anchors.binary_search(j).is_ok()).collect();
        sel.sort_unstable();
        sel
    }

    #[test]
    fn sparse_topk_equals_dense_topk_with_ties() {
        let mut s = 12345u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as usize
        };
        for _ in 0..500 {
            let na = 1 + next() % 60;
            let anchors: Vec<usize> = (0..na).filter(|_| next() % 3 == 0).collect();
            // Values drawn from a small set so that ties (and zeros) are common.
            let vals: Vec<f32> = anchors.iter().map(|_| [0.0, 0.0, 0.25, 0.5, 0.5, 1.0][next() % 6]).collect();
            let k = 1 + next() % 12;
            let mut scratch = vec![false; na];
            let mut got = sparse_topk(&anchors, &vals, na, k, &mut scratch);
            got.sort_unstable();
            assert_eq!(got, dense_topk(&anchors, &vals, na, k), "na {na} k {k} anchors {anchors:?} vals {vals:?}");
            assert!(scratch.iter().all(|&b| !b), "scratch is left clean");
        }
    }

    #[test]
    fn alignment_metric_worked_example() {
        // docs/loss.md §2.3: score 0.3, OKS 0.8 → t = 0.3^0.5 · 0.8^6 = 0.14358.
        let t = pow_f32(0.3, 0.5) * pow_f32(0.8, 6.0);
        assert!((t - 0.14358).abs() < 1e-5, "{t}");
    }
}

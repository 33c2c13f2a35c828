//! The pose task-aligned assigner (docs/loss.md §2) as fixed-shape tensor ops: every (image, GT slot,
//! anchor) triple at once over targets padded to a bucketed slot count, so it runs on the
//! predictions' device with no host read and no data-dependent shape — what a recorded loss
//! region needs (the whole-step issue). Written step for step after the host assigner
//! ([`super::assigner::assign`]) with the same f32 arithmetic in the same order (the OKS sum over
//! keypoints is a chain of f32 adds, as the host's loop; top-k ties by the lower anchor index,
//! argmax ties by the lower GT slot), so on the CPU it gives the host assigner's assignment;
//! padding slots take part as GTs without candidates and change nothing.

use ptl_autograd::{no_grad, DType, Device, Tensor};

use super::assigner::AssignParams;
use super::boxes::ciou;
use super::targets::PaddedTargets;
use crate::error::{Result, TrainerError};

/// Slot counts the targets are padded to: a batch with up to `n` objects in one image takes the
/// smallest bucket ≥ n, so a recorded region sees one of a few shapes.
pub const TARGET_BUCKETS: [usize; 6] = [8, 16, 32, 64, 128, 256];

/// The bucket for `max_boxes` objects in one image, or `None` beyond the largest.
pub fn target_bucket(max_boxes: usize) -> Option<usize> {
    TARGET_BUCKETS.iter().copied().find(|&b| b >= max_boxes)
}

/// Padded targets as device tensors with `slots` slots per image (≥ the batch's largest count).
#[derive(Clone, Debug)]
pub struct DeviceTargets {
    /// Ground-truth slots per image.
    pub slots: usize,
    /// (B, M) class of each slot, f32 (0 for padding).
    pub labels: Tensor,
    /// (B, M, 4) xyxy pixels.
    pub boxes: Tensor,
    /// (B, M) 1 for a valid slot, else 0 (f32).
    pub mask: Tensor,
    /// (B, M, K, 3) keypoints in pixels and visibility.
    pub kpts: Tensor,
}

impl DeviceTargets {
    /// Uploads `t` re-padded to `slots` slots per image (one host→device copy per tensor).
    pub fn upload(t: &PaddedTargets, slots: usize, device: Device) -> Result<DeviceTargets> {
        let (bs, m, nk) = (t.batch_size, t.max_boxes, t.nkpt);
        if slots < m {
            return Err(TrainerError::InvalidArgument {
                what: "target slots",
                reason: format!("{slots} slots for images with up to {m} objects: pick a larger bucket"),
            });
        }
        let mut labels = vec![0f32; bs * slots];
        let mut boxes = vec![0f32; bs * slots * 4];
        let mut mask = vec![0f32; bs * slots];
        let mut kpts = vec![0f32; bs * slots * nk * 3];
        for b in 0..bs {
            for g in 0..m {
                let (src, dst) = (b * m + g, b * slots + g);
                labels[dst] = t.labels[src];
                mask[dst] = f32::from(u8::from(t.mask[src]));
                boxes[4 * dst..4 * dst + 4].copy_from_slice(&t.boxes[4 * src..4 * src + 4]);
                kpts[dst * nk * 3..(dst + 1) * nk * 3].copy_from_slice(&t.kpts[src * nk * 3..(src + 1) * nk * 3]);
            }
        }
        Ok(DeviceTargets {
            slots,
            labels: Tensor::from_vec(labels, vec![bs, slots], device)?,
            boxes: Tensor::from_vec(boxes, vec![bs, slots, 4], device)?,
            mask: Tensor::from_vec(mask, vec![bs, slots], device)?,
            kpts: Tensor::from_vec(kpts, vec![bs, slots, nk, 3], device)?,
        })
    }
}

/// What a dense assignment reads besides the predictions and targets, made once per image size
/// on the device (so an assignment uploads nothing).
#[derive(Clone, Debug)]
pub struct DenseGeometry {
    /// (A, 2) anchor centres in pixels.
    pub anchors_px: Tensor,
    /// (A,) anchor strides.
    pub strides: Tensor,
    /// (1, 1, 1, K) the OKS factors (2σ)² in f32, as the host assigner forms them.
    pub sigma_sq: Tensor,
    /// (1, max bucket, 1) slot indices 0, 1, … (i64).
    pub slot_index: Tensor,
    /// (1, 1, nc) class indices (i64).
    pub class_index: Tensor,
    /// (1, A, 2) anchor centres in grid units and (1, A, 1) strides, for the decode.
    pub anchors_grid: Tensor,
    /// Each anchor's stride, as a column.
    pub strides_col: Tensor,
}

impl DenseGeometry {
    /// The device constants for `anchors`, `sigmas` and `nc` classes.
    pub fn new(anchors: &super::Anchors, sigmas: &[f32], nc: usize, device: Device) -> Result<DenseGeometry> {
        let na = anchors.len();
        let sq: Vec<f32> = sigmas.iter().map(|&s| (2.0 * s) * (2.0 * s)).collect();
        let largest = TARGET_BUCKETS[TARGET_BUCKETS.len() - 1];
        Ok(DenseGeometry {
            anchors_px: Tensor::from_vec(anchors.points_px(), vec![na, 2], device)?,
            strides: Tensor::from_vec(anchors.strides.clone(), vec![na], device)?,
            sigma_sq: Tensor::from_vec(sq, vec![1, 1, 1, sigmas.len()], device)?,
            slot_index: Tensor::arange(0, largest as i64, DType::I64, device)?.reshape(vec![1, largest, 1])?,
            class_index: Tensor::arange(0, nc as i64, DType::I64, device)?.reshape(vec![1, 1, nc])?,
            anchors_grid: anchors.points_tensor(device)?.reshape(vec![1, na, 2])?,
            strides_col: anchors.strides_tensor(device)?.reshape(vec![1, na, 1])?,
        })
    }
}

/// Device inputs of one dense assignment (detached; pixels).
pub struct DenseInputs<'a> {
    /// (B, A, nc) sigmoid scores.
    pub scores: &'a Tensor,
    /// (B, A, 4) predicted xyxy boxes.
    pub boxes: &'a Tensor,
    /// (B, A, K, 2) predicted keypoints.
    pub kpts: &'a Tensor,
    /// Anchors and constants.
    pub geometry: &'a DenseGeometry,
    /// The batch's targets on the device.
    pub targets: &'a DeviceTargets,
}

/// The assigner's view of one branch's raw outputs on their device — sigmoid scores (B, A, nc),
/// xyxy boxes (B, A, 4) and keypoints (B, A, K, 2) in pixels — decoded with the host decode's f32
/// arithmetic (`(anchor ∓ distance) · stride`, `(offset + anchor) · stride`). Detached.
pub fn decode_for_assignment(boxes: &Tensor, scores: &Tensor, kpts: &Tensor, geometry: &DenseGeometry) -> Result<(Tensor, Tensor, Tensor)> {
    no_grad(|| -> Result<(Tensor, Tensor, Tensor)> {
        let f32_of = |t: &Tensor| -> Result<Tensor> { Ok(t.detach().to_dtype(DType::F32)?.permute(&[0, 2, 1])?) };
        let (b, s, k) = (f32_of(boxes)?, f32_of(scores)?, f32_of(kpts)?);
        let (bs, na) = (b.dims()[0], b.dims()[1]);
        let nk = k.dims()[2] / 3;
        if geometry.anchors_grid.dims() != [1, na, 2] {
            return Err(TrainerError::shape("decode anchors (1, A, 2)", &[1, na, 2], geometry.anchors_grid.numel()));
        }
        let (anc, st) = (&geometry.anchors_grid, &geometry.strides_col);
        let lt = anc.sub(&b.narrow(-1, 0, 2)?)?;
        let rb = anc.add(&b.narrow(-1, 2, 2)?)?;
        let px_boxes = Tensor::cat(&[&lt, &rb], -1)?.mul(st)?;
        let kp = k.reshape(vec![bs, na, nk, 3])?.narrow(-1, 0, 2)?;
        let px_kpts = kp.add(&anc.unsqueeze(2)?)?.mul(&st.unsqueeze(-1)?)?;
        Ok((s.sigmoid()?, px_boxes, px_kpts))
    })
}

/// A dense assignment, every tensor on the inputs' device.
#[derive(Clone, Debug)]
pub struct DenseAssignment {
    /// (B, A) 1 at foreground anchors, else 0 (f32).
    pub fg_mask: Tensor,
    /// (B, A) GT slot of each anchor (0 for background), i64.
    pub target_gt_idx: Tensor,
    /// (B, A) class of the assigned GT (0 for background), i64.
    pub target_labels: Tensor,
    /// (B, A, 4) assigned GT box, xyxy pixels (0 for background).
    pub target_bboxes: Tensor,
    /// (B, A, nc) soft class targets.
    pub target_scores: Tensor,
}

/// 1.0 where `c` holds, else 0.0 (f32).
fn f32_mask(c: &Tensor) -> Result<Tensor> {
    Ok(c.to_dtype(DType::F32)?)
}

/// Runs the assigner of docs/loss.md §2 on fixed shapes (see the module doc): on a CUDA device in four
/// fused kernels ([`super::assign_fused`], the composed ops' bytes), elsewhere as composed tensor ops.
pub fn assign_dense(inp: &DenseInputs<'_>, p: &AssignParams) -> Result<DenseAssignment> {
    no_grad(|| {
        check_dense(inp, p)?;
        #[cfg(feature = "cuda")]
        if super::assign_fused::supports(inp, p) {
            return super::assign_fused::assign_fused(inp, p);
        }
        assign_composed_checked(inp, p)
    })
}

/// The assigner as composed tensor ops on any device (the CPU path, and the reference the fused
/// CUDA kernels are tested against).
pub fn assign_composed(inp: &DenseInputs<'_>, p: &AssignParams) -> Result<DenseAssignment> {
    no_grad(|| {
        check_dense(inp, p)?;
        assign_composed_checked(inp, p)
    })
}

/// Rejects inputs whose shapes do not fit together, or parameters the dense assigner is not written for.
fn check_dense(inp: &DenseInputs<'_>, p: &AssignParams) -> Result<()> {
    let t = inp.targets;
    let sd = inp.scores.dims().to_vec();
    let kd = t.kpts.dims().to_vec();
    if sd.len() != 3 || kd.len() != 4 {
        return Err(TrainerError::shape("dense assigner scores (B, A, nc)", &[0, 0, 0], inp.scores.numel()));
    }
    let (bs, na, nc) = (sd[0], sd[1], sd[2]);
    let (m, nk) = (kd[1], kd[2]);
    let geo = inp.geometry;
    if inp.boxes.dims() != [bs, na, 4] || inp.kpts.dims() != [bs, na, nk, 2] || geo.strides.dims() != [na] || kd[0] != bs {
        return Err(TrainerError::shape("dense assigner boxes / keypoints / strides", &[bs, na, 4], inp.boxes.numel()));
    }
    if p.sigmas.len() != nk || geo.sigma_sq.numel() != nk || geo.class_index.numel() != nc || geo.slot_index.numel() < m {
        return Err(TrainerError::InvalidArgument {
            what: "assigner sigmas",
            reason: format!("{} sigmas for {nk} keypoints", p.sigmas.len()),
        });
    }
    if p.alpha != 0.5 || p.beta != 6.0 {
        return Err(TrainerError::InvalidArgument {
            what: "dense assigner",
            reason: format!("α = {}, β = {}: the dense assigner is written for the pose assigner's 0.5 and 6", p.alpha, p.beta),
        });
    }
    if t.boxes.dims() != [bs, m, 4] || t.mask.dims() != [bs, m] || t.labels.dims() != [bs, m] {
        return Err(TrainerError::shape("dense assigner target boxes (B, M, 4), mask and labels (B, M)", &[bs, m, 4], t.boxes.numel()));
    }
    if t.slots != m || inp.scores.device() != t.boxes.device() || inp.scores.device() != geo.strides.device() {
        return Err(TrainerError::InvalidArgument {
            what: "dense assigner targets",
            reason: format!(
                "{} slots on {} for keypoints of {m} slots, predictions on {}, geometry on {}: upload the targets and make the geometry on the predictions' device",
                t.slots,
                t.boxes.device(),
                inp.scores.device(),
                geo.strides.device()
            ),
        });
    }
    Ok(())
}

fn assign_composed_checked(inp: &DenseInputs<'_>, p: &AssignParams) -> Result<DenseAssignment> {
    let t = inp.targets;
    let (bs, na, _) = (inp.scores.dims()[0], inp.scores.dims()[1], inp.scores.dims()[2]);
    let (m, nk) = (t.kpts.dims()[1], t.kpts.dims()[2]);
    let geo = inp.geometry;
    let device = inp.scores.device();
    let eps = f64::from(p.eps);
    // Column views of the GT boxes, (B, M, 1) each, and of the anchors, (1, 1, A).
    let gcol = |i: usize| -> Result<Tensor> { Ok(t.boxes.narrow(-1, i, 1)?) };
    let (gx1, gy1, gx2, gy2) = (gcol(0)?, gcol(1)?, gcol(2)?, gcol(3)?);
    let ax = geo.anchors_px.narrow(-1, 0, 1)?.reshape(vec![1, 1, na])?;
    let ay = geo.anchors_px.narrow(-1, 1, 1)?.reshape(vec![1, 1, na])?;
    let st = geo.strides.reshape(vec![1, 1, na])?;

    // §2.1 candidates: in the box enlarged to the size floor, the level gate, the ungated fallback.
    let (cx, cy) = (gx1.add(&gx2)?.div_scalar(2.0)?, gy1.add(&gy2)?.div_scalar(2.0)?);
    let (w, h) = (gx2.sub(&gx1)?, gy2.sub(&gy1)?);
    let floor = f64::from(p.size_floor);
    let (hw, hh) = (w.clamp_min(floor)?.div_scalar(2.0)?, h.clamp_min(floor)?.div_scalar(2.0)?);
    let (x1, y1, x2, y2) = (cx.sub(&hw)?, cy.sub(&hh)?, cx.add(&hw)?, cy.add(&hh)?);
    let valid = t.mask.unsqueeze(-1)?;
    let in_box = f32_mask(&ax.sub(&x1)?.gt_scalar(eps)?)?
        .mul(&f32_mask(&ay.sub(&y1)?.gt_scalar(eps)?)?)?
        .mul(&f32_mask(&x2.sub(&ax)?.gt_scalar(eps)?)?)?
        .mul(&f32_mask(&y2.sub(&ay)?.gt_scalar(eps)?)?)?
        .mul(&valid)?;
    let side = w.mul(&h)?.sqrt()?;
    let (lo, hi) = (f64::from(p.level_range.0), f64::from(p.level_range.1));
    let lo_ok = f32_mask(&side.ge(&st.mul_scalar(lo)?)?)?.maximum(&f32_mask(&st.eq_scalar(f64::from(p.min_stride))?)?)?;
    let hi_ok = f32_mask(&side.le(&st.mul_scalar(hi)?)?)?.maximum(&f32_mask(&st.eq_scalar(f64::from(p.max_stride))?)?)?;
    let gated = in_box.mul(&lo_ok)?.mul(&hi_ok)?;
    let any_gated = gated.max_dim(-1, true)?.0;
    let cand = any_gated.where_cond(&gated, &in_box)?;

    // §2.2 overlaps: OKS over visible keypoints, the clamped CIoU for GTs without any.
    let gk = |i: usize| -> Result<Tensor> { Ok(t.kpts.narrow(-1, i, 1)?.squeeze(-1)?.unsqueeze(2)?) }; // (B, M, 1, K)
    let (gkx, gky, gkv) = (gk(0)?, gk(1)?, gk(2)?);
    let vis = f32_mask(&gkv.gt_scalar(0.0)?)?;
    let nvis = vis.sum_dim(-1, false)?; // (B, M, 1): small integers, exact
    let area = w.mul(&h)?.mul_scalar(f64::from(p.area_factor))?; // (B, M, 1)
    let denom = geo.sigma_sq.mul(&area.add_scalar(eps)?.unsqueeze(-1)?)?.mul_scalar(2.0)?; // (B, M, 1, K)
    let pk = inp.kpts.unsqueeze(1)?; // (B, 1, A, K, 2)
    let pkx = pk.narrow(-1, 0, 1)?.squeeze(-1)?;
    let pky = pk.narrow(-1, 1, 1)?.squeeze(-1)?;
    let (dx, dy) = (pkx.sub(&gkx)?, pky.sub(&gky)?); // (B, M, A, K)
    let terms = dx.square()?.add(&dy.square()?)?.div(&denom)?.neg()?.exp()?.mul(&vis)?;
    // Summed keypoint by keypoint in f32, as the host loop adds them (invisible ones add +0).
    let mut acc = terms.narrow(-1, 0, 1)?;
    for k in 1..nk {
        acc = acc.add(&terms.narrow(-1, k, 1)?)?;
    }
    let oks = acc.squeeze(-1)?.div(&nvis.clamp_min(1.0)?)?;
    let gt_boxes = t.boxes.unsqueeze(2)?.expand(&[bs, m, na, 4])?.reshape(vec![bs * m * na, 4])?;
    let pred_boxes = inp.boxes.unsqueeze(1)?.expand(&[bs, m, na, 4])?.reshape(vec![bs * m * na, 4])?;
    let box_iou = ciou(&gt_boxes, &pred_boxes)?.clamp_min(0.0)?.reshape(vec![bs, m, na])?;
    let overlaps = f32_mask(&nvis.gt_scalar(0.0)?)?.where_cond(&oks, &box_iou)?.mul(&cand)?;

    // §2.3 alignment metric sqrt(score)·overlap⁶ (the power in f64, rounded), on candidates.
    let labels_i = t.labels.to_dtype(DType::I64)?;
    let cls_idx = labels_i.unsqueeze(-1)?.expand(&[bs, m, na])?;
    let score = inp.scores.permute(&[0, 2, 1])?.gather(1, &cls_idx.reshape(vec![bs, m, na])?)?; // (B, M, A)
    let metric = score.sqrt()?.mul(&overlaps.to_dtype(DType::F64)?.powf(p.beta)?.to_dtype(DType::F32)?)?.mul(&cand)?;

    // §2.4 top-k over all anchors, kept where candidate.
    let topk_mask = |values: &Tensor, k: usize| -> Result<Tensor> {
        let (_, idx) = values.topk(k.min(na), -1, true)?;
        let ones = Tensor::ones(idx.dims().to_vec(), DType::F32, device)?;
        Ok(Tensor::zeros(vec![bs, m, na], DType::F32, device)?.scatter_add(-1, &idx, &ones)?)
    };
    let mut pos = topk_mask(&metric, p.topk)?.mul(&cand)?;

    // §2.5 an anchor claimed by several GTs goes to the one of highest overlap (lowest slot on ties).
    let claims = pos.sum_dim(1, true)?; // (B, 1, A)
    let best = overlaps.argmax(1, true)?; // (B, 1, A)
    let slot = geo.slot_index.narrow(1, 0, m)?;
    let one_hot = f32_mask(&slot.eq(&best)?)?;
    pos = f32_mask(&claims.gt_scalar(1.0)?)?.where_cond(&one_hot, &pos)?;

    // §2.6 second filter: per GT the top-`topk2` of the metric among its positives.
    if p.topk2 != p.topk {
        let kept = metric.mul(&pos)?;
        pos = topk_mask(&kept, p.topk2)?.mul(&pos)?;
    }

    // §2.7 targets and the normalised metric.
    let fg = pos.max_dim(1, false)?.0; // (B, A)
    let gt_idx = pos.argmax(1, false)?; // (B, A)
    let pos_al = metric.mul(&pos)?.max_dim(-1, true)?.0; // (B, M, 1)
    let pos_ov = overlaps.mul(&pos)?.max_dim(-1, true)?.0;
    let norm = metric.mul(&pos_ov)?.div(&pos_al.add_scalar(eps)?)?.mul(&pos)?.max_dim(1, false)?.0; // (B, A)
    let zero_i = Tensor::zeros(vec![bs, na], DType::I64, device)?;
    let labels = labels_i.gather(1, &gt_idx)?;
    let target_labels = fg.where_cond(&labels, &zero_i)?;
    let gathered = t.boxes.gather(1, &gt_idx.unsqueeze(-1)?.expand(&[bs, na, 4])?)?;
    let target_bboxes = fg.unsqueeze(-1)?.where_cond(&gathered, &Tensor::zeros(vec![bs, na, 4], DType::F32, device)?)?;
    let cls_hot = f32_mask(&geo.class_index.eq(&target_labels.unsqueeze(-1)?)?)?;
    let target_scores = cls_hot.mul(&norm.mul(&fg)?.unsqueeze(-1)?)?;
    Ok(DenseAssignment { fg_mask: fg, target_gt_idx: gt_idx, target_labels, target_bboxes, target_scores })
}

#[cfg(test)]
mod tests {
    use super::super::anchors::Anchors;
    use super::super::assigner::{assign, candidate_sets, AssignInputs, NOT_LOADED};
    use super::super::targets::{pad_targets, TargetBatch};
    use super::*;
    use ptl_autograd::Rng;

    const NK: usize = 17;

    /// A batch of `bs` images with the given object counts: random boxes (some tiny, some large),
    /// keypoints inside them with random visibility (some objects with none visible).
    fn batch(counts: &[usize], rng: &mut Rng) -> TargetBatch {
        let mut t = TargetBatch { nkpt: NK, ..Default::default() };
        let mut u = |lo: f32, hi: f32| lo + (hi - lo) * rng.uniform() as f32;
        for (b, &n) in counts.iter().enumerate() {
            for i in 0..n {
                let (w, h) = if i % 4 == 3 { (u(0.01, 0.05), u(0.01, 0.05)) } else { (u(0.08, 0.7), u(0.08, 0.7)) };
                let (cx, cy) = (u(w / 2.0, 1.0 - w / 2.0), u(h / 2.0, 1.0 - h / 2.0));
                t.batch_idx.push(b as f32);
                t.cls.push(0.0);
                t.bboxes.extend_from_slice(&[cx, cy, w, h]);
                let none_visible = i % 5 == 2;
                for _ in 0..NK {
                    let v = if none_visible || u(0.0, 1.0) < 0.3 { 0.0 } else { 2.0 };
                    let (x, y) = (u(cx - w / 2.0, cx + w / 2.0), u(cy - h / 2.0, cy + h / 2.0));
                    t.keypoints.extend_from_slice(&[x, y, v]);
                }
            }
        }
        t
    }

    /// The dense assigner gives the host assigner's assignment bit for bit on the CPU — foreground,
    /// GT index, labels, boxes and soft scores — for both branches' top-k settings, over crowded,
    /// tiny, keypoint-less and empty images, with the targets padded to their bucket.
    #[test]
    fn dense_assignment_equals_the_host_assignment() {
        let strides = [8.0, 16.0, 32.0];
        let anchors = Anchors::from_image_hw((96, 128), &strides).unwrap();
        let na = anchors.len();
        let sigmas = crate::loss::LossConfig::default().sigmas;
        let mut rng = Rng::new(61);
        let mut conflicts = 0;
        for (case, counts) in [vec![3usize, 0], vec![9, 1], vec![0, 0], vec![14, 6]].into_iter().enumerate() {
            let bs = counts.len();
            let targets = batch(&counts, &mut rng);
            let padded = pad_targets(&targets, bs, anchors.image_hw()).unwrap();
            // Predictions: random logits, boxes and keypoints around each anchor.
            let logits: Vec<f32> = (0..bs * na).map(|_| (rng.uniform() as f32 - 0.5) * 8.0).collect();
            let scores: Vec<f32> = logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
            let (ap, st) = (anchors.points_px(), &anchors.strides);
            let mut boxes = Vec::with_capacity(bs * na * 4);
            let mut kpts = Vec::with_capacity(bs * na * NK * 2);
            for f in 0..bs * na {
                let j = f % na;
                let (x, y, s) = (ap[2 * j], ap[2 * j + 1], st[j]);
                let mut d = || (0.2 + 4.0 * rng.uniform() as f32) * s;
                boxes.extend_from_slice(&[x - d(), y - d(), x + d(), y + d()]);
                for _ in 0..NK {
                    kpts.extend_from_slice(&[x + (rng.uniform() as f32 - 0.5) * 6.0 * s, y + (rng.uniform() as f32 - 0.5) * 6.0 * s]);
                }
            }
            for (topk, topk2) in [(10, 10), (7, 1)] {
                let params = AssignParams::pose(topk, topk2, &strides, &sigmas);
                let cands = candidate_sets(&padded, &ap, st, &params).unwrap();
                let rows: Vec<u32> = (0..bs * na).map(|f| f as u32).collect();
                assert!(rows.iter().all(|&r| r != NOT_LOADED));
                let host = assign(
                    &AssignInputs {
                        batch_size: bs,
                        num_anchors: na,
                        nc: 1,
                        rows: &rows,
                        scores: &scores,
                        boxes: &boxes,
                        kpts: &kpts,
                        strides: st,
                        targets: &padded,
                        candidates: &cands,
                    },
                    &params,
                )
                .unwrap();
                let slots = target_bucket(padded.max_boxes).unwrap();
                let dt = DeviceTargets::upload(&padded, slots, Device::Cpu).unwrap();
                let t = |v: &[f32], shape: Vec<usize>| Tensor::from_vec(v.to_vec(), shape, Device::Cpu).unwrap();
                let geometry = DenseGeometry::new(&anchors, &sigmas, 1, Device::Cpu).unwrap();
                let dense = assign_dense(
                    &DenseInputs {
                        scores: &t(&scores, vec![bs, na, 1]),
                        boxes: &t(&boxes, vec![bs, na, 4]),
                        kpts: &t(&kpts, vec![bs, na, NK, 2]),
                        geometry: &geometry,
                        targets: &dt,
                    },
                    &params,
                )
                .unwrap();
                let what = format!("case {case} ({counts:?}), top-k {topk}/{topk2}");
                let fg: Vec<bool> = dense.fg_mask.to_vec::<f32>().unwrap().iter().map(|&v| v != 0.0).collect();
                assert_eq!(fg, host.fg_mask, "{what}: foreground");
                let gi: Vec<usize> = dense.target_gt_idx.to_vec::<i64>().unwrap().iter().map(|&v| v as usize).collect();
                assert_eq!(gi, host.target_gt_idx, "{what}: GT index");
                let tl: Vec<usize> = dense.target_labels.to_vec::<i64>().unwrap().iter().map(|&v| v as usize).collect();
                assert_eq!(tl, host.target_labels, "{what}: labels");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&dense.target_bboxes.to_vec::<f32>().unwrap()), bits(&host.target_bboxes), "{what}: boxes");
                assert_eq!(bits(&dense.target_scores.to_vec::<f32>().unwrap()), bits(&host.target_scores), "{what}: scores");
                if counts.iter().sum::<usize>() > 0 {
                    assert!(host.fg_mask.iter().any(|&f| f), "{what}: the case assigns something");
                }
                conflicts += host.n_conflicts;
            }
        }
        assert!(conflicts > 0, "the crowded cases exercise conflict resolution");
    }

    /// Targets go to the smallest bucket that holds them; beyond the largest there is none, and
    /// uploading into too few slots is an error that names the fix.
    #[test]
    fn target_buckets_hold_their_counts() {
        assert_eq!(target_bucket(0), Some(8));
        assert_eq!(target_bucket(8), Some(8));
        assert_eq!(target_bucket(9), Some(16));
        assert_eq!(target_bucket(256), Some(256));
        assert_eq!(target_bucket(257), None);
        let mut rng = Rng::new(3);
        let padded = pad_targets(&batch(&[10, 2], &mut rng), 2, (64.0, 64.0)).unwrap();
        let err = DeviceTargets::upload(&padded, 8, Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("larger bucket"), "{err}");
        let up = DeviceTargets::upload(&padded, 16, Device::Cpu).unwrap();
        assert_eq!(up.boxes.dims(), &[2, 16, 4]);
        assert_eq!(up.mask.to_vec::<f32>().unwrap().iter().sum::<f32>(), 12.0);
    }
}

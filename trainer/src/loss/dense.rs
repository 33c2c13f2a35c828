//! One branch's six loss terms (docs/loss.md §3) from a dense assignment ([`super::assign_dense`]) with
//! fixed shapes and no host read. The foreground rows are compacted on the device
//! ([`Tensor::nonzero_static`]) into a buffer of a static bound — an image's foreground never
//! exceeds its slots × the branch's top-k — so the box, keypoint and RLE terms run over that
//! bound (640 rows for the one-to-many branch at batch 4 with 16 slots) instead of every anchor,
//! in the host path's ascending-anchor order. Padding rows are replaced by harmless finite values
//! before any division or logarithm and weighted by zero after, so each sum adds the host path's
//! terms in its order with exact zeros after them, and their gradients are zero. Counts that
//! divide (foreground anchors, visible keypoints) stay on the device; the constants are made once
//! per shape ([`DenseConstants`]).

use ptl_autograd::{DType, Device, Tensor};

use super::assign_dense::{DenseAssignment, DeviceTargets};
use super::assigner::AssignParams;
use super::branch::{gain_scaled, sigma_floor_of, BranchOutputs};
use super::terms::{self, constant};
use super::{Anchors, FlowLogProb, LossConfig};
use crate::error::{Result, TrainerError};

/// What the dense terms read besides the outputs and the assignment, made once per image size,
/// batch size, slot count and device (so a criterion call uploads only its targets).
#[derive(Clone, Debug)]
pub struct DenseConstants {
    /// Rows of the compacted foreground buffer: min(B·M·min(top-k, top-k₂), B·A).
    pub foreground_bound: usize,
    /// (B·A, 3) each row's anchor x, y (grid units) and stride.
    anchor_rows: Tensor,
    /// (B, 1) i64 offset b·M of each image's slots in the flattened (B·M) targets.
    slot_offsets: Tensor,
    /// (F,) i64 rows 0, 1, … F−1: where the padding entries of the foreground buffer point, so that
    /// no row is hit by more than two entries (the gathers' deterministic backward sorts each
    /// row's entries, and hundreds of padding entries on one row made that sort quadratic).
    padding_rows: Tensor,
    /// (1, 4) the unit box that stands in for padding rows' boxes.
    unit_box: Tensor,
    /// (1, 4) image width, height, width, height.
    whwh: Tensor,
    /// (1, K) the OKS factors (2σ)².
    two_sigma_sq: Tensor,
    /// (1, K, 1) the RLE keypoint weights.
    rle_weights: Tensor,
    /// 0-d f32 K (the keypoint loss's visibility factor numerator).
    nkpt: Tensor,
    /// (1, 1) zero and (1, 1, 1) one stand-ins.
    zero: Tensor,
    one: Tensor,
}

impl DenseConstants {
    /// The loss's device constants.
    pub fn new(
        cfg: &LossConfig,
        params: &AssignParams,
        anchors: &Anchors,
        batch: usize,
        slots: usize,
        device: Device,
    ) -> Result<DenseConstants> {
        let (na, nk) = (anchors.len(), cfg.nkpt);
        let (img_h, img_w) = anchors.image_hw();
        let mut rows = Vec::with_capacity(batch * na * 3);
        for _ in 0..batch {
            for (p, &s) in anchors.points.chunks_exact(2).zip(&anchors.strides) {
                rows.extend_from_slice(&[p[0], p[1], s]);
            }
        }
        let offsets: Vec<i64> = (0..batch).map(|b| (b * slots) as i64).collect();
        let two_s_sq: Vec<f32> = cfg.sigmas.iter().map(|&s| (2.0 * s) * (2.0 * s)).collect();
        let foreground_bound = (batch * slots * params.topk.min(params.topk2)).min(batch * na);
        Ok(DenseConstants {
            foreground_bound,
            padding_rows: Tensor::arange(0, foreground_bound as i64, DType::I64, device)?,
            anchor_rows: constant(rows, &[batch * na, 3], device)?,
            slot_offsets: Tensor::from_vec(offsets, vec![batch, 1], device)?,
            unit_box: constant(vec![0.0, 0.0, 1.0, 1.0], &[1, 4], device)?,
            whwh: constant(vec![img_w, img_h, img_w, img_h], &[1, 4], device)?,
            two_sigma_sq: constant(two_s_sq, &[1, nk], device)?,
            rle_weights: constant(cfg.rle_weights.clone(), &[1, nk, 1], device)?,
            nkpt: Tensor::scalar(nk as f64, DType::F32, device)?,
            zero: constant(vec![0.0], &[1, 1], device)?,
            one: constant(vec![1.0], &[1, 1, 1], device)?,
        })
    }
}

/// The six gain-scaled terms `[box, pose, kobj, cls, l1, rle]` as a (6,) device tensor
/// (differentiable), the fixed-shape counterpart of the host path's `loss_times_bs / bs`.
pub fn dense_branch_terms(
    cfg: &LossConfig,
    out: &BranchOutputs,
    asg: &DenseAssignment,
    targets: &DeviceTargets,
    consts: &DenseConstants,
    flow: Option<&dyn FlowLogProb>,
) -> Result<Tensor> {
    let parts = dense_branch_parts(cfg, out, &F32Outputs::of(out)?, asg, targets, consts)?;
    let rle = rle_terms(&[&parts], flow)?;
    parts.finish(cfg, &rle[0])
}

/// One branch's terms before the RLE's flow: the five raw terms and the RLE's rows, so that the
/// criterion can run the flow once over both branches' rows ([`rle_terms`]).
pub struct DenseParts {
    /// Raw `[box, pose, kobj, cls, l1]` (0-d each).
    raw: [Tensor; 5],
    rle: Option<RleRows>,
    device: Device,
}

/// The RLE's padded rows of one branch: clamped errors (F·K, 2), σ (F, K, 1) with 1 where not
/// kept, the keep mask (F, K, 1) and the keypoint weights (1, K, 1).
struct RleRows {
    error: Tensor,
    sigma: Tensor,
    keep: Tensor,
    weights: Tensor,
}

impl DenseParts {
    /// The (6,) gain-scaled terms with the branch's RLE term `rle` (from [`rle_terms`]).
    pub fn finish(&self, cfg: &LossConfig, rle: &Tensor) -> Result<Tensor> {
        let [b, k, o, c, l] = &self.raw;
        gain_scaled(cfg, [b, k, o, c, l, rle])
    }
}

/// The RLE term of each branch in `parts` with **one** flow evaluation over all their rows (the
/// flow is per point, so batching the branches changes no value; it halves the flow's kernels).
/// A branch without keypoint sigmas gets 0.
pub fn rle_terms(parts: &[&DenseParts], flow: Option<&dyn FlowLogProb>) -> Result<Vec<Tensor>> {
    let rows: Vec<&RleRows> = parts.iter().filter_map(|p| p.rle.as_ref()).collect();
    let log_phi = match (rows.is_empty(), flow) {
        (true, _) => None,
        (false, None) => {
            return Err(TrainerError::InvalidArgument {
                what: "flow",
                reason: "kpts_sigma given but no flow model for the RLE term".into(),
            })
        }
        (false, Some(flow)) => {
            let errors: Vec<&Tensor> = rows.iter().map(|r| &r.error).collect();
            let n: usize = rows.iter().map(|r| r.error.dims()[0]).sum();
            let all = if errors.len() == 1 { errors[0].clone() } else { Tensor::cat(&errors, 0)? };
            let lp = flow.log_prob(&all)?;
            if lp.dims() != [n] {
                return Err(TrainerError::InvalidArgument {
                    what: "flow.log_prob",
                    reason: format!("returned shape {:?} for {n} errors", lp.dims()),
                });
            }
            let sizes: Vec<usize> = rows.iter().map(|r| r.error.dims()[0]).collect();
            Some(if sizes.len() == 1 { vec![lp] } else { lp.split(&sizes, 0)? })
        }
    };
    let mut per_row = log_phi.into_iter().flatten();
    parts
        .iter()
        .map(|p| match &p.rle {
            None => Ok(Tensor::scalar(0.0, DType::F32, p.device)?),
            Some(r) => {
                let lp = per_row.next().ok_or_else(|| TrainerError::InvalidArgument { what: "flow", reason: "missing rows".into() })?;
                let (s, e, keep) = (&r.sigma, &r.error, &r.keep);
                let (f, nk) = (s.dims()[0], s.dims()[1]);
                let n_keep = keep.sum_all()?.clamp_min(1.0)?;
                #[cfg(feature = "cuda")]
                {
                    let rows = super::kpt_fused::RleRowsIn { sigma: s, log_phi: &lp, error: e, weights: &r.weights, keep, n_keep: &n_keep };
                    if super::kpt_fused::supports_rle(&rows) {
                        return Ok(super::kpt_fused::rle_rows(&rows)?.sum_all()?.clamp_min(0.0)?);
                    }
                }
                let e = e.reshape(vec![f, nk, 2])?;
                let l = s
                    .log()?
                    .sub(&lp.reshape(vec![f, nk, 1])?)?
                    .add(&s.mul_scalar(2.0)?.log()?.add(&e.abs()?)?)?
                    .mul(&r.weights)?
                    .mul(keep)?;
                Ok(l.div(&n_keep)?.sum_all()?.clamp_min(0.0)?)
            }
        })
        .collect()
}

/// A branch's raw outputs in f32, the loss's arithmetic: one batched cast (one autograd node, one
/// launch each way on CUDA) instead of a cast per tensor, shared by the assigner's decode and the
/// loss terms.
pub struct F32Outputs {
    /// (B, 4, A) box distances.
    pub boxes: Tensor,
    /// (B, nc, A) class logits.
    pub scores: Tensor,
    /// (B, 3K, A) keypoints.
    pub kpts: Tensor,
    /// (B, 2K, A) sigma logits, when the branch has them.
    pub kpts_sigma: Option<Tensor>,
}

impl F32Outputs {
    /// `out`'s tensors in f32 (those already f32 as they are).
    pub fn of(out: &BranchOutputs) -> Result<F32Outputs> {
        let mut xs = vec![out.boxes.clone(), out.scores.clone(), out.kpts.clone()];
        xs.extend(out.kpts_sigma.clone());
        let mut cast = Tensor::to_dtype_many(&xs, DType::F32)?.into_iter();
        let mut next =
            || cast.next().ok_or_else(|| TrainerError::InvalidArgument { what: "dense loss", reason: "a cast output is missing".into() });
        let (boxes, scores, kpts) = (next()?, next()?, next()?);
        let kpts_sigma = if out.kpts_sigma.is_some() { Some(next()?) } else { None };
        Ok(F32Outputs { boxes, scores, kpts, kpts_sigma })
    }
}

/// One branch's raw terms and RLE rows (see [`DenseParts`]); `f32` is `out` in f32
/// ([`F32Outputs::of`]).
pub fn dense_branch_parts(
    cfg: &LossConfig,
    out: &BranchOutputs,
    f32: &F32Outputs,
    asg: &DenseAssignment,
    targets: &DeviceTargets,
    consts: &DenseConstants,
) -> Result<DenseParts> {
    let sigma_floor = sigma_floor_of(out);
    let (boxes, scores, kpts) = (f32.boxes.clone(), f32.scores.clone(), f32.kpts.clone());
    let (bs, na, nk, nc) = (boxes.dims()[0], boxes.dims()[2], cfg.nkpt, cfg.nc);
    if consts.anchor_rows.dims() != [bs * na, 3] || consts.slot_offsets.dims() != [bs, 1] || targets.kpts.dims()[2] != nk {
        return Err(TrainerError::InvalidArgument {
            what: "dense loss constants",
            reason: format!(
                "made for {:?} anchor rows, {:?} images; the outputs have {bs} × {na}",
                consts.anchor_rows.dims(),
                consts.slot_offsets.dims()
            ),
        });
    }
    let f = consts.foreground_bound;

    // T = max(Σ target scores, 1) and the classification term over every anchor.
    let tss = asg.target_scores.sum_all()?.clamp_min(1.0)?;
    let l_cls = terms::cls_loss(&scores.permute(&[0, 2, 1])?, &asg.target_scores, &tss)?;

    // The foreground rows (ascending (image, anchor)), padded to the bound; `valid` (F, 1).
    let (fg_rows, valid) = ptl_autograd::no_grad(|| -> Result<(Tensor, Tensor)> {
        let at = asg.fg_mask.reshape(vec![bs * na])?.nonzero_static(f, -1)?;
        let real = at.ge_scalar(0.0)?;
        Ok((real.where_cond(&at, &consts.padding_rows)?, real.to_dtype(DType::F32)?.reshape(vec![f, 1])?))
    })?;
    let n_fg = valid.sum_all()?;
    let rows_of = |t: &Tensor, width: usize| -> Result<Tensor> { Ok(t.reshape(vec![bs * na, width])?.index_select(0, &fg_rows)?) };
    let anchor = rows_of(&consts.anchor_rows, 3)?;
    let anc = anchor.narrow(-1, 0, 2)?; // (F, 2) grid units
    let st = anchor.narrow(-1, 2, 1)?; // (F, 1)
                                       // (F, 1) each row's weight, zeroed on padding rows (they point at real rows).
    let w = rows_of(&asg.target_scores, nc)?.sum_dim(-1, true)?.mul(&valid)?;
    let tb = rows_of(&asg.target_bboxes, 4)?.div(&st)?; // grid units

    // Box CIoU and side L1; padding rows' boxes become a unit box.
    let ltrb = rows_of(&boxes.permute(&[0, 2, 1])?, 4)?;
    let (l_box, l_l1) = box_terms(&ltrb, &anc, &st, &tb, &valid, &w, &tss, consts)?;

    // Keypoints: each row's assigned GT keypoints (grid units), the visibility mask on real rows.
    let slot = ptl_autograd::no_grad(|| -> Result<Tensor> {
        let flat = asg.target_gt_idx.add(&consts.slot_offsets)?; // (B, A) index into B·M
        Ok(flat.reshape(vec![bs * na])?.index_select(0, &fg_rows)?)
    })?;
    let gk = targets.kpts.reshape(vec![bs * targets.slots, nk * 3])?.index_select(0, &slot)?.reshape(vec![f, nk, 3])?;
    let kp = rows_of(&kpts.permute(&[0, 2, 1])?, nk * 3)?.reshape(vec![f, nk, 3])?;
    // The host path's mean over N × K: Σ · (1/(N·K)) with the reciprocal rounded to f32.
    let inv_nk = n_fg.to_dtype(DType::F64)?.mul_scalar(nk as f64)?.clamp_min(1.0)?.recip()?.to_dtype(DType::F32)?;
    let sg_rows = match &f32.kpts_sigma {
        Some(sigma) => Some(rows_of(&sigma.permute(&[0, 2, 1])?, nk * 2)?.reshape(vec![f, nk, 2])?),
        None => None,
    };
    // On CUDA the keypoint terms and the RLE rows in one kernel each way (`kpt_fused`).
    #[cfg(feature = "cuda")]
    if let Some(sg) = &sg_rows {
        let rows = super::kpt_fused::KptRows {
            kp: &kp,
            sigma_logits: sg,
            anchor: &anc,
            stride: &st,
            target_box: &tb,
            valid: &valid,
            target_kpts: &gk,
            two_sigma_sq: &consts.two_sigma_sq,
            sigma_floor,
        };
        if super::kpt_fused::take(&rows) {
            let t = super::kpt_fused::kpt_terms(&rows)?;
            let l_kpt = t.kpt.sum_all()?.mul(&inv_nk)?;
            let l_kobj = t.kobj.sum_all()?.mul(&inv_nk)?;
            let rle =
                RleRows { error: t.error.reshape(vec![f * nk, 2])?, sigma: t.sigma, keep: t.keep, weights: consts.rle_weights.clone() };
            return Ok(DenseParts { raw: [l_box, l_kpt, l_kobj, l_cls, l_l1], rle: Some(rle), device: boxes.device() });
        }
    }
    let s3 = st.unsqueeze(-1)?; // (F, 1, 1)
    let gxy = gk.narrow(-1, 0, 2)?.div(&s3)?;
    let vis = gk.narrow(-1, 2, 1)?.squeeze(-1)?.ne(&consts.zero)?.to_dtype(DType::F32)?;
    let m = vis.mul(&valid)?; // (F, K)
    let kp_xy = kp.narrow(-1, 0, 2)?.add(&anc.unsqueeze(1)?)?;
    let pxy = kp_xy.split(&[1, 1], -1)?;
    let gxy_s = gxy.split(&[1, 1], -1)?;
    let (px, py, gx, gy) = (pxy[0].squeeze(-1)?, pxy[1].squeeze(-1)?, gxy_s[0].squeeze(-1)?, gxy_s[1].squeeze(-1)?);
    let tbs = tb.split(&[1, 1, 1, 1], -1)?;
    let area = tbs[2].sub(&tbs[0])?.mul(&tbs[3].sub(&tbs[1])?)?; // (F, 1)
    let denom = consts.two_sigma_sq.mul(&area.add_scalar(1e-9)?)?.mul_scalar(2.0)?;
    let nv = m.sum_dim(-1, true)?;
    let factor = consts.nkpt.div(&nv.add_scalar(1e-9)?)?;
    let d = px.sub(&gx)?.square()?.add(&py.sub(&gy)?.square()?)?;
    let lk = d.div(&denom)?.neg()?.exp()?.affine(-1.0, 1.0)?.mul(&m)?;
    let l_kpt = factor.mul(&lk)?.mul(&valid)?.sum_all()?.mul(&inv_nk)?;
    let vlog = kp.narrow(-1, 2, 1)?.squeeze(-1)?;
    let l_kobj = vlog.bce_with_logits(&m)?.mul(&valid)?.sum_all()?.mul(&inv_nk)?;

    // RLE rows: the visible foreground keypoints whose error is finite (the flow runs later).
    let rle = match &sg_rows {
        Some(sg) => {
            let sig = sg.sigmoid()?.clamp_min(sigma_floor)?;
            let error = kp_xy.sub(&gxy)?.div(&sig.add_scalar(1e-9)?)?;
            let finite = ptl_autograd::no_grad(|| -> Result<Tensor> {
                let ok = error.detach().abs()?.le_scalar(f64::from(f32::MAX))?.to_dtype(DType::F32)?;
                Ok(ok.narrow(-1, 0, 1)?.mul(&ok.narrow(-1, 1, 1)?)?.squeeze(-1)?)
            })?;
            let keep = m.mul(&finite)?.unsqueeze(-1)?; // (F, K, 1)
            let e = keep.where_cond(&error, &consts.zero.unsqueeze(0)?)?.clamp(-100.0, 100.0)?;
            let s = keep.where_cond(&sig, &consts.one)?;
            Some(RleRows { error: e.reshape(vec![f * nk, 2])?, sigma: s, keep, weights: consts.rle_weights.clone() })
        }
        None => None,
    };
    Ok(DenseParts { raw: [l_box, l_kpt, l_kobj, l_cls, l_l1], rle, device: boxes.device() })
}

/// The box CIoU and side-L1 terms of the foreground rows: on CUDA one kernel each way
/// (`ciou_fused::box_rows`), else the composed ops (which the fused kernels follow).
#[allow(clippy::too_many_arguments)]
fn box_terms(
    ltrb: &Tensor,
    anc: &Tensor,
    st: &Tensor,
    tb: &Tensor,
    valid: &Tensor,
    w: &Tensor,
    tss: &Tensor,
    consts: &DenseConstants,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    {
        let rows = super::ciou_fused::BoxRows { ltrb, anchor: anc, stride: st, target_box: tb, valid, weight: w, whwh: &consts.whwh };
        if super::ciou_fused::supports_rows(&rows) {
            let (b, l) = super::ciou_fused::box_rows(&rows)?;
            return Ok((b.sum_all()?.div(tss)?, l.sum_all()?.div(tss)?));
        }
    }
    let lt_rb = ltrb.split(&[2, 2], -1)?;
    let pred_xyxy = Tensor::cat(&[&anc.sub(&lt_rb[0])?, &anc.add(&lt_rb[1])?], -1)?;
    let unit = &consts.unit_box;
    let l_box = terms::box_loss(&valid.where_cond(&pred_xyxy, unit)?, &valid.where_cond(tb, unit)?, w, tss)?;
    let pred_l1 = ltrb.mul(st)?.div(&consts.whwh)?;
    let tb_xy = tb.split(&[2, 2], -1)?;
    let tl1 = Tensor::cat(&[&anc.sub(&tb_xy[0])?, &tb_xy[1].sub(anc)?], -1)?.mul(st)?.div(&consts.whwh)?;
    let l_l1 = terms::l1_loss(&pred_l1, &tl1, w, tss)?;
    Ok((l_box, l_l1))
}

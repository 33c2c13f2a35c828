//! One branch's six loss terms (loss.md §3) over every anchor with masks, from a dense
//! assignment ([`super::assign_dense`]): fixed shapes and no host read, where the host path
//! gathers the foreground rows by a host-built index. Rows outside the foreground (and keypoints
//! outside the visible ones) are replaced by harmless finite values before any division or
//! logarithm and weighted by zero after, so each sum adds the host path's terms in the same
//! (ascending anchor) order with exact zeros between them, and their gradients are zero as the
//! host path's are. Counts that divide (foreground anchors, visible keypoints) stay on the device.

use ptl_autograd::{DType, Tensor};

use super::assign_dense::{DenseAssignment, DeviceTargets};
use super::branch::{f32_of, gain_scaled, sigma_floor_of, BranchOutputs};
use super::terms::{self, constant};
use super::{Anchors, FlowLogProb, LossConfig};
use crate::error::{Result, TrainerError};

/// The six gain-scaled terms `[box, pose, kobj, cls, l1, rle]` as a (6,) device tensor
/// (differentiable), the fixed-shape counterpart of the host path's `loss_times_bs / bs`.
pub fn dense_branch_terms(
    cfg: &LossConfig,
    out: &BranchOutputs,
    asg: &DenseAssignment,
    targets: &DeviceTargets,
    anchors: &Anchors,
    flow: Option<&dyn FlowLogProb>,
) -> Result<Tensor> {
    let sigma_floor = sigma_floor_of(out);
    let (boxes, scores, kpts) = (f32_of(&out.boxes)?, f32_of(&out.scores)?, f32_of(&out.kpts)?);
    let device = boxes.device();
    let (bs, na, nk, nc) = (boxes.dims()[0], anchors.len(), cfg.nkpt, cfg.nc);
    let rows = bs * na;
    let (img_h, img_w) = anchors.image_hw();

    // Foreground mask (B·A, 1), its count, and T = max(Σ target scores, 1).
    let fg = asg.fg_mask.reshape(vec![rows, 1])?;
    let n_fg = fg.sum_all()?;
    let tss = asg.target_scores.sum_all()?.clamp_min(1.0)?;
    let l_cls = terms::cls_loss(&scores.permute(&[0, 2, 1])?, &asg.target_scores, &tss)?;

    // Anchors (grid units) and strides per row.
    let anc = anchors.points_tensor(device)?.unsqueeze(0)?.expand(&[bs, na, 2])?.reshape(vec![rows, 2])?;
    let st = anchors.strides_tensor(device)?.unsqueeze(0)?.expand(&[bs, na, 1])?.reshape(vec![rows, 1])?;
    let w = asg.target_scores.reshape(vec![rows, nc])?.sum_dim(-1, true)?; // (rows, 1), 0 off the foreground
    let tb = asg.target_bboxes.reshape(vec![rows, 4])?.div(&st)?; // grid units

    // Box CIoU and side L1 over every row; off the foreground both boxes become a unit box.
    let ltrb = boxes.permute(&[0, 2, 1])?.reshape(vec![rows, 4])?;
    let lt_rb = ltrb.split(&[2, 2], -1)?;
    let pred_xyxy = Tensor::cat(&[&anc.sub(&lt_rb[0])?, &anc.add(&lt_rb[1])?], -1)?;
    let unit = constant(vec![0.0, 0.0, 1.0, 1.0], &[1, 4], device)?;
    let l_box = terms::box_loss(&fg.where_cond(&pred_xyxy, &unit)?, &fg.where_cond(&tb, &unit)?, &w, &tss)?;
    let whwh = constant(vec![img_w, img_h, img_w, img_h], &[1, 4], device)?;
    let pred_l1 = ltrb.mul(&st)?.div(&whwh)?;
    let tb_xy = tb.split(&[2, 2], -1)?;
    let tl1 = Tensor::cat(&[&anc.sub(&tb_xy[0])?, &tb_xy[1].sub(&anc)?], -1)?.mul(&st)?.div(&whwh)?;
    let l_l1 = terms::l1_loss(&pred_l1, &tl1, &w, &tss)?;

    // Keypoints: each row's assigned GT keypoints (grid units), visibility mask on the foreground.
    let gk = targets.kpts.reshape(vec![bs, targets.slots, nk * 3])?;
    let gk = gk.gather(1, &asg.target_gt_idx.unsqueeze(-1)?.expand(&[bs, na, nk * 3])?)?.reshape(vec![rows, nk, 3])?;
    let s3 = st.unsqueeze(-1)?; // (rows, 1, 1)
    let gxy = gk.narrow(-1, 0, 2)?.div(&s3)?;
    let vis = gk.narrow(-1, 2, 1)?.squeeze(-1)?.ne(&Tensor::zeros(vec![1, 1], DType::F32, device)?)?.to_dtype(DType::F32)?;
    let m = vis.mul(&fg)?; // (rows, K)
    let kp = kpts.permute(&[0, 2, 1])?.reshape(vec![rows, nk, 3])?;
    let kp_xy = kp.narrow(-1, 0, 2)?.add(&anc.unsqueeze(1)?)?;
    let pxy = kp_xy.split(&[1, 1], -1)?;
    let gxy_s = gxy.split(&[1, 1], -1)?;
    let (px, py, gx, gy) = (pxy[0].squeeze(-1)?, pxy[1].squeeze(-1)?, gxy_s[0].squeeze(-1)?, gxy_s[1].squeeze(-1)?);
    let tbs = tb.split(&[1, 1, 1, 1], -1)?;
    let area = tbs[2].sub(&tbs[0])?.mul(&tbs[3].sub(&tbs[1])?)?; // (rows, 1)
    let two_s_sq: Vec<f32> = cfg.sigmas.iter().map(|&s| (2.0 * s) * (2.0 * s)).collect();
    let denom = constant(two_s_sq, &[1, nk], device)?.mul(&area.add_scalar(1e-9)?)?.mul_scalar(2.0)?;
    let nv = m.sum_dim(-1, true)?;
    let factor = Tensor::scalar(nk as f64, DType::F32, device)?.div(&nv.add_scalar(1e-9)?)?;
    // The host path's mean over N × K: Σ · (1/(N·K)) with the reciprocal rounded to f32.
    let inv_nk = n_fg.to_dtype(DType::F64)?.mul_scalar(nk as f64)?.clamp_min(1.0)?.recip()?.to_dtype(DType::F32)?;
    let d = px.sub(&gx)?.square()?.add(&py.sub(&gy)?.square()?)?;
    let lk = d.div(&denom)?.neg()?.exp()?.affine(-1.0, 1.0)?.mul(&m)?;
    let l_kpt = factor.mul(&lk)?.mul(&fg)?.sum_all()?.mul(&inv_nk)?;
    let vlog = kp.narrow(-1, 2, 1)?.squeeze(-1)?;
    let l_kobj = vlog.bce_with_logits(&m)?.mul(&fg)?.sum_all()?.mul(&inv_nk)?;

    // RLE over the visible foreground keypoints whose error is finite.
    let l_rle = match (&out.kpts_sigma, flow) {
        (Some(sigma), Some(flow)) => {
            let sg = f32_of(sigma)?.permute(&[0, 2, 1])?.reshape(vec![rows, nk, 2])?;
            let sig = sg.sigmoid()?.clamp_min(sigma_floor)?;
            let error = kp_xy.sub(&gxy)?.div(&sig.add_scalar(1e-9)?)?;
            let finite = ptl_autograd::no_grad(|| -> Result<Tensor> {
                let ok = error.detach().abs()?.le_scalar(f64::from(f32::MAX))?.to_dtype(DType::F32)?;
                Ok(ok.narrow(-1, 0, 1)?.mul(&ok.narrow(-1, 1, 1)?)?.squeeze(-1)?)
            })?;
            let keep = m.mul(&finite)?.unsqueeze(-1)?; // (rows, K, 1)
            let zeros = Tensor::zeros(vec![1, 1, 1], DType::F32, device)?;
            let ones = Tensor::ones(vec![1, 1, 1], DType::F32, device)?;
            let e = keep.where_cond(&error, &zeros)?.clamp(-100.0, 100.0)?;
            let s = keep.where_cond(&sig, &ones)?;
            let log_phi = flow.log_prob(&e.reshape(vec![rows * nk, 2])?)?;
            if log_phi.dims() != [rows * nk] {
                return Err(TrainerError::InvalidArgument {
                    what: "flow.log_prob",
                    reason: format!("returned shape {:?} for {} errors", log_phi.dims(), rows * nk),
                });
            }
            let wk = constant(cfg.rle_weights.clone(), &[1, nk, 1], device)?;
            let l = s
                .log()?
                .sub(&log_phi.reshape(vec![rows, nk, 1])?)?
                .add(&s.mul_scalar(2.0)?.log()?.add(&e.abs()?)?)?
                .mul(&wk)?
                .mul(&keep)?;
            let n_keep = keep.sum_all()?.clamp_min(1.0)?;
            l.div(&n_keep)?.sum_all()?.clamp_min(0.0)?
        }
        (Some(_), None) => {
            return Err(TrainerError::InvalidArgument {
                what: "flow",
                reason: "kpts_sigma given but no flow model for the RLE term".into(),
            })
        }
        _ => Tensor::scalar(0.0, DType::F32, device)?,
    };

    gain_scaled(cfg, [&l_box, &l_kpt, &l_kobj, &l_cls, &l_l1, &l_rle])
}

//! The six loss terms of one branch (docs/loss.md §3), as differentiable tensor expressions.
//!
//! Predictions arrive already gathered at the foreground anchors (N rows); everything that does
//! not depend on predictions (targets, anchors, strides, per-keypoint constants) is a constant
//! tensor built on the predictions' device.

use ptl_autograd::{DType, Device, Tensor};

use super::boxes::ciou;
use super::FlowLogProb;
use crate::error::{Result, TrainerError};

/// A constant f32 tensor on `device`.
pub(crate) fn constant(v: Vec<f32>, shape: &[usize], device: Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(v, shape.to_vec(), device)?)
}

/// `x · 0` summed: a zero-valued scalar that keeps `x` in the graph (its gradient is present
/// and zero, as the reference's empty-foreground terms are).
pub(crate) fn zero_connected(x: &Tensor) -> Result<Tensor> {
    Ok(x.mul_scalar(0.0)?.sum_all()?)
}

/// Classification (slot 3): Σ BCEWithLogits(logits, targets) / T.
/// `logits` (B, A, nc), `targets` (B, A, nc) constant, `t` the scalar T (0-d constant).
pub fn cls_loss(logits: &Tensor, targets: &Tensor, t: &Tensor) -> Result<Tensor> {
    Ok(logits.bce_with_logits(targets)?.sum_all()?.div(t)?)
}

/// Box CIoU (slot 0): Σ (1 − CIoU(pred, target)) · w / T; boxes (N, 4) xyxy grid units,
/// `weight` (N, 1).
pub fn box_loss(pred_xyxy: &Tensor, target_xyxy: &Tensor, weight: &Tensor, t: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    let iou = match super::ciou_fused::supports(pred_xyxy, target_xyxy) {
        true => super::ciou_fused::ciou(pred_xyxy, target_xyxy)?,
        false => ciou(pred_xyxy, target_xyxy)?,
    };
    #[cfg(not(feature = "cuda"))]
    let iou = ciou(pred_xyxy, target_xyxy)?;
    Ok(iou.affine(-1.0, 1.0)?.mul(weight)?.sum_all()?.div(t)?)
}

/// Box-side L1 (slot 4): Σ w · mean₄ |pred − target| / T, both already scaled to image-normalised
/// distances; `pred` (N, 4) differentiable, `target` (N, 4) constant, `weight` (N, 1).
pub fn l1_loss(pred: &Tensor, target: &Tensor, weight: &Tensor, t: &Tensor) -> Result<Tensor> {
    Ok(pred.sub(target)?.abs()?.mean_dim(-1, true)?.mul(weight)?.sum_all()?.div(t)?)
}

/// Keypoint location (slot 1): mean over N×K of factor · (1 − exp(−d / denom)) · mask.
/// `px`, `py` (N, K) predictions; `gx`, `gy`, `mask`, `denom` (N, K) and `factor` (N, 1) constants.
pub fn keypoint_loss(px: &Tensor, py: &Tensor, gx: &Tensor, gy: &Tensor, mask: &Tensor, denom: &Tensor, factor: &Tensor) -> Result<Tensor> {
    let d = px.sub(gx)?.square()?.add(&py.sub(gy)?.square()?)?;
    let e = d.div(denom)?;
    let l = e.neg()?.exp()?.affine(-1.0, 1.0)?.mul(mask)?;
    Ok(factor.mul(&l)?.mean_all()?)
}

/// Keypoint visibility (slot 2): mean BCEWithLogits(v_logit, mask) over N×K.
pub fn kobj_loss(v_logit: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(v_logit.bce_with_logits(mask)?.mean_all()?)
}

/// RLE (slot 5) over the visible foreground keypoints (docs/loss.md §3.6).
/// `pred` (V, 2) decoded keypoints, `sigma_logit` (V, 2), `gt` (V, 2) and `weight` (V,) constants;
/// σ = sigmoid(logit) is clamped below at `sigma_floor` (the smallest positive normal number of
/// the logits' dtype: 6.1e-5 for f16, 1.18e-38 for f32/bf16).
/// Returns `None` when no keypoint survives the finiteness filter (the caller keeps a connected
/// zero then).
pub fn rle_loss(
    pred: &Tensor,
    sigma_logit: &Tensor,
    gt: &Tensor,
    weight: &[f32],
    sigma_floor: f64,
    flow: &dyn FlowLogProb,
) -> Result<Option<Tensor>> {
    let device = pred.device();
    let sigma = sigma_logit.sigmoid()?.clamp_min(sigma_floor)?;
    let error = pred.sub(gt)?.div(&sigma.add_scalar(1e-9)?)?;
    // Drop keypoints whose error is not finite (a host read of a small (V, 2) tensor).
    let ev = error.detach().to_vec::<f32>()?;
    let keep: Vec<i64> = (0..ev.len() / 2).filter(|&i| ev[2 * i].is_finite() && ev[2 * i + 1].is_finite()).map(|i| i as i64).collect();
    if keep.is_empty() {
        return Ok(None);
    }
    let (error, sigma, weight) = if keep.len() == ev.len() / 2 {
        (error, sigma, weight.to_vec())
    } else {
        let w: Vec<f32> = keep.iter().map(|&i| weight[i as usize]).collect();
        let n = keep.len();
        let idx = Tensor::from_vec(keep, n, device)?;
        (error.index_select(0, &idx)?, sigma.index_select(0, &idx)?, w)
    };
    let n = weight.len();
    let error = error.clamp(-100.0, 100.0)?;
    let log_phi = flow.log_prob(&error)?;
    if log_phi.dims() != [n] {
        return Err(TrainerError::InvalidArgument {
            what: "flow.log_prob",
            reason: format!("returned shape {:?} for {n} errors", log_phi.dims()),
        });
    }
    let w = constant(weight, &[n, 1], device)?;
    let l = sigma.log()?.sub(&log_phi.unsqueeze(1)?)?.add(&sigma.mul_scalar(2.0)?.log()?.add(&error.abs()?)?)?.mul(&w)?;
    let l = l.div(&Tensor::scalar(n as f64, DType::F32, device)?)?.sum_all()?;
    Ok(Some(l.clamp_min(0.0)?))
}

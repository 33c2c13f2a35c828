//! Box geometry: CIoU (docs/loss.md §3.2) on host f32 values (for the assigner) and as a
//! differentiable tensor op (for the box loss).

use ptl_autograd::{no_grad, Tensor};

use crate::error::Result;

/// eps of `bbox_iou`.
pub const CIOU_EPS: f32 = 1e-7;

/// CIoU of two xyxy boxes in float32 with the reference's operation order
/// (`bbox_iou(box1, box2, xywh=False, CIoU=True)`).
pub fn ciou_f32(b1: [f32; 4], b2: [f32; 4]) -> f32 {
    let eps = CIOU_EPS;
    let (b1x1, b1y1, b1x2, b1y2) = (b1[0], b1[1], b1[2], b1[3]);
    let (b2x1, b2y1, b2x2, b2y2) = (b2[0], b2[1], b2[2], b2[3]);
    let (w1, h1) = (b1x2 - b1x1, b1y2 - b1y1 + eps);
    let (w2, h2) = (b2x2 - b2x1, b2y2 - b2y1 + eps);
    let iw = (b1x2.min(b2x2) - b1x1.max(b2x1)).max(0.0);
    let ih = (b1y2.min(b2y2) - b1y1.max(b2y1)).max(0.0);
    let inter = iw * ih;
    let union = w1 * h1 + w2 * h2 - inter + eps;
    let iou = inter / union;
    let cw = b1x2.max(b2x2) - b1x1.min(b2x1);
    let ch = b1y2.max(b2y2) - b1y1.min(b2y1);
    let c2 = cw * cw + ch * ch + eps;
    let dx = b2x1 + b2x2 - b1x1 - b1x2;
    let dy = b2y1 + b2y2 - b1y1 - b1y2;
    let rho2 = (dx * dx + dy * dy) / 4.0;
    let four_over_pi2 = (4.0 / (std::f64::consts::PI * std::f64::consts::PI)) as f32;
    let da = (w2 / h2).atan() - (w1 / h1).atan();
    let v = four_over_pi2 * (da * da);
    let alpha = v / (v - iou + (1.0 + eps));
    iou - (rho2 / c2 + v * alpha)
}

/// Differentiable CIoU of (N, 4) xyxy boxes `b1` (predictions) and `b2` (targets) → (N, 1).
/// The aspect-ratio weight α is computed without gradient, as in the reference.
pub fn ciou(b1: &Tensor, b2: &Tensor) -> Result<Tensor> {
    let eps = f64::from(CIOU_EPS);
    let c1 = b1.split(&[1, 1, 1, 1], -1)?;
    let c2 = b2.split(&[1, 1, 1, 1], -1)?;
    let (b1x1, b1y1, b1x2, b1y2) = (&c1[0], &c1[1], &c1[2], &c1[3]);
    let (b2x1, b2y1, b2x2, b2y2) = (&c2[0], &c2[1], &c2[2], &c2[3]);
    let w1 = b1x2.sub(b1x1)?;
    let h1 = b1y2.sub(b1y1)?.add_scalar(eps)?;
    let w2 = b2x2.sub(b2x1)?;
    let h2 = b2y2.sub(b2y1)?.add_scalar(eps)?;
    let iw = b1x2.minimum(b2x2)?.sub(&b1x1.maximum(b2x1)?)?.clamp_min(0.0)?;
    let ih = b1y2.minimum(b2y2)?.sub(&b1y1.maximum(b2y1)?)?.clamp_min(0.0)?;
    let inter = iw.mul(&ih)?;
    let union = w1.mul(&h1)?.add(&w2.mul(&h2)?)?.sub(&inter)?.add_scalar(eps)?;
    let iou = inter.div(&union)?;
    let cw = b1x2.maximum(b2x2)?.sub(&b1x1.minimum(b2x1)?)?;
    let ch = b1y2.maximum(b2y2)?.sub(&b1y1.minimum(b2y1)?)?;
    let cc = cw.square()?.add(&ch.square()?)?.add_scalar(eps)?;
    let dx = b2x1.add(b2x2)?.sub(b1x1)?.sub(b1x2)?;
    let dy = b2y1.add(b2y2)?.sub(b1y1)?.sub(b1y2)?;
    let rho2 = dx.square()?.add(&dy.square()?)?.div(&dx.scalar_like(4.0)?)?;
    let four_over_pi2 = 4.0 / (std::f64::consts::PI * std::f64::consts::PI);
    let v = w2.div(&h2)?.atan()?.sub(&w1.div(&h1)?.atan()?)?.square()?.mul_scalar(four_over_pi2)?;
    let alpha = no_grad(|| -> Result<Tensor> {
        let v = v.detach();
        let denom = v.sub(&iou.detach())?.add_scalar(1.0 + eps)?;
        Ok(v.div(&denom)?)
    })?;
    Ok(iou.sub(&rho2.div(&cc)?.add(&v.mul(&alpha)?)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ciou_worked_example() {
        // docs/loss.md §3.2: GT (0,0,10,10), prediction (2,2,14,10) → CIoU 0.450595.
        let c = ciou_f32([2.0, 2.0, 14.0, 10.0], [0.0, 0.0, 10.0, 10.0]);
        assert!((c - 0.450595).abs() < 2e-6, "{c}");
        let p = Tensor::from_vec(vec![2f32, 2.0, 14.0, 10.0], (1, 4), ptl_autograd::Device::Cpu).unwrap();
        let t = Tensor::from_vec(vec![0f32, 0.0, 10.0, 10.0], (1, 4), ptl_autograd::Device::Cpu).unwrap();
        let c2 = ciou(&p, &t).unwrap().item().unwrap();
        assert!((c2 - 0.450595).abs() < 2e-6, "{c2}");
    }
}

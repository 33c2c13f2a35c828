//! Anchors and decoding (docs/model.md §5): `make_anchors`, ltrb → boxes, keypoint decode, and the
//! default eval output `(B, 4 + nc + nk, A)`.

use ptl_autograd::{DType, Device, Tensor};

use crate::{HeadsError, Result};

/// Anchor centres `(x + offset, y + offset)` in grid units for every level (y outer, x inner),
/// levels concatenated in order, and the per-anchor stride.
///
/// `sizes`: `(H_i, W_i)` per level; returns `(anchors (A, 2), strides (A, 1))`.
pub fn make_anchors(sizes: &[(usize, usize)], strides: &[f64], offset: f64, dtype: DType, device: Device) -> Result<(Tensor, Tensor)> {
    if sizes.len() != strides.len() {
        return Err(HeadsError::input("make_anchors", format!("{} feature sizes but {} strides", sizes.len(), strides.len())));
    }
    let total: usize = sizes.iter().map(|(h, w)| h * w).sum();
    let mut a = Vec::with_capacity(total * 2);
    let mut s = Vec::with_capacity(total);
    for (&(h, w), &st) in sizes.iter().zip(strides) {
        for y in 0..h {
            for x in 0..w {
                a.push(x as f64 + offset);
                a.push(y as f64 + offset);
                s.push(st);
            }
        }
    }
    Ok((Tensor::from_f64(&a, vec![total, 2], dtype, device)?, Tensor::from_f64(&s, vec![total, 1], dtype, device)?))
}

fn check_anchor_args(op: &'static str, x: &Tensor, anchors: &Tensor, strides: &Tensor) -> Result<usize> {
    let a = *x.dims().last().unwrap_or(&0);
    if x.rank() != 3 || anchors.dims() != [a, 2] || strides.dims() != [a, 1] {
        return Err(HeadsError::input(
            op,
            format!(
                "expected (B, C, A) with anchors (A, 2) and strides (A, 1), got {:?}, {:?}, {:?}",
                x.dims(),
                anchors.dims(),
                strides.dims()
            ),
        ));
    }
    Ok(a)
}

/// ltrb distances `(B, 4, A)` (grid units) → boxes in **pixels**: `(cx, cy, w, h)` when `xywh`,
/// else `(x1, y1, x2, y2)`.
pub fn decode_boxes(boxes: &Tensor, anchors: &Tensor, strides: &Tensor, xywh: bool) -> Result<Tensor> {
    let a = check_anchor_args("decode_boxes", boxes, anchors, strides)?;
    if boxes.dims()[1] != 4 {
        return Err(HeadsError::input("decode_boxes", format!("expected 4 box channels, got {:?}", boxes.dims())));
    }
    let anc = anchors.to_dtype(boxes.dtype())?.transpose(0, 1)?.reshape(vec![1, 2, a])?;
    let st = strides.to_dtype(boxes.dtype())?.reshape(vec![1, 1, a])?;
    let lt = boxes.narrow(1, 0, 2)?;
    let rb = boxes.narrow(1, 2, 2)?;
    let x1y1 = anc.sub(&lt)?;
    let x2y2 = anc.add(&rb)?;
    let b = if xywh {
        let c = x1y1.add(&x2y2)?.div_scalar(2.0)?;
        let wh = x2y2.sub(&x1y1)?;
        Tensor::cat(&[&c, &wh], 1)?
    } else {
        Tensor::cat(&[&x1y1, &x2y2], 1)?
    };
    Ok(b.mul(&st)?)
}

/// Raw keypoints `(B, K·D, A)` → pixels: `x = (raw_x + a_x)·s`, `y = (raw_y + a_y)·s`, and for
/// D = 3 `v = sigmoid(raw_v)` (YOLO26: no ×2, no −0.5).
pub fn decode_kpts(kpts: &Tensor, anchors: &Tensor, strides: &Tensor, kpt_shape: (usize, usize)) -> Result<Tensor> {
    let a = check_anchor_args("decode_kpts", kpts, anchors, strides)?;
    let (k, d) = kpt_shape;
    let b = kpts.dims()[0];
    if kpts.dims()[1] != k * d || !(d == 2 || d == 3) {
        return Err(HeadsError::input("decode_kpts", format!("kpt_shape {kpt_shape:?} does not fit {:?}", kpts.dims())));
    }
    let y = kpts.reshape(vec![b, k, d, a])?;
    let anc = anchors.to_dtype(kpts.dtype())?.transpose(0, 1)?.reshape(vec![1, 1, 2, a])?;
    let st = strides.to_dtype(kpts.dtype())?.reshape(vec![1, 1, 1, a])?;
    let xy = y.narrow(2, 0, 2)?.add(&anc)?.mul(&st)?;
    let out = if d == 3 {
        let v = y.narrow(2, 2, 1)?.sigmoid()?;
        Tensor::cat(&[&xy, &v], 2)?
    } else {
        xy
    };
    Ok(out.reshape(vec![b, k * d, a])?)
}

/// Training-time box decode (§5.2): ltrb `(B, 4, A)` → `(x1, y1, x2, y2)` in **grid units**
/// (`a − lt`, `a + rb`), no stride.
pub fn decode_boxes_grid(boxes: &Tensor, anchors: &Tensor) -> Result<Tensor> {
    let a = anchors.dims().first().copied().unwrap_or(0);
    if boxes.rank() != 3 || boxes.dims()[1] != 4 || boxes.dims()[2] != a || anchors.dims() != [a, 2] {
        return Err(HeadsError::input("decode_boxes_grid", format!("boxes {:?} with anchors {:?}", boxes.dims(), anchors.dims())));
    }
    let anc = anchors.to_dtype(boxes.dtype())?.transpose(0, 1)?.reshape(vec![1, 2, a])?;
    let x1y1 = anc.sub(&boxes.narrow(1, 0, 2)?)?;
    let x2y2 = anc.add(&boxes.narrow(1, 2, 2)?)?;
    Ok(Tensor::cat(&[&x1y1, &x2y2], 1)?)
}

/// Training-time keypoint decode (§5.2): `x = raw_x + a_x`, `y = raw_y + a_y` in **grid units**;
/// the visibility channel stays a logit. `(B, K·D, A)` → same shape.
pub fn decode_kpts_grid(kpts: &Tensor, anchors: &Tensor, kpt_shape: (usize, usize)) -> Result<Tensor> {
    let a = anchors.dims().first().copied().unwrap_or(0);
    let (k, d) = kpt_shape;
    if kpts.rank() != 3 || kpts.dims()[1] != k * d || kpts.dims()[2] != a || anchors.dims() != [a, 2] || d < 2 {
        return Err(HeadsError::input(
            "decode_kpts_grid",
            format!("kpts {:?}, anchors {:?}, kpt_shape {kpt_shape:?}", kpts.dims(), anchors.dims()),
        ));
    }
    let b = kpts.dims()[0];
    let y = kpts.reshape(vec![b, k, d, a])?;
    let anc = anchors.to_dtype(kpts.dtype())?.transpose(0, 1)?.reshape(vec![1, 1, 2, a])?;
    let xy = y.narrow(2, 0, 2)?.add(&anc)?;
    let out = if d > 2 { Tensor::cat(&[&xy, &y.narrow(2, 2, d - 2)?], 2)? } else { xy };
    Ok(out.reshape(vec![b, k * d, a])?)
}

/// The default inference output `(B, 4 + nc + K·D, A)`: boxes (cx, cy, w, h) px when `xywh`
/// (else x1, y1, x2, y2), sigmoid scores, decoded keypoints.
pub fn decode_predictions(
    boxes: &Tensor,
    scores: &Tensor,
    kpts: &Tensor,
    anchors: &Tensor,
    strides: &Tensor,
    kpt_shape: (usize, usize),
    xywh: bool,
) -> Result<Tensor> {
    let b = decode_boxes(boxes, anchors, strides, xywh)?;
    let s = scores.sigmoid()?;
    let k = decode_kpts(kpts, anchors, strides, kpt_shape)?;
    Ok(Tensor::cat(&[&b, &s, &k], 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_order_and_offset() {
        let (a, s) = make_anchors(&[(2, 3), (1, 1)], &[8.0, 16.0], 0.5, DType::F32, Device::Cpu).expect("anchors");
        assert_eq!(a.dims(), &[7, 2]);
        let v = a.to_vec::<f32>().expect("v");
        assert_eq!(&v[..6], &[0.5, 0.5, 1.5, 0.5, 2.5, 0.5]);
        assert_eq!(&v[6..8], &[0.5, 1.5]);
        assert_eq!(s.to_vec::<f32>().expect("s"), vec![8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 16.0]);
    }

    #[test]
    fn training_decode_in_grid_units() {
        let (a, _) = make_anchors(&[(1, 2)], &[8.0], 0.5, DType::F32, Device::Cpu).expect("anchors");
        let ltrb = Tensor::from_vec(vec![1.0f32, 0.0, 2.0, 0.0, 3.0, 0.0, 4.0, 0.0], vec![1, 4, 2], Device::Cpu).expect("t");
        let b = decode_boxes_grid(&ltrb, &a).expect("d").to_vec::<f32>().expect("v");
        assert_eq!(b, vec![-0.5, 1.5, -1.5, 0.5, 3.5, 1.5, 4.5, 0.5]);
        let k = Tensor::from_vec(vec![0.25f32, 1.0, -0.5, 2.0, 3.0, 7.0], vec![1, 3, 2], Device::Cpu).expect("k");
        let d = decode_kpts_grid(&k, &a, (1, 3)).expect("d").to_vec::<f32>().expect("v");
        assert_eq!(d, vec![0.75, 2.5, 0.0, 2.5, 3.0, 7.0]);
    }

    #[test]
    fn box_decode_xywh_and_xyxy() {
        let (a, s) = make_anchors(&[(1, 1)], &[8.0], 0.5, DType::F32, Device::Cpu).expect("anchors");
        let ltrb = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], vec![1, 4, 1], Device::Cpu).expect("t");
        let xyxy = decode_boxes(&ltrb, &a, &s, false).expect("d").to_vec::<f32>().expect("v");
        assert_eq!(xyxy, vec![-4.0, -12.0, 28.0, 36.0]);
        let xywh = decode_boxes(&ltrb, &a, &s, true).expect("d").to_vec::<f32>().expect("v");
        assert_eq!(xywh, vec![12.0, 12.0, 32.0, 48.0]);
    }
}

//! End-to-end post-processing of the o2o branch (docs/model.md §5.3, docs/metrics.md §1.2): decode, top-k
//! over anchors, top-k over (anchor, class) pairs, then a confidence filter — no IoU suppression.
//!
//! Ties between equal scores are broken by the lower index (stable sorts); torch's `topk`
//! leaves this implementation-defined.

use super::types::Detections;
use crate::error::{check_finite, check_len, Result};

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Decode raw o2o head outputs into `(batch, A, 4 + nc + 3·nk)` rows
/// `[x1, y1, x2, y2, nc sigmoid scores, nk × (x, y, sigmoid v)]` in input pixels.
///
/// `boxes`: (B, 4, A) ltrb distances in grid units; `scores`: (B, nc, A) logits;
/// `kpts`: (B, 3·nk, A) raw (x, y offsets in grid units, visibility logit);
/// `anchors`: (A, 2) centres in grid units; `strides`: (A,).
#[allow(clippy::too_many_arguments)]
pub fn decode_o2o(
    boxes: &[f32],
    scores: &[f32],
    kpts: &[f32],
    anchors: &[f32],
    strides: &[f32],
    batch: usize,
    nc: usize,
    nk: usize,
) -> Result<Vec<f32>> {
    let a = strides.len();
    check_len("o2o boxes", boxes, &[batch, 4, a])?;
    check_len("o2o scores", scores, &[batch, nc, a])?;
    check_len("o2o kpts", kpts, &[batch, 3 * nk, a])?;
    check_len("anchors", anchors, &[a, 2])?;
    for (what, v) in [("o2o boxes", boxes), ("o2o scores", scores), ("o2o kpts", kpts), ("anchors", anchors), ("strides", strides)] {
        check_finite(what, v)?;
    }
    let width = 4 + nc + 3 * nk;
    let mut out = Vec::with_capacity(batch * a * width);
    for b in 0..batch {
        let bx = &boxes[b * 4 * a..(b + 1) * 4 * a];
        let sc = &scores[b * nc * a..(b + 1) * nc * a];
        let kp = &kpts[b * 3 * nk * a..(b + 1) * 3 * nk * a];
        for i in 0..a {
            let (ax, ay, s) = (anchors[2 * i], anchors[2 * i + 1], strides[i]);
            out.extend_from_slice(&[(ax - bx[i]) * s, (ay - bx[a + i]) * s, (ax + bx[2 * a + i]) * s, (ay + bx[3 * a + i]) * s]);
            out.extend((0..nc).map(|c| sigmoid(sc[c * a + i])));
            for k in 0..nk {
                out.push((kp[3 * k * a + i] + ax) * s);
                out.push((kp[(3 * k + 1) * a + i] + ay) * s);
                out.push(sigmoid(kp[(3 * k + 2) * a + i]));
            }
        }
    }
    Ok(out)
}

/// Indices of the `k` largest values, descending, lower index first on ties.
fn topk_desc(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    idx.truncate(k);
    idx
}

/// Top-k selection (`get_topk_index`, non-agnostic): `decoded` (B, A, 4 + nc + 3·nk) →
/// (B, k, 6 + 3·nk) rows `[x1, y1, x2, y2, score, class, kpts…]` sorted by score, k = min(max_det, A).
pub fn topk(decoded: &[f32], batch: usize, nc: usize, nk: usize, max_det: usize) -> Result<Vec<f32>> {
    let width = 4 + nc + 3 * nk;
    if batch == 0 || width == 0 {
        return Ok(Vec::new());
    }
    if decoded.len() % (batch * width) != 0 {
        return Err(crate::error::TrainerError::shape("decoded o2o", &[batch, decoded.len() / (batch * width), width], decoded.len()));
    }
    let a = decoded.len() / (batch * width);
    check_finite("decoded o2o", decoded)?;
    let k = max_det.min(a);
    let ow = 6 + 3 * nk;
    let mut out = Vec::with_capacity(batch * k * ow);
    for img in decoded.chunks_exact(a * width) {
        let row = |i: usize| &img[i * width..(i + 1) * width];
        let max_score: Vec<f32> = (0..a).map(|i| row(i)[4..4 + nc].iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
        let ori = topk_desc(&max_score, k);
        let flat: Vec<f32> = ori.iter().flat_map(|&i| row(i)[4..4 + nc].to_vec()).collect();
        for f in topk_desc(&flat, k) {
            let r = row(ori[f / nc]);
            out.extend_from_slice(&r[..4]);
            out.push(flat[f]);
            out.push((f % nc) as f32);
            out.extend_from_slice(&r[4 + nc..]);
        }
    }
    Ok(out)
}

/// Caller-side filter of the e2e output of one image: rows with score > `conf_thres`, at most
/// `max_det` of them, in the given (score) order. `rows`: (k, 6 + 3·nk).
pub fn postprocess(rows: &[f32], nk: usize, conf_thres: f32, max_det: usize) -> Result<Detections> {
    let width = 6 + 3 * nk;
    if rows.len() % width != 0 {
        return Err(crate::error::TrainerError::shape("e2e rows", &[rows.len() / width + 1, width], rows.len()));
    }
    check_finite("e2e rows", rows)?;
    let mut d = Detections::empty(nk);
    for r in rows.chunks_exact(width).filter(|r| r[4] > conf_thres).take(max_det) {
        d.push_row(r)?;
    }
    Ok(d)
}

//! Keypoint OKS as Ultralytics' `kpt_iou` computes it (docs/metrics.md §3.2).

use crate::error::{Result, TrainerError};

/// COCO keypoint sigmas ×10, as written in Ultralytics' `OKS_SIGMA` before the `/ 10.0`.
const COCO_SIGMAS_X10: [f64; 17] = [0.26, 0.25, 0.25, 0.35, 0.35, 0.79, 0.79, 0.72, 0.72, 0.62, 0.62, 1.07, 1.07, 0.87, 0.87, 0.89, 0.89];

/// COCO sigmas as float32, computed like the reference (float64 `/ 10.0`, then cast).
pub fn coco_sigmas() -> Vec<f32> {
    COCO_SIGMAS_X10.iter().map(|s| (s / 10.0) as f32).collect()
}

/// Sigmas the validator uses: COCO for 17 keypoints, otherwise `1/nk` each.
pub fn default_sigmas(nk: usize) -> Vec<f32> {
    if nk == 17 {
        coco_sigmas()
    } else {
        vec![1.0 / nk as f32; nk]
    }
}

/// OKS matrix `(m GT, n pred)`.
///
/// `gt`: (m, nk, 3) with visibility in channel 2 (non-zero = labelled); `pred`: (n, nk, 3)
/// (predicted visibility ignored); `areas`: (m,) area proxy (box area × 0.53). A GT without
/// labelled keypoints gets OKS 0 with everything (0 / (0 + eps)).
pub fn kpt_oks(gt: &[f32], pred: &[f32], areas: &[f32], sigmas: &[f32]) -> Result<Vec<f32>> {
    let nk = sigmas.len();
    if nk == 0 {
        return Err(TrainerError::InvalidArgument { what: "sigmas", reason: "no keypoints".into() });
    }
    let m = areas.len();
    crate::error::check_len("gt keypoints", gt, &[m, nk, 3])?;
    if pred.len() % (nk * 3) != 0 {
        return Err(TrainerError::shape("pred keypoints", &[pred.len() / (nk * 3) + 1, nk, 3], pred.len()));
    }
    let n = pred.len() / (nk * 3);
    // (2σ)² in float32, like `(2 * sigma).pow(2)` on a float32 tensor.
    let var: Vec<f32> = sigmas.iter().map(|s| (2.0 * s) * (2.0 * s)).collect();
    let mut out = Vec::with_capacity(m * n);
    for (g, kg) in gt.chunks_exact(nk * 3).enumerate() {
        let area = areas[g] + 1e-7f32;
        let visible = kg.chunks_exact(3).filter(|k| k[2] != 0.0).count();
        let denom_count = visible as f32 + 1e-7f32;
        for kp in pred.chunks_exact(nk * 3) {
            let mut sum = 0f32;
            for k in 0..nk {
                if kg[3 * k + 2] == 0.0 {
                    continue;
                }
                let dx = kg[3 * k] - kp[3 * k];
                let dy = kg[3 * k + 1] - kp[3 * k + 1];
                let d = dx * dx + dy * dy;
                let e = d / (var[k] * area * 2.0);
                sum += (-e).exp();
            }
            out.push(sum / denom_count);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/metrics.md §3.2 worked example: OKS = 0.924154.
    #[test]
    fn worked_example() {
        let sig = coco_sigmas();
        let mut gt = vec![0f32; 51];
        let mut pr = vec![0f32; 51];
        for (k, (g, p)) in [(0usize, ((50., 20.), (52., 21.))), (5, ((30., 60.), (35., 60.))), (11, ((40., 120.), (40., 130.)))] {
            gt[3 * k] = g.0;
            gt[3 * k + 1] = g.1;
            gt[3 * k + 2] = 2.0;
            pr[3 * k] = p.0;
            pr[3 * k + 1] = p.1;
        }
        let area = 100.0f32 * 200.0 * 0.53;
        let o = kpt_oks(&gt, &pr, &[area], &sig).unwrap();
        assert!((o[0] - 0.924154).abs() < 2e-6, "{}", o[0]);
    }

    #[test]
    fn invisible_gt_is_zero() {
        let sig = coco_sigmas();
        let gt = vec![0f32; 51];
        let o = kpt_oks(&gt, &gt, &[100.0], &sig).unwrap();
        assert_eq!(o, vec![0.0]);
    }
}

//! AP / P / R / F1 per class as Ultralytics' `ap_per_class` + `compute_ap` (docs/metrics.md §5).
//!
//! Everything runs in float64 like the numpy reference; helpers reproduce `np.linspace`,
//! `np.interp` (right-most duplicate rule) and `np.trapezoid` so that results agree to ~1e-15.

use super::NUM_THRESHOLDS;
use crate::error::{check_finite, check_len, Result};

/// `np.linspace(0, 1, num)`: `i · (1/(num−1))`, last point exactly 1.
pub(crate) fn linspace01(num: usize) -> Vec<f64> {
    let step = 1.0 / (num as f64 - 1.0);
    let mut v: Vec<f64> = (0..num).map(|i| i as f64 * step).collect();
    if let Some(last) = v.last_mut() {
        *last = 1.0;
    }
    v
}

/// `np.interp(x, xp, fp, left, right)` for non-decreasing `xp`.
///
/// Like numpy, the segment is chosen by the right-most `xp[j] <= x`, so among equal `xp`
/// the last value wins, and an exact hit returns `fp[j]` without interpolation.
pub(crate) fn interp(x: f64, xp: &[f64], fp: &[f64], left: f64, right: f64) -> f64 {
    let n = xp.len();
    if n == 0 {
        return f64::NAN;
    }
    if x > xp[n - 1] {
        return right;
    }
    if x < xp[0] {
        return left;
    }
    // Largest j with xp[j] <= x.
    let j = xp.partition_point(|&v| v <= x) - 1;
    if j == n - 1 || xp[j] == x {
        return fp[j];
    }
    let slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j]);
    slope * (x - xp[j]) + fp[j]
}

/// `np.trapezoid(y, x)`.
fn trapezoid(y: &[f64], x: &[f64]) -> f64 {
    (1..y.len()).map(|i| (x[i] - x[i - 1]) * (y[i] + y[i - 1]) / 2.0).sum()
}

/// AP of one PR curve: sentinels `(0, 1)` first and `(r_last, 0), (1, 0)` last, precision
/// envelope, 101-point sampling, trapezoid integration. Returns `(ap, mpre, mrec)`.
pub fn compute_ap(recall: &[f64], precision: &[f64]) -> (f64, Vec<f64>, Vec<f64>) {
    let last = recall.last().copied().unwrap_or(1.0);
    let mut mrec = Vec::with_capacity(recall.len() + 3);
    mrec.push(0.0);
    mrec.extend_from_slice(recall);
    mrec.extend_from_slice(&[last, 1.0]);
    let mut mpre = Vec::with_capacity(precision.len() + 3);
    mpre.push(1.0);
    mpre.extend_from_slice(precision);
    mpre.extend_from_slice(&[0.0, 0.0]);
    for i in (0..mpre.len() - 1).rev() {
        mpre[i] = mpre[i].max(mpre[i + 1]);
    }
    let x = linspace01(101);
    let y: Vec<f64> = x.iter().map(|&r| interp(r, &mrec, &mpre, mpre[0], mpre[mpre.len() - 1])).collect();
    (trapezoid(&y, &x), mpre, mrec)
}

/// Centred box filter with edge padding (`smooth(y, f)` of the reference, `nf = round(2·f·n)//2 + 1`).
pub(crate) fn smooth(y: &[f64], f: f64) -> Vec<f64> {
    if y.is_empty() {
        return Vec::new();
    }
    let nf = ((y.len() as f64 * f * 2.0).round_ties_even() as usize) / 2 + 1;
    let pad = nf / 2;
    let mut yp = Vec::with_capacity(y.len() + 2 * pad);
    yp.extend(std::iter::repeat_n(y[0], pad));
    yp.extend_from_slice(y);
    yp.extend(std::iter::repeat_n(y[y.len() - 1], pad));
    let w = 1.0 / nf as f64;
    yp.windows(nf).map(|win| win.iter().map(|v| v * w).sum()).collect()
}

/// Output of [`ap_per_class`], indexed by the classes present in the targets (sorted).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ApPerClass {
    /// Class ids that have at least one target (sorted ascending).
    pub classes: Vec<usize>,
    /// Target count per class.
    pub n_targets: Vec<usize>,
    /// Precision at the max-F1 confidence, per class.
    pub p: Vec<f64>,
    /// Recall at the max-F1 confidence, per class.
    pub r: Vec<f64>,
    /// F1 at the max-F1 confidence, per class.
    pub f1: Vec<f64>,
    /// AP per class and threshold.
    pub ap: Vec<[f64; NUM_THRESHOLDS]>,
    /// Confidence grid (1000 points in [0, 1]).
    pub x: Vec<f64>,
    /// Precision vs confidence, per class (1000 each).
    pub p_curve: Vec<Vec<f64>>,
    /// Recall vs confidence, per class.
    pub r_curve: Vec<Vec<f64>>,
    /// F1 vs confidence, per class.
    pub f1_curve: Vec<Vec<f64>>,
    /// Envelope precision sampled on the recall grid at IoU 0.5, per class with predictions.
    pub prec_values: Vec<Vec<f64>>,
    /// Index into `classes` of each `prec_values` curve (the PR plot labels curves by it).
    pub prec_classes: Vec<usize>,
    /// Index into `x` of the max smoothed mean F1.
    pub best_index: usize,
}

/// Per-class AP, P, R, F1 over a whole validation set.
///
/// `tp`: (n, 10) matches, `conf`: (n,) float32 confidences (promoted to f64 like numpy does),
/// `pred_cls`: (n,), `target_cls`: one entry per GT. Sorting by confidence is stable (ties keep
/// input order). Classes without targets are ignored, classes without predictions get zeros.
pub fn ap_per_class(tp: &[[bool; NUM_THRESHOLDS]], conf: &[f32], pred_cls: &[usize], target_cls: &[usize]) -> Result<ApPerClass> {
    const EPS: f64 = 1e-16;
    check_len("tp", tp, &[conf.len()])?;
    check_len("pred_cls", pred_cls, &[conf.len()])?;
    check_finite("conf", conf)?;
    let mut order: Vec<usize> = (0..conf.len()).collect();
    order.sort_by(|&a, &b| conf[b].total_cmp(&conf[a]));

    let mut classes: Vec<usize> = target_cls.to_vec();
    classes.sort_unstable();
    classes.dedup();
    let n_targets: Vec<usize> = classes.iter().map(|c| target_cls.iter().filter(|t| *t == c).count()).collect();
    let nc = classes.len();
    let x = linspace01(1000);
    let neg_x: Vec<f64> = x.iter().map(|v| -v).collect();

    let mut out = ApPerClass {
        classes: classes.clone(),
        n_targets: n_targets.clone(),
        ap: vec![[0.0; NUM_THRESHOLDS]; nc],
        p_curve: vec![vec![0.0; 1000]; nc],
        r_curve: vec![vec![0.0; 1000]; nc],
        ..Default::default()
    };
    for (ci, &c) in classes.iter().enumerate() {
        let idx: Vec<usize> = order.iter().copied().filter(|&i| pred_cls[i] == c).collect();
        let n_l = n_targets[ci];
        if idx.is_empty() || n_l == 0 {
            continue;
        }
        let neg_conf: Vec<f64> = idx.iter().map(|&i| -f64::from(conf[i])).collect();
        let mut recall = vec![vec![0.0; idx.len()]; NUM_THRESHOLDS];
        let mut precision = vec![vec![0.0; idx.len()]; NUM_THRESHOLDS];
        for t in 0..NUM_THRESHOLDS {
            let (mut tpc, mut fpc) = (0u64, 0u64);
            for (k, &i) in idx.iter().enumerate() {
                if tp[i][t] {
                    tpc += 1;
                } else {
                    fpc += 1;
                }
                recall[t][k] = tpc as f64 / (n_l as f64 + EPS);
                precision[t][k] = tpc as f64 / (tpc + fpc) as f64;
            }
        }
        let last_r = recall[0][idx.len() - 1];
        let last_p = precision[0][idx.len() - 1];
        for (k, &nx) in neg_x.iter().enumerate() {
            out.r_curve[ci][k] = interp(nx, &neg_conf, &recall[0], 0.0, last_r);
            out.p_curve[ci][k] = interp(nx, &neg_conf, &precision[0], 1.0, last_p);
        }
        for t in 0..NUM_THRESHOLDS {
            let (ap, mpre, mrec) = compute_ap(&recall[t], &precision[t]);
            out.ap[ci][t] = ap;
            if t == 0 {
                let (l, r) = (mpre[0], mpre[mpre.len() - 1]);
                out.prec_values.push(x.iter().map(|&v| interp(v, &mrec, &mpre, l, r)).collect());
                out.prec_classes.push(ci);
            }
        }
    }
    out.f1_curve =
        out.p_curve.iter().zip(&out.r_curve).map(|(p, r)| p.iter().zip(r).map(|(p, r)| 2.0 * p * r / (p + r + EPS)).collect()).collect();
    if nc > 0 {
        let mean: Vec<f64> = (0..1000).map(|k| out.f1_curve.iter().map(|c| c[k]).sum::<f64>() / nc as f64).collect();
        let sm = smooth(&mean, 0.1);
        // argmax: first maximum, like numpy.
        let mut best = 0;
        for (i, v) in sm.iter().enumerate() {
            if *v > sm[best] {
                best = i;
            }
        }
        out.best_index = best;
    }
    let b = out.best_index;
    out.p = out.p_curve.iter().map(|c| c[b]).collect();
    out.r = out.r_curve.iter().map(|c| c[b]).collect();
    out.f1 = out.f1_curve.iter().map(|c| c[b]).collect();
    out.x = x;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/metrics.md §5 worked example: trapezoid AP 0.7530, P 0.6, R 1.0.
    #[test]
    fn worked_example() {
        let pattern = [true, false, true, false, true];
        let tp: Vec<[bool; NUM_THRESHOLDS]> = pattern.iter().map(|&b| [b; NUM_THRESHOLDS]).collect();
        let conf = [0.9f32, 0.8, 0.7, 0.6, 0.5];
        let r = ap_per_class(&tp, &conf, &[0; 5], &[0, 0, 0]).unwrap();
        assert!((r.ap[0][0] - 0.7530).abs() < 5e-4, "{}", r.ap[0][0]);
        assert!((r.p[0] - 0.6).abs() < 1e-9 && (r.r[0] - 1.0).abs() < 1e-9);
    }

    #[test]
    fn interp_rightmost_duplicate() {
        let xp = [0.0, 0.5, 0.5, 1.0];
        let fp = [1.0, 0.8, 0.2, 0.0];
        assert_eq!(interp(0.5, &xp, &fp, 9.0, 9.0), 0.2);
        assert!((interp(0.25, &xp, &fp, 9.0, 9.0) - 0.9).abs() < 1e-12);
        assert_eq!(interp(-1.0, &xp, &fp, 9.0, 7.0), 9.0);
        assert_eq!(interp(2.0, &xp, &fp, 9.0, 7.0), 7.0);
    }
}

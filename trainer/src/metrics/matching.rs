//! Greedy prediction ↔ GT matching per threshold (docs/metrics.md §4).

use super::{iou_thresholds, NUM_THRESHOLDS};
use crate::error::{check_len, Result};

/// Match predictions (in descending score order) to GTs with similarity matrix `sim` (m × n, GT-major).
///
/// Pairs with different classes get similarity 0. A prediction whose best similarity is below
/// the first threshold (0.5) is skipped at every threshold. Otherwise, independently for each
/// threshold, it takes the unclaimed GT with the highest similarity (first index on ties) and is a
/// TP there if that similarity reaches the threshold; that GT is then claimed at that threshold.
pub fn match_predictions(pred_classes: &[usize], gt_classes: &[usize], sim: &[f32]) -> Result<Vec<[bool; NUM_THRESHOLDS]>> {
    let (m, n) = (gt_classes.len(), pred_classes.len());
    check_len("similarity matrix", sim, &[m, n])?;
    let mut tp = vec![[false; NUM_THRESHOLDS]; n];
    if m == 0 || n == 0 {
        return Ok(tp);
    }
    let thr = iou_thresholds();
    let s = |g: usize, j: usize| {
        if gt_classes[g] == pred_classes[j] {
            sim[g * n + j]
        } else {
            0.0
        }
    };
    let mut claimed = vec![[false; NUM_THRESHOLDS]; m];
    for (j, tpj) in tp.iter_mut().enumerate() {
        let best = (0..m).map(|g| s(g, j)).fold(f32::NEG_INFINITY, f32::max);
        if best < thr[0] {
            continue;
        }
        for (t, &tau) in thr.iter().enumerate() {
            let mut pick: Option<(usize, f32)> = None;
            for (g, cl) in claimed.iter().enumerate() {
                if cl[t] {
                    continue;
                }
                let v = s(g, j);
                if pick.is_none_or(|(_, bv)| v > bv) {
                    pick = Some((g, v));
                }
            }
            if let Some((g, v)) = pick {
                if v >= tau {
                    tpj[t] = true;
                    claimed[g][t] = true;
                }
            }
        }
    }
    Ok(tp)
}

//! The detection confusion matrix Ultralytics draws after validation (`ConfusionMatrix` with
//! `task="detect"`, confidence 0.25, IoU 0.45): rows are the predicted class, columns the true
//! class, the last of each being "background" — a true object no prediction matched (bottom row)
//! and a prediction no object matched (last column).

use super::iou::box_iou;
use super::types::{Detections, GroundTruth};

/// Counts of `(predicted, true)` class pairs over a validation pass.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfusionMatrix {
    /// Classes (the matrix is `(nc + 1) × (nc + 1)`).
    pub nc: usize,
    /// Detections below this confidence are left out.
    pub conf: f32,
    /// A detection and an object match above this IoU.
    pub iou: f32,
    /// `matrix[predicted][true]`, index `nc` = background.
    pub matrix: Vec<Vec<f64>>,
}

impl Default for ConfusionMatrix {
    /// An empty one-class matrix.
    fn default() -> Self {
        ConfusionMatrix::new(1)
    }
}

impl ConfusionMatrix {
    /// An empty matrix with Ultralytics' thresholds.
    pub fn new(nc: usize) -> ConfusionMatrix {
        ConfusionMatrix { nc, conf: 0.25, iou: 0.45, matrix: vec![vec![0.0; nc + 1]; nc + 1] }
    }

    /// Adds one image: matches taken greedily by IoU (each detection and each object at most
    /// once, highest IoU first, as Ultralytics' `np.unique` passes pick them).
    pub fn update(&mut self, det: &Detections, gt: &GroundTruth) {
        let nc = self.nc;
        let class = |c: usize| c.min(nc);
        let keep: Vec<usize> = (0..det.boxes.len()).filter(|&k| det.scores[k] > self.conf).collect();
        if gt.boxes.is_empty() {
            for &k in &keep {
                self.matrix[class(det.classes[k])][nc] += 1.0;
            }
            return;
        }
        let boxes: Vec<[f32; 4]> = keep.iter().map(|&k| det.boxes[k]).collect();
        let iou = box_iou(&gt.boxes, &boxes);
        let mut pairs: Vec<(usize, usize, f32)> = (0..gt.boxes.len())
            .flat_map(|g| (0..boxes.len()).map(move |d| (g, d)))
            .map(|(g, d)| (g, d, iou[g * boxes.len() + d]))
            .filter(|p| p.2 > self.iou)
            .collect();
        pairs.sort_by(|a, b| b.2.total_cmp(&a.2));
        let (mut det_used, mut gt_used) = (vec![false; boxes.len()], vec![None; gt.boxes.len()]);
        for (g, d, _) in pairs {
            if !det_used[d] && gt_used[g].is_none() {
                det_used[d] = true;
                gt_used[g] = Some(d);
            }
        }
        for (g, m) in gt_used.iter().enumerate() {
            let row = m.map_or(nc, |d| class(det.classes[keep[d]]));
            self.matrix[row][class(gt.classes[g])] += 1.0;
        }
        for (d, used) in det_used.iter().enumerate() {
            if !used {
                self.matrix[class(det.classes[keep[d]])][nc] += 1.0;
            }
        }
    }

    /// Each column divided by its sum (what `confusion_matrix_normalized.png` shows: where the
    /// objects of each true class went).
    pub fn normalized(&self) -> Vec<Vec<f64>> {
        let n = self.nc + 1;
        let sums: Vec<f64> = (0..n).map(|c| self.matrix.iter().map(|r| r[c]).sum::<f64>() + 1e-9).collect();
        self.matrix.iter().map(|r| r.iter().zip(&sums).map(|(v, s)| v / s).collect()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn det(boxes: &[[f32; 4]], scores: &[f32]) -> Detections {
        Detections { boxes: boxes.to_vec(), scores: scores.to_vec(), classes: vec![0; boxes.len()], keypoints: Vec::new(), nk: 0 }
    }

    fn gt(boxes: &[[f32; 4]]) -> GroundTruth {
        GroundTruth { boxes: boxes.to_vec(), classes: vec![0; boxes.len()], keypoints: Vec::new(), nk: 0 }
    }

    /// One hit, one duplicate on the same object (a false positive), one missed object, one
    /// detection below the confidence threshold (left out), and a background image's detection.
    #[test]
    fn hits_misses_and_false_positives_land_in_their_cells() {
        let mut m = ConfusionMatrix::new(1);
        let objects = gt(&[[0.0, 0.0, 10.0, 10.0], [50.0, 50.0, 60.0, 60.0]]);
        let found = det(&[[0.0, 0.0, 10.0, 10.0], [1.0, 0.0, 10.0, 10.0], [50.0, 50.0, 60.0, 60.0]], &[0.9, 0.8, 0.1]);
        m.update(&found, &objects);
        m.update(&det(&[[5.0, 5.0, 9.0, 9.0]], &[0.5]), &gt(&[]));
        assert_eq!(m.matrix, vec![vec![1.0, 2.0], vec![1.0, 0.0]]);
        let n = m.normalized();
        assert!((n[0][0] - 0.5).abs() < 1e-6 && (n[1][0] - 0.5).abs() < 1e-6, "{n:?}");
    }
}

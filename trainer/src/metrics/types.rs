//! Per-image detections and ground truth in letterboxed input pixels (docs/metrics.md §2).

use crate::error::{check_finite, check_len, Result, TrainerError};

/// Post-processed detections of one image, in descending score order.
///
/// Row layout matches Ultralytics' post-processed output `[x1, y1, x2, y2, score, class, nk×(x, y, v)]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Detections {
    /// Boxes xyxy in input pixels.
    pub boxes: Vec<[f32; 4]>,
    /// Confidence of each detection.
    pub scores: Vec<f32>,
    /// Class index of each detection.
    pub classes: Vec<usize>,
    /// Keypoints, `len × nk × 3` (x px, y px, visibility in [0, 1]).
    pub keypoints: Vec<f32>,
    /// Keypoints per detection.
    pub nk: usize,
}

impl Detections {
    /// Empty detections with `nk` keypoints per row.
    pub fn empty(nk: usize) -> Self {
        Detections { nk, ..Default::default() }
    }

    /// Number of detections.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// True when there is no detection.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// Parse rows `(n, 6 + 3·nk)` `[x1, y1, x2, y2, score, class, kpts…]` (the NMS / e2e output layout).
    pub fn from_rows(rows: &[f32], n: usize, nk: usize) -> Result<Self> {
        let width = 6 + 3 * nk;
        check_len("detection rows", rows, &[n, width])?;
        check_finite("detection rows", rows)?;
        let mut d = Detections::empty(nk);
        for r in rows.chunks_exact(width) {
            d.push_row(r)?;
        }
        Ok(d)
    }

    /// Append one row (already validated as finite).
    pub(crate) fn push_row(&mut self, r: &[f32]) -> Result<()> {
        let c = r[5];
        if c < 0.0 || c.fract() != 0.0 {
            return Err(TrainerError::InvalidArgument {
                what: "detection class",
                reason: format!("class must be a non-negative integer, got {c}"),
            });
        }
        self.boxes.push([r[0], r[1], r[2], r[3]]);
        self.scores.push(r[4]);
        self.classes.push(c as usize);
        self.keypoints.extend_from_slice(&r[6..]);
        Ok(())
    }

    /// Check internal consistency and finiteness (the validator calls this on every update).
    pub fn validate(&self) -> Result<()> {
        let n = self.scores.len();
        check_len("detection boxes", &self.boxes, &[n])?;
        check_len("detection classes", &self.classes, &[n])?;
        check_len("detection keypoints", &self.keypoints, &[n, self.nk, 3])?;
        check_finite("detection boxes", self.boxes.as_flattened())?;
        check_finite("detection scores", &self.scores)?;
        check_finite("detection keypoints", &self.keypoints)
    }
}

/// Ground truth of one image in input pixels (Ultralytics `_prepare_batch`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GroundTruth {
    /// Boxes xyxy in input pixels.
    pub boxes: Vec<[f32; 4]>,
    /// Class index of each GT.
    pub classes: Vec<usize>,
    /// Keypoints `len × nk × 3` (x px, y px, v ∈ {0, 1, 2}); v = 0 means unlabelled.
    pub keypoints: Vec<f32>,
    /// Keypoints per GT.
    pub nk: usize,
}

impl GroundTruth {
    /// No GT (background image).
    pub fn empty(nk: usize) -> Self {
        GroundTruth { nk, ..Default::default() }
    }

    /// Number of GT objects.
    pub fn len(&self) -> usize {
        self.classes.len()
    }

    /// True when the image has no GT.
    pub fn is_empty(&self) -> bool {
        self.classes.is_empty()
    }

    /// Scale training-batch targets to the `width × height` letterboxed input, in float32 exactly
    /// like the reference: `xywh2xyxy(box) · (W, H, W, H)`, keypoints `x·W`, `y·H`, `v` unchanged.
    ///
    /// `boxes_xywhn`: (m, 4) normalised (cx, cy, w, h); `classes`: (m,); `keypoints_n`: (m, nk, 3).
    pub fn from_normalized(boxes_xywhn: &[f32], classes: &[f32], keypoints_n: &[f32], nk: usize, width: u32, height: u32) -> Result<Self> {
        let m = classes.len();
        check_len("gt boxes", boxes_xywhn, &[m, 4])?;
        check_len("gt keypoints", keypoints_n, &[m, nk, 3])?;
        check_finite("gt boxes", boxes_xywhn)?;
        check_finite("gt keypoints", keypoints_n)?;
        check_finite("gt classes", classes)?;
        let (w, h) = (width as f32, height as f32);
        let mut gt = GroundTruth::empty(nk);
        for (i, b) in boxes_xywhn.chunks_exact(4).enumerate() {
            let (hw, hh) = (b[2] / 2.0, b[3] / 2.0);
            gt.boxes.push([(b[0] - hw) * w, (b[1] - hh) * h, (b[0] + hw) * w, (b[1] + hh) * h]);
            let c = classes[i];
            if c < 0.0 || c.fract() != 0.0 {
                return Err(TrainerError::InvalidArgument {
                    what: "gt class",
                    reason: format!("class must be a non-negative integer, got {c}"),
                });
            }
            gt.classes.push(c as usize);
        }
        gt.keypoints = keypoints_n.chunks_exact(3).flat_map(|k| [k[0] * w, k[1] * h, k[2]]).collect();
        Ok(gt)
    }

    /// Split an Ultralytics-collated batch into per-image GT in input pixels.
    ///
    /// `batch_idx`: (N,) image index of each target (float, as collated); `classes`: (N,);
    /// `boxes_xywhn`: (N, 4); `keypoints_n`: (N, nk, 3). Targets keep their batch order per image.
    #[allow(clippy::too_many_arguments)]
    pub fn from_batch(
        batch_idx: &[f32],
        classes: &[f32],
        boxes_xywhn: &[f32],
        keypoints_n: &[f32],
        batch_size: usize,
        nk: usize,
        width: u32,
        height: u32,
    ) -> Result<Vec<Self>> {
        let n = batch_idx.len();
        check_len("batch classes", classes, &[n])?;
        check_len("batch boxes", boxes_xywhn, &[n, 4])?;
        check_len("batch keypoints", keypoints_n, &[n, nk, 3])?;
        check_finite("batch_idx", batch_idx)?;
        let mut per: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = vec![Default::default(); batch_size];
        for (t, &bi) in batch_idx.iter().enumerate() {
            if bi < 0.0 || bi.fract() != 0.0 || bi as usize >= batch_size {
                return Err(TrainerError::InvalidArgument {
                    what: "batch_idx",
                    reason: format!("target {t} has image index {bi}, batch size {batch_size}"),
                });
            }
            let e = &mut per[bi as usize];
            e.0.push(classes[t]);
            e.1.extend_from_slice(&boxes_xywhn[4 * t..4 * t + 4]);
            e.2.extend_from_slice(&keypoints_n[3 * nk * t..3 * nk * (t + 1)]);
        }
        per.iter().map(|(c, b, k)| Self::from_normalized(b, c, k, nk, width, height)).collect()
    }

    /// Check internal consistency and finiteness.
    pub fn validate(&self) -> Result<()> {
        let m = self.classes.len();
        check_len("gt boxes", &self.boxes, &[m])?;
        check_len("gt keypoints", &self.keypoints, &[m, self.nk, 3])?;
        check_finite("gt boxes", self.boxes.as_flattened())?;
        check_finite("gt keypoints", &self.keypoints)
    }

    /// OKS area proxy per GT: box area (from xyxy) × 0.53, in float32 (docs/metrics.md §3.2).
    pub fn oks_areas(&self) -> Vec<f32> {
        self.boxes.iter().map(|b| (b[2] - b[0]) * (b[3] - b[1]) * 0.53f32).collect()
    }
}

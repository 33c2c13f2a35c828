//! Training targets of one batch (Ultralytics collate layout, docs/data.md §9) and their per-image
//! padding into pixel boxes and keypoints (docs/loss.md §1 steps 3–4).

use crate::error::{check_finite, check_len, Result, TrainerError};

/// Targets of a batch, host vectors in the collate layout (objects of image 0 first).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TargetBatch {
    /// (N,) image index of each object (float, as collated).
    pub batch_idx: Vec<f32>,
    /// (N,) class id (the collated (N, 1) flattened).
    pub cls: Vec<f32>,
    /// (N, 4) normalised (cx, cy, w, h).
    pub bboxes: Vec<f32>,
    /// (N, K, 3) normalised (x, y) and visibility.
    pub keypoints: Vec<f32>,
    /// Keypoints per object K.
    pub nkpt: usize,
}

impl TargetBatch {
    /// Number of objects N.
    pub fn len(&self) -> usize {
        self.batch_idx.len()
    }

    /// Whether the batch has no object.
    pub fn is_empty(&self) -> bool {
        self.batch_idx.is_empty()
    }

    /// Checks lengths and finiteness.
    pub fn validate(&self, batch_size: usize) -> Result<()> {
        let n = self.len();
        check_len("targets.cls", &self.cls, &[n, 1])?;
        check_len("targets.bboxes", &self.bboxes, &[n, 4])?;
        check_len("targets.keypoints", &self.keypoints, &[n, self.nkpt, 3])?;
        check_finite("targets.bboxes", &self.bboxes)?;
        check_finite("targets.keypoints", &self.keypoints)?;
        check_finite("targets.cls", &self.cls)?;
        for (i, &b) in self.batch_idx.iter().enumerate() {
            if !(b >= 0.0 && (b as usize) < batch_size && b.fract() == 0.0) {
                return Err(TrainerError::InvalidArgument {
                    what: "targets.batch_idx",
                    reason: format!("object {i} has image index {b} for a batch of {batch_size}"),
                });
            }
        }
        Ok(())
    }
}

/// Targets padded per image to M = max objects per image, in pixels.
#[derive(Clone, Debug, PartialEq)]
pub struct PaddedTargets {
    /// Images.
    pub batch_size: usize,
    /// M.
    pub max_boxes: usize,
    /// Keypoints per object.
    pub nkpt: usize,
    /// (B, M) class of each slot (0 for padding).
    pub labels: Vec<f32>,
    /// (B, M, 4) xyxy pixels (zeros for padding).
    pub boxes: Vec<f32>,
    /// (B, M) valid slot: x1 + y1 + x2 + y2 > 0.
    pub mask: Vec<bool>,
    /// (B, M, K, 3) keypoints in pixels (x·W, y·H, v).
    pub kpts: Vec<f32>,
}

/// Pads the batch per image (docs/loss.md §1): boxes to xyxy pixels via `xywh2xyxy(xywh · [W,H,W,H])`,
/// keypoints to pixels; `image_hw` = (H, W) in pixels.
pub fn pad_targets(t: &TargetBatch, batch_size: usize, image_hw: (f32, f32)) -> Result<PaddedTargets> {
    t.validate(batch_size)?;
    let (h, w) = image_hw;
    let nk = t.nkpt;
    let mut counts = vec![0usize; batch_size];
    for &b in &t.batch_idx {
        counts[b as usize] += 1;
    }
    let m = counts.iter().copied().max().unwrap_or(0);
    let mut labels = vec![0f32; batch_size * m];
    let mut boxes = vec![0f32; batch_size * m * 4];
    let mut kpts = vec![0f32; batch_size * m * nk * 3];
    let mut fill = vec![0usize; batch_size];
    for i in 0..t.len() {
        let b = t.batch_idx[i] as usize;
        let slot = b * m + fill[b];
        fill[b] += 1;
        labels[slot] = t.cls[i];
        let bb = &t.bboxes[4 * i..4 * i + 4];
        let (cx, cy, bw, bh) = (bb[0] * w, bb[1] * h, bb[2] * w, bb[3] * h);
        let (hw, hh) = (bw / 2.0, bh / 2.0);
        boxes[4 * slot..4 * slot + 4].copy_from_slice(&[cx - hw, cy - hh, cx + hw, cy + hh]);
        for k in 0..nk {
            let src = &t.keypoints[(i * nk + k) * 3..(i * nk + k) * 3 + 3];
            let dst = (slot * nk + k) * 3;
            kpts[dst] = src[0] * w;
            kpts[dst + 1] = src[1] * h;
            kpts[dst + 2] = src[2];
        }
    }
    let mask = boxes.chunks_exact(4).map(|b| b[0] + b[1] + b[2] + b[3] > 0.0).collect();
    Ok(PaddedTargets { batch_size, max_boxes: m, nkpt: nk, labels, boxes, mask, kpts })
}

//! Anchor centres and strides (`make_anchors`, offset 0.5; docs/model.md §5.1).

use ptl_autograd::{Device, Tensor};

use crate::error::{Result, TrainerError};

/// Anchor grid of all levels, concatenated P3, P4, P5, row-major inside a level.
#[derive(Clone, Debug, PartialEq)]
pub struct Anchors {
    /// (H_i, W_i) of each level.
    pub level_hw: Vec<(usize, usize)>,
    /// Stride of each level.
    pub level_strides: Vec<f32>,
    /// Anchor centres in grid units, (A, 2) row-major: x, y.
    pub points: Vec<f32>,
    /// Stride of each anchor, (A,).
    pub strides: Vec<f32>,
}

impl Anchors {
    /// Anchors for explicit level sizes.
    pub fn from_levels(level_hw: &[(usize, usize)], strides: &[f64]) -> Result<Anchors> {
        if level_hw.len() != strides.len() || level_hw.is_empty() {
            return Err(TrainerError::InvalidArgument {
                what: "anchors",
                reason: format!("{} level sizes for {} strides", level_hw.len(), strides.len()),
            });
        }
        let n: usize = level_hw.iter().map(|(h, w)| h * w).sum();
        let mut points = Vec::with_capacity(2 * n);
        let mut st = Vec::with_capacity(n);
        for (&(h, w), &s) in level_hw.iter().zip(strides) {
            for y in 0..h {
                for x in 0..w {
                    points.push(x as f32 + 0.5);
                    points.push(y as f32 + 0.5);
                    st.push(s as f32);
                }
            }
        }
        Ok(Anchors { level_hw: level_hw.to_vec(), level_strides: strides.iter().map(|&s| s as f32).collect(), points, strides: st })
    }

    /// Anchors for an input of `image_hw` pixels: each level is the input size divided by its
    /// stride, rounded up (what a stride-2 3×3 conv with padding 1 produces level by level).
    pub fn from_image_hw(image_hw: (usize, usize), strides: &[f64]) -> Result<Anchors> {
        let levels: Vec<(usize, usize)> = strides
            .iter()
            .map(|&s| {
                let s = s as usize;
                (image_hw.0.div_ceil(s.max(1)), image_hw.1.div_ceil(s.max(1)))
            })
            .collect();
        Anchors::from_levels(&levels, strides)
    }

    /// Number of anchors A.
    pub fn len(&self) -> usize {
        self.strides.len()
    }

    /// Whether there is no anchor.
    pub fn is_empty(&self) -> bool {
        self.strides.is_empty()
    }

    /// Image size in pixels, (height, width) of the first level × its stride (docs/loss.md §1).
    pub fn image_hw(&self) -> (f32, f32) {
        let (h, w) = self.level_hw[0];
        let s = self.level_strides[0];
        (h as f32 * s, w as f32 * s)
    }

    /// Anchor centres as an (A, 2) f32 tensor.
    pub fn points_tensor(&self, device: Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.points.clone(), (self.len(), 2), device)?)
    }

    /// Strides as an (A, 1) f32 tensor.
    pub fn strides_tensor(&self, device: Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.strides.clone(), (self.len(), 1), device)?)
    }

    /// Anchor centres in pixels, (A, 2) host f32 (point × stride).
    pub fn points_px(&self) -> Vec<f32> {
        self.points.chunks_exact(2).zip(&self.strides).flat_map(|(p, &s)| [p[0] * s, p[1] * s]).collect()
    }
}

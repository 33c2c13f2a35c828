//! Ultralytics' `train_batch0.jpg` … and `val_batch0_labels.jpg` / `val_batch0_pred.jpg`: a batch
//! as a grid of its images (up to 16; training ones as the model receives them after mosaic and
//! geometric augmentation), each with its labels or predictions drawn — boxes and the keypoint
//! skeleton — so that a user sees what the model is taught and what it finds.

use std::path::{Path, PathBuf};

use ptl_data::image::{resize_bilinear, write_jpeg, Image};

use crate::pose::draw::{people, Person};
use crate::Result;

/// Images drawn per grid (Ultralytics' `plot_images` draws at most 16).
const MAX_IMAGES: usize = 16;
/// The grid's largest side in pixels.
const MAX_SIDE: usize = 1920;

/// A batch's pixels and labels as the loader hands them out (see `ptl_data::Batch`).
pub struct LabelledBatch<'a> {
    /// u8 RGB, `B × 3 × H × W`.
    pub pixels: &'a [u8],
    /// `[B, 3, H, W]`.
    pub shape: [usize; 4],
    /// Image index of each object.
    pub batch_idx: &'a [f32],
    /// Normalised (cx, cy, w, h) per object.
    pub bboxes: &'a [f32],
    /// Normalised (x, y, visibility) per keypoint of each object, `nkpt` per object.
    pub keypoints: &'a [f32],
    /// Keypoints per object.
    pub nkpt: usize,
    /// Each object's confidence (predictions), drawn beside its label.
    pub scores: Option<&'a [f32]>,
    /// Each object's class, and the class names, for the label (`None`: `person`).
    pub classes: Option<(&'a [usize], &'a [String])>,
}

/// The grid: images in rows of ⌈√n⌉, scaled down together so the grid fits 1920 pixels, labels
/// drawn on each (visible keypoints joined by the skeleton).
pub fn batch_grid(b: &LabelledBatch<'_>) -> Result<Image> {
    let [n_all, _, h, w] = b.shape;
    let n = n_all.min(MAX_IMAGES);
    let cols = (n as f64).sqrt().ceil().max(1.0) as usize;
    let rows = n.div_ceil(cols).max(1);
    let scale = (MAX_SIDE as f64 / (cols * w).max(rows * h).max(1) as f64).min(1.0);
    let (tw, th) = (((w as f64 * scale).round() as usize).max(1), ((h as f64 * scale).round() as usize).max(1));
    let mut canvas = vec![255u8; cols * tw * rows * th * 3];
    let plane = h * w;
    for k in 0..n {
        let img = &b.pixels[k * 3 * plane..(k + 1) * 3 * plane];
        let hwc: Vec<u8> = (0..plane).flat_map(|i| [img[i], img[plane + i], img[2 * plane + i]]).collect();
        let mut tile = resize_bilinear(&Image::from_rgb(w as u32, h as u32, hwc), tw as u32, th as u32);
        let mine: Vec<usize> = b.batch_idx.iter().enumerate().filter(|(_, &i)| i as usize == k).map(|(j, _)| j).collect();
        let kpts: Vec<Vec<[f32; 3]>> = mine
            .iter()
            .map(|&j| {
                (0..b.nkpt)
                    .map(|q| {
                        let o = (j * b.nkpt + q) * 3;
                        [b.keypoints[o] * tw as f32, b.keypoints[o + 1] * th as f32, b.keypoints[o + 2]]
                    })
                    .collect()
            })
            .collect();
        let persons: Vec<Person<'_>> = mine
            .iter()
            .zip(&kpts)
            .map(|(&j, kp)| {
                let [cx, cy, bw, bh] = [0, 1, 2, 3].map(|c| b.bboxes[4 * j + c]);
                let (x1, y1) = ((cx - bw / 2.0) * tw as f32, (cy - bh / 2.0) * th as f32);
                let score = b.scores.and_then(|s| s.get(j).copied());
                let name = b.classes.and_then(|(c, names)| c.get(j).and_then(|&c| names.get(c))).map_or("person", String::as_str);
                Person { bbox: [x1, y1, x1 + bw * tw as f32, y1 + bh * th as f32], kpts: kp, score, name }
            })
            .collect();
        people(&mut tile, &persons, 0.5)?;
        let rgb = tile.to_rgb();
        let (r, c) = (k / cols, k % cols);
        for y in 0..th {
            let dst = ((r * th + y) * cols * tw + c * tw) * 3;
            canvas[dst..dst + tw * 3].copy_from_slice(&rgb[y * tw * 3..(y + 1) * tw * 3]);
        }
    }
    Ok(Image::from_rgb((cols * tw) as u32, (rows * th) as u32, canvas))
}

/// Writes `train_batch{index}.jpg` into `dir` and returns its path.
pub fn plot_train_batch(b: &LabelledBatch<'_>, dir: &Path, index: usize) -> Result<PathBuf> {
    plot_batch(b, &dir.join(format!("train_batch{index}.jpg")))
}

/// Writes the grid of `b` as a JPEG at `out` and returns the path.
pub fn plot_batch(b: &LabelledBatch<'_>, out: &Path) -> Result<PathBuf> {
    write_jpeg(&batch_grid(b)?, out, 90)?;
    Ok(out.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two grey 64 px images, one person on the second: the grid is 2 × 1 tiles, the first tile
    /// stays grey, and the second has drawn pixels on its box's edge and none far from it.
    #[test]
    fn labels_are_drawn_on_their_own_image() {
        let (h, w) = (64usize, 64usize);
        let pixels = vec![128u8; 2 * 3 * h * w];
        let kpts: Vec<f32> = (0..17).flat_map(|q| [0.3 + 0.02 * q as f32, 0.5, 1.0]).collect();
        let b = LabelledBatch {
            pixels: &pixels,
            shape: [2, 3, h, w],
            batch_idx: &[1.0],
            bboxes: &[0.5, 0.5, 0.5, 0.5],
            keypoints: &kpts,
            nkpt: 17,
            scores: None,
            classes: None,
        };
        let g = batch_grid(&b).unwrap();
        assert_eq!((g.w, g.h), (128, 64));
        let px = |x: usize, y: usize| &g.data[(y * g.w as usize + x) * 3..(y * g.w as usize + x) * 3 + 3];
        assert!((0..64).all(|x| (0..64).all(|y| px(x, y) == [128, 128, 128])), "the first image has no label");
        // The box spans 16..48 of the second tile: its left edge at x = 64 + 16.
        assert!((20..44).any(|y| px(64 + 16, y) != [128, 128, 128]), "box edge drawn");
        assert_eq!(px(64 + 2, 60), [128, 128, 128], "nothing far from the box");
    }
}

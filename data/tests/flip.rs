//! Horizontal flips in the training pipeline swap left and right keypoints through `flip_idx`
//! (docs/data.md §6): keypoint k of a flipped sample is the mirrored keypoint `flip_idx[k]` of the same
//! sample unflipped.

mod common;

use std::sync::Arc;

use common::*;
use ptl_data::augment::Instances;
use ptl_data::image::Image;
use ptl_data::{AugmentConfig, PoseDataset, TrainConfig, TrainLoader};

const S: u32 = 64;

/// A loader with mosaic off and the given flip probability; everything else (affine, HSV) at its
/// defaults, so both loaders draw the same random numbers for a given (seed, epoch, index).
fn loader(ds: &Arc<PoseDataset>, fliplr: f64) -> TrainLoader {
    let aug = AugmentConfig { mosaic: 0.0, fliplr, ..AugmentConfig::default() };
    TrainLoader::new(ds.clone(), TrainConfig { batch: 2, seed: 9, epochs: 1, workers: 0, aug, ..TrainConfig::default() }).expect("loader")
}

fn mirrored(img: &Image) -> Image {
    let (w, h) = (img.w as usize, img.h as usize);
    let mut out = img.clone();
    for y in 0..h {
        for x in 0..w {
            let (d, s) = ((y * w + x) * 3, (y * w + (w - 1 - x)) * 3);
            out.data[d..d + 3].copy_from_slice(&img.data[s..s + 3]);
        }
    }
    out
}

/// Checks `flipped` against `plain` mirrored in a `w`-wide image with keypoints reordered by
/// `fi`; returns how many keypoints the reorder moved to a different x (so the check has teeth).
fn check_flipped(flipped: &Instances, plain: &Instances, w: f32, fi: &[usize], at: usize) -> usize {
    let k = plain.k;
    assert_eq!(flipped.cls, plain.cls, "sample {at}: same objects");
    for (f, p) in flipped.boxes.iter().zip(&plain.boxes) {
        assert_eq!(*f, [w - p[2], p[1], w - p[0], p[3]], "sample {at}: box mirrored");
    }
    let mut moved = 0;
    for (o, (fo, po)) in flipped.kpts.chunks_exact(k * 3).zip(plain.kpts.chunks_exact(k * 3)).enumerate() {
        for (j, &src) in fi.iter().enumerate() {
            let (f, p) = (&fo[j * 3..j * 3 + 3], &po[src * 3..src * 3 + 3]);
            assert_eq!(f, [w - p[0], p[1], p[2]], "sample {at} object {o}: keypoint {j} must be mirrored keypoint flip_idx[{j}] = {src}");
            if po[j * 3] != p[0] {
                moved += 1;
            }
        }
    }
    moved
}

/// With `fliplr = 1` every training sample is the `fliplr = 0` sample mirrored: image, boxes, and
/// keypoints with left/right swapped by the dataset's `flip_idx`.
#[test]
fn fliplr_swaps_left_and_right_keypoints() {
    let dir = tempfile::tempdir().expect("temp dir");
    let st = small_synth(dir.path(), 6, 0, 1, S, 21);
    let ds = Arc::new(PoseDataset::open_yaml(&st.yaml, "train", &quiet(S)).expect("dataset"));
    let fi = ds.meta.flip_idx.clone().expect("the synthetic dataset has a flip_idx");
    assert!(fi.iter().enumerate().any(|(j, &s)| j != s), "flip_idx swaps something");
    let (plain, flip) = (loader(&ds, 0.0), loader(&ds, 1.0));
    let (mut objects, mut moved) = (0, 0);
    for i in 0..ds.len() {
        let (p, f) = (plain.sample(0, i), flip.sample(0, i));
        assert!(f.img == mirrored(&p.img), "sample {i}: image mirrored");
        moved += check_flipped(&f.inst, &p.inst, p.img.w as f32, &fi, i);
        objects += p.inst.len();
    }
    assert!(objects > 0, "some sample has objects");
    assert!(moved > 0, "some left/right pair sits at different x, so a missing swap would be seen");
}

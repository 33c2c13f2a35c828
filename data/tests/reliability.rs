//! Inputs that once aborted or were accepted silently (reliability issue): images whose header
//! claims a huge size, out-of-range boxes and visibilities, a `flip_idx` that is not a
//! permutation, and folder-link loops under images/.

mod common;

use common::*;
use ptl_data::{DataError, PoseDataset, SkipReason};

/// CRC-32 (IEEE) of `bytes`, for patching PNG chunks.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

/// A valid small PNG whose IHDR claims `w × h` (CRC fixed, so only the size is wrong).
fn png_claiming(path: &std::path::Path, w: u32, h: u32) {
    let bytes = std::fs::read(path).unwrap();
    let mut b = bytes.clone();
    // signature (8) | length (4) | "IHDR" (4) | width (4) | height (4) | ... | crc over type+data
    assert_eq!(&b[12..16], b"IHDR");
    b[16..20].copy_from_slice(&w.to_be_bytes());
    b[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = crc32(&b[12..29]);
    b[29..33].copy_from_slice(&crc.to_be_bytes());
    std::fs::write(path, b).unwrap();
}

/// A valid small JPEG whose SOF0 claims `w × h`.
fn jpeg_claiming(path: &std::path::Path, w: u16, h: u16) {
    let mut b = std::fs::read(path).unwrap();
    let sof = b.windows(2).position(|m| m == [0xFF, 0xC0]).expect("baseline JPEG");
    // FF C0 | length (2) | precision (1) | height (2) | width (2)
    b[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
    b[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
    std::fs::write(path, b).unwrap();
}

#[test]
fn huge_image_headers_are_skipped_before_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    l.image("train", "good.jpg", 120, 90, 1);
    l.label("train", "good", &row(0.0));
    let png = l.image("train", "huge.png", 64, 64, 2);
    png_claiming(&png, 100_000, 100_000);
    l.label("train", "huge", &row(0.0));
    let jpg = l.image("train", "huge.jpg", 64, 64, 3);
    jpeg_claiming(&jpg, 65_000, 65_000);
    l.label("train", "huge_jpg", &row(0.0));
    let ds = PoseDataset::open_yaml(&l.yaml(), "train", &quiet(64)).unwrap();
    let r = &ds.report;
    assert_eq!(r.usable, 1, "{r:?}");
    for name in ["huge.png", "huge.jpg"] {
        let s = r.skipped.iter().find(|s| s.path.ends_with(name)).unwrap_or_else(|| panic!("{name} not skipped: {r:?}"));
        assert_eq!(s.reason, SkipReason::OversizeImage, "{name}: {}", s.message);
        assert!(s.message.contains(name) && s.message.contains("pixel limit"), "{}", s.message);
    }
    assert!(r.summary().contains("2 oversize image"), "{}", r.summary());
    // Decoding the file directly (predict's path) is the same typed error.
    let e = ptl_data::image::decode_file(&png).unwrap_err();
    assert!(matches!(e, DataError::ImageTooLarge { w: 100_000, h: 100_000, .. }), "{e}");
}

#[test]
fn boxes_outside_the_image_and_bad_visibilities_are_invalid_labels() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    l.image("train", "good.jpg", 120, 90, 1);
    l.label("train", "good", &row(0.0));
    l.image("train", "centre.jpg", 120, 90, 2);
    l.label("train", "centre", &row(0.0).replacen("0 0.5 0.5", "0 1.7 0.5", 1));
    l.image("train", "vis.jpg", 120, 90, 3);
    let mut bad_vis: Vec<String> = row(0.0).split(' ').map(str::to_string).collect();
    bad_vis[5 + 2] = "7".into();
    l.label("train", "vis", &bad_vis.join(" "));
    let ds = PoseDataset::open_yaml(&l.yaml(), "train", &quiet(64)).unwrap();
    let msg = |n: &str| ds.report.skipped.iter().find(|s| s.path.to_string_lossy().contains(n)).map(|s| (s.reason, s.message.clone()));
    let (reason, m) = msg("centre.txt").expect("box centre 1.7 rejected");
    assert_eq!(reason, SkipReason::InvalidLabel);
    assert!(m.contains("centre x 1.7"), "{m}");
    let (reason, m) = msg("vis.txt").expect("visibility 7 rejected");
    assert_eq!(reason, SkipReason::InvalidLabel);
    assert!(m.contains("visibility 7"), "{m}");
    assert_eq!(ds.len(), 1);
}

#[test]
fn flip_idx_must_be_a_permutation() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    let yaml = std::fs::read_to_string(l.yaml()).unwrap().replace("[0, 2, 1, 4,", "[0, 0, 1, 4,");
    std::fs::write(l.yaml(), yaml).unwrap();
    let e = ptl_data::DatasetConfig::load(&l.yaml()).unwrap_err();
    assert!(matches!(e, DataError::Config { field: "flip_idx", .. }), "{e}");
    assert!(e.to_string().contains("permutation"), "{e}");
}

#[cfg(unix)]
#[test]
fn folder_link_loops_are_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    for i in 0..8u8 {
        l.image("train", &format!("im{i}.jpg"), 64, 64, i);
        l.label("train", &format!("im{i}"), &row(0.0));
    }
    // images/train/loop -> images (an enclosing folder), labels/train/again -> labels/train
    std::os::unix::fs::symlink(dir.path().join("images"), dir.path().join("images/train/loop")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("labels/train"), dir.path().join("labels/train/again")).unwrap();
    let ds = PoseDataset::open_yaml(&l.yaml(), "train", &quiet(64)).unwrap();
    let r = &ds.report;
    assert_eq!((r.found, r.usable, r.missing_labels), (8, 8, 0), "{}", r.summary());
    assert_eq!(r.links_not_followed, 2, "{}", r.summary());
    assert!(r.warnings.iter().any(|w| w.contains("loop") && w.contains("not followed")), "{:?}", r.warnings);
}

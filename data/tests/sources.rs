//! Dataset sources: synthetic generator round trip, Ultralytics layout, COCO JSON, disk cache.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use ptl_data::config::DatasetConfig;
use ptl_data::dataset::OpenOptions;
use ptl_data::labels::{label_path_for, parse_label_text, KptShape, LabelRules};
use ptl_data::PoseDataset;

fn read_tree(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for sub in ["images/train", "labels/train", "images/val", "labels/val"] {
        let mut names: Vec<_> = std::fs::read_dir(root.join(sub)).unwrap().flatten().map(|e| e.path()).collect();
        names.sort();
        for p in names {
            out.insert(format!("{sub}/{}", p.file_name().unwrap().to_string_lossy()), std::fs::read(&p).unwrap());
        }
    }
    out
}

#[test]
fn synth_roundtrip_through_ultralytics_loader() {
    let dir = tempfile::tempdir().unwrap();
    let st = small_synth(dir.path(), 16, 5, 4, 160, 347);
    assert_eq!(st.train_images, 16);
    assert_eq!(st.train_background, 5);
    assert_eq!(st.val_images, 4);
    assert!(st.train_instances >= 11, "{st:?}");

    // yaml is Ultralytics' format
    let cfg = DatasetConfig::load(&st.yaml).unwrap();
    assert_eq!(cfg.kpt_shape, KptShape::COCO);
    assert_eq!(cfg.names, vec!["person"]);
    assert_eq!(cfg.flip_idx.as_deref(), Some(&ptl_data::config::COCO_FLIP_IDX[..]));

    let ds = PoseDataset::open_yaml(&st.yaml, "train", &quiet(160)).unwrap();
    assert_eq!(ds.len(), 16);
    assert_eq!(ds.report.background, 5);
    assert_eq!(ds.report.instances, st.train_instances);
    assert!(ds.report.skipped.is_empty() && ds.report.warnings.is_empty(), "{:?}", ds.report);
    for it in &ds.items {
        assert_eq!(it.image.w.max(it.image.h), 160);
        assert!(label_path_for(&it.im_file).is_file()); // background images have empty label files
        for obj in it.labels.kpts.chunks(51) {
            for p in obj.chunks(3) {
                assert!(p[2] == 0.0 || p[2] == 1.0 || p[2] == 2.0);
                if p[2] == 0.0 {
                    assert_eq!((p[0], p[1]), (0.0, 0.0));
                }
            }
        }
    }
    let val = PoseDataset::open_yaml(&st.yaml, "val", &quiet(160)).unwrap();
    assert_eq!(val.len(), 4);
    assert_eq!(val.report.background, 0);
}

#[test]
fn synth_visibility_flags_all_occur() {
    let dir = tempfile::tempdir().unwrap();
    let st = small_synth(dir.path(), 40, 0, 0, 128, 3);
    assert!(st.visibility.iter().all(|&n| n > 0), "{:?}", st.visibility);
}

#[test]
fn synth_is_deterministic_and_thread_independent() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let c = tempfile::tempdir().unwrap();
    small_synth(a.path(), 6, 2, 2, 128, 11);
    ptl_data::synth_generate(&ptl_data::SynthOptions {
        out: b.path().to_path_buf(),
        train: 6,
        background: 2,
        val: 2,
        imgsz: 128,
        seed: 11,
        jpeg_quality: 90,
        threads: 1,
        classes: 1,
    })
    .unwrap();
    small_synth(c.path(), 6, 2, 2, 128, 12);
    let ta = read_tree(a.path());
    assert_eq!(ta.len(), 2 * 8);
    assert_eq!(ta, read_tree(b.path()));
    assert_ne!(ta, read_tree(c.path()));
}

#[test]
fn synth_rejects_bad_options() {
    let dir = tempfile::tempdir().unwrap();
    let e =
        ptl_data::synth_generate(&ptl_data::SynthOptions { out: dir.path().to_path_buf(), train: 3, background: 5, ..Default::default() })
            .unwrap_err();
    assert!(e.to_string().contains("--background"), "{e}");
}

#[test]
fn list_file_split_and_2d_keypoints() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    l.image("train", "a.png", 100, 50, 1);
    l.image("train", "b.png", 100, 50, 2);
    l.label("train", "a", "0 0.5 0.5 0.2 0.2 0.1 0.2 -0.005 -0.005 0.3 0.3\n");
    std::fs::write(dir.path().join("train.txt"), "./images/train/b.png\n./images/train/a.png\n").unwrap();
    let yaml = format!("path: {}\ntrain: train.txt\nkpt_shape: [3, 2]\nnames: [person]\n", dir.path().display());
    std::fs::write(dir.path().join("d.yaml"), yaml).unwrap();
    let ds = PoseDataset::open_yaml(&dir.path().join("d.yaml"), "train", &quiet(64)).unwrap();
    assert_eq!(ds.len(), 2);
    assert!(ds.items[0].im_file.ends_with("a.png")); // sorted
    assert_eq!(ds.items[0].labels.kpts, vec![0.1, 0.2, 1.0, -0.005, -0.005, 0.0, 0.3, 0.3, 1.0]);
    assert_eq!(ds.report.missing_labels, 1);
    assert!(ds.meta.flip_idx.is_none());
    assert_eq!((ds.items[0].image.w, ds.items[0].image.h), (64, 32));
}

#[test]
fn coco_json_source() {
    let dir = tempfile::tempdir().unwrap();
    let imgs = dir.path().join("val2017");
    std::fs::create_dir_all(&imgs).unwrap();
    for n in ["1", "2", "3"] {
        ptl_data::image::write_png(&gradient(80, 60, 3), &imgs.join(format!("{n}.png"))).unwrap();
    }
    let kp: Vec<String> = (0..17).map(|j| format!("{}, 30, 2", 10 + 2 * j)).collect();
    let kp = kp.join(", ");
    let json = format!(
        r#"{{"images": [{{"id": 1, "file_name": "1.png", "width": 80, "height": 60}},
                       {{"id": 2, "file_name": "2.png", "width": 80, "height": 60}},
                       {{"id": 3, "file_name": "3.png", "width": 80, "height": 60}}],
            "annotations": [{{"image_id": 1, "category_id": 1, "bbox": [8, 6, 40, 30], "iscrowd": 0, "keypoints": [{kp}], "num_keypoints": 17, "area": 1200}},
                            {{"image_id": 2, "category_id": 1, "bbox": [8, 6, 40, 30], "iscrowd": 1, "keypoints": [{kp}]}}],
            "categories": [{{"id": 1, "name": "person", "keypoints": [], "skeleton": []}}]}}"#
    );
    let jp = dir.path().join("person_keypoints_val2017.json");
    std::fs::write(&jp, json).unwrap();
    let ds = PoseDataset::from_coco(&jp, &imgs, "val", &quiet(64)).unwrap();
    assert_eq!(ds.len(), 3);
    assert_eq!(ds.report.instances, 1);
    assert_eq!(ds.report.background, 2);
    let l = &ds.items[0].labels;
    assert_eq!(l.boxes[0], [0.35, 0.35, 0.5, 0.5]);
    assert!((l.kpts[3] - 0.15).abs() < 1e-6 && l.kpts[5] == 2.0);
    // written label files read back the same
    let out = dir.path().join("labels/val2017");
    assert_eq!(ptl_data::coco::convert_coco_file(&jp, &out).unwrap(), 2);
    let text = std::fs::read_to_string(out.join("1.txt")).unwrap();
    let rules = LabelRules { kpt_shape: KptShape::COCO, nc: 1, single_cls: false };
    assert_eq!(&parse_label_text(&text, &out, &rules).unwrap().0, l);
    assert_eq!(std::fs::read_to_string(out.join("2.txt")).unwrap(), "");
    // broken JSON names its location; missing image folder is an error
    std::fs::write(&jp, "{\"images\": [}").unwrap();
    let e = PoseDataset::from_coco(&jp, &imgs, "val", &quiet(64)).unwrap_err().to_string();
    assert!(e.contains("person_keypoints_val2017.json:1:"), "{e}");
    let e = PoseDataset::from_coco(&jp, &dir.path().join("nope"), "val", &quiet(64)).unwrap_err();
    assert!(matches!(e, ptl_data::DataError::MissingPath { .. }));
}

#[test]
fn disk_cache_is_reused_keyed_and_invalidated() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    let im = l.image("train", "a.jpg", 200, 100, 4);
    l.label("train", "a", &row(0.0));
    let cache = dir.path().join("cache");
    let opts = OpenOptions { cache_dir: Some(cache.clone()), ..quiet(128) };
    let first = PoseDataset::open_yaml(&l.yaml(), "train", &opts).unwrap();
    let entry = ptl_data::cache::entry_path(&cache, &im, 128);
    assert!(entry.is_file() && entry.parent().unwrap().ends_with("v1-128"));
    // a cached entry is what the second open returns (prove it by planting different pixels)
    let (img, ori) = ptl_data::cache::load(&cache, &im, 128).unwrap();
    assert_eq!(img, *first.items[0].image);
    assert_eq!(ori, (100, 200));
    let mut planted = img.clone();
    planted.data.iter_mut().for_each(|v| *v = 7);
    ptl_data::cache::store(&cache, &im, 128, &planted, ori).unwrap();
    let second = PoseDataset::open_yaml(&l.yaml(), "train", &opts).unwrap();
    assert_eq!(*second.items[0].image, planted);
    // another imgsz is another key
    let other = PoseDataset::open_yaml(&l.yaml(), "train", &OpenOptions { imgsz: 64, ..opts.clone() }).unwrap();
    assert_eq!(other.items[0].image.w, 64);
    // a changed source invalidates the entry
    std::thread::sleep(std::time::Duration::from_millis(20));
    l.image("train", "a.jpg", 200, 100, 9);
    let third = PoseDataset::open_yaml(&l.yaml(), "train", &opts).unwrap();
    assert_ne!(*third.items[0].image, planted);
    // no temporary files left behind
    let leftovers: Vec<_> = std::fs::read_dir(entry.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
}

/// Inserts an EXIF APP1 segment with the given orientation right after the JPEG SOI marker.
fn with_exif_orientation(jpeg: &[u8], orientation: u16) -> Vec<u8> {
    let mut tiff = Vec::new();
    tiff.extend_from_slice(b"II*\0");
    tiff.extend_from_slice(&8u32.to_le_bytes());
    tiff.extend_from_slice(&1u16.to_le_bytes()); // one IFD entry
    tiff.extend_from_slice(&0x0112u16.to_le_bytes()); // Orientation
    tiff.extend_from_slice(&3u16.to_le_bytes()); // SHORT
    tiff.extend_from_slice(&1u32.to_le_bytes());
    tiff.extend_from_slice(&orientation.to_le_bytes());
    tiff.extend_from_slice(&[0, 0]);
    tiff.extend_from_slice(&0u32.to_le_bytes()); // no next IFD
    let mut app1 = b"Exif\0\0".to_vec();
    app1.extend_from_slice(&tiff);
    let mut out = jpeg[..2].to_vec();
    out.extend_from_slice(&[0xFF, 0xE1]);
    out.extend_from_slice(&((app1.len() + 2) as u16).to_be_bytes());
    out.extend_from_slice(&app1);
    out.extend_from_slice(&jpeg[2..]);
    out
}

#[test]
fn exif_orientation_is_applied() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    let p = l.image("train", "rot.jpg", 120, 60, 1);
    let plain = std::fs::read(&p).unwrap();
    std::fs::write(&p, with_exif_orientation(&plain, 6)).unwrap(); // rotate 90° clockwise to display
    l.label("train", "rot", &row(0.0));
    let ds = PoseDataset::open_yaml(&l.yaml(), "train", &quiet(120)).unwrap();
    assert_eq!(ds.items[0].ori_shape, (120, 60)); // (h0, w0) after orientation
    assert_eq!((ds.items[0].image.w, ds.items[0].image.h), (60, 120));
}

#[test]
fn synth_ensure_reuses_a_matching_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let o = ptl_data::SynthOptions {
        out: dir.path().to_path_buf(),
        train: 3,
        background: 1,
        val: 1,
        imgsz: 96,
        seed: 1,
        jpeg_quality: 90,
        threads: 1,
        classes: 1,
    };
    let y = ptl_data::synth_ensure(&o).unwrap();
    let marker = dir.path().join("images/train/train_000000.jpg");
    std::fs::write(&marker, b"changed").unwrap();
    assert_eq!(ptl_data::synth_ensure(&o).unwrap(), y);
    assert_eq!(std::fs::read(&marker).unwrap(), b"changed"); // reused, not regenerated
    let o2 = ptl_data::SynthOptions { seed: 2, ..o };
    ptl_data::synth_ensure(&o2).unwrap();
    assert_ne!(std::fs::read(&marker).unwrap(), b"changed");
}

/// `classes`: labels cycle through the classes per image, the yaml names them, the dataset opens
/// with that many classes; the one-class set is unchanged by the option's existence (its labels
/// are class 0, its yaml names `person` alone).
#[test]
fn synth_labels_several_classes_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let o = ptl_data::SynthOptions {
        out: dir.path().to_path_buf(),
        train: 6,
        background: 0,
        val: 2,
        imgsz: 96,
        seed: 3,
        classes: 3,
        ..Default::default()
    };
    let st = ptl_data::synth_generate(&o).unwrap();
    let yaml = std::fs::read_to_string(&st.yaml).unwrap();
    assert!(yaml.contains("names:\n  0: person\n  1: person1\n  2: person2\n"), "{yaml}");
    let mut seen = [0usize; 3];
    for e in std::fs::read_dir(dir.path().join("labels/train")).unwrap().flatten() {
        for line in std::fs::read_to_string(e.path()).unwrap().lines() {
            seen[line.split(' ').next().unwrap().parse::<usize>().unwrap()] += 1;
        }
    }
    assert!(seen.iter().all(|&n| n > 0), "every class labelled: {seen:?}");
    let ds =
        ptl_data::PoseDataset::open_yaml(&st.yaml, "train", &ptl_data::OpenOptions { imgsz: 96, verbose: false, ..Default::default() })
            .unwrap();
    assert_eq!(ds.meta.nc, 3);
    let bad = ptl_data::SynthOptions { classes: 0, ..o };
    assert!(ptl_data::synth_generate(&bad).unwrap_err().to_string().contains("--classes 0"));
}

//! COCO keypoints JSON as a dataset from a yaml or directly, with every annotation that cannot
//! be used counted by reason (reliability issue, point 3).

mod common;

use common::*;
use ptl_data::{DataError, PoseDataset};

fn kp(v: f64, n: usize) -> String {
    (0..n).map(|j| format!("{}, 20, {v}", 10 + j)).collect::<Vec<_>>().join(", ")
}

/// A COCO-style folder: annotations/person_keypoints_train2017.json and images/train2017/*.jpg.
fn coco_dir(root: &std::path::Path) -> std::path::PathBuf {
    let images = root.join("images/train2017");
    std::fs::create_dir_all(&images).unwrap();
    std::fs::create_dir_all(root.join("annotations")).unwrap();
    for (i, name) in ["a.jpg", "b.jpg", "c.jpg"].iter().enumerate() {
        ptl_data::image::write_jpeg(&gradient(200, 100, i as u8), &images.join(name), 90).unwrap();
    }
    let good = kp(2.0, 17);
    let json = format!(
        r#"{{"images": [{{"id": 1, "file_name": "a.jpg", "width": 200, "height": 100}},
                       {{"id": 2, "file_name": "b.jpg", "width": 200, "height": 100}},
                       {{"id": 3, "file_name": "c.jpg", "width": 200, "height": 100}}],
            "annotations": [
              {{"image_id": 1, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 0, "keypoints": [{good}]}},
              {{"image_id": 1, "category_id": 1, "bbox": [50, 20, 30, 40], "iscrowd": 0, "keypoints": [{short}]}},
              {{"image_id": 2, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 0}},
              {{"image_id": 2, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 0, "keypoints": [{none}]}},
              {{"image_id": 9, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 0, "keypoints": [{good}]}},
              {{"image_id": 3, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 1, "keypoints": [{good}]}}
            ]}}"#,
        short = kp(2.0, 5),
        none = kp(0.0, 17),
    );
    let p = root.join("annotations/person_keypoints_train2017.json");
    std::fs::write(&p, json).unwrap();
    p
}

#[test]
fn coco_json_directly_with_counted_skips() {
    let dir = tempfile::tempdir().unwrap();
    let json = coco_dir(dir.path());
    let ds = PoseDataset::open_yaml(&json, "train", &quiet(64)).expect("a COCO JSON opens as a dataset");
    assert_eq!(ds.len(), 3, "images without a usable annotation stay as background");
    let c = ds.report.coco.as_ref().expect("COCO counts");
    assert_eq!((c.images, c.annotations, c.used), (3, 6, 1), "{}", c.summary());
    for reason in ["keypoints not 3·K finite numbers", "no keypoints field", "no labelled keypoint", "no image with that image_id", "crowd"]
    {
        assert!(c.skipped.iter().any(|(r, n)| *r == reason && *n == 1), "{reason}: {}", c.summary());
        assert!(ds.report.warnings.iter().any(|w| w.contains(reason)), "warned: {reason}");
    }
    // The val split of a direct JSON is the same file.
    assert_eq!(PoseDataset::open_yaml(&json, "val", &quiet(64)).unwrap().len(), 3);
}

#[test]
fn coco_json_from_a_yaml_and_an_explicit_image_folder() {
    let dir = tempfile::tempdir().unwrap();
    let json = coco_dir(dir.path());
    let moved = dir.path().join("pictures");
    std::fs::rename(dir.path().join("images/train2017"), &moved).unwrap();
    let yaml = dir.path().join("coco.yaml");
    std::fs::write(&yaml, format!("path: {}\ntrain: {}\nkpt_shape: [17, 3]\nnames: [person]\n", dir.path().display(), json.display()))
        .unwrap();
    let e = PoseDataset::open_yaml(&yaml, "train", &quiet(64)).unwrap_err();
    assert!(e.to_string().contains("train_images"), "says how to name the folder: {e}");
    std::fs::write(
        &yaml,
        format!("path: {}\ntrain: {}\ntrain_images: pictures\nkpt_shape: [17, 3]\nnames: [person]\n", dir.path().display(), json.display()),
    )
    .unwrap();
    let ds = PoseDataset::open_yaml(&yaml, "train", &quiet(64)).expect("explicit folder");
    assert_eq!(ds.items.iter().filter(|i| !i.labels.is_empty()).count(), 1);
}

#[test]
fn a_coco_split_without_any_usable_annotation_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("images/val2017")).unwrap();
    ptl_data::image::write_jpeg(&gradient(64, 64, 1), &dir.path().join("images/val2017/a.jpg"), 90).unwrap();
    let json = dir.path().join("person_keypoints_val2017.json");
    std::fs::write(
        &json,
        r#"{"images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 64}],
            "annotations": [{"image_id": 1, "category_id": 1, "bbox": [1, 1, 10, 10], "iscrowd": 1, "keypoints": []}]}"#,
    )
    .unwrap();
    let e = PoseDataset::open_yaml(&json, "val", &quiet(64)).unwrap_err();
    assert!(matches!(e, DataError::NoUsableAnnotations { .. }), "{e}");
    assert!(e.to_string().contains("1 crowd"), "{e}");
}

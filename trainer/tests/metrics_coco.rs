//! COCOeval port vs pycocotools (metrics.json) and `pred_to_json` export vs coco_results.json.

mod common;

use common::{goldens, Golden};
use ptl_trainer::metrics::coco::{detections_to_results, evaluate, load_dataset, load_results, IouType, Letterbox};
use ptl_trainer::metrics::Detections;
use ptl_trainer::TrainerError;

fn metrics_json(dir: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("metrics/metrics.json")).expect("metrics.json");
    serde_json::from_str(&text).expect("metrics.json parses")
}

#[test]
fn cocoeval_matches_pycocotools() {
    let Some(dir) = goldens() else { return };
    let gt = load_dataset(dir.join("metrics/coco_gt.json")).expect("gt");
    let res = load_results(dir.join("metrics/coco_results.json")).expect("results");
    let js = metrics_json(&dir);
    for (key, ty) in [("bbox", IouType::Bbox), ("keypoints", IouType::Keypoints)] {
        let r = evaluate(&gt, &res, ty).expect("evaluate");
        let want: Vec<f64> =
            js["pycocotools"][key]["stats"].as_array().expect("stats").iter().map(|v| v.as_f64().expect("number")).collect();
        assert_eq!(r.stats.len(), want.len(), "{key}: number of stats");
        let worst = r.stats.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        println!("{key}: max |stat − pycocotools| = {worst:e}");
        for line in &r.summary {
            println!("{line}");
        }
        assert!(worst <= 1e-3, "{key}: {:?} vs {:?}", r.stats, want);
        let lines: Vec<&str> =
            js["pycocotools"][key]["summary_text"].as_array().expect("summary_text").iter().map(|v| v.as_str().expect("str")).collect();
        assert_eq!(r.summary, lines, "{key}: summary lines");
    }
}

#[test]
fn export_matches_pred_to_json() {
    let Some(dir) = goldens() else { return };
    let g = Golden::open(dir.join("metrics/inputs.safetensors"));
    let js = metrics_json(&dir);
    let want = load_results(dir.join("metrics/coco_results.json")).expect("results");
    let mut ours = Vec::new();
    for img in js["per_image"].as_array().expect("per_image") {
        let i = img["image"].as_u64().expect("image") as usize;
        let image_id = img["image_id"].as_i64().expect("image_id");
        let p = format!("img{i:02}");
        let b = g.f32(&format!("{p}.pred.bboxes_xyxy"));
        let det = Detections {
            boxes: b.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]).collect(),
            scores: g.f32(&format!("{p}.pred.conf")),
            classes: g.f32(&format!("{p}.pred.cls")).iter().map(|&c| c as usize).collect(),
            keypoints: g.f32(&format!("{p}.pred.keypoints")),
            nk: 17,
        };
        let lb = Letterbox::identity(640.0, 480.0);
        ours.extend(detections_to_results(image_id, &det, &lb, |c| c as i64 + 1).expect("export"));
    }
    assert_eq!(ours.len(), want.len());
    for (a, b) in ours.iter().zip(&want) {
        assert_eq!(a, b, "exported result differs");
    }
    // Round trip through a file.
    let tmp = std::env::temp_dir().join(format!("ptl_metrics_export_{}.json", std::process::id()));
    ptl_trainer::metrics::coco::save_results(&tmp, &ours).expect("save");
    let back = load_results(&tmp).expect("load");
    let _ = std::fs::remove_file(&tmp);
    assert_eq!(back, ours);
}

#[test]
fn missing_and_malformed_files_are_typed_errors() {
    let e = load_dataset("/definitely/not/here.json").unwrap_err();
    assert!(matches!(e, TrainerError::Io { .. }), "{e}");
    let tmp = std::env::temp_dir().join(format!("ptl_metrics_bad_{}.json", std::process::id()));
    std::fs::write(&tmp, "{\n  \"images\": [\n    {\"id\": \"x\"}\n  ]\n}").expect("write");
    let e = load_dataset(&tmp).unwrap_err();
    let _ = std::fs::remove_file(&tmp);
    match e {
        TrainerError::Json { line, column, .. } => {
            assert_eq!(line, 3);
            assert!(column > 0);
        }
        other => panic!("expected a JSON error, got {other}"),
    }
}

fn synthetic_gt(crowd: bool) -> ptl_trainer::metrics::coco::CocoDataset {
    let text = format!(
        r#"{{"images": [{{"id": 1, "width": 640, "height": 480}}, {{"id": 2}}],
            "categories": [{{"id": 1, "name": "person"}}],
            "annotations": [
              {{"id": 1, "image_id": 1, "category_id": 1, "iscrowd": 0, "bbox": [0, 0, 100, 100], "area": 10000}},
              {{"id": 2, "image_id": 1, "category_id": 1, "iscrowd": {}, "bbox": [200, 200, 100, 100], "area": 10000}}
            ]}}"#,
        if crowd { 1 } else { 0 }
    );
    ptl_trainer::metrics::coco::parse_dataset(&text, std::path::Path::new("synthetic")).expect("gt")
}

fn det(image_id: i64, bbox: [f64; 4], score: f64) -> ptl_trainer::metrics::coco::CocoResult {
    ptl_trainer::metrics::coco::CocoResult { image_id, category_id: 1, bbox: bbox.to_vec(), score, keypoints: vec![] }
}

#[test]
fn cocoeval_crowd_absorbs_detections() {
    // Two high-scoring detections inside a crowd region, then an exact hit on the regular GT.
    let res =
        vec![det(1, [200.0, 200.0, 50.0, 50.0], 0.95), det(1, [250.0, 250.0, 50.0, 50.0], 0.92), det(1, [0.0, 0.0, 100.0, 100.0], 0.9)];
    let with_crowd = evaluate(&synthetic_gt(true), &res, IouType::Bbox).expect("eval");
    assert!((with_crowd.stats[0] - 1.0).abs() < 1e-12, "{:?}", with_crowd.stats);
    assert_eq!(with_crowd.stats[3], -1.0, "no small GT → undefined");
    // Without the crowd flag the two detections are plain false positives ranked first.
    let plain = evaluate(&synthetic_gt(false), &res, IouType::Bbox).expect("eval");
    assert!(plain.stats[0] < 0.5, "{:?}", plain.stats);
}

#[test]
fn cocoeval_edge_cases() {
    let gt = synthetic_gt(false);
    // No detections at all: AP and AR are 0 where GT exists.
    let r = evaluate(&gt, &[], IouType::Bbox).expect("eval");
    assert_eq!(r.stats[0], 0.0);
    assert_eq!(r.stats[8], 0.0);
    // Results for an unknown image are rejected like pycocotools' loadRes assertion.
    let e = evaluate(&gt, &[det(99, [0.0, 0.0, 1.0, 1.0], 0.5)], IouType::Bbox).unwrap_err();
    assert!(matches!(e, TrainerError::Coco(_)), "{e}");
    // Keypoint evaluation without keypoints in the GT is a typed error, not a panic.
    let mut d = det(1, [0.0, 0.0, 100.0, 100.0], 0.5);
    d.keypoints = vec![1.0; 51];
    let e = evaluate(&gt, &[d], IouType::Keypoints).unwrap_err();
    assert!(matches!(e, TrainerError::Coco(_)), "{e}");
    // Only GTs with num_keypoints == 0: all ignored for keypoints → every stat undefined (−1).
    let text = r#"{"images": [{"id": 1}], "categories": [{"id": 1}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 10],
        "area": 100, "keypoints": [0, 0, 0, 0, 0, 0], "num_keypoints": 0}]}"#;
    let gt = ptl_trainer::metrics::coco::parse_dataset(text, std::path::Path::new("k")).expect("gt");
    let r = evaluate(&gt, &[], IouType::Keypoints).expect("eval");
    assert!(r.stats.iter().all(|s| *s == -1.0), "{:?}", r.stats);
}

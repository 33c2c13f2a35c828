//! Edge cases: empty predictions/GT, invisible keypoints, NaN inputs, class handling in NMS.

use ptl_trainer::metrics::{non_max_suppression, Detections, GroundTruth, NmsConfig, PoseValidator};
use ptl_trainer::TrainerError;

const NK: usize = 17;

/// One GT in a 640×480 input: box (cx, cy, w, h) normalised, all keypoints visible or none.
fn gt_one(visible: bool) -> GroundTruth {
    let kpts: Vec<f32> = (0..NK)
        .flat_map(|k| [0.4 + 0.01 * k as f32, 0.3 + 0.02 * k as f32, if visible { 2.0 } else { 0.0 }])
        .map(|v| if visible { v } else { 0.0 })
        .collect();
    GroundTruth::from_normalized(&[0.5, 0.5, 0.25, 0.5], &[0.0], &kpts, NK, 640, 480).unwrap()
}

/// A detection that reproduces `gt` exactly (box and keypoints).
fn perfect(gt: &GroundTruth, score: f32) -> Detections {
    Detections { boxes: gt.boxes.clone(), scores: vec![score], classes: vec![0], keypoints: gt.keypoints.clone(), nk: NK }
}

#[test]
fn empty_validator_reports_zeros() {
    let v = PoseValidator::new(NK).unwrap();
    let m = v.compute();
    assert!(m.results_dict().iter().all(|(_, x)| *x == 0.0), "{:?}", m.results_dict());
}

#[test]
fn predictions_without_any_gt_give_zero_metrics() {
    let mut v = PoseValidator::new(NK).unwrap();
    let gt = gt_one(true);
    let tp = v.update(&perfect(&gt, 0.9), &GroundTruth::empty(NK)).unwrap();
    assert_eq!(tp.tp_box, vec![[false; 10]]);
    let m = v.compute();
    assert!(m.results_dict().iter().all(|(_, x)| *x == 0.0));
    assert!(m.box_metrics.per_class.classes.is_empty());
}

#[test]
fn gt_without_predictions_counts_as_missed() {
    let mut v = PoseValidator::new(NK).unwrap();
    let gt = gt_one(true);
    v.update(&perfect(&gt, 0.9), &gt).unwrap();
    v.update(&Detections::empty(NK), &gt).unwrap();
    let m = v.compute();
    // One of two GTs found with precision 1 → recall 0.5.
    assert!((m.box_metrics.mr - 0.5).abs() < 1e-12, "{}", m.box_metrics.mr);
    assert!((m.box_metrics.mp - 1.0).abs() < 1e-12);
    // Only GT, never a prediction: everything zero.
    let mut v = PoseValidator::new(NK).unwrap();
    v.update(&Detections::empty(NK), &gt).unwrap();
    let m = v.compute();
    assert!(m.results_dict().iter().all(|(_, x)| *x == 0.0));
    assert_eq!(m.box_metrics.per_class.classes, vec![0]);
}

#[test]
fn perfect_prediction_gives_reference_0995() {
    // Trapezoid over the 101-point envelope with (1, 0) as the last sample: 0.99 + 0.005.
    let mut v = PoseValidator::new(NK).unwrap();
    let gt = gt_one(true);
    v.update(&perfect(&gt, 0.8), &gt).unwrap();
    let m = v.compute();
    for ms in [&m.box_metrics, &m.pose_metrics] {
        assert!((ms.map50 - 0.995).abs() < 1e-12, "{}", ms.map50);
        assert!((ms.map - 0.995).abs() < 1e-12);
    }
    assert!((m.fitness - 1.99).abs() < 1e-12);
}

#[test]
fn all_invisible_keypoints_match_box_but_never_pose() {
    let mut v = PoseValidator::new(NK).unwrap();
    let gt = gt_one(false);
    let tp = v.update(&perfect(&gt, 0.8), &gt).unwrap();
    assert_eq!(tp.tp_box, vec![[true; 10]]);
    assert_eq!(tp.tp_pose, vec![[false; 10]]);
    let m = v.compute();
    assert!((m.box_metrics.map - 0.995).abs() < 1e-12);
    assert_eq!(m.pose_metrics.map, 0.0);
    assert_eq!(m.pose_metrics.per_class.n_targets, vec![1], "still counted as a target");
}

#[test]
fn class_mismatch_never_matches() {
    let mut v = PoseValidator::new(NK).unwrap();
    let gt = gt_one(true);
    let mut d = perfect(&gt, 0.8);
    d.classes = vec![1];
    let tp = v.update(&d, &gt).unwrap();
    assert_eq!(tp.tp_box, vec![[false; 10]]);
    // single_cls folds classes together.
    let mut v = PoseValidator::new(NK).unwrap().single_cls(true);
    assert_eq!(v.update(&d, &gt).unwrap().tp_box, vec![[true; 10]]);
}

#[test]
fn nan_predictions_are_errors() {
    let gt = gt_one(true);
    let mut v = PoseValidator::new(NK).unwrap();
    for field in 0..3 {
        let mut d = perfect(&gt, 0.8);
        match field {
            0 => d.boxes[0][2] = f32::NAN,
            1 => d.scores[0] = f32::NAN,
            _ => d.keypoints[7] = f32::NAN,
        }
        let e = v.update(&d, &gt).unwrap_err();
        assert!(matches!(e, TrainerError::NonFinite { .. }), "{e}");
    }
    assert_eq!(v.seen(), 0, "failed updates accumulate nothing");
    let mut rows = vec![0f32; 6 + 3 * NK];
    rows[4] = f32::NAN;
    assert!(matches!(Detections::from_rows(&rows, 1, NK), Err(TrainerError::NonFinite { .. })));
    let e = GroundTruth::from_normalized(&[0.5, f32::NAN, 0.1, 0.1], &[0.0], &[0.0; 51], NK, 64, 64).unwrap_err();
    assert!(matches!(e, TrainerError::NonFinite { .. }));
}

#[test]
fn wrong_shapes_are_errors() {
    let e = Detections::from_rows(&[0.0; 10], 1, NK).unwrap_err();
    assert!(matches!(e, TrainerError::ShapeMismatch { .. }), "{e}");
    let e = GroundTruth::from_normalized(&[0.5; 4], &[0.0], &[0.0; 50], NK, 64, 64).unwrap_err();
    assert!(matches!(e, TrainerError::ShapeMismatch { .. }));
    let gt = gt_one(true);
    let mut d = perfect(&gt, 0.5);
    d.keypoints.pop();
    assert!(matches!(PoseValidator::new(NK).unwrap().update(&d, &gt), Err(TrainerError::ShapeMismatch { .. })));
    let d5 = Detections::empty(5);
    assert!(matches!(PoseValidator::new(NK).unwrap().update(&d5, &GroundTruth::empty(5)), Err(TrainerError::InvalidArgument { .. })));
    assert!(matches!(non_max_suppression(&[0.0; 7], 2, 1, 0, &NmsConfig::default()), Err(TrainerError::ShapeMismatch { .. })));
}

/// Channel-major candidates (4 + nc, n) without keypoints.
fn cands(rows: &[Vec<f32>]) -> Vec<f32> {
    let (n, ch) = (rows.len(), rows[0].len());
    (0..ch).flat_map(|c| rows.iter().map(move |r| r[c])).take(n * ch).collect()
}

#[test]
fn nms_is_class_aware_multilabel_and_capped() {
    // Two heavily overlapping boxes of different classes both survive; with nc = 2 the validator's
    // multi-label mode emits one row per (box, class) above the threshold.
    let p = cands(&[
        vec![50.0, 50.0, 20.0, 20.0, 0.9, 0.0005],
        vec![51.0, 50.0, 20.0, 20.0, 0.0, 0.8],
        vec![300.0, 300.0, 20.0, 20.0, 0.3, 0.2],
    ]);
    let o = non_max_suppression(&p, 3, 2, 0, &NmsConfig::default()).unwrap();
    assert_eq!(o.keep, vec![0, 1, 2, 2]);
    assert_eq!(o.detections.classes, vec![0, 1, 0, 1]);
    // Agnostic: the second box is suppressed by the first.
    let cfg = NmsConfig { agnostic: true, ..NmsConfig::default() };
    let o = non_max_suppression(&p, 3, 2, 0, &cfg).unwrap();
    assert_eq!(o.keep, vec![0, 2]);
    // max_det truncates after NMS, max_nms before it.
    let cfg = NmsConfig { max_det: 1, ..NmsConfig::default() };
    assert_eq!(non_max_suppression(&p, 3, 2, 0, &cfg).unwrap().keep, vec![0]);
    let cfg = NmsConfig { max_nms: 2, ..NmsConfig::default() };
    assert_eq!(non_max_suppression(&p, 3, 2, 0, &cfg).unwrap().keep, vec![0, 1]);
    assert_eq!(NmsConfig::default().with_max_gt(450).max_det, 450);
    // No candidate above conf: empty output.
    let p = cands(&[vec![1.0, 1.0, 2.0, 2.0, 0.001]]);
    assert!(non_max_suppression(&p, 1, 1, 0, &NmsConfig::default()).unwrap().detections.is_empty());
}

#[test]
fn gt_from_collated_batch() {
    // Ultralytics collate layout: targets of image 1, image 0, image 1; image 2 empty.
    let batch_idx = [1.0, 0.0, 1.0];
    let cls = [0.0, 0.0, 0.0];
    let boxes = [0.5, 0.5, 0.2, 0.4, 0.25, 0.25, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1];
    let kpts: Vec<f32> = (0..3 * NK * 3).map(|i| (i % 7) as f32 / 7.0).collect();
    let gts = GroundTruth::from_batch(&batch_idx, &cls, &boxes, &kpts, 3, NK, 200, 100).unwrap();
    assert_eq!(gts.iter().map(GroundTruth::len).collect::<Vec<_>>(), vec![1, 2, 0]);
    assert_eq!(gts[0].boxes[0], [0.0, 0.0, 100.0, 50.0]);
    assert_eq!(gts[1].boxes[1], [0.05 * 200.0, 0.05 * 100.0, 0.15 * 200.0, 0.15 * 100.0]);
    assert_eq!(gts[1].keypoints[3 * NK], kpts[2 * 3 * NK] * 200.0);
    let e = GroundTruth::from_batch(&[3.0], &[0.0], &[0.5; 4], &[0.0; 51], 3, NK, 8, 8).unwrap_err();
    assert!(matches!(e, TrainerError::InvalidArgument { .. }));
}

#[test]
fn coco_results_replace_map_and_fitness() {
    let mut v = PoseValidator::new(NK).unwrap();
    let gt = gt_one(true);
    v.update(&perfect(&gt, 0.8), &gt).unwrap();
    let m = v.compute();
    let d = m.coco_results_dict(&[0.4, 0.6], &[0.2, 0.5]).unwrap();
    let get = |k: &str| d.iter().find(|(n, _)| *n == k).unwrap().1;
    assert_eq!(get("metrics/mAP50-95(B)"), 0.4);
    assert_eq!(get("metrics/mAP50(P)"), 0.5);
    assert!((get("fitness") - (0.9 * 0.2 + 0.1 * 0.5)).abs() < 1e-15);
    assert_eq!(get("metrics/precision(B)"), m.box_metrics.mp);
    assert!(m.coco_results_dict(&[], &[0.1, 0.2]).is_err());
}

#[test]
fn low_level_shape_checks() {
    use ptl_trainer::metrics::{ap_per_class, match_predictions};
    assert!(matches!(match_predictions(&[0, 0], &[0], &[0.9]), Err(TrainerError::ShapeMismatch { .. })));
    assert!(matches!(ap_per_class(&[[true; 10]], &[0.5, 0.4], &[0, 0], &[0]), Err(TrainerError::ShapeMismatch { .. })));
    assert!(matches!(ap_per_class(&[[true; 10]], &[f32::NAN], &[0], &[0]), Err(TrainerError::NonFinite { .. })));
}

#[test]
fn export_undoes_letterbox_and_clips() {
    use ptl_trainer::metrics::coco::{detections_to_results, Letterbox};
    let det = Detections {
        boxes: vec![[30.0, 40.0, 130.0, 240.0]],
        scores: vec![0.123_456_7],
        classes: vec![0],
        keypoints: vec![5.0, 50.0, 0.5],
        nk: 1,
    };
    let lb = Letterbox { gain: 0.5, pad_x: 10.0, pad_y: 20.0, orig_w: 400.0, orig_h: 300.0 };
    let r = detections_to_results(7, &det, &lb, |c| c as i64 + 1).unwrap();
    assert_eq!(r[0].bbox, vec![40.0, 40.0, 200.0, 260.0]);
    assert_eq!(r[0].score, 0.12346);
    assert_eq!(r[0].keypoints, vec![0.0, 60.0, 0.5]);
    assert_eq!((r[0].image_id, r[0].category_id), (7, 1));
    let bad = Letterbox { gain: 0.0, ..lb };
    assert!(detections_to_results(7, &det, &bad, |c| c as i64).is_err());
}

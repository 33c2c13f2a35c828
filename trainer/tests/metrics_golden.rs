//! Ultralytics PoseValidator golden: NMS, GT scaling, IoU/OKS, tp matrices, AP/P/R/fitness, curves.

mod common;

use common::{goldens, max_abs_diff, to_f64, Golden};
use ptl_trainer::metrics::{
    box_iou, coco_sigmas, kpt_oks, non_max_suppression, Detections, GroundTruth, NmsConfig, PoseValidator, NUM_THRESHOLDS,
};

const NK: usize = 17;
const W: u32 = 640;
const H: u32 = 480;

fn tp_from(v: &[f32]) -> Vec<[bool; NUM_THRESHOLDS]> {
    v.chunks_exact(NUM_THRESHOLDS).map(|c| std::array::from_fn(|t| c[t] != 0.0)).collect()
}

fn json(dir: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("metrics/metrics.json")).expect("metrics.json");
    serde_json::from_str(&text).expect("metrics.json parses")
}

fn golden_preds(g: &Golden, p: &str) -> Detections {
    let b = g.f32(&format!("{p}.pred.bboxes_xyxy"));
    Detections {
        boxes: b.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]).collect(),
        scores: g.f32(&format!("{p}.pred.conf")),
        classes: g.f32(&format!("{p}.pred.cls")).iter().map(|&c| c as usize).collect(),
        keypoints: g.f32(&format!("{p}.pred.keypoints")),
        nk: NK,
    }
}

fn golden_gt(g: &Golden, p: &str) -> GroundTruth {
    GroundTruth::from_normalized(
        &g.f32(&format!("{p}.gt.bboxes_xywhn")),
        &g.f32(&format!("{p}.gt.cls")),
        &g.f32(&format!("{p}.gt.keypoints_n")),
        NK,
        W,
        H,
    )
    .expect("gt")
}

#[test]
fn nms_matches_golden() {
    let Some(dir) = goldens() else { return };
    let g = Golden::open(dir.join("metrics/inputs.safetensors"));
    let n_img = json(&dir)["n_images"].as_u64().expect("n_images") as usize;
    let mut max_dev = 0f64;
    for i in 0..n_img {
        let p = format!("img{i:02}");
        let raw = g.get(&format!("{p}.raw_candidates"));
        let n = raw.shape[1];
        let out = non_max_suppression(&raw.f32, n, 1, NK, &NmsConfig::default()).expect("nms");
        let keep: Vec<usize> = g.get(&format!("{p}.nms_keep")).i64.iter().map(|&k| k as usize).collect();
        assert_eq!(out.keep, keep, "{p}: kept candidates");
        let want = golden_preds(&g, &p);
        assert_eq!(out.detections.classes, want.classes, "{p}: classes");
        let d = &out.detections;
        for (a, b) in [
            (d.boxes.as_flattened(), want.boxes.as_flattened()),
            (&d.scores[..], &want.scores[..]),
            (&d.keypoints[..], &want.keypoints[..]),
        ] {
            max_dev = max_dev.max(max_abs_diff(&to_f64(a), &to_f64(b)));
        }
    }
    println!("NMS: max |deviation| of kept rows = {max_dev:e}");
    assert!(max_dev <= 1e-4, "NMS output deviates by {max_dev}");
}

#[test]
fn similarity_and_matching_match_golden() {
    let Some(dir) = goldens() else { return };
    let g = Golden::open(dir.join("metrics/inputs.safetensors"));
    let n_img = json(&dir)["n_images"].as_u64().expect("n_images") as usize;
    let sig = coco_sigmas();
    let (mut dev_iou, mut dev_oks, mut scale) = (0f64, 0f64, 0f64);
    for i in 0..n_img {
        let p = format!("img{i:02}");
        let pred = golden_preds(&g, &p);
        let gt = golden_gt(&g, &p);
        if !pred.is_empty() && !gt.is_empty() {
            let iou = box_iou(&gt.boxes, &pred.boxes);
            let oks = kpt_oks(&gt.keypoints, &pred.keypoints, &gt.oks_areas(), &sig).expect("oks");
            dev_iou = dev_iou.max(max_abs_diff(&to_f64(&iou), &to_f64(&g.f32(&format!("{p}.iou")))));
            dev_oks = dev_oks.max(max_abs_diff(&to_f64(&oks), &to_f64(&g.f32(&format!("{p}.oks")))));
            scale = scale.max(1.0);
        }
        let mut v = PoseValidator::new(NK).expect("validator");
        let tp = v.update(&pred, &gt).expect("update");
        assert_eq!(tp.tp_box, tp_from(&g.f32(&format!("{p}.tp_box"))), "{p}: tp_box");
        assert_eq!(tp.tp_pose, tp_from(&g.f32(&format!("{p}.tp_pose"))), "{p}: tp_pose");
    }
    println!("IoU max |dev| = {dev_iou:e}, OKS max |dev| = {dev_oks:e}");
    assert!(scale > 0.0);
    assert!(dev_iou <= 1e-6 && dev_oks <= 1e-6);
}

#[test]
fn validator_metrics_match_ultralytics() {
    let Some(dir) = goldens() else { return };
    let g = Golden::open(dir.join("metrics/inputs.safetensors"));
    let js = json(&dir);
    let n_img = js["n_images"].as_u64().expect("n_images") as usize;
    // Full pipeline: raw candidates → NMS → validator.
    let mut v = PoseValidator::new(NK).expect("validator");
    for i in 0..n_img {
        let p = format!("img{i:02}");
        let raw = g.get(&format!("{p}.raw_candidates"));
        let out = non_max_suppression(&raw.f32, raw.shape[1], 1, NK, &NmsConfig::default()).expect("nms");
        v.update(&out.detections, &golden_gt(&g, &p)).expect("update");
    }
    assert_eq!(v.seen(), n_img);
    let m = v.compute();
    let want = &js["ultralytics"]["results_dict"];
    let mut worst = 0f64;
    for (k, val) in m.results_dict() {
        let w = want[k].as_f64().unwrap_or_else(|| panic!("missing {k}"));
        let d = (val - w).abs();
        println!("{k:24} rust {val:.15} ultralytics {w:.15} |d| {d:e}");
        worst = worst.max(d);
    }
    for (name, ms) in [("box", &m.box_metrics), ("pose", &m.pose_metrics)] {
        let u = &js["ultralytics"][name];
        let all_ap: Vec<f64> = u["all_ap"][0].as_array().expect("all_ap").iter().map(|x| x.as_f64().unwrap()).collect();
        let d_ap = max_abs_diff(&ms.per_class.ap[0], &all_ap);
        let d_f1 = (ms.per_class.f1[0] - u["f1"][0].as_f64().unwrap()).abs();
        let d_75 = (ms.map75 - u["map75"].as_f64().unwrap()).abs();
        println!("{name}: AP per threshold max |d| {d_ap:e}, F1 |d| {d_f1:e}, mAP75 |d| {d_75:e}");
        worst = worst.max(d_ap).max(d_f1).max(d_75);
        // Curves (stored as float32).
        let pc = &ms.per_class;
        for (key, ours) in [
            ("curve_x", pc.x.clone()),
            ("p_curve", pc.p_curve[0].clone()),
            ("r_curve", pc.r_curve[0].clone()),
            ("f1_curve", pc.f1_curve[0].clone()),
            ("pr_prec_values", pc.prec_values[0].clone()),
        ] {
            let gold = to_f64(&g.f32(&format!("{name}.{key}")));
            let d = max_abs_diff(&ours, &gold);
            println!("{name}.{key}: max |d| {d:e}");
            assert!(d <= 1e-6, "{name}.{key} deviates by {d}");
        }
    }
    println!("worst metric deviation {worst:e}");
    assert!(worst <= 1e-6, "metrics deviate by {worst}");

    // Concatenated stats stored by the generator.
    let all_tp = tp_from(&g.f32("all.tp_box"));
    let all_tp_p = tp_from(&g.f32("all.tp_pose"));
    let mut v2 = PoseValidator::new(NK).expect("validator");
    let mut ours_tp = Vec::new();
    let mut ours_tp_p = Vec::new();
    for i in 0..n_img {
        let p = format!("img{i:02}");
        let t = v2.update(&golden_preds(&g, &p), &golden_gt(&g, &p)).expect("update");
        ours_tp.extend(t.tp_box);
        ours_tp_p.extend(t.tp_pose);
    }
    assert_eq!(ours_tp, all_tp);
    assert_eq!(ours_tp_p, all_tp_p);
    assert_eq!(v2.compute(), m, "golden post-NMS predictions give the same metrics");
}

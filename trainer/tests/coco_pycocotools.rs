//! Real pycocotools (a python3 subprocess) against our COCOeval port on the same files: the
//! goldens' `coco_gt.json` + `coco_results.json`, and the `val_gt.json` + `predictions.json`
//! that a tiny training run with `save_json=true` writes. Without pycocotools the tests print
//! `skipping: pycocotools not installed`, except under `CI`, where they fail (`.ci/run` installs it).

mod common;
mod fit_support;

use std::path::Path;
use std::process::Command;

use ptl_trainer::metrics::coco::{evaluate, load_dataset, load_results, EvalParams, IouType};
use ptl_trainer::pose::{fit, validate_with, PoseTrainConfig, ValOptions};

/// Runs COCOeval for "bbox" and "keypoints" (COCO's 17 keypoint sigmas, set explicitly) and
/// prints `{type: {stats, kpt_oks_sigmas}}` as JSON; pycocotools' own prints go to stderr.
const SCRIPT: &str = r#"
import contextlib, json, sys
import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
COCO_SIGMAS = np.array([.26, .25, .25, .35, .35, .79, .79, .72, .72, .62, .62, 1.07, 1.07, .87, .87, .89, .89]) / 10.0
out = {}
with contextlib.redirect_stdout(sys.stderr):
    gt = COCO(sys.argv[1])
    dt = gt.loadRes(sys.argv[2])
    for t in ("bbox", "keypoints"):
        e = COCOeval(gt, dt, t)
        if t == "keypoints":
            e.params.kpt_oks_sigmas = COCO_SIGMAS
        e.evaluate()
        e.accumulate()
        e.summarize()
        out[t] = {"stats": [float(s) for s in e.stats]}
        if t == "keypoints":
            out[t]["kpt_oks_sigmas"] = [float(s) for s in e.params.kpt_oks_sigmas]
print(json.dumps(out))
"#;

/// True when python3 can import pycocotools; false (after printing the skip line) when it
/// cannot and `CI` is unset; a failure when it cannot under `CI`.
fn pycocotools_available() -> bool {
    let ok =
        Command::new("python3").args(["-c", "import pycocotools.coco, pycocotools.cocoeval"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but python3 cannot import pycocotools: .ci/run must install it (python3 -m pip install pycocotools)"
        );
        eprintln!("skipping: pycocotools not installed");
    }
    ok
}

/// pycocotools' stats for both iou types on the two files.
fn pycocotools(gt: &Path, results: &Path) -> serde_json::Value {
    let o = Command::new("python3").arg("-c").arg(SCRIPT).arg(gt).arg(results).output().expect("python3 runs");
    assert!(o.status.success(), "pycocotools failed on {} + {}:\n{}", gt.display(), results.display(), String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("the script prints JSON")
}

/// Our evaluator on the same files vs pycocotools: every stat within 1e-3 and the same keypoint
/// sigmas. Returns (type, ours, theirs) for the caller's own checks.
fn compare(gt_path: &Path, results_path: &Path) -> Vec<(&'static str, Vec<f64>, Vec<f64>)> {
    let py = pycocotools(gt_path, results_path);
    let gt = load_dataset(gt_path).expect("our reader takes the GT");
    let res = load_results(results_path).expect("our reader takes the results");
    let floats = |v: &serde_json::Value| -> Vec<f64> { v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number")).collect() };
    let mut out = Vec::new();
    for (key, ty) in [("bbox", IouType::Bbox), ("keypoints", IouType::Keypoints)] {
        let ours = evaluate(&gt, &res, ty).expect("our COCOeval");
        let theirs = floats(&py[key]["stats"]);
        println!("{}  {key}", gt_path.display());
        println!("  pycocotools {theirs:.6?}");
        println!("  ours        {:.6?}", ours.stats);
        assert_eq!(ours.stats.len(), theirs.len(), "{key}: number of stats");
        let worst = ours.stats.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        println!("  max |ours − pycocotools| = {worst:e}");
        for (i, (a, b)) in ours.stats.iter().zip(&theirs).enumerate() {
            assert!((a - b).abs() <= 1e-3, "{key} stat {i}: ours {a} vs pycocotools {b}");
        }
        if ty == IouType::Keypoints {
            let sigmas = floats(&py[key]["kpt_oks_sigmas"]);
            let want = EvalParams::new(ty, &gt).kpt_oks_sigmas;
            assert_eq!(sigmas.len(), want.len());
            assert!(sigmas.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-12), "sigmas {sigmas:?} vs ours {want:?}");
        }
        out.push((key, ours.stats, theirs));
    }
    out
}

#[test]
fn goldens_pycocotools_vs_ours() {
    let Some(dir) = common::goldens() else { return };
    if !pycocotools_available() {
        return;
    }
    let m = dir.join("metrics");
    let stats = compare(&m.join("coco_gt.json"), &m.join("coco_results.json"));
    // The goldens have real matches: AP is far from 0 for both types.
    assert!(stats.iter().all(|(_, ours, _)| ours[0] > 0.1), "{stats:?}");
}

#[test]
fn fit_with_save_json_writes_files_pycocotools_scores_like_ours() {
    let save = fit_support::scratch("coco_json_fit");
    let cfg = PoseTrainConfig { save_json: true, ..fit_support::tiny_in(&save) };
    fit(&cfg, vec![]).expect("tiny fit");
    let (gt_path, res_path) = (save.join("val_gt.json"), save.join("predictions.json"));
    let gt = load_dataset(&gt_path).expect("val_gt.json");
    let res = load_results(&res_path).expect("predictions.json");
    // The ground truth is the val split, labels in original pixels, with COCO's keypoint metadata.
    let ds = ptl_data::PoseDataset::open_yaml(&cfg.data, "val", &ptl_data::OpenOptions { imgsz: 64, verbose: false, ..Default::default() })
        .expect("val split");
    assert_eq!(gt.images.len(), ds.len());
    assert_eq!(gt.annotations.len(), ds.items.iter().map(|it| it.labels.len()).sum::<usize>());
    assert!(!gt.annotations.is_empty(), "the tiny val split has people");
    let cat = &gt.categories[0];
    assert_eq!((cat.id, cat.name.as_str(), cat.keypoints.len(), cat.skeleton.len()), (1, "person", 17, 19));
    for a in &gt.annotations {
        let img = gt.images.iter().find(|i| i.id == a.image_id).expect("annotation's image");
        let [x, y, w, h] = a.bbox;
        assert!(x >= -1e-3 && y >= -1e-3 && x + w <= f64::from(img.width) + 1e-3 && y + h <= f64::from(img.height) + 1e-3, "{a:?}");
        assert_eq!(a.num_keypoints, Some(a.keypoints.chunks(3).filter(|k| k[2] > 0.0).count() as i64));
    }
    // Results: every image id known, boxes inside the original image, 17 keypoints each.
    assert!(!res.is_empty(), "a fitted model has detections at conf 0.001");
    for r in &res {
        let img = gt.images.iter().find(|i| i.id == r.image_id).expect("result's image is in the GT");
        assert_eq!((r.category_id, r.bbox.len(), r.keypoints.len()), (1, 4, 51));
        assert!(r.bbox[0] >= 0.0 && r.bbox[0] + r.bbox[2] <= f64::from(img.width) + 1e-3, "{r:?}");
    }
    if !pycocotools_available() {
        return;
    }
    compare(&gt_path, &res_path);
}

#[test]
fn save_json_into_an_unwritable_place_names_the_path() {
    let dir = fit_support::scratch("coco_json_bad");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a_file");
    std::fs::write(&file, b"x").unwrap();
    let ds = std::sync::Arc::new(
        ptl_data::PoseDataset::open_yaml(
            &fit_support::dataset(),
            "val",
            &ptl_data::OpenOptions { imgsz: 64, verbose: false, ..Default::default() },
        )
        .unwrap(),
    );
    let model = ptl_heads::PoseModel::new(
        ptl_heads::ModelConfig { nc: 1, kpt_shape: (17, 3), scale: ptl_heads::Scale::N },
        ptl_autograd::Device::Cpu,
        0,
    )
    .unwrap();
    let opts = ValOptions { save_json: Some(file.join("val")), ..ValOptions::default() };
    let e = validate_with(&model, &ds, 2, ptl_autograd::Device::Cpu, ptl_trainer::pose::Precision::F32, &opts).unwrap_err();
    assert!(matches!(&e, ptl_trainer::TrainerError::Io { path, .. } if *path == file.join("val")), "{e}");
    assert!(e.to_string().contains("a_file"), "{e}");
}

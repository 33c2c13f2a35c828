//! Validation parity with Ultralytics: a YOLO26n-pose that Ultralytics 8.4.190 trained on a
//! `ptl data synth` set (320 training images at 128 px, seed 347), its weights rounded to f16
//! (`fixtures/val_parity/weights.safetensors`),
//! validated by Ultralytics on the CPU in fp32 (`fixtures/val_parity/ultralytics.json`, made by
//! `fixtures/val_parity/make_val_parity.py`): `ptl val` of the same weights on the same images at
//! the same imgsz, batch, conf and IoU gives every reported metric (P, R, mAP50, mAP50-95 for
//! boxes and keypoints) within 1e-3, and `ptl predict` gives Ultralytics' boxes and keypoints
//! within 0.5 px on the first validation images.

mod common;

use std::path::{Path, PathBuf};

use common::{ptl, text};

fn fixture() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/val_parity"))
}

/// The validation images (PNG: lossless, so both tools see the same pixels — ptl's JPEG decoder
/// and libjpeg-turbo differ in the last bits of about 1% of the values, which moves the OKS of
/// these small people) and labels, checked against the fixture's SHA-256, with a data yaml.
fn dataset(dir: &Path, expected: &serde_json::Value) -> PathBuf {
    let root = fixture().join("ds");
    let files = expected["files_sha256"].as_object().expect("files_sha256");
    assert_eq!(files.len(), 32, "16 images and their labels");
    for (rel, sha) in files {
        let bytes = std::fs::read(root.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert_eq!(&ptl_autograd::hash::bytes_hash(&bytes), sha.as_str().expect("hex"), "{rel}: not the fixture's bytes");
    }
    let yaml = dir.join("data.yaml");
    let flip = "0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15";
    let text = format!(
        "path: '{}'\ntrain: images/val\nval: images/val\nkpt_shape: [17, 3]\nflip_idx: [{flip}]\nnames:\n  0: person\n",
        root.display()
    );
    std::fs::write(&yaml, text).expect("data.yaml");
    yaml
}

/// `ptl val`'s printed metrics (`  metrics/mAP50(B)   0.1234`).
fn printed_metrics(out: &str) -> Vec<(String, f64)> {
    out.lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>().as_slice() {
            [k, v] if k.starts_with("metrics/") => v.parse().ok().map(|v| (k.to_string(), v)),
            _ => None,
        })
        .collect()
}

#[test]
fn ptl_val_and_predict_match_ultralytics_on_the_same_weights() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("ultralytics.json")).expect("fixture")).expect("JSON");
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dataset(dir.path(), &expected);
    let weights = fixture().join("weights.safetensors");
    let v = &expected["validation"];
    let o = ptl(
        &[
            "val",
            &format!("model={}", weights.display()),
            &format!("data={}", data.display()),
            &format!("imgsz={}", v["imgsz"]),
            &format!("batch={}", v["batch"]),
            &format!("conf={}", v["conf"]),
            &format!("iou={}", v["iou"]),
            "device=cpu",
            "plots=false",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    let got = printed_metrics(&text(&o));
    let want = expected["metrics"].as_object().expect("metrics");
    assert_eq!(got.len(), want.len(), "{}", text(&o));
    let mut worst = (0f64, String::new());
    for (k, w) in want {
        let w = w.as_f64().expect("number");
        let g = got.iter().find(|(n, _)| n == k).unwrap_or_else(|| panic!("ptl val printed no {k}")).1;
        println!("{k:<24} ptl {g:.4}  Ultralytics {w:.4}");
        if (g - w).abs() > worst.0 {
            worst = ((g - w).abs(), k.clone());
        }
    }
    assert!(worst.0 <= 1e-3, "{}: |ptl − Ultralytics| = {:.1e} > 1e-3", worst.1, worst.0);
    assert!(want.values().any(|w| w.as_f64().unwrap_or(0.0) > 0.1), "the weights detect something: the parity means something");
    println!("worst metric difference {:.1e} ({})", worst.0, worst.1);

    // Prediction on the first validation images.
    let p = &expected["predict"];
    let (mut worst_px, mut worst_score, mut compared) = (0f64, 0f64, 0usize);
    for case in expected["predictions"].as_array().expect("predictions") {
        let image = fixture().join("ds").join(case["image"].as_str().expect("image"));
        let out = dir.path().join("pred");
        let o = ptl(
            &[
                "predict",
                &format!("model={}", weights.display()),
                &format!("source={}", image.display()),
                &format!("imgsz={}", p["imgsz"]),
                &format!("conf={}", p["conf"]),
                &format!("iou={}", p["iou"]),
                "device=cpu",
                &format!("project={}", out.display()),
            ],
            dir.path(),
        );
        assert!(o.status.success(), "{}", text(&o));
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("predictions.json")).expect("json")).expect("JSON");
        let mine = json[0]["persons"].as_array().expect("persons").clone();
        let theirs = case["boxes_xyxy"].as_array().expect("boxes");
        assert_eq!(mine.len(), theirs.len(), "{}: detections", image.display());
        let mut used = vec![false; mine.len()];
        for (i, b) in theirs.iter().enumerate() {
            let b: Vec<f64> = b.as_array().expect("box").iter().map(|v| v.as_f64().expect("x")).collect();
            let dist = |m: &serde_json::Value| {
                let mb: Vec<f64> = m["box_xyxy"].as_array().expect("box").iter().map(|v| v.as_f64().expect("x")).collect();
                mb.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f64, f64::max)
            };
            let j =
                (0..mine.len()).filter(|&j| !used[j]).min_by(|&x, &y| dist(&mine[x]).total_cmp(&dist(&mine[y]))).expect("a detection left");
            used[j] = true;
            assert!(dist(&mine[j]) <= 0.5, "{}: box {i} {b:?} vs ptl {}", image.display(), mine[j]["box_xyxy"]);
            worst_px = worst_px.max(dist(&mine[j]));
            compared += 1;
            let kt = case["keypoints"][i].as_array().expect("keypoints");
            let km = mine[j]["keypoints"].as_array().expect("keypoints");
            for (k, (a, m)) in kt.iter().zip(km).enumerate() {
                for c in 0..2 {
                    let (a, m) = (a[c].as_f64().expect("x"), m[c].as_f64().expect("x"));
                    assert!((a - m).abs() <= 0.5, "{}: detection {i} keypoint {k}: Ultralytics {a} vs ptl {m}", image.display());
                    worst_px = worst_px.max((a - m).abs());
                }
            }
            let (sa, sm) = (case["scores"][i].as_f64().expect("score"), mine[j]["score"].as_f64().expect("score"));
            assert!((sa - sm).abs() <= 1e-3, "{}: score {sa} vs {sm}", image.display());
            worst_score = worst_score.max((sa - sm).abs());
        }
    }
    println!("{compared} detections: boxes and keypoints within {worst_px:.2e} px, scores within {worst_score:.1e}");
    assert!(compared >= 3, "the weights find people in the first images: the comparison means something");
}

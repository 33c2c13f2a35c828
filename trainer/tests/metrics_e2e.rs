//! End-to-end (o2o, nms=False) decode + top-k vs the Ultralytics golden `eval_calibrated.e2e_o2o_topk`.

mod common;

use common::{goldens, max_abs_diff, to_f64, Golden};
use ptl_trainer::metrics::{decode_o2o, e2e_postprocess, e2e_topk, PoseValidator};

const NK: usize = 17;

#[test]
fn e2e_topk_matches_golden() {
    let Some(dir) = goldens() else { return };
    let g = Golden::open(dir.join("model/forward.safetensors"));
    let boxes = g.get("eval_calibrated.one2one.boxes");
    let (batch, a) = (boxes.shape[0], boxes.shape[2]);
    let scores = g.get("eval_calibrated.one2one.scores");
    let nc = scores.shape[1];
    let kpts = g.f32("eval_calibrated.one2one.kpts");
    let anchors = g.f32("anchors");
    let strides = g.f32("anchor_strides");
    let want = g.get("eval_calibrated.e2e_o2o_topk");
    let k = want.shape[1];

    let decoded = decode_o2o(&boxes.f32, &scores.f32, &kpts, &anchors, &strides, batch, nc, NK).expect("decode");
    assert_eq!(decoded.len(), batch * a * (4 + nc + 3 * NK));
    let rows = e2e_topk(&decoded, batch, nc, NK, 300).expect("topk");
    assert_eq!(rows.len(), want.f32.len(), "shape (B, k, 6 + 3·nk)");

    let width = 6 + 3 * NK;
    let ours = to_f64(&rows);
    let gold = to_f64(&want.f32);
    let scale = gold.iter().fold(0f64, |m, v| m.max(v.abs()));
    let dev = max_abs_diff(&ours, &gold);
    // Per column group, for the report.
    let col_dev = |lo: usize, hi: usize| {
        ours.chunks_exact(width)
            .zip(gold.chunks_exact(width))
            .flat_map(|(a, b)| (lo..hi).map(move |c| (a[c] - b[c]).abs()))
            .fold(0f64, f64::max)
    };
    println!(
        "e2e top-{k}: max |dev| {dev:e} (scale {scale}); boxes {:e}, scores {:e}, class {:e}, kpts {:e}",
        col_dev(0, 4),
        col_dev(4, 5),
        col_dev(5, 6),
        col_dev(6, width)
    );
    assert_eq!(col_dev(5, 6), 0.0, "class column");
    assert!(dev <= 1e-4, "e2e output deviates by {dev}");

    // Caller-side filter: rows with score > conf, in order, at most max_det.
    let img0 = &rows[..k * width];
    let det = e2e_postprocess(img0, NK, 0.001, 300).expect("postprocess");
    let expected = img0.chunks_exact(width).filter(|r| r[4] > 0.001).count();
    assert_eq!(det.len(), expected);
    assert!(det.scores.windows(2).all(|w| w[0] >= w[1]), "sorted by score");
    let det5 = e2e_postprocess(img0, NK, 0.0, 5).expect("postprocess");
    assert_eq!(det5.len(), 5);
    // The e2e detections feed the validator like NMS output.
    let mut v = PoseValidator::new(NK).expect("validator");
    v.update(&det5, &ptl_trainer::metrics::GroundTruth::empty(NK)).expect("update");
}

/// The default path on a real model output layout (B, 4 + nc + 51, A): NMS runs on
/// `eval_calibrated.decoded_o2m` and every kept row is a candidate above the threshold.
#[test]
fn nms_on_model_output_layout() {
    let Some(dir) = goldens() else { return };
    let g = Golden::open(dir.join("model/forward.safetensors"));
    let dec = g.get("eval_calibrated.decoded_o2m");
    let (batch, ch, a) = (dec.shape[0], dec.shape[1], dec.shape[2]);
    let nc = ch - 4 - 3 * NK;
    let cfg = ptl_trainer::metrics::NmsConfig::default();
    let outs = ptl_trainer::metrics::nms::non_max_suppression_batch(&dec.f32, batch, a, nc, NK, &cfg).expect("nms");
    assert_eq!(outs.len(), batch);
    for (b, o) in outs.iter().enumerate() {
        let img = &dec.f32[b * ch * a..(b + 1) * ch * a];
        assert!(o.detections.len() <= cfg.max_det);
        assert!(o.detections.scores.windows(2).all(|w| w[0] >= w[1]));
        for (r, &i) in o.keep.iter().enumerate() {
            assert_eq!(o.detections.scores[r], img[4 * a + i]);
            assert!(img[4 * a + i] > cfg.conf_thres);
            assert_eq!(o.detections.keypoints[r * 51], img[(4 + nc) * a + i]);
        }
    }
}

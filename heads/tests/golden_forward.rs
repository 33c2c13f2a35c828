//! Golden forward tests against the goldens' `model/` (Ultralytics 8.4.190, fp32 CPU).
//! Device-generic: each check takes a `Device`; CUDA variants run with `--features cuda`.

mod common;

use common::*;
use ptl_autograd::module::state_dict;
use ptl_autograd::{DType, Device, Module, Tensor, TensorKind};
use ptl_heads::Branch;

const TOL: f64 = 1e-4;
/// The bf16 tolerance; met by the head on golden features (measured ≤ 7e-3).
const BF16_TOL: f64 = 2e-2;
/// Whole-network bf16 bound. bf16 operand rounding (2^-9 relative) compounds through the 23
/// randomly initialised backbone/neck layers with train-mode BN: measured on the CPU, layer 1 is
/// already 6.6e-3 off and layer 22 2.2e-1 (max |a − b| / max |b|), so 2e-2 cannot hold for the
/// full chain; this bound only guards against gross errors (wrong casts, lost gradients).
const BF16_FULL_TOL: f64 = 0.5;

/// Train-mode forward: both branches' raw outputs, features, per-layer outputs and the BN
/// buffers after the step. `compute` = activation dtype (F32, or BF16 for autocast-style).
fn check_train_forward(device: Device, compute: DType, tol: f64) {
    let Some(dir) = model_dir() else { return };
    let model = golden_model(&dir, device);
    let g = load(&dir, "forward.safetensors", device);
    let gl = load(&dir, "forward_layers.safetensors", device);
    let x = get(&g, "input").clone();
    let _ac = ptl_autograd::AutocastGuard::new(if compute == DType::F32 { None } else { Some(compute) });
    let mut layer_out: Vec<(usize, Tensor)> = Vec::new();
    let feats = model
        .forward_features_with(&x, &mut |i, t| {
            if gl.contains_key(&format!("layer.{i}")) {
                layer_out.push((i, t.narrow(0, 0, 1).expect("img0")));
            }
        })
        .expect("features");
    let out = model.head().forward(&feats).expect("head");
    let f32_ = |t: &Tensor| t.to_dtype(DType::F32).expect("f32");
    let mut r = Report::default();
    for b in Branch::ALL {
        let o = out.branch(b);
        let p = format!("train.{}", b.name());
        r.check(&format!("{p}.boxes"), "boxes", &f32_(&o.boxes), get(&g, &format!("{p}.boxes")));
        r.check(&format!("{p}.scores"), "scores", &f32_(&o.scores), get(&g, &format!("{p}.scores")));
        r.check(&format!("{p}.kpts"), "kpts", &f32_(&o.kpts), get(&g, &format!("{p}.kpts")));
        let sig = o.kpts_sigma.as_ref().expect("training mode yields kpts_sigma");
        r.check(&format!("{p}.kpts_sigma"), "kpts_sigma", &f32_(sig), get(&g, &format!("{p}.kpts_sigma")));
    }
    for (i, f) in out.feats.iter().enumerate() {
        r.check("train.feats", &format!("feats.{i}"), &f32_(f), get(&g, &format!("train.feats.{i}")));
    }
    assert_eq!(layer_out.len(), gl.len(), "every golden layer output was produced");
    for (i, t) in &layer_out {
        let k = format!("layer.{i}");
        r.check("layers (image 0)", &k, &f32_(t), get(&gl, &k));
        if std::env::var("PTL_HEADS_VERBOSE").is_ok() {
            println!("{k}: {:.3e}", rel_dev(&k, &f32_(t), get(&gl, &k)));
        }
    }
    // BN buffers after the one train-mode forward.
    let mut n_bn = 0;
    for (name, t, kind) in state_dict(&model) {
        if kind != TensorKind::Buffer || !name.contains(".bn.") {
            continue;
        }
        let k = format!("bn_after.{name}");
        let gold = get(&g, &k);
        if name.ends_with("num_batches_tracked") {
            assert_eq!(t.to_f64_vec().expect("v"), gold.to_f64_vec().expect("v"), "{k}");
        } else {
            r.check("bn_after running stats", &name, &t, gold);
            let abs =
                t.sub(&gold.to_dtype(t.dtype()).expect("cast")).and_then(|d| d.abs()).and_then(|d| d.max_all()).and_then(|d| d.item());
            r.add("bn_after running stats (abs)", &name, abs.expect("abs dev"));
        }
        n_bn += 1;
    }
    assert_eq!(n_bn, 378, "BN buffers compared");
    if compute != DType::F32 {
        // Absolute BN-statistics deviations are not meaningful relative to bf16 noise; keep the
        // relative groups only.
        r.groups.retain(|g| !g.0.ends_with("(abs)"));
    }
    r.assert_below(tol, &format!("train {device} {compute}"));
    // BN statistics: additionally within 1e-5 absolute in fp32. (Relative to max |b| they sit at
    // the golden's own float32 noise: the README measures 1.35e-5 for the worst BN buffer
    // against a float64 re-run, so a 1e-5 *relative* bound is below the reference's precision.)
    if compute == DType::F32 {
        let bn = r.groups.iter().find(|g| g.0 == "bn_after running stats (abs)").expect("bn group");
        assert!(bn.1 <= 1e-5, "BN running stats deviate {:.3e} > 1e-5 absolute ({})", bn.1, bn.2);
    }
}

/// Eval-mode forward with the fresh BN statistics, and with the "calibrated" ones.
fn check_eval_forward(device: Device, compute: DType, tol: f64) {
    let Some(dir) = model_dir() else { return };
    let mut model = golden_model(&dir, device);
    let g = load(&dir, "forward.safetensors", device);
    let x = get(&g, "input").clone();
    let _ac = ptl_autograd::AutocastGuard::new(if compute == DType::F32 { None } else { Some(compute) });
    model.set_training(false);
    let f32_ = |t: &Tensor| t.to_dtype(DType::F32).expect("f32");
    let mut r = Report::default();
    for variant in ["eval", "eval_calibrated"] {
        if variant == "eval_calibrated" {
            for (name, t, _) in state_dict(&model) {
                if name.ends_with("running_mean") || name.ends_with("running_var") {
                    let v = get(&g, &format!("eval_calibrated.bn.{name}"));
                    ptl_autograd::no_grad(|| t.copy_(v)).expect("set stats");
                }
            }
        }
        let before = model.state_dict().iter().map(|e| e.1.to_f64_vec().expect("v")).collect::<Vec<_>>();
        let p = ptl_autograd::no_grad(|| model.predict(&x)).expect("predict");
        let after = model.state_dict().iter().map(|e| e.1.to_f64_vec().expect("v")).collect::<Vec<_>>();
        assert!(before == after, "eval forward must not touch buffers");
        r.check(&format!("{variant}.decoded_o2m"), "decoded", &f32_(&p.decoded), get(&g, &format!("{variant}.decoded_o2m")));
        for b in Branch::ALL {
            let o = p.raw.branch(b);
            assert!(o.kpts_sigma.is_none(), "eval mode has no sigma views");
            let k = format!("{variant}.{}", b.name());
            r.check(&format!("{k}.boxes"), "boxes", &f32_(&o.boxes), get(&g, &format!("{k}.boxes")));
            r.check(&format!("{k}.scores"), "scores", &f32_(&o.scores), get(&g, &format!("{k}.scores")));
            r.check(&format!("{k}.kpts"), "kpts", &f32_(&o.kpts), get(&g, &format!("{k}.kpts")));
        }
        if variant == "eval" {
            r.check("anchors", "anchors", &p.anchors, get(&g, "anchors"));
            r.check("anchor_strides", "anchor_strides", &p.strides, get(&g, "anchor_strides"));
        }
    }
    r.assert_below(tol, &format!("eval {device} {compute}"));
}

#[test]
fn train_forward_cpu_fp32() {
    check_train_forward(Device::Cpu, DType::F32, TOL);
}

#[test]
fn eval_forward_cpu_fp32() {
    check_eval_forward(Device::Cpu, DType::F32, TOL);
}

#[cfg(feature = "cuda")]
#[test]
fn train_forward_cuda_fp32() {
    check_train_forward(Device::Cuda(0), DType::F32, TOL);
}

#[cfg(feature = "cuda")]
#[test]
fn eval_forward_cuda_fp32() {
    check_eval_forward(Device::Cuda(0), DType::F32, TOL);
}

#[cfg(feature = "cuda")]
#[test]
fn train_forward_cuda_bf16_autocast() {
    check_train_forward(Device::Cuda(0), DType::BF16, BF16_FULL_TOL);
}

#[cfg(feature = "cuda")]
#[test]
fn eval_forward_cuda_bf16_autocast() {
    check_eval_forward(Device::Cuda(0), DType::BF16, BF16_FULL_TOL);
}

/// Autocast-style execution on the CPU: activations in bf16, f32 master weights cast at use,
/// BN statistics accumulated in f32.
#[test]
fn train_forward_cpu_bf16_autocast() {
    check_train_forward(Device::Cpu, DType::BF16, BF16_FULL_TOL);
}

#[test]
fn eval_forward_cpu_bf16_autocast() {
    check_eval_forward(Device::Cpu, DType::BF16, BF16_FULL_TOL);
}

/// The head alone on the golden neck features (train mode), under autocast `compute`: isolates
/// the head's precision from the error accumulated through the 23 backbone/neck layers.
fn check_head_on_golden_feats(device: Device, compute: DType, tol: f64) {
    let Some(dir) = model_dir() else { return };
    let model = golden_model(&dir, device);
    let g = load(&dir, "forward.safetensors", device);
    let feats: Vec<Tensor> = (0..3).map(|i| get(&g, &format!("train.feats.{i}")).clone()).collect();
    let _ac = ptl_autograd::AutocastGuard::new(if compute == DType::F32 { None } else { Some(compute) });
    let out = model.head().forward(&feats).expect("head");
    let f32_ = |t: &Tensor| t.to_dtype(DType::F32).expect("f32");
    let mut r = Report::default();
    for b in Branch::ALL {
        let o = out.branch(b);
        let p = format!("train.{}", b.name());
        r.check(&format!("head.{p}.boxes"), "boxes", &f32_(&o.boxes), get(&g, &format!("{p}.boxes")));
        r.check(&format!("head.{p}.scores"), "scores", &f32_(&o.scores), get(&g, &format!("{p}.scores")));
        r.check(&format!("head.{p}.kpts"), "kpts", &f32_(&o.kpts), get(&g, &format!("{p}.kpts")));
        let sig = o.kpts_sigma.as_ref().expect("sigma");
        r.check(&format!("head.{p}.kpts_sigma"), "kpts_sigma", &f32_(sig), get(&g, &format!("{p}.kpts_sigma")));
    }
    r.assert_below(tol, &format!("head-only {device} {compute}"));
}

#[test]
fn head_on_golden_feats_cpu_fp32() {
    check_head_on_golden_feats(Device::Cpu, DType::F32, TOL);
}

#[test]
fn head_on_golden_feats_cpu_bf16_autocast() {
    check_head_on_golden_feats(Device::Cpu, DType::BF16, BF16_TOL);
}

#[cfg(feature = "cuda")]
#[test]
fn head_on_golden_feats_cuda_bf16_autocast() {
    check_head_on_golden_feats(Device::Cuda(0), DType::BF16, BF16_TOL);
}

/// The end-to-end path: o2o outputs decoded with (x1, y1, x2, y2) boxes; a test-only top-300
/// selection (nc = 1, so the anchor and (anchor, class) top-k coincide) reproduces
/// `eval_calibrated.e2e_o2o_topk`. (The library leaves top-k to the metrics code.)
fn check_e2e_calibrated(device: Device) {
    let Some(dir) = model_dir() else { return };
    let mut model = golden_model(&dir, device);
    let g = load(&dir, "forward.safetensors", device);
    model.set_training(false);
    for (name, t, _) in state_dict(&model) {
        if name.ends_with("running_mean") || name.ends_with("running_var") {
            ptl_autograd::no_grad(|| t.copy_(get(&g, &format!("eval_calibrated.bn.{name}")))).expect("set stats");
        }
    }
    let p = ptl_autograd::no_grad(|| model.predict(get(&g, "input"))).expect("predict");
    let head = model.head();
    let dec = head.decode(&p.raw.one2one, &p.anchors, &p.strides, false).expect("decode o2o").to_vec::<f32>().expect("v");
    let gold = get(&g, "eval_calibrated.e2e_o2o_topk");
    let (b, k, w) = (gold.dims()[0], gold.dims()[1], gold.dims()[2]);
    let (c, a) = (56, p.anchors.dims()[0]);
    let kk = (k + 8).min(a); // our candidates: the reference's k plus a margin for boundary ties
    let mut rows = Vec::with_capacity(b * kk * w);
    for bi in 0..b {
        let at = |ch: usize, ai: usize| dec[(bi * c + ch) * a + ai];
        let mut idx: Vec<usize> = (0..a).collect();
        idx.sort_by(|&x, &y| at(4, y).total_cmp(&at(4, x)));
        for &ai in idx.iter().take(k + 8) {
            rows.extend([at(0, ai), at(1, ai), at(2, ai), at(3, ai), at(4, ai), 0.0]);
            rows.extend((5..c).map(|ch| at(ch, ai)));
        }
    }
    // Rows whose scores tie to float32 precision may come in either order (e.g. ranks 250/251 of
    // image 0 differ by 4e-6 relative in the reference and tie on the CPU): pair each reference
    // row with the best-matching row of ours among ranks r−8..r+8 whose score agrees to 1e-4 of
    // the largest score, then compare everything.
    let gv = gold.to_vec::<f32>().expect("gold");
    let smax = (0..b * k).map(|r| gv[r * w + 4].abs()).fold(0.0f32, f32::max);
    let mut paired = Vec::with_capacity(rows.len());
    let mut swaps = 0;
    for bi in 0..b {
        let mut used = vec![false; kk];
        for r in 0..k {
            let gr = &gv[(bi * k + r) * w..(bi * k + r + 1) * w];
            let dev = |q: usize| (0..w).map(|j| (rows[(bi * kk + q) * w + j] - gr[j]).abs()).fold(0.0f32, f32::max);
            let best = (r.saturating_sub(8)..(r + 9).min(kk))
                .filter(|&q| !used[q] && (rows[(bi * kk + q) * w + 4] - gr[4]).abs() <= 1e-4 * smax)
                .min_by(|&p, &q| dev(p).total_cmp(&dev(q)))
                .unwrap_or(r);
            used[best] = true;
            if best != r {
                swaps += 1;
                println!(
                    "e2e: image {bi} reference rank {r} paired with our rank {best} (score {} vs {})",
                    gr[4],
                    rows[(bi * kk + best) * w + 4]
                );
            }
            paired.extend_from_slice(&rows[(bi * kk + best) * w..(bi * kk + best + 1) * w]);
        }
    }
    println!("e2e: {swaps} rows paired across a float32 score tie");
    assert!(swaps <= 20, "too many reordered rows: {swaps}");
    let rows = paired;
    let ours = Tensor::from_vec(rows, vec![b, k, w], device).expect("rows");
    let mut r = Report::default();
    r.check("eval_calibrated.e2e_o2o_topk", "e2e", &ours, gold);
    r.assert_below(TOL, &format!("e2e {device}"));
}

#[test]
fn e2e_o2o_topk_cpu() {
    check_e2e_calibrated(Device::Cpu);
}

#[cfg(feature = "cuda")]
#[test]
fn e2e_o2o_topk_cuda() {
    check_e2e_calibrated(Device::Cuda(0));
}

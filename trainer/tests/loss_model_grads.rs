//! model/loss golden through the full model: golden weights + input + targets → train-mode
//! forward (ptl-heads) → E2ELoss → backward; every parameter gradient against `grad.*`.

mod loss_support;

use std::collections::{HashMap, HashSet};

use loss_support::*;
use ptl_autograd::module::named_parameters;
use ptl_autograd::{Device, Tensor};
use ptl_heads::{BranchOutput, ModelConfig, PoseModel};
use ptl_trainer::loss::{Anchors, BranchOutputs, E2ELoss, LossConfig, LOSS_NAMES};

fn branch(o: &BranchOutput) -> BranchOutputs {
    BranchOutputs { boxes: o.boxes.clone(), scores: o.scores.clone(), kpts: o.kpts.clone(), kpts_sigma: o.kpts_sigma.clone() }
}

fn json_list(v: &serde_json::Value, path: &[&str]) -> Vec<String> {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_array().unwrap_or_else(|| panic!("loss.json {path:?} is not a list")).iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

/// Loss items through the model carry the forward's float32 rounding (ptl-heads vs torch: up to
/// 1.4e-5 of max |value| on `kpts_sigma`), which the RLE term amplifies (|e| = |Δ|/σ): the o2o
/// `rle_loss` moves by 1.6e-5 relative. On the stored raw outputs (`loss_model_outputs.rs`) every
/// item is within 1e-5; here items are held to 5e-5 and the total to 1e-5.
const ITEM_TOL: f64 = 5e-5;

#[test]
fn model_loss_gradients_match_golden() {
    let Some(root) = goldens() else { return };
    let dir = root.join("model");
    let t0 = std::time::Instant::now();
    let model = PoseModel::new(ModelConfig::default(), Device::Cpu, 0).unwrap();
    let w = load(dir.join("weights.safetensors"));
    model.load_state_dict(&w, true).unwrap();
    let fwd = load(dir.join("forward.safetensors"));
    let gl = load(dir.join("loss.safetensors"));
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("loss.json")).unwrap()).unwrap();
    let x: &Tensor = get(&fwd, "input");
    let out = model.forward(x).unwrap();
    let cfg = LossConfig::default();
    let anchors = Anchors::from_image_hw((x.dims()[2], x.dims()[3]), &cfg.strides).unwrap();
    let targets = target_batch(&gl, "batch.");
    let crit = E2ELoss::new(cfg, 100);
    let flow = &model.head().flow_model;
    let loss = crit.loss(&branch(&out.one2many), &branch(&out.one2one), &targets, &anchors, Some(flow)).unwrap();

    for (br, bl) in [("one2many", &loss.one2many), ("one2one", &loss.one2one)] {
        let r = f64v(get(&gl, &format!("{br}.items")));
        let mut line = format!("model forward+loss {br} items rel dev:");
        for i in 0..6 {
            line += &format!(" {}={:.1e}", LOSS_NAMES[i], rel_scalar(bl.items[i], r[i]));
            assert!((bl.items[i] - r[i]).abs() <= ITEM_TOL * r[i].abs() + 1e-6, "{br} {}: {} vs {}", LOSS_NAMES[i], bl.items[i], r[i]);
        }
        eprintln!("{line}");
        let fg_ref = f64v(get(&gl, &format!("assign.{br}.fg_mask")));
        let idx_ref = f64v(get(&gl, &format!("assign.{br}.target_gt_idx")));
        let a = bl.assignment.as_ref().expect("the host path keeps its assignment");
        let bad = (0..fg_ref.len())
            .filter(|&i| f64::from(u8::from(a.fg_mask[i])) != fg_ref[i] || (fg_ref[i] != 0.0 && a.target_gt_idx[i] as f64 != idx_ref[i]))
            .count();
        assert_eq!(bad, 0, "{br} assignment");
    }
    let total_ref = get(&gl, "epoch0.total").item().unwrap();
    let total = loss.total.item().unwrap();
    let vr = f64v(get(&gl, "epoch0.loss_vec"));
    let v = f64v(&loss.loss_vec);
    let vd = (0..6).map(|i| rel_scalar(v[i], vr[i])).fold(0f64, f64::max);
    eprintln!("model forward+loss total {total} vs {total_ref} (rel {:.1e}); loss_vec max rel {vd:.1e}", rel_scalar(total, total_ref));
    assert!((total - total_ref).abs() <= 1e-5 * total_ref.abs() + 1e-6, "total");
    let t_fwd = t0.elapsed();

    loss.total.backward().unwrap();
    let settings = &meta["settings"]["epoch0"];
    let absent_ref: HashSet<String> = json_list(settings, &["absent_grad_params"]).into_iter().collect();
    let zero_ref: HashSet<String> = json_list(settings, &["zero_grad_params"]).into_iter().collect();
    let cancel: HashSet<String> = json_list(&meta, &["float32_vs_float64", "cancellation_noise_params"]).into_iter().collect();
    let per_tensor = meta["grad_stats_epoch0"]["per_tensor_max_abs_l2"].as_object().expect("per-tensor gradient norms").clone();
    let params = named_parameters(&model);
    assert_eq!(params.len(), 498);
    let (mut absent, mut zero) = (HashSet::new(), HashSet::new());
    let (mut worst, mut worst_name, mut worst_cancel) = (0f64, String::new(), 0f64);
    for (name, p) in &params {
        let Some(g) = p.grad() else {
            absent.insert(name.clone());
            continue;
        };
        let gv = f64v(&g);
        if gv.iter().all(|&v| v == 0.0) {
            zero.insert(name.clone());
        }
        // Cancellation noise and exactly-zero gradients are judged by size alone, below.
        let judged_whole = !cancel.contains(name) && !zero_ref.contains(name);
        let (gv, r) = golden_gradient(&gl, &per_tensor, name, gv, judged_whole);
        if cancel.contains(name) {
            let m = gv.iter().chain(&r).fold(0f64, |m, v| m.max(v.abs()));
            worst_cancel = worst_cancel.max(m);
            assert!(m <= 1e-4, "cancellation gradient {name}: {m:.2e}");
            continue;
        }
        if zero_ref.contains(name) {
            assert!(gv.iter().all(|v| v.abs() <= 1e-12), "{name} must be exactly zero");
            continue;
        }
        let d = rel_dev(&gv, &r, 1e-30);
        if d > worst {
            worst = d;
            worst_name = name.clone();
        }
    }
    eprintln!(
        "model gradients: {} params, max rel dev {worst:.2e} ({worst_name}), cancellation |g| max {worst_cancel:.1e}, absent {} (golden {}), exactly-zero {} (golden {}); forward+loss {:.1?}, total {:.1?}",
        params.len(),
        absent.len(),
        absent_ref.len(),
        zero.len(),
        zero_ref.len(),
        t_fwd,
        t0.elapsed()
    );
    assert_eq!(absent, absent_ref, "absent-gradient set");
    assert_eq!(zero, zero_ref, "exactly-zero gradient set");
    assert!(worst <= 1e-3, "gradient {worst_name}: {worst:.2e}");

    // Epoch 50 (criterion.update() × 50): flow and class-stem gradients.
    let g50 = load(dir.join("loss_grads_epoch50.safetensors"));
    ptl_autograd::module::zero_grad(&model);
    let mut crit50 = E2ELoss::new(LossConfig::default(), 100);
    for _ in 0..50 {
        crit50.update();
    }
    let out = model.forward(x).unwrap();
    let loss50 = crit50.loss(&branch(&out.one2many), &branch(&out.one2one), &targets, &anchors, Some(&model.head().flow_model)).unwrap();
    let t50 = get(&gl, "epoch50.total").item().unwrap();
    assert!((loss50.total.item().unwrap() - t50).abs() <= 1e-5 * t50.abs() + 1e-6, "epoch50 total");
    loss50.total.backward().unwrap();
    let (mut worst50, mut n50) = (0f64, 0);
    for (name, p) in &params {
        let Some(r) = g50.get(&format!("grad.{name}")) else { continue };
        let g = p.grad().unwrap_or_else(|| panic!("epoch-50 gradient {name} absent"));
        let d = rel_dev(&f64v(&g), &f64v(r), 1e-30);
        worst50 = worst50.max(d);
        n50 += 1;
    }
    eprintln!("model gradients at epoch 50: {n50} params (flow + class stems), max rel dev {worst50:.2e}");
    assert_eq!(n50, g50.len());
    assert!(worst50 <= 1e-3);
}

/// The same golden weights, input and targets with the forward computed in float64 (the f32
/// weights are cast at use): this removes ptl's own float32 forward rounding, leaving only the
/// loss arithmetic and the golden's float32 rounding (≤ 2.1e-6 on the loss vector per loss.json
/// `float32_vs_float64`). Every logged item of both branches and the total are within 1e-5.
#[test]
fn model_loss_items_with_float64_forward_within_1e5() {
    let Some(root) = goldens() else { return };
    let dir = root.join("model");
    let model = PoseModel::new(ModelConfig::default(), Device::Cpu, 0).unwrap();
    model.load_state_dict(&load(dir.join("weights.safetensors")), true).unwrap();
    let fwd = load(dir.join("forward.safetensors"));
    let gl = load(dir.join("loss.safetensors"));
    let x = get(&fwd, "input").to_dtype(ptl_autograd::DType::F64).unwrap();
    let out = ptl_autograd::no_grad(|| model.forward(&x)).unwrap();
    assert_eq!(out.one2one.kpts.dtype(), ptl_autograd::DType::F64, "the forward ran in float64");
    let cfg = LossConfig::default();
    let anchors = Anchors::from_image_hw((x.dims()[2], x.dims()[3]), &cfg.strides).unwrap();
    let targets = target_batch(&gl, "batch.");
    let crit = E2ELoss::new(cfg, 100);
    let loss = ptl_autograd::no_grad(|| {
        crit.loss(&branch(&out.one2many), &branch(&out.one2one), &targets, &anchors, Some(&model.head().flow_model))
    })
    .unwrap();
    let mut worst = 0f64;
    for (br, bl) in [("one2many", &loss.one2many), ("one2one", &loss.one2one)] {
        let r = f64v(get(&gl, &format!("{br}.items")));
        let mut line = format!("float64 forward + loss {br} items rel dev:");
        for i in 0..6 {
            let d = rel_scalar(bl.items[i], r[i]);
            worst = worst.max(d);
            line += &format!(" {}={d:.1e}", LOSS_NAMES[i]);
            assert!((bl.items[i] - r[i]).abs() <= 1e-5 * r[i].abs() + 1e-6, "{br} {}: {} vs {}", LOSS_NAMES[i], bl.items[i], r[i]);
        }
        eprintln!("{line}");
    }
    let total_ref = get(&gl, "epoch0.total").item().unwrap();
    let total = loss.total.item().unwrap();
    eprintln!("float64 forward + loss: total rel dev {:.1e}, worst item {worst:.1e}", rel_scalar(total, total_ref));
    assert!((total - total_ref).abs() <= 1e-5 * total_ref.abs() + 1e-6, "total");
}

/// Ours and the golden gradient of `name`, as compared: whole when the goldens hold `grad.<name>`;
/// in the repository's reduced copy a large gradient is `grad_sample.<name>` (values at
/// `ptl_goldens::sample_positions`), so ours is taken at the same positions, and the whole of
/// ours is checked here (when `judged_whole`) against the L2 norm and largest magnitude `loss.json`
/// holds for it.
fn golden_gradient(
    gl: &HashMap<String, Tensor>,
    per_tensor: &serde_json::Map<String, serde_json::Value>,
    name: &str,
    ours: Vec<f64>,
    judged_whole: bool,
) -> (Vec<f64>, Vec<f64>) {
    if let Some(whole) = gl.get(&format!("grad.{name}")) {
        return (ours, f64v(whole));
    }
    let sample = f64v(get(gl, &format!("grad_sample.{name}")));
    let picked = ptl_goldens::sample_positions(ours.len()).map(|i| ours[i]).collect();
    if !judged_whole {
        return (picked, sample);
    }
    let stats = per_tensor[name].as_array().expect("[max_abs, l2]");
    let (max_ref, l2_ref) = (stats[0].as_f64().expect("max_abs"), stats[1].as_f64().expect("l2"));
    let l2 = ours.iter().map(|v| v * v).sum::<f64>().sqrt();
    let max = ours.iter().fold(0f64, |m, v| m.max(v.abs()));
    assert!((l2 - l2_ref).abs() <= 1e-3 * l2_ref.max(1e-30), "gradient {name}: L2 {l2} against the golden {l2_ref}");
    assert!((max - max_ref).abs() <= 1e-3 * max_ref.max(1e-30), "gradient {name}: largest |g| {max} against the golden {max_ref}");
    (picked, sample)
}

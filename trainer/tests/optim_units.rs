//! Unit tests of the optimisation module on tiny parameter sets; expected values are the worked
//! examples of docs/training.md or derived by hand in the test.

mod optim_common;

use std::collections::HashMap;

use optim_common::{dev, fresh_params, goldens};
use ptl_autograd::{module::parameter, DType, Device, Tensor};
use ptl_trainer::optim::schedule::interp;
use ptl_trainer::optim::state::{checkpoint_dtypes, OptimizerMeta};
use ptl_trainer::optim::{
    auto_iterations, build_optimizer, capped_accumulate, clip_grad_norm, newton_schulz5, nominal_accumulate, resolve, scaled_weight_decay,
    step_due, warmup_iterations, GradScaler, GradScalerConfig, LrLambda, LrScheduler, ModelEma, NsPrecision, OptimizerConfig,
    OptimizerName, ParamKind, Warmup,
};

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape.to_vec(), Device::Cpu).expect("tensor")
}

fn p(v: &[f32], shape: &[usize]) -> Tensor {
    parameter(t(v, shape)).expect("parameter")
}

fn vals(x: &Tensor) -> Vec<f64> {
    x.to_f64_vec().expect("values")
}

/// A tiny MuSGD-shaped parameter list: boosted/plain conv, Linear, BN weight, biases.
fn tiny_named() -> Vec<(String, Tensor)> {
    let seq = |n: usize, s: f32| (0..n).map(|i| ((i as f32 * 0.37 + s).sin()) * 0.5).collect::<Vec<f32>>();
    vec![
        ("model.0.conv.weight".into(), p(&seq(2 * 3 * 3 * 3, 0.1), &[2, 3, 3, 3])),
        ("model.0.bn.weight".into(), p(&seq(2, 0.2), &[2])),
        ("model.0.bn.bias".into(), p(&seq(2, 0.3), &[2])),
        ("model.23.cv3.0.2.weight".into(), p(&seq(3 * 4, 0.4), &[3, 4, 1, 1])),
        ("model.23.cv3.0.2.bias".into(), p(&seq(3, 0.5), &[3])),
        ("model.23.flow_model.s.0.0.weight".into(), p(&seq(8 * 2, 0.6), &[8, 2])),
    ]
}

fn grads_for(params: &[(String, Tensor)], step: usize) -> Vec<Tensor> {
    params
        .iter()
        .map(|(_, x)| {
            let n = x.numel();
            let v: Vec<f32> = (0..n).map(|i| ((i as f32 * 1.3 + step as f32 * 0.7).cos()) * 0.1).collect();
            t(&v, x.dims())
        })
        .collect()
}

#[test]
fn auto_rule_accumulate_and_decay() {
    assert_eq!(auto_iterations(56_599, 16, 64, 100), 88_500);
    assert_eq!(auto_iterations(512, 4, 64, 5), 40);
    assert_eq!(nominal_accumulate(64, 16).expect("acc"), 4);
    assert_eq!(nominal_accumulate(64, 4).expect("acc"), 16);
    assert_eq!(nominal_accumulate(64, 128).expect("acc"), 1, "round(0.5) = 0 → 1");
    assert!((scaled_weight_decay(0.0005, 16, 64).expect("wd") - 0.0005).abs() < 1e-18);
    assert!((scaled_weight_decay(0.0005, 4, 64).expect("wd") - 0.0005).abs() < 1e-18);
    assert!(nominal_accumulate(64, 0).is_err());
    assert_eq!(capped_accumulate(64, 4, Some(8 * 2)).expect("acc"), 16);
    assert_eq!(capped_accumulate(64, 4, Some(3)).expect("acc"), 3);
    assert_eq!(capped_accumulate(64, 4, None).expect("acc"), 16);
    // §2 example: 32 images, batch 4, 2 epochs, nw 8: one step at ni 0, none afterwards.
    let w = Warmup::new(3.0, 2, 8, 0.0, 0.8, 0.937, 16);
    let lf = LrLambda::new(false, 0.01, 2);
    let mut groups = build_optimizer(&tiny_named(), &OptimizerConfig { iterations: 88_500, ..Default::default() }).expect("opt");
    let mut last = -1i64;
    let mut steps = Vec::new();
    for ni in 0..16usize {
        let acc = w.apply(ni, ni / 8, &lf, groups.param_groups_mut()).unwrap_or(16);
        if step_due(ni, last, acc) {
            steps.push(ni);
            last = ni as i64;
        }
    }
    assert_eq!(steps, vec![0]);

    let r = resolve(&OptimizerConfig { iterations: 88_500, ..Default::default() }).expect("resolve");
    assert_eq!((r.name, r.lr0, r.momentum, r.warmup_bias_lr), (OptimizerName::MuSgd, 0.01, 0.9, 0.0));
    let r = resolve(&OptimizerConfig { iterations: 10_000, nc: Some(1), batch: 4, ..Default::default() }).expect("resolve");
    assert_eq!((r.name, r.lr0, r.momentum, r.warmup_bias_lr), (OptimizerName::AdamW, 0.002, 0.9, 0.0));
    assert!((r.weight_decay - 0.0005).abs() < 1e-18);
    // nc absent → 10: round(0.01 / 14, 6) = 0.000714.
    let r = resolve(&OptimizerConfig { iterations: 40, nc: None, ..Default::default() }).expect("resolve");
    assert_eq!(r.lr0, 0.000714);
    // Explicit names keep the run arguments.
    let r = resolve(&OptimizerConfig { name: OptimizerName::MuSgd, lr0: 0.02, ..Default::default() }).expect("resolve");
    assert_eq!((r.name, r.lr0, r.momentum, r.warmup_bias_lr), (OptimizerName::MuSgd, 0.02, 0.937, 0.1));
    assert_eq!(OptimizerName::parse("musgd").expect("parse"), OptimizerName::MuSgd);
    assert!(OptimizerName::parse("lion").is_err());
}

#[test]
fn adamw_and_sgd_group_counts_on_the_model() {
    if goldens().is_none() {
        return;
    }
    let params = fresh_params();
    let cfg = OptimizerConfig { iterations: 40, nc: Some(1), batch: 4, ..Default::default() };
    let opt = build_optimizer(&params, &cfg).expect("adamw");
    assert_eq!(opt.kind(), OptimizerName::AdamW);
    let g = opt.param_groups();
    type Summary = (ParamKind, usize, f64, Option<(f64, f64)>, Option<f64>);
    let summary: Vec<Summary> = g.iter().map(|g| (g.kind, g.params.len(), g.weight_decay, g.betas, g.momentum)).collect();
    assert_eq!(
        summary,
        vec![
            (ParamKind::Weight, 186, 0.0005, Some((0.9, 0.999)), None),
            (ParamKind::Bn, 126, 0.0, Some((0.9, 0.999)), None),
            (ParamKind::Bias, 186, 0.0, Some((0.9, 0.999)), None),
        ]
    );
    assert!(g.iter().all(|g| g.lr == 0.002 && !g.boosted && !g.use_muon));
}

#[test]
fn newton_schulz_reference_values() {
    // docs/training.md §3.5 float64 reference values.
    let g = Tensor::from_vec(vec![2.0f64, 0.0, 0.0, 1.0], vec![2, 2], Device::Cpu).expect("g");
    let o = vals(&newton_schulz5(&g, NsPrecision::F64).expect("ns"));
    for (a, b) in o.iter().zip([0.688763, 0.0, 0.0, 1.114164]) {
        assert!((a - b).abs() < 1e-6, "{o:?}");
    }
    let g = Tensor::from_vec(vec![1.0f64, 2.0, 0.0, 0.0, 1.0, 1.0], vec![2, 3], Device::Cpu).expect("g");
    let o = vals(&newton_schulz5(&g, NsPrecision::F64).expect("ns"));
    for (a, b) in o.iter().zip([0.446829, 0.592689, -0.300970, -0.300970, 0.296344, 0.898284]) {
        assert!((a - b).abs() < 1e-6, "{o:?}");
    }
    // Tall input: worked on the transpose, same result transposed.
    let gt = g.transpose(0, 1).expect("t");
    let ot = newton_schulz5(&gt, NsPrecision::F64).expect("ns").transpose(0, 1).expect("t");
    assert!(dev(&ot, &Tensor::from_vec(o.clone(), vec![2, 3], Device::Cpu).expect("o")).0 < 1e-12);
    // bf16 reference of diag(2, 1): diag(0.691, 1.117); the result keeps the input dtype.
    let g = t(&[2.0, 0.0, 0.0, 1.0], &[2, 2]);
    let ob = newton_schulz5(&g, NsPrecision::Bf16).expect("ns");
    assert_eq!(ob.dtype(), DType::F32);
    let ob = vals(&ob);
    assert!((ob[0] - 0.691).abs() < 2e-3 && (ob[3] - 1.117).abs() < 2e-3, "{ob:?}");
    assert!(newton_schulz5(&t(&[1.0; 8], &[2, 2, 2]), NsPrecision::Bf16).is_err());
}

#[test]
fn warmup_iterations_and_worked_examples() {
    assert_eq!(warmup_iterations(3.0, 100, 3538), 10_614);
    assert_eq!(warmup_iterations(3.0, 5, 128), 384);
    assert_eq!(warmup_iterations(3.0, 2, 8), 8);
    assert_eq!(warmup_iterations(3.0, 1, 100), 0, "1-epoch runs have no warm-up");
    assert_eq!(warmup_iterations(0.0, 100, 100), 0);

    let cfg = OptimizerConfig { iterations: 88_500, ..Default::default() };
    let mut opt = build_optimizer(&tiny_named(), &cfg).expect("musgd");
    assert_eq!(opt.param_groups().len(), 8);
    // Worked example: epochs 100, nb 1000 → nw 3000; ni 1500 in epoch 1.
    let lf = LrLambda::new(false, 0.01, 100);
    let w = Warmup { nw: warmup_iterations(3.0, 100, 1000), warmup_bias_lr: 0.0, warmup_momentum: 0.8, momentum: 0.937, accumulate: 4 };
    assert_eq!(w.nw, 3000);
    let acc = w.apply(1500, 1, &lf, opt.param_groups_mut()).expect("active");
    assert_eq!(acc, 2, "round(2.5) = 2");
    let g = opt.param_groups();
    assert!((g[1].lr - 0.0049505).abs() < 1e-15, "{}", g[1].lr);
    assert!((g[0].lr - 0.0148515).abs() < 1e-15, "{}", g[0].lr);
    assert!(g.iter().all(|g| (g.momentum.expect("m") - 0.8685).abs() < 1e-15));

    // Reference trainer check: nb 8, nw 8, accumulate 16, 2 epochs.
    let lf = LrLambda::new(false, 0.01, 2);
    let w = Warmup { nw: 8, warmup_bias_lr: 0.0, warmup_momentum: 0.8, momentum: 0.937, accumulate: 16 };
    let mut opt = build_optimizer(&tiny_named(), &cfg).expect("musgd");
    for ni in 0..=8usize {
        let epoch = ni / 8;
        let acc = w.apply(ni, epoch, &lf, opt.param_groups_mut()).expect("active");
        let m = opt.param_groups()[0].momentum.expect("m");
        let expect_m = if ni == 8 { 0.937 } else { 0.8 + 0.017125 * ni as f64 };
        assert!((m - expect_m).abs() < 1e-15, "ni {ni}: momentum {m}");
        let expect_acc = (1.0 + 15.0 * ni as f64 / 8.0).round_ties_even().max(1.0) as usize;
        assert_eq!(acc, expect_acc, "ni {ni}");
        let lr1 = opt.param_groups()[1].lr;
        let expect_lr = if ni == 8 { 0.00505 } else { 0.01 * ni as f64 / 8.0 };
        assert!((lr1 - expect_lr).abs() < 1e-15, "ni {ni}: lr {lr1} vs {expect_lr}");
    }
    assert_eq!(opt.param_groups()[5].lr, 0.01 * 0.505);
    // After the warm-up nothing changes any more.
    opt.param_groups_mut()[1].set_lr(0.123);
    assert!(w.apply(9, 1, &lf, opt.param_groups_mut()).is_none());
    assert_eq!(opt.param_groups()[1].lr, 0.123);
    assert_eq!(opt.param_groups()[1].momentum, Some(0.937));

    // Bias groups start at warmup_bias_lr (explicit optimizers keep 0.1); AdamW has no momentum.
    let cfg = OptimizerConfig { name: OptimizerName::AdamW, lr0: 0.002, ..Default::default() };
    let mut opt = build_optimizer(&tiny_named(), &cfg).expect("adamw");
    let w = Warmup { nw: 10, warmup_bias_lr: 0.1, warmup_momentum: 0.8, momentum: 0.937, accumulate: 4 };
    let lf = LrLambda::new(false, 0.01, 5);
    w.apply(0, 0, &lf, opt.param_groups_mut()).expect("active");
    let g = opt.param_groups();
    assert_eq!((g[0].lr, g[1].lr, g[2].lr), (0.0, 0.0, 0.1));
    w.apply(5, 0, &lf, opt.param_groups_mut()).expect("active");
    let g = opt.param_groups();
    assert!((g[2].lr - (0.05 + 0.5 * 0.002)).abs() < 1e-15);
    assert!((g[0].lr - 0.001).abs() < 1e-15);
    assert!(g.iter().all(|g| g.momentum.is_none() && g.betas == Some((0.937, 0.999))));
    assert_eq!(interp(0.0, 8.0, 0.8, 0.937), 0.8);
}

#[test]
fn lr_lambdas_and_scheduler() {
    let lin = LrLambda::new(false, 0.01, 100);
    for (e, v) in [(0.0, 1.0), (50.0, 0.505), (99.0, 0.0199), (100.0, 0.01), (120.0, 0.01)] {
        assert!((lin.factor(e) - v).abs() < 1e-15, "linear lf({e}) = {}", lin.factor(e));
    }
    let cos = LrLambda::new(true, 0.01, 100);
    for (e, v) in [(0.0, 1.0), (50.0, 0.505), (99.0, 0.010244)] {
        assert!((cos.factor(e) - v).abs() < 1e-6, "cosine lf({e}) = {}", cos.factor(e));
    }
    // AdamW run of 5 epochs: 0.002·{1, 0.802, 0.604, 0.406, 0.208}, stepped at each epoch start.
    let cfg = OptimizerConfig { iterations: 40, nc: Some(1), ..Default::default() };
    let mut opt = build_optimizer(&tiny_named(), &cfg).expect("adamw");
    let mut s = LrScheduler::new(LrLambda::new(false, 0.01, 5), 0);
    for (e, f) in [1.0, 0.802, 0.604, 0.406, 0.208].into_iter().enumerate() {
        s.step(opt.param_groups_mut());
        assert_eq!(s.last_epoch, e as i64);
        for g in opt.param_groups() {
            assert!((g.lr - 0.002 * f).abs() < 1e-15, "epoch {e}: {}", g.lr);
        }
    }
    let back = LrScheduler::from_json(&s.to_json().expect("json")).expect("parse");
    assert_eq!(back, s);
    // Resume at epoch 3: the next step applies lf(3).
    let mut r = LrScheduler::new(LrLambda::new(false, 0.01, 5), 3);
    r.step(opt.param_groups_mut());
    assert!((opt.param_groups()[0].lr - 0.002 * 0.406).abs() < 1e-15);
}

#[test]
fn adamw_matches_hand_formula() {
    let params = vec![
        ("model.0.conv.weight".to_string(), p(&[0.5, -0.25, 1.0, 0.0], &[1, 1, 2, 2])),
        ("model.0.bn.weight".to_string(), p(&[1.0, 0.75], &[2])),
        ("model.0.bn.bias".to_string(), p(&[0.1, -0.2], &[2])),
    ];
    let cfg = OptimizerConfig { iterations: 40, nc: Some(1), ..Default::default() };
    let mut opt = build_optimizer(&params, &cfg).expect("adamw");
    assert_eq!(opt.kind(), OptimizerName::AdamW);
    let (lr, wd, b1, b2, eps) = (0.002, 0.0005, 0.9, 0.999, 1e-8);
    // Host f64 replica of docs/training.md §3.6.
    let mut x: Vec<Vec<f64>> = params.iter().map(|(_, t)| vals(t)).collect();
    let mut m: Vec<Vec<f64>> = x.iter().map(|v| vec![0.0; v.len()]).collect();
    let mut v2 = m.clone();
    let decay = [wd, 0.0, 0.0];
    for step in 1..=3 {
        let grads: Vec<Vec<f32>> =
            x.iter().enumerate().map(|(k, v)| (0..v.len()).map(|i| ((i + 2 * k + step) as f32 * 0.9).sin() * 0.3).collect()).collect();
        for ((_, t), g) in params.iter().zip(&grads) {
            t.set_grad(Some(Tensor::from_vec(g.clone(), t.dims().to_vec(), Device::Cpu).expect("g")));
        }
        opt.step().expect("step");
        let tt = step as f64;
        for k in 0..3 {
            for i in 0..x[k].len() {
                let g = grads[k][i] as f64;
                x[k][i] *= 1.0 - lr * decay[k];
                m[k][i] = b1 * m[k][i] + (1.0 - b1) * g;
                v2[k][i] = b2 * v2[k][i] + (1.0 - b2) * g * g;
                let mh = m[k][i] / (1.0 - b1.powf(tt));
                let vh = v2[k][i] / (1.0 - b2.powf(tt));
                x[k][i] -= lr * mh / (vh.sqrt() + eps);
            }
        }
        for ((n, t), e) in params.iter().zip(&x) {
            for (a, b) in vals(t).iter().zip(e) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "step {step} {n}: {a} vs {b}");
            }
        }
    }
    let meta = opt.state_meta();
    assert_eq!(meta.steps.values().copied().collect::<Vec<_>>(), vec![3, 3, 3]);
    assert_eq!(opt.state_tensors().len(), 6);
}

#[test]
fn grad_scaler_skips_exactly_the_inf_step() {
    let params = tiny_named();
    let cfg = OptimizerConfig { name: OptimizerName::Sgd, ..Default::default() };
    let mut opt = build_optimizer(&params, &cfg).expect("sgd");
    let ref_named = tiny_named();
    let mut reference = build_optimizer(&ref_named, &cfg).expect("sgd");
    let ref_params: Vec<Tensor> = ref_named.iter().map(|(_, t)| t.clone()).collect();
    let my_params: Vec<Tensor> = params.iter().map(|(_, t)| t.clone()).collect();
    let mut scaler = GradScaler::new(GradScalerConfig { growth_interval: 3, ..Default::default() }).expect("scaler");
    assert_eq!(scaler.get_scale().expect("scale"), 65536.0);
    let loss = t(&[1.5], &[]);
    assert_eq!(scaler.scale(&loss).expect("scaled").item().expect("v"), 1.5 * 65536.0);

    let set = |ps: &[Tensor], gs: &[Tensor], mul: f32| {
        for (p, g) in ps.iter().zip(gs) {
            p.set_grad(Some(g.mul_scalar(f64::from(mul)).expect("scale")));
        }
    };
    // steps: 1 clean, 2 inf, 3 NaN, 4..6 clean (growth after 3 clean), 7 inf.
    let mut expected_scale = 65536.0f64;
    for step in 1..=7usize {
        let gs = grads_for(&params, step);
        let s = scaler.get_scale().expect("scale") as f32;
        set(&my_params, &gs, s);
        let bad = matches!(step, 2 | 3 | 7);
        if bad {
            let g = my_params[3].grad().expect("grad");
            let mut v = g.to_vec::<f32>().expect("v");
            v[1] = if step == 3 { f32::NAN } else { f32::INFINITY };
            my_params[3].set_grad(Some(t(&v, g.dims())));
        }
        let before: Vec<Vec<f64>> = my_params.iter().map(vals).collect();
        let state_before: Vec<Vec<f64>> = opt.state_tensors().iter().map(|(_, t)| vals(t)).collect();
        let stepped = scaler.step(opt.as_mut()).expect("step");
        assert_eq!(stepped, !bad, "step {step}");
        assert_eq!(scaler.found_inf().expect("flag").item().expect("v"), if bad { 1.0 } else { 0.0 });
        if bad {
            assert_eq!(my_params.iter().map(vals).collect::<Vec<_>>(), before, "step {step}: params must be untouched");
            assert_eq!(opt.state_tensors().iter().map(|(_, t)| vals(t)).collect::<Vec<_>>(), state_before);
        } else {
            // Unscaled gradients equal the true ones exactly (power-of-two scale).
            for (p, g) in my_params.iter().zip(&gs) {
                assert_eq!(vals(&p.grad().expect("grad")), vals(g));
            }
            set(&ref_params, &gs, 1.0);
            reference.step().expect("reference step");
            for (a, b) in my_params.iter().zip(&ref_params) {
                assert_eq!(vals(a), vals(b), "step {step}");
            }
        }
        assert!(scaler.step(opt.as_mut()).is_err(), "second step before update");
        scaler.update().expect("update");
        opt.zero_grad();
        match step {
            2 | 3 | 7 => expected_scale *= 0.5,
            6 => expected_scale *= 2.0,
            _ => {}
        }
        assert_eq!(scaler.get_scale().expect("scale"), expected_scale, "after step {step}");
        let tracker = match step {
            1 => 1,
            4 => 1,
            5 => 2,
            _ => 0,
        };
        assert_eq!(scaler.growth_tracker().expect("tracker"), tracker, "after step {step}");
    }
    // unscale_ twice is an error; update without a recorded check is an error.
    scaler.unscale_(opt.as_ref()).expect("unscale");
    assert!(scaler.unscale_(opt.as_ref()).is_err());
    scaler.update().expect("update");
    assert!(scaler.update().is_err());
    // State round trip (that last clean update counted one good step).
    let st = scaler.state().expect("state").expect("enabled");
    assert_eq!((st.scale, st.growth_tracker, st.growth_interval), (expected_scale, 1, 3));
    let mut fresh = GradScaler::new(GradScalerConfig::default()).expect("scaler");
    fresh.load_state(Some(&st)).expect("load");
    assert_eq!(fresh.get_scale().expect("scale"), expected_scale);
    let _ = fresh.scale(&loss).expect("scale");
    assert_eq!(fresh.growth_tracker().expect("tracker"), 1);
    assert!(GradScaler::new(GradScalerConfig { growth_factor: 1.0, ..Default::default() }).is_err());
    // unscale_/step before any scale() is refused (PyTorch asserts the same).
    let mut unused = GradScaler::new(GradScalerConfig::default()).expect("scaler");
    assert!(unused.unscale_(opt.as_ref()).is_err());
    assert!(unused.step(opt.as_mut()).is_err());
    // A disabled scaler is a pass-through.
    let mut off = GradScaler::new(GradScalerConfig { enabled: false, ..Default::default() }).expect("scaler");
    assert_eq!(off.scale(&loss).expect("s").item().expect("v"), 1.5);
    assert!(off.step(opt.as_mut()).expect("step"));
    off.update().expect("update");
    assert_eq!(off.state().expect("state"), None);
}

#[test]
fn grad_scaler_skip_does_not_advance_adamw_steps() {
    let params = tiny_named();
    let cfg = OptimizerConfig { name: OptimizerName::AdamW, ..Default::default() };
    let mut opt = build_optimizer(&params, &cfg).expect("adamw");
    let mut scaler = GradScaler::new(GradScalerConfig::default()).expect("scaler");
    let _ = scaler.scale(&t(&[1.0], &[])).expect("scale");
    for (i, (_, x)) in params.iter().enumerate() {
        let mut v = vec![0.25f32; x.numel()];
        if i == 0 {
            v[0] = f32::INFINITY;
        }
        x.set_grad(Some(t(&v, x.dims())));
    }
    assert!(!scaler.step(opt.as_mut()).expect("step"));
    scaler.update().expect("update");
    assert!(opt.state_meta().steps.is_empty());
    assert!(opt.state_tensors().is_empty());
}

#[test]
fn clip_grad_norm_by_hand() {
    let a = p(&[3.0, 4.0], &[2]);
    let b = p(&[0.0; 3], &[3]);
    let c = p(&[1.0], &[1]);
    a.set_grad(Some(t(&[3.0, 4.0], &[2])));
    c.set_grad(Some(t(&[12.0], &[1])));
    // b has no gradient: skipped, stays absent. total = √(9 + 16 + 144) = 13.
    let total = clip_grad_norm([&a, &b, &c], 6.5).expect("clip").item().expect("v");
    assert_eq!(total, 13.0);
    let coef = 6.5f32 * (1.0f32 / (13.0f32 + 1e-6f32));
    assert_eq!(vals(&a.grad().expect("g")), vec![f64::from(3.0 * coef), f64::from(4.0 * coef)]);
    assert_eq!(vals(&c.grad().expect("g")), vec![f64::from(12.0 * coef)]);
    assert!(b.grad().is_none());
    // Below the threshold the coefficient is clamped to 1.
    let total = clip_grad_norm([&a, &b, &c], 100.0).expect("clip").item().expect("v");
    assert!((total - 6.5).abs() < 1e-5);
    assert_eq!(vals(&c.grad().expect("g")), vec![f64::from(12.0 * coef)]);
    // No gradients at all: total 0, nothing happens.
    assert_eq!(clip_grad_norm([&b], 10.0).expect("clip").item().expect("v"), 0.0);
}

#[test]
fn ema_decay_ramp_and_integer_buffers() {
    let w = t(&[1.0, 2.0], &[2]);
    let nbt = Tensor::from_vec(vec![5i64], vec![1], Device::Cpu).expect("i64");
    let mut ema = ModelEma::new(&[("w".into(), w.clone()), ("bn.num_batches_tracked".into(), nbt)]).expect("ema");
    for (u, d) in [(1u64, 0.0004998), (100, 0.04877), (2000, 0.63206), (10_000, 0.99316)] {
        let got = ema.decay_at(u);
        assert!((got - d).abs() / d < 1e-4, "d({u}) = {got}");
    }
    let model = vec![
        ("w".to_string(), t(&[3.0, 4.0], &[2])),
        ("bn.num_batches_tracked".to_string(), Tensor::from_vec(vec![9i64], vec![1], Device::Cpu).expect("i")),
    ];
    let d = ema.update(&model).expect("update");
    let e = vals(ema.get("w").expect("w"));
    let expect = [1.0 + (1.0 - d) * 2.0, 2.0 + (1.0 - d) * 2.0];
    assert!((e[0] - expect[0]).abs() < 1e-6 && (e[1] - expect[1]).abs() < 1e-6, "{e:?}");
    assert_eq!(vals(ema.get("bn.num_batches_tracked").expect("nbt")), vec![5.0], "integer buffers are not averaged");
    // Names matched even when the order differs; a missing entry is an error.
    let rev: Vec<(String, Tensor)> = model.iter().rev().cloned().collect();
    ema.update(&rev).expect("reordered");
    assert!(ema.update(&model[1..]).is_err());
    // Round trip of the scalar state and tensors.
    let meta = ema.meta();
    let tensors: HashMap<String, Tensor> = ema.ema_tensors().iter().map(|(n, t)| (n.clone(), t.deep_copy().expect("c"))).collect();
    let mut other = ModelEma::new(&model).expect("ema");
    other.load(&meta, &tensors).expect("load");
    assert_eq!(other.updates, ema.updates);
    assert_eq!(vals(other.get("w").expect("w")), vals(ema.get("w").expect("w")));
}

/// Saving after two MuSGD steps and loading into a fresh optimizer continues identically.
#[test]
fn optimizer_state_round_trip() {
    for cfg in [
        OptimizerConfig { iterations: 88_500, ..Default::default() },
        OptimizerConfig { name: OptimizerName::Sgd, ..Default::default() },
        OptimizerConfig { name: OptimizerName::AdamW, ..Default::default() },
    ] {
        let pa = tiny_named();
        let mut a = build_optimizer(&pa, &cfg).expect("a");
        for s in 0..2 {
            for ((_, x), g) in pa.iter().zip(grads_for(&pa, s)) {
                x.set_grad(Some(g));
            }
            a.step().expect("step");
            a.zero_grad();
        }
        a.param_groups_mut()[0].set_lr(0.0123);
        a.param_groups_mut()[0].set_momentum(0.91);
        let json = a.state_meta().to_json().expect("json");
        let ckpt = checkpoint_dtypes(a.state_tensors()).expect("fp16");
        for (n, t) in &ckpt {
            let want = if n.starts_with("state.exp_avg") { DType::F32 } else { DType::F16 };
            assert_eq!(t.dtype(), want, "{n}");
        }
        let tensors: HashMap<String, Tensor> = ckpt.into_iter().collect();
        // A fresh model with the same parameter values, a fresh optimizer, then load.
        let pb: Vec<(String, Tensor)> = pa.iter().map(|(n, t)| (n.clone(), parameter(t.deep_copy().expect("c")).expect("p"))).collect();
        let mut b = build_optimizer(&pb, &cfg).expect("b");
        b.load_state_meta(&OptimizerMeta::from_json(&json).expect("parse")).expect("meta");
        b.load_state_tensors(&tensors).expect("tensors");
        assert_eq!(b.state_meta(), a.state_meta());
        // Re-load from the fp32 state so both continue from identical buffers.
        let exact: HashMap<String, Tensor> = a.state_tensors().into_iter().collect();
        let addr: Vec<usize> = b.state_tensors().iter().map(|(_, t)| t.storage_ptr()).collect();
        b.load_state_tensors(&exact).expect("tensors");
        assert_eq!(addr, b.state_tensors().iter().map(|(_, t)| t.storage_ptr()).collect::<Vec<_>>(), "loaded in place");
        for s in 2..4 {
            for (((_, x), (_, y)), g) in pa.iter().zip(&pb).zip(grads_for(&pa, s)) {
                x.set_grad(Some(g.deep_copy().expect("c")));
                y.set_grad(Some(g));
            }
            a.step().expect("a");
            b.step().expect("b");
        }
        for ((n, x), (_, y)) in pa.iter().zip(&pb) {
            assert_eq!(vals(x), vals(y), "{:?}: {n}", cfg.name);
        }
        // Mismatched membership is refused.
        let mut meta = OptimizerMeta::from_json(&json).expect("parse");
        meta.groups[0].params.push("nope".into());
        assert!(b.load_state_meta(&meta).is_err());
    }
}

//! Parameter layout: count, names, order, shapes and dtypes against the golden `params.json` and
//! `weights.safetensors`; save/load round trips; stable parameter addresses; other scales.

mod common;

use std::collections::HashSet;

use common::*;
use ptl_autograd::module::{named_parameters, state_dict};
use ptl_autograd::{DType, Device, Module, Tensor, TensorKind};
use ptl_heads::model::LayerKind;
use ptl_heads::{Branch, ModelConfig, PoseModel, Scale, StemKind};

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::I64 => "int64",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::U8 => "uint8",
        DType::Bool => "bool",
    }
}

#[test]
fn nano_nc1_has_3679464_params_and_the_table_3_layer_counts() {
    let m = PoseModel::new(ModelConfig::default(), Device::Cpu, 1).expect("build");
    assert_eq!(m.num_params(), 3_679_464);
    let expected = [
        464, 4_672, 6_640, 36_992, 26_080, 147_712, 87_040, 295_424, 346_112, 164_608, 249_728, 0, 0, 119_808, 0, 0, 34_304, 36_992, 0,
        95_232, 147_712, 0, 463_104, 1_416_840,
    ];
    let got: Vec<usize> = m.layers().iter().map(|l| l.num_params()).collect();
    assert_eq!(got, expected);
    let head = m.head();
    assert_eq!(head.flow_model.num_params(), 53_784);
    // Per-set stem totals (docs/model.md §4).
    let sum = |b: Branch, k: StemKind| -> usize {
        (0..3)
            .map(|l| {
                let mut n = 0;
                head.stem(b, l, k).expect("stem").visit("", &mut |_, t, kind| {
                    if kind == TensorKind::Parameter {
                        n += t.numel()
                    }
                });
                n
            })
            .sum()
    };
    for b in Branch::ALL {
        assert_eq!(sum(b, StemKind::Box), 71_820);
        assert_eq!(sum(b, StemKind::Class), 48_963);
        assert_eq!(sum(b, StemKind::Point), 538_815);
    }
}

#[test]
fn nc80_has_3747554_params() {
    let m = PoseModel::new(ModelConfig { nc: 80, ..ModelConfig::default() }, Device::Cpu, 1).expect("build");
    assert_eq!(m.num_params(), 3_747_554);
}

#[test]
fn state_dict_matches_params_json_and_weights_file() {
    let Some(dir) = model_dir() else { return };
    let m = PoseModel::new(ModelConfig::default(), Device::Cpu, 1).expect("build");
    let sd = state_dict(&m);
    let pj: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("params.json")).expect("read")).expect("json");
    let entries = pj["entries"].as_array().expect("entries");
    assert_eq!(sd.len(), entries.len(), "number of state-dict entries");
    assert_eq!(sd.len(), 879);
    for ((name, t, kind), e) in sd.iter().zip(entries) {
        assert_eq!(name, e["name"].as_str().expect("name"), "state-dict order");
        let shape: Vec<usize> = e["shape"].as_array().expect("shape").iter().map(|v| v.as_u64().expect("dim") as usize).collect();
        assert_eq!(t.dims(), shape.as_slice(), "{name}: shape");
        assert_eq!(dtype_name(t.dtype()), e["dtype"].as_str().expect("dtype"), "{name}: dtype");
        let k = if *kind == TensorKind::Parameter { "parameter" } else { "buffer" };
        assert_eq!(k, e["kind"].as_str().expect("kind"), "{name}: kind");
        if *kind == TensorKind::Parameter {
            assert!(t.requires_grad() && t.is_leaf(), "{name}: trainable leaf");
        }
    }
    let order: Vec<String> = named_parameters(&m).into_iter().map(|(n, _)| n).collect();
    let want: Vec<String> = pj["parameter_order"].as_array().expect("order").iter().map(|v| v.as_str().expect("s").to_string()).collect();
    assert_eq!(order, want, "named_parameters order");
    // The safetensors file: same key set, shapes and dtypes; nothing missing or extra.
    let w = load(&dir, "weights.safetensors", Device::Cpu);
    let file_keys: HashSet<&String> = w.keys().collect();
    let model_keys: HashSet<&String> = sd.iter().map(|e| &e.0).collect();
    assert_eq!(file_keys, model_keys);
    for (name, t, _) in &sd {
        let f = &w[name];
        assert_eq!(f.dims(), t.dims(), "{name}");
        assert_eq!(f.dtype(), t.dtype(), "{name}");
    }
    m.load_state_dict(&w, true).expect("strict load");
}

#[test]
fn fresh_init_matches_reference_conventions() {
    let m = PoseModel::new(ModelConfig::default(), Device::Cpu, 3).expect("build");
    let sd = state_dict(&m);
    let val = |n: &str| -> Vec<f64> { sd.iter().find(|e| e.0 == n).unwrap_or_else(|| panic!("{n}")).1.to_f64_vec().expect("v") };
    // Head bias init, both sets.
    for p in ["", "one2one_"] {
        for l in 0..3 {
            assert!(val(&format!("model.23.{p}cv2.{l}.2.bias")).iter().all(|&v| v == 2.0));
        }
        let want = [-7.15462, -5.76832, -4.38203];
        for (l, w) in want.iter().enumerate() {
            let b = val(&format!("model.23.{p}cv3.{l}.2.bias"));
            assert!((b[0] - w).abs() < 1e-5, "{p}cv3.{l}: {} vs {w}", b[0]);
        }
    }
    // o2o starts as an exact copy of o2m.
    for (name, t, _) in &sd {
        if let Some(rest) = name.strip_prefix("model.23.one2one_") {
            let twin = format!("model.23.{rest}");
            assert_eq!(t.to_f64_vec().expect("v"), val(&twin), "{name} vs {twin}");
        }
    }
    // BN: γ = 1, β = 0, running stats (0, 1), eps/momentum.
    assert!(val("model.0.bn.weight").iter().all(|&v| v == 1.0));
    assert!(val("model.0.bn.bias").iter().all(|&v| v == 0.0));
    assert!(val("model.5.bn.running_var").iter().all(|&v| v == 1.0));
    // Weight init bounds: U(±1/√fan_in); flow Linear weights Xavier gain 0.01.
    let check_bound = |n: &str, bound: f64| {
        let v = val(n);
        let mx = v.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(mx <= bound && mx > 0.8 * bound, "{n}: max {mx} vs bound {bound}");
    };
    check_bound("model.3.conv.weight", 1.0 / (64.0f64 * 9.0).sqrt());
    check_bound("model.23.cv4_kpts.0.weight", 1.0 / 85.0f64.sqrt());
    check_bound("model.23.cv4_kpts.0.bias", 1.0 / 85.0f64.sqrt());
    check_bound("model.23.flow_model.s.0.2.weight", 0.01 * (6.0f64 / 128.0).sqrt());
    check_bound("model.23.flow_model.s.0.2.bias", 1.0 / 64.0f64.sqrt());
    assert_eq!(val("model.23.flow_model.mask"), vec![0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
}

#[test]
fn save_then_load_round_trips_with_reference_names_and_stable_addresses() {
    let a = PoseModel::new(ModelConfig::default(), Device::Cpu, 11).expect("a");
    let b = PoseModel::new(ModelConfig::default(), Device::Cpu, 12).expect("b");
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("m.safetensors");
    a.save_safetensors(&path).expect("save");
    let addrs: Vec<usize> = state_dict(&b).iter().map(|e| e.1.storage_ptr()).collect();
    b.load_safetensors(&path).expect("load");
    let after: Vec<usize> = state_dict(&b).iter().map(|e| e.1.storage_ptr()).collect();
    assert_eq!(addrs, after, "loading copies in place");
    for ((na, ta, _), (nb, tb, _)) in state_dict(&a).iter().zip(state_dict(&b).iter()) {
        assert_eq!(na, nb);
        assert_eq!(ta.to_bytes().expect("a"), tb.to_bytes().expect("b"), "{na}");
    }
    // Header: reference names and dtypes (num_batches_tracked int64 scalars), as PyTorch expects.
    let raw = ptl_autograd::module::load_safetensors(&path, Device::Cpu).expect("read back");
    assert_eq!(raw.len(), 879);
    let nbt = &raw["model.23.one2one_cv4.2.1.bn.num_batches_tracked"];
    assert_eq!((nbt.dtype(), nbt.dims().len()), (DType::I64, 0));
}

#[test]
fn forward_keeps_parameter_addresses() {
    let m = PoseModel::new(ModelConfig::default(), Device::Cpu, 5).expect("build");
    let before: Vec<usize> = state_dict(&m).iter().map(|e| e.1.storage_ptr()).collect();
    let x = Tensor::full(vec![1, 3, 64, 64], 0.5, DType::F32, Device::Cpu).expect("x");
    let out = m.forward(&x).expect("forward");
    out.one2many.boxes.sum_all().and_then(|s| s.backward()).expect("backward");
    let after: Vec<usize> = state_dict(&m).iter().map(|e| e.1.storage_ptr()).collect();
    assert_eq!(before, after);
    let nbt = state_dict(&m).into_iter().find(|e| e.0 == "model.0.bn.num_batches_tracked").expect("nbt").1;
    assert_eq!(nbt.to_vec::<i64>().expect("v"), vec![1]);
}

#[test]
fn all_scales_build_with_scaled_widths_and_depths() {
    let mut prev = 0;
    for scale in [Scale::N, Scale::S, Scale::M, Scale::L, Scale::X] {
        let m = PoseModel::new(ModelConfig { scale, ..ModelConfig::default() }, Device::Cpu, 1).expect("build");
        let n = m.num_params();
        assert!(n > prev, "{scale:?}: {n} params");
        prev = n;
        let (depth, width, max_ch) = scale.multipliers();
        let c = |x: usize| ((x.min(max_ch) as f64 * width / 8.0).ceil() as usize) * 8;
        assert_eq!(m.layers()[0].c_out, c(64));
        assert_eq!(m.layers()[9].c_out, c(1024));
        assert_eq!(m.head().ch, vec![c(256), c(512), c(1024)]);
        let reps = if depth >= 1.0 { 2 } else { 1 };
        assert_eq!(m.layers()[2].repeats, reps, "{scale:?}");
        assert_eq!(m.layers()[22].repeats, 1);
        if let LayerKind::C3k2(b) = &m.layers()[2].kind {
            let c3k = matches!(b.m[0], ptl_heads::blocks::C3k2Block::C3k(_));
            assert_eq!(c3k, matches!(scale, Scale::M | Scale::L | Scale::X), "{scale:?}: m/l/x use C3k in every C3k2");
        } else {
            panic!("layer 2 is a C3k2");
        }
    }
}

#[test]
fn small_scale_forward_shapes() {
    let m = PoseModel::new(ModelConfig { scale: Scale::S, ..ModelConfig::default() }, Device::Cpu, 2).expect("build");
    let x = Tensor::full(vec![2, 3, 64, 96], 0.25, DType::F32, Device::Cpu).expect("x");
    let out = m.forward(&x).expect("forward");
    let a = 8 * 12 + 4 * 6 + 2 * 3;
    assert_eq!(out.one2many.boxes.dims(), &[2, 4, a]);
    assert_eq!(out.one2one.scores.dims(), &[2, 1, a]);
    assert_eq!(out.one2many.kpts.dims(), &[2, 51, a]);
    assert_eq!(out.one2one.kpts_sigma.as_ref().expect("sigma").dims(), &[2, 34, a]);
}

/// Every BatchNorm follows `set_training`: in eval mode a forward leaves every running statistic
/// and counter as it was; in train mode every BatchNorm of the model counts the batch. A child
/// left out of the traversal (visited but not switched, or the other way round) fails this.
#[test]
fn every_batchnorm_follows_set_training() {
    let mut m = PoseModel::new(ModelConfig { scale: Scale::N, ..ModelConfig::default() }, Device::Cpu, 1).expect("build");
    let x = Tensor::rand(vec![1, 3, 64, 64], 0.0, 1.0, DType::F32, Device::Cpu, &mut ptl_autograd::Rng::new(7)).expect("input");
    let counters = |m: &PoseModel| -> Vec<(String, i64)> {
        state_dict(m)
            .into_iter()
            .filter(|(n, _, _)| n.ends_with("num_batches_tracked"))
            .map(|(n, t, _)| (n, t.to_vec::<i64>().expect("counter")[0]))
            .collect()
    };
    let stats = |m: &PoseModel| -> Vec<Vec<f32>> {
        state_dict(m)
            .into_iter()
            .filter(|(n, _, _)| n.ends_with("running_mean"))
            .map(|(_, t, _)| t.to_vec::<f32>().expect("mean"))
            .collect()
    };
    let before = (counters(&m), stats(&m));
    assert!(before.0.len() > 100, "{} BatchNorms", before.0.len());
    m.set_training(false);
    ptl_autograd::no_grad(|| m.forward(&x)).expect("eval forward");
    assert_eq!((counters(&m), stats(&m)), before, "eval mode: no BatchNorm updated its statistics");
    m.set_training(true);
    ptl_autograd::no_grad(|| m.forward(&x)).expect("train forward");
    let untouched: Vec<String> = counters(&m).into_iter().filter(|(_, c)| *c != 1).map(|(n, _)| n).collect();
    assert!(untouched.is_empty(), "train mode: these BatchNorms did not count the batch: {untouched:?}");
}

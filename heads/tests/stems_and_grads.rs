//! Stem addressing, stem-by-stem replay, and gradient isolation (absent gradients stay `None`).

use std::collections::HashSet;

use ptl_autograd::module::{named_parameters, state_dict, zero_grad};
use ptl_autograd::{DType, Device, Rng, Tensor, TensorKind};
use ptl_heads::{Branch, ModelConfig, Pose26, PoseModel, StemKind};

fn model_and_input(device: Device) -> (PoseModel, Tensor) {
    let m = PoseModel::new(ModelConfig::default(), device, 9).expect("build");
    let mut rng = Rng::new(4);
    let x = Tensor::rand(vec![2, 3, 64, 64], 0.0, 1.0, DType::F32, device, &mut rng).expect("x");
    (m, x)
}

/// Which parameters received a gradient after backpropagating `pick(output)`.
fn grads_after(m: &PoseModel, x: &Tensor, pick: impl Fn(&ptl_heads::HeadOutput) -> Tensor) -> Vec<(String, bool)> {
    zero_grad(m);
    let out = m.forward(x).expect("forward");
    pick(&out).sum_all().and_then(|s| s.backward()).expect("backward");
    named_parameters(m).into_iter().map(|(n, p)| (n, p.grad().is_some())).collect()
}

fn assert_grads(g: &[(String, bool)], has: impl Fn(&str) -> bool, what: &str) {
    for (n, some) in g {
        assert_eq!(*some, has(n), "{what}: `{n}` gradient should be {}", if has(n) { "present" } else { "None" });
    }
}

fn is_backbone(n: &str) -> bool {
    !n.starts_with("model.23.")
}

fn check_isolation(device: Device) {
    let (m, x) = model_and_input(device);
    let g = grads_after(&m, &x, |o| o.one2many.boxes.clone());
    assert_grads(&g, |n| is_backbone(n) || n.starts_with("model.23.cv2."), "o2m boxes");

    let g = grads_after(&m, &x, |o| o.one2one.boxes.clone());
    assert_grads(&g, |n| n.starts_with("model.23.one2one_cv2."), "o2o boxes (detached features)");

    let g = grads_after(&m, &x, |o| o.one2many.scores.clone());
    assert_grads(&g, |n| is_backbone(n) || n.starts_with("model.23.cv3."), "o2m scores");

    let g = grads_after(&m, &x, |o| o.one2many.kpts.clone());
    assert_grads(&g, |n| is_backbone(n) || n.starts_with("model.23.cv4.") || n.starts_with("model.23.cv4_kpts."), "o2m kpts");

    let g = grads_after(&m, &x, |o| o.one2one.kpts_sigma.clone().expect("sigma"));
    assert_grads(&g, |n| n.starts_with("model.23.one2one_cv4.") || n.starts_with("model.23.one2one_cv4_sigma."), "o2o sigma");

    // The flow only through log_prob.
    zero_grad(&m);
    let e = Tensor::from_vec(vec![0.1f32, -0.3, 1.2, 0.4, -2.0, 0.05], vec![3, 2], device).expect("e");
    let lp = m.head().flow_model.log_prob(&e).expect("log_prob");
    assert_eq!(lp.dims(), &[3]);
    lp.sum_all().and_then(|s| s.backward()).expect("backward");
    let g: Vec<(String, bool)> = named_parameters(&m).into_iter().map(|(n, p)| (n, p.grad().is_some())).collect();
    assert_grads(&g, |n| n.starts_with("model.23.flow_model."), "flow log_prob");
}

#[test]
fn gradients_reach_only_the_used_stems_cpu() {
    check_isolation(Device::Cpu);
}

#[cfg(feature = "cuda")]
#[test]
fn gradients_reach_only_the_used_stems_cuda() {
    check_isolation(Device::Cuda(0));
}

#[test]
fn eighteen_stems_are_addressable_and_own_their_parameters() {
    let (m, _) = model_and_input(Device::Cpu);
    let head = m.head();
    let stems = head.stems();
    assert_eq!(stems.len(), 18);
    let all: HashSet<String> = state_dict(&m).into_iter().map(|e| e.0).collect();
    let mut seen: HashSet<usize> = HashSet::new();
    let mut covered: HashSet<String> = HashSet::new();
    for (b, l, k, s) in &stems {
        assert_eq!(s.kind(), *k);
        let prefix = format!("model.23.{}", Pose26::stem_name(*b, *l, *k));
        let mut n = 0;
        s.visit(&prefix, &mut |name, t, kind| {
            assert!(all.contains(name), "{name} is a reference key");
            if kind == TensorKind::Parameter {
                assert!(seen.insert(t.storage_ptr()), "{name}: parameters are not shared between stems");
                n += 1;
            }
            covered.insert(name.to_string());
        });
        assert!(n > 0);
        for (view, pfx) in [(head.kpt_view(*b, *l), "cv4_kpts"), (head.sigma_view(*b, *l), "cv4_sigma")] {
            if *k == StemKind::Point {
                let v = view.expect("view");
                covered.insert(format!("model.23.{}{pfx}.{l}.weight", b.attr_prefix()));
                covered.insert(format!("model.23.{}{pfx}.{l}.bias", b.attr_prefix()));
                assert_eq!(v.c_in(), 85);
            }
        }
    }
    assert!(head.stem(Branch::OneToOne, 3, StemKind::Box).is_none());
    // Every head entry belongs to a stem, a view or the flow.
    for n in all.iter().filter(|n| n.starts_with("model.23.") && !n.starts_with("model.23.flow_model.")) {
        assert!(covered.contains(n), "{n} not reachable through a stem or view");
    }
}

#[test]
fn stems_replayed_one_by_one_equal_the_head_forward() {
    let (mut m, x) = model_and_input(Device::Cpu);
    use ptl_autograd::Module;
    m.set_training(false); // running statistics: stems are deterministic functions of the input
    let feats = m.forward_features(&x).expect("feats");
    let out = m.head().forward(&feats).expect("head");
    let head = m.head();
    for b in Branch::ALL {
        let mut offset = 0;
        for (l, f) in feats.iter().enumerate() {
            let hw = f.dims()[2] * f.dims()[3];
            let o = out.branch(b);
            let bx = head.stem(b, l, StemKind::Box).expect("box").forward(f).expect("box fwd");
            assert_eq!(bx.dims(), &[2, 4, f.dims()[2], f.dims()[3]]);
            let want = o.boxes.narrow(2, offset, hw).expect("slice");
            assert_eq!(bx.reshape(vec![2, 4, hw]).expect("r").to_vec::<f32>().expect("v"), want.to_vec::<f32>().expect("v"));
            let cl = head.stem(b, l, StemKind::Class).expect("cls").forward(f).expect("cls fwd");
            let want = o.scores.narrow(2, offset, hw).expect("slice");
            assert_eq!(cl.reshape(vec![2, 1, hw]).expect("r").to_vec::<f32>().expect("v"), want.to_vec::<f32>().expect("v"));
            let pt = head.stem(b, l, StemKind::Point).expect("pt").forward(f).expect("pt fwd");
            assert_eq!(pt.dims()[1], 85);
            let kp = head.kpt_view(b, l).expect("view").forward(&pt).expect("kpts");
            let want = o.kpts.narrow(2, offset, hw).expect("slice");
            assert_eq!(kp.reshape(vec![2, 51, hw]).expect("r").to_vec::<f32>().expect("v"), want.to_vec::<f32>().expect("v"));
            let sg = head.sigma_view(b, l).expect("view").forward(&pt).expect("sigma");
            assert_eq!(sg.dims()[1], 34);
            offset += hw;
        }
    }
}

/// Channels-last activations change no value on the CPU (its ops compute in the logical order and
/// the batch norm on rearranged copies): the forward's outputs and every parameter's gradient are
/// the contiguous model's bytes, the neck's features are channels-last, the outputs' shapes are
/// unchanged — so every op of the trunk, neck and head takes the format.
#[test]
fn channels_last_activations_give_the_same_bytes_on_the_cpu() {
    use ptl_autograd::MemoryFormat;
    /// Output bytes, the neck features' formats, and each parameter's gradient bytes.
    type Seen = (Vec<Vec<u8>>, Vec<MemoryFormat>, Vec<(String, Vec<u8>)>);
    let run = |format: MemoryFormat| -> Seen {
        let (mut m, x) = model_and_input(Device::Cpu);
        m.set_activation_format(format);
        assert_eq!(m.activation_format(), format);
        let out = m.forward(&x).expect("forward");
        let o = &out.one2many;
        let sigma = o.kpts_sigma.as_ref().expect("training outputs carry sigma");
        let loss = [&o.boxes, &o.scores, &o.kpts, sigma].iter().map(|t| t.sum_all().unwrap()).reduce(|a, b| a.add(&b).unwrap()).unwrap();
        loss.backward().expect("backward");
        let outs = [&o.boxes, &o.scores, &o.kpts, &out.one2one.boxes].map(|t| t.to_bytes().unwrap()).to_vec();
        let feats = out.feats.iter().map(|f| f.memory_format()).collect();
        let grads =
            named_parameters(&m).into_iter().map(|(n, p)| (n, p.grad().map(|g| g.to_bytes().unwrap()).unwrap_or_default())).collect();
        (outs, feats, grads)
    };
    let (plain, cl) = (run(MemoryFormat::Contiguous), run(MemoryFormat::ChannelsLast));
    assert_eq!(cl.1, vec![MemoryFormat::ChannelsLast; 3], "the neck's features");
    assert_eq!(plain.1, vec![MemoryFormat::Contiguous; 3]);
    for (k, name) in ["o2m boxes", "o2m scores", "o2m kpts", "o2o boxes"].iter().enumerate() {
        assert_eq!(cl.0[k], plain.0[k], "{name}");
    }
    assert_eq!(cl.2.len(), plain.2.len());
    for ((n, a), (_, b)) in plain.2.iter().zip(&cl.2) {
        // The one-to-one stems read detached features and the flow only serves the loss: no
        // gradient from these outputs.
        assert_eq!(a.is_empty(), n.contains("one2one") || n.contains("flow_model"), "{n}: which parameters get a gradient");
        assert_eq!(a, b, "{n}: gradient");
    }
}

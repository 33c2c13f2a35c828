//! The criterion on CUDA (fp32) against the same criterion on CPU, on every golden loss case:
//! items and total within 1e-4 relative, assignments identical, gradients of the raw outputs and
//! of the flow within 1e-4 of each tensor's max |value|. Skips when no GPU answers.

#![cfg(feature = "cuda")]

mod loss_support;

use loss_support::*;
use ptl_autograd::Device;
use ptl_trainer::loss::{Anchors, E2ELoss, LossConfig, LOSS_NAMES};

const CASES: [&str; 6] = [
    "case1_basic.safetensors",
    "case2_empty_image.safetensors",
    "case3_invisible_keypoints.safetensors",
    "case4_tiny_and_thin.safetensors",
    "case5_crowded.safetensors",
    "case6_no_targets.safetensors",
];

/// A CUDA device, or `None` (with the reason printed) to skip.
fn gpu() -> Option<Device> {
    let gpu = Device::auto();
    if !gpu.is_cuda() {
        eprintln!("skipping: no usable CUDA device");
        return None;
    }
    Some(gpu)
}

/// The goldens' folder and a CUDA device, or `None` (with the reason printed) to skip.
fn goldens_and_gpu() -> Option<(std::path::PathBuf, Device)> {
    let root = goldens()?;
    Some((root, gpu()?))
}

#[test]
fn loss_cases_cuda_match_cpu() {
    let Some((root, gpu)) = goldens_and_gpu() else { return };
    let flow_vals = load(root.join("loss_cases/flow.safetensors"));
    for file in CASES {
        let g = load(root.join("loss_cases").join(file));
        let cfg = LossConfig::default();
        let (anchors, targets) = case_anchors_and_targets(&g);
        let crit = E2ELoss::new(cfg, 100);
        let mut res = Vec::new();
        for dev in [Device::Cpu, gpu] {
            let flow = flow_on(&flow_vals, dev);
            let o2m = branch_leaves_on(&g, "input.one2many.", dev);
            let o2o = branch_leaves_on(&g, "input.one2one.", dev);
            let out = crit.loss(&o2m, &o2o, &targets, &anchors, Some(&flow)).unwrap();
            assert_eq!(out.total.device(), dev, "the loss lives on the inputs' device");
            out.total.backward().unwrap();
            let mut grads = Vec::new();
            for o in [&o2m, &o2o] {
                for t in [&o.boxes, &o.scores, &o.kpts, o.kpts_sigma.as_ref().unwrap()] {
                    grads.push(f64v(&t.grad().expect("gradient present")));
                }
            }
            for (_, p) in ptl_autograd::module::named_parameters(&flow) {
                grads.push(f64v(&p.grad().expect("flow gradient present")));
            }
            res.push((out, grads));
        }
        let ((c, cg), (d, dg)) = (&res[0], &res[1]);
        for (bc, bd) in [(&c.one2many, &d.one2many), (&c.one2one, &d.one2one)] {
            let (ac, ad) = (bc.assignment.as_ref().expect("host assignment"), bd.assignment.as_ref().expect("host assignment"));
            assert_eq!(ac.fg_mask, ad.fg_mask, "{file}: fg mask");
            assert_eq!(ac.target_gt_idx, ad.target_gt_idx, "{file}: gt idx");
            for (i, name) in LOSS_NAMES.iter().enumerate() {
                let r = rel_scalar(bd.items[i], bc.items[i]);
                assert!(r <= 1e-4, "{file} {name}: cuda {} cpu {}", bd.items[i], bc.items[i]);
            }
        }
        let (tc, td) = (c.total.item().unwrap(), d.total.item().unwrap());
        let gw = cg.iter().zip(dg).map(|(a, b)| rel_dev(b, a, 1e-30)).fold(0f64, f64::max);
        eprintln!("{file}: total cpu {tc} cuda {td} (rel {:.1e}); gradients max rel dev {gw:.1e}", rel_scalar(td, tc));
        assert!(rel_scalar(td, tc) <= 1e-4);
        assert!(gw <= 1e-4, "{file}: gradient deviation {gw:.2e}");
    }
}

/// The dense (fixed-shape) assigner on CUDA against the host assigner on the CPU, on every golden
/// case and both branches: the same foreground, GT indices and boxes, soft scores within 1e-6;
/// while it runs nothing is read back to the host (the backend's counters: no host
/// synchronisation, no device→host copy, no host→device copy). Then its launches and kernel time
/// at the benchmark's shape (batch 4, 640 px, 16 slots), printed for the whole-step issue's budget.
#[test]
fn dense_assignment_on_cuda_matches_the_host() {
    use ptl_trainer::loss::assign_dense::{assign_dense, decode_for_assignment, DenseGeometry, DenseInputs, DeviceTargets};
    let Some((root, gpu)) = goldens_and_gpu() else { return };
    let flow_vals = load(root.join("loss_cases/flow.safetensors"));
    for file in CASES {
        let g = load(root.join("loss_cases").join(file));
        let cfg = LossConfig::default();
        let (anchors, targets) = case_anchors_and_targets(&g);
        let crit = E2ELoss::new(cfg, 100);
        let flow = flow_on(&flow_vals, Device::Cpu);
        let (o2m, o2o) = (branch_leaves_on(&g, "input.one2many.", Device::Cpu), branch_leaves_on(&g, "input.one2one.", Device::Cpu));
        let host = crit.loss(&o2m, &o2o, &targets, &anchors, Some(&flow)).unwrap();
        for (br, prefix, params, h) in [
            ("one2many", "input.one2many.", &crit.one2many.assign, host.one2many.assignment.as_ref().expect("host assignment")),
            ("one2one", "input.one2one.", &crit.one2one.assign, host.one2one.assignment.as_ref().expect("host assignment")),
        ] {
            let outs = branch_leaves_on(&g, prefix, gpu);
            let DenseCase { targets: dt, geometry, decoded: (scores, boxes, kpts) } =
                dense_case(&outs, &targets, &anchors, &params.sigmas, gpu);
            let before = ptl_autograd::internal::cuda::counters();
            let d = assign_dense(&DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt }, params)
                .unwrap();
            let during = ptl_autograd::internal::cuda::counters().since(&before);
            assert_eq!(
                (during.host_syncs, during.device_to_host_copies, during.host_to_device_copies),
                (0, 0, 0),
                "{file} {br}: the dense assigner reads nothing back and uploads nothing ({during:?})"
            );
            let composed = ptl_trainer::loss::assign_dense::assign_composed(
                &DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt },
                params,
            )
            .unwrap();
            assert_same_assignment(&d, &composed, &format!("{file} {br}"));
            let fg: Vec<bool> = d.fg_mask.to_vec::<f32>().unwrap().iter().map(|&v| v != 0.0).collect();
            assert_eq!(fg, h.fg_mask, "{file} {br}: foreground");
            let gi: Vec<usize> = d.target_gt_idx.to_vec::<i64>().unwrap().iter().map(|&v| v as usize).collect();
            assert_eq!(gi, h.target_gt_idx, "{file} {br}: GT index");
            assert_eq!(d.target_bboxes.to_vec::<f32>().unwrap(), h.target_bboxes, "{file} {br}: boxes");
            let ts = d.target_scores.to_vec::<f32>().unwrap();
            let worst = ts.iter().zip(&h.target_scores).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-6, "{file} {br}: soft scores differ by {worst}");
            eprintln!(
                "{file} {br}: dense on CUDA = host ({} foreground, {} launches, scores within {worst:e})",
                fg.iter().filter(|&&f| f).count(),
                during.kernel_launches + during.library_calls
            );
        }
    }
    // The benchmark's shape: batch 4, 640 px (8,400 anchors), 16 slots, random predictions.
    let cfg = LossConfig::default();
    let anchors = Anchors::from_image_hw((640, 640), &cfg.strides).unwrap();
    let na = anchors.len();
    let mut rng = ptl_autograd::Rng::new(5);
    let mut t = ptl_trainer::loss::TargetBatch { nkpt: 17, ..Default::default() };
    for b in 0..4 {
        for _ in 0..(3 + 4 * b) {
            let (w, h) = (0.05 + 0.4 * rng.uniform() as f32, 0.05 + 0.4 * rng.uniform() as f32);
            t.batch_idx.push(b as f32);
            t.cls.push(0.0);
            t.bboxes.extend_from_slice(&[0.5, 0.5, w, h]);
            for k in 0..17 {
                t.keypoints.extend_from_slice(&[0.5 + (k as f32 - 8.0) * w / 20.0, 0.5, 2.0]);
            }
        }
    }
    let padded = ptl_trainer::loss::targets::pad_targets(&t, 4, anchors.image_hw()).unwrap();
    let dt = DeviceTargets::upload(&padded, 16, gpu).unwrap();
    let crit = E2ELoss::new(cfg, 100);
    let geometry = DenseGeometry::new(&anchors, &crit.one2many.assign.sigmas, 1, gpu).unwrap();
    let mut raw = |c: usize| ptl_autograd::Tensor::rand(vec![4, c, na], -2.0, 2.0, ptl_autograd::DType::F32, gpu, &mut rng).unwrap();
    let (rb, rs, rk) = (raw(4).abs().unwrap(), raw(1), raw(51));
    let (scores, boxes, kpts) =
        decode_for_assignment(&rb, &rs, &rk, &DenseGeometry::new(&anchors, &LossConfig::default().sigmas, 1, rb.device()).unwrap())
            .unwrap();
    let inputs = DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt };
    type AssignFn =
        fn(&DenseInputs<'_>, &ptl_trainer::loss::AssignParams) -> ptl_trainer::Result<ptl_trainer::loss::assign_dense::DenseAssignment>;
    let ways: [(&str, AssignFn); 2] = [("fused", assign_dense), ("composed", ptl_trainer::loss::assign_dense::assign_composed)];
    for (way, assign) in ways {
        assign(&inputs, &crit.one2many.assign).unwrap();
        let timer = ptl_autograd::internal::cuda::GpuKernelTimer::start_detailed(gpu).unwrap();
        let before = ptl_autograd::internal::cuda::counters();
        let mut results = Vec::new();
        for params in [&crit.one2many.assign, &crit.one2one.assign] {
            results.push(assign(&inputs, params).unwrap());
        }
        let c = ptl_autograd::internal::cuda::counters().since(&before);
        let (k, detail) = timer.finish_detailed().unwrap();
        eprintln!(
            "dense assignment ({way}) of both branches at batch 4, 640 px, 16 slots: {} launches, {} kernels, {:.3} ms of kernels; largest:",
            c.kernel_launches + c.library_calls,
            k.kernels,
            k.kernel_ns as f64 * 1e-6
        );
        for d in detail.iter().take(12) {
            eprintln!("  {way} kernel {}: {} × {:.3} ms", d.name.chars().take(60).collect::<String>(), d.count, d.ns as f64 * 1e-6);
        }
        if way == "fused" {
            for (params, fused) in [&crit.one2many.assign, &crit.one2one.assign].into_iter().zip(&results) {
                let composed = ptl_trainer::loss::assign_dense::assign_composed(&inputs, params).unwrap();
                assert_same_assignment(fused, &composed, "batch 4, 640 px");
            }
        }
    }
}

/// The fused and composed dense assignments hold the same bytes.
fn assert_same_assignment(
    a: &ptl_trainer::loss::assign_dense::DenseAssignment,
    b: &ptl_trainer::loss::assign_dense::DenseAssignment,
    what: &str,
) {
    let bits = |t: &ptl_autograd::Tensor| -> Vec<u32> { t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect() };
    assert_eq!(bits(&a.fg_mask), bits(&b.fg_mask), "{what}: fused vs composed foreground");
    assert_eq!(a.target_gt_idx.to_vec::<i64>().unwrap(), b.target_gt_idx.to_vec::<i64>().unwrap(), "{what}: fused vs composed GT index");
    assert_eq!(a.target_labels.to_vec::<i64>().unwrap(), b.target_labels.to_vec::<i64>().unwrap(), "{what}: fused vs composed labels");
    assert_eq!(bits(&a.target_bboxes), bits(&b.target_bboxes), "{what}: fused vs composed boxes");
    assert_eq!(bits(&a.target_scores), bits(&b.target_scores), "{what}: fused vs composed soft scores");
}

/// The fused CUDA assigner against the composed ops on the same GPU, bit for bit, on random
/// crowded batches: tiny and large boxes, objects without visible keypoints, images without
/// objects, every bucket up to 64 slots, and both branches' top-k settings (10/10 and 7/1).
#[test]
fn fused_assigner_equals_the_composed_ops_on_random_batches() {
    use ptl_trainer::loss::assign_dense::{
        assign_composed, assign_dense, decode_for_assignment, target_bucket, DenseGeometry, DenseInputs, DeviceTargets,
    };
    let Some(gpu) = gpu() else { return };
    let cfg = LossConfig::default();
    let mut rng = ptl_autograd::Rng::new(21);
    for (case, (hw, counts)) in
        [((128, 160), vec![3, 0, 7]), ((256, 256), vec![1, 12, 0, 30]), ((320, 192), vec![60, 2]), ((64, 64), vec![0, 0])]
            .into_iter()
            .enumerate()
    {
        let anchors = Anchors::from_image_hw(hw, &cfg.strides).unwrap();
        let na = anchors.len();
        let mut t = ptl_trainer::loss::TargetBatch { nkpt: 17, ..Default::default() };
        for (b, &n) in counts.iter().enumerate() {
            for i in 0..n {
                let mut u = |lo: f32, hi: f32| lo + (hi - lo) * rng.uniform() as f32;
                let (w, h) = if i % 4 == 3 { (u(0.01, 0.05), u(0.01, 0.05)) } else { (u(0.08, 0.7), u(0.08, 0.7)) };
                let (cx, cy) = (u(w / 2.0, 1.0 - w / 2.0), u(h / 2.0, 1.0 - h / 2.0));
                t.batch_idx.push(b as f32);
                t.cls.push(0.0);
                t.bboxes.extend_from_slice(&[cx, cy, w, h]);
                let none_visible = i % 5 == 4;
                for _ in 0..17 {
                    let v = if none_visible || u(0.0, 1.0) < 0.3 { 0.0 } else { 2.0 };
                    t.keypoints.extend_from_slice(&[u(cx - w / 2.0, cx + w / 2.0), u(cy - h / 2.0, cy + h / 2.0), v]);
                }
            }
        }
        let bs = counts.len();
        let padded = ptl_trainer::loss::targets::pad_targets(&t, bs, anchors.image_hw()).unwrap();
        let dt = DeviceTargets::upload(&padded, target_bucket(padded.max_boxes).unwrap(), gpu).unwrap();
        let mut raw = |c: usize, lo: f64, hi: f64| {
            ptl_autograd::Tensor::rand(vec![bs, c, na], lo, hi, ptl_autograd::DType::F32, gpu, &mut rng).unwrap()
        };
        let (rb, rs, rk) = (raw(4, 0.0, 4.0), raw(1, -3.0, 2.0), raw(51, -1.5, 1.5));
        let (scores, boxes, kpts) =
            decode_for_assignment(&rb, &rs, &rk, &DenseGeometry::new(&anchors, &LossConfig::default().sigmas, 1, rb.device()).unwrap())
                .unwrap();
        for (topk, topk2) in [(10, 10), (7, 1)] {
            let params = ptl_trainer::loss::AssignParams::pose(topk, topk2, &cfg.strides, &cfg.sigmas);
            let geometry = DenseGeometry::new(&anchors, &params.sigmas, 1, gpu).unwrap();
            let inputs = DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt };
            let fused = assign_dense(&inputs, &params).unwrap();
            let composed = assign_composed(&inputs, &params).unwrap();
            let what = format!("case {case} ({counts:?} at {hw:?}), top-k {topk}/{topk2}");
            assert_same_assignment(&fused, &composed, &what);
            let n_fg = fused.fg_mask.to_vec::<f32>().unwrap().iter().filter(|&&v| v != 0.0).count();
            eprintln!("{what}: fused = composed ({n_fg} foreground anchors, {} slots)", dt.slots);
        }
    }
}

/// The whole criterion (both branches, forward and backward) at the benchmark's shape — batch 4,
/// 640 px, a 16-slot bucket, random raw outputs, the golden flow — on the host path and on the
/// dense path: launches, host synchronisations and summed kernel time of each, printed for the
/// whole-step issue's budget (the loss and assigner ≤ 2 ms of kernels per step). The two totals
/// must agree (the same assignment on the same outputs).
#[test]
fn criterion_kernel_time_at_the_benchmark_shape() {
    let Some((root, gpu)) = goldens_and_gpu() else { return };
    let flow = flow_on(&load(root.join("loss_cases/flow.safetensors")), gpu);
    let anchors = Anchors::from_image_hw((640, 640), &LossConfig::default().strides).unwrap();
    let na = anchors.len();
    let mut rng = ptl_autograd::Rng::new(9);
    let mut t = ptl_trainer::loss::TargetBatch { nkpt: 17, ..Default::default() };
    for b in 0..4 {
        for i in 0..(2 + 3 * b) {
            let (w, h) = (0.05 + 0.4 * rng.uniform() as f32, 0.05 + 0.4 * rng.uniform() as f32);
            let (cx, cy) = (w / 2.0 + (1.0 - w) * rng.uniform() as f32, h / 2.0 + (1.0 - h) * rng.uniform() as f32);
            t.batch_idx.push(b as f32);
            t.cls.push(0.0);
            t.bboxes.extend_from_slice(&[cx, cy, w, h]);
            for k in 0..17 {
                let v = if (i + k) % 5 == 0 { 0.0 } else { 2.0 };
                t.keypoints.extend_from_slice(&[cx + (k as f32 - 8.0) * w / 20.0, cy + (k as f32 % 3.0 - 1.0) * h / 4.0, v]);
            }
        }
    }
    let mut raw =
        |c: usize, lo: f64, hi: f64| ptl_autograd::Tensor::rand(vec![4, c, na], lo, hi, ptl_autograd::DType::F32, gpu, &mut rng).unwrap();
    let leaves = [raw(4, 0.0, 3.0), raw(1, -3.0, 1.0), raw(51, -1.0, 1.0), raw(34, -2.0, 2.0)];
    let outs = |i: usize| ptl_trainer::loss::BranchOutputs {
        boxes: leaves[0].narrow(1, 0, 4).unwrap().add_scalar(0.1 * i as f64).unwrap().detach().requires_grad_(true).unwrap(),
        scores: leaves[1].detach().requires_grad_(true).unwrap(),
        kpts: leaves[2].detach().requires_grad_(true).unwrap(),
        kpts_sigma: Some(leaves[3].detach().requires_grad_(true).unwrap()),
    };
    let mut totals = Vec::new();
    for dense in [false, true] {
        let cfg = LossConfig { dense_assignment: dense, ..LossConfig::default() };
        let mut crit = E2ELoss::new(cfg, 100);
        crit.set_updates(40);
        let run = || {
            let (o2m, o2o) = (outs(0), outs(1));
            let out = crit.loss(&o2m, &o2o, &t, &anchors, Some(&flow)).unwrap();
            out.total.backward().unwrap();
            out.total.detach().item().unwrap()
        };
        run();
        let timer = ptl_autograd::internal::cuda::GpuKernelTimer::start_detailed(gpu).unwrap();
        let before = ptl_autograd::internal::cuda::counters();
        let total = run();
        let c = ptl_autograd::internal::cuda::counters().since(&before);
        let (k, detail) = timer.finish_detailed().unwrap();
        let path = if dense { "dense" } else { "host" };
        eprintln!(
            "criterion ({path}) at batch 4, 640 px, forward + backward: total {total:.6}, {} launches, {} host syncs, {} kernels, {:.3} ms of kernels; largest:",
            c.kernel_launches + c.library_calls,
            c.host_syncs,
            k.kernels,
            k.kernel_ns as f64 * 1e-6
        );
        for d in detail.iter().take(14) {
            eprintln!("  {path} kernel {}: {} × {:.3} ms", d.name.chars().take(60).collect::<String>(), d.count, d.ns as f64 * 1e-6);
        }
        totals.push(total);
    }
    assert!(rel_scalar(totals[1], totals[0]) <= 1e-4, "dense total {} vs host {}", totals[1], totals[0]);
}

/// A flow on `device` from seed 5 whose weights are scaled by `gain` (the reference init's
/// Xavier gain 0.01 leaves the flow nearly the identity; a larger gain exercises every path).
fn scaled_flow(device: Device, gain: f64) -> ptl_heads::RealNvp {
    let mut rng = ptl_autograd::Rng::new(5);
    let flow = ptl_heads::RealNvp::new(&mut ptl_heads::nn::Init { rng: &mut rng, device }).unwrap();
    ptl_autograd::no_grad(|| {
        for (name, p) in ptl_autograd::module::named_parameters(&flow) {
            let k = if name.ends_with("weight") { gain } else { 1.0 };
            p.copy_(&p.mul_scalar(k).unwrap()).unwrap();
        }
    });
    flow
}

/// The fused CUDA flow (`loss::flow_fused`) against the composed `RealNvp::log_prob` on the same
/// GPU, in f32 and under bf16 and f16 autocast: log p, ∂/∂e and every parameter's gradient, for a
/// row count that is not a multiple of the kernels' tile and an upstream gradient that is zero on
/// a tail of rows (the kernels skip tiles of zero-gradient rows).
#[test]
fn fused_flow_matches_composed() {
    use ptl_autograd::{DType, Tensor};
    let Some(gpu) = gpu() else { return };
    let n = 1_003;
    let mut rng = ptl_autograd::Rng::new(11);
    let e0 = Tensor::randn(vec![n, 2], 0.0, 3.0, DType::F32, gpu, &mut rng).unwrap();
    let gv: Vec<f32> = (0..n).map(|i| if i < 700 { ((i * 37 % 101) as f32 - 50.0) / 40.0 } else { 0.0 }).collect();
    let g = Tensor::from_vec(gv, vec![n], gpu).unwrap();
    // (autocast, max deviation relative to each tensor's max |value|)
    for (autocast, tol) in [(None, 1e-4), (Some(DType::BF16), 3e-2), (Some(DType::F16), 5e-3)] {
        let mut runs = Vec::new();
        for fused in [false, true] {
            let flow = scaled_flow(gpu, 60.0);
            let e = e0.deep_copy().unwrap().requires_grad_(true).unwrap();
            let lp = ptl_autograd::autocast(autocast, || {
                if fused {
                    ptl_trainer::loss::flow_fused::log_prob(&flow, &e).unwrap().expect("the fused kernels take this flow")
                } else {
                    flow.log_prob(&e).unwrap()
                }
            });
            lp.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let mut vals = vec![("log p".to_string(), f64v(&lp)), ("d/de".to_string(), f64v(&e.grad().expect("d/de present")))];
            for (name, p) in ptl_autograd::module::named_parameters(&flow) {
                vals.push((name, f64v(&p.grad().expect("flow gradient present"))));
            }
            runs.push(vals);
        }
        let mut worst = (0f64, String::new());
        for ((name, c), (_, f)) in runs[0].iter().zip(&runs[1]) {
            let d = rel_dev(f, c, 1e-30);
            assert!(d.is_finite(), "{autocast:?} {name}: non-finite deviation");
            if d > worst.0 {
                worst = (d, name.clone());
            }
        }
        eprintln!("fused flow {autocast:?}: worst deviation {:.2e} ({})", worst.0, worst.1);
        assert!(worst.0 <= tol, "{autocast:?}: {} deviates by {:.2e} (> {tol:.0e})", worst.1, worst.0);
    }
}

/// The fused CUDA CIoU (`loss::ciou_fused`) against the composed `boxes::ciou` on the same GPU:
/// values and the predictions' gradient, on box pairs that overlap, nest, touch, share edges
/// exactly (the minimum/maximum ties) and lie apart.
#[test]
fn fused_ciou_matches_composed() {
    use ptl_autograd::Tensor;
    let Some(gpu) = gpu() else { return };
    let n = 2_000;
    let mut rng = ptl_autograd::Rng::new(3);
    let mut p = Vec::with_capacity(4 * n);
    let mut t = Vec::with_capacity(4 * n);
    for i in 0..n {
        let (tx, ty) = (rng.uniform_range(0.0, 40.0) as f32, rng.uniform_range(0.0, 40.0) as f32);
        let (tw, th) = (rng.uniform_range(0.5, 20.0) as f32, rng.uniform_range(0.5, 20.0) as f32);
        let tb = [tx, ty, tx + tw, ty + th];
        let mut pb = [0f32; 4];
        for (k, v) in pb.iter_mut().enumerate() {
            *v = tb[k] + rng.uniform_range(-6.0, 6.0) as f32;
        }
        match i % 5 {
            0 => pb = [pb[0].min(pb[2] - 0.1), pb[1].min(pb[3] - 0.1), pb[2], pb[3]],
            1 => (pb[0], pb[2]) = (tb[0], tb[2].max(tb[0] + 0.2)), // equal x edges: ties
            2 => pb = [tb[0] + 1.0, tb[1] + 1.0, tb[0] + 2.0, tb[1] + 2.0], // nested (or touching)
            3 => pb = [tb[2] + 5.0, tb[3] + 5.0, tb[2] + 9.0, tb[3] + 7.0], // apart
            _ => pb = [pb[0].min(pb[2] - 0.1), pb[1].min(pb[3] - 0.1), pb[2], pb[3]],
        }
        p.extend(pb);
        t.extend(tb);
    }
    let gv: Vec<f32> = (0..n).map(|i| ((i * 29 % 53) as f32 - 26.0) / 13.0).collect();
    let g = Tensor::from_vec(gv, vec![n, 1], gpu).unwrap();
    let target = Tensor::from_vec(t, vec![n, 4], gpu).unwrap();
    let was_enabled = ptl_trainer::loss::ciou_fused::enabled();
    let mut runs = Vec::new();
    for fused in [false, true] {
        let pred = Tensor::from_vec(p.clone(), vec![n, 4], gpu).unwrap().requires_grad_(true).unwrap();
        ptl_trainer::loss::ciou_fused::set_enabled(fused);
        assert_eq!(ptl_trainer::loss::ciou_fused::supports(&pred, &target), fused);
        let c = match fused {
            true => ptl_trainer::loss::ciou_fused::ciou(&pred, &target).unwrap(),
            false => ptl_trainer::loss::boxes::ciou(&pred, &target).unwrap(),
        };
        assert_eq!(c.dims(), [n, 1]);
        c.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        runs.push((f64v(&c), f64v(&pred.grad().expect("gradient present"))));
    }
    // Later tests of this binary run with the setting they would have had without this one.
    ptl_trainer::loss::ciou_fused::set_enabled(was_enabled);
    let (dv, dg) = (rel_dev(&runs[1].0, &runs[0].0, 1e-30), rel_dev(&runs[1].1, &runs[0].1, 1e-30));
    eprintln!("fused CIoU: values within {dv:.2e}, gradients within {dg:.2e} of the composed op's max");
    assert!(dv <= 1e-5, "values deviate by {dv:.2e}");
    assert!(dg <= 1e-4, "gradients deviate by {dg:.2e}");
}

/// The fused CUDA terms of the dense loss — keypoints (`loss::kpt_fused`: OKS term, visibility
/// BCE, RLE rows) and box rows (`loss::ciou_fused::box_rows`: CIoU and side-L1 terms) — against
/// the composed ops on the same GPU, on every golden case and both branches:
/// the six items within 1e-5 relative (the keypoint and visibility items bit for bit when the
/// element arithmetic matches; the RLE sums the same rows), and the gradients of the raw outputs
/// and of the flow within 1e-4 of each tensor's largest value. Both runs must have foreground
/// keypoints for the comparison to mean anything: the case's pose item is checked non-zero where
/// the case has visible keypoints.
#[test]
fn fused_dense_terms_match_composed() {
    use ptl_trainer::loss::assign_dense::{assign_dense, DenseInputs};
    use ptl_trainer::loss::dense::{dense_branch_terms, DenseConstants};
    let Some((root, gpu)) = goldens_and_gpu() else { return };
    let flow_vals = load(root.join("loss_cases/flow.safetensors"));
    let was_enabled = (ptl_trainer::loss::kpt_fused::enabled(), ptl_trainer::loss::ciou_fused::enabled());
    let mut worst = (0f64, String::new());
    let mut with_keypoints = 0;
    for file in CASES {
        let g = load(root.join("loss_cases").join(file));
        let cfg = LossConfig::default();
        let (anchors, targets) = case_anchors_and_targets(&g);
        let crit = E2ELoss::new(cfg.clone(), 100);
        for (br, prefix, params) in
            [("one2many", "input.one2many.", &crit.one2many.assign), ("one2one", "input.one2one.", &crit.one2one.assign)]
        {
            let mut runs = Vec::new();
            for fused in [false, true] {
                ptl_trainer::loss::kpt_fused::set_enabled(fused);
                ptl_trainer::loss::ciou_fused::set_enabled(fused);
                let calls_before = (ptl_trainer::loss::kpt_fused::calls(), ptl_trainer::loss::ciou_fused::box_rows_calls());
                let outs = branch_leaves_on(&g, prefix, gpu);
                let flow = flow_on(&flow_vals, gpu);
                let bs = outs.boxes.dims()[0];
                let DenseCase { targets: dt, geometry, decoded: (scores, boxes, kpts) } =
                    dense_case(&outs, &targets, &anchors, &params.sigmas, gpu);
                let asg =
                    assign_dense(&DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt }, params)
                        .unwrap();
                let consts = DenseConstants::new(&cfg, params, &anchors, bs, dt.slots, gpu).unwrap();
                let terms = dense_branch_terms(&cfg, &outs, &asg, &dt, &consts, Some(&flow)).unwrap();
                terms.mul_scalar(bs as f64).unwrap().sum_all().unwrap().backward().unwrap();
                let ran = (
                    ptl_trainer::loss::kpt_fused::calls() - calls_before.0,
                    ptl_trainer::loss::ciou_fused::box_rows_calls() - calls_before.1,
                );
                assert_eq!(
                    ran,
                    (u64::from(fused), u64::from(fused)),
                    "{file} {br}: fused calls with fused = {fused} (last refusal: {:?})",
                    ptl_trainer::loss::kpt_fused::last_refusal()
                );
                let mut grads: Vec<(String, Vec<f64>)> = [("boxes", &outs.boxes), ("scores", &outs.scores), ("kpts", &outs.kpts)]
                    .into_iter()
                    .chain(outs.kpts_sigma.as_ref().map(|s| ("kpts_sigma", s)))
                    .map(|(k, t)| (k.to_string(), f64v(&t.grad().expect("gradient of the raw output"))))
                    .collect();
                for (name, p) in ptl_autograd::module::named_parameters(&flow) {
                    if let Some(gr) = p.grad() {
                        grads.push((format!("flow {name}"), f64v(&gr)));
                    }
                }
                runs.push((f64v(&terms), grads));
            }
            ptl_trainer::loss::kpt_fused::set_enabled(was_enabled.0);
            ptl_trainer::loss::ciou_fused::set_enabled(was_enabled.1);
            let ((composed, cg), (fused, fg)) = (&runs[0], &runs[1]);
            for i in 0..6 {
                let d = rel_scalar(fused[i], composed[i]);
                assert!(d <= 1e-5, "{file} {br} {}: fused {} vs composed {} ({d:.2e})", LOSS_NAMES[i], fused[i], composed[i]);
                if d > worst.0 {
                    worst = (d, format!("{file} {br} item {}", LOSS_NAMES[i]));
                }
            }
            if composed[1] != 0.0 {
                with_keypoints += 1;
            }
            assert_eq!(cg.len(), fg.len(), "{file} {br}: the same gradients are present");
            for ((name, a), (_, b)) in cg.iter().zip(fg) {
                let d = rel_dev(b, a, 1e-30);
                assert!(d <= 1e-4, "{file} {br} gradient {name}: {d:.2e}");
                if d > worst.0 {
                    worst = (d, format!("{file} {br} gradient {name}"));
                }
            }
        }
    }
    assert!(with_keypoints >= 4, "only {with_keypoints} branch runs had a keypoint term: the comparison checked little");
    eprintln!("fused dense terms: worst deviation {:.2e} ({})", worst.0, worst.1);
}

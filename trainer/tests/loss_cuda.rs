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

/// The goldens' folder and a CUDA device, or `None` (with the reason printed) to skip.
fn goldens_and_gpu() -> Option<(std::path::PathBuf, Device)> {
    let root = goldens()?;
    let gpu = Device::auto();
    if !gpu.is_cuda() {
        eprintln!("skipping: no usable CUDA device");
        return None;
    }
    Some((root, gpu))
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
    use ptl_trainer::loss::assign_dense::{assign_dense, decode_for_assignment, target_bucket, DenseGeometry, DenseInputs, DeviceTargets};
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
            let bs = outs.boxes.dims()[0];
            let padded = ptl_trainer::loss::targets::pad_targets(&targets, bs, anchors.image_hw()).unwrap();
            let dt = DeviceTargets::upload(&padded, target_bucket(padded.max_boxes).unwrap(), gpu).unwrap();
            let geometry = DenseGeometry::new(&anchors, &params.sigmas, outs.scores.dims()[1], gpu).unwrap();
            let (scores, boxes, kpts) = decode_for_assignment(&outs.boxes, &outs.scores, &outs.kpts, &anchors).unwrap();
            let before = ptl_autograd::cuda::counters();
            let d = assign_dense(&DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt }, params)
                .unwrap();
            let during = ptl_autograd::cuda::counters().since(&before);
            assert_eq!(
                (during.host_syncs, during.device_to_host_copies, during.host_to_device_copies),
                (0, 0, 0),
                "{file} {br}: the dense assigner reads nothing back and uploads nothing ({during:?})"
            );
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
    let (scores, boxes, kpts) = decode_for_assignment(&rb, &rs, &rk, &anchors).unwrap();
    let inputs = DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt };
    assign_dense(&inputs, &crit.one2many.assign).unwrap();
    let timer = ptl_autograd::cuda::GpuKernelTimer::start_detailed(gpu).unwrap();
    let before = ptl_autograd::cuda::counters();
    for params in [&crit.one2many.assign, &crit.one2one.assign] {
        assign_dense(&inputs, params).unwrap();
    }
    let c = ptl_autograd::cuda::counters().since(&before);
    let (k, detail) = timer.finish_detailed().unwrap();
    eprintln!(
        "dense assignment of both branches at batch 4, 640 px, 16 slots: {} launches, {} kernels, {:.3} ms of kernels; largest:",
        c.kernel_launches + c.library_calls,
        k.kernels,
        k.kernel_ns as f64 * 1e-6
    );
    for d in detail.iter().take(12) {
        eprintln!("  dense kernel {}: {} × {:.3} ms", d.name.chars().take(60).collect::<String>(), d.count, d.ns as f64 * 1e-6);
    }
}

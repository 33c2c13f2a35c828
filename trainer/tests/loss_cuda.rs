//! The criterion on CUDA (fp32) against the same criterion on CPU, on every golden loss case:
//! items and total within 1e-4 relative, assignments identical, gradients of the raw outputs and
//! of the flow within 1e-4 of each tensor's max |value|. Skips when no GPU answers.

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

#[test]
fn loss_cases_cuda_match_cpu() {
    let Some(root) = goldens() else { return };
    let gpu = Device::auto();
    if !gpu.is_cuda() {
        eprintln!("skipping: no usable CUDA device");
        return;
    }
    let flow_vals = load(root.join("loss_cases/flow.safetensors"));
    for file in CASES {
        let g = load(root.join("loss_cases").join(file));
        let hw = f64v(get(&g, "input.image_hw"));
        let cfg = LossConfig::default();
        let anchors = Anchors::from_image_hw((hw[0] as usize, hw[1] as usize), &cfg.strides).unwrap();
        let targets = target_batch(&g, "batch.");
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
            assert_eq!(bc.assignment.fg_mask, bd.assignment.fg_mask, "{file}: fg mask");
            assert_eq!(bc.assignment.target_gt_idx, bd.assignment.target_gt_idx, "{file}: gt idx");
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

//! Edge cases of the loss: no targets, invisible keypoints, tiny boxes, more targets than anchors,
//! non-finite predictions, shape errors, the o2m/o2o schedule and the spec's worked examples.

mod loss_support;

use ptl_autograd::{Device, Rng, Tensor};
use ptl_heads::nn::Init;
use ptl_heads::RealNvp;
use ptl_trainer::loss::terms::{keypoint_loss, rle_loss};
use ptl_trainer::loss::{Anchors, BranchOutputs, E2ELoss, FlowLogProb, LossConfig, TargetBatch};
use ptl_trainer::TrainerError;

const HW: (usize, usize) = (64, 96);

fn anchors() -> Anchors {
    Anchors::from_image_hw(HW, &LossConfig::default().strides).unwrap()
}

/// Deterministic pseudo-random values in [lo, hi).
fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn outputs(bs: usize, seed: u64) -> BranchOutputs {
    let a = anchors().len();
    let leaf = |v: Vec<f32>, c: usize| Tensor::from_vec(v, (bs, c, a), Device::Cpu).unwrap().requires_grad_(true).unwrap();
    BranchOutputs {
        boxes: leaf(values(bs * 4 * a, seed, 0.5, 3.0), 4),
        scores: leaf(values(bs * a, seed + 1, -6.0, 1.0), 1),
        kpts: leaf(values(bs * 51 * a, seed + 2, -2.0, 2.0), 51),
        kpts_sigma: Some(leaf(values(bs * 34 * a, seed + 3, -3.0, 1.0), 34)),
    }
}

fn flow() -> RealNvp {
    let mut rng = Rng::new(7);
    RealNvp::new(&mut Init { rng: &mut rng, device: Device::Cpu }).unwrap()
}

/// One person per (cx, cy, w, h) in pixels, all 17 keypoints spread inside the box with `v`.
fn people(boxes: &[(usize, f32, f32, f32, f32)], v: f32) -> TargetBatch {
    let (h, w) = (HW.0 as f32, HW.1 as f32);
    let mut t = TargetBatch { nkpt: 17, ..Default::default() };
    for (i, &(b, cx, cy, bw, bh)) in boxes.iter().enumerate() {
        t.batch_idx.push(b as f32);
        t.cls.push(0.0);
        t.bboxes.extend_from_slice(&[cx / w, cy / h, bw / w, bh / h]);
        let r = values(34, 100 + i as u64, -0.45, 0.45);
        for k in 0..17 {
            t.keypoints.extend_from_slice(&[(cx + r[2 * k] * bw) / w, (cy + r[2 * k + 1] * bh) / h, v]);
        }
    }
    t
}

fn all_grads_present(o: &BranchOutputs) {
    for t in [&o.boxes, &o.scores, &o.kpts, o.kpts_sigma.as_ref().unwrap()] {
        let g = t.grad().expect("gradient present");
        assert!(g.to_vec::<f32>().unwrap().iter().all(|v| v.is_finite()));
    }
}

fn flow_grads_present(f: &RealNvp) {
    for (name, p) in ptl_autograd::module::named_parameters(f) {
        assert!(p.grad().is_some(), "flow gradient {name} absent");
    }
}

#[test]
fn no_targets_gives_cls_only_and_connected_zero_gradients() {
    let (o2m, o2o, f) = (outputs(2, 1), outputs(2, 11), flow());
    let t = TargetBatch { nkpt: 17, ..Default::default() };
    let out = E2ELoss::new(LossConfig::default(), 10).loss(&o2m, &o2o, &t, &anchors(), Some(&f)).unwrap();
    for (i, v) in out.items.iter().enumerate() {
        if i == 3 {
            assert!(*v > 0.0);
        } else {
            assert_eq!(*v, 0.0, "slot {i}");
        }
    }
    assert!(out.one2many.assignment.as_ref().expect("host assignment").fg_mask.iter().all(|f| !f));
    out.total.backward().unwrap();
    all_grads_present(&o2m);
    all_grads_present(&o2o);
    flow_grads_present(&f);
    let gb = o2m.boxes.grad().unwrap().to_vec::<f32>().unwrap();
    assert!(gb.iter().all(|&v| v == 0.0), "box gradient is zero without foreground");
}

#[test]
fn image_without_people_next_to_one_with_people() {
    let (o2m, o2o, f) = (outputs(2, 2), outputs(2, 12), flow());
    let t = people(&[(1, 40.0, 30.0, 40.0, 50.0)], 2.0);
    let out = E2ELoss::new(LossConfig::default(), 10).loss(&o2m, &o2o, &t, &anchors(), Some(&f)).unwrap();
    let a = anchors().len();
    let fg = &out.one2many.assignment.as_ref().expect("host assignment").fg_mask;
    assert!(fg[..a].iter().all(|f| !f), "image 0 has no foreground");
    assert!(fg[a..].iter().any(|&f| f));
    assert!(out.items.iter().all(|v| v.is_finite()));
}

#[test]
fn all_keypoints_invisible() {
    let (o2m, o2o, f) = (outputs(1, 3), outputs(1, 13), flow());
    let t = people(&[(0, 48.0, 32.0, 40.0, 40.0)], 0.0);
    let out = E2ELoss::new(LossConfig::default(), 10).loss(&o2m, &o2o, &t, &anchors(), Some(&f)).unwrap();
    let it = out.one2many.items;
    assert!(out.one2many.assignment.as_ref().expect("host assignment").fg_mask.iter().any(|&f| f), "CIoU fallback still assigns");
    assert_eq!(it[1], 0.0, "pose loss numerator is empty");
    assert_eq!(it[5], 0.0, "no visible keypoint: no RLE");
    assert!(it[2] > 0.0, "kobj still trains visibility towards 0");
    assert!(it[0] > 0.0 && it[3] > 0.0);
    out.total.backward().unwrap();
    all_grads_present(&o2m);
    flow_grads_present(&f);
}

#[test]
fn tiny_boxes_use_the_size_floor() {
    let (o2m, o2o, f) = (outputs(1, 4), outputs(1, 14), flow());
    // 2×3 px and 1×40 px boxes: without the 16-px floor no anchor centre would be inside.
    let t = people(&[(0, 20.0, 20.0, 2.0, 3.0), (0, 70.0, 30.0, 1.0, 40.0)], 1.0);
    let mut crit = E2ELoss::new(LossConfig::default(), 10);
    crit.one2many.assign.debug = true;
    let out = crit.loss(&o2m, &o2o, &t, &anchors(), Some(&f)).unwrap();
    let asg = out.one2many.assignment.as_ref().expect("host assignment");
    let na = asg.num_anchors;
    for g in 0..2 {
        assert!(asg.candidates[g * na..(g + 1) * na].iter().any(|&c| c), "gt {g} has candidates");
    }
    assert!(out.items.iter().chain(out.one2many.items.iter()).all(|v| v.is_finite()));
    out.total.backward().unwrap();
    all_grads_present(&o2o);
}

#[test]
fn more_targets_than_anchors_can_serve() {
    let (o2m, o2o, f) = (outputs(1, 5), outputs(1, 15), flow());
    // 120 overlapping people on a 64×96 image with 84 anchors.
    let boxes: Vec<(usize, f32, f32, f32, f32)> = (0..120)
        .map(|i| {
            let r = values(4, 500 + i, 0.0, 1.0);
            (0, 10.0 + 76.0 * r[0], 10.0 + 44.0 * r[1], 8.0 + 40.0 * r[2], 8.0 + 40.0 * r[3])
        })
        .collect();
    let t = people(&boxes, 2.0);
    let out = E2ELoss::new(LossConfig::default(), 10).loss(&o2m, &o2o, &t, &anchors(), Some(&f)).unwrap();
    for bl in [&out.one2many, &out.one2one] {
        let a = bl.assignment.as_ref().expect("host assignment");
        let n_fg = a.fg_indices().len();
        assert!(n_fg > 0 && n_fg <= a.num_anchors);
        assert!(bl.items.iter().all(|v| v.is_finite()));
    }
    // o2o: every GT keeps at most one positive anchor.
    let a = out.one2one.assignment.as_ref().expect("host assignment");
    let mut per_gt = vec![0usize; a.max_boxes];
    for i in a.fg_indices() {
        per_gt[a.target_gt_idx[i]] += 1;
    }
    assert!(per_gt.iter().all(|&c| c <= 1), "o2o: at most one anchor per GT");
    out.total.backward().unwrap();
    all_grads_present(&o2m);
}

#[test]
fn nan_in_predictions_is_a_typed_error() {
    let f = flow();
    let t = people(&[(0, 48.0, 32.0, 40.0, 40.0)], 2.0);
    let crit = E2ELoss::new(LossConfig::default(), 10);
    for which in 0..4 {
        let o2m = outputs(1, 6);
        let src = match which {
            0 => &o2m.boxes,
            1 => &o2m.scores,
            2 => &o2m.kpts,
            _ => o2m.kpts_sigma.as_ref().unwrap(),
        };
        let mut v = src.to_vec::<f32>().unwrap();
        v[5] = f32::NAN;
        let bad = Tensor::from_vec(v, src.dims().to_vec(), Device::Cpu).unwrap();
        let mut o = o2m.clone();
        match which {
            0 => o.boxes = bad,
            1 => o.scores = bad,
            2 => o.kpts = bad,
            _ => o.kpts_sigma = Some(bad),
        }
        let err = crit.loss(&o, &outputs(1, 16), &t, &anchors(), Some(&f)).unwrap_err();
        assert!(matches!(err, TrainerError::NonFinite { index: 5, .. }), "case {which}: {err}");
    }
}

#[test]
fn shape_errors_are_reported() {
    let f = flow();
    let t = people(&[(0, 48.0, 32.0, 40.0, 40.0)], 2.0);
    let crit = E2ELoss::new(LossConfig::default(), 10);
    let wrong = Anchors::from_image_hw((128, 128), &LossConfig::default().strides).unwrap();
    let err = crit.loss(&outputs(1, 7), &outputs(1, 17), &t, &wrong, Some(&f)).unwrap_err();
    assert!(matches!(err, TrainerError::ShapeMismatch { .. }), "{err}");
    // A target pointing at image 3 of a batch of 1.
    let mut t2 = t.clone();
    t2.batch_idx[0] = 3.0;
    let err = crit.loss(&outputs(1, 7), &outputs(1, 17), &t2, &anchors(), Some(&f)).unwrap_err();
    assert!(matches!(err, TrainerError::InvalidArgument { .. }), "{err}");
    // Sigma views without a flow.
    let err = crit.loss(&outputs(1, 7), &outputs(1, 17), &t, &anchors(), None).unwrap_err();
    assert!(matches!(err, TrainerError::InvalidArgument { .. }), "{err}");
}

#[test]
fn eval_mode_outputs_without_sigma_have_zero_rle() {
    let t = people(&[(0, 48.0, 32.0, 40.0, 40.0)], 2.0);
    let (mut a, mut b) = (outputs(1, 8), outputs(1, 18));
    a.kpts_sigma = None;
    b.kpts_sigma = None;
    let out = E2ELoss::new(LossConfig::default(), 10).loss(&a, &b, &t, &anchors(), None).unwrap();
    assert_eq!(out.items[5], 0.0);
    assert!(out.items[1] > 0.0);
}

#[test]
fn o2m_o2o_schedule_matches_spec_examples() {
    let mut c = E2ELoss::new(LossConfig::default(), 100);
    assert_eq!((c.w_o2m, c.w_o2o), (0.8, 1.0 - 0.8));
    let expect = [(1usize, 0.7929, 0.2071), (50, 0.4465, 0.5535), (98, 0.1071, 0.8929), (99, 0.100, 0.900)];
    let mut u = 0;
    for (epoch, wm, wo) in expect {
        while u < epoch {
            c.update();
            u += 1;
        }
        assert!((c.w_o2m - wm).abs() < 5e-5 && (c.w_o2o - wo).abs() < 5e-5, "epoch {epoch}: {} {}", c.w_o2m, c.w_o2o);
    }
    // Past the last epoch the weights stay at the floor; resume sets them directly.
    c.update();
    assert!((c.w_o2m - 0.1).abs() < 1e-12);
    let mut r = E2ELoss::new(LossConfig::default(), 100);
    r.set_updates(50);
    assert_eq!(r.w_o2m, {
        let mut s = E2ELoss::new(LossConfig::default(), 100);
        for _ in 0..50 {
            s.update();
        }
        s.w_o2m
    });
}

fn t2(v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape.to_vec(), Device::Cpu).unwrap()
}

#[test]
fn keypoint_loss_worked_example() {
    // docs/loss.md §3.4: GT box 100×200 px on stride 8, three visible keypoints.
    let s = 8f32;
    let area = (100.0 / s) * (200.0 / s);
    let sig = [0.026f32, 0.079, 0.107];
    let denom: Vec<f32> = sig.iter().map(|&k| (2.0 * k) * (2.0 * k) * (area + 1e-9) * 2.0).collect();
    let px = t2(vec![52.0 / s, 35.0 / s, 40.0 / s], &[1, 3]);
    let py = t2(vec![21.0 / s, 60.0 / s, 130.0 / s], &[1, 3]);
    let gx = t2(vec![50.0 / s, 30.0 / s, 40.0 / s], &[1, 3]);
    let gy = t2(vec![20.0 / s, 60.0 / s, 120.0 / s], &[1, 3]);
    let m = t2(vec![1.0; 3], &[1, 3]);
    let fac = t2(vec![3.0 / (3.0 + 1e-9)], &[1, 1]);
    let l = keypoint_loss(&px, &py, &gx, &gy, &m, &t2(denom, &[1, 3]), &fac).unwrap().item().unwrap();
    assert!((l - 0.041009).abs() < 2e-6, "{l}");
}

struct IdentityFlow;
impl FlowLogProb for IdentityFlow {
    fn log_prob(&self, e: &Tensor) -> ptl_trainer::Result<Tensor> {
        let ln2pi = (2.0 * std::f64::consts::PI).ln();
        Ok(e.square()?.sum_dim(1, false)?.affine(-0.5, -ln2pi)?)
    }
}

#[test]
fn rle_worked_example_with_identity_flow() {
    // docs/loss.md §3.6: pred (10.3, 5.0), GT (10.0, 5.2), sigma logits (0, −1) → 3.305912.
    let pred = t2(vec![10.3, 5.0], &[1, 2]).requires_grad_(true).unwrap();
    let sig = t2(vec![0.0, -1.0], &[1, 2]);
    let gt = t2(vec![10.0, 5.2], &[1, 2]);
    let l = rle_loss(&pred, &sig, &gt, &[1.0], f64::from(f32::MIN_POSITIVE), &IdentityFlow).unwrap().unwrap();
    assert!((l.item().unwrap() - 3.305912).abs() < 2e-5, "{}", l.item().unwrap());
    l.backward().unwrap();
    assert!(pred.grad().is_some());
}

#[test]
fn half_precision_outputs_are_computed_in_f32() {
    let t = people(&[(0, 48.0, 32.0, 40.0, 40.0)], 2.0);
    let f = flow();
    let crit = E2ELoss::new(LossConfig::default(), 10);
    let (a, b) = (outputs(1, 10), outputs(1, 20));
    let reference = crit.loss(&a, &b, &t, &anchors(), Some(&f)).unwrap();
    let to = |o: &BranchOutputs, dt: ptl_autograd::DType| BranchOutputs {
        boxes: o.boxes.to_dtype(dt).unwrap(),
        scores: o.scores.to_dtype(dt).unwrap(),
        kpts: o.kpts.to_dtype(dt).unwrap(),
        kpts_sigma: o.kpts_sigma.as_ref().map(|s| s.to_dtype(dt).unwrap()),
    };
    for dt in [ptl_autograd::DType::BF16, ptl_autograd::DType::F16] {
        let out = crit.loss(&to(&a, dt), &to(&b, dt), &t, &anchors(), Some(&f)).unwrap();
        assert_eq!(out.total.dtype(), ptl_autograd::DType::F32);
        let (x, y) = (out.total.item().unwrap(), reference.total.item().unwrap());
        assert!((x - y).abs() <= 5e-2 * y.abs(), "{dt}: {x} vs {y}");
        out.total.backward().unwrap();
        assert!(a.boxes.grad().is_some());
    }
}

#[test]
fn degenerate_boxes_and_bad_classes() {
    let (o2m, o2o, f) = (outputs(1, 9), outputs(1, 19), flow());
    // Zero width, zero height, and a box hanging over the image border.
    let t = people(&[(0, 30.0, 30.0, 0.0, 20.0), (0, 50.0, 20.0, 20.0, 0.0), (0, 92.0, 60.0, 30.0, 30.0)], 2.0);
    let out = E2ELoss::new(LossConfig::default(), 10).loss(&o2m, &o2o, &t, &anchors(), Some(&f)).unwrap();
    assert!(out.one2many.items.iter().chain(out.items.iter()).all(|v| v.is_finite()), "{:?}", out.one2many.items);
    out.total.backward().unwrap();
    all_grads_present(&o2m);
    // A class id outside 0..nc is an error, not an out-of-bounds read.
    let mut bad = people(&[(0, 48.0, 32.0, 40.0, 40.0)], 2.0);
    bad.cls[0] = 3.0;
    let err = E2ELoss::new(LossConfig::default(), 10).loss(&outputs(1, 9), &outputs(1, 19), &bad, &anchors(), Some(&f)).unwrap_err();
    assert!(matches!(err, TrainerError::InvalidArgument { .. }), "{err}");
}

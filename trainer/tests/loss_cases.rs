//! Golden loss cases (the goldens' `loss_cases/`): per-term items, assignment, gradients.

mod loss_support;

use loss_support::*;
use ptl_trainer::loss::{Anchors, Assignment, E2ELoss, LossConfig, LOSS_NAMES};

fn check_assignment(tag: &str, a: &Assignment, g: &std::collections::HashMap<String, ptl_autograd::Tensor>, br: &str) {
    let fg_ref = f64v(get(g, &format!("assign.{br}.fg_mask")));
    let idx_ref = f64v(get(g, &format!("assign.{br}.target_gt_idx")));
    let fg: Vec<f64> = a.fg_mask.iter().map(|&f| f64::from(u8::from(f))).collect();
    let fg_diff = fg.iter().zip(&fg_ref).filter(|(x, y)| x != y).count();
    let idx_diff = (0..fg.len()).filter(|&i| fg_ref[i] != 0.0 && a.target_gt_idx[i] as f64 != idx_ref[i]).count();
    let m = a.max_boxes;
    let cand_dev = if m > 0 {
        let cref = f64v(get(g, &format!("assign.{br}.candidates")));
        a.candidates.iter().zip(&cref).filter(|(x, y)| f64::from(u8::from(**x)) != **y).count()
    } else {
        0
    };
    let ov = if m > 0 {
        rel_dev(&a.overlaps.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), &f64v(get(g, &format!("assign.{br}.overlaps"))), 1e-12)
    } else {
        0.0
    };
    let al = if m > 0 {
        rel_dev(
            &a.align_metric.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
            &f64v(get(g, &format!("assign.{br}.align_metric"))),
            1e-12,
        )
    } else {
        0.0
    };
    let ts = rel_dev(
        &a.target_scores.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
        &f64v(get(g, &format!("assign.{br}.target_scores"))),
        1e-12,
    );
    let tbr = f64v(get(g, &format!("assign.{br}.target_bboxes")));
    // Boxes compared on foreground anchors (background rows hold GT 0's box in both).
    let mut tb_dev = 0f64;
    for i in 0..fg.len() {
        if fg_ref[i] != 0.0 {
            for c in 0..4 {
                tb_dev = tb_dev.max((f64::from(a.target_bboxes[4 * i + c]) - tbr[4 * i + c]).abs());
            }
        }
    }
    eprintln!(
        "{tag} {br}: fg mismatches {fg_diff}, gt-idx mismatches {idx_diff}, candidate mismatches {cand_dev}, overlaps {ov:.2e}, align {al:.2e}, target_scores {ts:.2e}, target_bboxes abs {tb_dev:.2e}"
    );
    assert_eq!(fg_diff, 0, "{tag} {br}: fg mask");
    assert_eq!(idx_diff, 0, "{tag} {br}: target_gt_idx");
    assert_eq!(cand_dev, 0, "{tag} {br}: candidates");
    assert!(ov <= 1e-4 && al <= 1e-4 && ts <= 1e-4, "{tag} {br}: overlaps/align/target scores");
    assert!(tb_dev <= 1e-3, "{tag} {br}: target boxes");
}

/// The dense (device, fixed-shape) assigner gives the host assigner's assignment bit for bit on
/// the golden case, from the branch's raw outputs and the targets padded to their bucket.
fn check_dense_assignment(
    tag: &str,
    host: &Assignment,
    outs: &ptl_trainer::loss::BranchOutputs,
    targets: &ptl_trainer::loss::TargetBatch,
    anchors: &Anchors,
    params: &ptl_trainer::loss::AssignParams,
) {
    use ptl_trainer::loss::assign_dense::{assign_dense, decode_for_assignment, target_bucket, DenseGeometry, DenseInputs, DeviceTargets};
    let bs = outs.boxes.dims()[0];
    let device = outs.boxes.device();
    let padded = ptl_trainer::loss::targets::pad_targets(targets, bs, anchors.image_hw()).unwrap();
    let slots = target_bucket(padded.max_boxes).unwrap();
    let dt = DeviceTargets::upload(&padded, slots, device).unwrap();
    let (scores, boxes, kpts) = decode_for_assignment(
        &outs.boxes,
        &outs.scores,
        &outs.kpts,
        &DenseGeometry::new(anchors, &LossConfig::default().sigmas, 1, outs.boxes.device()).unwrap(),
    )
    .unwrap();
    let nc = outs.scores.dims()[1];
    let geometry = DenseGeometry::new(anchors, &params.sigmas, nc, device).unwrap();
    let d = assign_dense(&DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt }, params).unwrap();
    let fg: Vec<bool> = d.fg_mask.to_vec::<f32>().unwrap().iter().map(|&v| v != 0.0).collect();
    assert_eq!(fg, host.fg_mask, "{tag}: dense foreground");
    let gi: Vec<usize> = d.target_gt_idx.to_vec::<i64>().unwrap().iter().map(|&v| v as usize).collect();
    assert_eq!(gi, host.target_gt_idx, "{tag}: dense GT index");
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(d.target_bboxes.to_vec::<f32>().unwrap()), bits(host.target_bboxes.clone()), "{tag}: dense boxes");
    assert_eq!(bits(d.target_scores.to_vec::<f32>().unwrap()), bits(host.target_scores.clone()), "{tag}: dense scores");
    eprintln!("{tag}: dense assignment ({slots} slots) = host assignment, {} foreground", fg.iter().filter(|&&f| f).count());
}

/// The fixed-shape loss terms (`loss::dense`) from the dense assignment against the host path's
/// branch loss on the golden case: the six items bit for bit, every gradient (raw outputs and
/// flow) within the goldens' 1e-4 — the flow's weight gradients sum over every (anchor, keypoint)
/// row of its GEMMs instead of the visible ones only: another summation order.
fn check_dense_terms(
    file: &str,
    g: &std::collections::HashMap<String, ptl_autograd::Tensor>,
    flow_vals: &std::collections::HashMap<String, ptl_autograd::Tensor>,
) {
    use ptl_trainer::loss::assign_dense::{assign_dense, DenseInputs};
    use ptl_trainer::loss::dense::{dense_branch_terms, DenseConstants};
    let cfg = LossConfig::default();
    let (anchors, targets) = case_anchors_and_targets(g);
    let crit = E2ELoss::new(cfg.clone(), 100);
    for (br, branch) in [("one2many", &crit.one2many), ("one2one", &crit.one2one)] {
        let prefix = format!("input.{br}.");
        let (host_out, dense_out) = (branch_leaves(g, &prefix), branch_leaves(g, &prefix));
        let (host_flow, dense_flow) = (flow_from(flow_vals), flow_from(flow_vals));
        let host = branch.loss(&host_out, &targets, &anchors, Some(&host_flow)).unwrap();
        host.loss_times_bs.sum_all().unwrap().backward().unwrap();
        let bs = dense_out.boxes.dims()[0];
        let device = dense_out.boxes.device();
        let DenseCase { targets: dt, geometry, decoded: (scores, boxes, kpts) } =
            dense_case(&dense_out, &targets, &anchors, &branch.assign.sigmas, device);
        let asg =
            assign_dense(&DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: &dt }, &branch.assign)
                .unwrap();
        let terms = dense_branch_terms(
            &cfg,
            &dense_out,
            &asg,
            &dt,
            &DenseConstants::new(&cfg, &branch.assign, &anchors, bs, dt.slots, device).unwrap(),
            Some(&dense_flow),
        )
        .unwrap();
        terms.mul_scalar(bs as f64).unwrap().sum_all().unwrap().backward().unwrap();
        let items = f64v(&terms);
        for i in 0..6 {
            assert_eq!(
                items[i].to_bits(),
                host.items[i].to_bits(),
                "{file} {br} {}: dense {} vs host {}",
                LOSS_NAMES[i],
                items[i],
                host.items[i]
            );
        }
        let mut worst = 0f64;
        for (k, a, b) in [
            ("boxes", &host_out.boxes, &dense_out.boxes),
            ("scores", &host_out.scores, &dense_out.scores),
            ("kpts", &host_out.kpts, &dense_out.kpts),
            ("kpts_sigma", host_out.kpts_sigma.as_ref().unwrap(), dense_out.kpts_sigma.as_ref().unwrap()),
        ] {
            let d = rel_dev(&f64v(&b.grad().expect("dense gradient")), &f64v(&a.grad().expect("host gradient")), 1e-30);
            assert!(d <= 1e-4, "{file} {br} grad {k}: {d:.2e}");
            worst = worst.max(d);
        }
        for ((name, a), (_, b)) in
            ptl_autograd::module::named_parameters(&host_flow).into_iter().zip(ptl_autograd::module::named_parameters(&dense_flow))
        {
            let d = rel_dev(&f64v(&b.grad().expect("dense flow gradient")), &f64v(&a.grad().expect("host flow gradient")), 1e-30);
            assert!(d <= 1e-4, "{file} {br} flow grad {name}: {d:.2e}");
            worst = worst.max(d);
        }
        eprintln!("{file} {br}: dense terms = host items bit for bit, gradients within {worst:.1e}");
    }
}

fn run_case(file: &str) {
    let Some(root) = goldens() else { return };
    let g = load(root.join("loss_cases").join(file));
    let flow_vals = load(root.join("loss_cases/flow.safetensors"));
    let flow = flow_from(&flow_vals);
    let cfg = LossConfig::default();
    let (anchors, targets) = case_anchors_and_targets(&g);
    let o2m = branch_leaves(&g, "input.one2many.");
    let o2o = branch_leaves(&g, "input.one2one.");
    let mut crit = E2ELoss::new(cfg, 100);
    crit.one2many.assign.debug = true;
    crit.one2one.assign.debug = true;
    let out = crit.loss(&o2m, &o2o, &targets, &anchors, Some(&flow)).unwrap();
    check_dense_terms(file, &g, &flow_vals);
    // The criterion on the dense path: the same total and logged items, bit for bit.
    let dense = E2ELoss::new(LossConfig { dense_assignment: true, ..LossConfig::default() }, 100);
    let dflow = flow_from(&flow_vals);
    let dout =
        dense.loss(&branch_leaves(&g, "input.one2many."), &branch_leaves(&g, "input.one2one."), &targets, &anchors, Some(&dflow)).unwrap();
    assert_eq!(dout.total.item().unwrap().to_bits(), out.total.item().unwrap().to_bits(), "{file}: dense total");
    assert_eq!(dout.items, out.items, "{file}: dense items");
    assert!(dout.one2many.assignment.is_none() && dense.one2many.dense_fallbacks() == 0);

    // Items per branch and term.
    let mut worst = 0f64;
    for (br, bl) in [("one2many", &out.one2many), ("one2one", &out.one2one)] {
        let r = f64v(get(&g, &format!("{br}.items")));
        let rb = f64v(get(&g, &format!("{br}.loss_times_bs")));
        let lb = f64v(&bl.loss_times_bs);
        let mut line = format!("{file} {br} items rel dev:");
        for i in 0..6 {
            let d = rel_scalar(bl.items[i], r[i]).max(rel_scalar(lb[i], rb[i]));
            line += &format!(" {}={d:.1e}", LOSS_NAMES[i]);
            assert!((bl.items[i] - r[i]).abs() <= 1e-5 * r[i].abs() + 1e-6, "{file} {br} {}: {} vs {}", LOSS_NAMES[i], bl.items[i], r[i]);
            assert!((lb[i] - rb[i]).abs() <= 1e-5 * rb[i].abs() + 1e-6, "{file} {br} ×bs {i}");
            worst = worst.max(d);
        }
        eprintln!("{line}");
        let host_asg = bl.assignment.as_ref().expect("the host path keeps its assignment");
        check_assignment(file, host_asg, &g, br);
        let (outs, params) = if br == "one2many" { (&o2m, &crit.one2many.assign) } else { (&o2o, &crit.one2one.assign) };
        check_dense_assignment(&format!("{file} {br}"), host_asg, outs, &targets, &anchors, params);
    }
    let total_ref = get(&g, "total.scalar").item().unwrap();
    let total = out.total.item().unwrap();
    let vec_ref = f64v(get(&g, "total.loss_vec"));
    let vec = f64v(&out.loss_vec);
    let vec_dev = (0..6).map(|i| rel_scalar(vec[i], vec_ref[i])).fold(0f64, f64::max);
    eprintln!(
        "{file} total {total} vs {total_ref} (rel {:.1e}), loss_vec max rel {vec_dev:.1e}, worst item {worst:.1e}",
        rel_scalar(total, total_ref)
    );
    assert!((total - total_ref).abs() <= 1e-5 * total_ref.abs() + 1e-6);
    for i in 0..6 {
        assert!((vec[i] - vec_ref[i]).abs() <= 1e-5 * vec_ref[i].abs() + 1e-6, "loss_vec {i}");
    }
    for (i, name) in LOSS_NAMES.iter().enumerate() {
        assert_eq!(out.items[i], out.one2one.items[i], "logged {name} is the o2o item");
    }

    // Gradients w.r.t. raw outputs and flow parameters.
    out.total.backward().unwrap();
    let mut gworst = 0f64;
    for (br, o) in [("one2many", &o2m), ("one2one", &o2o)] {
        for (k, t) in [("boxes", &o.boxes), ("scores", &o.scores), ("kpts", &o.kpts), ("kpts_sigma", o.kpts_sigma.as_ref().unwrap())] {
            let gr = t.grad().unwrap_or_else(|| panic!("{file}: gradient of {br}.{k} absent"));
            let d = rel_dev(&f64v(&gr), &f64v(get(&g, &format!("grad.{br}.{k}"))), 1e-30);
            gworst = gworst.max(d);
            assert!(d <= 1e-4, "{file} grad {br}.{k}: {d:.2e}");
        }
    }
    for (name, p) in ptl_autograd::module::named_parameters(&flow) {
        let gr = p.grad().unwrap_or_else(|| panic!("{file}: flow gradient {name} absent"));
        let r = f64v(get(&g, &format!("grad.model.23.flow_model.{name}")));
        let d = rel_dev(&f64v(&gr), &r, 1e-30);
        gworst = gworst.max(d);
        assert!(d <= 1e-4, "{file} flow grad {name}: {d:.2e}");
    }
    eprintln!("{file} gradients (raw outputs + flow) max rel dev {gworst:.2e}");
}

#[test]
fn case1_basic() {
    run_case("case1_basic.safetensors");
}
#[test]
fn case2_empty_image() {
    run_case("case2_empty_image.safetensors");
}
#[test]
fn case3_invisible_keypoints() {
    run_case("case3_invisible_keypoints.safetensors");
}
#[test]
fn case4_tiny_and_thin() {
    run_case("case4_tiny_and_thin.safetensors");
}
#[test]
fn case5_crowded() {
    run_case("case5_crowded.safetensors");
}
#[test]
fn case6_no_targets() {
    run_case("case6_no_targets.safetensors");
}

/// A batch with more objects in one image than the largest target bucket (256) runs the host
/// path on the dense setting — the same result — and is counted.
#[test]
fn dense_loss_beyond_the_largest_bucket_falls_back_to_the_host_path() {
    use ptl_autograd::{DType, Device, Rng, Tensor};
    let anchors = Anchors::from_image_hw((64, 64), &[8.0, 16.0, 32.0]).unwrap();
    let na = anchors.len();
    let mut rng = Rng::new(8);
    let out = |c: usize, rng: &mut Rng| Tensor::rand(vec![1, c, na], 0.1, 2.0, DType::F32, Device::Cpu, rng).unwrap();
    let outs =
        ptl_trainer::loss::BranchOutputs { boxes: out(4, &mut rng), scores: out(1, &mut rng), kpts: out(51, &mut rng), kpts_sigma: None };
    let n = 257;
    let mut t = ptl_trainer::loss::TargetBatch { nkpt: 17, ..Default::default() };
    for i in 0..n {
        t.batch_idx.push(0.0);
        t.cls.push(0.0);
        t.bboxes.extend_from_slice(&[0.1 + 0.8 * (i as f32 / n as f32), 0.5, 0.05, 0.05]);
        t.keypoints.extend((0..17).flat_map(|_| [0.5f32, 0.5, 2.0]));
    }
    let host = E2ELoss::new(LossConfig::default(), 10).loss(&outs, &outs, &t, &anchors, None).unwrap();
    let dense = E2ELoss::new(LossConfig { dense_assignment: true, ..LossConfig::default() }, 10);
    let got = dense.loss(&outs, &outs, &t, &anchors, None).unwrap();
    assert_eq!(got.items, host.items);
    assert_eq!((dense.one2many.dense_fallbacks(), dense.one2one.dense_fallbacks()), (1, 1), "each branch counted once");
    assert!(got.one2many.assignment.is_some(), "the host path ran");
}

/// With `defer_items` the dense criterion reads nothing back: its device values hold the items
/// and the total a synchronous call returns (bit for bit), with a non-finite flag of 0; a NaN in
/// the predictions sets the flag (1) instead of failing the call, which the synchronous call does.
#[test]
fn deferred_dense_items_carry_the_values_and_a_non_finite_flag() {
    let Some(root) = goldens() else { return };
    let g = load(root.join("loss_cases/case1_basic.safetensors"));
    let flow = flow_from(&load(root.join("loss_cases/flow.safetensors")));
    let (anchors, targets) = case_anchors_and_targets(&g);
    let cfg = LossConfig { dense_assignment: true, ..LossConfig::default() };
    let (o2m, o2o) = (branch_leaves(&g, "input.one2many."), branch_leaves(&g, "input.one2one."));
    let sync = E2ELoss::new(cfg.clone(), 100);
    let mut deferred = E2ELoss::new(cfg, 100);
    deferred.defer_items = true;
    let want = sync.loss(&o2m, &o2o, &targets, &anchors, Some(&flow)).unwrap();
    let before = ptl_autograd::host_reads_on_this_thread();
    let got = deferred.loss(&o2m, &o2o, &targets, &anchors, Some(&flow)).unwrap();
    assert_eq!(ptl_autograd::host_reads_on_this_thread().since(&before).immediate, 0, "the deferred call reads nothing back");
    let d = got.deferred.expect("deferred values");
    let values = f64v(&d.values);
    assert_eq!(values.len(), 13);
    for (i, item) in want.items.iter().enumerate() {
        assert_eq!(values[6 + i].to_bits(), item.to_bits(), "item {}", LOSS_NAMES[i]);
    }
    assert_eq!(values[12].to_bits(), want.total.item().unwrap().to_bits(), "total");
    assert_eq!(f64v(&d.nonfinite), vec![0.0], "finite values: flag 0");
    let mut scores = f32v(&o2m.scores);
    scores[3] = f32::NAN;
    let bad = ptl_trainer::loss::BranchOutputs {
        scores: ptl_autograd::Tensor::from_vec(scores, o2m.scores.dims().to_vec(), ptl_autograd::Device::Cpu).unwrap(),
        ..o2m.clone()
    };
    let flagged = deferred.loss(&bad, &o2o, &targets, &anchors, Some(&flow)).unwrap();
    assert_eq!(f64v(&flagged.deferred.expect("deferred").nonfinite), vec![1.0], "a NaN prediction sets the flag");
    assert!(sync.loss(&bad, &o2o, &targets, &anchors, Some(&flow)).is_err(), "the synchronous call rejects it");
}

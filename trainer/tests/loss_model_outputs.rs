//! model/loss golden on the stored raw head outputs (forward.safetensors `train.*`): items,
//! per-branch ×bs vectors, epoch-0 and epoch-50 weighted vectors and totals, assignments.
//! (The full-model gradient check lives in `loss_model_grads.rs`.)

mod loss_support;

use loss_support::*;
use ptl_trainer::loss::{Anchors, E2ELoss, LossConfig, LOSS_NAMES};

#[test]
fn model_loss_on_stored_outputs() {
    let Some(root) = goldens() else { return };
    let fwd = load(root.join("model/forward.safetensors"));
    let gl = load(root.join("model/loss.safetensors"));
    let w = load(root.join("model/weights.safetensors"));
    let prefix = "model.23.flow_model.";
    let flow_vals = w.iter().filter_map(|(k, v)| k.strip_prefix(prefix).map(|s| (s.to_string(), v.clone()))).collect();
    let flow = flow_from(&flow_vals);
    let img = get(&fwd, "input").dims().to_vec();
    let cfg = LossConfig::default();
    let anchors = Anchors::from_image_hw((img[2], img[3]), &cfg.strides).unwrap();
    // The stored anchors agree with ours.
    assert_eq!(f32v(get(&fwd, "anchors")), anchors.points);
    assert_eq!(f32v(get(&fwd, "anchor_strides")), anchors.strides);
    let targets = target_batch(&gl, "batch.");
    let o2m = branch_leaves(&fwd, "train.one2many.");
    let o2o = branch_leaves(&fwd, "train.one2one.");
    let mut crit = E2ELoss::new(cfg, 100);
    let out = crit.loss(&o2m, &o2o, &targets, &anchors, Some(&flow)).unwrap();
    for (br, bl) in [("one2many", &out.one2many), ("one2one", &out.one2one)] {
        let r = f64v(get(&gl, &format!("{br}.items")));
        let rb = f64v(get(&gl, &format!("{br}.loss_times_bs")));
        let lb = f64v(&bl.loss_times_bs);
        let mut line = format!("model/loss {br} items rel dev:");
        for i in 0..6 {
            line += &format!(" {}={:.1e}", LOSS_NAMES[i], rel_scalar(bl.items[i], r[i]).max(rel_scalar(lb[i], rb[i])));
            assert!((bl.items[i] - r[i]).abs() <= 1e-5 * r[i].abs() + 1e-6, "{br} {}: {} vs {}", LOSS_NAMES[i], bl.items[i], r[i]);
            assert!((lb[i] - rb[i]).abs() <= 1e-5 * rb[i].abs() + 1e-6, "{br} ×bs {i}");
        }
        eprintln!("{line}");
        let a = bl.assignment.as_ref().expect("the host path keeps its assignment");
        let fg_ref = f64v(get(&gl, &format!("assign.{br}.fg_mask")));
        let idx_ref = f64v(get(&gl, &format!("assign.{br}.target_gt_idx")));
        let fg_bad = a.fg_mask.iter().zip(&fg_ref).filter(|(x, y)| f64::from(u8::from(**x)) != **y).count();
        let idx_bad = (0..fg_ref.len()).filter(|&i| fg_ref[i] != 0.0 && a.target_gt_idx[i] as f64 != idx_ref[i]).count();
        let ts = rel_dev(
            &a.target_scores.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
            &f64v(get(&gl, &format!("assign.{br}.target_scores"))),
            1e-12,
        );
        eprintln!(
            "model/loss {br}: n_fg {}, fg mismatches {fg_bad}, gt-idx mismatches {idx_bad}, target_scores rel {ts:.1e}, conflicts {}",
            a.fg_indices().len(),
            a.n_conflicts
        );
        assert_eq!((fg_bad, idx_bad), (0, 0), "{br} assignment");
        assert!(ts <= 1e-4);
    }
    for (i, name) in LOSS_NAMES.iter().enumerate() {
        assert_eq!(out.items[i], out.one2one.items[i], "logged {name}");
    }
    let check_epoch = |tag: &str, out: &ptl_trainer::loss::LossOutput| {
        let vr = f64v(get(&gl, &format!("{tag}.loss_vec")));
        let tr = get(&gl, &format!("{tag}.total")).item().unwrap();
        let v = f64v(&out.loss_vec);
        let t = out.total.item().unwrap();
        let vd = (0..6).map(|i| rel_scalar(v[i], vr[i])).fold(0f64, f64::max);
        eprintln!("model/loss {tag}: total {t} vs {tr} (rel {:.1e}), loss_vec max rel {vd:.1e}, w_o2m {}", rel_scalar(t, tr), out.w_o2m);
        assert!((t - tr).abs() <= 1e-5 * tr.abs() + 1e-6, "{tag} total");
        for i in 0..6 {
            assert!((v[i] - vr[i]).abs() <= 1e-5 * vr[i].abs() + 1e-6, "{tag} loss_vec {i}");
        }
    };
    check_epoch("epoch0", &out);
    for _ in 0..50 {
        crit.update();
    }
    let out50 = crit.loss(&o2m, &o2o, &targets, &anchors, Some(&flow)).unwrap();
    check_epoch("epoch50", &out50);
}

//! Multi-class pose against Ultralytics 8.4.190: a two-class YOLO26n-pose (the goldens'
//! one-class weights with two-class class stems, `fixtures/two_class_loss.safetensors`, made by
//! `fixtures/two_class_loss.py`) runs the goldens' input in train mode, and ptl's criterion with
//! nc = 2 evaluates it on the goldens' targets with classes [0, 1, 1, 1, 0, 1]: the class
//! logits of both branches and every loss item equal Ultralytics' on the same batch — the first
//! loss values of a two-class fit.

mod loss_support;

use std::collections::HashMap;

use loss_support::*;
use ptl_autograd::{Device, Tensor};
use ptl_heads::{BranchOutput, ModelConfig, PoseModel};
use ptl_trainer::loss::{Anchors, BranchOutputs, E2ELoss, LossConfig, LOSS_NAMES};

fn branch(o: &BranchOutput) -> BranchOutputs {
    BranchOutputs { boxes: o.boxes.clone(), scores: o.scores.clone(), kpts: o.kpts.clone(), kpts_sigma: o.kpts_sigma.clone() }
}

/// As `loss_model_grads.rs`: items through the model carry the forward's float32 rounding.
const ITEM_TOL: f64 = 5e-5;

#[test]
fn two_class_loss_equals_ultralytics_on_the_same_batch() {
    let Some(root) = goldens() else {
        assert!(std::env::var_os("CI").is_none(), "CI is set but the shared goldens are missing: this test cannot check anything");
        return;
    };
    let fixture = load(std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/two_class_loss.safetensors")));
    let mut weights: HashMap<String, Tensor> = load(root.join("model/weights.safetensors"));
    let stems: Vec<(String, Tensor)> =
        fixture.iter().filter_map(|(k, v)| k.strip_prefix("weights.").map(|n| (n.to_string(), v.clone()))).collect();
    assert_eq!(stems.len(), 12, "the final convolution of the six class stems, weight and bias");
    for (n, v) in stems {
        assert_eq!(v.dims()[0], 2, "{n} has two outputs");
        weights.insert(n, v);
    }
    let model = PoseModel::new(ModelConfig { nc: 2, ..ModelConfig::default() }, Device::Cpu, 0).unwrap();
    model.load_state_dict(&weights, true).unwrap();
    let fwd = load(root.join("model/forward.safetensors"));
    let x: &Tensor = get(&fwd, "input");
    let out = model.forward(x).unwrap();

    // The class logits of both branches (2, 2, 1344), within the forward's float32 rounding (the
    // one-class model's outputs differ from torch's by up to 1.4e-5 of their largest value).
    for (br, o) in [("one2many", &out.one2many), ("one2one", &out.one2one)] {
        let want = f64v(get(&fixture, &format!("train.{br}.scores")));
        let got = f64v(&o.scores);
        assert_eq!(o.scores.dims(), [2, 2, 1344]);
        let dev = rel_dev(&got, &want, 1e-12);
        eprintln!("two classes {br}: class logits rel dev {dev:.1e}");
        assert!(dev <= 3e-5, "{br} class logits: {dev:e}");
    }

    let cfg = LossConfig { nc: 2, ..LossConfig::default() };
    let anchors = Anchors::from_image_hw((x.dims()[2], x.dims()[3]), &cfg.strides).unwrap();
    let targets = target_batch(&fixture, "batch.");
    assert!(targets.cls.contains(&1.0) && targets.cls.contains(&0.0), "both classes have targets");
    let crit = E2ELoss::new(cfg, 100);
    let loss = crit.loss(&branch(&out.one2many), &branch(&out.one2one), &targets, &anchors, Some(&model.head().flow_model)).unwrap();
    for (br, bl) in [("one2many", &loss.one2many), ("one2one", &loss.one2one)] {
        let r = f64v(get(&fixture, &format!("{br}.items")));
        let mut line = format!("two classes {br} items rel dev:");
        for i in 0..6 {
            line += &format!(" {}={:.1e}", LOSS_NAMES[i], rel_scalar(bl.items[i], r[i]));
            assert!((bl.items[i] - r[i]).abs() <= ITEM_TOL * r[i].abs() + 1e-6, "{br} {}: {} vs {}", LOSS_NAMES[i], bl.items[i], r[i]);
        }
        eprintln!("{line}");
    }
    let want = f64v(get(&fixture, "epoch0.loss_vec"));
    let got = f64v(&loss.loss_vec);
    for i in 0..6 {
        assert!((got[i] - want[i]).abs() <= ITEM_TOL * want[i].abs() + 1e-6, "epoch-0 {}: {} vs {}", LOSS_NAMES[i], got[i], want[i]);
    }
    let (t, tr) = (loss.total.item().unwrap(), get(&fixture, "epoch0.total").item().unwrap());
    eprintln!("two classes: total {t} vs Ultralytics {tr} (rel {:.1e})", rel_scalar(t, tr));
    assert!((t - tr).abs() <= 1e-5 * tr.abs() + 1e-6);
}

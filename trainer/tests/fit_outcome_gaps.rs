//! What per-step goldens cannot see: validation scores the EMA weights (not the live model),
//! mosaic-on training batches keep their bytes, and an AdamW run killed after an epoch and
//! resumed ends with the uninterrupted run's bytes.

mod fit_support;

use std::sync::Arc;

use ptl_autograd::{hash, Device, Module};
use ptl_heads::{ModelConfig, PoseModel};
use ptl_trainer::loss::LossConfig;
use ptl_trainer::pose::{fit, validate_with, PoseTrainConfig, Precision, ValOptions};

/// The last row of a run's results.csv, by column name.
fn last_results_row(dir: &std::path::Path) -> Vec<(String, f64)> {
    let csv = std::fs::read_to_string(dir.join("results.csv")).expect("results.csv");
    let mut lines = csv.lines();
    let header: Vec<String> = lines.next().expect("header").split(',').map(|s| s.trim().to_string()).collect();
    let last = lines.last().expect("a row");
    header.into_iter().zip(last.split(',').map(|v| v.trim().parse::<f64>().expect("a number"))).collect()
}

/// The in-fit validation of the last epoch is that of `last.ckpt`'s EMA weights with the fit's
/// own settings (batch × 2, the training precision and size): the same metrics, bit for bit, and
/// the same validation losses as results.csv prints them (to its six significant digits); the live
/// model's weights in the same checkpoint give other losses — so a fit that validated its live
/// weights would fail here.
#[test]
fn in_fit_validation_scores_the_ema_weights() {
    let cfg = PoseTrainConfig { epochs: 3, max_batches: Some(3), ..fit_support::tiny_in(&fit_support::scratch("outcome-ema")) };
    let summary = fit(&cfg, vec![]).expect("fit");
    let last = cfg.save_dir.join("weights/last.ckpt");
    let open = ptl_data::OpenOptions { imgsz: cfg.imgsz as u32, verbose: false, ..Default::default() };
    let ds = Arc::new(ptl_data::PoseDataset::open_yaml(&cfg.data, "val", &open).expect("val split"));
    let opts = ValOptions { loss: Some(LossConfig::with_keypoints(17, None)), ..ValOptions::default() };
    let (ema, _) = ptl_trainer::pose::predict::load_eval_model(&last, Device::Cpu).expect("EMA weights");
    let r = validate_with(&ema, &ds, cfg.batch * 2, Device::Cpu, Precision::F32, &opts).expect("validate EMA");
    let in_fit: Vec<(String, f64)> = summary.final_metrics.iter().filter(|(k, _)| k.starts_with("metrics/")).cloned().collect();
    assert!(!in_fit.is_empty(), "the fit validated");
    for (k, v) in &in_fit {
        let again = r.get(k).unwrap_or_else(|| panic!("{k} missing"));
        assert_eq!(v.to_bits(), again.to_bits(), "{k}: in-fit {v} vs last.ckpt's EMA {again}");
    }
    let row = last_results_row(&cfg.save_dir);
    let csv = |name: &str| row.iter().find(|(k, _)| k == name).map(|(_, v)| *v).unwrap_or_else(|| panic!("{name} column"));
    let names = ["box_loss", "pose_loss", "kobj_loss", "cls_loss", "l1_loss"];
    let ema_losses = r.losses.expect("validation losses");
    for (i, n) in names.iter().enumerate() {
        let printed = csv(&format!("val/{n}"));
        assert!((ema_losses[i] - printed).abs() <= 1e-5 * printed.abs(), "val/{n}: last.ckpt's EMA {} vs printed {printed}", ema_losses[i]);
    }
    // The live weights of the same checkpoint.
    let ck = ptl_trainer::fit::load_checkpoint(&last, Device::Cpu).expect("checkpoint");
    let mut live = PoseModel::new(ModelConfig::default(), Device::Cpu, 0).expect("model");
    live.load_state_dict(&ck.part("model"), false).expect("live weights");
    live.set_training(false);
    let rl = validate_with(&live, &ds, cfg.batch * 2, Device::Cpu, Precision::F32, &opts).expect("validate live");
    let live_losses = rl.losses.expect("losses");
    let differ = (0..names.len()).filter(|&i| live_losses[i] != ema_losses[i]).count();
    println!("EMA val losses {:?}, live {:?}", &ema_losses[..5], &live_losses[..5]);
    assert!(differ > 0, "the live model scores as the EMA does: the test could not tell them apart");
}

/// SHA-256 of every batch (pixels and labels) of epochs 0–2 with mosaic on for epochs 0 and 1
/// (`close_mosaic: 1`), and of the same epochs with mosaic off throughout.
fn mosaic_batch_hashes(close_mosaic: usize) -> (String, Vec<usize>) {
    let open = ptl_data::OpenOptions { imgsz: 64, verbose: false, ..Default::default() };
    let ds = Arc::new(ptl_data::PoseDataset::open_yaml(&fit_support::dataset(), "train", &open).expect("dataset"));
    let cfg = ptl_data::TrainConfig { batch: 3, seed: 11, epochs: 3, close_mosaic, workers: 2, ..Default::default() };
    let ld = Arc::new(ptl_data::TrainLoader::new(ds, cfg).expect("loader"));
    let (mut bytes, mut instances) = (Vec::new(), Vec::new());
    for b in ld.prefetch(0) {
        let b = b.expect("batch");
        bytes.extend_from_slice(&b.img);
        for v in b.batch_idx.iter().chain(&b.cls).chain(&b.bboxes).chain(&b.keypoints) {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        instances.push(b.cls.len());
    }
    (hash::bytes_hash(&bytes), instances)
}

/// Mosaic-on batches keep their bytes (a change of the mosaic centre range, tile placement or
/// crop shows here: `fit_pipeline`'s pinned batches all fall under close_mosaic). The hash was
/// recorded from this loader; that mosaic is really on is checked by the mosaic-off run of the
/// same epochs differing in the mosaic epochs only.
#[test]
fn mosaic_on_batches_are_the_recorded_bytes() {
    let (on, on_instances) = mosaic_batch_hashes(1);
    let (off, off_instances) = mosaic_batch_hashes(3);
    assert_ne!(on, off, "mosaic changes the batches");
    let per_epoch = on_instances.len() / 3;
    assert_eq!(on_instances[2 * per_epoch..], off_instances[2 * per_epoch..], "the last epoch (close_mosaic) is mosaic-free in both");
    assert_ne!(on_instances[..2 * per_epoch], off_instances[..2 * per_epoch], "four images per mosaic tile change the label counts");
    assert_eq!(on, "cf1375ff63fae857012bae6a6b68722caa7f3f4ee115c603dbb2d22e1c1f4a21", "mosaic-on batch bytes");
}

/// AdamW (its step count and moment buffers) across a kill: a run stepping every batch (nbs =
/// batch), stopped after one full epoch and resumed from last.ckpt, ends with the uninterrupted
/// run's model, optimizer, EMA and per-step losses.
#[test]
fn a_killed_and_resumed_adamw_fit_ends_with_the_uninterrupted_bytes() {
    let cfg = |name: &str| PoseTrainConfig {
        batch: 3,
        nbs: 3,
        max_batches: None,
        optimizer: "AdamW".into(),
        ..fit_support::tiny_in(&fit_support::scratch(name))
    };
    let whole = fit(&cfg("outcome-adamw-whole"), vec![]).expect("uninterrupted fit");
    let killed = cfg("outcome-adamw-killed");
    fit(&PoseTrainConfig { stop_after_epochs: Some(1), ..killed.clone() }, vec![]).expect("first epoch");
    let last = killed.save_dir.join("weights/last.ckpt");
    let manifest = ptl_trainer::fit::read_manifest(&last).expect("manifest");
    assert_eq!(manifest.optimizer["resolved"]["name"], "AdamW", "{}", manifest.optimizer);
    let resumed = fit(&PoseTrainConfig { resume: Some(last), ..killed }, vec![]).expect("resumed");
    assert!(whole.optimizer_steps >= 2, "updates on both sides of the kill");
    assert_eq!(resumed.hashes, whole.hashes, "AdamW: resume ends where the uninterrupted run ends");
}

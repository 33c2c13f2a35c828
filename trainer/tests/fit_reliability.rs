//! Resume, artefacts and non-finite losses (reliability issue): resume restores and checks the
//! run's settings, results.csv and the summary always match the checkpoint, a new run never
//! overwrites an old one, failed writes leave nothing behind, older checkpoint formats migrate,
//! and a non-finite loss is recovered from (or named) as docs/training.md §9 says.

mod fit_support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ptl_autograd::{Device, Tensor};
use ptl_trainer::fit::{load_checkpoint, save_checkpoint, Callback, LoopView};
use ptl_trainer::pose::{fit, PoseTrainConfig};
use ptl_trainer::TrainerError;

fn tiny(save: &Path) -> PoseTrainConfig {
    PoseTrainConfig { epochs: 3, ..fit_support::tiny_in(save) }
}

fn csv_rows(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("results.csv")).expect("results.csv").lines().skip(1).map(str::to_string).collect()
}

#[test]
fn resume_restores_the_runs_settings_and_refuses_changes() {
    let dir = fit_support::scratch("resume");
    let cfg = tiny(&dir);
    fit(&PoseTrainConfig { stop_after_epochs: Some(1), ..cfg.clone() }, vec![]).expect("first epoch");
    let ckpt = dir.join("weights/last.ckpt");
    // No other key: the run's own settings come back (not the defaults, not the embedded dataset).
    let restored = PoseTrainConfig::for_resume(&ckpt, &[]).expect("resume config");
    assert_eq!((restored.batch, restored.imgsz, restored.epochs, restored.seed), (2, 64, 3, 11));
    assert_eq!(restored.data, cfg.data);
    assert_eq!(restored.save_dir, dir);
    // Machine settings may change.
    let machine = [("device".to_string(), "cpu".to_string()), ("workers".to_string(), "2".to_string())];
    assert!(PoseTrainConfig::for_resume(&ckpt, &machine).is_ok());
    // Training settings may not: the error names the key and both values.
    for (key, value, stored) in [("batch", "4", "2"), ("imgsz", "128", "64"), ("epochs", "10", "3"), ("lr0", "0.02", "0.01")] {
        let e = PoseTrainConfig::for_resume(&ckpt, &[(key.to_string(), value.to_string())]).expect_err(key);
        let msg = e.to_string();
        assert!(matches!(&e, TrainerError::ResumeMismatch { key: k, .. } if k == key), "{msg}");
        assert!(msg.contains(value) && msg.contains(stored), "{msg}");
    }
    let other = PathBuf::from("/elsewhere/data.yaml");
    let e = fit(&PoseTrainConfig { data: other, resume: Some(ckpt.clone()), ..cfg.clone() }, vec![]).expect_err("other dataset");
    assert!(matches!(e, TrainerError::ResumeMismatch { ref key, .. } if key == "data"), "{e}");
    // And the restored configuration finishes the run like an uninterrupted one.
    let resumed = fit(&restored, vec![]).expect("resumed");
    let full = fit(&tiny(&fit_support::scratch("resume-full")), vec![]).expect("uninterrupted");
    assert_eq!(resumed.hashes, full.hashes);
}

#[test]
fn results_csv_and_summary_follow_the_checkpoint_across_resumes() {
    let dir = fit_support::scratch("csv");
    let cfg = tiny(&dir);
    fit(&PoseTrainConfig { stop_after_epochs: Some(1), ..cfg.clone() }, vec![]).expect("epoch 0");
    // A process killed between an old-style CSV append and its checkpoint left a row too many.
    let mut rows = csv_rows(&dir);
    assert_eq!(rows.len(), 1);
    let text = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    std::fs::write(dir.join("results.csv"), format!("{text}{}\n", rows[0].replacen("1,", "2,", 1))).unwrap();
    let ckpt = dir.join("weights/last.ckpt");
    fit(&PoseTrainConfig { resume: Some(ckpt.clone()), stop_after_epochs: Some(1), ..cfg.clone() }, vec![]).expect("epoch 1");
    let s = fit(&PoseTrainConfig { resume: Some(ckpt), ..cfg.clone() }, vec![]).expect("epoch 2");
    rows = csv_rows(&dir);
    let epochs: Vec<String> = rows.iter().map(|r| r.split(',').next().unwrap().to_string()).collect();
    assert_eq!(epochs, ["1", "2", "3"], "one row per epoch (as integers), none duplicated: {rows:?}");
    let times: Vec<f64> = rows.iter().map(|r| r.split(',').nth(1).unwrap().parse().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[1] > w[0]), "the time column continues across resumes: {times:?}");
    assert_eq!(s.metrics_per_epoch.len(), 3, "the resumed run's summary lists every epoch");
    // The CSV prints six significant digits (`%.6g`): equal up to that rounding.
    assert!(s.fit_time_s >= times[2] * (1.0 - 1e-5), "{} against the CSV's {}", s.fit_time_s, times[2]);
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(written["metrics_per_epoch"].as_array().map(Vec::len), Some(3));
}

#[test]
fn a_new_run_never_overwrites_an_old_one() {
    let dir = fit_support::scratch("project");
    let first = fit(&tiny(&dir), vec![]).expect("first");
    assert_eq!(first.save_dir, dir);
    let second = fit(&tiny(&dir), vec![]).expect("second");
    let want = dir.with_file_name(format!("{}2", dir.file_name().unwrap().to_string_lossy()));
    assert_eq!(second.save_dir, want, "numbered sibling as Ultralytics does");
    assert!(want.join("weights/last.ckpt").exists() && csv_rows(&dir).len() == 3, "the first run is untouched");
    let third = fit(&PoseTrainConfig { exist_ok: true, ..tiny(&dir) }, vec![]).expect("exist_ok");
    assert_eq!(third.save_dir, dir);
    assert_eq!(csv_rows(&dir).len(), 3, "exist_ok rewrites the folder's results, it does not append");
    let _ = std::fs::remove_dir_all(&want);
}

#[test]
fn a_failed_checkpoint_write_leaves_no_temporary_file() {
    let dir = fit_support::scratch("diskfull");
    let dir2 = dir.clone();
    let ckpt = ptl_trainer::fit::Checkpoint {
        manifest: {
            fit(&PoseTrainConfig { epochs: 1, ..tiny(&dir2) }, vec![]).expect("fit");
            load_checkpoint(&dir.join("weights/last.ckpt"), Device::Cpu).expect("load").manifest
        },
        tensors: vec![("model.w".into(), Tensor::from_vec(vec![1.0f32; 4], 4, Device::Cpu).unwrap())],
    };
    // The final rename cannot replace a non-empty folder: the write fails after the temporary file exists.
    let target = dir.join("blocked.ckpt");
    std::fs::create_dir_all(target.join("x")).unwrap();
    assert!(save_checkpoint(&target, &ckpt).is_err());
    let leftovers: Vec<_> =
        std::fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".tmp")).collect();
    assert!(leftovers.is_empty(), "temporary file removed on failure: {leftovers:?}");
}

#[test]
fn older_and_newer_checkpoint_formats() {
    let dir = fit_support::scratch("formats");
    fit(&PoseTrainConfig { epochs: 1, ..tiny(&dir) }, vec![]).expect("fit");
    let ck = load_checkpoint(&dir.join("weights/last.ckpt"), Device::Cpu).expect("load");
    assert_eq!(ck.manifest.history.rows.len(), 1, "format 2 keeps the epoch history");
    // Rewrite the manifest as format 1 (no history) and as a future format.
    let rewrite = |format: u32, name: &str| -> PathBuf {
        let mut m = serde_json::to_value(&ck.manifest).unwrap();
        m["format"] = format.into();
        m.as_object_mut().unwrap().remove("history");
        let manifest: ptl_trainer::fit::Manifest = serde_json::from_value(m).unwrap();
        let p = dir.join(name);
        save_checkpoint(&p, &ptl_trainer::fit::Checkpoint { manifest, tensors: ck.tensors.clone() }).unwrap();
        p
    };
    let old = load_checkpoint(&rewrite(1, "v1.ckpt"), Device::Cpu).expect("format 1 migrates");
    assert_eq!(old.manifest.format, ptl_trainer::fit::checkpoint::CHECKPOINT_FORMAT);
    assert!(old.manifest.history.rows.is_empty());
    let e = load_checkpoint(&rewrite(99, "v99.ckpt"), Device::Cpu).err().expect("future format refused");
    assert!(e.to_string().contains("format 99") && e.to_string().contains("newer ptl"), "{e}");
}

/// Up to format 2 the settings' `scale` was the model size ("n"): such a checkpoint loads with
/// `model=yolo26{size}-pose.yaml` and `scale` the augmentation gain it trained with (the default),
/// and its run resumes to the same bytes as one never interrupted.
#[test]
fn a_format_2_checkpoint_with_the_size_in_scale_migrates_and_resumes() {
    let dir = fit_support::scratch("format2");
    fit(&PoseTrainConfig { stop_after_epochs: Some(1), ..tiny(&dir) }, vec![]).expect("first epoch");
    let last = dir.join("weights/last.ckpt");
    let ck = load_checkpoint(&last, Device::Cpu).expect("load");
    let as_format_2 = |size: &str, path: &Path| {
        let mut m = serde_json::to_value(&ck.manifest).unwrap();
        m["format"] = 2.into();
        let args = m["train_args"].as_object_mut().unwrap();
        for new in ["model", "hsv_h", "hsv_s", "hsv_v", "degrees", "translate", "shear", "perspective", "flipud", "fliplr", "bgr"] {
            args.remove(new).expect("a setting of format 3");
        }
        for new in ["mixup", "cutmix", "copy_paste", "project", "name"] {
            args.remove(new);
        }
        args.insert("scale".into(), size.into());
        let manifest: ptl_trainer::fit::Manifest = serde_json::from_value(m).unwrap();
        save_checkpoint(path, &ptl_trainer::fit::Checkpoint { manifest, tensors: ck.tensors.clone() }).unwrap();
    };
    let small = dir.join("small.ckpt");
    as_format_2("s", &small);
    let stored = PoseTrainConfig::from_checkpoint(&small).expect("format 2 migrates");
    assert_eq!((stored.model.as_str(), stored.scale), ("yolo26s-pose.yaml", 0.5));
    as_format_2("n", &last);
    let resumed = PoseTrainConfig::for_resume(&last, &[]).expect("resume settings");
    assert_eq!((resumed.model.as_str(), resumed.scale), ("yolo26n-pose.yaml", 0.5));
    let finished = fit(&resumed, vec![]).expect("resumed");
    let straight = fit(&tiny(&fit_support::scratch("format2-straight")), vec![]).expect("straight");
    assert_eq!(finished.hashes, straight.hashes, "the migrated run continues exactly");
}

/// Puts NaN into the first convolution's weights at the start of epoch 1's first batch, the first
/// `times` times that batch starts.
#[derive(Clone)]
struct PoisonWeights {
    times: usize,
    seen: Arc<AtomicUsize>,
}

impl Callback for PoisonWeights {
    fn on_after_backward_params(&mut self, v: &LoopView, params: &[(String, Tensor)]) {
        if v.epoch == 1 && v.batch_in_epoch == 0 && self.seen.fetch_add(1, Ordering::SeqCst) < self.times {
            let (_, p) = params.iter().find(|(n, _)| n == "model.0.conv.weight").expect("parameter");
            let g = p.grad().expect("gradient");
            let nan = Tensor::full(g.dims().to_vec(), f64::NAN, g.dtype(), g.device()).unwrap();
            g.copy_(&nan).unwrap();
        }
    }
}

#[test]
fn a_non_finite_loss_reloads_the_last_checkpoint_then_stops_with_a_named_error() {
    // Once: epoch 1 goes non-finite, is run again from epoch 0's checkpoint, and the fit ends.
    let seen = Arc::new(AtomicUsize::new(0));
    let cfg = PoseTrainConfig { nbs: 2, warmup_epochs: 0.0, ..tiny(&fit_support::scratch("nan-once")) };
    let s = fit(&cfg, vec![Box::new(PoisonWeights { times: 1, seen: seen.clone() })]).expect("recovered");
    assert_eq!(seen.load(Ordering::SeqCst), 2, "epoch 1 ran twice");
    assert_eq!(s.metrics_per_epoch.len(), 3);
    // Always: three reloads, then a typed error naming the step, the term and a likely cause.
    let seen = Arc::new(AtomicUsize::new(0));
    let cfg = PoseTrainConfig { nbs: 2, warmup_epochs: 0.0, ..tiny(&fit_support::scratch("nan-always")) };
    let e = fit(&cfg, vec![Box::new(PoisonWeights { times: usize::MAX, seen: seen.clone() })]).expect_err("gives up");
    assert_eq!(seen.load(Ordering::SeqCst), 4, "the first attempt and 3 reloads");
    let msg = e.to_string();
    assert!(matches!(e, TrainerError::NonFiniteLoss { epoch: 1, attempts: 3, .. }), "{msg}");
    assert!(msg.contains("epoch 1, batch 1") && msg.contains("likely cause"), "{msg}");
}

#[test]
fn absurd_settings_are_typed_errors_up_front() {
    let base = tiny(&fit_support::scratch("settings"));
    for (key, value) in [
        ("momentum", "nan"),
        ("mosaic", "nan"),
        ("mosaic", "1.5"),
        ("warmup_epochs", "nan"),
        ("lrf", "nan"),
        ("lr0", "1e30"),
        ("lr0", "-0.01"),
        ("weight_decay", "inf"),
        ("imgsz", "100000"),
        ("batch", "100000"),
        ("epochs", "0"),
    ] {
        let mut cfg = base.clone();
        // A value that is no number (NaN, ∞) is refused as it is read; one out of range by validate.
        let e = match cfg.set(key, value) {
            Err(e) => {
                assert!(!value.parse::<f64>().is_ok_and(f64::is_finite), "{key}={value} is a finite number: {e}");
                e
            }
            Ok(()) => {
                let e = cfg.validate().expect_err(key);
                assert!(matches!(e, TrainerError::InvalidArgument { what: "config", .. }), "{key}={value}: {e}");
                // And fit refuses before touching any file.
                assert!(fit(&cfg, vec![]).is_err());
                e
            }
        };
        assert!(e.to_string().contains(key.trim_end_matches("_epochs")) || e.to_string().contains(value), "{key}={value}: {e}");
    }
    let mut cfg = base.clone();
    cfg.set("batch", "512").unwrap();
    cfg.set("imgsz", "4096").unwrap();
    let e = cfg.validate().expect_err("batch × imgsz² too large");
    assert!(e.to_string().contains("pixels per batch"), "{e}");
    assert!(!base.save_dir.exists(), "nothing was written for a rejected configuration");
    // channels_last is a GPU setting: refused on the CPU by name, before anything is written.
    let mut cfg = base.clone();
    cfg.set("channels_last", "true").unwrap();
    cfg.device = Device::Cpu;
    let e = fit(&cfg, vec![]).expect_err("channels_last on the CPU");
    assert!(matches!(e, TrainerError::InvalidArgument { what: "channels_last", .. }), "{e}");
    assert!(e.to_string().contains("cuda"), "the error names the fix: {e}");
    assert!(!base.save_dir.exists(), "nothing was written for a rejected configuration");
}

/// At epoch 1's first batch (after its backward) puts NaN into the RLE flow's parameters, which
/// only the loss reads: the next batch's loss is NaN while the model's outputs stay finite. Keeps
/// the first convolution's weights as seen at each batch of epoch 1.
/// (batch in epoch, the first convolution's weight bytes) as each batch of epoch 1 saw them.
type SeenWeights = Arc<std::sync::Mutex<Vec<(usize, Vec<u8>)>>>;

#[derive(Clone, Default)]
struct PoisonTheFlow {
    weights: SeenWeights,
    poisoned: Arc<AtomicUsize>,
}

impl Callback for PoisonTheFlow {
    fn on_after_backward_params(&mut self, v: &LoopView, params: &[(String, Tensor)]) {
        if v.epoch != 1 {
            return;
        }
        let (_, w) = params.iter().find(|(n, _)| n == "model.0.conv.weight").expect("parameter");
        self.weights.lock().unwrap().push((v.batch_in_epoch, w.to_bytes().unwrap()));
        if v.batch_in_epoch == 0 && self.poisoned.fetch_add(1, Ordering::SeqCst) == 0 {
            for (_, p) in params.iter().filter(|(n, _)| n.starts_with("model.23.flow_model.")) {
                p.copy_(&Tensor::full(p.dims().to_vec(), f64::NAN, p.dtype(), p.device()).unwrap()).unwrap();
            }
        }
    }
}

/// The dense path's device gate (the whole-step issue): a NaN loss leaves the weights untouched —
/// the step after it sees the same first-layer weights — the warning names the step and the
/// term, and the epoch runs again from the last checkpoint (docs/training.md §9), after which the fit
/// finishes. Its losses arrive a step late, without a host read in the step.
#[test]
fn a_nan_loss_on_the_dense_path_never_reaches_the_weights() {
    let mut cfg = PoseTrainConfig { nbs: 2, warmup_epochs: 0.0, max_batches: Some(3), ..tiny(&fit_support::scratch("nan-dense")) };
    cfg.set("loss_assigner", "dense").unwrap();
    let poison = PoisonTheFlow::default();
    let s = fit(&cfg, vec![Box::new(poison.clone())]).expect("recovered by the reload");
    assert_eq!(s.metrics_per_epoch.len(), 3, "every epoch completed");
    let seen = poison.weights.lock().unwrap().clone();
    let batches: Vec<usize> = seen.iter().map(|(b, _)| *b).collect();
    // Epoch 1, attempt 1: batch 0 (poisons the flow after its backward; its own step is clean),
    // batches 1 and 2 (NaN losses: their steps are skipped); attempt 2 after the reload: 0, 1, 2.
    assert_eq!(batches, vec![0, 1, 2, 0, 1, 2], "epoch 1 ran twice");
    assert_ne!(seen[0].1, seen[1].1, "the clean step at batch 0 moved the weights");
    assert_eq!(seen[1].1, seen[2].1, "the NaN step at batch 1 left the weights untouched");
    let finite = |b: &[u8]| b.chunks_exact(4).all(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite());
    assert!(seen.iter().all(|(_, w)| finite(w)), "no NaN reached the first layer");
}

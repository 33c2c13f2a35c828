//! End-to-end native training on the CPU with a tiny synthetic dataset: determinism (hashes),
//! hook order (insta snapshot), kill-and-resume, corrupt checkpoints, 16-mixed skipped step.

mod fit_support;

use std::path::PathBuf;

use ptl_trainer::fit::{Callback, HookTrace, LoopView};
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

fn tiny(save: &str) -> PoseTrainConfig {
    fit_support::tiny_in(&fit_support::scratch(save))
}

#[test]
fn tiny_fit_is_deterministic_and_hooks_are_ordered() {
    let trace = HookTrace::default();
    let a = fit(&tiny("a"), vec![Box::new(trace.clone())]).unwrap();
    let b = fit(&tiny("b"), vec![]).unwrap();
    assert_eq!(a.hashes, b.hashes, "same seed ⇒ byte-identical weights, optimizer state, EMA and losses");
    assert_eq!(a.optimizer_steps, b.optimizer_steps);
    assert!(a.optimizer_steps >= 1);
    assert!(!a.final_metrics.is_empty(), "validation ran");
    let cfg_c = PoseTrainConfig { seed: 12, plots: true, ..tiny("c") };
    let c = fit(&cfg_c, vec![]).unwrap();
    assert_ne!(a.hashes.model, c.hashes.model, "a different seed gives different weights");
    for artefact in
        ["results.csv", "results.png", "summary.json", "val_pred_0.png", "weights/last.ckpt", "train_batch0.jpg", "train_batch1.jpg"]
    {
        assert!(cfg_c.save_dir.join(artefact).exists(), "{artefact} written");
    }
    plots_follow_ultralytics(&cfg_c.save_dir);
    let plain = tiny("a").save_dir;
    for artefact in
        ["results.png", "BoxPR_curve.png", "PosePR_curve.png", "val_pred_0.png", "train_batch0.jpg", "val_batch0_labels.jpg", "labels.jpg"]
    {
        assert!(!plain.join(artefact).exists(), "plots=false draws no {artefact}");
    }
    insta::assert_snapshot!("hook_order_2_epochs_2_batches", trace.take().join("\n"));
}

/// results.csv has the spec's columns (docs/training.md §11, `val/` losses included) with finite
/// values; results.png has one chart with a drawn series per column; the PR curves are written.
fn plots_follow_ultralytics(dir: &std::path::Path) {
    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<String> = lines.next().unwrap().split(',').map(|s| s.trim().to_string()).collect();
    let losses = ["box", "pose", "kobj", "cls", "l1", "rle"];
    let mut want: Vec<String> = vec!["epoch".into(), "time".into()];
    want.extend(losses.iter().map(|l| format!("train/{l}_loss")));
    for s in ["B", "P"] {
        want.extend(["precision", "recall", "mAP50", "mAP50-95"].iter().map(|m| format!("metrics/{m}({s})")));
    }
    want.extend(losses.iter().map(|l| format!("val/{l}_loss")));
    let n_lr = header.len().saturating_sub(want.len());
    want.extend((0..n_lr).map(|i| format!("lr/pg{i}")));
    assert!(n_lr >= 1, "learning-rate columns in {header:?}");
    assert_eq!(header, want);
    let rows: Vec<Vec<f64>> = lines.map(|l| l.split(',').map(|v| v.trim().parse().unwrap()).collect()).collect();
    assert_eq!(rows.len(), 2, "two epochs");
    let col = |name: &str| header.iter().position(|h| h == name).unwrap();
    for r in &rows {
        assert!(r.iter().all(|v| v.is_finite()), "every value finite: {r:?}");
        assert!(r[col("val/box_loss")] > 0.0 && r[col("val/cls_loss")] > 0.0, "val losses computed: {r:?}");
        // Eval-mode outputs carry no keypoint sigmas (as in Ultralytics): no RLE term.
        assert_eq!(r[col("val/rle_loss")], 0.0);
    }
    let (img, _) = ptl_data::image::decode_file(&dir.join("results.png")).unwrap();
    let charts = header.len() - 2;
    let (cw, ch, cols) = (320u32, 240u32, 5usize);
    assert_eq!((img.w, img.h), (cw * cols as u32, ch * charts.div_ceil(cols) as u32));
    for k in 0..charts {
        let (x0, y0) = ((k % cols) as u32 * cw, (k / cols) as u32 * ch);
        let series = (y0..y0 + ch)
            .flat_map(|y| (x0..x0 + cw).map(move |x| (y * img.w + x) as usize * 3))
            .filter(|&i| img.data[i] as i32 - img.data[i + 2] as i32 > 60 && img.data[i] > 120)
            .count();
        assert!(series > 20, "chart {k} ({}) has its series drawn ({series} px)", header[k + 2]);
    }
    for f in ["BoxPR_curve.png", "PosePR_curve.png"] {
        let (pr, _) = ptl_data::image::decode_file(&dir.join(f)).unwrap();
        assert_eq!((pr.w, pr.h), (900, 600), "{f}");
        assert!(pr.data.iter().any(|&v| v < 100), "{f} has axes and text");
    }
}

#[test]
fn kill_and_resume_gives_identical_hashes() {
    let full = fit(&tiny("full"), vec![]).unwrap();
    let cfg = tiny("killed");
    let _first = fit(&PoseTrainConfig { stop_after_epochs: Some(1), ..cfg.clone() }, vec![]).unwrap();
    let last = cfg.save_dir.join("weights").join("last.ckpt");
    let resumed = fit(&PoseTrainConfig { resume: Some(last), ..cfg }, vec![]).unwrap();
    assert_eq!(full.hashes, resumed.hashes);
}

#[test]
fn corrupt_checkpoint_is_a_typed_error() {
    let cfg = tiny("corrupt");
    std::fs::create_dir_all(&cfg.save_dir).unwrap();
    let bad = cfg.save_dir.join("bad.ckpt");
    std::fs::write(&bad, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all").unwrap();
    let err = fit(&PoseTrainConfig { resume: Some(bad), ..cfg }, vec![]).expect_err("must fail");
    assert!(matches!(err, ptl_trainer::TrainerError::Checkpoint { .. }), "{err}");
}

/// Records one parameter's bytes at every batch start and puts an inf into its gradient after
/// the backward of batch `at`.
#[derive(Clone)]
struct InjectInf {
    at: usize,
    name: String,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    last: Option<ptl_autograd::Tensor>,
}

impl Callback for InjectInf {
    fn on_train_batch_start(&mut self, _: &LoopView) {
        if let Some(p) = &self.last {
            self.seen.lock().unwrap().push(p.to_bytes().unwrap());
        }
    }
    fn on_after_backward_params(&mut self, v: &LoopView, params: &[(String, ptl_autograd::Tensor)]) {
        let (_, p) = params.iter().find(|(n, _)| *n == self.name).expect("parameter");
        if self.last.is_none() {
            self.seen.lock().unwrap().push(p.to_bytes().unwrap());
            self.last = Some(p.clone());
        }
        if v.epoch * v.batches_per_epoch + v.batch_in_epoch == self.at {
            let g = p.grad().expect("gradient present");
            let mut vals = g.to_vec::<f32>().unwrap();
            vals[0] = f32::INFINITY;
            g.copy_(&ptl_autograd::Tensor::from_vec(vals, g.dims().to_vec(), g.device()).unwrap()).unwrap();
        }
    }
    fn on_train_end(&mut self, _: &LoopView) {
        if let Some(p) = &self.last {
            self.seen.lock().unwrap().push(p.to_bytes().unwrap());
        }
    }
}

fn fp16_snapshots(at: usize) -> Vec<Vec<u8>> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let cb = InjectInf { at, name: "model.0.conv.weight".into(), seen: seen.clone(), last: None };
    // batch 1 with nbs 1 ⇒ a step every batch; no warm-up (the lr of weights starts at 0 in it).
    // The scaler starts at 2^16 and halves on every overflow, so the first steps are skipped.
    let cfg = PoseTrainConfig {
        epochs: 3,
        batch: 1,
        nbs: 1,
        warmup_epochs: 0.0,
        max_batches: Some(8),
        precision: Precision::F16Mixed,
        val: false,
        ..tiny("fp16")
    };
    fit(&cfg, vec![Box::new(cb)]).unwrap();
    let s = seen.lock().unwrap().clone();
    s
}

#[test]
fn fp16_with_injected_inf_skips_exactly_that_step() {
    // Baseline: which steps change the weights (the scaler may skip early steps on its own while
    // the scale settles, exactly as PyTorch's GradScaler does).
    let base = fp16_snapshots(usize::MAX);
    // 3 epochs × 8 steps: 25 snapshots (before each step and after the last).
    assert_eq!(base.len(), 25, "weights before each of 24 steps and after the last");
    let k = (0..24).find(|&i| base[i] != base[i + 1]).expect("some fp16 step updates the weights");
    let hit = fp16_snapshots(k);
    assert_eq!(hit[..=k], base[..=k], "identical up to the injected step");
    assert_eq!(hit[k], hit[k + 1], "the step with an inf gradient is skipped: weights untouched");
    assert_ne!(base[k], base[k + 1], "the same step without the inf updates the weights");
}

#[test]
fn bad_config_is_rejected() {
    let mut cfg = tiny("bad");
    assert!(cfg.set("imgsz", "65").is_ok());
    assert!(cfg.validate().is_err());
    assert!(cfg.set("nope", "1").is_err());
    assert!(cfg.set("epochs", "x").is_err());
    assert!(Precision::parse("fp8").is_err());
    let missing = PoseTrainConfig { data: PathBuf::from("/definitely/missing.yaml"), ..tiny("missing") };
    assert!(fit(&missing, vec![]).is_err());
}

/// `loss_assigner=dense` trains end to end on the CPU: two runs give byte-identical hashes, and
/// its first step's loss is the host path's (the first entry of the loss sequence in the
/// checkpoint is equal; later steps differ only through the flow's gradient summation order).
#[test]
fn tiny_fit_with_the_dense_assigner_is_deterministic() {
    let mut a_cfg = tiny("dense-a");
    a_cfg.set("loss_assigner", "dense").unwrap();
    let mut b_cfg = tiny("dense-b");
    b_cfg.set("loss_assigner", "dense").unwrap();
    assert!(tiny("x").set("loss_assigner", "gpu").is_err(), "unknown assigner names are rejected");
    let (a, b) = (fit(&a_cfg, vec![]).unwrap(), fit(&b_cfg, vec![]).unwrap());
    assert_eq!(a.hashes, b.hashes);
    assert!(a.optimizer_steps >= 1 && !a.final_metrics.is_empty());
    let host_cfg = tiny("dense-host");
    fit(&host_cfg, vec![]).unwrap();
    let first = |dir: &std::path::Path| {
        let ckpt = ptl_trainer::fit::checkpoint::load_checkpoint(&dir.join("weights/last.ckpt"), ptl_autograd::Device::Cpu).unwrap();
        ckpt.manifest.loop_state.step_losses[0]
    };
    assert_eq!(first(&a_cfg.save_dir).to_bits(), first(&host_cfg.save_dir).to_bits(), "the first step's loss is the host path's");
}

/// Host reads (the backend's counters) between a batch's start and end hooks.
#[derive(Clone, Default)]
struct ReadsPerStep {
    at_start: Option<ptl_autograd::HostReads>,
    steps: std::sync::Arc<std::sync::Mutex<Vec<ptl_autograd::HostReads>>>,
}

impl Callback for ReadsPerStep {
    fn on_train_batch_start(&mut self, _: &LoopView) {
        self.at_start = Some(ptl_autograd::host_reads_on_this_thread());
    }
    fn on_train_batch_end(&mut self, _: &LoopView) {
        if let Some(s) = self.at_start.take() {
            self.steps.lock().unwrap().push(ptl_autograd::host_reads_on_this_thread().since(&s));
        }
    }
}

/// The whole-step issue's CPU acceptance point: on the dense path a steady-state step (loss,
/// backward, optimizer step with its device-side non-finite gate, EMA) reads nothing back to the
/// host synchronously — its loss values leave as one deferred read, booked a step later — and
/// the run still records every step's loss (the checkpoint's sequence is complete and finite).
#[test]
fn a_steady_state_dense_step_reads_nothing_back() {
    let mut cfg = PoseTrainConfig { epochs: 1, batch: 1, max_batches: Some(6), ..tiny("no-reads") };
    cfg.set("loss_assigner", "dense").unwrap();
    let reads = ReadsPerStep::default();
    let run = fit(&cfg, vec![Box::new(reads.clone())]).unwrap();
    let steps = reads.steps.lock().unwrap().clone();
    assert_eq!(steps.len(), 6, "one record per batch");
    for (i, r) in steps.iter().enumerate().skip(1) {
        assert_eq!((r.immediate, r.deferred), (0, 1), "step {i}: no synchronous read, one deferred read ({r:?})");
    }
    assert!(run.optimizer_steps >= 1);
    assert_eq!(run.dense_loss_fallbacks, 0, "every batch fitted a target bucket");
    let ckpt = ptl_trainer::fit::checkpoint::load_checkpoint(&cfg.save_dir.join("weights/last.ckpt"), ptl_autograd::Device::Cpu).unwrap();
    let losses = &ckpt.manifest.loop_state.step_losses;
    assert_eq!(losses.len(), 6, "every step's loss was booked");
    assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0), "{losses:?}");
}

/// A misspelt key is answered with the nearest accepted one; a key like none gets no guess.
#[test]
fn an_unknown_key_names_the_closest_one() {
    let mut cfg = tiny("typo");
    for (typo, want) in [("epoch", "epochs"), ("lr_0", "lr0"), ("imgsize", "imgsz"), ("optimiser", "optimizer")] {
        let e = cfg.set(typo, "1").expect_err("unknown key").to_string();
        assert!(e.contains(&format!("did you mean `{want}`?")), "{typo}: {e}");
    }
    let e = cfg.set("completely_unrelated", "1").expect_err("unknown key").to_string();
    assert!(!e.contains("did you mean") && e.contains("ptl cfg"), "{e}");
}

/// Ultralytics' loss-gain keys reach the criterion: with `pose=0 kobj=0` the logged pose and
/// keypoint-visibility losses are 0 in every epoch while the box loss is not; a negative gain is
/// refused up front.
#[test]
fn loss_gain_keys_reach_the_loss() {
    let mut cfg = tiny("gains");
    cfg.set("pose", "0").unwrap();
    cfg.set("kobj", "0").unwrap();
    fit(&cfg, vec![]).unwrap();
    let csv = std::fs::read_to_string(cfg.save_dir.join("results.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').map(str::trim).collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no {name} in {header:?}"));
    let (pose, kobj, boxl) = (col("train/pose_loss"), col("train/kobj_loss"), col("train/box_loss"));
    let mut rows = 0;
    for line in lines {
        let v: Vec<f64> = line.split(',').map(|s| s.trim().parse().unwrap_or(f64::NAN)).collect();
        assert_eq!((v[pose], v[kobj]), (0.0, 0.0), "{line}");
        assert!(v[boxl] > 0.0, "{line}");
        rows += 1;
    }
    assert_eq!(rows, 2, "two epochs");
    let mut bad = tiny("gains-bad");
    bad.set("box", "-1").unwrap();
    let e = bad.validate().expect_err("negative gain").to_string();
    assert!(e.contains("box"), "{e}");
}

/// `save_period=1` keeps a checkpoint of every epoch beside last/best (and they load); by default
/// none is kept. The early stopper's state travels in the checkpoint.
#[test]
fn save_period_keeps_epoch_checkpoints() {
    let mut cfg = tiny("period");
    cfg.set("save_period", "1").unwrap();
    cfg.set("patience", "50").unwrap();
    fit(&cfg, vec![]).unwrap();
    for e in 0..2 {
        let p = cfg.save_dir.join(format!("weights/epoch{e}.ckpt"));
        let ck = ptl_trainer::fit::checkpoint::load_checkpoint(&p, ptl_autograd::Device::Cpu).unwrap_or_else(|err| panic!("{p:?}: {err}"));
        assert_eq!(ck.manifest.loop_state.epoch, e as i64);
        let best = ck.manifest.loop_state.stopper.best_epoch;
        assert!((1..=e + 1).contains(&best), "epoch {e}: the stopper's best epoch {best} is one of the epochs so far");
    }
    let plain = tiny("no-period");
    fit(&plain, vec![]).unwrap();
    assert!(!plain.save_dir.join("weights/epoch0.ckpt").exists());
    assert!(tiny("x").set("save_period", "often").is_err());
}

/// `fraction=0.5` trains on the first half of the training images (the tiny set's 8 → 4: two
/// batches of 2 where the whole set gives four); a fraction outside (0, 1] is refused.
#[test]
fn fraction_uses_part_of_the_training_split() {
    let whole = PoseTrainConfig { epochs: 1, max_batches: None, ..tiny("fraction-whole") };
    let mut half = PoseTrainConfig { epochs: 1, max_batches: None, ..tiny("fraction-half") };
    half.set("fraction", "0.5").unwrap();
    let (w, h) = (fit(&whole, vec![]).unwrap(), fit(&half, vec![]).unwrap());
    let steps = |dir: &std::path::Path| {
        ptl_trainer::fit::checkpoint::load_checkpoint(&dir.join("weights/last.ckpt"), ptl_autograd::Device::Cpu)
            .unwrap()
            .manifest
            .loop_state
            .step_losses
            .len()
    };
    assert_eq!((steps(&whole.save_dir), steps(&half.save_dir)), (4, 2));
    assert_ne!(w.hashes.model, h.hashes.model);
    for bad in ["0", "1.5", "-0.2"] {
        let mut c = tiny("fraction-bad");
        c.set("fraction", bad).unwrap();
        assert!(c.validate().is_err(), "fraction={bad}");
    }
}

/// Every augmentation gain is wired to the loader: changed alone, it changes the same (seed,
/// epoch, batch) — and a fit trains on what the loader builds (`degrees=10` moves the weights).
#[test]
fn augmentation_gains_reach_the_loader_and_the_fit() {
    use ptl_data::{OpenOptions, PoseDataset, TrainConfig, TrainLoader};
    let open = OpenOptions { imgsz: 64, verbose: false, ..OpenOptions::default() };
    let ds = std::sync::Arc::new(PoseDataset::open_yaml(&fit_support::dataset(), "train", &open).unwrap());
    let batch = |cfg: &PoseTrainConfig| {
        let t = TrainConfig { batch: 4, seed: 3, epochs: 2, close_mosaic: 0, aug: cfg.augment(), workers: 0, ..TrainConfig::default() };
        TrainLoader::new(ds.clone(), t).unwrap().build_batch(0, 0).unwrap()
    };
    let base = batch(&PoseTrainConfig::default());
    for (key, value) in [
        ("hsv_h", "0.5"),
        ("hsv_s", "0"),
        ("hsv_v", "0.9"),
        ("degrees", "30"),
        ("translate", "0.3"),
        ("scale", "0"),
        ("shear", "20"),
        ("perspective", "0.001"),
        ("flipud", "1"),
        ("fliplr", "0"),
        ("fliplr", "1"),
        ("mosaic", "0"),
        ("bgr", "1"),
    ] {
        let mut cfg = PoseTrainConfig::default();
        cfg.set(key, value).unwrap();
        cfg.validate().unwrap();
        let b = batch(&cfg);
        assert!(b.img != base.img || b.keypoints != base.keypoints, "{key}={value} changed nothing");
    }
    let plain = fit(&PoseTrainConfig { epochs: 1, ..tiny("aug-plain") }, vec![]).unwrap();
    let mut rotated = PoseTrainConfig { epochs: 1, ..tiny("aug-rotated") };
    rotated.set("degrees", "10").unwrap();
    assert_ne!(fit(&rotated, vec![]).unwrap().hashes.model, plain.hashes.model);
}

/// Every parameter's bytes as the first step's backward left them (before any optimizer step: the
/// weights the fit started from).
#[derive(Clone, Default)]
struct StartWeights(std::sync::Arc<std::sync::Mutex<NamedBytes>>);

/// (parameter name, its bytes).
type NamedBytes = Vec<(String, Vec<u8>)>;

impl Callback for StartWeights {
    fn on_after_backward_params(&mut self, v: &LoopView, params: &[(String, ptl_autograd::Tensor)]) {
        let mut seen = self.0.lock().unwrap();
        if v.epoch == 0 && v.batch_in_epoch == 0 && seen.is_empty() {
            seen.extend(params.iter().map(|(n, p)| (n.clone(), p.to_bytes().unwrap())));
        }
    }
}

/// `model=start.safetensors` (a state dict with Ultralytics' names, as the goldens and the
/// conversion script write it) starts the fit from exactly those weights, not from the random seed's
/// initialisation, and the fit fine-tunes them; `model=last.ckpt` starts from a ptl checkpoint's
/// EMA weights. Weights of another model are a typed error naming the tensor.
#[test]
fn a_fit_fine_tunes_from_saved_weights() {
    use ptl_autograd::Device;
    use ptl_heads::{ModelConfig, PoseModel};
    let dir = fit_support::scratch("start-weights");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("start.safetensors");
    PoseModel::new(ModelConfig::default(), Device::Cpu, 77).unwrap().save_safetensors(&file).unwrap();
    let saved = ptl_autograd::module::load_safetensors(&file, Device::Cpu).unwrap();
    let own_init = PoseModel::new(ModelConfig::default(), Device::Cpu, 11).unwrap();

    let start = StartWeights::default();
    let mut cfg = tiny("fine-tune");
    cfg.set("model", file.to_str().unwrap()).unwrap();
    let tuned = fit(&cfg, vec![Box::new(start.clone())]).unwrap();
    let seen = start.0.lock().unwrap().clone();
    assert!(seen.len() > 400, "every parameter seen ({})", seen.len());
    for (name, bytes) in &seen {
        assert_eq!(*bytes, saved[name].to_bytes().unwrap(), "{name} starts as in the file");
    }
    let first_conv = |sd: Vec<(String, ptl_autograd::Tensor, ptl_autograd::TensorKind)>| {
        sd.into_iter().find(|(n, _, _)| n == "model.0.conv.weight").unwrap().1.to_bytes().unwrap()
    };
    let seen_first = &seen.iter().find(|(n, _)| n == "model.0.conv.weight").unwrap().1;
    assert_ne!(*seen_first, first_conv(own_init.state_dict()), "not the random seed's own initialisation");
    let plain = fit(&tiny("fine-tune-plain"), vec![]).unwrap();
    assert_ne!(tuned.hashes.model, plain.hashes.model);
    assert!(tuned.optimizer_steps >= 1 && tuned.hashes.step_losses != plain.hashes.step_losses);

    // A ptl checkpoint: its EMA weights.
    let last = cfg.save_dir.join("weights/last.ckpt");
    let ema = ptl_trainer::fit::load_checkpoint(&last, Device::Cpu).unwrap().part("ema");
    let start = StartWeights::default();
    let mut again = tiny("fine-tune-ckpt");
    again.set("model", last.to_str().unwrap()).unwrap();
    fit(&PoseTrainConfig { epochs: 1, ..again }, vec![Box::new(start.clone())]).unwrap();
    for (name, bytes) in start.0.lock().unwrap().iter() {
        assert_eq!(*bytes, ema[name].to_bytes().unwrap(), "{name} starts as the checkpoint's EMA");
    }

    // Another shape, a name the model lacks: typed errors naming the tensor, before any training.
    for (edit, tensor, says) in
        [("reshape", "model.1.conv.weight", "has shape [1, 1, 1, 1]"), ("extra", "model.99.weight", "is not in the model")]
    {
        let mut tensors: Vec<(String, ptl_autograd::Tensor)> = saved.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
        let odd = ptl_autograd::Tensor::from_vec(vec![0.0f32], vec![1, 1, 1, 1], Device::Cpu).unwrap();
        match edit {
            "reshape" => tensors.iter_mut().find(|(n, _)| n == tensor).unwrap().1 = odd,
            _ => tensors.push((tensor.into(), odd)),
        }
        let bad_file = dir.join(format!("{edit}.safetensors"));
        std::fs::write(&bad_file, ptl_autograd::module::to_safetensors_bytes(&tensors).unwrap()).unwrap();
        let mut bad = tiny(&format!("fine-tune-{edit}"));
        bad.set("model", bad_file.to_str().unwrap()).unwrap();
        let e = fit(&bad, vec![]).expect_err(edit);
        assert!(matches!(&e, ptl_trainer::TrainerError::StartWeights { tensor: t, .. } if t == tensor), "{e}");
        assert!(e.to_string().contains(says), "{e}");
    }
}

/// The goldens' `weights.safetensors` (Ultralytics' own `state_dict()` of YOLO26n-pose, what the
/// conversion script writes) is a valid `model=`: size n, every tensor in place.
#[test]
fn an_ultralytics_state_dict_is_a_start_model() {
    let Some(dir) = ptl_goldens::folder() else { return };
    let file = dir.join("model/weights.safetensors");
    let source = ptl_trainer::pose::ModelSource::parse(file.to_str().unwrap()).unwrap();
    assert_eq!(source.scale().unwrap(), ptl_heads::Scale::N);
    let model = ptl_heads::PoseModel::new(ptl_heads::ModelConfig::default(), ptl_autograd::Device::Cpu, 0).unwrap();
    let values = source.start_weights().unwrap().expect("a weights file");
    ptl_trainer::pose::weights::load_start_weights(&model, &values, &file).unwrap();
    let (name, t, _) = model.state_dict().into_iter().next().unwrap();
    assert_eq!(t.to_bytes().unwrap(), values[&name].to_bytes().unwrap(), "{name} loaded");
}

/// `best.ckpt` and `last_weights.ckpt` hold what Ultralytics ships as `best.pt` and `last.pt`:
/// the EMA model in half precision and the run's settings, nothing else — under 8 MB for
/// yolo26n-pose, a fraction of the full `last.ckpt`; they load for prediction (and as start
/// weights) with the EMA's values, and a resume from them is refused with a message naming the
/// full checkpoint beside them.
#[test]
fn best_weights_are_lean_and_load() {
    use ptl_autograd::{DType, Device};
    let cfg = tiny("lean-best");
    fit(&cfg, vec![]).unwrap();
    let (best, last) = (cfg.save_dir.join("weights/best.ckpt"), cfg.save_dir.join("weights/last.ckpt"));
    let size = |p: &std::path::Path| std::fs::metadata(p).unwrap().len();
    assert!(size(&best) < 8 << 20, "best.ckpt is {} bytes", size(&best));
    assert!(size(&best) * 4 < size(&last), "best {} vs last {} bytes", size(&best), size(&last));
    let lean = ptl_trainer::fit::load_checkpoint(&best, Device::Cpu).unwrap();
    assert!(!lean.tensors.is_empty());
    for (n, t) in &lean.tensors {
        assert!(n.starts_with("ema."), "{n} in best.ckpt");
        if !t.dtype().is_float() {
            continue;
        }
        assert_eq!(t.dtype(), DType::F16, "{n}");
    }
    assert_eq!(lean.manifest.train_args, ptl_trainer::fit::load_checkpoint(&last, Device::Cpu).unwrap().manifest.train_args);
    // The EMA of the best epoch, rounded to half precision: with two epochs and a tiny set the
    // best epoch may be either; each value is the f16 of an f32 the model could load.
    let (model, args) = ptl_trainer::pose::predict::load_eval_model(&best, Device::Cpu).unwrap();
    assert_eq!(args["imgsz"], lean.manifest.train_args["imgsz"]);
    let state: std::collections::HashMap<String, ptl_autograd::Tensor> = model.state_dict().into_iter().map(|(n, t, _)| (n, t)).collect();
    for (n, t) in lean.part("ema") {
        if t.dtype().is_float() {
            let loaded = state[&n].to_dtype(DType::F16).unwrap().to_bytes().unwrap();
            assert_eq!(loaded, t.to_bytes().unwrap(), "{n} loads as stored");
        }
    }
    let resumed = PoseTrainConfig::for_resume(&best, &[]).and_then(|c| fit(&c, vec![]).map(|_| ()));
    let err = resumed.expect_err("resume from weights only").to_string();
    assert!(err.contains("weights only") && err.contains("last.ckpt"), "{err}");
    // The last epoch's lean weights: the full checkpoint's EMA in half precision, tensor by tensor.
    let last_weights = cfg.save_dir.join("weights").join(ptl_trainer::fit::checkpoint::LAST_WEIGHTS);
    assert!(size(&last_weights) < 8 << 20, "{} is {} bytes", last_weights.display(), size(&last_weights));
    let lean_last = ptl_trainer::fit::load_checkpoint(&last_weights, Device::Cpu).unwrap();
    let full = ptl_trainer::fit::load_checkpoint(&last, Device::Cpu).unwrap();
    let full_ema = full.part("ema");
    assert_eq!(lean_last.part("ema").len(), full_ema.len());
    for (n, t) in lean_last.part("ema") {
        let want = if t.dtype().is_float() { full_ema[&n].to_dtype(DType::F16).unwrap() } else { full_ema[&n].clone() };
        assert_eq!(t.to_bytes().unwrap(), want.to_bytes().unwrap(), "{n}: the last epoch's EMA");
    }
    assert!(ptl_trainer::pose::predict::load_eval_model(&last_weights, Device::Cpu).is_ok());
    let err = PoseTrainConfig::for_resume(&last_weights, &[]).expect_err("resume from lean last").to_string();
    assert!(err.contains("weights only") && err.contains("last.ckpt"), "{err}");
}

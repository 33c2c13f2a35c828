//! The pose fit loop: Ultralytics' optimisation recipe (docs/training.md §2–§7) inside Lightning's hook
//! order (docs/trainer.md §3–§4), with replay plugins wrapping the step's stages.
//!
//! Read top down: [`fit`] assembles a run (this module), `epochs` runs its epochs, `step` one
//! training step, `persist` checkpoints and hashes; `run` holds the state they share.

mod autobatch_probe;
mod bucket_plan;
pub(crate) mod epoch_line;
mod epochs;
mod persist;
mod run;
mod run_ahead;
mod step;

use std::sync::Arc;
use std::time::Instant;

use ptl_autograd::{module, Device, Module, Tensor, TensorKind};
use ptl_data::{OpenOptions, PoseDataset, Shard, TrainConfig, TrainLoader};
use ptl_heads::{ModelConfig, PoseModel};

use super::clock::StepClock;
use super::config::{PoseTrainConfig, Precision};
use super::probe;
use super::weights::ModelSource;
use crate::distributed::{per_rank_batch, Collective, DataParallel};
use crate::fit::{Callback, LoopState, LoopView, PluginStack, RunDir, RunHistory, RunSummary, StageProfile, StartupReport};
use crate::loss::{E2ELoss, LossConfig};
use crate::optim::{
    auto_iterations, build_optimizer_for_module, nominal_accumulate, resolve, GradScaler, GradScalerConfig, LrLambda, LrScheduler,
    ModelEma, OptimizerConfig, OptimizerName, Warmup,
};
use crate::{Result, TrainerError};

use epochs::fit_loop;
use run::*;

/// Loss item names in the order of the 6-vector (docs/loss.md §5).
pub const LOSS_NAMES: [&str; 6] = ["box_loss", "pose_loss", "kobj_loss", "cls_loss", "l1_loss", "rle_loss"];

/// The device's TF32 switch for f32 convolutions set from the run's `tf32` for as long as the
/// fit runs; dropping it puts the device's earlier setting back (a later fit or plain tensor code
/// in the process sees what it set itself). A no-op on the CPU.
struct Tf32ForRun {
    #[cfg(feature = "cuda")]
    restore: Option<(Device, ptl_autograd::cuda::DeviceOptions)>,
}

fn set_tf32(device: Device, tf32: bool) -> Result<Tf32ForRun> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let before = ptl_autograd::cuda::device_options(device)?;
        ptl_autograd::cuda::set_device_options(device, ptl_autograd::cuda::DeviceOptions { tf32_convolutions: tf32, ..before })?;
        return Ok(Tf32ForRun { restore: Some((device, before)) });
    }
    let _ = (device, tf32);
    Ok(Tf32ForRun {
        #[cfg(feature = "cuda")]
        restore: None,
    })
}

impl Drop for Tf32ForRun {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some((device, before)) = self.restore.take() {
            // Setting a device's options only fails for a device that is not there, and this
            // one was set a moment ago.
            let _ = ptl_autograd::cuda::set_device_options(device, before);
        }
    }
}

/// The models' activation storage order from the run's `channels_last`.
pub(super) fn activation_format(cfg: &PoseTrainConfig) -> ptl_autograd::MemoryFormat {
    match cfg.channels_last {
        true => ptl_autograd::MemoryFormat::ChannelsLast,
        false => ptl_autograd::MemoryFormat::Contiguous,
    }
}

/// Trains a pose model as `cfg` says, calling `callbacks` at the hook points; returns the summary
/// (also written to `save_dir/summary.json`).
pub fn fit(cfg: &PoseTrainConfig, callbacks: Vec<Box<dyn Callback>>) -> Result<RunSummary> {
    fit_with(cfg, callbacks, None)
}

/// Trains as one rank of a data-parallel group, with Ultralytics' semantics (docs/multi-gpu.md):
/// `batch` is the global batch, floored per rank; each rank takes its share of every epoch;
/// gradients are averaged over the ranks before each optimizer step, so every rank holds the
/// same weights; rank 0 alone validates, writes the run folder and prints, and the others follow
/// its decisions (early stop, the non-finite recovery). Every rank calls this with the same
/// settings; each returns its summary (rank 0's is the one written).
pub fn fit_data_parallel(cfg: &PoseTrainConfig, callbacks: Vec<Box<dyn Callback>>, group: Box<dyn Collective>) -> Result<RunSummary> {
    fit_with(cfg, callbacks, Some(DataParallel::new(group)))
}

fn fit_with(cfg: &PoseTrainConfig, callbacks: Vec<Box<dyn Callback>>, dp: Option<DataParallel>) -> Result<RunSummary> {
    cfg.validate()?;
    let started = Instant::now();
    let mut cfg = cfg.clone();
    cfg.resolve_amp();
    cfg.resolve_autobatch()?;
    // Against the settings as given: a rank other than 0 turns its outputs off below.
    if let Some(path) = &cfg.resume {
        cfg.check_resume(path)?;
    }
    let shard = match &dp {
        Some(dp) => data_parallel_settings(&mut cfg, dp)?,
        None => Shard::WHOLE,
    };
    let is_main = dp.as_ref().is_none_or(DataParallel::is_main);
    let mut startup = StartupReport { process_to_fit_s: probe::process_age_s(), ..StartupReport::default() };
    let t = Instant::now();
    probe::open_device(cfg.device)?;
    if cfg.channels_last && !cfg.device.is_cuda() {
        return Err(TrainerError::InvalidArgument {
            what: "channels_last",
            reason: format!(
                "channels_last=true stores activations for cuDNN's convolutions and needs a CUDA device, not {}; use device=cuda:N or channels_last=false",
                cfg.device
            ),
        });
    }
    let _tf32 = set_tf32(cfg.device, cfg.tf32)?;
    startup.device_open_s = t.elapsed().as_secs_f64();
    crate::pose::reset_memory_peaks(cfg.device);
    let t = Instant::now();
    let open = OpenOptions { imgsz: cfg.imgsz as u32, verbose: true, ..OpenOptions::default() };
    let train_ds = Arc::new(PoseDataset::open_yaml(&cfg.data, "train", &OpenOptions { fraction: cfg.fraction, ..open.clone() })?);
    let val_ds = if cfg.val { Some(Arc::new(PoseDataset::open_yaml(&cfg.data, "val", &open)?)) } else { None };
    startup.dataset_open_s = t.elapsed().as_secs_f64();
    let source = ModelSource::parse(&cfg.model)?;
    let mcfg = model_config(&cfg, &source, &train_ds)?;
    let probe_setup = autobatch_probe::ProbeSetup {
        model: mcfg,
        loss: loss_config(&cfg, &train_ds),
        dataset_size: train_ds.len(),
        max_objects: bucket_plan::most_objects_per_sample(&train_ds, cfg.mosaic > 0.0),
    };
    // AutoBatch on a CUDA device (`resolve_autobatch` settled the CPU): the run's own step probed.
    if let Some(fraction) = cfg.autobatch.take() {
        cfg.batch = autobatch_probe::autobatch(&cfg, fraction, &probe_setup)?.batch;
    }
    // Only now, with the settings, the device and the data known good, is anything written.
    // The run folder is this process's until the fit returns (see `RunDir`). A resume continues
    // in the checkpoint's own run folder, or starts a new one where the user said.
    // With several ranks only rank 0 writes; the others learn its folder (they read its
    // checkpoints in the non-finite recovery).
    let run_dir = match is_main {
        true => Some(claim_run_folder(&mut cfg, &train_ds)),
        false => None,
    };
    let run_dir = match &dp {
        Some(dp) => {
            let claimed = run_dir.as_ref().and_then(|r| r.as_ref().ok()).map(|r| r.path().to_string_lossy().into_owned());
            let folder = dp.bytes_from_main(claimed.as_deref().unwrap_or("").as_bytes())?;
            if folder.is_empty() && !is_main {
                return Err(TrainerError::InvalidArgument {
                    what: "data-parallel run",
                    reason: "rank 0 could not set up its run folder (its error says why)".into(),
                });
            }
            cfg.save_dir = String::from_utf8_lossy(&folder).into_owned().into();
            run_dir.transpose()?
        }
        None => run_dir.transpose()?,
    };
    let cfg = &cfg;
    let t = Instant::now();
    let rank_batch = per_rank_batch(cfg.batch, shard.world)?;
    let batches = shard.len(train_ds.len()).div_ceil(rank_batch.min(shard.len(train_ds.len())).max(1));
    let batches = cfg.max_batches.map_or(batches, |m| m.min(batches));
    let workers = cfg.effective_workers(batches);
    // Several ranks on one host share its cores: each loader takes at most its share, as
    // Ultralytics' min(cores / GPUs, workers).
    let workers = match shard.world {
        1 => workers,
        world => workers.min((std::thread::available_parallelism().map_or(1, |n| n.get()) / world).max(1)),
    };
    let mut tcfg = TrainConfig {
        batch: rank_batch,
        shard,
        seed: cfg.seed,
        epochs: cfg.epochs,
        close_mosaic: cfg.close_mosaic,
        workers,
        prefetch: ptl_data::loader::prefetch_for(workers),
        inject_panic_at: cfg.inject_loader_panic_at,
        // CUDA runs jitter colours on the device after the upload (one fused launch per batch).
        hsv_on_device: matches!(cfg.device, Device::Cuda(_)) && cfg!(feature = "cuda"),
        ..TrainConfig::default()
    };
    tcfg.aug = cfg.augment();
    // The device kernel reads every image as RGB: with BGR swaps on, colours are jittered on the CPU.
    tcfg.hsv_on_device &= cfg.bgr == 0.0;
    let loader = Arc::new(TrainLoader::new(train_ds.clone(), tcfg)?);
    let nb_full = loader.batches_per_epoch();
    let nb = cfg.max_batches.map_or(nb_full, |m| m.min(nb_full)).max(1);

    let nc = train_ds.meta.nc;
    let mut model = PoseModel::new(mcfg, cfg.device, cfg.seed)?;
    model.set_activation_format(activation_format(cfg));
    if cfg.resume.is_none() {
        if let (Some(values), Some(path)) = (source.start_weights()?, source.weights_path()) {
            let kept = super::weights::load_start_weights_for_classes(&model, &values, path)?;
            if kept > 0 {
                log::warn!(
                    "ptl: start weights {}: the class head has another class count; its {kept} prediction tensors start from \
                     their initial values for the data's {nc} class(es)",
                    path.display()
                );
            }
        }
    }
    freeze_layers(&model, &cfg.freeze)?;

    // Optimiser per docs/training.md §2–§3: nominal accumulation, wd scaling, `auto` rule.
    let accumulate_nominal = nominal_accumulate(cfg.nbs, cfg.batch)?.min(nb * cfg.epochs).max(1);
    let ocfg = OptimizerConfig {
        name: OptimizerName::parse(&cfg.optimizer)?,
        lr0: cfg.lr0,
        momentum: cfg.momentum,
        weight_decay: cfg.weight_decay,
        nbs: cfg.nbs,
        batch: cfg.batch,
        iterations: auto_iterations(train_ds.len(), cfg.batch, cfg.nbs, cfg.epochs),
        nc: Some(nc),
        warmup_bias_lr: cfg.warmup_bias_lr,
        ..OptimizerConfig::default()
    };
    let resolved = resolve(&ocfg)?;
    let optimizer = build_optimizer_for_module(&model, &ocfg)?;
    let lambda = LrLambda::new(cfg.cos_lr, cfg.lrf, cfg.epochs);
    let warmup = Warmup {
        nw: crate::optim::warmup_iterations(cfg.warmup_epochs, cfg.epochs, nb),
        warmup_bias_lr: resolved.warmup_bias_lr,
        warmup_momentum: cfg.warmup_momentum,
        momentum: cfg.momentum,
        accumulate: accumulate_nominal,
    };
    let ema = ModelEma::from_module(&model)?;
    let scaler = match cfg.precision {
        Precision::F16Mixed => Some(GradScaler::new(GradScalerConfig {
            init_scale: cfg.scaler_init_scale,
            growth_interval: cfg.scaler_growth_interval as u64,
            ..GradScalerConfig::default()
        })?),
        _ => None,
    };
    let loss_cfg = probe_setup.loss.clone();
    let dense = loss_cfg.dense_assignment;
    let mut criterion = E2ELoss::new(loss_cfg, cfg.epochs);
    // The dense path leaves its values on the device; the loop reads them a step later.
    criterion.defer_items = dense;
    let plugins = PluginStack::from_registry(&cfg.replay, &cfg.replay_config)?;
    let mut run = Run {
        cfg: cfg.clone(),
        model,
        model_cfg: mcfg,
        criterion,
        optimizer,
        scheduler: LrScheduler::new(lambda, 0),
        lambda,
        warmup,
        accumulate: accumulate_nominal,
        ema,
        scaler,
        plugins,
        callbacks,
        loader,
        val_ds,
        names: train_ds.meta.names.clone(),
        nb,
        state: LoopState { epoch: -1, last_opt_step: -1, ..LoopState::default() },
        view: LoopView { epochs: cfg.epochs, batches_per_epoch: nb, ..LoopView::default() },
        clock: StepClock::new(cfg.device, cfg.timing_warmup_steps, Err("not started".into())),
        stage_ms: Vec::new(),
        epoch_s: Vec::new(),
        memory_per_epoch: Vec::new(),
        workers,
        pageable_uploads: 0,
        loader_build: (0, 0.0),
        metrics_per_epoch: Vec::new(),
        optimizer_name: format!("{:?}", resolved.name),
        history: RunHistory::default(),
        nonfinite: None,
        resolved: serde_json::json!({
            "name": format!("{:?}", resolved.name), "lr0": resolved.lr0, "momentum": resolved.momentum,
            "warmup_bias_lr": resolved.warmup_bias_lr, "weight_decay": resolved.weight_decay,
        }),
        params: Vec::new(),
        float_buffers: Vec::new(),
        compute_weights: Vec::new(),
        anchors: None,
        flow_surface: Vec::new(),
        model_surface: Vec::new(),
        pending_losses: Default::default(),
        absorbed: 0,
        loss_flag: None,
        overlapped: None,
        overlap_allowed: None,
        bucket_plan: bucket_plan::BucketPlan::new(bucket_plan::most_objects_per_sample(&train_ds, cfg.mosaic > 0.0)),
        dp,
    };
    run.params = model_params(&run.model);
    run.compute_weights = compute_weights(&run.params);
    run.float_buffers = module::state_dict(&run.model)
        .into_iter()
        .filter(|(_, t, kind)| *kind == TensorKind::Buffer && t.dtype().is_float())
        .map(|(_, t, _)| t)
        .collect();
    run.flow_surface = run
        .params
        .iter()
        .filter(|(n, _)| n.starts_with("model.23.flow_model."))
        .map(|(n, t)| (n.clone(), t.clone(), TensorKind::Parameter))
        .collect();
    let mut surface = Vec::new();
    run.model.visit("", &mut |n, t, k| surface.push((n.to_string(), t.clone(), k)));
    run.model_surface = surface;
    startup.model_build_s = t.elapsed().as_secs_f64();
    let train_args = serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null);
    let result = fit_loop(&mut run, &train_args);
    let (plugin_lines, replay_counters, replay_cadence) = (run.plugins.summaries(), run.plugins.counters(), run.plugins.cadences());
    // Per-fit holds of the plugins go whatever happened (a later fit starts clean).
    run.plugins.on_fit_end();
    for (_, p) in &run.params {
        p.set_keep_grad_buffer(false);
    }
    if let Err(e) = result {
        let msg = e.to_string();
        let v = run.view.clone();
        for cb in run.callbacks.iter_mut() {
            cb.on_exception(&v, &msg);
        }
        // Out of device memory: the run's memory goes back, and AutoBatch names a batch that fits.
        if autobatch_probe::is_out_of_memory(&e) {
            drop(run);
            return Err(autobatch_probe::batch_does_not_fit(cfg, &probe_setup, e));
        }
        return Err(e);
    }
    let hashes = run.hashes()?;
    let (peak_allocated_bytes, peak_reserved_bytes) = crate::pose::memory_peaks(cfg.device);
    let peak_allocated_during = crate::pose::memory_peak_during(cfg.device);
    let mut timing = run.clock.finish(run.workers, run.pageable_uploads);
    let images_per_batch = run.loader.batch_size() as f64;
    timing.loader_images_per_s =
        (run.loader_build.0 > 0 && run.loader_build.1 > 0.0).then(|| run.workers.max(1) as f64 * images_per_batch / run.loader_build.1);
    timing.consumed_images_per_s =
        (timing.start_to_start.median_ms > 0.0).then(|| images_per_batch * 1000.0 / timing.start_to_start.median_ms);
    timing.stages = stage_profile(&run.stage_ms);
    let (first_began, first_step_s) = run.clock.first_step();
    startup.first_step_s = first_step_s;
    if let Some(t) = first_began {
        startup.fit_to_first_step_s = t.duration_since(started).as_secs_f64();
        startup.process_to_first_step_s = startup.process_to_fit_s.map(|p| p + startup.fit_to_first_step_s);
    }
    startup.kernel_modules = probe::kernel_modules();
    probe::library_setup(&mut startup);
    startup.epoch_s = run.epoch_s.clone();
    let summary = RunSummary {
        device: cfg.device.to_string(),
        precision: cfg.precision.name().into(),
        epochs: cfg.epochs,
        batch: cfg.batch,
        imgsz: cfg.imgsz,
        optimizer: run.optimizer_name.clone(),
        total_runtime_s: started.elapsed().as_secs_f64(),
        step_time: timing.start_to_start.clone(),
        timing,
        startup,
        peak_allocated_bytes,
        peak_reserved_bytes,
        peak_allocated_during,
        library_workspace_bytes: crate::pose::library_workspace_bytes(cfg.device),
        optimizer_steps: run.state.global_step,
        save_dir: cfg.save_dir.clone(),
        fit_time_s: run.history.fit_time_s,
        final_metrics: run.metrics_per_epoch.last().cloned().unwrap_or_default(),
        metrics_per_epoch: run.metrics_per_epoch.clone(),
        hashes,
        memory_per_epoch: run.memory_per_epoch.clone(),
        plugins: plugin_lines,
        replay_counters,
        replay_cadence,
        // Both branches fall back together; each counts the call once.
        dense_loss_fallbacks: run.criterion.one2many.dense_fallbacks() as u64,
        planned_target_slots: run.bucket_plan.prepared_slots(),
    };
    if is_main {
        summary.write(&cfg.save_dir.join("summary.json"))?;
    }
    drop(run_dir);
    Ok(summary)
}

/// Settles a data-parallel rank's settings: AutoBatch replaced by batch 16 as Ultralytics does on
/// several GPUs, and the ranks other than 0 neither validate, plot nor print. Returns this rank's
/// share of each epoch. Replay plugins work as alone: the gradients are averaged natively
/// between the replayed backward and the (replayed) update, into the gradients' own buffers.
fn data_parallel_settings(cfg: &mut PoseTrainConfig, dp: &DataParallel) -> Result<Shard> {
    if cfg.autobatch.take().is_some() {
        cfg.batch = 16;
        if dp.is_main() {
            log::warn!("ptl: AutoBatch (batch=-1) is for one device; training {} ranks with the default batch=16", dp.world());
        }
    }
    // Refused here, on every rank alike, before the ranks' first exchange.
    per_rank_batch(cfg.batch, dp.world())?;
    if !dp.is_main() {
        (cfg.progress, cfg.plots, cfg.val, cfg.save_json) = (false, false, false, false);
    }
    Ok(Shard { rank: dp.rank(), world: dp.world() })
}

/// Claims the run folder (a new numbered one unless resuming in place or `exist_ok`), writes
/// args.yaml and, on a new run with plots on, labels.jpg. `cfg.save_dir` becomes the folder.
fn claim_run_folder(cfg: &mut PoseTrainConfig, train_ds: &PoseDataset) -> Result<RunDir> {
    let own_folder = cfg.resume.as_deref().and_then(PoseTrainConfig::run_dir_of).is_some_and(|d| d == cfg.save_dir);
    let run_dir = match own_folder || cfg.exist_ok {
        true => RunDir::claim_existing(&cfg.save_dir)?,
        false => RunDir::claim_new(&cfg.save_dir)?,
    };
    if run_dir.path() != cfg.save_dir {
        log::warn!(
            "ptl: {} already holds a run; writing to {} (exist_ok=true trains into the existing folder)",
            cfg.save_dir.display(),
            run_dir.path().display()
        );
        cfg.save_dir = run_dir.path().to_path_buf();
    } else if cfg.progress {
        log::info!("ptl: writing to {}", run_dir.path().display());
    }
    // Every resolved setting, as Ultralytics' args.yaml (`ptl train args.yaml` reads it back).
    let args = run_dir.path().join("args.yaml");
    let yaml = cfg.args_yaml();
    ptl_files::write_atomic_with(&args, 0o644, |f| std::io::Write::write_all(f, yaml.as_bytes()))?;
    // Ultralytics' labels.jpg: the training labels before the first epoch (not again on a resume).
    if cfg.plots && cfg.resume.is_none() {
        let objects = train_ds.items.iter().flat_map(|it| it.labels.cls.iter().zip(&it.labels.boxes));
        let (cls, boxes): (Vec<usize>, Vec<[f32; 4]>) = objects.map(|(c, b)| (*c as usize, *b)).unzip();
        super::plots::plot_labels(&cls, &boxes, &train_ds.meta.names, run_dir.path())?;
    }
    Ok(run_dir)
}

/// The model's configuration: the data's classes and keypoints, the size of the start weights
/// (of the checkpoint when resuming: the start weights file may be gone by now).
fn model_config(cfg: &PoseTrainConfig, source: &ModelSource, train_ds: &PoseDataset) -> Result<ModelConfig> {
    let scale = match &cfg.resume {
        Some(path) => {
            crate::fit::checkpoint::refuse_resume_from_weights(path, &crate::fit::checkpoint::read_manifest(path)?)?;
            super::weights::scale_in_file(path, "model.")?
        }
        None => source.scale()?,
    };
    Ok(ModelConfig { nc: train_ds.meta.nc, kpt_shape: (train_ds.nkpt(), 3), scale })
}

/// The criterion's configuration: the run's gains and assigner, the data's classes, keypoints and
/// OKS sigmas. `loss_assigner=auto` takes the fixed-shape path on a GPU (fewer host syncs and
/// launches: faster there), the host path on the CPU (cheaper there, and the reference's own
/// algorithm).
fn loss_config(cfg: &PoseTrainConfig, train_ds: &PoseDataset) -> LossConfig {
    let dense = match cfg.loss_assigner.as_str() {
        "dense" => true,
        "auto" => cfg.device.is_cuda(),
        _ => false,
    };
    let g = cfg.loss_gains;
    LossConfig {
        dense_assignment: dense,
        box_gain: g.box_gain,
        cls_gain: g.cls,
        l1_gain: g.dfl,
        pose_gain: g.pose,
        kobj_gain: g.kobj,
        rle_gain: g.rle,
        nc: train_ds.meta.nc,
        ..LossConfig::with_keypoints(train_ds.nkpt(), train_ds.meta.custom_oks_sigmas().map(<[f32]>::to_vec))
    }
}

/// Medians of the `profile=true` stage times (NaN entries — stages that did not run — skipped).
fn stage_profile(samples: &[[f64; 7]]) -> Option<StageProfile> {
    if samples.is_empty() {
        return None;
    }
    let median = |k: usize| {
        let mut v: Vec<f64> = samples.iter().map(|s| s[k]).filter(|x| x.is_finite()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        match v.len() {
            0 => 0.0,
            n if n % 2 == 1 => v[n / 2],
            n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
        }
    };
    Some(StageProfile {
        steps: samples.len(),
        data_ms: median(0),
        upload_ms: median(1),
        forward_ms: median(2),
        loss_ms: median(3),
        backward_ms: median(4),
        optimizer_ms: median(5),
        ema_ms: median(6),
    })
}

/// Freezes the parameters of `layers` (Ultralytics' `freeze`): they keep `requires_grad = false`
/// for the whole run, receive no gradient and are skipped by the optimizer.
fn freeze_layers(model: &PoseModel, layers: &[usize]) -> Result<()> {
    if layers.is_empty() {
        return Ok(());
    }
    let n_layers = model.layers().len();
    if let Some(bad) = layers.iter().find(|&&i| i >= n_layers) {
        return Err(TrainerError::InvalidArgument {
            what: "freeze",
            reason: format!("layer {bad} does not exist (the model has layers 0…{})", n_layers - 1),
        });
    }
    let prefixes: Vec<String> = layers.iter().map(|i| format!("model.{i}.")).collect();
    let mut frozen = 0;
    for (name, p) in module::named_parameters(model) {
        if prefixes.iter().any(|pre| name.starts_with(pre)) {
            p.set_requires_grad(false)?;
            frozen += 1;
        }
    }
    log::info!("ptl: freeze: {frozen} parameters of layers {layers:?} are frozen");
    Ok(())
}

/// The parameters the forward casts to the compute dtype: rank ≥ 2 ones, and a `<module>.bias`
/// whose `<module>.weight` is a 4-d convolution weight (a convolution's bias is cast like its
/// weight; a BatchNorm's weight is rank 1, so its bias stays out and is read in f32).
fn compute_weights(params: &[(String, Tensor)]) -> Vec<Tensor> {
    let conv_modules: std::collections::HashSet<&str> =
        params.iter().filter(|(_, t)| t.rank() == 4).filter_map(|(n, _)| n.strip_suffix(".weight")).collect();
    params
        .iter()
        .filter(|(n, t)| t.rank() >= 2 || (t.rank() == 1 && n.strip_suffix(".bias").is_some_and(|m| conv_modules.contains(m))))
        .map(|(_, t)| t.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batched autocast copies cover every convolution weight and bias of YOLO26n-pose and no
    /// BatchNorm parameter (those are read in f32: a bf16 copy would round them).
    #[test]
    fn compute_weights_are_conv_weights_and_biases() {
        let model = PoseModel::new(ModelConfig { nc: 1, kpt_shape: (17, 3), scale: ptl_heads::Scale::N }, Device::Cpu, 0).unwrap();
        let params = model_params(&model);
        let bn_modules: std::collections::HashSet<String> =
            float_state(&model).into_iter().filter_map(|(n, _)| n.strip_suffix(".running_mean").map(str::to_string)).collect();
        let chosen: std::collections::HashSet<usize> = compute_weights(&params).iter().map(|t| t.storage_ptr()).collect();
        let (mut biases, mut bn) = (0, 0);
        for (name, t) in &params {
            let in_bn = name.rsplit_once('.').is_some_and(|(m, _)| bn_modules.contains(m));
            if in_bn {
                assert!(!chosen.contains(&t.storage_ptr()), "{name} is a BatchNorm parameter, read in f32");
                bn += 1;
            } else if t.rank() >= 2 {
                assert!(chosen.contains(&t.storage_ptr()), "{name} (rank {}) is cast up front", t.rank());
            } else {
                let conv =
                    name.strip_suffix(".bias").is_some_and(|m| params.iter().any(|(n, w)| *n == format!("{m}.weight") && w.rank() == 4));
                assert_eq!(chosen.contains(&t.storage_ptr()), conv, "{name}: cast up front exactly when it is a convolution's bias");
                biases += usize::from(conv);
            }
        }
        assert!(biases > 0 && bn > 0, "{biases} convolution biases, {bn} BatchNorm parameters");
    }
}

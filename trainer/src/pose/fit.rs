//! The pose fit loop: Ultralytics' optimisation recipe (training.md §2–§7) inside Lightning's hook
//! order (trainer.md §3–§4), with replay plugins wrapping the step's stages.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use ptl_autograd::stage::{in_stage, StageGuard};
use ptl_autograd::{hash, module, no_grad, DType, Device, Module, Tensor, TensorKind};
use ptl_data::{OpenOptions, PoseDataset, PrefetchPlan, TrainConfig, TrainLoader};
use ptl_heads::{ModelConfig, PoseModel};

use super::clock::StepClock;
use super::config::{PoseTrainConfig, Precision};
use super::images::device_images;
use super::pipeline::TrainPipeline;
use super::probe;
use super::stages;
use super::validate::{validate_with, ValOptions, ValResult};
use super::weights::ModelSource;
use crate::fit::{
    interrupt, save_checkpoint, Callback, Checkpoint, LoopState, LoopView, Manifest, NsSite, PartialEpoch, PluginStack, ResultsCsv, RunDir,
    RunHashes, RunHistory, RunSummary, Site, SiteRunner, Stage, StageInfo, StageProfile, StartupReport, UpdatePart,
};
use crate::loss::{Anchors, BranchOutputs, E2ELoss, LossConfig, TargetBatch};
use crate::optim::{
    auto_iterations, build_optimizer_for_module, clip_grad_norm, nominal_accumulate, resolve, GradScaler, GradScalerConfig, LrLambda,
    LrScheduler, ModelEma, Optimizer, OptimizerConfig, OptimizerName, Warmup,
};
use crate::{Result, TrainerError};

/// Loss item names in the order of the 6-vector (loss.md §5).
pub const LOSS_NAMES: [&str; 6] = ["box_loss", "pose_loss", "kobj_loss", "cls_loss", "l1_loss", "rle_loss"];

/// The live state of one run.
struct Run {
    cfg: PoseTrainConfig,
    model: PoseModel,
    /// The architecture, for the evaluation model built from the EMA weights at each validation
    /// (built then and dropped after, so its 14 MiB — at the n scale — are not held through
    /// training).
    model_cfg: ModelConfig,
    criterion: E2ELoss,
    optimizer: Box<dyn Optimizer>,
    scheduler: LrScheduler,
    lambda: LrLambda,
    warmup: Warmup,
    accumulate: usize,
    ema: ModelEma,
    scaler: Option<GradScaler>,
    plugins: PluginStack,
    callbacks: Vec<Box<dyn Callback>>,
    loader: Arc<TrainLoader>,
    val_ds: Option<Arc<PoseDataset>>,
    nb: usize,
    state: LoopState,
    view: LoopView,
    clock: StepClock,
    /// Per-step stage times (`profile=true`): data, upload, forward, loss, backward, optimizer, EMA
    /// (NaN where a stage did not run).
    stage_ms: Vec<[f64; 7]>,
    /// Wall time of each epoch run by this process.
    epoch_s: Vec<f64>,
    workers: usize,
    pageable_uploads: u64,
    /// The loader's last figures: batches built and mean seconds per batch on its thread.
    loader_build: (u64, f64),
    /// results.csv rows and metrics of every completed epoch (kept in checkpoints).
    history: RunHistory,
    /// The first non-finite loss of the current epoch attempt.
    nonfinite: Option<NonFiniteStep>,
    /// The optimizer as resolved (`auto` → a name, lr0, momentum), stored in checkpoints.
    resolved: serde_json::Value,
    metrics_per_epoch: Vec<Vec<(String, f64)>>,
    optimizer_name: String,
    /// Named parameters, walked once: parameters keep their storage for the whole run.
    params: Vec<(String, Tensor)>,
    /// The parameters autocast ops read, cast once per forward under mixed precision: every one of
    /// rank ≥ 2 (convolution and linear weights) and the biases of convolutions (see
    /// [`compute_weights`]); BatchNorm's rank-1 parameters are read in f32.
    compute_weights: Vec<Tensor>,
    /// Anchor grid of the last input size (training batches share one size).
    anchors: Option<((usize, usize), Anchors)>,
    /// The RLE flow's parameters: what a recorded loss region reads besides its inputs.
    flow_surface: Vec<(String, Tensor, TensorKind)>,
    /// Every parameter and buffer of the model (what a step's forward and loss read, the flow's
    /// included): the surface of a forward-and-loss region.
    model_surface: Vec<(String, Tensor, TensorKind)>,
    /// Loss values of earlier steps on their way to the host (the dense path's deferred items),
    /// oldest first, and how many of this epoch's have arrived.
    pending_losses: std::collections::VecDeque<PendingLoss>,
    absorbed: usize,
    /// With deferred items: a (1,) f32 device flag, 1 once a loss of the current accumulation
    /// window was not finite (the optimizer step is skipped on the device then), and its zero.
    loss_flag: Option<(Tensor, Tensor)>,
}

/// One step's deferred loss values ([`crate::loss::DeferredItems`]) being read.
struct PendingLoss {
    epoch: usize,
    batch: usize,
    step: usize,
    read: ptl_autograd::PendingRead,
}

/// Where a loss first went non-finite.
#[derive(Clone, Copy, Debug)]
struct NonFiniteStep {
    epoch: usize,
    batch: usize,
    step: usize,
    term: &'static str,
    value: f64,
}

fn model_params(m: &PoseModel) -> Vec<(String, Tensor)> {
    module::named_parameters(m)
}

fn float_state(m: &PoseModel) -> Vec<(String, Tensor)> {
    module::state_dict(m).into_iter().map(|(n, t, _)| (n, t)).collect()
}

fn branch(b: &ptl_heads::BranchOutput) -> BranchOutputs {
    BranchOutputs { boxes: b.boxes.clone(), scores: b.scores.clone(), kpts: b.kpts.clone(), kpts_sigma: b.kpts_sigma.clone() }
}

impl Run {
    fn each_cb(&mut self, f: impl Fn(&mut dyn Callback, &LoopView)) {
        let v = self.view.clone();
        for cb in self.callbacks.iter_mut() {
            f(cb.as_mut(), &v);
        }
    }

    fn lrs(&self) -> Vec<f64> {
        self.optimizer.param_groups().iter().map(|g| g.lr).collect()
    }

    /// Stage boundary of the `profile=true` diagnosis: waits for the device and returns the
    /// milliseconds since `t` (then restarts `t`); NaN (and no wait) when profiling is off.
    fn stage_mark(&self, t: &mut Instant) -> Result<f64> {
        if !self.cfg.profile {
            return Ok(f64::NAN);
        }
        probe::sync(self.cfg.device)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        *t = Instant::now();
        Ok(ms)
    }

    /// One batch: warm-up, forward+loss, backward, and (when due) the optimizer step. `pixels` are
    /// the batch's u8 images already on the device; `data_ms` is how long the step waited for them.
    fn train_batch(
        &mut self,
        epoch: usize,
        i: usize,
        batch: &ptl_data::Batch,
        pixels: &Tensor,
        data_ms: f64,
        sums: &mut [f64; 6],
    ) -> Result<()> {
        let ni = i + self.nb * epoch;
        if let Some(acc) = self.warmup.apply(ni, epoch, &self.lambda, self.optimizer.param_groups_mut()) {
            self.accumulate = acc;
        }
        self.view.batch_in_epoch = i;
        self.view.lr = self.lrs();
        self.each_cb(|c, v| c.on_train_batch_start(v));
        let mut t = Instant::now();
        let mut stages = [f64::NAN; 7];
        stages[0] = data_ms;
        let x = in_stage(stages::UPLOAD, || device_images(batch, pixels))?;
        stages[1] = self.stage_mark(&mut t)?;
        let targets = TargetBatch {
            batch_idx: batch.batch_idx.clone(),
            cls: batch.cls.clone(),
            bboxes: batch.bboxes.clone(),
            keypoints: batch.keypoints.clone(),
            nkpt: batch.nkpt,
        };
        let info = |stage| StageInfo { stage, epoch, batch_index: ni, training: true };
        let (h, w) = (batch.shape[2], batch.shape[3]);
        let anchors = match &self.anchors {
            Some((hw, a)) if *hw == (h, w) => a.clone(),
            _ => {
                let a = Anchors::from_image_hw((h, w), &ptl_heads::model::STRIDES)?;
                self.anchors = Some(((h, w), a.clone()));
                a
            }
        };
        // With a plugin that claims them, the forward and the dense criterion run as one body
        // (one recorded region for both); `None`: this step goes through the pieces.
        let mut loss = None;
        let bs = x.dims().first().copied().unwrap_or(0);
        let step_targets = match self.plugins.claims(Site::ForwardLoss) {
            true => self.criterion.dense_step_targets(&targets, bs, &anchors, x.device())?,
            false => None,
        };
        let ran = match step_targets {
            Some(dt) => self.forward_and_loss(&x, &dt, &targets, &anchors, epoch, ni).map(|l| loss = Some(l)),
            None => Ok(()),
        };
        let ran = match (ran, &loss) {
            (Ok(()), None) => self.forward_then_loss(&x, &targets, &anchors, epoch, ni, &mut t, &mut stages).map(|l| loss = Some(l)),
            (ran, _) => ran,
        };
        // Non-finite predictions (diverged weights) stop the loss itself: the batch is
        // skipped — no backward, no step — and the epoch ends in the recovery below.
        if let Err(TrainerError::NonFinite { what, value, .. }) = &ran {
            self.note_nonfinite(NonFiniteStep { epoch, batch: i, step: ni, term: what, value: *value });
            self.state.step_losses.push(f64::NAN);
            self.absorbed += 1;
            return Ok(());
        }
        ran?;
        let loss =
            loss.ok_or_else(|| TrainerError::InvalidArgument { what: "plugin", reason: "the loss stage produced no output".into() })?;
        stages[3] = self.stage_mark(&mut t)?;

        if self.clock.wants_memory_snapshot() {
            let snapshot = self.memory_parts();
            if let Some(m) = probe::memory_at_backward(self.cfg.device, snapshot) {
                self.clock.set_memory_snapshot(m);
            }
        }
        self.each_cb(|c, v| c.on_before_backward(v));
        let to_backprop = match self.scaler.as_mut() {
            Some(s) => s.scale(&loss.total)?,
            None => loss.total.clone(),
        };
        self.plugins.run(info(Stage::Backward), &mut || Ok(in_stage(stages::BACKWARD, || to_backprop.backward())?))?;
        stages[4] = self.stage_mark(&mut t)?;
        self.each_cb(|c, v| c.on_after_backward(v));
        if !self.callbacks.is_empty() {
            let v = self.view.clone();
            for cb in self.callbacks.iter_mut() {
                cb.on_after_backward_params(&v, &self.params);
            }
        }

        match &loss.deferred {
            Some(d) => {
                // No host read: the values travel to the host while later steps run, and the
                // step's non-finite flag joins the window's on the device.
                let (flag, zero) = match self.loss_flag.take() {
                    Some(f) => f,
                    None => (Tensor::zeros(vec![1], DType::F32, self.cfg.device)?, Tensor::zeros(vec![1], DType::F32, self.cfg.device)?),
                };
                no_grad(|| flag.copy_(&flag.maximum(&d.nonfinite)?))?;
                self.loss_flag = Some((flag, zero));
                self.pending_losses.push_back(PendingLoss { epoch, batch: i, step: ni, read: d.values.read_later()? });
                self.absorb_losses(sums, false)?;
            }
            None => {
                let total = loss.total.detach().item()?;
                self.record_loss(NonFiniteStep { epoch, batch: i, step: ni, term: "", value: 0.0 }, total, loss.items, sums);
            }
        }

        if ni as i64 - self.state.last_opt_step >= self.accumulate as i64 {
            self.clock.note_update();
            let mut t = Instant::now();
            let ema_ms = self.optimizer_step(ni, epoch)?;
            stages[5] = self.stage_mark(&mut t)? - ema_ms;
            stages[6] = ema_ms;
            self.state.last_opt_step = ni as i64;
        }
        if self.cfg.profile {
            self.stage_ms.push(stages);
        }
        self.each_cb(|c, v| c.on_train_batch_end(v));
        Ok(())
    }

    /// The model's forward (`Stage::Forward`, the pieces through their claimants) and then the
    /// criterion (`Stage::Loss`, the dense device work through its claimant).
    #[allow(clippy::too_many_arguments)]
    fn forward_then_loss(
        &mut self,
        x: &Tensor,
        targets: &TargetBatch,
        anchors: &Anchors,
        epoch: usize,
        ni: usize,
        t: &mut Instant,
        stages: &mut [f64; 7],
    ) -> Result<crate::loss::LossOutput> {
        let info = |stage| StageInfo { stage, epoch, batch_index: ni, training: true };
        let autocast = self.cfg.precision.autocast();
        let out = {
            let model = &self.model;
            let runner = self.plugins.runner(model);
            // Natively, autocast's weight copies are made once up front in one batched cast; a
            // replay plugin's regions cast inside their graphs instead (see compute_weights).
            let weights: &[Tensor] = if self.plugins.is_empty() { &self.compute_weights } else { &[] };
            self.plugins.run_stage(info(Stage::Forward), || {
                Ok(in_stage(stages::FORWARD, || {
                    ptl_autograd::autocast_with_weights(autocast, weights, || model.forward_with(x, &runner))?
                })?)
            })?
        };
        stages[2] = self.stage_mark(t)?;
        let (criterion, model, plugins, flow_surface) = (&self.criterion, &self.model, &self.plugins, &self.flow_surface);
        self.plugins.run_stage(info(Stage::Loss), || {
            let flow = &model.head().flow_model;
            // The dense criterion's device work is a site: a plugin that claims it records it.
            let route = |inputs: &[Tensor], body: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>| {
                plugins.run_site(Site::Loss, inputs, flow_surface, &mut |_, xs| body(xs))
            };
            in_stage(stages::LOSS, || {
                ptl_autograd::autocast(autocast, || {
                    let (o2m, o2o) = (branch(&out.one2many), branch(&out.one2one));
                    match plugins.claims(Site::Loss) {
                        true => criterion.loss_routed(&o2m, &o2o, targets, anchors, Some(flow), &route),
                        false => criterion.loss(&o2m, &o2o, targets, anchors, Some(flow)),
                    }
                })
            })
        })
    }

    /// The model's forward and the dense criterion as one body handed to the plugin that claims
    /// them (`E2ELoss::loss_with_forward`; recorded as one region). Inside it the pieces run
    /// natively (no region inside a region) and autocast casts the weights where they are used.
    /// Runs under both stages' wrappers, `Stage::Forward`'s around the work; `dt` are the step's
    /// padded targets (`E2ELoss::dense_step_targets`: a step without them goes through the pieces).
    #[allow(clippy::too_many_arguments)]
    fn forward_and_loss(
        &mut self,
        x: &Tensor,
        dt: &crate::loss::assign_dense::DeviceTargets,
        targets: &TargetBatch,
        anchors: &Anchors,
        epoch: usize,
        ni: usize,
    ) -> Result<crate::loss::LossOutput> {
        let info = |stage| StageInfo { stage, epoch, batch_index: ni, training: true };
        let autocast = self.cfg.precision.autocast();
        let (criterion, model, plugins, surface) = (&self.criterion, &self.model, &self.plugins, &self.model_surface);
        let forward = |x: &Tensor| -> Result<(BranchOutputs, BranchOutputs)> {
            let out = in_stage(stages::FORWARD, || {
                ptl_autograd::autocast_with_weights(autocast, &[], || model.forward_with(x, &ptl_heads::NativeRunner))?
            })?;
            Ok((branch(&out.one2many), branch(&out.one2one)))
        };
        let route = |inputs: &[Tensor], body: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>| {
            plugins.run_site(Site::ForwardLoss, inputs, surface, &mut |_, xs| body(xs))
        };
        let loss = self.plugins.run_stage(info(Stage::Forward), || {
            let flow = &model.head().flow_model;
            // One graph holds both: its kernels count for the forward stage (and its backward's
            // for the model's backward) in the GPU window's breakdown.
            in_stage(stages::FORWARD, || {
                ptl_autograd::autocast(autocast, || criterion.loss_with_forward(x, dt, &forward, targets, anchors, Some(flow), &route))
            })
        })?;
        self.plugins.run_stage(info(Stage::Loss), || Ok(()))?;
        Ok(loss)
    }

    /// Books one step's loss: the per-step total (hashed), the epoch's item sums, the running means
    /// for the progress bar, and a non-finite note naming the step and the term.
    fn record_loss(&mut self, at: NonFiniteStep, total: f64, items: [f64; 6], sums: &mut [f64; 6]) {
        let named = LOSS_NAMES.iter().zip(items).find(|(_, v)| !v.is_finite());
        if let Some((term, value)) = named.map(|(n, v)| (*n, v)).or((!total.is_finite()).then_some(("total loss", total))) {
            self.note_nonfinite(NonFiniteStep { term, value, ..at });
        }
        self.state.step_losses.push(total);
        for (s, v) in sums.iter_mut().zip(items) {
            *s += v;
        }
        self.absorbed += 1;
        self.view.mean_items = sums.iter().map(|s| s / self.absorbed as f64).collect();
    }

    /// Ends the fit for `signal` after batch `at.1 - 1` of epoch `at.0`: the step's losses are
    /// booked, and a checkpoint holding the place inside the epoch replaces `last_ckpt` — unless
    /// the epoch saw a non-finite loss (a resume then repeats it from the last checkpoint, as the
    /// recovery would).
    fn stop_for_signal(
        &mut self,
        signal: i32,
        at: (usize, usize),
        sums: &mut [f64; 6],
        train_args: &serde_json::Value,
        last_ckpt: &Path,
        fit_time_s: f64,
    ) -> Result<()> {
        let (epoch, next_batch) = at;
        self.absorb_losses(sums, true)?;
        interrupt::clear();
        let name = interrupt::signal_name(signal);
        if self.nonfinite.is_some() {
            let kept = last_ckpt.exists().then(|| last_ckpt.to_path_buf());
            eprintln!("ptl: {name} received: epoch {epoch} had a non-finite loss, so its place is not kept; a resume repeats it");
            return Err(TrainerError::Interrupted { signal, checkpoint: kept });
        }
        self.state.partial_epoch = Some(PartialEpoch { epoch, next_batch, loss_sums: *sums, absorbed: self.absorbed });
        self.history.fit_time_s = fit_time_s;
        let ck = self.checkpoint(train_args);
        self.state.partial_epoch = None;
        save_checkpoint(last_ckpt, &ck?)?;
        eprintln!(
            "ptl: {name} received: stopped in epoch {epoch} after batch {next_batch}/{}; checkpoint {}",
            self.nb,
            last_ckpt.display()
        );
        Err(TrainerError::Interrupted { signal, checkpoint: Some(last_ckpt.to_path_buf()) })
    }

    /// Books the deferred losses that have reached the host, oldest first (all of them, waiting
    /// where needed, when `drain`: at the end of an epoch).
    fn absorb_losses(&mut self, sums: &mut [f64; 6], drain: bool) -> Result<()> {
        while let Some(mut p) = self.pending_losses.pop_front() {
            let values = match p.read.poll()? {
                Some(v) => v,
                None if drain => p.read.wait()?,
                None => {
                    self.pending_losses.push_front(p);
                    break;
                }
            };
            let (total, items) = match values.get(crate::loss::DeferredItems::TOTAL) {
                Some(&t) => (f64::from(t), crate::loss::branch::items_of(&values[crate::loss::DeferredItems::ITEMS])),
                None => {
                    return Err(TrainerError::InvalidArgument {
                        what: "deferred loss",
                        reason: format!("{} values, expected 13", values.len()),
                    })
                }
            };
            self.record_loss(NonFiniteStep { epoch: p.epoch, batch: p.batch, step: p.step, term: "", value: 0.0 }, total, items, sums);
        }
        Ok(())
    }

    /// The persistent state's bytes by owner (for the memory snapshot at backward).
    fn memory_parts(&self) -> Vec<(String, u64)> {
        let sd = module::state_dict(&self.model);
        let params = probe::tensor_bytes(sd.iter().filter(|e| e.2 == TensorKind::Parameter).map(|e| &e.1));
        let buffers = probe::tensor_bytes(sd.iter().filter(|e| e.2 != TensorKind::Parameter).map(|e| &e.1));
        let grads: Vec<Tensor> = self.params.iter().filter_map(|(_, p)| p.grad()).collect();
        let opt: Vec<(String, Tensor)> = self.optimizer.state_tensors();
        vec![
            ("parameters".into(), params),
            ("buffers".into(), buffers),
            ("gradients (accumulated)".into(), probe::tensor_bytes(grads.iter())),
            ("optimizer state".into(), probe::tensor_bytes(opt.iter().map(|e| &e.1))),
            ("EMA shadow".into(), probe::tensor_bytes(self.ema.ema_tensors().iter().map(|e| &e.1))),
        ]
    }

    /// Unscale → hook → clip → step (skipped on inf under 16-mixed) → scaler update → zero grad → EMA.
    /// Returns the EMA update's milliseconds under `profile=true` (device synchronised around it), else 0.
    fn optimizer_step(&mut self, ni: usize, epoch: usize) -> Result<f64> {
        let info = StageInfo { stage: Stage::OptimizerStep, epoch, batch_index: ni, training: true };
        let params = &self.params;
        let max_norm = self.cfg.clip_max_norm;
        let (optimizer, scaler, ema, model) = (&mut self.optimizer, &mut self.scaler, &mut self.ema, &self.model);
        // Deferred losses: a non-finite one in this window skips the update on the device.
        let loss_flag = self.loss_flag.as_ref().map(|(f, _)| f.clone());
        let callbacks = &mut self.callbacks;
        let view = self.view.clone();
        let (profile, device) = (self.cfg.profile, self.cfg.device);
        let mut ema_ms = 0.0;
        let plugins = &self.plugins;
        plugins.run(info, &mut || {
            let _stage = StageGuard::new(stages::OPTIMIZER);
            // A step is handed to a replay plugin only when its device part reads every changing
            // scalar from the device and decides a 16-mixed skip there (SGD, MuSGD; not AdamW).
            let capturable = optimizer.is_capturable();
            // A device part is a site (`Site::Update`); its body gets the runner of the sites
            // nested in it (the Newton–Schulz of MuSGD's step).
            let run_update = |part: UpdatePart, body: &mut dyn FnMut(&dyn SiteRunner) -> Result<()>| -> Result<()> {
                match capturable {
                    true => plugins.run_site(Site::Update(part), &[], &[], &mut |inner, _| body(inner).map(|()| Vec::new())).map(|_| ()),
                    false => body(plugins),
                }
            };
            // 16-mixed: the host part of the unscale (order of calls), then its device part —
            // every present gradient × 1/scale and the found-inf flag.
            if let Some(s) = scaler.as_mut() {
                if s.begin_unscale()? {
                    let grads: Vec<Tensor> =
                        optimizer.param_groups().iter().flat_map(|g| &g.params).filter_map(|p| p.tensor.grad()).collect();
                    let s: &GradScaler = s;
                    run_update(UpdatePart::Unscale, &mut |_| s.unscale_grads(&grads))?;
                }
            }
            for cb in callbacks.iter_mut() {
                cb.on_before_optimizer_step(&view);
            }
            // The host part (the step's scalars to the device), then the device part — clipping,
            // the update (skipped on the device after an inf/NaN under 16-mixed) and the scaler's
            // growth/backoff — which a plugin may record and replay.
            optimizer.prepare_step()?;
            let found_inf = match scaler.as_mut().filter(|s| s.is_enabled()) {
                Some(s) => Some(s.begin_step()?),
                None => None,
            };
            {
                let s: Option<&GradScaler> = scaler.as_ref().filter(|s| s.is_enabled());
                run_update(UpdatePart::Step, &mut |inner| {
                    let ns = NsSite(inner);
                    clip_grad_norm(params.iter().map(|(_, t)| t), max_norm)?;
                    match (&found_inf, s) {
                        (Some(found), Some(s)) => {
                            optimizer.step_prepared_unless(found, &ns)?;
                            s.update_scale()
                        }
                        _ => match &loss_flag {
                            Some(flag) => optimizer.step_prepared_unless(flag, &ns),
                            None => optimizer.step_prepared(&ns),
                        },
                    }
                })?;
            }
            if let Some(s) = scaler.as_mut().filter(|s| s.is_enabled()) {
                s.end_update()?;
            }
            for cb in callbacks.iter_mut() {
                cb.on_before_zero_grad(&view);
            }
            optimizer.zero_grad();
            if profile {
                probe::sync(device)?;
            }
            let t = Instant::now();
            in_stage(stages::EMA, || -> Result<()> {
                // Host part (count, weight to the device), then the device part through a plugin.
                let sd: Vec<(String, Tensor)> = module::state_dict(model).into_iter().map(|e| (e.0, e.1)).collect();
                ema.prepare_update()?;
                plugins
                    .run_site(Site::Update(UpdatePart::Ema), &[], &[], &mut |_, _| ema.update_prepared(&sd).map(|()| Vec::new()))
                    .map(|_| ())
            })?;
            if profile {
                probe::sync(device)?;
                ema_ms = t.elapsed().as_secs_f64() * 1e3;
            }
            Ok(())
        })?;
        if let Some((flag, zero)) = &self.loss_flag {
            flag.copy_(zero)?;
        }
        self.state.global_step += 1;
        self.view.global_step = self.state.global_step;
        Ok(ema_ms)
    }

    /// Keeps the first non-finite step of an epoch attempt and says so once.
    fn note_nonfinite(&mut self, nf: NonFiniteStep) {
        if self.nonfinite.is_none() {
            eprintln!(
                "ptl: warning: {} is {} at epoch {}, batch {} (step {}); likely cause: {}",
                nf.term,
                nf.value,
                nf.epoch,
                nf.batch,
                nf.step,
                self.nonfinite_hint()
            );
            self.nonfinite = Some(nf);
        }
    }

    /// The setting most likely behind a non-finite loss.
    fn nonfinite_hint(&self) -> String {
        let c = &self.cfg;
        if c.precision == Precision::F16Mixed {
            "fp16 overflow: the GradScaler skips such steps; if it persists train with --precision bf16-mixed or a lower lr0".into()
        } else if c.lr0 > 0.05 {
            format!("lr0 = {} is high for this optimizer; try lr0=0.01 or lower", c.lr0)
        } else {
            format!("diverging weights or bad labels: lower lr0 (now {}) or check the dataset's warnings", c.lr0)
        }
    }

    /// An evaluation model (eval mode) holding the EMA weights; the live model's integer buffers.
    fn ema_eval_model(&self) -> Result<PoseModel> {
        let mut m = PoseModel::new(self.model_cfg, self.cfg.device, self.cfg.seed)?;
        m.set_training(false);
        self.sync_ema_model(&m)?;
        Ok(m)
    }

    /// Copies the EMA weights into `eval_model` (in place).
    fn sync_ema_model(&self, eval_model: &PoseModel) -> Result<()> {
        let values: HashMap<String, Tensor> = self.ema.ema_tensors().iter().cloned().collect();
        let entries = module::state_dict(eval_model);
        no_grad(|| -> Result<()> {
            for (name, t, kind) in entries {
                if let Some(v) = values.get(&name) {
                    t.copy_(&v.to_dtype(t.dtype())?)?;
                } else if kind == TensorKind::Buffer {
                    // Integer buffers (num_batches_tracked) are not averaged: copy from the live model.
                    if let Some((_, live, _)) = module::state_dict(&self.model).into_iter().find(|(n, _, _)| *n == name) {
                        t.copy_(&live)?;
                    }
                }
            }
            Ok(())
        })
    }

    fn checkpoint(&self, train_args: &serde_json::Value) -> Result<Checkpoint> {
        let mut tensors: Vec<(String, Tensor)> = float_state(&self.model).into_iter().map(|(n, t)| (format!("model.{n}"), t)).collect();
        tensors.extend(self.ema.ema_tensors().iter().map(|(n, t)| (format!("ema.{n}"), t.clone())));
        tensors.extend(self.optimizer.state_tensors().into_iter().map(|(n, t)| (format!("optim.{n}"), t)));
        // Gradients accumulated since the last optimizer step carry over epochs (training.md §2):
        // keep them so a resumed run continues with exactly the same sums.
        for (n, p) in model_params(&self.model) {
            if let Some(g) = p.grad() {
                tensors.push((format!("grad.{n}"), g));
            }
        }
        let scaler = match &self.scaler {
            Some(s) => serde_json::to_value(s.state()?).unwrap_or(serde_json::Value::Null),
            None => serde_json::Value::Null,
        };
        let optimizer = serde_json::json!({
            "meta": serde_json::to_value(self.optimizer.state_meta()).unwrap_or(serde_json::Value::Null),
            "scheduler": serde_json::to_value(&self.scheduler).unwrap_or(serde_json::Value::Null),
            "accumulate": self.accumulate,
            "resolved": self.resolved,
        });
        Ok(Checkpoint {
            manifest: Manifest {
                format: crate::fit::checkpoint::CHECKPOINT_FORMAT,
                ptl_version: env!("CARGO_PKG_VERSION").into(),
                loop_state: self.state.clone(),
                train_args: train_args.clone(),
                optimizer,
                scaler,
                ema: serde_json::to_value(self.ema.meta()).unwrap_or(serde_json::Value::Null),
                criterion: serde_json::json!({ "updates": self.criterion.updates }),
                callbacks: self.callbacks.iter().map(|c| (c.state_key(), c.state())).collect(),
                plugins: self.plugins.states(),
                recordings: "none".into(),
                history: self.history.clone(),
            },
            tensors,
        })
    }

    /// Restores the run from a checkpoint. `ema_into_model`: the live model takes the EMA weights
    /// (training.md §9's recovery from a non-finite loss) instead of its own.
    fn restore(&mut self, path: &Path, ema_into_model: bool) -> Result<()> {
        let ck = crate::fit::load_checkpoint(path, self.cfg.device)?;
        let bad = |msg: String| TrainerError::Checkpoint { path: path.to_path_buf(), msg };
        let stored = &ck.manifest.optimizer["resolved"];
        if !stored.is_null() && *stored != self.resolved {
            return Err(bad(format!("the optimizer resolves to {} now but the run used {stored}", self.resolved)));
        }
        let model_part = if ema_into_model { "ema" } else { "model" };
        self.model.load_state_dict(&ck.part(model_part), !ema_into_model).map_err(|e| bad(e.to_string()))?;
        let ema_meta = serde_json::from_value(ck.manifest.ema.clone()).map_err(|e| bad(format!("EMA state: {e}")))?;
        self.ema.load(&ema_meta, &ck.part("ema"))?;
        self.optimizer.load_state_tensors(&ck.part("optim"))?;
        let meta = serde_json::from_value(ck.manifest.optimizer["meta"].clone()).map_err(|e| bad(format!("optimizer state: {e}")))?;
        self.optimizer.load_state_meta(&meta)?;
        self.scheduler =
            serde_json::from_value(ck.manifest.optimizer["scheduler"].clone()).map_err(|e| bad(format!("scheduler state: {e}")))?;
        if let Some(acc) = ck.manifest.optimizer["accumulate"].as_u64() {
            self.accumulate = acc as usize;
        }
        if let Some(s) = self.scaler.as_mut() {
            let st: Option<crate::optim::scaler::ScalerState> =
                serde_json::from_value(ck.manifest.scaler.clone()).map_err(|e| bad(format!("scaler state: {e}")))?;
            s.load_state(st.as_ref())?;
        }
        if let Some(u) = ck.manifest.criterion["updates"].as_u64() {
            self.criterion.set_updates(u as usize);
        }
        let grads = ck.part("grad");
        for (n, p) in model_params(&self.model) {
            p.set_grad(match grads.get(&n) {
                Some(g) => Some(g.deep_copy()?),
                None => None,
            });
        }
        self.state = ck.manifest.loop_state.clone();
        self.history = ck.manifest.history.clone();
        self.plugins.load_states(&ck.manifest.plugins)?;
        Ok(())
    }

    fn hashes(&self) -> Result<RunHashes> {
        let model = float_state(&self.model);
        let opt = self.optimizer.state_tensors();
        let ema = self.ema.ema_tensors();
        let losses: Vec<u8> = self.state.step_losses.iter().flat_map(|l| l.to_le_bytes()).collect();
        Ok(RunHashes {
            model: hash::named_tensors_hash(model.iter().map(|(n, t)| (n.as_str(), t)))?,
            optimizer: {
                let meta = serde_json::to_string(&self.optimizer.state_meta()).unwrap_or_default();
                let t = hash::named_tensors_hash(opt.iter().map(|(n, t)| (n.as_str(), t)))?;
                hash::bytes_hash(format!("{t}{meta}").as_bytes())
            },
            scheduler: hash::bytes_hash(serde_json::to_string(&self.scheduler).unwrap_or_default().as_bytes()),
            ema: hash::named_tensors_hash(ema.iter().map(|(n, t)| (n.as_str(), t)))?,
            step_losses: hash::bytes_hash(&losses),
        })
    }
}

/// Trains a pose model as `cfg` says, calling `callbacks` at the hook points; returns the summary
/// (also written to `save_dir/summary.json`).
pub fn fit(cfg: &PoseTrainConfig, callbacks: Vec<Box<dyn Callback>>) -> Result<RunSummary> {
    cfg.validate()?;
    let started = Instant::now();
    let mut cfg = cfg.clone();
    cfg.resolve_amp();
    if let Some(path) = &cfg.resume {
        cfg.check_resume(path)?;
    }
    // The run folder is this process's until the fit returns (see `RunDir`). A resume continues
    // in the checkpoint's own run folder, or starts a new one where the user said.
    let own_folder = cfg.resume.as_deref().and_then(PoseTrainConfig::run_dir_of).is_some_and(|d| d == cfg.save_dir);
    let run_dir = match own_folder || cfg.exist_ok {
        true => RunDir::claim_existing(&cfg.save_dir)?,
        false => RunDir::claim_new(&cfg.save_dir)?,
    };
    if run_dir.path() != cfg.save_dir {
        eprintln!(
            "ptl: {} already holds a run; writing to {} (exist_ok=true trains into the existing folder)",
            cfg.save_dir.display(),
            run_dir.path().display()
        );
        cfg.save_dir = run_dir.path().to_path_buf();
    }
    let cfg = &cfg;
    let mut startup = StartupReport { process_to_fit_s: probe::process_age_s(), ..StartupReport::default() };
    let t = Instant::now();
    probe::open_device(cfg.device)?;
    startup.device_open_s = t.elapsed().as_secs_f64();
    crate::pose::reset_memory_peaks(cfg.device);
    let t = Instant::now();
    let open = OpenOptions { imgsz: cfg.imgsz as u32, verbose: true, ..OpenOptions::default() };
    let train_ds = Arc::new(PoseDataset::open_yaml(&cfg.data, "train", &OpenOptions { fraction: cfg.fraction, ..open.clone() })?);
    let val_ds = if cfg.val { Some(Arc::new(PoseDataset::open_yaml(&cfg.data, "val", &open)?)) } else { None };
    startup.dataset_open_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let batches = train_ds.len().div_ceil(cfg.batch.min(train_ds.len()).max(1));
    let batches = cfg.max_batches.map_or(batches, |m| m.min(batches));
    let workers = cfg.effective_workers(batches);
    let mut tcfg = TrainConfig {
        batch: cfg.batch,
        seed: cfg.seed,
        epochs: cfg.epochs,
        close_mosaic: cfg.close_mosaic,
        workers,
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

    let nkpt = train_ds.nkpt();
    let source = ModelSource::parse(&cfg.model)?;
    // A resumed run's size is its checkpoint's (the start weights file may be gone by now).
    let scale = match &cfg.resume {
        Some(path) => super::weights::scale_in_file(path, "model.")?,
        None => source.scale()?,
    };
    let mcfg = ModelConfig { nc: 1, kpt_shape: (nkpt, 3), scale };
    let model = PoseModel::new(mcfg, cfg.device, cfg.seed)?;
    if cfg.resume.is_none() {
        if let (Some(values), Some(path)) = (source.start_weights()?, source.weights_path()) {
            super::weights::load_start_weights(&model, &values, path)?;
        }
    }
    freeze_layers(&model, &cfg.freeze)?;

    // Optimiser per training.md §2–§3: nominal accumulation, wd scaling, `auto` rule.
    let accumulate_nominal = nominal_accumulate(cfg.nbs, cfg.batch)?.min(nb * cfg.epochs).max(1);
    let ocfg = OptimizerConfig {
        name: OptimizerName::parse(&cfg.optimizer)?,
        lr0: cfg.lr0,
        momentum: cfg.momentum,
        weight_decay: cfg.weight_decay,
        nbs: cfg.nbs,
        batch: cfg.batch,
        iterations: auto_iterations(train_ds.len(), cfg.batch, cfg.nbs, cfg.epochs),
        nc: Some(1),
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
    // `auto`: the fixed-shape path on a GPU (fewer host syncs and launches: faster there), the
    // host path on the CPU (cheaper there, and the reference's own algorithm).
    let dense = match cfg.loss_assigner.as_str() {
        "dense" => true,
        "auto" => cfg.device.is_cuda(),
        _ => false,
    };
    let g = cfg.loss_gains;
    let loss_cfg = LossConfig {
        dense_assignment: dense,
        box_gain: g.box_gain,
        cls_gain: g.cls,
        l1_gain: g.dfl,
        pose_gain: g.pose,
        kobj_gain: g.kobj,
        rle_gain: g.rle,
        ..LossConfig::with_keypoints(nkpt, train_ds.meta.custom_oks_sigmas().map(<[f32]>::to_vec))
    };
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
        nb,
        state: LoopState { epoch: -1, last_opt_step: -1, ..LoopState::default() },
        view: LoopView { epochs: cfg.epochs, batches_per_epoch: nb, ..LoopView::default() },
        clock: StepClock::new(cfg.device, cfg.timing_warmup_steps, Err("not started".into())),
        stage_ms: Vec::new(),
        epoch_s: Vec::new(),
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
        compute_weights: Vec::new(),
        anchors: None,
        flow_surface: Vec::new(),
        model_surface: Vec::new(),
        pending_losses: Default::default(),
        absorbed: 0,
        loss_flag: None,
    };
    run.params = model_params(&run.model);
    run.compute_weights = compute_weights(&run.params);
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
    if let Err(e) = &result {
        let msg = e.to_string();
        let v = run.view.clone();
        for cb in run.callbacks.iter_mut() {
            cb.on_exception(&v, &msg);
        }
        return Err(result.err().unwrap_or(TrainerError::InvalidArgument { what: "fit", reason: msg }));
    }
    let hashes = run.hashes()?;
    let (peak_allocated_bytes, peak_reserved_bytes) = crate::pose::memory_peaks(cfg.device);
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
        library_workspace_bytes: crate::pose::library_workspace_bytes(cfg.device),
        optimizer_steps: run.state.global_step,
        save_dir: cfg.save_dir.clone(),
        fit_time_s: run.history.fit_time_s,
        final_metrics: run.metrics_per_epoch.last().cloned().unwrap_or_default(),
        metrics_per_epoch: run.metrics_per_epoch.clone(),
        hashes,
        plugins: plugin_lines,
        replay_counters,
        replay_cadence,
        // Both branches fall back together; each counts the call once.
        dense_loss_fallbacks: run.criterion.one2many.dense_fallbacks() as u64,
    };
    summary.write(&cfg.save_dir.join("summary.json"))?;
    Ok(summary)
}

fn fit_loop(run: &mut Run, train_args: &serde_json::Value) -> Result<()> {
    let cfg = run.cfg.clone();
    if let Some(path) = &cfg.resume {
        run.restore(path, false)?;
    }
    let start_epoch = (run.state.epoch + 1) as usize;
    if cfg.resume.is_some() && start_epoch >= cfg.epochs {
        eprintln!("ptl: the run in {} already finished its {} epochs: nothing to resume", cfg.save_dir.display(), cfg.epochs);
    }
    run.view.epoch = start_epoch;
    run.each_cb(|c, v| c.setup(v));
    {
        let ctx = crate::fit::PluginSetup {
            model: &run.model,
            params: &run.params,
            optimizer: run.optimizer.as_ref(),
            ema: &run.ema,
            device: run.cfg.device,
            settings: train_args,
        };
        run.plugins.setup(&ctx)?;
        if !run.plugins.is_empty() {
            eprintln!("ptl: replay plugins: {}", run.plugins.names().join(", "));
        }
    }
    // Persistent gradients when a plugin needs them at fixed addresses (dropped at the fit's end).
    let persistent = run.plugins.wants_persistent_gradients();
    for (_, p) in &run.params {
        p.set_keep_grad_buffer(persistent);
    }
    run.each_cb(|c, v| c.on_fit_start(v));
    run.each_cb(|c, v| c.on_train_start(v));
    let columns: Vec<String> = ["epoch", "time"]
        .iter()
        .map(|s| s.to_string())
        .chain(LOSS_NAMES.iter().map(|n| format!("train/{n}")))
        .chain(ValResult::metric_names().iter().map(|s| s.to_string()))
        .chain(LOSS_NAMES.iter().map(|n| format!("val/{n}")))
        .chain((0..run.optimizer.param_groups().len()).map(|i| format!("lr/pg{i}")))
        .collect();
    if run.history.columns.is_empty() {
        run.history.columns = columns.clone();
    }
    // The CSV always matches the last checkpoint: a resume rewrites it from the checkpoint's rows
    // (a kill between the two writes can neither duplicate nor lose an epoch).
    let csv = ResultsCsv::new(&cfg.save_dir.join("results.csv"));
    if cfg.resume.is_some() {
        csv.write(&run.history.columns, &run.history.rows)?;
    }
    run.metrics_per_epoch =
        run.history.metrics.iter().map(|m| m.iter().map(|(k, v)| (k.clone(), v.unwrap_or(f64::NAN))).collect()).collect();
    let fit_time_before = run.history.fit_time_s;
    // The last validation's PR curves, drawn at the end when `plots` is on.
    let mut last_pr_curves = Vec::new();
    let last_ckpt = cfg.save_dir.join("weights").join("last.ckpt");
    let mut attempts = 0usize;
    // save_json: every validation rewrites the COCO files, so the last one's stay (however the run ends).
    // The criterion on validation batches too: results.csv's `val/` losses.
    let val_opts = ValOptions {
        save_json: cfg.save_json.then(|| cfg.save_dir.clone()),
        loss: Some(run.criterion.one2one.cfg.clone()),
        ..ValOptions::default()
    };
    let mut coco_json = None;
    let last_epoch = cfg.stop_after_epochs.map_or(cfg.epochs, |n| (start_epoch + n).min(cfg.epochs)).max(start_epoch + 1) - 1;
    let device = cfg.device;
    let gpu_plan = StepClock::plan_gpu_window(cfg.gpu_time, device, cfg.timing_warmup_steps, start_epoch, last_epoch, run.nb);
    run.clock = StepClock::new(device, cfg.timing_warmup_steps, gpu_plan);
    let image_bytes = run.loader.batch_size() * 3 * cfg.imgsz * cfg.imgsz;
    let start_batch = run.state.partial_epoch.as_ref().filter(|p| p.epoch == start_epoch).map_or(0, |p| p.next_batch);
    let plan = PrefetchPlan { start_epoch, batches_per_epoch: Some(run.nb), start_batch };
    let mut pipeline = TrainPipeline::start(&run.loader, plan, device, image_bytes)?;
    let fit_start = Instant::now();
    let mut epoch = start_epoch;
    while epoch < cfg.epochs {
        let epoch_start = Instant::now();
        // Scheduler first (epoch e uses lf(e)); the criterion weights follow the epoch count.
        run.scheduler = LrScheduler::new(run.lambda, epoch);
        run.scheduler.step(run.optimizer.param_groups_mut());
        run.criterion.set_updates(epoch);
        run.view.epoch = epoch;
        run.model.set_training(true);
        run.each_cb(|c, v| c.on_train_epoch_start(v));
        let mut sums = [0f64; 6];
        run.absorbed = 0;
        run.view.mean_items.clear(); // until this epoch's first loss arrives
                                     // An epoch a signal interrupted continues from its place (the pipeline starts there too).
        let first_batch = match run.state.partial_epoch.take().filter(|p| p.epoch == epoch) {
            Some(p) => {
                (sums, run.absorbed) = (p.loss_sums, p.absorbed);
                p.next_batch
            }
            None => 0,
        };
        let bar = super::progress::EpochBar::new(cfg.progress, epoch, cfg.epochs, run.nb);
        for i in first_batch..run.nb {
            run.clock.begin_step(epoch, i, run.nb)?;
            let (batch, pixels, waited) = pipeline.next()?.ok_or_else(|| TrainerError::InvalidArgument {
                what: "loader",
                reason: format!("the batch pipeline ended before epoch {epoch} batch {i}"),
            })?;
            if (batch.epoch, batch.index) != (epoch, i) {
                return Err(TrainerError::InvalidArgument {
                    what: "loader",
                    reason: format!("expected epoch {epoch} batch {i}, the pipeline delivered epoch {} batch {}", batch.epoch, batch.index),
                });
            }
            run.clock.data_wait(waited);
            run.train_batch(epoch, i, &batch, &pixels, waited.as_secs_f64() * 1e3, &mut sums)?;
            run.clock.end_step();
            bar.update(i, &run.view.mean_items, run.view.lr.first().copied().unwrap_or(0.0));
            // A signal during the epoch's last batch lets the epoch end (checked below).
            if let Some(signal) = interrupt::requested().filter(|_| i + 1 < run.nb) {
                bar.finish();
                let fit_time = fit_time_before + fit_start.elapsed().as_secs_f64();
                return run.stop_for_signal(signal, (epoch, i + 1), &mut sums, train_args, &last_ckpt, fit_time);
            }
        }
        run.absorb_losses(&mut sums, true)?;
        bar.finish();
        let stats = pipeline.stats();
        (run.workers, run.pageable_uploads) = (stats.workers, stats.pageable_uploads);
        run.loader_build = (stats.batches_built, stats.build_s_per_batch);
        if let Some(nf) = run.nonfinite.take() {
            // training.md §9: reload the last checkpoint (its EMA weights into the model), reset the
            // optimizer-step counter and run the epoch again; after 3 attempts, stop. Without a
            // checkpoint to go back to (the first epoch) Ultralytics only warns and trains on with
            // broken weights; we stop at once with the same message.
            // `last.ckpt` of this run exists once an epoch has completed (or a signal stopped one).
            let can_reload = last_ckpt.exists();
            attempts += 1;
            if !can_reload || attempts > 3 {
                return Err(TrainerError::NonFiniteLoss {
                    epoch: nf.epoch,
                    batch: nf.batch,
                    step: nf.step,
                    term: nf.term,
                    value: nf.value,
                    attempts: attempts - 1,
                    hint: run.nonfinite_hint(),
                });
            }
            eprintln!(
                "ptl: non-finite loss in epoch {epoch}: reloading {} and running the epoch again ({attempts}/3)",
                last_ckpt.display()
            );
            drop(pipeline);
            run.restore(&last_ckpt, true)?;
            run.state.last_opt_step = -1;
            // A non-finite loss of the abandoned attempt must not skip the rerun's first update.
            if let Some((flag, zero)) = &run.loss_flag {
                flag.copy_(zero)?;
            }
            run.clock.break_sequence();
            let start_batch = run.state.partial_epoch.as_ref().filter(|p| p.epoch == epoch).map_or(0, |p| p.next_batch);
            let plan = PrefetchPlan { start_epoch: epoch, batches_per_epoch: Some(run.nb), start_batch };
            pipeline = TrainPipeline::start(&run.loader, plan, device, image_bytes)?;
            continue;
        } else {
            attempts = 0;
        }
        let lrs = run.lrs();
        // Validation on the EMA model.
        let val = if let Some(ds) = run.val_ds.clone() {
            run.plugins.on_validation_start()?;
            run.each_cb(|c, v| c.on_validation_start(v));
            run.each_cb(|c, v| c.on_validation_epoch_start(v));
            let r = validate_with(&run.ema_eval_model()?, &ds, cfg.batch * 2, cfg.device, cfg.precision, &val_opts)?;
            coco_json = r.coco_json.clone().or(coco_json);
            run.view.metrics = r.metrics.clone();
            run.each_cb(|c, v| c.on_validation_epoch_end(v));
            run.each_cb(|c, v| c.on_validation_end(v));
            Some(r)
        } else {
            None
        };
        run.state.epoch = epoch as i64;
        let fitness = val.as_ref().map(|v| v.fitness);
        let mut stop_early = false;
        if let Some(f) = fitness {
            if run.state.best_fitness.is_none_or(|b| f > b) {
                run.state.best_fitness = Some(f);
            }
            stop_early = run.state.stopper.update(epoch + 1, f, cfg.patience);
        }
        let fit_time = fit_time_before + fit_start.elapsed().as_secs_f64();
        let mut values = vec![epoch as f64 + 1.0, fit_time];
        values.extend(sums.iter().map(|s| s / run.nb as f64));
        values.extend(val.as_ref().map(|v| v.metric_values()).unwrap_or_else(|| vec![f64::NAN; ValResult::metric_names().len()]));
        values.extend(val.as_ref().and_then(|v| v.losses).unwrap_or([f64::NAN; 6]));
        values.extend(lrs);
        // By name: a run resumed from a checkpoint written before a column existed keeps its
        // own header (and rows) and only drops the new column's values.
        let row: Vec<f64> = run
            .history
            .columns
            .iter()
            .map(|c| columns.iter().position(|n| n == c).map_or(f64::NAN, |i| values.get(i).copied().unwrap_or(f64::NAN)))
            .collect();
        if let Some(v) = &val {
            last_pr_curves.clone_from(&v.pr_curves);
        }
        let metrics = val.map(|v| v.metrics).unwrap_or_default();
        run.history.rows.push(ResultsCsv::format_row(&row));
        run.history.metrics.push(metrics.iter().map(|(k, v)| (k.clone(), v.is_finite().then_some(*v))).collect());
        run.history.fit_time_s = fit_time;
        run.metrics_per_epoch.push(metrics);
        // Checkpoint first, then the CSV derived from it.
        let ck = run.checkpoint(train_args)?;
        save_checkpoint(&last_ckpt, &ck)?;
        if fitness.is_some() && fitness == run.state.best_fitness {
            save_checkpoint(&cfg.save_dir.join("weights").join("best.ckpt"), &ck)?;
        }
        if cfg.save_period > 0 && epoch as i64 % cfg.save_period == 0 {
            save_checkpoint(&cfg.save_dir.join("weights").join(format!("epoch{epoch}.ckpt")), &ck)?;
        }
        csv.write(&run.history.columns, &run.history.rows)?;
        run.each_cb(|c, v| c.on_save_checkpoint(v));
        run.each_cb(|c, v| c.on_train_epoch_end(v));
        run.epoch_s.push(epoch_start.elapsed().as_secs_f64());
        if let Some(signal) = interrupt::requested().filter(|_| epoch + 1 < cfg.epochs) {
            interrupt::clear();
            eprintln!("ptl: {} received: stopped after epoch {epoch}; checkpoint {}", interrupt::signal_name(signal), last_ckpt.display());
            return Err(TrainerError::Interrupted { signal, checkpoint: Some(last_ckpt.clone()) });
        }
        if stop_early && epoch + 1 < cfg.epochs {
            eprintln!(
                "ptl: stopping early: no better fitness in the last {} epochs (best {:.5} at epoch {}); patience={} sets this (0 = never)",
                cfg.patience, run.state.stopper.best_fitness, run.state.stopper.best_epoch, cfg.patience
            );
            break;
        }
        if cfg.stop_after_epochs.is_some_and(|n| epoch + 1 - start_epoch >= n) && epoch + 1 < cfg.epochs {
            return Ok(());
        }
        epoch += 1;
    }
    if let Some(j) = &coco_json {
        eprintln!(
            "ptl: COCO JSON of the final validation: {} ({} detections), ground truth {} ({} annotations)",
            j.predictions.display(),
            j.detections,
            j.ground_truth.display(),
            j.annotations
        );
    }
    if cfg.plots {
        let csv = cfg.save_dir.join("results.csv");
        if csv.exists() {
            super::plots::plot_results(&csv, &cfg.save_dir.join("results.png"))?;
        }
        for c in &last_pr_curves {
            super::plots::plot_pr_curve(c, &cfg.save_dir)?;
        }
        if let Some(ds) = run.val_ds.clone() {
            super::validate::draw_val_predictions(&run.ema_eval_model()?, &ds, 4, cfg.device, &cfg.save_dir)?;
        }
    }
    run.each_cb(|c, v| c.on_train_end(v));
    run.each_cb(|c, v| c.on_fit_end(v));
    run.each_cb(|c, v| c.teardown(v));
    Ok(())
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
    eprintln!("ptl: freeze: {frozen} parameters of layers {layers:?} are frozen");
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

//! One training step: forward and loss through their sites, backward, and (when due) the
//! optimizer update's device parts through theirs.

use std::time::Instant;

use ptl_autograd::internal::stage::{in_stage, StageGuard};
use ptl_autograd::{module, no_grad, DType, Tensor};

use super::super::images::device_images;
use super::super::probe;
use super::super::stages;
use crate::distributed::OverlappedSums;
use crate::fit::{NsSite, Site, SiteRunner, Stage, StageInfo, UpdatePart};
use crate::loss::{Anchors, BranchOutputs, TargetBatch};
use crate::optim::{clip_grad_norm, GradScaler};
use crate::{Result, TrainerError};

use super::run::*;
use super::LOSS_NAMES;

impl Run {
    /// Several ranks, the host decisions before an update, in one collective
    /// ([`DataParallel::agree_on_update`]): which gradients are present (the same on every rank), a
    /// non-finite loss of this window on any rank skips the update on every rank, and rank 0's
    /// BatchNorm statistics replace the others' before the EMA reads them (as
    /// [`Run::buffers_from_rank_0`]). The gradients' sum over the ranks follows in
    /// [`Run::optimizer_step`].
    fn agree_over_ranks(&mut self) -> Result<()> {
        let Some(dp) = self.dp.as_mut() else { return Ok(()) };
        let flag = self.loss_flag.as_ref().map(|(f, _)| f);
        let here = match flag {
            Some(f) => f.to_vec::<f32>()?.iter().any(|v| *v != 0.0),
            None => false,
        };
        // One collective for the three decisions.
        let buffers: &[Tensor] = if dp.world() > 1 { &self.float_buffers } else { &[] };
        // After sums started during backward, the agreement comes with their end.
        let anywhere = match self.overlapped.take() {
            Some(sums) => sums.finish(dp, &self.params, here, buffers)?,
            None => dp.agree_on_update(&self.params, here, buffers)?,
        };
        if let Some(f) = flag.filter(|_| anywhere && !here) {
            no_grad(|| f.copy_(&Tensor::from_vec(vec![1f32], vec![1], f.device())?))?;
        }
        Ok(())
    }

    /// Whether the ranks may sum gradients during backward: not when a rank has callbacks (one
    /// may read or change the gradients after backward, which the sums must then see). Agreed
    /// once per fit, at the first update that could overlap (one max all-reduce), so every rank
    /// decides alike.
    fn overlap_agreed(&mut self) -> Result<bool> {
        let Some(dp) = self.dp.as_ref().filter(|dp| dp.world() > 1) else { return Ok(false) };
        if let Some(v) = self.overlap_allowed {
            return Ok(v);
        }
        let allowed = !dp.any(!self.callbacks.is_empty())?;
        self.overlap_allowed = Some(allowed);
        Ok(allowed)
    }

    /// On the dense path of a data-parallel fit, the ranks agree on the step's objects per image
    /// (the largest count any rank's batch has; one max all-reduce every step, whichever path the
    /// step then takes) and pad their targets to that count's bucket: every rank records and
    /// replays the same step shape — a new bucket is a warm-up on every rank at once — and a batch
    /// beyond the largest bucket anywhere sends every rank to the host path.
    fn agree_on_targets(&mut self, targets: &TargetBatch, bs: usize) -> Result<()> {
        let Some(dp) = self.dp.as_mut().filter(|dp| dp.world() > 1) else { return Ok(()) };
        if !self.criterion.is_dense() {
            return Ok(());
        }
        let mut counts = vec![0usize; bs];
        for &b in &targets.batch_idx {
            if let Some(c) = counts.get_mut(b as usize) {
                *c += 1;
            }
        }
        let agreed = dp.agree_max_boxes(counts.into_iter().max().unwrap_or(0))?;
        self.criterion.set_agreed_max_boxes(agreed);
        Ok(())
    }

    /// One batch: warm-up, forward+loss, backward, and (when due) the optimizer step. `pixels` are
    /// the batch's u8 images already on the device; `data_ms` is how long the step waited for them.
    pub(super) fn train_batch(
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
        self.agree_on_targets(&targets, batch.shape[0])?;
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
        if let Some(dt) = &step_targets {
            self.prepare_planned_step(&x, dt, &targets, &anchors)?;
        }
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
        // Several ranks: the loss × the world size, as Ultralytics does, so the gradients
        // averaged over the ranks are the sum of theirs (a global batch's gradient).
        let total = match self.dp.as_ref().map(|dp| dp.world()).filter(|&w| w > 1) {
            Some(world) => loss.total.mul_scalar(world as f64)?,
            None => loss.total.clone(),
        };
        let to_backprop = match self.scaler.as_mut() {
            Some(s) => s.scale(&total)?,
            None => total,
        };
        // Several ranks, no replay, the update's last backward: its gradient buckets are summed
        // over the ranks as backward finishes them (`overlap_all_reduce`).
        let updates = ni as i64 - self.state.last_opt_step >= self.accumulate as i64;
        let overlap = updates && self.cfg.overlap_all_reduce && self.plugins.is_empty() && self.overlap_agreed()?;
        match self.dp.as_mut().filter(|dp| overlap && dp.world() > 1) {
            Some(dp) => {
                let mut sums = OverlappedSums::new(dp, &self.params)?;
                let seed = to_backprop.ones_like()?;
                let dp = &*dp;
                self.plugins.run(info(Stage::Backward), &mut || {
                    Ok(in_stage(stages::BACKWARD, || to_backprop.backward_with_ready(&seed, &mut sums.ready_hook(dp)))?)
                })?;
                self.overlapped = Some(sums);
            }
            None => self.plugins.run(info(Stage::Backward), &mut || Ok(in_stage(stages::BACKWARD, || to_backprop.backward())?))?,
        }
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

        if updates {
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
    pub(super) fn forward_then_loss(
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
    /// natively (no region inside a region) and the weights are cast in one batch inside it.
    /// Runs under both stages' wrappers, `Stage::Forward`'s around the work; `dt` are the step's
    /// padded targets (`E2ELoss::dense_step_targets`: a step without them goes through the pieces).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_and_loss(
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
        let forward = step_forward(model, &self.compute_weights, autocast);
        let route = |inputs: &[Tensor], body: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>| {
            plugins.run_site(Site::ForwardLoss, inputs, surface, &mut |_, xs| body(xs))
        };
        let loss = self.plugins.run_stage(info(Stage::Forward), || {
            let flow = &model.head().flow_model;
            // One graph holds both: its kernels count for the forward stage (and its backward's
            // for the model's backward) in the GPU window's breakdown.
            in_stage(stages::FORWARD, || {
                let step = crate::loss::StepBody { x, targets: dt, forward: &forward, batch: targets, anchors, flow: Some(flow) };
                ptl_autograd::autocast(autocast, || criterion.loss_with_forward(&step, &route))
            })
        })?;
        self.plugins.run_stage(info(Stage::Loss), || Ok(()))?;
        Ok(loss)
    }

    /// Before the step plugin's first recording: has it record, without running, a step whose
    /// targets are padded to the largest bucket the data can give ([`super::bucket_plan`]), so
    /// the arenas its buckets share are laid out for the largest first. Nothing of it runs.
    fn prepare_planned_step(
        &mut self,
        x: &Tensor,
        dt: &crate::loss::assign_dense::DeviceTargets,
        targets: &TargetBatch,
        anchors: &Anchors,
    ) -> Result<()> {
        let Some(objects) = self.bucket_plan.due(&self.plugins, dt.slots) else { return Ok(()) };
        let bs = x.dims().first().copied().unwrap_or(0);
        let Some(planned) = crate::loss::branch::padded_targets_on(targets, bs, anchors, x.device(), objects)? else { return Ok(()) };
        let autocast = self.cfg.precision.autocast();
        let (criterion, model, plugins, surface) = (&self.criterion, &self.model, &self.plugins, &self.model_surface);
        let forward = step_forward(model, &self.compute_weights, autocast);
        let prepare = |inputs: &[Tensor], body: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>| {
            let call = crate::fit::SiteCall { site: Site::ForwardLoss, inputs, surface, model: None };
            plugins.prepare_call(call, &mut |_, xs| body(xs))
        };
        let flow = &model.head().flow_model;
        let made = in_stage(stages::FORWARD, || {
            ptl_autograd::autocast(autocast, || {
                let step = crate::loss::StepBody { x, targets: &planned, forward: &forward, batch: targets, anchors, flow: Some(flow) };
                criterion.prepare_with_forward(&step, &prepare)
            })
        })?;
        if made {
            self.bucket_plan.prepared(planned.slots);
        }
        Ok(())
    }

    /// Books one step's loss: the per-step total (hashed), the epoch's item sums, the running means
    /// for the progress bar, and a non-finite note naming the step and the term.
    pub(super) fn record_loss(&mut self, at: NonFiniteStep, total: f64, items: [f64; 6], sums: &mut [f64; 6]) {
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

    /// Books the deferred losses that have reached the host, oldest first (all of them, waiting
    /// where needed, when `drain`: at the end of an epoch).
    pub(super) fn absorb_losses(&mut self, sums: &mut [f64; 6], drain: bool) -> Result<()> {
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

    /// Unscale → hook → clip → step (skipped on inf under 16-mixed) → scaler update → zero grad → EMA.
    /// Returns the EMA update's milliseconds under `profile=true` (device synchronised around it), else 0.
    pub(super) fn optimizer_step(&mut self, ni: usize, epoch: usize) -> Result<f64> {
        let summed = self.overlapped.is_some();
        self.agree_over_ranks()?;
        let info = StageInfo { stage: Stage::OptimizerStep, epoch, batch_index: ni, training: true };
        let params = &self.params;
        // Several ranks: the gradients become their average over the ranks (the same bytes on
        // every rank, so every rank's update is the same) before the unscale (a 16-mixed
        // found-inf is then the same everywhere) — inside the update's first device part when
        // the transport's sum can be recorded there (NCCL; the CPU's recordings re-run their
        // bodies), else here.
        // Sums started during backward are already averaged (`agree_over_ranks` finished them).
        let dp = self.dp.as_ref().filter(|_| !summed);
        let sum_in_update = dp.is_some_and(|d| d.sums_in_regions(self.cfg.device));
        if let (Some(d), false) = (dp, sum_in_update) {
            d.sum_gradients(params)?;
        }
        let sum_over_ranks = || match (dp, sum_in_update) {
            (Some(d), true) => d.sum_gradients(params),
            _ => Ok(()),
        };
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
            let mut summed = false;
            if let Some(s) = scaler.as_mut() {
                if s.begin_unscale()? {
                    let grads: Vec<Tensor> =
                        optimizer.param_groups().iter().flat_map(|g| &g.params).filter_map(|p| p.tensor.grad()).collect();
                    let s: &GradScaler = s;
                    run_update(UpdatePart::Unscale, &mut |_| {
                        sum_over_ranks()?;
                        s.unscale_grads(&grads)
                    })?;
                    summed = true;
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
                    if !summed {
                        sum_over_ranks()?;
                    }
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
}

/// The model's forward as a step body runs it: autocast with the weights' batched cast inside
/// (so a recording holds it as one kernel, and one for the gradients), both branches' raw outputs.
fn step_forward<'a>(
    model: &'a ptl_heads::PoseModel,
    weights: &'a [Tensor],
    autocast: Option<DType>,
) -> impl Fn(&Tensor) -> Result<(BranchOutputs, BranchOutputs)> + 'a {
    move |x: &Tensor| {
        let out = in_stage(stages::FORWARD, || {
            ptl_autograd::autocast_with_weights(autocast, weights, || model.forward_with(x, &ptl_heads::NativeRunner))?
        })?;
        Ok((branch(&out.one2many), branch(&out.one2one)))
    }
}

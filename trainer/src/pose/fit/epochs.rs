//! The epoch loop: batches, the non-finite recovery, validation, results, checkpoints, early
//! stopping and signals.

use std::path::Path;
use std::time::Instant;

use ptl_autograd::Module;
use ptl_data::PrefetchPlan;

use super::super::clock::StepClock;
use super::super::pipeline::TrainPipeline;
use super::super::validate::{validate_with, ValOptions, ValResult};
use super::run_ahead::RunAhead;
use crate::fit::checkpoint::LAST_WEIGHTS;
use crate::fit::{interrupt, save_checkpoint, PartialEpoch, ResultsCsv};
use crate::optim::LrScheduler;
use crate::{Result, TrainerError};

use super::run::*;
use super::{epoch_line, LOSS_NAMES};

/// How often (in batches) the ranks of a data-parallel group agree on whether a signal asked
/// them to stop: each agreement is a collective that waits for the device.
const SIGNAL_CHECK_EVERY: usize = 8;

pub(super) fn fit_loop(run: &mut Run, train_args: &serde_json::Value) -> Result<()> {
    let cfg = run.cfg.clone();
    if let Some(path) = &cfg.resume {
        run.restore(path, false)?;
    }
    let start_epoch = (run.state.epoch + 1) as usize;
    if cfg.resume.is_some() && start_epoch >= cfg.epochs {
        log::info!("ptl: the run in {} already finished its {} epochs: nothing to resume", cfg.save_dir.display(), cfg.epochs);
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
            ranks: run.dp.as_ref().map_or(1, |dp| dp.world()),
        };
        run.plugins.setup(&ctx)?;
        if !run.plugins.is_empty() {
            log::info!("ptl: replay plugins: {}", run.plugins.names().join(", "));
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
    if cfg.resume.is_some() && run.is_main() {
        csv.write(&run.history.columns, &run.history.rows)?;
    }
    run.metrics_per_epoch =
        run.history.metrics.iter().map(|m| m.iter().map(|(k, v)| (k.clone(), v.unwrap_or(f64::NAN))).collect()).collect();
    let fit_time_before = run.history.fit_time_s;
    // The last validation's PR curves, drawn at the end when `plots` is on.
    let mut last_pr_curves = Vec::new();
    let mut last_confusion = None;
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
        if cfg.progress {
            log::info!("{}", epoch_line::train_header());
        }
        let mut last_instances = 0;
        let bar = super::super::progress::EpochBar::new(cfg.progress, epoch, cfg.epochs, run.nb);
        let mut ahead = RunAhead::new(cfg.device);
        for i in first_batch..run.nb {
            ahead.wait_turn()?;
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
            // Ultralytics' train_batch0..2.jpg: the first batches as the model receives them (on
            // a GPU before the device's HSV jitter), with their labels.
            if cfg.plots && epoch == 0 && i < 3 {
                let host = pixels.to_vec::<u8>()?;
                let labelled = crate::pose::plots::LabelledBatch {
                    pixels: &host,
                    shape: batch.shape,
                    batch_idx: &batch.batch_idx,
                    bboxes: &batch.bboxes,
                    keypoints: &batch.keypoints,
                    nkpt: batch.nkpt,
                    scores: None,
                    classes: None,
                };
                crate::pose::plots::plot_train_batch(&labelled, &cfg.save_dir, i)?;
            }
            last_instances = batch.batch_idx.len();
            run.train_batch(epoch, i, &batch, &pixels, waited.as_secs_f64() * 1e3, &mut sums)?;
            run.clock.end_step();
            ahead.step_queued()?;
            bar.update(i, &run.view.mean_items, run.view.lr.first().copied().unwrap_or(0.0));
            // A signal during the epoch's last batch lets the epoch end (checked below). Ranks of a
            // group decide together every SIGNAL_CHECK_EVERY batches (a collective each time),
            // and at the epoch's end.
            let signal = match run.dp.is_some() {
                false => interrupt::requested(),
                true if (i + 1) % SIGNAL_CHECK_EVERY == 0 => run.signal_on_any_rank()?,
                true => None,
            };
            if let Some(signal) = signal.filter(|_| i + 1 < run.nb) {
                bar.finish();
                let fit_time = fit_time_before + fit_start.elapsed().as_secs_f64();
                return run.stop_for_signal(signal, (epoch, i + 1), &mut sums, train_args, &last_ckpt, fit_time);
            }
        }
        run.absorb_losses(&mut sums, true)?;
        run.buffers_from_rank_0()?;
        bar.finish();
        let stats = pipeline.stats();
        (run.workers, run.pageable_uploads) = (stats.workers, stats.pageable_uploads);
        run.loader_build = (stats.batches_built, stats.build_s_per_batch);
        // Ranks recover together: a non-finite loss on any rank sends every rank back.
        let nonfinite = run.nonfinite.take();
        let elsewhere = NonFiniteStep { epoch, batch: 0, step: 0, term: "the loss of another rank", value: f64::NAN };
        if let Some(nf) = run.on_any_rank(nonfinite.is_some())?.then(|| nonfinite.unwrap_or(elsewhere)) {
            // docs/training.md §9: reload the last checkpoint (its EMA weights into the model), reset the
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
            log::warn!(
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
            let r = ptl_autograd::internal::stage::in_stage(crate::pose::stages::VALIDATION, || {
                validate_with(&run.ema_eval_model()?, &ds, cfg.batch * 2, cfg.device, cfg.precision, &val_opts)
            })?;
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
        let stop_early = run.as_rank_0_says(stop_early)?;
        let fit_time = fit_time_before + fit_start.elapsed().as_secs_f64();
        if cfg.progress {
            let losses: Vec<f64> = sums.iter().map(|s| s / run.nb as f64).collect();
            let secs = epoch_start.elapsed().as_secs_f64();
            let reserved = crate::pose::memory_reserved(cfg.device);
            log::info!("{}", epoch_line::train_row(epoch, cfg.epochs, reserved, &losses, last_instances, cfg.imgsz, secs));
            if let (Some(v), Some(ds)) = (&val, &run.val_ds) {
                for row in epoch_line::val_rows(v.images, ds.report.instances, &v.metric_values()) {
                    log::info!("{row}");
                }
                // Per class after the last epoch, as Ultralytics' final validation.
                if v.per_class.len() > 1 && (epoch + 1 == cfg.epochs || stop_early) {
                    for c in &v.per_class {
                        log::info!("{}", epoch_line::class_row(&c.name, c.images, c.instances, &c.metrics));
                    }
                }
            }
        }
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
            last_confusion = Some(v.confusion.clone());
        }
        let metrics = val.map(|v| v.metrics).unwrap_or_default();
        run.history.rows.push(ResultsCsv::format_row(&row));
        run.history.metrics.push(metrics.iter().map(|(k, v)| (k.clone(), v.is_finite().then_some(*v))).collect());
        run.history.fit_time_s = fit_time;
        run.metrics_per_epoch.push(metrics);
        if run.is_main() {
            // Checkpoint first, then the CSV derived from it.
            let ck = run.checkpoint(train_args)?;
            save_checkpoint(&last_ckpt, &ck)?;
            // What Ultralytics ships as last.pt and best.pt: the EMA model in half precision and the
            // settings (last.ckpt stays the full, resumable checkpoint).
            let lean = Run::weights_only(&ck)?;
            save_checkpoint(&cfg.save_dir.join("weights").join(LAST_WEIGHTS), &lean)?;
            if fitness.is_some() && fitness == run.state.best_fitness {
                save_checkpoint(&cfg.save_dir.join("weights").join("best.ckpt"), &lean)?;
            }
            if cfg.save_period > 0 && epoch as i64 % cfg.save_period == 0 {
                save_checkpoint(&cfg.save_dir.join("weights").join(format!("epoch{epoch}.ckpt")), &ck)?;
            }
            csv.write(&run.history.columns, &run.history.rows)?;
            run.each_cb(|c, v| c.on_save_checkpoint(v));
        }
        run.each_cb(|c, v| c.on_train_epoch_end(v));
        run.epoch_s.push(epoch_start.elapsed().as_secs_f64());
        if let (Some(peak_allocated_bytes), Some(peak_reserved_bytes)) = crate::pose::memory_peaks(cfg.device) {
            run.memory_per_epoch.push(crate::fit::EpochMemory {
                epoch,
                peak_allocated_bytes,
                peak_reserved_bytes,
                reserved_bytes: crate::pose::memory_reserved(cfg.device),
                recordings: crate::fit::EpochMemory::recordings_in(&run.plugins.counters()),
            });
        }
        // Every rank stops at this epoch's end once any rank has a signal.
        if let Some(signal) = run.signal_on_any_rank()?.filter(|_| epoch + 1 < cfg.epochs) {
            interrupt::clear();
            log::warn!("ptl: {} received: stopped after epoch {epoch}; checkpoint {}", interrupt::signal_name(signal), last_ckpt.display());
            return Err(TrainerError::Interrupted { signal, checkpoint: Some(last_ckpt.clone()) });
        }
        if stop_early && epoch + 1 < cfg.epochs {
            log::info!(
                "ptl: stopping early: no better fitness in the last {} epochs (best {:.5} at epoch {}); patience={} sets this (0 = never)",
                cfg.patience,
                run.state.stopper.best_fitness,
                run.state.stopper.best_epoch,
                cfg.patience
            );
            break;
        }
        if cfg.stop_after_epochs.is_some_and(|n| epoch + 1 - start_epoch >= n) && epoch + 1 < cfg.epochs {
            return Ok(());
        }
        epoch += 1;
    }
    if let Some(j) = &coco_json {
        log::info!(
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
            super::super::plots::plot_results(&csv, &cfg.save_dir.join("results.png"))?;
        }
        for c in &last_pr_curves {
            super::super::plots::plot_pr_curve(c, &cfg.save_dir)?;
            super::super::plots::plot_conf_curves(c, &cfg.save_dir)?;
        }
        if let (Some(cm), Some(ds)) = (&last_confusion, &run.val_ds) {
            super::super::plots::plot_confusion_matrix(cm, &ds.meta.names, &cfg.save_dir)?;
        }
        if let Some(ds) = run.val_ds.clone() {
            let model = run.ema_eval_model()?;
            super::super::validate::draw_val_predictions(&model, &ds, 4, cfg.device, &cfg.save_dir)?;
            super::super::validate::draw_val_batch(&model, &ds, cfg.device, &cfg.save_dir)?;
        }
    }
    run.each_cb(|c, v| c.on_train_end(v));
    run.each_cb(|c, v| c.on_fit_end(v));
    run.each_cb(|c, v| c.teardown(v));
    Ok(())
}

impl Run {
    /// Ends the fit for `signal` after batch `at.1 - 1` of epoch `at.0`: the step's losses are
    /// booked, and a checkpoint holding the place inside the epoch replaces `last_ckpt` — unless
    /// the epoch saw a non-finite loss (a resume then repeats it from the last checkpoint, as the
    /// recovery would).
    pub(super) fn stop_for_signal(
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
        // Ranks of a group keep the place only if none of them saw a non-finite loss.
        if self.on_any_rank(self.nonfinite.is_some())? {
            let kept = last_ckpt.exists().then(|| last_ckpt.to_path_buf());
            log::warn!("ptl: {name} received: epoch {epoch} had a non-finite loss, so its place is not kept; a resume repeats it");
            return Err(TrainerError::Interrupted { signal, checkpoint: kept });
        }
        self.state.partial_epoch = Some(PartialEpoch { epoch, next_batch, loss_sums: *sums, absorbed: self.absorbed });
        self.history.fit_time_s = fit_time_s;
        if self.is_main() {
            let ck = self.checkpoint(train_args);
            self.state.partial_epoch = None;
            save_checkpoint(last_ckpt, &ck?)?;
        }
        log::warn!(
            "ptl: {name} received: stopped in epoch {epoch} after batch {next_batch}/{}; checkpoint {}",
            self.nb,
            last_ckpt.display()
        );
        Err(TrainerError::Interrupted { signal, checkpoint: Some(last_ckpt.to_path_buf()) })
    }
}

//! The live state of one run, and what every part of the fit reads of it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use ptl_autograd::{module, no_grad, Module, Tensor, TensorKind};
use ptl_data::{PoseDataset, TrainLoader};
use ptl_heads::{ModelConfig, PoseModel};

use super::super::clock::StepClock;
use super::super::config::{PoseTrainConfig, Precision};
use super::super::probe;
use crate::distributed::DataParallel;
use crate::fit::{Callback, LoopState, LoopView, PluginStack, RunHistory};
use crate::loss::{Anchors, BranchOutputs, E2ELoss};
use crate::optim::{GradScaler, LrLambda, LrScheduler, ModelEma, Optimizer, Warmup};
use crate::Result;

/// The live state of one run.
pub(super) struct Run {
    // ---- what is trained and how ----
    pub(super) cfg: PoseTrainConfig,
    pub(super) model: PoseModel,
    /// The architecture, for the evaluation model built from the EMA weights at each validation
    /// (built then and dropped after, so its 14 MiB — at the n scale — are not held through
    /// training).
    pub(super) model_cfg: ModelConfig,
    /// Named parameters, walked once: parameters keep their storage for the whole run.
    pub(super) params: Vec<(String, Tensor)>,
    /// The model's floating-point buffers (BatchNorm's running statistics): what rank 0 hands
    /// the other ranks of a data-parallel group before each update and at each epoch's end.
    pub(super) float_buffers: Vec<Tensor>,
    /// The parameters autocast ops read, cast once per forward under mixed precision: every one of
    /// rank ≥ 2 (convolution and linear weights) and the biases of convolutions (see
    /// [`compute_weights`]); BatchNorm's rank-1 parameters are read in f32.
    pub(super) compute_weights: Vec<Tensor>,
    /// Anchor grid of the last input size (training batches share one size).
    pub(super) anchors: Option<((usize, usize), Anchors)>,
    /// The RLE flow's parameters: what a recorded loss region reads besides its inputs.
    pub(super) flow_surface: Vec<(String, Tensor, TensorKind)>,
    /// Every parameter and buffer of the model (what a step's forward and loss read, the flow's
    /// included): the surface of a forward-and-loss region.
    pub(super) model_surface: Vec<(String, Tensor, TensorKind)>,
    pub(super) criterion: E2ELoss,
    pub(super) optimizer: Box<dyn Optimizer>,
    pub(super) optimizer_name: String,
    /// The optimizer as resolved (`auto` → a name, lr0, momentum), stored in checkpoints.
    pub(super) resolved: serde_json::Value,
    pub(super) scheduler: LrScheduler,
    pub(super) lambda: LrLambda,
    pub(super) warmup: Warmup,
    pub(super) accumulate: usize,
    pub(super) ema: ModelEma,
    pub(super) scaler: Option<GradScaler>,
    // ---- what extends the loop ----
    pub(super) plugins: PluginStack,
    pub(super) callbacks: Vec<Box<dyn Callback>>,
    // ---- where the batches come from ----
    pub(super) loader: Arc<TrainLoader>,
    pub(super) val_ds: Option<Arc<PoseDataset>>,
    /// Class names by id (the training data's), stored in checkpoints.
    pub(super) names: Vec<String>,
    pub(super) nb: usize,
    pub(super) workers: usize,
    pub(super) pageable_uploads: u64,
    /// The loader's last figures: batches built and mean seconds per batch on its thread.
    pub(super) loader_build: (u64, f64),
    // ---- where the run stands, and its results ----
    pub(super) state: LoopState,
    pub(super) view: LoopView,
    /// results.csv rows and metrics of every completed epoch (kept in checkpoints).
    pub(super) history: RunHistory,
    pub(super) metrics_per_epoch: Vec<Vec<(String, f64)>>,
    /// The first non-finite loss of the current epoch attempt.
    pub(super) nonfinite: Option<NonFiniteStep>,
    /// Loss values of earlier steps on their way to the host (the dense path's deferred items),
    /// oldest first, and how many of this epoch's have arrived.
    pub(super) pending_losses: std::collections::VecDeque<PendingLoss>,
    pub(super) absorbed: usize,
    /// With deferred items: a (1,) f32 device flag, 1 once a loss of the current accumulation
    /// window was not finite (the optimizer step is skipped on the device then), and its zero.
    pub(super) loss_flag: Option<(Tensor, Tensor)>,
    // ---- timing ----
    pub(super) clock: StepClock,
    /// Per-step stage times (`profile=true`): data, upload, forward, loss, backward, optimizer, EMA
    /// (NaN where a stage did not run).
    pub(super) stage_ms: Vec<[f64; 7]>,
    /// Wall time of each epoch run by this process.
    pub(super) epoch_s: Vec<f64>,
    /// Device memory at the end of each epoch run by this process (CUDA only).
    pub(super) memory_per_epoch: Vec<crate::fit::EpochMemory>,
    // ---- data-parallel training ----
    /// This process's rank of a data-parallel group; `None`: the only one.
    pub(super) dp: Option<DataParallel>,
    /// The gradient sums the update's last backward started (`overlap_all_reduce`), finished
    /// when the ranks agree on the update.
    pub(super) overlapped: Option<crate::distributed::OverlappedSums>,
    /// Whether the ranks agreed to sum during backward (none has callbacks); `None`: not asked yet.
    pub(super) overlap_allowed: Option<bool>,
    // ---- replay ----
    /// The target bucket the first recorded step is padded to (the data's largest).
    pub(super) bucket_plan: super::bucket_plan::BucketPlan,
}

/// One step's deferred loss values ([`crate::loss::DeferredItems`]) being read.
pub(super) struct PendingLoss {
    pub(super) epoch: usize,
    pub(super) batch: usize,
    pub(super) step: usize,
    pub(super) read: ptl_autograd::PendingRead,
}

/// Where a loss first went non-finite.
#[derive(Clone, Copy, Debug)]
pub(super) struct NonFiniteStep {
    pub(super) epoch: usize,
    pub(super) batch: usize,
    pub(super) step: usize,
    pub(super) term: &'static str,
    pub(super) value: f64,
}

pub(super) fn model_params(m: &PoseModel) -> Vec<(String, Tensor)> {
    module::named_parameters(m)
}

pub(super) fn float_state(m: &PoseModel) -> Vec<(String, Tensor)> {
    module::state_dict(m).into_iter().map(|(n, t, _)| (n, t)).collect()
}

pub(super) fn branch(b: &ptl_heads::BranchOutput) -> BranchOutputs {
    BranchOutputs { boxes: b.boxes.clone(), scores: b.scores.clone(), kpts: b.kpts.clone(), kpts_sigma: b.kpts_sigma.clone() }
}

impl Run {
    /// Whether this process writes and prints: the only one, or rank 0 of a group.
    pub(super) fn is_main(&self) -> bool {
        self.dp.as_ref().is_none_or(DataParallel::is_main)
    }

    /// Whether `flag` holds on any rank (alone: `flag`).
    pub(super) fn on_any_rank(&self, flag: bool) -> Result<bool> {
        match &self.dp {
            Some(dp) => dp.any(flag),
            None => Ok(flag),
        }
    }

    /// Several ranks: rank 0's BatchNorm running statistics on every rank, bit for bit (PyTorch
    /// DDP's `broadcast_buffers`: each rank's batches move its own statistics, rank 0's are the
    /// run's). Done before each update (the EMA reads them) and at each epoch's end, rather than
    /// after every step: only rank 0's statistics reach any output, and a collective waits for
    /// the device.
    pub(super) fn buffers_from_rank_0(&self) -> Result<()> {
        match self.dp.as_ref().filter(|dp| dp.world() > 1) {
            Some(dp) => dp.buffers_from_main(&self.float_buffers),
            None => Ok(()),
        }
    }

    /// The signal that asked this process to stop, agreed over the ranks: a signal on any rank
    /// stops every rank (each reports its own signal, or SIGTERM's when it came to another).
    pub(super) fn signal_on_any_rank(&self) -> Result<Option<i32>> {
        let own = crate::fit::interrupt::requested();
        Ok(self.on_any_rank(own.is_some())?.then(|| own.unwrap_or(crate::fit::interrupt::SIGTERM)))
    }

    /// Rank 0's `flag` on every rank (alone: `flag`): the decisions that follow its validation.
    pub(super) fn as_rank_0_says(&self, flag: bool) -> Result<bool> {
        match &self.dp {
            Some(dp) => Ok(dp.from_main(flag as u64)? != 0),
            None => Ok(flag),
        }
    }

    pub(super) fn each_cb(&mut self, f: impl Fn(&mut dyn Callback, &LoopView)) {
        let v = self.view.clone();
        for cb in self.callbacks.iter_mut() {
            f(cb.as_mut(), &v);
        }
    }

    pub(super) fn lrs(&self) -> Vec<f64> {
        self.optimizer.param_groups().iter().map(|g| g.lr).collect()
    }

    /// Stage boundary of the `profile=true` diagnosis: waits for the device and returns the
    /// milliseconds since `t` (then restarts `t`); NaN (and no wait) when profiling is off.
    pub(super) fn stage_mark(&self, t: &mut Instant) -> Result<f64> {
        if !self.cfg.profile {
            return Ok(f64::NAN);
        }
        probe::sync(self.cfg.device)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        *t = Instant::now();
        Ok(ms)
    }

    /// Keeps the first non-finite step of an epoch attempt and says so once.
    pub(super) fn note_nonfinite(&mut self, nf: NonFiniteStep) {
        if self.nonfinite.is_none() {
            log::warn!(
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
    pub(super) fn nonfinite_hint(&self) -> String {
        let c = &self.cfg;
        if c.precision == Precision::F16Mixed {
            "fp16 overflow: the GradScaler skips such steps; if it persists train with --precision bf16-mixed or a lower lr0".into()
        } else if c.lr0 > 0.05 {
            format!("lr0 = {} is high for this optimizer; try lr0=0.01 or lower", c.lr0)
        } else {
            format!("diverging weights or bad labels: lower lr0 (now {}) or check the dataset's warnings", c.lr0)
        }
    }

    /// The persistent state's bytes by owner (for the memory snapshot at backward).
    pub(super) fn memory_parts(&self) -> Vec<(String, u64)> {
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

    /// An evaluation model (eval mode) holding the EMA weights; the live model's integer buffers.
    pub(super) fn ema_eval_model(&self) -> Result<PoseModel> {
        let mut m = PoseModel::new(self.model_cfg, self.cfg.device, self.cfg.seed)?;
        m.set_activation_format(super::activation_format(&self.cfg));
        m.set_training(false);
        self.sync_ema_model(&m)?;
        Ok(m)
    }

    /// Copies the EMA weights into `eval_model` (in place).
    pub(super) fn sync_ema_model(&self, eval_model: &PoseModel) -> Result<()> {
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
}

//! Warm-up (per batch: lr, momentum, accumulate; docs/training.md §4) and the per-epoch LR lambda
//! (linear or cosine; §5). Both write `lr` / `momentum` into the optimizer's groups.

use serde::{Deserialize, Serialize};

use super::groups::{round_half_even, ParamGroup, ParamKind};
use crate::error::{Result, TrainerError};

/// NumPy `interp(x, [0, x1], [y0, y1])` for `x ≥ 0`: `y1` exactly at/after `x1`, otherwise
/// `slope·x + y0` with `slope = (y1 − y0) / x1`.
pub fn interp(x: f64, x1: f64, y0: f64, y1: f64) -> f64 {
    if x >= x1 {
        return y1;
    }
    if x <= 0.0 {
        return y0;
    }
    let slope = (y1 - y0) / x1;
    slope * x + y0
}

/// `nw`: `round(min(warmup_epochs, max(epochs − 1, 0)) · nb)` (half to even), 0 when that is ≤ 0.
pub fn warmup_iterations(warmup_epochs: f64, epochs: usize, nb: usize) -> usize {
    let w = warmup_epochs.min((epochs as f64 - 1.0).max(0.0));
    if w > 0.0 {
        round_half_even(w * nb as f64) as usize
    } else {
        0
    }
}

/// The per-epoch LR factor `lf(e)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum LrLambda {
    /// `max(1 − e/E, 0)·(1 − lrf) + lrf`.
    Linear {
        /// Final learning rate fraction.
        lrf: f64,
        /// Epochs of the run.
        epochs: usize,
    },
    /// Ultralytics `one_cycle(1, lrf, E)`: `max((1 − cos(π e / E)) / 2, 0)·(lrf − 1) + 1`.
    Cosine {
        /// Final learning rate fraction.
        lrf: f64,
        /// Epochs of the run.
        epochs: usize,
    },
}

impl LrLambda {
    /// Linear, or cosine when `cos_lr`, to `lrf` over `epochs`.
    pub fn new(cos_lr: bool, lrf: f64, epochs: usize) -> Self {
        if cos_lr {
            LrLambda::Cosine { lrf, epochs }
        } else {
            LrLambda::Linear { lrf, epochs }
        }
    }
    /// lf(epoch).
    pub fn factor(&self, epoch: f64) -> f64 {
        match *self {
            LrLambda::Linear { lrf, epochs } => (1.0 - epoch / epochs as f64).max(0.0) * (1.0 - lrf) + lrf,
            LrLambda::Cosine { lrf, epochs } => {
                ((1.0 - (epoch * std::f64::consts::PI / epochs as f64).cos()) / 2.0).max(0.0) * (lrf - 1.0) + 1.0
            }
        }
    }
}

/// `LambdaLR` stepped once at the start of every epoch: group lr = `initial_lr · lf(epoch)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrScheduler {
    /// The schedule's factor.
    pub lambda: LrLambda,
    /// The epoch whose factor is applied (−1 before the first `step`).
    pub last_epoch: i64,
}

impl LrScheduler {
    /// A scheduler whose next `step` applies `lf(start_epoch)` (resume sets `start_epoch`).
    pub fn new(lambda: LrLambda, start_epoch: usize) -> Self {
        LrScheduler { lambda, last_epoch: start_epoch as i64 - 1 }
    }
    /// Advances one epoch and writes `initial_lr · lf(epoch)` into every group.
    pub fn step(&mut self, groups: &mut [ParamGroup]) {
        self.last_epoch += 1;
        let f = self.lambda.factor(self.last_epoch as f64);
        for g in groups {
            g.lr = g.initial_lr * f;
        }
    }
    /// The current factor.
    pub fn factor(&self) -> f64 {
        self.lambda.factor(self.last_epoch.max(0) as f64)
    }
    /// The state for a checkpoint.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|e| TrainerError::InvalidArgument { what: "scheduler state", reason: e.to_string() })
    }
    /// A scheduler from a checkpoint's state.
    pub fn from_json(s: &str) -> Result<Self> {
        serde_json::from_str(s)
            .map_err(|e| TrainerError::InvalidArgument { what: "scheduler state", reason: format!("malformed JSON: {e}") })
    }
}

/// Per-batch linear warm-up of lr (from 0, or `warmup_bias_lr` for bias groups), momentum (from
/// `warmup_momentum` to the run-argument momentum) and gradient accumulation (from 1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Warmup {
    /// Warm-up iterations (batches); 0 disables the warm-up.
    pub nw: usize,
    /// The bias groups' starting learning rate.
    pub warmup_bias_lr: f64,
    /// The starting momentum.
    pub warmup_momentum: f64,
    /// Target momentum: the run argument (0.937), not the constructor's 0.9 of `auto`.
    pub momentum: f64,
    /// Nominal accumulate after the cap (§2).
    pub accumulate: usize,
}

impl Warmup {
    /// `nw` from [`warmup_iterations`]; `accumulate` is the capped nominal value of §2.
    pub fn new(
        warmup_epochs: f64,
        epochs: usize,
        nb: usize,
        warmup_bias_lr: f64,
        warmup_momentum: f64,
        momentum: f64,
        accumulate: usize,
    ) -> Self {
        Warmup { nw: warmup_iterations(warmup_epochs, epochs, nb), warmup_bias_lr, warmup_momentum, momentum, accumulate }
    }

    /// Whether batch `ni` (counted from the start of training) is a warm-up batch.
    pub fn active(&self, ni: usize) -> bool {
        self.nw > 0 && ni <= self.nw
    }

    /// Applies the warm-up of batch `ni` in epoch `epoch` (`lf` = the scheduler's lambda) and
    /// returns the accumulate to use, or `None` outside the warm-up (nothing is changed).
    pub fn apply(&self, ni: usize, epoch: usize, lf: &LrLambda, groups: &mut [ParamGroup]) -> Option<usize> {
        if !self.active(ni) {
            return None;
        }
        let (x, x1) = (ni as f64, self.nw as f64);
        let acc = round_half_even(interp(x, x1, 1.0, self.accumulate as f64)).max(1.0) as usize;
        let f = lf.factor(epoch as f64);
        for g in groups.iter_mut() {
            let start = if g.kind == ParamKind::Bias { self.warmup_bias_lr } else { 0.0 };
            g.lr = interp(x, x1, start, g.initial_lr * f);
            if g.momentum.is_some() {
                g.set_momentum(interp(x, x1, self.warmup_momentum, self.momentum));
            }
        }
        Some(acc)
    }
}

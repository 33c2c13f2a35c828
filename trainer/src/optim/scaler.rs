//! FP16 GradScaler, `torch.amp.GradScaler` semantics (docs/trainer.md §5, docs/training.md §8): the loss is
//! multiplied by `scale`; `unscale_` multiplies every present gradient by `1/scale` and records
//! whether any was non-finite; `step` skips the optimizer step when one was; `update` backs off
//! (×0.5, tracker reset) after an inf/NaN, or grows (×2) after `growth_interval` clean steps.
//! Scale, growth tracker and found-inf flag live on the device as 0-d tensors updated in place.
//! Each call has a host part (the order of calls) and a device part (tensor ops only), so that a
//! replay plugin can record the device parts; the skipped step is decided on the device by an
//! optimizer that [`Optimizer::is_capturable`] (a host read otherwise).

use ptl_autograd::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::Optimizer;
use crate::error::{Result, TrainerError};

/// PyTorch defaults: init 2¹⁶, growth 2.0 every 2000 clean steps, backoff 0.5.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradScalerConfig {
    /// Initial scale (2¹⁶).
    pub init_scale: f64,
    /// Factor after a run of clean steps (2).
    pub growth_factor: f64,
    /// Factor after an overflow (0.5).
    pub backoff_factor: f64,
    /// Clean steps before growing (2000).
    pub growth_interval: u64,
    /// Whether scaling is on (16-mixed).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, enabled: true }
    }
}

/// Checkpoint form (`scale`, factors, interval, `_growth_tracker`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// Current scale.
    pub scale: f64,
    /// Growth factor.
    pub growth_factor: f64,
    /// Backoff factor.
    pub backoff_factor: f64,
    /// Growth interval.
    pub growth_interval: u64,
    /// Clean steps since the last change.
    pub growth_tracker: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Ready,
    Unscaled,
    Stepped,
}

/// PyTorch's GradScaler for 16-mixed (docs/trainer.md §5): scale and tracker on the device.
pub struct GradScaler {
    cfg: GradScalerConfig,
    scale: Option<Tensor>,
    tracker: Option<Tensor>,
    found_inf: Option<Tensor>,
    stage: Stage,
    /// Whether an inf check was recorded since the last `update`.
    checked: bool,
    /// Growth tracker restored from a checkpoint before the device scalars exist.
    pending_tracker: Option<u64>,
}

fn scaler_err(msg: impl Into<String>) -> TrainerError {
    TrainerError::InvalidArgument { what: "GradScaler", reason: msg.into() }
}

impl GradScaler {
    /// A scaler with `cfg`.
    pub fn new(cfg: GradScalerConfig) -> Result<Self> {
        if cfg.growth_factor <= 1.0 {
            return Err(scaler_err(format!("growth_factor must be > 1, got {}", cfg.growth_factor)));
        }
        if !(cfg.backoff_factor < 1.0 && cfg.backoff_factor > 0.0) {
            return Err(scaler_err(format!("backoff_factor must be in (0, 1), got {}", cfg.backoff_factor)));
        }
        if cfg.growth_interval == 0 {
            return Err(scaler_err("growth_interval must be at least 1"));
        }
        Ok(GradScaler { cfg, scale: None, tracker: None, found_inf: None, stage: Stage::Ready, checked: false, pending_tracker: None })
    }

    /// Its settings.
    pub fn config(&self) -> &GradScalerConfig {
        &self.cfg
    }
    /// Whether it scales.
    pub fn is_enabled(&self) -> bool {
        self.cfg.enabled
    }

    fn ensure(&mut self, like: &Tensor) -> Result<()> {
        if self.scale.is_none() {
            let dev = like.device();
            self.scale = Some(Tensor::scalar(self.cfg.init_scale, DType::F32, dev)?);
            let t0 = self.pending_tracker.take().unwrap_or(0);
            self.tracker = Some(Tensor::scalar(t0 as f64, DType::F32, dev)?);
            self.found_inf = Some(Tensor::scalar(0.0, DType::F32, dev)?);
        }
        Ok(())
    }

    /// `loss · scale` (the loss unchanged when disabled). Creates the device scalars lazily.
    pub fn scale(&mut self, loss: &Tensor) -> Result<Tensor> {
        if !self.cfg.enabled {
            return Ok(loss.clone());
        }
        self.ensure(loss)?;
        let s = self.scale.as_ref().ok_or_else(|| scaler_err("scale missing"))?;
        Ok(loss.mul(&s.to_dtype(loss.dtype())?)?)
    }

    /// Multiplies every present gradient of `opt` by `1/scale` (computed in f64, cast to f32) and
    /// records whether any value was non-finite. Calling it twice, or after `step`, is an error.
    /// [`GradScaler::begin_unscale`] then [`GradScaler::unscale_grads`].
    pub fn unscale_(&mut self, opt: &dyn Optimizer) -> Result<()> {
        if !self.begin_unscale()? {
            return Ok(());
        }
        let grads: Vec<Tensor> = opt.param_groups().iter().flat_map(|g| g.params.iter()).filter_map(|p| p.tensor.grad()).collect();
        self.unscale_grads(&grads)
    }

    /// The host part of an unscale: checks the order of calls and marks the unscale done. Returns
    /// whether the scaler is enabled (nothing to do when not).
    pub fn begin_unscale(&mut self) -> Result<bool> {
        if !self.cfg.enabled {
            return Ok(false);
        }
        match self.stage {
            Stage::Unscaled => return Err(scaler_err("unscale_() has already been called since the last update()")),
            Stage::Stepped => return Err(scaler_err("unscale_() is being called after step()")),
            Stage::Ready => {}
        }
        if self.scale.is_none() {
            return Err(scaler_err("unscale_() before scale(): the loss was never scaled in this iteration"));
        }
        self.checked = true;
        self.stage = Stage::Unscaled;
        Ok(true)
    }

    /// The device part of an unscale: every gradient in `grads` times `1/scale`, and the found-inf
    /// flag set to whether any was non-finite. Tensor ops only (no host read, no host→device copy):
    /// a replay plugin may record it.
    pub fn unscale_grads(&self, grads: &[Tensor]) -> Result<()> {
        let (Some(scale), Some(found)) = (self.scale.as_ref(), self.found_inf.as_ref()) else {
            return Err(scaler_err("unscale_() before scale(): the loss was never scaled in this iteration"));
        };
        ptl_autograd::no_grad(|| -> Result<()> {
            let inv = scale.to_dtype(DType::F64)?.recip()?.to_dtype(DType::F32)?;
            if grads.iter().any(|g| g.dtype() == DType::F16) {
                return Err(scaler_err("attempting to unscale FP16 gradients (parameters must stay FP32)"));
            }
            // f32 CUDA gradients: one multi-tensor launch per 40 (the same bytes as below).
            if Tensor::unscale_many_(&grads.iter().collect::<Vec<_>>(), &inv, found)? {
                return Ok(());
            }
            let mut any_bad = found.zeros_like()?;
            for g in grads {
                let limit = if g.dtype() == DType::F64 { f64::MAX } else { f64::from(f32::MAX) };
                let finite = g.abs()?.le_scalar(limit)?.to_dtype(DType::F32)?.min_all()?;
                any_bad = any_bad.maximum(&finite.affine(-1.0, 1.0)?)?;
                g.copy_(&g.mul(&inv.to_dtype(g.dtype())?)?)?;
            }
            found.copy_(&any_bad)?;
            Ok(())
        })
    }

    /// Unscales if not yet done, then runs `opt.step()` unless an inf/NaN was found, decided by a
    /// host read as PyTorch's `GradScaler.step` does (no state is created for a skipped step).
    /// Returns whether it stepped. The fit loop uses the parts instead, with the skip decided on
    /// the device ([`Optimizer::step_prepared_unless`]).
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<bool> {
        if !self.cfg.enabled {
            opt.step()?;
            return Ok(true);
        }
        if self.stage == Stage::Ready {
            self.unscale_(opt)?;
        }
        let found = self.begin_step()?;
        if found.item()? != 0.0 {
            return Ok(false);
        }
        opt.step()?;
        Ok(true)
    }

    /// The host part of a step after the unscale: checks the order of calls, marks the step done
    /// and returns the device found-inf flag the update is skipped by.
    pub fn begin_step(&mut self) -> Result<Tensor> {
        match self.stage {
            Stage::Stepped => return Err(scaler_err("step() has already been called since the last update()")),
            Stage::Ready => return Err(scaler_err("step() before unscale_(): no inf check was recorded")),
            Stage::Unscaled => {}
        }
        let found = self.found_inf.clone().ok_or_else(|| scaler_err("step() before the scaler was used"))?;
        self.stage = Stage::Stepped;
        Ok(found)
    }

    /// Backoff after an inf/NaN, else count a clean step and grow after `growth_interval` of them.
    /// [`GradScaler::update_scale`] then [`GradScaler::end_update`].
    pub fn update(&mut self) -> Result<()> {
        if !self.cfg.enabled {
            return Ok(());
        }
        if !self.checked {
            return Err(scaler_err("no inf checks were recorded prior to update()"));
        }
        self.update_scale()?;
        self.end_update()
    }

    /// The device part of an update: the new scale and growth tracker from the found-inf flag, which
    /// is then cleared. Tensor ops with the configuration's constants (no host read).
    pub fn update_scale(&self) -> Result<()> {
        let (Some(scale), Some(tracker), Some(found)) = (self.scale.as_ref(), self.tracker.as_ref(), self.found_inf.as_ref()) else {
            return Err(scaler_err("update() before the scaler was used"));
        };
        let cfg = self.cfg;
        ptl_autograd::no_grad(|| -> Result<()> {
            let is_found = found.gt_scalar(0.0)?;
            let inc = tracker.add_scalar(1.0)?;
            let grow = inc.ge_scalar(cfg.growth_interval as f64)?;
            let zero = tracker.zeros_like()?;
            let grown = grow.where_cond(&scale.mul_scalar(cfg.growth_factor)?, scale)?;
            let new_scale = is_found.where_cond(&scale.mul_scalar(cfg.backoff_factor)?, &grown)?;
            let new_tracker = is_found.where_cond(&zero, &grow.where_cond(&zero, &inc)?)?;
            scale.copy_(&new_scale)?;
            tracker.copy_(&new_tracker)?;
            found.copy_(&zero)?;
            Ok(())
        })
    }

    /// The host part of an update: back to the start of an iteration.
    pub fn end_update(&mut self) -> Result<()> {
        if !self.checked {
            return Err(scaler_err("no inf checks were recorded prior to update()"));
        }
        self.stage = Stage::Ready;
        self.checked = false;
        Ok(())
    }

    /// Current scale (host read; `init_scale` before first use, 1 when disabled).
    pub fn get_scale(&self) -> Result<f64> {
        if !self.cfg.enabled {
            return Ok(1.0);
        }
        match &self.scale {
            Some(s) => Ok(s.item()?),
            None => Ok(self.cfg.init_scale),
        }
    }

    /// Clean steps since the last growth/backoff (host read).
    pub fn growth_tracker(&self) -> Result<u64> {
        match &self.tracker {
            Some(t) => Ok(t.item()? as u64),
            None => Ok(0),
        }
    }

    /// The device flag of the last unscale (1.0 when an inf/NaN was seen).
    pub fn found_inf(&self) -> Option<&Tensor> {
        self.found_inf.as_ref()
    }

    /// Checkpoint state; `None` when disabled (PyTorch's empty dict).
    pub fn state(&self) -> Result<Option<ScalerState>> {
        if !self.cfg.enabled {
            return Ok(None);
        }
        Ok(Some(ScalerState {
            scale: self.get_scale()?,
            growth_factor: self.cfg.growth_factor,
            backoff_factor: self.cfg.backoff_factor,
            growth_interval: self.cfg.growth_interval,
            growth_tracker: self.growth_tracker()?,
        }))
    }

    /// Restores a checkpoint state (in place when the device scalars already exist).
    pub fn load_state(&mut self, st: Option<&ScalerState>) -> Result<()> {
        let Some(st) = st else {
            if self.cfg.enabled {
                return Err(scaler_err("the checkpoint has no scaler state but this scaler is enabled"));
            }
            return Ok(());
        };
        self.cfg.growth_factor = st.growth_factor;
        self.cfg.backoff_factor = st.backoff_factor;
        self.cfg.growth_interval = st.growth_interval;
        self.cfg.init_scale = st.scale;
        match (&self.scale, &self.tracker) {
            (Some(s), Some(t)) => {
                s.copy_(&s.full_like(st.scale)?)?;
                t.copy_(&t.full_like(st.growth_tracker as f64)?)?;
            }
            _ => {
                // Created lazily on the device of the first scaled loss, starting from these values.
                self.pending_tracker = Some(st.growth_tracker);
            }
        }
        self.stage = Stage::Ready;
        self.checked = false;
        Ok(())
    }
}

//! Model EMA (docs/training.md §7): `ema ← lerp(ema, model, 1 − d)` with
//! `d = decay · (1 − exp(−updates / tau))` over every floating-point state-dict entry (parameters
//! and float buffers); integer buffers keep their creation value. The EMA copies are FP32 and are
//! updated in place.

use std::collections::HashMap;

use ptl_autograd::{DType, Module, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainerError};

/// Scalar EMA state for checkpoints (tensors: [`ModelEma::ema_tensors`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EmaMeta {
    /// Updates made.
    pub updates: u64,
    /// The decay's limit (0.9999).
    pub decay: f64,
    /// The ramp's time constant in updates (2000).
    pub tau: f64,
}

/// The model's exponential moving average (docs/training.md §7): every float tensor of the state dict.
pub struct ModelEma {
    entries: Vec<(String, Tensor)>,
    index: HashMap<String, usize>,
    /// Updates made.
    pub updates: u64,
    /// The decay's limit (0.9999).
    pub decay: f64,
    /// The ramp's time constant in updates (2000).
    pub tau: f64,
    /// The update's weight `1 − d` on the entries' device, written before each update and read by
    /// the lerp kernels (so a recorded update takes each step's decay); never saved.
    weight: Option<Tensor>,
}

fn ema_err(msg: String) -> TrainerError {
    TrainerError::InvalidArgument { what: "model EMA", reason: msg }
}

impl ModelEma {
    /// Copies every state-dict entry (float entries as FP32); decay 0.9999, tau 2000, updates 0.
    pub fn new(state: &[(String, Tensor)]) -> Result<Self> {
        Self::with_params(state, 0.9999, 2000.0, 0)
    }

    /// An EMA starting from the tensors `state`, with `decay` and `tau`.
    pub fn with_params(state: &[(String, Tensor)], decay: f64, tau: f64, updates: u64) -> Result<Self> {
        let mut entries = Vec::with_capacity(state.len());
        let mut index = HashMap::with_capacity(state.len());
        for (n, t) in state {
            let c = ptl_autograd::no_grad(|| -> Result<Tensor> {
                let c = if t.dtype().is_float() && t.dtype() != DType::F32 { t.to_dtype(DType::F32)? } else { t.deep_copy()? };
                Ok(c.detach())
            })?;
            if index.insert(n.clone(), entries.len()).is_some() {
                return Err(ema_err(format!("entry `{n}` listed twice")));
            }
            entries.push((n.clone(), c));
        }
        Ok(ModelEma { entries, index, updates, decay, tau, weight: None })
    }

    /// From a module's full state dict (parameters and buffers).
    pub fn from_module(model: &dyn Module) -> Result<Self> {
        let sd: Vec<(String, Tensor)> = ptl_autograd::module::state_dict(model).into_iter().map(|e| (e.0, e.1)).collect();
        Self::new(&sd)
    }

    /// `decay · (1 − exp(−updates / tau))`.
    pub fn decay_at(&self, updates: u64) -> f64 {
        self.decay * (1.0 - (-(updates as f64) / self.tau).exp())
    }

    /// One EMA update from the live model's state dict (matched by name; every float EMA entry
    /// must be present). Returns the decay used.
    pub fn update(&mut self, model: &[(String, Tensor)]) -> Result<f64> {
        let d = self.prepare_update()?;
        self.update_prepared(model)?;
        Ok(d)
    }

    /// The host part of [`ModelEma::update`], split so that the device part can be recorded:
    /// counts the update and writes its weight `1 − d` to the device. Returns `d`.
    pub fn prepare_update(&mut self) -> Result<f64> {
        self.updates += 1;
        let d = self.decay_at(self.updates);
        let device = self.entries.iter().map(|(_, e)| e).find(|e| e.dtype().is_float()).map(|e| e.device());
        if let Some(device) = device {
            if self.weight.as_ref().is_none_or(|w| w.device() != device) {
                self.weight = Some(Tensor::zeros(vec![1], DType::F64, device)?);
            }
            let w = self.weight.as_ref().ok_or_else(|| ema_err("the weight vector was not made".into()))?;
            w.write_f64(0, &[1.0 - d])?;
        }
        Ok(d)
    }

    /// The device part of [`ModelEma::update`] after [`ModelEma::prepare_update`]: every float
    /// entry moves toward the model's by the weight written there (no host→device copy).
    pub fn update_prepared(&self, model: &[(String, Tensor)]) -> Result<()> {
        let same_order = model.len() == self.entries.len() && model.iter().zip(&self.entries).all(|(a, b)| a.0 == b.0);
        let lookup: HashMap<&str, &Tensor> = if same_order { HashMap::new() } else { model.iter().map(|(n, t)| (n.as_str(), t)).collect() };
        ptl_autograd::no_grad(|| -> Result<()> {
            // Every entry checked before any moves; then one batched lerp (a launch per 40 f32
            // entries on CUDA, the bytes of `e ← lerp(e, v, 1 − d)` each).
            let mut pairs: Vec<(&Tensor, Tensor)> = Vec::with_capacity(self.entries.len());
            for (i, (name, e)) in self.entries.iter().enumerate() {
                if !e.dtype().is_float() {
                    continue;
                }
                let src = if same_order {
                    &model[i].1
                } else {
                    lookup.get(name.as_str()).copied().ok_or_else(|| ema_err(format!("model has no entry `{name}`")))?
                };
                if src.dims() != e.dims() {
                    return Err(ema_err(format!("`{name}`: model shape {:?} vs EMA {:?}", src.dims(), e.dims())));
                }
                pairs.push((e, src.detach().to_dtype(e.dtype())?));
            }
            let refs: Vec<(&Tensor, &Tensor)> = pairs.iter().map(|(e, v)| (*e, v)).collect();
            if refs.is_empty() {
                return Ok(());
            }
            let w = self.weight.as_ref().ok_or_else(|| ema_err("update_prepared() before prepare_update()".into()))?;
            Ok(Tensor::lerp_many_dev_(&refs, ptl_autograd::DeviceScalars::new(w, 0))?)
        })
    }

    /// [`ModelEma::update`] from a module's state dict.
    pub fn update_module(&mut self, model: &dyn Module) -> Result<f64> {
        let sd: Vec<(String, Tensor)> = ptl_autograd::module::state_dict(model).into_iter().map(|e| (e.0, e.1)).collect();
        self.update(&sd)
    }

    /// The EMA entries (state-dict order of creation).
    pub fn ema_tensors(&self) -> &[(String, Tensor)] {
        &self.entries
    }
    /// The averaged tensor of `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.index.get(name).map(|&i| &self.entries[i].1)
    }

    /// The scalars for a checkpoint.
    pub fn meta(&self) -> EmaMeta {
        EmaMeta { updates: self.updates, decay: self.decay, tau: self.tau }
    }

    /// Restores updates/decay/tau and copies `tensors` into the EMA entries in place (all entries
    /// must be present; dtypes are converted, e.g. from an FP16 checkpoint).
    pub fn load(&mut self, meta: &EmaMeta, tensors: &HashMap<String, Tensor>) -> Result<()> {
        ptl_autograd::no_grad(|| -> Result<()> {
            for (name, e) in &self.entries {
                let src = tensors.get(name).ok_or_else(|| ema_err(format!("checkpoint has no EMA entry `{name}`")))?;
                if src.dims() != e.dims() {
                    return Err(ema_err(format!("`{name}`: checkpoint shape {:?} vs EMA {:?}", src.dims(), e.dims())));
                }
                e.copy_(&src.to_dtype(e.dtype())?.to_device(e.device())?)?;
            }
            Ok(())
        })?;
        self.updates = meta.updates;
        self.decay = meta.decay;
        self.tau = meta.tau;
        Ok(())
    }
}

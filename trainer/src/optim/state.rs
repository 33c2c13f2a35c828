//! Checkpointable state: per-parameter optimizer buffers as named tensors plus small serde JSON
//! structures for the scalars (group hyper-parameters, step counters, scheduler, scaler, EMA).

use std::collections::{BTreeMap, HashMap};

use ptl_autograd::Tensor;
use serde::{Deserialize, Serialize};

use super::groups::{OptimizerName, ParamGroup, ParamKind};
use crate::error::{Result, TrainerError};

/// Per-parameter state buffers (`momentum_buffer`, `exp_avg`, …) and AdamW step counters,
/// keyed by parameter name. Buffers are allocated once and afterwards only updated in place.
#[derive(Default, Debug, Clone)]
pub struct ParamStates {
    buffers: HashMap<String, BTreeMap<String, Tensor>>,
    steps: HashMap<String, u64>,
    /// Step counts kept on the device (AdamW's device path increments them there, so a skipped
    /// 16-mixed step, decided on the device, does not count): they supersede `steps` where present.
    device_steps: HashMap<String, Tensor>,
}

fn state_err(msg: String) -> TrainerError {
    TrainerError::InvalidArgument { what: "optimizer state", reason: msg }
}

impl ParamStates {
    /// The buffer `key` of `param`, allocated as zeros like `like` on first use.
    pub fn get_or_zeros(&mut self, param: &str, key: &str, like: &Tensor) -> Result<Tensor> {
        let slots = self.buffers.entry(param.to_string()).or_default();
        if let Some(t) = slots.get(key) {
            return Ok(t.clone());
        }
        let t = like.zeros_like()?;
        slots.insert(key.to_string(), t.clone());
        Ok(t)
    }
    /// State tensor `key` of `param`.
    pub fn get(&self, param: &str, key: &str) -> Option<&Tensor> {
        self.buffers.get(param).and_then(|s| s.get(key))
    }
    /// Whether `param` has any state yet (PyTorch `len(state) == 0`).
    pub fn has_state(&self, param: &str) -> bool {
        self.buffers.get(param).is_some_and(|s| !s.is_empty())
    }
    /// Steps `param` took.
    pub fn step_count(&self, param: &str) -> u64 {
        self.steps.get(param).copied().unwrap_or(0)
    }
    /// The step count of `param` as one f64 value on `like`'s device, for an update that reads and
    /// increments it there; made from the host count on first use.
    pub fn device_step(&mut self, param: &str, like: &Tensor) -> Result<Tensor> {
        if let Some(t) = self.device_steps.get(param) {
            return Ok(t.clone());
        }
        let t = Tensor::full(vec![1], self.step_count(param) as f64, ptl_autograd::DType::F64, like.device())?;
        self.device_steps.insert(param.to_string(), t.clone());
        Ok(t)
    }
    /// Increments and returns the step counter of `param`.
    pub fn next_step(&mut self, param: &str) -> u64 {
        let s = self.steps.entry(param.to_string()).or_insert(0);
        *s += 1;
        *s
    }

    /// `state.<key>.<param>` for every allocated buffer, in group order, keys sorted.
    pub fn to_named(&self, groups: &[ParamGroup]) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for g in groups {
            for p in &g.params {
                if let Some(slots) = self.buffers.get(&p.name) {
                    for (k, t) in slots {
                        out.push((format!("state.{k}.{}", p.name), t.clone()));
                    }
                }
            }
        }
        out
    }

    /// Loads `state.<key>.<param>` for each of `keys`; existing buffers are overwritten in place,
    /// missing ones are allocated; a buffer absent from `tensors` is zero-filled (equivalent to no
    /// state for every optimizer here). dtypes are converted to the parameter's (checkpoints may
    /// hold FP16 buffers).
    pub fn load_named(&mut self, groups: &[ParamGroup], keys: &[&str], tensors: &HashMap<String, Tensor>) -> Result<()> {
        ptl_autograd::no_grad(|| -> Result<()> {
            for g in groups {
                for p in &g.params {
                    for &k in keys {
                        let name = format!("state.{k}.{}", p.name);
                        match tensors.get(&name) {
                            Some(src) => {
                                if src.dims() != p.tensor.dims() {
                                    return Err(state_err(format!(
                                        "`{name}` has shape {:?}, parameter has {:?}",
                                        src.dims(),
                                        p.tensor.dims()
                                    )));
                                }
                                let v = src.to_dtype(p.tensor.dtype())?.to_device(p.tensor.device())?;
                                let buf = self.get_or_zeros(&p.name, k, &p.tensor)?;
                                buf.copy_(&v)?;
                            }
                            None => {
                                if let Some(buf) = self.get(&p.name, k) {
                                    buf.copy_(&buf.zeros_like()?)?;
                                }
                            }
                        }
                    }
                }
            }
            Ok(())
        })
    }

    /// Every step count, those on the device read back (a synchronisation; checkpoints only). A
    /// count that cannot be read keeps its host value, with a warning.
    pub(crate) fn steps_map(&self) -> BTreeMap<String, u64> {
        let mut out: BTreeMap<String, u64> = self.steps.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for (k, t) in &self.device_steps {
            match t.to_vec::<f64>().map(|v| v.first().copied()) {
                Ok(Some(v)) if v > 0.0 => {
                    out.insert(k.clone(), v as u64);
                }
                Ok(_) => {}
                Err(e) => {
                    log::warn!("ptl: warning: the step count of `{k}` could not be read from the device ({e}); its host value is saved")
                }
            }
        }
        out
    }
    pub(crate) fn set_steps(&mut self, steps: &BTreeMap<String, u64>) -> Result<()> {
        self.steps = steps.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for (k, t) in &self.device_steps {
            t.write_f64(0, &[self.steps.get(k).copied().unwrap_or(0) as f64])?;
        }
        Ok(())
    }
}

/// One group's hyper-parameters and membership, as stored in a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupMeta {
    /// Which kind of parameters.
    pub param_group: ParamKind,
    /// The class stems' group.
    pub boosted: bool,
    /// Current learning rate.
    pub lr: f64,
    /// Learning rate at construction.
    pub initial_lr: f64,
    /// Momentum (SGD, MuSGD).
    pub momentum: Option<f64>,
    /// Adam's betas.
    pub betas: Option<(f64, f64)>,
    /// Adam's ε.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Muon update.
    pub use_muon: bool,
    /// Parameter names.
    pub params: Vec<String>,
}

/// Scalars of an optimizer's state (the tensors travel separately, see [`ParamStates`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerMeta {
    /// Which optimizer.
    pub optimizer: OptimizerName,
    /// MuSGD's Muon weight.
    pub muon_factor: Option<f64>,
    /// MuSGD's SGD weight.
    pub sgd_factor: Option<f64>,
    /// The groups.
    pub groups: Vec<GroupMeta>,
    /// Per-parameter step counters (AdamW).
    #[serde(default)]
    pub steps: BTreeMap<String, u64>,
}

impl OptimizerMeta {
    /// As JSON.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|e| state_err(format!("cannot serialise: {e}")))
    }
    /// From JSON.
    pub fn from_json(s: &str) -> Result<Self> {
        serde_json::from_str(s).map_err(|e| state_err(format!("malformed optimizer state JSON: {e}")))
    }
}

pub(crate) fn groups_meta(groups: &[ParamGroup]) -> Vec<GroupMeta> {
    groups
        .iter()
        .map(|g| GroupMeta {
            param_group: g.kind,
            boosted: g.boosted,
            lr: g.lr,
            initial_lr: g.initial_lr,
            momentum: g.momentum,
            betas: g.betas,
            eps: g.eps,
            weight_decay: g.weight_decay,
            nesterov: g.nesterov,
            use_muon: g.use_muon,
            params: g.params.iter().map(|p| p.name.clone()).collect(),
        })
        .collect()
}

/// Writes `meta`'s hyper-parameters into `groups` after checking kind, group count and membership.
pub(crate) fn apply_groups_meta(kind: OptimizerName, groups: &mut [ParamGroup], meta: &OptimizerMeta) -> Result<()> {
    if meta.optimizer != kind {
        return Err(state_err(format!("checkpoint holds {} state, this optimizer is {}", meta.optimizer.as_str(), kind.as_str())));
    }
    if meta.groups.len() != groups.len() {
        return Err(state_err(format!("checkpoint has {} parameter groups, optimizer has {}", meta.groups.len(), groups.len())));
    }
    for (i, (g, m)) in groups.iter().zip(&meta.groups).enumerate() {
        let names: Vec<&str> = g.params.iter().map(|p| p.name.as_str()).collect();
        if m.param_group != g.kind || m.boosted != g.boosted || m.params.iter().map(String::as_str).ne(names.iter().copied()) {
            return Err(state_err(format!("parameter group {i} ({}) does not match the checkpoint's membership", g.name())));
        }
    }
    for (g, m) in groups.iter_mut().zip(&meta.groups) {
        g.lr = m.lr;
        g.initial_lr = m.initial_lr;
        g.momentum = m.momentum;
        g.betas = m.betas;
        g.eps = m.eps;
        g.weight_decay = m.weight_decay;
        g.nesterov = m.nesterov;
    }
    Ok(())
}

/// Ultralytics' `convert_optimizer_state_dict_to_fp16` for checkpoints: floating-point state
/// tensors (`state.<key>.<param>`) become FP16 except the keys `step`, `exp_avg`, `exp_avg_sq` and
/// `square_avg` (so MuSGD/SGD momentum buffers are stored in FP16, AdamW moments stay FP32).
/// Loading converts back to the parameter dtype ([`ParamStates::load_named`]).
pub fn checkpoint_dtypes(tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
    const KEEP: [&str; 4] = ["step", "exp_avg", "exp_avg_sq", "square_avg"];
    tensors
        .into_iter()
        .map(|(n, t)| {
            let key = n.strip_prefix("state.").and_then(|r| r.split('.').next()).unwrap_or("");
            if t.dtype() == ptl_autograd::DType::F32 && !KEEP.contains(&key) {
                Ok((n, ptl_autograd::no_grad(|| t.to_dtype(ptl_autograd::DType::F16))?))
            } else {
                Ok((n, t))
            }
        })
        .collect()
}

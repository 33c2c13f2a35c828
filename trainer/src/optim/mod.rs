//! Optimisation (docs/training.md §2–§8, docs/trainer.md §5, §7, §8): parameter groups, MuSGD / SGD / AdamW,
//! Newton–Schulz, warm-up and LR schedules, model EMA, gradient clipping, the FP16 GradScaler and
//! checkpointable state.
//!
//! Conventions shared by every optimizer here:
//! * a parameter whose `grad()` is `None` is skipped entirely (no state is created or changed);
//! * parameters and state buffers are updated **in place** (`copy_`), so their storage addresses
//!   never change (CUDA-graph recordings rely on that); buffers are allocated once, on first use;
//! * all math is written with tensor ops and runs on the parameter's device, under `no_grad`.
//!
//! Capturable where the rule reads device scalars (SGD, MuSGD, the EMA; docs/capture.md §16): the host
//! part of a step (`prepare_step`) writes learning rates, momenta and decay to the device, the
//! device part (`step_prepared`, `step_prepared_unless` under 16-mixed) reads them, so a recorded
//! update takes each step's values; AdamW keeps its step counts on the device as well.
//!
//! ```
//! use ptl_autograd::{module::parameter, Device, Tensor};
//! use ptl_trainer::optim::{build_optimizer, clip_grad_norm, LrLambda, LrScheduler, ModelEma, OptimizerConfig, Warmup};
//!
//! # fn main() -> ptl_trainer::Result<()> {
//! let w = parameter(Tensor::from_vec(vec![0.5f32; 8], vec![2, 4], Device::Cpu)?)?;
//! let b = parameter(Tensor::from_vec(vec![0.0f32; 2], vec![2], Device::Cpu)?)?;
//! let params = vec![("model.0.linear.weight".to_string(), w.clone()), ("model.0.linear.bias".to_string(), b.clone())];
//! // `auto` with > 10 000 nominal iterations → MuSGD (8 groups), lr0 0.01, momentum 0.9.
//! let mut opt = build_optimizer(&params, &OptimizerConfig { iterations: 88_500, ..Default::default() })?;
//! let mut ema = ModelEma::new(&params)?;
//! let lf = LrLambda::new(false, 0.01, 100);
//! let mut sched = LrScheduler::new(lf, 0);
//! let warmup = Warmup::new(3.0, 100, 1000, 0.0, 0.8, 0.937, 4);
//! sched.step(opt.param_groups_mut()); // start of epoch 0
//! let accumulate = warmup.apply(0, 0, &lf, opt.param_groups_mut()).unwrap_or(4);
//! assert_eq!(accumulate, 1);
//! w.set_grad(Some(Tensor::from_vec(vec![0.1f32; 8], vec![2, 4], Device::Cpu)?)); // b has no gradient: skipped
//! let _total_norm = clip_grad_norm(params.iter().map(|(_, t)| t), 10.0)?;
//! opt.step()?;
//! opt.zero_grad();
//! ema.update(&params)?;
//! # Ok(())
//! # }
//! ```

pub mod adamw;
pub mod clip;
pub mod ema;
pub mod grouped;
pub mod groups;
pub mod musgd;
pub mod newton_schulz;
pub mod scaler;
pub mod schedule;
pub mod sgd;
pub mod state;

use std::collections::{HashMap, HashSet};

use ptl_autograd::{Module, Tensor, TensorKind};

pub use adamw::AdamW;
pub use clip::clip_grad_norm;
pub use ema::ModelEma;
pub use grouped::{Grouped, TensorUpdate};
pub use groups::{
    auto_iterations, build_groups, capped_accumulate, classify, is_boosted, nominal_accumulate, norm_modules_from_names, resolve,
    round_half_even, scaled_weight_decay, step_due, NamedParam, NsPrecision, OptimizerConfig, OptimizerName, ParamGroup, ParamKind,
    ResolvedOptimizer,
};
pub use musgd::MuSgd;
pub use newton_schulz::{newton_schulz5, orthogonalized_update, NativeNs, NsRunner};
pub use scaler::{GradScaler, GradScalerConfig};
pub use schedule::{warmup_iterations, LrLambda, LrScheduler, Warmup};
pub use sgd::Sgd;
pub use state::{OptimizerMeta, ParamStates};

use crate::error::Result;

/// An optimizer over named parameter groups.
pub trait Optimizer: Send {
    /// Which family this is (never `Auto`).
    fn kind(&self) -> OptimizerName;
    /// The parameter groups, in order.
    fn param_groups(&self) -> &[ParamGroup];
    /// Warm-up and schedulers write `lr` / `momentum` here.
    fn param_groups_mut(&mut self) -> &mut [ParamGroup];
    /// One update from the current gradients; parameters without a gradient are skipped.
    fn step(&mut self) -> Result<()>;
    /// The host part of a step, split from [`Optimizer::step_prepared`] so that the device part can
    /// be recorded and replayed: writes the step's scalars (learning rates, momenta, decay) to the
    /// device. `prepare_step` then `step_prepared` is `step`.
    fn prepare_step(&mut self) -> Result<()> {
        Ok(())
    }
    /// The device part of a step after [`Optimizer::prepare_step`]: every update, reading the scalars
    /// it wrote; no host→device copy and no host read of device data. `ns` runs the step's
    /// Newton–Schulz (MuSGD; [`NativeNs`] where it is not a plugin's site). By default `step` (a
    /// rule without device scalars does everything here).
    fn step_prepared(&mut self, ns: &dyn NsRunner) -> Result<()> {
        let _ = ns;
        self.step()
    }
    /// Whether the device part of a step can be recorded and replayed: it reads every scalar that
    /// changes between steps from the device (written by [`Optimizer::prepare_step`]), and
    /// [`Optimizer::step_prepared_unless`] decides on the device (no host read). Only then does the
    /// trainer hand the step to a replay plugin.
    fn is_capturable(&self) -> bool {
        false
    }
    /// [`Optimizer::step_prepared`] unless the f32 flag `found_inf` (the grad scaler's) is non-zero,
    /// in which case no parameter and no state changes: decided on the device where
    /// [`Optimizer::is_capturable`], else by this default's host read.
    fn step_prepared_unless(&mut self, found_inf: &Tensor, ns: &dyn NsRunner) -> Result<()> {
        match found_inf.item()? != 0.0 {
            true => Ok(()),
            false => self.step_prepared(ns),
        }
    }
    /// Clears every gradient to `None` (`zero_grad(set_to_none=True)`).
    fn zero_grad(&self) {
        for g in self.param_groups() {
            for p in &g.params {
                p.tensor.zero_grad();
            }
        }
    }
    /// Per-parameter state buffers as `state.<key>.<parameter name>` (group order).
    fn state_tensors(&self) -> Vec<(String, Tensor)>;
    /// Loads buffers written by [`Optimizer::state_tensors`] into the existing buffers (in place).
    fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> Result<()>;
    /// Group hyper-parameters, memberships and scalar state (serde JSON).
    fn state_meta(&self) -> OptimizerMeta;
    /// Restores what [`Optimizer::state_meta`] returned; the group memberships must match.
    fn load_state_meta(&mut self, meta: &OptimizerMeta) -> Result<()>;
}

/// Builds the optimizer of `cfg` (after [`resolve`]) over `params` in `named_parameters` order.
pub fn build_optimizer(params: &[(String, Tensor)], cfg: &OptimizerConfig) -> Result<Box<dyn Optimizer>> {
    let resolved = resolve(cfg)?;
    let groups = build_groups(params, &resolved, cfg.norm_modules.as_ref())?;
    Ok(match resolved.name {
        OptimizerName::MuSgd => Box::new(MuSgd::new(groups, cfg.ns_precision)),
        OptimizerName::AdamW => Box::new(AdamW::new(groups)),
        _ => Box::new(Sgd::new(groups)),
    })
}

/// [`build_optimizer`] over a module's parameters; normalisation layers are recognised by their
/// `running_mean` buffers (unless `cfg.norm_modules` is already set).
pub fn build_optimizer_for_module(model: &dyn Module, cfg: &OptimizerConfig) -> Result<Box<dyn Optimizer>> {
    let sd = ptl_autograd::module::state_dict(model);
    let mut cfg = cfg.clone();
    if cfg.norm_modules.is_none() {
        let norms: HashSet<String> = norm_modules_from_names(sd.iter().map(|e| e.0.as_str()));
        cfg.norm_modules = Some(norms);
    }
    let params: Vec<(String, Tensor)> = sd.into_iter().filter(|e| e.2 == TensorKind::Parameter).map(|e| (e.0, e.1)).collect();
    build_optimizer(&params, &cfg)
}

/// The gradient of `p` (`None` = absent, skip), checked against the parameter's shape and device.
pub(crate) fn present_grad(p: &NamedParam) -> Result<Option<Tensor>> {
    let Some(g) = p.tensor.grad() else { return Ok(None) };
    if g.dims() != p.tensor.dims() || g.device() != p.tensor.device() {
        return Err(crate::error::TrainerError::InvalidArgument {
            what: "gradient",
            reason: format!(
                "`{}`: gradient {:?} on {} for a parameter {:?} on {}",
                p.name,
                g.dims(),
                g.device(),
                p.tensor.dims(),
                p.tensor.device()
            ),
        });
    }
    Ok(Some(g))
}

//! AdamW, PyTorch single-tensor semantics (docs/training.md §3.6): decoupled decay, bias-corrected
//! moments, eps 1e-8, no amsgrad; per-parameter step counters starting at 1. The step reads its
//! scalars and each parameter's step count from the device (`Tensor::adamw_step_many_dev`), so it
//! can be recorded; [`TensorUpdate::update`] is the host-scalar reference it matches.

use ptl_autograd::{adamw_composed, AdamWItem, DeviceScalars, Tensor, ADAMW_SCALARS};

use super::grouped::{Grouped, TensorUpdate};
use super::groups::{NamedParam, OptimizerName, ParamGroup};
use super::state::ParamStates;
use super::NsRunner;
use crate::error::Result;

/// State key of the first moment.
pub const EXP_AVG: &str = "exp_avg";
/// State key of the second moment.
pub const EXP_AVG_SQ: &str = "exp_avg_sq";

/// AdamW over named parameter groups.
pub type AdamW = Grouped<AdamWUpdate>;

/// AdamW's per-tensor update (per-parameter step counts in the state).
pub struct AdamWUpdate;

impl AdamW {
    /// AdamW over `groups`.
    pub fn new(groups: Vec<ParamGroup>) -> Self {
        Grouped::with_update(groups, AdamWUpdate)
    }
}

impl TensorUpdate for AdamWUpdate {
    fn kind(&self) -> OptimizerName {
        OptimizerName::AdamW
    }
    fn state_keys(&self) -> &'static [&'static str] {
        &[EXP_AVG, EXP_AVG_SQ]
    }
    fn counts_steps(&self) -> bool {
        true
    }
    fn device_scalars(&self) -> usize {
        ADAMW_SCALARS
    }
    /// `[1 − lr·wd, 1 − β1, β2, 1 − β2, eps, lr, β1]`, as [`TensorUpdate::update`] computes them.
    fn write_scalars(&self, g: &ParamGroup, out: &mut [f64]) {
        let (b1, b2) = g.betas.unwrap_or((0.9, 0.999));
        out.copy_from_slice(&[1.0 - g.lr * g.weight_decay, 1.0 - b1, b2, 1.0 - b2, g.eps, g.lr, b1]);
    }
    /// The group's update from the device scalars, each parameter's step count on the device.
    fn update_group_dev(
        &self,
        g: &ParamGroup,
        params: &[(&NamedParam, Tensor)],
        state: &mut ParamStates,
        s: DeviceScalars<'_>,
        _ns: &dyn NsRunner,
    ) -> Result<()> {
        let mut held = Vec::with_capacity(params.len());
        for (p, _) in params {
            let m = state.get_or_zeros(&p.name, EXP_AVG, &p.tensor)?;
            let v = state.get_or_zeros(&p.name, EXP_AVG_SQ, &p.tensor)?;
            held.push((m, v, state.device_step(&p.name, &p.tensor)?));
        }
        let items: Vec<AdamWItem<'_>> = params
            .iter()
            .zip(&held)
            .map(|((p, grad), (m, v, c))| AdamWItem { param: &p.tensor, grad, exp_avg: m, exp_avg_sq: v, step: c })
            .collect();
        Ok(Tensor::adamw_step_many_dev(&items, s, g.weight_decay != 0.0)?)
    }
    /// The host-scalar update: the same arithmetic ([`adamw_composed`]) at the host's step count.
    fn update(&self, g: &ParamGroup, p: &NamedParam, grad: &Tensor, state: &mut ParamStates) -> Result<()> {
        let mut h = [0.0; ADAMW_SCALARS];
        self.write_scalars(g, &mut h);
        let m = state.get_or_zeros(&p.name, EXP_AVG, &p.tensor)?;
        let v = state.get_or_zeros(&p.name, EXP_AVG_SQ, &p.tensor)?;
        let t = state.next_step(&p.name) as f64;
        Ok(adamw_composed(&p.tensor, grad, &m, &v, &h, t, g.weight_decay != 0.0)?)
    }
}

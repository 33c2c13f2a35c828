//! SGD with (Nesterov) momentum, PyTorch semantics, no dampening (docs/training.md §3.4 non-Muon part).

use ptl_autograd::{DeviceScalars, SgdStep, Tensor};

use super::grouped::{Grouped, TensorUpdate};
use super::groups::{NamedParam, OptimizerName, ParamGroup};
use super::state::ParamStates;
use super::NsRunner;
use crate::error::Result;

/// Momentum-buffer key (PyTorch's name).
pub const MOMENTUM_BUFFER: &str = "momentum_buffer";

/// One SGD update of `p` with gradient `g` and buffer `buf`, all in place:
/// g′ = g + λ·p; buf ← μ·buf + g′; p ← p − lr·factor·(g′ + μ·buf) (Nesterov) or p − lr·factor·buf.
/// A zero-initialised `buf` gives buf = g′ on the first step, as PyTorch's clone does.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd_update(
    p: &Tensor,
    g: &Tensor,
    buf: &Tensor,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    nesterov: bool,
    factor: f64,
) -> Result<()> {
    Ok(Tensor::sgd_step_composed(p, g, Some(buf), sgd_step(lr, momentum, weight_decay, nesterov, factor))?)
}

/// The step's hyperparameters as the fused and composed SGD ops take them.
pub(crate) fn sgd_step(lr: f64, momentum: f64, weight_decay: f64, nesterov: bool, factor: f64) -> SgdStep {
    SgdStep { weight_decay, momentum, neg_lr: -(lr * factor), nesterov }
}

/// `torch.optim.SGD(nesterov=True)` over Ultralytics' three groups [weight, bn, bias].
pub type Sgd = Grouped<SgdUpdate>;

/// SGD's per-tensor update: plain SGD (no buffer) without momentum, else `sgd_update`.
pub struct SgdUpdate;

impl Sgd {
    /// SGD over `groups`.
    pub fn new(groups: Vec<ParamGroup>) -> Self {
        Grouped::with_update(groups, SgdUpdate)
    }
}

impl TensorUpdate for SgdUpdate {
    fn kind(&self) -> OptimizerName {
        OptimizerName::Sgd
    }
    fn state_keys(&self) -> &'static [&'static str] {
        &[MOMENTUM_BUFFER]
    }
    fn update(&self, g: &ParamGroup, p: &NamedParam, grad: &Tensor, state: &mut ParamStates) -> Result<()> {
        let mu = g.momentum.unwrap_or(0.0);
        if mu == 0.0 {
            // Plain SGD keeps no buffer.
            return Ok(Tensor::sgd_step_composed(&p.tensor, grad, None, sgd_step(g.lr, 0.0, g.weight_decay, g.nesterov, 1.0))?);
        }
        let buf = state.get_or_zeros(&p.name, MOMENTUM_BUFFER, &p.tensor)?;
        sgd_update(&p.tensor, grad, &buf, g.lr, mu, g.weight_decay, g.nesterov, 1.0)
    }
    fn device_scalars(&self) -> usize {
        3
    }
    /// `[weight_decay, momentum, −lr]` as `sgd_step` computes them.
    fn write_scalars(&self, g: &ParamGroup, out: &mut [f64]) {
        let h = sgd_step(g.lr, g.momentum.unwrap_or(0.0), g.weight_decay, g.nesterov, 1.0);
        out.copy_from_slice(&[h.weight_decay, h.momentum, h.neg_lr]);
    }
    fn update_group_dev(
        &self,
        g: &ParamGroup,
        params: &[(&NamedParam, Tensor)],
        state: &mut ParamStates,
        s: DeviceScalars<'_>,
        _ns: &dyn NsRunner,
    ) -> Result<()> {
        let mu = g.momentum.unwrap_or(0.0);
        let bufs = if mu == 0.0 {
            Vec::new()
        } else {
            params.iter().map(|(p, _)| state.get_or_zeros(&p.name, MOMENTUM_BUFFER, &p.tensor)).collect::<Result<Vec<_>>>()?
        };
        let items: Vec<(&Tensor, &Tensor, Option<&Tensor>)> =
            params.iter().enumerate().map(|(i, (p, grad))| (&p.tensor, grad, bufs.get(i))).collect();
        Ok(Tensor::sgd_step_many_dev(&items, s, g.weight_decay != 0.0, g.nesterov)?)
    }
}

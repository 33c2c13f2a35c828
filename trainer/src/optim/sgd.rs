//! SGD with (Nesterov) momentum, PyTorch semantics, no dampening (training.md §3.4 non-Muon part).

use ptl_autograd::Tensor;

use super::grouped::{Grouped, TensorUpdate};
use super::groups::{NamedParam, OptimizerName, ParamGroup};
use super::state::ParamStates;
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
    ptl_autograd::no_grad(|| -> Result<()> {
        let g = if weight_decay != 0.0 { g.add(&p.mul_scalar(weight_decay)?)? } else { g.clone() };
        let new_buf = buf.mul_scalar(momentum)?.add(&g)?;
        buf.copy_(&new_buf)?;
        let upd = if nesterov { g.add(&buf.mul_scalar(momentum)?)? } else { new_buf };
        p.copy_(&p.add(&upd.mul_scalar(-(lr * factor))?)?)?;
        Ok(())
    })
}

/// `torch.optim.SGD(nesterov=True)` over Ultralytics' three groups [weight, bn, bias].
pub type Sgd = Grouped<SgdUpdate>;

/// SGD's per-tensor update: plain SGD (no buffer) without momentum, else [`sgd_update`].
pub struct SgdUpdate;

impl Sgd {
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
            return ptl_autograd::no_grad(|| -> Result<()> {
                let gd = if g.weight_decay != 0.0 { grad.add(&p.tensor.mul_scalar(g.weight_decay)?)? } else { grad.clone() };
                p.tensor.copy_(&p.tensor.add(&gd.mul_scalar(-g.lr)?)?)?;
                Ok(())
            });
        }
        let buf = state.get_or_zeros(&p.name, MOMENTUM_BUFFER, &p.tensor)?;
        sgd_update(&p.tensor, grad, &buf, g.lr, mu, g.weight_decay, g.nesterov, 1.0)
    }
}

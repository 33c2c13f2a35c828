//! SGD with (Nesterov) momentum, PyTorch semantics, no dampening (training.md §3.4 non-Muon part).

use std::collections::HashMap;

use ptl_autograd::Tensor;

use super::groups::{OptimizerName, ParamGroup};
use super::state::{apply_groups_meta, groups_meta, OptimizerMeta, ParamStates};
use super::{present_grad, Optimizer};
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
pub struct Sgd {
    groups: Vec<ParamGroup>,
    state: ParamStates,
}

impl Sgd {
    pub fn new(groups: Vec<ParamGroup>) -> Self {
        Sgd { groups, state: ParamStates::default() }
    }
    pub fn state(&self) -> &ParamStates {
        &self.state
    }
}

impl Optimizer for Sgd {
    fn kind(&self) -> OptimizerName {
        OptimizerName::Sgd
    }
    fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }
    fn param_groups_mut(&mut self) -> &mut [ParamGroup] {
        &mut self.groups
    }
    fn step(&mut self) -> Result<()> {
        for g in &self.groups {
            let mu = g.momentum.unwrap_or(0.0);
            for p in &g.params {
                let Some(grad) = present_grad(p)? else { continue };
                if mu == 0.0 {
                    // Plain SGD keeps no buffer.
                    ptl_autograd::no_grad(|| -> Result<()> {
                        let gd = if g.weight_decay != 0.0 { grad.add(&p.tensor.mul_scalar(g.weight_decay)?)? } else { grad.clone() };
                        p.tensor.copy_(&p.tensor.add(&gd.mul_scalar(-g.lr)?)?)?;
                        Ok(())
                    })?;
                    continue;
                }
                let buf = self.state.get_or_zeros(&p.name, MOMENTUM_BUFFER, &p.tensor)?;
                sgd_update(&p.tensor, &grad, &buf, g.lr, mu, g.weight_decay, g.nesterov, 1.0)?;
            }
        }
        Ok(())
    }
    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.state.to_named(&self.groups)
    }
    fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        self.state.load_named(&self.groups, &[MOMENTUM_BUFFER], tensors)
    }
    fn state_meta(&self) -> OptimizerMeta {
        OptimizerMeta {
            optimizer: self.kind(),
            muon_factor: None,
            sgd_factor: None,
            groups: groups_meta(&self.groups),
            steps: Default::default(),
        }
    }
    fn load_state_meta(&mut self, meta: &OptimizerMeta) -> Result<()> {
        apply_groups_meta(self.kind(), &mut self.groups, meta)
    }
}

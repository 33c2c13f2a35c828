//! AdamW, PyTorch single-tensor semantics (training.md §3.6): decoupled decay, bias-corrected
//! moments, eps 1e-8, no amsgrad; per-parameter step counters starting at 1.

use std::collections::HashMap;

use ptl_autograd::Tensor;

use super::groups::{OptimizerName, ParamGroup};
use super::state::{apply_groups_meta, groups_meta, OptimizerMeta, ParamStates};
use super::{lerp, present_grad, Optimizer};
use crate::error::Result;

pub const EXP_AVG: &str = "exp_avg";
pub const EXP_AVG_SQ: &str = "exp_avg_sq";

pub struct AdamW {
    groups: Vec<ParamGroup>,
    state: ParamStates,
}

impl AdamW {
    pub fn new(groups: Vec<ParamGroup>) -> Self {
        AdamW { groups, state: ParamStates::default() }
    }
    pub fn state(&self) -> &ParamStates {
        &self.state
    }
}

impl Optimizer for AdamW {
    fn kind(&self) -> OptimizerName {
        OptimizerName::AdamW
    }
    fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }
    fn param_groups_mut(&mut self) -> &mut [ParamGroup] {
        &mut self.groups
    }
    fn step(&mut self) -> Result<()> {
        for g in &self.groups {
            let (b1, b2) = g.betas.unwrap_or((0.9, 0.999));
            for p in &g.params {
                let Some(grad) = present_grad(p)? else { continue };
                let m = self.state.get_or_zeros(&p.name, EXP_AVG, &p.tensor)?;
                let v = self.state.get_or_zeros(&p.name, EXP_AVG_SQ, &p.tensor)?;
                let t = self.state.next_step(&p.name) as f64;
                let (lr, wd, eps) = (g.lr, g.weight_decay, g.eps);
                ptl_autograd::no_grad(|| -> Result<()> {
                    let x = &p.tensor;
                    if wd != 0.0 {
                        x.copy_(&x.mul_scalar(1.0 - lr * wd)?)?;
                    }
                    m.copy_(&lerp(&m, &grad, 1.0 - b1)?)?;
                    v.copy_(&v.mul_scalar(b2)?.add(&grad.mul_scalar(1.0 - b2)?.mul(&grad)?)?)?;
                    let bc1 = 1.0 - b1.powf(t);
                    let bc2 = 1.0 - b2.powf(t);
                    let step_size = lr / bc1;
                    let denom = v.sqrt()?.div_scalar(bc2.sqrt())?.add_scalar(eps)?;
                    x.copy_(&x.add(&m.div(&denom)?.mul_scalar(-step_size)?)?)?;
                    Ok(())
                })?;
            }
        }
        Ok(())
    }
    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.state.to_named(&self.groups)
    }
    fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        self.state.load_named(&self.groups, &[EXP_AVG, EXP_AVG_SQ], tensors)
    }
    fn state_meta(&self) -> OptimizerMeta {
        OptimizerMeta {
            optimizer: self.kind(),
            muon_factor: None,
            sgd_factor: None,
            groups: groups_meta(&self.groups),
            steps: self.state.steps_map(),
        }
    }
    fn load_state_meta(&mut self, meta: &OptimizerMeta) -> Result<()> {
        apply_groups_meta(self.kind(), &mut self.groups, meta)?;
        self.state.set_steps(&meta.steps);
        Ok(())
    }
}

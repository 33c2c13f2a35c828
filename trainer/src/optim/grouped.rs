//! The part every optimizer shares: parameter groups, per-parameter state buffers, the state dict
//! and group metadata. An optimizer supplies only its per-tensor update ([`TensorUpdate`]);
//! [`Grouped`] walks the groups in order, skips parameters without a gradient and keeps the rest.

use std::collections::HashMap;

use ptl_autograd::Tensor;

use super::groups::{NamedParam, OptimizerName, ParamGroup};
use super::state::{apply_groups_meta, groups_meta, OptimizerMeta, ParamStates};
use super::{present_grad, Optimizer};
use crate::error::Result;

/// One optimizer's update of one parameter, given its group, its present gradient and the
/// optimizer's per-parameter state (buffers created on first use, updated in place).
pub trait TensorUpdate: Send {
    fn kind(&self) -> OptimizerName;
    /// The state buffers it keeps per parameter, in state-dict order.
    fn state_keys(&self) -> &'static [&'static str];
    /// Whether it counts steps per parameter (saved in the metadata).
    fn counts_steps(&self) -> bool {
        false
    }
    fn update(&self, group: &ParamGroup, p: &NamedParam, grad: &Tensor, state: &mut ParamStates) -> Result<()>;
    /// One group's update over its parameters that have a gradient (in group order): by default
    /// [`TensorUpdate::update`] one by one; a rule may batch work across them (MuSGD's
    /// Newton–Schulz) as long as every parameter ends as the one-by-one update leaves it.
    fn update_group(&self, group: &ParamGroup, params: &[(&NamedParam, Tensor)], state: &mut ParamStates) -> Result<()> {
        for (p, grad) in params {
            self.update(group, p, grad, state)?;
        }
        Ok(())
    }
    /// Its own scalars in the checkpoint metadata.
    fn write_meta(&self, _meta: &mut OptimizerMeta) {}
    fn read_meta(&mut self, _meta: &OptimizerMeta) {}
}

/// An optimizer over named parameter groups with the per-tensor update `U`.
pub struct Grouped<U> {
    groups: Vec<ParamGroup>,
    state: ParamStates,
    update: U,
}

impl<U: TensorUpdate> Grouped<U> {
    pub fn with_update(groups: Vec<ParamGroup>, update: U) -> Self {
        Grouped { groups, state: ParamStates::default(), update }
    }
    pub fn state(&self) -> &ParamStates {
        &self.state
    }
    /// The per-tensor update (and its settings).
    pub fn update_rule(&self) -> &U {
        &self.update
    }
}

impl<U: TensorUpdate> Optimizer for Grouped<U> {
    fn kind(&self) -> OptimizerName {
        self.update.kind()
    }
    fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }
    fn param_groups_mut(&mut self) -> &mut [ParamGroup] {
        &mut self.groups
    }
    fn step(&mut self) -> Result<()> {
        for g in &self.groups {
            let mut present = Vec::with_capacity(g.params.len());
            for p in &g.params {
                if let Some(grad) = present_grad(p)? {
                    present.push((p, grad));
                }
            }
            self.update.update_group(g, &present, &mut self.state)?;
        }
        Ok(())
    }
    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.state.to_named(&self.groups)
    }
    fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        self.state.load_named(&self.groups, self.update.state_keys(), tensors)
    }
    fn state_meta(&self) -> OptimizerMeta {
        let mut meta = OptimizerMeta {
            optimizer: self.kind(),
            muon_factor: None,
            sgd_factor: None,
            groups: groups_meta(&self.groups),
            steps: if self.update.counts_steps() { self.state.steps_map() } else { Default::default() },
        };
        self.update.write_meta(&mut meta);
        meta
    }
    fn load_state_meta(&mut self, meta: &OptimizerMeta) -> Result<()> {
        apply_groups_meta(self.kind(), &mut self.groups, meta)?;
        if self.update.counts_steps() {
            self.state.set_steps(&meta.steps);
        }
        self.update.read_meta(meta);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::groups::ParamKind;
    use ptl_autograd::{module::parameter, DType, Device};

    /// A rule that adds its step count to a parameter: shows what the base does around it.
    struct Count;

    impl TensorUpdate for Count {
        fn kind(&self) -> OptimizerName {
            OptimizerName::Sgd
        }
        fn state_keys(&self) -> &'static [&'static str] {
            &["seen"]
        }
        fn counts_steps(&self) -> bool {
            true
        }
        fn update(&self, _g: &ParamGroup, p: &NamedParam, grad: &Tensor, state: &mut ParamStates) -> Result<()> {
            let seen = state.get_or_zeros(&p.name, "seen", &p.tensor)?;
            let t = state.next_step(&p.name) as f64;
            ptl_autograd::no_grad(|| -> Result<()> {
                seen.copy_(&seen.add(grad)?)?;
                p.tensor.copy_(&p.tensor.add_scalar(t)?)?;
                Ok(())
            })
        }
    }

    #[test]
    fn the_base_skips_absent_gradients_and_keeps_state_and_steps() {
        let t = |v: f32| parameter(Tensor::full(vec![2], v as f64, DType::F32, Device::Cpu).unwrap()).unwrap();
        let (a, b) = (t(0.0), t(10.0));
        let group = ParamGroup {
            kind: ParamKind::Weight,
            boosted: false,
            lr: 0.1,
            initial_lr: 0.1,
            momentum: Some(0.9),
            betas: None,
            eps: 1e-8,
            weight_decay: 0.0,
            nesterov: false,
            use_muon: false,
            params: vec![NamedParam { name: "a".into(), tensor: a.clone() }, NamedParam { name: "b".into(), tensor: b.clone() }],
        };
        let mut opt = Grouped::with_update(vec![group], Count);
        a.set_grad(Some(Tensor::full(vec![2], 1.0, DType::F32, Device::Cpu).unwrap()));
        opt.step().unwrap();
        opt.step().unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![3.0, 3.0], "steps 1 + 2");
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![10.0, 10.0], "no gradient: untouched");
        let names: Vec<String> = opt.state_tensors().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["state.seen.a"], "state only for the parameter that stepped");
        let meta = opt.state_meta();
        assert_eq!(meta.steps.get("a"), Some(&2));
        let mut again = Grouped::with_update(opt.param_groups().to_vec(), Count);
        again.load_state_meta(&meta).unwrap();
        again.load_state_tensors(&opt.state_tensors().into_iter().collect()).unwrap();
        assert_eq!(again.state_meta().steps, meta.steps);
        assert_eq!(again.state_tensors()[0].1.to_vec::<f32>().unwrap(), vec![2.0, 2.0]);
    }
}

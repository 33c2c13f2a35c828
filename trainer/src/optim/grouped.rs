//! The part every optimizer shares: parameter groups, per-parameter state buffers, the state dict
//! and group metadata. An optimizer supplies only its per-tensor update ([`TensorUpdate`]);
//! [`Grouped`] walks the groups in order, skips parameters without a gradient and keeps the rest.

use std::collections::HashMap;

use ptl_autograd::{DType, DeviceScalars, Tensor};

use super::groups::{NamedParam, OptimizerName, ParamGroup};
use super::state::{apply_groups_meta, groups_meta, OptimizerMeta, ParamStates};
use super::{present_grad, NativeNs, NsRunner, Optimizer};
use crate::error::Result;

/// One optimizer's update of one parameter, given its group, its present gradient and the
/// optimizer's per-parameter state (buffers created on first use, updated in place).
pub trait TensorUpdate: Send {
    /// Which optimizer this is.
    fn kind(&self) -> OptimizerName;
    /// The state buffers it keeps per parameter, in state-dict order.
    fn state_keys(&self) -> &'static [&'static str];
    /// Whether it counts steps per parameter (saved in the metadata).
    fn counts_steps(&self) -> bool {
        false
    }
    /// Updates one parameter with its gradient.
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
    /// How many scalars per group the rule reads from device memory each step (0: none, the
    /// host-scalar [`TensorUpdate::update_group`] runs). With some, [`Grouped`] writes every
    /// group's [`TensorUpdate::write_scalars`] with one host→device copy before the updates and
    /// runs [`TensorUpdate::update_group_dev`]: a recorded update then reads each step's learning
    /// rate, momentum and decay (docs/capture.md §16) instead of the ones it was recorded with.
    fn device_scalars(&self) -> usize {
        0
    }
    /// The group's scalars for this step (`out.len()` = [`TensorUpdate::device_scalars`]), in the
    /// order [`TensorUpdate::update_group_dev`] reads them.
    fn write_scalars(&self, _group: &ParamGroup, _out: &mut [f64]) {}
    /// [`TensorUpdate::update_group`] with the group's scalars read from `s`; the same bytes. A
    /// set `s.skip` flag (16-mixed's found-inf) means no write at all: a rule overriding this
    /// passes it to its device ops, so the decision stays on the device. This default decides by
    /// a host read.
    /// `ns` runs the group's Newton–Schulz (MuSGD's Muon groups), natively or as a plugin's site.
    fn update_group_dev(
        &self,
        group: &ParamGroup,
        params: &[(&NamedParam, Tensor)],
        state: &mut ParamStates,
        s: DeviceScalars<'_>,
        ns: &dyn NsRunner,
    ) -> Result<()> {
        let _ = ns;
        if s.skipped_on_host()? {
            return Ok(());
        }
        self.update_group(group, params, state)
    }
    /// Its own scalars in the checkpoint metadata.
    fn write_meta(&self, _meta: &mut OptimizerMeta) {}
    /// Takes optimizer-level scalars from a checkpoint.
    fn read_meta(&mut self, _meta: &OptimizerMeta) {}
}

/// An optimizer over named parameter groups with the per-tensor update `U`.
pub struct Grouped<U> {
    groups: Vec<ParamGroup>,
    state: ParamStates,
    update: U,
    /// The step's device scalars, [`TensorUpdate::device_scalars`] per group in group order, on the
    /// parameters' device (made at the first step; rewritten from the groups every step, never saved).
    scalars: Option<Tensor>,
}

impl<U: TensorUpdate> Grouped<U> {
    /// The optimizer over `groups` with the per-tensor rule `update`.
    pub fn with_update(groups: Vec<ParamGroup>, update: U) -> Self {
        Grouped { groups, state: ParamStates::default(), update, scalars: None }
    }

    /// Writes every group's scalars for this step into the device vector (one host→device copy),
    /// making it on `device` first; `None` when the rule reads none.
    fn write_step_scalars(&mut self, device: ptl_autograd::Device) -> Result<Option<&Tensor>> {
        let n = self.update.device_scalars();
        if n == 0 {
            return Ok(None);
        }
        let mut host = vec![0.0; n * self.groups.len()];
        for (g, out) in self.groups.iter().zip(host.chunks_mut(n)) {
            self.update.write_scalars(g, out);
        }
        let fits = self.scalars.as_ref().is_some_and(|t| t.device() == device && t.numel() == host.len());
        if !fits {
            self.scalars = Some(Tensor::zeros(vec![host.len()], DType::F64, device)?);
        }
        let t = self.scalars.as_ref().ok_or_else(|| crate::error::TrainerError::InvalidArgument {
            what: "optimizer scalars",
            reason: "the device vector was not made".into(),
        })?;
        t.write_f64(0, &host)?;
        Ok(Some(t))
    }
    /// The per-parameter state.
    pub fn state(&self) -> &ParamStates {
        &self.state
    }

    /// Every group's update over its present gradients, skipped on the device when `skip` (an f32
    /// flag) is set — only for rules with device scalars; the others never get a flag here.
    fn run_updates(&mut self, skip: Option<&Tensor>, ns: &dyn NsRunner) -> Result<()> {
        let n = self.update.device_scalars();
        let Grouped { groups, state, update, scalars } = self;
        for (gi, g) in groups.iter().enumerate() {
            let mut present = Vec::with_capacity(g.params.len());
            for p in g.params.iter() {
                if let Some(grad) = present_grad(p)? {
                    present.push((p, grad));
                }
            }
            match scalars.as_ref().filter(|_| n > 0) {
                Some(values) => update.update_group_dev(g, &present, state, DeviceScalars::new(values, gi * n).skipping_if(skip), ns)?,
                None => update.update_group(g, &present, state)?,
            }
        }
        Ok(())
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
        self.prepare_step()?;
        self.step_prepared(&NativeNs)
    }
    fn prepare_step(&mut self) -> Result<()> {
        let device = self.groups.iter().flat_map(|g| &g.params).map(|p| p.tensor.device()).next();
        if let Some(device) = device {
            self.write_step_scalars(device)?;
        }
        Ok(())
    }
    fn step_prepared(&mut self, ns: &dyn NsRunner) -> Result<()> {
        self.run_updates(None, ns)
    }
    fn is_capturable(&self) -> bool {
        self.update.device_scalars() > 0
    }
    fn step_prepared_unless(&mut self, found_inf: &Tensor, ns: &dyn NsRunner) -> Result<()> {
        match self.is_capturable() {
            true => self.run_updates(Some(found_inf), ns),
            false if found_inf.item()? != 0.0 => Ok(()),
            false => self.run_updates(None, ns),
        }
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
            self.state.set_steps(&meta.steps)?;
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

#[cfg(test)]
mod device_scalar_tests {
    use super::*;
    use crate::optim::groups::{NsPrecision, ParamKind};
    use crate::optim::musgd::MuSgdUpdate;
    use crate::optim::sgd::SgdUpdate;
    use ptl_autograd::{module::parameter, DType, Device, Rng};

    /// A rule with its scalars on the host: the reference the device-scalar path must match.
    struct HostOnly<U>(U);

    impl<U: TensorUpdate> TensorUpdate for HostOnly<U> {
        fn kind(&self) -> OptimizerName {
            self.0.kind()
        }
        fn counts_steps(&self) -> bool {
            self.0.counts_steps()
        }
        fn state_keys(&self) -> &'static [&'static str] {
            self.0.state_keys()
        }
        fn update(&self, g: &ParamGroup, p: &NamedParam, grad: &Tensor, state: &mut ParamStates) -> Result<()> {
            self.0.update(g, p, grad, state)
        }
        fn update_group(&self, g: &ParamGroup, params: &[(&NamedParam, Tensor)], state: &mut ParamStates) -> Result<()> {
            self.0.update_group(g, params, state)
        }
    }

    fn groups(rng: &mut Rng) -> Vec<ParamGroup> {
        let group = |kind, wd: f64, use_muon: bool, shapes: &[&[usize]], rng: &mut Rng| ParamGroup {
            kind,
            boosted: false,
            lr: 0.01,
            initial_lr: 0.01,
            momentum: Some(0.937),
            betas: None,
            eps: 1e-8,
            weight_decay: wd,
            nesterov: true,
            use_muon,
            params: shapes
                .iter()
                .enumerate()
                .map(|(i, s)| NamedParam {
                    name: format!("{kind:?}.{i}"),
                    tensor: parameter(Tensor::rand(s.to_vec(), -1.0, 1.0, DType::F32, Device::Cpu, rng).unwrap()).unwrap(),
                })
                .collect(),
        };
        vec![
            group(ParamKind::Weight, 5e-4, true, &[&[8, 4, 3, 3], &[8, 4, 3, 3], &[16, 8, 1, 1]], rng),
            group(ParamKind::Bn, 0.0, false, &[&[8], &[16]], rng),
            group(ParamKind::Bias, 0.0, false, &[&[16]], rng),
        ]
    }

    /// SGD, MuSGD and AdamW read their step's scalars from the device vector (`update_group_dev`;
    /// AdamW its step counts too) and end with the bytes of the host-scalar path — parameters,
    /// every state buffer and the step counts — over three steps whose learning rate and momentum
    /// change (warm-up) and with one parameter without a gradient in a step.
    #[test]
    fn device_scalars_give_the_host_scalar_bytes() {
        use crate::optim::adamw::AdamWUpdate;
        for rule in ["sgd", "musgd", "adamw"] {
            let mut rng = Rng::new(4);
            let (ga, gb) = (groups(&mut rng), groups(&mut Rng::new(4)));
            let grads: Vec<Vec<Tensor>> = (0..3)
                .map(|_| {
                    ga.iter()
                        .flat_map(|g| &g.params)
                        .map(|p| Tensor::rand(p.tensor.dims().to_vec(), -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap())
                        .collect()
                })
                .collect();
            let musgd = || MuSgdUpdate { muon_factor: 0.2, sgd_factor: 1.0, ns_precision: NsPrecision::F32 };
            let (mut dev, mut host): (Box<dyn Optimizer>, Box<dyn Optimizer>) = match rule {
                "musgd" => (Box::new(Grouped::with_update(ga, musgd())), Box::new(Grouped::with_update(gb, HostOnly(musgd())))),
                "adamw" => (Box::new(Grouped::with_update(ga, AdamWUpdate)), Box::new(Grouped::with_update(gb, HostOnly(AdamWUpdate)))),
                _ => (Box::new(Grouped::with_update(ga, SgdUpdate)), Box::new(Grouped::with_update(gb, HostOnly(SgdUpdate)))),
            };
            for (step, gs) in grads.iter().enumerate() {
                for opt in [&mut dev, &mut host] {
                    for g in opt.param_groups_mut() {
                        g.lr = 0.01 * (step + 1) as f64;
                        g.momentum = Some(0.8 + 0.05 * step as f64);
                    }
                    let params: Vec<Tensor> = opt.param_groups().iter().flat_map(|g| &g.params).map(|p| p.tensor.clone()).collect();
                    for (k, (p, g)) in params.iter().zip(gs).enumerate() {
                        p.set_grad((step != 1 || k != 2).then(|| g.clone()));
                    }
                    opt.step().unwrap();
                }
            }
            let bytes = |o: &dyn Optimizer| -> Vec<(String, Vec<u8>)> {
                let ps = o.param_groups().iter().flat_map(|g| &g.params).map(|p| (p.name.clone(), p.tensor.to_bytes().unwrap()));
                ps.chain(o.state_tensors().into_iter().map(|(n, t)| (n, t.to_bytes().unwrap()))).collect()
            };
            assert_eq!(bytes(dev.as_ref()), bytes(host.as_ref()), "{rule}");
            assert_eq!(dev.state_meta().steps, host.state_meta().steps, "{rule}: step counts");
            assert!(dev.is_capturable() && !host.is_capturable(), "{rule}");
        }
    }
}

//! MuSGD (Ultralytics `ultralytics/optim/muon.py`, docs/training.md §3.4): Muon groups get an
//! orthogonalised momentum update scaled by `muon_factor` **plus** an SGD-Nesterov update scaled by
//! `sgd_factor` (separate buffers); other groups get plain SGD-Nesterov.

use ptl_autograd::{DeviceScalars, Tensor};

use super::grouped::{Grouped, TensorUpdate};
use super::groups::{NamedParam, NsPrecision, OptimizerName, ParamGroup};
use super::newton_schulz::{orthogonalized_update, orthogonalized_updates, NsRunner};
use super::sgd::{sgd_step, sgd_update, MOMENTUM_BUFFER};
use super::state::{OptimizerMeta, ParamStates};
use crate::error::Result;

/// Key of the separate SGD buffer of Muon parameters (the Muon momentum uses [`MOMENTUM_BUFFER`]).
pub const MOMENTUM_BUFFER_SGD: &str = "momentum_buffer_SGD";

/// Ultralytics' factors: `muon = 0.2`, `sgd = 1.0`.
pub const MUON_FACTOR: f64 = 0.2;
/// Weight of MuSGD's SGD update.
pub const SGD_FACTOR: f64 = 1.0;

/// Muon momentum and Nesterov blend, in place on `momentum`: M ← lerp(M, g, 1−β);
/// returns U = lerp(g, M, β) (or M without Nesterov).
pub fn muon_momentum(grad: &Tensor, momentum: &Tensor, beta: f64, nesterov: bool) -> Result<Tensor> {
    Ok(Tensor::momentum_blend_composed(grad, momentum, beta, nesterov)?)
}

/// The parameter half of a Muon-group step, in place: `p ← p − lr·muon_factor·o`, then the SGD
/// part with its own buffer (weight decay on the already-updated `p`), scaled by `sgd_factor`.
#[allow(clippy::too_many_arguments)]
pub fn muon_apply(
    p: &Tensor,
    grad: &Tensor,
    o: &Tensor,
    sgd_buf: &Tensor,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    nesterov: bool,
    muon_factor: f64,
    sgd_factor: f64,
) -> Result<()> {
    muon_step(p, o, lr, muon_factor)?;
    sgd_update(p, grad, sgd_buf, lr, momentum, weight_decay, nesterov, sgd_factor)
}

/// The Muon half alone, in place: `p ← p − lr·muon_factor·o`.
fn muon_step(p: &Tensor, o: &Tensor, lr: f64, muon_factor: f64) -> Result<()> {
    Ok(ptl_autograd::no_grad(|| p.copy_(&p.add(&o.mul_scalar(-(lr * muon_factor))?)?))?)
}

/// MuSGD over Ultralytics' groups (Muon groups flagged `use_muon`).
pub type MuSgd = Grouped<MuSgdUpdate>;

/// MuSGD's per-tensor update and its factors.
pub struct MuSgdUpdate {
    /// Weight of the Muon update (0.2).
    pub muon_factor: f64,
    /// Weight of the SGD update (1.0).
    pub sgd_factor: f64,
    /// Newton–Schulz's arithmetic.
    pub ns_precision: NsPrecision,
}

impl MuSgd {
    /// MuSGD over `groups`.
    pub fn new(groups: Vec<ParamGroup>, ns_precision: NsPrecision) -> Self {
        Grouped::with_update(groups, MuSgdUpdate { muon_factor: MUON_FACTOR, sgd_factor: SGD_FACTOR, ns_precision })
    }
}

impl TensorUpdate for MuSgdUpdate {
    fn kind(&self) -> OptimizerName {
        OptimizerName::MuSgd
    }
    fn state_keys(&self) -> &'static [&'static str] {
        &[MOMENTUM_BUFFER, MOMENTUM_BUFFER_SGD]
    }
    fn update(&self, g: &ParamGroup, p: &NamedParam, grad: &Tensor, state: &mut ParamStates) -> Result<()> {
        let mu = g.momentum.unwrap_or(0.0);
        if g.use_muon {
            let m = state.get_or_zeros(&p.name, MOMENTUM_BUFFER, &p.tensor)?;
            let b = state.get_or_zeros(&p.name, MOMENTUM_BUFFER_SGD, &p.tensor)?;
            let u = muon_momentum(grad, &m, mu, g.nesterov)?;
            let o = orthogonalized_update(&u, self.ns_precision)?;
            muon_apply(&p.tensor, grad, &o, &b, g.lr, mu, g.weight_decay, g.nesterov, self.muon_factor, self.sgd_factor)
        } else {
            let buf = state.get_or_zeros(&p.name, MOMENTUM_BUFFER, &p.tensor)?;
            sgd_update(&p.tensor, grad, &buf, g.lr, mu, g.weight_decay, g.nesterov, 1.0)
        }
    }
    fn device_scalars(&self) -> usize {
        7
    }
    /// `[wd, μ, −lr·f]` of the group's SGD step (f = 1, or `sgd_factor` in a Muon group), β = μ of
    /// the Muon blend, and `[0, 0, −lr·muon_factor]` of the Muon step — as `sgd_step` computes them.
    fn write_scalars(&self, g: &ParamGroup, out: &mut [f64]) {
        let mu = g.momentum.unwrap_or(0.0);
        let f = if g.use_muon { self.sgd_factor } else { 1.0 };
        let sgd = sgd_step(g.lr, mu, g.weight_decay, g.nesterov, f);
        let muon = sgd_step(g.lr, 0.0, 0.0, false, self.muon_factor);
        out.copy_from_slice(&[sgd.weight_decay, sgd.momentum, sgd.neg_lr, mu, muon.weight_decay, muon.momentum, muon.neg_lr]);
    }
    /// The group's update with the scalars of [`TensorUpdate::write_scalars`] read from `s`: Muon
    /// groups in three passes — every momentum blend, then Newton–Schulz batched over the blends of
    /// one shape, then every parameter update — which leaves each parameter, buffer and blend as
    /// [`TensorUpdate::update`] one by one does (the passes touch disjoint tensors); other groups
    /// one fused SGD-Nesterov step.
    fn update_group_dev(
        &self,
        g: &ParamGroup,
        params: &[(&NamedParam, Tensor)],
        state: &mut ParamStates,
        s: DeviceScalars<'_>,
        ns: &dyn NsRunner,
    ) -> Result<()> {
        let at = |k: usize| s.offset(k);
        let decay = g.weight_decay != 0.0;
        if !g.use_muon {
            let bufs = params.iter().map(|(p, _)| state.get_or_zeros(&p.name, MOMENTUM_BUFFER, &p.tensor)).collect::<Result<Vec<_>>>()?;
            let items: Vec<(&Tensor, &Tensor, Option<&Tensor>)> =
                params.iter().zip(&bufs).map(|((p, grad), b)| (&p.tensor, grad, Some(b))).collect();
            return Ok(Tensor::sgd_step_many_dev(&items, at(0), decay, g.nesterov)?);
        }
        let mut momenta = Vec::with_capacity(params.len());
        let mut sgd_bufs = Vec::with_capacity(params.len());
        for (p, _) in params {
            momenta.push(state.get_or_zeros(&p.name, MOMENTUM_BUFFER, &p.tensor)?);
            sgd_bufs.push(state.get_or_zeros(&p.name, MOMENTUM_BUFFER_SGD, &p.tensor)?);
        }
        let pairs: Vec<(&Tensor, &Tensor)> = params.iter().zip(&momenta).map(|((_, grad), m)| (grad, m)).collect();
        let blends = Tensor::momentum_blend_many_dev(&pairs, at(3), g.nesterov)?;
        let directions = orthogonalized_updates(&blends, self.ns_precision, ns)?;
        let muon: Vec<(&Tensor, &Tensor, Option<&Tensor>)> =
            params.iter().zip(&directions).map(|((p, _), o)| (&p.tensor, o, None)).collect();
        Tensor::sgd_step_many_dev(&muon, at(4), false, false)?;
        let items: Vec<(&Tensor, &Tensor, Option<&Tensor>)> =
            params.iter().zip(&sgd_bufs).map(|((p, grad), b)| (&p.tensor, grad, Some(b))).collect();
        Ok(Tensor::sgd_step_many_dev(&items, at(0), decay, g.nesterov)?)
    }
    fn write_meta(&self, meta: &mut OptimizerMeta) {
        meta.muon_factor = Some(self.muon_factor);
        meta.sgd_factor = Some(self.sgd_factor);
    }
    fn read_meta(&mut self, meta: &OptimizerMeta) {
        if let Some(f) = meta.muon_factor {
            self.muon_factor = f;
        }
        if let Some(f) = meta.sgd_factor {
            self.sgd_factor = f;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::groups::ParamKind;
    use ptl_autograd::{module::parameter, DType, Device, Rng};

    /// The batched group update (momentum blends, Newton–Schulz per shape, updates) leaves every
    /// parameter and buffer with the bytes of the one-by-one update, over three steps, with
    /// parameters of shared and unique shapes and one without a gradient.
    #[test]
    fn the_batched_muon_group_update_equals_one_by_one() {
        let shapes = [vec![8, 4, 3, 3], vec![6, 5], vec![8, 4, 3, 3], vec![3, 7], vec![6, 5]];
        let mut rng = Rng::new(5);
        let init: Vec<Tensor> =
            shapes.iter().map(|s| Tensor::rand(s.clone(), -0.5, 0.5, DType::F32, Device::Cpu, &mut rng).unwrap()).collect();
        let grads: Vec<Vec<Tensor>> = (0..3)
            .map(|_| shapes.iter().map(|s| Tensor::rand(s.clone(), -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap()).collect())
            .collect();
        let rule = MuSgdUpdate { muon_factor: MUON_FACTOR, sgd_factor: SGD_FACTOR, ns_precision: NsPrecision::Bf16 };
        let run = |batched: bool| -> Vec<Vec<u8>> {
            let params: Vec<NamedParam> = init
                .iter()
                .enumerate()
                .map(|(i, t)| NamedParam { name: format!("p{i}"), tensor: parameter(t.deep_copy().unwrap()).unwrap() })
                .collect();
            let group = ParamGroup {
                kind: ParamKind::Weight,
                boosted: false,
                lr: 0.01,
                initial_lr: 0.01,
                momentum: Some(0.9),
                betas: None,
                eps: 1e-8,
                weight_decay: 5e-4,
                nesterov: true,
                use_muon: true,
                params: params.clone(),
            };
            let mut state = ParamStates::default();
            for step in &grads {
                // Parameter 3 has no gradient: absent from the present list, untouched.
                let present: Vec<(&NamedParam, Tensor)> =
                    params.iter().zip(step).filter(|(p, _)| p.name != "p3").map(|(p, g)| (p, g.clone())).collect();
                if batched {
                    let scalars = Tensor::zeros(vec![7], DType::F64, Device::Cpu).unwrap();
                    let mut host = [0.0; 7];
                    rule.write_scalars(&group, &mut host);
                    scalars.write_f64(0, &host).unwrap();
                    rule.update_group_dev(&group, &present, &mut state, DeviceScalars::new(&scalars, 0), &crate::optim::NativeNs).unwrap();
                } else {
                    for (p, g) in &present {
                        rule.update(&group, p, g, &mut state).unwrap();
                    }
                }
            }
            let mut out: Vec<Vec<u8>> = params.iter().map(|p| p.tensor.to_bytes().unwrap()).collect();
            out.extend(state.to_named(std::slice::from_ref(&group)).into_iter().map(|(_, t)| t.to_bytes().unwrap()));
            out
        };
        let (a, b) = (run(true), run(false));
        assert_eq!(a.len(), 5 + 2 * 4, "5 parameters, two buffers for each of the 4 with gradients");
        assert_eq!(a, b);
        assert_eq!(a[3], init[3].to_bytes().unwrap(), "no gradient: untouched");
    }
}

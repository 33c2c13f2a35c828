//! The RealNVP flow used by the RLE keypoint loss (docs/model.md §5.4), `model.23.flow_model.*`.
//!
//! Six affine coupling layers on ℝ² with alternating masks. [`RealNvp::log_prob`] maps data to
//! the latent (layers in reverse order) and returns `log N(z; 0, I) + log|det J|`.

use ptl_autograd::impl_module;
use ptl_autograd::module::join_name;
use ptl_autograd::{DType, Device, Module, Tensor, TensorKind};

use crate::nn::{Init, Linear};
use crate::{HeadsError, Result};

/// Hidden width of the scale/translation nets.
pub const FLOW_HIDDEN: usize = 64;
/// Number of coupling layers (rows of the mask buffer).
pub const FLOW_LAYERS: usize = 6;
/// Gain of the Xavier-uniform init of every flow Linear weight.
pub const FLOW_XAVIER_GAIN: f64 = 0.01;

/// `Linear(2→64) → SiLU → Linear(64→64) → SiLU → Linear(64→2) [→ Tanh]`
/// (state-dict indices 0, 2, 4 as in the reference `nn.Sequential`).
pub struct CouplingNet {
    /// First linear layer (2 → 64), state-dict index 0.
    pub l0: Linear,
    /// Second linear layer (64 → 64), index 2.
    pub l2: Linear,
    /// Last linear layer (64 → 2), index 4.
    pub l4: Linear,
    /// Scale nets end in Tanh, translation nets do not.
    pub tanh: bool,
}

impl CouplingNet {
    fn new(tanh: bool, init: &mut Init<'_>) -> Result<Self> {
        Ok(CouplingNet {
            l0: Linear::new_xavier(2, FLOW_HIDDEN, FLOW_XAVIER_GAIN, init)?,
            l2: Linear::new_xavier(FLOW_HIDDEN, FLOW_HIDDEN, FLOW_XAVIER_GAIN, init)?,
            l4: Linear::new_xavier(FLOW_HIDDEN, 2, FLOW_XAVIER_GAIN, init)?,
            tanh,
        })
    }

    /// The net's output for `x` (…, 2).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.l0.forward(x)?.silu()?;
        let h = self.l2.forward(&h)?.silu()?;
        let y = self.l4.forward(&h)?;
        Ok(if self.tanh { y.tanh()? } else { y })
    }
}

impl_module!(CouplingNet { "0" => one l0, "2" => one l2, "4" => one l4 });

/// RealNVP with buffers `loc` (2), `cov` (2×2), `mask` (6×2) and nets `s.{0..5}`, `t.{0..5}`.
pub struct RealNvp {
    /// Legacy prior mean (zeros), kept for checkpoint compatibility; unused.
    pub loc: Tensor,
    /// Legacy prior covariance (identity), kept for checkpoint compatibility; unused.
    pub cov: Tensor,
    /// Coupling masks `[[0,1],[1,0]] × 3`.
    pub mask: Tensor,
    /// The scale nets, one per coupling layer.
    pub s: Vec<CouplingNet>,
    /// The translation nets, one per coupling layer.
    pub t: Vec<CouplingNet>,
}

impl RealNvp {
    /// Builds the flow with the reference init (Xavier-uniform gain 0.01 weights, default biases).
    /// All nets `s` are drawn before all nets `t`, as the reference constructs them.
    pub fn new(init: &mut Init<'_>) -> Result<Self> {
        let dev = init.device;
        let mask: Vec<f32> = (0..FLOW_LAYERS).flat_map(|j| if j % 2 == 0 { [0.0, 1.0] } else { [1.0, 0.0] }).collect();
        let s = (0..FLOW_LAYERS).map(|_| CouplingNet::new(true, init)).collect::<Result<Vec<_>>>()?;
        let t = (0..FLOW_LAYERS).map(|_| CouplingNet::new(false, init)).collect::<Result<Vec<_>>>()?;
        Ok(RealNvp {
            loc: Tensor::zeros(2, DType::F32, dev)?,
            cov: Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 1.0], vec![2, 2], dev)?,
            mask: Tensor::from_vec(mask, vec![FLOW_LAYERS, 2], dev)?,
            s,
            t,
        })
    }

    /// The device the flow's tensors are on.
    pub fn device(&self) -> Device {
        self.mask.device()
    }

    /// Data → latent: returns `(z (N,2), log|det J| (N))`, layers applied in reverse order.
    pub fn backward_p(&self, e: &Tensor) -> Result<(Tensor, Tensor)> {
        if e.rank() != 2 || e.dims()[1] != 2 {
            return Err(HeadsError::input("RealNvp::log_prob", format!("expected (N, 2) residuals, got {:?}", e.dims())));
        }
        // The flow runs in float32 whatever the caller's precision.
        let mut z = if e.dtype() == DType::F32 { e.clone() } else { e.to_dtype(DType::F32)? };
        let n = z.dims()[0];
        let mut logdet: Option<Tensor> = None;
        let mask = self.mask.detach();
        for j in (0..self.s.len()).rev() {
            let m = mask.narrow(0, j, 1)?; // (1, 2)
            let inv = m.affine(-1.0, 1.0)?;
            let z_ = z.mul(&m)?;
            let s = self.s[j].forward(&z_)?.mul(&inv)?;
            let t = self.t[j].forward(&z_)?.mul(&inv)?;
            z = inv.mul(&z.sub(&t)?)?.mul(&s.neg()?.exp()?)?.add(&z_)?;
            let ssum = s.sum_dim(1, false)?;
            logdet = Some(match logdet {
                None => ssum.neg()?,
                Some(l) => l.sub(&ssum)?,
            });
        }
        let logdet = match logdet {
            Some(l) => l,
            None => Tensor::zeros(n, DType::F32, z.device())?,
        };
        Ok((z, logdet))
    }

    /// `log p(e)` for residuals `e` of shape (N, 2) → (N): `−½‖z‖² − ln(2π) + log|det J|`.
    pub fn log_prob(&self, e: &Tensor) -> Result<Tensor> {
        let (z, logdet) = self.backward_p(e)?;
        let ln2pi = (2.0 * std::f64::consts::PI).ln();
        Ok(z.square()?.sum_dim(1, false)?.affine(-0.5, -ln2pi)?.add(&logdet)?)
    }

    /// Number of parameter elements (53,784 for the reference flow).
    pub fn num_params(&self) -> usize {
        crate::nn::param_count(self)
    }
}

impl Module for RealNvp {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f(&join_name(prefix, "loc"), &self.loc, TensorKind::Buffer);
        f(&join_name(prefix, "cov"), &self.cov, TensorKind::Buffer);
        f(&join_name(prefix, "mask"), &self.mask, TensorKind::Buffer);
        let sp = join_name(prefix, "s");
        for (i, net) in self.s.iter().enumerate() {
            net.visit(&join_name(&sp, &i.to_string()), f);
        }
        let tp = join_name(prefix, "t");
        for (i, net) in self.t.iter().enumerate() {
            net.visit(&join_name(&tp, &i.to_string()), f);
        }
    }
    fn set_training(&mut self, _training: bool) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use ptl_autograd::Rng;

    fn flow() -> RealNvp {
        let mut rng = Rng::new(7);
        let mut init = Init { rng: &mut rng, device: Device::Cpu };
        RealNvp::new(&mut init).expect("flow")
    }

    #[test]
    fn names_and_count() {
        let f = flow();
        let sd = ptl_autograd::module::state_dict(&f);
        assert_eq!(sd[0].0, "loc");
        assert_eq!(sd[2].0, "mask");
        assert_eq!(sd[3].0, "s.0.0.weight");
        assert_eq!(sd.last().map(|e| e.0.as_str()), Some("t.5.4.bias"));
        assert_eq!(f.num_params(), 53_784);
    }

    #[test]
    fn identity_flow_is_standard_normal() {
        let f = flow();
        // Zero every net's last layer → s = t = 0 → z = e, logdet = 0.
        for net in f.s.iter().chain(&f.t) {
            ptl_autograd::no_grad(|| {
                net.l4.weight.copy_(&net.l4.weight.zeros_like().expect("z")).expect("copy");
                net.l4.bias.copy_(&net.l4.bias.zeros_like().expect("z")).expect("copy");
            });
        }
        let e = Tensor::from_vec(vec![0.0f32, 0.0, 1.0, -2.0], vec![2, 2], Device::Cpu).expect("e");
        let lp = f.log_prob(&e).expect("lp").to_vec::<f32>().expect("v");
        let c = -(2.0 * std::f64::consts::PI).ln();
        assert!((lp[0] as f64 - c).abs() < 1e-6);
        assert!((lp[1] as f64 - (c - 2.5)).abs() < 1e-5);
    }
}

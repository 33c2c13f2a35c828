//! Primitive layers with PyTorch names and default initialisation: `Conv2d`, `BatchNorm2d`,
//! `Conv` (Conv2d + BN + optional SiLU, Ultralytics' `Conv`), `Linear`.
//!
//! Parameters are created once and never replaced (loading copies into them), so their storage
//! addresses are stable for the life of the model.

use ptl_autograd::impl_module;
use ptl_autograd::module::{join_name, parameter};
use ptl_autograd::{BatchNormOptions, DType, Device, Module, Rng, Tensor, TensorKind};

use crate::Result;

/// BatchNorm epsilon used by every BN of the model (Ultralytics `initialize_weights`).
pub const BN_EPS: f64 = 1e-3;
/// BatchNorm momentum (PyTorch convention: weight of the new batch statistic).
pub const BN_MOMENTUM: f64 = 0.03;

/// Where and how parameters are created.
pub struct Init<'a> {
    /// The generator the weights are drawn from.
    pub rng: &'a mut Rng,
    /// The device the weights are made on.
    pub device: Device,
}

/// `U(-bound, bound)` as f32 on `device`.
pub fn uniform(shape: &[usize], bound: f64, device: Device, rng: &mut Rng) -> Result<Tensor> {
    Ok(Tensor::rand(shape.to_vec(), -bound, bound, DType::F32, device, rng)?)
}

/// PyTorch's default Conv2d/Linear weight init: kaiming-uniform with a = √5, i.e.
/// `U(±1/√fan_in)`.
pub fn kaiming_uniform_a_sqrt5(shape: &[usize], fan_in: usize, device: Device, rng: &mut Rng) -> Result<Tensor> {
    uniform(shape, 1.0 / (fan_in.max(1) as f64).sqrt(), device, rng)
}

/// Xavier-uniform: `U(±gain·√(6/(fan_in+fan_out)))`.
pub fn xavier_uniform(shape: &[usize], fan_in: usize, fan_out: usize, gain: f64, device: Device, rng: &mut Rng) -> Result<Tensor> {
    uniform(shape, gain * (6.0 / (fan_in + fan_out) as f64).sqrt(), device, rng)
}

/// Casts a parameter to the activation dtype when they differ (autocast-style execution: f32
/// master weights, half-precision compute). Gradients flow back to the f32 parameter.
pub(crate) fn cast_like(p: &Tensor, x: &Tensor) -> Result<Tensor> {
    if p.dtype() == x.dtype() {
        Ok(p.clone())
    } else {
        // Under `autocast_with_weights` the copy made up front for the whole forward.
        Ok(ptl_autograd::cast_weight(p, x.dtype())?)
    }
}

/// `nn.Conv2d` (dilation 1, "same" padding k/2), optional bias.
pub struct Conv2d {
    /// Kernel, (c_out, c_in / groups, k, k).
    pub weight: Tensor,
    /// Bias, when the layer has one.
    pub bias: Option<Tensor>,
    /// Stride in both directions.
    pub stride: usize,
    /// Padding on every side (k / 2).
    pub padding: usize,
    /// Groups (c_in for depthwise).
    pub groups: usize,
}

impl Conv2d {
    /// A `k`×`k` convolution from `c1` to `c2` channels with same padding, weights (and bias) drawn from `init` as PyTorch's default.
    pub fn new(c1: usize, c2: usize, k: usize, stride: usize, groups: usize, bias: bool, init: &mut Init<'_>) -> Result<Self> {
        if groups == 0 || c1 % groups != 0 || c2 % groups != 0 {
            return Err(crate::HeadsError::Config(format!("Conv2d {c1}->{c2} cannot use {groups} groups")));
        }
        let fan_in = c1 / groups * k * k;
        let weight = parameter(kaiming_uniform_a_sqrt5(&[c2, c1 / groups, k, k], fan_in, init.device, init.rng)?)?;
        let bias = if bias { Some(parameter(kaiming_uniform_a_sqrt5(&[c2], fan_in, init.device, init.rng)?)?) } else { None };
        Ok(Conv2d { weight, bias, stride, padding: k / 2, groups })
    }

    /// Input channels.
    pub fn c_in(&self) -> usize {
        self.weight.dims()[1] * self.groups
    }
    /// Output channels.
    pub fn c_out(&self) -> usize {
        self.weight.dims()[0]
    }
    /// Kernel size.
    pub fn kernel(&self) -> usize {
        self.weight.dims()[2]
    }

    /// The convolution of `x` (under autocast in the compute dtype).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (s, p) = ((self.stride, self.stride), (self.padding, self.padding));
        // Under `ptl_autograd::autocast` the convolution itself casts to the compute dtype.
        let w = cast_like(&self.weight, x)?;
        let b = match &self.bias {
            Some(b) => Some(cast_like(b, x)?),
            None => None,
        };
        Ok(x.conv2d(&w, b.as_ref(), s, p, self.groups)?)
    }
}

impl Module for Conv2d {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f(&join_name(prefix, "weight"), &self.weight, TensorKind::Parameter);
        if let Some(b) = &self.bias {
            f(&join_name(prefix, "bias"), b, TensorKind::Parameter);
        }
    }
    fn set_training(&mut self, _training: bool) {}
}

/// `nn.BatchNorm2d` with eps 1e-3 and momentum 0.03; tracks `num_batches_tracked` (int64).
pub struct BatchNorm2d {
    /// Scale γ per channel.
    pub weight: Tensor,
    /// Shift β per channel.
    pub bias: Tensor,
    /// Running mean per channel.
    pub running_mean: Tensor,
    /// Running (unbiased) variance per channel.
    pub running_var: Tensor,
    /// Batches seen in training (i64).
    pub num_batches_tracked: Tensor,
    /// Added to the variance (1e-3).
    pub eps: f64,
    /// Weight of a batch in the running statistics (0.03).
    pub momentum: f64,
    /// Training mode (batch statistics).
    pub training: bool,
}

impl BatchNorm2d {
    /// Batch norm over `c` channels on `device`: weight 1, bias 0, running mean 0 and variance 1.
    pub fn new(c: usize, device: Device) -> Result<Self> {
        Ok(BatchNorm2d {
            weight: parameter(Tensor::ones(c, DType::F32, device)?)?,
            bias: parameter(Tensor::zeros(c, DType::F32, device)?)?,
            running_mean: Tensor::zeros(c, DType::F32, device)?,
            running_var: Tensor::ones(c, DType::F32, device)?,
            num_batches_tracked: Tensor::zeros((), DType::I64, device)?,
            eps: BN_EPS,
            momentum: BN_MOMENTUM,
            training: true,
        })
    }

    /// Normalises `x` (batch statistics in training, counting the batch; running ones in eval).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let opts = BatchNormOptions { training: self.training, momentum: self.momentum, eps: self.eps };
        let y = x.batch_norm2d(&self.weight, &self.bias, &self.running_mean, &self.running_var, opts)?;
        if self.training {
            let one = Tensor::ones((), DType::I64, self.num_batches_tracked.device())?;
            self.num_batches_tracked.add_(&one)?;
        }
        Ok(y)
    }

    /// [`BatchNorm2d::forward`] followed by SiLU when `silu`, as one fused op
    /// ([`Tensor::batch_norm2d_fused`]: equal up to rounding, a few kernels instead of dozens).
    pub fn forward_fused(&self, x: &Tensor, silu: bool) -> Result<Tensor> {
        let opts = BatchNormOptions { training: self.training, momentum: self.momentum, eps: self.eps };
        // The statistics kernel counts the batch (training mode only).
        Ok(x.batch_norm2d_fused_tracked(
            &self.weight,
            &self.bias,
            &self.running_mean,
            &self.running_var,
            Some(&self.num_batches_tracked),
            opts,
            silu,
        )?)
    }

    /// `residual + forward_fused(x)`: a block's shortcut added to the normalised output, the
    /// same bytes as the addition after it, inside the normalisation's kernels where the backend
    /// can ([`Tensor::batch_norm2d_fused_add`]).
    pub fn forward_fused_add(&self, x: &Tensor, silu: bool, residual: &Tensor) -> Result<Tensor> {
        let opts = BatchNormOptions { training: self.training, momentum: self.momentum, eps: self.eps };
        Ok(x.batch_norm2d_fused_add(
            &self.weight,
            &self.bias,
            &self.running_mean,
            &self.running_var,
            Some(&self.num_batches_tracked),
            opts,
            silu,
            residual,
        )?)
    }
}

impl Module for BatchNorm2d {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f(&join_name(prefix, "weight"), &self.weight, TensorKind::Parameter);
        f(&join_name(prefix, "bias"), &self.bias, TensorKind::Parameter);
        f(&join_name(prefix, "running_mean"), &self.running_mean, TensorKind::Buffer);
        f(&join_name(prefix, "running_var"), &self.running_var, TensorKind::Buffer);
        f(&join_name(prefix, "num_batches_tracked"), &self.num_batches_tracked, TensorKind::Buffer);
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}

/// Ultralytics `Conv`: Conv2d (no bias, padding k/2) → BatchNorm2d → SiLU (or identity).
pub struct Conv {
    /// The convolution (no bias).
    pub conv: Conv2d,
    /// The batch norm.
    pub bn: BatchNorm2d,
    /// Whether SiLU follows.
    pub act: bool,
}

impl Conv {
    /// `Conv(c1, c2, k, s, g, act)`.
    pub fn new(c1: usize, c2: usize, k: usize, s: usize, g: usize, act: bool, init: &mut Init<'_>) -> Result<Self> {
        Ok(Conv { conv: Conv2d::new(c1, c2, k, s, g, false, init)?, bn: BatchNorm2d::new(c2, init.device)?, act })
    }
    /// `Conv(c1, c2, k, s)` with SiLU.
    pub fn silu(c1: usize, c2: usize, k: usize, s: usize, init: &mut Init<'_>) -> Result<Self> {
        Conv::new(c1, c2, k, s, 1, true, init)
    }
    /// `DWConv(c1, c2, k)`: groups = gcd(c1, c2), SiLU.
    pub fn dw(c1: usize, c2: usize, k: usize, init: &mut Init<'_>) -> Result<Self> {
        Conv::new(c1, c2, k, 1, gcd(c1, c2), true, init)
    }

    /// Conv, then BatchNorm (+SiLU) as one fused op on every device.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.bn.forward_fused(&self.conv.forward(x)?, self.act)
    }

    /// `residual + forward(x)` (a block's shortcut), the addition inside the batch norm's
    /// kernels where the backend can: one launch fewer per shortcut.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.bn.forward_fused_add(&self.conv.forward(x)?, self.act, residual)
    }
}

impl_module!(Conv { "conv" => one conv, "bn" => one bn });

/// Greatest common divisor.
pub fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `nn.Linear(in, out)`; weight `[out, in]`.
pub struct Linear {
    /// Weight, (out, in).
    pub weight: Tensor,
    /// Bias, (out).
    pub bias: Tensor,
}

impl Linear {
    /// PyTorch default init (kaiming-uniform a = √5 weight, `U(±1/√in)` bias).
    pub fn new(inp: usize, out: usize, init: &mut Init<'_>) -> Result<Self> {
        let weight = parameter(kaiming_uniform_a_sqrt5(&[out, inp], inp, init.device, init.rng)?)?;
        let bias = parameter(kaiming_uniform_a_sqrt5(&[out], inp, init.device, init.rng)?)?;
        Ok(Linear { weight, bias })
    }

    /// Weight drawn from Xavier-uniform with `gain` (bias still PyTorch default).
    pub fn new_xavier(inp: usize, out: usize, gain: f64, init: &mut Init<'_>) -> Result<Self> {
        // PyTorch draws the default weight and bias at construction, then re-draws the weight.
        let weight = parameter(xavier_uniform(&[out, inp], inp, out, gain, init.device, init.rng)?)?;
        let bias = parameter(kaiming_uniform_a_sqrt5(&[out], inp, init.device, init.rng)?)?;
        Ok(Linear { weight, bias })
    }

    /// `x·Wᵀ + b`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.linear(&self.weight, Some(&self.bias))?)
    }
}

impl Module for Linear {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f(&join_name(prefix, "weight"), &self.weight, TensorKind::Parameter);
        f(&join_name(prefix, "bias"), &self.bias, TensorKind::Parameter);
    }
    fn set_training(&mut self, _training: bool) {}
}

/// Number of parameter elements under a module.
pub fn param_count(m: &dyn Module) -> usize {
    let mut n = 0;
    m.visit("", &mut |_, t, k| {
        if k == TensorKind::Parameter {
            n += t.numel()
        }
    });
    n
}

/// Nearest-neighbour upsampling of an NCHW tensor by an integer factor (`nn.Upsample(scale_factor,
/// "nearest")`): the autograd op, one kernel forward and one backward.
pub fn upsample_nearest(x: &Tensor, factor: usize) -> Result<Tensor> {
    let d = x.dims();
    if d.len() != 4 || factor == 0 {
        return Err(crate::HeadsError::input("upsample_nearest", format!("expected NCHW and a factor ≥ 1, got {d:?} × {factor}")));
    }
    if factor == 1 {
        return Ok(x.clone());
    }
    Ok(x.upsample_nearest(factor)?)
}

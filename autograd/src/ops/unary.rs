//! Element-wise unary ops with their derivatives.

use crate::autograd::{record1, FnBackward};
use crate::backend::UnaryOp;
use crate::{Result, Tensor};

/// Element by element, so a channels-last tensor is computed as it lies and stays channels-last.
fn forward(x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    let s = x.raw_storage().unary(op)?;
    Tensor::from_storage_in(s, x.shape().clone(), x.memory_format())
}

/// Applies `op` and records `dx = g · dfdx(x, y)` where `dfdx` builds the local derivative.
fn unary_with_grad(
    x: &Tensor,
    op: UnaryOp,
    name: &'static str,
    dfdx: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    let y = forward(x, op)?;
    if !x.requires_grad() || !crate::is_grad_enabled() {
        return Ok(y);
    }
    let (xs, ys) = (x.detach(), y.detach());
    Ok(record1(
        &[x],
        y,
        FnBackward {
            name,
            f: move |g: &[Option<Tensor>]| {
                let g = g[0].as_ref().ok_or_else(|| crate::Error::Backward { msg: format!("{name}: missing gradient") })?;
                Ok(vec![Some(dfdx(g, &xs, &ys)?)])
            },
        },
    ))
}

impl Tensor {
    /// −x.
    pub fn neg(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Neg, "neg", |g, _, _| g.neg())
    }
    /// eˣ.
    pub fn exp(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Exp, "exp", |g, _, y| g.mul(y))
    }
    /// ln x.
    pub fn log(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Log, "log", |g, x, _| g.div(x))
    }
    /// √x.
    pub fn sqrt(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Sqrt, "sqrt", |g, _, y| g.div(y)?.affine(0.5, 0.0))
    }
    /// |x|.
    pub fn abs(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Abs, "abs", |g, x, _| g.mul(&forward(x, UnaryOp::Sign)?))
    }
    /// 1 / (1 + e⁻ˣ).
    pub fn sigmoid(&self) -> Result<Tensor> {
        // dy/dx = y (1 - y)
        unary_with_grad(self, UnaryOp::Sigmoid, "sigmoid", |g, _, y| g.mul(&y.mul(&y.affine(-1.0, 1.0)?)?))
    }
    /// x·sigmoid(x).
    pub fn silu(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Silu, "silu", |g, x, _| g.mul(&forward(x, UnaryOp::SiluGrad)?))
    }
    /// tanh x.
    pub fn tanh(&self) -> Result<Tensor> {
        // dy/dx = 1 - y²
        unary_with_grad(self, UnaryOp::Tanh, "tanh", |g, _, y| g.mul(&y.square()?.affine(-1.0, 1.0)?))
    }
    /// `log(1 + eˣ)` (PyTorch default beta 1, threshold 20).
    pub fn softplus(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Softplus, "softplus", |g, x, _| {
            let above = x.gt_scalar(20.0)?;
            let s = forward(x, UnaryOp::Sigmoid)?;
            g.mul(&above.where_cond(&s.ones_like()?, &s)?)
        })
    }
    /// atan x.
    pub fn atan(&self) -> Result<Tensor> {
        // dy/dx = 1 / (1 + x²)
        unary_with_grad(self, UnaryOp::Atan, "atan", |g, x, _| g.div(&x.square()?.affine(1.0, 1.0)?))
    }
    /// 1 / x.
    pub fn recip(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Recip, "recip", |g, _, y| g.mul(&y.square()?)?.neg())
    }
    /// x².
    pub fn square(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Square, "square", |g, x, _| g.mul(x)?.affine(2.0, 0.0))
    }
    /// max(x, 0).
    pub fn relu(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Relu, "relu", |g, x, _| g.mul(&x.gt_scalar(0.0)?.to_dtype(g.dtype())?))
    }
    /// `xᵖ` for a scalar exponent.
    pub fn powf(&self, p: f64) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Powf(p), "powf", move |g, x, _| g.mul(&forward(x, UnaryOp::Powf(p - 1.0))?.affine(p, 0.0)?))
    }
    /// Clamps into `[lo, hi]`; the gradient passes where `lo ≤ x ≤ hi` (as in PyTorch).
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        // f32 and f64 are clamped in their own precision, so with lo ≤ hi an element lies inside
        // [lo, hi] exactly when the clamp left it as it was (NaN: in neither): one comparison
        // instead of two scalar fills, two comparisons and their product — the same mask. Halves
        // are clamped in f32 and keep the two comparisons.
        let own_precision = matches!(self.dtype(), crate::DType::F32 | crate::DType::F64) && lo <= hi;
        unary_with_grad(self, UnaryOp::Clamp(lo, hi), "clamp", move |g, x, y| {
            let inside = match own_precision {
                true => y.eq(x)?,
                false => x.ge_scalar(lo)?.mul(&x.le_scalar(hi)?)?,
            };
            g.mul(&inside.to_dtype(g.dtype())?)
        })
    }
    /// max(x, lo).
    pub fn clamp_min(&self, lo: f64) -> Result<Tensor> {
        self.clamp(lo, f64::INFINITY)
    }
    /// min(x, hi).
    pub fn clamp_max(&self, hi: f64) -> Result<Tensor> {
        self.clamp(f64::NEG_INFINITY, hi)
    }
    /// `x · mul + add`.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Affine(mul, add), "affine", move |g, _, _| g.affine(mul, 0.0))
    }
    /// x + v.
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0, v)
    }
    /// x − v.
    pub fn sub_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0, -v)
    }
    /// x·v.
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(v, 0.0)
    }
    /// x / v.
    pub fn div_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0 / v, 0.0)
    }
    /// Sign (−1, 0, 1); its gradient is zero, as in PyTorch.
    pub fn sign(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Sign, "sign", |g, _, _| g.zeros_like())
    }
    /// ⌊x⌋ (its gradient is zero).
    pub fn floor(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Floor, "floor", |g, _, _| g.zeros_like())
    }
    /// ⌈x⌉ (its gradient is zero).
    pub fn ceil(&self) -> Result<Tensor> {
        unary_with_grad(self, UnaryOp::Ceil, "ceil", |g, _, _| g.zeros_like())
    }
}

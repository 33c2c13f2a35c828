//! Batch normalisation over NCHW with PyTorch's running-statistics rule.

use crate::autograd::{record, FnBackward};
use crate::{DType, Error, Result, Tensor};

/// Options of [`Tensor::batch_norm2d`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormOptions {
    /// Use batch statistics and update the running ones (train mode).
    pub training: bool,
    /// Weight of the new batch statistic in the running average (PyTorch convention).
    pub momentum: f64,
    /// Added to the variance.
    pub eps: f64,
}

impl Tensor {
    /// BatchNorm2d. In training the output uses the biased batch variance while `running_var`
    /// receives the unbiased one: `running ← (1 − m)·running + m·batch`.
    pub fn batch_norm2d(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        opts: BatchNormOptions,
    ) -> Result<Tensor> {
        let d = self.dims();
        if d.len() != 4 {
            return Err(Error::invalid("batch_norm2d", format!("expected NCHW input, got {d:?}")));
        }
        let c = d[1];
        for (name, t) in [("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)] {
            if t.dims() != [c] {
                return Err(Error::invalid("batch_norm2d", format!("{name} has shape {:?}, expected [{c}] for input {d:?}", t.dims())));
            }
        }
        // Half inputs normalise in f32 (statistics in low precision are useless) and cast back.
        if self.dtype().is_half() {
            let y = self.to_dtype(DType::F32)?.batch_norm2d(
                &weight.to_dtype(DType::F32)?,
                &bias.to_dtype(DType::F32)?,
                running_mean,
                running_var,
                opts,
            )?;
            return y.to_dtype(self.dtype());
        }
        let shape4 = vec![1, c, 1, 1];
        let (w4, b4) = (weight.reshape(shape4.clone())?, bias.reshape(shape4.clone())?);
        if !opts.training {
            let inv = crate::no_grad(|| running_var.to_dtype(self.dtype())?.add_scalar(opts.eps)?.sqrt()?.recip())?;
            let mean = running_mean.to_dtype(self.dtype())?.reshape(shape4.clone())?;
            return self.sub(&mean)?.mul(&inv.reshape(shape4)?)?.mul(&w4)?.add(&b4);
        }
        let n = d[0] * d[2] * d[3];
        if n < 2 {
            return Err(Error::invalid("batch_norm2d", format!("training needs more than one value per channel, got input {d:?}")));
        }
        let (y, xhat, invstd) = crate::no_grad(|| -> Result<(Tensor, Tensor, Tensor)> {
            let x = self.detach();
            let mean = x.mean_dims(&[0, 2, 3], true)?;
            let xc = x.sub(&mean)?;
            let var = xc.square()?.mean_dims(&[0, 2, 3], true)?;
            let invstd = var.add_scalar(opts.eps)?.sqrt()?.recip()?;
            let xhat = xc.mul(&invstd)?;
            let y = xhat.mul(&w4.detach())?.add(&b4.detach())?;
            // Running statistics (unbiased variance), updated in place to keep buffer addresses.
            let m = opts.momentum;
            let rm = running_mean.to_dtype(x.dtype())?.affine(1.0 - m, 0.0)?.add(&mean.reshape(vec![c])?.affine(m, 0.0)?)?;
            let unbiased = var.reshape(vec![c])?.affine(n as f64 / (n as f64 - 1.0), 0.0)?;
            let rv = running_var.to_dtype(x.dtype())?.affine(1.0 - m, 0.0)?.add(&unbiased.affine(m, 0.0)?)?;
            running_mean.copy_(&rm.to_dtype(running_mean.dtype())?)?;
            running_var.copy_(&rv.to_dtype(running_var.dtype())?)?;
            Ok((y, xhat, invstd))
        })?;
        if !(self.requires_grad() || weight.requires_grad() || bias.requires_grad()) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let wd = w4.detach();
        let needs = [self.requires_grad(), weight.requires_grad(), bias.requires_grad()];
        Ok(record(
            &[self, weight, bias],
            vec![y],
            FnBackward {
                name: "batch_norm2d",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None, None, None]) };
                    let dims = [0isize, 2, 3];
                    let gb = g.sum_dims(&dims, true)?;
                    let gxh = g.mul(&xhat)?.sum_dims(&dims, true)?;
                    let gx = if needs[0] {
                        // dx = invstd/N · (N·dx̂ − Σdx̂ − x̂·Σ(dx̂·x̂)) with dx̂ = g·w
                        let w_inv = wd.mul(&invstd)?.affine(1.0 / n as f64, 0.0)?;
                        let inner = g.affine(n as f64, 0.0)?.sub(&gb)?.sub(&xhat.mul(&gxh)?)?;
                        Some(inner.mul(&w_inv)?)
                    } else {
                        None
                    };
                    let gw = if needs[1] { Some(gxh.reshape(vec![c])?) } else { None };
                    let gbias = if needs[2] { Some(gb.reshape(vec![c])?) } else { None };
                    Ok(vec![gx, gw, gbias])
                },
            },
        )
        .remove(0))
    }
}

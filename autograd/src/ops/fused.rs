//! Fused BatchNorm2d + SiLU: forward in three kernels on CUDA (deterministic per-channel statistics,
//! a per-channel finish that also updates the running statistics, one affine+SiLU pass), backward
//! composed from primitives like every other op.

use crate::autograd::{record, FnBackward};
use crate::backend::stats_dtype;
use crate::{BatchNormOptions, Error, Result, Tensor};

impl Tensor {
    /// `silu(batch_norm2d(x))`, numerically the same as `x.batch_norm2d(..)?.silu()` (same
    /// running-statistics rule), with a fused forward.
    pub fn batch_norm2d_silu(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        opts: BatchNormOptions,
    ) -> Result<Tensor> {
        let d = self.dims().to_vec();
        if d.len() != 4 {
            return Err(Error::invalid("batch_norm2d_silu", format!("expected NCHW input, got {d:?}")));
        }
        let c = d[1];
        for (name, t) in [("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)] {
            if t.dims() != [c] {
                return Err(Error::invalid(
                    "batch_norm2d_silu",
                    format!("{name} has shape {:?}, expected [{c}] for input {d:?}", t.dims()),
                ));
            }
        }
        let sd = stats_dtype(self.dtype());
        let n = d[0] * d[2] * d[3];
        // Per-channel parameters in the statistics dtype: aff = [scale; shift], nrm = [invstd; −mean·invstd].
        let (aff, nrm) = crate::no_grad(|| -> Result<(Tensor, Tensor)> {
            let (w, b) = (weight.detach().to_dtype(sd)?, bias.detach().to_dtype(sd)?);
            if opts.training {
                if n < 2 {
                    return Err(Error::invalid(
                        "batch_norm2d_silu",
                        format!("training needs more than one value per channel, got input {d:?}"),
                    ));
                }
                let (rm, rv) = (running_mean.to_dtype(sd)?, running_var.to_dtype(sd)?);
                // Private copies when a cast was needed, so the update below writes through.
                let (a, q) = {
                    let x = self.read_storage();
                    let (ws, bs) = (w.read_storage(), b.read_storage());
                    let mut rms = rm.write_storage();
                    let mut rvs = rv.write_storage();
                    x.batch_norm_train_stats(&d, &ws, &bs, &mut rms, &mut rvs, opts.eps, opts.momentum)?
                };
                if rm.storage_ptr() != running_mean.storage_ptr() {
                    running_mean.copy_(&rm.to_dtype(running_mean.dtype())?)?;
                }
                if rv.storage_ptr() != running_var.storage_ptr() {
                    running_var.copy_(&rv.to_dtype(running_var.dtype())?)?;
                }
                Ok((Tensor::from_storage(a, vec![2 * c])?, Tensor::from_storage(q, vec![2 * c])?))
            } else {
                let (rm, rv) = (running_mean.to_dtype(sd)?, running_var.to_dtype(sd)?);
                let (a, q) =
                    w.read_storage().batch_norm_eval_params(&b.read_storage(), &rm.read_storage(), &rv.read_storage(), opts.eps)?;
                Ok((Tensor::from_storage(a, vec![2 * c])?, Tensor::from_storage(q, vec![2 * c])?))
            }
        })?;
        let y = {
            let s = self.read_storage().channel_affine(&d, &aff.read_storage(), true)?;
            Tensor::from_storage(s, d.clone())?
        };
        if !(self.requires_grad() || weight.requires_grad() || bias.requires_grad()) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let x = self.detach();
        let (wd, training) = (weight.detach(), opts.training);
        let needs = [self.requires_grad(), weight.requires_grad(), bias.requires_grad()];
        Ok(record(
            &[self, weight, bias],
            vec![y],
            FnBackward {
                name: "batch_norm2d_silu",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None, None, None]) };
                    let dims = [0isize, 2, 3];
                    let shape4 = vec![1, c, 1, 1];
                    let dt = x.dtype();
                    // Recompute the pre-activation and x̂ (one pass each), then SiLU' and BN backward.
                    let z = Tensor::from_storage(x.read_storage().channel_affine(&d, &aff.read_storage(), false)?, d.clone())?;
                    let xhat = Tensor::from_storage(x.read_storage().channel_affine(&d, &nrm.read_storage(), false)?, d.clone())?;
                    let gz = g.mul(&z.silu_grad()?)?;
                    let gb = gz.sum_dims(&dims, true)?;
                    let gxh = gz.mul(&xhat)?.sum_dims(&dims, true)?;
                    let invstd = nrm.narrow(0, 0, c)?.to_dtype(dt)?.reshape(shape4.clone())?;
                    let w4 = wd.to_dtype(dt)?.reshape(shape4)?;
                    let gx = if needs[0] {
                        if training {
                            // dx = invstd/N · (N·dx̂ − Σdx̂ − x̂·Σ(dx̂·x̂)) with dx̂ = gz·w
                            let w_inv = w4.mul(&invstd)?.affine(1.0 / n as f64, 0.0)?;
                            let inner = gz.affine(n as f64, 0.0)?.sub(&gb)?.sub(&xhat.mul(&gxh)?)?;
                            Some(inner.mul(&w_inv)?)
                        } else {
                            Some(gz.mul(&w4.mul(&invstd)?)?)
                        }
                    } else {
                        None
                    };
                    let gw = if needs[1] { Some(gxh.reshape(vec![c])?.to_dtype(wd.dtype())?) } else { None };
                    let gbias = if needs[2] { Some(gb.reshape(vec![c])?.to_dtype(wd.dtype())?) } else { None };
                    Ok(vec![gx, gw, gbias])
                },
            },
        )
        .remove(0))
    }

    /// Derivative of SiLU evaluated at `self` (no gradient of its own).
    pub(crate) fn silu_grad(&self) -> Result<Tensor> {
        let s = self.read_storage().unary(crate::backend::UnaryOp::SiluGrad)?;
        Tensor::from_storage(s, self.dims().to_vec())
    }
}

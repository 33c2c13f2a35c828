//! Global L2 gradient-norm clipping, PyTorch `clip_grad_norm_` semantics (docs/trainer.md §8):
//! absent gradients are skipped, the coefficient `min(1, max_norm / (total + 1e-6))` is always
//! multiplied in (no host read), gradients are scaled in place. f32 gradients on CUDA can take
//! multi-tensor kernels (`Tensor::clip_norm_many_`, a few launches), others the composed ops.

use ptl_autograd::{DType, Device, Tensor};

use crate::error::{Result, TrainerError};

/// Clips the gradients of `params` (walked in the given order) to a global L2 norm of `max_norm`
/// and returns the total norm before clipping as a 0-d tensor on the gradients' device (0 on the
/// host when no parameter has a gradient). Non-finite totals are not an error: they propagate
/// (the GradScaler then skips the step).
pub fn clip_grad_norm<'a>(params: impl IntoIterator<Item = &'a Tensor>, max_norm: f64) -> Result<Tensor> {
    let grads: Vec<Tensor> = params.into_iter().filter_map(|p| p.grad()).collect();
    ptl_autograd::no_grad(|| -> Result<Tensor> {
        let Some(first) = grads.first() else { return Ok(Tensor::scalar(0.0, DType::F32, Device::Cpu)?) };
        let device = first.device();
        // f32 CUDA gradients with the fused kernels on: a few multi-tensor launches.
        let refs: Vec<&Tensor> = grads.iter().collect();
        if let Some(total) = Tensor::clip_norm_many_(&refs, max_norm)? {
            return Ok(total);
        }
        let mut norms = Vec::with_capacity(grads.len());
        for g in &grads {
            if g.device() != device {
                return Err(TrainerError::InvalidArgument {
                    what: "clip_grad_norm",
                    reason: format!("gradients on {} and {}", device, g.device()),
                });
            }
            // Per-tensor norm in f32 (as `_foreach_norm`), the sum of squares accumulated by the backend.
            norms.push(g.to_dtype(DType::F32)?.square()?.sum_all()?.sqrt()?.reshape(vec![1])?);
        }
        let refs: Vec<&Tensor> = norms.iter().collect();
        let total = Tensor::cat(&refs, 0)?.square()?.sum_all()?.sqrt()?;
        let coef = total.add_scalar(1e-6)?.recip()?.mul_scalar(max_norm)?.clamp_max(1.0)?;
        for g in &grads {
            let c = coef.to_dtype(g.dtype())?;
            g.copy_(&g.mul(&c)?)?;
        }
        Ok(total)
    })
}

/// [`clip_grad_norm`] over named parameters.
pub fn clip_grad_norm_named(params: &[(String, Tensor)], max_norm: f64) -> Result<Tensor> {
    clip_grad_norm(params.iter().map(|(_, t)| t), max_norm)
}

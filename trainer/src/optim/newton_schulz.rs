//! Quintic Newton–Schulz orthogonalisation (training.md §3.5), written with tensor ops so it runs on
//! the parameter's device. In [`NsPrecision::Bf16`] values are rounded to bfloat16 exactly where the
//! reference rounds: the input, the norm, the normalised X, the Gram matrix A = X·Xᵀ, and the two
//! fused `baddbmm` results B = b·A + c·A·A and X = a·X + B·X (products accumulated in f32, one
//! rounding each). This reproduces the goldens' `ns_out_bf16` bit for bit on most matrices; the
//! rest differ only through f32 summation order.

use ptl_autograd::{DType, Tensor};

use super::groups::NsPrecision;
use crate::error::{Result, TrainerError};

/// (a, b, c) of the quintic iteration.
pub const NS_COEFFS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);
/// Number of iterations.
pub const NS_STEPS: usize = 5;
/// Added to the Frobenius norm before normalising.
pub const NS_EPS: f64 = 1e-7;

fn work_dtype(p: NsPrecision) -> DType {
    match p {
        NsPrecision::Bf16 => DType::BF16,
        NsPrecision::F32 => DType::F32,
        NsPrecision::F64 => DType::F64,
    }
}

/// Orthogonalises a 2-D matrix; the result has `g`'s dtype and shape.
pub fn newton_schulz5(g: &Tensor, precision: NsPrecision) -> Result<Tensor> {
    if g.rank() != 2 {
        return Err(TrainerError::InvalidArgument {
            what: "newton_schulz5",
            reason: format!("expected a 2-D matrix, got shape {:?}", g.dims()),
        });
    }
    let (rows, cols) = (g.dims()[0], g.dims()[1]);
    let wd = work_dtype(precision);
    ptl_autograd::no_grad(|| -> Result<Tensor> {
        let mut x = g.to_dtype(wd)?;
        // ‖X‖_F accumulated in (at least) f32, rounded to the working dtype, then + eps (rounded).
        let acc = if wd == DType::F64 { DType::F64 } else { DType::F32 };
        let norm = x.to_dtype(acc)?.square()?.sum_all()?.sqrt()?.to_dtype(wd)?;
        let denom = norm.add_scalar(NS_EPS)?;
        x = if wd == DType::BF16 {
            // PyTorch divides a reduced-precision tensor by a scalar as x · (1/s) in f32.
            x.to_dtype(DType::F32)?.mul(&denom.to_dtype(DType::F32)?.recip()?)?.to_dtype(wd)?
        } else {
            x.div(&denom)?
        };
        let transposed = rows > cols;
        if transposed {
            x = x.transpose(0, 1)?;
        }
        let (a, b, c) = NS_COEFFS;
        for _ in 0..NS_STEPS {
            // A = X·Xᵀ (one rounding); B = b·A + c·(A·A) and X = a·X + B·X as fused
            // `baddbmm` (accumulate in `acc`, one rounding to the working dtype).
            let xa = x.to_dtype(acc)?;
            let gram = xa.matmul(&xa.transpose(0, 1)?)?.to_dtype(wd)?.to_dtype(acc)?;
            let bm = gram.mul_scalar(b)?.add(&gram.matmul(&gram)?.mul_scalar(c)?)?.to_dtype(wd)?.to_dtype(acc)?;
            x = xa.mul_scalar(a)?.add(&bm.matmul(&xa)?)?.to_dtype(wd)?;
        }
        if transposed {
            x = x.transpose(0, 1)?;
        }
        Ok(x.to_dtype(g.dtype())?)
    })
}

/// `√max(1, n₋₂ / n₋₁)` of the gradient's last two dimensions.
pub fn muon_scale(dims: &[usize]) -> f64 {
    if dims.len() < 2 {
        return 1.0;
    }
    let (r, c) = (dims[dims.len() - 2] as f64, dims[dims.len() - 1] as f64);
    (r / c).max(1.0).sqrt()
}

/// The Muon direction of a Nesterov blend `u` (2-D or 4-D): reshape 4-D to (out, rest),
/// orthogonalise, scale by [`muon_scale`] of the original shape, reshape back.
pub fn orthogonalized_update(u: &Tensor, precision: NsPrecision) -> Result<Tensor> {
    let dims = u.dims().to_vec();
    let mat = match dims.len() {
        2 => u.clone(),
        4 => u.reshape(vec![dims[0], dims[1] * dims[2] * dims[3]])?,
        _ => {
            return Err(TrainerError::InvalidArgument {
                what: "muon update",
                reason: format!("expected a 2-D or 4-D tensor, got shape {dims:?}"),
            });
        }
    };
    let o = newton_schulz5(&mat, precision)?;
    let s = muon_scale(&dims);
    let o = if s != 1.0 { ptl_autograd::no_grad(|| o.mul_scalar(s))? } else { o };
    Ok(o.reshape(dims)?)
}

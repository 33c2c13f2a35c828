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
    ptl_autograd::no_grad(|| -> Result<Tensor> {
        let x = g.to_dtype(work_dtype(precision))?;
        let norm = frobenius_norm(&x)?;
        Ok(iterate(x, &norm)?.to_dtype(g.dtype())?)
    })
}

/// ‖X‖_F of a matrix in the working dtype: accumulated in (at least) f32, rounded to the working
/// dtype.
fn frobenius_norm(x: &Tensor) -> Result<Tensor> {
    let wd = x.dtype();
    Ok(x.to_dtype(acc_dtype(wd))?.square()?.sum_all()?.sqrt()?.to_dtype(wd)?)
}

fn acc_dtype(wd: DType) -> DType {
    if wd == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The quintic iteration on `x` (a matrix or a stack of them, in the working dtype) after dividing
/// by `norm` + eps (rounded; `norm` broadcasts over `x`); works on the wide orientation.
fn iterate(x: Tensor, norm: &Tensor) -> Result<Tensor> {
    let wd = x.dtype();
    let acc = acc_dtype(wd);
    let denom = norm.add_scalar(NS_EPS)?;
    let mut x = if wd == DType::BF16 {
        // PyTorch divides a reduced-precision tensor by a scalar as x · (1/s) in f32.
        x.to_dtype(DType::F32)?.mul(&denom.to_dtype(DType::F32)?.recip()?)?.to_dtype(wd)?
    } else {
        x.div(&denom)?
    };
    let d = x.dims().to_vec();
    let transposed = d[d.len() - 2] > d[d.len() - 1];
    if transposed {
        x = x.transpose(-2, -1)?;
    }
    let (a, b, c) = NS_COEFFS;
    for _ in 0..NS_STEPS {
        // A = X·Xᵀ (one rounding); B = b·A + c·(A·A) and X = a·X + B·X as fused
        // `baddbmm` (accumulate in `acc`, one rounding to the working dtype).
        let xa = x.to_dtype(acc)?;
        let gram = xa.matmul(&xa.transpose(-2, -1)?)?.to_dtype(wd)?.to_dtype(acc)?;
        let bm = gram.mul_scalar(b)?.add(&gram.matmul(&gram)?.mul_scalar(c)?)?.to_dtype(wd)?.to_dtype(acc)?;
        x = xa.mul_scalar(a)?.add(&bm.matmul(&xa)?)?.to_dtype(wd)?;
    }
    if transposed {
        x = x.transpose(-2, -1)?;
    }
    Ok(x)
}

/// [`newton_schulz5`] of several matrices of one shape and dtype at once: the matrices are stacked
/// and every iteration is one batched op per step of the recurrence (MuSGD's groups share a few
/// weight shapes); each matrix's Frobenius norm is its own. Same rounding points as
/// [`newton_schulz5`], and bit for bit its result on the CPU backend (tested); on CUDA a batched
/// GEMM may sum in another order than a single one.
pub fn newton_schulz5_many(gs: &[Tensor], precision: NsPrecision) -> Result<Vec<Tensor>> {
    match gs {
        [] => return Ok(Vec::new()),
        [g] => return Ok(vec![newton_schulz5(g, precision)?]),
        _ => {}
    }
    let dims = gs[0].dims().to_vec();
    let dtype = gs[0].dtype();
    if dims.len() != 2 || gs.iter().any(|g| g.dims() != dims.as_slice() || g.dtype() != dtype) {
        return Err(TrainerError::InvalidArgument {
            what: "newton_schulz5_many",
            reason: format!("expected 2-D matrices of one shape and dtype, the first being {dims:?} {dtype}"),
        });
    }
    let n = gs.len();
    let wd = work_dtype(precision);
    ptl_autograd::no_grad(|| -> Result<Vec<Tensor>> {
        let xs: Vec<Tensor> = gs.iter().map(|g| g.to_dtype(wd)).collect::<std::result::Result<_, _>>()?;
        // Each norm as newton_schulz5 takes it (one sum over the whole matrix: a batched
        // reduction over two dimensions sums in another order and moved f32 results).
        let norms =
            xs.iter().map(|x| -> Result<Tensor> { Ok(frobenius_norm(x)?.reshape(vec![1, 1, 1])?) }).collect::<Result<Vec<Tensor>>>()?;
        let stacked: Vec<Tensor> = xs.iter().map(|x| x.unsqueeze(0)).collect::<std::result::Result<_, _>>()?;
        let x = Tensor::cat(&stacked.iter().collect::<Vec<_>>(), 0)?;
        let norm = Tensor::cat(&norms.iter().collect::<Vec<_>>(), 0)?;
        let x = iterate(x, &norm)?.to_dtype(dtype)?;
        (0..n).map(|i| Ok(x.narrow(0, i, 1)?.squeeze(0)?)).collect()
    })
}

/// Runs the batched Newton–Schulz of one shape group for an optimizer step: `body(matrices)`
/// natively, or a replay of it (a plugin's recorded graph). It must return what `body` returns.
pub trait NsRunner: Send + Sync {
    fn run_ns(&self, matrices: &[Tensor], body: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>>;
}

thread_local! {
    static NS_RUNNER: std::cell::RefCell<Option<std::sync::Arc<dyn NsRunner>>> = const { std::cell::RefCell::new(None) };
}

fn current_ns_runner() -> Option<std::sync::Arc<dyn NsRunner>> {
    NS_RUNNER.with(|r| r.borrow().clone())
}

/// Runs `f` (an optimizer step) with `runner` doing its Newton–Schulz groups on this thread: how
/// a replay plugin reaches the optimizer without the trainer knowing it. The previous runner comes
/// back when `f` returns or unwinds.
pub fn with_ns_runner<R>(runner: std::sync::Arc<dyn NsRunner>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<std::sync::Arc<dyn NsRunner>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            NS_RUNNER.with(|r| *r.borrow_mut() = previous);
        }
    }
    let _restore = Restore(NS_RUNNER.with(|r| r.borrow_mut().replace(runner)));
    f()
}

/// [`orthogonalized_update`] of many blends, batched: blends whose matrices share a shape go
/// through one [`newton_schulz5_many`]. Results in the input order.
pub fn orthogonalized_updates(us: &[Tensor], precision: NsPrecision) -> Result<Vec<Tensor>> {
    let mats = us.iter().map(as_matrix).collect::<Result<Vec<Tensor>>>()?;
    // (matrix shape, dtype) → indices of the blends with it, in first-seen order.
    let mut by_shape: Vec<(MatrixKey, Vec<usize>)> = Vec::new();
    for (i, m) in mats.iter().enumerate() {
        let key = (m.dims().to_vec(), m.dtype());
        match by_shape.iter_mut().find(|(k, _)| *k == key) {
            Some((_, idx)) => idx.push(i),
            None => by_shape.push((key, vec![i])),
        }
    }
    let mut out: Vec<Option<Tensor>> = vec![None; us.len()];
    for (_, idx) in by_shape {
        let group: Vec<Tensor> = idx.iter().map(|&i| mats[i].clone()).collect();
        let body = |ms: &[Tensor]| newton_schulz5_many(ms, precision);
        let orthogonal = match current_ns_runner() {
            Some(runner) => runner.run_ns(&group, &body)?,
            None => body(&group)?,
        };
        if orthogonal.len() != group.len() {
            return Err(TrainerError::InvalidArgument {
                what: "Newton–Schulz runner",
                reason: format!("returned {} matrices for {}", orthogonal.len(), group.len()),
            });
        }
        for (&i, o) in idx.iter().zip(orthogonal) {
            out[i] = Some(scaled_back(o, us[i].dims())?);
        }
    }
    out.into_iter()
        .map(|o| o.ok_or_else(|| TrainerError::InvalidArgument { what: "muon update", reason: "a blend got no update".into() }))
        .collect()
}

type MatrixKey = (Vec<usize>, DType);

/// A 2-D or 4-D blend as the matrix Newton–Schulz works on: (out, rest).
fn as_matrix(u: &Tensor) -> Result<Tensor> {
    let dims = u.dims().to_vec();
    match dims.len() {
        2 => Ok(u.clone()),
        4 => Ok(u.reshape(vec![dims[0], dims[1] * dims[2] * dims[3]])?),
        _ => {
            Err(TrainerError::InvalidArgument { what: "muon update", reason: format!("expected a 2-D or 4-D tensor, got shape {dims:?}") })
        }
    }
}

/// The orthogonalised matrix scaled by [`muon_scale`] of the blend's shape, in that shape.
fn scaled_back(o: Tensor, dims: &[usize]) -> Result<Tensor> {
    let s = muon_scale(dims);
    let o = if s != 1.0 { ptl_autograd::no_grad(|| o.mul_scalar(s))? } else { o };
    Ok(o.reshape(dims.to_vec())?)
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
    scaled_back(newton_schulz5(&as_matrix(u)?, precision)?, u.dims())
}

#[cfg(test)]
mod batched_tests {
    use super::*;
    use ptl_autograd::{Device, Rng};

    /// The batched form gives each matrix the bytes of the one-matrix form on the CPU, wide and tall
    /// matrices, every precision; `orthogonalized_updates` keeps the input order across shapes.
    #[test]
    fn batched_newton_schulz_matches_one_by_one() {
        let mut rng = Rng::new(17);
        for precision in [NsPrecision::Bf16, NsPrecision::F32, NsPrecision::F64] {
            for dims in [[6usize, 10], [12, 5]] {
                let gs: Vec<Tensor> =
                    (0..3).map(|_| Tensor::rand(dims.to_vec(), -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap()).collect();
                let many = newton_schulz5_many(&gs, precision).unwrap();
                for (g, m) in gs.iter().zip(&many) {
                    let one = newton_schulz5(g, precision).unwrap();
                    assert_eq!(m.dims(), one.dims());
                    assert_eq!(m.to_bytes().unwrap(), one.to_bytes().unwrap(), "{precision:?} {dims:?}");
                }
            }
        }
        let us: Vec<Tensor> = [vec![4, 2, 3, 3], vec![5, 7], vec![4, 2, 3, 3], vec![8, 3, 1, 1]]
            .into_iter()
            .map(|d| Tensor::rand(d, -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap())
            .collect();
        let batched = orthogonalized_updates(&us, NsPrecision::Bf16).unwrap();
        for (u, b) in us.iter().zip(&batched) {
            assert_eq!(b.to_bytes().unwrap(), orthogonalized_update(u, NsPrecision::Bf16).unwrap().to_bytes().unwrap(), "{:?}", u.dims());
        }
        assert!(newton_schulz5_many(&[us[1].clone(), us[1].transpose(0, 1).unwrap()], NsPrecision::F32).is_err(), "mixed shapes");
    }
}

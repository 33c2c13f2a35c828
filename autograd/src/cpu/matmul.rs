//! Batched GEMM on the CPU through the `gemm` crate (f32/f64; halves computed in f32).

use rayon::prelude::*;

use super::CpuStorage;
use crate::backend::{BackendStorage, MatmulParams};
use crate::{Error, Result};

/// Element types the GEMM wrapper accepts.
pub(crate) trait GemmElem: Copy + Send + Sync + 'static + num_traits::Zero + num_traits::One {}
impl GemmElem for f32 {}
impl GemmElem for f64 {}

/// `c (m×n) [+]= op(a) · op(b)` on row-major slices; `a` is `m×k` (`k×m` if `at`), `b` is `k×n`
/// (`n×k` if `bt`). `threads` > 1 lets gemm split the work (it never splits `k`, so the result does
/// not depend on the thread count).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_rm<T: GemmElem>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    at: bool,
    b: &[T],
    bt: bool,
    c: &mut [T],
    accumulate: bool,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.iter_mut().for_each(|x| *x = T::zero());
        }
        return;
    }
    let (a_rs, a_cs) = if at { (1isize, m as isize) } else { (k as isize, 1isize) };
    let (b_rs, b_cs) = if bt { (1isize, k as isize) } else { (n as isize, 1isize) };
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    debug_assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    // SAFETY: the slices are at least as long as the strided extents computed above, and `c` does
    // not alias `a` or `b` (it is a distinct &mut).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            T::one(),
            T::one(),
            false,
            false,
            false,
            par,
        );
    }
}

fn bmm<T: GemmElem>(a: &[T], b: &[T], p: &MatmulParams) -> Vec<T> {
    let (m, n, k) = (p.m, p.n, p.k);
    let batch = p.batch();
    let mut out = vec![T::zero(); batch * m * n];
    let threads = rayon::current_num_threads();
    let run = |bi: usize, c: &mut [T], th: usize| {
        let ai = if p.lhs_batch == 1 { 0 } else { bi };
        let bj = if p.rhs_batch == 1 { 0 } else { bi };
        gemm_rm(m, n, k, &a[ai * m * k..(ai + 1) * m * k], p.lhs_t, &b[bj * k * n..(bj + 1) * k * n], p.rhs_t, c, false, th);
    };
    if batch >= 4 && m * n * k < 1 << 22 {
        out.par_chunks_mut(m * n.max(1)).enumerate().for_each(|(bi, c)| run(bi, c, 1));
    } else {
        for (bi, c) in out.chunks_mut((m * n).max(1)).enumerate() {
            run(bi, c, if m * n * k >= 1 << 18 { threads } else { 1 });
        }
    }
    out
}

pub(crate) fn matmul(a: &CpuStorage, b: &CpuStorage, p: &MatmulParams) -> Result<CpuStorage> {
    if a.len() != p.lhs_batch * p.m * p.k || b.len() != p.rhs_batch * p.k * p.n {
        return Err(Error::invalid("matmul", format!("storage sizes {} / {} do not match {p:?}", a.len(), b.len())));
    }
    use CpuStorage as S;
    Ok(match (a, b) {
        (S::F32(x), S::F32(y)) => S::F32(bmm(x, y, p)),
        (S::F64(x), S::F64(y)) => S::F64(bmm(x, y, p)),
        (S::F16(x), S::F16(y)) => S::F16(super::narrow_f16(bmm(&super::widen_f16(x), &super::widen_f16(y), p))),
        (S::BF16(x), S::BF16(y)) => S::BF16(super::narrow_bf16(bmm(&super::widen_bf16(x), &super::widen_bf16(y), p))),
        _ if a.dtype() != b.dtype() => return Err(Error::DTypeMismatch { op: "matmul", lhs: a.dtype(), rhs: b.dtype() }),
        _ => return Err(Error::UnsupportedDType { op: "matmul", dtype: a.dtype(), expected: "a float dtype" }),
    })
}

/// `beta·c + alpha·op(a)·op(b)` (PyTorch `baddbmm`): the product as [`matmul`] computes it, then
/// each element combined in the accumulation type as the composed ops would (`x·s + 0` for a
/// scale other than 1, one add) and rounded once to the dtype.
pub(crate) fn matmul_add(a: &CpuStorage, b: &CpuStorage, c: &CpuStorage, p: &MatmulParams, alpha: f64, beta: f64) -> Result<CpuStorage> {
    if a.len() != p.lhs_batch * p.m * p.k || b.len() != p.rhs_batch * p.k * p.n || c.len() != p.batch() * p.m * p.n {
        let sizes = format!("storage sizes {} / {} / {} do not match {p:?}", a.len(), b.len(), c.len());
        return Err(Error::invalid("matmul_add", sizes));
    }
    use CpuStorage as S;
    fn combine<T: num_traits::Float>(acc: Vec<T>, c: &[T], alpha: T, beta: T) -> Vec<T> {
        let scaled = |x: T, s: T| if s == T::one() { x } else { x * s + T::zero() };
        acc.into_iter().zip(c).map(|(x, &y)| scaled(y, beta) + scaled(x, alpha)).collect()
    }
    let (a32, b32) = (alpha as f32, beta as f32);
    Ok(match (a, b, c) {
        (S::F32(x), S::F32(y), S::F32(z)) => S::F32(combine(bmm(x, y, p), z, a32, b32)),
        (S::F64(x), S::F64(y), S::F64(z)) => S::F64(combine(bmm(x, y, p), z, alpha, beta)),
        (S::F16(x), S::F16(y), S::F16(z)) => {
            let acc = bmm(&super::widen_f16(x), &super::widen_f16(y), p);
            S::F16(super::narrow_f16(combine(acc, &super::widen_f16(z), a32, b32)))
        }
        (S::BF16(x), S::BF16(y), S::BF16(z)) => {
            let acc = bmm(&super::widen_bf16(x), &super::widen_bf16(y), p);
            S::BF16(super::narrow_bf16(combine(acc, &super::widen_bf16(z), a32, b32)))
        }
        _ if a.dtype() != b.dtype() => return Err(Error::DTypeMismatch { op: "matmul_add", lhs: a.dtype(), rhs: b.dtype() }),
        _ if a.dtype() != c.dtype() => return Err(Error::DTypeMismatch { op: "matmul_add", lhs: a.dtype(), rhs: c.dtype() }),
        _ => return Err(Error::UnsupportedDType { op: "matmul_add", dtype: a.dtype(), expected: "a float dtype" }),
    })
}

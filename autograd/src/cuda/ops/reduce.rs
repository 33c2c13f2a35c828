//! Reductions along one dimension and partial sums.

use std::ffi::c_void;

use super::super::device::sfx;
use super::super::storage::CudaStorage;
use crate::backend::ReduceOp;
use crate::{DType, Error, Result};

use super::elementwise::to_dtype;
use super::geometry::*;

pub(super) fn split3(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (shape[..dim].iter().product(), shape[dim], shape[dim + 1..].iter().product())
}

pub(crate) fn reduce(x: &CudaStorage, shape: &[usize], dim: usize, op: ReduceOp) -> Result<CudaStorage> {
    let (outer, d, inner) = split3(shape, dim);
    if d == 0 && op != ReduceOp::Sum {
        return Err(Error::invalid("reduce", format!("{op:?} over an empty dimension {dim} of {shape:?}")));
    }
    let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
    if !arg && matches!(x.dtype, DType::U8 | DType::Bool) {
        // Like the CPU backend: value reductions of bytes are done (and returned) in i64.
        return reduce(&to_dtype(x, DType::I64)?, shape, dim, op);
    }
    let dev = &x.buf.dev;
    let out_dt = if arg { DType::I64 } else { x.dtype };
    let out = CudaStorage::alloc(dev, out_dt, outer * inner)?;
    if outer * inner == 0 {
        return Ok(out);
    }
    let code = match op {
        ReduceOp::Sum => 0i32,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
        ReduceOp::ArgMax => 3,
        ReduceOp::ArgMin => 4,
    };
    let (px, py, dd) = (ptr(x), ptr(&out), u32c("reduce", d)?);
    if inner == 1 {
        let f = dev.func("reduce_rows", sfx(x.dtype))?;
        let grid = u32c("reduce", outer)?;
        dev.launch(f, (grid, 1, 1), (256, 1, 1), &mut args!(px, py, dd, code))
    } else if code == 0 && outer * inner.div_ceil(32) < 64 && d >= 1024 && x.dtype.is_float() {
        // A tall sum over few columns (a bias gradient over many rows): reduce_cols would give
        // each column 8 threads; sum_mid gives it a block of 256 (fixed order, the same
        // accumulation precision and one rounding).
        let f = dev.func("sum_mid", sfx(x.dtype))?;
        if outer == 1 {
            let (oo, mm, ii) = (dd, u32c("reduce", inner)?, 1u32);
            dev.launch(f, (mm, 1, 1), (256, 1, 1), &mut args!(px, py, oo, mm, ii))
        } else {
            // [outer, d, inner] → one sum_mid per outer index (its [d, inner] block).
            let (in_es, out_es) = (x.dtype.size_in_bytes() as u64, out_dt.size_in_bytes() as u64);
            for o in 0..outer {
                let pxs = px + (o * d * inner) as u64 * in_es;
                let pys = py + (o * inner) as u64 * out_es;
                let (oo, mm, ii) = (dd, u32c("reduce", inner)?, 1u32);
                dev.launch(f, (mm, 1, 1), (256, 1, 1), &mut args!(pxs, pys, oo, mm, ii))?;
            }
            Ok(())
        }
    } else {
        let cols = inner.div_ceil(32);
        if cols > 65535 {
            return Err(Error::invalid("reduce", format!("inner size {inner} too large for the CUDA reduction")));
        }
        let f = dev.func("reduce_cols", sfx(x.dtype))?;
        let ii = u32c("reduce", inner)?;
        // The grid's y extent is limited to 65535: large outer sizes go in chunks (same kernel,
        // shifted base pointers), so the result does not depend on the chunking.
        let (in_es, out_es) = (x.dtype.size_in_bytes() as u64, out_dt.size_in_bytes() as u64);
        let mut start = 0usize;
        while start < outer {
            let n = (outer - start).min(65535);
            let pxs = px + (start * d * inner) as u64 * in_es;
            let pys = py + (start * inner) as u64 * out_es;
            dev.launch(f, (cols as u32, n as u32, 1), (32, 8, 1), &mut args!(pxs, pys, dd, ii, code))?;
            start += n;
        }
        Ok(())
    }?;
    Ok(out)
}

/// Sum over the outer and inner dims of `x` viewed as [outer, mid, inner] (one launch, one block per
/// mid index, fixed order; sums of f32 in f64, of halves in f32, one rounding to `x`'s dtype).
pub(crate) fn sum_mid(x: &CudaStorage, outer: usize, mid: usize, inner: usize) -> Result<CudaStorage> {
    const OP: &str = "sum_mid";
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: x.dtype, expected: "a float dtype" });
    }
    if outer * mid * inner != x.len {
        return Err(Error::invalid(OP, format!("[{outer}, {mid}, {inner}] does not cover {} values", x.len)));
    }
    let dev = &x.buf.dev;
    let out = CudaStorage::alloc(dev, x.dtype, mid)?;
    if mid == 0 {
        return Ok(out);
    }
    let f = dev.func(OP, sfx(x.dtype))?;
    u32c(OP, x.len)?;
    let (px, py, oo, mm, ii) = (ptr(x), ptr(&out), u32c(OP, outer)?, u32c(OP, mid)?, u32c(OP, inner)?);
    dev.launch(f, (mm, 1, 1), (256, 1, 1), &mut args!(px, py, oo, mm, ii))?;
    Ok(out)
}

/// `out` = the in-order sum of the `n` f32 partials of `out.len` values that `partials` holds,
/// rounded once to `out`'s dtype (f32, bf16 or f16).
pub(crate) fn sum_partials(partials: &CudaStorage, n: usize, out: &CudaStorage) -> Result<()> {
    const OP: &str = "sum_partials";
    if partials.dtype != DType::F32 || partials.len != n * out.len {
        return Err(Error::invalid(OP, format!("{} {} values for {n} partials of {}", partials.len, partials.dtype, out.len)));
    }
    if !matches!(out.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::UnsupportedDType { op: OP, dtype: out.dtype, expected: "f32, bf16 or f16" });
    }
    partials.same_device(OP, out)?;
    if out.len == 0 {
        return Ok(());
    }
    let dev = &out.buf.dev;
    let f = dev.func(OP, sfx(out.dtype))?;
    let (pp, po, nn, ll) = (ptr(partials), ptr(out), u32c(OP, n)?, u32c(OP, out.len)?);
    dev.launch1d(f, out.len, &mut args!(pp, po, nn, ll))
}

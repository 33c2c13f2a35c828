//! Index ops: index_select/index_add, gather/scatter_add, nonzero, top-k.

use std::ffi::c_void;

use cudarc::driver::result as dr;

use super::super::device::{cu_err, sfx};
use super::super::storage::CudaStorage;
use crate::{DType, Error, Result};

use super::geometry::*;
use super::reduce::split3;

pub(super) fn need_i64(op: &'static str, s: &CudaStorage) -> Result<()> {
    if s.dtype != DType::I64 {
        return Err(Error::UnsupportedDType { op, dtype: s.dtype, expected: "I64 indices" });
    }
    Ok(())
}

pub(crate) fn index_select(x: &CudaStorage, shape: &[usize], dim: usize, idx: &CudaStorage) -> Result<CudaStorage> {
    need_i64("index_select", idx)?;
    x.same_device("index_select", idx)?;
    let (outer, d, inner) = split3(shape, dim);
    let n = idx.len;
    let dev = &x.buf.dev;
    let total = outer * n * inner;
    let out = CudaStorage::alloc(dev, x.dtype, total)?;
    if total == 0 {
        return Ok(out);
    }
    let f = dev.func("index_select", sfx(x.dtype))?;
    let (px, pi, py) = (ptr(x), ptr(idx), ptr(&out));
    let (o, dd, nn, ii) = (u32c("index_select", outer)?, u32c("index_select", d)?, u32c("index_select", n)?, u32c("index_select", inner)?);
    u32c("index_select", total)?;
    dev.launch1d(f, total, &mut args!(px, pi, py, o, dd, nn, ii))?;
    Ok(out)
}

pub(super) fn float_or_i64(op: &'static str, dt: DType) -> Result<()> {
    if dt.is_float() || dt == DType::I64 {
        Ok(())
    } else {
        Err(Error::UnsupportedDType { op, dtype: dt, expected: "a float or I64 dtype" })
    }
}

/// The most indices `index_add` sorts in one block (`IA_SORTED_MAX` in index.cu).
const IA_SORTED_MAX: usize = 4096;

pub(crate) fn index_add(x: &CudaStorage, shape: &[usize], dim: usize, idx: &CudaStorage, src: &CudaStorage) -> Result<CudaStorage> {
    if src.dtype != x.dtype {
        return Err(Error::DTypeMismatch { op: "index_add", lhs: x.dtype, rhs: src.dtype });
    }
    x.same_device("index_add", src)?;
    if x.len != shape.iter().product::<usize>() {
        return Err(Error::invalid("index_add", format!("{} values for the shape {shape:?}", x.len)));
    }
    index_add_onto(Some(x), shape, dim, idx, src)
}

/// [`index_add`] onto zeros of `shape` (`src`'s dtype), without a zeroed buffer to read: the
/// kernels read a null base as zeros (one memset fewer per `index_select` gradient).
pub(crate) fn index_add_to_zeros(shape: &[usize], dim: usize, idx: &CudaStorage, src: &CudaStorage) -> Result<CudaStorage> {
    index_add_onto(None, shape, dim, idx, src)
}

fn index_add_onto(x: Option<&CudaStorage>, shape: &[usize], dim: usize, idx: &CudaStorage, src: &CudaStorage) -> Result<CudaStorage> {
    need_i64("index_add", idx)?;
    float_or_i64("index_add", src.dtype)?;
    src.same_device("index_add", idx)?;
    let (outer, d, inner) = split3(shape, dim);
    let n = idx.len;
    if src.len != outer * n * inner {
        return Err(Error::invalid("index_add", format!("source has {} elements, expected {}", src.len, outer * n * inner)));
    }
    let dev = &src.buf.dev;
    let len = outer * d * inner;
    let out = CudaStorage::alloc(dev, src.dtype, len)?;
    if len == 0 {
        return Ok(out);
    }
    let (px, pi, ps, py) = (x.map_or(0, ptr), ptr(idx), ptr(src), ptr(&out));
    let (o, dd, nn, ii) = (u32c("index_add", outer)?, u32c("index_add", d)?, u32c("index_add", n)?, u32c("index_add", inner)?);
    if n == 0 || !dev.options().index_add_by_buckets || (len as u64) * (n as u64) < 1 << 20 {
        // Small: one launch scanning every index per output element.
        let f = dev.func("index_add", sfx(src.dtype))?;
        dev.launch1d(f, len, &mut args!(px, pi, ps, py, o, dd, nn, ii))?;
        return Ok(out);
    }
    u32c("index_add", d + 1)?;
    if n <= IA_SORTED_MAX {
        // Few indices (see index.cu): sorted in one block, then summed — two launches, the same
        // sums in the same order.
        let (targets, rows) = (super::super::alloc::DevBuf::alloc(dev, 4 * n)?, super::super::alloc::DevBuf::alloc(dev, 4 * n)?);
        let (pt, pr) = (targets.ptr, rows.ptr);
        dev.launch(dev.func("ia_sorted_keys", "")?, (1, 1, 1), (1024, 1, 1), &mut args!(pi, nn, dd, pt, pr))?;
        dev.launch1d(dev.func("ia_sorted_sum", sfx(src.dtype))?, len, &mut args!(px, ps, pt, pr, py, o, dd, nn, ii))?;
        return Ok(out);
    }
    // By buckets (see index.cu): the same sums in the same order, O(n + d + outputs).
    let (counts, cursor) = (super::super::alloc::DevBuf::alloc(dev, 4 * d)?, super::super::alloc::DevBuf::alloc(dev, 4 * d)?);
    let (offsets, rows) = (super::super::alloc::DevBuf::alloc(dev, 4 * (d + 1))?, super::super::alloc::DevBuf::alloc(dev, 4 * n)?);
    dev.bind()?;
    for b in [&counts, &cursor] {
        super::super::counters::count(super::super::counters::Count::Memset);
        unsafe { dr::memset_d8_async(b.ptr, 0, b.bytes, dev.stream()) }.map_err(|e| cu_err("cuMemsetD8Async", e))?;
    }
    let (pc, pu, po, pr) = (counts.ptr, cursor.ptr, offsets.ptr, rows.ptr);
    dev.launch1d(dev.func("ia_count", "")?, n, &mut args!(pi, nn, dd, pc))?;
    // The counts' exclusive scan, by blocks of 1024 (see index.cu).
    let blocks = d.div_ceil(1024);
    let (sums, block_offsets) =
        (super::super::alloc::DevBuf::alloc(dev, 4 * blocks)?, super::super::alloc::DevBuf::alloc(dev, 4 * (blocks + 1))?);
    // (`psums`, not `ps`: that name holds the source rows' pointer, which `ia_sum` reads below.)
    let (psums, pb, bb) = (sums.ptr, block_offsets.ptr, u32c("index_add", blocks)?);
    dev.launch(dev.func("ia_block_sums", "")?, (bb, 1, 1), (1024, 1, 1), &mut args!(pc, dd, psums))?;
    dev.launch(dev.func("ia_scan", "")?, (1, 1, 1), (1024, 1, 1), &mut args!(psums, pb, bb))?;
    dev.launch(dev.func("ia_scan_apply", "")?, (bb, 1, 1), (1024, 1, 1), &mut args!(pc, pb, po, dd, bb))?;
    dev.launch1d(dev.func("ia_fill", "")?, n, &mut args!(pi, nn, dd, po, pu, pr))?;
    dev.launch1d(dev.func("ia_sort", "")?, d, &mut args!(po, dd, pr))?;
    dev.launch1d(dev.func("ia_sum", sfx(src.dtype))?, len, &mut args!(px, ps, po, pr, py, o, dd, nn, ii))?;
    Ok(out)
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct GatherGeo {
    rank: u32,
    dim: u32,
    xshape: [u32; MAXD],
    ishape: [u32; MAXD],
}

pub(super) fn gather_geo(op: &'static str, shape: &[usize], dim: usize, idx_shape: &[usize]) -> Result<GatherGeo> {
    if idx_shape.len() != shape.len() {
        return Err(Error::ShapeMismatch { op, lhs: shape.to_vec(), rhs: idx_shape.to_vec() });
    }
    for (k, (&a, &b)) in shape.iter().zip(idx_shape).enumerate() {
        if k != dim && b > a {
            return Err(Error::ShapeMismatch { op, lhs: shape.to_vec(), rhs: idx_shape.to_vec() });
        }
    }
    if shape.len() > MAXD {
        return Err(Error::invalid(op, format!("rank {} exceeds {MAXD} on CUDA", shape.len())));
    }
    let mut g = GatherGeo { rank: shape.len() as u32, dim: dim as u32, ..Default::default() };
    for k in 0..shape.len() {
        g.xshape[k] = u32c(op, shape[k])?;
        g.ishape[k] = u32c(op, idx_shape[k])?;
    }
    u32c(op, shape.iter().product())?;
    Ok(g)
}

pub(crate) fn gather(x: &CudaStorage, shape: &[usize], dim: usize, idx: &CudaStorage, idx_shape: &[usize]) -> Result<CudaStorage> {
    need_i64("gather", idx)?;
    x.same_device("gather", idx)?;
    let g = gather_geo("gather", shape, dim, idx_shape)?;
    let dev = &x.buf.dev;
    let n = idx.len;
    let out = CudaStorage::alloc(dev, x.dtype, n)?;
    if n == 0 {
        return Ok(out);
    }
    let f = dev.func("gather", sfx(x.dtype))?;
    let (px, pi, py, nn) = (ptr(x), ptr(idx), ptr(&out), u32c("gather", n)?);
    dev.launch1d(f, n, &mut args!(px, pi, py, nn, g))?;
    Ok(out)
}

pub(crate) fn scatter_add(
    x: &CudaStorage,
    shape: &[usize],
    dim: usize,
    idx: &CudaStorage,
    idx_shape: &[usize],
    src: &CudaStorage,
) -> Result<CudaStorage> {
    need_i64("scatter_add", idx)?;
    float_or_i64("scatter_add", x.dtype)?;
    if src.dtype != x.dtype {
        return Err(Error::DTypeMismatch { op: "scatter_add", lhs: x.dtype, rhs: src.dtype });
    }
    x.same_device("scatter_add", idx)?;
    x.same_device("scatter_add", src)?;
    let g = gather_geo("scatter_add", shape, dim, idx_shape)?;
    if src.len != idx.len {
        return Err(Error::invalid("scatter_add", format!("source has {} elements, index has {}", src.len, idx.len)));
    }
    let dev = &x.buf.dev;
    let out = CudaStorage::alloc(dev, x.dtype, x.len)?;
    if x.len == 0 {
        return Ok(out);
    }
    let f = dev.func("scatter_add", sfx(x.dtype))?;
    let (px, pi, ps, py, nn) = (ptr(x), ptr(idx), ptr(src), ptr(&out), u32c("scatter_add", x.len)?);
    dev.launch1d(f, x.len, &mut args!(px, pi, ps, py, nn, g))?;
    Ok(out)
}

/// See [`crate::backend::BackendStorage::nonzero_static`]: one block, 1024 threads.
pub(crate) fn nonzero_static(x: &CudaStorage, size: usize, fill: i64) -> Result<CudaStorage> {
    let dev = &x.buf.dev;
    let out = CudaStorage::alloc(dev, DType::I64, size)?;
    if size == 0 {
        return Ok(out);
    }
    let f = dev.func("nonzero_static", sfx(x.dtype))?;
    let (px, py, nn, ss) = (ptr(x), ptr(&out), u32c("nonzero_static", x.len)?, u32c("nonzero_static", size)?);
    dev.launch(f, (1, 1, 1), (1024, 1, 1), &mut args!(px, py, nn, ss, fill))?;
    Ok(out)
}

/// Largest k that takes the selection kernel (`topk_select_*`: one block-wide reduction per pick).
pub(super) const TOPK_SELECT_MAX_K: usize = 64;

pub(crate) fn topk(x: &CudaStorage, shape: &[usize], dim: usize, k: usize, largest: bool) -> Result<(CudaStorage, CudaStorage)> {
    let (outer, d, inner) = split3(shape, dim);
    if k > d {
        return Err(Error::invalid("topk", format!("k = {k} exceeds size {d} of dim {dim} in {shape:?}")));
    }
    let dev = &x.buf.dev;
    let vals = CudaStorage::alloc(dev, x.dtype, outer * k * inner)?;
    let idx = CudaStorage::alloc(dev, DType::I64, outer * k * inner)?;
    if outer * k * inner == 0 {
        return Ok((vals, idx));
    }
    // Few picks from long rows: k selection rounds (k·d work) beat ranking every element (d²).
    let f = if k <= TOPK_SELECT_MAX_K && d > 2 * k { dev.func("topk_select", sfx(x.dtype))? } else { dev.func("topk", sfx(x.dtype))? };
    let (px, pv, pi) = (ptr(x), ptr(&vals), ptr(&idx));
    let (dd, ii, kk, lg) = (u32c("topk", d)?, u32c("topk", inner)?, u32c("topk", k)?, largest as i32);
    let rows = u32c("topk", outer * inner)?;
    dev.launch(f, (rows, 1, 1), (256, 1, 1), &mut args!(px, pv, pi, dd, ii, kk, lg))?;
    Ok((vals, idx))
}

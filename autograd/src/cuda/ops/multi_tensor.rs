//! Multi-tensor launchers: one launch over many tensors (gradient accumulation, SGD/MuSGD/AdamW
//! updates with host or device scalars, clipping, unscaling).

use std::ffi::c_void;

use cudarc::driver::result as dr;

use super::super::device::{cu_err, sfx};
use super::super::storage::CudaStorage;
use crate::backend::{BackendStorage, MultiTensorOp, MultiTensorStorage, Operand, ScalarsAt};
use crate::{DType, Error, Result};

use super::geometry::*;

/// Tensors per multi-tensor launch and elements per block (`MT_ADD`, `MT_CHUNK` in multi_tensor.cu and prelude.cuh).
pub(super) const MT_ADD: usize = 40;

pub(crate) const MT_CHUNK: usize = 2048;

/// The kernel-parameter table of the multi-tensor kernels (layout of `MtTable` in multi_tensor.cu):
/// up to three operand addresses per tensor, its length and first block.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MtTable {
    ptr: [[u64; MT_ADD]; 3],
    len: [u32; MT_ADD],
    first_block: [u32; MT_ADD + 1],
    count: u32,
}

/// The tables for `rows` (operand addresses, length) in chunks of 40, each with its block count
/// (tables without a block are left out).
pub(super) fn mt_tables(op: &'static str, rows: &[([u64; 3], usize)]) -> Result<Vec<(MtTable, u32)>> {
    let mut out = Vec::with_capacity(rows.len().div_ceil(MT_ADD));
    for chunk in rows.chunks(MT_ADD) {
        let mut t = MtTable { ptr: [[0; MT_ADD]; 3], len: [0; MT_ADD], first_block: [0; MT_ADD + 1], count: chunk.len() as u32 };
        let mut blocks = 0usize;
        for (k, &(ptrs, n)) in chunk.iter().enumerate() {
            for (a, &p) in ptrs.iter().enumerate() {
                t.ptr[a][k] = p;
            }
            (t.len[k], t.first_block[k]) = (u32c(op, n)?, u32c(op, blocks)?);
            blocks += n.div_ceil(MT_CHUNK);
        }
        t.first_block[chunk.len()] = u32c(op, blocks)?;
        if blocks > 0 {
            out.push((t, blocks as u32));
        }
    }
    Ok(out)
}

/// `dst[i] += src[i]` for every pair, the same bytes as [`add_assign`] on each, with one launch per
/// dtype and 40 tensors. Every pair is checked before anything is launched.
pub(crate) fn add_assign_many(pairs: &mut [(&mut CudaStorage, &CudaStorage)]) -> Result<()> {
    for (d, s) in pairs.iter() {
        if d.len != s.len {
            return Err(Error::ShapeMismatch { op: "add_assign", lhs: vec![d.len], rhs: vec![s.len] });
        }
        if d.dtype != s.dtype || !d.dtype.is_float() {
            return Err(Error::DTypeMismatch { op: "add_assign", lhs: d.dtype, rhs: s.dtype });
        }
        d.same_device("add_assign", s)?;
        u32c("add_assign", d.len)?;
    }
    let Some((first, _)) = pairs.first() else { return Ok(()) };
    let dev = &first.buf.dev;
    for (d, _) in pairs.iter().skip(1) {
        first.same_device("add_assign", d)?;
    }
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let items: Vec<(u64, u64, usize)> =
            pairs.iter().filter(|(d, _)| d.dtype == dtype && d.len > 0).map(|(d, s)| (ptr(d), ptr(s), d.len)).collect();
        let f = dev.func("mt_add", sfx(dtype))?;
        launch_multi_tensor(dev, f, &items)?;
    }
    Ok(())
}

/// `dst = src` for every pair, bytes as they are: one launch per 40 pairs whose sizes are whole
/// 4-byte words (`mt_copy_words`), a copy of its own for any other pair.
pub(crate) fn copy_many(pairs: &mut [(&mut CudaStorage, &CudaStorage)]) -> Result<()> {
    for (d, s) in pairs.iter() {
        if d.len != s.len {
            return Err(Error::ShapeMismatch { op: "copy_many", lhs: vec![d.len], rhs: vec![s.len] });
        }
        if d.dtype != s.dtype {
            return Err(Error::DTypeMismatch { op: "copy_many", lhs: d.dtype, rhs: s.dtype });
        }
        d.same_device("copy_many", s)?;
    }
    let Some((first, _)) = pairs.first() else { return Ok(()) };
    for (d, _) in pairs.iter().skip(1) {
        first.same_device("copy_many", d)?;
    }
    let dev = &first.buf.dev;
    let mut words: Vec<(u64, u64, usize)> = Vec::new();
    for (d, s) in pairs.iter() {
        let bytes = d.len * d.dtype.size_in_bytes();
        if bytes == 0 {
            continue;
        }
        if bytes % 4 == 0 && u32::try_from(bytes / 4).is_ok() {
            words.push((ptr(d), ptr(s), bytes / 4));
        } else {
            dev.bind()?;
            super::super::counters::count(super::super::counters::Count::DeviceToDevice);
            // SAFETY: both buffers hold `bytes` bytes on this device (checked above).
            unsafe { dr::memcpy_dtod_async(ptr(d), ptr(s), bytes, dev.stream()) }.map_err(|e| cu_err("cuMemcpyDtoDAsync", e))?;
        }
    }
    if !words.is_empty() {
        let f = dev.func("mt_copy_words", "")?;
        launch_multi_tensor(dev, f, &words)?;
    }
    Ok(())
}

/// Launches a table-only multi-tensor kernel (`mt_add`, `mt_cast`) over `(dst, src, len)` items.
pub(super) fn launch_multi_tensor(
    dev: &super::super::device::Dev,
    f: cudarc::driver::sys::CUfunction,
    items: &[(u64, u64, usize)],
) -> Result<()> {
    let rows: Vec<([u64; 3], usize)> = items.iter().map(|&(d, s, n)| ([d, s, 0], n)).collect();
    for (t, blocks) in mt_tables("multi-tensor", &rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t))?;
    }
    Ok(())
}

/// One fused SGD step over `([param, grad, buffer], len)` rows of f32 device memory (buffer 0 when
/// `with_buf` is false); see `Tensor::sgd_step_many`. `any` names the device.
pub(crate) fn sgd_many(any: &CudaStorage, rows: &[([u64; 3], usize)], h: crate::ops::optim::SgdStep, with_buf: bool) -> Result<()> {
    let dev = &any.buf.dev;
    let f = dev.func("mt_sgd_f32", "")?;
    let (wd, mu, nlr, zero) = (h.weight_decay, h.momentum, h.neg_lr, 0f32);
    let (has_wd, has_buf, nesterov) = ((h.weight_decay != 0.0) as i32, with_buf as i32, h.nesterov as i32);
    for (t, blocks) in mt_tables("sgd_step_many", rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t, wd, mu, nlr, zero, has_wd, has_buf, nesterov))?;
    }
    Ok(())
}

/// The fused momentum blend over `([momentum, grad, out], len)` rows; see
/// `Tensor::momentum_blend_many`.
pub(crate) fn blend_many(any: &CudaStorage, rows: &[([u64; 3], usize)], f: [(f32, bool); 2], nesterov: bool) -> Result<()> {
    let dev = &any.buf.dev;
    let func = dev.func("mt_blend_f32", "")?;
    let (f1, small1, f2, small2, nest, zero) = (f[0].0, f[0].1 as i32, f[1].0, f[1].1 as i32, nesterov as i32, 0f32);
    for (t, blocks) in mt_tables("momentum_blend_many", rows)? {
        dev.launch(func, (blocks, 1, 1), (256, 1, 1), &mut args!(t, f1, small1, f2, small2, nest, zero))?;
    }
    Ok(())
}

/// The fused in-place lerp over `([dst, src, 0], len)` rows; see `Tensor::lerp_many_`.
pub(crate) fn lerp_many(any: &CudaStorage, rows: &[([u64; 3], usize)], factor: f32, small: bool) -> Result<()> {
    let dev = &any.buf.dev;
    let f = dev.func("mt_lerp_f32", "")?;
    let (sm, zero) = (small as i32, 0f32);
    for (t, blocks) in mt_tables("lerp_many_", rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t, factor, sm, zero))?;
    }
    Ok(())
}

/// [`sgd_many`] with `[weight_decay, momentum, neg_lr]` read from device address `hp` (f64); no
/// write at all when the f32 flag at `skip` (0: none) is non-zero.
pub(crate) fn sgd_many_dev(
    any: &CudaStorage,
    rows: &[([u64; 3], usize)],
    hp: u64,
    skip: u64,
    weight_decay: bool,
    with_buf: bool,
    nesterov: bool,
) -> Result<()> {
    let dev = &any.buf.dev;
    let f = dev.func("mt_sgd_dev_f32", "")?;
    let (zero, has_wd, has_buf, nest) = (0f32, weight_decay as i32, with_buf as i32, nesterov as i32);
    for (t, blocks) in mt_tables("sgd_step_many_dev", rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t, hp, skip, zero, has_wd, has_buf, nest))?;
    }
    Ok(())
}

/// [`blend_many`] with β read from device address `hp` (f64); the lerp factors are derived in the
/// kernel as [`crate::ops::optim::lerp_factor`] derives them; the momenta are not written when the
/// f32 flag at `skip` (0: none) is non-zero.
pub(crate) fn blend_many_dev(any: &CudaStorage, rows: &[([u64; 3], usize)], hp: u64, skip: u64, nesterov: bool) -> Result<()> {
    let dev = &any.buf.dev;
    let func = dev.func("mt_blend_dev_f32", "")?;
    let (nest, zero) = (nesterov as i32, 0f32);
    for (t, blocks) in mt_tables("momentum_blend_many_dev", rows)? {
        dev.launch(func, (blocks, 1, 1), (256, 1, 1), &mut args!(t, hp, skip, nest, zero))?;
    }
    Ok(())
}

/// Gradient clipping over `rows` (`([grad, 0, 0], len)`, f32, in place; `Tensor::clip_norm_many_`):
/// scratch = [partials (one per 2048-element chunk), norms (one per tensor), total, coefficient].
/// Per table of 40: the chunks' sums of squares, then each tensor's norm; then the total and the
/// coefficient in one thread; then per table every gradient times the coefficient.
pub(crate) fn clip_norm_many(any: &CudaStorage, rows: &[([u64; 3], usize)], scratch: [u64; 4], max_norm: f32) -> Result<()> {
    let dev = &any.buf.dev;
    let [partials, norms, total, coef] = scratch;
    let (sumsq, norm, finish, scale) =
        (dev.func("mt_sumsq_f32", "")?, dev.func("mt_norms_f32", "")?, dev.func("clip_coef_f32", "")?, dev.func("mt_scale_by_f32", "")?);
    let tables = mt_tables("clip_norm_many_", rows)?;
    let (mut part_at, mut norm_at) = (0u64, 0u64);
    // The tables go to the kernels by value (`args!` takes each argument's address: a reference
    // there would hand the kernel a pointer instead of the table — the first GPU run's bug).
    for &(t, blocks) in &tables {
        let (pa, na) = (partials + 4 * part_at, norms + 4 * norm_at);
        dev.launch(sumsq, (blocks, 1, 1), (256, 1, 1), &mut args!(t, pa))?;
        dev.launch(norm, (t.count, 1, 1), (1, 1, 1), &mut args!(t, pa, na))?;
        part_at += u64::from(blocks);
        norm_at += u64::from(t.count);
    }
    let (n, eps) = (u32c("clip_norm_many_", rows.len())?, 1e-6f32);
    dev.launch(finish, (1, 1, 1), (1, 1, 1), &mut args!(norms, n, max_norm, eps, total, coef))?;
    for &(t, blocks) in &tables {
        dev.launch(scale, (blocks, 1, 1), (256, 1, 1), &mut args!(t, coef))?;
    }
    Ok(())
}

/// GradScaler's unscale over `([grad, 0, 0], len)` rows (f32, in place; `Tensor::unscale_many_`):
/// the flag at `found` zeroed, then one launch per table of 40 multiplying by the f32 at `inv` and
/// setting the flag on a non-finite value.
pub(crate) fn unscale_many(any: &CudaStorage, rows: &[([u64; 3], usize)], inv: u64, found: u64) -> Result<()> {
    let dev = &any.buf.dev;
    dev.bind()?;
    super::super::counters::count(super::super::counters::Count::Memset);
    unsafe { dr::memset_d8_async(found, 0, 4, dev.stream()) }.map_err(|e| cu_err("cuMemsetD8Async", e))?;
    let f = dev.func("mt_unscale_f32", "")?;
    for (t, blocks) in mt_tables("unscale_many_", rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t, inv, found))?;
    }
    Ok(())
}

/// Whether gradient clipping on `device` takes the multi-tensor kernels
/// ([`super::super::DeviceOptions::fused_clip`]).
pub(crate) fn fused_clip_enabled(device: crate::Device) -> bool {
    super::super::device::dev_of(device).map(|d| d.options().fused_clip).unwrap_or(true)
}

/// One parameter's AdamW step (`Tensor::adamw_step_many_dev`): `ptrs` = [param, grad, exp_avg,
/// exp_avg_sq, step count (f64)], `n` elements, the group's scalars at `hp`, no write when the f32
/// flag at `skip` (0: none) is set. The count is read, not written (`count_many_dev` follows).
pub(crate) fn adamw_dev(any: &CudaStorage, ptrs: [u64; 5], n: usize, hp: u64, skip: u64, weight_decay: bool) -> Result<()> {
    let dev = &any.buf.dev;
    let f = dev.func("adamw_dev_f32", "")?;
    let [p, g, m, v, c] = ptrs;
    let (n32, has_wd, zero) = (u32c("adamw_step_many_dev", n)?, weight_decay as i32, 0f32);
    let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
    dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(p, g, m, v, c, hp, skip, n32, has_wd, zero))
}

/// `count += 1` for every f64 count of `rows` (`([count, 0, 0], 1)`), unless the f32 flag at `skip`
/// (0: none) is set.
pub(crate) fn count_many_dev(any: &CudaStorage, rows: &[([u64; 3], usize)], skip: u64) -> Result<()> {
    let dev = &any.buf.dev;
    let f = dev.func("mt_count_dev", "")?;
    for (t, blocks) in mt_tables("adamw_step_many_dev", rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t, skip))?;
    }
    Ok(())
}

/// [`lerp_many`] with the weight read from device address `hp` (f64).
pub(crate) fn lerp_many_dev(any: &CudaStorage, rows: &[([u64; 3], usize)], hp: u64) -> Result<()> {
    let dev = &any.buf.dev;
    let f = dev.func("mt_lerp_dev_f32", "")?;
    let zero = 0f32;
    for (t, blocks) in mt_tables("lerp_many_dev_", rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t, hp, zero))?;
    }
    Ok(())
}

/// A multi-tensor row's operand addresses (up to three) and its first operand's length.
fn row_table(rows: &[Vec<Operand<'_, CudaStorage>>]) -> Vec<([u64; 3], usize)> {
    rows.iter()
        .map(|r| {
            let mut ptrs = [0u64; 3];
            for (k, o) in r.iter().take(3).enumerate() {
                ptrs[k] = o.get().device_ptr();
            }
            (ptrs, r.first().map_or(0, |o| BackendStorage::len(o.get())))
        })
        .collect()
}

/// The address of a `*_dev` update's scalars and of its skip flag (0: none).
fn scalar_ptrs(s: &ScalarsAt<'_, CudaStorage>) -> (u64, u64) {
    (s.values.device_ptr() + 8 * s.at as u64, s.skip.map_or(0, CudaStorage::device_ptr))
}

impl MultiTensorStorage for CudaStorage {
    fn multi_tensor(op: MultiTensorOp<'_, Self>, rows: Vec<Vec<Operand<'_, Self>>>) -> Result<Option<Vec<Self>>> {
        let Some(any) = rows.iter().flatten().next().map(|o| o.get()) else { return Ok(Some(Vec::new())) };
        for o in rows.iter().flatten() {
            any.same_device("multi_tensor", o.get())?;
        }
        let table = row_table(&rows);
        match op {
            MultiTensorOp::Sgd { h, with_buf } => sgd_many(any, &table, h, with_buf)?,
            MultiTensorOp::SgdDev { scalars, weight_decay, nesterov, with_buf } => {
                let (hp, skip) = scalar_ptrs(&scalars);
                sgd_many_dev(any, &table, hp, skip, weight_decay, with_buf, nesterov)?;
            }
            MultiTensorOp::Blend { beta, nesterov } => {
                let factors = [crate::ops::optim::lerp_factor(1.0 - beta), crate::ops::optim::lerp_factor(beta)];
                blend_many(any, &table, factors, nesterov)?;
            }
            MultiTensorOp::BlendDev { scalars, nesterov } => {
                let (hp, skip) = scalar_ptrs(&scalars);
                blend_many_dev(any, &table, hp, skip, nesterov)?;
            }
            MultiTensorOp::Lerp { w } => {
                let (f, small) = crate::ops::optim::lerp_factor(w);
                lerp_many(any, &table, f, small)?;
            }
            MultiTensorOp::LerpDev { scalars } => lerp_many_dev(any, &table, scalar_ptrs(&scalars).0)?,
            MultiTensorOp::AdamWDev { scalars, weight_decay } => {
                let (hp, skip) = scalar_ptrs(&scalars);
                let mut counts = Vec::with_capacity(rows.len());
                for r in &rows {
                    let [x, g, m, v, c] = &r[..] else {
                        return Err(Error::invalid("adamw_step_many_dev", "a row needs x, g, m, v and its count"));
                    };
                    let ptrs = [x, g, m, v, c].map(|o| o.get().device_ptr());
                    adamw_dev(any, ptrs, BackendStorage::len(x.get()), hp, skip, weight_decay)?;
                    counts.push(([ptrs[4], 0, 0], 1));
                }
                // Every update above read its count before any count moves (stream order).
                count_many_dev(any, &counts, skip)?;
            }
            MultiTensorOp::Unscale { inv_scale } => {
                let Some((found, grads)) = table.split_last() else { return Ok(Some(Vec::new())) };
                unscale_many(any, grads, inv_scale.device_ptr(), found.0[0])?;
            }
            MultiTensorOp::ClipNorm { max_norm } => {
                if !fused_clip_enabled(crate::Device::Cuda(any.buf.dev.ordinal)) {
                    return Ok(None);
                }
                let blocks: usize = table.iter().map(|(_, n)| n.div_ceil(MT_CHUNK)).sum();
                let dev = &any.buf.dev;
                let partials = CudaStorage::alloc(dev, DType::F32, blocks.max(1))?;
                let norms = CudaStorage::alloc(dev, DType::F32, table.len().max(1))?;
                let total = CudaStorage::alloc(dev, DType::F32, 1)?;
                let coef = CudaStorage::alloc(dev, DType::F32, 1)?;
                let scratch = [partials.device_ptr(), norms.device_ptr(), total.device_ptr(), coef.device_ptr()];
                clip_norm_many(any, &table, scratch, max_norm)?;
                return Ok(Some(vec![total]));
            }
        }
        Ok(Some(Vec::new()))
    }
}

//! Launchers for the NVRTC kernels: element-wise, casts, strided copies, reductions, index ops,
//! top-k and max pooling. Every launcher allocates its output stream-ordered and queues the kernel
//! on the device's compute stream; nothing here synchronises or reads device memory on the host.

use std::ffi::c_void;

use cudarc::driver::result as dr;

use super::device::{cu_err, sfx, Dev};
use super::CudaStorage;
use crate::backend::{BinaryOp, CmpOp, Pool2dParams, ReduceOp, UnaryOp};
use crate::shape::Layout;
use crate::{DType, Error, Result};
use std::sync::Arc;

const MAXD: usize = 8;

/// Kernel geometry for up to three strided operands over one logical shape (see kernels.cu).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct Strided {
    rank: u32,
    shape: [u32; MAXD],
    st: [[u32; MAXD]; 3],
    off: [u32; 3],
}

fn u32c(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(op, format!("size {v} exceeds the CUDA backend's 32-bit indexing")))
}

/// Builds a coalesced geometry: size-1 dims dropped, adjacent dims merged where every operand is
/// contiguous across them.
pub(crate) fn strided(op: &'static str, shape: &[usize], ops: &[(&[usize], usize)]) -> Result<Strided> {
    let mut dims: Vec<(usize, [usize; 3])> = Vec::with_capacity(shape.len());
    for (d, &s) in shape.iter().enumerate() {
        if s == 1 {
            continue;
        }
        let mut st = [0usize; 3];
        for (k, (strides, _)) in ops.iter().enumerate() {
            st[k] = strides[d];
        }
        if let Some(last) = dims.last_mut() {
            if (0..ops.len()).all(|k| last.1[k] == st[k] * s) {
                last.0 *= s;
                last.1 = st;
                continue;
            }
        }
        dims.push((s, st));
    }
    if dims.len() > MAXD {
        return Err(Error::invalid(op, format!("rank {} after coalescing exceeds {MAXD} on CUDA", dims.len())));
    }
    let mut g = Strided { rank: dims.len() as u32, ..Default::default() };
    for (d, (s, st)) in dims.iter().enumerate() {
        g.shape[d] = u32c(op, *s)?;
        for (k, &v) in st.iter().enumerate().take(ops.len()) {
            g.st[k][d] = u32c(op, v)?;
        }
    }
    for (k, (_, off)) in ops.iter().enumerate() {
        g.off[k] = u32c(op, *off)?;
    }
    Ok(g)
}

macro_rules! args {
    ($($a:ident),* $(,)?) => {
        [$( &$a as *const _ as *mut c_void ),*]
    };
}

fn ptr(s: &CudaStorage) -> u64 {
    s.buf.ptr
}

// ---- element-wise ---------------------------------------------------------------------------------

fn unary_code(op: UnaryOp) -> (i32, f64, f64) {
    match op {
        UnaryOp::Neg => (0, 0.0, 0.0),
        UnaryOp::Exp => (1, 0.0, 0.0),
        UnaryOp::Log => (2, 0.0, 0.0),
        UnaryOp::Sqrt => (3, 0.0, 0.0),
        UnaryOp::Abs => (4, 0.0, 0.0),
        UnaryOp::Sigmoid => (5, 0.0, 0.0),
        UnaryOp::Silu => (6, 0.0, 0.0),
        UnaryOp::Tanh => (7, 0.0, 0.0),
        UnaryOp::Softplus => (8, 0.0, 0.0),
        UnaryOp::Atan => (9, 0.0, 0.0),
        UnaryOp::Recip => (10, 0.0, 0.0),
        UnaryOp::Sign => (11, 0.0, 0.0),
        UnaryOp::Square => (12, 0.0, 0.0),
        UnaryOp::Relu => (13, 0.0, 0.0),
        UnaryOp::Floor => (14, 0.0, 0.0),
        UnaryOp::Ceil => (15, 0.0, 0.0),
        UnaryOp::Powf(p) => (16, p, 0.0),
        UnaryOp::Clamp(lo, hi) => (17, lo, hi),
        UnaryOp::Affine(m, a) => (18, m, a),
        UnaryOp::SiluGrad => (19, 0.0, 0.0),
    }
}

pub(crate) fn unary(x: &CudaStorage, op: UnaryOp) -> Result<CudaStorage> {
    let dev = &x.buf.dev;
    let (code, p0, p1) = match (x.dtype, op) {
        (DType::I64, UnaryOp::Neg) => (0, 0.0, 0.0),
        (DType::I64, UnaryOp::Abs) => (1, 0.0, 0.0),
        (DType::I64, UnaryOp::Affine(m, a)) if m.fract() == 0.0 && a.fract() == 0.0 => (2, m, a),
        (DType::I64, UnaryOp::Clamp(lo, hi)) => (3, lo, hi),
        (dt, _) if dt.is_float() => unary_code(op),
        (dt, _) => return Err(Error::UnsupportedDType { op: "unary", dtype: dt, expected: "a float dtype" }),
    };
    let out = CudaStorage::alloc(dev, x.dtype, x.len)?;
    if x.len == 0 {
        return Ok(out);
    }
    let f = dev.func("unary", sfx(x.dtype))?;
    let (a, y, n) = (ptr(x), ptr(&out), u32c("unary", x.len)?);
    dev.launch1d(f, x.len, &mut args!(a, y, n, code, p0, p1))?;
    Ok(out)
}

fn binary_code(op: BinaryOp) -> i32 {
    match op {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::Maximum => 4,
        BinaryOp::Minimum => 5,
        BinaryOp::Pow => 6,
        BinaryOp::Atan2 => 7,
        BinaryOp::BceWithLogits => 8,
    }
}

fn plain(l: &Layout) -> bool {
    l.offset == 0 && l.is_contiguous()
}

/// `out = a op b` into `out` (which may alias `a` for in-place accumulation).
fn binary_into(a: &CudaStorage, la: &Layout, b: &CudaStorage, lb: &Layout, op: BinaryOp, out: &CudaStorage) -> Result<()> {
    let dev = &a.buf.dev;
    let n = la.numel();
    if n == 0 {
        return Ok(());
    }
    let code = binary_code(op);
    let unsupported = || Error::UnsupportedDType { op: "binary", dtype: a.dtype, expected: "a float dtype for this op" };
    let (pa, pb, py, nn) = (ptr(a), ptr(b), ptr(out), u32c("binary", n)?);
    match a.dtype {
        DType::U8 | DType::Bool => {
            if matches!(op, BinaryOp::Div | BinaryOp::Pow | BinaryOp::Atan2 | BinaryOp::BceWithLogits) {
                return Err(unsupported());
            }
            let g = strided("binary", &la.shape, &[(&la.strides, la.offset), (&lb.strides, lb.offset)])?;
            let is_bool = (a.dtype == DType::Bool) as i32;
            let f = dev.func("binary_s", "u8")?;
            dev.launch1d(f, n, &mut args!(pa, pb, py, nn, code, g, is_bool))
        }
        dt => {
            if dt == DType::I64 && matches!(op, BinaryOp::Pow | BinaryOp::Atan2 | BinaryOp::BceWithLogits) {
                return Err(unsupported());
            }
            if plain(la) && plain(lb) {
                let v = if dt.is_float() { 16 / dt.size_in_bytes() } else { 1 };
                if v > 1 && n.is_multiple_of(v) && [pa, pb, py].iter().all(|p| p.is_multiple_of(16)) {
                    // ld.global.nc in the vector loads is safe with out == a: each thread reads
                    // its elements before writing them, and no other thread touches them.
                    let f = dev.func("binary_cv", sfx(dt))?;
                    let nvec = nn / v as u32;
                    return dev.launch1d(f, n / v, &mut args!(pa, pb, py, nvec, code));
                }
                let f = dev.func("binary_c", sfx(dt))?;
                dev.launch1d(f, n, &mut args!(pa, pb, py, nn, code))
            } else {
                let g = strided("binary", &la.shape, &[(&la.strides, la.offset), (&lb.strides, lb.offset)])?;
                let f = dev.func("binary_s", sfx(dt))?;
                dev.launch1d(f, n, &mut args!(pa, pb, py, nn, code, g))
            }
        }
    }
}

pub(crate) fn binary(a: &CudaStorage, la: &Layout, b: &CudaStorage, lb: &Layout, op: BinaryOp) -> Result<CudaStorage> {
    if a.dtype != b.dtype {
        return Err(Error::DTypeMismatch { op: "binary", lhs: a.dtype, rhs: b.dtype });
    }
    a.same_device("binary", b)?;
    let out = CudaStorage::alloc(&a.buf.dev, a.dtype, la.numel())?;
    binary_into(a, la, b, lb, op, &out)?;
    Ok(out)
}

pub(crate) fn add_assign(dst: &mut CudaStorage, src: &CudaStorage) -> Result<()> {
    if dst.len != src.len {
        return Err(Error::ShapeMismatch { op: "add_assign", lhs: vec![dst.len], rhs: vec![src.len] });
    }
    if dst.dtype != src.dtype || matches!(dst.dtype, DType::U8 | DType::Bool) {
        return Err(Error::DTypeMismatch { op: "add_assign", lhs: dst.dtype, rhs: src.dtype });
    }
    dst.same_device("add_assign", src)?;
    let l = Layout::contiguous(&[dst.len]);
    binary_into(dst, &l, src, &l, BinaryOp::Add, dst)
}

/// Tensors per multi-tensor launch and elements per block (`MT_ADD`, `MT_CHUNK` in kernels.cu).
const MT_ADD: usize = 40;
pub(crate) const MT_CHUNK: usize = 2048;

/// The kernel-parameter table of the multi-tensor kernels (layout of `MtTable` in kernels.cu):
/// up to three operand addresses per tensor, its length and first block.
#[repr(C)]
#[derive(Clone, Copy)]
struct MtTable {
    ptr: [[u64; MT_ADD]; 3],
    len: [u32; MT_ADD],
    first_block: [u32; MT_ADD + 1],
    count: u32,
}

/// The tables for `rows` (operand addresses, length) in chunks of 40, each with its block count
/// (tables without a block are left out).
fn mt_tables(op: &'static str, rows: &[([u64; 3], usize)]) -> Result<Vec<(MtTable, u32)>> {
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

/// Launches a table-only multi-tensor kernel (`mt_add`, `mt_cast`) over `(dst, src, len)` items.
fn launch_multi_tensor(dev: &super::device::Dev, f: cudarc::driver::sys::CUfunction, items: &[(u64, u64, usize)]) -> Result<()> {
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
    super::counters::count(super::counters::Count::Memset);
    unsafe { dr::memset_d8_async(found, 0, 4, dev.cu_stream) }.map_err(|e| cu_err("cuMemsetD8Async", e))?;
    let f = dev.func("mt_unscale_f32", "")?;
    for (t, blocks) in mt_tables("unscale_many_", rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t, inv, found))?;
    }
    Ok(())
}

/// Matrices per padded-batch launch (`PACK_MAX` in kernels.cu).
const PACK_MAX: usize = 40;

/// The kernel-parameter table of `pack_pad_*` / `unpack_pad_*` (layout of `PackTable` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct PackTable {
    src: [u64; PACK_MAX],
    dst: [u64; PACK_MAX],
    rows: [u32; PACK_MAX],
    cols: [u32; PACK_MAX],
    transposed: [u32; PACK_MAX],
    scale: [f32; PACK_MAX],
    count: u32,
    slot_rows: u32,
    slot_cols: u32,
}

/// One matrix of a padded-batch launch: source and destination addresses, its shape and its scale.
pub(crate) type PackRow = (u64, u64, crate::ops::pack::PackedMatrix, f32);

/// The tables of `items` in chunks of [`PACK_MAX`].
fn pack_tables(op: &'static str, items: &[PackRow], rows: usize, cols: usize) -> Result<Vec<PackTable>> {
    let (slot_rows, slot_cols) = (u32c(op, rows)?, u32c(op, cols)?);
    u32c(op, rows * cols)?;
    items
        .chunks(PACK_MAX)
        .map(|chunk| {
            let mut t = PackTable {
                src: [0; PACK_MAX],
                dst: [0; PACK_MAX],
                rows: [0; PACK_MAX],
                cols: [0; PACK_MAX],
                transposed: [0; PACK_MAX],
                scale: [1.0; PACK_MAX],
                count: chunk.len() as u32,
                slot_rows,
                slot_cols,
            };
            for (k, &(src, dst, m, scale)) in chunk.iter().enumerate() {
                (t.src[k], t.dst[k], t.scale[k]) = (src, dst, scale);
                (t.rows[k], t.cols[k], t.transposed[k]) = (u32c(op, m.rows)?, u32c(op, m.cols)?, m.transposed as u32);
            }
            Ok(t)
        })
        .collect()
}

/// Packs f32 matrices into zero-padded `rows × cols` slots of `dtype` (`Tensor::pack_padded`).
pub(crate) fn pack_padded(any: &CudaStorage, items: &[PackRow], rows: usize, cols: usize, dtype: DType) -> Result<()> {
    let dev = &any.buf.dev;
    let name = match dtype {
        DType::BF16 => "pack_pad_f32_bf16",
        DType::F32 => "pack_pad_f32_f32",
        DType::F64 => "pack_pad_f32_f64",
        other => return Err(Error::UnsupportedDType { op: "pack_padded", dtype: other, expected: "bf16, f32 or f64 slots" }),
    };
    let f = dev.func(name, "")?;
    let chunks = u32c("pack_padded", (rows * cols).div_ceil(MT_CHUNK))?;
    for t in pack_tables("pack_padded", items, rows, cols)? {
        if chunks > 0 {
            dev.launch(f, (chunks, t.count, 1), (256, 1, 1), &mut args!(t))?;
        }
    }
    Ok(())
}

/// Unpacks slots of `src` dtype into f32 matrices, scaled (`Tensor::unpack_padded`).
pub(crate) fn unpack_padded(any: &CudaStorage, items: &[PackRow], rows: usize, cols: usize, src: DType) -> Result<()> {
    let dev = &any.buf.dev;
    let name = match src {
        DType::BF16 => "unpack_pad_bf16_f32",
        DType::F32 => "unpack_pad_f32_f32",
        DType::F64 => "unpack_pad_f64_f32",
        other => return Err(Error::UnsupportedDType { op: "unpack_padded", dtype: other, expected: "bf16, f32 or f64 slots" }),
    };
    let f = dev.func(name, "")?;
    let zero = 0f32;
    for (chunk, t) in items.chunks(PACK_MAX).zip(pack_tables("unpack_padded", items, rows, cols)?) {
        let largest = chunk.iter().map(|(_, _, m, _)| m.rows * m.cols).max().unwrap_or(0);
        let blocks = u32c("unpack_padded", largest.div_ceil(MT_CHUNK))?;
        if blocks > 0 {
            dev.launch(f, (blocks, t.count, 1), (256, 1, 1), &mut args!(t, zero))?;
        }
    }
    Ok(())
}

/// Whether gradient clipping on `device` takes the multi-tensor kernels
/// ([`super::DeviceOptions::fused_clip`]).
pub(crate) fn fused_clip_enabled(device: crate::Device) -> bool {
    super::dev_of(device).map(|d| d.options().fused_clip).unwrap_or(true)
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

/// Casts every storage to `dt`, the same bytes as [`to_dtype`] on each; f32 ↔ bf16/f16 run as one
/// launch per 40 tensors (autocast's weight copies and their gradients), other pairs one by one.
pub(crate) fn to_dtype_many(xs: &[&CudaStorage], dt: DType) -> Result<Vec<CudaStorage>> {
    let Some(first) = xs.first() else { return Ok(Vec::new()) };
    let name = match (first.dtype, dt) {
        (DType::F32, DType::BF16) => Some("mt_cast_f32_bf16"),
        (DType::F32, DType::F16) => Some("mt_cast_f32_f16"),
        (DType::BF16, DType::F32) => Some("mt_cast_bf16_f32"),
        (DType::F16, DType::F32) => Some("mt_cast_f16_f32"),
        _ => None,
    };
    let uniform = xs.iter().all(|x| x.dtype == first.dtype && x.same_device("to_dtype", first).is_ok());
    let (Some(name), true) = (name, uniform) else { return xs.iter().map(|x| to_dtype(x, dt)).collect() };
    let dev = &first.buf.dev;
    let outs = xs.iter().map(|x| CudaStorage::alloc(dev, dt, x.len)).collect::<Result<Vec<_>>>()?;
    let items: Vec<(u64, u64, usize)> = outs.iter().zip(xs).filter(|(_, x)| x.len > 0).map(|(o, x)| (ptr(o), ptr(x), x.len)).collect();
    launch_multi_tensor(dev, dev.func(name, "")?, &items)?;
    Ok(outs)
}

pub(crate) fn cmp(a: &CudaStorage, la: &Layout, b: &CudaStorage, lb: &Layout, op: CmpOp) -> Result<CudaStorage> {
    if a.dtype != b.dtype {
        return Err(Error::DTypeMismatch { op: "cmp", lhs: a.dtype, rhs: b.dtype });
    }
    a.same_device("cmp", b)?;
    let dev = &a.buf.dev;
    let n = la.numel();
    let out = CudaStorage::alloc(dev, DType::Bool, n)?;
    if n == 0 {
        return Ok(out);
    }
    let code = match op {
        CmpOp::Eq => 0i32,
        CmpOp::Ne => 1,
        CmpOp::Lt => 2,
        CmpOp::Le => 3,
        CmpOp::Gt => 4,
        CmpOp::Ge => 5,
    };
    let g = strided("cmp", &la.shape, &[(&la.strides, la.offset), (&lb.strides, lb.offset)])?;
    let f = dev.func("cmp_s", sfx(a.dtype))?;
    let (pa, pb, py, nn) = (ptr(a), ptr(b), ptr(&out), u32c("cmp", n)?);
    dev.launch1d(f, n, &mut args!(pa, pb, py, nn, code, g))?;
    Ok(out)
}

pub(crate) fn where_cond(c: &CudaStorage, lc: &Layout, a: &CudaStorage, la: &Layout, b: &CudaStorage, lb: &Layout) -> Result<CudaStorage> {
    if a.dtype != b.dtype {
        return Err(Error::DTypeMismatch { op: "where_cond", lhs: a.dtype, rhs: b.dtype });
    }
    c.same_device("where_cond", a)?;
    a.same_device("where_cond", b)?;
    let conv;
    let c = if matches!(c.dtype, DType::U8 | DType::Bool) {
        c
    } else {
        conv = to_dtype(c, DType::Bool)?;
        &conv
    };
    let dev = &a.buf.dev;
    let n = lc.numel();
    let out = CudaStorage::alloc(dev, a.dtype, n)?;
    if n == 0 {
        return Ok(out);
    }
    let g = strided("where_cond", &lc.shape, &[(&lc.strides, lc.offset), (&la.strides, la.offset), (&lb.strides, lb.offset)])?;
    let f = dev.func("where_s", sfx(a.dtype))?;
    let (pc, pa, pb, py, nn) = (ptr(c), ptr(a), ptr(b), ptr(&out), u32c("where_cond", n)?);
    dev.launch1d(f, n, &mut args!(pc, pa, pb, py, nn, g))?;
    Ok(out)
}

/// Fills every element with `value` (converted to the dtype like a cast from f64).
pub(crate) fn fill(s: &CudaStorage, value: f64) -> Result<()> {
    let dev = &s.buf.dev;
    if s.len == 0 {
        return Ok(());
    }
    if value == 0.0 && value.is_sign_positive() {
        dev.bind()?;
        super::counters::count(super::counters::Count::Memset);
        return unsafe { dr::memset_d8_async(s.buf.ptr, 0, s.len * s.dtype.size_in_bytes(), dev.cu_stream) }
            .map_err(|e| cu_err("cuMemsetD8Async", e));
    }
    let v = if s.dtype == DType::Bool { (value != 0.0) as u8 as f64 } else { value };
    let f = dev.func("fill", sfx(s.dtype))?;
    let (py, nn) = (ptr(s), u32c("fill", s.len)?);
    dev.launch1d(f, s.len, &mut args!(py, nn, v))
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

pub(crate) fn to_dtype(x: &CudaStorage, dt: DType) -> Result<CudaStorage> {
    let dev = &x.buf.dev;
    if x.dtype == dt {
        return x.try_clone();
    }
    let out = CudaStorage::alloc(dev, dt, x.len)?;
    if x.len == 0 {
        return Ok(out);
    }
    let src = x.dtype;
    if matches!((src, dt), (DType::Bool, DType::U8)) {
        dev.bind()?;
        super::counters::count(super::counters::Count::DeviceToDevice);
        unsafe { dr::memcpy_dtod_async(out.buf.ptr, x.buf.ptr, x.len, dev.cu_stream) }.map_err(|e| cu_err("cuMemcpyDtoDAsync", e))?;
        return Ok(out);
    }
    let (base, suffix): (&'static str, &'static str) = match (src, dt) {
        (_, DType::Bool) => ("cast_bool", sfx(src)),
        (DType::F32, DType::BF16) => ("cast_f32", "bf16"),
        (DType::F32, DType::F16) => ("cast_f32", "f16"),
        (DType::I64, DType::U8) => ("cast_i64", "u8"),
        (DType::I64, d) => ("cast_i64", sfx(d)),
        (s, d) => {
            let base = match s {
                DType::F32 => "cast_f32",
                DType::F64 => "cast_f64",
                DType::F16 => "cast_f16",
                DType::BF16 => "cast_bf16",
                _ => "cast_u8",
            };
            let suffix = match d {
                DType::F32 => "f32",
                DType::F64 => "f64",
                DType::F16 => "f16x",
                DType::BF16 => "bf16x",
                DType::I64 => "i64x",
                _ => "u8",
            };
            (base, suffix)
        }
    };
    let f = dev.func(base, suffix)?;
    let (px, py, nn) = (ptr(x), ptr(&out), u32c("to_dtype", x.len)?);
    dev.launch1d(f, x.len, &mut args!(px, py, nn))?;
    Ok(out)
}

pub(crate) fn copy_strided(src: &CudaStorage, sl: &Layout, dst: &mut CudaStorage, dl: &Layout) -> Result<()> {
    if sl.shape != dl.shape {
        return Err(Error::ShapeMismatch { op: "copy_strided", lhs: sl.shape.clone(), rhs: dl.shape.clone() });
    }
    if src.dtype != dst.dtype {
        return Err(Error::DTypeMismatch { op: "copy_strided", lhs: src.dtype, rhs: dst.dtype });
    }
    src.same_device("copy_strided", dst)?;
    let dev = &src.buf.dev;
    let n = sl.numel();
    if n == 0 {
        return Ok(());
    }
    let es = src.dtype.size_in_bytes();
    if sl.is_contiguous() && dl.is_contiguous() {
        dev.bind()?;
        super::counters::count(super::counters::Count::DeviceToDevice);
        return unsafe {
            dr::memcpy_dtod_async(dst.buf.ptr + (dl.offset * es) as u64, src.buf.ptr + (sl.offset * es) as u64, n * es, dev.cu_stream)
        }
        .map_err(|e| cu_err("cuMemcpyDtoDAsync", e));
    }
    let g = strided("copy_strided", &sl.shape, &[(&sl.strides, sl.offset), (&dl.strides, dl.offset)])?;
    // Row copies (concatenation, narrowing): after coalescing, rows of contiguous elements with
    // pitches on both sides go through a vectorised 2-D copy kernel (16-byte accesses where the
    // row width, pitches and bases allow) instead of the per-element indexing kernel.
    let rows_ok = |k: usize| g.st[k][1] == 1 && g.st[k][0] >= g.shape[1];
    if g.rank <= 2
        && (g.rank < 2 || (rows_ok(0) && rows_ok(1)))
        && (g.rank == 0 || g.st[0][g.rank as usize - 1] == 1 && g.st[1][g.rank as usize - 1] == 1)
    {
        let (h, w, sp, dp) = match g.rank {
            2 => (g.shape[0] as usize, g.shape[1] as usize * es, g.st[0][0] as usize * es, g.st[1][0] as usize * es),
            1 => (1, g.shape[0] as usize * es, g.shape[0] as usize * es, g.shape[0] as usize * es),
            _ => (1, es, es, es),
        };
        let sb = src.buf.ptr + (g.off[0] as usize * es) as u64;
        let db = dst.buf.ptr + (g.off[1] as usize * es) as u64;
        return copy_rows(dev, sb, db, h, w, sp, dp);
    }
    let f = dev.func("copy_s", sfx(src.dtype))?;
    let (px, py, nn) = (ptr(src), ptr(dst), u32c("copy_strided", n)?);
    dev.launch1d(f, n, &mut args!(px, py, nn, g))
}

/// The widest access (16, 8, 4, 2 or 1 bytes) that divides `all` (the OR of every size, pitch,
/// offset and base address involved).
fn access_width(all: u64) -> usize {
    [16usize, 8, 4, 2, 1].into_iter().find(|v| all.is_multiple_of(*v as u64)).unwrap_or(1)
}

/// Copies `h` rows of `w` bytes from `sb` (pitch `sp`) to `db` (pitch `dp`) with the widest
/// access (16/8/4/2/1 bytes) that divides the width, both pitches and both base addresses.
fn copy_rows(dev: &Arc<Dev>, sb: u64, db: u64, h: usize, w: usize, sp: usize, dp: usize) -> Result<()> {
    let v = access_width((w | sp | dp) as u64 | sb | db);
    let name = ["copy2d_v1", "copy2d_v2", "copy2d_v4", "copy2d_v8", "copy2d_v16"][v.trailing_zeros() as usize];
    let total = h * (w / v);
    if total == 0 {
        return Ok(());
    }
    let f = dev.func(name, "")?;
    let (rows, cols) = (u32c("copy_strided", h)?, u32c("copy_strided", w / v)?);
    u32c("copy_strided", total)?;
    let (spv, dpv) = ((sp / v) as u64, (dp / v) as u64);
    dev.launch1d(f, total, &mut args!(sb, db, rows, cols, spv, dpv))
}

/// Kernel argument of `cat_rows_*` (see kernels.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CatArgs {
    src: [u64; 8],
    cols: [u32; 8],
    off: [u32; 8],
}

/// Most inputs [`cat_rows`] takes in one launch.
pub(crate) const CAT_MAX_INPUTS: usize = 8;

/// Concatenates contiguous inputs into `dst` in one launch: `rows` rows; input `k` (device address
/// `srcs[k].0`) holds `srcs[k].1` bytes per row and lands at the running byte offset of each
/// output row. Uses the widest access (16/8/4/2/1 bytes) that divides every width, offset, the
/// output pitch and every base address.
pub(crate) fn cat_rows(dst: &CudaStorage, rows: usize, srcs: &[(u64, usize)]) -> Result<()> {
    launch_row_pieces("cat", "cat_rows", dst, rows, srcs)
}

/// Splits `src` (`rows` rows) into contiguous outputs in one launch, the inverse of
/// [`cat_rows`]: output `k` (device address `dsts[k].0`) receives `dsts[k].1` bytes of every row,
/// taken at the running byte offset. Same access-width rule as [`cat_rows`].
pub(crate) fn split_rows(src: &CudaStorage, rows: usize, dsts: &[(u64, usize)]) -> Result<()> {
    launch_row_pieces("split", "split_rows", src, rows, dsts)
}

/// One launch of `kernel` (`cat_rows` / `split_rows`) between the `rows` rows of `whole` and the
/// contiguous `pieces` (device address, bytes per row), which tile each row in order.
fn launch_row_pieces(op: &'static str, kernel: &'static str, whole: &CudaStorage, rows: usize, pieces: &[(u64, usize)]) -> Result<()> {
    if pieces.is_empty() || pieces.len() > CAT_MAX_INPUTS {
        return Err(Error::invalid(op, format!("{} pieces for one launch (1..={CAT_MAX_INPUTS})", pieces.len())));
    }
    let dev = &whole.buf.dev;
    let pitch: usize = pieces.iter().map(|s| s.1).sum();
    if rows * pitch != whole.len * whole.dtype.size_in_bytes() {
        return Err(Error::invalid(
            op,
            format!("{rows} rows of {pitch} bytes do not match the {}-byte tensor", whole.len * whole.dtype.size_in_bytes()),
        ));
    }
    let mut all = pitch as u64 | whole.buf.ptr;
    let mut off = 0usize;
    for &(p, w) in pieces {
        all |= p | w as u64 | off as u64;
        off += w;
    }
    let v = access_width(all);
    let name = ["_v1", "_v2", "_v4", "_v8", "_v16"][v.trailing_zeros() as usize];
    let mut a = CatArgs::default();
    let mut off = 0usize;
    let mut most = 0usize;
    for (k, &(p, w)) in pieces.iter().enumerate() {
        a.src[k] = p;
        a.cols[k] = u32c(op, w / v)?;
        a.off[k] = u32c(op, off / v)?;
        u32c(op, rows * (w / v))?;
        most = most.max(rows * (w / v));
        off += w;
    }
    if most == 0 {
        return Ok(());
    }
    let f = dev.func(kernel, &name[1..])?;
    let (pw, rr, wp) = (ptr(whole), u32c(op, rows)?, u32c(op, pitch / v)?);
    let blocks = most.div_ceil(256).clamp(1, 65536) as u32;
    dev.launch(f, (blocks, pieces.len() as u32, 1), (256, 1, 1), &mut args!(a, pw, rr, wp))
}

// ---- reductions -----------------------------------------------------------------------------------

fn split3(shape: &[usize], dim: usize) -> (usize, usize, usize) {
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

// ---- index ops --------------------------------------------------------------------------------------

fn need_i64(op: &'static str, s: &CudaStorage) -> Result<()> {
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

fn float_or_i64(op: &'static str, dt: DType) -> Result<()> {
    if dt.is_float() || dt == DType::I64 {
        Ok(())
    } else {
        Err(Error::UnsupportedDType { op, dtype: dt, expected: "a float or I64 dtype" })
    }
}

pub(crate) fn index_add(x: &CudaStorage, shape: &[usize], dim: usize, idx: &CudaStorage, src: &CudaStorage) -> Result<CudaStorage> {
    need_i64("index_add", idx)?;
    float_or_i64("index_add", x.dtype)?;
    if src.dtype != x.dtype {
        return Err(Error::DTypeMismatch { op: "index_add", lhs: x.dtype, rhs: src.dtype });
    }
    x.same_device("index_add", idx)?;
    x.same_device("index_add", src)?;
    let (outer, d, inner) = split3(shape, dim);
    let n = idx.len;
    if src.len != outer * n * inner {
        return Err(Error::invalid("index_add", format!("source has {} elements, expected {}", src.len, outer * n * inner)));
    }
    let dev = &x.buf.dev;
    let out = CudaStorage::alloc(dev, x.dtype, x.len)?;
    if x.len == 0 {
        return Ok(out);
    }
    let (px, pi, ps, py) = (ptr(x), ptr(idx), ptr(src), ptr(&out));
    let (o, dd, nn, ii) = (u32c("index_add", outer)?, u32c("index_add", d)?, u32c("index_add", n)?, u32c("index_add", inner)?);
    if n == 0 || !x.buf.dev.options().index_add_by_buckets || (x.len as u64) * (n as u64) < 1 << 20 {
        // Small: one launch scanning every index per output element.
        let f = dev.func("index_add", sfx(x.dtype))?;
        dev.launch1d(f, x.len, &mut args!(px, pi, ps, py, o, dd, nn, ii))?;
        return Ok(out);
    }
    // By buckets (see kernels.cu): the same sums in the same order, O(n + d + outputs).
    u32c("index_add", d + 1)?;
    let (counts, cursor) = (super::alloc::DevBuf::alloc(dev, 4 * d)?, super::alloc::DevBuf::alloc(dev, 4 * d)?);
    let (offsets, rows) = (super::alloc::DevBuf::alloc(dev, 4 * (d + 1))?, super::alloc::DevBuf::alloc(dev, 4 * n)?);
    dev.bind()?;
    for b in [&counts, &cursor] {
        super::counters::count(super::counters::Count::Memset);
        unsafe { dr::memset_d8_async(b.ptr, 0, b.bytes, dev.cu_stream) }.map_err(|e| cu_err("cuMemsetD8Async", e))?;
    }
    let (pc, pu, po, pr) = (counts.ptr, cursor.ptr, offsets.ptr, rows.ptr);
    dev.launch1d(dev.func("ia_count", "")?, n, &mut args!(pi, nn, dd, pc))?;
    // The counts' exclusive scan, by blocks of 1024 (see kernels.cu).
    let blocks = d.div_ceil(1024);
    let (sums, block_offsets) = (super::alloc::DevBuf::alloc(dev, 4 * blocks)?, super::alloc::DevBuf::alloc(dev, 4 * (blocks + 1))?);
    // (`psums`, not `ps`: that name holds the source rows' pointer, which `ia_sum` reads below.)
    let (psums, pb, bb) = (sums.ptr, block_offsets.ptr, u32c("index_add", blocks)?);
    dev.launch(dev.func("ia_block_sums", "")?, (bb, 1, 1), (1024, 1, 1), &mut args!(pc, dd, psums))?;
    dev.launch(dev.func("ia_scan", "")?, (1, 1, 1), (1024, 1, 1), &mut args!(psums, pb, bb))?;
    dev.launch(dev.func("ia_scan_apply", "")?, (bb, 1, 1), (1024, 1, 1), &mut args!(pc, pb, po, dd, bb))?;
    dev.launch1d(dev.func("ia_fill", "")?, n, &mut args!(pi, nn, dd, po, pu, pr))?;
    dev.launch1d(dev.func("ia_sort", "")?, d, &mut args!(po, dd, pr))?;
    dev.launch1d(dev.func("ia_sum", sfx(x.dtype))?, x.len, &mut args!(px, ps, po, pr, py, o, dd, nn, ii))?;
    Ok(out)
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GatherGeo {
    rank: u32,
    dim: u32,
    xshape: [u32; MAXD],
    ishape: [u32; MAXD],
}

fn gather_geo(op: &'static str, shape: &[usize], dim: usize, idx_shape: &[usize]) -> Result<GatherGeo> {
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
const TOPK_SELECT_MAX_K: usize = 64;

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

// ---- pooling -------------------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
struct PoolGeo {
    planes: u32,
    h: u32,
    w: u32,
    oh: u32,
    ow: u32,
    k: u32,
    s: u32,
    p: u32,
}

fn pool_geo(p: &Pool2dParams) -> Result<PoolGeo> {
    let c = |v| u32c("max_pool2d", v);
    Ok(PoolGeo {
        planes: c(p.batch * p.channels)?,
        h: c(p.h_in)?,
        w: c(p.w_in)?,
        oh: c(p.h_out())?,
        ow: c(p.w_out())?,
        k: c(p.kernel)?,
        s: c(p.stride)?,
        p: c(p.padding)?,
    })
}

pub(crate) fn max_pool2d(x: &CudaStorage, p: &Pool2dParams) -> Result<(CudaStorage, CudaStorage)> {
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: "max_pool2d", dtype: x.dtype, expected: "a float dtype" });
    }
    let dev = &x.buf.dev;
    let n = p.batch * p.channels * p.h_out() * p.w_out();
    let vals = CudaStorage::alloc(dev, x.dtype, n)?;
    let idx = CudaStorage::alloc(dev, DType::I64, n)?;
    if n == 0 {
        return Ok((vals, idx));
    }
    let g = pool_geo(p)?;
    let f = dev.func("maxpool_fwd", sfx(x.dtype))?;
    let (px, pv, pi) = (ptr(x), ptr(&vals), ptr(&idx));
    dev.launch1d(f, n, &mut args!(px, pv, pi, g))?;
    Ok((vals, idx))
}

pub(crate) fn max_pool2d_backward(dy: &CudaStorage, idx: &CudaStorage, p: &Pool2dParams) -> Result<CudaStorage> {
    need_i64("max_pool2d_backward", idx)?;
    if !dy.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: "max_pool2d_backward", dtype: dy.dtype, expected: "a float dtype" });
    }
    dy.same_device("max_pool2d_backward", idx)?;
    let dev = &dy.buf.dev;
    let n = p.batch * p.channels * p.h_in * p.w_in;
    let dx = CudaStorage::alloc(dev, dy.dtype, n)?;
    if n == 0 {
        return Ok(dx);
    }
    let g = pool_geo(p)?;
    let f = dev.func("maxpool_bwd", sfx(dy.dtype))?;
    let (pd, pi, px) = (ptr(dy), ptr(idx), ptr(&dx));
    dev.launch1d(f, n, &mut args!(pd, pi, px, g))?;
    Ok(dx)
}

fn nchw(op: &'static str, shape: &[usize], len: usize) -> Result<(usize, usize, usize)> {
    if shape.len() != 4 || shape.iter().product::<usize>() != len {
        return Err(Error::invalid(op, format!("expected a contiguous NCHW tensor, got shape {shape:?} for {len} elements")));
    }
    Ok((shape[0], shape[1], shape[2] * shape[3]))
}

fn stats_arg(op: &'static str, s: &CudaStorage, want: DType, c: usize) -> Result<()> {
    if s.dtype != want || s.len != c {
        return Err(Error::invalid(op, format!("expected {c} values of {want}, got {} of {}", s.len, s.dtype)));
    }
    Ok(())
}

/// Vector width of the batch-norm kernels (see kernels.cu): 16-byte loads when every run of HW
/// elements is a whole number of vectors and the buffers are 16-byte aligned, else 1.
fn bn_vector(dtype: DType, hw: usize, bufs: &[&CudaStorage]) -> (&'static str, usize) {
    let v = 16 / dtype.size_in_bytes();
    if hw.is_multiple_of(v) && bufs.iter().all(|b| ptr(b).is_multiple_of(16)) {
        ("_v", v)
    } else {
        ("", 1)
    }
}

/// Blocks per channel of the batch-norm reductions: ≤ 8192 elements each and about two blocks per
/// SM in all (264), but one block for a channel of ≤ 4096 elements, which then needs no second
/// phase (the combine of partials is a serial tail of a few µs per launch, measured as most of a
/// small layer's time). The forward and backward use the same split.
fn bn_parts(total: usize, c: usize) -> usize {
    let one = bn_one_block_max();
    if total <= one {
        return 1;
    }
    total.div_ceil(8192).max(264usize.div_ceil(c)).min(total.div_ceil(4096)).clamp(1, 1024)
}

/// The largest channel (values) one block reduces alone: 4096, or `PTL_BN_ONE_BLOCK_MAX` (for
/// measuring; a different value changes the summation order of the layers it moves, so the
/// bytes of a run, which stay fixed for any one setting).
fn bn_one_block_max() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| match std::env::var("PTL_BN_ONE_BLOCK_MAX") {
        Err(_) => 4096,
        Ok(v) => v.trim().parse::<usize>().ok().filter(|&m| (1..=1 << 20).contains(&m)).unwrap_or_else(|| {
            eprintln!("ptl: PTL_BN_ONE_BLOCK_MAX={v:?} is not a count of values from 1 to 1048576; using 4096");
            4096
        }),
    })
}

/// Whether a batch-norm layer of `parts` channel blocks runs as one launch on `dev`
/// ([`super::DeviceOptions::bn_one_launch`]).
fn bn_one_launch(dev: &super::device::Dev, parts: usize) -> bool {
    parts == 1 && dev.options().bn_one_launch
}

fn bn_channels(op: &'static str, c: usize) -> Result<u32> {
    if c > super::device::BN_TICKETS {
        return Err(Error::invalid(op, format!("{c} channels; the CUDA batch norm handles at most {}", super::device::BN_TICKETS)));
    }
    u32c(op, c)
}

/// Deterministic one-launch batch statistics: per-(channel, block) f64 partial sums, the last
/// block of each channel finishing its parameters, running statistics and (optionally) the
/// `num_batches_tracked` counter (see kernels.cu).
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_train_stats(
    x: &CudaStorage,
    shape: &[usize],
    w: &CudaStorage,
    b: &CudaStorage,
    rm: &mut CudaStorage,
    rv: &mut CudaStorage,
    batches: Option<&mut CudaStorage>,
    eps: f64,
    momentum: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    let (_, aff, nrm) = bn_train(x, shape, w, b, rm, rv, batches, eps, momentum, None)?;
    Ok((aff, nrm))
}

/// The statistics and `y = act(x·scale + shift)`: for a channel small enough for one block
/// (`bn_parts` = 1) in one launch (`bn_fwd1`, the two kernels' arithmetic), else the statistics
/// launch and [`channel_affine`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_train_apply(
    x: &CudaStorage,
    shape: &[usize],
    w: &CudaStorage,
    b: &CudaStorage,
    rm: &mut CudaStorage,
    rv: &mut CudaStorage,
    batches: Option<&mut CudaStorage>,
    eps: f64,
    momentum: f64,
    silu: bool,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    match bn_train(x, shape, w, b, rm, rv, batches, eps, momentum, Some(silu))? {
        (Some(y), aff, nrm) => Ok((y, aff, nrm)),
        (None, aff, nrm) => {
            let y = channel_affine(x, shape, &aff, silu)?;
            Ok((y, aff, nrm))
        }
    }
}

/// The statistics launch; with `apply` = `Some(silu)` and one block per channel, the fused
/// statistics-and-apply launch, whose output it returns.
#[allow(clippy::too_many_arguments)]
fn bn_train(
    x: &CudaStorage,
    shape: &[usize],
    w: &CudaStorage,
    b: &CudaStorage,
    rm: &mut CudaStorage,
    rv: &mut CudaStorage,
    batches: Option<&mut CudaStorage>,
    eps: f64,
    momentum: f64,
    apply: Option<bool>,
) -> Result<(Option<CudaStorage>, CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_train_stats";
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: x.dtype, expected: "a float dtype" });
    }
    let (n, c, hw) = nchw(OP, shape, x.len)?;
    let sd = crate::backend::stats_dtype(x.dtype);
    for s in [w, b, &*rm, &*rv] {
        stats_arg(OP, s, sd, c)?;
        x.same_device(OP, s)?;
    }
    let nbt = match batches {
        Some(s) => {
            if s.dtype != DType::I64 || s.len != 1 {
                return Err(Error::invalid(OP, format!("the batch counter must be one i64, got {} of {}", s.len, s.dtype)));
            }
            x.same_device(OP, s)?;
            ptr(s)
        }
        None => 0u64,
    };
    let dev = &x.buf.dev;
    let total = n * hw;
    if c == 0 || total == 0 {
        return Err(Error::invalid(OP, format!("empty batch for shape {shape:?}")));
    }
    let aff = CudaStorage::alloc(dev, sd, 2 * c)?;
    let nrm = CudaStorage::alloc(dev, sd, 2 * c)?;
    let parts = bn_parts(total, c);
    // The statistics' summation order follows x's vector width alone; the fused launch also
    // stores y with it, so y must allow it too.
    let (vsfx, _) = bn_vector(x.dtype, hw, &[x]);
    let (px, nn, cc, hh) = (ptr(x), u32c(OP, n)?, bn_channels(OP, c)?, u32c(OP, hw)?);
    u32c(OP, x.len)?;
    let count = total as f64;
    let (pw, pb, prm, prv, pa, pq) = (ptr(w), ptr(b), ptr(rm), ptr(rv), ptr(&aff), ptr(&nrm));
    if let (Some(silu), true) = (apply, bn_one_launch(dev, parts)) {
        let y = CudaStorage::alloc(dev, x.dtype, x.len)?;
        if bn_vector(x.dtype, hw, &[x, &y]).0 == vsfx {
            let f = dev.func(if vsfx.is_empty() { "bn_fwd1" } else { "bn_fwd1_v" }, sfx(x.dtype))?;
            let (py, act) = (ptr(&y), silu as i32);
            dev.launch(
                f,
                (1, cc, 1),
                (256, 1, 1),
                &mut args!(px, py, nn, cc, hh, count, pw, pb, prm, prv, eps, momentum, pa, pq, nbt, act),
            )?;
            return Ok((Some(y), aff, nrm));
        }
    }
    let part = super::alloc::DevBuf::alloc(dev, c * parts * 16)?;
    let (pp, pn) = (part.ptr, parts as u32);
    let f = dev.func(if vsfx.is_empty() { "bn_stats" } else { "bn_stats_v" }, sfx(x.dtype))?;
    let tickets = dev.bn_tickets;
    dev.launch(
        f,
        (pn, cc, 1),
        (256, 1, 1),
        &mut args!(px, pp, nn, cc, hh, pn, tickets, count, pw, pb, prm, prv, eps, momentum, pa, pq, nbt),
    )?;
    drop(part);
    Ok((None, aff, nrm))
}

/// See `BackendStorage::batch_norm_act_backward`: two launches — per-(channel, block) f64 partial
/// sums of `gz` and `gz·x̂` whose last block per channel writes the weight and bias gradients and
/// dx's coefficients (fixed order), then one elementwise pass for dx; one launch doing both when
/// a channel fits one block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_act_backward(
    x: &CudaStorage,
    g: &CudaStorage,
    shape: &[usize],
    aff: &CudaStorage,
    nrm: &CudaStorage,
    w: &CudaStorage,
    silu: bool,
    training: bool,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_act_backward";
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: x.dtype, expected: "a float dtype" });
    }
    if g.dtype != x.dtype || g.len != x.len {
        return Err(Error::invalid(OP, format!("g ({} × {}) must match x ({} × {})", g.len, g.dtype, x.len, x.dtype)));
    }
    let (n, c, hw) = nchw(OP, shape, x.len)?;
    let sd = crate::backend::stats_dtype(x.dtype);
    stats_arg(OP, aff, sd, 2 * c)?;
    stats_arg(OP, nrm, sd, 2 * c)?;
    stats_arg(OP, w, sd, c)?;
    for s in [g, aff, nrm, w] {
        x.same_device(OP, s)?;
    }
    let dev = &x.buf.dev;
    let total = n * hw;
    if c == 0 || total == 0 {
        return Err(Error::invalid(OP, format!("empty batch for shape {shape:?}")));
    }
    let dx = CudaStorage::alloc(dev, x.dtype, x.len)?;
    let gw = CudaStorage::alloc(dev, sd, c)?;
    let gb = CudaStorage::alloc(dev, sd, c)?;
    let coef = CudaStorage::alloc(dev, sd, 3 * c)?;
    let parts = bn_parts(total, c);
    let (vsfx, v) = bn_vector(x.dtype, hw, &[x, g, &dx]);
    let (px, pg, pa, pn, pw) = (ptr(x), ptr(g), ptr(aff), ptr(nrm), ptr(w));
    let (nn, cc, hh, pnum) = (u32c(OP, n)?, bn_channels(OP, c)?, u32c(OP, hw)?, parts as u32);
    u32c(OP, x.len)?;
    let (act, train, count) = (silu as i32, training as i32, total as f64);
    let (pgw, pgb, pc, tickets) = (ptr(&gw), ptr(&gb), ptr(&coef), dev.bn_tickets);
    if bn_one_launch(dev, parts) {
        // One block per channel: the reduction and dx in one launch (the two kernels' arithmetic).
        let f = dev.func(if vsfx.is_empty() { "bnb_fused1" } else { "bnb_fused1_v" }, sfx(x.dtype))?;
        let pdx = ptr(&dx);
        dev.launch(f, (1, cc, 1), (256, 1, 1), &mut args!(px, pg, pa, pn, nn, cc, hh, act, count, pw, train, pgw, pgb, pc, pdx))?;
        return Ok((dx, gw, gb));
    }
    let part = super::alloc::DevBuf::alloc(dev, c * parts * 16)?;
    let pp = part.ptr;
    let f = dev.func(if vsfx.is_empty() { "bnb_reduce" } else { "bnb_reduce_v" }, sfx(x.dtype))?;
    dev.launch(
        f,
        (pnum, cc, 1),
        (256, 1, 1),
        &mut args!(px, pg, pa, pn, pp, nn, cc, hh, pnum, act, tickets, count, pw, train, pgw, pgb, pc),
    )?;
    let f = dev.func(if vsfx.is_empty() { "bnb_dx" } else { "bnb_dx_v" }, sfx(x.dtype))?;
    let (pdx, nvec, hv) = (ptr(&dx), (x.len / v) as u32, (hw / v) as u32);
    dev.launch1d(f, x.len / v, &mut args!(px, pg, pa, pn, pc, pdx, nvec, hv, cc, act))?;
    drop(part);
    Ok((dx, gw, gb))
}

pub(crate) fn channel_affine(x: &CudaStorage, shape: &[usize], p: &CudaStorage, silu: bool) -> Result<CudaStorage> {
    const OP: &str = "channel_affine";
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: x.dtype, expected: "a float dtype" });
    }
    let (_, c, hw) = nchw(OP, shape, x.len)?;
    stats_arg(OP, p, crate::backend::stats_dtype(x.dtype), 2 * c)?;
    x.same_device(OP, p)?;
    let dev = &x.buf.dev;
    let out = CudaStorage::alloc(dev, x.dtype, x.len)?;
    if x.len == 0 {
        return Ok(out);
    }
    let (vsfx, v) = bn_vector(x.dtype, hw, &[x, &out]);
    let f = dev.func(if vsfx.is_empty() { "chaffine" } else { "chaffine_v" }, sfx(x.dtype))?;
    let (px, pp, py) = (ptr(x), ptr(p), ptr(&out));
    u32c(OP, x.len)?;
    let (nvec, hv, cc, act) = ((x.len / v) as u32, (hw / v) as u32, u32c(OP, c)?, silu as i32);
    dev.launch1d(f, x.len / v, &mut args!(px, pp, py, nvec, hv, cc, act))?;
    Ok(out)
}

pub(crate) fn softmax(x: &CudaStorage, shape: &[usize], dim: usize, log: bool) -> Result<CudaStorage> {
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: "softmax", dtype: x.dtype, expected: "a float dtype" });
    }
    let (outer, d, inner) = split3(shape, dim);
    let dev = &x.buf.dev;
    let out = CudaStorage::alloc(dev, x.dtype, x.len)?;
    if x.len == 0 {
        return Ok(out);
    }
    let (px, py, dd, ii, lg) = (ptr(x), ptr(&out), u32c("softmax", d)?, u32c("softmax", inner)?, log as i32);
    u32c("softmax", x.len)?;
    if inner == 1 && d <= 1024 {
        // Short rows: a warp per row, the row in registers (8 rows per 256-thread block), with
        // as few register slots per lane as the row needs.
        let name = match d.div_ceil(32) {
            0..=4 => "softmax_warp4",
            5..=8 => "softmax_warp8",
            9..=16 => "softmax_warp16",
            _ => "softmax_warp32",
        };
        let f = dev.func(name, sfx(x.dtype))?;
        let rows = u32c("softmax", outer)?;
        dev.launch(f, (outer.div_ceil(8).clamp(1, 1 << 20) as u32, 1, 1), (256, 1, 1), &mut args!(px, py, rows, dd, lg))
    } else if inner == 1 {
        let f = dev.func("softmax_rows", sfx(x.dtype))?;
        dev.launch(f, (u32c("softmax", outer)?, 1, 1), (256, 1, 1), &mut args!(px, py, dd, lg))
    } else {
        let f = dev.func("softmax_cols", sfx(x.dtype))?;
        let n = u32c("softmax", outer * inner)?;
        dev.launch1d(f, outer * inner, &mut args!(px, py, n, dd, ii, lg))
    }?;
    Ok(out)
}

pub(crate) fn batch_norm_eval_params(
    w: &CudaStorage,
    b: &CudaStorage,
    rm: &CudaStorage,
    rv: &CudaStorage,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_eval_params";
    let (sd, c) = (w.dtype, w.len);
    if !matches!(sd, DType::F32 | DType::F64) {
        return Err(Error::UnsupportedDType { op: OP, dtype: sd, expected: "F32 or F64 statistics" });
    }
    for s in [b, rm, rv] {
        stats_arg(OP, s, sd, c)?;
        w.same_device(OP, s)?;
    }
    let dev = &w.buf.dev;
    let aff = CudaStorage::alloc(dev, sd, 2 * c)?;
    let nrm = CudaStorage::alloc(dev, sd, 2 * c)?;
    if c == 0 {
        return Ok((aff, nrm));
    }
    let f = dev.func("bn_eval", sfx(sd))?;
    let (pw, pb, pm, pv, pa, pn, cc) = (ptr(w), ptr(b), ptr(rm), ptr(rv), ptr(&aff), ptr(&nrm), u32c(OP, c)?);
    dev.launch1d(f, c, &mut args!(pw, pb, pm, pv, eps, pa, pn, cc))?;
    Ok((aff, nrm))
}

// ---- graph-safe RNG ----------------------------------------------------------------------------------

/// A u8 keep mask of `n` elements (1 with probability `keep`), see kernels.cu `philox_keep_mask`.
/// `state` = the generator's device `[seed, base offset]` when recording into a graph.
pub(crate) fn philox_keep_mask(
    device: crate::Device,
    n: usize,
    keep: f32,
    seed: u64,
    offset: u64,
    state: Option<&CudaStorage>,
    intra: u64,
) -> Result<CudaStorage> {
    let dev = super::dev_of(device)?;
    let out = CudaStorage::alloc(&dev, DType::U8, n)?;
    if n == 0 {
        return Ok(out);
    }
    let f = dev.func("philox_keep_mask", "")?;
    let (py, nn) = (ptr(&out), u32c("dropout", n)?);
    let sp: u64 = state.map_or(0, ptr);
    dev.launch1d(f, n.div_ceil(4), &mut args!(py, nn, keep, seed, offset, sp, intra))?;
    Ok(out)
}

/// Writes `(seed, offset)` into a generator's device state `[u64; 2]` (on the stream).
pub(crate) fn rng_state_set(state: &CudaStorage, seed: u64, offset: u64) -> Result<()> {
    let dev = &state.buf.dev;
    let f = dev.func("rng_state_set", "")?;
    let sp = ptr(state);
    dev.launch(f, (1, 1, 1), (1, 1, 1), &mut args!(sp, seed, offset))
}

// ---- nearest upsampling -------------------------------------------------------------------------------

/// `x` (`shape` = [n, c, h, w]) upsampled by `f` (forward) or, with `backward`, the f×f block sums
/// of an output gradient `x` ([n, c, h·f, w·f]) back to `shape`.
pub(crate) fn upsample_nearest2d(x: &CudaStorage, shape: [usize; 4], f: usize, backward: bool) -> Result<CudaStorage> {
    let op = if backward { "upsample_nearest2d_backward" } else { "upsample_nearest2d" };
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op, dtype: x.dtype, expected: "a float dtype" });
    }
    let dev = &x.buf.dev;
    let n_in: usize = shape.iter().product();
    let out = CudaStorage::alloc(dev, x.dtype, if backward { n_in } else { n_in * f * f })?;
    if n_in == 0 {
        return Ok(out);
    }
    let k = dev.func(if backward { "upsample_bwd" } else { "upsample_fwd" }, sfx(x.dtype))?;
    let (px, py) = (ptr(x), ptr(&out));
    let (nn, h, w, ff) = (u32c(op, n_in)?, u32c(op, shape[2])?, u32c(op, shape[3])?, u32c(op, f)?);
    u32c(op, n_in * f * f)?;
    dev.launch1d(k, n_in, &mut args!(px, py, nn, h, w, ff))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::access_width;

    #[test]
    fn access_width_is_the_widest_common_divisor() {
        assert_eq!(access_width(0), 16);
        assert_eq!(access_width(4096 | 1600), 16);
        assert_eq!(access_width(24), 8);
        assert_eq!(access_width(12), 4);
        assert_eq!(access_width(6), 2);
        assert_eq!(access_width(0x1000 | 3), 1);
        // Kernel-name tables are indexed by log2 of the width.
        for (v, k) in [(1usize, 0u32), (2, 1), (4, 2), (8, 3), (16, 4)] {
            assert_eq!(v.trailing_zeros(), k);
        }
    }
}

//! Element-wise launchers: unary and binary ops, comparisons, `where`, fills, casts, strided copies and
//! the row-piece copies of `cat`/`split`.

use std::ffi::c_void;

use cudarc::driver::result as dr;

use super::super::device::{cu_err, sfx, Dev};
use super::super::storage::CudaStorage;
use crate::backend::{BinaryOp, CmpOp, UnaryOp};
use crate::shape::Layout;
use crate::{DType, Device, Error, Result};
use std::sync::Arc;

use super::geometry::*;
use super::multi_tensor::mt_tables;

pub(super) fn unary_code(op: UnaryOp) -> (i32, f64, f64) {
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

pub(super) fn binary_code(op: BinaryOp) -> i32 {
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

/// `out = a op b` into `out` (which may alias `a` for in-place accumulation).
pub(super) fn binary_into(a: &CudaStorage, la: &Layout, b: &CudaStorage, lb: &Layout, op: BinaryOp, out: &CudaStorage) -> Result<()> {
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
        super::super::counters::count(super::super::counters::Count::Memset);
        return unsafe { dr::memset_d8_async(s.buf.ptr, 0, s.len * s.dtype.size_in_bytes(), dev.stream()) }
            .map_err(|e| cu_err("cuMemsetD8Async", e));
    }
    let v = if s.dtype == DType::Bool { (value != 0.0) as u8 as f64 } else { value };
    let f = dev.func("fill", sfx(s.dtype))?;
    let (py, nn) = (ptr(s), u32c("fill", s.len)?);
    dev.launch1d(f, s.len, &mut args!(py, nn, v))
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
        super::super::counters::count(super::super::counters::Count::DeviceToDevice);
        unsafe { dr::memcpy_dtod_async(out.buf.ptr, x.buf.ptr, x.len, dev.stream()) }.map_err(|e| cu_err("cuMemcpyDtoDAsync", e))?;
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

/// Casts every storage to `dt`, the same bytes as [`to_dtype`] on each; f32 ↔ bf16/f16 run as one
/// launch per 40 tensors (autocast's weight copies and their gradients), other pairs one by one.
/// Every storage cast to `dt`, the f32 ↔ half casts in one launch per 40; `transposes[k] =
/// Some((a, b))` also stores storage k, read as (K, a, b), in (K, b, a) order (see `mt_cast_k`).
pub(crate) fn to_dtype_many(xs: &[&CudaStorage], dt: DType, transposes: &[Option<(usize, usize)>]) -> Result<Vec<CudaStorage>> {
    const OP: &str = "to_dtype_many";
    if transposes.len() != xs.len() {
        return Err(crate::Error::invalid(OP, format!("{} transposes for {} storages", transposes.len(), xs.len())));
    }
    let Some(first) = xs.first() else { return Ok(Vec::new()) };
    let name = match (first.dtype, dt) {
        (DType::F32, DType::BF16) => Some("mt_cast_f32_bf16"),
        (DType::F32, DType::F16) => Some("mt_cast_f32_f16"),
        (DType::BF16, DType::F32) => Some("mt_cast_bf16_f32"),
        (DType::F16, DType::F32) => Some("mt_cast_f16_f32"),
        _ => None,
    };
    for (x, t) in xs.iter().zip(transposes) {
        if let Some((a, b)) = *t {
            if a == 0 || b == 0 || x.len % (a * b) != 0 || u32::try_from(a * b).is_err() {
                return Err(crate::Error::invalid(OP, format!("a ({a}, {b}) transpose of a storage of {} elements", x.len)));
            }
        }
    }
    let uniform = xs.iter().all(|x| x.dtype == first.dtype && x.same_device("to_dtype", first).is_ok());
    let (Some(name), true) = (name, uniform) else {
        return xs.iter().zip(transposes).map(|(x, t)| transposed(to_dtype(x, dt)?, *t)).collect();
    };
    let dev = &first.buf.dev;
    let outs = xs.iter().map(|x| CudaStorage::alloc(dev, dt, x.len)).collect::<Result<Vec<_>>>()?;
    let rows: Vec<([u64; 3], usize)> = outs
        .iter()
        .zip(xs)
        .zip(transposes)
        .filter(|((_, x), _)| x.len > 0)
        .map(|((o, x), t)| ([ptr(o), ptr(x), t.map_or(0, |(a, b)| a as u64 | (b as u64) << 32)], x.len))
        .collect();
    let f = dev.func(name, "")?;
    for (t, blocks) in mt_tables(OP, &rows)? {
        dev.launch(f, (blocks, 1, 1), (256, 1, 1), &mut args!(t))?;
    }
    Ok(outs)
}

/// `x` read as (K, a, b) and stored (K, b, a) (one strided copy), or `x` itself for `None`.
fn transposed(x: CudaStorage, t: Option<(usize, usize)>) -> Result<CudaStorage> {
    let Some((a, b)) = t else { return Ok(x) };
    let k = x.len / (a * b);
    let mut out = CudaStorage::alloc(&x.buf.dev, x.dtype, x.len)?;
    let src = Layout { shape: vec![k, b, a], strides: vec![a * b, 1, b], offset: 0 };
    copy_strided(&x, &src, &mut out, &Layout::contiguous(&[k, b, a]))?;
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
        super::super::counters::count(super::super::counters::Count::DeviceToDevice);
        return unsafe {
            dr::memcpy_dtod_async(dst.buf.ptr + (dl.offset * es) as u64, src.buf.ptr + (sl.offset * es) as u64, n * es, dev.stream())
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
    if let Some((k, rows, cols)) = batched_transpose(&g) {
        if let Some(name) = [(2, "transpose_b2"), (4, "transpose_b4"), (8, "transpose_b8")].iter().find(|(s, _)| *s == es).map(|(_, f)| *f)
        {
            let f = dev.func(name, "")?;
            let sb = src.buf.ptr + (g.off[0] as usize * es) as u64;
            let db = dst.buf.ptr + (g.off[1] as usize * es) as u64;
            let grid = (cols.div_ceil(TRANSPOSE_TILE), rows.div_ceil(TRANSPOSE_TILE), k);
            return dev.launch(f, grid, (TRANSPOSE_TILE, 8, 1), &mut args!(sb, db, rows, cols));
        }
    }
    let f = dev.func("copy_s", sfx(src.dtype))?;
    let (px, py, nn) = (ptr(src), ptr(dst), u32c("copy_strided", n)?);
    dev.launch1d(f, n, &mut args!(px, py, nn, g))
}

/// Side of the square tiles of `transpose_b*` (elementwise.cu).
const TRANSPOSE_TILE: u32 = 32;

/// A coalesced copy that writes `k` contiguous (`cols` × `rows`) matrices from (`rows` × `cols`)
/// row-major ones — N, C, H·W storage to N, H·W, C and back, the layout conversions — as
/// `(k, rows, cols)`. Such a copy through `copy_s` reads with a stride of a whole row per
/// element; the tiled kernel reads and writes whole rows. `None` for any other copy (and for a
/// batch beyond the grid's third dimension).
fn batched_transpose(g: &super::geometry::Strided) -> Option<(u32, u32, u32)> {
    let (k, a, b, st) = match g.rank {
        3 => (g.shape[0], g.shape[1], g.shape[2], [[g.st[0][1], g.st[0][2]], [g.st[1][1], g.st[1][2]]]),
        2 => (1, g.shape[0], g.shape[1], [[g.st[0][0], g.st[0][1]], [g.st[1][0], g.st[1][1]]]),
        _ => return None,
    };
    // Destination contiguous (a, b); the source holds (b, a) row-major: element (j, l) at j + l·a.
    let ab = u64::from(a) * u64::from(b);
    let whole = g.rank == 2 || (u64::from(g.st[0][0]) == ab && u64::from(g.st[1][0]) == ab);
    (whole && st[1] == [b, 1] && st[0] == [1, a] && a > 1 && b > 1 && k <= 65_535).then_some((k, b, a))
}

/// The widest access (16, 8, 4, 2 or 1 bytes) that divides `all` (the OR of every size, pitch,
/// offset and base address involved).
pub(super) fn access_width(all: u64) -> usize {
    [16usize, 8, 4, 2, 1].into_iter().find(|v| all.is_multiple_of(*v as u64)).unwrap_or(1)
}

/// Copies `h` rows of `w` bytes from `sb` (pitch `sp`) to `db` (pitch `dp`) with the widest
/// access (16/8/4/2/1 bytes) that divides the width, both pitches and both base addresses.
pub(super) fn copy_rows(dev: &Arc<Dev>, sb: u64, db: u64, h: usize, w: usize, sp: usize, dp: usize) -> Result<()> {
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

/// Kernel argument of `cat_rows_*` (see elementwise.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct CatArgs {
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

/// Kernel argument of `cat_rows_add_*` (see elementwise.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CatAddArgs {
    src: [u64; 8],
    src2: [u64; 8],
    cols: [u32; 8],
    off: [u32; 8],
}

/// [`cat_rows`] of float elements where a piece may be the sum of two sources: `srcs[k]` = (an
/// address, a second address whose values are added to the first's or `None`, elements per
/// row). A sum is computed as the addition kernel computes it (in the accumulator type, rounded
/// once), so the result has the bytes of adding first and concatenating after, in one launch.
pub(crate) fn cat_rows_adding(dst: &CudaStorage, rows: usize, srcs: &[(u64, Option<u64>, usize)]) -> Result<()> {
    const OP: &str = "cat";
    if srcs.is_empty() || srcs.len() > CAT_MAX_INPUTS {
        return Err(Error::invalid(OP, format!("{} pieces for one launch (1..={CAT_MAX_INPUTS})", srcs.len())));
    }
    if !matches!(dst.dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        return Err(Error::UnsupportedDType { op: OP, dtype: dst.dtype, expected: "f32, f64, f16 or bf16" });
    }
    let pitch: usize = srcs.iter().map(|s| s.2).sum();
    if rows * pitch != dst.len {
        return Err(Error::invalid(OP, format!("{rows} rows of {pitch} values do not match the {}-value tensor", dst.len)));
    }
    let mut a = CatAddArgs::default();
    let (mut off, mut most) = (0usize, 0usize);
    for (k, &(p, p2, w)) in srcs.iter().enumerate() {
        a.src[k] = p;
        a.src2[k] = p2.unwrap_or(0);
        a.cols[k] = u32c(OP, w)?;
        a.off[k] = u32c(OP, off)?;
        u32c(OP, rows * w)?;
        most = most.max(rows * w);
        off += w;
    }
    if most == 0 {
        return Ok(());
    }
    let dev = &dst.buf.dev;
    let f = dev.func("cat_rows_add", sfx(dst.dtype))?;
    let (pd, rr, wp) = (ptr(dst), u32c(OP, rows)?, u32c(OP, pitch)?);
    let blocks = most.div_ceil(256).clamp(1, 65536) as u32;
    dev.launch(f, (blocks, srcs.len() as u32, 1), (256, 1, 1), &mut args!(a, pd, rr, wp))
}

/// Splits `src` (`rows` rows) into contiguous outputs in one launch, the inverse of
/// [`cat_rows`]: output `k` (device address `dsts[k].0`) receives `dsts[k].1` bytes of every row,
/// taken at the running byte offset. Same access-width rule as [`cat_rows`].
pub(crate) fn split_rows(src: &CudaStorage, rows: usize, dsts: &[(u64, usize)]) -> Result<()> {
    launch_row_pieces("split", "split_rows", src, rows, dsts)
}

/// One launch of `kernel` (`cat_rows` / `split_rows`) between the `rows` rows of `whole` and the
/// contiguous `pieces` (device address, bytes per row), which tile each row in order.
pub(super) fn launch_row_pieces(
    op: &'static str,
    kernel: &'static str,
    whole: &CudaStorage,
    rows: usize,
    pieces: &[(u64, usize)],
) -> Result<()> {
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

impl CudaStorage {
    /// A constant-filled buffer (`cuMemsetD8Async` for zero, a fill kernel otherwise).
    pub(crate) fn full(device: Device, dtype: DType, len: usize, value: f64) -> Result<CudaStorage> {
        let dev = super::super::device::dev_of(device)?;
        let s = CudaStorage::alloc(&dev, dtype, len)?;
        fill(&s, value)?;
        Ok(s)
    }
}

#[cfg(test)]
mod access_width_tests {
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

#[cfg(test)]
mod transpose_tests {
    use super::*;

    /// The layout conversions' coalesced copies are recognised as batched transposes (and
    /// launched as `(images, rows, cols)` of the source's matrices); other copies are not.
    #[test]
    fn layout_conversions_are_batched_transposes() {
        let (n, c, h, w) = (3usize, 40usize, 5usize, 7usize);
        let to_cl = |n: usize| strided("t", &[n, h, w, c], &[(&[c * h * w, w, 1, h * w], 0), (&[h * w * c, w * c, c, 1], 0)]).unwrap();
        assert_eq!(batched_transpose(&to_cl(n)), Some((3, 40, 35)), "N, C, H, W → N, H, W, C: (C × H·W) matrices");
        assert_eq!(batched_transpose(&to_cl(1)), Some((1, 40, 35)), "one image");
        let from_cl = strided("t", &[n, c, h, w], &[(&[h * w * c, 1, w * c, c], 0), (&[c * h * w, h * w, w, 1], 0)]).unwrap();
        assert_eq!(batched_transpose(&from_cl), Some((3, 35, 40)), "N, H, W, C → N, C, H, W: (H·W × C) matrices");
        let plain = strided("t", &[n, c], &[(&[c, 1], 0), (&[c, 1], 0)]).unwrap();
        assert_eq!(batched_transpose(&plain), None, "a contiguous copy");
        let narrowing = strided("t", &[n, c, 4], &[(&[c * 8, 8, 1], 0), (&[c * 4, 4, 1], 0)]).unwrap();
        assert_eq!(batched_transpose(&narrowing), None, "row copies");
        let permuted = strided("t", &[n, c, 4], &[(&[4, 4 * n, 1], 0), (&[c * 4, 4, 1], 0)]).unwrap();
        assert_eq!(batched_transpose(&permuted), None, "a permutation that is no batched transpose");
    }
}

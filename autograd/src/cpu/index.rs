//! Strided copies and index kernels (select / gather and their deterministic scatter-adds).

use super::reduce::split3;
use super::CpuStorage;
use crate::backend::BackendStorage;
use crate::shape::{contiguous_strides, Layout};
use crate::{Error, Result};

pub(crate) fn copy_strided(src: &CpuStorage, sl: &Layout, dst: &mut CpuStorage, dl: &Layout) -> Result<()> {
    if sl.shape != dl.shape {
        return Err(Error::ShapeMismatch { op: "copy_strided", lhs: sl.shape.clone(), rhs: dl.shape.clone() });
    }
    macro_rules! cp {
        ($s:expr, $d:expr) => {{
            if sl.is_contiguous() && dl.is_contiguous() {
                let n = sl.numel();
                $d[dl.offset..dl.offset + n].copy_from_slice(&$s[sl.offset..sl.offset + n]);
            } else {
                for (so, dof) in sl.offsets().zip(dl.offsets()) {
                    $d[dof] = $s[so];
                }
            }
        }};
    }
    use CpuStorage as S;
    match (src, dst) {
        (S::F32(s), S::F32(d)) => cp!(s, d),
        (S::F64(s), S::F64(d)) => cp!(s, d),
        (S::F16(s), S::F16(d)) => cp!(s, d),
        (S::BF16(s), S::BF16(d)) => cp!(s, d),
        (S::I64(s), S::I64(d)) => cp!(s, d),
        (S::U8(s), S::U8(d)) => cp!(s, d),
        (S::Bool(s), S::Bool(d)) => cp!(s, d),
        (s, d) => return Err(Error::DTypeMismatch { op: "copy_strided", lhs: s.dtype(), rhs: d.dtype() }),
    }
    Ok(())
}

fn check_idx(op: &'static str, idx: &[i64], size: usize) -> Result<()> {
    for &i in idx {
        if i < 0 || i as usize >= size {
            return Err(Error::IndexOutOfRange { op, index: i, size });
        }
    }
    Ok(())
}

/// See [`crate::backend::BackendStorage::nonzero_static`].
pub(crate) fn nonzero_static(s: &CpuStorage, size: usize, fill: i64) -> CpuStorage {
    let mut out: Vec<i64> = s.to_f64_vec().iter().enumerate().filter(|(_, &v)| v != 0.0).map(|(i, _)| i as i64).take(size).collect();
    out.resize(size, fill);
    CpuStorage::I64(out)
}

pub(crate) fn index_select(s: &CpuStorage, shape: &[usize], dim: usize, idx: &CpuStorage) -> Result<CpuStorage> {
    let idx = idx.as_i64("index_select")?;
    let (outer, d, inner) = split3(shape, dim);
    check_idx("index_select", idx, d)?;
    let n = idx.len();
    Ok(super::any_map!(s, |v| {
        let mut out = Vec::with_capacity(outer * n * inner);
        for o in 0..outer {
            for &j in idx {
                let base = (o * d + j as usize) * inner;
                out.extend_from_slice(&v[base..base + inner]);
            }
        }
        out
    }))
}

/// Adds in a fixed order (ascending source position), so the result never depends on threads.
fn add_into(op: &'static str, dst: &mut CpuStorage, pairs: impl Iterator<Item = (usize, usize)>, src: &CpuStorage) -> Result<()> {
    use CpuStorage as S;
    match (dst, src) {
        (S::F32(d), S::F32(s)) => pairs.for_each(|(di, si)| d[di] += s[si]),
        (S::F64(d), S::F64(s)) => pairs.for_each(|(di, si)| d[di] += s[si]),
        (S::F16(d), S::F16(s)) => pairs.for_each(|(di, si)| d[di] = half::f16::from_f32(d[di].to_f32() + s[si].to_f32())),
        (S::BF16(d), S::BF16(s)) => pairs.for_each(|(di, si)| d[di] = half::bf16::from_f32(d[di].to_f32() + s[si].to_f32())),
        (S::I64(d), S::I64(s)) => pairs.for_each(|(di, si)| d[di] += s[si]),
        (d, s) => return Err(Error::DTypeMismatch { op, lhs: d.dtype(), rhs: s.dtype() }),
    }
    Ok(())
}

pub(crate) fn index_add(s: &CpuStorage, shape: &[usize], dim: usize, idx: &CpuStorage, src: &CpuStorage) -> Result<CpuStorage> {
    let idx = idx.as_i64("index_add")?;
    let (outer, d, inner) = split3(shape, dim);
    check_idx("index_add", idx, d)?;
    let n = idx.len();
    if src.len() != outer * n * inner {
        return Err(Error::invalid("index_add", format!("source has {} elements, expected {}", src.len(), outer * n * inner)));
    }
    let mut out = s.clone();
    let pairs = (0..outer).flat_map(move |o| {
        (0..n).flat_map(move |r| {
            let j = idx[r] as usize;
            (0..inner).map(move |i| ((o * d + j) * inner + i, (o * n + r) * inner + i))
        })
    });
    add_into("index_add", &mut out, pairs, src)?;
    Ok(out)
}

/// Storage offsets in `shape` addressed by each index element (row-major over `idx_shape`).
fn gather_offsets(op: &'static str, shape: &[usize], dim: usize, idx: &[i64], idx_shape: &[usize]) -> Result<Vec<usize>> {
    if idx_shape.len() != shape.len() {
        return Err(Error::ShapeMismatch { op, lhs: shape.to_vec(), rhs: idx_shape.to_vec() });
    }
    for (k, (&a, &b)) in shape.iter().zip(idx_shape).enumerate() {
        if k != dim && b > a {
            return Err(Error::ShapeMismatch { op, lhs: shape.to_vec(), rhs: idx_shape.to_vec() });
        }
    }
    check_idx(op, idx, shape[dim])?;
    let st = contiguous_strides(shape);
    let mut base_strides = st.clone();
    base_strides[dim] = 0;
    let l = Layout { shape: idx_shape.to_vec(), strides: base_strides, offset: 0 };
    Ok(l.offsets().zip(idx).map(|(b, &j)| b + j as usize * st[dim]).collect())
}

pub(crate) fn gather(s: &CpuStorage, shape: &[usize], dim: usize, idx: &CpuStorage, idx_shape: &[usize]) -> Result<CpuStorage> {
    let offs = gather_offsets("gather", shape, dim, idx.as_i64("gather")?, idx_shape)?;
    Ok(super::any_map!(s, |v| offs.iter().map(|&o| v[o]).collect()))
}

pub(crate) fn scatter_add(
    s: &CpuStorage,
    shape: &[usize],
    dim: usize,
    idx: &CpuStorage,
    idx_shape: &[usize],
    src: &CpuStorage,
) -> Result<CpuStorage> {
    let offs = gather_offsets("scatter_add", shape, dim, idx.as_i64("scatter_add")?, idx_shape)?;
    if src.len() != offs.len() {
        return Err(Error::invalid("scatter_add", format!("source has {} elements, index has {}", src.len(), offs.len())));
    }
    let mut out = s.clone();
    add_into("scatter_add", &mut out, offs.iter().copied().enumerate().map(|(si, di)| (di, si)), src)?;
    Ok(out)
}

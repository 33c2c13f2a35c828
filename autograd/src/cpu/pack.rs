//! Padded-batch packing on the CPU: the reference of `cuda/ops/pack.cu`, the bytes of the
//! composed ops (`ops/pack.rs`) for f32 matrices in bf16, f32 or f64 slots.

use half::bf16;

use super::CpuStorage;
use crate::backend::{BackendStorage, PackStorage, PackedMatrix};
use crate::{DType, Result};

/// Where element (a, b) of a matrix stored `rows × cols` sits in its slot (`slot_cols` wide).
fn slot_index(m: &PackedMatrix, a: usize, b: usize, slot_cols: usize) -> usize {
    if m.transposed {
        b * slot_cols + a
    } else {
        a * slot_cols + b
    }
}

/// Fills the slots of `out` (zeros already) from `items`, casting each value with `cast`.
fn pack_into<T: Copy>(out: &mut [T], items: &[(&[f32], PackedMatrix)], rows: usize, cols: usize, cast: impl Fn(f32) -> T) {
    for (slot, (src, m)) in out.chunks_mut(rows * cols).zip(items) {
        for a in 0..m.rows {
            for b in 0..m.cols {
                slot[slot_index(m, a, b, cols)] = cast(src[a * m.cols + b]);
            }
        }
    }
}

/// Slot `k` of `batch` back as f32, scaled as `mul_scalar` rounds (`x·s + 0` in f32).
fn unpack_slot<T: Copy>(
    batch: &[T],
    k: usize,
    m: &PackedMatrix,
    scale: f64,
    rows: usize,
    cols: usize,
    widen: impl Fn(T) -> f32,
) -> Vec<f32> {
    let slot = &batch[k * rows * cols..(k + 1) * rows * cols];
    let s = scale as f32;
    let mut out = Vec::with_capacity(m.rows * m.cols);
    for a in 0..m.rows {
        for b in 0..m.cols {
            let v = widen(slot[slot_index(m, a, b, cols)]);
            out.push(if scale != 1.0 { v * s + 0.0 } else { v });
        }
    }
    out
}

impl PackStorage for CpuStorage {
    fn pack_padded(items: &[(&Self, PackedMatrix)], rows: usize, cols: usize, dtype: DType) -> Result<Option<Self>> {
        let mut srcs = Vec::with_capacity(items.len());
        for (s, m) in items {
            match s {
                CpuStorage::F32(v) if v.len() == m.rows * m.cols => srcs.push((v.as_slice(), *m)),
                _ => return Ok(None),
            }
        }
        let n = items.len() * rows * cols;
        Ok(Some(match dtype {
            DType::F32 => {
                let mut out = vec![0f32; n];
                pack_into(&mut out, &srcs, rows, cols, |x| x);
                CpuStorage::F32(out)
            }
            DType::F64 => {
                let mut out = vec![0f64; n];
                pack_into(&mut out, &srcs, rows, cols, f64::from);
                CpuStorage::F64(out)
            }
            DType::BF16 => {
                let mut out = vec![bf16::ZERO; n];
                pack_into(&mut out, &srcs, rows, cols, bf16::from_f32);
                CpuStorage::BF16(out)
            }
            _ => return Ok(None),
        }))
    }

    fn unpack_padded(&self, items: &[(PackedMatrix, f64)], rows: usize, cols: usize) -> Result<Option<Vec<Self>>> {
        if self.len() != items.len() * rows * cols {
            return Ok(None);
        }
        let each = |f: &dyn Fn(usize, &PackedMatrix, f64) -> Vec<f32>| -> Vec<CpuStorage> {
            items.iter().enumerate().map(|(k, (m, scale))| CpuStorage::F32(f(k, m, *scale))).collect()
        };
        Ok(Some(match self {
            CpuStorage::F32(v) => each(&|k, m, s| unpack_slot(v, k, m, s, rows, cols, |x| x)),
            CpuStorage::F64(v) => each(&|k, m, s| unpack_slot(v, k, m, s, rows, cols, |x| x as f32)),
            CpuStorage::BF16(v) => each(&|k, m, s| unpack_slot(v, k, m, s, rows, cols, bf16::to_f32)),
            _ => return Ok(None),
        }))
    }
}

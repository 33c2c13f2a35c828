//! Packing many matrices into zero-padded batches and back (Newton–Schulz).

use std::ffi::c_void;

use super::super::storage::CudaStorage;
use crate::backend::{BackendStorage, PackStorage, PackedMatrix};
use crate::{DType, Error, Result};

use super::geometry::*;
use super::multi_tensor::MT_CHUNK;

/// Matrices per padded-batch launch (`PACK_MAX` in pack.cu).
pub(super) const PACK_MAX: usize = 40;

/// The kernel-parameter table of `pack_pad_*` / `unpack_pad_*` (layout of `PackTable` in pack.cu).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct PackTable {
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
pub(crate) type PackRow = (u64, u64, PackedMatrix, f32);

/// The tables of `items` in chunks of [`PACK_MAX`].
pub(super) fn pack_tables(op: &'static str, items: &[PackRow], rows: usize, cols: usize) -> Result<Vec<PackTable>> {
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
fn pack_padded(any: &CudaStorage, items: &[PackRow], rows: usize, cols: usize, dtype: DType) -> Result<()> {
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
fn unpack_padded(any: &CudaStorage, items: &[PackRow], rows: usize, cols: usize, src: DType) -> Result<()> {
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

impl PackStorage for CudaStorage {
    fn pack_padded(items: &[(&Self, PackedMatrix)], rows: usize, cols: usize, dtype: DType) -> Result<Option<Self>> {
        let Some(&(first, _)) = items.first() else { return Ok(None) };
        if !matches!(dtype, DType::BF16 | DType::F32 | DType::F64)
            || items.iter().any(|(s, m)| s.dtype != DType::F32 || s.len != m.rows * m.cols)
        {
            return Ok(None);
        }
        for (s, _) in items {
            first.same_device("pack_padded", s)?;
        }
        let out = CudaStorage::alloc(&first.buf.dev, dtype, items.len() * rows * cols)?;
        let slot = (rows * cols * dtype.size_in_bytes()) as u64;
        let launch: Vec<PackRow> = items.iter().enumerate().map(|(i, (s, m))| (ptr(s), ptr(&out) + i as u64 * slot, *m, 1.0f32)).collect();
        pack_padded(&out, &launch, rows, cols, dtype)?;
        Ok(Some(out))
    }

    fn unpack_padded(&self, items: &[(PackedMatrix, f64)], rows: usize, cols: usize) -> Result<Option<Vec<Self>>> {
        if !matches!(self.dtype, DType::BF16 | DType::F32 | DType::F64) || self.len != items.len() * rows * cols {
            return Ok(None);
        }
        let slot = (rows * cols * self.dtype.size_in_bytes()) as u64;
        // Each result in a storage of its own (what the fused optimizer steps that read them need).
        let mut out = Vec::with_capacity(items.len());
        let mut launch = Vec::with_capacity(items.len());
        for (i, (m, scale)) in items.iter().enumerate() {
            let t = CudaStorage::alloc(&self.buf.dev, DType::F32, m.rows * m.cols)?;
            if m.rows * m.cols > 0 {
                launch.push((ptr(self) + i as u64 * slot, ptr(&t), *m, *scale as f32));
            }
            out.push(t);
        }
        if !launch.is_empty() {
            unpack_padded(self, &launch, rows, cols, self.dtype())?;
        }
        Ok(Some(out))
    }
}

//! Matrices of different shapes packed into one zero-padded batch, and back: how MuSGD's
//! Newton–Schulz runs the momenta of many shapes through one batched GEMM per product instead of
//! one per shape (zero rows and columns add exact zeros to every product, so each slot's result is
//! its own matrix's). No gradient: optimizer-side data movement.

use crate::{DType, Error, Result, Tensor};

/// One matrix of a padded batch: its shape as stored (`rows × cols`, row-major) and whether its
/// slot holds the transpose (then it fills `cols × rows` of the slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PackedMatrix {
    pub rows: usize,
    pub cols: usize,
    pub transposed: bool,
}

impl PackedMatrix {
    /// The corner of the slot it fills.
    pub fn extent(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// What [`Tensor::unpack_padded`] makes of one slot: the matrix, the shape it is given back
/// (`rows·cols` elements) and a factor it is multiplied by (as `mul_scalar`; 1 multiplies nothing).
#[derive(Clone, Debug, PartialEq)]
pub struct Unpacked {
    pub matrix: PackedMatrix,
    pub dims: Vec<usize>,
    pub scale: f64,
}

impl Tensor {
    /// A `[mats.len(), rows, cols]` tensor of `dtype` whose slot `i` holds matrix `i` (its
    /// elements viewed as `rows × cols` of its [`PackedMatrix`], transposed when flagged) in the
    /// top-left corner and zeros elsewhere; values cast as [`Tensor::to_dtype`] casts them. On CUDA
    /// one launch for up to 40 f32 matrices of their own storages; otherwise composed ops.
    pub fn pack_padded(mats: &[(&Tensor, PackedMatrix)], rows: usize, cols: usize, dtype: DType) -> Result<Tensor> {
        let Some(&(first, _)) = mats.first() else {
            return Err(Error::invalid("pack_padded", "no matrices to pack"));
        };
        for (t, m) in mats {
            let (er, ec) = m.extent();
            if t.numel() != m.rows * m.cols || er > rows || ec > cols {
                return Err(Error::invalid(
                    "pack_padded",
                    format!("a tensor of {:?} as {m:?} does not fit a {rows}×{cols} slot", t.dims()),
                ));
            }
            if t.device() != first.device() {
                return Err(Error::DeviceMismatch { op: "pack_padded", lhs: first.device(), rhs: t.device() });
            }
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch { op: "pack_padded", lhs: first.dtype(), rhs: t.dtype() });
            }
        }
        if fused_pack_ok(mats, dtype) {
            return fused_pack(mats, rows, cols, dtype);
        }
        crate::no_grad(|| composed_pack(mats, rows, cols, dtype))
    }

    /// The slots of a packed batch (`[n, rows, cols]`, see [`Tensor::pack_padded`]) as separate
    /// tensors of `dtype`: slot `i`'s corner (transposed back when flagged), cast, times its scale,
    /// in its dims. On CUDA one launch for up to 40 slots into f32; otherwise composed ops.
    pub fn unpack_padded(&self, items: &[Unpacked], dtype: DType) -> Result<Vec<Tensor>> {
        let d = self.dims();
        if d.len() != 3 || d[0] != items.len() {
            return Err(Error::invalid("unpack_padded", format!("a batch of {} slots, got shape {d:?}", items.len())));
        }
        let (rows, cols) = (d[1], d[2]);
        for it in items {
            let (er, ec) = it.matrix.extent();
            if er > rows || ec > cols || it.dims.iter().product::<usize>() != it.matrix.rows * it.matrix.cols {
                return Err(Error::invalid("unpack_padded", format!("{:?} as {:?} does not fit a {rows}×{cols} slot", it.matrix, it.dims)));
            }
        }
        if fused_unpack_ok(self, dtype) {
            return fused_unpack(self, items, dtype);
        }
        crate::no_grad(|| composed_unpack(self, items, dtype))
    }
}

/// The reference of the fused pack: cast, transpose, pad with zero blocks, stack.
fn composed_pack(mats: &[(&Tensor, PackedMatrix)], rows: usize, cols: usize, dtype: DType) -> Result<Tensor> {
    let device = mats[0].0.device();
    let mut slots = Vec::with_capacity(mats.len());
    for (t, m) in mats {
        let mut x = t.reshape(vec![m.rows, m.cols])?.to_dtype(dtype)?;
        if m.transposed {
            x = x.transpose(0, 1)?;
        }
        let (er, ec) = m.extent();
        if ec < cols {
            x = Tensor::cat(&[&x, &Tensor::zeros(vec![er, cols - ec], dtype, device)?], 1)?;
        }
        if er < rows {
            x = Tensor::cat(&[&x, &Tensor::zeros(vec![rows - er, cols], dtype, device)?], 0)?;
        }
        slots.push(x.unsqueeze(0)?);
    }
    Tensor::cat(&slots.iter().collect::<Vec<_>>(), 0)
}

/// The reference of the fused unpack: corner, transpose back, cast, scale, reshape.
fn composed_unpack(batch: &Tensor, items: &[Unpacked], dtype: DType) -> Result<Vec<Tensor>> {
    let (rows, cols) = (batch.dims()[1], batch.dims()[2]);
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let (er, ec) = it.matrix.extent();
        let mut x = batch.narrow(0, i, 1)?.reshape(vec![rows, cols])?;
        if er < rows {
            x = x.narrow(0, 0, er)?;
        }
        if ec < cols {
            x = x.narrow(1, 0, ec)?;
        }
        if it.matrix.transposed {
            x = x.transpose(0, 1)?;
        }
        let mut x = x.to_dtype(dtype)?;
        if it.scale != 1.0 {
            x = x.mul_scalar(it.scale)?;
        }
        out.push(x.reshape(it.dims.clone())?);
    }
    Ok(out)
}

fn whole_on_cuda(t: &Tensor) -> bool {
    matches!(t.device(), crate::Device::Cuda(_)) && t.numel() > 0 && t.read_storage().len() == t.numel()
}

fn fused_pack_ok(mats: &[(&Tensor, PackedMatrix)], dtype: DType) -> bool {
    cfg!(feature = "cuda")
        && matches!(dtype, DType::BF16 | DType::F32 | DType::F64)
        && mats.iter().all(|(t, _)| t.dtype() == DType::F32 && whole_on_cuda(t))
}

fn fused_unpack_ok(batch: &Tensor, dtype: DType) -> bool {
    cfg!(feature = "cuda") && dtype == DType::F32 && matches!(batch.dtype(), DType::BF16 | DType::F32 | DType::F64) && whole_on_cuda(batch)
}

#[cfg(feature = "cuda")]
fn cuda_ptr(op: &'static str, t: &Tensor) -> Result<u64> {
    match &*t.read_storage() {
        crate::storage::Storage::Cuda(c) => Ok(c.device_ptr()),
        #[allow(unreachable_patterns)]
        _ => Err(Error::invalid(op, "an operand is not on CUDA")),
    }
}

/// Runs `launch` with the CUDA storage of `out` (held for writing).
#[cfg(feature = "cuda")]
fn on_cuda_out(op: &'static str, out: &Tensor, launch: impl FnOnce(&crate::cuda::CudaStorage) -> Result<()>) -> Result<()> {
    match &*out.write_storage() {
        crate::storage::Storage::Cuda(c) => launch(c),
        #[allow(unreachable_patterns)]
        _ => Err(Error::invalid(op, "the output is not on CUDA")),
    }
}

#[cfg(feature = "cuda")]
fn fused_pack(mats: &[(&Tensor, PackedMatrix)], rows: usize, cols: usize, dtype: DType) -> Result<Tensor> {
    use crate::storage::Storage;
    let device = mats[0].0.device();
    let n = mats.len() * rows * cols;
    let out = Tensor::from_storage(Storage::uninit(device, dtype, n)?, vec![mats.len(), rows, cols])?;
    let base = cuda_ptr("pack_padded", &out)?;
    let slot = (rows * cols * dtype.size_in_bytes()) as u64;
    let mut items = Vec::with_capacity(mats.len());
    for (i, (t, m)) in mats.iter().enumerate() {
        items.push((cuda_ptr("pack_padded", t)?, base + i as u64 * slot, *m, 1.0f32));
    }
    on_cuda_out("pack_padded", &out, |c| crate::cuda::ops::pack_padded(c, &items, rows, cols, dtype))?;
    Ok(out)
}

#[cfg(not(feature = "cuda"))]
fn fused_pack(_mats: &[(&Tensor, PackedMatrix)], _rows: usize, _cols: usize, _dtype: DType) -> Result<Tensor> {
    Err(Error::invalid("pack_padded", "CUDA matrices without the CUDA backend"))
}

#[cfg(feature = "cuda")]
fn fused_unpack(batch: &Tensor, items: &[Unpacked], dtype: DType) -> Result<Vec<Tensor>> {
    use crate::storage::Storage;
    let device = batch.device();
    let (rows, cols) = (batch.dims()[1], batch.dims()[2]);
    let slot = (rows * cols * batch.dtype().size_in_bytes()) as u64;
    let base = cuda_ptr("unpack_padded", batch)?;
    // Each result in a storage of its own (what the fused optimizer steps that read them need).
    let mut out = Vec::with_capacity(items.len());
    let mut launch_rows = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let n = it.matrix.rows * it.matrix.cols;
        let t = Tensor::from_storage(Storage::uninit(device, dtype, n)?, it.dims.clone())?;
        if n > 0 {
            launch_rows.push((base + i as u64 * slot, cuda_ptr("unpack_padded", &t)?, it.matrix, it.scale as f32));
        }
        out.push(t);
    }
    if launch_rows.is_empty() {
        return Ok(out);
    }
    // The batch is only read; the launch names its device.
    match &*batch.read_storage() {
        Storage::Cuda(c) => crate::cuda::ops::unpack_padded(c, &launch_rows, rows, cols, batch.dtype())?,
        #[allow(unreachable_patterns)]
        _ => return Err(Error::invalid("unpack_padded", "the batch is not on CUDA")),
    }
    Ok(out)
}

#[cfg(not(feature = "cuda"))]
fn fused_unpack(_batch: &Tensor, _items: &[Unpacked], _dtype: DType) -> Result<Vec<Tensor>> {
    Err(Error::invalid("unpack_padded", "a CUDA batch without the CUDA backend"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Device, Rng};

    /// Packing then unpacking gives each matrix back (scaled), wide and tall, in every slot dtype
    /// that keeps f32 values; the padding is zeros.
    #[test]
    fn pack_then_unpack_round_trips() {
        let mut rng = Rng::new(3);
        let shapes = [(3usize, 5usize, false), (6, 2, true), (4, 4, false)];
        let ts: Vec<Tensor> =
            shapes.iter().map(|&(r, c, _)| Tensor::rand(vec![r, c], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap()).collect();
        let mats: Vec<(&Tensor, PackedMatrix)> =
            ts.iter().zip(&shapes).map(|(t, &(rows, cols, transposed))| (t, PackedMatrix { rows, cols, transposed })).collect();
        for dt in [DType::F32, DType::F64] {
            let packed = Tensor::pack_padded(&mats, 4, 8, dt).unwrap();
            assert_eq!(packed.dims(), &[3, 4, 8]);
            let v = packed.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            // Slot 1 holds the 6×2 matrix transposed (2×6): its row 0 is the matrix's column 0.
            let t1 = ts[1].to_vec::<f32>().unwrap();
            assert_eq!(&v[32..38], &[t1[0], t1[2], t1[4], t1[6], t1[8], t1[10]]);
            assert!(v[38..40].iter().chain(&v[48..64]).all(|&x| x == 0.0), "padding is zero");
            let items: Vec<Unpacked> = mats.iter().map(|(t, m)| Unpacked { matrix: *m, dims: t.dims().to_vec(), scale: 2.0 }).collect();
            let back = packed.unpack_padded(&items, DType::F32).unwrap();
            for (t, b) in ts.iter().zip(&back) {
                assert_eq!(b.to_bytes().unwrap(), t.mul_scalar(2.0).unwrap().to_bytes().unwrap());
            }
        }
        assert!(Tensor::pack_padded(&mats, 4, 4, DType::F32).is_err(), "a 3×5 matrix does not fit 4×4");
    }
}

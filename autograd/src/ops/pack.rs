//! Matrices of different shapes packed into one zero-padded batch, and back: how MuSGD's
//! Newton–Schulz runs the momenta of many shapes through one batched GEMM per product instead of
//! one per shape (zero rows and columns add exact zeros to every product, so each slot's result is
//! its own matrix's). No gradient: optimizer-side data movement.

pub use crate::backend::PackedMatrix;
use crate::storage::Storage;
use crate::{DType, Error, Result, Tensor};

/// What [`Tensor::unpack_padded`] makes of one slot: the matrix, the shape it is given back
/// (`rows·cols` elements) and a factor it is multiplied by (as `mul_scalar`; 1 multiplies nothing).
#[derive(Clone, Debug, PartialEq)]
pub struct Unpacked {
    /// Where the matrix lies in the packed buffer.
    pub matrix: PackedMatrix,
    /// The shape it is given back (`rows·cols` elements).
    pub dims: Vec<usize>,
    /// The factor it is multiplied by.
    pub scale: f64,
}

impl Tensor {
    /// A `[mats.len(), rows, cols]` tensor of `dtype` whose slot `i` holds matrix `i` (its
    /// elements viewed as `rows × cols` of its [`PackedMatrix`], transposed when flagged) in the
    /// top-left corner and zeros elsewhere; values cast as [`Tensor::to_dtype`] casts them. f32
    /// matrices of their own storages go through the backend's [`crate::backend::PackStorage`]
    /// (on CUDA one launch for up to 40); anything else through composed ops.
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
        if mats.iter().all(|(t, _)| whole(t)) {
            let held = mats.iter().map(|(t, _)| t.read_storage()).collect::<Result<Vec<_>>>()?;
            let items: Vec<(&Storage, PackedMatrix)> = held.iter().zip(mats).map(|(s, (_, m))| (&**s, *m)).collect();
            if let Some(s) = Storage::pack_padded(&items, rows, cols, dtype)? {
                return Tensor::from_storage(s, vec![mats.len(), rows, cols]);
            }
        }
        crate::no_grad(|| composed_pack(mats, rows, cols, dtype))
    }

    /// The slots of a packed batch (`[n, rows, cols]`, see [`Tensor::pack_padded`]) as separate
    /// tensors of `dtype`: slot `i`'s corner (transposed back when flagged), cast, times its scale,
    /// in its dims. Into f32, through the backend's [`crate::backend::PackStorage`] (on CUDA one launch for up to
    /// 40 slots); anything else through composed ops.
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
        if dtype == DType::F32 && whole(self) {
            let slots: Vec<(PackedMatrix, f64)> = items.iter().map(|it| (it.matrix, it.scale)).collect();
            let unpacked = Storage::unpack_padded(&*self.read_storage()?, &slots, rows, cols)?;
            if let Some(storages) = unpacked {
                return storages.into_iter().zip(items).map(|(s, it)| Tensor::from_storage(s, it.dims.clone())).collect();
            }
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

/// Whether `t` covers its whole storage (a batch kernel reads and writes storages).
fn whole(t: &Tensor) -> bool {
    t.numel() > 0 && t.raw_storage().len() == t.numel()
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

    /// The CPU backend's pack and unpack kernels give the composed ops' bytes — every slot dtype,
    /// transposed and not, scales of 1, 2 and 0.3, with signed zeros, a NaN and values bf16 rounds.
    #[test]
    fn the_cpu_kernels_give_the_composed_bytes() {
        let mut rng = Rng::new(9);
        let shapes = [(3usize, 5usize, false), (6, 2, true), (4, 4, false), (1, 7, true)];
        let ts: Vec<Tensor> = shapes
            .iter()
            .map(|&(r, c, _)| {
                let mut v = Tensor::rand(vec![r * c], -3.0, 3.0, DType::F32, Device::Cpu, &mut rng).unwrap().to_vec::<f32>().unwrap();
                v[0] = -0.0;
                if v.len() > 2 {
                    v[1] = f32::NAN;
                    v[2] = 1.0 + f32::EPSILON;
                }
                Tensor::from_vec(v, vec![r, c], Device::Cpu).unwrap()
            })
            .collect();
        let mats: Vec<(&Tensor, PackedMatrix)> =
            ts.iter().zip(&shapes).map(|(t, &(rows, cols, transposed))| (t, PackedMatrix { rows, cols, transposed })).collect();
        for dt in [DType::BF16, DType::F32, DType::F64] {
            let kernel = Tensor::pack_padded(&mats, 7, 8, dt).unwrap();
            let composed = composed_pack(&mats, 7, 8, dt).unwrap();
            assert_eq!(kernel.to_bytes().unwrap(), composed.to_bytes().unwrap(), "pack into {dt}");
            for scale in [1.0, 2.0, 0.3] {
                let items: Vec<Unpacked> = mats.iter().map(|(t, m)| Unpacked { matrix: *m, dims: t.dims().to_vec(), scale }).collect();
                let kernel = kernel.unpack_padded(&items, DType::F32).unwrap();
                let composed = composed_unpack(&composed, &items, DType::F32).unwrap();
                for (k, c) in kernel.iter().zip(&composed) {
                    assert_eq!(k.to_bytes().unwrap(), c.to_bytes().unwrap(), "unpack from {dt}, scale {scale}");
                }
            }
        }
    }
}

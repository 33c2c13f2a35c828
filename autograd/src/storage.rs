//! Device dispatch: a [`Storage`] is one backend's buffer; every primitive forwards to the
//! backend after checking that all operands live on the same device.

use crate::backend::{
    BackendStorage, BinaryOp, CmpOp, Conv2dParams, DeferredReadStorage, HostRead, MatmulParams, MultiTensorOp, MultiTensorStorage, Operand,
    PackStorage, PackedMatrix, PhiloxStart, Pool2dParams, RandomStorage, ReduceOp, ScalarsAt, UnaryOp,
};
use crate::cpu::CpuStorage;
use crate::shape::Layout;
use crate::{DType, Device, Error, Result};

/// Whether `Cuda(ordinal)` can be used in this process (false in builds without a CUDA backend,
/// or when the driver, a library or the GPU is missing).
pub fn cuda_usable(ordinal: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::is_available(ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        false
    }
}

/// A buffer on some device.
#[derive(Debug)]
pub enum Storage {
    /// On the host.
    Cpu(CpuStorage),
    /// On a CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaStorage),
}

macro_rules! unary_dispatch {
    ($self:expr, |$s:ident| $body:expr) => {
        match $self {
            Storage::Cpu($s) => Ok(Storage::Cpu($body?)),
            #[cfg(feature = "cuda")]
            Storage::Cuda($s) => Ok(Storage::Cuda($body?)),
        }
    };
}

macro_rules! pair {
    ($op:literal, $a:expr, $b:expr, |$x:ident, $y:ident| $body:expr) => {
        match ($a, $b) {
            (Storage::Cpu($x), Storage::Cpu($y)) => Ok(Storage::Cpu($body?)),
            #[cfg(feature = "cuda")]
            (Storage::Cuda($x), Storage::Cuda($y)) => Ok(Storage::Cuda($body?)),
            #[allow(unreachable_patterns)]
            (a, b) => Err(Error::DeviceMismatch { op: $op, lhs: a.device(), rhs: b.device() }),
        }
    };
}

#[allow(dead_code)]
fn mismatch3(op: &'static str, a: &Storage, b: &Storage, c: &Storage) -> Error {
    let (da, db, dc) = (a.device(), b.device(), c.device());
    Error::DeviceMismatch { op, lhs: da, rhs: if db != da { db } else { dc } }
}

impl Storage {
    /// Where the elements are.
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.device(),
        }
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.dtype(),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.len(),
        }
    }
    /// Whether there is no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Zero-filled storage on `device`.
    pub fn zeros(device: Device, dtype: DType, n: usize) -> Result<Storage> {
        Storage::full(device, dtype, n, 0.0)
    }

    /// A keep mask of `n` elements drawn on `device` ([`RandomStorage::keep_mask`]); a state buffer
    /// must live on `device` too.
    pub(crate) fn keep_mask(device: Device, n: usize, keep: f32, start: PhiloxStart<'_, Storage>) -> Result<Storage> {
        let mismatch = |s: &Storage| Error::DeviceMismatch { op: "keep_mask", lhs: device, rhs: s.device() };
        match device {
            Device::Cpu => {
                let start = match start {
                    PhiloxStart::Value { seed, offset } => PhiloxStart::Value { seed, offset },
                    PhiloxStart::State { state: Storage::Cpu(s), intra } => PhiloxStart::State { state: s, intra },
                    #[allow(unreachable_patterns)]
                    PhiloxStart::State { state, .. } => return Err(mismatch(state)),
                };
                Ok(Storage::Cpu(CpuStorage::keep_mask(device, n, keep, start)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let start = match start {
                    PhiloxStart::Value { seed, offset } => PhiloxStart::Value { seed, offset },
                    PhiloxStart::State { state: Storage::Cuda(s), intra } => PhiloxStart::State { state: s, intra },
                    PhiloxStart::State { state, .. } => return Err(mismatch(state)),
                };
                Ok(Storage::Cuda(crate::cuda::CudaStorage::keep_mask(device, n, keep, start)?))
            }
            #[allow(unreachable_patterns)]
            d => Err(Error::DeviceUnavailable { op: "keep_mask", device: d, reason: "this build has no CUDA backend".into() }),
        }
    }

    /// Writes `(seed, offset)` into this generator state buffer ([`RandomStorage::set_rng_state`]).
    pub(crate) fn set_rng_state(&mut self, seed: u64, offset: u64) -> Result<()> {
        match self {
            Storage::Cpu(c) => c.set_rng_state(seed, offset),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.set_rng_state(seed, offset),
        }
    }

    /// [`PackStorage::pack_padded`] on the items' device (`None`: no kernel for these dtypes).
    pub(crate) fn pack_padded(items: &[(&Storage, PackedMatrix)], rows: usize, cols: usize, dtype: DType) -> Result<Option<Storage>> {
        let Some(&(first, _)) = items.first() else { return Ok(None) };
        let mismatch = |s: &Storage| Error::DeviceMismatch { op: "pack_padded", lhs: first.device(), rhs: s.device() };
        match first {
            Storage::Cpu(_) => {
                let cpu = items.iter().map(|&(s, m)| match s {
                    Storage::Cpu(c) => Ok((c, m)),
                    #[allow(unreachable_patterns)]
                    other => Err(mismatch(other)),
                });
                let cpu: Vec<(&CpuStorage, PackedMatrix)> = cpu.collect::<Result<_>>()?;
                Ok(CpuStorage::pack_padded(&cpu, rows, cols, dtype)?.map(Storage::Cpu))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => {
                let cuda = items.iter().map(|&(s, m)| match s {
                    Storage::Cuda(c) => Ok((c, m)),
                    other => Err(mismatch(other)),
                });
                let cuda: Vec<(&crate::cuda::CudaStorage, PackedMatrix)> = cuda.collect::<Result<_>>()?;
                Ok(crate::cuda::CudaStorage::pack_padded(&cuda, rows, cols, dtype)?.map(Storage::Cuda))
            }
        }
    }

    /// [`MultiTensorStorage::multi_tensor`] on the operands' device (`None`: no kernel for this
    /// op there). Every operand and scalar must be on the first operand's device.
    pub(crate) fn multi_tensor<'a>(op: MultiTensorOp<'a, Storage>, rows: Vec<Vec<Operand<'a, Storage>>>) -> Result<Option<Vec<Storage>>> {
        let Some(device) = rows.iter().flatten().next().map(|o| o.get().device()) else { return Ok(Some(Vec::new())) };
        let mismatch = |other: Device| Error::DeviceMismatch { op: "multi-tensor update", lhs: device, rhs: other };
        match device {
            Device::Cpu => {
                #[allow(unreachable_patterns)]
                let (op, rows) = narrow_multi(
                    op,
                    rows,
                    |s| match s {
                        Storage::Cpu(c) => Ok(c),
                        other => Err(mismatch(other.device())),
                    },
                    |s| match s {
                        Storage::Cpu(c) => Ok(c),
                        other => Err(mismatch(other.device())),
                    },
                )?;
                Ok(CpuStorage::multi_tensor(op, rows)?.map(|v| v.into_iter().map(Storage::Cpu).collect()))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let (op, rows) = narrow_multi(
                    op,
                    rows,
                    |s| match s {
                        Storage::Cuda(c) => Ok(c),
                        other => Err(mismatch(other.device())),
                    },
                    |s| match s {
                        Storage::Cuda(c) => Ok(c),
                        other => Err(mismatch(other.device())),
                    },
                )?;
                Ok(crate::cuda::CudaStorage::multi_tensor(op, rows)?.map(|v| v.into_iter().map(Storage::Cuda).collect()))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(mismatch(device)),
        }
    }

    /// Writes `values` into this f64 storage from element `at` on (on CUDA a host→device copy
    /// queued on the compute stream; refused while a graph is being recorded).
    pub(crate) fn write_f64(&mut self, at: usize, values: &[f64]) -> Result<()> {
        match self {
            Storage::Cpu(CpuStorage::F64(v)) => {
                v[at..at + values.len()].copy_from_slice(values);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) if c.dtype() == DType::F64 => {
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                c.write_from_host(8 * at, &bytes)
            }
            _ => Err(Error::invalid("write_f64", "not an f64 storage")),
        }
    }

    /// [`PackStorage::unpack_padded`] on this batch's device (`None`: no kernel for its dtype).
    pub(crate) fn unpack_padded(&self, items: &[(PackedMatrix, f64)], rows: usize, cols: usize) -> Result<Option<Vec<Storage>>> {
        Ok(match self {
            Storage::Cpu(c) => c.unpack_padded(items, rows, cols)?.map(|v| v.into_iter().map(Storage::Cpu).collect()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.unpack_padded(items, rows, cols)?.map(|v| v.into_iter().map(Storage::Cuda).collect()),
        })
    }

    /// Queues the copy of this f32 storage to the host ([`DeferredReadStorage::read_later`]).
    pub(crate) fn read_later(&self) -> Result<Box<dyn HostRead>> {
        match self {
            Storage::Cpu(c) => c.read_later(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => c.read_later(),
        }
    }

    /// Storage whose every element the caller overwrites before reading: no fill on GPUs (zeros on
    /// the host). Used for outputs of full copies (views, concatenation).
    pub fn uninit(device: Device, dtype: DType, n: usize) -> Result<Storage> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Ok(Storage::Cuda(crate::cuda::CudaStorage::uninit(device, dtype, n)?)),
            _ => Storage::zeros(device, dtype, n),
        }
    }

    /// Constant-filled storage on `device`.
    pub fn full(device: Device, dtype: DType, n: usize, value: f64) -> Result<Storage> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Ok(Storage::Cuda(crate::cuda::CudaStorage::full(device, dtype, n, value)?)),
            _ => Storage::from_cpu(CpuStorage::full(dtype, n, value), device),
        }
    }

    /// Uploads a host buffer (or keeps it on the host).
    pub fn from_cpu(s: CpuStorage, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(s)),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Ok(Storage::Cuda(crate::cuda::CudaStorage::from_cpu(&s, device)?)),
            #[allow(unreachable_patterns)]
            d => Err(Error::DeviceUnavailable { op: "to_device", device: d, reason: "this build has no CUDA backend".into() }),
        }
    }

    /// Downloads to the host (a synchronising copy on GPUs).
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s.clone()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.to_cpu(),
        }
    }

    /// A deep copy on the same device.
    pub fn try_clone(&self) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.clone())),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(s.try_clone()?)),
        }
    }

    /// See [`BackendStorage::unary`].
    pub fn unary(&self, op: UnaryOp) -> Result<Storage> {
        unary_dispatch!(self, |s| s.unary(op))
    }
    /// See [`BackendStorage::binary`].
    pub fn binary(&self, l: &Layout, rhs: &Storage, r: &Layout, op: BinaryOp) -> Result<Storage> {
        pair!("binary", self, rhs, |a, b| a.binary(l, b, r, op))
    }
    /// See [`BackendStorage::cmp`].
    pub fn cmp(&self, l: &Layout, rhs: &Storage, r: &Layout, op: CmpOp) -> Result<Storage> {
        pair!("cmp", self, rhs, |a, b| a.cmp(l, b, r, op))
    }
    /// See [`BackendStorage::where_cond`].
    pub fn where_cond(&self, cl: &Layout, a: &Storage, al: &Layout, b: &Storage, bl: &Layout) -> Result<Storage> {
        match (self, a, b) {
            (Storage::Cpu(c), Storage::Cpu(x), Storage::Cpu(y)) => Ok(Storage::Cpu(c.where_cond(cl, x, al, y, bl)?)),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(c), Storage::Cuda(x), Storage::Cuda(y)) => Ok(Storage::Cuda(c.where_cond(cl, x, al, y, bl)?)),
            #[allow(unreachable_patterns)]
            (c, x, y) => Err(mismatch3("where_cond", c, x, y)),
        }
    }
    /// See [`BackendStorage::reduce`].
    pub fn reduce(&self, shape: &[usize], dim: usize, op: ReduceOp) -> Result<Storage> {
        unary_dispatch!(self, |s| s.reduce(shape, dim, op))
    }
    /// The sum over the outer and inner dims of `self` viewed as [outer, mid, inner] in one pass,
    /// where the backend has one (CUDA); `None` elsewhere (the caller reduces dim by dim).
    pub fn sum_mid(&self, outer: usize, mid: usize, inner: usize) -> Result<Option<Storage>> {
        match self {
            Storage::Cpu(_) => Ok(None),
            #[cfg(feature = "cuda")]
            Storage::Cuda(x) => Ok(Some(Storage::Cuda(crate::cuda::ops::sum_mid(x, outer, mid, inner)?))),
        }
    }
    /// See [`BackendStorage::to_dtype`].
    pub fn to_dtype(&self, dtype: DType) -> Result<Storage> {
        unary_dispatch!(self, |s| s.to_dtype(dtype))
    }
    /// Every storage cast to `dtype` (each as [`Storage::to_dtype`]); on CUDA the f32 ↔ half casts
    /// of many tensors run as one launch per 40. `transposes[k] = Some((a, b))`: storage k, read
    /// as (K, a, b), is stored (K, b, a) — in the same launch on CUDA.
    pub fn to_dtype_many(xs: &[&Storage], dtype: DType, transposes: &[Option<(usize, usize)>]) -> Result<Vec<Storage>> {
        if transposes.len() != xs.len() {
            return Err(Error::invalid("to_dtype_many", format!("{} transposes for {} storages", transposes.len(), xs.len())));
        }
        #[cfg(feature = "cuda")]
        if !xs.is_empty() && xs.iter().all(|s| matches!(s, Storage::Cuda(_))) {
            let cuda: Vec<&crate::cuda::CudaStorage> = xs
                .iter()
                .filter_map(|s| match s {
                    Storage::Cuda(c) => Some(c),
                    #[allow(unreachable_patterns)]
                    _ => None,
                })
                .collect();
            return Ok(crate::cuda::ops::to_dtype_many(&cuda, dtype, transposes)?.into_iter().map(Storage::Cuda).collect());
        }
        xs.iter()
            .zip(transposes)
            .map(|(s, t)| {
                let cast = s.to_dtype(dtype)?;
                let Some((a, b)) = *t else { return Ok(cast) };
                if a == 0 || b == 0 || cast.len() % (a * b) != 0 {
                    return Err(Error::invalid("to_dtype_many", format!("a ({a}, {b}) transpose of a storage of {} elements", cast.len())));
                }
                let k = cast.len() / (a * b);
                let mut out = Storage::uninit(cast.device(), dtype, cast.len())?;
                let src = Layout { shape: vec![k, b, a], strides: vec![a * b, 1, b], offset: 0 };
                cast.copy_strided(&src, &mut out, &Layout::contiguous(&[k, b, a]))?;
                Ok(out)
            })
            .collect()
    }
    /// See [`BackendStorage::copy_strided`].
    pub fn copy_strided(&self, sl: &Layout, dst: &mut Storage, dl: &Layout) -> Result<()> {
        match (self, dst) {
            (Storage::Cpu(s), Storage::Cpu(d)) => s.copy_strided(sl, d, dl),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(s), Storage::Cuda(d)) => s.copy_strided(sl, d, dl),
            #[allow(unreachable_patterns)]
            (s, d) => Err(Error::DeviceMismatch { op: "copy_strided", lhs: s.device(), rhs: d.device() }),
        }
    }
    /// Splits `self` along one dimension into contiguous outputs in a single device pass where the
    /// backend has one (CUDA, up to 8 outputs): `rows` = product of the dims before it, `dsts[k]`
    /// = (output k's device address, its bytes per row). `Ok(false)`: copy piece by piece instead.
    pub fn split_rows(&self, rows: usize, dsts: &[(Option<u64>, usize)]) -> Result<bool> {
        self.rows_in_one_pass(rows, dsts, true)
    }
    /// The device address of a CUDA storage (`None` on the CPU).
    pub fn device_address(&self) -> Option<u64> {
        match self {
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Some(c.device_ptr()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    /// Concatenates contiguous inputs along one dimension in a single device pass where the
    /// backend has one (CUDA, up to 8 inputs): `rows` = product of the dims before it, `srcs[k]` =
    /// (input k's device address, its bytes per row). `Ok(false)`: copy input by input instead.
    pub fn cat_rows(&mut self, rows: usize, srcs: &[(Option<u64>, usize)]) -> Result<bool> {
        self.rows_in_one_pass(rows, srcs, false)
    }
    /// [`Storage::cat_rows`] of float inputs where a piece may be the sum of two, added as the
    /// addition kernel adds (the bytes of adding first): `srcs[k]` = (input k's device address,
    /// the second addend's or `None`, its values per row). `Ok(false)`: add, then concatenate.
    #[allow(unused_variables)]
    pub fn cat_rows_adding(&mut self, rows: usize, srcs: &[(u64, Option<u64>, usize)]) -> Result<bool> {
        match self {
            #[cfg(feature = "cuda")]
            Storage::Cuda(whole) if srcs.len() <= crate::cuda::ops::CAT_MAX_INPUTS && whole.dtype.is_float() => {
                crate::cuda::ops::cat_rows_adding(whole, rows, srcs)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    /// [`Storage::split_rows`] (`split`) or [`Storage::cat_rows`] between `self` and the pieces.
    #[allow(unused_variables)]
    fn rows_in_one_pass(&self, rows: usize, pieces: &[(Option<u64>, usize)], split: bool) -> Result<bool> {
        match self {
            #[cfg(feature = "cuda")]
            Storage::Cuda(whole) => {
                if pieces.len() > crate::cuda::ops::CAT_MAX_INPUTS {
                    return Ok(false);
                }
                let Some(ptrs) = pieces.iter().map(|&(p, w)| p.map(|p| (p, w))).collect::<Option<Vec<_>>>() else {
                    return Ok(false);
                };
                if split {
                    crate::cuda::ops::split_rows(whole, rows, &ptrs)?;
                } else {
                    crate::cuda::ops::cat_rows(whole, rows, &ptrs)?;
                }
                Ok(true)
            }
            #[allow(unreachable_patterns)]
            _ => Ok(false),
        }
    }
    /// See [`BackendStorage::add_assign`].
    pub fn add_assign(&mut self, src: &Storage) -> Result<()> {
        match (self, src) {
            (Storage::Cpu(d), Storage::Cpu(s)) => d.add_assign(s),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(d), Storage::Cuda(s)) => d.add_assign(s),
            #[allow(unreachable_patterns)]
            (d, s) => Err(Error::DeviceMismatch { op: "add_assign", lhs: d.device(), rhs: s.device() }),
        }
    }
    /// `dst += src` for every pair (each as [`Storage::add_assign`] would); on CUDA one launch per
    /// dtype and 40 tensors instead of one per pair.
    pub fn add_assign_many(pairs: &mut [(&mut Storage, &Storage)]) -> Result<()> {
        #[cfg(feature = "cuda")]
        if pairs.iter().all(|(d, s)| matches!((&**d, s), (Storage::Cuda(_), Storage::Cuda(_)))) {
            let mut cuda: Vec<(&mut crate::cuda::CudaStorage, &crate::cuda::CudaStorage)> = pairs
                .iter_mut()
                .filter_map(|(d, s)| match (&mut **d, &**s) {
                    (Storage::Cuda(d), Storage::Cuda(s)) => Some((d, s)),
                    #[allow(unreachable_patterns)]
                    _ => None,
                })
                .collect();
            return crate::cuda::ops::add_assign_many(&mut cuda);
        }
        for (d, s) in pairs.iter_mut() {
            d.add_assign(s)?;
        }
        Ok(())
    }
    /// `dst = src` for every pair (same length and dtype), bytes as they are; on CUDA one launch
    /// per 40 pairs instead of a copy each (a recorded graph's copies become one node each).
    pub fn copy_many(pairs: &mut [(&mut Storage, &Storage)]) -> Result<()> {
        #[cfg(feature = "cuda")]
        if pairs.iter().all(|(d, s)| matches!((&**d, s), (Storage::Cuda(_), Storage::Cuda(_)))) {
            let mut cuda: Vec<(&mut crate::cuda::CudaStorage, &crate::cuda::CudaStorage)> = pairs
                .iter_mut()
                .filter_map(|(d, s)| match (&mut **d, &**s) {
                    (Storage::Cuda(d), Storage::Cuda(s)) => Some((d, s)),
                    #[allow(unreachable_patterns)]
                    _ => None,
                })
                .collect();
            return crate::cuda::ops::copy_many(&mut cuda);
        }
        for (d, s) in pairs.iter_mut() {
            let whole = crate::shape::Layout::contiguous(&[s.len()]);
            s.copy_strided(&whole, d, &whole)?;
        }
        Ok(())
    }
    /// See [`BackendStorage::index_select`].
    pub fn index_select(&self, shape: &[usize], dim: usize, idx: &Storage) -> Result<Storage> {
        pair!("index_select", self, idx, |s, i| s.index_select(shape, dim, i))
    }
    /// See [`BackendStorage::index_add`].
    pub fn index_add(&self, shape: &[usize], dim: usize, idx: &Storage, src: &Storage) -> Result<Storage> {
        match (self, idx, src) {
            (Storage::Cpu(s), Storage::Cpu(i), Storage::Cpu(x)) => Ok(Storage::Cpu(s.index_add(shape, dim, i, x)?)),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(s), Storage::Cuda(i), Storage::Cuda(x)) => Ok(Storage::Cuda(s.index_add(shape, dim, i, x)?)),
            #[allow(unreachable_patterns)]
            (s, i, x) => Err(mismatch3("index_add", s, i, x)),
        }
    }
    /// `index_add` onto zeros of `shape` in `src`'s dtype: on CUDA without a zeroed buffer (the
    /// kernels read a missing base as zeros), elsewhere onto [`Storage::zeros`]. The same bytes.
    pub fn index_add_to_zeros(shape: &[usize], dim: usize, idx: &Storage, src: &Storage) -> Result<Storage> {
        match (idx, src) {
            #[cfg(feature = "cuda")]
            (Storage::Cuda(i), Storage::Cuda(x)) => Ok(Storage::Cuda(crate::cuda::ops::index_add_to_zeros(shape, dim, i, x)?)),
            _ => Storage::zeros(src.device(), src.dtype(), shape.iter().product())?.index_add(shape, dim, idx, src),
        }
    }
    /// See [`BackendStorage::gather`].
    pub fn gather(&self, shape: &[usize], dim: usize, idx: &Storage, idx_shape: &[usize]) -> Result<Storage> {
        pair!("gather", self, idx, |s, i| s.gather(shape, dim, i, idx_shape))
    }
    /// See [`BackendStorage::scatter_add`].
    pub fn scatter_add(&self, shape: &[usize], dim: usize, idx: &Storage, idx_shape: &[usize], src: &Storage) -> Result<Storage> {
        match (self, idx, src) {
            (Storage::Cpu(s), Storage::Cpu(i), Storage::Cpu(x)) => Ok(Storage::Cpu(s.scatter_add(shape, dim, i, idx_shape, x)?)),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(s), Storage::Cuda(i), Storage::Cuda(x)) => Ok(Storage::Cuda(s.scatter_add(shape, dim, i, idx_shape, x)?)),
            #[allow(unreachable_patterns)]
            (s, i, x) => Err(mismatch3("scatter_add", s, i, x)),
        }
    }
    /// See [`BackendStorage::matmul`].
    pub fn matmul(&self, rhs: &Storage, p: &MatmulParams) -> Result<Storage> {
        pair!("matmul", self, rhs, |a, b| a.matmul(b, p))
    }
    /// See [`BackendStorage::matmul_add`].
    pub fn matmul_add(&self, rhs: &Storage, c: &Storage, p: &MatmulParams, alpha: f64, beta: f64) -> Result<Storage> {
        match (self, rhs, c) {
            (Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)) => Ok(Storage::Cpu(a.matmul_add(b, c, p, alpha, beta)?)),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)) => Ok(Storage::Cuda(a.matmul_add(b, c, p, alpha, beta)?)),
            #[allow(unreachable_patterns)]
            (a, b, c) => Err(mismatch3("matmul_add", a, b, c)),
        }
    }
    /// Whether this storage's backend computes convolutions on channels-last data.
    pub fn computes_channels_last_convolutions(&self) -> bool {
        match self {
            Storage::Cpu(s) => s.computes_channels_last_convolutions(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.computes_channels_last_convolutions(),
        }
    }
    /// See [`BackendStorage::reads_channels_last_output_gradient`].
    pub fn reads_channels_last_output_gradient(&self, p: &Conv2dParams) -> bool {
        match self {
            Storage::Cpu(s) => s.reads_channels_last_output_gradient(p),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.reads_channels_last_output_gradient(p),
        }
    }
    /// See [`BackendStorage::reads_channels_last_input`].
    pub fn reads_channels_last_input(&self, p: &Conv2dParams) -> bool {
        match self {
            Storage::Cpu(s) => s.reads_channels_last_input(p),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.reads_channels_last_input(p),
        }
    }
    /// See [`BackendStorage::conv2d`].
    pub fn conv2d(&self, w: &Storage, p: &Conv2dParams) -> Result<Storage> {
        pair!("conv2d", self, w, |a, b| a.conv2d(b, p))
    }
    /// See [`BackendStorage::conv2d_backward_input`].
    pub fn conv2d_backward_input(&self, w: &Storage, p: &Conv2dParams) -> Result<Storage> {
        pair!("conv2d_backward_input", self, w, |a, b| a.conv2d_backward_input(b, p))
    }
    /// See [`BackendStorage::conv2d_backward_weight`].
    pub fn conv2d_backward_weight(&self, x: &Storage, p: &Conv2dParams) -> Result<Storage> {
        pair!("conv2d_backward_weight", self, x, |a, b| a.conv2d_backward_weight(b, p))
    }
    /// See [`BackendStorage::fuses_bias_gradient`].
    pub fn fuses_bias_gradient(&self, p: &Conv2dParams) -> bool {
        match self {
            Storage::Cpu(s) => s.fuses_bias_gradient(p),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.fuses_bias_gradient(p),
        }
    }
    /// See [`BackendStorage::conv2d_backward_weight_and_bias`].
    pub fn conv2d_backward_weight_and_bias(&self, x: &Storage, p: &Conv2dParams) -> Result<(Storage, Storage)> {
        match (self, x) {
            (Storage::Cpu(a), Storage::Cpu(b)) => a.conv2d_backward_weight_and_bias(b, p).map(|(w, g)| (Storage::Cpu(w), Storage::Cpu(g))),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(a), Storage::Cuda(b)) => {
                a.conv2d_backward_weight_and_bias(b, p).map(|(w, g)| (Storage::Cuda(w), Storage::Cuda(g)))
            }
            #[allow(unreachable_patterns)]
            (a, b) => Err(Error::DeviceMismatch { op: "conv2d_backward_weight_and_bias", lhs: a.device(), rhs: b.device() }),
        }
    }
    /// See [`BackendStorage::max_pool2d`].
    pub fn max_pool2d(&self, p: &Pool2dParams) -> Result<(Storage, Storage)> {
        match self {
            Storage::Cpu(s) => {
                let (v, i) = s.max_pool2d(p)?;
                Ok((Storage::Cpu(v), Storage::Cpu(i)))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => {
                let (v, i) = s.max_pool2d(p)?;
                Ok((Storage::Cuda(v), Storage::Cuda(i)))
            }
        }
    }
    /// See [`BackendStorage::upsample_nearest2d`].
    pub fn upsample_nearest2d(&self, shape: [usize; 4], factor: usize, channels_last: bool) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.upsample_nearest2d(shape, factor, channels_last)?)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(s.upsample_nearest2d(shape, factor, channels_last)?)),
        }
    }
    /// See [`BackendStorage::upsample_nearest2d_backward`].
    pub fn upsample_nearest2d_backward(&self, shape: [usize; 4], factor: usize, channels_last: bool) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.upsample_nearest2d_backward(shape, factor, channels_last)?)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(s.upsample_nearest2d_backward(shape, factor, channels_last)?)),
        }
    }
    /// See [`BackendStorage::max_pool2d_backward`].
    pub fn max_pool2d_backward(&self, idx: &Storage, p: &Pool2dParams) -> Result<Storage> {
        pair!("max_pool2d_backward", self, idx, |a, b| a.max_pool2d_backward(b, p))
    }
    /// See [`BackendStorage::batch_norm_train_stats`].
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_train_stats(
        &self,
        shape: &[usize],
        w: &Storage,
        b: &Storage,
        rm: &mut Storage,
        rv: &mut Storage,
        batches: Option<&mut Storage>,
        eps: f64,
        momentum: f64,
        channels_last: bool,
    ) -> Result<(Storage, Storage)> {
        match (self, w, b, rm, rv, batches) {
            (Storage::Cpu(x), Storage::Cpu(w), Storage::Cpu(b), Storage::Cpu(rm), Storage::Cpu(rv), nb) => {
                let nb = match nb {
                    None => None,
                    Some(Storage::Cpu(s)) => Some(s),
                    #[allow(unreachable_patterns)]
                    Some(s) => return Err(Error::DeviceMismatch { op: "batch_norm_train_stats", lhs: Device::Cpu, rhs: s.device() }),
                };
                let (a, n) = x.batch_norm_train_stats(shape, w, b, rm, rv, nb, eps, momentum, channels_last)?;
                Ok((Storage::Cpu(a), Storage::Cpu(n)))
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(x), Storage::Cuda(w), Storage::Cuda(b), Storage::Cuda(rm), Storage::Cuda(rv), nb) => {
                let nb = match nb {
                    None => None,
                    Some(Storage::Cuda(s)) => Some(s),
                    Some(s) => return Err(Error::DeviceMismatch { op: "batch_norm_train_stats", lhs: x.device(), rhs: s.device() }),
                };
                let (a, n) = x.batch_norm_train_stats(shape, w, b, rm, rv, nb, eps, momentum, channels_last)?;
                Ok((Storage::Cuda(a), Storage::Cuda(n)))
            }
            #[allow(unreachable_patterns)]
            (x, w, b, _, _, _) => Err(mismatch3("batch_norm_train_stats", x, w, b)),
        }
    }
    /// See [`BackendStorage::batch_norm_train_apply`].
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_train_apply(
        &self,
        shape: &[usize],
        w: &Storage,
        b: &Storage,
        rm: &mut Storage,
        rv: &mut Storage,
        batches: Option<&mut Storage>,
        eps: f64,
        momentum: f64,
        silu: bool,
        residual: Option<&Storage>,
        channels_last: bool,
    ) -> Result<(Storage, Storage, Storage)> {
        let mismatch = |r: &Storage| Error::DeviceMismatch { op: "batch_norm_train_apply", lhs: self.device(), rhs: r.device() };
        match (self, w, b, rm, rv, batches) {
            (Storage::Cpu(x), Storage::Cpu(w), Storage::Cpu(b), Storage::Cpu(rm), Storage::Cpu(rv), nb) => {
                let nb = match nb {
                    None => None,
                    Some(Storage::Cpu(s)) => Some(s),
                    #[allow(unreachable_patterns)]
                    Some(s) => return Err(Error::DeviceMismatch { op: "batch_norm_train_apply", lhs: Device::Cpu, rhs: s.device() }),
                };
                let r = match residual {
                    None => None,
                    Some(Storage::Cpu(r)) => Some(r),
                    #[allow(unreachable_patterns)]
                    Some(r) => return Err(mismatch(r)),
                };
                let (y, a, n) = x.batch_norm_train_apply(shape, w, b, rm, rv, nb, eps, momentum, silu, r, channels_last)?;
                Ok((Storage::Cpu(y), Storage::Cpu(a), Storage::Cpu(n)))
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(x), Storage::Cuda(w), Storage::Cuda(b), Storage::Cuda(rm), Storage::Cuda(rv), nb) => {
                let nb = match nb {
                    None => None,
                    Some(Storage::Cuda(s)) => Some(s),
                    Some(s) => return Err(Error::DeviceMismatch { op: "batch_norm_train_apply", lhs: x.device(), rhs: s.device() }),
                };
                let r = match residual {
                    None => None,
                    Some(Storage::Cuda(r)) => Some(r),
                    Some(r) => return Err(mismatch(r)),
                };
                let (y, a, n) = x.batch_norm_train_apply(shape, w, b, rm, rv, nb, eps, momentum, silu, r, channels_last)?;
                Ok((Storage::Cuda(y), Storage::Cuda(a), Storage::Cuda(n)))
            }
            #[allow(unreachable_patterns)]
            (x, w, b, _, _, _) => Err(mismatch3("batch_norm_train_apply", x, w, b)),
        }
    }
    /// See [`BackendStorage::batch_norm_act_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_act_backward(
        &self,
        g: &Storage,
        g2: Option<&Storage>,
        shape: &[usize],
        aff: &Storage,
        nrm: &Storage,
        w: &Storage,
        silu: bool,
        training: bool,
        channels_last: bool,
    ) -> Result<(Storage, Storage, Storage)> {
        let other = |x: &Storage| Err(mismatch3("batch_norm_act_backward", self, g, x));
        match (self, g, aff, nrm, w) {
            (Storage::Cpu(x), Storage::Cpu(g), Storage::Cpu(a), Storage::Cpu(n), Storage::Cpu(w)) => {
                let g2 = match g2 {
                    None => None,
                    Some(Storage::Cpu(s)) => Some(s),
                    Some(s) => return other(s),
                };
                let (dx, gw, gb) = x.batch_norm_act_backward(g, g2, shape, a, n, w, silu, training, channels_last)?;
                Ok((Storage::Cpu(dx), Storage::Cpu(gw), Storage::Cpu(gb)))
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(x), Storage::Cuda(g), Storage::Cuda(a), Storage::Cuda(n), Storage::Cuda(w)) => {
                let g2 = match g2 {
                    None => None,
                    Some(Storage::Cuda(s)) => Some(s),
                    Some(s) => return other(s),
                };
                let (dx, gw, gb) = x.batch_norm_act_backward(g, g2, shape, a, n, w, silu, training, channels_last)?;
                Ok((Storage::Cuda(dx), Storage::Cuda(gw), Storage::Cuda(gb)))
            }
            #[allow(unreachable_patterns)]
            (x, g, a, _, _) => Err(mismatch3("batch_norm_act_backward", x, g, a)),
        }
    }
    /// See [`BackendStorage::batch_norm_eval_params`].
    pub fn batch_norm_eval_params(&self, b: &Storage, rm: &Storage, rv: &Storage, eps: f64) -> Result<(Storage, Storage)> {
        match (self, b, rm, rv) {
            (Storage::Cpu(w), Storage::Cpu(b), Storage::Cpu(m), Storage::Cpu(v)) => {
                let (a, n) = w.batch_norm_eval_params(b, m, v, eps)?;
                Ok((Storage::Cpu(a), Storage::Cpu(n)))
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(w), Storage::Cuda(b), Storage::Cuda(m), Storage::Cuda(v)) => {
                let (a, n) = w.batch_norm_eval_params(b, m, v, eps)?;
                Ok((Storage::Cuda(a), Storage::Cuda(n)))
            }
            #[allow(unreachable_patterns)]
            (w, b, m, _) => Err(mismatch3("batch_norm_eval_params", w, b, m)),
        }
    }
    /// See [`BackendStorage::softmax`].
    pub fn softmax(&self, shape: &[usize], dim: usize, log: bool) -> Result<Storage> {
        unary_dispatch!(self, |s| s.softmax(shape, dim, log))
    }
    /// See [`BackendStorage::channel_affine`].
    pub fn channel_affine(&self, shape: &[usize], params: &Storage, silu: bool, channels_last: bool) -> Result<Storage> {
        pair!("channel_affine", self, params, |a, b| a.channel_affine(shape, b, silu, channels_last))
    }
    /// See [`BackendStorage::nonzero_static`].
    pub fn nonzero_static(&self, size: usize, fill: i64) -> Result<Storage> {
        unary_dispatch!(self, |s| s.nonzero_static(size, fill))
    }
    /// See [`BackendStorage::topk`].
    pub fn topk(&self, shape: &[usize], dim: usize, k: usize, largest: bool) -> Result<(Storage, Storage)> {
        match self {
            Storage::Cpu(s) => {
                let (v, i) = s.topk(shape, dim, k, largest)?;
                Ok((Storage::Cpu(v), Storage::Cpu(i)))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => {
                let (v, i) = s.topk(shape, dim, k, largest)?;
                Ok((Storage::Cuda(v), Storage::Cuda(i)))
            }
        }
    }
}

/// Multi-tensor rows: each item's operands.
type Rows<'a, B> = Vec<Vec<Operand<'a, B>>>;

/// A multi-tensor op and its rows with every storage taken out of [`Storage`] by `pick` (read) and
/// `pick_mut` (written): one backend's operands, or the error of the first foreign one.
fn narrow_multi<'a, B>(
    op: MultiTensorOp<'a, Storage>,
    rows: Vec<Vec<Operand<'a, Storage>>>,
    pick: impl Fn(&'a Storage) -> Result<&'a B>,
    pick_mut: impl Fn(&'a mut Storage) -> Result<&'a mut B>,
) -> Result<(MultiTensorOp<'a, B>, Rows<'a, B>)> {
    let scalars = |s: ScalarsAt<'a, Storage>| -> Result<ScalarsAt<'a, B>> {
        Ok(ScalarsAt { values: pick(s.values)?, at: s.at, skip: s.skip.map(&pick).transpose()? })
    };
    let op = match op {
        MultiTensorOp::Sgd { h, with_buf } => MultiTensorOp::Sgd { h, with_buf },
        MultiTensorOp::SgdDev { scalars: s, weight_decay, nesterov, with_buf } => {
            MultiTensorOp::SgdDev { scalars: scalars(s)?, weight_decay, nesterov, with_buf }
        }
        MultiTensorOp::Blend { beta, nesterov } => MultiTensorOp::Blend { beta, nesterov },
        MultiTensorOp::BlendDev { scalars: s, nesterov } => MultiTensorOp::BlendDev { scalars: scalars(s)?, nesterov },
        MultiTensorOp::Lerp { w } => MultiTensorOp::Lerp { w },
        MultiTensorOp::LerpDev { scalars: s } => MultiTensorOp::LerpDev { scalars: scalars(s)? },
        MultiTensorOp::AdamWDev { scalars: s, weight_decay } => MultiTensorOp::AdamWDev { scalars: scalars(s)?, weight_decay },
        MultiTensorOp::Unscale { inv_scale } => MultiTensorOp::Unscale { inv_scale: pick(inv_scale)? },
        MultiTensorOp::ClipNorm { max_norm } => MultiTensorOp::ClipNorm { max_norm },
    };
    let rows = rows
        .into_iter()
        .map(|r| {
            r.into_iter()
                .map(|o| match o {
                    Operand::Read(s) => pick(s).map(Operand::Read),
                    Operand::Write(s) => pick_mut(s).map(Operand::Write),
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((op, rows))
}

//! The [`Tensor`] handle: shape, dtype, device, shared storage and autograd metadata.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use half::{bf16, f16};

use crate::autograd::GradFn;
use crate::cpu::CpuStorage;
use crate::memory_format::{MemoryFormat, StorageRead};
use crate::shape::{Layout, Shape};
use crate::storage::Storage;
use crate::{DType, Device, Error, Result};

/// Unique identity of a tensor handle (not of its storage).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TensorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

pub(crate) struct TensorImpl {
    pub(crate) id: TensorId,
    pub(crate) storage: Arc<RwLock<Storage>>,
    pub(crate) shape: Shape,
    /// The order of the elements in `storage` (every handle on one storage has the same).
    pub(crate) format: MemoryFormat,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    /// Whether gradients are recorded for this tensor; a leaf's flag may be switched in place
    /// ([`Tensor::set_requires_grad`], PyTorch's `param.requires_grad_(False)`: freezing).
    pub(crate) requires_grad: std::sync::atomic::AtomicBool,
    pub(crate) grad_fn: Option<GradFn>,
    /// Accumulated gradient of a leaf; `None` means "no gradient reached it" (never zero-filled).
    pub(crate) grad: Mutex<Option<Tensor>>,
    /// Whether [`Tensor::zero_grad`] keeps the gradient's buffer for the next one
    /// ([`Tensor::set_keep_grad_buffer`]).
    pub(crate) keep_grad: std::sync::atomic::AtomicBool,
    /// The buffer kept by [`Tensor::zero_grad`] (the gradient is absent meanwhile).
    pub(crate) kept_grad: Mutex<Option<Tensor>>,
}

/// A leaf's gradient and kept buffer while taken out ([`Tensor::take_grad_state`]).
pub struct GradState {
    grad: Option<Tensor>,
    kept: Option<Tensor>,
}

/// An n-dimensional array: its storage row-major in the logical shape's order, or channels-last
/// for a 4-D tensor converted with [`Tensor::to_memory_format`]. Cloning is cheap (shared storage
/// and identity).
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorImpl>);

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor{{shape: {:?}, dtype: {}, device: {}", self.dims(), self.dtype(), self.device())?;
        if let Some(g) = &self.0.grad_fn {
            write!(f, ", grad_fn: {}", g.node.name())?;
        } else if self.requires_grad() {
            write!(f, ", leaf")?;
        }
        write!(f, "}}")
    }
}

/// Host element types that tensors can be built from and read back into.
pub trait Element: Copy + Send + Sync + 'static {
    /// The dtype of this element type.
    const DTYPE: DType;
    /// Host storage of these values.
    fn into_storage(v: Vec<Self>) -> CpuStorage;
    /// The values, when the storage has this dtype.
    fn from_storage(s: &CpuStorage) -> Option<Vec<Self>>;
}

macro_rules! element {
    ($t:ty, $dt:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dt;
            fn into_storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$dt(v)
            }
            fn from_storage(s: &CpuStorage) -> Option<Vec<Self>> {
                match s {
                    CpuStorage::$dt(v) => Some(v.clone()),
                    _ => None,
                }
            }
        }
    };
}
element!(f32, F32);
element!(f64, F64);
element!(f16, F16);
element!(bf16, BF16);
element!(i64, I64);
element!(u8, U8);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn into_storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::Bool(v.into_iter().map(|b| b as u8).collect())
    }
    fn from_storage(s: &CpuStorage) -> Option<Vec<Self>> {
        match s {
            CpuStorage::Bool(v) => Some(v.iter().map(|&b| b != 0).collect()),
            _ => None,
        }
    }
}

impl Tensor {
    // ---- construction ---------------------------------------------------------------------------

    /// Wraps a storage as a tensor without autograd history.
    pub fn from_storage(storage: Storage, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_storage_shape(storage, shape.into())
    }

    pub(crate) fn from_storage_shape(storage: Storage, shape: Shape) -> Result<Tensor> {
        if storage.len() != shape.numel() {
            return Err(Error::invalid(
                "from_storage",
                format!("storage has {} elements but shape {:?} needs {}", storage.len(), shape, shape.numel()),
            ));
        }
        Tensor::from_storage_in(storage, shape, MemoryFormat::Contiguous)
    }

    /// [`Tensor::from_storage`] for a storage whose elements lie in `format`.
    pub(crate) fn from_storage_in(storage: Storage, shape: Shape, format: MemoryFormat) -> Result<Tensor> {
        if storage.len() != shape.numel() {
            return Err(Error::invalid(
                "from_storage",
                format!("storage has {} elements but shape {:?} needs {}", storage.len(), shape, shape.numel()),
            ));
        }
        let storage = Arc::new(RwLock::new(storage));
        crate::write_journal::note_created(&storage);
        Ok(Tensor::build_in(storage, shape, format, false, None))
    }

    /// A contiguous tensor on `storage` (see [`Tensor::build_in`]).
    pub(crate) fn build(storage: Arc<RwLock<Storage>>, shape: Shape, requires_grad: bool, grad_fn: Option<GradFn>) -> Tensor {
        Tensor::build_in(storage, shape, MemoryFormat::Contiguous, requires_grad, grad_fn)
    }

    /// A new handle on `storage`, whose elements lie in `format`.
    pub(crate) fn build_in(
        storage: Arc<RwLock<Storage>>,
        shape: Shape,
        format: MemoryFormat,
        requires_grad: bool,
        grad_fn: Option<GradFn>,
    ) -> Tensor {
        let (dtype, device) = {
            let s = storage.read().unwrap_or_else(|e| e.into_inner());
            (s.dtype(), s.device())
        };
        Tensor(Arc::new(TensorImpl {
            id: TensorId::next(),
            storage,
            shape,
            format,
            dtype,
            device,
            requires_grad: std::sync::atomic::AtomicBool::new(requires_grad || grad_fn.is_some()),
            grad_fn,
            grad: Mutex::new(None),
            keep_grad: std::sync::atomic::AtomicBool::new(false),
            kept_grad: Mutex::new(None),
        }))
    }

    /// A tensor from host data.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(Error::invalid("from_vec", format!("{} values for shape {:?} ({} elements)", data.len(), shape, shape.numel())));
        }
        Tensor::from_storage(Storage::from_cpu(T::into_storage(data), device)?, shape)
    }

    /// A tensor of any dtype from f64 values (converted).
    pub fn from_f64(data: &[f64], shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(Error::invalid("from_f64", format!("{} values for shape {:?}", data.len(), shape)));
        }
        Tensor::from_storage(Storage::from_cpu(CpuStorage::from_f64(dtype, data), device)?, shape)
    }

    /// A 0-d tensor.
    pub fn scalar(v: f64, dtype: DType, device: Device) -> Result<Tensor> {
        // A fill on the device, not an upload: scalars inside ops never cost a host transfer.
        Tensor::full((), v, dtype, device)
    }

    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype, device)
    }
    /// A tensor of ones.
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }
    /// A tensor filled with `value`.
    pub fn full(shape: impl Into<Shape>, value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        Tensor::from_storage(Storage::full(device, dtype, shape.numel(), value)?, shape)
    }
    /// Zeros of this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape().clone(), self.dtype(), self.device())
    }
    /// Ones of this tensor's shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape().clone(), self.dtype(), self.device())
    }
    /// `v` in this tensor's shape, dtype and device.
    pub fn full_like(&self, v: f64) -> Result<Tensor> {
        Tensor::full(self.shape().clone(), v, self.dtype(), self.device())
    }
    /// `[start, start+1, …, end)` as a 1-d tensor.
    pub fn arange(start: i64, end: i64, dtype: DType, device: Device) -> Result<Tensor> {
        let v: Vec<f64> = (start..end).map(|x| x as f64).collect();
        let n = v.len();
        Tensor::from_f64(&v, n, dtype, device)
    }

    // ---- accessors ------------------------------------------------------------------------------

    /// The tensor's identity (shared by its clones).
    pub fn id(&self) -> TensorId {
        self.0.id
    }
    /// Its shape.
    pub fn shape(&self) -> &Shape {
        &self.0.shape
    }
    /// Its dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0.shape.0
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.shape.rank()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.shape.numel()
    }
    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// Its device.
    pub fn device(&self) -> Device {
        self.0.device
    }
    /// Size of dimension `dim` (negative counts from the end).
    pub fn dim(&self, dim: isize) -> Result<usize> {
        Ok(self.dims()[crate::shape::normalize_dim("dim", dim, self.rank())?])
    }
    /// Whether a backward pass computes its gradient.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Switches gradient recording of this leaf in place, for every handle on it (freezing a
    /// parameter: the modules keep the same tensor). A frozen parameter's gradient stays absent.
    /// Tensors produced by an op (with autograd history) cannot be switched.
    pub fn set_requires_grad(&self, on: bool) -> Result<()> {
        if self.0.grad_fn.is_some() {
            return Err(Error::invalid("set_requires_grad", "only leaf tensors (parameters, inputs) can be switched; use detach()"));
        }
        if on && !self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: "set_requires_grad", dtype: self.dtype(), expected: "a float dtype" });
        }
        self.0.requires_grad.store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    /// A leaf has no producing node (parameters, inputs, detached tensors).
    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.is_none()
    }
    pub(crate) fn grad_fn(&self) -> Option<&GradFn> {
        self.0.grad_fn.as_ref()
    }
    /// Name of the op that produced this tensor, if it has autograd history.
    pub fn grad_fn_name(&self) -> Option<String> {
        self.0.grad_fn.as_ref().map(|g| g.node.name().to_string())
    }

    /// The storage as it lies when an op computes on channels-last storage (`channels_last`),
    /// else in the contiguous order ([`Tensor::read_storage`]).
    pub(crate) fn storage_for(&self, channels_last: bool) -> Result<StorageRead<'_>> {
        match channels_last {
            true => Ok(StorageRead::Shared(self.raw_storage())),
            false => self.read_storage(),
        }
    }

    /// The storage in the contiguous order, as ops read their operands: the tensor's own under
    /// its read lock, or a contiguous copy of a channels-last tensor (see [`MemoryFormat`]).
    pub(crate) fn read_storage(&self) -> Result<StorageRead<'_>> {
        match self.memory_format() {
            MemoryFormat::Contiguous => Ok(StorageRead::Shared(self.raw_storage())),
            format => Ok(StorageRead::Converted(crate::memory_format::rearranged(
                &self.raw_storage(),
                self.dims(),
                format,
                MemoryFormat::Contiguous,
            )?)),
        }
    }
    /// The storage as it lies, in the tensor's [`MemoryFormat`] (lengths, addresses, raw copies).
    pub(crate) fn raw_storage(&self) -> RwLockReadGuard<'_, Storage> {
        self.0.storage.read().unwrap_or_else(|e| e.into_inner())
    }
    /// The storage for an in-place write by `op`: refused for a channels-last tensor, whose
    /// elements are not where the op's contiguous arithmetic would put them.
    pub(crate) fn write_storage_for(&self, op: &'static str) -> Result<RwLockWriteGuard<'_, Storage>> {
        if self.memory_format() != MemoryFormat::Contiguous {
            return Err(Error::invalid(
                op,
                format!(
                    "an in-place write into a {:?} tensor of shape {:?}: convert it with to_memory_format(Contiguous) first",
                    self.memory_format(),
                    self.dims()
                ),
            ));
        }
        Ok(self.write_storage())
    }
    pub(crate) fn write_storage(&self) -> RwLockWriteGuard<'_, Storage> {
        crate::write_journal::before_write(&self.0.storage);
        self.0.storage.write().unwrap_or_else(|e| e.into_inner())
    }
    /// Address of the shared storage: equal for tensors that share memory, and unchanged by
    /// in-place updates (the recorder relies on this).
    pub fn storage_ptr(&self) -> usize {
        Arc::as_ptr(&self.0.storage) as *const () as usize
    }
    /// Device address of this tensor's buffer (`None` on the CPU), for fused multi-input kernels.
    pub(crate) fn device_address(&self) -> Option<u64> {
        self.with_storage(|s| s.device_address())
    }
    /// Runs `f` on the storage as it lies (read lock held for the call): in the tensor's
    /// [`MemoryFormat`], so a channels-last tensor's elements in (N, H, W, C) order.
    pub fn with_storage<R>(&self, f: impl FnOnce(&Storage) -> R) -> R {
        f(&self.raw_storage())
    }
    /// Runs `f` on the storage with write access; the storage identity is preserved.
    pub fn with_storage_mut<R>(&self, f: impl FnOnce(&mut Storage) -> R) -> R {
        f(&mut self.write_storage())
    }
    /// The contiguous strided view of the logical shape: how the data ops read lies (for a
    /// channels-last tensor, not its raw storage).
    pub fn layout(&self) -> Layout {
        Layout::contiguous(self.dims())
    }

    // ---- host reads (explicit synchronisation points) -----------------------------------------

    /// Copies the data to the host as `T` (must be the tensor's dtype).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        crate::pending::count_immediate_read();
        let host = self.read_storage()?.to_cpu()?;
        T::from_storage(&host).ok_or(Error::DTypeMismatch { op: "to_vec", lhs: self.dtype(), rhs: T::DTYPE })
    }
    /// All values as f64, whatever the dtype (a host copy).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        crate::pending::count_immediate_read();
        Ok(self.read_storage()?.to_cpu()?.to_f64_vec())
    }
    /// The value of a one-element tensor as f64 (a host copy).
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::invalid("item", format!("tensor of shape {:?} has {} elements, expected 1", self.dims(), self.numel())));
        }
        Ok(self.to_f64_vec()?[0])
    }
    /// Raw little-endian bytes of the data (host copy).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        crate::pending::count_immediate_read();
        Ok(self.read_storage()?.to_cpu()?.as_bytes().to_vec())
    }

    // ---- autograd-facing handles ---------------------------------------------------------------

    /// A new handle on the same storage with no history and no gradient requirement.
    pub fn detach(&self) -> Tensor {
        Tensor::build_in(self.0.storage.clone(), self.shape().clone(), self.memory_format(), false, None)
    }

    /// A leaf handle on the same storage that records gradients (like `requires_grad_()`).
    pub fn requires_grad_(&self, on: bool) -> Result<Tensor> {
        if on && !self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: "requires_grad_", dtype: self.dtype(), expected: "a float dtype" });
        }
        Ok(Tensor::build_in(self.0.storage.clone(), self.shape().clone(), self.memory_format(), on, None))
    }

    /// The accumulated gradient: `None` when no gradient reached this leaf.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// Replaces the gradient (`None` clears it, as `zero_grad(set_to_none=True)` does); a buffer
    /// kept by [`Tensor::zero_grad`] is dropped.
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = g;
        *self.0.kept_grad.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
    /// Makes the gradient absent (`None`). With [`Tensor::set_keep_grad_buffer`] on, its buffer is
    /// kept and the next gradient is written into it (same address, step after step — what a
    /// recorded graph reading gradients needs); otherwise it is dropped.
    pub fn zero_grad(&self) {
        let g = self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).take();
        if self.0.keep_grad.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(g) = g {
                *self.0.kept_grad.lock().unwrap_or_else(|e| e.into_inner()) = Some(g);
            }
        }
    }
    /// Takes the gradient and any kept buffer out of this leaf (leaving it with neither) — for code
    /// whose gradients must not land in them, such as a recorder's warmup — to be put back with
    /// [`Tensor::restore_grad_state`].
    pub fn take_grad_state(&self) -> GradState {
        let g = self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).take();
        let k = self.0.kept_grad.lock().unwrap_or_else(|e| e.into_inner()).take();
        GradState { grad: g, kept: k }
    }
    /// Puts back what [`Tensor::take_grad_state`] took (whatever the leaf holds now is dropped).
    pub fn restore_grad_state(&self, s: GradState) {
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = s.grad;
        *self.0.kept_grad.lock().unwrap_or_else(|e| e.into_inner()) = s.kept;
    }
    /// Where this leaf's next gradient lands when it keeps its gradient buffer
    /// ([`Tensor::set_keep_grad_buffer`]): the present gradient, accumulated into (`true`), or the
    /// kept buffer, written (`false`). `None` without persistent gradients or before the first
    /// gradient. A recorder writes a replayed backward's gradients there inside its graph.
    pub fn grad_target(&self) -> Option<(Tensor, bool)> {
        if !self.0.keep_grad.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        if let Some(g) = self.grad() {
            return Some((g, true));
        }
        self.0.kept_grad.lock().unwrap_or_else(|e| e.into_inner()).clone().map(|k| (k, false))
    }
    /// Makes the kept buffer the gradient as it is (a recorded graph wrote it): `grad()` is then
    /// present. Returns whether it did (`false`: a gradient was present, or no buffer was kept).
    pub fn adopt_kept_grad(&self) -> bool {
        let mut slot = self.0.grad.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return false;
        }
        match self.0.kept_grad.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(k) => {
                *slot = Some(k);
                true
            }
            None => false,
        }
    }
    /// Adds `g` into this leaf's gradient as the backward engine does — into the existing gradient,
    /// else into a kept buffer ([`Tensor::set_keep_grad_buffer`]), else as a private copy — but
    /// never takes `g`'s storage (the caller keeps using it: a recorder's static buffer).
    pub fn add_to_grad(&self, g: &Tensor) -> Result<()> {
        self.accumulate_grad_into(g, false)
    }
    /// Whether [`Tensor::zero_grad`] keeps this leaf's gradient buffer (persistent gradients):
    /// "absent" keeps its meaning — `grad()` is `None` until a gradient arrives — but the buffer
    /// is allocated once. Off by default (a kept buffer holds memory between steps). Turning it
    /// off drops a kept buffer.
    pub fn set_keep_grad_buffer(&self, on: bool) {
        self.0.keep_grad.store(on, std::sync::atomic::Ordering::Relaxed);
        if !on {
            *self.0.kept_grad.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// Adds `g` into this leaf's gradient. The first gradient goes into the kept buffer when there
    /// is one (a copy), else is stored privately (copied if its storage is shared); later ones are
    /// added in place so the gradient buffer keeps its address.
    pub(crate) fn accumulate_grad(&self, g: &Tensor) -> Result<()> {
        self.accumulate_grad_into(g, true)
    }

    /// [`Tensor::accumulate_grad`]; `may_take`: a first gradient held by nobody else becomes the
    /// gradient without a copy (the engine's temporaries).
    fn accumulate_grad_into(&self, g: &Tensor, may_take: bool) -> Result<()> {
        let mut slot = self.0.grad.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            Some(existing) => {
                let src = g.read_storage()?;
                existing.write_storage_for("accumulate_grad")?.add_assign(&src)?;
            }
            None => {
                let kept = self.0.kept_grad.lock().unwrap_or_else(|e| e.into_inner()).take();
                let fits = |k: &Tensor| {
                    k.dims() == g.dims() && k.dtype() == g.dtype() && k.device() == g.device() && k.storage_ptr() != g.storage_ptr()
                };
                let own = match kept {
                    Some(k) if fits(&k) => {
                        k.copy_(&g.detach())?;
                        k
                    }
                    // A gradient is kept in the contiguous order (later ones are added in place).
                    _ if may_take
                        && Arc::strong_count(&g.0.storage) == 1
                        && Arc::strong_count(&g.0) == 1
                        && g.memory_format() == MemoryFormat::Contiguous =>
                    {
                        g.detach()
                    }
                    _ => g.deep_copy()?,
                };
                *slot = Some(own);
            }
        }
        Ok(())
    }

    /// A contiguous copy with its own storage and no history.
    pub fn deep_copy(&self) -> Result<Tensor> {
        let s = match self.read_storage()? {
            StorageRead::Shared(g) => g.try_clone()?,
            StorageRead::Converted(s) => s,
        };
        Tensor::from_storage(s, self.shape().clone())
    }

    // ---- in-place updates (keep storage identity) -----------------------------------------------

    /// Overwrites this tensor's data with `src` (same shape, dtype and device). The storage
    /// address is unchanged, so parameters keep stable addresses across optimizer steps.
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        if src.dims() != self.dims() {
            return Err(Error::ShapeMismatch { op: "copy_", lhs: self.dims().to_vec(), rhs: src.dims().to_vec() });
        }
        if src.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: "copy_", lhs: self.dtype(), rhs: src.dtype() });
        }
        if src.storage_ptr() == self.storage_ptr() {
            return Ok(());
        }
        let l = self.layout();
        let s = src.read_storage()?;
        let mut d = self.write_storage_for("copy_")?;
        s.copy_strided(&l, &mut d, &l)
    }

    /// `self += src` in place.
    pub fn add_(&self, src: &Tensor) -> Result<()> {
        if src.dims() != self.dims() {
            return Err(Error::ShapeMismatch { op: "add_", lhs: self.dims().to_vec(), rhs: src.dims().to_vec() });
        }
        if src.storage_ptr() == self.storage_ptr() {
            let doubled = src.deep_copy()?;
            return self.add_(&doubled);
        }
        let s = src.read_storage()?;
        self.write_storage_for("add_")?.add_assign(&s)
    }

    /// `dst.copy_(src)` for every pair (same shape and dtype), batched: on CUDA one launch per 40
    /// contiguous pairs. A pair that is not plain contiguous storage, or whose source is another
    /// pair's destination, is copied on its own.
    pub fn copy_many_(pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
        let mut batch: Vec<(&Tensor, &Tensor)> = Vec::with_capacity(pairs.len());
        let mut alone: Vec<(&Tensor, &Tensor)> = Vec::new();
        let mut used: std::collections::HashSet<usize> = std::collections::HashSet::new();
        for &(d, s) in pairs {
            if s.dims() != d.dims() {
                return Err(Error::ShapeMismatch { op: "copy_many_", lhs: d.dims().to_vec(), rhs: s.dims().to_vec() });
            }
            if s.dtype() != d.dtype() {
                return Err(Error::DTypeMismatch { op: "copy_many_", lhs: d.dtype(), rhs: s.dtype() });
            }
            let plain = d.memory_format() == MemoryFormat::Contiguous
                && s.memory_format() == MemoryFormat::Contiguous
                && d.numel() == d.raw_storage().len()
                && s.numel() == s.raw_storage().len();
            if plain && used.insert(d.storage_ptr()) && used.insert(s.storage_ptr()) {
                batch.push((d, s));
            } else {
                alone.push((d, s));
            }
        }
        {
            let mut dsts: Vec<_> = batch.iter().map(|(d, _)| d.write_storage_for("copy_many_")).collect::<Result<_>>()?;
            let srcs: Vec<_> = batch.iter().map(|(_, s)| s.raw_storage()).collect();
            let mut refs: Vec<(&mut Storage, &Storage)> = dsts.iter_mut().map(|d| &mut **d).zip(srcs.iter().map(|s| &**s)).collect();
            Storage::copy_many(&mut refs)?;
        }
        for (d, s) in alone {
            d.copy_(s)?;
        }
        Ok(())
    }

    /// `dst.add_(src)` for every pair, the same bytes, batched: on CUDA one launch per dtype and 40
    /// tensors (gradient accumulation into many parameters). A pair whose source shares storage
    /// with another operand of the batch, or that is not a plain same-shape pair, runs on its own.
    pub fn add_many_(pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
        let mut batch: Vec<(&Tensor, &Tensor)> = Vec::with_capacity(pairs.len());
        let mut alone: Vec<(&Tensor, &Tensor)> = Vec::new();
        let mut used: std::collections::HashSet<usize> = std::collections::HashSet::new();
        for &(d, s) in pairs {
            let plain = d.dims() == s.dims()
                && d.dtype() == s.dtype()
                && d.memory_format() == MemoryFormat::Contiguous
                && s.memory_format() == MemoryFormat::Contiguous
                && d.numel() == d.raw_storage().len()
                && s.numel() == s.raw_storage().len();
            if plain && used.insert(d.storage_ptr()) && used.insert(s.storage_ptr()) {
                batch.push((d, s));
            } else {
                alone.push((d, s));
            }
        }
        {
            let mut dsts: Vec<_> = batch.iter().map(|(d, _)| d.write_storage()).collect();
            let srcs: Vec<_> = batch.iter().map(|(_, s)| s.raw_storage()).collect();
            let mut refs: Vec<(&mut Storage, &Storage)> = dsts.iter_mut().map(|d| &mut **d).zip(srcs.iter().map(|s| &**s)).collect();
            Storage::add_assign_many(&mut refs)?;
        }
        for (d, s) in alone {
            d.add_(s)?;
        }
        Ok(())
    }

    /// Moves (copies) the tensor to `device`; gradients flow back to the source device.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        crate::ops::cast::to_device(self, device)
    }
}

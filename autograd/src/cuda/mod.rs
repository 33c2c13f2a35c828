//! The CUDA backend (feature `cuda`).
//!
//! - **Device and stream**: each GPU gets one context and one compute stream, opened on first use
//!   ([`Device::Cuda`]); all work is queued on that stream, in program order. cudarc's event
//!   tracking is off (it breaks stream capture).
//! - **Kernels**: one source per op family (`ops/<family>.cu` next to the launcher `ops/<family>.rs`,
//!   behind a shared `ops/prelude.cuh`), each compiled with NVRTC to machine code (CUBIN) for the
//!   device's `sm_XY` (headers from `$CUDA_HOME/include`, default `/usr/local/cuda/include`), in
//!   parallel, and kept as its own entry of an on-disk cache across processes
//!   ([`kernel_cache_dir`], [`module_reports`]). Reductions and
//!   scatter/index adds use fixed-order loops and trees, never float atomics, so results are
//!   bit-identical run to run. f16/bf16 are computed in f32.
//! - **Libraries**: matmul through cuBLASLt with plans cached per shape (true FP32, f16/bf16 with
//!   f32 accumulation; classic cuBLAS as the fallback); convolutions (forward, backward-data,
//!   backward-filter) through cuDNN's graph API with execution plans and variant packs cached per
//!   shape, restricted to deterministic engines (heuristic order, the same in every process; no
//!   TF32 for f32) and with the legacy API as the fallback; 1×1 convolutions as GEMMs. Each plan
//!   owns its workspace, so captured steps never allocate inside a library.
//! - **Fused kernels**: BatchNorm+SiLU forward (`Tensor::batch_norm2d_silu`: deterministic batch
//!   statistics and running-stat update in one launch, affine+SiLU in a second), (log-)softmax in
//!   one kernel (a warp per row for rows ≤ 1024), BCE-with-logits in one element-wise pass,
//!   concatenation of up to 8 inputs in one launch.
//! - **Memory**: stream-ordered allocation from the device pool (release threshold `u64::MAX`)
//!   behind a host-side block cache (freed blocks reused by size without a driver call), or from a
//!   private [`MemPool`] while it is entered; [`memory_stats`] / [`reset_peak_memory_stats`] /
//!   [`library_workspace_bytes`].
//! - **Host transfers** happen only in `Tensor::to_vec` / `item` / `to_f64_vec` / `to_bytes` /
//!   `to_device(Cpu)` (synchronising reads) and uploads (`from_vec`, `to_device(Cuda)`,
//!   [`PinnedBuffer::upload`]). Every other op is asynchronous.
//! - **Startup checks**: driver, NVRTC, cuBLAS and cuDNN are probed before use; a missing piece
//!   gives [`crate::Error::CudaUnavailable`] naming it.
//! - Indices are not bounds-checked on the device (that would need a host read): an out-of-range
//!   index reads as zero and adds nothing. Integer division by zero gives 0.

mod alloc;
mod blas;
pub mod capture_support;
mod conv;
mod conv_choice;
mod conv_graph;
mod counters;
mod device;
mod graph;
#[doc(hidden)]
pub mod host_probe;
mod kernel_timer;
mod kernel_units;
mod module_cache;
pub(crate) mod ops;
mod pending_copy;
mod user_kernel;

use std::sync::Arc;

use cudarc::driver::{result as dr, sys};

pub use alloc::{
    empty_cache, library_workspace_bytes, memory_stats, private_pool_allocated_bytes, reset_peak_memory_stats, set_block_cache_limits,
    set_poison_allocations, synchronize, MemPool, MemPoolGuard, MemoryStats,
};
pub use blas::gemm_paths;
pub use capture_support::{CaptureArena, CaptureScopeGuard, CaptureViolation};
pub use conv::conv_paths;
pub use conv_choice::cudnn_cache_dir;
pub use counters::{counters, library_setup, CudaCounters, LibrarySetup};
pub use device::CudaSetupError;
pub use device::DeviceOptions;
pub use graph::{begin_capture, end_capture, gpu_spin, graph_mem_reserved, time_on_stream, CudaGraph, StreamMark};
pub(crate) use kernel_timer::stage_changed;
pub use kernel_timer::{GpuKernelTimer, GpuKernelTotals, KernelDetail};
pub use module_cache::{kernel_cache_dir, module_reports, probe_module_cache, ModuleReport, ModuleSource};
pub(crate) use ops::{philox_keep_mask, rng_state_set};

/// The kernel choices of `device` ([`DeviceOptions`]).
pub fn device_options(device: Device) -> Result<DeviceOptions> {
    Ok(dev_of(device)?.options())
}

/// Sets the kernel choices of `device` (per device: another device, or another test on another
/// device, keeps its own).
pub fn set_device_options(device: Device, options: DeviceOptions) -> Result<()> {
    *dev_of(device)?.options.lock().unwrap_or_else(|e| e.into_inner()) = options;
    Ok(())
}
pub use pending_copy::PendingCopy;
pub use user_kernel::{KernelArg, UserKernel};

use alloc::DevBuf;
use device::{cu_err, Dev};

use crate::backend::{BackendStorage, BinaryOp, CmpOp, Conv2dParams, MatmulParams, Pool2dParams, ReduceOp, UnaryOp};
use crate::cpu::CpuStorage;
use crate::shape::Layout;
use crate::{DType, Device, Error, Result, Tensor};

/// A device buffer with its element type. Contiguous; `len` elements.
pub struct CudaStorage {
    pub(crate) buf: DevBuf,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({}, {} x {})", self.device(), self.len, self.dtype)
    }
}

/// Whether `cuda:ordinal` can be opened (driver, libraries, device and kernels all fine).
pub fn is_available(ordinal: usize) -> bool {
    Dev::get(ordinal).is_ok()
}

/// Why `cuda:ordinal` cannot be used, or `Ok(())` when it can.
pub fn check(ordinal: usize) -> std::result::Result<(), CudaSetupError> {
    Dev::get(ordinal).map(|_| ())
}

/// `cuda:ordinal` for a CUDA test: `Ok(None)` (the reason printed as `skipping: …`) on a machine
/// without a driver or GPU, so the test passes as skipped there; a GPU that is present but
/// unusable is an error, never a skip.
pub fn device_for_tests(ordinal: usize) -> std::result::Result<Option<Device>, CudaSetupError> {
    match check(ordinal) {
        Ok(()) => Ok(Some(Device::Cuda(ordinal))),
        Err(e @ (CudaSetupError::NoDriver | CudaSetupError::NoDevice { .. })) => {
            println!("skipping: {e}");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Number of visible GPUs (0 when the driver or a library is missing).
pub fn device_count() -> usize {
    device::probe().unwrap_or(0)
}

/// Name of the GPU behind `cuda:ordinal`.
pub fn device_name(ordinal: usize) -> Result<String> {
    let d = Dev::get(ordinal).map_err(Error::CudaUnavailable)?;
    d.ctx.name().map_err(|e| cu_err("cuDeviceGetName", e))
}

pub(crate) fn dev_of(device: Device) -> Result<Arc<Dev>> {
    match device {
        Device::Cuda(n) => Dev::get(n).map_err(Error::CudaUnavailable),
        Device::Cpu => Err(Error::invalid("cuda", "expected a CUDA device")),
    }
}

/// The raw `CUstream` of the device's compute stream (for graph capture by the recorder).
pub fn raw_stream(device: Device) -> Result<sys::CUstream> {
    Ok(dev_of(device)?.cu_stream)
}

/// Makes the device's context current on this thread (needed before raw driver calls).
pub fn bind_context(device: Device) -> Result<()> {
    dev_of(device)?.bind()
}

impl CudaStorage {
    pub(crate) fn alloc(dev: &Arc<Dev>, dtype: DType, len: usize) -> Result<CudaStorage> {
        Ok(CudaStorage { buf: DevBuf::alloc(dev, len * dtype.size_in_bytes())?, dtype, len })
    }

    /// An unfilled buffer (poisoned when [`set_poison_allocations`] is on).
    pub(crate) fn uninit(device: Device, dtype: DType, len: usize) -> Result<CudaStorage> {
        CudaStorage::alloc(&dev_of(device)?, dtype, len)
    }

    /// A constant-filled buffer (`cuMemsetD8Async` for zero, a fill kernel otherwise).
    pub(crate) fn full(device: Device, dtype: DType, len: usize, value: f64) -> Result<CudaStorage> {
        let dev = dev_of(device)?;
        let s = CudaStorage::alloc(&dev, dtype, len)?;
        ops::fill(&s, value)?;
        Ok(s)
    }

    pub(crate) fn same_device(&self, op: &'static str, other: &CudaStorage) -> Result<()> {
        if self.buf.dev.ordinal != other.buf.dev.ordinal {
            return Err(Error::DeviceMismatch { op, lhs: self.device(), rhs: other.device() });
        }
        Ok(())
    }

    /// Uploads a host buffer (an explicit host→device copy, queued on the compute stream).
    pub(crate) fn from_cpu(s: &CpuStorage, device: Device) -> Result<CudaStorage> {
        capture_support::check_host_upload("from_cpu")?;
        let dev = dev_of(device)?;
        let out = CudaStorage::alloc(&dev, s.dtype(), s.len())?;
        let bytes = s.as_bytes();
        if !bytes.is_empty() {
            // Pageable source: the driver stages it before returning, so `s` may be dropped after.
            counters::count(counters::Count::HostToDevice);
            unsafe { dr::memcpy_htod_async(out.buf.ptr, bytes, dev.cu_stream) }.map_err(|e| cu_err("cuMemcpyHtoDAsync", e))?;
        }
        Ok(out)
    }

    /// Writes host bytes into this storage at byte offset `at`, in place (an explicit host→device
    /// copy on the compute stream; the driver stages the pageable source before returning).
    pub(crate) fn write_from_host(&self, at: usize, bytes: &[u8]) -> Result<()> {
        capture_support::check_host_upload("write_from_host")?;
        if at + bytes.len() > self.len * self.dtype.size_in_bytes() {
            return Err(Error::invalid("write_from_host", format!("{} bytes at {at} exceed the storage", bytes.len())));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let dev = &self.buf.dev;
        dev.bind()?;
        counters::count(counters::Count::HostToDevice);
        unsafe { dr::memcpy_htod_async(self.buf.ptr + at as u64, bytes, dev.cu_stream) }.map_err(|e| cu_err("cuMemcpyHtoDAsync", e))
    }

    /// Downloads to the host: waits for the stream, then copies (a synchronisation point).
    pub(crate) fn to_cpu(&self) -> Result<CpuStorage> {
        capture_support::check_host_sync("to_cpu")?;
        let dev = &self.buf.dev;
        dev.bind()?;
        let mut bytes = vec![0u8; self.len * self.dtype.size_in_bytes()];
        if !bytes.is_empty() {
            counters::count(counters::Count::DeviceToHost);
            unsafe { dr::memcpy_dtoh_async(&mut bytes, self.buf.ptr, dev.cu_stream) }.map_err(|e| cu_err("cuMemcpyDtoHAsync", e))?;
        }
        dev.synchronize()?;
        CpuStorage::from_bytes(self.dtype, &bytes)
    }

    /// A device-side deep copy.
    pub(crate) fn try_clone(&self) -> Result<CudaStorage> {
        let dev = &self.buf.dev;
        let out = CudaStorage::alloc(dev, self.dtype, self.len)?;
        let n = self.len * self.dtype.size_in_bytes();
        if n > 0 {
            counters::count(counters::Count::DeviceToDevice);
            unsafe { dr::memcpy_dtod_async(out.buf.ptr, self.buf.ptr, n, dev.cu_stream) }.map_err(|e| cu_err("cuMemcpyDtoDAsync", e))?;
        }
        Ok(out)
    }

    /// Device address of the first element (for graph recorders and interop).
    pub fn device_ptr(&self) -> u64 {
        self.buf.ptr
    }
}

impl BackendStorage for CudaStorage {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn device(&self) -> Device {
        Device::Cuda(self.buf.dev.ordinal)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn unary(&self, op: UnaryOp) -> Result<Self> {
        ops::unary(self, op)
    }
    fn binary(&self, l: &Layout, rhs: &Self, r: &Layout, op: BinaryOp) -> Result<Self> {
        ops::binary(self, l, rhs, r, op)
    }
    fn cmp(&self, l: &Layout, rhs: &Self, r: &Layout, op: CmpOp) -> Result<Self> {
        ops::cmp(self, l, rhs, r, op)
    }
    fn where_cond(&self, cl: &Layout, a: &Self, al: &Layout, b: &Self, bl: &Layout) -> Result<Self> {
        ops::where_cond(self, cl, a, al, b, bl)
    }
    fn reduce(&self, shape: &[usize], dim: usize, op: ReduceOp) -> Result<Self> {
        ops::reduce(self, shape, dim, op)
    }
    fn to_dtype(&self, dtype: DType) -> Result<Self> {
        ops::to_dtype(self, dtype)
    }
    fn copy_strided(&self, src_l: &Layout, dst: &mut Self, dst_l: &Layout) -> Result<()> {
        ops::copy_strided(self, src_l, dst, dst_l)
    }
    fn add_assign(&mut self, src: &Self) -> Result<()> {
        ops::add_assign(self, src)
    }
    fn index_select(&self, shape: &[usize], dim: usize, idx: &Self) -> Result<Self> {
        ops::index_select(self, shape, dim, idx)
    }
    fn index_add(&self, shape: &[usize], dim: usize, idx: &Self, src: &Self) -> Result<Self> {
        ops::index_add(self, shape, dim, idx, src)
    }
    fn gather(&self, shape: &[usize], dim: usize, idx: &Self, idx_shape: &[usize]) -> Result<Self> {
        ops::gather(self, shape, dim, idx, idx_shape)
    }
    fn scatter_add(&self, shape: &[usize], dim: usize, idx: &Self, idx_shape: &[usize], src: &Self) -> Result<Self> {
        ops::scatter_add(self, shape, dim, idx, idx_shape, src)
    }
    fn matmul(&self, rhs: &Self, p: &MatmulParams) -> Result<Self> {
        self.same_device("matmul", rhs)?;
        blas::matmul(self, rhs, p)
    }
    fn matmul_add(&self, rhs: &Self, c: &Self, p: &MatmulParams, alpha: f64, beta: f64) -> Result<Self> {
        blas::matmul_add(self, rhs, c, p, alpha, beta)
    }
    fn conv2d(&self, weight: &Self, p: &Conv2dParams) -> Result<Self> {
        self.same_device("conv2d", weight)?;
        conv::conv2d(self, weight, p)
    }
    fn conv2d_backward_input(&self, weight: &Self, p: &Conv2dParams) -> Result<Self> {
        self.same_device("conv2d_backward_input", weight)?;
        conv::conv2d_backward_input(self, weight, p)
    }
    fn conv2d_backward_weight(&self, input: &Self, p: &Conv2dParams) -> Result<Self> {
        self.same_device("conv2d_backward_weight", input)?;
        conv::conv2d_backward_weight(self, input, p)
    }
    fn max_pool2d(&self, p: &Pool2dParams) -> Result<(Self, Self)> {
        ops::max_pool2d(self, p)
    }
    fn max_pool2d_backward(&self, indices: &Self, p: &Pool2dParams) -> Result<Self> {
        ops::max_pool2d_backward(self, indices, p)
    }
    fn upsample_nearest2d(&self, shape: [usize; 4], factor: usize) -> Result<Self> {
        ops::upsample_nearest2d(self, shape, factor, false)
    }
    fn upsample_nearest2d_backward(&self, shape: [usize; 4], factor: usize) -> Result<Self> {
        ops::upsample_nearest2d(self, shape, factor, true)
    }
    fn topk(&self, shape: &[usize], dim: usize, k: usize, largest: bool) -> Result<(Self, Self)> {
        ops::topk(self, shape, dim, k, largest)
    }
    fn nonzero_static(&self, size: usize, fill: i64) -> Result<Self> {
        ops::nonzero_static(self, size, fill)
    }
    fn batch_norm_train_stats(
        &self,
        shape: &[usize],
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        batches: Option<&mut Self>,
        eps: f64,
        momentum: f64,
    ) -> Result<(Self, Self)> {
        ops::batch_norm_train_stats(self, shape, weight, bias, running_mean, running_var, batches, eps, momentum)
    }
    fn batch_norm_train_apply(
        &self,
        shape: &[usize],
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        batches: Option<&mut Self>,
        eps: f64,
        momentum: f64,
        silu: bool,
    ) -> Result<(Self, Self, Self)> {
        ops::batch_norm_train_apply(self, shape, weight, bias, running_mean, running_var, batches, eps, momentum, silu)
    }
    fn channel_affine(&self, shape: &[usize], params: &Self, silu: bool) -> Result<Self> {
        ops::channel_affine(self, shape, params, silu)
    }
    fn batch_norm_act_backward(
        &self,
        g: &Self,
        shape: &[usize],
        aff: &Self,
        nrm: &Self,
        w: &Self,
        silu: bool,
        training: bool,
    ) -> Result<(Self, Self, Self)> {
        ops::batch_norm_act_backward(self, g, shape, aff, nrm, w, silu, training)
    }
    fn softmax(&self, shape: &[usize], dim: usize, log: bool) -> Result<Self> {
        ops::softmax(self, shape, dim, log)
    }
    fn batch_norm_eval_params(&self, bias: &Self, running_mean: &Self, running_var: &Self, eps: f64) -> Result<(Self, Self)> {
        ops::batch_norm_eval_params(self, bias, running_mean, running_var, eps)
    }
}

/// Whether the stream has passed `event` (a non-blocking query; the device must be bound).
pub(crate) fn event_reached(event: sys::CUevent) -> Result<bool> {
    match unsafe { dr::event::query(event) } {
        Ok(()) => Ok(true),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        Err(e) => Err(cu_err("cuEventQuery", e)),
    }
}

/// Page-locked host memory for fast, asynchronous uploads of u8 image batches.
///
/// Fill it through [`PinnedBuffer::host_mut`] (no CUDA call: loader worker threads may fill a
/// buffer while the training thread records a CUDA graph) or [`PinnedBuffer::as_mut_slice`]
/// (waits for the last upload), then call [`PinnedBuffer::upload`] or
/// [`PinnedBuffer::upload_prefix`]: the copy is queued on the device's compute stream and the
/// call returns at once. Until [`PinnedBuffer::poll_idle`] has seen that copy finish, the buffer
/// counts as in flight and `host_mut` refuses it, so host writes never race the DMA.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    dev: Arc<Dev>,
    event: sys::CUevent,
    in_flight: bool,
}

unsafe impl Send for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuffer({} bytes, {:?}, in flight: {})", self.len, self.dev, self.in_flight)
    }
}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned host memory usable with `device`.
    pub fn new(device: Device, len: usize) -> Result<PinnedBuffer> {
        let dev = dev_of(device)?;
        dev.bind()?;
        let ptr = unsafe { dr::malloc_host(len.max(1), 0) }.map_err(|e| cu_err("cuMemHostAlloc", e))? as *mut u8;
        let event = dr::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| cu_err("cuEventCreate", e))?;
        Ok(PinnedBuffer { ptr, len, dev, event, in_flight: false })
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the buffer uploads to.
    pub fn device(&self) -> Device {
        Device::Cuda(self.dev.ordinal)
    }

    /// Host access; blocks until the last upload from this buffer has been read by the GPU.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        if self.in_flight {
            capture_support::check_host_sync("PinnedBuffer::as_mut_slice")?;
            self.dev.bind()?;
            counters::count(counters::Count::HostSync);
            unsafe { dr::event::synchronize(self.event) }.map_err(|e| cu_err("cuEventSynchronize", e))?;
            self.in_flight = false;
        }
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Host access without any CUDA call: `None` while an upload from the buffer may still be
    /// reading it (until [`PinnedBuffer::poll_idle`] has returned true).
    pub fn host_mut(&mut self) -> Option<&mut [u8]> {
        (!self.in_flight).then(|| unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Whether the last upload has finished (a non-blocking event query); afterwards
    /// [`PinnedBuffer::host_mut`] hands the memory out again.
    pub fn poll_idle(&mut self) -> Result<bool> {
        if !self.in_flight {
            return Ok(true);
        }
        capture_support::check_host_sync("PinnedBuffer::poll_idle")?;
        self.dev.bind()?;
        self.in_flight = !event_reached(self.event)?;
        Ok(!self.in_flight)
    }

    /// Queues a host→device copy of the whole buffer into a new U8 tensor of `shape` (asynchronous).
    pub fn upload(&mut self, shape: impl Into<crate::Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.len {
            return Err(Error::invalid(
                "PinnedBuffer::upload",
                format!("shape {shape:?} has {} elements, buffer holds {}", shape.numel(), self.len),
            ));
        }
        self.upload_prefix(shape)
    }

    /// Queues a host→device copy of the first `shape.numel()` bytes into a new U8 tensor of
    /// `shape` (asynchronous; a buffer sized for a full batch also carries a partial one).
    pub fn upload_prefix(&mut self, shape: impl Into<crate::Shape>) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.numel();
        if n > self.len {
            return Err(Error::invalid(
                "PinnedBuffer::upload_prefix",
                format!("shape {shape:?} has {n} elements, buffer holds only {}", self.len),
            ));
        }
        capture_support::check_host_upload("PinnedBuffer::upload")?;
        self.dev.bind()?;
        let out = CudaStorage::alloc(&self.dev, DType::U8, n)?;
        if n > 0 {
            counters::count(counters::Count::HostToDevice);
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(out.buf.ptr, self.ptr as *const std::ffi::c_void, n, self.dev.cu_stream)
                    .result()
                    .map_err(|e| cu_err("cuMemcpyHtoDAsync (pinned)", e))?;
                dr::event::record(self.event, self.dev.cu_stream).map_err(|e| cu_err("cuEventRecord", e))?;
            }
            self.in_flight = true;
        }
        Tensor::from_storage(crate::storage::Storage::Cuda(out), shape)
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            unsafe {
                let _ = dr::event::synchronize(self.event);
                let _ = dr::event::destroy(self.event);
                let _ = dr::free_host(self.ptr as *mut std::ffi::c_void);
            }
        }
    }
}

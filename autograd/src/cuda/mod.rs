//! The CUDA backend (feature `cuda`).
//!
//! - **Device and streams**: each GPU gets one context and a compute stream, opened on first use
//!   ([`Device::Cuda`]); work is queued on that stream, in program order, except side tasks —
//!   weight gradients and work a model sends [`crate::streams::beside`] the chain — on a second,
//!   lower-priority stream with fork and join events (`side_stream`, docs/concurrent-backward.md;
//!   [`DeviceOptions::concurrent_weight_gradients`]). cudarc's event tracking is off (it breaks
//!   stream capture).
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
//!   TF32 for f32 unless [`DeviceOptions::tf32_convolutions`]) and with the legacy API as the
//!   fallback; 1×1 convolutions as GEMMs. Each plan
//!   owns its workspace, so captured steps never allocate inside a library.
//! - **Fused kernels**: BatchNorm+SiLU forward (`Tensor::batch_norm2d_silu`: deterministic batch
//!   statistics and running-stat update in one launch, affine+SiLU in a second), (log-)softmax in
//!   one kernel (a warp per row for rows ≤ 1024), BCE-with-logits in one element-wise pass,
//!   concatenation of up to 8 inputs in one launch.
//! - **Memory**: stream-ordered allocation from the device pool (release threshold `u64::MAX`)
//!   behind a host-side block cache (freed blocks reused by size without a driver call), or from a
//!   private [`crate::internal::cuda::MemPool`] while it is entered; [`memory_stats`] / [`reset_peak_memory_stats`] /
//!   [`library_workspace_bytes`].
//! - **Host transfers** happen only in `Tensor::to_vec` / `item` / `to_f64_vec` / `to_bytes` /
//!   `to_device(Cpu)` (synchronising reads) and uploads (`from_vec`, `to_device(Cuda)`,
//!   [`crate::internal::cuda::PinnedBuffer::upload`]). Every other op is asynchronous.
//! - **Startup checks**: driver, NVRTC, cuBLAS and cuDNN are probed before use; a missing piece
//!   gives [`crate::Error::CudaUnavailable`] naming it.
//! - Indices are not bounds-checked on the device (that would need a host read): an out-of-range
//!   index reads as zero and adds nothing. Integer division by zero gives 0.

mod aliased_range;
pub(crate) mod alloc;
pub(crate) mod blas;
mod block_cache;
mod capture_scope;
pub(crate) mod capture_support;
mod comm_stream;
pub(crate) mod conv;
mod conv_choice;
mod conv_graph;
mod conv_workspace;
pub(crate) mod counters;
mod device;
pub(crate) mod graph;
pub(crate) mod host_probe;
pub(crate) mod kernel_timer;
mod kernel_units;
mod library_memory;
mod mapped_range;
pub(crate) mod module_cache;
pub(crate) mod module_probe;
mod nccl;
pub(crate) mod ops;
pub(crate) mod pending_copy;
pub(crate) mod pinned;
pub(crate) mod side_stream;
mod side_tasks;
mod storage;
pub(crate) mod user_kernel;

pub use alloc::{
    device_memory, empty_cache, memory_stats, reset_peak_memory_stats, set_block_cache_limits, synchronize, MemoryStats, PeakContext,
};
pub use conv_choice::cudnn_cache_dir;
pub use conv_workspace::cudnn_workspaces_from_arenas;
pub use device::CudaSetupError;
pub use device::DeviceOptions;
pub(crate) use kernel_timer::{restore_label, set_label, stage_changed};
pub use library_memory::library_workspace_bytes;
pub use module_cache::{kernel_cache_dir, module_reports, ModuleReport, ModuleSource};
pub use nccl::{nccl_candidates, nccl_version, NcclComm, NcclId, NCCL_LIBRARY_ENV};
pub use side_stream::{side_stream_stats, SideStreamStats};

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

/// Whether `device` launches thread-block clusters (compute capability 9.0 and later), which the
/// batch norm uses for layers of 2–8 blocks per channel; false for a device that does not open.
pub fn has_clusters(device: Device) -> bool {
    dev_of(device).is_ok_and(|d| d.clusters)
}

/// Whether `device` launches ptl's kernels with programmatic dependent launch (compute capability
/// 9.0 and later, `PTL_PDL`; the same bytes either way); false for a device that does not open.
pub fn dependent_launch(device: Device) -> bool {
    dev_of(device).is_ok_and(|d| d.dependent_launch)
}

use device::{cu_err, dev_of, Dev};
pub use storage::CudaStorage;

use crate::backend::{BackendStorage, BinaryOp, CmpOp, Conv2dParams, MatmulParams, Pool2dParams, ReduceOp, UnaryOp};
use crate::shape::Layout;
use crate::{DType, Device, Error, Result};

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

/// Number of visible GPUs, or why none can be used (no driver, a missing library, no device) —
/// without opening any of them (no context, no memory taken).
pub fn visible_devices() -> std::result::Result<usize, CudaSetupError> {
    device::probe()
}

/// Name of the GPU behind `cuda:ordinal`.
pub fn device_name(ordinal: usize) -> Result<String> {
    let d = Dev::get(ordinal).map_err(Error::CudaUnavailable)?;
    d.ctx.name().map_err(|e| cu_err("cuDeviceGetName", e))
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
    fn computes_channels_last_convolutions(&self) -> bool {
        true
    }
    fn reads_channels_last_output_gradient(&self, p: &Conv2dParams) -> bool {
        conv::reads_channels_last_output_gradient(p, self.dtype)
    }
    fn reads_channels_last_input(&self, p: &Conv2dParams) -> bool {
        conv::reads_channels_last_input(p, self.dtype)
    }
    fn conv2d_backward_weight(&self, input: &Self, p: &Conv2dParams) -> Result<Self> {
        self.same_device("conv2d_backward_weight", input)?;
        conv::conv2d_backward_weight(self, input, p)
    }
    fn fuses_bias_gradient(&self, p: &Conv2dParams) -> bool {
        conv::fuses_bias_gradient(p, self.dtype)
    }
    fn conv2d_backward_weight_and_bias(&self, input: &Self, p: &Conv2dParams) -> Result<(Self, Self)> {
        self.same_device("conv2d_backward_weight_and_bias", input)?;
        conv::conv2d_backward_weight_and_bias(self, input, p)
    }
    fn max_pool2d(&self, p: &Pool2dParams) -> Result<(Self, Self)> {
        ops::max_pool2d(self, p)
    }
    fn max_pool2d_backward(&self, indices: &Self, p: &Pool2dParams) -> Result<Self> {
        ops::max_pool2d_backward(self, indices, p)
    }
    fn upsample_nearest2d(&self, shape: [usize; 4], factor: usize, channels_last: bool) -> Result<Self> {
        ops::upsample_nearest2d(self, shape, factor, false, channels_last)
    }
    fn upsample_nearest2d_backward(&self, shape: [usize; 4], factor: usize, channels_last: bool) -> Result<Self> {
        ops::upsample_nearest2d(self, shape, factor, true, channels_last)
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
        channels_last: bool,
    ) -> Result<(Self, Self)> {
        ops::batch_norm_train_stats(self, shape, weight, bias, running_mean, running_var, batches, eps, momentum, channels_last)
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
        residual: Option<&Self>,
        channels_last: bool,
    ) -> Result<(Self, Self, Self)> {
        ops::batch_norm_train_apply(
            self,
            shape,
            weight,
            bias,
            running_mean,
            running_var,
            batches,
            eps,
            momentum,
            silu,
            residual,
            channels_last,
        )
    }
    fn channel_affine(&self, shape: &[usize], params: &Self, silu: bool, channels_last: bool) -> Result<Self> {
        ops::channel_affine(self, shape, params, silu, channels_last)
    }
    fn batch_norm_act_backward(
        &self,
        g: &Self,
        g2: Option<&Self>,
        shape: &[usize],
        aff: &Self,
        nrm: &Self,
        w: &Self,
        silu: bool,
        training: bool,
        channels_last: bool,
    ) -> Result<(Self, Self, Self)> {
        ops::batch_norm_act_backward(self, g, g2, shape, aff, nrm, w, silu, training, channels_last)
    }
    fn softmax(&self, shape: &[usize], dim: usize, log: bool) -> Result<Self> {
        ops::softmax(self, shape, dim, log)
    }
    fn batch_norm_eval_params(&self, bias: &Self, running_mean: &Self, running_var: &Self, eps: f64) -> Result<(Self, Self)> {
        ops::batch_norm_eval_params(self, bias, running_mean, running_var, eps)
    }
}

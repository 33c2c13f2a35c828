//! The workspace-internal API: what the sibling crates (`ptl-capture`, `ptl-trainer`, the replay
//! plugins, the benchmarks) need from the tensor library beyond the user surface — stage tags, raw
//! storage, allocation traces for arena planning, the write journal and, on CUDA, stream capture,
//! memory pools, pinned buffers, stream marks, the kernel timer, counters and user kernels.
//!
//! It is public so those crates can be built separately, not because it is stable: a training
//! script should not need anything here, and any of it may change with the crate that uses it.

/// Stage tags: which part of a step (forward, backward of, loss, update) issued a kernel, for the
/// kernel timer and the arena planner.
pub mod stage {
    pub use crate::stage::{current, in_stage, LabelGuard, StageGuard, BACKWARD_OF};
}

/// The device-dispatching storage behind a tensor.
pub mod storage {
    pub use crate::storage::{cuda_usable, Storage};
}

/// Allocation traces of a warm-up step and the arena plans made from them.
pub mod arena_plan {
    pub use crate::arena_plan::*;
}

/// Whether this thread runs a recorder's warm-up (work whose results are rolled back).
pub mod warmup {
    pub use crate::warmup::{active, WarmupGuard};
}

/// Which storages a closure wrote (the recorder's rollback of a failed warm-up).
pub mod write_journal {
    pub use crate::write_journal::{journal_writes, WriteJournal};
}

/// The CUDA side: stream capture and graphs, private memory pools, pinned uploads, stream marks,
/// the kernel timer, launch counters, library choices and kernels compiled from other crates.
#[cfg(feature = "cuda")]
pub mod cuda {
    pub use crate::cuda::alloc::{private_pool_allocated_bytes, set_poison_allocations, MemPool, MemPoolGuard};
    pub use crate::cuda::blas::gemm_paths;
    pub use crate::cuda::capture_support::{CaptureArena, CaptureScopeGuard, CaptureViolation};
    pub use crate::cuda::conv::{
        channels_last_input_reads, channels_last_output_gradient_reads, conv_paths, narrow_bias_gradients, narrow_weight_gradients,
        thin_weight_gradients,
    };
    pub use crate::cuda::counters::{counters, library_setup, CudaCounters, LibrarySetup};
    pub use crate::cuda::graph::{begin_capture, end_capture, gpu_spin, graph_mem_reserved, time_on_stream, CudaGraph, StreamMark};
    pub use crate::cuda::kernel_timer::{GpuKernelTimer, GpuKernelTotals, KernelDetail};
    pub use crate::cuda::module_probe::probe_module_cache;
    pub use crate::cuda::ops::bn_cluster_launches;
    pub use crate::cuda::pending_copy::PendingCopy;
    pub use crate::cuda::pinned::PinnedBuffer;
    pub use crate::cuda::user_kernel::{KernelArg, UserKernel};

    /// The recorder's side of stream capture: capture state, allocation checks, measured
    /// footprints, arena placement.
    pub mod capture_support {
        pub use crate::cuda::capture_support::*;
    }

    /// Host-side costs of the launch path (lookup, argument packing), for the benchmarks.
    pub mod host_probe {
        pub use crate::cuda::host_probe::*;
    }
}

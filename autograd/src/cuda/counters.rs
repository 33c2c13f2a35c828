//! Process-wide counts of what the CUDA backend asks of the driver: kernel launches, library
//! calls (cuDNN, cuBLAS/cuBLASLt), graph launches, copies, memsets and host synchronisations.
//!
//! They are how a run reports "launches per step" and how a test proves that a region was
//! replayed instead of launched op by op. Relaxed atomics: a count costs about a nanosecond and
//! the numbers are read between steps, never to order memory.

use std::sync::atomic::{AtomicU64, Ordering};

/// What one counter counts.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Count {
    KernelLaunch,
    LibraryCall,
    GraphLaunch,
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
    Memset,
    HostSync,
}

const N: usize = 8;
static COUNTS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

#[inline]
pub(crate) fn count(c: Count) {
    COUNTS[c as usize].fetch_add(1, Ordering::Relaxed);
}

/// A snapshot of the counters (all threads of the process, all devices).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaCounters {
    /// Kernels launched one by one from the host (ours and [`super::user_kernel::UserKernel`]s).
    pub kernel_launches: u64,
    /// cuDNN and cuBLAS/cuBLASLt calls (each may run one or more kernels on the device).
    pub library_calls: u64,
    /// CUDA graph launches (one launch replays a whole recorded region).
    pub graph_launches: u64,
    /// Host-to-device copies.
    pub host_to_device_copies: u64,
    /// Device-to-host copies.
    pub device_to_host_copies: u64,
    /// Device-to-device copies.
    pub device_to_device_copies: u64,
    /// Memsets.
    pub memsets: u64,
    /// Points where the host waited for the device (stream/event synchronisation, host reads).
    pub host_syncs: u64,
}

impl CudaCounters {
    /// Counts since `earlier` (a snapshot taken before).
    pub fn since(&self, earlier: &CudaCounters) -> CudaCounters {
        CudaCounters {
            kernel_launches: self.kernel_launches.saturating_sub(earlier.kernel_launches),
            library_calls: self.library_calls.saturating_sub(earlier.library_calls),
            graph_launches: self.graph_launches.saturating_sub(earlier.graph_launches),
            host_to_device_copies: self.host_to_device_copies.saturating_sub(earlier.host_to_device_copies),
            device_to_host_copies: self.device_to_host_copies.saturating_sub(earlier.device_to_host_copies),
            device_to_device_copies: self.device_to_device_copies.saturating_sub(earlier.device_to_device_copies),
            memsets: self.memsets.saturating_sub(earlier.memsets),
            host_syncs: self.host_syncs.saturating_sub(earlier.host_syncs),
        }
    }
}

/// The current counts.
pub fn counters() -> CudaCounters {
    let g = |c: Count| COUNTS[c as usize].load(Ordering::Relaxed);
    CudaCounters {
        kernel_launches: g(Count::KernelLaunch),
        library_calls: g(Count::LibraryCall),
        graph_launches: g(Count::GraphLaunch),
        host_to_device_copies: g(Count::HostToDevice),
        device_to_host_copies: g(Count::DeviceToHost),
        device_to_device_copies: g(Count::DeviceToDevice),
        memsets: g(Count::Memset),
        host_syncs: g(Count::HostSync),
    }
}

/// Kinds of one-time library set-up.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Setup {
    /// cuDNN or cuBLAS/cuBLASLt handle.
    Handle,
    /// A cuDNN execution plan (graph API or legacy algorithm choice).
    ConvPlan,
    /// A cuBLASLt matmul plan.
    GemmPlan,
    /// Inside a graph-API conv plan: cuDNN's engine ranking for the shape.
    ConvHeuristics,
    /// Inside a graph-API conv plan: one engine's execution-plan finalize (kept or refused).
    ConvFinalize,
    /// The finalizes of engines that compile their kernel at run time (part of `ConvFinalize`).
    ConvRuntimeCompiled,
    /// A conv plan restored from its serialized form (an earlier process compiled its kernel).
    ConvPlanLoad,
}

static SETUPS: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];
static SETUP_NS: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];

/// Counts one set-up of `kind` that took `took` (timed by the caller).
pub(crate) fn add_setup(kind: Setup, took: std::time::Duration) {
    SETUPS[kind as usize].fetch_add(1, Ordering::Relaxed);
    SETUP_NS[kind as usize].fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
}

/// Runs `f`, a one-time library set-up, and adds its wall time to [`library_setup`].
pub(crate) fn time_setup<R>(kind: Setup, f: impl FnOnce() -> R) -> R {
    let t = std::time::Instant::now();
    let r = f();
    add_setup(kind, t.elapsed());
    r
}

/// One-time library set-ups so far: how many and how many seconds they took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LibrarySetup {
    /// cuBLAS/cuDNN handles created.
    pub handles: u64,
    /// Seconds spent creating them.
    pub handle_s: f64,
    /// cuDNN execution plans, one per convolution shape, dtype and direction.
    pub conv_plans: u64,
    /// Seconds spent building convolution plans.
    pub conv_plan_s: f64,
    /// cuBLASLt plans, one per matmul shape and dtype.
    pub gemm_plans: u64,
    /// Seconds spent building GEMM plans.
    pub gemm_plan_s: f64,
    /// Parts of the conv plans' time (graph API): ranking the engines, and finalizing execution
    /// plans (one per engine tried).
    pub conv_heuristics_s: f64,
    /// cuDNN plans finalised.
    pub conv_finalizes: u64,
    /// Seconds spent finalising them.
    pub conv_finalize_s: f64,
    /// Of those, the finalizes of engines that compile their kernel at run time.
    pub conv_runtime_compiled: u64,
    /// Seconds of cuDNN's runtime kernel compilation.
    pub conv_runtime_compiled_s: f64,
    /// Plans restored from the serialized form an earlier process stored (instead of compiling).
    pub conv_plans_loaded: u64,
    /// Seconds spent loading remembered plans.
    pub conv_plan_load_s: f64,
}

/// Library set-ups (handles and execution plans of cuDNN and cuBLAS/cuBLASLt) so far: a fixed
/// cost paid once per process and shape.
pub fn library_setup() -> LibrarySetup {
    let n = |k: Setup| SETUPS[k as usize].load(Ordering::Relaxed);
    let s = |k: Setup| SETUP_NS[k as usize].load(Ordering::Relaxed) as f64 * 1e-9;
    LibrarySetup {
        handles: n(Setup::Handle),
        handle_s: s(Setup::Handle),
        conv_plans: n(Setup::ConvPlan),
        conv_plan_s: s(Setup::ConvPlan),
        gemm_plans: n(Setup::GemmPlan),
        gemm_plan_s: s(Setup::GemmPlan),
        conv_heuristics_s: s(Setup::ConvHeuristics),
        conv_finalizes: n(Setup::ConvFinalize),
        conv_finalize_s: s(Setup::ConvFinalize),
        conv_runtime_compiled: n(Setup::ConvRuntimeCompiled),
        conv_runtime_compiled_s: s(Setup::ConvRuntimeCompiled),
        conv_plans_loaded: n(Setup::ConvPlanLoad),
        conv_plan_load_s: s(Setup::ConvPlanLoad),
    }
}

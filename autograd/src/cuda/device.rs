//! Per-device state: context, the compute stream and the side stream beside it (`side_stream`),
//! the kernel units' modules, library handles.
//!
//! A device is opened on first use (`Dev::get`) after checking that the driver and every library
//! we load are present (cudarc panics on a missing library, so we never let it try).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result as dr, sys, CudaContext, CudaModule, CudaStream};

use super::block_cache::BlockCache;
use super::module_cache::cuda_home;
pub use crate::error::CudaSetupError;
use crate::{DType, Device, Error, Result};

pub(crate) fn cu_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// Checks the driver and libraries once per process; returns the visible GPU count.
pub(crate) fn probe() -> std::result::Result<usize, CudaSetupError> {
    static PROBE: OnceLock<std::result::Result<usize, CudaSetupError>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: these only try to dlopen the libraries.
            unsafe {
                if !sys::is_culib_present() {
                    return Err(CudaSetupError::NoDriver);
                }
                if !cudarc::nvrtc::sys::is_culib_present() {
                    return Err(CudaSetupError::MissingLibrary { name: "NVRTC (libnvrtc.so)" });
                }
                if !cudarc::cublas::sys::is_culib_present() {
                    return Err(CudaSetupError::MissingLibrary { name: "cuBLAS (libcublas.so)" });
                }
                if !cudarc::cudnn::sys::is_culib_present() {
                    return Err(CudaSetupError::MissingLibrary { name: "cuDNN (libcudnn.so)" });
                }
            }
            dr::init().map_err(|e| CudaSetupError::NoDevice { detail: format!("cuInit failed: {e:?}") })?;
            let n = CudaContext::device_count().map_err(|e| CudaSetupError::NoDevice { detail: format!("{e:?}") })?;
            if n <= 0 {
                return Err(CudaSetupError::NoDevice { detail: "the driver reports 0 devices".into() });
            }
            Ok(n as usize)
        })
        .clone()
}

/// Library calls that took the fast path or the fallback, counted per thread (diagnostics: tests
/// and benchmarks check which path ran). Indexed by [`LibPath`].
#[derive(Clone, Copy)]
pub(crate) enum LibPath {
    ConvGraph,
    ConvLegacy,
    GemmLt,
    GemmClassic,
}

thread_local! {
    static LIB_PATHS: std::cell::Cell<[u64; 4]> = const { std::cell::Cell::new([0; 4]) };
}

pub(crate) fn count_path(p: LibPath) {
    super::counters::count(super::counters::Count::LibraryCall);
    LIB_PATHS.with(|c| {
        let mut v = c.get();
        v[p as usize] += 1;
        c.set(v);
    });
}

pub(crate) fn path_counts() -> [u64; 4] {
    LIB_PATHS.with(|c| c.get())
}

/// Channels the one-launch batch-norm statistics kernel handles (more: two launches).
pub(crate) const BN_TICKETS: usize = 65535;

/// Kernel choices of one CUDA device, set per device ([`super::set_device_options`]). Each pair
/// of choices gives the same bytes; the options exist to compare them (tests, benchmarks). The
/// defaults are the faster ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceOptions {
    /// Gradient clipping through the multi-tensor kernels (`Tensor::clip_norm_many_`). Off, it
    /// runs the composed per-tensor ops (about ten launches per gradient), whose total norm differs
    /// in its last bits (another summation order) — the one choice here that changes bytes.
    pub fused_clip: bool,
    /// A large `index_add` by buckets (count, scan, fill, sort, sum: linear work) instead of the
    /// one-launch scan of every index per output element.
    pub index_add_by_buckets: bool,
    /// A batch-norm layer whose channels fit one block runs its forward (statistics + apply) and
    /// its backward (reduction + dx) as one launch each instead of two.
    pub bn_one_launch: bool,
    /// f32 convolutions (cuDNN's, and 1×1 ones run as GEMMs) may round their inputs to TF32 on
    /// tensor cores, as PyTorch's default `torch.backends.cudnn.allow_tf32 = True` lets them; f32
    /// matmuls stay full FP32 either way (PyTorch's matmul default). Off by default here (strict
    /// FP32, the CPU's bytes within f32 rounding); the trainer's `tf32` key turns it on.
    pub tf32_convolutions: bool,
    /// Convolution weight gradients (and the backward work that consumes them) run on a second
    /// stream beside the chain of data gradients, so that independent kernels overlap
    /// (`side_stream`, docs/concurrent-backward.md). The same kernels on the same inputs: the bytes
    /// do not change. On by default; `PTL_SIDE_STREAM=0` turns it off when the device opens.
    pub concurrent_weight_gradients: bool,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            fused_clip: true,
            index_add_by_buckets: true,
            bn_one_launch: true,
            tf32_convolutions: false,
            concurrent_weight_gradients: super::side_tasks::enabled_by_env(),
        }
    }
}

/// A library's per-device state, filled on first use by the module that owns the library: the
/// device knows no library type (those modules sit above it).
#[derive(Default)]
pub(crate) struct LibrarySlot(Mutex<Option<Box<dyn std::any::Any + Send>>>);

impl LibrarySlot {
    /// Runs `f` on the state of type `T` under the slot's lock, made by `init` if there is none.
    pub fn with<T: Send + 'static, R>(&self, init: impl FnOnce() -> Result<T>, f: impl FnOnce(&mut T) -> Result<R>) -> Result<R> {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Some(Box::new(init()?));
        }
        let state =
            guard.as_mut().and_then(|b| b.downcast_mut::<T>()).ok_or_else(|| Error::Cuda("library slot holds another type".into()))?;
        f(state)
    }

    /// `f` of the state of type `T`, if it was made.
    pub fn peek<T: 'static, R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        let guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().and_then(|b| b.downcast_ref::<T>()).map(f)
    }
}

pub(crate) struct Dev {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    /// Keeps cudarc's stream object (and so the raw stream) alive.
    #[allow(dead_code)]
    pub stream: Arc<CudaStream>,
    pub cu_stream: sys::CUstream,
    /// Keeps the side stream (weight gradients beside the compute stream) alive.
    #[allow(dead_code)]
    pub side_stream: Arc<CudaStream>,
    pub side_cu_stream: sys::CUstream,
    /// Forks, joins and the frees held for the side stream (`side_stream`).
    pub side: Mutex<super::side_tasks::SideState>,
    pub default_pool: sys::CUmemoryPool,
    /// The kernel units' modules ([`super::kernel_units::UNITS`], same order).
    modules: Vec<Arc<CudaModule>>,
    funcs: Mutex<HashMap<(&'static str, &'static str), sys::CUfunction>>,
    /// Modules compiled from other crates' sources ([`super::UserKernel`]), keyed by module name.
    pub user_modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    /// Functions looked up in those modules, keyed by (module, function): a repeated
    /// [`super::UserKernel::compile`] is a map lookup.
    pub user_functions: Mutex<HashMap<(String, String), sys::CUfunction>>,
    /// Free pinned host buffers of [`super::PendingCopy`] (addresses of `PINNED_READ_BYTES` each):
    /// a deferred read every step reuses them instead of allocating page-locked memory.
    pub pinned_reads: Mutex<Vec<usize>>,
    /// cuBLAS/cuBLASLt state (`blas::Blas`), made on first use by the module that owns it.
    pub blas: LibrarySlot,
    /// cuDNN state (`conv::Dnn`), the same way.
    pub dnn: LibrarySlot,
    /// Bytes currently handed out by this allocator (all pools) and the peak since the last reset.
    pub allocated: AtomicU64,
    pub peak_allocated: AtomicU64,
    /// Reserved high-water marks of private pools destroyed since the last peak reset, so that
    /// a peak read after the recordings are gone still counts their memory.
    pub released_pool_peaks: AtomicU64,
    /// Bytes of arenas mapped at reserved addresses (`mapped_range`), outside every pool: part
    /// of `allocated` and of the reserved figures, with their own high-water mark.
    pub mapped: AtomicU64,
    pub peak_mapped: AtomicU64,
    /// What the thread that set the allocated peak was doing (packed by the allocator).
    pub peak_context: AtomicU32,
    /// Errors from `Drop` paths (frees), which cannot return them.
    pub deferred_error: Mutex<Option<String>>,
    /// Freed default-pool blocks kept for reuse without a driver call ([`super::block_cache`]).
    pub block_cache: Mutex<BlockCache>,
    /// `BN_TICKETS` zeroed u32 counters for the one-launch batch-norm statistics kernel, allocated
    /// at open (so never inside a capture) and kept for the device's lifetime.
    pub bn_tickets: sys::CUdeviceptr,
    /// The side stream's own tickets: two batch norms running at once on the two streams must
    /// not share counters.
    pub side_bn_tickets: sys::CUdeviceptr,
    /// Set while the compute stream is being captured ([`super::begin_capture`]): the block cache
    /// is bypassed then, so a graph never holds a block the eager side could hand out again.
    pub capturing: AtomicBool,
    /// Kernel choices of this device ([`DeviceOptions`]).
    pub options: Mutex<DeviceOptions>,
    /// Thread-block clusters can be launched (compute capability 9.0 and later).
    pub clusters: bool,
    /// The units' kernels are launched with programmatic stream serialization (compute capability
    /// 9.0 and later, `PTL_PDL`): the next kernel's blocks may be scheduled while this one
    /// ends, and wait at entry for its writes (`ops/prelude.cuh`, `ptl_kernel_entry`).
    pub dependent_launch: bool,
}

/// Whether kernels are launched dependent where `PTL_PDL` is not set.
const DEPENDENT_LAUNCH_BY_DEFAULT: bool = true;

/// `PTL_PDL=1` turns programmatic dependent launch on, `0` off (the bytes are the same either way);
/// else [`DEPENDENT_LAUNCH_BY_DEFAULT`].
fn dependent_launch_from_env() -> bool {
    match std::env::var("PTL_PDL").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => DEPENDENT_LAUNCH_BY_DEFAULT,
    }
}

// SAFETY: the raw handles are process-global driver objects; all mutation goes through mutexes or
// the driver's own thread safety, and work is ordered on the single compute stream.
unsafe impl Send for Dev {}
unsafe impl Sync for Dev {}

impl std::fmt::Debug for Dev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{}", self.ordinal)
    }
}

type DevSlot = std::result::Result<Arc<Dev>, CudaSetupError>;

fn registry() -> &'static Mutex<HashMap<usize, DevSlot>> {
    static R: OnceLock<Mutex<HashMap<usize, DevSlot>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Every device opened so far.
pub(crate) fn opened() -> Vec<Arc<Dev>> {
    registry().lock().unwrap_or_else(|e| e.into_inner()).values().filter_map(|slot| slot.as_ref().ok().cloned()).collect()
}

thread_local! {
    static BOUND: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Dev {
    /// The process-wide handle of `cuda:ordinal`, opened on first use.
    pub fn get(ordinal: usize) -> std::result::Result<Arc<Dev>, CudaSetupError> {
        let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = reg.get(&ordinal) {
            return slot.clone();
        }
        let slot = Dev::open(ordinal).map(Arc::new);
        reg.insert(ordinal, slot.clone());
        slot
    }

    fn open(ordinal: usize) -> std::result::Result<Dev, CudaSetupError> {
        let count = probe()?;
        if ordinal >= count {
            return Err(CudaSetupError::BadOrdinal { ordinal, count });
        }
        let init = |what: &str, e: &dyn std::fmt::Debug| CudaSetupError::Init { detail: format!("{what}: {e:?}") };
        let ctx = CudaContext::new(ordinal).map_err(|e| init("context", &e))?;
        // Event tracking breaks stream capture; we order everything on one stream ourselves.
        unsafe { ctx.disable_event_tracking() };
        // The compute stream at the highest priority, the side stream at the lowest: where both
        // have blocks waiting, the chain of data gradients (the critical path) is scheduled first
        // and weight gradients fill the idle SMs. Captured kernels keep their stream's priority
        // (graphs are instantiated to use it).
        let (least, greatest) = match super::side_tasks::priorities_enabled() {
            true => dr::stream::get_priority_range().map_err(|e| init("stream priorities", &e))?,
            false => (0, 0),
        };
        let stream = ctx.new_stream_with_priority(greatest).map_err(|e| init("stream", &e))?;
        let cu_stream = stream.cu_stream();
        let side_stream = ctx.new_stream_with_priority(least).map_err(|e| init("side stream", &e))?;
        let side_cu_stream = side_stream.cu_stream();
        let side = super::side_tasks::SideState::new().map_err(|e| init("side stream events", &e))?;
        let dev = ctx.cu_device();
        let pool = unsafe { dr::device::get_default_mem_pool(dev) }.map_err(|e| init("default memory pool", &e))?;
        let mut thr = u64::MAX;
        unsafe {
            dr::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut thr as *mut u64 as *mut c_void,
            )
        }
        .map_err(|e| init("pool release threshold", &e))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| init("compute capability", &e))?;
        let units = super::kernel_units::compiled_units();
        let units: Vec<(&str, &str)> = units.iter().map(|(name, source)| (*name, source.as_str())).collect();
        let modules = super::module_cache::load_modules(&ctx, &units, major, minor).map_err(|e| CudaSetupError::Init {
            detail: format!("kernels (CUDA headers from {}/include; set CUDA_HOME): {e}", cuda_home()),
        })?;
        let (cache_limit, cache_max_block) =
            super::block_cache::cache_limits_from_env().map_err(|detail| CudaSetupError::Init { detail })?;
        let tickets = || unsafe {
            let p = dr::malloc_sync(BN_TICKETS * 4).map_err(|e| init("batch-norm tickets", &e))?;
            dr::memset_d8_sync(p, 0, BN_TICKETS * 4).map_err(|e| init("batch-norm tickets", &e))?;
            Ok::<_, CudaSetupError>(p)
        };
        let (bn_tickets, side_bn_tickets) = (tickets()?, tickets()?);
        Ok(Dev {
            ordinal,
            ctx,
            stream,
            cu_stream,
            side_stream,
            side_cu_stream,
            side: Mutex::new(side),
            default_pool: pool,
            modules,
            funcs: Mutex::new(HashMap::new()),
            user_modules: Mutex::new(HashMap::new()),
            user_functions: Mutex::new(HashMap::new()),
            pinned_reads: Mutex::new(Vec::new()),
            blas: LibrarySlot::default(),
            dnn: LibrarySlot::default(),
            allocated: AtomicU64::new(0),
            peak_allocated: AtomicU64::new(0),
            released_pool_peaks: AtomicU64::new(0),
            mapped: AtomicU64::new(0),
            peak_mapped: AtomicU64::new(0),
            peak_context: AtomicU32::new(0),
            deferred_error: Mutex::new(None),
            block_cache: Mutex::new(BlockCache::with_limits(cache_limit, cache_max_block)),
            capturing: AtomicBool::new(false),
            bn_tickets,
            side_bn_tickets,
            options: Mutex::new(DeviceOptions::default()),
            clusters: major >= 9,
            dependent_launch: major >= 9 && dependent_launch_from_env(),
        })
    }

    /// This device's kernel choices (read where a kernel is picked).
    pub fn options(&self) -> DeviceOptions {
        *self.options.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes this device's context current on the calling thread (cheap when it already is).
    #[inline]
    pub fn bind(&self) -> Result<()> {
        let want = self.ctx.cu_ctx() as usize;
        if BOUND.with(|b| b.get()) != want {
            unsafe { dr::ctx::set_current(self.ctx.cu_ctx()) }.map_err(|e| cu_err("cuCtxSetCurrent", e))?;
            BOUND.with(|b| b.set(want));
        }
        Ok(())
    }

    /// A kernel of the units: `base` plus a dtype suffix (`""` for none). The first lookup of a
    /// name asks each unit's module in turn (names are unique across units); later ones are a map
    /// lookup.
    pub fn func(&self, base: &'static str, suffix: &'static str) -> Result<sys::CUfunction> {
        let mut m = self.funcs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = m.get(&(base, suffix)) {
            return Ok(*f);
        }
        let name = if suffix.is_empty() { base.to_string() } else { format!("{base}_{suffix}") };
        let f = self
            .modules
            .iter()
            .find_map(|module| module.load_function(&name).ok())
            .ok_or_else(|| Error::Cuda(format!("kernel {name}: in none of the kernel units")))?;
        let raw = f.cu_function();
        // The module (held by self) keeps the function alive.
        std::mem::forget(f);
        m.insert((base, suffix), raw);
        Ok(raw)
    }

    /// Launches `f` with a 1-D grid over `n` items (grid-stride loops inside the kernels).
    #[inline]
    pub fn launch1d(&self, f: sys::CUfunction, n: usize, params: &mut [*mut c_void]) -> Result<()> {
        let block = 256u32;
        let blocks = n.div_ceil(block as usize).clamp(1, 65536 * 8) as u32;
        self.launch(f, (blocks, 1, 1), (block, 1, 1), params)
    }

    /// Launches one of the units' kernels on this thread's stream.
    #[inline]
    pub fn launch(&self, f: sys::CUfunction, grid: (u32, u32, u32), block: (u32, u32, u32), params: &mut [*mut c_void]) -> Result<()> {
        if self.dependent_launch {
            return self.launch_ex(f, grid, block, None, params);
        }
        super::counters::count(super::counters::Count::KernelLaunch);
        // SAFETY: every caller passes pointers to live arguments matching the kernel signature.
        unsafe { dr::launch_kernel(f, grid, block, 0, self.stream(), params) }.map_err(|e| cu_err("kernel launch", e))
    }

    /// `cuLaunchKernelEx` with a cluster dimension (when given) and programmatic stream
    /// serialization (when [`Dev::dependent_launch`]).
    fn launch_ex(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        cluster_x: Option<u32>,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        super::counters::count(super::counters::Count::KernelLaunch);
        // SAFETY: plain-data attributes; zero is a valid bit pattern (the "ignore" attribute).
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if let Some(x) = cluster_x {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x, y: 1, z: 1 };
            n += 1;
        }
        if self.dependent_launch {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: 0,
            hStream: self.stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        // SAFETY: every caller passes pointers to live arguments matching the kernel signature;
        // the configuration and its attributes live across the call.
        unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| cu_err("kernel launch (cuLaunchKernelEx)", e))
    }

    /// [`Dev::launch`] with the grid's blocks grouped in thread-block clusters of `cluster_x` × 1
    /// × 1 (which share their shared memory); only where [`Dev::clusters`] says so.
    pub fn launch_cluster(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        cluster_x: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if !self.clusters || cluster_x == 0 || !grid.0.is_multiple_of(cluster_x) {
            return Err(crate::Error::Cuda(format!(
                "a cluster launch of {cluster_x} blocks over a grid of {grid:?} on a device without clusters or not divisible by it"
            )));
        }
        self.launch_ex(f, grid, block, Some(cluster_x), params)
    }

    /// The stream this thread queues work on: the side stream inside a side task
    /// ([`super::side_stream::on_side`]), the compute stream otherwise.
    #[inline]
    pub fn stream(&self) -> sys::CUstream {
        if super::side_tasks::is_on_side(self.ordinal) {
            self.side_cu_stream
        } else {
            self.cu_stream
        }
    }

    /// Makes the compute stream wait for every side task that has ended (`side_stream`) and carries
    /// out the frees held for them. Inside a side task, the running task stays unjoined.
    pub fn join_side_tasks(&self) -> Result<()> {
        let released = {
            let mut s = self.side.lock().unwrap_or_else(|e| e.into_inner());
            if !s.ledger.pending() {
                return Ok(());
            }
            s.join_through(self.cu_stream, u64::MAX)?
        };
        for f in released {
            f.release();
        }
        Ok(())
    }

    /// For tagging a new buffer: the side task this thread is inside (0: none), and the last task
    /// that cannot touch the buffer (every task up to it had queued its work before the buffer
    /// existed).
    pub fn side_birth(&self) -> (u64, u64) {
        let forked = self.side.lock().unwrap_or_else(|e| e.into_inner()).ledger.forked;
        if self.on_side() {
            (forked, forked - 1)
        } else {
            (0, forked)
        }
    }

    /// The batch-norm tickets of the stream this thread queues on.
    #[inline]
    pub fn bn_tickets(&self) -> sys::CUdeviceptr {
        if self.on_side() {
            self.side_bn_tickets
        } else {
            self.bn_tickets
        }
    }

    /// Whether this thread is inside a side task of this device.
    #[inline]
    pub fn on_side(&self) -> bool {
        super::side_tasks::is_on_side(self.ordinal)
    }

    /// Waits for all work queued on the compute stream (and the side tasks joined into it first).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.join_side_tasks()?;
        super::counters::count(super::counters::Count::HostSync);
        unsafe { dr::stream::synchronize(self.stream()) }.map_err(|e| cu_err("stream synchronize", e))
    }

    pub fn record_deferred(&self, what: &str, e: impl std::fmt::Debug) {
        let mut d = self.deferred_error.lock().unwrap_or_else(|e| e.into_inner());
        if d.is_none() {
            *d = Some(format!("{what}: {e:?}"));
        }
    }

    /// Counts `bytes` as allocated; `true` when that set a new peak.
    pub fn note_alloc(&self, bytes: u64) -> bool {
        let now = self.allocated.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_allocated.fetch_max(now, Ordering::Relaxed) < now
    }
    pub fn note_free(&self, bytes: u64) {
        self.allocated.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// Kernel-name suffix of a dtype (Bool shares the u8 kernels).
pub(crate) fn sfx(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I64 => "i64",
        DType::U8 | DType::Bool => "u8",
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

/// The device state of a CUDA [`Device`] (an error for the CPU or a device that cannot open).
pub(crate) fn dev_of(device: Device) -> Result<Arc<Dev>> {
    match device {
        Device::Cuda(n) => Dev::get(n).map_err(Error::CudaUnavailable),
        Device::Cpu => Err(Error::invalid("cuda", "expected a CUDA device")),
    }
}

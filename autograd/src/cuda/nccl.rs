//! NCCL, the collective engine of data-parallel training, loaded at run time like the other CUDA
//! libraries, so builds and machines without it keep working.
//!
//! cudarc's `nccl::sys` gives the types; the symbols are resolved here from the library file we
//! find, because NCCL installs `libnccl.so.2`, a name cudarc's own loader does not try, and
//! because its safe `Comm` aborts on drop through `expect` and cannot report NCCL's asynchronous
//! errors. Collectives run on the device's compute stream, so they are ordered with the kernels
//! around them and are recorded when that stream is being captured (NCCL ≥ 2.9) — or, started
//! with [`NcclComm::all_reduce_sum_beside`], on the communicator's own stream, beside the compute
//! stream's work until [`NcclComm::join_beside`].

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::nccl::sys as ns;

use super::comm_stream::CommStream;
use super::device::{dev_of, Dev};
use crate::{DType, Device, Error, Result, Tensor};

/// The environment variable naming the NCCL library file to load (before any search).
pub const NCCL_LIBRARY_ENV: &str = "PTL_NCCL_LIBRARY";

/// The files to try for NCCL, in order: `PTL_NCCL_LIBRARY`; the names the dynamic loader finds on
/// its path (`libnccl.so.2`, then `libnccl.so`); the `nvidia-nccl-cu*` Python packages' copies
/// under the active virtual or conda environment, the user's site-packages and the system's.
/// `var` reads an environment variable (a parameter, so the search is testable).
pub fn nccl_candidates(var: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = var(NCCL_LIBRARY_ENV).map(PathBuf::from).into_iter().collect();
    out.extend(["libnccl.so.2", "libnccl.so"].map(PathBuf::from));
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"].iter().filter_map(|k| var(k)).map(PathBuf::from).collect();
    prefixes.extend(var("HOME").map(|h| Path::new(&h).join(".local")));
    prefixes.extend(["/usr/local", "/usr"].map(PathBuf::from));
    for prefix in prefixes {
        let lib = prefix.join("lib");
        let Ok(entries) = std::fs::read_dir(&lib) else { continue };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("python3")))
            .collect();
        pythons.sort();
        for python in pythons.iter().rev() {
            for packages in ["site-packages", "dist-packages"] {
                let file = python.join(packages).join("nvidia/nccl/lib/libnccl.so.2");
                if file.is_file() {
                    out.push(file);
                }
            }
        }
    }
    out
}

/// The NCCL entry points ptl uses, resolved from one library file.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> ns::ncclResult_t,
    get_unique_id: unsafe extern "C" fn(*mut ns::ncclUniqueId) -> ns::ncclResult_t,
    comm_init_rank: unsafe extern "C" fn(*mut ns::ncclComm_t, c_int, ns::ncclUniqueId, c_int) -> ns::ncclResult_t,
    /// `ncclCommInitRankConfig` (NCCL ≥ 2.14), absent in older libraries.
    comm_init_rank_config:
        Option<unsafe extern "C" fn(*mut ns::ncclComm_t, c_int, ns::ncclUniqueId, c_int, *mut Config) -> ns::ncclResult_t>,
    #[allow(clippy::type_complexity)]
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ns::ncclDataType_t,
        ns::ncclRedOp_t,
        ns::ncclComm_t,
        ns::cudaStream_t,
    ) -> ns::ncclResult_t,
    comm_get_async_error: unsafe extern "C" fn(ns::ncclComm_t, *mut ns::ncclResult_t) -> ns::ncclResult_t,
    comm_abort: unsafe extern "C" fn(ns::ncclComm_t) -> ns::ncclResult_t,
    comm_destroy: unsafe extern "C" fn(ns::ncclComm_t) -> ns::ncclResult_t,
    get_error_string: unsafe extern "C" fn(ns::ncclResult_t) -> *const c_char,
    /// The file it came from.
    path: PathBuf,
    /// Kept loaded for the life of the process (the entry points above point into it).
    _library: libloading::Library,
}

/// The loaded library, or why none could be loaded (every file tried, in order).
fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        let tried = nccl_candidates(&|k| std::env::var(k).ok());
        let mut failures = Vec::new();
        for path in &tried {
            // SAFETY: loading NCCL runs only its own initialisers.
            match unsafe { libloading::Library::new(path) } {
                Ok(library) => return resolve(library, path).map_err(|e| format!("{}: {e}", path.display())),
                Err(e) => failures.push(format!("{}: {e}", path.display())),
            }
        }
        Err(format!(
            "NCCL (libnccl.so.2) not found; install it (e.g. `pip install nvidia-nccl-cu13`) or name the file with {NCCL_LIBRARY_ENV}. Tried: {}",
            failures.join("; ")
        ))
    })
    .as_ref()
    .map_err(|e| Error::Cuda(e.clone()))
}

/// The entry points of `library` (loaded from `path`).
fn resolve(library: libloading::Library, path: &Path) -> std::result::Result<Api, String> {
    // SAFETY: each symbol is looked up with the signature of NCCL's C header (nccl.h of 2.x, the
    // ABI cudarc's bindings are generated from); the copies stay valid while `library` is held.
    unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *library.get($name).map_err(|e| format!("{}: {e}", String::from_utf8_lossy(&$name[..$name.len() - 1])))?
            };
        }
        Ok(Api {
            get_version: sym!(b"ncclGetVersion\0"),
            get_unique_id: sym!(b"ncclGetUniqueId\0"),
            comm_init_rank: sym!(b"ncclCommInitRank\0"),
            comm_init_rank_config: library.get(b"ncclCommInitRankConfig\0").ok().map(|f| *f),
            all_reduce: sym!(b"ncclAllReduce\0"),
            comm_get_async_error: sym!(b"ncclCommGetAsyncError\0"),
            comm_abort: sym!(b"ncclCommAbort\0"),
            comm_destroy: sym!(b"ncclCommDestroy\0"),
            get_error_string: sym!(b"ncclGetErrorString\0"),
            path: path.to_path_buf(),
            _library: library,
        })
    }
}

/// The leading fields of NCCL's `ncclConfig_t` as of 2.17. NCCL reads a configuration by its
/// `size` and `version` fields, so a later library takes this prefix and leaves its newer fields
/// at their defaults; `i32::MIN` (`NCCL_CONFIG_UNDEF_INT`) and a null name leave a field to NCCL.
#[repr(C)]
struct Config {
    size: usize,
    magic: std::ffi::c_uint,
    version: std::ffi::c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

/// The oldest NCCL whose communicators take a configuration: 2.17.1 (`NCCL_VERSION(2, 17, 1)`).
const CONFIG_VERSION: c_int = 21701;

impl Config {
    /// A non-blocking communicator: its calls return at once with `ncclInProgress` while NCCL
    /// works in the background, so a rank waiting for a peer that never arrives can give up.
    fn non_blocking() -> Config {
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: CONFIG_VERSION as std::ffi::c_uint,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
        }
    }
}

/// An NCCL result as an error naming the call (`Ok` for success).
fn check(api: &Api, what: &str, r: ns::ncclResult_t) -> Result<()> {
    if r == ns::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: NCCL returns a static C string for every result code.
    let text = unsafe { CStr::from_ptr((api.get_error_string)(r)) }.to_string_lossy().into_owned();
    Err(Error::Cuda(format!("NCCL {what}: {text} ({r:?})")))
}

/// The loaded NCCL's version (e.g. 22707 for 2.27.7) and the file it was loaded from.
pub fn nccl_version() -> Result<(i32, PathBuf)> {
    let api = api()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    check(api, "ncclGetVersion", unsafe { (api.get_version)(&mut v) })?;
    Ok((v, api.path.clone()))
}

/// The identifier all ranks of one communicator share: rank 0 makes it ([`NcclId::new`]) and
/// hands its bytes to the others (ptl's rendezvous store).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    /// A fresh identifier (on rank 0).
    pub fn new() -> Result<NcclId> {
        let api = api()?;
        let mut id = ns::ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte identifier.
        check(api, "ncclGetUniqueId", unsafe { (api.get_unique_id)(&mut id) })?;
        Ok(NcclId(id.internal.map(|c| c as u8)))
    }
}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({:02x?}…)", &self.0[..8])
    }
}

/// One rank's NCCL communicator on one device. Collectives are issued on the device's compute
/// stream. Dropping it destroys the communicator, or aborts it after an error (an aborted
/// communicator's peers see their collectives fail instead of spinning).
pub struct NcclComm {
    comm: ns::ncclComm_t,
    dev: Arc<Dev>,
    rank: usize,
    world: usize,
    /// Made with a non-blocking configuration: each call is followed by [`NcclComm::settle`].
    non_blocking: bool,
    /// The longest wait for a call to finish (non-blocking communicators).
    timeout: std::time::Duration,
    /// [`HEALTHY`], [`FAILED`] (an error was seen: drop aborts) or [`ABORTED`] (drop does nothing).
    state: AtomicU8,
    /// The communication stream, made on the first all-reduce started beside the compute stream.
    beside: OnceLock<CommStream>,
    /// Whether all-reduces started beside the compute stream have not been joined yet.
    beside_pending: std::sync::atomic::AtomicBool,
}

const HEALTHY: u8 = 0;
const FAILED: u8 = 1;
const ABORTED: u8 = 2;

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; ptl issues them from the fit's thread, and `abort` (the watchdog's) is the one call
// NCCL allows concurrently with others.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins the `world`-rank communicator `id` as `rank`, on `device`; waits until every rank
    /// has joined, at most `timeout`: with NCCL ≥ 2.17 the communicator is non-blocking, so a
    /// peer that never arrives ends the wait (the communicator is aborted and the error says how
    /// long this rank waited); an older NCCL joins blocking, without that limit.
    pub fn init(device: Device, world: usize, rank: usize, id: &NcclId, timeout: std::time::Duration) -> Result<NcclComm> {
        if world == 0 || rank >= world || world > c_int::MAX as usize {
            return Err(Error::invalid("NcclComm::init", format!("rank {rank} of a world of {world} does not exist")));
        }
        let api = api()?;
        let dev = dev_of(device)?;
        dev.bind()?;
        let mut comm: ns::ncclComm_t = std::ptr::null_mut();
        let id = ns::ncclUniqueId { internal: id.0.map(|b| b as c_char) };
        let configured = api.comm_init_rank_config.filter(|_| nccl_version().is_ok_and(|(v, _)| v >= CONFIG_VERSION));
        let Some(init_config) = configured else {
            // SAFETY: `comm` receives the new communicator; the device's context is current.
            check(api, "ncclCommInitRank", unsafe { (api.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) })?;
            return Ok(NcclComm::new(comm, dev, rank, world, false, timeout));
        };
        let mut config = Config::non_blocking();
        // SAFETY: `comm` receives the new communicator, `config` outlives the call (NCCL copies
        // it); the device's context is current.
        let r = unsafe { init_config(&mut comm, world as c_int, id, rank as c_int, &mut config) };
        if r != ns::ncclResult_t::ncclSuccess && r != ns::ncclResult_t::ncclInProgress {
            if !comm.is_null() {
                // SAFETY: a communicator that failed to start is aborted, never used again.
                unsafe { (api.comm_abort)(comm) };
            }
            return Err(match check(api, "ncclCommInitRankConfig", r) {
                Err(e) => e,
                Ok(()) => Error::Cuda("NCCL ncclCommInitRankConfig failed".into()),
            });
        }
        let comm = NcclComm::new(comm, dev, rank, world, true, timeout);
        comm.settle("joining the communicator")?;
        Ok(comm)
    }

    fn new(comm: ns::ncclComm_t, dev: Arc<Dev>, rank: usize, world: usize, non_blocking: bool, timeout: std::time::Duration) -> NcclComm {
        let (state, beside, beside_pending) = (AtomicU8::new(HEALTHY), OnceLock::new(), Default::default());
        NcclComm { comm, dev, rank, world, non_blocking, timeout, state, beside, beside_pending }
    }

    /// Waits until a non-blocking communicator's last call has finished (its asynchronous state
    /// leaves `ncclInProgress`), at most the communicator's timeout; on an error or the timeout
    /// the communicator is aborted and the error names what was waited for.
    fn settle(&self, what: &str) -> Result<()> {
        if !self.non_blocking {
            return Ok(());
        }
        let api = api()?;
        let began = std::time::Instant::now();
        loop {
            let mut r = ns::ncclResult_t::ncclInProgress;
            // SAFETY: writes one result code; allowed at any time on a live communicator.
            let q = unsafe { (api.comm_get_async_error)(self.comm, &mut r) };
            let failed = match (q, r) {
                (ns::ncclResult_t::ncclSuccess, ns::ncclResult_t::ncclSuccess) => return Ok(()),
                (ns::ncclResult_t::ncclSuccess, ns::ncclResult_t::ncclInProgress) => None,
                (ns::ncclResult_t::ncclSuccess, r) => Some(check(api, what, r)),
                (q, _) => Some(check(api, "ncclCommGetAsyncError", q)),
            };
            if let Some(e) = failed {
                self.abort();
                return e;
            }
            if began.elapsed() > self.timeout {
                self.abort();
                return Err(Error::Cuda(format!(
                    "NCCL rank {} of {}: {what} did not finish within {:.0} s (a peer missing or stuck); the communicator was aborted",
                    self.rank,
                    self.world,
                    self.timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Whether the communicator is non-blocking (NCCL ≥ 2.17: its waits end at the timeout).
    pub fn is_non_blocking(&self) -> bool {
        self.non_blocking
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Replaces `t` (an f32, f16 or bf16 tensor on this communicator's device) with the
    /// element-wise sum over the ranks, in place, on the compute stream. Every rank gets the same
    /// bytes; the summation order is NCCL's, fixed for a given world and topology.
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        let (dtype, ptr) = self.sum_arguments(t)?;
        self.issue(ptr, t.numel(), dtype, ns::ncclRedOp_t::ncclSum, self.dev.cu_stream)
    }

    /// Starts [`NcclComm::all_reduce_sum`] of `t` on the communicator's own stream, which waits for
    /// the work queued on the compute stream so far: the compute stream goes on with what follows
    /// (the rest of a backward) while the ranks sum. `t` must be neither read, written nor freed
    /// until [`NcclComm::join_beside`]; nothing else of it is touched. Started all-reduces
    /// complete in the order they were started. While the compute stream is being captured, the
    /// all-reduce is recorded on it instead (a graph's streams must join before it ends).
    pub fn all_reduce_sum_beside(&self, t: &Tensor) -> Result<()> {
        if self.dev.capturing.load(Ordering::Acquire) {
            return self.all_reduce_sum(t);
        }
        let (dtype, ptr) = self.sum_arguments(t)?;
        let beside = match self.beside.get() {
            Some(b) => b,
            None => {
                let made = CommStream::new(&self.dev)?;
                self.beside.get_or_init(|| made)
            }
        };
        self.dev.bind()?;
        beside.fork(self.dev.cu_stream)?;
        self.beside_pending.store(true, Ordering::Release);
        self.issue(ptr, t.numel(), dtype, ns::ncclRedOp_t::ncclSum, beside.stream)?;
        beside.end()
    }

    /// Ends the all-reduces started by [`NcclComm::all_reduce_sum_beside`]: the compute stream
    /// waits for them (what it queues next sees the sums), and so does the host — the wait a
    /// watchdog bounds, since a collective that a dead peer never joins spins. Nothing to do when
    /// none is pending.
    pub fn join_beside(&self) -> Result<()> {
        if !self.beside_pending.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let beside = self.beside.get().ok_or_else(|| Error::Cuda("NCCL: all-reduces pending without a communication stream".into()))?;
        self.dev.bind()?;
        beside.join(self.dev.cu_stream)
    }

    /// The NCCL type and device address of an all-reduced tensor, checked.
    fn sum_arguments(&self, t: &Tensor) -> Result<(ns::ncclDataType_t, u64)> {
        const OP: &str = "NcclComm::all_reduce_sum";
        let dtype = match t.dtype() {
            DType::F32 => ns::ncclDataType_t::ncclFloat32,
            DType::F16 => ns::ncclDataType_t::ncclFloat16,
            DType::BF16 => ns::ncclDataType_t::ncclBfloat16,
            other => return Err(Error::UnsupportedDType { op: OP, dtype: other, expected: "f32, f16 or bf16" }),
        };
        if t.device() != Device::Cuda(self.dev.ordinal) {
            return Err(Error::invalid(OP, format!("the tensor must be on cuda:{} (it is on {})", self.dev.ordinal, t.device())));
        }
        // A tensor's storage is its own dense buffer of numel values (no views with offsets), in
        // either memory format: a sum of positions is a sum of elements.
        let ptr = super::capture_support::device_ptr(t).ok_or_else(|| Error::invalid(OP, "no device buffer"))?;
        Ok((dtype, ptr))
    }

    /// [`NcclComm::all_reduce_sum`], then a wait for the device — unless its stream is being
    /// captured, where the all-reduce is recorded and completes when the graph runs.
    pub fn all_reduce_sum_waited(&self, t: &Tensor) -> Result<()> {
        self.all_reduce_sum(t)?;
        match self.dev.capturing.load(Ordering::Acquire) {
            true => Ok(()),
            false => self.dev.synchronize(),
        }
    }

    /// Replaces `values` with the element-wise maximum over the ranks (a host round trip through
    /// a small device buffer; waits for the device).
    pub fn all_reduce_max(&self, values: &mut [u64]) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let bits: Vec<i64> = values.iter().map(|&v| v as i64).collect();
        let buf = Tensor::from_vec(bits, vec![values.len()], Device::Cuda(self.dev.ordinal))?;
        let ptr = super::capture_support::device_ptr(&buf).ok_or_else(|| Error::invalid("NcclComm::all_reduce_max", "no device buffer"))?;
        self.issue(ptr, values.len(), ns::ncclDataType_t::ncclUint64, ns::ncclRedOp_t::ncclMax, self.dev.cu_stream)?;
        for (v, b) in values.iter_mut().zip(buf.to_vec::<i64>()?) {
            *v = b as u64;
        }
        Ok(())
    }

    /// One in-place all-reduce of `count` values at `ptr` on `stream` (the compute stream or the
    /// communication stream).
    fn issue(
        &self,
        ptr: u64,
        count: usize,
        dtype: ns::ncclDataType_t,
        op: ns::ncclRedOp_t,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let api = api()?;
        self.dev.bind()?;
        let p = ptr as *mut c_void;
        // SAFETY: `p` addresses `count` values of `dtype` on this communicator's device, alive
        // until the stream passes this call (the caller holds the tensor); in place is allowed.
        let r = unsafe { (api.all_reduce)(p, p, count, dtype, op, self.comm, stream as ns::cudaStream_t) };
        if self.non_blocking && r == ns::ncclResult_t::ncclInProgress {
            // Queued in the background: the stream holds the collective once NCCL is done.
            return self.settle("queueing an all-reduce");
        }
        if r != ns::ncclResult_t::ncclSuccess {
            let _ = self.state.compare_exchange(HEALTHY, FAILED, Ordering::AcqRel, Ordering::Acquire);
        }
        check(api, "ncclAllReduce", r)
    }

    /// An error NCCL met in the background (a peer gone, a network failure), if any: what a
    /// watchdog polls while a collective has not completed.
    pub fn async_error(&self) -> Result<()> {
        let api = api()?;
        let mut r = ns::ncclResult_t::ncclSuccess;
        // SAFETY: writes one result code; allowed while collectives are in flight.
        check(api, "ncclCommGetAsyncError", unsafe { (api.comm_get_async_error)(self.comm, &mut r) })?;
        if r != ns::ncclResult_t::ncclSuccess && r != ns::ncclResult_t::ncclInProgress {
            let _ = self.state.compare_exchange(HEALTHY, FAILED, Ordering::AcqRel, Ordering::Acquire);
        }
        match r {
            ns::ncclResult_t::ncclInProgress => Ok(()),
            r => check(api, "asynchronous error", r),
        }
    }

    /// Ends the communicator at once (the watchdog's way out of a collective a dead peer will
    /// never complete): its pending collectives fail, and the drop that follows does not wait.
    pub fn abort(&self) {
        if self.state.swap(ABORTED, Ordering::AcqRel) == ABORTED {
            return;
        }
        if let Ok(api) = api() {
            // SAFETY: ncclCommAbort is the one call NCCL allows while other calls on the
            // communicator are blocked; the communicator is not used by ptl afterwards (its
            // collectives return the abort's error and the drop skips it).
            unsafe { (api.comm_abort)(self.comm) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let Ok(api) = api() else { return };
        let _ = self.dev.bind();
        // SAFETY: the communicator is not used after this; a failed one is aborted (destroy
        // would wait for collectives that never complete), an aborted one is already gone.
        unsafe {
            match self.state.load(Ordering::Acquire) {
                HEALTHY => (api.comm_destroy)(self.comm),
                FAILED => (api.comm_abort)(self.comm),
                _ => ns::ncclResult_t::ncclSuccess,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration's layout is `ncclConfig_t`'s prefix of NCCL 2.17 on 64-bit targets
    /// (size, magic, version, four ints, the network name pointer, splitShare).
    #[test]
    fn the_configuration_has_the_layout_of_nccl_2_17() {
        let c = Config::non_blocking();
        let base = &c as *const Config as usize;
        let at = |p: *const u8| p as usize - base;
        assert_eq!(std::mem::size_of::<Config>(), 48);
        assert_eq!(c.size, 48);
        assert_eq!(at(&c.magic as *const _ as *const u8), 8);
        assert_eq!(at(&c.blocking as *const _ as *const u8), 16);
        assert_eq!(at(&c.net_name as *const _ as *const u8), 32);
        assert_eq!(at(&c.split_share as *const _ as *const u8), 40);
        assert_eq!((c.magic, c.version, c.blocking, c.min_ctas), (0xcafe_beef, 21701, 0, i32::MIN));
    }

    /// The search order: the named file, the loader's names, then the Python packages' copies
    /// (newest Python first) under the environment prefixes.
    #[test]
    fn nccl_is_looked_for_where_its_packages_put_it() {
        let venv = tempfile_dir("venv");
        for python in ["python3.10", "python3.12"] {
            let lib = venv.join("lib").join(python).join("site-packages/nvidia/nccl/lib");
            std::fs::create_dir_all(&lib).unwrap();
            std::fs::write(lib.join("libnccl.so.2"), b"").unwrap();
        }
        let v = venv.to_string_lossy().into_owned();
        let env = |k: &str| match k {
            "VIRTUAL_ENV" => Some(v.clone()),
            NCCL_LIBRARY_ENV => Some("/opt/nccl/libnccl.so.2".to_string()),
            _ => None,
        };
        let found = nccl_candidates(&env);
        assert_eq!(found[0], PathBuf::from("/opt/nccl/libnccl.so.2"));
        assert_eq!(found[1..3], [PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")]);
        assert_eq!(found[3], venv.join("lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"));
        assert_eq!(found[4], venv.join("lib/python3.10/site-packages/nvidia/nccl/lib/libnccl.so.2"));
        let _ = std::fs::remove_dir_all(&venv);
    }

    fn tempfile_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ptl-nccl-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

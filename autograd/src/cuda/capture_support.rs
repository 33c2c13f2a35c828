//! Support for graph recorders (the `ptl-capture` crate): a per-thread *capture scope* that
//! routes every device allocation to a recording-owned bump arena and turns illegal work during a
//! capture (host reads/synchronisation, fresh host→device uploads, allocation beyond the arena,
//! nested capture) into errors with a typed [`CaptureViolation`] the recorder can read back, plus
//! a per-thread byte counter used to size arenas during warmup.
//!
//! Arena memory is never freed one buffer at a time: a buffer allocated from the arena keeps the
//! arena alive (shared handle) and its drop is a no-op, so every address baked into a graph stays
//! reserved for as long as the recording (or any tensor on arena memory) lives.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use super::device::Dev;
use crate::{Device, Error, Result, Tensor};

/// Alignment of arena sub-allocations (what cudaMalloc guarantees).
pub const ARENA_ALIGN: usize = 256;

/// What went wrong inside a capture scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureViolation {
    /// A host read or synchronisation (`to_cpu`, `item`, `synchronize`).
    HostSync { op: &'static str },
    /// An upload of fresh host data (would be frozen into the graph).
    HostUpload { op: &'static str },
    /// An allocation that does not fit in the recording's arena.
    AllocOutsidePool { requested: usize, free: usize },
    /// A capture scope opened while another is open on this thread.
    NestedCapture,
}

impl std::fmt::Display for CaptureViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CaptureViolation::HostSync { op } => write!(f, "host synchronisation `{op}` during graph capture"),
            CaptureViolation::HostUpload { op } => write!(f, "host-to-device upload `{op}` of fresh host data during graph capture"),
            CaptureViolation::AllocOutsidePool { requested, free } => {
                write!(f, "allocation of {requested} bytes outside the recording's pool during capture ({free} bytes left in the arena)")
            }
            CaptureViolation::NestedCapture => write!(f, "nested graph capture"),
        }
    }
}

/// A bump arena: one device allocation carved into aligned pieces, reset only by dropping it.
pub struct CaptureArena {
    base: u64,
    size: usize,
    used: Cell<usize>,
    dev: Arc<Dev>,
    /// The backing tensor (holds the device memory, from whatever pool was entered at creation).
    _backing: Tensor,
}

// SAFETY: `used` is only touched by the thread that holds the arena in its capture scope.
unsafe impl Send for CaptureArena {}
unsafe impl Sync for CaptureArena {}

impl std::fmt::Debug for CaptureArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CaptureArena(cuda:{}, {} of {} bytes used)", self.dev.ordinal, self.used.get(), self.size)
    }
}

impl CaptureArena {
    /// Reserves `bytes` of device memory (from the private pool entered on this thread, if any).
    pub fn new(device: Device, bytes: usize) -> Result<Arc<CaptureArena>> {
        let dev = super::dev_of(device)?;
        let size = bytes.max(ARENA_ALIGN).next_multiple_of(ARENA_ALIGN);
        let backing = Tensor::from_storage(crate::storage::Storage::Cuda(super::CudaStorage::alloc(&dev, crate::DType::U8, size)?), size)?;
        let base = backing.with_storage(|s| match s {
            crate::storage::Storage::Cuda(c) => Ok(c.device_ptr()),
            #[allow(unreachable_patterns)]
            _ => Err(Error::invalid("CaptureArena", "backing storage is not on a CUDA device")),
        })?;
        Ok(Arc::new(CaptureArena { base, size, used: Cell::new(0), dev, _backing: backing }))
    }
    /// Capacity in bytes.
    pub fn size(&self) -> usize {
        self.size
    }
    /// Bytes handed out so far.
    pub fn used(&self) -> usize {
        self.used.get()
    }
    /// Hands the whole arena out again from its start, for the next graph recorded into it. Only
    /// for graphs that run one after another on one stream and keep nothing in the arena past
    /// their own end (a recording's backward graphs: their results go to static buffers).
    pub fn rewind(&self) {
        self.used.set(0);
    }
    fn take(&self, bytes: usize) -> std::result::Result<u64, CaptureViolation> {
        let n = bytes.max(1).next_multiple_of(ARENA_ALIGN);
        let off = self.used.get();
        if off + n > self.size {
            return Err(CaptureViolation::AllocOutsidePool { requested: bytes, free: self.size - off });
        }
        self.used.set(off + n);
        Ok(self.base + off as u64)
    }
}

struct Scope {
    arena: Arc<CaptureArena>,
}

thread_local! {
    static SCOPE: RefCell<Option<Scope>> = const { RefCell::new(None) };
    static VIOLATION: RefCell<Option<CaptureViolation>> = const { RefCell::new(None) };
    static MEASURE: Cell<Option<usize>> = const { Cell::new(None) };
}

fn violate(v: CaptureViolation) -> Error {
    let msg = v.to_string();
    VIOLATION.with(|s| {
        let mut s = s.borrow_mut();
        if s.is_none() {
            *s = Some(v);
        }
    });
    Error::Cuda(msg)
}

/// While alive, this thread is inside a capture scope (see [`enter_capture_scope`]).
pub struct CaptureScopeGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for CaptureScopeGuard {
    fn drop(&mut self) {
        SCOPE.with(|s| s.borrow_mut().take());
    }
}

/// Opens a capture scope on this thread: allocations come from `arena`, host transfers fail.
/// Clears any earlier violation. A scope already open is a [`CaptureViolation::NestedCapture`].
pub fn enter_capture_scope(arena: Arc<CaptureArena>) -> std::result::Result<CaptureScopeGuard, CaptureViolation> {
    if is_capturing() {
        return Err(CaptureViolation::NestedCapture);
    }
    VIOLATION.with(|s| s.borrow_mut().take());
    SCOPE.with(|s| *s.borrow_mut() = Some(Scope { arena }));
    Ok(CaptureScopeGuard { _not_send: std::marker::PhantomData })
}

/// Whether a capture scope is open on this thread.
pub fn is_capturing() -> bool {
    SCOPE.with(|s| s.borrow().is_some())
}

/// The first violation recorded since the scope was entered (taken).
pub fn take_capture_violation() -> Option<CaptureViolation> {
    VIOLATION.with(|s| s.borrow_mut().take())
}

/// Starts counting the bytes this thread allocates on the device (arena sizing during warmup).
pub fn begin_alloc_measure() {
    MEASURE.with(|m| m.set(Some(0)));
}

/// Whether this thread is counting its allocations ([`begin_alloc_measure`]): a recorder's warm-up.
pub(crate) fn is_measuring() -> bool {
    MEASURE.with(|m| m.get().is_some())
}

/// Stops counting; returns the bytes (each request rounded up to [`ARENA_ALIGN`]).
pub fn end_alloc_measure() -> usize {
    MEASURE.with(|m| m.take()).unwrap_or(0)
}

/// Called by the allocator: inside a scope, serves the request from the arena.
pub(crate) fn arena_alloc(dev: &Arc<Dev>, bytes: usize) -> Option<Result<(u64, Arc<CaptureArena>)>> {
    MEASURE.with(|m| {
        if let Some(n) = m.get() {
            m.set(Some(n + bytes.max(1).next_multiple_of(ARENA_ALIGN)));
        }
    });
    SCOPE.with(|s| {
        let s = s.borrow();
        let scope = s.as_ref()?;
        if scope.arena.dev.ordinal != dev.ordinal {
            return Some(Err(violate(CaptureViolation::AllocOutsidePool { requested: bytes, free: 0 })));
        }
        Some(scope.arena.take(bytes).map(|p| (p, scope.arena.clone())).map_err(violate))
    })
}

/// Called by host-synchronising entry points: an error inside a capture scope.
pub(crate) fn check_host_sync(op: &'static str) -> Result<()> {
    if is_capturing() {
        return Err(violate(CaptureViolation::HostSync { op }));
    }
    Ok(())
}

/// Called by host→device uploads: an error inside a capture scope.
pub(crate) fn check_host_upload(op: &'static str) -> Result<()> {
    if is_capturing() {
        return Err(violate(CaptureViolation::HostUpload { op }));
    }
    Ok(())
}

/// Device address of a tensor's buffer (`None` for host tensors).
pub fn device_ptr(t: &Tensor) -> Option<u64> {
    t.with_storage(|s| match s {
        crate::storage::Storage::Cuda(c) => Some(c.device_ptr()),
        #[allow(unreachable_patterns)]
        _ => None,
    })
}

//! The capture scope (see `capture_support`): the thread's open arena, the checks that turn work
//! a capture must not do into typed violations, and the warm-up's allocation trace. Below the
//! allocator, which asks it where each allocation goes.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::device::Dev;
use super::mapped_range::MappedRange;
use crate::arena_plan::{AllocTrace, ArenaPlan, Placer};
use crate::{Error, Result};

/// Alignment of arena sub-allocations (what cudaMalloc guarantees).
pub const ARENA_ALIGN: usize = 256;

/// What went wrong inside a capture scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureViolation {
    /// A host read or synchronisation (`to_cpu`, `item`, `synchronize`).
    HostSync {
        /// The operation.
        op: &'static str,
    },
    /// An upload of fresh host data (would be frozen into the graph).
    HostUpload {
        /// The operation.
        op: &'static str,
    },
    /// An allocation that does not fit in the recording's arena.
    AllocOutsidePool {
        /// Bytes asked for.
        requested: usize,
        /// Bytes left in the arena.
        free: usize,
    },
    /// A capture scope opened while another is open on this thread.
    NestedCapture,
    /// A library's device-lifetime workspace (`library`: cuDNN, cuBLAS) would have to grow, which
    /// a capture must not do: its arena's bytes are reused, rewound or given back later.
    WorkspaceGrowth {
        /// The library (cuDNN, cuBLAS).
        library: &'static str,
        /// Bytes asked for.
        requested: usize,
    },
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
            CaptureViolation::WorkspaceGrowth { library, requested } => write!(
                f,
                "{library}'s workspace would have to grow to {requested} bytes during graph capture (run the work natively once first, as a recorder's warm-up does)"
            ),
        }
    }
}

/// One device allocation carved into aligned pieces: planned offsets first (see the module
/// documentation), the rest bump-allocated after the planned part; memory returns only when the
/// arena is dropped.
pub struct CaptureArena {
    base: u64,
    size: AtomicUsize,
    dev: Arc<Dev>,
    state: Mutex<Placer>,
    /// The capture's own allocations and frees, in order (by offset while live).
    traced: Mutex<(AllocTrace, HashMap<usize, usize>)>,
    /// Memory at reserved addresses that can grow, be given back and be mapped again
    /// ([`CaptureArena::growable`]).
    mapped: Option<MappedRange>,
    /// What else holds the addresses (device memory, or an aliased range), kept until the arena
    /// drops.
    _backing: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for CaptureArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CaptureArena(cuda:{}, {} of {} bytes used)", self.dev.ordinal, self.used(), self.size())
    }
}

impl CaptureArena {
    /// An arena over `size` addresses from `base`, laid out by `plan`, holding `backing` (what
    /// keeps the addresses valid) until it drops.
    pub(crate) fn over(
        dev: Arc<Dev>,
        base: u64,
        size: usize,
        plan: ArenaPlan,
        backing: Box<dyn std::any::Any + Send + Sync>,
    ) -> Arc<CaptureArena> {
        let state = Mutex::new(Placer::new(plan, size));
        Arc::new(CaptureArena { base, size: AtomicUsize::new(size), dev, state, traced: Mutex::default(), mapped: None, _backing: backing })
    }

    /// An arena over `range`, laid out by `plan`: it can grow in place ([`CaptureArena::grow`])
    /// and give its memory back between replays ([`CaptureArena::evict`]).
    pub(crate) fn over_range(dev: Arc<Dev>, range: MappedRange, plan: ArenaPlan) -> Arc<CaptureArena> {
        let (base, size) = (range.base(), range.bytes());
        let state = Mutex::new(Placer::new(plan, size));
        Arc::new(CaptureArena {
            base,
            size: AtomicUsize::new(size),
            dev,
            state,
            traced: Mutex::default(),
            mapped: Some(range),
            _backing: Box::new(()),
        })
    }

    /// Grows a growable arena to at least `bytes` in place (the addresses recorded graphs baked
    /// keep their meaning). `false`: this arena cannot grow.
    pub fn grow(&self, bytes: usize) -> Result<bool> {
        let Some(range) = &self.mapped else { return Ok(false) };
        let size = range.grow(bytes)?;
        self.size.store(size, Ordering::Relaxed);
        Ok(true)
    }

    /// Gives a growable arena's memory back to the driver (after waiting for the device): its
    /// graphs must not run until [`CaptureArena::restore`], and whatever it held is lost. For an
    /// arena that holds nothing between its graphs' replays, while native work runs beside them.
    /// `false`: not growable, or already evicted.
    pub fn evict(&self) -> Result<bool> {
        match &self.mapped {
            Some(range) => range.evict(),
            None => Ok(false),
        }
    }

    /// Maps memory under an evicted arena again (its bytes are undefined: its graphs write every
    /// piece before reading it).
    pub fn restore(&self) -> Result<()> {
        match &self.mapped {
            Some(range) => range.restore(),
            None => Ok(()),
        }
    }

    /// Whether the arena's memory is mapped (always, unless evicted).
    pub fn resident(&self) -> bool {
        self.mapped.as_ref().is_none_or(MappedRange::resident)
    }

    /// The allocations and frees made in this arena so far, in order (pieces still live have no
    /// free): the trace of the capture made into it.
    pub fn trace(&self) -> AllocTrace {
        self.traced.lock().unwrap_or_else(|e| e.into_inner()).0.clone()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Placer> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Capacity in bytes.
    pub fn size(&self) -> usize {
        self.size.load(Ordering::Relaxed)
    }
    /// The most bytes in use at once so far (the planned part counts once it is reached).
    pub fn used(&self) -> usize {
        self.state().high
    }
    /// Allocations that took their planned offset, and those that went to the tail.
    pub fn placement_counts(&self) -> (usize, usize) {
        let s = self.state();
        (s.planned_hits, s.tail_allocs)
    }
    /// Hands the whole arena out again from its start, laid out as `plan` says, for the next
    /// graph recorded into it. Only for graphs that run one after another on one stream and keep
    /// nothing in the arena past their own end (backward graphs: their results go to static
    /// buffers). `plan` must fit: `plan.bytes` ≤ the arena's size.
    pub fn rewind(&self, plan: ArenaPlan) {
        *self.state() = Placer::new(plan, self.size());
    }
    fn take(&self, bytes: usize) -> std::result::Result<u64, CaptureViolation> {
        let n = bytes.max(1).next_multiple_of(ARENA_ALIGN);
        let mut s = self.state();
        match s.place(n) {
            Some(off) => {
                let mut t = self.traced.lock().unwrap_or_else(|e| e.into_inner());
                let id = t.0.alloc(n);
                t.1.insert(off, id);
                Ok(self.base + off as u64)
            }
            None => Err(CaptureViolation::AllocOutsidePool { requested: bytes, free: s.tail_free() }),
        }
    }
    /// A piece was dropped: its bytes may take a later planned buffer of the same recording.
    pub(crate) fn release(&self, ptr: u64) {
        if let Some(off) = ptr.checked_sub(self.base) {
            self.state().release(off as usize);
            let mut t = self.traced.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(id) = t.1.remove(&(off as usize)) {
                t.0.free(id);
            }
        }
    }
}

struct Scope {
    arena: Arc<CaptureArena>,
}

/// What a warm-up allocated: the sum, and the trace of allocations and frees by address.
#[derive(Default)]
struct Measure {
    bytes: usize,
    trace: AllocTrace,
    ids: HashMap<u64, usize>,
}

thread_local! {
    static SCOPE: RefCell<Option<Scope>> = const { RefCell::new(None) };
    static VIOLATION: RefCell<Option<CaptureViolation>> = const { RefCell::new(None) };
    static MEASURE: RefCell<Option<Measure>> = const { RefCell::new(None) };
    static MEASURING: Cell<bool> = const { Cell::new(false) };
}

/// Records `v` as the scope's violation (the first one stays) and returns it as an error.
pub(crate) fn violation(v: CaptureViolation) -> Error {
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

/// Starts recording the device allocations and frees of this thread (a recorder's warm-up: arena
/// sizing and planning).
pub fn begin_alloc_measure() {
    MEASURE.with(|m| *m.borrow_mut() = Some(Measure::default()));
    MEASURING.with(|m| m.set(true));
}

/// Whether this thread is recording its allocations ([`begin_alloc_measure`]): a recorder's warm-up.
pub(crate) fn is_measuring() -> bool {
    MEASURING.with(|m| m.get())
}

/// Runs `f` with this thread's allocation trace paused: what it allocates is not part of the
/// region being measured (the write journal's copies).
pub(crate) fn unmeasured<R>(f: impl FnOnce() -> R) -> R {
    let was = MEASURING.with(|m| m.replace(false));
    let r = f();
    MEASURING.with(|m| m.set(was));
    r
}

/// What a warm-up allocated, from [`end_alloc_measure`].
#[derive(Clone, Debug, Default)]
pub struct Measured {
    /// The sum of its allocations (each rounded up to [`ARENA_ALIGN`]).
    pub bytes: usize,
    /// Its allocations and frees in order (sizes rounded up to [`ARENA_ALIGN`]).
    pub trace: AllocTrace,
}

/// Stops recording; returns what was allocated since [`begin_alloc_measure`].
pub fn end_alloc_measure() -> Measured {
    MEASURING.with(|m| m.set(false));
    MEASURE.with(|m| m.borrow_mut().take()).map(|m| Measured { bytes: m.bytes, trace: m.trace }).unwrap_or_default()
}

/// Called by the allocator after a device allocation outside an arena (recorded while measuring).
pub(crate) fn note_alloc(ptr: u64, bytes: usize) {
    if !is_measuring() {
        return;
    }
    MEASURE.with(|m| {
        if let Some(m) = m.borrow_mut().as_mut() {
            let n = bytes.max(1).next_multiple_of(ARENA_ALIGN);
            m.bytes += n;
            let id = m.trace.alloc(n);
            m.ids.insert(ptr, id);
        }
    });
}

/// Called by the allocator when a buffer outside an arena is freed (recorded while measuring).
pub(crate) fn note_free(ptr: u64) {
    if !is_measuring() {
        return;
    }
    MEASURE.with(|m| {
        if let Some(m) = m.borrow_mut().as_mut() {
            if let Some(id) = m.ids.remove(&ptr) {
                m.trace.free(id);
            }
        }
    });
}

/// Called by the allocator: inside a scope, serves the request from the arena.
pub(crate) fn arena_alloc(dev: &Arc<Dev>, bytes: usize) -> Option<Result<(u64, Arc<CaptureArena>)>> {
    SCOPE.with(|s| {
        let s = s.borrow();
        let scope = s.as_ref()?;
        if scope.arena.dev.ordinal != dev.ordinal {
            return Some(Err(violation(CaptureViolation::AllocOutsidePool { requested: bytes, free: 0 })));
        }
        Some(scope.arena.take(bytes).map(|p| (p, scope.arena.clone())).map_err(violation))
    })
}

/// Called by host-synchronising entry points: an error inside a capture scope.
pub(crate) fn check_host_sync(op: &'static str) -> Result<()> {
    if is_capturing() {
        return Err(violation(CaptureViolation::HostSync { op }));
    }
    Ok(())
}

/// Called by host→device uploads: an error inside a capture scope.
pub(crate) fn check_host_upload(op: &'static str) -> Result<()> {
    if is_capturing() {
        return Err(violation(CaptureViolation::HostUpload { op }));
    }
    Ok(())
}

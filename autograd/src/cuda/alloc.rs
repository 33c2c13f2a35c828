//! The caching allocator view: stream-ordered allocations (`cuMemAllocFromPoolAsync`) on the
//! device's compute stream, from the device's default pool (release threshold raised to
//! `u64::MAX`, so freed memory stays cached) or from a private [`MemPool`] while one is entered on
//! the calling thread. Statistics follow PyTorch's `memory_allocated` / `memory_reserved` and their
//! peaks.
//!
//! In front of the default pool sits a host-side block cache (like PyTorch's caching allocator):
//! a freed block goes onto a free list of its size and the next request it fits (with at most 1/8
//! to spare) takes it back without a driver call (an alloc + free pair costs ~0.6–1.1 µs of host time in the driver,
//! a sizeable part of a ~4 µs eager op). Reuse is safe because a freed buffer comes back in the
//! compute stream's order: work queued with the new owner runs after the old owner's (a buffer a
//! side task may still touch is held until the compute stream joins it, `side_stream`). The cache is
//! off by default (it costs reserved memory, see `block_cache::CACHE_LIMIT`; `PTL_CUDA_BLOCK_CACHE` or
//! [`set_block_cache_limits`] turn it on), bypassed while the stream is captured and for private
//! pools, and emptied into the pool when an allocation fails or on [`empty_cache`].

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{result as dr, sys};

use super::device::{cu_err, Dev};
use crate::{Device, Error, Result};

/// Sets the block cache's limits on `device` (bytes in all, largest cached block), returning the
/// previous ones; cached blocks go back to the pool first. Like `CACHE_ENV`, at run time.
pub fn set_block_cache_limits(device: Device, limit: u64, max_block: usize) -> Result<(u64, usize)> {
    let dev = super::device::dev_of(device)?;
    flush_block_cache(&dev);
    let before = dev.block_cache.lock().unwrap_or_else(|e| e.into_inner()).set_limits(limit, max_block);
    Ok(before)
}

/// Returns `ptrs` to `dev`'s default pool (stream-ordered frees).
fn free_to_pool(dev: &Dev, ptrs: Vec<sys::CUdeviceptr>) {
    for p in ptrs {
        if let Err(e) = unsafe { dr::free_async(p, dev.cu_stream) } {
            dev.record_deferred("cuMemFreeAsync (block cache)", e);
        }
    }
}

/// The size actually allocated for a request: rounded so that nearby sizes share free lists.
fn block_size(bytes: usize) -> usize {
    let n = bytes.max(1);
    if n <= 1 << 20 {
        n.next_multiple_of(512)
    } else {
        n.next_multiple_of(128 << 10)
    }
}

/// Returns every cached block of `dev` to the default pool (stream-ordered frees).
fn flush_block_cache(dev: &Dev) {
    let blocks = dev.block_cache.lock().unwrap_or_else(|e| e.into_inner()).drain();
    free_to_pool(dev, blocks);
}

/// A device buffer owned by one tensor storage. Freed stream-ordered on drop.
pub(crate) struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    /// Size of the underlying block (≥ `bytes`; 0 for arena memory).
    block: usize,
    pub dev: Arc<Dev>,
    /// Keeps a private pool alive while memory from it is live.
    _pool: Option<Arc<PoolInner>>,
    /// Set for memory carved from a recorder's capture arena (never freed on its own).
    _arena: Option<Arc<super::capture_scope::CaptureArena>>,
    /// The side task that allocated it (0: the compute stream's work): its contents are written
    /// by that task until the compute stream joins it ([`super::side_stream`]).
    pub side_task: u64,
    /// The last side task that cannot touch it (its work was queued before this buffer existed):
    /// a free needs to wait only for later ones.
    side_born: u64,
}

// SAFETY: a device pointer is a plain address; access is ordered on the device's stream.
unsafe impl Send for DevBuf {}
unsafe impl Sync for DevBuf {}

static POISON: AtomicBool = AtomicBool::new(false);

/// Testing aid: when on, every new device allocation is filled with 0xFF bytes (NaN for floats,
/// -1 for integers) before use, so a kernel that leaves an output element unwritten is caught.
pub fn set_poison_allocations(on: bool) {
    POISON.store(on, Ordering::Relaxed);
}

thread_local! {
    /// Private pools entered on this thread (innermost last).
    static POOL_STACK: RefCell<Vec<Arc<PoolInner>>> = const { RefCell::new(Vec::new()) };
}

impl DevBuf {
    /// Uninitialised memory for `bytes` bytes (callers write every byte before reading).
    pub fn alloc(dev: &Arc<Dev>, bytes: usize) -> Result<DevBuf> {
        dev.bind()?;
        if let Some(r) = super::capture_scope::arena_alloc(dev, bytes) {
            let (ptr, arena) = r?;
            if POISON.load(Ordering::Relaxed) {
                // Recorded into the graph: every replay poisons the piece again, so a kernel that
                // reads bytes another buffer of the plan left there is caught too.
                let n = bytes.max(1).next_multiple_of(super::capture_scope::ARENA_ALIGN);
                unsafe { dr::memset_d8_async(ptr, 0xFF, n, dev.stream()) }.map_err(|e| cu_err("cuMemsetD8Async (poison)", e))?;
            }
            let (side_task, side_born) = dev.side_birth();
            return Ok(DevBuf { ptr, bytes, block: 0, dev: dev.clone(), _pool: None, _arena: Some(arena), side_task, side_born });
        }
        let pool = POOL_STACK.with(|s| {
            let s = s.borrow();
            if s.is_empty() {
                None
            } else {
                s.iter().rev().find(|p| p.dev.ordinal == dev.ordinal).cloned()
            }
        });
        let raw_pool = pool.as_ref().map(|p| p.pool).unwrap_or(dev.default_pool);
        // A zero-byte request still gets a distinct (tiny) allocation so pointers stay unique.
        let mut block = block_size(bytes);
        let cacheable = pool.is_none() && !dev.capturing.load(Ordering::Relaxed);
        let cached = if cacheable { dev.block_cache.lock().unwrap_or_else(|e| e.into_inner()).take(block) } else { None };
        let ptr = match cached {
            Some((p, size)) => {
                block = size;
                p
            }
            None => {
                let fresh = unsafe { dr::mem_pool::alloc_async(raw_pool, block, dev.cu_stream) };
                match fresh {
                    Ok(p) => p,
                    // Out of memory with blocks parked in the cache: give them back and retry once.
                    Err(_) if cacheable && dev.block_cache.lock().unwrap_or_else(|e| e.into_inner()).bytes() > 0 => {
                        flush_block_cache(dev);
                        unsafe { dr::mem_pool::alloc_async(raw_pool, block, dev.cu_stream) }.map_err(|e| oom(dev, block, e))?
                    }
                    Err(e) => return Err(oom(dev, block, e)),
                }
            }
        };
        if dev.note_alloc(bytes.max(1) as u64) {
            dev.peak_context.store(PeakContext::now().pack(), Ordering::Relaxed);
        }
        super::capture_scope::note_alloc(ptr, bytes);
        if POISON.load(Ordering::Relaxed) {
            unsafe { dr::memset_d8_async(ptr, 0xFF, block, dev.stream()) }.map_err(|e| cu_err("cuMemsetD8Async (poison)", e))?;
        }
        let (side_task, side_born) = dev.side_birth();
        Ok(DevBuf { ptr, bytes, block, dev: dev.clone(), _pool: pool, _arena: None, side_task, side_born })
    }
}

/// A failed pool allocation: [`Error::OutOfMemory`] when the driver says so (a caller can shrink
/// the work and try again), any other failure as it came.
fn oom(dev: &Dev, block: usize, e: cudarc::driver::DriverError) -> Error {
    if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
        let free = dr::mem_get_info().map_or(0, |(free, _)| free as u64);
        return Error::OutOfMemory { device: dev.ordinal, bytes: block as u64, free };
    }
    Error::Cuda(format!("cuMemAllocFromPoolAsync of {block} bytes on cuda:{} failed: {e:?}", dev.ordinal))
}

/// The driver's (free, total) bytes of `device` (`cuMemGetInfo`; what `torch.cuda.mem_get_info`
/// reports): memory the pools have reserved counts as used.
pub fn device_memory(device: Device) -> Result<(u64, u64)> {
    let dev = cuda_dev(device)?;
    dev.bind()?;
    let (free, total) = dr::mem_get_info().map_err(|e| cu_err("cuMemGetInfo", e))?;
    Ok((free as u64, total as u64))
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let freed = Freed {
            ptr: self.ptr,
            bytes: self.bytes,
            block: self.block,
            dev: self.dev.clone(),
            pool: self._pool.take(),
            arena: self._arena.take(),
        };
        // While side tasks that may read or write it are unjoined (any forked after it existed),
        // the free waits for their join (`side_stream`). Released outside the lock: a pool's drop
        // synchronises, which joins.
        let now = {
            let mut side = self.dev.side.lock().unwrap_or_else(|e| e.into_inner());
            if side.ledger.must_hold(self.side_born) {
                side.ledger.hold(Box::new(freed));
                None
            } else {
                Some(freed)
            }
        };
        if let Some(freed) = now {
            freed.release_now();
        }
    }
}

/// A dropped buffer's memory, on its way back to the arena, the block cache or the pool.
pub(crate) struct Freed {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    block: usize,
    dev: Arc<Dev>,
    pool: Option<Arc<PoolInner>>,
    arena: Option<Arc<super::capture_scope::CaptureArena>>,
}

impl super::side_tasks::Held for Freed {
    fn bytes(&self) -> usize {
        self.bytes
    }
    fn release(self: Box<Self>) {
        self.release_now();
    }
}

impl Freed {
    /// Gives the memory back: a later request may take it, ordered after the compute stream's
    /// work queued so far.
    pub(crate) fn release_now(self) {
        let dev = &*self.dev;
        if let Some(a) = &self.arena {
            a.release(self.ptr);
            return;
        }
        if dev.bind().is_err() {
            return;
        }
        super::capture_scope::note_free(self.ptr);
        dev.note_free(self.bytes.max(1) as u64);
        if self.pool.is_none()
            && !dev.capturing.load(Ordering::Relaxed)
            && dev.block_cache.lock().unwrap_or_else(|e| e.into_inner()).put(self.block, self.ptr)
        {
            return;
        }
        if let Err(e) = unsafe { dr::free_async(self.ptr, dev.cu_stream) } {
            dev.record_deferred("cuMemFreeAsync", e);
        }
    }
}

/// What the work that set a device's allocated peak was part of: the stage tag it ran under
/// ([`crate::internal::stage`]), whether a graph capture was being recorded, and whether a
/// recorder's warm-up was being measured — where to look when a peak is larger than expected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeakContext {
    /// The stage tag the work ran under.
    pub stage: u8,
    /// Whether a graph capture was being recorded.
    pub capturing: bool,
    /// Whether a recorder's warm-up was being measured.
    pub measuring: bool,
}

impl PeakContext {
    /// This thread's context now.
    pub(crate) fn now() -> PeakContext {
        PeakContext {
            stage: crate::stage::current(),
            capturing: super::capture_scope::is_capturing(),
            measuring: super::capture_scope::is_measuring(),
        }
    }
    pub(crate) fn pack(self) -> u32 {
        self.stage as u32 | (self.capturing as u32) << 8 | (self.measuring as u32) << 9
    }
    fn unpack(v: u32) -> PeakContext {
        PeakContext { stage: v as u8, capturing: v & 1 << 8 != 0, measuring: v & 1 << 9 != 0 }
    }
}

/// Allocator statistics of one device, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes held by live tensors (and workspaces) right now (`torch.cuda.memory_allocated`).
    pub allocated: u64,
    /// Bytes the pools hold from the driver right now (`torch.cuda.memory_reserved`).
    pub reserved: u64,
    /// Peak of `allocated` since the last [`reset_peak_memory_stats`].
    pub peak_allocated: u64,
    /// Peak of `reserved` since the last reset (sum of the pools' high-water marks, destroyed
    /// private pools and mapped arenas included: exact while only one pool is in use, an upper
    /// bound with private pools or mapped arenas).
    pub peak_reserved: u64,
    /// What set `peak_allocated`.
    pub peak_context: PeakContext,
}

fn pool_attr(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64> {
    let mut v = 0u64;
    unsafe { dr::mem_pool::get_attribute(pool, attr, &mut v as *mut u64 as *mut c_void) }
        .map_err(|e| cu_err("cuMemPoolGetAttribute", e))?;
    Ok(v)
}

fn reset_pool_peaks(pool: sys::CUmemoryPool) -> Result<()> {
    for attr in [sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH] {
        let mut z = 0u64;
        unsafe { dr::mem_pool::set_attribute(pool, attr, &mut z as *mut u64 as *mut c_void) }
            .map_err(|e| cu_err("cuMemPoolSetAttribute", e))?;
    }
    Ok(())
}

fn cuda_dev(device: Device) -> Result<Arc<Dev>> {
    match device {
        Device::Cuda(n) => Dev::get(n).map_err(Error::CudaUnavailable),
        Device::Cpu => Err(Error::invalid("cuda", "this call needs a CUDA device, got cpu")),
    }
}

/// The private pools made on each device (by ordinal), held weakly: statistics sum the live ones.
fn private_pools() -> &'static std::sync::Mutex<std::collections::HashMap<usize, Vec<std::sync::Weak<PoolInner>>>> {
    static POOLS: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<usize, Vec<std::sync::Weak<PoolInner>>>>> =
        std::sync::OnceLock::new();
    POOLS.get_or_init(Default::default)
}

fn live_pools(dev: &Dev) -> Vec<Arc<PoolInner>> {
    let mut all = private_pools().lock().unwrap_or_else(|e| e.into_inner());
    let v = all.entry(dev.ordinal).or_default();
    v.retain(|w| w.strong_count() > 0);
    v.iter().filter_map(|w| w.upgrade()).collect()
}

/// Current and peak allocated/reserved bytes of `device` (default pool, live private pools and
/// arenas mapped at reserved addresses).
pub fn memory_stats(device: Device) -> Result<MemoryStats> {
    let dev = cuda_dev(device)?;
    let mut reserved = pool_attr(dev.default_pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
    let mut peak_reserved = pool_attr(dev.default_pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?
        + dev.released_pool_peaks.load(Ordering::Relaxed)
        + dev.peak_mapped.load(Ordering::Relaxed);
    reserved += dev.mapped.load(Ordering::Relaxed);
    for p in live_pools(&dev) {
        reserved += pool_attr(p.pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        peak_reserved += pool_attr(p.pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?;
    }
    Ok(MemoryStats {
        allocated: dev.allocated.load(Ordering::Relaxed),
        reserved,
        peak_allocated: dev.peak_allocated.load(Ordering::Relaxed),
        peak_reserved: peak_reserved.max(reserved),
        peak_context: PeakContext::unpack(dev.peak_context.load(Ordering::Relaxed)),
    })
}

/// Bytes allocated from the live private pools of `device` and mapped for arenas (recorded
/// graphs' arenas and static buffers), part of [`MemoryStats::allocated`].
pub fn private_pool_allocated_bytes(device: Device) -> Result<u64> {
    let dev = cuda_dev(device)?;
    let pools: u64 = live_pools(&dev)
        .iter()
        .map(|p| pool_attr(p.pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT))
        .sum::<Result<u64>>()?;
    Ok(pools + dev.mapped.load(Ordering::Relaxed))
}

/// Resets the peaks to the current values (`torch.cuda.reset_peak_memory_stats`).
pub fn reset_peak_memory_stats(device: Device) -> Result<()> {
    let dev = cuda_dev(device)?;
    dev.peak_allocated.store(dev.allocated.load(Ordering::Relaxed), Ordering::Relaxed);
    dev.released_pool_peaks.store(0, Ordering::Relaxed);
    dev.peak_mapped.store(dev.mapped.load(Ordering::Relaxed), Ordering::Relaxed);
    dev.peak_context.store(PeakContext::now().pack(), Ordering::Relaxed);
    reset_pool_peaks(dev.default_pool)?;
    for p in live_pools(&dev) {
        reset_pool_peaks(p.pool)?;
    }
    Ok(())
}

/// Returns cached, unused memory (the block cache and the default pool's free memory) to the
/// driver (`torch.cuda.empty_cache`).
pub fn empty_cache(device: Device) -> Result<()> {
    let dev = cuda_dev(device)?;
    dev.bind()?;
    flush_block_cache(&dev);
    dev.synchronize()?;
    unsafe { dr::mem_pool::trim_to(dev.default_pool, 0) }.map_err(|e| cu_err("cuMemPoolTrimTo", e))
}

/// Waits until every queued operation on `device`'s compute stream has finished, then reports any
/// error recorded by a stream-ordered free.
pub fn synchronize(device: Device) -> Result<()> {
    super::capture_scope::check_host_sync("synchronize")?;
    let dev = cuda_dev(device)?;
    dev.synchronize()?;
    if let Some(e) = dev.deferred_error.lock().unwrap_or_else(|e| e.into_inner()).take() {
        return Err(Error::Cuda(e));
    }
    Ok(())
}

pub(crate) struct PoolInner {
    pub pool: sys::CUmemoryPool,
    pub dev: Arc<Dev>,
}
unsafe impl Send for PoolInner {}
unsafe impl Sync for PoolInner {}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Every buffer of the pool is gone (they hold the Arc); wait for their frees, then destroy.
        if let Ok(high) = pool_attr(self.pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) {
            self.dev.released_pool_peaks.fetch_add(high, Ordering::Relaxed);
        }
        if self.dev.synchronize().is_ok() {
            if let Err(e) = unsafe { dr::mem_pool::destroy(self.pool) } {
                self.dev.record_deferred("cuMemPoolDestroy", e);
            }
        }
    }
}

/// A private memory pool (like PyTorch's graph pools): allocations made on this thread while a
/// [`MemPoolGuard`] is alive come from it. The pool's memory returns to the driver as a whole when
/// the `MemPool` handle and every buffer allocated from it are dropped.
///
/// ```text
/// let pool = ptl_autograd::cuda::MemPool::new(Device::Cuda(0))?;
/// {
///     let _g = pool.enter();
///     let y = x.conv2d(&w, ...)?; // y's memory comes from `pool`
/// }
/// println!("{:?}", pool.stats()?);
/// ```
#[derive(Clone)]
pub struct MemPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for MemPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemPool(cuda:{}, {:p})", self.inner.dev.ordinal, self.inner.pool)
    }
}

/// While alive, allocations on this thread (for the pool's device) use the pool.
pub struct MemPoolGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for MemPoolGuard {
    fn drop(&mut self) {
        POOL_STACK.with(|s| {
            s.borrow_mut().pop();
        });
    }
}

impl MemPool {
    /// Creates a device-local pool that keeps freed memory cached (release threshold `u64::MAX`).
    pub fn new(device: Device) -> Result<MemPool> {
        let dev = cuda_dev(device)?;
        dev.bind()?;
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = dev.ordinal as i32;
        let pool = unsafe { dr::mem_pool::create(&props) }.map_err(|e| cu_err("cuMemPoolCreate", e))?;
        let mut thr = u64::MAX;
        unsafe {
            dr::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut thr as *mut u64 as *mut c_void,
            )
        }
        .map_err(|e| cu_err("cuMemPoolSetAttribute", e))?;
        let inner = Arc::new(PoolInner { pool, dev: dev.clone() });
        private_pools().lock().unwrap_or_else(|e| e.into_inner()).entry(dev.ordinal).or_default().push(Arc::downgrade(&inner));
        Ok(MemPool { inner })
    }

    /// Routes this thread's allocations on the pool's device to this pool until the guard drops.
    pub fn enter(&self) -> MemPoolGuard {
        POOL_STACK.with(|s| s.borrow_mut().push(self.inner.clone()));
        MemPoolGuard { _not_send: std::marker::PhantomData }
    }

    /// Runs `f` with allocations routed to this pool.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        let _g = self.enter();
        f()
    }

    /// The pool's device.
    pub fn device(&self) -> Device {
        Device::Cuda(self.inner.dev.ordinal)
    }

    /// This pool's used/reserved bytes (current and high-water marks).
    pub fn stats(&self) -> Result<MemoryStats> {
        let p = self.inner.pool;
        Ok(MemoryStats {
            allocated: pool_attr(p, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            reserved: pool_attr(p, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            peak_allocated: pool_attr(p, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            peak_reserved: pool_attr(p, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            peak_context: PeakContext::default(),
        })
    }

    /// Returns the pool's unused cached memory to the driver (after the stream drains).
    pub fn trim(&self) -> Result<()> {
        self.inner.dev.synchronize()?;
        unsafe { dr::mem_pool::trim_to(self.inner.pool, 0) }.map_err(|e| cu_err("cuMemPoolTrimTo", e))
    }

    /// The raw `CUmemoryPool` (for graph recorders that pass it to the driver).
    pub fn raw(&self) -> sys::CUmemoryPool {
        self.inner.pool
    }
}

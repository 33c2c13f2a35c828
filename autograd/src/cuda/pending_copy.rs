//! A device→host copy queued on the compute stream into pinned memory, with an event that says
//! when it is done: the CUDA side of [`crate::PendingRead`].

use std::sync::Arc;

use cudarc::driver::{result as dr, sys};

use super::device::{cu_err, Dev};
use super::storage::CudaStorage;
use super::{capture_scope, counters};
use crate::{DType, Error, Result};

/// Size of the pooled pinned buffers: reads up to this many bytes reuse one.
const PINNED_READ_BYTES: usize = 4096;

/// See the module doc. Dropping it waits for the copy (the DMA may not outlive its buffer).
pub struct PendingCopy {
    dev: Arc<Dev>,
    ptr: *mut u8,
    bytes: usize,
    pooled: bool,
    event: sys::CUevent,
    done: bool,
}

// SAFETY: the pinned buffer and the event belong to this value alone.
unsafe impl Send for PendingCopy {}

impl std::fmt::Debug for PendingCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PendingCopy({} bytes, done: {})", self.bytes, self.done)
    }
}

impl PendingCopy {
    /// Queues the copy of an f32 storage (asynchronous: no host sync).
    pub(crate) fn start(src: &CudaStorage) -> Result<PendingCopy> {
        if src.dtype != DType::F32 {
            return Err(Error::UnsupportedDType { op: "read_later", dtype: src.dtype, expected: "F32" });
        }
        capture_scope::check_host_sync("read_later")?;
        let dev = src.buf.dev.clone();
        dev.bind()?;
        // What side tasks wrote is read after the compute stream joins them.
        dev.join_side_tasks()?;
        let bytes = src.len * 4;
        let pooled = bytes <= PINNED_READ_BYTES;
        let reuse = if pooled { dev.pinned_reads.lock().unwrap_or_else(|e| e.into_inner()).pop() } else { None };
        let ptr = match reuse {
            Some(p) => p as *mut u8,
            None => {
                let len = if pooled { PINNED_READ_BYTES } else { bytes.max(1) };
                unsafe { dr::malloc_host(len, 0) }.map_err(|e| cu_err("cuMemHostAlloc", e))? as *mut u8
            }
        };
        let event = dr::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| cu_err("cuEventCreate", e))?;
        let pending = PendingCopy { dev, ptr, bytes, pooled, event, done: bytes == 0 };
        if bytes > 0 {
            counters::count(counters::Count::DeviceToHost);
            // SAFETY: `ptr` holds at least `bytes` pinned bytes and lives until the event has fired
            // (`Drop` waits for it); the source buffer is kept alive by the stream order.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(pending.ptr as *mut std::ffi::c_void, src.buf.ptr, bytes, pending.dev.cu_stream)
                    .result()
                    .map_err(|e| cu_err("cuMemcpyDtoHAsync (deferred read)", e))?;
                dr::event::record(pending.event, pending.dev.cu_stream).map_err(|e| cu_err("cuEventRecord", e))?;
            }
        }
        Ok(pending)
    }

    /// Whether the copy has finished (a non-blocking event query).
    pub fn poll(&mut self) -> Result<bool> {
        if self.done {
            return Ok(true);
        }
        self.dev.bind()?;
        self.done = super::device::event_reached(self.event)?;
        Ok(self.done)
    }

    /// Waits for the copy (a host sync when it has not finished yet).
    pub fn wait(&mut self) -> Result<()> {
        if self.poll()? {
            return Ok(());
        }
        capture_scope::check_host_sync("PendingRead::wait")?;
        counters::count(counters::Count::HostSync);
        unsafe { dr::event::synchronize(self.event) }.map_err(|e| cu_err("cuEventSynchronize", e))?;
        self.done = true;
        Ok(())
    }

    /// The copied values (call after [`PendingCopy::poll`] or [`PendingCopy::wait`] said done).
    pub fn values(&self) -> Vec<f32> {
        if !self.done || self.bytes == 0 {
            return Vec::new();
        }
        // SAFETY: the copy into `ptr` has finished; it holds `bytes / 4` f32 values.
        let raw = unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) };
        raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        if self.dev.bind().is_err() {
            return;
        }
        unsafe {
            let _ = dr::event::synchronize(self.event);
            let _ = dr::event::destroy(self.event);
        }
        if self.pooled {
            self.dev.pinned_reads.lock().unwrap_or_else(|e| e.into_inner()).push(self.ptr as usize);
        } else {
            unsafe {
                let _ = dr::free_host(self.ptr as *mut std::ffi::c_void);
            }
        }
    }
}

impl crate::backend::HostRead for PendingCopy {
    fn poll(&mut self) -> Result<bool> {
        PendingCopy::poll(self)
    }
    fn wait(&mut self) -> Result<()> {
        PendingCopy::wait(self)
    }
    fn values(&self) -> Vec<f32> {
        PendingCopy::values(self)
    }
}

impl crate::backend::DeferredReadStorage for CudaStorage {
    fn read_later(&self) -> Result<Box<dyn crate::backend::HostRead>> {
        Ok(Box::new(PendingCopy::start(self)?))
    }
}

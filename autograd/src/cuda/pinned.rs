//! Page-locked host buffers: the loader's image batches go to the GPU from here without a
//! synchronising copy.

use std::sync::Arc;

use cudarc::driver::{result as dr, sys};

use super::device::dev_of;
use super::device::{cu_err, event_reached, Dev};
use super::storage::CudaStorage;
use super::{capture_scope, counters};
use crate::{DType, Device, Error, Result, Tensor};

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

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no byte.
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
            capture_scope::check_host_sync("PinnedBuffer::as_mut_slice")?;
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
        capture_scope::check_host_sync("PinnedBuffer::poll_idle")?;
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
        capture_scope::check_host_upload("PinnedBuffer::upload")?;
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

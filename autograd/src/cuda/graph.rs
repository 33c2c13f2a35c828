//! Minimal stream capture of the compute stream into a CUDA graph (for capture-readiness tests and
//! as the primitive a step recorder builds on).
//!
//! Rules while capturing: tensors allocated before the capture must not be
//! dropped during it; memory allocated during the capture must be dropped before it ends; no host
//! transfers.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result as dr, sys};

use super::device::dev_of;
use super::device::{cu_err, Dev};
use crate::{Device, Result};

/// An instantiated graph recorded from a device's compute stream.
pub struct CudaGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    dev: Arc<Dev>,
}

unsafe impl Send for CudaGraph {}

/// Starts capturing the compute stream of `device` (thread-local capture mode).
pub fn begin_capture(device: Device) -> Result<()> {
    let dev = dev_of(device)?;
    dev.bind()?;
    // Side tasks queued before the capture are not part of it.
    dev.join_side_tasks()?;
    // Set first: from here on the allocator's block cache is bypassed.
    let was = dev.capturing.swap(true, std::sync::atomic::Ordering::Relaxed);
    unsafe { dr::stream::begin_capture(dev.cu_stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }.map_err(|e| {
        dev.capturing.store(was, std::sync::atomic::Ordering::Relaxed);
        cu_err("cuStreamBeginCapture", e)
    })
}

/// Ends the capture started by [`begin_capture`] and instantiates the graph.
pub fn end_capture(device: Device) -> Result<CudaGraph> {
    let dev = dev_of(device)?;
    dev.bind()?;
    // A capture ends with every stream that joined it joined back.
    let joined = dev.join_side_tasks();
    let ended = unsafe { dr::stream::end_capture(dev.cu_stream) };
    dev.capturing.store(false, std::sync::atomic::Ordering::Relaxed);
    let graph = ended.map_err(|e| cu_err("cuStreamEndCapture", e))?;
    if let Err(e) = joined {
        unsafe {
            let _ = dr::graph::destroy(graph);
        }
        return Err(e);
    }
    if let Some(e) = dev.deferred_error.lock().unwrap_or_else(|e| e.into_inner()).take() {
        unsafe {
            let _ = dr::graph::destroy(graph);
        }
        return Err(crate::Error::Cuda(format!("during capture: {e}")));
    }
    // Kernels keep the priority of the stream they were captured on (compute over side).
    let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY;
    let exec = unsafe { dr::graph::instantiate(graph, flags) }.map_err(|e| cu_err("cuGraphInstantiate", e))?;
    Ok(CudaGraph { graph, exec, dev })
}

impl CudaGraph {
    /// Queues one replay on the compute stream (asynchronous).
    pub fn launch(&self) -> Result<()> {
        self.dev.bind()?;
        super::counters::count(super::counters::Count::GraphLaunch);
        unsafe { dr::graph::launch(self.exec, self.dev.cu_stream) }.map_err(|e| cu_err("cuGraphLaunch", e))
    }

    /// Number of nodes in the recorded graph.
    pub fn node_count(&self) -> Result<usize> {
        let mut n = 0usize;
        unsafe { sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n) }.result().map_err(|e| cu_err("cuGraphGetNodes", e))?;
        Ok(n)
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            unsafe {
                let _ = dr::graph::exec_destroy(self.exec);
                let _ = dr::graph::destroy(self.graph);
            }
        }
    }
}

/// Bytes of device memory reserved for graph-owned allocations (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`).
pub fn graph_mem_reserved(device: Device) -> Result<u64> {
    let dev = dev_of(device)?;
    dev.bind()?;
    let mut v = 0u64;
    unsafe {
        sys::cuDeviceGetGraphMemAttribute(
            dev.ctx.cu_device(),
            sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
            &mut v as *mut u64 as *mut c_void,
        )
    }
    .result()
    .map_err(|e| cu_err("cuDeviceGetGraphMemAttribute", e))?;
    Ok(v)
}

/// Queues a kernel that keeps the GPU busy for about `cycles` SM clock cycles (~0.5 ns each on an
/// H200). Benchmarks queue it before an event-timed loop so the host gets ahead of the GPU and the
/// events measure GPU time even for ops shorter than their launch cost.
pub fn gpu_spin(device: Device, cycles: i64) -> Result<()> {
    let dev = dev_of(device)?;
    dev.bind()?;
    let f = dev.func("spin_cycles", "")?;
    let mut c = cycles;
    dev.launch(f, (1, 1, 1), (1, 1, 1), &mut [&mut c as *mut i64 as *mut c_void])
}

/// Runs `f` between two events recorded on `device`'s compute stream and returns its result with
/// the GPU time in milliseconds between them (waits for the stream).
pub fn time_on_stream<R>(device: Device, f: impl FnOnce() -> R) -> Result<(R, f64)> {
    time_on_dev(&dev_of(device)?, f)
}

/// [`time_on_stream`] for a device already opened.
pub(crate) fn time_on_dev<R>(dev: &Arc<Dev>, f: impl FnOnce() -> R) -> Result<(R, f64)> {
    dev.bind()?;
    let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
    let a = dr::event::create(flags).map_err(|e| cu_err("cuEventCreate", e))?;
    let b = dr::event::create(flags).map_err(|e| cu_err("cuEventCreate", e))?;
    // The stream the thread queues on (a side task's, for an engine timed inside one).
    unsafe { dr::event::record(a, dev.stream()) }.map_err(|e| cu_err("cuEventRecord", e))?;
    let r = f();
    dev.bind()?;
    let ms = unsafe {
        dr::event::record(b, dev.stream()).map_err(|e| cu_err("cuEventRecord", e))?;
        super::counters::count(super::counters::Count::HostSync);
        dr::event::synchronize(b).map_err(|e| cu_err("cuEventSynchronize", e))?;
        let ms = dr::event::elapsed(a, b).map_err(|e| cu_err("cuEventElapsedTime", e))?;
        let _ = dr::event::destroy(a);
        let _ = dr::event::destroy(b);
        ms
    };
    Ok((r, ms as f64))
}

/// A timing event recorded on a device's compute stream: the span between two marks is the
/// device time between the points where they were queued (idle gaps included).
pub struct StreamMark {
    event: sys::CUevent,
    dev: Arc<Dev>,
}

unsafe impl Send for StreamMark {}

impl StreamMark {
    /// Queues a mark on `device`'s compute stream (asynchronous).
    pub fn record(device: Device) -> Result<StreamMark> {
        let dev = dev_of(device)?;
        dev.bind()?;
        let event = dr::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| cu_err("cuEventCreate", e))?;
        let mark = StreamMark { event, dev };
        unsafe { dr::event::record(mark.event, mark.dev.cu_stream) }.map_err(|e| cu_err("cuEventRecord", e))?;
        Ok(mark)
    }

    /// Waits until the device has reached this mark. Not counted as a host synchronisation: the
    /// work queued after the mark keeps the device busy (what bounds how far a host runs ahead).
    pub fn wait(&self) -> Result<()> {
        super::capture_scope::check_host_sync("StreamMark::wait")?;
        self.dev.bind()?;
        unsafe { dr::event::synchronize(self.event) }.map_err(|e| cu_err("cuEventSynchronize", e))
    }

    /// Milliseconds of device time from this mark to `later` (waits until `later` is reached).
    pub fn elapsed_ms_until(&self, later: &StreamMark) -> Result<f64> {
        super::capture_scope::check_host_sync("StreamMark::elapsed_ms_until")?;
        self.dev.bind()?;
        super::counters::count(super::counters::Count::HostSync);
        unsafe {
            dr::event::synchronize(later.event).map_err(|e| cu_err("cuEventSynchronize", e))?;
            dr::event::elapsed(self.event, later.event).map(|ms| ms as f64).map_err(|e| cu_err("cuEventElapsedTime", e))
        }
    }
}

impl Drop for StreamMark {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            unsafe {
                let _ = dr::event::destroy(self.event);
            }
        }
    }
}

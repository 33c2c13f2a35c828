//! CUDA graphs: capture on the device's compute stream into recording-owned arenas.

use std::sync::Mutex;

use ptl_autograd::cuda;
use ptl_autograd::internal::arena_plan::AllocTrace;
use ptl_autograd::internal::cuda::{capture_support as cs, CaptureArena, CaptureViolation, MemPool};
use ptl_autograd::{Device, Tensor};

use crate::backend::{ArenaSlot, ArenaSpec, Backend, Body, Footprint, Graph, PoolHandle};
use crate::{CaptureError, Result};

/// Captures CUDA graphs (stream capture of the compute stream, thread-local mode).
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaBackend;

/// Times a shared arena (a recorder's shared forward or backward arena, a device's turn arena)
/// was too small for a new recording and grew, or was replaced by a larger one, in this process.
static SHARED_ARENA_GROWTHS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How often a shared arena has grown in this process: a fit that laid its arenas out for its
/// largest shape first sees none after its first recordings.
pub fn shared_arena_growths() -> u64 {
    SHARED_ARENA_GROWTHS.load(std::sync::atomic::Ordering::Relaxed)
}

fn violation(region: &str, v: CaptureViolation) -> CaptureError {
    let region = region.to_string();
    match v {
        CaptureViolation::HostSync { op } => CaptureError::HostSync { region, op: op.to_string() },
        CaptureViolation::HostUpload { op } => CaptureError::HostUpload { region, op: op.to_string() },
        CaptureViolation::AllocOutsidePool { requested, free } => CaptureError::AllocOutsidePool { region, requested, free },
        CaptureViolation::NestedCapture => CaptureError::NestedCapture { region },
        CaptureViolation::WorkspaceGrowth { library, requested } => CaptureError::WorkspaceGrowth { region, library, requested },
    }
}

/// A captured graph. Field order is drop order: graph, then arena; `Drop` first waits for the
/// stream so no memory is released under a replay in flight.
struct CudaRecorded {
    graph: Mutex<ptl_autograd::internal::cuda::CudaGraph>,
    arena: std::sync::Arc<CaptureArena>,
    /// Whether this graph made its arena (a graph sharing another's counts no arena bytes).
    owns_arena: bool,
    nodes: usize,
    /// Planned and tail allocations of this graph's capture.
    placement: (usize, usize),
    device: Device,
}

impl Drop for CudaRecorded {
    fn drop(&mut self) {
        let _ = cuda::synchronize(self.device);
    }
}

impl Graph for CudaRecorded {
    fn launch(&self) -> Result<()> {
        // A shared arena set aside between replays gets its memory back first (what native work
        // cached meanwhile goes back to the driver before).
        if !self.arena.resident() {
            cuda::empty_cache(self.device)?;
            self.arena.restore()?;
        }
        Ok(self.graph.lock().unwrap_or_else(|e| e.into_inner()).launch()?)
    }
    fn node_count(&self) -> usize {
        self.nodes
    }
    fn placement(&self) -> (usize, usize) {
        self.placement
    }
    fn arena_bytes(&self) -> usize {
        if self.owns_arena {
            self.arena.size()
        } else {
            0
        }
    }
}

/// The bytes a shared arena must have to take a graph laid out by `spec`. A plan made from a
/// traced capture is followed exactly, so its tail (room for allocations it did not foresee) may
/// be what the arena has left, down to 1 MiB: a later bucket's slightly larger plan then still
/// fits the arena an earlier one made. Without a plan the whole tail is needed.
fn shared_bytes_needed(spec: &ArenaSpec) -> usize {
    match spec.plan.offsets.is_empty() {
        true => spec.bytes(),
        false => spec.plan.bytes + spec.tail.min(1 << 20),
    }
}

/// A recording cannot start inside another (nor allocate its arena there).
fn not_capturing(region: &str) -> Result<()> {
    match cs::is_capturing() {
        true => Err(CaptureError::NestedCapture { region: region.to_string() }),
        false => Ok(()),
    }
}

impl CudaBackend {
    fn new_arena(&self, device: Device, spec: &ArenaSpec, pool: Option<&PoolHandle>) -> Result<std::sync::Arc<CaptureArena>> {
        let mut arena = None;
        self.in_pool(pool, &mut || {
            arena = Some(CaptureArena::planned(device, spec.plan.clone(), spec.tail)?);
            Ok(())
        })?;
        arena.ok_or_else(|| CaptureError::Backend("arena not created".into()))
    }

    /// Captures `body` on the compute stream with its allocations carved from `arena`.
    fn capture_into(
        &self,
        region: &str,
        device: Device,
        arena: std::sync::Arc<CaptureArena>,
        owns_arena: bool,
        body: Body,
    ) -> Result<Box<dyn Graph>> {
        not_capturing(region)?;
        cuda::synchronize(device)?;
        let scope = cs::enter_capture_scope(arena.clone()).map_err(|v| violation(region, v))?;
        if let Err(e) = ptl_autograd::internal::cuda::begin_capture(device) {
            drop(scope);
            return Err(e.into());
        }
        let r = body();
        let g = ptl_autograd::internal::cuda::end_capture(device);
        drop(scope);
        if let Some(v) = cs::take_capture_violation() {
            return Err(violation(region, v));
        }
        r?;
        let g = g?;
        let nodes = g.node_count()?;
        if nodes == 0 {
            return Err(CaptureError::EmptyGraph { region: region.to_string() });
        }
        let placement = arena.placement_counts();
        Ok(Box::new(CudaRecorded { graph: Mutex::new(g), arena, owns_arena, nodes, placement, device }))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn new_pool(&self, device: Device) -> Result<Option<PoolHandle>> {
        match device {
            Device::Cuda(_) => Ok(Some(Box::new(MemPool::new(device)?))),
            Device::Cpu => Err(CaptureError::Backend("the CUDA recorder needs inputs on a CUDA device".into())),
        }
    }
    fn in_pool(&self, pool: Option<&PoolHandle>, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        match pool.and_then(|p| p.downcast_ref::<MemPool>()) {
            Some(p) => {
                let _g = p.enter();
                f()
            }
            None => f(),
        }
    }
    fn measure(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Footprint> {
        cs::begin_alloc_measure();
        let r = f();
        let m = cs::end_alloc_measure();
        r.map(|_| Footprint { bytes: m.bytes, trace: Some(m.trace) })
    }
    fn record(&self, region: &str, device: Device, arena: &ArenaSpec, pool: Option<&PoolHandle>, body: Body) -> Result<Box<dyn Graph>> {
        not_capturing(region)?;
        let arena = self.new_arena(device, arena, pool)?;
        self.capture_into(region, device, arena, true, body)
    }
    fn record_sharing(
        &self,
        region: &str,
        device: Device,
        spec: &ArenaSpec,
        slot: &ArenaSlot,
        pool: Option<&PoolHandle>,
        body: Body,
    ) -> Result<Box<dyn Graph>> {
        not_capturing(region)?;
        // A shared arena is mapped at reserved addresses of its own, not taken from `pool`.
        let _ = pool;
        let mut held = slot.lock().unwrap_or_else(|e| e.into_inner());
        let shared = held.as_ref().and_then(|a| a.downcast_ref::<std::sync::Arc<CaptureArena>>()).cloned();
        if let Some(a) = shared.as_ref().filter(|a| !a.resident()) {
            cuda::empty_cache(device)?;
            a.restore()?;
        }
        let need = shared_bytes_needed(spec);
        let held_before = shared.is_some();
        let (arena, owns) = match shared {
            // The graphs sharing it run one after another and keep nothing in it: the next one
            // may use it from the start, laid out by its own plan — after growing in place, if it
            // is too small (the graphs recorded into it keep their addresses).
            Some(a) if a.size() >= need => {
                a.rewind(spec.plan.clone());
                (a, false)
            }
            Some(a) if a.grow(spec.bytes())? => {
                SHARED_ARENA_GROWTHS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                a.rewind(spec.plan.clone());
                (a, false)
            }
            _ => {
                if held_before {
                    SHARED_ARENA_GROWTHS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                (CaptureArena::growable(device, spec.plan.clone(), spec.tail)?, true)
            }
        };
        let graph = self.capture_into(region, device, arena.clone(), owns, body)?;
        // A new arena is shared from now on only if a graph was recorded into it (a failed
        // capture's arena is dropped, not kept in the slot).
        if owns {
            *held = Some(Box::new(arena));
        }
        Ok(graph)
    }
    /// One turn arena per device for the whole process: the recorders of every replay plugin
    /// take turns in it.
    fn turn_arena(&self, device: Device) -> std::sync::Arc<ArenaSlot> {
        static SLOTS: Mutex<Vec<(Device, std::sync::Arc<ArenaSlot>)>> = Mutex::new(Vec::new());
        crate::backend::turn_slot_of(&SLOTS, device)
    }
    fn set_shared_resident(&self, slot: &ArenaSlot, resident: bool) -> Result<bool> {
        let held = slot.lock().unwrap_or_else(|e| e.into_inner());
        let Some(arena) = held.as_ref().and_then(|a| a.downcast_ref::<std::sync::Arc<CaptureArena>>()) else { return Ok(false) };
        match resident {
            true => arena.restore().map(|_| true),
            false => arena.evict(),
        }
        .map_err(CaptureError::from)
    }
    fn trace_capture(&self, region: &str, device: Device, bytes: usize, body: Body) -> Result<Option<AllocTrace>> {
        not_capturing(region)?;
        let arena = CaptureArena::aliased(device, bytes)?;
        let graph = self.capture_into(region, device, arena.clone(), true, body)?;
        let trace = arena.trace();
        drop(graph);
        Ok(Some(trace))
    }
    fn address(&self, t: &Tensor) -> u64 {
        cs::device_ptr(t).unwrap_or(t.storage_ptr() as u64)
    }
    fn synchronize(&self, device: Device) -> Result<()> {
        match device {
            Device::Cuda(_) => Ok(cuda::synchronize(device)?),
            Device::Cpu => Ok(()),
        }
    }
    fn is_capturing(&self) -> bool {
        cs::is_capturing()
    }
    fn trim(&self, device: Device) -> Result<()> {
        match device {
            Device::Cuda(_) => Ok(cuda::empty_cache(device)?),
            Device::Cpu => Ok(()),
        }
    }
}

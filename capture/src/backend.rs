//! What the recorder needs from a device: private pools, arena sizing, capture and launch.

use std::any::Any;
use std::sync::Arc;

use ptl_autograd::internal::arena_plan::{AllocTrace, ArenaPlan};
use ptl_autograd::{Device, Tensor};

use crate::Result;

/// The work one graph records: run on the host during capture (CUDA) or on every launch
/// (the test double).
pub type Body = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// A private memory pool owned by one recording (opaque to the recorder).
pub type PoolHandle = Box<dyn Any + Send + Sync>;

/// An arena several graphs of one recording share ([`Backend::record_sharing`]): empty until the
/// first of them is recorded (opaque to the recorder).
pub type ArenaSlot = std::sync::Mutex<Option<Box<dyn Any + Send + Sync>>>;

/// The turn arena slot of `device` among `slots` (made on first use): what a backend keeps for
/// [`Backend::turn_arena`].
pub(crate) fn turn_slot_of(
    slots: &std::sync::Mutex<Vec<(Device, std::sync::Arc<ArenaSlot>)>>,
    device: Device,
) -> std::sync::Arc<ArenaSlot> {
    let mut slots = slots.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, s)) = slots.iter().find(|(d, _)| *d == device) {
        return s.clone();
    }
    let s = std::sync::Arc::new(ArenaSlot::default());
    slots.push((device, s.clone()));
    s
}

/// What a native run of a body allocated ([`Backend::measure`]).
#[derive(Clone, Debug, Default)]
pub struct Footprint {
    /// The sum of its allocations.
    pub bytes: usize,
    /// Its allocations and frees in order, where the backend records them.
    pub trace: Option<AllocTrace>,
}

/// The arena a graph records into: the planned part laid out by `plan` (empty: none), then `tail`
/// bytes handed out in order for what the plan does not cover.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaSpec {
    /// Offsets of the allocations the warm-up's trace planned.
    pub plan: ArenaPlan,
    /// Bytes after the planned part for what the plan does not cover.
    pub tail: usize,
}

impl ArenaSpec {
    /// Bytes the arena takes.
    pub fn bytes(&self) -> usize {
        self.plan.bytes + self.tail
    }
}

/// One recorded graph.
pub trait Graph: Send + Sync {
    /// Queues one replay.
    fn launch(&self) -> Result<()>;
    /// Number of device operations recorded.
    fn node_count(&self) -> usize;
    /// Bytes reserved for the graph's intermediates.
    fn arena_bytes(&self) -> usize;
    /// Allocations of the capture that took their planned offset, and those that went to the
    /// arena's unplanned tail.
    fn placement(&self) -> (usize, usize) {
        (0, 0)
    }
}

/// A way to record and replay bodies. [`crate::CudaBackend`] captures CUDA graphs;
/// [`crate::testing::ReplayNatively`] keeps the body and runs it on every launch.
pub trait Backend: Send + Sync {
    /// The backend's name in counters and summaries (`cuda`, `native`).
    fn name(&self) -> &'static str;
    /// A fresh private pool for one recording's static buffers and arenas (`None`: no pools).
    fn new_pool(&self, device: Device) -> Result<Option<PoolHandle>>;
    /// Runs `f` with allocations routed to `pool`.
    fn in_pool(&self, pool: Option<&PoolHandle>, f: &mut dyn FnMut() -> Result<()>) -> Result<()>;
    /// Runs `f` natively and returns what it allocated (arena sizing and planning).
    fn measure(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Footprint>;
    /// Records `body` into a graph whose intermediates live in an arena laid out as `arena` says.
    fn record(&self, region: &str, device: Device, arena: &ArenaSpec, pool: Option<&PoolHandle>, body: Body) -> Result<Box<dyn Graph>>;
    /// [`Backend::record`] into the arena of `slot`, shared with the other graphs recorded through
    /// it (made on first use): for graphs that run one after another and keep nothing in the arena
    /// past their end — a recording's backward graphs, one per gradient mask and target. By
    /// default each graph gets its own arena.
    fn record_sharing(
        &self,
        region: &str,
        device: Device,
        arena: &ArenaSpec,
        slot: &ArenaSlot,
        pool: Option<&PoolHandle>,
        body: Body,
    ) -> Result<Box<dyn Graph>> {
        let _ = slot;
        self.record(region, device, arena, pool, body)
    }
    /// The slot of `device`'s turn arena: shared by every recorder with
    /// [`crate::RecorderConfig::take_turns`] on this backend, for graphs that keep nothing in
    /// their arena past their end — backward graphs, and forward graphs of regions with no
    /// backward (an optimizer update writing in place) — which run one at a time on the device's
    /// compute stream. By default a fresh slot each time (no sharing).
    fn turn_arena(&self, device: Device) -> std::sync::Arc<ArenaSlot> {
        let _ = device;
        std::sync::Arc::new(ArenaSlot::default())
    }
    /// Gives the memory of `slot`'s shared arena back (`resident` false) or maps it again
    /// (true): its graphs hold nothing between replays, so a native run beside them (a new
    /// signature's warm-up) may have that memory; none of them runs until it is mapped again.
    /// Returns whether the slot holds an arena that did so (default: none does).
    fn set_shared_resident(&self, slot: &ArenaSlot, resident: bool) -> Result<bool> {
        let _ = (slot, resident);
        Ok(false)
    }
    /// Captures `body` once, into `bytes` of addresses that need no memory (the graph is
    /// dropped, never launched), and returns the allocations and frees the capture made, in
    /// order: the trace a plan for the real capture of the same body follows exactly. `None`:
    /// this backend cannot, and plans come from the warm-up's trace (the default).
    fn trace_capture(&self, region: &str, device: Device, bytes: usize, body: Body) -> Result<Option<AllocTrace>> {
        let _ = (region, device, bytes, body);
        Ok(None)
    }
    /// The address of a tensor's memory as a graph would bake it.
    fn address(&self, t: &Tensor) -> u64;
    /// Waits for the device.
    fn synchronize(&self, device: Device) -> Result<()>;
    /// Gives the device's default pool back what it holds unused — after a capture, the
    /// warm-up's native allocations (default: nothing to give back).
    fn trim(&self, device: Device) -> Result<()> {
        let _ = device;
        Ok(())
    }
    /// Whether a capture is running on this thread.
    fn is_capturing(&self) -> bool;
}

//! What the recorder needs from a device: private pools, arena sizing, capture and launch.

use std::any::Any;
use std::sync::Arc;

use ptl_autograd::{Device, Tensor};

use crate::Result;

/// The work one graph records: run on the host during capture (CUDA) or on every launch
/// (the test double).
pub type Body = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// A private memory pool owned by one recording (opaque to the recorder).
pub type PoolHandle = Box<dyn Any + Send + Sync>;

/// One recorded graph.
pub trait Graph: Send + Sync {
    /// Queues one replay.
    fn launch(&self) -> Result<()>;
    /// Number of device operations recorded.
    fn node_count(&self) -> usize;
    /// Bytes reserved for the graph's intermediates.
    fn arena_bytes(&self) -> usize;
}

/// A way to record and replay bodies. [`crate::CudaBackend`] captures CUDA graphs;
/// [`crate::testing::ReplayNatively`] keeps the body and runs it on every launch.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// A fresh private pool for one recording's static buffers and arenas (`None`: no pools).
    fn new_pool(&self, device: Device) -> Result<Option<PoolHandle>>;
    /// Runs `f` with allocations routed to `pool`.
    fn in_pool(&self, pool: Option<&PoolHandle>, f: &mut dyn FnMut() -> Result<()>) -> Result<()>;
    /// Runs `f` natively and returns the device bytes it allocated (arena sizing).
    fn measure(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<usize>;
    /// Records `body` into a graph whose intermediates live in an arena of `arena_bytes`.
    fn record(&self, region: &str, device: Device, arena_bytes: usize, pool: Option<&PoolHandle>, body: Body) -> Result<Box<dyn Graph>>;
    /// The address of a tensor's memory as a graph would bake it.
    fn address(&self, t: &Tensor) -> u64;
    /// Waits for the device.
    fn synchronize(&self, device: Device) -> Result<()>;
    /// Whether a capture is running on this thread.
    fn is_capturing(&self) -> bool;
}

//! A test double for CPU CI: "recording" keeps the body and every launch runs it natively, so the
//! recorder's state machine (signatures, masks, counters, retire/fallback, static-buffer copies,
//! gradient accumulation) runs for real without a GPU. Not for production use: it is eager.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ptl_autograd::{Device, Tensor};

use crate::backend::{ArenaSpec, Backend, Body, Footprint, Graph, PoolHandle};
use crate::{CaptureError, Result};

/// Records by keeping the body; replays by running it.
#[derive(Default)]
pub struct ReplayNatively {
    /// Graphs recorded so far.
    pub records: AtomicU64,
    /// Errors the next recordings fail with (front first), to test fallbacks.
    pub fail_next: Mutex<Vec<CaptureError>>,
}

struct Stored {
    body: Body,
    /// The arena the recorder asked for (nothing is reserved: the double runs eagerly).
    arena: usize,
}

impl Graph for Stored {
    fn launch(&self) -> Result<()> {
        (self.body)()
    }
    fn node_count(&self) -> usize {
        1
    }
    fn arena_bytes(&self) -> usize {
        self.arena
    }
}

impl Backend for ReplayNatively {
    fn name(&self) -> &'static str {
        "replay-natively"
    }
    fn new_pool(&self, _device: Device) -> Result<Option<PoolHandle>> {
        Ok(None)
    }
    fn in_pool(&self, _pool: Option<&PoolHandle>, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        f()
    }
    fn measure(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Footprint> {
        f().map(|_| Footprint::default())
    }
    fn record(&self, _region: &str, _device: Device, arena: &ArenaSpec, _pool: Option<&PoolHandle>, body: Body) -> Result<Box<dyn Graph>> {
        let arena_bytes = arena.bytes();
        let mut f = self.fail_next.lock().unwrap_or_else(|e| e.into_inner());
        if !f.is_empty() {
            return Err(f.remove(0));
        }
        self.records.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(Stored { body, arena: arena_bytes }))
    }
    fn address(&self, t: &Tensor) -> u64 {
        t.storage_ptr() as u64
    }
    fn synchronize(&self, _device: Device) -> Result<()> {
        Ok(())
    }
    fn is_capturing(&self) -> bool {
        false
    }
}

/// A shared handle on a [`ReplayNatively`] backend (to inspect its counters from tests).
pub fn replay_natively() -> Arc<ReplayNatively> {
    Arc::new(ReplayNatively::default())
}

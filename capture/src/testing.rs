//! A test double for CPU CI: "recording" keeps the body and every launch runs it natively, so the
//! recorder's state machine (signatures, masks, counters, retire/fallback, static-buffer copies,
//! gradient accumulation) runs for real without a GPU. Not for production use: it is eager.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ptl_autograd::{Device, Tensor};

use crate::backend::{ArenaSlot, ArenaSpec, Backend, Body, Footprint, Graph, PoolHandle};
use crate::{CaptureError, Result};

/// Records by keeping the body; replays by running it.
#[derive(Default)]
pub struct ReplayNatively {
    /// Graphs recorded so far.
    pub records: AtomicU64,
    /// Errors the next recordings fail with (front first), to test fallbacks.
    pub fail_next: Mutex<Vec<CaptureError>>,
    /// Shared arenas set aside ([`Backend::set_shared_resident`] with `false`) and put back
    /// (explicitly, or by the next launch or capture into them).
    pub evictions: AtomicU64,
    /// Shared arenas put back after an eviction.
    pub restores: Arc<AtomicU64>,
    /// The turn arenas' slots by device ([`Backend::turn_arena`]), shared by the recorders on
    /// this double.
    pub turn_slots: Mutex<Vec<(Device, Arc<ArenaSlot>)>>,
}

struct Stored {
    body: Body,
    /// The arena the recorder asked for (nothing is reserved: the double runs eagerly).
    arena: usize,
    /// For a graph recorded into a shared arena: whether that arena is "mapped" (a launch while
    /// it is set aside maps it again, as on the device).
    resident: Option<Arc<AtomicBool>>,
    /// The backend's restore counter.
    restores: Arc<AtomicU64>,
}

impl Graph for Stored {
    fn launch(&self) -> Result<()> {
        if let Some(r) = &self.resident {
            if !r.swap(true, Ordering::Relaxed) {
                self.restores.fetch_add(1, Ordering::Relaxed);
            }
        }
        (self.body)()
    }
    fn node_count(&self) -> usize {
        1
    }
    fn arena_bytes(&self) -> usize {
        self.arena
    }
}

impl ReplayNatively {
    fn store(&self, arena: &ArenaSpec, body: Body, resident: Option<Arc<AtomicBool>>) -> Result<Stored> {
        let mut f = self.fail_next.lock().unwrap_or_else(|e| e.into_inner());
        if !f.is_empty() {
            return Err(f.remove(0));
        }
        self.records.fetch_add(1, Ordering::Relaxed);
        Ok(Stored { body, arena: arena.bytes(), resident, restores: self.restores.clone() })
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
        Ok(Box::new(self.store(arena, body, None)?))
    }
    /// A shared arena is a residency flag in the slot, made by the first graph recorded into it.
    fn record_sharing(
        &self,
        _region: &str,
        _device: Device,
        arena: &ArenaSpec,
        slot: &ArenaSlot,
        _pool: Option<&PoolHandle>,
        body: Body,
    ) -> Result<Box<dyn Graph>> {
        let mut held = slot.lock().unwrap_or_else(|e| e.into_inner());
        let flag = held.as_ref().and_then(|a| a.downcast_ref::<Arc<AtomicBool>>()).cloned();
        let owns = flag.is_none();
        let flag = flag.unwrap_or_else(|| Arc::new(AtomicBool::new(true)));
        if !flag.swap(true, Ordering::Relaxed) {
            self.restores.fetch_add(1, Ordering::Relaxed);
        }
        let stored = self.store(arena, body, Some(flag.clone()))?;
        if owns {
            *held = Some(Box::new(flag));
        }
        Ok(Box::new(stored))
    }
    fn turn_arena(&self, device: Device) -> Arc<ArenaSlot> {
        crate::backend::turn_slot_of(&self.turn_slots, device)
    }
    fn set_shared_resident(&self, slot: &ArenaSlot, resident: bool) -> Result<bool> {
        let held = slot.lock().unwrap_or_else(|e| e.into_inner());
        let Some(flag) = held.as_ref().and_then(|a| a.downcast_ref::<Arc<AtomicBool>>()) else { return Ok(false) };
        if flag.swap(resident, Ordering::Relaxed) == resident {
            return Ok(false);
        }
        match resident {
            true => self.restores.fetch_add(1, Ordering::Relaxed),
            false => self.evictions.fetch_add(1, Ordering::Relaxed),
        };
        Ok(true)
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

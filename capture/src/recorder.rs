//! The recorder: configuration, the backend, and the regions it holds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ptl_autograd::{DType, Device, Tensor};

use serde::{Deserialize, Serialize};

use crate::backend::{ArenaSlot, Backend};
use crate::region::{RegionHandle, RegionShared, RegionSpec};
use crate::stats::RegionStats;

/// How regions are recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RecorderConfig {
    /// Master switch: when false every call runs natively (counted as `Disabled`).
    pub enabled: bool,
    /// Native calls of a new signature before it is captured.
    pub warmup_calls: usize,
    /// Warmup iterations (forward + backward, rolled back) right before a capture (at least 1:
    /// they also size the recording's arenas).
    pub warmup_iters: usize,
    /// Recordings per region (a miss beyond the bound runs natively).
    pub max_recordings: usize,
    /// A forward while the previous backward is pending errors instead of running natively.
    pub strict_pending: bool,
    /// Only the all-outputs gradient mask replays; another mask errors instead of being captured.
    pub strict_masks: bool,
    /// Lay each arena out from an allocation trace (`ptl_autograd::internal::arena_plan`): that
    /// of a traced capture of the same body where the backend can make one, else the warm-up's —
    /// about the peak of live bytes instead of their sum (docs/memory.md). Off (or on a backend
    /// that records no trace): arena = the warm-up's summed bytes × `arena_slack` +
    /// `arena_extra_bytes`.
    pub plan_arenas: bool,
    /// Bytes beyond a planned part, as a fraction of it (plus `arena_extra_bytes`), for
    /// allocations the capture makes that its warm-up did not (a plan from the warm-up's trace).
    pub plan_headroom: f64,
    /// The same for a plan from a traced capture, whose allocations the real capture repeats one
    /// for one: its tail stays unused, so it is small (at batch 64 a sixteenth of the step's
    /// arena was 600 MiB held for nothing).
    pub traced_headroom: f64,
    /// The regions of this recorder take turns (one region's forward and backward end before
    /// another's forward starts — one region per batch, as the `step` and `loss` plugins record
    /// one per target bucket): their forward graphs share one arena, sized for the largest.
    pub share_forward_arena: bool,
    /// This recorder's graphs that keep nothing in their arena past their end — its backward
    /// graphs, and the forward graphs of regions with no backward (nothing saved for one: an
    /// optimizer update writing in place) — record into the backend's turn arena of the device
    /// ([`crate::Backend::turn_arena`]), shared with every other recorder that takes turns,
    /// instead of an arena of the recorder's own (backward) or of their own (such forwards).
    /// They run one at a time on the compute stream, so the step's backward and the optimizer's
    /// update need memory for the larger of the two only (docs/memory.md).
    pub take_turns: bool,
    /// An unplanned arena's size as a multiple of what the warm-up allocated (headroom for a
    /// capture that allocates a little more).
    pub arena_slack: f64,
    /// Bytes added to every unplanned arena on top of the slack.
    pub arena_extra_bytes: usize,
}

impl Default for RecorderConfig {
    fn default() -> Self {
        RecorderConfig {
            enabled: true,
            warmup_calls: 1,
            warmup_iters: 1,
            max_recordings: 2,
            strict_pending: false,
            strict_masks: false,
            plan_arenas: true,
            plan_headroom: 1.0 / 16.0,
            traced_headroom: 1.0 / 128.0,
            share_forward_arena: false,
            take_turns: false,
            arena_slack: 1.25,
            arena_extra_bytes: 1 << 20,
        }
    }
}

/// An input's position, shape and dtype.
type InputKey = (usize, Vec<usize>, DType);

pub(crate) struct RecorderInner {
    pub(crate) config: RecorderConfig,
    pub(crate) backend: Arc<dyn Backend>,
    regions: Mutex<Vec<Arc<RegionShared>>>,
    /// The arena every backward graph of every region of this recorder shares: backward graphs
    /// run one at a time and keep nothing in it past their end.
    pub(crate) bwd_arena: Arc<ArenaSlot>,
    /// The forward graphs' shared arena when [`RecorderConfig::share_forward_arena`] is on.
    pub(crate) fwd_arena: Arc<ArenaSlot>,
    /// The turn arenas this recorder's graphs recorded into ([`RecorderConfig::take_turns`]).
    turn_slots: Mutex<Vec<Arc<ArenaSlot>>>,
    /// With [`RecorderConfig::share_forward_arena`], the regions take turns: their recordings
    /// share one static buffer per input position, shape and dtype (a step's images are copied
    /// into one buffer whichever target bucket records the step).
    shared_inputs: Mutex<HashMap<InputKey, Tensor>>,
}

impl RecorderInner {
    /// The static buffer shared by the recordings for input `index` shaped and typed as `x`,
    /// made by `make` on first use.
    pub(crate) fn shared_input(
        &self,
        index: usize,
        x: &Tensor,
        make: impl FnOnce() -> ptl_autograd::Result<Tensor>,
    ) -> ptl_autograd::Result<Tensor> {
        let mut held = self.shared_inputs.lock().unwrap_or_else(|e| e.into_inner());
        let key = (index, x.dims().to_vec(), x.dtype());
        if let Some(t) = held.get(&key) {
            return Ok(t.clone());
        }
        let t = make()?;
        held.insert(key, t.clone());
        Ok(t)
    }

    /// Whether no region of this recorder but `me` has a recording waiting for its backward —
    /// then the shared arenas hold nothing and may be set aside (a region busy in another call
    /// counts as waiting).
    pub(crate) fn others_idle(&self, me: &RegionShared) -> bool {
        let regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        regions.iter().filter(|r| !std::ptr::eq(r.as_ref(), me)).all(|r| r.idle())
    }

    /// The slot of the arena that graphs keeping nothing past their end record into on `device`:
    /// the backend's turn arena with [`RecorderConfig::take_turns`], else the recorder's own
    /// backward arena.
    pub(crate) fn turn_slot(&self, device: Device) -> Arc<ArenaSlot> {
        if !self.config.take_turns {
            return self.bwd_arena.clone();
        }
        let slot = self.backend.turn_arena(device);
        let mut held = self.turn_slots.lock().unwrap_or_else(|e| e.into_inner());
        if !held.iter().any(|s| Arc::ptr_eq(s, &slot)) {
            held.push(slot.clone());
        }
        slot
    }

    /// Every shared arena slot this recorder's graphs use.
    fn shared_slots(&self) -> Vec<Arc<ArenaSlot>> {
        let mut slots = vec![self.fwd_arena.clone(), self.bwd_arena.clone()];
        slots.extend(self.turn_slots.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned());
        slots
    }

    /// Whether a forward graph has been recorded into the shared forward arena.
    pub(crate) fn holds_shared_forward(&self) -> bool {
        self.fwd_arena.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

/// Holds regions (child holders) that share a configuration and a backend. `Clone` and
/// deserialisation give a recorder with the same configuration and no region or recording;
/// serialisation writes the configuration only.
pub struct Recorder {
    pub(crate) inner: Arc<RecorderInner>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recorder({}, {} regions)", self.inner.backend.name(), self.regions().len())
    }
}

impl Recorder {
    /// A recorder over any backend.
    pub fn with_backend(config: RecorderConfig, backend: Arc<dyn Backend>) -> Recorder {
        let (bwd_arena, fwd_arena) = (Arc::new(ArenaSlot::default()), Arc::new(ArenaSlot::default()));
        let shared_inputs = Mutex::default();
        Recorder {
            inner: Arc::new(RecorderInner {
                config,
                backend,
                regions: Mutex::new(Vec::new()),
                bwd_arena,
                fwd_arena,
                turn_slots: Mutex::default(),
                shared_inputs,
            }),
        }
    }

    /// A recorder that captures CUDA graphs.
    #[cfg(feature = "cuda")]
    pub fn cuda(config: RecorderConfig) -> Recorder {
        Recorder::with_backend(config, Arc::new(crate::CudaBackend))
    }

    /// The backend used when none is named: CUDA graphs with the `cuda` feature; otherwise the
    /// recorder is disabled (every call native).
    pub fn default_for(config: RecorderConfig) -> Recorder {
        #[cfg(feature = "cuda")]
        {
            Recorder::cuda(config)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let config = RecorderConfig { enabled: false, ..config };
            Recorder::with_backend(config, Arc::new(crate::testing::ReplayNatively::default()))
        }
    }

    /// The settings the recorder was made with.
    pub fn config(&self) -> &RecorderConfig {
        &self.inner.config
    }

    /// Adds a region (a child holder).
    pub fn region(&self, spec: RegionSpec) -> RegionHandle {
        let shared = Arc::new(RegionShared::new(spec));
        self.inner.regions.lock().unwrap_or_else(|e| e.into_inner()).push(shared.clone());
        RegionHandle { shared, recorder: self.inner.clone() }
    }

    fn regions(&self) -> Vec<Arc<RegionShared>> {
        self.inner.regions.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Releases every recording of every region (graphs and pools), and what they shared.
    pub fn release_all(&self) {
        for r in self.regions() {
            r.release();
        }
        self.release_shared();
    }

    /// Lets go of the shared arenas and static inputs (their memory returns once no recording
    /// holds them): after the regions' recordings were released.
    pub fn release_shared(&self) {
        // A turn arena's graphs of other recorders keep theirs alive; the next capture into the
        // slot makes a new one.
        for slot in self.inner.shared_slots() {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        self.inner.turn_slots.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.inner.shared_inputs.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Gives the memory of this recorder's shared arenas back to the driver while none of its
    /// regions waits for a backward — for native work between replays, such as validation, which
    /// then does not hold its working set beside them. The next replay of a graph recorded into
    /// them (or a capture into them) maps them again, after returning the default pool's unused
    /// memory to the driver. Returns whether an arena was set aside (`false` also when a backward
    /// is pending, or on a backend without shared arenas).
    pub fn set_shared_arenas_aside(&self) -> crate::Result<bool> {
        let idle = self.regions().iter().all(|r| r.idle());
        if !idle {
            return Ok(false);
        }
        let b = &self.inner.backend;
        let mut any = false;
        for slot in self.inner.shared_slots() {
            any |= b.set_shared_resident(&slot, false)?;
        }
        Ok(any)
    }

    /// Counters of every region, in creation order.
    pub fn stats(&self) -> Vec<(String, RegionStats)> {
        self.regions().iter().map(|r| (r.name().to_string(), r.stats())).collect()
    }

    /// One line for the end of a fit: `capture: trunk: 1 captures … | head: …`.
    pub fn summary_line(&self) -> String {
        let parts: Vec<String> = self.stats().iter().map(|(n, s)| s.line(n)).collect();
        format!("capture[{}]: {}", self.inner.backend.name(), if parts.is_empty() { "no regions".to_string() } else { parts.join(" | ") })
    }
}

impl Clone for Recorder {
    fn clone(&self) -> Self {
        Recorder::with_backend(self.inner.config.clone(), self.inner.backend.clone())
    }
}

impl Serialize for Recorder {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.inner.config.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Recorder {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(Recorder::default_for(RecorderConfig::deserialize(d)?))
    }
}

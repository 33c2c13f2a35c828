//! One recorder per plugin and one region per piece: the part both plugins share.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use ptl_autograd::{Device, Tensor, TensorKind};
use ptl_capture::{Recorder, RecorderConfig, RegionHandle, RegionSpec};
use ptl_heads::{HeadsError, Piece, PieceBody};

/// A recorder and the regions of the pieces it has seen. `Clone` gives a fresh recorder with the
/// same configuration and no region or recording (checkpoints and clones never carry graphs).
pub struct PieceRegions {
    config: RecorderConfig,
    /// Test hook: the first N captures fail (CPU test double only), to exercise fallbacks.
    inject_capture_failures: usize,
    recorder: Option<Recorder>,
    regions: Mutex<BTreeMap<Piece, Arc<RegionHandle>>>,
    /// The model head the recordings were made against ([`ptl_heads::PoseModel::head_id`]).
    head: Mutex<Option<u64>>,
    /// Pieces with hooks registered: they run natively (a hook must see every call).
    hooked: Mutex<BTreeSet<Piece>>,
}

impl Clone for PieceRegions {
    fn clone(&self) -> Self {
        PieceRegions { inject_capture_failures: self.inject_capture_failures, ..PieceRegions::new(self.config.clone()) }
    }
}

impl PieceRegions {
    /// No region recorded yet; each piece gets a recorder with `config` on its first call.
    pub fn new(config: RecorderConfig) -> PieceRegions {
        PieceRegions {
            config,
            inject_capture_failures: 0,
            recorder: None,
            regions: Mutex::new(BTreeMap::new()),
            head: Mutex::new(None),
            hooked: Mutex::new(BTreeSet::new()),
        }
    }

    /// The recorder configuration (what a checkpoint keeps).
    pub fn config(&self) -> &RecorderConfig {
        &self.config
    }

    /// Makes the first `n` captures of the next fit fail (on the CPU test double).
    #[doc(hidden)]
    pub fn inject_capture_failures(&mut self, n: usize) {
        self.inject_capture_failures = n;
    }

    /// Replaces the configuration (before [`PieceRegions::start`]).
    pub fn set_config(&mut self, config: RecorderConfig) {
        self.config = config;
    }

    /// Starts recording for a fit on `device`: CUDA graphs on a GPU, the test double on the CPU.
    pub fn start(&mut self, device: Device) {
        self.release();
        let recorder = crate::keyed::recorder_for(&self.config, device, crate::keyed::failing_double(self.inject_capture_failures));
        self.recorder = Some(recorder);
    }

    /// Runs `piece` of `model` through its region (created on first use). A replaced head
    /// (another [`ptl_heads::PoseModel::head_id`]) first retires every recording — the trunk's
    /// (the parent the stems hang off) and the old stems' — and releases their pools.
    pub fn run(
        &self,
        model: &ptl_heads::PoseModel,
        piece: Piece,
        inputs: &[Tensor],
        surface: &[(String, Tensor, TensorKind)],
        body: &PieceBody<'_>,
    ) -> ptl_heads::Result<Vec<Tensor>> {
        let Some(recorder) = &self.recorder else {
            return body(inputs); // not started (a plugin used outside a fit): native
        };
        {
            let mut head = self.head.lock().unwrap_or_else(|e| e.into_inner());
            if head.is_some_and(|h| h != model.head_id()) {
                self.release_recordings();
            }
            *head = Some(model.head_id());
        }
        let region = {
            let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
            regions
                .entry(piece)
                .or_insert_with(|| {
                    let r = recorder.region(RegionSpec::per_call(piece.name()));
                    r.set_hooks(self.hooked.lock().unwrap_or_else(|e| e.into_inner()).contains(&piece));
                    Arc::new(r)
                })
                .clone()
        };
        let body = |xs: &[Tensor]| -> ptl_autograd::Result<Vec<Tensor>> { body(xs).map_err(to_tensor_error) };
        region.call_with(inputs, surface, &body).map_err(|e| HeadsError::Runner { piece: piece.name(), msg: e.to_string() })
    }

    /// Marks `piece` as hooked (a user inspects its calls): it runs natively, its recordings stay
    /// for when the hook goes. Other pieces are not affected.
    pub fn set_hooks(&self, piece: Piece, on: bool) {
        let mut hooked = self.hooked.lock().unwrap_or_else(|e| e.into_inner());
        if on {
            hooked.insert(piece);
        } else {
            hooked.remove(&piece);
        }
        if let Some(r) = self.regions.lock().unwrap_or_else(|e| e.into_inner()).get(&piece) {
            r.set_hooks(on);
        }
    }

    /// Retires every recording (counted as released; the regions and their counters stay).
    fn release_recordings(&self) {
        let regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        for r in regions.values() {
            r.discard_pending();
            r.release();
        }
    }

    /// Drops every recording (and its pool) and forgets pending backwards.
    pub fn release(&self) {
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        for r in regions.values() {
            r.discard_pending();
            r.release();
        }
        regions.clear();
    }

    /// Counters per region, `capture[backend]: name: … | …`.
    pub fn summary(&self) -> Option<String> {
        self.recorder.as_ref().map(Recorder::summary_line)
    }

    /// Counters of each region as JSON (region name → `ptl_capture::RegionStats`).
    pub fn counters_json(&self) -> serde_json::Value {
        let regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        serde_json::Value::Object(
            regions.iter().map(|(p, r)| (p.name(), serde_json::to_value(r.stats()).unwrap_or(serde_json::Value::Null))).collect(),
        )
    }

    /// Counters of each region, by piece.
    pub fn stats(&self) -> Vec<(Piece, ptl_capture::RegionStats)> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(p, r)| (*p, r.stats())).collect()
    }
}

/// A piece body's error as the recorder's body error.
fn to_tensor_error(e: HeadsError) -> ptl_autograd::Error {
    match e {
        HeadsError::Tensor(t) => t,
        other => ptl_autograd::Error::InvalidArgument { op: "piece body", msg: other.to_string() },
    }
}

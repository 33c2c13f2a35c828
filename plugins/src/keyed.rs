//! What the optimizer-stage plugins (`ns`, `optimizer`) share: a recorder and per-call regions
//! keyed by what selects a recording (a matrix-shape group, a gradient-presence mask).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ptl_autograd::Device;
use ptl_capture::{Recorder, RecorderConfig, RegionHandle, RegionSpec};

/// A recorder for a fit on `device`: CUDA graphs on a GPU, `double` (the CPU test double) elsewhere.
pub(crate) fn recorder_for(config: &RecorderConfig, device: Device, double: ptl_capture::testing::ReplayNatively) -> Recorder {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let _ = double;
            Recorder::cuda(config.clone())
        }
        _ => Recorder::with_backend(config.clone(), Arc::new(double)),
    }
}

/// A recorder and its regions by key (each named when first made).
pub(crate) struct KeyedRegions<K> {
    recorder: Recorder,
    regions: Mutex<BTreeMap<K, Arc<RegionHandle>>>,
}

impl<K: Ord> KeyedRegions<K> {
    pub(crate) fn new(config: &RecorderConfig, device: Device) -> Self {
        KeyedRegions { recorder: recorder_for(config, device, Default::default()), regions: Mutex::new(BTreeMap::new()) }
    }

    /// The region of `key`, made on first use with the name `name` gives (from the keys so far).
    pub(crate) fn region(&self, key: K, name: impl FnOnce(&BTreeMap<K, Arc<RegionHandle>>) -> String) -> Arc<RegionHandle> {
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = regions.get(&key) {
            return r.clone();
        }
        let r = Arc::new(self.recorder.region(RegionSpec::per_call(name(&regions))));
        regions.insert(key, r.clone());
        r
    }

    /// Counters of each region as JSON (region name → `ptl_capture::RegionStats`).
    pub(crate) fn counters_json(&self) -> serde_json::Value {
        let regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        serde_json::Value::Object(
            regions.values().map(|r| (r.name().to_string(), serde_json::to_value(r.stats()).unwrap_or(serde_json::Value::Null))).collect(),
        )
    }

    pub(crate) fn summary_line(&self) -> String {
        self.recorder.summary_line()
    }

    /// Drops every recording (and its pool).
    pub(crate) fn release(&self) {
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        for r in regions.values() {
            r.release();
        }
        regions.clear();
    }
}

//! What the optimizer-stage plugins (`ns`, `optimizer`) share: a recorder and per-call regions
//! keyed by what selects a recording (a matrix-shape group, a gradient-presence mask), and the
//! plugin shell around them (settings, this fit's regions, the dispatch test hook).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ptl_autograd::Device;
use ptl_capture::{Recorder, RecorderConfig, RegionHandle, RegionSpec};

/// A site's body as a recorded region calls it: every nested site native (nothing is recorded
/// twice), the trainer's errors as tensor errors (`what` names the site in them). The body may be
/// called several times (warm-up, capture).
pub(crate) fn region_body<'a, 'b: 'a>(
    body: &'a mut ptl_trainer::fit::SiteBody<'b>,
    what: &'static str,
) -> impl Fn(&[ptl_autograd::Tensor]) -> ptl_autograd::Result<Vec<ptl_autograd::Tensor>> + use<'a, 'b> {
    let body = std::cell::RefCell::new(body);
    move |xs| {
        let mut b = body.borrow_mut();
        (*b)(&ptl_trainer::fit::NativeSites, xs).map_err(|e| ptl_autograd::Error::InvalidArgument { op: what, msg: e.to_string() })
    }
}

/// The CPU test double whose first `failures` recordings fail (the `inject_capture_failures` test
/// hook), to exercise the fallbacks.
pub(crate) fn failing_double(failures: usize) -> ptl_capture::testing::ReplayNatively {
    let double = ptl_capture::testing::ReplayNatively::default();
    let errors = (0..failures)
        .map(|i| ptl_capture::CaptureError::Region { region: "injected".into(), msg: format!("injected capture failure {}", i + 1) });
    double.fail_next.lock().unwrap_or_else(|e| e.into_inner()).extend(errors);
    double
}

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
    /// Regions recorded with `config` on `device`; on the CPU test double the first
    /// `inject_failures` recordings fail.
    pub(crate) fn new(config: &RecorderConfig, device: Device, inject_failures: usize) -> Self {
        KeyedRegions { recorder: recorder_for(config, device, failing_double(inject_failures)), regions: Mutex::new(BTreeMap::new()) }
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

    /// Sets the recorder's shared arenas aside while nothing waits for a backward
    /// ([`Recorder::set_shared_arenas_aside`]).
    pub(crate) fn set_shared_arenas_aside(&self) -> ptl_trainer::Result<()> {
        self.recorder.set_shared_arenas_aside().map(|_| ()).map_err(|e| ptl_autograd::Error::from(e).into())
    }

    /// Drops every recording (and its pool).
    pub(crate) fn release(&self) {
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        for r in regions.values() {
            r.release();
        }
        regions.clear();
        self.recorder.release_shared();
    }
}

/// A plugin's per-fit state that holds its keyed regions.
pub(crate) trait HoldsRegions {
    type Key: Ord;
    fn keyed(&self) -> &KeyedRegions<Self::Key>;
}

/// The part of an optimizer-stage plugin that does not depend on what it records: its recorder
/// settings (checkpointed), this fit's regions, and the test hooks: `"dispatch": false` (the seam
/// acts broken, so that the mutation tests can show the replay guard failing) and
/// `inject_capture_failures` (the first N recordings fail on the CPU test double).
pub(crate) struct PluginShell<R> {
    pub(crate) config: RecorderConfig,
    regions: Option<Arc<R>>,
    dispatch: bool,
    pub(crate) inject_capture_failures: usize,
}

impl<R> Clone for PluginShell<R> {
    /// A clone starts without recordings (checkpoints and clones never carry graphs).
    fn clone(&self) -> Self {
        PluginShell {
            config: self.config.clone(),
            regions: None,
            dispatch: self.dispatch,
            inject_capture_failures: self.inject_capture_failures,
        }
    }
}

impl<R: HoldsRegions> PluginShell<R> {
    pub(crate) fn new(config: RecorderConfig) -> Self {
        PluginShell { config, regions: None, dispatch: true, inject_capture_failures: 0 }
    }

    /// Settings of plugin `name` from its `replay_config` entry (recorder fields and the test hooks).
    pub(crate) fn from_config(name: &'static str, cfg: &serde_json::Value) -> ptl_trainer::Result<Self> {
        let mut shell = PluginShell::new(crate::replay::parse_config(name, cfg)?);
        shell.dispatch = cfg["dispatch"].as_bool().unwrap_or(true);
        shell.inject_capture_failures = cfg["inject_capture_failures"].as_u64().unwrap_or(0) as usize;
        Ok(shell)
    }

    /// This fit's regions, the previous fit's released first.
    pub(crate) fn install(&mut self, regions: R) {
        self.release();
        self.regions = Some(Arc::new(regions));
    }

    /// The regions, when the plugin dispatches to them.
    pub(crate) fn active(&self) -> Option<&Arc<R>> {
        self.regions.as_ref().filter(|_| self.dispatch)
    }

    pub(crate) fn release(&self) {
        if let Some(r) = &self.regions {
            r.keyed().release();
        }
    }

    pub(crate) fn summary(&self) -> Option<String> {
        self.regions.as_ref().map(|r| r.keyed().summary_line())
    }

    pub(crate) fn counters(&self) -> serde_json::Value {
        self.regions.as_ref().map_or(serde_json::Value::Null, |r| r.keyed().counters_json())
    }

    pub(crate) fn state(&self) -> serde_json::Value {
        serde_json::json!({ "recorder": self.config })
    }

    pub(crate) fn load_state(&mut self, name: &'static str, state: &serde_json::Value) -> ptl_trainer::Result<()> {
        if !state["recorder"].is_null() {
            self.config = crate::replay::parse_config(name, &state["recorder"])?;
        }
        Ok(())
    }
}

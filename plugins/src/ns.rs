//! `replay=ns`: MuSGD's batched Newton–Schulz as recorded regions. The optimizer orthogonalises
//! its Muon momenta one shape group at a time (the groups' matrices stacked, five quintic
//! iterations of batched GEMMs and casts: ≈ 100 launches per group); each (shape, dtype, count)
//! becomes a region whose inputs are the group's matrices and whose outputs are their
//! orthogonalised updates. Newton–Schulz has no state and no hyperparameters (its coefficients are
//! constants), so a recording replays whatever the step's learning rate. The plugin reaches the
//! optimizer through `ptl_trainer::optim::with_ns_runner` around the optimizer stage.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ptl_autograd::{Device, Tensor};
use ptl_capture::{Recorder, RecorderConfig, RegionHandle, RegionSpec};
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin, Stage, StageInfo};
use ptl_trainer::optim::{with_ns_runner, NsRunner};

/// A group's key: matrix shape, dtype and how many matrices.
type GroupKey = (Vec<usize>, String, usize);

/// The recorder and one region per Newton–Schulz group.
struct NsRegions {
    recorder: Recorder,
    regions: Mutex<BTreeMap<GroupKey, Arc<RegionHandle>>>,
}

impl NsRunner for NsRegions {
    fn run_ns(
        &self,
        matrices: &[Tensor],
        body: &dyn Fn(&[Tensor]) -> ptl_trainer::Result<Vec<Tensor>>,
    ) -> ptl_trainer::Result<Vec<Tensor>> {
        let Some(first) = matrices.first() else { return body(matrices) };
        // Inside another recording (`replay=optimizer` records the whole update): run natively,
        // so the kernels go into that graph.
        #[cfg(feature = "cuda")]
        if ptl_autograd::cuda::capture_support::is_capturing() {
            return body(matrices);
        }
        let key = (first.dims().to_vec(), first.dtype().to_string(), matrices.len());
        let region = {
            let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
            let name = format!("ns.{}x{}.{}", key.0.first().copied().unwrap_or(0), key.0.get(1).copied().unwrap_or(0), key.2);
            regions.entry(key).or_insert_with(|| Arc::new(self.recorder.region(RegionSpec::per_call(name)))).clone()
        };
        let body = |xs: &[Tensor]| -> ptl_autograd::Result<Vec<Tensor>> {
            body(xs).map_err(|e| ptl_autograd::Error::InvalidArgument { op: "Newton–Schulz body", msg: e.to_string() })
        };
        ptl_autograd::no_grad(|| region.call_with(matrices, &[], &body))
            .map_err(|e| ptl_trainer::TrainerError::InvalidArgument { what: "ns replay", reason: e.to_string() })
    }
}

impl NsRegions {
    fn counters_json(&self) -> serde_json::Value {
        let regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        serde_json::Value::Object(
            regions.values().map(|r| (r.name().to_string(), serde_json::to_value(r.stats()).unwrap_or(serde_json::Value::Null))).collect(),
        )
    }
    fn release(&self) {
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        for r in regions.values() {
            r.release();
        }
        regions.clear();
    }
}

/// The `ns` replay plugin. Configuration: `ptl_capture::RecorderConfig` fields as JSON over
/// [`crate::plugin_defaults`].
pub struct NsReplay {
    config: RecorderConfig,
    regions: Option<Arc<NsRegions>>,
    /// Test hook (`"dispatch": false`): the optimizer stage is not wrapped, as if the seam were
    /// broken — the mutation tests show that the replay guard then fails.
    dispatch: bool,
}

impl Clone for NsReplay {
    /// A clone starts without recordings (checkpoints and clones never carry graphs).
    fn clone(&self) -> Self {
        NsReplay { config: self.config.clone(), regions: None, dispatch: self.dispatch }
    }
}

impl NsReplay {
    pub const NAME: &'static str = "ns";

    pub fn new(config: RecorderConfig) -> NsReplay {
        NsReplay { config, regions: None, dispatch: true }
    }

    fn from_config(cfg: &serde_json::Value) -> ptl_trainer::Result<Box<dyn ReplayPlugin>> {
        let mut p = NsReplay::new(crate::replay::parse_config(Self::NAME, cfg)?);
        p.dispatch = cfg["dispatch"].as_bool().unwrap_or(true);
        Ok(Box::new(p))
    }

    fn recorder(&self, device: Device) -> Recorder {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Recorder::cuda(self.config.clone()),
            _ => Recorder::with_backend(self.config.clone(), Arc::new(ptl_capture::testing::ReplayNatively::default())),
        }
    }
}

impl ReplayPlugin for NsReplay {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn priority(&self) -> i32 {
        10
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        if let Some(r) = self.regions.take() {
            r.release();
        }
        self.regions = Some(Arc::new(NsRegions { recorder: self.recorder(ctx.config.device), regions: Mutex::new(BTreeMap::new()) }));
        Ok(())
    }
    fn around(&self, info: StageInfo, next: &mut dyn FnMut() -> ptl_trainer::Result<()>) -> ptl_trainer::Result<()> {
        match (&self.regions, info.stage, self.dispatch) {
            (Some(r), Stage::OptimizerStep, true) => with_ns_runner(r.clone(), next),
            _ => next(),
        }
    }
    fn on_fit_end(&self) {
        if let Some(r) = &self.regions {
            r.release();
        }
    }
    fn summary(&self) -> Option<String> {
        self.regions.as_ref().map(|r| r.recorder.summary_line())
    }
    fn counters(&self) -> serde_json::Value {
        self.regions.as_ref().map_or(serde_json::Value::Null, |r| r.counters_json())
    }
    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "recorder": self.config })
    }
    fn load_state(&mut self, state: &serde_json::Value) -> ptl_trainer::Result<()> {
        if !state["recorder"].is_null() {
            self.config = crate::replay::parse_config(Self::NAME, &state["recorder"])?;
        }
        Ok(())
    }
}

inventory::submit! {
    PluginRegistration { name: NsReplay::NAME, in_all: true, create: NsReplay::from_config }
}

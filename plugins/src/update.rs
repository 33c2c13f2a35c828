//! `replay=optimizer`: the device part of the optimizer step — gradient clipping and the SGD /
//! MuSGD update (Newton–Schulz included) — as one recorded region per gradient-presence mask.
//! What makes it recordable: the step's scalars live on the device (the optimizer's host part
//! writes them before the region, `Optimizer::prepare_step`), the gradients have fixed buffers
//! (the plugin asks for persistent gradients), and the recorder's warmup rolls back everything the
//! update writes (parameters, momenta: the write journal). Under 16-mixed the grad scaler decides
//! on the host, so the trainer does not hand the update to a plugin.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ptl_autograd::{Device, Tensor, TensorKind};
use ptl_capture::{Recorder, RecorderConfig, RegionHandle, RegionSpec};
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin};

/// The plugin's recorder and its regions, one per gradient-presence mask.
struct UpdateRegions {
    recorder: Recorder,
    params: Vec<(String, Tensor)>,
    regions: Mutex<BTreeMap<Vec<bool>, Arc<RegionHandle>>>,
}

/// The `optimizer` replay plugin. Configuration: `ptl_capture::RecorderConfig` fields as JSON over
/// [`crate::plugin_defaults`].
pub struct UpdateReplay {
    config: RecorderConfig,
    regions: Option<Arc<UpdateRegions>>,
    /// Test hook (`"dispatch": false`): the update is not claimed, as if the seam were broken.
    dispatch: bool,
}

impl Clone for UpdateReplay {
    /// A clone starts without recordings (checkpoints and clones never carry graphs).
    fn clone(&self) -> Self {
        UpdateReplay { config: self.config.clone(), regions: None, dispatch: self.dispatch }
    }
}

impl UpdateReplay {
    pub const NAME: &'static str = "optimizer";

    pub fn new(config: RecorderConfig) -> UpdateReplay {
        UpdateReplay { config, regions: None, dispatch: true }
    }

    fn from_config(cfg: &serde_json::Value) -> ptl_trainer::Result<Box<dyn ReplayPlugin>> {
        let mut p = UpdateReplay::new(crate::replay::parse_config(Self::NAME, cfg)?);
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

impl UpdateRegions {
    fn run(&self, body: &mut dyn FnMut() -> ptl_trainer::Result<()>) -> ptl_trainer::Result<()> {
        let mask: Vec<bool> = self.params.iter().map(|(_, p)| p.grad().is_some()).collect();
        // What the update reads and writes in place: the parameters and their (persistent)
        // gradients — their addresses key the recording (a moved buffer retires it).
        let mut surface: Vec<(String, Tensor, TensorKind)> = Vec::with_capacity(2 * self.params.len());
        for ((name, p), present) in self.params.iter().zip(&mask) {
            surface.push((name.clone(), p.detach(), TensorKind::Buffer));
            if let (true, Some(g)) = (*present, p.grad()) {
                surface.push((format!("{name}.grad"), g, TensorKind::Buffer));
            }
        }
        let region = {
            let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
            let name = format!("update.{}", regions.len());
            regions.entry(mask).or_insert_with(|| Arc::new(self.recorder.region(RegionSpec::per_call(name)))).clone()
        };
        let body = std::cell::RefCell::new(body);
        let run = |_: &[Tensor]| -> ptl_autograd::Result<Vec<Tensor>> {
            let mut b = body.borrow_mut();
            (*b)().map_err(|e| ptl_autograd::Error::InvalidArgument { op: "optimizer update body", msg: e.to_string() })?;
            Ok(Vec::new())
        };
        ptl_autograd::no_grad(|| region.call_with(&[], &surface, &run))
            .map(|_| ())
            .map_err(|e| ptl_trainer::TrainerError::InvalidArgument { what: "optimizer replay", reason: e.to_string() })
    }

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

impl ReplayPlugin for UpdateReplay {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn priority(&self) -> i32 {
        20
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        if let Some(r) = self.regions.take() {
            r.release();
        }
        self.regions = Some(Arc::new(UpdateRegions {
            recorder: self.recorder(ctx.config.device),
            params: ctx.params.to_vec(),
            regions: Mutex::new(BTreeMap::new()),
        }));
        Ok(())
    }
    fn persistent_gradients(&self) -> bool {
        true
    }
    fn claims_update(&self) -> bool {
        self.dispatch && self.regions.is_some()
    }
    fn run_update(&self, body: &mut dyn FnMut() -> ptl_trainer::Result<()>) -> ptl_trainer::Result<()> {
        match &self.regions {
            Some(r) => r.run(body),
            None => body(),
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
    PluginRegistration { name: UpdateReplay::NAME, in_all: false, create: UpdateReplay::from_config }
}

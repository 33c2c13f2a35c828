//! `replay=ns`: MuSGD's batched Newton–Schulz as recorded regions. The optimizer orthogonalises
//! its Muon momenta one shape group at a time (the groups' matrices stacked, five quintic
//! iterations of batched GEMMs and casts: ≈ 100 launches per group); each (shape, dtype, count)
//! becomes a region whose inputs are the group's matrices and whose outputs are their
//! orthogonalised updates. Newton–Schulz has no state and no hyperparameters (its coefficients are
//! constants), so a recording replays whatever the step's learning rate. The plugin reaches the
//! optimizer through `ptl_trainer::optim::with_ns_runner` around the optimizer stage.

use std::sync::Arc;

use ptl_autograd::Tensor;
use ptl_capture::RecorderConfig;
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin, Stage, StageInfo};
use ptl_trainer::optim::{with_ns_runner, NsRunner};

use crate::keyed::KeyedRegions;

/// A group's key: matrix shape, dtype and how many matrices.
type GroupKey = (Vec<usize>, String, usize);

/// One region per Newton–Schulz group.
struct NsRegions(KeyedRegions<GroupKey>);

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
        let name = format!("ns.{}x{}.{}", key.0.first().copied().unwrap_or(0), key.0.get(1).copied().unwrap_or(0), key.2);
        let region = self.0.region(key, |_| name);
        let body = |xs: &[Tensor]| -> ptl_autograd::Result<Vec<Tensor>> {
            body(xs).map_err(|e| ptl_autograd::Error::InvalidArgument { op: "Newton–Schulz body", msg: e.to_string() })
        };
        ptl_autograd::no_grad(|| region.call_with(matrices, &[], &body))
            .map_err(|e| ptl_trainer::TrainerError::InvalidArgument { what: "ns replay", reason: e.to_string() })
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
            r.0.release();
        }
        self.regions = Some(Arc::new(NsRegions(KeyedRegions::new(&self.config, ctx.config.device))));
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
            r.0.release();
        }
    }
    fn cadence(&self) -> ptl_trainer::fit::ReplayCadence {
        ptl_trainer::fit::ReplayCadence::PerOptimizerStep
    }
    fn summary(&self) -> Option<String> {
        self.regions.as_ref().map(|r| r.0.summary_line())
    }
    fn counters(&self) -> serde_json::Value {
        self.regions.as_ref().map_or(serde_json::Value::Null, |r| r.0.counters_json())
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

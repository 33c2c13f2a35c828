//! `replay=ns`: MuSGD's Newton–Schulz as recorded regions. The optimizer orthogonalises each
//! Muon group's momenta in one call (packed into a few zero-padded batches, five quintic
//! iterations of three GEMMs each per batch); each call's (shapes, dtype) becomes a region whose
//! inputs are the group's matrices and whose outputs are their orthogonalised, scaled updates.
//! Newton–Schulz has no state and no hyperparameters (its coefficients are constants), so a
//! recording replays whatever the step's learning rate. The plugin reaches the optimizer through
//! `ptl_trainer::optim::with_ns_runner` around the optimizer stage. A plugin that records the
//! whole update (`replay=optimizer`) installs its own runner inside it, so these regions are not
//! used then.

use ptl_autograd::Tensor;
use ptl_capture::RecorderConfig;
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin, Stage, StageInfo};
use ptl_trainer::optim::{with_ns_runner, NsRunner};

use crate::keyed::{HoldsRegions, KeyedRegions, PluginShell};

/// A call's key: every matrix's shape, in order, and the dtype.
type GroupKey = (Vec<Vec<usize>>, String);

/// One region per Newton–Schulz call (per Muon group).
struct NsRegions(KeyedRegions<GroupKey>);

impl NsRunner for NsRegions {
    fn run_ns(
        &self,
        matrices: &[Tensor],
        body: &dyn Fn(&[Tensor]) -> ptl_trainer::Result<Vec<Tensor>>,
    ) -> ptl_trainer::Result<Vec<Tensor>> {
        let Some(first) = matrices.first() else { return body(matrices) };
        let key: GroupKey = (matrices.iter().map(|m| m.dims().to_vec()).collect(), first.dtype().to_string());
        let count = matrices.len();
        // Named in order of first use: `ns.<region index>.<matrices>`, unique within the fit.
        let region = self.0.region(key, |made| format!("ns.{}.{count}", made.len()));
        let body = |xs: &[Tensor]| -> ptl_autograd::Result<Vec<Tensor>> {
            body(xs).map_err(|e| ptl_autograd::Error::InvalidArgument { op: "Newton–Schulz body", msg: e.to_string() })
        };
        ptl_autograd::no_grad(|| region.call_with(matrices, &[], &body))
            .map_err(|e| ptl_trainer::TrainerError::InvalidArgument { what: "ns replay", reason: e.to_string() })
    }
}

/// The `ns` replay plugin. Configuration: `ptl_capture::RecorderConfig` fields as JSON over
/// [`crate::plugin_defaults`].
#[derive(Clone)]
pub struct NsReplay {
    shell: PluginShell<NsRegions>,
}

impl HoldsRegions for NsRegions {
    type Key = GroupKey;
    fn keyed(&self) -> &KeyedRegions<GroupKey> {
        &self.0
    }
}

impl NsReplay {
    pub const NAME: &'static str = "ns";

    pub fn new(config: RecorderConfig) -> NsReplay {
        NsReplay { shell: PluginShell::new(config) }
    }

    fn from_config(cfg: &serde_json::Value) -> ptl_trainer::Result<Box<dyn ReplayPlugin>> {
        Ok(Box::new(NsReplay { shell: PluginShell::from_config(Self::NAME, cfg)? }))
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
        let regions = NsRegions(KeyedRegions::new(&self.shell.config, ctx.config.device));
        self.shell.install(regions);
        Ok(())
    }
    fn around(&self, info: StageInfo, next: &mut dyn FnMut() -> ptl_trainer::Result<()>) -> ptl_trainer::Result<()> {
        match (self.shell.active(), info.stage) {
            (Some(r), Stage::OptimizerStep) => with_ns_runner(r.clone(), next),
            _ => next(),
        }
    }
    fn on_fit_end(&self) {
        self.shell.release();
    }
    fn cadence(&self) -> ptl_trainer::fit::ReplayCadence {
        ptl_trainer::fit::ReplayCadence::PerOptimizerStep
    }
    fn summary(&self) -> Option<String> {
        self.shell.summary()
    }
    fn counters(&self) -> serde_json::Value {
        self.shell.counters()
    }
    fn state(&self) -> serde_json::Value {
        self.shell.state()
    }
    fn load_state(&mut self, state: &serde_json::Value) -> ptl_trainer::Result<()> {
        self.shell.load_state(Self::NAME, state)
    }
}

inventory::submit! {
    PluginRegistration { name: NsReplay::NAME, in_all: true, create: NsReplay::from_config }
}

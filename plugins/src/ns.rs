//! `replay=ns`: MuSGD's Newton–Schulz as recorded regions. The optimizer orthogonalises each
//! Muon group's momenta in one call (packed into a few zero-padded batches, five quintic
//! iterations of three GEMMs each per batch); each call's (shapes, dtype) becomes a region whose
//! inputs are the group's matrices and whose outputs are their orthogonalised, scaled updates.
//! Newton–Schulz has no state and no hyperparameters (its coefficients are constants), so a
//! recording replays whatever the step's learning rate. The call is the step's
//! `Site::NewtonSchulz`, nested in the update (`Site::Update(Step)`): a plugin that records the
//! whole update (`replay=optimizer`) runs its nested sites natively, so these regions are not used
//! then.

use ptl_autograd::Tensor;
use ptl_capture::RecorderConfig;
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin, Site, SiteBody, SiteCall, SiteRunner};

use crate::keyed::{region_body, HoldsRegions, KeyedRegions, PluginShell};

/// A call's key: every matrix's shape, in order, and the dtype.
type GroupKey = (Vec<Vec<usize>>, String);

/// One region per Newton–Schulz call (per Muon group).
struct NsRegions(KeyedRegions<GroupKey>);

impl NsRegions {
    fn run(&self, matrices: &[Tensor], body: &mut SiteBody<'_>, rest: &dyn SiteRunner) -> ptl_trainer::Result<Vec<Tensor>> {
        let Some(first) = matrices.first() else { return body(rest, matrices) };
        let key: GroupKey = (matrices.iter().map(|m| m.dims().to_vec()).collect(), first.dtype().to_string());
        let count = matrices.len();
        // Named in order of first use: `ns.<region index>.<matrices>`, unique within the fit.
        let region = self.0.region(key, |made| format!("ns.{}.{count}", made.len()));
        let body = region_body(body, "Newton–Schulz body");
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
    /// The plugin's name in `replay=`.
    pub const NAME: &'static str = "ns";

    /// The plugin with `config` for its recorders (one per shape group of Newton–Schulz).
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
        let regions = NsRegions(KeyedRegions::new(&self.shell.config, ctx.device, self.shell.inject_capture_failures));
        self.shell.install(regions);
        Ok(())
    }
    fn claims(&self, site: Site) -> bool {
        site == Site::NewtonSchulz && self.shell.active().is_some()
    }
    fn run(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>, rest: &dyn SiteRunner) -> ptl_trainer::Result<Vec<Tensor>> {
        match self.shell.active() {
            Some(r) => r.run(call.inputs, body, rest),
            None => body(rest, call.inputs),
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

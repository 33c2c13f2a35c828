//! `replay=loss` and `replay=step`: the dense criterion recorded alone, or together with the
//! model's forward — one type, two scopes.
//!
//! `loss`: the dense criterion's device work — both branches' fixed-shape assignment (four fused
//! kernels each on CUDA), their loss terms over the compacted foreground, one RLE flow evaluation
//! and the branch mix — as one recorded region and autograd node per input signature (batch size
//! and target bucket). What makes it recordable: `loss_assigner=dense` has no host read and no
//! data-dependent shape (the targets are padded to a bucket and uploaded before the region, the
//! loss values leave the region as device tensors read a step later, the epoch's branch weights
//! are an input), and its constants are made on the first (warm-up) call. Its inputs: the two
//! branches' raw outputs, the padded targets, the weights; its surface: the RLE flow's parameters
//! (their gradients come out of the region's backward).
//!
//! `step`: the model's forward (trunk and all 18 stems, run natively inside the body) and that
//! criterion as one region per input signature: its inputs are the images, the padded targets
//! and the weights, its surface every parameter and buffer of the model, so a steady-state step
//! is one forward graph and one backward graph (which writes or adds every parameter's gradient
//! in place) — the trunk, stem and loss regions then see no call. A step the dense criterion
//! cannot take (targets beyond the largest bucket) goes through the pieces as before.
//!
//! Both are in `replay=all`; without the dense criterion (the CPU's default
//! `loss_assigner=host`) they record nothing.

use ptl_autograd::Tensor;
use ptl_capture::RecorderConfig;
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin, Site, SiteBody, SiteCall, SiteRunner};

use crate::keyed::{region_body, HoldsRegions, KeyedRegions, PluginShell};

/// A call's key: every input's shape and dtype, in order.
type LossKey = Vec<(Vec<usize>, String)>;

struct LossRegions(KeyedRegions<LossKey>);

impl HoldsRegions for LossRegions {
    type Key = LossKey;
    fn keyed(&self) -> &KeyedRegions<LossKey> {
        &self.0
    }
}

/// The `loss` and `step` replay plugins. Configuration: `ptl_capture::RecorderConfig` fields as
/// JSON over [`crate::plugin_defaults`].
#[derive(Clone)]
pub struct LossReplay {
    shell: PluginShell<LossRegions>,
    /// `step`: the forward recorded with the criterion.
    with_forward: bool,
}

impl LossReplay {
    /// The plugin's name in `replay=` (the criterion recorded on its own).
    pub const NAME: &'static str = "loss";
    /// The plugin that records a step's forward together with the criterion.
    pub const STEP: &'static str = "step";

    /// The `loss` plugin (`with_forward`: the `step` plugin).
    pub fn new(config: RecorderConfig, with_forward: bool) -> LossReplay {
        LossReplay { shell: PluginShell::new(config), with_forward }
    }

    fn from_config(with_forward: bool, cfg: &serde_json::Value) -> ptl_trainer::Result<Box<dyn ReplayPlugin>> {
        let name = if with_forward { Self::STEP } else { Self::NAME };
        let mut shell = PluginShell::from_config(name, cfg)?;
        // One region per target bucket, one bucket per batch: the buckets' forward graphs take
        // turns and share one arena (unless the configuration says otherwise).
        if cfg.get("share_forward_arena").is_none() {
            shell.config.share_forward_arena = true;
        }
        Ok(Box::new(LossReplay { shell, with_forward }))
    }

    /// The site this plugin records: the criterion alone, or with the forward.
    fn site(&self) -> Site {
        if self.with_forward {
            Site::ForwardLoss
        } else {
            Site::Loss
        }
    }
}

impl ReplayPlugin for LossReplay {
    fn name(&self) -> &'static str {
        if self.with_forward {
            Self::STEP
        } else {
            Self::NAME
        }
    }
    fn priority(&self) -> i32 {
        if self.with_forward {
            -20
        } else {
            5
        }
    }
    /// A recorded step writes or adds every parameter's gradient inside its backward graph.
    fn persistent_gradients(&self) -> bool {
        self.with_forward
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        self.shell.install(LossRegions(KeyedRegions::new(&self.shell.config, ctx.device, self.shell.inject_capture_failures)));
        Ok(())
    }
    fn claims(&self, site: Site) -> bool {
        site == self.site() && self.shell.active().is_some()
    }
    /// The recorder's warm-up calls (for its first signature).
    fn calls_before_recording(&self, site: Site) -> Option<usize> {
        (site == self.site() && self.shell.active().is_some()).then_some(self.shell.config.warmup_calls)
    }
    /// Records the region of the call's signature without running it
    /// (`ptl_capture::RegionHandle::prepare`): the fit hands the step with the largest target
    /// bucket its data can give, so the buckets' shared forward arena is laid out for it first.
    fn prepare(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>) -> ptl_trainer::Result<bool> {
        let Some(r) = self.shell.active() else { return Ok(false) };
        let key: LossKey = call.inputs.iter().map(|t| (t.dims().to_vec(), t.dtype().to_string())).collect();
        let name = self.name();
        let region = r.0.region(key, |made| format!("{name}.{}", made.len()));
        let body = region_body(body, "loss body");
        region.prepare(call.inputs, call.surface, &body).map_err(|e| ptl_trainer::TrainerError::InvalidArgument {
            what: if self.with_forward { "step replay" } else { "loss replay" },
            reason: e.to_string(),
        })
    }
    /// Records the body as the region of its input signature (`loss.<n>` / `step.<n>`, numbered
    /// in order of first use).
    fn run(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>, rest: &dyn SiteRunner) -> ptl_trainer::Result<Vec<Tensor>> {
        let Some(r) = self.shell.active() else { return body(rest, call.inputs) };
        let key: LossKey = call.inputs.iter().map(|t| (t.dims().to_vec(), t.dtype().to_string())).collect();
        let name = self.name();
        let region = r.0.region(key, |made| format!("{name}.{}", made.len()));
        let body = region_body(body, "loss body");
        region.call_with(call.inputs, call.surface, &body).map_err(|e| ptl_trainer::TrainerError::InvalidArgument {
            what: if self.with_forward { "step replay" } else { "loss replay" },
            reason: e.to_string(),
        })
    }
    /// Validation runs natively between two steps: the step's shared arenas give their memory
    /// back meanwhile (the next step's replay maps them again), so validation's working set does
    /// not add to theirs.
    fn on_validation_start(&self) -> ptl_trainer::Result<()> {
        match self.shell.active() {
            Some(r) => r.0.set_shared_arenas_aside(),
            None => Ok(()),
        }
    }
    fn on_fit_end(&self) {
        self.shell.release();
    }
    fn cadence(&self) -> ptl_trainer::fit::ReplayCadence {
        ptl_trainer::fit::ReplayCadence::OnePerBatch
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
    PluginRegistration { name: LossReplay::NAME, in_all: true, create: |cfg| LossReplay::from_config(false, cfg) }
}

inventory::submit! {
    PluginRegistration { name: LossReplay::STEP, in_all: true, create: |cfg| LossReplay::from_config(true, cfg) }
}

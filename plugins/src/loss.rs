//! `replay=loss`: the dense criterion's device work — both branches' fixed-shape assignment
//! (four fused kernels each on CUDA), their loss terms over the compacted foreground, one RLE
//! flow evaluation and the branch mix — as one recorded region and autograd node per input
//! signature (batch size and target bucket). What makes it recordable: `loss_assigner=dense`
//! has no host read and no data-dependent shape (the targets are padded to a bucket and uploaded
//! before the region, the loss values leave the region as device tensors read a step later, the
//! epoch's branch weights are an input), and its constants are made on the first (warm-up) call.
//! Its inputs: the two branches' raw outputs, the padded targets, the weights; its surface: the
//! RLE flow's parameters (their gradients come out of the region's backward).
//!
//! In `replay=all` (`replay=feature,stem,loss` names it alone). Without the dense criterion (the
//! CPU's default `loss_assigner=host`) it records nothing.

use ptl_autograd::{Tensor, TensorKind};
use ptl_capture::RecorderConfig;
use ptl_trainer::fit::{LossBody, PluginRegistration, PluginSetup, ReplayPlugin};

use crate::keyed::{HoldsRegions, KeyedRegions, PluginShell};

/// A call's key: every input's shape and dtype, in order.
type LossKey = Vec<(Vec<usize>, String)>;

struct LossRegions(KeyedRegions<LossKey>);

impl HoldsRegions for LossRegions {
    type Key = LossKey;
    fn keyed(&self) -> &KeyedRegions<LossKey> {
        &self.0
    }
}

/// The `loss` replay plugin. Configuration: `ptl_capture::RecorderConfig` fields as JSON over
/// [`crate::plugin_defaults`].
#[derive(Clone)]
pub struct LossReplay {
    shell: PluginShell<LossRegions>,
}

impl LossReplay {
    pub const NAME: &'static str = "loss";

    pub fn new(config: RecorderConfig) -> LossReplay {
        LossReplay { shell: PluginShell::new(config) }
    }

    fn from_config(cfg: &serde_json::Value) -> ptl_trainer::Result<Box<dyn ReplayPlugin>> {
        Ok(Box::new(LossReplay { shell: PluginShell::from_config(Self::NAME, cfg)? }))
    }
}

impl ReplayPlugin for LossReplay {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn priority(&self) -> i32 {
        5
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        self.shell.install(LossRegions(KeyedRegions::new(&self.shell.config, ctx.config.device)));
        Ok(())
    }
    fn claims_loss(&self) -> bool {
        self.shell.active().is_some()
    }
    fn run_loss(
        &self,
        inputs: &[Tensor],
        surface: &[(String, Tensor, TensorKind)],
        body: &LossBody<'_>,
    ) -> ptl_trainer::Result<Vec<Tensor>> {
        let Some(r) = self.shell.active() else { return body(inputs) };
        let key: LossKey = inputs.iter().map(|t| (t.dims().to_vec(), t.dtype().to_string())).collect();
        // Named in order of first use: `loss.<region index>`.
        let region = r.0.region(key, |made| format!("loss.{}", made.len()));
        let body = |xs: &[Tensor]| -> ptl_autograd::Result<Vec<Tensor>> {
            body(xs).map_err(|e| ptl_autograd::Error::InvalidArgument { op: "loss body", msg: e.to_string() })
        };
        region
            .call_with(inputs, surface, &body)
            .map_err(|e| ptl_trainer::TrainerError::InvalidArgument { what: "loss replay", reason: e.to_string() })
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
    PluginRegistration { name: LossReplay::NAME, in_all: true, create: LossReplay::from_config }
}

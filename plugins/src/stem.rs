//! Stem replay: each of the head's 18 stems as its own recorded region and autograd node.

use ptl_autograd::{Tensor, TensorKind};
use ptl_capture::RecorderConfig;
use ptl_heads::{Piece, PieceBody, PoseModel};
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin};

use crate::feature::{injected_failures, parse_config};
use crate::PieceRegions;

/// `replay=stem`. Each stem has its own signature (the one-to-many stems read features that
/// require grad, the one-to-one stems detached ones), recordings and counters; a point stem's
/// region includes its keypoint and uncertainty views.
#[derive(Clone)]
pub struct StemPlugin {
    regions: PieceRegions,
}

impl StemPlugin {
    pub const NAME: &'static str = "stem";

    pub fn new(config: RecorderConfig) -> StemPlugin {
        StemPlugin { regions: PieceRegions::new(config) }
    }

    /// Counters of the stem regions.
    pub fn regions(&self) -> &PieceRegions {
        &self.regions
    }
}

impl ReplayPlugin for StemPlugin {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        self.regions.start(ctx.config.device);
        Ok(())
    }
    fn claims(&self, piece: Piece) -> bool {
        matches!(piece, Piece::Stem { .. })
    }
    fn run_piece(
        &self,
        model: &PoseModel,
        piece: Piece,
        inputs: &[Tensor],
        surface: &[(String, Tensor, TensorKind)],
        body: &PieceBody<'_>,
    ) -> ptl_heads::Result<Vec<Tensor>> {
        self.regions.run(model, piece, inputs, surface, body)
    }
    fn on_fit_end(&self) {
        self.regions.release();
    }
    fn summary(&self) -> Option<String> {
        self.regions.summary()
    }
    fn counters(&self) -> serde_json::Value {
        self.regions.counters_json()
    }
    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "recorder": self.regions.config() })
    }
    fn load_state(&mut self, state: &serde_json::Value) -> ptl_trainer::Result<()> {
        if !state["recorder"].is_null() {
            self.regions.set_config(parse_config(Self::NAME, &state["recorder"])?);
        }
        Ok(())
    }
}

inventory::submit! {
    PluginRegistration {
        name: StemPlugin::NAME,
        create: |cfg| {
            let mut p = StemPlugin::new(parse_config(StemPlugin::NAME, cfg)?);
            p.regions.inject_capture_failures(injected_failures(cfg));
            Ok(Box::new(p))
        },
    }
}

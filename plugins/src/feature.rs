//! Shared-feature replay: the trunk (backbone + neck) as one recorded region.

use ptl_autograd::{Tensor, TensorKind};
use ptl_capture::RecorderConfig;
use ptl_heads::{Piece, PieceBody, PoseModel};
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin};

use crate::PieceRegions;

/// `replay=feature`. Configuration: a `ptl_capture::RecorderConfig` as JSON (`replay_config=
/// {"feature": {"warmup_calls": 2}}`).
#[derive(Clone)]
pub struct FeaturePlugin {
    regions: PieceRegions,
    /// The trunk has frozen parameters: this fit runs it natively.
    trunk_frozen: bool,
}

impl FeaturePlugin {
    pub const NAME: &'static str = "feature";

    pub fn new(config: RecorderConfig) -> FeaturePlugin {
        FeaturePlugin { regions: PieceRegions::new(config), trunk_frozen: false }
    }

    /// Counters of the trunk region.
    pub fn regions(&self) -> &PieceRegions {
        &self.regions
    }
}

/// The recorder settings of a plugin: `ptl_capture::RecorderConfig` fields over the plugins'
/// defaults — one recording per region, so a temporary shape (the last partial batch, another
/// image size) runs natively and replay resumes on the recorded shape.
pub(crate) fn parse_config(name: &str, cfg: &serde_json::Value) -> ptl_trainer::Result<RecorderConfig> {
    let mut cfg = cfg.clone();
    if let Some(m) = cfg.as_object_mut() {
        m.remove("inject_capture_failures");
    }
    let cfg = &cfg;
    let mut merged = serde_json::to_value(plugin_defaults()).unwrap_or_default();
    if let (Some(m), Some(given)) = (merged.as_object_mut(), cfg.as_object()) {
        for (k, v) in given {
            m.insert(k.clone(), v.clone());
        }
    } else if !cfg.is_null() {
        return Err(ptl_trainer::TrainerError::InvalidArgument {
            what: "replay_config",
            reason: format!("`{name}`: expected a JSON object of recorder settings, got {cfg}"),
        });
    }
    serde_json::from_value(merged).map_err(|e| ptl_trainer::TrainerError::InvalidArgument {
        what: "replay_config",
        reason: format!("`{name}`: {e} (fields of ptl_capture::RecorderConfig: enabled, warmup_calls, warmup_iters, max_recordings, …)"),
    })
}

/// `inject_capture_failures` of a plugin configuration (a test hook: that many captures fail).
pub(crate) fn injected_failures(cfg: &serde_json::Value) -> usize {
    cfg["inject_capture_failures"].as_u64().unwrap_or(0) as usize
}

/// Recorder defaults of the replay plugins.
pub fn plugin_defaults() -> RecorderConfig {
    RecorderConfig { max_recordings: 1, ..RecorderConfig::default() }
}

impl ReplayPlugin for FeaturePlugin {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn priority(&self) -> i32 {
        -10
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        self.regions.start(ctx.config.device);
        let surface = ctx.model.piece_surface(Piece::Trunk);
        let frozen = surface.iter().filter(|(_, t, k)| *k == TensorKind::Parameter && !t.requires_grad()).count();
        self.trunk_frozen = frozen > 0;
        if self.trunk_frozen {
            eprintln!("ptl: feature replay: {frozen} trunk parameters are frozen (freeze=…): the trunk runs natively for this whole fit");
        }
        Ok(())
    }
    fn claims(&self, piece: Piece) -> bool {
        piece == Piece::Trunk && !self.trunk_frozen
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
        name: FeaturePlugin::NAME,
        create: |cfg| {
            let mut p = FeaturePlugin::new(parse_config(FeaturePlugin::NAME, cfg)?);
            p.regions.inject_capture_failures(injected_failures(cfg));
            Ok(Box::new(p))
        },
    }
}

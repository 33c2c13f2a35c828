//! The two replay plugins: one type, two scopes. `feature` records the trunk (backbone + neck)
//! as one region; `stem` records each of the head's 18 stems as its own region and autograd node
//! (the one-to-many stems read features that require grad, the one-to-one stems detached ones,
//! so each stem has its own signature; a point stem's region includes its views).

use ptl_autograd::{Tensor, TensorKind};
use ptl_capture::RecorderConfig;
use ptl_heads::Piece;
use ptl_trainer::fit::{NativeSites, PluginRegistration, PluginSetup, ReplayPlugin, Site, SiteBody, SiteCall, SiteRunner};

use crate::PieceRegions;

/// Which pieces a [`PieceReplay`] records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The trunk (`replay=feature`).
    Trunk,
    /// The 18 head stems (`replay=stem`).
    Stems,
}

impl Scope {
    /// The plugin name of this scope in `replay=`.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Trunk => PieceReplay::FEATURE,
            Scope::Stems => PieceReplay::STEM,
        }
    }
    fn covers(self, piece: Piece) -> bool {
        match self {
            Scope::Trunk => piece == Piece::Trunk,
            Scope::Stems => matches!(piece, Piece::Stem { .. }),
        }
    }
}

/// A replay plugin over the pieces of one [`Scope`]. Configuration: `ptl_capture::RecorderConfig`
/// fields as JSON over [`plugin_defaults`] (`replay_config={"stem": {"warmup_calls": 2}}`).
#[derive(Clone)]
pub struct PieceReplay {
    scope: Scope,
    regions: PieceRegions,
    /// The scope's pieces run natively for this whole fit (the trunk has frozen parameters).
    native_for_fit: bool,
    /// Test hook (`"dispatch": false`): the plugin claims no piece, as if the trainer's dispatch
    /// to it were broken — the mutation tests show that the identity tests then fail.
    dispatch: bool,
}

/// Recorder defaults of the replay plugins: one recording per region, so a temporary shape (the
/// last partial batch, another image size) runs natively and replay resumes on the recorded one;
/// the plugins' backward graphs and the optimizer's update graphs take turns in one arena
/// (`take_turns`: they never run at the same time).
pub fn plugin_defaults() -> RecorderConfig {
    RecorderConfig { max_recordings: 1, take_turns: true, ..RecorderConfig::default() }
}

/// Configuration keys that steer tests, not the recorder.
const TEST_HOOKS: [&str; 2] = ["inject_capture_failures", "dispatch"];

/// The recorder settings of plugin `name` from its JSON configuration (the test hook
/// hooks `inject_capture_failures` and `dispatch` are taken out first).
pub(crate) fn parse_config(name: &str, cfg: &serde_json::Value) -> ptl_trainer::Result<RecorderConfig> {
    let bad = |reason: String| ptl_trainer::TrainerError::InvalidArgument { what: "replay_config", reason: format!("`{name}`: {reason}") };
    let mut merged = serde_json::to_value(plugin_defaults()).map_err(|e| bad(e.to_string()))?;
    match (merged.as_object_mut(), cfg) {
        (_, serde_json::Value::Null) => {}
        (Some(m), serde_json::Value::Object(given)) => {
            // A misspelt field would otherwise be dropped without a word.
            if let Some(unknown) = given.keys().find(|k| !m.contains_key(k.as_str()) && !TEST_HOOKS.contains(&k.as_str())) {
                let mut fields: Vec<&str> = m.keys().map(String::as_str).collect();
                fields.sort_unstable();
                return Err(bad(format!("unknown setting `{unknown}` (a replay plugin takes {})", fields.join(", "))));
            }
            m.extend(given.iter().filter(|(k, _)| !TEST_HOOKS.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())));
        }
        _ => return Err(bad(format!("expected a JSON object of recorder settings, got {cfg}"))),
    }
    serde_json::from_value(merged)
        .map_err(|e| bad(format!("{e} (fields of ptl_capture::RecorderConfig: enabled, warmup_calls, warmup_iters, max_recordings, …)")))
}

impl PieceReplay {
    /// `replay=feature`: the trunk recorded as one region.
    pub const FEATURE: &'static str = "feature";
    /// `replay=stem`: each of the head's 18 stems recorded as its own region.
    pub const STEM: &'static str = "stem";

    /// The plugin for `scope` with `config` for its recorders.
    pub fn new(scope: Scope, config: RecorderConfig) -> PieceReplay {
        PieceReplay { scope, regions: PieceRegions::new(config), native_for_fit: false, dispatch: true }
    }

    /// The plugin from its registration's configuration.
    fn from_config(scope: Scope, cfg: &serde_json::Value) -> ptl_trainer::Result<Box<dyn ReplayPlugin>> {
        let mut p = PieceReplay::new(scope, parse_config(scope.name(), cfg)?);
        p.regions.inject_capture_failures(cfg["inject_capture_failures"].as_u64().unwrap_or(0) as usize);
        p.dispatch = cfg["dispatch"].as_bool().unwrap_or(true);
        Ok(Box::new(p))
    }

    /// Which pieces this plugin records.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// The recorder and its regions (counters).
    pub fn regions(&self) -> &PieceRegions {
        &self.regions
    }
}

impl ReplayPlugin for PieceReplay {
    fn name(&self) -> &'static str {
        self.scope.name()
    }
    /// With fixed gradient buffers a recorded backward adds (or writes) the parameters'
    /// gradients inside its graph instead of the host adding them in afterwards.
    fn persistent_gradients(&self) -> bool {
        true
    }
    fn priority(&self) -> i32 {
        match self.scope {
            Scope::Trunk => -10,
            Scope::Stems => 0,
        }
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        self.regions.start(ctx.device);
        self.native_for_fit = false;
        if self.scope == Scope::Trunk {
            let surface = ctx.model.piece_surface(Piece::Trunk);
            let frozen = surface.iter().filter(|(_, t, k)| *k == TensorKind::Parameter && !t.requires_grad()).count();
            if frozen > 0 {
                self.native_for_fit = true;
                log::info!(
                    "ptl: feature replay: {frozen} trunk parameters are frozen (freeze=…): the trunk runs natively for this whole fit"
                );
            }
        }
        Ok(())
    }
    fn claims(&self, site: Site) -> bool {
        matches!(site, Site::Piece(piece) if self.dispatch && self.scope.covers(piece) && !self.native_for_fit)
    }
    fn run(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>, rest: &dyn SiteRunner) -> ptl_trainer::Result<Vec<Tensor>> {
        let (Site::Piece(piece), Some(model)) = (call.site, call.model) else { return body(rest, call.inputs) };
        let body = std::cell::RefCell::new(body);
        let piece_body = |xs: &[Tensor]| -> ptl_heads::Result<Vec<Tensor>> {
            let mut b = body.borrow_mut();
            (*b)(&NativeSites, xs).map_err(|e| ptl_heads::HeadsError::Runner { piece: piece.name(), msg: e.to_string() })
        };
        Ok(self.regions.run(model, piece, call.inputs, call.surface, &piece_body)?)
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
            self.regions.set_config(parse_config(self.name(), &state["recorder"])?);
        }
        Ok(())
    }
}

inventory::submit! {
    PluginRegistration { name: PieceReplay::FEATURE, in_all: true, create: |cfg| PieceReplay::from_config(Scope::Trunk, cfg) }
}

inventory::submit! {
    PluginRegistration { name: PieceReplay::STEM, in_all: true, create: |cfg| PieceReplay::from_config(Scope::Stems, cfg) }
}

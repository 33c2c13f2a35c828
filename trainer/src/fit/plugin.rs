//! Replay plugins: the extension point through which CUDA-graph strategies run sites of a
//! training step ([`Site`]: a model piece, the loss, forward and loss together, a part of the
//! optimizer update, a Newton–Schulz group). Plugins register with `inventory` from any crate (no
//! fork needed); a fit enables the ones its `replay=` list names, in priority order. With none,
//! every site runs natively.
//!
//! A plugin sees the run at [`ReplayPlugin::setup`] (model, named parameters, optimizer, EMA,
//! configuration), claims sites ([`ReplayPlugin::claims`]; the first claimant in priority order
//! runs a site through [`ReplayPlugin::run`], which returns the site's outputs) and may observe
//! whole stages ([`ReplayPlugin::around`]). Everything else has a default. Its state goes into
//! checkpoints as JSON and comes back on resume; recordings never do — a clone or a restored plugin
//! starts with none. docs/plugins.md is the author's guide.

use dyn_clone::DynClone;
use ptl_autograd::Tensor;
use ptl_heads::{Piece, PieceBody, PieceRunner, PoseModel};

pub use super::sites::{NativeSites, NsSite, Site, SiteBody, SiteRunner, Surface, UpdatePart};
use crate::optim::{ModelEma, Optimizer};
use crate::{Result, TrainerError};

/// The stages of one training step a plugin may wrap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Model forward in training mode (features and all stems).
    Forward,
    /// Loss computation (assigner and terms).
    Loss,
    /// `backward()` of the (scaled) loss.
    Backward,
    /// Clipping + optimizer update (+ EMA).
    OptimizerStep,
}

/// How often a plugin's regions are called: once per batch (the model's pieces) or once per
/// optimizer step (the optimizer stage's). A replay guard counts a region's expected calls by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayCadence {
    /// Every batch.
    PerBatch,
    /// Every optimizer step.
    PerOptimizerStep,
    /// Each batch calls one of the plugin's regions, the one of its shapes (the loss region per
    /// target bucket): the guard counts the regions together.
    OnePerBatch,
}

/// What a plugin sees about the step it wraps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageInfo {
    /// The stage.
    pub stage: Stage,
    /// The epoch.
    pub epoch: usize,
    /// Global batch index (`i + nb·epoch`).
    pub batch_index: usize,
    /// Whether the current step runs in training mode.
    pub training: bool,
}

/// What a plugin is given when a fit starts (after any checkpoint was restored).
pub struct PluginSetup<'a> {
    /// The model.
    pub model: &'a PoseModel,
    /// The model's parameters by state-dict name (their storage lives for the whole run).
    pub params: &'a [(String, Tensor)],
    /// The optimizer.
    pub optimizer: &'a dyn Optimizer,
    /// The EMA.
    pub ema: &'a ModelEma,
    /// The device the fit trains on.
    pub device: ptl_autograd::Device,
    /// The run's settings as JSON (`PoseTrainConfig` as checkpoints store it).
    pub settings: &'a serde_json::Value,
    /// Data-parallel ranks training together (1: this process alone). With several, the
    /// optimizer update holds the gradients' collectives.
    pub ranks: usize,
}

/// A replay strategy. Every method has a native default, so a plugin overrides only what it
/// needs. Methods called during a step take `&self`: plugins keep their mutable state behind
/// interior mutability (their recorders already do).
pub trait ReplayPlugin: DynClone + Send {
    /// Unique registered name (also the key of its state in checkpoints).
    fn name(&self) -> &'static str;
    /// Lower runs outermost when several plugins wrap the same stage, and claims pieces first.
    fn priority(&self) -> i32 {
        0
    }
    /// Called once per fit, after any checkpoint was restored, before the first batch.
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> Result<()> {
        let _ = ctx;
        Ok(())
    }
    /// Whether this plugin runs `site` (the first claimant in priority order does).
    fn claims(&self, site: Site) -> bool {
        let _ = site;
        false
    }
    /// How many calls at `site` this plugin runs natively before it records the call's shape
    /// (its warm-up); `None` where it records nothing. The fit prepares the largest shape the
    /// site will see ([`ReplayPlugin::prepare`]) just before the call that records first.
    fn calls_before_recording(&self, site: Site) -> Option<usize> {
        let _ = site;
        None
    }
    /// Records a claimed site's `body` for `call`'s inputs ahead of use, without running it:
    /// nothing the body writes may change (a recorder rolls back its warm-up and launches
    /// nothing). The fit hands the largest inputs the site will see in this run (the targets
    /// padded to the largest bucket the data can give), so that what the plugin lays out for
    /// its recordings holds every later shape. `Ok(true)` when something was recorded.
    fn prepare(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>) -> Result<bool> {
        let _ = (call, body);
        Ok(false)
    }
    /// Runs a claimed site: must return what `body(rest, inputs)` returns (the same values and
    /// autograd behaviour), natively or by replaying a recording of it. `rest` runs the sites
    /// nested in the body; a plugin that records the body passes [`NativeSites`] instead, so a
    /// nested site is not recorded twice.
    fn run(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>, rest: &dyn SiteRunner) -> Result<Vec<Tensor>> {
        body(rest, call.inputs)
    }
    /// Observes (or wraps) a whole stage. `next` performs the stage and must be called exactly
    /// once. For measuring and logging; work a plugin replaces goes through sites.
    fn around(&self, info: StageInfo, next: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = info;
        next()
    }
    /// Whether the fit should keep every parameter's gradient buffer across steps (persistent
    /// gradients, `Tensor::set_keep_grad_buffer`): a plugin that records graphs reading or writing
    /// gradients needs them at fixed addresses. Absent gradients stay absent. Off by default (the
    /// kept buffers hold memory between steps).
    fn persistent_gradients(&self) -> bool {
        false
    }
    /// Validation is a region boundary: nothing may be left pending (docs/capture.md §14).
    fn on_validation_start(&self) -> Result<()> {
        Ok(())
    }
    /// The fit ended (normally or with an error): release per-fit holds (pending backwards,
    /// skipped-backward marks) so that a later fit starts clean.
    fn on_fit_end(&self) {}
    /// How often its regions are called ([`ReplayCadence`]; the run summary reports it).
    fn cadence(&self) -> ReplayCadence {
        ReplayCadence::PerBatch
    }
    /// One line for the run summary (counters), if the plugin has something to say.
    fn summary(&self) -> Option<String> {
        None
    }
    /// Per-region counters for the run summary, as JSON (region name → counters). Tests and
    /// benches read them to prove that regions replayed.
    fn counters(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// Serialisable configuration/state for checkpoints (never recordings).
    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// Restores what [`ReplayPlugin::state`] saved (on resume, before `setup`).
    fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let _ = state;
        Ok(())
    }
}

dyn_clone::clone_trait_object!(ReplayPlugin);

/// A site as a plugin receives it.
#[derive(Clone, Copy)]
pub struct SiteCall<'a> {
    /// Which site runs.
    pub site: Site,
    /// The body's inputs.
    pub inputs: &'a [Tensor],
    /// What the body reads besides them (the tensors a recording watches).
    pub surface: &'a Surface,
    /// The model whose piece runs ([`Site::Piece`] only).
    pub model: Option<&'a PoseModel>,
}

/// A plugin's entry in the global registry:
/// `inventory::submit! { PluginRegistration { name: "…", in_all: false, create: |cfg| … } }`.
pub struct PluginRegistration {
    /// The plugin's name in `replay=`.
    pub name: &'static str,
    /// Whether `replay=all` enables it: ptl's own replay strategies (`ptl-plugins`) say yes; a
    /// third-party plugin is enabled by its name.
    pub in_all: bool,
    /// Builds a fresh plugin (with no recordings) from its configuration (`null`: defaults).
    pub create: fn(&serde_json::Value) -> Result<Box<dyn ReplayPlugin>>,
}

/// The name in `replay=` that stands for every registered plugin with [`PluginRegistration::in_all`].
pub const ALL_PLUGINS: &str = "all";

inventory::collect!(PluginRegistration);

/// Every registered plugin, sorted by name for a stable order.
pub fn registered_plugins() -> Vec<&'static PluginRegistration> {
    let mut v: Vec<&'static PluginRegistration> = inventory::iter::<PluginRegistration>.into_iter().collect();
    v.sort_by_key(|r| r.name);
    v
}

/// An ordered stack of active plugins.
#[derive(Clone, Default)]
pub struct PluginStack {
    plugins: Vec<Box<dyn ReplayPlugin>>,
}

impl PluginStack {
    /// Instantiates the registered plugins named in `enabled` (empty: native; [`ALL_PLUGINS`]:
    /// every plugin registered with `in_all`), each with its entry of `configs` (by name; absent =
    /// defaults). A name registered twice, listed twice or not registered at all is an error.
    pub fn from_registry(enabled: &[String], configs: &serde_json::Map<String, serde_json::Value>) -> Result<Self> {
        let reg = registered_plugins();
        let bad = |reason: String| TrainerError::InvalidArgument { what: "replay", reason };
        for w in reg.windows(2) {
            if w[0].name == w[1].name {
                return Err(bad(format!(
                    "two replay plugins are registered under the name `{}`: rename one (names key checkpoints)",
                    w[0].name
                )));
            }
        }
        for (i, n) in enabled.iter().enumerate() {
            if enabled[..i].contains(n) {
                return Err(bad(format!("`{n}` is listed twice in replay=")));
            }
        }
        // `all` expands to ptl's own plugins, in registry order; names listed besides it add to it.
        let mut expanded: Vec<String> = Vec::new();
        for n in enabled {
            if n == ALL_PLUGINS {
                if reg.iter().any(|r| r.name == ALL_PLUGINS) {
                    return Err(bad(format!("a plugin is registered as `{ALL_PLUGINS}`, which replay= reserves: rename it")));
                }
                let own: Vec<String> = reg.iter().filter(|r| r.in_all).map(|r| r.name.to_string()).collect();
                if own.is_empty() {
                    return Err(bad(format!(
                        "replay={ALL_PLUGINS}: this program registers none of ptl's replay plugins (link ptl-plugins, \
                         as the ptl binary does, or name the plugins)"
                    )));
                }
                expanded.extend(own);
            } else {
                expanded.push(n.clone());
            }
        }
        let mut unique: Vec<String> = Vec::new();
        for n in expanded {
            if !unique.contains(&n) {
                unique.push(n);
            }
        }
        let enabled = &unique;
        let mut plugins: Vec<Box<dyn ReplayPlugin>> = Vec::new();
        for n in enabled.iter() {
            let r = reg.iter().find(|r| r.name == n).ok_or_else(|| {
                let known: Vec<&str> = reg.iter().map(|r| r.name).collect();
                bad(format!("no replay plugin named `{n}` is registered (registered: {known:?})"))
            })?;
            let cfg = configs.get(n).cloned().unwrap_or(serde_json::Value::Null);
            let p = (r.create)(&cfg)?;
            if p.name() != r.name {
                return Err(bad(format!("the plugin registered as `{}` calls itself `{}`", r.name, p.name())));
            }
            plugins.push(p);
        }
        if let Some(unused) = configs.keys().find(|k| !enabled.contains(k)) {
            return Err(bad(format!("replay_config has settings for `{unused}`, which replay= does not enable")));
        }
        Ok(PluginStack::new(plugins))
    }

    /// A stack with exactly these plugins (tests, programmatic use).
    pub fn new(mut plugins: Vec<Box<dyn ReplayPlugin>>) -> Self {
        plugins.sort_by_key(|p| p.priority());
        PluginStack { plugins }
    }

    /// Whether no plugin is active.
    pub fn is_empty(&self) -> bool {
        self.plugins.is_empty()
    }

    /// The active plugins' names, in stack order.
    pub fn names(&self) -> Vec<&'static str> {
        self.plugins.iter().map(|p| p.name()).collect()
    }

    /// The plugins, outermost first.
    pub fn plugins(&self) -> &[Box<dyn ReplayPlugin>] {
        &self.plugins
    }

    /// Runs `native` for `info`, wrapped by every plugin (outermost first).
    pub fn run(&self, info: StageInfo, native: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        fn nest(ps: &[Box<dyn ReplayPlugin>], info: StageInfo, native: &mut dyn FnMut() -> Result<()>) -> Result<()> {
            match ps.split_first() {
                None => native(),
                Some((first, rest)) => first.around(info, &mut || nest(rest, info, native)),
            }
        }
        nest(&self.plugins, info, native)
    }

    /// Runs `f` as stage `info` under every plugin's [`ReplayPlugin::around`] (outermost first)
    /// and returns its result; a plugin that did not let the stage run is an error naming it.
    pub fn run_stage<T>(&self, info: StageInfo, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut f = Some(f);
        let mut out = None;
        self.run(info, &mut || {
            let f = f.take().ok_or_else(|| TrainerError::InvalidArgument {
                what: "plugin",
                reason: format!("the {:?} stage was run twice by a plugin's `around`", info.stage),
            })?;
            out = Some(f()?);
            Ok(())
        })?;
        out.ok_or_else(|| TrainerError::InvalidArgument {
            what: "plugin",
            reason: format!("a plugin's `around` did not run the {:?} stage (it must call `next` once)", info.stage),
        })
    }

    /// Whether a plugin claims `site`.
    pub fn claims(&self, site: Site) -> bool {
        self.plugins.iter().any(|p| p.claims(site))
    }

    /// [`ReplayPlugin::calls_before_recording`] of `site`'s claimant (the first in priority
    /// order, the one [`PluginStack::run_call`] hands the site to); `None` when none claims it or
    /// it records nothing there.
    pub fn calls_before_recording(&self, site: Site) -> Option<usize> {
        self.plugins.iter().find(|p| p.claims(site)).and_then(|p| p.calls_before_recording(site))
    }

    /// [`ReplayPlugin::prepare`] of `call`'s site by its claimant; `Ok(false)` when none claims it.
    pub fn prepare_call(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>) -> Result<bool> {
        match self.plugins.iter().find(|p| p.claims(call.site)) {
            Some(p) => p.prepare(call, body),
            None => Ok(false),
        }
    }

    /// Runs `call`'s site through its first claimant in priority order, natively when none claims
    /// it (the sites nested in its body go through this stack either way, unless the claimant
    /// records the body).
    pub fn run_call(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>) -> Result<Vec<Tensor>> {
        match self.plugins.iter().find(|p| p.claims(call.site)) {
            Some(p) => p.run(call, body, self),
            None => body(self, call.inputs),
        }
    }

    /// A [`PieceRunner`] over `model` that hands each piece to its claimant (native otherwise).
    pub fn runner<'a>(&'a self, model: &'a PoseModel) -> StackRunner<'a> {
        StackRunner { stack: self, model }
    }

    /// Gives every plugin the run (after restore, before the first batch).
    pub fn setup(&mut self, ctx: &PluginSetup<'_>) -> Result<()> {
        self.plugins.iter_mut().try_for_each(|p| p.setup(ctx))
    }

    /// Whether any plugin asks for persistent gradients ([`ReplayPlugin::persistent_gradients`]).
    pub fn wants_persistent_gradients(&self) -> bool {
        self.plugins.iter().any(|p| p.persistent_gradients())
    }

    /// Tells every plugin that validation starts (a region boundary).
    pub fn on_validation_start(&self) -> Result<()> {
        self.plugins.iter().try_for_each(|p| p.on_validation_start())
    }

    /// Tells every plugin that the fit ended.
    pub fn on_fit_end(&self) {
        self.plugins.iter().for_each(|p| p.on_fit_end())
    }

    /// One line per plugin that reports counters.
    pub fn summaries(&self) -> Vec<String> {
        self.plugins.iter().filter_map(|p| p.summary().map(|s| format!("{}: {s}", p.name()))).collect()
    }

    /// Counters of every plugin that reports them, by plugin name.
    pub fn counters(&self) -> serde_json::Map<String, serde_json::Value> {
        self.plugins.iter().map(|p| (p.name().to_string(), p.counters())).filter(|(_, c)| !c.is_null()).collect()
    }

    /// Every plugin's [`ReplayPlugin::cadence`], by name.
    pub fn cadences(&self) -> std::collections::BTreeMap<String, ReplayCadence> {
        self.plugins.iter().map(|p| (p.name().to_string(), p.cadence())).collect()
    }

    /// Every plugin's state by name, for checkpoints.
    pub fn states(&self) -> serde_json::Map<String, serde_json::Value> {
        self.plugins.iter().map(|p| (p.name().to_string(), p.state())).collect()
    }

    /// Restores saved states (a state whose plugin is not enabled is an error: the run was
    /// trained with it).
    pub fn load_states(&mut self, states: &serde_json::Map<String, serde_json::Value>) -> Result<()> {
        for (name, state) in states {
            let p = self.plugins.iter_mut().find(|p| p.name() == name).ok_or_else(|| TrainerError::InvalidArgument {
                what: "replay",
                reason: format!("the checkpoint holds the state of replay plugin `{name}`, which this fit does not enable"),
            })?;
            p.load_state(state)?;
        }
        Ok(())
    }
}

/// Runs each piece through the plugin that claims it, natively otherwise.
pub struct StackRunner<'a> {
    stack: &'a PluginStack,
    model: &'a PoseModel,
}

impl PieceRunner for StackRunner<'_> {
    fn run(&self, piece: Piece, inputs: &[Tensor], body: &PieceBody<'_>) -> ptl_heads::Result<Vec<Tensor>> {
        let surface = self.model.piece_surface(piece);
        let call = SiteCall { site: Site::Piece(piece), inputs, surface: &surface, model: Some(self.model) };
        let mut site_body = |_: &dyn SiteRunner, xs: &[Tensor]| body(xs).map_err(TrainerError::from);
        self.stack.run_call(call, &mut site_body).map_err(|e| match e {
            TrainerError::Model(h) => h,
            other => ptl_heads::HeadsError::Runner { piece: piece.name(), msg: other.to_string() },
        })
    }
}

impl SiteRunner for PluginStack {
    fn run_site(&self, site: Site, inputs: &[Tensor], surface: &Surface, body: &mut SiteBody<'_>) -> Result<Vec<Tensor>> {
        self.run_call(SiteCall { site, inputs, surface, model: None }, body)
    }
}

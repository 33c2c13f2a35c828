//! Replay plugins: the extension point through which CUDA-graph strategies run pieces of the
//! model and wrap stages of a training step. Plugins register with `inventory` from any crate (no
//! fork needed); a fit enables the ones its `replay=` list names, in priority order. With none,
//! every piece and stage runs natively.
//!
//! A plugin sees the run at [`ReplayPlugin::setup`] (model, named parameters, optimizer, EMA,
//! configuration), may claim pieces of the model ([`ReplayPlugin::claims`]; the first claimant
//! in priority order runs a piece) and wraps stages ([`ReplayPlugin::around`]). Its state goes into
//! checkpoints as JSON and comes back on resume; recordings never do — a clone or a restored plugin
//! starts with none.

use dyn_clone::DynClone;
use ptl_autograd::{Tensor, TensorKind};
use ptl_heads::{Piece, PieceBody, PieceRunner, PoseModel};

use crate::optim::{ModelEma, Optimizer};
use crate::pose::PoseTrainConfig;
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
    PerBatch,
    PerOptimizerStep,
    /// Each batch calls one of the plugin's regions, the one of its shapes (the loss region per
    /// target bucket): the guard counts the regions together.
    OnePerBatch,
}

/// The device parts of an optimizer step a plugin may run ([`ReplayPlugin::run_update`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UpdatePart {
    /// 16-mixed only: every present gradient × 1/scale and the found-inf flag
    /// (`GradScaler::unscale_grads`), before the `on_before_optimizer_step` callbacks.
    Unscale,
    /// Gradient clipping and the optimizer's update (`Optimizer::step_prepared`); under 16-mixed
    /// the update skipped on the device by the found-inf flag (`Optimizer::step_prepared_unless`)
    /// and the scaler's growth/backoff (`GradScaler::update_scale`).
    Step,
    /// The EMA update (`ModelEma::update_prepared`), after zero-grad.
    Ema,
}

/// What a plugin sees about the step it wraps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageInfo {
    pub stage: Stage,
    pub epoch: usize,
    /// Global batch index (`i + nb·epoch`).
    pub batch_index: usize,
    /// Whether the current step runs in training mode.
    pub training: bool,
}

/// What a plugin is given when a fit starts (after any checkpoint was restored).
pub struct PluginSetup<'a> {
    pub model: &'a PoseModel,
    /// The model's parameters by state-dict name (their storage lives for the whole run).
    pub params: &'a [(String, Tensor)],
    pub optimizer: &'a dyn Optimizer,
    pub ema: &'a ModelEma,
    pub config: &'a PoseTrainConfig,
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
    /// Whether this plugin runs `piece` (see [`ReplayPlugin::run_piece`]).
    fn claims(&self, piece: Piece) -> bool {
        let _ = piece;
        false
    }
    /// Runs a claimed piece of `model`: must return what `body(inputs)` returns (natively or by
    /// replay). `surface` is what the body reads (the model's parameters and buffers of the piece).
    fn run_piece(
        &self,
        model: &PoseModel,
        piece: Piece,
        inputs: &[Tensor],
        surface: &[(String, Tensor, TensorKind)],
        body: &PieceBody<'_>,
    ) -> ptl_heads::Result<Vec<Tensor>> {
        let _ = (model, piece, surface);
        body(inputs)
    }
    /// Runs a stage. `next` performs the stage (natively or through the next plugin) and must be
    /// called exactly once unless the plugin replaces the work with an equivalent replay.
    fn around(&self, info: StageInfo, next: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = info;
        next()
    }
    /// Whether this plugin runs the device parts of optimizer steps ([`ReplayPlugin::run_update`]).
    fn claims_update(&self) -> bool {
        false
    }
    /// Runs a device part of an optimizer step ([`UpdatePart`]), after its host part wrote the
    /// step's scalars to the device, natively (`body()`) or by a replay of it; it must do what
    /// `body` does. The trainer hands over the unscale and the step only for an optimizer that
    /// `Optimizer::is_capturable` (SGD, MuSGD, AdamW).
    fn run_update(&self, part: UpdatePart, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = part;
        body()
    }
    /// Whether this plugin runs the dense criterion's device work ([`ReplayPlugin::run_loss`]).
    fn claims_loss(&self) -> bool {
        false
    }
    /// Runs the dense criterion's device work (both branches' fixed-shape assignment and terms,
    /// the RLE flow, the mix; `crate::loss::E2ELoss::loss_routed`): must return what
    /// `body(inputs)` returns, natively or by replay. `inputs` are the two branches' raw outputs,
    /// the padded device targets and the branch weights (`loss_routed` lists them); `surface` is
    /// what the body reads besides them: the RLE flow's parameters.
    fn run_loss(&self, inputs: &[Tensor], surface: &[(String, Tensor, TensorKind)], body: &LossBody<'_>) -> Result<Vec<Tensor>> {
        let _ = surface;
        body(inputs)
    }
    /// Whether this plugin runs the model's forward and the dense criterion together
    /// ([`ReplayPlugin::run_forward_loss`]): the whole forward-and-loss of a step as one body.
    fn claims_forward_loss(&self) -> bool {
        false
    }
    /// Runs a step's model forward and dense criterion as one body: must return what
    /// `body(inputs)` returns, natively or by replay. `inputs` are the batch's images, the padded
    /// device targets and the branch weights (`E2ELoss::loss_with_forward` lists them); `surface`
    /// is everything the body reads besides them: the model's parameters and buffers, the RLE
    /// flow's among them. Offered only when the fit is on the dense criterion and the batch's
    /// targets fit a bucket; otherwise the step runs through the pieces and `run_loss`.
    fn run_forward_loss(&self, inputs: &[Tensor], surface: &[(String, Tensor, TensorKind)], body: &LossBody<'_>) -> Result<Vec<Tensor>> {
        let _ = surface;
        body(inputs)
    }
    /// Whether the fit should keep every parameter's gradient buffer across steps (persistent
    /// gradients, `Tensor::set_keep_grad_buffer`): a plugin that records graphs reading or writing
    /// gradients needs them at fixed addresses. Absent gradients stay absent. Off by default (the
    /// kept buffers hold memory between steps).
    fn persistent_gradients(&self) -> bool {
        false
    }
    /// Validation is a region boundary: nothing may be left pending (capture.md §14).
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

/// The dense criterion's device work as a function of its input tensors ([`ReplayPlugin::run_loss`]).
pub type LossBody<'a> = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + 'a;

/// A plugin's entry in the global registry:
/// `inventory::submit! { PluginRegistration { name: "…", in_all: false, create: |cfg| … } }`.
pub struct PluginRegistration {
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

    pub fn is_empty(&self) -> bool {
        self.plugins.is_empty()
    }

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

    /// The plugin that runs `piece`: the first claimant in priority order.
    pub fn claimant(&self, piece: Piece) -> Option<&dyn ReplayPlugin> {
        self.plugins.iter().find(|p| p.claims(piece)).map(|p| p.as_ref())
    }

    /// A [`PieceRunner`] over `model` that hands each piece to its claimant (native otherwise).
    pub fn runner<'a>(&'a self, model: &'a PoseModel) -> StackRunner<'a> {
        StackRunner { stack: self, model }
    }

    /// Gives every plugin the run (after restore, before the first batch).
    pub fn setup(&mut self, ctx: &PluginSetup<'_>) -> Result<()> {
        self.plugins.iter_mut().try_for_each(|p| p.setup(ctx))
    }

    /// The device part of an optimizer step through its claimant ([`ReplayPlugin::run_update`]),
    /// natively when no plugin claims it.
    pub fn run_update(&self, part: UpdatePart, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        match self.plugins.iter().find(|p| p.claims_update()) {
            Some(p) => p.run_update(part, body),
            None => body(),
        }
    }

    /// The dense criterion's device work through its claimant ([`ReplayPlugin::run_loss`]),
    /// natively when no plugin claims it.
    pub fn run_loss(&self, inputs: &[Tensor], surface: &[(String, Tensor, TensorKind)], body: &LossBody<'_>) -> Result<Vec<Tensor>> {
        match self.plugins.iter().find(|p| p.claims_loss()) {
            Some(p) => p.run_loss(inputs, surface, body),
            None => body(inputs),
        }
    }

    /// Whether any plugin claims the dense criterion.
    pub fn claims_loss(&self) -> bool {
        self.plugins.iter().any(|p| p.claims_loss())
    }

    /// A step's forward and dense criterion through their claimant
    /// ([`ReplayPlugin::run_forward_loss`]), natively when no plugin claims them.
    pub fn run_forward_loss(
        &self,
        inputs: &[Tensor],
        surface: &[(String, Tensor, TensorKind)],
        body: &LossBody<'_>,
    ) -> Result<Vec<Tensor>> {
        match self.plugins.iter().find(|p| p.claims_forward_loss()) {
            Some(p) => p.run_forward_loss(inputs, surface, body),
            None => body(inputs),
        }
    }

    /// Whether any plugin claims a step's forward and criterion together.
    pub fn claims_forward_loss(&self) -> bool {
        self.plugins.iter().any(|p| p.claims_forward_loss())
    }

    /// Whether any plugin asks for persistent gradients ([`ReplayPlugin::persistent_gradients`]).
    pub fn wants_persistent_gradients(&self) -> bool {
        self.plugins.iter().any(|p| p.persistent_gradients())
    }

    pub fn on_validation_start(&self) -> Result<()> {
        self.plugins.iter().try_for_each(|p| p.on_validation_start())
    }

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
        match self.stack.claimant(piece) {
            Some(p) => p.run_piece(self.model, piece, inputs, &self.model.piece_surface(piece), body),
            None => body(inputs),
        }
    }
}

//! Replay plugins: the extension point through which CUDA-graph strategies wrap stages of a
//! training step. Plugins register with `inventory` from any crate (no fork needed) and the
//! trainer stacks every registered plugin that is enabled; with none, each stage runs natively.

use dyn_clone::DynClone;

use crate::Result;

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

/// A replay strategy. Every method has a native default, so a plugin overrides only what it needs.
pub trait ReplayPlugin: DynClone + Send {
    /// Unique registered name (also the key of its state in checkpoints).
    fn name(&self) -> &'static str;
    /// Lower runs outermost when several plugins wrap the same stage.
    fn priority(&self) -> i32 {
        0
    }
    /// Called once before the first batch, after any checkpoint was restored.
    fn on_fit_start(&mut self) -> Result<()> {
        Ok(())
    }
    /// Runs a stage. `next` performs the stage (natively or through the next plugin) and must be
    /// called exactly once unless the plugin replaces the work with an equivalent replay.
    fn around(&mut self, info: StageInfo, next: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = info;
        next()
    }
    /// Validation is a region boundary: nothing may be left pending (capture.md §14).
    fn on_validation_start(&mut self) -> Result<()> {
        Ok(())
    }
    /// One line for the run summary (counters), if the plugin has something to say.
    fn summary(&self) -> Option<String> {
        None
    }
    /// Serialisable configuration/state for checkpoints (never recordings).
    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

dyn_clone::clone_trait_object!(ReplayPlugin);

/// A plugin's entry in the global registry: `inventory::submit! { PluginRegistration { … } }`.
pub struct PluginRegistration {
    pub name: &'static str,
    /// Builds a fresh plugin (with no recordings).
    pub create: fn() -> Box<dyn ReplayPlugin>,
}

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
    /// Instantiates the registered plugins whose names are in `enabled` (all when `None`).
    pub fn from_registry(enabled: Option<&[String]>) -> Result<Self> {
        let reg = registered_plugins();
        if let Some(names) = enabled {
            for n in names {
                if !reg.iter().any(|r| r.name == n) {
                    let known: Vec<&str> = reg.iter().map(|r| r.name).collect();
                    return Err(crate::TrainerError::InvalidArgument {
                        what: "plugins",
                        reason: format!("no replay plugin named `{n}` is registered (registered: {known:?})"),
                    });
                }
            }
        }
        let mut plugins: Vec<Box<dyn ReplayPlugin>> =
            reg.iter().filter(|r| enabled.is_none_or(|e| e.iter().any(|n| n == r.name))).map(|r| (r.create)()).collect();
        plugins.sort_by_key(|p| p.priority());
        Ok(PluginStack { plugins })
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

    /// Runs `native` for `info`, wrapped by every plugin (outermost first).
    pub fn run(&mut self, info: StageInfo, native: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        fn nest(ps: &mut [Box<dyn ReplayPlugin>], info: StageInfo, native: &mut dyn FnMut() -> Result<()>) -> Result<()> {
            match ps.split_first_mut() {
                None => native(),
                Some((first, rest)) => first.around(info, &mut || nest(rest, info, native)),
            }
        }
        nest(&mut self.plugins, info, native)
    }

    pub fn on_fit_start(&mut self) -> Result<()> {
        self.plugins.iter_mut().try_for_each(|p| p.on_fit_start())
    }

    pub fn on_validation_start(&mut self) -> Result<()> {
        self.plugins.iter_mut().try_for_each(|p| p.on_validation_start())
    }

    /// One line per plugin that reports counters.
    pub fn summaries(&self) -> Vec<String> {
        self.plugins.iter().filter_map(|p| p.summary().map(|s| format!("{}: {s}", p.name()))).collect()
    }

    pub fn states(&self) -> serde_json::Map<String, serde_json::Value> {
        self.plugins.iter().map(|p| (p.name().to_string(), p.state())).collect()
    }
}

//! An example replay plugin from outside ptl (`replay=count`): it wraps every stage of a step and
//! counts them, and shows everything a third-party plugin needs — a registration with a
//! configuration, state that survives a resume, counters in the run summary. It replays nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin, Stage, StageInfo};

/// Counts stages; `replay_config={"count": {"start": N}}` starts the count at N.
#[derive(Clone, Default)]
pub struct CountPlugin {
    stages: Arc<[AtomicU64; 4]>,
    start: u64,
    params: usize,
}

impl CountPlugin {
    pub const NAME: &'static str = "count";

    fn total(&self) -> u64 {
        self.start + self.stages.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>()
    }
}

impl ReplayPlugin for CountPlugin {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn priority(&self) -> i32 {
        10
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        self.params = ctx.params.len();
        Ok(())
    }
    fn around(&self, info: StageInfo, next: &mut dyn FnMut() -> ptl_trainer::Result<()>) -> ptl_trainer::Result<()> {
        let i = match info.stage {
            Stage::Forward => 0,
            Stage::Loss => 1,
            Stage::Backward => 2,
            Stage::OptimizerStep => 3,
        };
        self.stages[i].fetch_add(1, Ordering::Relaxed);
        next()
    }
    fn summary(&self) -> Option<String> {
        let c: Vec<u64> = self.stages.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        Some(format!(
            "{} stages so far (forward {}, loss {}, backward {}, optimizer {}) over {} parameters",
            self.total(),
            c[0],
            c[1],
            c[2],
            c[3],
            self.params
        ))
    }
    fn counters(&self) -> serde_json::Value {
        serde_json::json!({ "stages": self.total() })
    }
    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "start": self.total() })
    }
    fn load_state(&mut self, state: &serde_json::Value) -> ptl_trainer::Result<()> {
        self.start = state["start"].as_u64().unwrap_or(0);
        self.stages.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        Ok(())
    }
}

inventory::submit! {
    PluginRegistration {
        name: CountPlugin::NAME,
        // A third-party plugin: enabled by its name, not by `replay=all`.
        in_all: false,
        create: |cfg| Ok(Box::new(CountPlugin { start: cfg["start"].as_u64().unwrap_or(0), ..CountPlugin::default() })),
    }
}

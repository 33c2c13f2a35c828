//! The replay guard over a fit's summary: which regions of a plugin did not replay every step
//! after their warm-up. Tests and users check it before believing "replay equals native".

use ptl_capture::{FallbackReason, RegionStats};
use ptl_trainer::fit::RunSummary;

/// One line per region of `plugin` in `summary` that did not replay each of `steps` calls after
/// its warm-up (native for another reason than `allowed`, or too few replays); empty when the
/// guard holds. A plugin that reported no region is itself a line.
pub fn replay_shortfalls(summary: &RunSummary, plugin: &str, steps: u64, allowed: &[FallbackReason]) -> Vec<String> {
    let Some(regions) = summary.replay_counters.get(plugin).and_then(|c| c.as_object()).filter(|m| !m.is_empty()) else {
        return vec![format!("{plugin}: no region reported counters")];
    };
    regions
        .iter()
        .filter_map(|(name, counters)| match serde_json::from_value::<RegionStats>(counters.clone()) {
            Ok(stats) => stats.replay_shortfall(steps, allowed).map(|why| format!("{plugin}/{name}: {why}")),
            Err(e) => Some(format!("{plugin}/{name}: unreadable counters ({e})")),
        })
        .collect()
}

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
    if summary.replay_cadence.get(plugin) == Some(&ptl_trainer::fit::ReplayCadence::OnePerBatch) {
        // One region per call, chosen by the call's shapes: their counts add up to the calls.
        let mut all = RegionStats::default();
        for (name, counters) in regions {
            match serde_json::from_value::<RegionStats>(counters.clone()) {
                Ok(s) => {
                    all.replays += s.replays;
                    for (r, n) in s.native {
                        *all.native.entry(r).or_default() += n;
                    }
                }
                Err(e) => return vec![format!("{plugin}/{name}: unreadable counters ({e})")],
            }
        }
        return all
            .replay_shortfall(steps, allowed)
            .map(|why| format!("{plugin} (its {} regions together): {why}", regions.len()))
            .into_iter()
            .collect();
    }
    regions
        .iter()
        .filter_map(|(name, counters)| match serde_json::from_value::<RegionStats>(counters.clone()) {
            Ok(stats) => stats.replay_shortfall(steps, allowed).map(|why| format!("{plugin}/{name}: {why}")),
            Err(e) => Some(format!("{plugin}/{name}: unreadable counters ({e})")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ptl_trainer::fit::ReplayCadence;

    /// A plugin with one region per target bucket (`OnePerBatch`): the regions' replays and
    /// warm-ups add up to the batches (the counts of a CUDA run: 1 + 1 and 9 + 1 in 12 batches);
    /// counted region by region the same counts would fail, and a missing replay fails together.
    #[test]
    fn regions_chosen_per_batch_are_counted_together() {
        let stats = |replays: u64| {
            let mut r = RegionStats { replays, ..RegionStats::default() };
            r.native.insert(FallbackReason::Warmup, 1);
            serde_json::to_value(r).expect("stats as JSON")
        };
        let mut s = RunSummary::default();
        s.replay_counters.insert("loss".into(), serde_json::json!({"loss.0": stats(1), "loss.1": stats(9)}));
        s.replay_cadence.insert("loss".into(), ReplayCadence::OnePerBatch);
        assert!(replay_shortfalls(&s, "loss", 12, &[]).is_empty());
        assert_eq!(replay_shortfalls(&s, "loss", 13, &[]).len(), 1, "one call short");
        s.replay_cadence.insert("loss".into(), ReplayCadence::PerBatch);
        assert_eq!(replay_shortfalls(&s, "loss", 12, &[]).len(), 2, "per region, both fall short");
    }
}

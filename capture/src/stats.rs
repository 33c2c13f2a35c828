//! Per-region counters.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Why a call ran natively.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum FallbackReason {
    /// A new signature's first calls (lazy initialisation runs for real).
    Warmup,
    /// The region already holds its maximum number of recordings (e.g. a smaller last batch).
    CacheFull,
    /// Hooks are registered on the region.
    Hooks,
    /// The previous forward replay's backward had not run.
    PendingBackward,
    /// Capturing failed (the error is in the warnings); this signature stays native.
    CaptureFailed,
    /// The recording was stale (storage changed) and was retired this call.
    Stale,
    /// Recording is switched off ([`crate::RecorderConfig::enabled`]).
    Disabled,
    /// Called while another region is being captured (the work is recorded into that graph).
    InsideCapture,
    /// Nothing to record (no tensor input or no device input).
    Unsupported,
}

/// Why a recording was released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum RetireReason {
    /// A parameter or buffer changed storage.
    Storage,
    /// The precision (autocast) changed.
    Precision,
    /// The set of trainable parameters changed (a parameter was frozen or unfrozen).
    Trainable,
    /// Released on request.
    Released,
}

/// Counters of one region.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RegionStats {
    /// Forward captures (one per recording).
    pub captures: u64,
    /// Backward captures (one per recording and gradient mask).
    pub backward_captures: u64,
    /// Forward replays.
    pub replays: u64,
    /// Backward replays.
    pub backward_replays: u64,
    /// Graph launches (forward and backward).
    pub graph_launches: u64,
    /// Host-issued copy/accumulate operations around replays (copy-in, hand-out, accumulation).
    pub host_ops: u64,
    /// Native calls by reason.
    pub native: BTreeMap<FallbackReason, u64>,
    /// Released recordings by reason.
    pub retired: BTreeMap<RetireReason, u64>,
    /// Failed captures by error kind.
    pub capture_failures: BTreeMap<String, u64>,
    /// Times the region's host closure ran during replay (must stay 0; see test T1).
    pub eager_dispatches_during_replay: u64,
    /// Recordings currently held.
    pub live_recordings: u64,
    /// Nodes of the live recordings' graphs.
    pub graph_nodes: u64,
    /// Bytes reserved by the live recordings' arenas (their private pools' intermediates).
    #[serde(default)]
    pub pool_bytes: u64,
    /// Allocations of this region's captures that took their planned arena offset, and those
    /// that went to an arena's unplanned tail (the warm-up did not make them, or their bytes
    /// were still live).
    #[serde(default)]
    pub arena_planned: u64,
    /// Allocations of the captures that went to the arena's unplanned tail.
    #[serde(default)]
    pub arena_tail: u64,
    /// Captures made again in an unplanned arena after overflowing their planned arena's tail
    /// (the plan did not fit what the capture allocated).
    #[serde(default)]
    pub arena_replans: u64,
    /// Last warnings (capture failures), newest last, at most 8.
    pub warnings: Vec<String>,
}

impl RegionStats {
    /// Native (not replayed) calls, every reason together.
    pub fn native_total(&self) -> u64 {
        self.native.values().sum()
    }
    /// Native calls for reason `r`.
    pub fn native_for(&self, r: FallbackReason) -> u64 {
        self.native.get(&r).copied().unwrap_or(0)
    }
    /// Recordings retired for reason `r`.
    pub fn retired_for(&self, r: RetireReason) -> u64 {
        self.retired.get(&r).copied().unwrap_or(0)
    }
    /// Why this region did not replay every one of `calls` calls after its warm-up, if it did
    /// not. The guard under every "replay equals native" claim: the recorder falls back to
    /// native on purpose, and equal bytes from native calls prove nothing. `allowed` reasons
    /// (e.g. [`FallbackReason::CacheFull`] for a smaller last batch) count like warm-up.
    pub fn replay_shortfall(&self, calls: u64, allowed: &[FallbackReason]) -> Option<String> {
        let excused = |r: &FallbackReason| *r == FallbackReason::Warmup || allowed.contains(r);
        let other: Vec<String> = self.native.iter().filter(|(r, n)| !excused(r) && **n > 0).map(|(r, n)| format!("{r:?} {n}")).collect();
        let excused_calls: u64 = self.native.iter().filter(|(r, _)| excused(r)).map(|(_, n)| n).sum();
        if !other.is_empty() {
            Some(format!("ran natively: {}", other.join(", ")))
        } else if self.replays + excused_calls < calls {
            Some(format!("{} replays and {excused_calls} warm-up calls in {calls} calls", self.replays))
        } else {
            None
        }
    }
    pub(crate) fn bump_native(&mut self, r: FallbackReason) {
        *self.native.entry(r).or_default() += 1;
    }
    pub(crate) fn warn(&mut self, w: String) {
        if self.warnings.len() == 8 {
            self.warnings.remove(0);
        }
        self.warnings.push(w);
    }
    /// `name: 3 captures, 40 replays (38 bwd), native 2 (warmup 1, cache_full 1), retired 0`
    pub fn line(&self, name: &str) -> String {
        let native: Vec<String> = self.native.iter().map(|(k, v)| format!("{k:?} {v}")).collect();
        let retired: Vec<String> = self.retired.iter().map(|(k, v)| format!("{k:?} {v}")).collect();
        let mut s = format!(
            "{name}: {} captures ({} bwd), {} replays ({} bwd), native {}",
            self.captures,
            self.backward_captures,
            self.replays,
            self.backward_replays,
            self.native_total()
        );
        if !native.is_empty() {
            s += &format!(" ({})", native.join(", "));
        }
        if !retired.is_empty() {
            s += &format!(", retired {}", retired.join(", "));
        }
        if !self.capture_failures.is_empty() {
            let f: Vec<String> = self.capture_failures.iter().map(|(k, v)| format!("{k} {v}")).collect();
            s += &format!(", capture failures {}", f.join(", "));
        }
        if self.pool_bytes > 0 || self.arena_planned + self.arena_tail > 0 {
            s += &format!(
                ", arenas {:.1} MiB ({} in place, {} in the tail, {} replanned)",
                self.pool_bytes as f64 / 1048576.0,
                self.arena_planned,
                self.arena_tail,
                self.arena_replans
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replay_guard_names_what_ran_natively() {
        let mut s = RegionStats { replays: 9, ..Default::default() };
        s.bump_native(FallbackReason::Warmup);
        assert_eq!(s.replay_shortfall(10, &[]), None);
        assert_eq!(s.replay_shortfall(11, &[]).as_deref(), Some("9 replays and 1 warm-up calls in 11 calls"));
        s.bump_native(FallbackReason::CacheFull);
        assert_eq!(s.replay_shortfall(10, &[]).as_deref(), Some("ran natively: CacheFull 1"));
        assert_eq!(s.replay_shortfall(11, &[FallbackReason::CacheFull]), None);
    }
}

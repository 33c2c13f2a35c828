//! The workspace cuDNN plans of a device use, and when it may grow.
//!
//! The kept buffer is device state that outlives every recording: graphs captured with its
//! address keep using it. So it never comes from a capture's arena — an arena's bytes are reused
//! by the next graph sharing it, rewound, given back while idle, or (for a capture that is only
//! traced) alias one page — and a capture never grows it. A need the kept buffer does not cover is
//! served by a buffer for that call alone: from the pool in native work, from the capture's arena
//! inside a capture, where it is one more temporary of the graph's planned layout (its bytes are
//! shared with buffers dead at that point of the graph, as native work shares them through the
//! pool). A recorder's warm-up runs the same convolutions natively just before and makes the same
//! choices ([`next_step`]).

use std::sync::Arc;

use super::alloc::DevBuf;
use super::capture_scope;
use super::device::Dev;
use crate::Result;

/// The one workspace every cuDNN plan of a device uses (calls run one after another on the compute
/// stream), sized to the largest need so far. When a plan needs more, the old buffer is freed
/// (stream-ordered, after the work already queued on it) unless a CUDA graph was captured with
/// its address; then it stays for the graph's sake and the new one is at least twice as large, so
/// kept buffers sum to less than twice the largest need. (One workspace per plan summed to 0.9 GiB
/// in bf16 and 2.0 GiB in f32 in a training run; keeping every outgrown buffer cost ~20 MiB more.)
/// A workspace per call, freed after it, was tried: the peak allocation barely moved (835 against
/// 846 MiB — the largest workspaces are needed at the step's peak) and the pool, placing the big
/// short-lived blocks between activations, reserved 1.5 GiB instead of 0.9. Plans are instead
/// limited to `conv_graph::max_workspace` bytes.
#[derive(Default)]
pub(crate) struct Workspace {
    /// Buffers, the current one last, each with whether a capture has seen its address.
    bufs: Vec<(DevBuf, bool)>,
}

/// A workspace address for one call, and the buffer behind it when it was made for that call
/// alone (freed, stream-ordered, when the lease drops after the call is queued).
pub(crate) struct WorkspaceLease {
    pub(crate) ptr: u64,
    _transient: Option<DevBuf>,
}

/// The current buffer as [`next_step`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Current {
    /// Its size.
    pub bytes: usize,
    /// Whether a capture has seen its address.
    pub pinned: bool,
}

/// What the thread is doing when a call asks for workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Activity {
    /// Plain native work.
    Native,
    /// A recorder's warm-up: the region about to be captured, run natively.
    WarmUp,
    /// Inside a graph capture (traced or real).
    Capture,
}

/// How a request for workspace is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// No workspace needed (address 0).
    None,
    /// The current buffer (marked pinned when capturing).
    UseCurrent,
    /// A buffer for this call alone: above the kept limit, inside a capture (from its arena),
    /// or when graphs hold the current one and native work (validation at twice the training
    /// batch) needs more, which should not leave a second buffer beside the graphs' for the rest
    /// of the process.
    Transient(usize),
    /// Replace the current buffer (free it) by one of this size.
    Replace(usize),
    /// Keep the current buffer (graphs use it) and add one of this size after it.
    Add(usize),
}

/// Workspaces taken from a capture's arena so far (process-wide): how a test shows that the
/// path ran.
static FROM_ARENAS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many cuDNN calls recorded into a graph so far had a workspace of their own from the
/// capture's arena (their need was above the kept buffer).
pub fn cudnn_workspaces_from_arenas() -> u64 {
    FROM_ARENAS.load(std::sync::atomic::Ordering::Relaxed)
}

/// MiB of cuDNN workspace plain native work keeps by default (see [`kept_limit`]).
pub(crate) const DEFAULT_KEPT_MIB: usize = 32;

/// The most bytes plain native work keeps in the workspace buffer (`PTL_CUDNN_KEPT_WORKSPACE_MIB`,
/// MiB, default [`DEFAULT_KEPT_MIB`]; `off`: no limit): a larger need gets a buffer for its call
/// alone, which the pool hands back after it. The legacy API's engines may ask for up to 512 MiB
/// (the large 3×3 convolutions at batch 64), and a kept buffer of that size adds to the step's
/// peak for the whole run, while a call's own buffer can take memory that the activations have
/// already given back. Warm-ups and captures follow the same limit (a capture's own buffer comes
/// from its arena).
pub(crate) fn kept_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| parse_kept_limit(std::env::var("PTL_CUDNN_KEPT_WORKSPACE_MIB").ok().as_deref()))
}

/// [`kept_limit`] from the variable's value (`None`: unset).
fn parse_kept_limit(value: Option<&str>) -> usize {
    let Some(v) = value else { return DEFAULT_KEPT_MIB << 20 };
    match v.trim() {
        "off" => usize::MAX,
        t => {
            match t.parse::<usize>() {
                Ok(mib) if mib <= 1 << 14 => mib << 20,
                _ => {
                    log::warn!("ptl: PTL_CUDNN_KEPT_WORKSPACE_MIB={v:?} is neither `off` nor a number of MiB up to 16384; using {DEFAULT_KEPT_MIB}");
                    DEFAULT_KEPT_MIB << 20
                }
            }
        }
    }
}

/// The policy behind [`Workspace::get`], apart from the device so it can be tested anywhere.
/// `kept`: the most bytes the kept buffer grows to ([`kept_limit`]). A capture never changes the
/// kept buffer, and its warm-up makes the same choice wherever the capture will (a need above the
/// limit is a call's own buffer in both), so the capture finds what its warm-up left.
pub(crate) fn next_step(current: Option<Current>, need: usize, activity: Activity, kept: usize) -> Step {
    const MIB: usize = 1 << 20;
    if need == 0 {
        return Step::None;
    }
    let own = Step::Transient(need.next_multiple_of(MIB));
    match current {
        Some(c) if c.bytes >= need => Step::UseCurrent,
        _ if activity == Activity::Capture || need > kept => own,
        Some(c) if c.pinned && activity == Activity::Native => own,
        Some(c) if c.pinned => Step::Add(need.max(2 * c.bytes).next_multiple_of(MIB)),
        Some(_) => Step::Replace(need.next_multiple_of(MIB)),
        None => Step::Add(need.next_multiple_of(MIB)),
    }
}

impl Workspace {
    /// A workspace of at least `bytes` bytes (address 0 when none is needed).
    pub(crate) fn get(&mut self, dev: &Arc<Dev>, bytes: usize) -> Result<WorkspaceLease> {
        let kept = |ptr| WorkspaceLease { ptr, _transient: None };
        let capturing = dev.capturing.load(std::sync::atomic::Ordering::Relaxed);
        let activity = match (capturing, capture_scope::is_measuring()) {
            (true, _) => Activity::Capture,
            (false, true) => Activity::WarmUp,
            (false, false) => Activity::Native,
        };
        let current = self.bufs.last().map(|(b, pinned)| Current { bytes: b.bytes, pinned: *pinned });
        // The kept buffer is device state, not part of the region a warm-up measures for its
        // arena; a call's own buffer is (inside a capture it is a piece of the arena).
        let alloc = |size: usize| capture_scope::unmeasured(|| DevBuf::alloc(dev, size));
        let step = next_step(current, bytes, activity, kept_limit());
        match step {
            Step::None => Ok(kept(0)),
            Step::Transient(size) => {
                let t = DevBuf::alloc(dev, size)?;
                if capturing {
                    FROM_ARENAS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(WorkspaceLease { ptr: t.ptr, _transient: Some(t) })
            }
            Step::Replace(size) | Step::Add(size) => {
                if step == Step::Replace(size) {
                    self.bufs.pop();
                }
                let b = alloc(size)?;
                let ptr = b.ptr;
                self.bufs.push((b, false));
                Ok(kept(ptr))
            }
            Step::UseCurrent => match self.bufs.last_mut() {
                Some((b, pinned)) => {
                    *pinned |= capturing;
                    Ok(kept(b.ptr))
                }
                None => Ok(kept(0)),
            },
        }
    }

    /// Bytes held by the workspace buffers.
    pub(crate) fn bytes(&self) -> u64 {
        self.bufs.iter().map(|(b, _)| b.bytes as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const NO_LIMIT: usize = usize::MAX;

    fn cur(bytes: usize, pinned: bool) -> Option<Current> {
        Some(Current { bytes, pinned })
    }

    #[test]
    fn a_capture_takes_a_buffer_from_its_arena_and_never_grows_the_kept_one() {
        for current in [None, cur(MIB, false), cur(MIB, true)] {
            for kept in [NO_LIMIT, 32 * MIB] {
                assert_eq!(next_step(current, 3 * MIB + 5, Activity::Capture, kept), Step::Transient(4 * MIB), "{current:?}");
            }
        }
        assert_eq!(next_step(cur(4 * MIB, true), 3 * MIB, Activity::Capture, NO_LIMIT), Step::UseCurrent);
        assert_eq!(next_step(cur(MIB, true), 0, Activity::Capture, NO_LIMIT), Step::None);
    }

    #[test]
    fn within_the_limit_a_warm_up_grows_the_kept_buffer_where_native_work_takes_a_transient_one() {
        // Graphs hold a 1 MiB buffer: a warm-up adds a kept one (the capture after it finds it),
        // plain native work borrows one for the call.
        assert_eq!(next_step(cur(MIB, true), 3 * MIB + 5, Activity::WarmUp, NO_LIMIT), Step::Add(4 * MIB));
        assert_eq!(next_step(cur(4 * MIB, true), 5 * MIB, Activity::WarmUp, NO_LIMIT), Step::Add(8 * MIB));
        assert_eq!(next_step(cur(MIB, true), 3 * MIB + 5, Activity::Native, NO_LIMIT), Step::Transient(4 * MIB));
        // No graph holds it: replaced, in either.
        for activity in [Activity::Native, Activity::WarmUp] {
            assert_eq!(next_step(cur(MIB, false), 3 * MIB, activity, NO_LIMIT), Step::Replace(3 * MIB));
            assert_eq!(next_step(None, 3 * MIB, activity, NO_LIMIT), Step::Add(3 * MIB));
            assert_eq!(next_step(cur(3 * MIB, true), 3 * MIB, activity, NO_LIMIT), Step::UseCurrent);
        }
    }

    #[test]
    fn above_the_kept_limit_every_call_borrows_a_buffer_for_itself() {
        let kept = 32 * MIB;
        for activity in [Activity::Native, Activity::WarmUp, Activity::Capture] {
            assert_eq!(next_step(cur(8 * MIB, false), 300 * MIB + 1, activity, kept), Step::Transient(301 * MIB), "{activity:?}");
            assert_eq!(next_step(None, 300 * MIB, activity, kept), Step::Transient(300 * MIB), "{activity:?}");
            assert_eq!(next_step(cur(300 * MIB, true), 200 * MIB, activity, kept), Step::UseCurrent, "{activity:?}: large enough");
        }
        assert_eq!(next_step(cur(8 * MIB, false), 20 * MIB, Activity::Native, kept), Step::Replace(20 * MIB), "within the limit: kept");
        assert_eq!(next_step(cur(8 * MIB, false), 20 * MIB, Activity::WarmUp, kept), Step::Replace(20 * MIB));
    }

    /// A warm-up leaves the kept buffer as its capture will find it: for any need, the capture
    /// right after the warm-up uses the kept buffer exactly when the warm-up did or grew it.
    #[test]
    fn a_capture_makes_the_choice_of_its_warm_up() {
        let kept = 32 * MIB;
        for current in [None, cur(8 * MIB, false), cur(8 * MIB, true), cur(40 * MIB, true)] {
            for need in [MIB, 8 * MIB, 20 * MIB, 33 * MIB, 200 * MIB] {
                let warm = next_step(current, need, Activity::WarmUp, kept);
                let after = match warm {
                    Step::Replace(b) => cur(b, false),
                    Step::Add(b) => cur(b, false),
                    _ => current,
                };
                let capture = next_step(after, need, Activity::Capture, kept);
                let warm_own = matches!(warm, Step::Transient(_));
                assert_eq!(matches!(capture, Step::Transient(_)), warm_own, "{current:?}, need {need}: {warm:?} then {capture:?}");
            }
        }
    }

    #[test]
    fn the_kept_limit_is_read_in_mib() {
        assert_eq!(parse_kept_limit(None), 32 * MIB);
        assert_eq!(parse_kept_limit(Some("off")), usize::MAX);
        assert_eq!(parse_kept_limit(Some(" 64 ")), 64 * MIB);
        assert_eq!(parse_kept_limit(Some("0")), 0);
        assert_eq!(parse_kept_limit(Some("many")), 32 * MIB, "not a number: the default, with a warning");
    }
}

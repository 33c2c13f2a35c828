//! The bookkeeping of side tasks (see `side_stream`, above the allocator, for what they are):
//! which thread is inside one, their sequence numbers and end events, and the frees held for
//! them. Below the device, which keeps one [`SideState`] per GPU.

use std::cell::Cell;
use std::collections::VecDeque;

use cudarc::driver::{result as dr, sys};

use crate::{Error, Result};

/// A free that waits for a side task's join (the allocator's dropped buffer).
pub(crate) trait Held: Send {
    /// Bytes it gives back.
    fn bytes(&self) -> usize;
    /// Gives the memory back now.
    fn release(self: Box<Self>);
}

thread_local! {
    /// `ordinal + 1` of the device whose side task this thread is inside (0: none).
    static ON_SIDE: Cell<usize> = const { Cell::new(0) };
}

/// Whether newly opened devices run side tasks: yes unless `PTL_SIDE_STREAM=0`.
pub(crate) fn enabled_by_env() -> bool {
    std::env::var("PTL_SIDE_STREAM").map_or(true, |v| v != "0")
}

/// Whether the compute stream runs at a higher priority than the side stream
/// (`PTL_SIDE_PRIORITY=0` turns that off, for comparison).
pub(crate) fn priorities_enabled() -> bool {
    std::env::var("PTL_SIDE_PRIORITY").map_or(true, |v| v != "0")
}

/// Side tasks left unjoined at most (`PTL_SIDE_IN_FLIGHT`, 1–64, default 3): more overlap, but
/// the frees held meanwhile cost memory.
pub(crate) fn in_flight() -> u64 {
    static N: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("PTL_SIDE_IN_FLIGHT").ok().and_then(|v| v.parse::<u64>().ok()).filter(|n| (1..=64).contains(n)).unwrap_or(3)
    })
}

/// Held frees allowed by default, MiB: at batch 64 it lowers native training's peak by 454 MiB
/// with the same step time, and at batch 16 and with `replay=all` it changes neither.
pub(crate) const DEFAULT_HELD_MIB: u64 = 256;

/// Bytes of held frees above which a fork joins the oldest side tasks (`PTL_SIDE_HELD_MIB`, MiB,
/// default [`DEFAULT_HELD_MIB`]; `off`: no limit beyond [`in_flight`]). Each held free waits for
/// up to `in_flight` tasks, and at large batches a task's buffers are large: three tasks' worth
/// held 840 MiB more at the batch-64 peak than one stream did.
pub(crate) fn held_cap() -> Option<u64> {
    static CAP: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| parse_held_cap(std::env::var("PTL_SIDE_HELD_MIB").ok().as_deref()))
}

/// [`held_cap`] from the variable's value (`None`: unset).
fn parse_held_cap(value: Option<&str>) -> Option<u64> {
    let Some(v) = value else { return Some(DEFAULT_HELD_MIB << 20) };
    match v.trim() {
        "off" => None,
        t => match t.parse::<u64>() {
            Ok(mib) if mib <= 1 << 20 => Some(mib << 20),
            _ => {
                log::warn!("ptl: PTL_SIDE_HELD_MIB={v:?} is neither `off` nor a number of MiB up to 1048576; using {DEFAULT_HELD_MIB} MiB");
                Some(DEFAULT_HELD_MIB << 20)
            }
        },
    }
}

/// The device whose side task this thread is inside.
pub(crate) fn side_ordinal() -> Option<usize> {
    ON_SIDE.with(|s| s.get().checked_sub(1))
}

/// Marks this thread as inside a side task of device `ordinal` (`None`: none).
pub(crate) fn set_on_side(ordinal: Option<usize>) {
    ON_SIDE.with(|s| s.set(ordinal.map_or(0, |o| o + 1)));
}

/// Whether this thread is inside a side task of device `ordinal`.
#[inline]
pub(crate) fn is_on_side(ordinal: usize) -> bool {
    ON_SIDE.with(|s| s.get() == ordinal + 1)
}

/// Bytes a held free gives back (what the ledger counts).
pub(crate) trait HeldBytes {
    /// Bytes it gives back.
    fn bytes(&self) -> usize;
}

impl HeldBytes for Box<dyn Held> {
    fn bytes(&self) -> usize {
        (**self).bytes()
    }
}

/// The side tasks of one device as numbers: what was forked, what has ended (with its end event
/// `E`), what was joined, and the frees `H` held meanwhile. No driver calls: the caller records and
/// waits on the events it names, so the rules are tested on the CPU.
pub(crate) struct SideLedger<E, H> {
    /// Sequence number of the latest side task (0: none yet).
    pub(crate) forked: u64,
    /// Tasks up to this one are ordered before the compute stream's later work.
    pub(crate) joined: u64,
    /// The end event of each ended (queued) task not yet joined, oldest first.
    ends: VecDeque<(u64, E)>,
    /// Events free for reuse as end events.
    spare: Vec<E>,
    /// Frees waiting for the join of the task they are tagged with, in tag order.
    held: VecDeque<(u64, H)>,
    /// Bytes held now, and the most held at once.
    pub(crate) held_bytes: u64,
    pub(crate) peak_held_bytes: u64,
    /// Side tasks forked so far (diagnostics).
    pub(crate) tasks: u64,
}

impl<E: Copy, H: HeldBytes> SideLedger<E, H> {
    pub(crate) fn new() -> Self {
        SideLedger {
            forked: 0,
            joined: 0,
            ends: VecDeque::new(),
            spare: Vec::new(),
            held: VecDeque::new(),
            held_bytes: 0,
            peak_held_bytes: 0,
            tasks: 0,
        }
    }

    /// Whether a side task may still be running from the compute stream's point of view.
    pub(crate) fn pending(&self) -> bool {
        self.forked > self.joined
    }

    /// The latest task whose end event is queued.
    pub(crate) fn last_ended(&self) -> u64 {
        self.ends.back().map_or(self.joined, |(seq, _)| *seq)
    }

    /// The task to join before another forks, so that at most `in_flight` stay unjoined with it.
    pub(crate) fn join_before_fork(&self, in_flight: u64) -> u64 {
        self.forked.saturating_sub(in_flight.max(1) - 1).min(self.last_ended())
    }

    /// The task to join before another forks so that at most `cap` bytes of frees stay held:
    /// the oldest tasks first (frees are held in the order of the tasks they wait for), only
    /// ended ones; `joined` when the held bytes are within `cap` already.
    pub(crate) fn join_for_held_bytes(&self, cap: u64) -> u64 {
        let mut left = self.held_bytes;
        let mut through = self.joined;
        for (tag, freed) in &self.held {
            if left <= cap {
                break;
            }
            through = *tag;
            left -= freed.bytes() as u64;
        }
        through.min(self.last_ended())
    }

    /// Starts a task: its sequence number.
    pub(crate) fn fork(&mut self) -> u64 {
        self.forked += 1;
        self.tasks += 1;
        self.forked
    }

    /// An event to record a task's end with, if one is free.
    pub(crate) fn spare_event(&mut self) -> Option<E> {
        self.spare.pop()
    }

    /// The running task's work is queued, its end recorded in `event`.
    pub(crate) fn ended(&mut self, event: E) {
        self.ends.push_back((self.forked, event));
    }

    /// Joins every task up to `n` (ended ones only count): the event the compute stream must wait
    /// for (the latest such task's; `None`: nothing to wait for) and the frees that waited for it,
    /// in the order they were made. The event goes back to the spare ones: the caller queues its
    /// wait before recording anything else.
    pub(crate) fn join_through(&mut self, n: u64) -> (Option<E>, Vec<H>) {
        let n = n.min(self.last_ended());
        if n <= self.joined {
            return (None, Vec::new());
        }
        let mut last = None;
        while let Some(&(seq, ev)) = self.ends.front() {
            if seq > n {
                break;
            }
            self.ends.pop_front();
            if let Some(prev) = last.replace(ev) {
                self.spare.push(prev);
            }
        }
        if let Some(ev) = last {
            self.spare.push(ev);
        }
        self.joined = n;
        let mut out = Vec::new();
        while self.held.front().is_some_and(|(tag, _)| *tag <= n) {
            if let Some((_, f)) = self.held.pop_front() {
                self.held_bytes -= f.bytes() as u64;
                out.push(f);
            }
        }
        (last, out)
    }

    /// Whether the free of a buffer made after task `born` must wait: a task forked after it
    /// existed (which may read or write it) is unjoined. Earlier tasks had queued all their work
    /// before the buffer existed.
    pub(crate) fn must_hold(&self, born: u64) -> bool {
        self.forked > self.joined.max(born)
    }

    /// Keeps `freed` until the join of the latest task.
    pub(crate) fn hold(&mut self, freed: H) {
        self.held_bytes += freed.bytes() as u64;
        self.peak_held_bytes = self.peak_held_bytes.max(self.held_bytes);
        self.held.push_back((self.forked, freed));
    }
}

/// The side tasks of one device: the ledger and the event each fork records.
pub(crate) struct SideState {
    pub(crate) ledger: SideLedger<sys::CUevent, Box<dyn Held>>,
    /// The event each fork records on the compute stream (reused: a wait takes the event's state
    /// when it is queued).
    pub(crate) fork: sys::CUevent,
}

// SAFETY: events are process-global driver objects; the state is only touched under its mutex.
unsafe impl Send for SideState {}

pub(crate) fn new_event() -> std::result::Result<sys::CUevent, cudarc::driver::DriverError> {
    dr::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
}

/// `to` waits for what `from` has queued so far, through `event` (recorded on `from`): a fork of
/// a second stream from the compute stream. Under stream capture it is an edge of the graph.
pub(crate) fn fork_stream(event: sys::CUevent, from: sys::CUstream, to: sys::CUstream, what: &str) -> Result<()> {
    // SAFETY: live handles of the bound context.
    unsafe {
        dr::event::record(event, from).map_err(|e| Error::Cuda(format!("cuEventRecord ({what}): {e:?}")))?;
        dr::stream::wait_event(to, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            .map_err(|e| Error::Cuda(format!("cuStreamWaitEvent ({what}): {e:?}")))
    }
}

impl SideState {
    pub(crate) fn new() -> std::result::Result<SideState, cudarc::driver::DriverError> {
        Ok(SideState { ledger: SideLedger::new(), fork: new_event()? })
    }

    /// Makes the compute stream wait for task `n` (ended tasks only) and returns the frees that
    /// waited for it.
    pub(crate) fn join_through(&mut self, compute: sys::CUstream, n: u64) -> Result<Vec<Box<dyn Held>>> {
        let (wait, released) = self.ledger.join_through(n);
        if let Some(ev) = wait {
            unsafe { dr::stream::wait_event(compute, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .map_err(|e| Error::Cuda(format!("cuStreamWaitEvent (join): {e:?}")))?;
        }
        Ok(released)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Buf(usize, &'static str);
    impl HeldBytes for Buf {
        fn bytes(&self) -> usize {
            self.0
        }
    }

    fn names(v: &[Buf]) -> Vec<&'static str> {
        v.iter().map(|b| b.1).collect()
    }

    #[test]
    fn a_join_waits_for_the_latest_ended_task_and_releases_what_waited_for_it() {
        let mut l: SideLedger<u32, Buf> = SideLedger::new();
        assert!(!l.pending() && !l.must_hold(0), "nothing forked: frees go back at once");
        assert_eq!(l.fork(), 1);
        // A buffer that existed before task 1 (born 0) may be touched by it; one made after it
        // forked (born 1, on the compute stream) may not.
        assert!(l.must_hold(0) && !l.must_hold(1));
        l.hold(Buf(100, "dy"));
        l.ended(11);
        assert_eq!(l.fork(), 2);
        l.hold(Buf(20, "x"));
        assert_eq!((l.held_bytes, l.peak_held_bytes), (120, 120));
        // Task 2 has not ended: a join now stops at task 1, with task 1's event.
        let (wait, freed) = l.join_through(2);
        assert_eq!((wait, names(&freed)), (Some(11), vec!["dy"]));
        assert!(l.pending() && l.joined == 1 && l.held_bytes == 20);
        l.ended(12);
        let (wait, freed) = l.join_through(u64::MAX);
        assert_eq!((wait, names(&freed)), (Some(12), vec!["x"]));
        assert!(!l.pending() && l.held_bytes == 0 && l.peak_held_bytes == 120);
        assert_eq!(l.join_through(u64::MAX).0, None, "nothing left to wait for");
        // Both events are free again, the last one waited for on top.
        assert_eq!((l.spare_event(), l.spare_event(), l.spare_event()), (Some(12), Some(11), None));
    }

    #[test]
    fn a_fork_joins_the_oldest_task_beyond_the_in_flight_limit() {
        let mut l: SideLedger<u32, Buf> = SideLedger::new();
        for ev in 1..=5 {
            l.fork();
            l.ended(ev);
        }
        assert_eq!(l.join_before_fork(3), 3, "with the sixth task, tasks 4 and 5 stay unjoined");
        assert_eq!(l.join_before_fork(1), 5, "one in flight: everything before joins");
        assert_eq!(l.join_before_fork(0), 5, "a limit of 0 counts as 1");
        assert_eq!(l.join_before_fork(64), 0, "nothing to join yet");
        // Joining through task 3 waits for task 3's event only (the side stream runs in order).
        let (wait, _) = l.join_through(l.join_before_fork(3));
        assert_eq!((wait, l.joined), (Some(3), 3));
        assert_eq!((l.spare_event(), l.spare_event(), l.spare_event(), l.spare_event()), (Some(3), Some(2), Some(1), None));
    }

    #[test]
    fn a_cap_on_held_bytes_joins_the_oldest_tasks_first() {
        let mut l: SideLedger<u32, Buf> = SideLedger::new();
        for (ev, bytes) in [(1, 100), (2, 50), (3, 30)] {
            l.fork();
            l.hold(Buf(bytes, "x"));
            l.hold(Buf(bytes, "dy"));
            l.ended(ev);
        }
        assert_eq!(l.held_bytes, 360);
        assert_eq!(l.join_for_held_bytes(360), 0, "within the cap: nothing to join");
        assert_eq!(l.join_for_held_bytes(200), 1, "task 1's 200 bytes released leave 160");
        assert_eq!(l.join_for_held_bytes(160), 1);
        assert_eq!(l.join_for_held_bytes(159), 2);
        assert_eq!(l.join_for_held_bytes(0), 3);
        let (_, freed) = l.join_through(l.join_for_held_bytes(100));
        assert_eq!((freed.len(), l.held_bytes), (4, 60));
        assert_eq!(l.join_for_held_bytes(100), 2, "already within the cap: the tasks joined so far");
        // A task that has not ended is never joined.
        l.fork();
        l.hold(Buf(500, "big"));
        assert_eq!(l.join_for_held_bytes(0), 3);
    }

    #[test]
    fn the_held_cap_defaults_to_256_mib_and_can_be_lifted() {
        assert_eq!(parse_held_cap(None), Some(256 << 20));
        assert_eq!(parse_held_cap(Some("off")), None);
        assert_eq!(parse_held_cap(Some(" 64 ")), Some(64 << 20));
        assert_eq!(parse_held_cap(Some("0")), Some(0), "0: every fork joins the tasks whose frees wait");
        assert_eq!(parse_held_cap(Some("lots")), Some(256 << 20), "not a number: the default, with a warning");
        assert_eq!(parse_held_cap(Some("2000000")), Some(256 << 20), "above 1 TiB: the default, with a warning");
    }

    #[test]
    fn frees_come_back_in_the_order_they_were_made() {
        let mut l: SideLedger<u32, Buf> = SideLedger::new();
        l.fork();
        l.hold(Buf(1, "a"));
        l.hold(Buf(2, "b"));
        l.ended(7);
        l.fork();
        l.hold(Buf(3, "c"));
        l.ended(8);
        let (_, freed) = l.join_through(u64::MAX);
        assert_eq!(names(&freed), ["a", "b", "c"]);
    }
}

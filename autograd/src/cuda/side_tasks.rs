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

/// The side tasks of one device: what was forked, what was joined, and the frees held meanwhile.
pub(crate) struct SideState {
    /// Sequence number of the latest side task (0: none yet).
    pub(crate) forked: u64,
    /// Tasks up to this one are ordered before the compute stream's later work.
    pub(crate) joined: u64,
    /// The end event of each finished (queued) task not yet joined, oldest first.
    pub(crate) ends: VecDeque<(u64, sys::CUevent)>,
    /// The event each fork records on the compute stream (reused: a wait takes the event's state
    /// when it is queued).
    pub(crate) fork: sys::CUevent,
    /// Events free for reuse as end events.
    pub(crate) spare: Vec<sys::CUevent>,
    /// Frees waiting for the join of the task they are tagged with, in tag order.
    held: VecDeque<(u64, Box<dyn Held>)>,
    /// Bytes held now, and the most held at once.
    pub(crate) held_bytes: u64,
    pub(crate) peak_held_bytes: u64,
    /// Side tasks forked since the device opened (diagnostics).
    pub(crate) tasks: u64,
}

// SAFETY: events are process-global driver objects; the state is only touched under its mutex.
unsafe impl Send for SideState {}

pub(crate) fn new_event() -> std::result::Result<sys::CUevent, cudarc::driver::DriverError> {
    dr::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
}

impl SideState {
    pub(crate) fn new() -> std::result::Result<SideState, cudarc::driver::DriverError> {
        Ok(SideState {
            forked: 0,
            joined: 0,
            ends: VecDeque::new(),
            fork: new_event()?,
            spare: Vec::new(),
            held: VecDeque::new(),
            held_bytes: 0,
            peak_held_bytes: 0,
            tasks: 0,
        })
    }

    /// Whether a side task may still be running from the compute stream's point of view.
    pub(crate) fn pending(&self) -> bool {
        self.forked > self.joined
    }

    /// Makes the compute stream wait for task `n` (which must have ended: its end event is
    /// queued) and returns the frees that waited for it.
    pub(crate) fn join_through(&mut self, compute: sys::CUstream, n: u64) -> Result<Vec<Box<dyn Held>>> {
        if n <= self.joined {
            return Ok(Vec::new());
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
            unsafe { dr::stream::wait_event(compute, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .map_err(|e| Error::Cuda(format!("cuStreamWaitEvent (join): {e:?}")))?;
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
        Ok(out)
    }

    /// Keeps `freed` until the join of the latest task if one is unjoined; otherwise hands it back.
    pub(crate) fn hold(&mut self, freed: Box<dyn Held>) -> Option<Box<dyn Held>> {
        if !self.pending() {
            return Some(freed);
        }
        self.held_bytes += freed.bytes() as u64;
        self.peak_held_bytes = self.peak_held_bytes.max(self.held_bytes);
        self.held.push_back((self.forked, freed));
        None
    }

    /// The latest task whose end event is queued.
    pub(crate) fn last_ended(&self) -> u64 {
        self.ends.back().map_or(self.joined, |(seq, _)| *seq)
    }
}

//! Side tasks: work queued on a device's second stream beside the compute stream, so that
//! independent kernels overlap — weight gradients, and what a model sends beside the chain
//! ([`crate::streams::beside`]) with its backward (docs/concurrent-backward.md).
//!
//! * **Fork.** A side task starts with the side stream waiting for an event recorded on the
//!   compute stream: it sees everything queued there before it. Kernels, copies, memsets and
//!   library calls of the thread go to the side stream until the task ends ([`Dev::stream`]).
//! * **Join.** The compute stream waits for the end event of a side task before it may use what
//!   the task wrote. Side tasks run one after another, so joining task `n` joins every earlier
//!   one. At most [`in_flight`] tasks are left unjoined (the oldest is joined before another
//!   forks; with [`held_cap`], also as many of the oldest as keep the held frees within it), and
//!   everything is joined before a host synchronisation, before a capture begins or
//!   ends, and at the end of each backward pass.
//! * **Held frees.** A buffer dropped while a side task forked after it existed is unjoined may
//!   still be read or written by that task; handing its memory to the next request on the compute
//!   stream (the pool, the block cache, a capture arena's plan) would race. So such a free is
//!   *held*, tagged with the latest task, and carried out when the compute stream joins that task
//!   (tasks forked before the buffer existed had queued all their work without it). The warm-up's allocation trace
//!   sees the free there too, so an arena plan made from it keeps the buffer apart from what the
//!   compute stream allocates meanwhile.
//!
//! Under stream capture the fork and join become edges of the graph (the side stream joins the
//! capture through the first wait and is joined back before the capture ends). Every kernel
//! computes what it computes on one stream; only which kernels overlap changes, so the bytes do
//! not.

use cudarc::driver::result as dr;

use super::device::{cu_err, Dev};
use super::side_tasks::{held_cap, in_flight, new_event, set_on_side, side_ordinal, Held, SideState};
use crate::Result;

fn release_all(freed: Vec<Box<dyn Held>>) {
    for f in freed {
        f.release();
    }
}

fn state(dev: &Dev) -> std::sync::MutexGuard<'_, SideState> {
    dev.side.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a buffer allocated by side task `task` may still be written by it, seen from the
/// compute stream.
pub(crate) fn task_pending(dev: &Dev, task: u64) -> bool {
    task != 0 && state(dev).ledger.joined < task
}

/// Runs `f` as a side task of `dev` when the device's `concurrent_weight_gradients` option is on
/// (otherwise, or already inside one, on the current stream).
pub(crate) fn on_side<R, E: From<crate::Error>>(dev: &Dev, f: impl FnOnce() -> std::result::Result<R, E>) -> std::result::Result<R, E> {
    if !dev.options().concurrent_weight_gradients || side_ordinal().is_some() {
        return f();
    }
    dev.bind()?;
    // Leave at most `in_flight() - 1` tasks unjoined before this one forks; what waited for the
    // joined ones is freed before the fork, so the new task sees those frees done.
    let released = {
        let mut s = state(dev);
        let mut through = s.ledger.join_before_fork(in_flight());
        if let Some(cap) = held_cap() {
            through = through.max(s.ledger.join_for_held_bytes(cap));
        }
        s.join_through(dev.cu_stream, through)?
    };
    release_all(released);
    {
        let mut s = state(dev);
        super::side_tasks::fork_stream(s.fork, dev.cu_stream, dev.side_cu_stream, "fork")?;
        s.ledger.fork();
    }
    set_on_side(Some(dev.ordinal));
    let r = f();
    set_on_side(None);
    let mut s = state(dev);
    let ev = match s.ledger.spare_event() {
        Some(ev) => ev,
        None => new_event().map_err(|e| cu_err("cuEventCreate", e))?,
    };
    unsafe { dr::event::record(ev, dev.side_cu_stream) }.map_err(|e| cu_err("cuEventRecord (side task end)", e))?;
    s.ledger.ended(ev);
    r
}

/// Side-task figures of one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SideStreamStats {
    /// Side tasks forked since the device opened.
    pub tasks: u64,
    /// Bytes of frees held for unjoined side tasks now.
    pub held_bytes: u64,
    /// The most bytes held at once since the device opened.
    pub peak_held_bytes: u64,
}

/// The side-task figures of `device`.
pub fn side_stream_stats(device: crate::Device) -> Result<SideStreamStats> {
    let dev = super::device::dev_of(device)?;
    let s = state(&dev);
    let l = &s.ledger;
    Ok(SideStreamStats { tasks: l.tasks, held_bytes: l.held_bytes, peak_held_bytes: l.peak_held_bytes })
}

/// Runs `f` as a side task of `device` (see [`on_side`]).
pub(crate) fn run_aside<R, E: From<crate::Error>>(
    device: crate::Device,
    f: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    match device {
        crate::Device::Cuda(_) => on_side(&*super::device::dev_of(device)?, f),
        crate::Device::Cpu => f(),
    }
}

/// Whether `storage` was written by a side task the compute stream has not joined yet.
pub(crate) fn written_aside(storage: &super::storage::CudaStorage) -> bool {
    task_pending(&storage.buf.dev, storage.buf.side_task)
}

/// Whether `device` runs side tasks (its `concurrent_weight_gradients` option).
pub(crate) fn enabled(device: crate::Device) -> bool {
    match device {
        crate::Device::Cuda(_) => super::device::dev_of(device).is_ok_and(|d| d.options().concurrent_weight_gradients),
        crate::Device::Cpu => false,
    }
}

/// Whether this thread is inside a side task.
pub(crate) fn in_side_task() -> bool {
    side_ordinal().is_some()
}

/// Joins the side tasks of every opened device ([`Dev::join_side_tasks`]).
pub(crate) fn join_every_device() -> Result<()> {
    for dev in super::device::opened() {
        dev.join_side_tasks()?;
    }
    Ok(())
}

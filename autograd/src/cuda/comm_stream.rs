//! A communicator's own stream: collectives started there run beside the compute stream's work
//! (a data-parallel gradient sum beside the rest of the backward), as PyTorch's process groups
//! run theirs beside the default stream.
//!
//! The stream starts each collective after the compute stream's work queued so far (a fork event)
//! and ends with a done event; the compute stream and the host wait for that event before the
//! collective's buffer is read again. The buffer must stay allocated until then: the pool reuses a
//! freed block on the compute stream without waiting for other streams, so a caller keeps it
//! alive across the join (the gradient buckets live until the update's average is written).

use cudarc::driver::{result as dr, sys};

use super::device::{cu_err, Dev};
use crate::Result;

/// The stream and its two events.
pub(crate) struct CommStream {
    /// Where the collectives run.
    pub(crate) stream: sys::CUstream,
    fork: sys::CUevent,
    done: sys::CUevent,
}

// SAFETY: CUDA streams and events are handles the driver lets any thread use with the context
// bound; the communicator that owns this issues its calls from one thread at a time.
unsafe impl Send for CommStream {}
unsafe impl Sync for CommStream {}

impl CommStream {
    /// A stream at the compute stream's priority (a collective's few blocks should not wait
    /// behind the side stream's weight gradients) and its events, on `dev`.
    pub(crate) fn new(dev: &Dev) -> Result<CommStream> {
        dev.bind()?;
        let priority = match super::side_tasks::priorities_enabled() {
            true => dr::stream::get_priority_range().map_err(|e| cu_err("stream priorities", e))?.1,
            false => 0,
        };
        let stream = dr::stream::create_with_priority(dr::stream::StreamKind::NonBlocking, priority)
            .map_err(|e| cu_err("cuStreamCreateWithPriority (communication stream)", e))?;
        let event = || super::side_tasks::new_event().map_err(|e| cu_err("cuEventCreate (communication stream)", e));
        Ok(CommStream { stream, fork: event()?, done: event()? })
    }

    /// The stream waits for what `compute` has queued so far.
    pub(crate) fn fork(&self, compute: sys::CUstream) -> Result<()> {
        super::side_tasks::fork_stream(self.fork, compute, self.stream, "communication fork")
    }

    /// Marks the end of what the stream has queued so far.
    pub(crate) fn end(&self) -> Result<()> {
        // SAFETY: live handles of the bound context.
        unsafe { dr::event::record(self.done, self.stream) }.map_err(|e| cu_err("cuEventRecord (communication end)", e))
    }

    /// `compute` waits for the last [`CommStream::end`], and so does the host.
    pub(crate) fn join(&self, compute: sys::CUstream) -> Result<()> {
        // SAFETY: live handles of the bound context.
        unsafe {
            dr::stream::wait_event(compute, self.done, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                .map_err(|e| cu_err("cuStreamWaitEvent (communication join)", e))?;
            dr::event::synchronize(self.done).map_err(|e| cu_err("cuEventSynchronize (communication join)", e))
        }
    }
}

impl Drop for CommStream {
    fn drop(&mut self) {
        // SAFETY: nothing uses the handles afterwards; the driver finishes queued work first.
        unsafe {
            let _ = dr::event::destroy(self.fork);
            let _ = dr::event::destroy(self.done);
            let _ = dr::stream::destroy(self.stream);
        }
    }
}

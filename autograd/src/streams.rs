//! Work beside the main chain, seen from the backend-neutral side: the CUDA backend runs it as
//! side tasks on a second stream (`cuda::side_stream`, docs/concurrent-backward.md) when the
//! device's `concurrent_weight_gradients` option is on; the CPU runs everything in order and these
//! are plain calls. Weight gradients go there on their own; a model may also send a branch whose
//! backward is independent of the rest (e.g. one fed detached features) with [`beside`]: the
//! backward of what it records runs there too.

use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor};

/// Runs `f` beside the main chain of `device` where the backend can (the device's
/// `concurrent_weight_gradients` option): as one side task, whose autograd nodes run their
/// backward beside the chain too. What `f` returns may still be written when this returns:
/// [`join`] before other work reads it. Inside a side task, `f` just runs.
pub fn beside<R, E: From<Error>>(device: Device, f: impl FnOnce() -> std::result::Result<R, E>) -> std::result::Result<R, E> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::side_stream::run_aside(device, f)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        f()
    }
}

/// Whether `device` runs work beside its main chain ([`beside`] is then more than a plain call).
pub fn overlapping(device: Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::side_stream::enabled(device)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// Whether this thread is inside a side task (an autograd node recorded now runs its backward
/// beside the chain).
pub(crate) fn in_side_task() -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::side_stream::in_side_task()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The device of the first of `grads` still being written beside the data-gradient chain: work
/// that reads it must run there too, or after a join.
pub(crate) fn written_aside<'a>(grads: impl IntoIterator<Item = &'a Tensor>) -> Option<Device> {
    grads.into_iter().find(|t| t.with_storage(storage_written_aside)).map(Tensor::device)
}

fn storage_written_aside(s: &Storage) -> bool {
    match s {
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) => crate::cuda::side_stream::written_aside(c),
        _ => false,
    }
}

/// Orders everything written beside the main chain before the work queued after this call
/// (every device).
pub fn join() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::side_stream::join_every_device()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(())
    }
}

/// Joins on drop, so that a backward pass that stops early leaves nothing beside the chain.
pub(crate) struct JoinOnDrop;

impl Drop for JoinOnDrop {
    fn drop(&mut self) {
        if let Err(e) = join() {
            log::warn!("ptl: joining the weight-gradient stream failed: {e}");
        }
    }
}

//! Weight gradients beside the data gradients, seen from the backend-neutral side: the CUDA
//! backend runs them as side tasks on a second stream (`cuda::side_stream`,
//! docs/concurrent-backward.md); the CPU runs everything in order and these are plain calls.

use crate::storage::Storage;
use crate::{Device, Result, Tensor};

/// Runs `f`, the computation of a weight gradient on `device`, beside the data-gradient chain
/// where the backend can (the device's `concurrent_weight_gradients` option).
pub(crate) fn weight_gradient<R>(device: Device, f: impl FnOnce() -> Result<R>) -> Result<R> {
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

/// Orders everything written beside the data-gradient chain before the work queued after this
/// call (every device).
pub(crate) fn join() -> Result<()> {
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

//! How far the training thread may run ahead of the device. A replayed step costs the host about
//! a millisecond, so without a bound the host would queue steps as fast as the loader hands out
//! batches, empty the prefetch queue in a burst, and then wait for the workers while the device
//! still has several steps queued: waits that starve nothing, counted as data waits. With at most
//! [`STEPS_AHEAD`] steps queued, the host takes a batch only when the device is about to need it,
//! so the data wait measures what it should — the device waiting for the loader.

#[cfg(feature = "cuda")]
use std::collections::VecDeque;

use ptl_autograd::Device;

use crate::Result;

/// Steps the host may have queued on the device beyond the one it is preparing.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) const STEPS_AHEAD: usize = 2;

/// Marks on the device's stream at the end of the steps queued so far (CUDA only).
pub(super) struct RunAhead {
    #[cfg(feature = "cuda")]
    device: Device,
    #[cfg(feature = "cuda")]
    marks: VecDeque<ptl_autograd::internal::cuda::StreamMark>,
}

impl RunAhead {
    pub(super) fn new(device: Device) -> RunAhead {
        #[cfg(feature = "cuda")]
        return RunAhead { device, marks: VecDeque::new() };
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            RunAhead {}
        }
    }

    /// A step's work has been queued: mark where it ends.
    pub(super) fn step_queued(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            self.marks.push_back(ptl_autograd::internal::cuda::StreamMark::record(self.device)?);
        }
        Ok(())
    }

    /// Before the next step: waits until the device has finished all but the last
    /// [`STEPS_AHEAD`] queued steps.
    pub(super) fn wait_turn(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        while self.marks.len() > STEPS_AHEAD {
            if let Some(m) = self.marks.pop_front() {
                m.wait()?;
            }
        }
        Ok(())
    }
}

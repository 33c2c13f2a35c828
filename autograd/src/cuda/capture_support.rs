//! Support for graph recorders (the `ptl-capture` crate): a per-thread *capture scope* that
//! routes every device allocation to a recording-owned bump arena and turns illegal work during a
//! capture (host reads/synchronisation, fresh host→device uploads, allocation beyond the arena,
//! nested capture) into errors with a typed [`CaptureViolation`] the recorder can read back, plus
//! a per-thread byte counter used to size arenas during warmup.
//!
//! Arena memory is never returned one buffer at a time: a buffer allocated from the arena keeps the
//! arena alive (shared handle), so every address baked into a graph stays reserved for as long as
//! the recording (or any tensor on arena memory) lives. Within one capture, though, bytes are
//! reused: an arena made with an [`ArenaPlan`] (from the warm-up's [`AllocTrace`]) hands the k-th
//! allocation the planned offset of the warm-up's k-th buffer, so buffers whose lifetimes did not
//! meet share bytes, as in a caching allocator. A planned offset is taken only when the request
//! has the planned size and the bytes are free now (the buffers there were dropped, in stream
//! order before this point); anything else goes to the unplanned tail of the arena.

use std::sync::Arc;

pub use super::capture_scope::*;
use crate::arena_plan::ArenaPlan;
use crate::{Device, Error, Result, Tensor};

impl CaptureArena {
    /// Reserves `bytes` of device memory (from the private pool entered on this thread, if any),
    /// handed out by bumping a pointer.
    pub fn new(device: Device, bytes: usize) -> Result<Arc<CaptureArena>> {
        Self::planned(device, ArenaPlan::default(), bytes)
    }

    /// Reserves `plan.bytes + tail` bytes: the planned part laid out as `plan` says, then `tail`
    /// bytes for allocations the plan does not cover.
    pub fn planned(device: Device, plan: ArenaPlan, tail: usize) -> Result<Arc<CaptureArena>> {
        let dev = super::device::dev_of(device)?;
        let size = (plan.bytes + tail).max(ARENA_ALIGN).next_multiple_of(ARENA_ALIGN);
        let backing =
            Tensor::from_storage(crate::storage::Storage::Cuda(super::storage::CudaStorage::alloc(&dev, crate::DType::U8, size)?), size)?;
        let base = backing.with_storage(|s| match s {
            crate::storage::Storage::Cuda(c) => Ok(c.device_ptr()),
            #[allow(unreachable_patterns)]
            _ => Err(Error::invalid("CaptureArena", "backing storage is not on a CUDA device")),
        })?;
        Ok(CaptureArena::over(dev, base, size, plan, Box::new(backing)))
    }

    /// [`CaptureArena::planned`] at reserved addresses: the arena can grow in place
    /// ([`CaptureArena::grow`]) and give its memory back while its graphs are idle
    /// ([`CaptureArena::evict`]). Not from a private pool; counted in the device's statistics
    /// while mapped. Rounded up to the driver's granularity (2 MiB on current GPUs).
    pub fn growable(device: Device, plan: ArenaPlan, tail: usize) -> Result<Arc<CaptureArena>> {
        let dev = super::device::dev_of(device)?;
        let range = super::mapped_range::MappedRange::new(&dev, (plan.bytes + tail).max(ARENA_ALIGN))?;
        Ok(CaptureArena::over_range(dev, range, plan))
    }

    /// An arena of at least `bytes` addresses that holds one granule of memory: every piece
    /// aliases the same bytes. For a capture that is only traced ([`CaptureArena::trace`]) and
    /// whose graph is never launched: a plan made from that trace fits the real capture exactly.
    pub fn aliased(device: Device, bytes: usize) -> Result<Arc<CaptureArena>> {
        let dev = super::device::dev_of(device)?;
        let range = super::aliased_range::AliasedRange::new(&dev, bytes.max(ARENA_ALIGN))?;
        let (base, size) = (range.base(), range.size());
        Ok(CaptureArena::over(dev, base, size, ArenaPlan::default(), Box::new(range)))
    }
}

/// Device address of a tensor's buffer (`None` for host tensors).
pub fn device_ptr(t: &Tensor) -> Option<u64> {
    t.with_storage(|s| match s {
        crate::storage::Storage::Cuda(c) => Some(c.device_ptr()),
        #[allow(unreachable_patterns)]
        _ => None,
    })
}

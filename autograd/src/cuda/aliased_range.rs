//! A range of device addresses backed by one small physical chunk mapped over and over (CUDA's
//! virtual memory management): every address is valid device memory, but the whole range costs
//! one granule (2 MiB on current GPUs). What a capture that is never replayed needs: its kernels
//! and copies take real device addresses, and its allocations can be traced at full size without
//! the memory.

use cudarc::driver::sys;

use super::device::Dev;
use super::mapped_range::{check, device_memory};
use crate::Result;

/// Reserved addresses, each granule mapped to the same physical chunk; unmapped and released on
/// drop. Nothing may ever run on these addresses: every granule aliases the same bytes.
pub(crate) struct AliasedRange {
    dev: std::sync::Arc<Dev>,
    base: sys::CUdeviceptr,
    size: usize,
    granule: usize,
    mapped: usize,
    chunk: sys::CUmemGenericAllocationHandle,
}

impl AliasedRange {
    /// At least `bytes` addresses on `dev`.
    pub(crate) fn new(dev: &std::sync::Arc<Dev>, bytes: usize) -> Result<AliasedRange> {
        dev.bind()?;
        // SAFETY: plain driver calls on the device's bound context; every handle made here is
        // released by `Drop` (or below, on failure).
        unsafe {
            let (prop, granule) = device_memory(dev)?;
            let size = bytes.max(1).next_multiple_of(granule);
            let mut chunk = 0;
            check("cuMemCreate", sys::cuMemCreate(&mut chunk, granule, &prop, 0))?;
            let mut base = 0;
            if let Err(e) = check("cuMemAddressReserve", sys::cuMemAddressReserve(&mut base, size, granule, 0, 0)) {
                sys::cuMemRelease(chunk);
                return Err(e);
            }
            let mut range = AliasedRange { dev: dev.clone(), base, size, granule, mapped: 0, chunk };
            while range.mapped * granule < size {
                let at = base + (range.mapped * granule) as u64;
                check("cuMemMap", sys::cuMemMap(at, granule, 0, chunk, 0))?;
                range.mapped += 1;
            }
            let access =
                sys::CUmemAccessDesc { location: prop.location, flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
            check("cuMemSetAccess", sys::cuMemSetAccess(base, size, &access, 1))?;
            Ok(range)
        }
    }

    /// The first address.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Addresses in the range.
    pub(crate) fn size(&self) -> usize {
        self.size
    }
}

impl Drop for AliasedRange {
    fn drop(&mut self) {
        // SAFETY: unmaps what `new` mapped, then frees the reservation and the chunk; nothing
        // runs on these addresses (the graphs captured on them are never launched).
        let _ = self.dev.bind();
        unsafe {
            for k in 0..self.mapped {
                sys::cuMemUnmap(self.base + (k * self.granule) as u64, self.granule);
            }
            sys::cuMemAddressFree(self.base, self.size);
            sys::cuMemRelease(self.chunk);
        }
    }
}

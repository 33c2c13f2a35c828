//! Device memory whose addresses outlive it (CUDA's virtual memory management): a reserved range
//! of addresses with physical memory mapped over its first bytes, which can grow in place, be
//! given back to the driver and be mapped again at the same addresses. What an arena shared by
//! recorded graphs needs: the graphs bake its addresses, yet between their replays it holds
//! nothing, so a native run beside them (a new signature's warm-up) can have its memory, and a
//! graph recorded later for a larger input can have more of it without a second arena.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::device::{cu_err, Dev};
use crate::{Error, Result};

pub(super) fn check(what: &str, r: sys::CUresult) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(cu_err(what, e)),
    }
}

/// Physical memory on `dev` as the virtual-memory calls describe it, and its granularity.
pub(super) fn device_memory(dev: &Dev) -> Result<(sys::CUmemAllocationProp, usize)> {
    // SAFETY: a plain-old-data struct filled field by field; the query only reads it.
    unsafe {
        let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev.ordinal as i32;
        let mut granule = 0usize;
        check(
            "cuMemGetAllocationGranularity",
            sys::cuMemGetAllocationGranularity(
                &mut granule,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            ),
        )?;
        Ok((prop, granule.max(1)))
    }
}

/// What is mapped now: physical chunks, each at an offset of the range.
#[derive(Default)]
struct Mapping {
    /// Bytes the range holds (mapped while resident).
    bytes: usize,
    chunks: Vec<(usize, usize, sys::CUmemGenericAllocationHandle)>,
    resident: bool,
}

/// A reserved address range with `bytes()` of it backed by device memory while resident.
/// Counted in the device's allocated and reserved bytes while mapped.
pub(crate) struct MappedRange {
    dev: Arc<Dev>,
    base: sys::CUdeviceptr,
    reserved: usize,
    granule: usize,
    prop: sys::CUmemAllocationProp,
    mapping: Mutex<Mapping>,
}

// SAFETY: the handles are driver objects usable from any thread; mutation goes through the mutex.
unsafe impl Send for MappedRange {}
unsafe impl Sync for MappedRange {}

impl MappedRange {
    /// `bytes` of device memory (rounded up to the granularity) at addresses that may grow up to
    /// the device's total memory.
    pub(crate) fn new(dev: &Arc<Dev>, bytes: usize) -> Result<MappedRange> {
        dev.bind()?;
        let (prop, granule) = device_memory(dev)?;
        let (_, total) = cudarc::driver::result::mem_get_info().map_err(|e| cu_err("cuMemGetInfo", e))?;
        let bytes = bytes.max(1).next_multiple_of(granule);
        let reserved = total.max(bytes).next_multiple_of(granule);
        let mut base = 0;
        // SAFETY: reserves addresses only; freed in `Drop`.
        check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut base, reserved, granule, 0, 0) })?;
        let range = MappedRange { dev: dev.clone(), base, reserved, granule, prop, mapping: Mutex::new(Mapping::default()) };
        {
            let mut m = range.lock();
            m.resident = true;
            range.map(&mut m, 0, bytes)?;
            m.bytes = bytes;
        }
        Ok(range)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Mapping> {
        self.mapping.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Maps fresh physical memory over `[from, to)`.
    fn map(&self, m: &mut Mapping, from: usize, to: usize) -> Result<()> {
        if to <= from {
            return Ok(());
        }
        let size = to - from;
        let mut handle = 0;
        // SAFETY: the chunk is mapped inside the reservation, past every mapped chunk; on failure
        // it is released here, on success `unmap_all` releases it.
        unsafe {
            check("cuMemCreate", sys::cuMemCreate(&mut handle, size, &self.prop, 0))?;
            let at = self.base + from as u64;
            if let Err(e) = check("cuMemMap", sys::cuMemMap(at, size, 0, handle, 0)) {
                sys::cuMemRelease(handle);
                return Err(e);
            }
            let access =
                sys::CUmemAccessDesc { location: self.prop.location, flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
            if let Err(e) = check("cuMemSetAccess", sys::cuMemSetAccess(at, size, &access, 1)) {
                sys::cuMemUnmap(at, size);
                sys::cuMemRelease(handle);
                return Err(e);
            }
        }
        m.chunks.push((from, size, handle));
        // A peak set here keeps the context recorded before it (contexts are named by the
        // allocator, above this module).
        self.dev.note_alloc(size as u64);
        let now = self.dev.mapped.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
        self.dev.peak_mapped.fetch_max(now, Ordering::Relaxed);
        Ok(())
    }

    /// Unmaps and releases every chunk (the caller has waited for the work that used them).
    fn unmap_all(&self, m: &mut Mapping) {
        for (off, size, handle) in m.chunks.drain(..) {
            // SAFETY: each chunk was mapped at this offset by `map`.
            unsafe {
                sys::cuMemUnmap(self.base + off as u64, size);
                sys::cuMemRelease(handle);
            }
            self.dev.note_free(size as u64);
            self.dev.mapped.fetch_sub(size as u64, Ordering::Relaxed);
        }
    }

    /// The first address.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Bytes the range holds (whether resident or not).
    pub(crate) fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Grows the range to at least `bytes` (rounded up to the granularity), in place: addresses
    /// already handed out keep their meaning. Returns the new size.
    pub(crate) fn grow(&self, bytes: usize) -> Result<usize> {
        let mut m = self.lock();
        let want = bytes.next_multiple_of(self.granule);
        if want <= m.bytes {
            return Ok(m.bytes);
        }
        if want > self.reserved {
            return Err(Error::invalid("MappedRange::grow", format!("{want} bytes exceed the {} reserved", self.reserved)));
        }
        self.dev.bind()?;
        if m.resident {
            let from = m.bytes;
            self.map(&mut m, from, want)?;
        }
        m.bytes = want;
        Ok(want)
    }

    /// Gives the physical memory back to the driver; the addresses stay reserved and must not be
    /// touched until [`MappedRange::restore`]. Waits for the device first. Returns whether it was
    /// resident.
    pub(crate) fn evict(&self) -> Result<bool> {
        let mut m = self.lock();
        if !m.resident {
            return Ok(false);
        }
        self.dev.bind()?;
        self.dev.synchronize()?;
        self.unmap_all(&mut m);
        m.resident = false;
        Ok(true)
    }

    /// Maps fresh memory over the whole range again (its bytes are undefined).
    pub(crate) fn restore(&self) -> Result<()> {
        let mut m = self.lock();
        if m.resident {
            return Ok(());
        }
        self.dev.bind()?;
        let bytes = m.bytes;
        self.map(&mut m, 0, bytes)?;
        m.resident = true;
        Ok(())
    }

    /// Whether the memory is mapped now.
    pub(crate) fn resident(&self) -> bool {
        self.lock().resident
    }
}

impl Drop for MappedRange {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        let _ = self.dev.synchronize();
        let mut m = std::mem::take(&mut *self.lock());
        self.unmap_all(&mut m);
        // SAFETY: every mapping inside the reservation is gone.
        unsafe {
            sys::cuMemAddressFree(self.base, self.reserved);
        }
    }
}

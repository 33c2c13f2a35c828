//! GPU time as the sum of kernel durations, from CUPTI activity records.
//!
//! A device-event span around a step includes the idle gaps in which the GPU waits for the
//! host; it is not GPU time. CUPTI reports each kernel's start and end on the GPU (kernels of
//! libraries and of replayed graphs included), so their sum is what the GPU spent computing.
//! Tracing adds host cost per launch: time a window of steps with it and leave those steps out of
//! the step-time statistics.
//!
//! CUPTI (`libcupti.so`) ships with the CUDA toolkit, outside the default library path; when it is
//! not on the loader path it is looked for under `$CUDA_HOME` (`extras/CUPTI/lib64`, `lib64`,
//! `targets/*/lib`). One timer at a time per process.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use cudarc::cupti::result::activity;
use cudarc::cupti::sys::{self as cs, CUpti_ActivityKind as Kind};

use super::device::cuda_home;
use crate::{Device, Error, Result};

/// Kernel, copy and memset activity measured by a [`GpuKernelTimer`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuKernelTotals {
    pub kernels: u64,
    /// Sum of kernel durations (end − start on the GPU), nanoseconds.
    pub kernel_ns: u64,
    pub memcpys: u64,
    pub memcpy_ns: u64,
    pub memsets: u64,
    pub memset_ns: u64,
    /// Records CUPTI dropped for lack of buffer space (then the sums are too low).
    pub dropped: u64,
}

static TOTALS: Mutex<GpuKernelTotals> =
    Mutex::new(GpuKernelTotals { kernels: 0, kernel_ns: 0, memcpys: 0, memcpy_ns: 0, memsets: 0, memset_ns: 0, dropped: 0 });
static RUNNING: AtomicBool = AtomicBool::new(false);

const BUFFER_BYTES: usize = 8 << 20;
const BUFFER_ALIGN: usize = 8;
/// Offsets of `start` and `end` (u64 nanoseconds) in CUPTI's kernel (v4 and later), memcpy and
/// memset records; checked against the bindings in the tests below.
const START_AT: usize = 16;
const END_AT: usize = 24;

fn layout() -> std::alloc::Layout {
    // BUFFER_BYTES and BUFFER_ALIGN are valid constants.
    std::alloc::Layout::from_size_align(BUFFER_BYTES, BUFFER_ALIGN).unwrap_or(std::alloc::Layout::new::<u64>())
}

extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: CUPTI passes valid out-pointers; the buffer is freed in `buffer_completed`.
    unsafe {
        let p = std::alloc::alloc(layout());
        *buffer = p;
        *size = if p.is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

extern "C" fn buffer_completed(_ctx: cudarc::driver::sys::CUcontext, _stream: u32, buffer: *mut u8, _size: usize, valid: usize) {
    if buffer.is_null() {
        return;
    }
    let mut sums = GpuKernelTotals::default();
    let mut record: *mut cs::CUpti_Activity = std::ptr::null_mut();
    // SAFETY: `buffer` holds `valid` bytes of records written by CUPTI; each record starts with
    // its kind, and kernel/memcpy/memset records carry start/end at the offsets above.
    unsafe {
        while activity::get_next_record(buffer, valid, &mut record).is_ok() {
            let base = record as *const u8;
            let span = || {
                let s = std::ptr::read_unaligned(base.add(START_AT) as *const u64);
                let e = std::ptr::read_unaligned(base.add(END_AT) as *const u64);
                e.saturating_sub(s)
            };
            // Read the kind as a plain integer: CUPTI may write kinds newer than our bindings.
            let kind = std::ptr::read_unaligned(base as *const u32);
            if kind == Kind::CUPTI_ACTIVITY_KIND_KERNEL as u32 || kind == Kind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL as u32 {
                sums.kernels += 1;
                sums.kernel_ns += span();
            } else if kind == Kind::CUPTI_ACTIVITY_KIND_MEMCPY as u32 {
                sums.memcpys += 1;
                sums.memcpy_ns += span();
            } else if kind == Kind::CUPTI_ACTIVITY_KIND_MEMSET as u32 {
                sums.memsets += 1;
                sums.memset_ns += span();
            }
        }
        std::alloc::dealloc(buffer, layout());
    }
    let mut t = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    t.kernels += sums.kernels;
    t.kernel_ns += sums.kernel_ns;
    t.memcpys += sums.memcpys;
    t.memcpy_ns += sums.memcpy_ns;
    t.memsets += sums.memsets;
    t.memset_ns += sums.memset_ns;
}

/// Makes `libcupti.so` loadable: already on the loader path, or preloaded from `$CUDA_HOME`.
fn cupti_available() -> std::result::Result<(), String> {
    static OK: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    OK.get_or_init(|| {
        // SAFETY: only tries to dlopen the library.
        if unsafe { cs::is_culib_present() } {
            return Ok(());
        }
        let home = std::path::PathBuf::from(cuda_home());
        let mut dirs = vec![home.join("extras/CUPTI/lib64"), home.join("lib64")];
        if let Ok(rd) = std::fs::read_dir(home.join("targets")) {
            dirs.extend(rd.flatten().map(|e| e.path().join("lib")));
        }
        for dir in &dirs {
            let Ok(rd) = std::fs::read_dir(dir) else { continue };
            let mut libs: Vec<_> = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libcupti.so")))
                .collect();
            libs.sort();
            for lib in libs.iter().rev() {
                // SAFETY: loading CUPTI runs no foreign initialiser beyond the library's own.
                // RTLD_GLOBAL keeps it resolvable by its soname for cudarc's own dlopen; the handle
                // is leaked on purpose (the library stays for the life of the process).
                let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
                if let Ok(l) = unsafe { libloading::os::unix::Library::open(Some(lib), flags) } {
                    std::mem::forget(l);
                    if unsafe { cs::is_culib_present() } {
                        return Ok(());
                    }
                }
            }
        }
        Err(format!(
            "CUPTI (libcupti.so) not found on the loader path nor under {}: add its folder (e.g. {}/extras/CUPTI/lib64) to LD_LIBRARY_PATH",
            home.display(),
            home.display()
        ))
    })
    .clone()
}

fn cupti_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("CUPTI {what}: {e:?}"))
}

const KINDS: [Kind; 3] = [Kind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, Kind::CUPTI_ACTIVITY_KIND_MEMCPY, Kind::CUPTI_ACTIVITY_KIND_MEMSET];

/// Sums the GPU time of every kernel, copy and memset that runs between [`GpuKernelTimer::start`]
/// and [`GpuKernelTimer::finish`] (both wait for the device so the window is exact).
#[derive(Debug)]
pub struct GpuKernelTimer {
    device: Device,
}

impl GpuKernelTimer {
    /// Starts tracing; an error when CUPTI is missing or another timer is running.
    pub fn start(device: Device) -> Result<GpuKernelTimer> {
        cupti_available().map_err(Error::Cuda)?;
        static CALLBACKS: OnceLock<std::result::Result<(), String>> = OnceLock::new();
        CALLBACKS
            .get_or_init(|| activity::register_callbacks(Some(buffer_requested), Some(buffer_completed)).map_err(|e| format!("{e:?}")))
            .clone()
            .map_err(|e| cupti_err("cuptiActivityRegisterCallbacks", e))?;
        if RUNNING.swap(true, Ordering::SeqCst) {
            return Err(Error::invalid("GpuKernelTimer::start", "another GPU kernel timer is running in this process"));
        }
        let started = (|| {
            super::synchronize(device)?;
            activity::flush_all(0).map_err(|e| cupti_err("flush", e))?;
            *TOTALS.lock().unwrap_or_else(|e| e.into_inner()) = GpuKernelTotals::default();
            for k in KINDS {
                activity::enable(k).map_err(|e| cupti_err("cuptiActivityEnable", e))?;
            }
            Ok(())
        })();
        if let Err(e) = started {
            RUNNING.store(false, Ordering::SeqCst);
            return Err(e);
        }
        Ok(GpuKernelTimer { device })
    }

    /// Waits for the device, stops tracing and returns the totals of the window.
    pub fn finish(self) -> Result<GpuKernelTotals> {
        let r = (|| {
            super::synchronize(self.device)?;
            activity::flush_all(cs::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32).map_err(|e| cupti_err("flush", e))?;
            Ok(())
        })();
        self.stop();
        r?;
        let mut t = *TOTALS.lock().unwrap_or_else(|e| e.into_inner());
        let mut dropped = 0usize;
        // SAFETY: a null context asks for the records dropped outside any context.
        if unsafe { activity::get_num_dropped_records(std::ptr::null_mut(), 0, &mut dropped) }.is_ok() {
            t.dropped = dropped as u64;
        }
        Ok(t)
    }

    fn stop(&self) {
        for k in KINDS {
            let _ = activity::disable(k);
        }
        RUNNING.store(false, Ordering::SeqCst);
    }
}

impl Drop for GpuKernelTimer {
    fn drop(&mut self) {
        if RUNNING.load(Ordering::SeqCst) {
            self.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_offsets_match_the_bindings() {
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityKernel9, start), START_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityKernel9, end), END_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityKernel4, start), START_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemcpy6, start), START_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemcpy6, end), END_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemset4, start), START_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemset4, end), END_AT);
    }
}

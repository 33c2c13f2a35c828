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

use super::module_cache::cuda_home;
use crate::{Device, Error, Result};

/// Kernel, copy and memset activity measured by a [`GpuKernelTimer`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuKernelTotals {
    /// Kernels run.
    pub kernels: u64,
    /// Sum of kernel durations (end − start on the GPU), nanoseconds.
    pub kernel_ns: u64,
    /// Sum of kernel durations with each kernel counted from the end of the kernels before it on
    /// its stream, nanoseconds: a dependent launch's blocks start while its
    /// predecessor ends and wait for it, and that wait is in `kernel_ns` but is no work.
    pub kernel_busy_ns: u64,
    /// Streams the kernels ran on, as CUPTI names them.
    pub kernel_streams: u64,
    /// Time during which at least one kernel ran, nanoseconds: the union of the kernels' spans
    /// over every stream. Unlike the sums it does not grow when kernels run side by side (each
    /// lasting longer while they share the GPU) or wait for their predecessor; unlike an event
    /// span it leaves out the gaps between kernels.
    pub kernel_active_ns: u64,
    /// Copies run.
    pub memcpys: u64,
    /// Nanoseconds of copies.
    pub memcpy_ns: u64,
    /// Memsets run.
    pub memsets: u64,
    /// Nanoseconds of memsets.
    pub memset_ns: u64,
    /// Records CUPTI dropped for lack of buffer space (then the sums are too low).
    pub dropped: u64,
}

static TOTALS: Mutex<GpuKernelTotals> = Mutex::new(GpuKernelTotals {
    kernels: 0,
    kernel_ns: 0,
    kernel_busy_ns: 0,
    kernel_streams: 0,
    kernel_active_ns: 0,
    memcpys: 0,
    memcpy_ns: 0,
    memsets: 0,
    memset_ns: 0,
    dropped: 0,
});
static RUNNING: AtomicBool = AtomicBool::new(false);
/// A detailed window runs: kernels are kept by name and stage tag ([`GpuKernelTimer::start_detailed`]).
static DETAILED: AtomicBool = AtomicBool::new(false);

/// GPU time of one kernel name under one [`crate::internal::stage`] tag in a detailed window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelDetail {
    /// The stage tag of the host call that launched it (a graph launch for replayed kernels).
    pub stage: u8,
    /// The kernel's (demangled) name.
    pub name: String,
    /// Launches.
    pub count: u64,
    /// Summed kernel durations, nanoseconds.
    pub ns: u64,
}

/// Raw records of a detailed window: kernels by CUPTI correlation id, and the stage each
/// correlation id was launched under (external-correlation records, which may come in any order).
#[derive(Default)]
struct Detail {
    kernels: Vec<(u32, u32, u64)>,
    names: std::collections::HashMap<usize, u32>,
    name_list: Vec<String>,
    /// The external id each correlation id was launched under: the stage tag in the low byte,
    /// the [`crate::stage::LabelGuard`] label above it.
    stage_of: std::collections::HashMap<u32, u64>,
    /// With [`TRACE_ENV`] set: every kernel, copy and memset as it ran.
    trace: Option<Vec<TraceEvent>>,
}

/// One kernel, copy or memset of a traced window (see [`TRACE_ENV`]).
#[derive(Clone, Copy)]
struct TraceEvent {
    start: u64,
    end: u64,
    stream: u32,
    corr: u32,
    /// A kernel's index in `Detail::name_list`; `MEMCPY` / `MEMSET` otherwise.
    what: u32,
}

const MEMCPY: u32 = u32::MAX;
const MEMSET: u32 = u32::MAX - 1;

/// The environment variable that names a file for the kernel trace of the detailed window: one
/// line per kernel, copy and memset in start order (start µs from the first, duration µs, stream,
/// stage tag, the backward node it ran for, name). A diagnostic for finding which op launches
/// which kernel; nothing is written without it.
pub const TRACE_ENV: &str = "PTL_KERNEL_TRACE";

/// Names of the labels pushed while a detailed window runs, by label id (id 0: none).
static LABELS: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    /// The label id this thread's launches carry (0: none).
    static LABEL: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Sets this thread's label to `name` while a detailed window runs; returns the previous label id
/// for [`restore_label`]. A relaxed load otherwise.
pub(crate) fn set_label(name: &str) -> u32 {
    let prev = LABEL.with(|l| l.get());
    if !DETAILED.load(Ordering::Relaxed) {
        return prev;
    }
    let id = {
        let mut labels = LABELS.lock().unwrap_or_else(|e| e.into_inner());
        match labels.iter().position(|l| l == name) {
            Some(i) => i as u32 + 1,
            None => {
                labels.push(name.to_string());
                labels.len() as u32
            }
        }
    };
    LABEL.with(|l| l.set(id));
    push_stage(crate::stage::current());
    prev
}

/// Puts back the label [`set_label`] returned.
pub(crate) fn restore_label(prev: u32) {
    if LABEL.with(|l| l.replace(prev)) != prev && DETAILED.load(Ordering::Relaxed) {
        push_stage(crate::stage::current());
    }
}

static DETAIL: Mutex<Option<Detail>> = Mutex::new(None);

/// Every kernel of the running window as (stream, start, end), for `kernel_busy_ns`.
static SPANS: Mutex<Vec<(u32, u64, u64)>> = Mutex::new(Vec::new());

/// Kernel time with each kernel counted from `max(its start, the latest end of the kernels that
/// started before it on its stream)` to its end: the summed durations without the time a kernel
/// spends waiting for its predecessor (programmatic dependent launch starts a kernel's blocks
/// while the previous one still runs). Kernels on different streams still add up, as in a plain
/// sum. Returns (nanoseconds, streams seen); sorts `spans`.
pub fn kernel_busy_ns(spans: &mut [(u32, u64, u64)]) -> (u64, u64) {
    spans.sort_unstable();
    let (mut busy, mut streams) = (0u64, 0u64);
    let mut current: Option<(u32, u64)> = None;
    for &(stream, start, end) in spans.iter() {
        let covered = match current {
            Some((s, covered)) if s == stream => covered,
            _ => {
                streams += 1;
                0
            }
        };
        busy += end.saturating_sub(start.max(covered));
        current = Some((stream, covered.max(end)));
    }
    (busy, streams)
}

/// The union of the kernels' spans over every stream (stream ids ignored), nanoseconds: the time
/// during which at least one kernel ran. Sorts `spans` by start.
pub fn kernel_active_ns(spans: &mut [(u32, u64, u64)]) -> u64 {
    spans.sort_unstable_by_key(|&(_, start, end)| (start, end));
    let (mut active, mut covered) = (0u64, 0u64);
    for &(_, start, end) in spans.iter() {
        active += end.saturating_sub(start.max(covered));
        covered = covered.max(end);
    }
    active
}

thread_local! {
    /// Whether this thread has an external correlation id pushed (detailed windows only).
    static PUSHED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

const EXTERNAL: cs::CUpti_ExternalCorrelationKind = cs::CUpti_ExternalCorrelationKind::CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;

/// Labels this thread's next CUDA calls with `tag` while a detailed window runs (called by
/// [`crate::stage`] on every change; a relaxed load otherwise).
pub(crate) fn stage_changed(tag: u8) {
    if !DETAILED.load(Ordering::Relaxed) {
        return;
    }
    push_stage(tag);
}

fn push_stage(tag: u8) {
    // SAFETY: plain CUPTI calls on this thread's external-correlation stack (one entry kept).
    unsafe {
        if PUSHED.with(|p| p.get()) {
            let mut last = 0u64;
            let _ = cs::cuptiActivityPopExternalCorrelationId(EXTERNAL, &mut last);
        }
        let id = tag as u64 | (LABEL.with(|l| l.get()) as u64) << 8;
        let ok = cs::cuptiActivityPushExternalCorrelationId(EXTERNAL, id).result().is_ok();
        PUSHED.with(|p| p.set(ok));
    }
}

fn pop_stage() {
    if PUSHED.with(|p| p.replace(false)) {
        let mut last = 0u64;
        // SAFETY: pops the entry this thread pushed.
        let _ = unsafe { cs::cuptiActivityPopExternalCorrelationId(EXTERNAL, &mut last) };
    }
}

const BUFFER_BYTES: usize = 8 << 20;
const BUFFER_ALIGN: usize = 8;
/// Offsets of `start` and `end` (u64 nanoseconds) in CUPTI's kernel (v4 and later), memcpy and
/// memset records; checked against the bindings in the tests below.
const START_AT: usize = 16;
const END_AT: usize = 24;
/// Offset of `streamId` (u32) in kernel records (v4 and later).
const KERNEL_STREAM_AT: usize = 48;
/// Offsets of `correlationId` (u32) and `name` (C string) in kernel records (v4 and later, the
/// same prefix), and of `externalId` (u64) / `correlationId` in external-correlation records.
const KERNEL_CORRELATION_AT: usize = 92;
const KERNEL_NAME_AT: usize = 104;
const EXTERNAL_ID_AT: usize = 8;
const EXTERNAL_CORRELATION_AT: usize = 16;
/// Offsets of `streamId` and `correlationId` (u32) in memcpy and memset records.
const COPY_STREAM_AT: usize = 40;
const COPY_CORRELATION_AT: usize = 44;

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
    let mut detail = DETAIL.lock().unwrap_or_else(|e| e.into_inner());
    let mut spans = SPANS.lock().unwrap_or_else(|e| e.into_inner());
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
                spans.push((
                    std::ptr::read_unaligned(base.add(KERNEL_STREAM_AT) as *const u32),
                    std::ptr::read_unaligned(base.add(START_AT) as *const u64),
                    std::ptr::read_unaligned(base.add(END_AT) as *const u64),
                ));
                if let Some(d) = detail.as_mut() {
                    let corr = std::ptr::read_unaligned(base.add(KERNEL_CORRELATION_AT) as *const u32);
                    let name = std::ptr::read_unaligned(base.add(KERNEL_NAME_AT) as *const *const std::ffi::c_char);
                    let next = d.name_list.len() as u32;
                    let id = *d.names.entry(name as usize).or_insert(next);
                    if id == next {
                        let text = if name.is_null() { "?".into() } else { std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned() };
                        d.name_list.push(text);
                    }
                    d.kernels.push((corr, id, span()));
                    if let Some(t) = d.trace.as_mut() {
                        let (start, end) = (
                            std::ptr::read_unaligned(base.add(START_AT) as *const u64),
                            std::ptr::read_unaligned(base.add(END_AT) as *const u64),
                        );
                        let stream = std::ptr::read_unaligned(base.add(KERNEL_STREAM_AT) as *const u32);
                        t.push(TraceEvent { start, end, stream, corr, what: id });
                    }
                }
            } else if kind == Kind::CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION as u32 {
                if let Some(d) = detail.as_mut() {
                    let ext = std::ptr::read_unaligned(base.add(EXTERNAL_ID_AT) as *const u64);
                    let corr = std::ptr::read_unaligned(base.add(EXTERNAL_CORRELATION_AT) as *const u32);
                    d.stage_of.insert(corr, ext);
                }
            } else if kind == Kind::CUPTI_ACTIVITY_KIND_MEMCPY as u32 || kind == Kind::CUPTI_ACTIVITY_KIND_MEMSET as u32 {
                let memcpy = kind == Kind::CUPTI_ACTIVITY_KIND_MEMCPY as u32;
                if memcpy {
                    sums.memcpys += 1;
                    sums.memcpy_ns += span();
                } else {
                    sums.memsets += 1;
                    sums.memset_ns += span();
                }
                if let Some(t) = detail.as_mut().and_then(|d| d.trace.as_mut()) {
                    t.push(TraceEvent {
                        start: std::ptr::read_unaligned(base.add(START_AT) as *const u64),
                        end: std::ptr::read_unaligned(base.add(END_AT) as *const u64),
                        stream: std::ptr::read_unaligned(base.add(COPY_STREAM_AT) as *const u32),
                        corr: std::ptr::read_unaligned(base.add(COPY_CORRELATION_AT) as *const u32),
                        what: if memcpy { MEMCPY } else { MEMSET },
                    });
                }
            }
        }
        std::alloc::dealloc(buffer, layout());
    }
    drop(detail);
    drop(spans);
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

/// What a detailed window adds: the driver and runtime API records (which carry the launches'
/// correlation ids) and the external-correlation records that tie them to a stage tag.
const DETAIL_KINDS: [Kind; 3] =
    [Kind::CUPTI_ACTIVITY_KIND_DRIVER, Kind::CUPTI_ACTIVITY_KIND_RUNTIME, Kind::CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION];

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
            super::alloc::synchronize(device)?;
            activity::flush_all(0).map_err(|e| cupti_err("flush", e))?;
            *TOTALS.lock().unwrap_or_else(|e| e.into_inner()) = GpuKernelTotals::default();
            SPANS.lock().unwrap_or_else(|e| e.into_inner()).clear();
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

    /// [`GpuKernelTimer::start`], also keeping every kernel's name and the [`crate::internal::stage`] tag it
    /// was launched under (CUPTI external correlation; more host cost per launch than `start`).
    /// Tags are followed on the calling thread, the one that launches the work.
    pub fn start_detailed(device: Device) -> Result<GpuKernelTimer> {
        let t = GpuKernelTimer::start(device)?;
        let trace = std::env::var_os(TRACE_ENV).is_some().then(Vec::new);
        *DETAIL.lock().unwrap_or_else(|e| e.into_inner()) = Some(Detail { trace, ..Detail::default() });
        // External-correlation records come with the API records of the calls they label.
        for k in DETAIL_KINDS {
            activity::enable(k).map_err(|e| cupti_err("cuptiActivityEnable", e))?;
        }
        DETAILED.store(true, Ordering::SeqCst);
        push_stage(crate::stage::current());
        Ok(t)
    }

    /// Ends a detailed window: the totals and the GPU time per (stage tag, kernel name), largest
    /// first. Kernels whose launch had no tag record come under tag 0.
    pub fn finish_detailed(self) -> Result<(GpuKernelTotals, Vec<KernelDetail>)> {
        let totals = self.finish()?;
        let d = DETAIL.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
        if let (Some(path), Some(events)) = (std::env::var_os(TRACE_ENV), d.trace.as_ref()) {
            write_trace(std::path::Path::new(&path), events, &d)?;
        }
        let mut by: std::collections::HashMap<(u8, u32), (u64, u64)> = std::collections::HashMap::new();
        for (corr, name, ns) in &d.kernels {
            let e = by.entry((d.stage_of.get(corr).copied().unwrap_or(0) as u8, *name)).or_default();
            e.0 += 1;
            e.1 += ns;
        }
        let mut out: Vec<KernelDetail> = by
            .into_iter()
            .map(|((stage, name), (count, ns))| KernelDetail { stage, name: d.name_list[name as usize].clone(), count, ns })
            .collect();
        out.sort_by(|a, b| b.ns.cmp(&a.ns).then(a.stage.cmp(&b.stage)).then(a.name.cmp(&b.name)));
        Ok((totals, out))
    }

    /// Waits for the device, stops tracing and returns the totals of the window.
    pub fn finish(self) -> Result<GpuKernelTotals> {
        let r: Result<()> = (|| {
            super::alloc::synchronize(self.device)?;
            activity::flush_all(cs::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32).map_err(|e| cupti_err("flush", e))?;
            Ok(())
        })();
        self.stop();
        r?;
        let mut t = *TOTALS.lock().unwrap_or_else(|e| e.into_inner());
        let mut spans = std::mem::take(&mut *SPANS.lock().unwrap_or_else(|e| e.into_inner()));
        (t.kernel_busy_ns, t.kernel_streams) = kernel_busy_ns(&mut spans);
        t.kernel_active_ns = kernel_active_ns(&mut spans);
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
        if DETAILED.swap(false, Ordering::SeqCst) {
            pop_stage();
            for k in DETAIL_KINDS {
                let _ = activity::disable(k);
            }
        }
        RUNNING.store(false, Ordering::SeqCst);
    }
}

/// Writes a traced window (see [`TRACE_ENV`]) to `path`, in start order.
fn write_trace(path: &std::path::Path, events: &[TraceEvent], d: &Detail) -> Result<()> {
    use std::fmt::Write as _;
    let mut ev = events.to_vec();
    ev.sort_by_key(|e| (e.start, e.end));
    let t0 = ev.first().map_or(0, |e| e.start);
    let labels = LABELS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut out = String::from("start_us\tdur_us\tstream\tstage\tnode\tname\n");
    for e in &ev {
        let ext = d.stage_of.get(&e.corr).copied().unwrap_or(0);
        let label = match (ext >> 8) as usize {
            0 => "-",
            i => labels.get(i - 1).map_or("?", String::as_str),
        };
        let name = match e.what {
            MEMCPY => "(memcpy)",
            MEMSET => "(memset)",
            i => d.name_list.get(i as usize).map_or("?", String::as_str),
        };
        let _ = writeln!(
            out,
            "{:.3}\t{:.3}\t{}\t{:#04x}\t{label}\t{name}",
            (e.start - t0) as f64 / 1e3,
            e.end.saturating_sub(e.start) as f64 / 1e3,
            e.stream,
            ext as u8
        );
    }
    std::fs::write(path, out)
        .map_err(|e| Error::invalid("GpuKernelTimer::finish_detailed", format!("{}: {e} ({TRACE_ENV})", path.display())))
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
        for stream in [
            std::mem::offset_of!(cs::CUpti_ActivityKernel4, streamId),
            std::mem::offset_of!(cs::CUpti_ActivityKernel9, streamId),
            std::mem::offset_of!(cs::CUpti_ActivityKernel10, streamId),
        ] {
            assert_eq!(stream, KERNEL_STREAM_AT);
        }
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemcpy6, start), START_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemcpy6, end), END_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemset4, start), START_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemset4, end), END_AT);
        for (corr, name) in [
            (std::mem::offset_of!(cs::CUpti_ActivityKernel4, correlationId), std::mem::offset_of!(cs::CUpti_ActivityKernel4, name)),
            (std::mem::offset_of!(cs::CUpti_ActivityKernel9, correlationId), std::mem::offset_of!(cs::CUpti_ActivityKernel9, name)),
            (std::mem::offset_of!(cs::CUpti_ActivityKernel10, correlationId), std::mem::offset_of!(cs::CUpti_ActivityKernel10, name)),
        ] {
            assert_eq!((corr, name), (KERNEL_CORRELATION_AT, KERNEL_NAME_AT));
        }
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemcpy6, streamId), COPY_STREAM_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemcpy6, correlationId), COPY_CORRELATION_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemset4, streamId), COPY_STREAM_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityMemset4, correlationId), COPY_CORRELATION_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityExternalCorrelation, externalId), EXTERNAL_ID_AT);
        assert_eq!(std::mem::offset_of!(cs::CUpti_ActivityExternalCorrelation, correlationId), EXTERNAL_CORRELATION_AT);
    }

    #[test]
    fn a_trace_lists_kernels_copies_and_memsets_in_start_order_with_their_labels() {
        let label = {
            let mut l = LABELS.lock().unwrap_or_else(|e| e.into_inner());
            l.push("trace test node".into());
            l.len() as u64
        };
        let mut d = Detail { name_list: vec!["k_first".into(), "k_second".into()], ..Detail::default() };
        d.stage_of.insert(11, 0x83 | label << 8);
        let ev = |start, end, corr, what| TraceEvent { start, end, stream: 7, corr, what };
        let events = [ev(5_000, 6_500, 12, 1), ev(1_000, 3_000, 11, 0), ev(4_000, 4_100, 11, MEMSET), ev(7_000, 7_200, 13, MEMCPY)];
        let path = std::env::temp_dir().join(format!("ptl-trace-test-{}.tsv", std::process::id()));
        write_trace(&path, &events, &d).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "start_us\tdur_us\tstream\tstage\tnode\tname");
        assert_eq!(lines[1], "0.000\t2.000\t7\t0x83\ttrace test node\tk_first");
        assert_eq!(lines[2], "3.000\t0.100\t7\t0x83\ttrace test node\t(memset)");
        assert_eq!(lines[3], "4.000\t1.500\t7\t0x00\t-\tk_second");
        assert_eq!(lines[4], "6.000\t0.200\t7\t0x00\t-\t(memcpy)");
        assert_eq!(lines.len(), 5);
    }

    #[test]
    fn busy_time_leaves_out_waits_for_the_predecessor_on_the_same_stream() {
        // Stream 7: a 0..10, b starts at 4 (dependent launch) and ends at 15, c after a gap.
        // Stream 9 overlaps stream 7 and counts in full.
        let mut spans = vec![(7, 4, 15), (9, 2, 12), (7, 0, 10), (7, 20, 25)];
        assert_eq!(kernel_busy_ns(&mut spans), (10 + 5 + 5 + 10, 2));
        // A kernel wholly inside its predecessor's span counts nothing; serial kernels count in full.
        let mut nested = vec![(1, 0, 10), (1, 2, 8), (1, 10, 12)];
        assert_eq!(kernel_busy_ns(&mut nested), (12, 1));
        assert_eq!(kernel_busy_ns(&mut []), (0, 0));
    }

    #[test]
    fn active_time_is_the_union_over_every_stream() {
        // Stream 7: 0..10 and 4..15 (a dependent launch), 20..25; stream 9: 2..12 beside them,
        // 30..31 alone. Covered: 0..15, 20..25, 30..31.
        let mut spans = vec![(7, 4, 15), (9, 2, 12), (7, 0, 10), (7, 20, 25), (9, 30, 31)];
        assert_eq!(kernel_active_ns(&mut spans), 15 + 5 + 1);
        let mut spans = vec![(7, 4, 15), (9, 2, 12), (7, 0, 10), (7, 20, 25), (9, 30, 31)];
        let (busy, _) = kernel_busy_ns(&mut spans);
        assert!(kernel_active_ns(&mut spans) <= busy);
        // Serial kernels on one stream: the plain sum.
        let mut serial = vec![(1, 10, 12), (1, 0, 10), (1, 12, 20)];
        assert_eq!(kernel_active_ns(&mut serial), 20);
        assert_eq!(kernel_active_ns(&mut []), 0);
    }
}

//! Device-side measurements of a fit, with CPU stand-ins: synchronisation, the backend's launch
//! counters, the CUPTI kernel-time window and start-up figures. Everything here is diagnostics;
//! none of it changes what a step computes.

use ptl_autograd::Device;

use crate::fit::{GpuWindowReport, KernelModuleTime, LaunchesPerStep, StartupReport};
use crate::Result;

/// Waits for all work queued on `device` (no-op on the CPU).
pub(crate) fn sync(device: Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        ptl_autograd::cuda::synchronize(device)?;
    }
    let _ = device;
    Ok(())
}

/// Opens the device now (context, kernels) so that its cost is measured apart from the rest.
pub(crate) fn open_device(device: Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(n) = device {
        ptl_autograd::cuda::check(n).map_err(ptl_autograd::Error::CudaUnavailable)?;
    }
    let _ = device;
    Ok(())
}

/// A snapshot of the backend's counters (`None` on the CPU).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CounterMark {
    #[cfg(feature = "cuda")]
    counts: Option<ptl_autograd::internal::cuda::CudaCounters>,
}

impl CounterMark {
    pub fn now(device: Device) -> CounterMark {
        let _ = device;
        CounterMark {
            #[cfg(feature = "cuda")]
            counts: device.is_cuda().then(ptl_autograd::internal::cuda::counters),
        }
    }

    /// Counts per step from this mark to `later` over `steps` steps.
    pub fn per_step_until(&self, later: &CounterMark, steps: usize) -> Option<LaunchesPerStep> {
        #[cfg(feature = "cuda")]
        if let (Some(a), Some(b)) = (self.counts, later.counts) {
            let d = b.since(&a);
            let n = steps.max(1) as f64;
            return Some(LaunchesPerStep {
                steps,
                kernel_launches: d.kernel_launches as f64 / n,
                library_calls: d.library_calls as f64 / n,
                graph_launches: d.graph_launches as f64 / n,
                host_to_device_copies: d.host_to_device_copies as f64 / n,
                device_to_host_copies: d.device_to_host_copies as f64 / n,
                device_to_device_copies: d.device_to_device_copies as f64 / n,
                memsets: d.memsets as f64 / n,
                host_syncs: d.host_syncs as f64 / n,
            });
        }
        let _ = (later, steps);
        None
    }
}

/// A running CUPTI window: kernel durations plus a device-event span.
pub(crate) struct GpuWindow {
    first_step: usize,
    #[cfg(feature = "cuda")]
    timer: ptl_autograd::internal::cuda::GpuKernelTimer,
    #[cfg(feature = "cuda")]
    mark: ptl_autograd::internal::cuda::StreamMark,
}

impl GpuWindow {
    /// Starts a window on `device`; `Err(reason)` when it cannot be measured there.
    pub fn start(device: Device, first_step: usize) -> std::result::Result<GpuWindow, String> {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let timer = ptl_autograd::internal::cuda::GpuKernelTimer::start_detailed(device).map_err(|e| e.to_string())?;
            let mark = ptl_autograd::internal::cuda::StreamMark::record(device).map_err(|e| e.to_string())?;
            return Ok(GpuWindow { first_step, timer, mark });
        }
        let _ = (device, first_step);
        Err("GPU time is measured on CUDA devices only".into())
    }

    /// Ends the window after `steps` steps.
    pub fn finish(self, device: Device, steps: usize) -> std::result::Result<GpuWindowReport, String> {
        #[cfg(feature = "cuda")]
        {
            let end = ptl_autograd::internal::cuda::StreamMark::record(device).map_err(|e| e.to_string())?;
            let span = self.mark.elapsed_ms_until(&end).map_err(|e| e.to_string())?;
            let (t, detail) = self.timer.finish_detailed().map_err(|e| e.to_string())?;
            let rows: Vec<(u8, String, u64, u64)> = detail.into_iter().map(|d| (d.stage, d.name, d.count, d.ns)).collect();
            let n = steps.max(1) as f64;
            Ok(GpuWindowReport {
                steps,
                first_step: self.first_step,
                kernel_ms_per_step: t.kernel_ns as f64 * 1e-6 / n,
                kernel_busy_ms_per_step: t.kernel_busy_ns as f64 * 1e-6 / n,
                kernel_streams: t.kernel_streams,
                kernel_active_ms_per_step: t.kernel_active_ns as f64 * 1e-6 / n,
                kernels_per_step: t.kernels as f64 / n,
                memcpy_ms_per_step: t.memcpy_ns as f64 * 1e-6 / n,
                memcpys_per_step: t.memcpys as f64 / n,
                memsets_per_step: t.memsets as f64 / n,
                event_span_ms_per_step: span / n,
                optimizer_steps: 0,
                dropped_records: t.dropped,
                breakdown: Some(super::stages::breakdown(&rows, steps)),
                memory: None,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, steps, self.first_step);
            Err("GPU time is measured on CUDA devices only".into())
        }
    }
}

/// Device-code modules loaded in this process and what each cost.
pub(crate) fn kernel_modules() -> Vec<KernelModuleTime> {
    #[cfg(feature = "cuda")]
    {
        use ptl_autograd::cuda::ModuleSource;
        ptl_autograd::cuda::module_reports()
            .into_iter()
            .map(|r| KernelModuleTime {
                name: r.name,
                source: match r.source {
                    ModuleSource::CacheHit => "cache-hit",
                    ModuleSource::Compiled => "compiled",
                    ModuleSource::Rebuilt => "rebuilt",
                    ModuleSource::Uncached => "uncached",
                }
                .into(),
                compile_s: r.compile_s,
                load_s: r.load_s,
            })
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    Vec::new()
}

/// Fills in the cuDNN/cuBLAS set-ups so far (counts and seconds; zero on the CPU).
pub(crate) fn library_setup(s: &mut StartupReport) {
    #[cfg(feature = "cuda")]
    {
        let l = ptl_autograd::internal::cuda::library_setup();
        s.library_setups = l.handles + l.conv_plans + l.gemm_plans;
        s.library_setup_s = l.handle_s + l.conv_plan_s + l.gemm_plan_s;
        (s.conv_plans, s.conv_plan_s, s.gemm_plans, s.gemm_plan_s) = (l.conv_plans, l.conv_plan_s, l.gemm_plans, l.gemm_plan_s);
        (s.conv_heuristics_s, s.conv_finalizes, s.conv_finalize_s) = (l.conv_heuristics_s, l.conv_finalizes, l.conv_finalize_s);
        (s.conv_runtime_compiled, s.conv_runtime_compiled_s) = (l.conv_runtime_compiled, l.conv_runtime_compiled_s);
        (s.conv_plans_loaded, s.conv_plan_load_s) = (l.conv_plans_loaded, l.conv_plan_load_s);
    }
    let _ = s;
}

/// When the program's `main` began, where the binary marked it ([`mark_program_start`]).
static PROGRAM_START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Marks now as the program's start, for the start-up report's "process start" figures; the
/// first call counts. A binary calls it first thing in `main`: the kernel's record of the
/// process start also counts whatever ran in the same process before an `exec` (`cargo run`
/// execs the binary once it has built it, so that record would include the build).
pub fn mark_program_start() {
    let _ = PROGRAM_START.get_or_init(std::time::Instant::now);
}

/// Seconds since the program started: since [`mark_program_start`] where the binary called it,
/// else since the process started by the kernel's record (Linux); `None` elsewhere.
pub(crate) fn process_age_s() -> Option<f64> {
    if let Some(start) = PROGRAM_START.get() {
        return Some(start.elapsed().as_secs_f64());
    }
    kernel_process_age_s()
}

/// Seconds since this process started, from the kernel's record (Linux); `None` elsewhere.
fn kernel_process_age_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // `rest` starts at field 3 (state); starttime is field 22, in clock ticks since boot.
    let start_ticks: f64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime").ok()?.split_whitespace().next()?.parse().ok()?;
    // USER_HZ is 100 on every Linux ABI that ptl runs on.
    Some((uptime - start_ticks / 100.0).max(0.0))
}

/// Bytes of the tensors in `ts` (each storage counted once).
pub(crate) fn tensor_bytes<'a>(ts: impl IntoIterator<Item = &'a ptl_autograd::Tensor>) -> u64 {
    let mut seen = std::collections::HashSet::new();
    ts.into_iter().filter(|t| seen.insert(t.storage_ptr())).map(|t| (t.numel() * t.dtype().size_in_bytes()) as u64).sum()
}

/// The device's memory now, with the persistent `parts` named and the rest attributed to
/// activations and temporaries (`None` on the CPU or when the device cannot say).
pub(crate) fn memory_at_backward(device: Device, parts: Vec<(String, u64)>) -> Option<crate::fit::MemoryAtBackward> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let m = ptl_autograd::cuda::memory_stats(device).ok()?;
        let workspace = ptl_autograd::cuda::library_workspace_bytes(device).unwrap_or(0);
        let pools = ptl_autograd::internal::cuda::private_pool_allocated_bytes(device).unwrap_or(0);
        let named: u64 = parts.iter().map(|p| p.1).sum::<u64>() + workspace + pools;
        return Some(crate::fit::MemoryAtBackward {
            allocated_bytes: m.allocated,
            reserved_bytes: m.reserved,
            parts,
            library_workspace_bytes: workspace,
            replay_pool_bytes: pools,
            activations_and_temporaries_bytes: m.allocated.saturating_sub(named),
            cached_free_bytes: m.reserved.saturating_sub(m.allocated),
        });
    }
    let _ = (device, parts);
    None
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_program_start_mark_counts_from_main_not_from_before_an_exec() {
        // The test process started at least 100 ms before the mark (the kernel's record has a
        // 10 ms resolution); the age then counts from the mark, and grows.
        std::thread::sleep(std::time::Duration::from_millis(100));
        super::mark_program_start();
        let marked = super::process_age_s().unwrap();
        if let Some(kernel) = super::kernel_process_age_s() {
            assert!(kernel >= marked + 0.08, "kernel record {kernel} s, mark {marked} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        assert!(super::process_age_s().unwrap() >= marked + 0.009);
    }

    #[test]
    fn process_age_is_small_and_grows() {
        if let Some(a) = super::kernel_process_age_s() {
            assert!((0.0..3600.0).contains(&a), "test process started {a} s ago");
            std::thread::sleep(std::time::Duration::from_millis(30));
            let b = super::kernel_process_age_s().unwrap();
            assert!(b >= a);
        }
    }
}

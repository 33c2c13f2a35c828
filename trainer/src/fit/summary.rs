//! Run artefacts: the summary JSON (timings, memory, metrics, hashes) and `results.csv`.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// Median, range and 10th/90th percentiles of timed steps (milliseconds). The percentiles use the
/// same index rule as the Ultralytics reference script (`sorted[int(q·(n−1))]`), so they compare directly.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTiming {
    /// Steps timed.
    pub timed_steps: usize,
    /// Median, ms.
    pub median_ms: f64,
    /// Fastest, ms.
    pub min_ms: f64,
    /// Slowest, ms.
    pub max_ms: f64,
    /// 10th percentile, ms.
    #[serde(default)]
    pub p10_ms: f64,
    /// 90th percentile, ms.
    #[serde(default)]
    pub p90_ms: f64,
    /// Mean, ms.
    #[serde(default)]
    pub mean_ms: f64,
    /// The median over non-overlapping 16-step stretches of consecutive timed steps of their mean
    /// start-to-start time (0 when there is no such stretch). When the host queues work ahead of
    /// the GPU (no host read in a step), one step's start-to-start measures the host's queueing
    /// and the GPU's pace shows only over several steps, as bursts of waiting; a stretch's mean
    /// holds both, and the median over stretches leaves out one-time work (a new recording).
    #[serde(default)]
    pub window_ms: f64,
}

impl StepTiming {
    /// Statistics of `samples` (ms); empty input gives zeros.
    pub fn from_samples(samples: &[f64]) -> Self {
        if samples.is_empty() {
            return StepTiming::default();
        }
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        let n = s.len();
        let median = if n % 2 == 1 { s[n / 2] } else { 0.5 * (s[n / 2 - 1] + s[n / 2]) };
        let q = |f: f64| s[(f * (n - 1) as f64) as usize];
        let mean_ms = s.iter().sum::<f64>() / n as f64;
        StepTiming {
            timed_steps: n,
            median_ms: median,
            min_ms: s[0],
            max_ms: s[n - 1],
            p10_ms: q(0.1),
            p90_ms: q(0.9),
            mean_ms,
            window_ms: 0.0,
        }
    }

    /// Statistics of `runs` (ms), each a stretch of consecutive steps, with [`StepTiming::window_ms`]
    /// over windows of `window` steps.
    pub fn from_runs(runs: &[Vec<f64>], window: usize) -> Self {
        let all: Vec<f64> = runs.iter().flatten().copied().collect();
        let mut means: Vec<f64> =
            runs.iter().flat_map(|r| r.chunks_exact(window.max(1)).map(|c| c.iter().sum::<f64>() / c.len() as f64)).collect();
        means.sort_by(|a, b| a.total_cmp(b));
        let n = means.len();
        let window_ms = match n {
            0 => 0.0,
            _ if n % 2 == 1 => means[n / 2],
            _ => 0.5 * (means[n / 2 - 1] + means[n / 2]),
        };
        StepTiming { window_ms, ..StepTiming::from_samples(&all) }
    }
}

/// How steps were timed, and what a step cost (start-to-start figures next to
/// the GPU's own time). All per-step figures are means over the window named.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimingReport {
    /// Steps run by this process.
    pub steps: usize,
    /// Steps at the start of the process left out of every figure (warm-up).
    pub warmup_steps: usize,
    /// Start-to-start step time (from the start of one step — waiting for its batch included —
    /// to the start of the next, within an epoch) over every post-warm-up step outside the GPU
    /// window.
    pub start_to_start: StepTiming,
    /// [`TimingReport::start_to_start`] split by whether the step ran an optimizer update (with
    /// gradient accumulation most steps do not): an update's cost shows as the gap between the two.
    #[serde(default)]
    pub start_to_start_update: StepTiming,
    /// Start-to-start times of steps without an optimizer update.
    #[serde(default)]
    pub start_to_start_no_update: StepTiming,
    /// The reference system's measure: 16 consecutive steps after the warm-up, device synchronised at both
    /// ends, total time / 16.
    pub sync_window_ms_per_step: Option<f64>,
    /// The same over 16 steps right before the GPU window (the steady state; CUDA runs with a GPU
    /// window only): the pace of a run whose host queues steps ahead of the GPU.
    #[serde(default)]
    pub steady_window_ms_per_step: Option<f64>,
    /// Mean time the training thread waited for a batch, over the timed steps.
    pub data_wait_ms_mean: f64,
    /// Loader worker threads (0: batches built on the training thread).
    pub workers: usize,
    /// Batches uploaded from pageable memory on a CUDA device (pinned ring ran dry; 0 normally).
    pub pageable_uploads: u64,
    /// What the loader can deliver: images a second from its workers' mean time to build a batch
    /// (workers × batch / seconds per batch; the calling thread when there are no workers),
    /// whatever the steps consumed — next to `consumed_images_per_s`, it tells a loader that
    /// cannot keep up from a host waiting for the GPU.
    #[serde(default)]
    pub loader_images_per_s: Option<f64>,
    /// Images a second the steps took (batch × 1000 / the median start-to-start step).
    #[serde(default)]
    pub consumed_images_per_s: Option<f64>,
    /// Host-side counts per step over the sync window (CUDA only). It follows the warm-up, so it
    /// holds one-time work: with `nbs`/`batch` = 16 the first optimizer update and, under
    /// replay, the backward graphs that update makes necessary are recorded inside it.
    pub launches: Option<LaunchesPerStep>,
    /// The same counts over the GPU window's steps near the end of the run (CUDA only): the
    /// steady state, the window's own synchronisations left out.
    #[serde(default)]
    pub launches_steady: Option<LaunchesPerStep>,
    /// Kernel time per step from CUPTI over a window near the end of the run (CUDA only).
    pub gpu: Option<GpuWindowReport>,
    /// Why there is no GPU window (no CUPTI, too few steps, CPU run).
    pub gpu_unavailable: Option<String>,
    /// Per-stage times (`profile=true` only: every stage ends with a device synchronisation).
    pub stages: Option<StageProfile>,
}

/// What the host asked of the CUDA backend per step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LaunchesPerStep {
    /// Steps counted.
    pub steps: usize,
    /// Kernel launches.
    pub kernel_launches: f64,
    /// cuBLAS/cuDNN calls.
    pub library_calls: f64,
    /// CUDA graph launches.
    pub graph_launches: f64,
    /// Host-to-device copies.
    pub host_to_device_copies: f64,
    /// Device-to-host copies.
    pub device_to_host_copies: f64,
    /// Device-to-device copies.
    pub device_to_device_copies: f64,
    /// Memsets.
    pub memsets: f64,
    /// Host synchronisations.
    pub host_syncs: f64,
}

/// GPU time of a window of steps: the sum of kernel durations (CUPTI) next to the device-event
/// span of the same steps (which also counts the GPU's idle gaps).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuWindowReport {
    /// Steps in the window.
    pub steps: usize,
    /// Global step index (in this process) of the window's first step.
    pub first_step: usize,
    /// Kernel time per step, ms: CUPTI's durations summed.
    pub kernel_ms_per_step: f64,
    /// Kernel time per step, ms, each kernel counted from the end of the kernels before it on its
    /// stream: without the time a dependently launched kernel waits for its predecessor, which
    /// `kernel_ms_per_step` counts (0 in reports written before it was measured).
    #[serde(default)]
    pub kernel_busy_ms_per_step: f64,
    /// Streams the window's kernels ran on, as CUPTI names them.
    #[serde(default)]
    pub kernel_streams: u64,
    /// Time per step, ms, during which at least one kernel ran (the union of the kernels' spans
    /// over every stream): the GPU's working time, which neither sum measures once kernels run
    /// side by side (0 in reports written before it was measured).
    #[serde(default)]
    pub kernel_active_ms_per_step: f64,
    /// Kernels per step.
    pub kernels_per_step: f64,
    /// Copy time per step, ms.
    pub memcpy_ms_per_step: f64,
    /// Copies per step.
    pub memcpys_per_step: f64,
    /// Memsets per step.
    pub memsets_per_step: f64,
    /// Span between the window's first and last device events per step, ms.
    pub event_span_ms_per_step: f64,
    /// Optimizer updates among the window's steps (an update's own kernel time is the optimizer
    /// and EMA stages' time × steps / this).
    #[serde(default)]
    pub optimizer_steps: usize,
    /// Activity records CUPTI dropped (the sums are low when this is not 0).
    pub dropped_records: u64,
    /// Where the kernel time went: by step stage, by op class, and the largest kernels.
    #[serde(default)]
    pub breakdown: Option<KernelBreakdown>,
    /// Where the memory is when backward starts (the step's peak), first step of the window.
    #[serde(default)]
    pub memory: Option<MemoryAtBackward>,
}

/// Device memory right before the first traced step's backward — when the forward's saved
/// activations are all alive, next to the persistent state — split by owner.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryAtBackward {
    /// Bytes allocated.
    pub allocated_bytes: u64,
    /// Bytes reserved by the pools.
    pub reserved_bytes: u64,
    /// Model parameters and buffers, gradients present, optimizer state, EMA copy.
    pub parts: Vec<(String, u64)>,
    /// cuBLAS workspace and cached cuDNN plans' workspaces.
    pub library_workspace_bytes: u64,
    /// Recorded regions' private pools (replay), included in `allocated_bytes`.
    pub replay_pool_bytes: u64,
    /// What remains of `allocated_bytes`: the forward's saved activations, the loss's tensors and
    /// live temporaries.
    pub activations_and_temporaries_bytes: u64,
    /// Reserved but not allocated: freed blocks the allocators keep for reuse.
    pub cached_free_bytes: u64,
}

/// Kernel time of one label (a stage, an op class) per step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelShare {
    /// The stage or op class.
    pub label: String,
    /// Kernel time per step, ms.
    pub ms_per_step: f64,
    /// Kernels per step.
    pub kernels_per_step: f64,
}

/// One kernel name under one stage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelRow {
    /// The stage it ran in.
    pub stage: String,
    /// `cuDNN`, `cuBLAS`, or one of ptl's kernel families (the name without its dtype suffix).
    pub class: String,
    /// The kernel's name.
    pub name: String,
    /// Time per step, ms.
    pub ms_per_step: f64,
    /// Launches per step.
    pub kernels_per_step: f64,
}

/// The summed kernel time of a traced window split by the step stage each kernel was launched
/// under (model forward, model backward, loss, loss backward, optimizer, EMA, …; a replayed
/// graph's kernels go to the stage that launched it) and by op class, largest first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelBreakdown {
    /// Kernel time by stage.
    pub by_stage: Vec<KernelShare>,
    /// Kernel time by op class.
    pub by_class: Vec<KernelShare>,
    /// (stage, class) pairs, largest first.
    pub by_stage_class: Vec<KernelRow>,
    /// The 40 largest (stage, kernel name) rows.
    pub top: Vec<KernelRow>,
}

/// Median milliseconds per stage (`profile=true`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageProfile {
    /// Steps profiled.
    pub steps: usize,
    /// Waiting for the batch, ms.
    pub data_ms: f64,
    /// Upload, ms.
    pub upload_ms: f64,
    /// Forward, ms.
    pub forward_ms: f64,
    /// Loss, ms.
    pub loss_ms: f64,
    /// Backward, ms.
    pub backward_ms: f64,
    /// Unscale, clip, step, scaler update and zero-grad (optimizer steps only).
    pub optimizer_ms: f64,
    /// EMA update (optimizer steps only).
    pub ema_ms: f64,
}

/// Where the time before the training loop (and in its first step) went.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StartupReport {
    /// From the program's start (`main`, as the binary marked it with
    /// [`crate::pose::mark_program_start`], else the kernel's record of the process start) to the
    /// start of `fit`; `None` where unknown.
    pub process_to_fit_s: Option<f64>,
    /// Scanning, decoding and resizing the train and val images.
    pub dataset_open_s: f64,
    /// Opening the device: context, stream, kernels (compiled or from the cache) and their load.
    pub device_open_s: f64,
    /// Device code modules loaded so far: how each was obtained and what it cost.
    pub kernel_modules: Vec<KernelModuleTime>,
    /// Building the model, the EMA copy, the optimizer and the loss.
    pub model_build_s: f64,
    /// cuDNN/cuBLAS handles and execution plans built so far, and their total wall time.
    pub library_setups: u64,
    /// Seconds creating library handles.
    pub library_setup_s: f64,
    /// The same by kind: cuDNN convolution plans, cuBLASLt matmul plans (one per new shape).
    #[serde(default)]
    pub conv_plans: u64,
    /// Seconds building convolution plans.
    #[serde(default)]
    pub conv_plan_s: f64,
    /// GEMM plans built.
    #[serde(default)]
    pub gemm_plans: u64,
    /// Seconds building them.
    #[serde(default)]
    pub gemm_plan_s: f64,
    /// Inside the conv plans (graph API): cuDNN's engine ranking, and the execution-plan
    /// finalizes (one per engine tried; a remembered choice tries one).
    #[serde(default)]
    pub conv_heuristics_s: f64,
    /// cuDNN plans finalised.
    #[serde(default)]
    pub conv_finalizes: u64,
    /// Seconds finalising them.
    #[serde(default)]
    pub conv_finalize_s: f64,
    /// Of those, the finalizes of engines that compile their kernel at run time (NVRTC).
    #[serde(default)]
    pub conv_runtime_compiled: u64,
    /// Seconds of cuDNN's runtime compilation.
    #[serde(default)]
    pub conv_runtime_compiled_s: f64,
    /// Conv plans restored from an earlier process's serialized plan (no kernel compile).
    #[serde(default)]
    pub conv_plans_loaded: u64,
    /// Seconds loading remembered plans.
    #[serde(default)]
    pub conv_plan_load_s: f64,
    /// The first training step (first-use plans and allocations).
    pub first_step_s: f64,
    /// From process start to the start of the first step.
    pub process_to_first_step_s: Option<f64>,
    /// From `fit` start to the start of the first step.
    pub fit_to_first_step_s: f64,
    /// Wall time of each epoch of this process (training, validation, checkpoint).
    pub epoch_s: Vec<f64>,
}

/// One device-code module's start-up cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelModuleTime {
    /// The kernel unit.
    pub name: String,
    /// `cache-hit`, `compiled`, `rebuilt` or `uncached`.
    pub source: String,
    /// Seconds compiling it.
    pub compile_s: f64,
    /// Seconds loading it.
    pub load_s: f64,
}

/// SHA-256 hashes of the run's end state (hex).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunHashes {
    /// Hash of the final weights and buffers.
    pub model: String,
    /// Hash of the optimizer state.
    pub optimizer: String,
    /// Hash of the scheduler state.
    pub scheduler: String,
    /// Hash of the EMA.
    pub ema: String,
    /// Hash of every step's loss items.
    pub step_losses: String,
}

/// Device memory as an epoch ends: the process's peaks so far and what its replay plugins had
/// recorded by then.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochMemory {
    /// The epoch (0-based).
    pub epoch: usize,
    /// Peak bytes allocated since the run started.
    pub peak_allocated_bytes: u64,
    /// Peak bytes reserved since the run started.
    pub peak_reserved_bytes: u64,
    /// Bytes reserved at the epoch's end (what the epoch row prints as `GPU_mem`).
    pub reserved_bytes: u64,
    /// Graphs the replay plugins had recorded by the epoch's end (forward and backward captures
    /// of every region): a number that stays put means no recording was made in later epochs.
    pub recordings: u64,
}

impl EpochMemory {
    /// The recordings counted in replay counters as `RunSummary::replay_counters` holds them
    /// (plugin → region → counters): every region's `captures` and `backward_captures`.
    pub fn recordings_in(counters: &serde_json::Map<String, serde_json::Value>) -> u64 {
        counters
            .values()
            .filter_map(|regions| regions.as_object())
            .flat_map(|regions| regions.values())
            .map(|st| ["captures", "backward_captures"].iter().map(|k| st[*k].as_u64().unwrap_or(0)).sum::<u64>())
            .sum()
    }
}

/// The run summary written next to the checkpoints.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// The device trained on.
    pub device: String,
    /// The precision.
    pub precision: String,
    /// Epochs run.
    pub epochs: usize,
    /// Batch size.
    pub batch: usize,
    /// Image size.
    pub imgsz: usize,
    /// The optimizer used.
    pub optimizer: String,
    /// Seconds from start to end.
    pub total_runtime_s: f64,
    /// Start-to-start step time (the same as `timing.start_to_start`).
    pub step_time: StepTiming,
    /// Step timing.
    #[serde(default)]
    pub timing: TimingReport,
    /// What the start cost.
    #[serde(default)]
    pub startup: StartupReport,
    /// Peak bytes allocated (GPU).
    pub peak_allocated_bytes: Option<u64>,
    /// Peak bytes reserved (GPU).
    pub peak_reserved_bytes: Option<u64>,
    /// What the work that set the allocated peak was part of (a stage, and whether a graph was
    /// being recorded or a recorder's warm-up measured); `None` on the CPU.
    #[serde(default)]
    pub peak_allocated_during: Option<String>,
    /// Part of the allocated memory held by the math libraries' workspaces (cuBLAS and cached
    /// cuDNN plans) at the end of the run; `None` on the CPU.
    #[serde(default)]
    pub library_workspace_bytes: Option<u64>,
    /// Optimizer steps taken.
    pub optimizer_steps: u64,
    /// Where the run's artefacts went (a numbered sibling of the asked-for folder when that one
    /// already held a run).
    #[serde(default)]
    pub save_dir: std::path::PathBuf,
    /// Seconds of fitting over every process of the run (resumes included).
    #[serde(default)]
    pub fit_time_s: f64,
    /// The last validation's metrics.
    pub final_metrics: Vec<(String, f64)>,
    /// Every epoch's metrics.
    pub metrics_per_epoch: Vec<Vec<(String, f64)>>,
    /// Hashes of the final state.
    pub hashes: RunHashes,
    /// Device memory at the end of each epoch this process ran (validation included); empty on
    /// the CPU. A peak that stays at the first epoch's value means nothing grew after it.
    #[serde(default)]
    pub memory_per_epoch: Vec<EpochMemory>,
    /// One line per replay plugin (its counters).
    pub plugins: Vec<String>,
    /// Per-region counters of each replay plugin (plugin → region → counters).
    #[serde(default)]
    pub replay_counters: serde_json::Map<String, serde_json::Value>,
    /// How often each replay plugin's regions are called (per batch or per optimizer step).
    #[serde(default)]
    pub replay_cadence: std::collections::BTreeMap<String, crate::fit::plugin::ReplayCadence>,
    /// Loss calls of this process that ran the host path although the fixed-shape one was asked
    /// for (a batch beyond the largest target bucket); the bench's guard fails a run above 1 % of
    /// its steps.
    #[serde(default)]
    pub dense_loss_fallbacks: u64,
    /// With a replay plugin recording the dense step: the target slots per image of the step
    /// recorded ahead of use (the largest bucket the training data can give, prepared just
    /// before the first recording), so that every later bucket fits the arenas laid out for it;
    /// `None` when nothing was prepared (the first recorded bucket was already the largest).
    #[serde(default)]
    pub planned_target_slots: Option<usize>,
}

impl RunSummary {
    /// Writes the summary as JSON to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let s = serde_json::to_string_pretty(self).map_err(|e| TrainerError::InvalidArgument { what: "summary", reason: e.to_string() })?;
        // Temporary file + rename: a kill mid-write never leaves a truncated summary.
        Ok(ptl_files::write_atomic(path, s.as_bytes(), 0o644)?)
    }
}

/// `results.csv`: a header and one row per completed epoch, rewritten whole (temporary file +
/// rename) from the rows a checkpoint holds, so the file always matches the last checkpoint.
pub struct ResultsCsv {
    path: std::path::PathBuf,
}

impl ResultsCsv {
    /// The results.csv at `path`.
    pub fn new(path: &Path) -> Self {
        ResultsCsv { path: path.to_path_buf() }
    }

    /// One row as written to the file: every value as `%.6g`, as Ultralytics writes it (the
    /// epoch as an integer, 0.000315 as `0.000315`, zero as `0`).
    pub fn format_row(values: &[f64]) -> String {
        values.iter().map(|v| super::numbers::fmt_g(*v, 6)).collect::<Vec<_>>().join(",")
    }

    /// Writes `columns` and `rows` as the whole file.
    pub fn write(&self, columns: &[String], rows: &[String]) -> Result<()> {
        Ok(ptl_files::write_atomic_with(&self.path, 0o644, |f| {
            writeln!(f, "{}", columns.join(","))?;
            for r in rows {
                writeln!(f, "{r}")?;
            }
            Ok(())
        })?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recordings are every region's forward and backward captures, over every plugin.
    #[test]
    fn recordings_add_up_every_regions_captures() {
        let counters = serde_json::json!({
            "step": { "step.0": { "captures": 1, "backward_captures": 1, "replays": 120 },
                      "step.1": { "captures": 1, "backward_captures": 2 } },
            "optimizer": { "update": { "captures": 1, "backward_captures": 0 } },
            "feature": {}
        });
        assert_eq!(EpochMemory::recordings_in(counters.as_object().unwrap()), 6);
    }
}

//! Step timing as the benchmark protocol defines it.
//!
//! - **Start-to-start**: a step starts when the training thread asks for its batch, so waiting
//!   for data counts; a step's time runs to the start of the next step of the same epoch (the
//!   last step of an epoch has none: validation follows). The first `warmup` steps of the process
//!   are left out.
//! - **Sync window**: the 16 steps after the warm-up, with the device synchronised at both ends
//!   (total / 16) — the reference system's figure; the backend's launch counters are read over the same steps
//!   (`launches`), and again over the GPU window (`launches_steady`): the sync window can hold
//!   one-time work (the first optimizer update, the recordings it brings under replay).
//! - **Steady window**: 16 steps right before the GPU window, synchronised at both ends — with
//!   no host read in a step the host queues ahead of the GPU, and only a window closed by
//!   synchronisations measures the steady pace (`steady_window_ms_per_step`).
//! - **GPU window**: 16 steps near the end of the run traced with CUPTI (sum of kernel durations)
//!   next to their device-event span. Tracing costs host time per launch, so these steps and the
//!   step before them are left out of the start-to-start statistics.

use std::time::{Duration, Instant};

use ptl_autograd::Device;

use super::probe::{sync, CounterMark, GpuWindow};
use crate::fit::{GpuWindowReport, LaunchesPerStep, MemoryAtBackward, StepTiming, TimingReport};
use crate::Result;

/// Steps in the sync and GPU windows.
pub(crate) const WINDOW: usize = 16;

struct Previous {
    epoch: usize,
    /// The step's index in this process.
    step: usize,
    start: Instant,
    timed: bool,
    /// Whether the step ran an optimizer update ([`StepClock::note_update`]).
    updated: bool,
}

enum SyncWindow {
    Pending,
    Running { first: usize, t0: Instant, counters: CounterMark },
    Done,
}

/// A second synchronised 16-step window late in the run (right before the GPU window, clear of
/// the warm-up, the first optimizer updates and the recordings they bring): with no host read in
/// a step the host queues steps ahead of the GPU, so only a window closed by synchronisations
/// measures the pace of the steady state.
enum SteadyWindow {
    /// Starts at (epoch, batch index).
    Planned(usize, usize),
    Running {
        first: usize,
        t0: Instant,
    },
    Done,
    None,
}

enum Gpu {
    /// Starts at (epoch, batch index).
    Planned(usize, usize),
    /// The window, its first step, and the backend's counters at its start.
    Running(GpuWindow, usize, CounterMark),
    Done(GpuWindowReport),
    Unavailable(String),
}

pub(crate) struct StepClock {
    device: Device,
    warmup: usize,
    steps: usize,
    prev: Option<Previous>,
    current_timed: bool,
    step_began: Option<Instant>,
    samples: Vec<f64>,
    /// Per sample: its step's index in this process (stretches of consecutive steps make the
    /// 16-step windows of `StepTiming::window_ms`).
    sample_steps: Vec<usize>,
    /// Per sample: whether its step ran an optimizer update.
    sample_updated: Vec<bool>,
    waits: Vec<f64>,
    sync_window: SyncWindow,
    sync_ms: Option<f64>,
    steady: SteadyWindow,
    steady_ms: Option<f64>,
    launches: Option<LaunchesPerStep>,
    /// The counters over the GPU window (steady state).
    launches_steady: Option<LaunchesPerStep>,
    gpu: Gpu,
    first_step_s: Option<f64>,
    first_step_began: Option<Instant>,
    /// Memory at the first traced step's backward.
    memory: Option<MemoryAtBackward>,
    /// Optimizer updates in the GPU window's steps.
    gpu_updates: usize,
}

impl StepClock {
    /// `gpu_plan`: where the GPU window starts (epoch, batch index), or why there is none.
    pub fn new(device: Device, warmup: usize, gpu_plan: std::result::Result<(usize, usize), String>) -> StepClock {
        StepClock {
            device,
            warmup,
            steps: 0,
            prev: None,
            current_timed: false,
            step_began: None,
            samples: Vec::new(),
            sample_steps: Vec::new(),
            sample_updated: Vec::new(),
            waits: Vec::new(),
            sync_window: SyncWindow::Pending,
            sync_ms: None,
            steady: match &gpu_plan {
                Ok((e, b)) if *b > WINDOW => SteadyWindow::Planned(*e, b - 1 - WINDOW),
                _ => SteadyWindow::None,
            },
            steady_ms: None,
            launches: None,
            launches_steady: None,
            gpu: match gpu_plan {
                Ok((e, b)) => Gpu::Planned(e, b),
                Err(why) => Gpu::Unavailable(why),
            },
            first_step_s: None,
            first_step_began: None,
            memory: None,
            gpu_updates: 0,
        }
    }

    /// Where the GPU window of a run goes: the last 16 steps but one of the process's last epoch,
    /// clear of the warm-up and the sync window.
    pub fn plan_gpu_window(
        enabled: bool,
        device: Device,
        warmup: usize,
        start_epoch: usize,
        last_epoch: usize,
        nb: usize,
    ) -> std::result::Result<(usize, usize), String> {
        if !enabled {
            return Err("gpu_time=false".into());
        }
        if !device.is_cuda() {
            return Err("GPU time is measured on CUDA devices only".into());
        }
        let first = nb.checked_sub(WINDOW + 1).filter(|&b| b >= 1).ok_or_else(|| format!("epochs of {nb} steps are too short"))?;
        let steps_before = (last_epoch - start_epoch) * nb + first;
        if steps_before < warmup + WINDOW + 1 {
            return Err(format!("{steps_before} steps before the window: the warm-up and sync window need {}", warmup + WINDOW + 1));
        }
        Ok((last_epoch, first))
    }

    /// Called when a step starts, before its batch is fetched.
    pub fn begin_step(&mut self, epoch: usize, batch: usize, nb: usize) -> Result<()> {
        let now = Instant::now();
        if let Some(p) = self.prev.take() {
            if p.epoch == epoch && p.timed {
                self.samples.push(now.duration_since(p.start).as_secs_f64() * 1e3);
                self.sample_steps.push(p.step);
                self.sample_updated.push(p.updated);
            }
        }
        let step = self.steps;
        match &self.sync_window {
            SyncWindow::Pending if step >= self.warmup && batch + WINDOW <= nb => {
                sync(self.device)?;
                self.sync_window = SyncWindow::Running { first: step, t0: Instant::now(), counters: CounterMark::now(self.device) };
            }
            SyncWindow::Running { first, t0, counters } if step == first + WINDOW => {
                sync(self.device)?;
                self.sync_ms = Some(t0.elapsed().as_secs_f64() * 1e3 / WINDOW as f64);
                self.launches = counters.per_step_until(&CounterMark::now(self.device), WINDOW);
                self.sync_window = SyncWindow::Done;
            }
            _ => {}
        }
        match self.steady {
            // Not inside the first sync window (it would close this one's synchronisation).
            SteadyWindow::Planned(e, b) if (e, b) == (epoch, batch) && !matches!(self.sync_window, SyncWindow::Running { .. }) => {
                sync(self.device)?;
                self.steady = SteadyWindow::Running { first: step, t0: Instant::now() };
            }
            SteadyWindow::Running { first, t0 } if step == first + WINDOW => {
                sync(self.device)?;
                self.steady_ms = Some(t0.elapsed().as_secs_f64() * 1e3 / WINDOW as f64);
                self.steady = SteadyWindow::Done;
            }
            _ => {}
        }
        let mut in_gpu_window = false;
        match std::mem::replace(&mut self.gpu, Gpu::Unavailable(String::new())) {
            Gpu::Planned(e, b) if (e, b) == (epoch, batch) => {
                self.gpu = match GpuWindow::start(self.device, step) {
                    Ok(w) => Gpu::Running(w, step, CounterMark::now(self.device)),
                    Err(why) => Gpu::Unavailable(why),
                };
                in_gpu_window = true;
            }
            Gpu::Planned(e, b) => {
                // The step just before the window ends where tracing starts.
                in_gpu_window = e == epoch && batch + 1 == b;
                self.gpu = Gpu::Planned(e, b);
            }
            Gpu::Running(w, first, counters) if step == first + WINDOW => {
                self.launches_steady = counters.per_step_until(&CounterMark::now(self.device), WINDOW);
                self.gpu = match w.finish(self.device, WINDOW) {
                    Ok(r) => Gpu::Done(GpuWindowReport { optimizer_steps: self.gpu_updates, ..r }),
                    Err(why) => Gpu::Unavailable(why),
                };
                in_gpu_window = true;
            }
            Gpu::Running(w, first, counters) => {
                self.gpu = Gpu::Running(w, first, counters);
                in_gpu_window = true;
            }
            other => self.gpu = other,
        }
        self.current_timed = step >= self.warmup && !in_gpu_window;
        let start = Instant::now();
        if step == 0 {
            self.first_step_began = Some(start);
        }
        self.step_began = Some(start);
        self.prev = Some(Previous { epoch, step, start, timed: self.current_timed, updated: false });
        Ok(())
    }

    /// The current step runs an optimizer update.
    pub fn note_update(&mut self) {
        if let Some(p) = self.prev.as_mut() {
            p.updated = true;
        }
        if matches!(self.gpu, Gpu::Running(..)) {
            self.gpu_updates += 1;
        }
    }

    /// The next step does not continue the previous one (an epoch is run again): no
    /// start-to-start sample spans the gap.
    pub fn break_sequence(&mut self) {
        self.prev = None;
    }

    /// The current step waited `d` for its batch.
    pub fn data_wait(&mut self, d: Duration) {
        if self.current_timed {
            self.waits.push(d.as_secs_f64() * 1e3);
        }
    }

    /// Called when a step's work has been queued (its loss read back).
    pub fn end_step(&mut self) {
        if self.steps == 0 {
            self.first_step_s = self.step_began.map(|t| t.elapsed().as_secs_f64());
        }
        self.steps += 1;
    }

    /// Whether the memory snapshot of the GPU window is still to be taken (this step is traced).
    pub fn wants_memory_snapshot(&self) -> bool {
        matches!(self.gpu, Gpu::Running(..)) && self.memory.is_none()
    }

    pub fn set_memory_snapshot(&mut self, m: MemoryAtBackward) {
        self.memory = Some(m);
    }

    /// Start of the first step, and how long it took.
    pub fn first_step(&self) -> (Option<Instant>, f64) {
        (self.first_step_began, self.first_step_s.unwrap_or(0.0))
    }

    /// The samples in stretches of consecutive steps.
    fn sample_runs(&self) -> Vec<Vec<f64>> {
        let mut runs: Vec<Vec<f64>> = Vec::new();
        let mut last: Option<usize> = None;
        for (&v, &step) in self.samples.iter().zip(&self.sample_steps) {
            match runs.last_mut() {
                Some(r) if last.is_some_and(|l| l + 1 == step) => r.push(v),
                _ => runs.push(vec![v]),
            }
            last = Some(step);
        }
        runs
    }

    /// The start-to-start samples of steps that did (or did not) run an optimizer update.
    fn split_samples(&self, updated: bool) -> Vec<f64> {
        self.samples.iter().zip(&self.sample_updated).filter(|(_, u)| **u == updated).map(|(s, _)| *s).collect()
    }

    /// Closes any open window and returns the figures.
    pub fn finish(&mut self, workers: usize, pageable_uploads: u64) -> TimingReport {
        if matches!(self.gpu, Gpu::Running(..)) {
            if let Gpu::Running(w, first, counters) = std::mem::replace(&mut self.gpu, Gpu::Unavailable(String::new())) {
                let steps = self.steps - first;
                self.launches_steady = counters.per_step_until(&CounterMark::now(self.device), steps);
                self.gpu = match w.finish(self.device, steps) {
                    Ok(r) => Gpu::Done(GpuWindowReport { optimizer_steps: self.gpu_updates, ..r }),
                    Err(why) => Gpu::Unavailable(why),
                };
            }
        }
        let (gpu, gpu_unavailable) = match &self.gpu {
            Gpu::Done(r) => (Some(GpuWindowReport { memory: self.memory.clone(), ..r.clone() }), None),
            Gpu::Unavailable(why) => (None, Some(why.clone())),
            Gpu::Planned(..) => (None, Some("the run ended before the GPU window".into())),
            Gpu::Running(..) => (None, Some("window still open".into())),
        };
        TimingReport {
            steps: self.steps,
            warmup_steps: self.warmup,
            start_to_start: StepTiming::from_runs(&self.sample_runs(), WINDOW),
            start_to_start_update: StepTiming::from_samples(&self.split_samples(true)),
            start_to_start_no_update: StepTiming::from_samples(&self.split_samples(false)),
            sync_window_ms_per_step: self.sync_ms,
            steady_window_ms_per_step: self.steady_ms,
            data_wait_ms_mean: if self.waits.is_empty() { 0.0 } else { self.waits.iter().sum::<f64>() / self.waits.len() as f64 },
            workers,
            pageable_uploads,
            loader_images_per_s: None,
            consumed_images_per_s: None,
            launches: self.launches.clone(),
            launches_steady: self.launches_steady.clone(),
            gpu,
            gpu_unavailable,
            stages: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_window_plan() {
        let cuda = Device::Cuda(0);
        assert_eq!(StepClock::plan_gpu_window(true, cuda, 10, 0, 0, 128), Ok((0, 111)));
        assert_eq!(StepClock::plan_gpu_window(true, cuda, 10, 0, 4, 128), Ok((4, 111)));
        assert!(StepClock::plan_gpu_window(true, cuda, 10, 0, 0, 30).is_err(), "too short for warm-up + sync window");
        assert!(StepClock::plan_gpu_window(true, Device::Cpu, 10, 0, 0, 128).is_err());
        assert!(StepClock::plan_gpu_window(false, cuda, 10, 0, 0, 128).is_err());
    }

    #[test]
    fn start_to_start_samples_skip_warmup_and_epoch_ends() {
        let mut c = StepClock::new(Device::Cpu, 2, Err("cpu".into()));
        for epoch in 0..2 {
            for b in 0..5 {
                c.begin_step(epoch, b, 5).unwrap();
                c.data_wait(Duration::from_millis(1));
                if b % 2 == 1 {
                    c.note_update();
                }
                c.end_step();
            }
        }
        let r = c.finish(0, 0);
        // Epoch 0: steps 2, 3 timed (step 4 has no successor in its epoch); epoch 1: steps 5..8.
        assert_eq!(r.start_to_start.timed_steps, 6);
        // Updates at batches 1 and 3: batch 3 of epoch 0, batches 1 and 3 of epoch 1.
        assert_eq!((r.start_to_start_update.timed_steps, r.start_to_start_no_update.timed_steps), (3, 3));
        assert!(r.data_wait_ms_mean >= 1.0);
        assert!(r.sync_window_ms_per_step.is_none(), "no 16-step stretch in 5-step epochs");
        assert_eq!(r.start_to_start.window_ms, 0.0, "no 16 consecutive timed steps");
    }

    /// The steady window: 16 steps ending at the step before the GPU window, timed on the CPU too
    /// (synchronising a CPU device is a no-op).
    #[test]
    fn steady_window_precedes_the_gpu_window() {
        let mut c = StepClock::new(Device::Cpu, 10, Ok((0, 111)));
        for b in 0..128 {
            c.begin_step(0, b, 128).unwrap();
            if b == 94 {
                assert!(matches!(c.steady, SteadyWindow::Running { first: 94, .. }));
            }
            c.end_step();
        }
        let r = c.finish(0, 0);
        assert!(r.steady_window_ms_per_step.is_some(), "closed at the start of step 110");
        let mut short = StepClock::new(Device::Cpu, 10, Err("no GPU window".into()));
        short.begin_step(0, 0, 128).unwrap();
        assert!(short.finish(0, 0).steady_window_ms_per_step.is_none());
    }

    /// Windows of consecutive steps: a run of 40 steps (after 2 warm-up steps, 39 with a
    /// successor) holds two 16-step windows, and the median of their means is reported.
    #[test]
    fn window_figure_uses_stretches_of_consecutive_steps() {
        let r = StepTiming::from_runs(&[vec![1.0; 16], [vec![3.0; 16], vec![100.0]].concat(), vec![5.0; 15]], WINDOW);
        assert_eq!(r.timed_steps, 48);
        assert_eq!(r.window_ms, 2.0, "median of the windows' means 1 and 3");
        let mut c = StepClock::new(Device::Cpu, 2, Err("cpu".into()));
        for b in 0..40 {
            c.begin_step(0, b, 40).unwrap();
            c.end_step();
        }
        let runs = c.sample_runs();
        assert_eq!(runs.iter().map(Vec::len).collect::<Vec<_>>(), vec![37], "one stretch of steps 2..38");
    }
}

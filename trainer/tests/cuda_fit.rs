//! A real CUDA fit through the prefetching pipeline: pinned staging, asynchronous uploads and
//! the device HSV; bytes independent of the worker count; the run summary's GPU figures.
//! Without a usable GPU the test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use ptl_autograd::Device;
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

fn gpu() -> Option<Device> {
    ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
}

fn dataset() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ptl-cuda-fit-{}", std::process::id()));
    let opts = ptl_data::SynthOptions { out: dir.clone(), train: 96, background: 30, val: 4, imgsz: 64, seed: 5, ..Default::default() };
    ptl_data::synth_generate(&opts).expect("synthetic dataset").yaml
}

#[test]
fn prefetched_cuda_fit_is_worker_independent_and_reports_gpu_time() {
    let Some(dev) = gpu() else { return };
    let data = dataset();
    let cfg = |workers: usize, save: &str| PoseTrainConfig {
        data: data.clone(),
        epochs: 1,
        batch: 2,
        imgsz: 64,
        seed: 3,
        device: dev,
        precision: Precision::Bf16Mixed,
        workers: Some(workers),
        timing_warmup_steps: 2,
        optimizer: "MuSGD".into(),
        close_mosaic: 0,
        plots: false,
        progress: false,
        save_dir: std::env::temp_dir().join(format!("ptl-cuda-fit-{save}-{}", std::process::id())),
        ..PoseTrainConfig::default()
    };
    let serial = fit(&cfg(0, "w0"), vec![]).expect("workers=0 fit");
    let pre = fit(&cfg(4, "w4"), vec![]).expect("workers=4 fit");
    assert_eq!(serial.hashes, pre.hashes, "the same bytes with 0 and 4 loader workers on the GPU");
    let t = &pre.timing;
    assert_eq!(t.workers, 4);
    assert_eq!(t.pageable_uploads, 0, "every batch went through pinned memory");
    let l = t.launches.as_ref().expect("launch counts over the sync window");
    assert!(l.kernel_launches > 100.0 && l.library_calls > 10.0, "{l:?}");
    assert!(l.host_to_device_copies >= 1.0, "one image upload per step at least: {l:?}");
    let g = t.gpu.as_ref().unwrap_or_else(|| panic!("GPU window missing: {:?}", t.gpu_unavailable));
    assert_eq!(g.steps, 16);
    assert!(g.kernels_per_step > l.kernel_launches, "CUPTI counts library kernels too: {g:?} vs {l:?}");
    // Dependent launch puts waits into CUPTI's durations; the busy time has none, and each
    // stream is busy at most the whole span.
    assert!(g.kernel_busy_ms_per_step > 0.0 && g.kernel_busy_ms_per_step <= g.kernel_ms_per_step && g.kernel_streams >= 1, "{g:?}");
    assert!(g.kernel_busy_ms_per_step <= g.event_span_ms_per_step * g.kernel_streams as f64 * 1.01, "{g:?}");
    // The union of the kernels' spans fits in the window's event span and under the busy sum.
    assert!(
        g.kernel_active_ms_per_step > 0.0
            && g.kernel_active_ms_per_step <= g.kernel_busy_ms_per_step * 1.0001
            && g.kernel_active_ms_per_step <= g.event_span_ms_per_step * 1.01 + 0.01,
        "{g:?}"
    );
    assert!(t.sync_window_ms_per_step.is_some());
    assert!(
        pre.startup.kernel_modules.iter().filter(|m| m.name.starts_with("ptl-kernels-")).count() >= 9,
        "{:?}",
        pre.startup.kernel_modules
    );
    // Where each kernel unit came from: compiled by NVRTC, or a hit of the kernel cache (a second
    // process with the same cache folder hits every unit).
    let units: Vec<String> = pre
        .startup
        .kernel_modules
        .iter()
        .filter(|m| m.name.starts_with("ptl-kernels-"))
        .map(|m| format!("{} {} {:.2}s", m.name, m.source, m.compile_s + m.load_s))
        .collect();
    println!("kernel units: {}", units.join(", "));
    println!(
        "ok cuda fit: {} steps timed, start-to-start {:.1} ms, data wait {:.2} ms, GPU {:.2} ms/step in {:.0} kernels (span {:.2}), \
         {:.0} launches + {:.0} library calls/step",
        t.start_to_start.timed_steps,
        t.start_to_start.median_ms,
        t.data_wait_ms_mean,
        g.kernel_ms_per_step,
        g.kernels_per_step,
        g.event_span_ms_per_step,
        l.kernel_launches,
        l.library_calls
    );
}

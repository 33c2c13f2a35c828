//! Pose training: configuration, the fit loop, validation.

pub mod autobatch;
mod clock;
pub mod coco_json;
pub mod config;
pub mod draw;
pub mod fit;
pub mod foreign_keys;
pub mod images;
mod pipeline;
pub mod plots;
pub mod predict;
mod probe;
mod progress;
mod settings;
pub mod stages;
mod val_loss;
pub mod validate;
pub mod weights;

pub use coco_json::CocoJsonFiles;
pub use config::{nearest_key, PoseTrainConfig, Precision, MAX_BATCH, MAX_IMGSZ};
pub use fit::{fit, fit_data_parallel, LOSS_NAMES};
pub use images::images_to_tensor;
pub use probe::mark_program_start;
pub use validate::{validate, validate_with, ValOptions, ValResult};
pub use weights::ModelSource;

/// Peak (allocated, reserved) device memory on `device` since the last reset; `None` on the
/// CPU, where the process allocator keeps no such statistics.
pub fn memory_peaks(device: ptl_autograd::Device) -> (Option<u64>, Option<u64>) {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        if let Ok(s) = ptl_autograd::cuda::memory_stats(device) {
            return (Some(s.peak_allocated), Some(s.peak_reserved));
        }
    }
    let _ = device;
    (None, None)
}

/// What the work that set the allocated peak on `device` was part of: its stage
/// ([`stages::name`]), and whether a graph was being recorded or a recorder's warm-up measured
/// (`None` on the CPU).
pub fn memory_peak_during(device: ptl_autograd::Device) -> Option<String> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let c = ptl_autograd::cuda::memory_stats(device).ok()?.peak_context;
        let how = match (c.capturing, c.measuring) {
            (true, _) => " (graph capture)",
            (false, true) => " (capture warm-up)",
            (false, false) => "",
        };
        return Some(format!("{}{how}", stages::name(c.stage)));
    }
    let _ = device;
    None
}

/// Device memory the pools hold from the driver right now (`torch.cuda.memory_reserved`); 0 on
/// the CPU, as Ultralytics reports it there.
pub fn memory_reserved(device: ptl_autograd::Device) -> u64 {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return ptl_autograd::cuda::memory_stats(device).map_or(0, |s| s.reserved);
    }
    let _ = device;
    0
}

/// Bytes held by the math libraries' workspaces on `device` (`None` on the CPU).
pub fn library_workspace_bytes(device: ptl_autograd::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return ptl_autograd::cuda::library_workspace_bytes(device).ok();
    }
    let _ = device;
    None
}

/// Resets the peak statistics at the start of a run (no-op on the CPU).
pub fn reset_memory_peaks(device: ptl_autograd::Device) {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let _ = ptl_autograd::cuda::reset_peak_memory_stats(device);
    }
    let _ = device;
}

//! AutoBatch's measurements on a CUDA device (the rule itself is [`crate::pose::autobatch`]):
//! one training step of the run's model per probed batch size, and the batch a failed run would
//! have fitted with.

use ptl_autograd::{Device, Tensor};
use ptl_heads::{ModelConfig, PoseModel};

use super::run::branch;
use crate::loss::{Anchors, E2ELoss, LossConfig, TargetBatch};
use crate::pose::autobatch::{choose_batch, probe_sizes, report_line, BatchChoice, DeviceMemory, Probe, REPLAY_FACTOR};
use crate::pose::config::PoseTrainConfig;
use crate::{Result, TrainerError};

/// What a probe step needs of the run.
pub(super) struct ProbeSetup {
    pub model: ModelConfig,
    pub loss: LossConfig,
    /// Training images (no batch above it is probed or chosen).
    pub dataset_size: usize,
    /// Objects per image the probe's targets hold: the most crowded image's count, × 4 under
    /// mosaic (a mosaic joins four images), as Ultralytics' `auto_batch` — the count a replayed
    /// fit prepares its first recording for.
    pub max_objects: usize,
}

/// The batch size for `fraction` of `cfg.device`'s memory, with Ultralytics' lines on stderr.
pub(super) fn autobatch(cfg: &PoseTrainConfig, fraction: f64, setup: &ProbeSetup) -> Result<BatchChoice> {
    let Device::Cuda(ordinal) = cfg.device else {
        return Err(TrainerError::InvalidArgument { what: "batch", reason: "AutoBatch probes a CUDA device".into() });
    };
    log::info!("AutoBatch: Computing optimal batch size for imgsz={} at {:.1}% CUDA memory utilization.", cfg.imgsz, fraction * 100.0);
    let mem = device_memory(cfg.device)?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    log::info!(
        "AutoBatch: CUDA:{ordinal} ({}) {:.2}G total, {:.2}G reserved, {:.2}G available",
        device_name(ordinal),
        gib(mem.total),
        gib(mem.reserved),
        gib(mem.available())
    );
    let probes = probe(cfg, setup, &probe_sizes(mem.total, setup.dataset_size))?;
    let choice = choose_batch(&probes, mem, fraction, setup.dataset_size)?;
    log::info!("{}", report_line(&choice, ordinal, &mem));
    Ok(choice)
}

/// One step per batch size in `sizes` (smallest first); after the first that runs out of memory
/// the larger ones are not tried (they would too) and count as failed.
fn probe(cfg: &PoseTrainConfig, setup: &ProbeSetup, sizes: &[usize]) -> Result<Vec<Probe>> {
    let mut model = PoseModel::new(setup.model, cfg.device, cfg.seed)?;
    model.set_activation_format(super::activation_format(cfg));
    let criterion = E2ELoss::new(setup.loss.clone(), cfg.epochs);
    let factor = if cfg.replay.is_empty() { 1.0 } else { REPLAY_FACTOR };
    let mut probes = Vec::new();
    let mut out_of_memory = false;
    for &batch in sizes {
        let bytes = match out_of_memory {
            true => None,
            false => match probe_step(cfg, &model, &criterion, batch, setup) {
                Ok(b) => Some((b as f64 * factor) as u64),
                Err(e) if is_out_of_memory(&e) => {
                    out_of_memory = true;
                    None
                }
                Err(e) => return Err(e),
            },
        };
        ptl_autograd::module::zero_grad(&model);
        empty_cache(cfg.device)?;
        probes.push(Probe { batch, bytes });
    }
    Ok(probes)
}

/// Forward, criterion and backward of `batch` blank images with `setup.max_objects` targets each
/// at the run's precision; the device's allocated peak during it (bytes).
fn probe_step(cfg: &PoseTrainConfig, model: &PoseModel, criterion: &E2ELoss, batch: usize, setup: &ProbeSetup) -> Result<u64> {
    let s = cfg.imgsz;
    reset_peaks(cfg.device)?;
    let x = Tensor::zeros(vec![batch, 3, s, s], ptl_autograd::DType::F32, cfg.device)?;
    let targets = crowded_targets(batch, setup.max_objects.max(1), setup.loss.nkpt);
    let anchors = Anchors::from_image_hw((s, s), &ptl_heads::model::STRIDES)?;
    let autocast = cfg.precision.autocast();
    let out = ptl_autograd::autocast(autocast, || model.forward(&x))?;
    let loss = ptl_autograd::autocast(autocast, || {
        criterion.loss(&branch(&out.one2many), &branch(&out.one2one), &targets, &anchors, Some(&model.head().flow_model))
    })?;
    loss.total.backward()?;
    drop((out, loss));
    peak_allocated(cfg.device)
}

/// `per_image` objects on every image, spread on a grid, every keypoint visible at its box's
/// centre (their count sizes the assigner's and the loss's buffers, not their places).
fn crowded_targets(batch: usize, per_image: usize, nkpt: usize) -> TargetBatch {
    let side = (per_image as f64).sqrt().ceil() as usize;
    let mut t = TargetBatch { batch_idx: Vec::new(), cls: Vec::new(), bboxes: Vec::new(), keypoints: Vec::new(), nkpt };
    for i in 0..batch {
        for j in 0..per_image {
            let (cx, cy) = (((j % side) as f32 + 0.5) / side as f32, ((j / side) as f32 + 0.5) / side as f32);
            let w = 0.8 / side as f32;
            t.batch_idx.push(i as f32);
            t.cls.push(0.0);
            t.bboxes.extend([cx, cy, w, w]);
            for _ in 0..nkpt {
                t.keypoints.extend([cx, cy, 2.0]);
            }
        }
    }
    t
}

/// Whether `e` is the device running out of memory (a smaller batch may fit).
pub(super) fn is_out_of_memory(e: &TrainerError) -> bool {
    matches!(
        e,
        TrainerError::Tensor(ptl_autograd::Error::OutOfMemory { .. })
            | TrainerError::Model(ptl_heads::HeadsError::Tensor(ptl_autograd::Error::OutOfMemory { .. }))
    )
}

/// The error for a run whose batch did not fit: the batch AutoBatch would choose (60 % of the
/// memory) named beside the failure, or the failure alone when no batch fits.
pub(super) fn batch_does_not_fit(cfg: &PoseTrainConfig, setup: &ProbeSetup, failure: TrainerError) -> TrainerError {
    let Device::Cuda(device) = cfg.device else { return failure };
    let _ = empty_cache(cfg.device);
    match autobatch(cfg, 0.60, setup) {
        Ok(choice) if choice.batch < cfg.batch => {
            TrainerError::BatchDoesNotFit { batch: cfg.batch, device, fits: choice.batch, detail: failure.to_string() }
        }
        _ => failure,
    }
}

#[cfg(feature = "cuda")]
fn device_memory(device: Device) -> Result<DeviceMemory> {
    empty_cache(device)?;
    let (free, total) = ptl_autograd::cuda::device_memory(device)?;
    let reserved = ptl_autograd::cuda::memory_stats(device)?.reserved;
    Ok(DeviceMemory { total, reserved, free })
}

#[cfg(feature = "cuda")]
fn device_name(ordinal: usize) -> String {
    ptl_autograd::cuda::device_name(ordinal).unwrap_or_else(|_| "?".into())
}

#[cfg(feature = "cuda")]
fn empty_cache(device: Device) -> Result<()> {
    Ok(ptl_autograd::cuda::empty_cache(device)?)
}

#[cfg(feature = "cuda")]
fn reset_peaks(device: Device) -> Result<()> {
    ptl_autograd::cuda::synchronize(device)?;
    Ok(ptl_autograd::cuda::reset_peak_memory_stats(device)?)
}

#[cfg(feature = "cuda")]
fn peak_allocated(device: Device) -> Result<u64> {
    ptl_autograd::cuda::synchronize(device)?;
    Ok(ptl_autograd::cuda::memory_stats(device)?.peak_allocated)
}

#[cfg(not(feature = "cuda"))]
fn no_cuda() -> TrainerError {
    TrainerError::InvalidArgument { what: "device", reason: "this build has no CUDA support (build with --features cuda)".into() }
}

#[cfg(not(feature = "cuda"))]
fn device_memory(_: Device) -> Result<DeviceMemory> {
    Err(no_cuda())
}

#[cfg(not(feature = "cuda"))]
fn device_name(_: usize) -> String {
    "?".into()
}

#[cfg(not(feature = "cuda"))]
fn empty_cache(_: Device) -> Result<()> {
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn reset_peaks(_: Device) -> Result<()> {
    Err(no_cuda())
}

#[cfg(not(feature = "cuda"))]
fn peak_allocated(_: Device) -> Result<u64> {
    Err(no_cuda())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crowded_targets_give_every_image_its_objects_inside_the_image() {
        let t = crowded_targets(3, 5, 17);
        assert_eq!(t.len(), 15);
        assert_eq!(t.keypoints.len(), 15 * 17 * 3);
        assert_eq!(t.batch_idx.iter().filter(|&&i| i == 2.0).count(), 5);
        for b in t.bboxes.chunks(4) {
            assert!(b[0] - b[2] / 2.0 >= 0.0 && b[0] + b[2] / 2.0 <= 1.0 && b[1] - b[3] / 2.0 >= 0.0 && b[1] + b[3] / 2.0 <= 1.0, "{b:?}");
        }
    }
}

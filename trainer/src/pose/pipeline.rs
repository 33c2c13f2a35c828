//! Training batches on their way to the device.
//!
//! Worker threads build batches ahead of use into a bounded queue ([`ptl_data::Prefetcher`]); on a
//! CUDA device each worker also copies the batch's pixels into a page-locked buffer from a small
//! ring, so that the training thread's upload is an asynchronous DMA (a copy from pageable
//! memory makes the host wait). Workers never call the GPU — capture mode is per thread, and a
//! loader upload during a graph capture would be recorded into it or race it — so only the
//! training thread uploads, between steps, and only it checks which buffers the GPU has finished
//! reading. A batch whose worker finds no free pinned buffer keeps its pageable pixels (counted,
//! never wrong).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
#[cfg(feature = "cuda")]
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ptl_autograd::{Device, Tensor};
use ptl_data::{Batch, BatchStage, PrefetchPlan, Prefetcher, TrainLoader};

use crate::Result;

/// A batch with its pixels where the worker left them.
pub(crate) struct StagedBatch {
    /// The batch without its pixels (`img` is empty).
    pub batch: Batch,
    pixels: Pixels,
}

enum Pixels {
    /// Pageable host memory (CPU runs; a CUDA run whose pinned ring was exhausted).
    Host(Vec<u8>),
    /// Page-locked memory ready for an asynchronous upload.
    #[cfg(feature = "cuda")]
    Pinned(ptl_autograd::internal::cuda::PinnedBuffer),
}

/// Page-locked buffers: the free list shared with the workers, and the buffers whose upload may
/// still be running (owned by the training thread).
#[cfg(feature = "cuda")]
struct PinnedRing {
    free: Arc<Mutex<Vec<ptl_autograd::internal::cuda::PinnedBuffer>>>,
    in_flight: Vec<ptl_autograd::internal::cuda::PinnedBuffer>,
}

#[cfg(feature = "cuda")]
impl PinnedRing {
    fn new(device: Device, count: usize, bytes: usize) -> Result<PinnedRing> {
        let bufs =
            (0..count).map(|_| ptl_autograd::internal::cuda::PinnedBuffer::new(device, bytes)).collect::<ptl_autograd::Result<Vec<_>>>()?;
        Ok(PinnedRing { free: Arc::new(Mutex::new(bufs)), in_flight: Vec::new() })
    }

    /// Moves buffers whose upload has finished back to the free list (non-blocking queries).
    fn reclaim(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.in_flight.len() {
            if self.in_flight[i].poll_idle()? {
                let b = self.in_flight.swap_remove(i);
                self.free.lock().unwrap_or_else(|e| e.into_inner()).push(b);
            } else {
                i += 1;
            }
        }
        Ok(())
    }
}

/// Pinned buffers beyond the loader's queue: uploads queued on the device and not yet run (the
/// host may queue a few steps ahead of the GPU); past them a batch is uploaded from pageable
/// memory, counted in [`PipelineStats::pageable_uploads`].
const UPLOADS_IN_FLIGHT: usize = 4;

/// What the pipeline measured.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PipelineStats {
    pub workers: usize,
    /// Batches uploaded from pageable memory on a CUDA device (pinned ring exhausted).
    pub pageable_uploads: u64,
    /// Batches the loader built, and the mean seconds one took on its thread.
    pub batches_built: u64,
    pub build_s_per_batch: f64,
}

/// The fit's source of device-ready image batches.
pub(crate) struct TrainPipeline {
    // Field order matters: the prefetcher (and so its worker threads) goes first, before the
    // pinned ring its workers write into.
    prefetcher: Prefetcher<StagedBatch>,
    #[cfg(feature = "cuda")]
    pinned: Option<PinnedRing>,
    device: Device,
    pageable: Arc<AtomicU64>,
}

fn take_pixels(mut batch: Batch) -> StagedBatch {
    let img = std::mem::take(&mut batch.img);
    StagedBatch { batch, pixels: Pixels::Host(img) }
}

impl TrainPipeline {
    /// Starts the workers for `plan`. `image_bytes` is the size of a full batch's pixels.
    pub fn start(loader: &Arc<TrainLoader>, plan: PrefetchPlan, device: Device, image_bytes: usize) -> Result<TrainPipeline> {
        let pageable = Arc::new(AtomicU64::new(0));
        #[cfg(feature = "cuda")]
        if matches!(device, Device::Cuda(_)) {
            // A batch holds a buffer from the end of its building until its upload has run: at
            // most `prefetch` batches are in the works or waiting, plus uploads in flight.
            let count = loader.config().prefetch.max(1) + UPLOADS_IN_FLIGHT;
            let ring = PinnedRing::new(device, count, image_bytes)?;
            let free = ring.free.clone();
            let counter = pageable.clone();
            let stage: BatchStage<StagedBatch> = Arc::new(move |mut batch: Batch| {
                let buf = free.lock().unwrap_or_else(|e| e.into_inner()).pop();
                if let Some(mut buf) = buf {
                    if let Some(dst) = buf.host_mut().filter(|d| d.len() >= batch.img.len()) {
                        dst[..batch.img.len()].copy_from_slice(&batch.img);
                        batch.img = Vec::new();
                        return Ok(StagedBatch { batch, pixels: Pixels::Pinned(buf) });
                    }
                    free.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
                }
                counter.fetch_add(1, Ordering::Relaxed);
                Ok(take_pixels(batch))
            });
            let prefetcher = loader.prefetch_staged(plan, stage);
            return Ok(TrainPipeline { prefetcher, pinned: Some(ring), device, pageable });
        }
        let _ = image_bytes;
        let stage: BatchStage<StagedBatch> = Arc::new(|b: Batch| Ok(take_pixels(b)));
        Ok(TrainPipeline {
            prefetcher: loader.prefetch_staged(plan, stage),
            #[cfg(feature = "cuda")]
            pinned: None,
            device,
            pageable,
        })
    }

    /// The next batch and its u8 pixels on the device (upload queued, not waited for), with the
    /// time spent waiting for the workers. `None` after the last planned batch.
    pub fn next(&mut self) -> Result<Option<(Batch, Tensor, Duration)>> {
        #[cfg(feature = "cuda")]
        if let Some(ring) = self.pinned.as_mut() {
            ring.reclaim()?;
        }
        let t = Instant::now();
        let Some(staged) = self.prefetcher.next_batch() else { return Ok(None) };
        let waited = t.elapsed();
        let StagedBatch { batch, pixels } = staged?;
        let shape = batch.shape;
        let u8_batch = match pixels {
            Pixels::Host(img) => {
                let t = Tensor::from_vec(img, shape.to_vec(), Device::Cpu)?;
                if self.device == Device::Cpu {
                    t
                } else {
                    t.to_device(self.device)?
                }
            }
            #[cfg(feature = "cuda")]
            Pixels::Pinned(mut buf) => {
                let t = buf.upload_prefix(shape.to_vec())?;
                if let Some(ring) = self.pinned.as_mut() {
                    ring.in_flight.push(buf);
                }
                t
            }
        };
        Ok(Some((batch, u8_batch, waited)))
    }

    pub fn stats(&self) -> PipelineStats {
        let (batches_built, build_s_per_batch) = self.prefetcher.build_stats();
        PipelineStats {
            workers: self.prefetcher.workers(),
            pageable_uploads: self.pageable.load(Ordering::Relaxed),
            batches_built,
            build_s_per_batch,
        }
    }
}

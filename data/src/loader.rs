//! Sample pipelines (train: mosaic → affine → HSV → flips → format; val: letterbox → format), collation into
//! [`Batch`] (docs/data.md §9), deterministic epoch order, validation rect batches and the prefetching worker pool.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use rayon::prelude::*;

use crate::augment::{self, AffineDraw, AugmentConfig, Instances};
use crate::dataset::PoseDataset;
use crate::error::{DataError, Result};
use crate::hsv::HsvGains;
use crate::image::Image;
use crate::rng::{stream, Rng};

/// `ratio_pad` of one image. Train (mosaic): `ratio` = (h/h0, w/w0) of the load resize, `pad` = None.
/// Letterboxed (val, or train after close_mosaic): `ratio` = (h/h0·r, w/w0·r), `pad` = Some((left, top)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RatioPad {
    /// (gain_h, gain_w).
    pub ratio: [f32; 2],
    /// (pad_left, pad_top) in pixels.
    pub pad: Option<[f32; 2]>,
}

/// Whether this CPU runs the loader's AVX2 copy of the augmentation (x86-64 with AVX2).
fn wide_vectors() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *WIDE.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A collated batch, layout of docs/data.md §9 with plain Rust types. `B` images, `N` objects, `K` keypoints.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The epoch (validation: 0).
    pub epoch: usize,
    /// The batch's index within its epoch.
    pub index: usize,
    /// u8 RGB images, `B × 3 × H × W` row-major.
    pub img: Vec<u8>,
    /// `[B, 3, H, W]`.
    pub shape: [usize; 4],
    /// Image index (0..B−1) of each object, `N`.
    pub batch_idx: Vec<f32>,
    /// Class id per object, `N × 1`.
    pub cls: Vec<f32>,
    /// Normalised (cx, cy, w, h) in the final image, `N × 4`.
    pub bboxes: Vec<f32>,
    /// Normalised x, y and visibility, `N × K × 3`.
    pub keypoints: Vec<f32>,
    /// K.
    pub nkpt: usize,
    /// Image paths, `B`.
    pub im_file: Vec<PathBuf>,
    /// Original (h0, w0), `B`.
    pub ori_shape: Vec<[u32; 2]>,
    /// Size before collation (h, w), `B` (mosaic samples: (2·imgsz, 2·imgsz), the canvas, as the reference).
    pub resized_shape: Vec<[u32; 2]>,
    /// See [`RatioPad`], `B`.
    pub ratio_pad: Vec<RatioPad>,
    /// HSV gains drawn per image, `B` (zero when HSV is off).
    pub hsv_gains: Vec<HsvGains>,
    /// True if the gains were already applied on the CPU; false when HSV is left to the device kernel.
    pub hsv_applied: bool,
}

impl Batch {
    /// Images in the batch.
    /// Images in the batch.
    pub fn len(&self) -> usize {
        self.shape[0]
    }

    /// Whether the batch holds no image.
    pub fn is_empty(&self) -> bool {
        self.shape[0] == 0
    }

    /// Objects in the batch.
    pub fn num_objects(&self) -> usize {
        self.cls.len()
    }
}

/// One augmented sample before collation (BGR HWC image, pixel xyxy instances).
#[derive(Clone, Debug)]
pub struct Sample {
    /// The augmented image (BGR, HWC).
    pub img: Image,
    /// Its objects in pixels.
    pub inst: Instances,
    /// Whether Format turns it to RGB (the colour-order draw).
    pub rgb: bool,
    /// The HSV gains drawn for it.
    pub hsv: HsvGains,
    /// Whether the HSV jitter was applied already (else it is left to the device).
    pub hsv_applied: bool,
    /// The source image file.
    pub im_file: PathBuf,
    /// The source image's size (h, w).
    pub ori_shape: [u32; 2],
    /// The size before collation (h, w).
    pub resized_shape: [u32; 2],
    /// Resize ratio and letterbox padding.
    pub ratio_pad: RatioPad,
}

/// Training loader settings.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Images per batch.
    pub batch: usize,
    /// The seed every sample's generator derives from.
    pub seed: u64,
    /// Epochs of the run (for the close-mosaic switch).
    pub epochs: usize,
    /// Mosaic is off for epochs e ≥ epochs − close_mosaic (0 = never switch).
    pub close_mosaic: usize,
    /// Augmentation settings.
    pub aug: AugmentConfig,
    /// Leave HSV to the device (gains still drawn, returned in the batch).
    pub hsv_on_device: bool,
    /// Worker threads; 0 = build batches in the calling thread.
    pub workers: usize,
    /// Batches in the works or waiting to be taken (queue bound, ≥ 1). Twice the workers by
    /// default, as PyTorch's `prefetch_factor=2`: with no more than one per worker, the workers
    /// idle whenever the batch due next is the slowest one in the works.
    pub prefetch: usize,
    /// Shuffle every epoch (seeded by (seed, epoch)).
    pub shuffle: bool,
    /// Which share of each epoch this loader takes when several processes train together
    /// (data-parallel ranks); the whole epoch by default.
    pub shard: Shard,
    /// Test hook: building batch (epoch, index) panics, to exercise worker failure handling.
    #[doc(hidden)]
    pub inject_panic_at: Option<(usize, usize)>,
}

/// The queue bound for `workers` worker threads: two batches per worker (at least two), as
/// PyTorch's `prefetch_factor=2` ([`TrainConfig::prefetch`]).
pub fn prefetch_for(workers: usize) -> usize {
    (2 * workers).max(2)
}

/// Worker threads of [`TrainConfig::default`] (fewer where the machine has fewer cores).
const DEFAULT_WORKERS: usize = 8;

fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch: 16,
            seed: 0,
            epochs: 100,
            close_mosaic: 10,
            aug: AugmentConfig::default(),
            hsv_on_device: false,
            workers: DEFAULT_WORKERS.min(cores()),
            prefetch: prefetch_for(DEFAULT_WORKERS.min(cores())),
            shuffle: true,
            shard: Shard::WHOLE,
            inject_panic_at: None,
        }
    }
}

/// One rank's share of every epoch in data-parallel training: the epoch's order (the same on
/// every rank, drawn from the seed) padded to a multiple of `world` by repeating its head, then
/// every `world`-th sample from position `rank` — PyTorch's `DistributedSampler`, so every rank
/// takes the same number of samples (and steps) and every sample is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank (0-based).
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
}

impl Shard {
    /// The whole epoch: one rank.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// This share of `order`.
    pub fn of(&self, order: &[usize]) -> Vec<usize> {
        if self.world == 0 || self.rank >= self.world || order.is_empty() {
            return Vec::new();
        }
        let total = self.len(order.len());
        (self.rank..total * self.world).step_by(self.world).map(|i| order[i % order.len()]).collect()
    }

    /// Samples per epoch in this share of an epoch of `n` samples.
    pub fn len(&self, n: usize) -> usize {
        n.div_ceil(self.world.max(1))
    }
}

/// Training batches: a deterministic function of (dataset, config, epoch, batch index).
#[derive(Debug)]
pub struct TrainLoader {
    ds: Arc<PoseDataset>,
    cfg: TrainConfig,
    batch: usize,
}

impl TrainLoader {
    /// A loader over `ds` (refuses batch 0, an empty dataset, and device HSV with BGR samples).
    pub fn new(ds: Arc<PoseDataset>, cfg: TrainConfig) -> Result<Self> {
        if cfg.batch == 0 {
            return Err(DataError::Invalid("batch must be ≥ 1".into()));
        }
        if ds.is_empty() {
            return Err(DataError::Invalid("dataset is empty".into()));
        }
        crate::check_threads("workers", cfg.workers)?;
        if cfg.shard.world == 0 || cfg.shard.rank >= cfg.shard.world {
            return Err(DataError::Invalid(format!(
                "shard: rank {} of a world of {} does not exist (ranks are 0…world−1, world ≥ 1)",
                cfg.shard.rank, cfg.shard.world
            )));
        }
        if cfg.hsv_on_device && cfg.aug.bgr != 0.0 {
            // The device kernel reads every image as RGB; a BGR-swapped sample would be jittered wrongly.
            return Err(DataError::Invalid(format!(
                "hsv_on_device needs bgr = 0 (got {}): set bgr=0 or apply HSV on the CPU",
                cfg.aug.bgr
            )));
        }
        let batch = cfg.batch.min(cfg.shard.len(ds.len()));
        Ok(TrainLoader { ds, cfg, batch })
    }

    /// The dataset it reads.
    pub fn dataset(&self) -> &Arc<PoseDataset> {
        &self.ds
    }

    /// Its settings.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// Effective batch size: min(batch, samples of this loader's share of an epoch).
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// ceil(samples of this loader's share of an epoch / batch); the last partial batch is kept.
    pub fn batches_per_epoch(&self) -> usize {
        self.cfg.shard.len(self.ds.len()).div_ceil(self.batch)
    }

    /// Whether mosaic is used in `epoch` (close-mosaic switch, docs/data.md §7).
    pub fn mosaic_enabled(&self, epoch: usize) -> bool {
        self.cfg.aug.mosaic > 0.0 && (self.cfg.close_mosaic == 0 || epoch < self.cfg.epochs.saturating_sub(self.cfg.close_mosaic))
    }

    /// Dataset indices in the order of `epoch` (this loader's share of it, see [`Shard`]).
    pub fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.ds.len()).collect();
        if self.cfg.shuffle {
            Rng::for_sample(stream::SHUFFLE, self.cfg.seed, epoch as u64, 0).shuffle(&mut v);
        }
        match self.cfg.shard == Shard::WHOLE {
            true => v,
            false => self.cfg.shard.of(&v),
        }
    }

    /// One augmented training sample (per-sample RNG from (seed, epoch, index)), draw order of docs/data.md §6.0.
    #[inline(always)]
    pub fn sample(&self, epoch: usize, index: usize) -> Sample {
        let ds = &*self.ds;
        let a = &self.cfg.aug;
        let s = ds.imgsz;
        let k = ds.nkpt();
        let item = &ds.items[index];
        let mut rng = Rng::for_sample(stream::SAMPLE, self.cfg.seed, epoch as u64, index as u64);
        let p_mosaic = if self.mosaic_enabled(epoch) { a.mosaic } else { 0.0 };
        let gate = rng.uniform(0.0, 1.0);
        let (h, w) = (item.image.h, item.image.w);
        let load_ratio = [h as f32 / item.ori_shape.0 as f32, w as f32 / item.ori_shape.1 as f32];
        // The mosaic's canvas stays as its tiles' placements: the warp composes the rows it reads.
        enum Pre<'a> {
            Mosaic(crate::canvas::MosaicCanvas<'a>),
            Letterboxed(Image),
        }
        let (pre, pre_inst, resized_shape, ratio_pad) = if p_mosaic > 0.0 && gate <= p_mosaic {
            let n = ds.len() as i64;
            let partners = [rng.randint(0, n - 1), rng.randint(0, n - 1), rng.randint(0, n - 1)];
            let (yc, xc) = augment::draw_mosaic_centre(&mut rng, s);
            let it = |i: i64| &ds.items[i as usize];
            let (p1, p2, p3) = (it(partners[0]), it(partners[1]), it(partners[2]));
            let tiles = [(&*item.image, &item.labels), (&*p1.image, &p1.labels), (&*p2.image, &p2.labels), (&*p3.image, &p3.labels)];
            let (canvas, inst) = augment::mosaic4_layout(tiles, k, s, yc, xc);
            (Pre::Mosaic(canvas), inst, [2 * s, 2 * s], RatioPad { ratio: load_ratio, pad: None })
        } else {
            let mut inst = Instances::from_labels(&item.labels, k, w as f32, h as f32);
            let (img, lb) = augment::letterbox(&item.image, &mut inst, s, s, true);
            (
                Pre::Letterboxed(img),
                inst,
                [s, s],
                RatioPad { ratio: [load_ratio[0] * lb.r, load_ratio[1] * lb.r], pad: Some([lb.left as f32, lb.top as f32]) },
            )
        };
        let d = AffineDraw::draw(&mut rng, a);
        let (mut img, mut inst) = match &pre {
            Pre::Mosaic(canvas) => augment::random_perspective(canvas, &pre_inst, &d, s),
            Pre::Letterboxed(img) => augment::random_perspective(img, &pre_inst, &d, s),
        };
        if let Pre::Letterboxed(img) = pre {
            augment::recycle(img);
        }
        let _mixup_gate = rng.random();
        let _cutmix_gate = rng.random();
        let hsv_on = a.hsv_h != 0.0 || a.hsv_s != 0.0 || a.hsv_v != 0.0;
        let gains = if hsv_on { HsvGains::draw(&mut rng, a.hsv_h, a.hsv_s, a.hsv_v) } else { HsvGains::default() };
        let hsv_applied = !self.cfg.hsv_on_device;
        if hsv_applied {
            augment::hsv(&mut img, &gains);
        }
        let flip_idx = ds.meta.flip_idx.as_deref();
        let (pud, plr) = if flip_idx.is_some() { (a.flipud, a.fliplr) } else { (0.0, 0.0) };
        if rng.random() < pud {
            augment::flipud_image(&mut img);
            inst.flipud(img.h as f32, flip_idx);
        }
        if rng.random() < plr {
            augment::fliplr_image(&mut img);
            inst.fliplr(img.w as f32, flip_idx);
        }
        let rgb = rng.uniform(0.0, 1.0) > a.bgr;
        Sample {
            img,
            inst,
            rgb,
            hsv: gains,
            hsv_applied,
            im_file: item.im_file.clone(),
            ori_shape: [item.ori_shape.0, item.ori_shape.1],
            resized_shape,
            ratio_pad,
        }
    }

    /// Builds batch `b` of `epoch`.
    pub fn build_batch(&self, epoch: usize, b: usize) -> Result<Batch> {
        let nb = self.batches_per_epoch();
        if b >= nb {
            return Err(DataError::Invalid(format!("batch {b} out of range (epoch has {nb})")));
        }
        if self.cfg.inject_panic_at == Some((epoch, b)) {
            panic!("injected failure at epoch {epoch} batch {b}");
        }
        let order = self.epoch_order(epoch);
        let idx = &order[b * self.batch..((b + 1) * self.batch).min(order.len())];
        self.build_samples(epoch, b, idx, wide_vectors())
    }

    /// Augments and collates the samples `idx` as batch `b` of `epoch`; with `wide` (the CPU has
    /// AVX2) in a copy of the code compiled for it, whose byte loops take 32-byte vectors
    /// (no fused multiply-add: the same arithmetic, the same bytes).
    fn build_samples(&self, epoch: usize, b: usize, idx: &[usize], wide: bool) -> Result<Batch> {
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: `wide` is true only where the CPU reports AVX2 (`wide_vectors`).
            return unsafe { self.build_samples_avx2(epoch, b, idx) };
        }
        let _ = wide;
        self.build_samples_inline(epoch, b, idx)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn build_samples_avx2(&self, epoch: usize, b: usize, idx: &[usize]) -> Result<Batch> {
        self.build_samples_inline(epoch, b, idx)
    }

    /// The body of [`Self::build_samples`]; inlined, with the augmentation's loops, into each
    /// caller so that the AVX2 copy compiles them for AVX2.
    #[inline(always)]
    fn build_samples_inline(&self, epoch: usize, b: usize, idx: &[usize]) -> Result<Batch> {
        let samples: Vec<Sample> = idx.iter().map(|&i| self.sample(epoch, i)).collect();
        collate(samples, self.ds.nkpt(), epoch, b)
    }

    /// Starts worker threads that prepare batches from `start_epoch` to the last epoch, in order, ahead of use.
    pub fn prefetch(self: &Arc<Self>, start_epoch: usize) -> Prefetcher {
        let plan = PrefetchPlan { start_epoch, batches_per_epoch: None, start_batch: 0 };
        Prefetcher::new(self.clone(), plan, Arc::new(Ok))
    }
}

/// Collates samples: HWC BGR → CHW (RGB when the sample's gate says so), normalised boxes/keypoints.
#[inline(always)]
pub fn collate(samples: Vec<Sample>, k: usize, epoch: usize, index: usize) -> Result<Batch> {
    let Some(first) = samples.first() else {
        return Err(DataError::Invalid("cannot collate an empty batch".into()));
    };
    let (h, w) = (first.img.h as usize, first.img.w as usize);
    if samples.iter().any(|s| s.img.h as usize != h || s.img.w as usize != w) {
        return Err(DataError::Invalid("samples of one batch differ in size".into()));
    }
    let bsz = samples.len();
    let plane = h * w;
    let mut b = Batch {
        epoch,
        index,
        img: vec![0u8; bsz * 3 * plane],
        shape: [bsz, 3, h, w],
        batch_idx: Vec::new(),
        cls: Vec::new(),
        bboxes: Vec::new(),
        keypoints: Vec::new(),
        nkpt: k,
        im_file: Vec::with_capacity(bsz),
        ori_shape: Vec::with_capacity(bsz),
        resized_shape: Vec::with_capacity(bsz),
        ratio_pad: Vec::with_capacity(bsz),
        hsv_gains: Vec::with_capacity(bsz),
        hsv_applied: samples.iter().all(|s| s.hsv_applied),
    };
    let (wf, hf) = (w as f32, h as f32);
    for (i, s) in samples.into_iter().enumerate() {
        let dst = &mut b.img[i * 3 * plane..(i + 1) * 3 * plane];
        let [o0, o1, o2]: [usize; 3] = if s.rgb { [2, 1, 0] } else { [0, 1, 2] };
        // HWC → CHW in one pass over the pixels
        let (d0, rest) = dst.split_at_mut(plane);
        let (d1, d2) = rest.split_at_mut(plane);
        for (((px, p0), p1), p2) in s.img.data.as_chunks::<3>().0.iter().zip(d0).zip(d1).zip(d2) {
            (*p0, *p1, *p2) = (px[o0], px[o1], px[o2]);
        }
        for (j, bx) in s.inst.boxes.iter().enumerate() {
            b.batch_idx.push(i as f32);
            b.cls.push(s.inst.cls[j]);
            b.bboxes.extend_from_slice(&[
                (bx[0] + bx[2]) / 2.0 / wf,
                (bx[1] + bx[3]) / 2.0 / hf,
                (bx[2] - bx[0]) / wf,
                (bx[3] - bx[1]) / hf,
            ]);
            for p in s.inst.kpts[j * k * 3..(j + 1) * k * 3].chunks_exact(3) {
                b.keypoints.extend_from_slice(&[p[0] / wf, p[1] / hf, p[2]]);
            }
        }
        b.im_file.push(s.im_file);
        b.ori_shape.push(s.ori_shape);
        b.resized_shape.push(s.resized_shape);
        b.ratio_pad.push(s.ratio_pad);
        b.hsv_gains.push(s.hsv);
    }
    Ok(b)
}

/// Validation batches: images sorted by aspect ratio, rectangular letterbox shapes (docs/data.md §8).
#[derive(Debug)]
pub struct ValLoader {
    ds: Arc<PoseDataset>,
    batch: usize,
    seed: u64,
    order: Vec<usize>,
    /// (H_b, W_b) per batch.
    shapes: Vec<(u32, u32)>,
}

/// Rect batch shape for aspect ratios (h/w) `a_min ≤ a_max`: ceil(shape · imgsz / 32 + 0.5) · 32.
pub fn rect_shape(a_min: f64, a_max: f64, imgsz: u32) -> (u32, u32) {
    let shape = if a_max < 1.0 {
        [a_max, 1.0]
    } else if a_min > 1.0 {
        [1.0, 1.0 / a_min]
    } else {
        [1.0, 1.0]
    };
    let f = |v: f64| ((v * imgsz as f64 / 32.0 + 0.5).ceil() as u32) * 32;
    (f(shape[0]), f(shape[1]))
}

impl ValLoader {
    /// Val batch size is usually 2 × the train batch.
    pub fn new(ds: Arc<PoseDataset>, batch: usize, seed: u64) -> Result<Self> {
        if batch == 0 {
            return Err(DataError::Invalid("batch must be ≥ 1".into()));
        }
        let ar: Vec<f64> = ds.items.iter().map(|it| it.ori_shape.0 as f64 / it.ori_shape.1 as f64).collect();
        let mut order: Vec<usize> = (0..ds.len()).collect();
        order.sort_by(|&a, &b| ar[a].total_cmp(&ar[b]));
        let shapes = order
            .chunks(batch)
            .map(|c| {
                let a_min = ar[c[0]];
                let a_max = ar[c[c.len() - 1]];
                rect_shape(a_min, a_max, ds.imgsz)
            })
            .collect();
        Ok(ValLoader { ds, batch, seed, order, shapes })
    }

    /// Batches in one pass over the split.
    pub fn len(&self) -> usize {
        self.shapes.len()
    }

    /// Whether there is no batch.
    pub fn is_empty(&self) -> bool {
        self.shapes.is_empty()
    }

    /// (H_b, W_b) of batch `b`.
    pub fn batch_shape(&self, b: usize) -> Option<(u32, u32)> {
        self.shapes.get(b).copied()
    }

    /// One letterboxed validation sample.
    pub fn sample(&self, index: usize, shape: (u32, u32)) -> Sample {
        let ds = &*self.ds;
        let item = &ds.items[index];
        let (h, w) = (item.image.h, item.image.w);
        let mut inst = Instances::from_labels(&item.labels, ds.nkpt(), w as f32, h as f32);
        let (img, lb) = augment::letterbox(&item.image, &mut inst, shape.0, shape.1, false);
        let mut rng = Rng::for_sample(stream::VAL, self.seed, 0, index as u64);
        let rgb = rng.uniform(0.0, 1.0) > 0.0;
        Sample {
            img,
            inst,
            rgb,
            hsv: HsvGains::default(),
            hsv_applied: true,
            im_file: item.im_file.clone(),
            ori_shape: [item.ori_shape.0, item.ori_shape.1],
            resized_shape: [shape.0, shape.1],
            ratio_pad: RatioPad {
                ratio: [h as f32 / item.ori_shape.0 as f32 * lb.r, w as f32 / item.ori_shape.1 as f32 * lb.r],
                pad: Some([lb.left as f32, lb.top as f32]),
            },
        }
    }

    /// Builds validation batch `b`.
    pub fn build_batch(&self, b: usize) -> Result<Batch> {
        let shape =
            self.batch_shape(b).ok_or_else(|| DataError::Invalid(format!("val batch {b} out of range ({} batches)", self.len())))?;
        let idx = &self.order[b * self.batch..((b + 1) * self.batch).min(self.order.len())];
        let samples = idx.par_iter().map(|&i| self.sample(i, shape)).collect();
        collate(samples, self.ds.nkpt(), 0, b)
    }

    /// All validation batches in order.
    pub fn iter(&self) -> impl Iterator<Item = Result<Batch>> + '_ {
        (0..self.len()).map(move |b| self.build_batch(b))
    }
}

struct State<T> {
    /// Batches built so far and the time their building took (worker or caller thread).
    built: u64,
    build_ns: u64,
    next_job: u64,
    consumed: u64,
    total: u64,
    capacity: u64,
    done: BTreeMap<u64, Result<T>>,
    stop: bool,
}

struct Shared<T> {
    m: Mutex<State<T>>,
    work: Condvar,
    ready: Condvar,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.m.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What a [`Prefetcher`] prepares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchPlan {
    /// First epoch (a resumed run starts later).
    pub start_epoch: usize,
    /// Batches taken from each epoch (`None` = all; a fit's `max_batches` stops epochs early).
    pub batches_per_epoch: Option<usize>,
    /// Batches of the first epoch already trained (a run resumed inside an epoch): building
    /// starts at this batch.
    pub start_batch: usize,
}

/// Work done on the worker thread after a batch is built (e.g. copying its pixels into pinned
/// memory for an asynchronous upload). It must not call the GPU: the training thread may be
/// recording a CUDA graph meanwhile.
pub type BatchStage<T> = Arc<dyn Fn(Batch) -> Result<T> + Send + Sync>;

/// Prepares training batches ahead on worker threads, across epoch boundaries (the next epoch's first batches are
/// built while the caller validates). Batches come out in (epoch, index) order and their bytes do not depend on
/// the number of workers. Dropping it stops and joins the workers. A failed or panicking batch comes back as a
/// [`DataError::Worker`] naming the batch and its images, and stops the pool; with no workers, batches are built
/// in the calling thread when asked for.
pub struct Prefetcher<T = Batch> {
    loader: Arc<TrainLoader>,
    stage: BatchStage<T>,
    shared: Arc<Shared<T>>,
    handles: Vec<JoinHandle<()>>,
    start_epoch: usize,
    nb: u64,
    next_seq: u64,
    failed: bool,
}

/// The message of a caught panic.
fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "panic".into())
}

fn run_job<T>(loader: &TrainLoader, stage: &BatchStage<T>, start_epoch: usize, nb: u64, seq: u64) -> Result<T> {
    let epoch = start_epoch + (seq / nb) as usize;
    let b = (seq % nb) as usize;
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loader.build_batch(epoch, b).and_then(|batch| stage(batch))));
    let (cause, detail) = match built {
        Ok(Ok(t)) => return Ok(t),
        Ok(Err(e)) => ("failed", e.to_string()),
        Err(p) => ("panicked", panic_message(p)),
    };
    let files = loader.batch_files(epoch, b);
    let shown: Vec<String> = files.iter().take(4).map(|f| f.display().to_string()).collect();
    let more = if files.len() > shown.len() { format!(" and {} more", files.len() - shown.len()) } else { String::new() };
    Err(DataError::Worker(format!("epoch {epoch} batch {b} (images {}{more}) {cause}: {detail}", shown.join(", "))))
}

impl TrainLoader {
    /// Image files of batch `b` of `epoch`, in batch order.
    pub fn batch_files(&self, epoch: usize, b: usize) -> Vec<PathBuf> {
        let order = self.epoch_order(epoch);
        let lo = (b * self.batch).min(order.len());
        let hi = ((b + 1) * self.batch).min(order.len());
        order[lo..hi].iter().map(|&i| self.ds.items[i].im_file.clone()).collect()
    }

    /// Starts worker threads that build the batches of `plan` in order, ahead of use, and pass
    /// each through `stage` on the worker thread.
    pub fn prefetch_staged<T: Send + 'static>(self: &Arc<Self>, plan: PrefetchPlan, stage: BatchStage<T>) -> Prefetcher<T> {
        Prefetcher::new(self.clone(), plan, stage)
    }
}

impl<T: Send + 'static> Prefetcher<T> {
    fn new(loader: Arc<TrainLoader>, plan: PrefetchPlan, stage: BatchStage<T>) -> Self {
        let full = loader.batches_per_epoch();
        let nb = plan.batches_per_epoch.map_or(full, |m| m.clamp(1, full)) as u64;
        let start_epoch = plan.start_epoch;
        let epochs = loader.cfg.epochs.saturating_sub(start_epoch) as u64;
        // Sequence numbers count from batch 0 of the first epoch; the batches already trained are
        // neither built nor handed out.
        let skip = (plan.start_batch as u64).min(nb);
        let shared = Arc::new(Shared {
            m: Mutex::new(State {
                built: 0,
                build_ns: 0,
                next_job: skip,
                consumed: skip,
                total: nb * epochs,
                capacity: loader.cfg.prefetch.max(1) as u64,
                done: BTreeMap::new(),
                stop: false,
            }),
            work: Condvar::new(),
            ready: Condvar::new(),
        });
        let mut handles = Vec::new();
        for wi in 0..loader.cfg.workers {
            let sh = shared.clone();
            let ld = loader.clone();
            let st = stage.clone();
            let h = std::thread::Builder::new().name(format!("ptl-data-{wi}")).spawn(move || loop {
                let seq = {
                    let mut g = sh.lock();
                    loop {
                        if g.stop {
                            return;
                        }
                        if g.next_job < g.total && g.next_job < g.consumed + g.capacity {
                            let s = g.next_job;
                            g.next_job += 1;
                            break s;
                        }
                        if g.next_job >= g.total {
                            return;
                        }
                        g = sh.work.wait(g).unwrap_or_else(|p| p.into_inner());
                    }
                };
                let t = std::time::Instant::now();
                let res = run_job(&ld, &st, start_epoch, nb, seq);
                let took = t.elapsed().as_nanos() as u64;
                let mut g = sh.lock();
                (g.built, g.build_ns) = (g.built + 1, g.build_ns + took);
                g.done.insert(seq, res);
                sh.ready.notify_all();
            });
            match h {
                Ok(h) => handles.push(h),
                Err(_) => break, // fewer workers; the consumer builds inline if none started
            }
        }
        Prefetcher { loader, stage, shared, handles, start_epoch, nb, next_seq: skip, failed: false }
    }

    /// Epoch of the next batch.
    pub fn current_epoch(&self) -> usize {
        self.start_epoch + (self.next_seq / self.nb.max(1)) as usize
    }

    /// Batches taken from each epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.nb as usize
    }

    /// Worker threads running (0: batches are built in the calling thread).
    pub fn workers(&self) -> usize {
        self.handles.len()
    }

    /// Batches built so far and the mean seconds one took to build (on its thread, the
    /// stage included): with `w` workers the loader can deliver about `w / mean` batches a
    /// second, whatever the consumer takes.
    pub fn build_stats(&self) -> (u64, f64) {
        let g = self.shared.lock();
        (g.built, if g.built == 0 { 0.0 } else { g.build_ns as f64 * 1e-9 / g.built as f64 })
    }

    /// Next batch in (epoch, index) order; `None` after the last epoch or after an error.
    pub fn next_batch(&mut self) -> Option<Result<T>> {
        let total = self.shared.lock().total;
        if self.failed || self.next_seq >= total {
            return None;
        }
        let seq = self.next_seq;
        let res = if self.handles.is_empty() {
            let t = std::time::Instant::now();
            let r = run_job(&self.loader, &self.stage, self.start_epoch, self.nb, seq);
            let mut g = self.shared.lock();
            (g.built, g.build_ns) = (g.built + 1, g.build_ns + t.elapsed().as_nanos() as u64);
            r
        } else {
            let mut st = self.shared.lock();
            loop {
                if let Some(r) = st.done.remove(&seq) {
                    st.consumed += 1;
                    self.shared.work.notify_all();
                    break r;
                }
                st = self.shared.ready.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        self.next_seq += 1;
        if res.is_err() {
            self.failed = true;
            self.shutdown();
        }
        Some(res)
    }

    /// Iterator over the remaining batches of the current epoch.
    pub fn epoch(&mut self) -> EpochIter<'_, T> {
        let epoch = self.current_epoch();
        EpochIter { p: self, epoch }
    }
}

impl<T> Prefetcher<T> {
    fn shutdown(&mut self) {
        {
            let mut st = self.shared.lock();
            st.stop = true;
        }
        self.shared.work.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl<T: Send + 'static> Iterator for Prefetcher<T> {
    type Item = Result<T>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch()
    }
}

impl<T> Drop for Prefetcher<T> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Batches of one epoch from a [`Prefetcher`].
pub struct EpochIter<'a, T = Batch> {
    p: &'a mut Prefetcher<T>,
    epoch: usize,
}

impl<T: Send + 'static> Iterator for EpochIter<'_, T> {
    type Item = Result<T>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.p.current_epoch() != self.epoch {
            return None;
        }
        self.p.next_batch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 copy of the augmentation and collation gives the plain copy's bytes, for the
    /// separable warp (the default) and the per-pixel one (rotation and shear).
    #[test]
    fn the_avx2_copy_builds_the_plain_copys_bytes() {
        if !wide_vectors() {
            println!("skipping: this CPU has no AVX2, so the loader runs its plain copy only (nothing to compare)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let st = crate::synth_generate(&crate::SynthOptions {
            out: dir.path().to_path_buf(),
            train: 10,
            background: 2,
            val: 0,
            imgsz: 96,
            seed: 3,
            jpeg_quality: 90,
            threads: 2,
            classes: 1,
        })
        .unwrap();
        let ds = Arc::new(
            PoseDataset::open_yaml(&st.yaml, "train", &crate::OpenOptions { imgsz: 96, verbose: false, ..Default::default() }).unwrap(),
        );
        for (degrees, shear) in [(0.0, 0.0), (10.0, 3.0)] {
            let aug = AugmentConfig { degrees, shear, ..AugmentConfig::default() };
            let cfg = TrainConfig { batch: 4, seed: 5, epochs: 2, close_mosaic: 0, aug, workers: 0, ..TrainConfig::default() };
            let loader = TrainLoader::new(ds.clone(), cfg).unwrap();
            for (epoch, b) in [(0, 0), (0, 1), (1, 0)] {
                let order = loader.epoch_order(epoch);
                let idx = &order[b * 4..(b + 1) * 4];
                let wide = loader.build_samples(epoch, b, idx, true).unwrap();
                let plain = loader.build_samples(epoch, b, idx, false).unwrap();
                assert_eq!(wide, plain, "degrees {degrees}, epoch {epoch}, batch {b}");
            }
        }
    }

    #[test]
    fn rect_shapes_spec_examples() {
        assert_eq!(rect_shape(0.75, 0.75, 640), (512, 672));
        assert_eq!(rect_shape(0.5625, 1.5, 640), (672, 672));
        assert_eq!(rect_shape(1.5, 1.5, 640), (672, 448));
    }
}

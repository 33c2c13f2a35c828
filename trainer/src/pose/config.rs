//! Run configuration for pose training, with Ultralytics' defaults (docs/training.md §1) and
//! `key=value` overrides.

use std::path::PathBuf;

use ptl_autograd::{DType, Device};
use serde::{Deserialize, Serialize};

use ptl_data::AugmentConfig;

pub use super::weights::ModelSource;
use crate::{Result, TrainerError};

/// Numeric precision of the training step (docs/trainer.md §5). Read with [`Precision::parse`]'s
/// spellings (`bf16`, `fp16`, …), written as the canonical name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String")]
pub enum Precision {
    /// Plain f32.
    #[serde(rename = "32-true")]
    F32,
    /// bf16 autocast for conv/matmul, f32 master weights, no scaler.
    #[serde(rename = "bf16-mixed")]
    Bf16Mixed,
    /// f16 autocast with a GradScaler.
    #[serde(rename = "16-mixed")]
    F16Mixed,
}

impl TryFrom<String> for Precision {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        Precision::parse(&s).map_err(|_| format!("`{s}`: use 32-true, bf16-mixed or 16-mixed"))
    }
}

impl Precision {
    /// Reads `32-true`, `bf16-mixed` or `16-mixed` (and their spellings).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "32" | "32-true" | "fp32" | "f32" => Ok(Precision::F32),
            "bf16" | "bf16-mixed" => Ok(Precision::Bf16Mixed),
            "16" | "16-mixed" | "fp16" | "f16" => Ok(Precision::F16Mixed),
            other => {
                Err(TrainerError::InvalidArgument { what: "precision", reason: format!("`{other}`: use 32-true, bf16-mixed or 16-mixed") })
            }
        }
    }
    /// The name (`bf16-mixed`, …).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "32-true",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::F16Mixed => "16-mixed",
        }
    }
    /// The autocast compute dtype, if any.
    pub fn autocast(self) -> Option<DType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16Mixed => Some(DType::BF16),
            Precision::F16Mixed => Some(DType::F16),
        }
    }
}

/// Everything a pose training run needs. Defaults follow Ultralytics 8.4.190. Fields missing from a
/// stored configuration (an older checkpoint's) take their defaults.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default)]
pub struct PoseTrainConfig {
    /// Dataset yaml (Ultralytics layout).
    pub data: PathBuf,
    /// Epochs.
    pub epochs: usize,
    /// Images per batch.
    pub batch: usize,
    /// Training image size.
    pub imgsz: usize,
    /// The device.
    #[serde(with = "device_serde")]
    pub device: Device,
    /// The precision.
    pub precision: Precision,
    /// Ultralytics' `amp` switch, resolved once the device is known ([`Self::resolve_amp`]):
    /// `true` is 16-mixed on a CUDA device and 32-true on the CPU, `false` is 32-true; `None`
    /// keeps `precision` as set (a `precision` given after `amp` clears it). `ptl train` starts
    /// from `amp=true`, Ultralytics' default; this struct's `Default` leaves it `None` so that a
    /// program setting `precision` directly gets that precision. Not stored: checkpoints keep
    /// the precision it resolved to.
    #[serde(skip, default)]
    pub amp: Option<bool>,
    /// Ultralytics' AutoBatch (`batch=-1`, or `batch=0.7` for a fraction of device memory; −1
    /// is 0.60), resolved once the device is known ([`Self::resolve_autobatch`]). Not stored:
    /// checkpoints keep the batch it resolved to.
    #[serde(skip)]
    pub autobatch: Option<f64>,
    /// Seed of everything random.
    pub seed: u64,
    /// What to train (Ultralytics' `model`): a model yaml name for the size (`yolo26n-pose.yaml`
    /// … `yolo26x-pose.yaml`, or the bare letter), or weights to start from (a `.safetensors`
    /// state dict with Ultralytics' names, or a ptl `.ckpt`: its EMA weights). See [`ModelSource`].
    pub model: String,
    /// `auto`, `SGD`, `MuSGD` or `AdamW`.
    pub optimizer: String,
    /// Initial learning rate.
    pub lr0: f64,
    /// Final learning rate as a fraction of lr0.
    pub lrf: f64,
    /// SGD momentum / Adam β₁.
    pub momentum: f64,
    /// Weight decay (scaled by batch·accumulate/nbs).
    pub weight_decay: f64,
    /// Warm-up length in epochs.
    pub warmup_epochs: f64,
    /// Momentum at the warm-up's start.
    pub warmup_momentum: f64,
    /// The bias groups' learning rate at the warm-up's start.
    pub warmup_bias_lr: f64,
    /// Cosine decay instead of linear.
    pub cos_lr: bool,
    /// Nominal batch size (accumulation).
    pub nbs: usize,
    /// Last epochs without mosaic.
    pub close_mosaic: usize,
    /// Augmentation gains with Ultralytics' names and meanings (docs/data.md §6); checkpoints written
    /// before they were settings hold none and trained with these defaults.
    pub mosaic: f64,
    /// Hue gain.
    pub hsv_h: f64,
    /// Saturation gain.
    pub hsv_s: f64,
    /// Value gain.
    pub hsv_v: f64,
    /// Rotation range, ±degrees.
    pub degrees: f64,
    /// Translation range, ± fraction.
    pub translate: f64,
    /// The random affine's scale gain: zoom drawn from U(1 − scale, 1 + scale).
    pub scale: f64,
    /// Shear range, ±degrees.
    pub shear: f64,
    /// Perspective range.
    pub perspective: f64,
    /// Vertical flip probability.
    pub flipud: f64,
    /// Horizontal flip probability.
    pub fliplr: f64,
    /// Probability of keeping BGR order.
    pub bgr: f64,
    /// MixUp, CutMix and CopyPaste are not implemented: only 0 (their default) is accepted, so that
    /// a run asking for them fails up front instead of training without them.
    pub mixup: f64,
    /// CutMix probability (only 0 is taken).
    pub cutmix: f64,
    /// Copy-paste probability (only 0 is taken).
    pub copy_paste: f64,
    /// Loader worker threads. `None` (the default): on a GPU every core but two (at least
    /// Ultralytics' min(8, cores), at most 16; never more than the batches per epoch, 0 for one
    /// batch) — a replayed step consumes images faster than eight threads augment them at large
    /// batches — and on the CPU min(2, cores / 8), so that workers do not fight the CPU
    /// backend's own threads. 0 builds batches on the training thread.
    pub workers: Option<usize>,
    /// Gradient clipping max norm (10 in the reference).
    pub clip_max_norm: f64,
    /// 16-mixed grad scaler: the first loss scale (PyTorch's 2¹⁶) and the clean steps after which
    /// it doubles (PyTorch's 2000).
    pub scaler_init_scale: f64,
    /// Clean steps before the loss scaler grows.
    pub scaler_growth_interval: usize,
    /// The loss's assigner: `auto` (the default: `dense` on a CUDA device, `host` elsewhere),
    /// `host` (the task-aligned assigner on host vectors, a few host reads per branch) or `dense`
    /// (fixed-shape tensor ops on the predictions' device, no host read in a step).
    pub loss_assigner: String,
    /// Train on the first `round(n · fraction)` training images (Ultralytics' `fraction`; the
    /// validation split stays whole).
    #[serde(default = "default_fraction")]
    pub fraction: f64,
    /// Early stopping: stop after this many epochs without a better validation fitness (0: never).
    #[serde(default = "default_patience")]
    pub patience: usize,
    /// Also keep `weights/epoch{N}.ckpt` every this many epochs (N 0-based; 0 or less: never).
    #[serde(default)]
    pub save_period: i64,
    /// Loss gains, Ultralytics' `box`, `cls`, `dfl` (the box-side L1 term's), `pose`, `kobj`, `rle`.
    /// (Checkpoints written before the gains were settings hold none: the defaults.)
    #[serde(default)]
    pub loss_gains: LossGains,
    /// Validate after every epoch.
    pub val: bool,
    /// Stop an epoch after this many batches (tiny test runs); `None` = the whole epoch.
    pub max_batches: Option<usize>,
    /// Steps excluded from the timing statistics at the start (warm caches, first allocations);
    /// 10 as in the benchmark protocol.
    pub timing_warmup_steps: usize,
    /// Trace 16 steps near the end of the run with CUPTI for the GPU time per step (CUDA only).
    pub gpu_time: bool,
    /// Time forward, loss, backward, optimizer and EMA separately, synchronising the device after
    /// each (diagnosis only: it slows every step).
    pub profile: bool,
    /// Test hook: building this (epoch, batch) panics inside the loader.
    #[doc(hidden)]
    #[serde(skip)]
    pub inject_loader_panic_at: Option<(usize, usize)>,
    /// Output folder (checkpoints, results.csv, summary.json, plots): `project/name` unless set
    /// itself. A new run whose folder already holds one moves to a numbered sibling (`train2`, …)
    /// unless `exist_ok`.
    pub save_dir: PathBuf,
    /// Ultralytics' `project` and `name`: setting either makes `save_dir` = `project/name`.
    pub project: PathBuf,
    /// Run folder name under `project`.
    pub name: String,
    /// Train into an existing `save_dir` (the CLI's numbering is off).
    #[serde(default)]
    pub exist_ok: bool,
    /// Layers whose parameters are frozen (Ultralytics' `freeze`: `freeze=N` is layers 0…N−1,
    /// `freeze=0,3,5` a list); empty: nothing frozen.
    #[serde(deserialize_with = "list_serde::freeze")]
    pub freeze: Vec<usize>,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Replay plugins to enable, by registered name (empty: native, the default).
    #[serde(deserialize_with = "list_serde::names")]
    pub replay: Vec<String>,
    /// Per-plugin configuration, by name (JSON; absent: the plugin's defaults).
    pub replay_config: serde_json::Map<String, serde_json::Value>,
    /// End this invocation after this many epochs (checkpoint written), as if the process was
    /// killed there; `resume` continues. Used for time-boxed runs and kill/resume tests.
    pub stop_after_epochs: Option<usize>,
    /// Draw results.png, the PR curves and prediction images at the end.
    pub plots: bool,
    /// Write COCO JSON at each validation (`predictions.json`, `val_gt.json` in `save_dir`): the
    /// final one holds the last epoch's predictions, for pycocotools or any COCO tool.
    pub save_json: bool,
    /// Print a progress bar.
    pub progress: bool,
    /// 32-true's convolutions on a GPU may run on tensor cores in TF32, as PyTorch's default
    /// (`torch.backends.cudnn.allow_tf32 = True`, so Ultralytics' `amp=False`); matmuls stay full
    /// FP32. `false`: strict FP32 everywhere. The half precisions and the CPU are unaffected.
    pub tf32: bool,
    /// On a GPU, the trunk's and neck's activations stored channels-last (N, H, W, C, cuDNN's own
    /// layout: its convolutions run without layout conversions); values change only by the
    /// kernels' summation orders. `false` (default): N, C, H, W. Refused on the CPU.
    pub channels_last: bool,
    /// Several ranks, no `replay=`: each bucket of gradients is summed over the ranks during the
    /// update's last backward, as soon as backward has finished its parameters (PyTorch DDP's
    /// overlap); the same bytes as summing after backward (`false`). A replayed step keeps the
    /// sum after backward, where its recording holds it, and so does a fit where a rank has
    /// callbacks (one may read or change the gradients after backward).
    pub overlap_all_reduce: bool,
}

mod device_serde {
    use ptl_autograd::Device;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&d.to_string())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Device, D::Error> {
        let s = String::deserialize(d)?;
        Device::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// List fields that also read Ultralytics' scalar spellings: `freeze=3` (layers 0…2) and
/// `replay=a,b`.
mod list_serde {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Freeze {
        Count(usize),
        Layers(Vec<usize>),
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Names {
        One(String),
        Many(Vec<String>),
    }

    pub fn freeze<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<usize>, D::Error> {
        match Freeze::deserialize(d).map_err(|_| serde::de::Error::custom("expected a layer count N or a list of layer indices"))? {
            Freeze::Count(n) => Ok((0..n).collect()),
            Freeze::Layers(v) => Ok(v),
        }
    }

    pub fn names<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        let names = match Names::deserialize(d).map_err(|_| serde::de::Error::custom("expected comma-separated names"))? {
            Names::One(s) => s.split(',').map(str::to_string).collect(),
            Names::Many(v) => v,
        };
        Ok(names.into_iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
    }
}

impl Default for PoseTrainConfig {
    fn default() -> Self {
        let aug = AugmentConfig::default();
        PoseTrainConfig {
            data: PathBuf::from("data.yaml"),
            epochs: 100,
            batch: 16,
            imgsz: 640,
            device: Device::Cpu,
            precision: Precision::F32,
            amp: None,
            autobatch: None,
            seed: 0,
            model: DEFAULT_MODEL.into(),
            optimizer: "auto".into(),
            lr0: 0.01,
            lrf: 0.01,
            momentum: 0.937,
            weight_decay: 0.0005,
            warmup_epochs: 3.0,
            warmup_momentum: 0.8,
            warmup_bias_lr: 0.1,
            cos_lr: false,
            nbs: 64,
            close_mosaic: 10,
            mosaic: aug.mosaic,
            hsv_h: aug.hsv_h,
            hsv_s: aug.hsv_s,
            hsv_v: aug.hsv_v,
            degrees: aug.degrees,
            translate: aug.translate,
            scale: aug.scale,
            shear: aug.shear,
            perspective: aug.perspective,
            flipud: aug.flipud,
            fliplr: aug.fliplr,
            bgr: aug.bgr,
            mixup: 0.0,
            cutmix: 0.0,
            copy_paste: 0.0,
            workers: None,
            clip_max_norm: 10.0,
            scaler_init_scale: 65536.0,
            scaler_growth_interval: 2000,
            loss_assigner: "auto".into(),
            loss_gains: LossGains::default(),
            fraction: 1.0,
            patience: default_patience(),
            save_period: -1,
            val: true,
            max_batches: None,
            timing_warmup_steps: 10,
            gpu_time: true,
            profile: false,
            inject_loader_panic_at: None,
            save_dir: PathBuf::from("runs/pose/train"),
            project: PathBuf::from("runs/pose"),
            name: "train".into(),
            exist_ok: false,
            freeze: Vec::new(),
            resume: None,
            replay: Vec::new(),
            replay_config: serde_json::Map::new(),
            stop_after_epochs: None,
            plots: true,
            save_json: false,
            progress: true,
            tf32: true,
            channels_last: false,
            overlap_all_reduce: true,
        }
    }
}

impl PoseTrainConfig {
    /// Turns a pending `amp=true|false` into the precision it means on this run's device (see
    /// [`Self::amp`]); a no-op when a precision was set after it.
    pub fn resolve_amp(&mut self) {
        if let Some(on) = self.amp.take() {
            self.precision = if on && self.device.is_cuda() { Precision::F16Mixed } else { Precision::F32 };
        }
    }

    /// Settles a pending AutoBatch request where no device needs probing: on the CPU Ultralytics'
    /// default 16 (as Ultralytics does there), said on stderr. On a CUDA device the request stays
    /// pending: the fit probes the device with the run's model and data (`pose::autobatch`).
    pub fn resolve_autobatch(&mut self) -> Result<()> {
        if self.autobatch.is_none() || self.device.is_cuda() {
            return Ok(());
        }
        self.autobatch = None;
        self.batch = 16;
        log::warn!("AutoBatch: intended for CUDA devices; using the default CPU batch size 16");
        Ok(())
    }

    /// Loader workers for a run of `batches_per_epoch` batches on `device` (see [`Self::workers`]).
    pub fn effective_workers(&self, batches_per_epoch: usize) -> usize {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let n = match (self.workers, self.device) {
            (Some(w), _) => w,
            (None, Device::Cuda(_)) => cores.saturating_sub(2).max(8.min(cores)).min(16),
            (None, Device::Cpu) => 2.min(cores / 8),
        };
        if batches_per_epoch <= 1 {
            0
        } else {
            n.min(batches_per_epoch)
        }
    }

    /// The loader's augmentation settings (docs/data.md §6) from the gains above.
    pub fn augment(&self) -> AugmentConfig {
        AugmentConfig {
            mosaic: self.mosaic,
            degrees: self.degrees,
            translate: self.translate,
            scale: self.scale,
            shear: self.shear,
            perspective: self.perspective,
            hsv_h: self.hsv_h,
            hsv_s: self.hsv_s,
            hsv_v: self.hsv_v,
            flipud: self.flipud,
            fliplr: self.fliplr,
            bgr: self.bgr,
        }
    }

    /// Checks values that would otherwise fail deep inside the run (or, worse, train on
    /// quietly): sizes that cannot be allocated and non-finite or absurd hyperparameters.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(TrainerError::InvalidArgument { what: "config", reason });
        if self.epochs == 0 || self.epochs > MAX_EPOCHS {
            return bad(format!("epochs {} must be in 1..={MAX_EPOCHS}", self.epochs));
        }
        if self.batch == 0 || self.batch > MAX_BATCH {
            return bad(format!("batch {} must be in 1..={MAX_BATCH}", self.batch));
        }
        if self.imgsz < 32 || self.imgsz % 32 != 0 || self.imgsz > MAX_IMGSZ {
            return bad(format!("imgsz {} must be a multiple of 32 in 32..={MAX_IMGSZ}", self.imgsz));
        }
        let pixels = self.batch as u64 * self.imgsz as u64 * self.imgsz as u64;
        if pixels > MAX_BATCH_PIXELS {
            return bad(format!(
                "batch {} × imgsz {}² = {pixels} pixels per batch is over the {MAX_BATCH_PIXELS} limit \
                 (the mosaic canvas and activations would not fit): lower batch or imgsz",
                self.batch, self.imgsz
            ));
        }
        if let Some(w) = self.workers {
            let limit = ptl_data::thread_limit();
            if w > limit {
                return bad(format!(
                    "workers {w} is more than the {limit} loader threads this machine can use (4 per core; auto picks for you)"
                ));
            }
        }
        if self.max_batches == Some(0) {
            return bad("max_batches 0 would train nothing: give a positive number, or all".into());
        }
        if self.save_dir.as_os_str().is_empty() {
            return bad("save_dir is empty: give the run folder (save_dir=runs/pose/exp) or project= and name=".into());
        }
        if self.nbs == 0 {
            return bad("nbs must be at least 1".into());
        }
        // (name, value, lowest, highest, lowest excluded)
        if self.scaler_growth_interval == 0 {
            return bad("scaler_growth_interval must be at least 1".into());
        }
        ModelSource::parse(&self.model)?;
        if !["auto", "host", "dense"].contains(&self.loss_assigner.as_str()) {
            return bad(format!("loss_assigner `{}`: expected auto, host or dense", self.loss_assigner));
        }
        for (name, v, what) in
            [("mixup", self.mixup, "MixUp"), ("cutmix", self.cutmix, "CutMix"), ("copy_paste", self.copy_paste, "CopyPaste")]
        {
            if v != 0.0 {
                return bad(format!("{name} = {v}: ptl does not implement {what} (only {name}=0, the default, is accepted)"));
            }
        }
        let g = &self.loss_gains;
        let ranges: [(&str, f64, f64, f64, bool); 29] = [
            ("fraction", self.fraction, 0.0, 1.0, true),
            ("box", g.box_gain, 0.0, 1000.0, false),
            ("cls", g.cls, 0.0, 1000.0, false),
            ("dfl", g.dfl, 0.0, 1000.0, false),
            ("pose", g.pose, 0.0, 1000.0, false),
            ("kobj", g.kobj, 0.0, 1000.0, false),
            ("rle", g.rle, 0.0, 1000.0, false),
            ("lr0", self.lr0, 0.0, 10.0, true),
            ("lrf", self.lrf, 0.0, 10.0, true),
            ("momentum", self.momentum, 0.0, 1.0, false),
            ("weight_decay", self.weight_decay, 0.0, 1.0, false),
            ("warmup_epochs", self.warmup_epochs, 0.0, MAX_EPOCHS as f64, false),
            ("warmup_momentum", self.warmup_momentum, 0.0, 1.0, false),
            ("warmup_bias_lr", self.warmup_bias_lr, 0.0, 10.0, false),
            ("mosaic", self.mosaic, 0.0, 1.0, false),
            // Ultralytics' fraction keys lie in [0, 1]; rotation and shear in degrees.
            ("hsv_h", self.hsv_h, 0.0, 1.0, false),
            ("hsv_s", self.hsv_s, 0.0, 1.0, false),
            ("hsv_v", self.hsv_v, 0.0, 1.0, false),
            ("degrees", self.degrees, 0.0, 180.0, false),
            ("translate", self.translate, 0.0, 1.0, false),
            ("scale", self.scale, 0.0, 1.0, false),
            ("shear", self.shear, 0.0, 80.0, false),
            ("perspective", self.perspective, 0.0, 1.0, false),
            ("flipud", self.flipud, 0.0, 1.0, false),
            ("fliplr", self.fliplr, 0.0, 1.0, false),
            ("bgr", self.bgr, 0.0, 1.0, false),
            ("clip_max_norm", self.clip_max_norm, 0.0, 1e6, true),
            ("lr0·lrf", self.lr0 * self.lrf, 0.0, 10.0, true),
            ("scaler_init_scale", self.scaler_init_scale, 0.0, f64::from(f32::MAX), true),
        ];
        for (name, v, lo, hi, open_lo) in ranges {
            let low_ok = if open_lo { v > lo } else { v >= lo };
            if !v.is_finite() || !low_ok || v > hi {
                let lo_br = if open_lo { "(" } else { "[" };
                return bad(format!("{name} = {v} is outside {lo_br}{lo}, {hi}] (see `ptl cfg` for the defaults)"));
            }
        }
        Ok(())
    }

    /// Every key `ptl train` accepts, with its default and what it does (`ptl cfg`).
    pub fn keys() -> Vec<(&'static str, String, &'static str)> {
        let d = PoseTrainConfig::default();
        let opt = |v: Option<usize>| v.map_or("auto".to_string(), |n| n.to_string());
        vec![
            ("data", d.data.display().to_string(), "dataset yaml (Ultralytics layout) or a COCO keypoints JSON"),
            ("epochs", d.epochs.to_string(), "epochs to train"),
            ("batch", d.batch.to_string(), "images per batch"),
            ("imgsz", d.imgsz.to_string(), "training image size (multiple of 32)"),
            ("device", "auto".into(), "auto, cpu, cuda:N or N, or N,M,… for one worker process per GPU (also --device; auto picks a GPU when there is one)"),
            ("precision", d.precision.name().to_string(), "32-true, bf16-mixed or 16-mixed (also --precision)"),
            ("amp", "true".into(), "Ultralytics' switch: true = 16-mixed on a GPU (32-true on the CPU), false = 32-true; or a precision name"),
            ("tf32", d.tf32.to_string(), "32-true on a GPU: convolutions in TF32 on tensor cores as PyTorch's default (false: strict FP32)"),
            ("channels_last", d.channels_last.to_string(), "on a GPU: activations stored N, H, W, C (cuDNN's layout; false: N, C, H, W)"),
            ("overlap_all_reduce", d.overlap_all_reduce.to_string(), "several GPUs, no replay: gradient buckets summed over the ranks during backward (false: after it; the same bytes)"),
            ("seed", d.seed.to_string(), "random seed (also --seed)"),
            ("model", d.model.clone(), "yolo26{n,s,m,l,x}-pose.yaml (the size; or the letter), or weights to start from: a .safetensors with Ultralytics names or a ptl .ckpt (its EMA weights)"),
            ("optimizer", d.optimizer.clone(), "auto, SGD, MuSGD or AdamW (auto is resolved once and stored in checkpoints)"),
            ("lr0", d.lr0.to_string(), "initial learning rate"),
            ("lrf", d.lrf.to_string(), "final learning rate as a fraction of lr0"),
            ("momentum", d.momentum.to_string(), "SGD momentum / Adam beta1"),
            ("weight_decay", d.weight_decay.to_string(), "weight decay (scaled by batch / nbs)"),
            ("warmup_epochs", d.warmup_epochs.to_string(), "warm-up length in epochs"),
            ("warmup_momentum", d.warmup_momentum.to_string(), "momentum at the start of the warm-up"),
            ("warmup_bias_lr", d.warmup_bias_lr.to_string(), "bias learning rate at the start of the warm-up"),
            ("cos_lr", d.cos_lr.to_string(), "cosine learning-rate schedule"),
            ("nbs", d.nbs.to_string(), "nominal batch size (gradient accumulation up to it)"),
            ("close_mosaic", d.close_mosaic.to_string(), "turn mosaic off for the last N epochs (0 = never)"),
            ("mosaic", d.mosaic.to_string(), "mosaic probability"),
            ("hsv_h", d.hsv_h.to_string(), "hue jitter gain (fraction)"),
            ("hsv_s", d.hsv_s.to_string(), "saturation jitter gain (fraction)"),
            ("hsv_v", d.hsv_v.to_string(), "value (brightness) jitter gain (fraction)"),
            ("degrees", d.degrees.to_string(), "rotation range ± degrees"),
            ("translate", d.translate.to_string(), "translation range ± fraction of the image size"),
            ("scale", d.scale.to_string(), "zoom gain: scale drawn from U(1 − scale, 1 + scale)"),
            ("shear", d.shear.to_string(), "shear range ± degrees"),
            ("perspective", d.perspective.to_string(), "perspective gain (0 … 0.001 is sensible)"),
            ("flipud", d.flipud.to_string(), "vertical flip probability"),
            ("fliplr", d.fliplr.to_string(), "horizontal flip probability (keypoints swapped by flip_idx)"),
            ("bgr", d.bgr.to_string(), "probability of feeding an image as BGR instead of RGB"),
            ("mixup", d.mixup.to_string(), "MixUp probability: not implemented, only 0"),
            ("cutmix", d.cutmix.to_string(), "CutMix probability: not implemented, only 0"),
            ("copy_paste", d.copy_paste.to_string(), "CopyPaste probability: not implemented, only 0"),
            ("workers", opt(d.workers), "loader threads (auto: cores − 2 on a GPU, at least min(8, cores), at most 16; min(2, cores/8) on the CPU)"),
            ("val", d.val.to_string(), "validate after every epoch"),
            ("clip_max_norm", d.clip_max_norm.to_string(), "gradient clipping: largest global L2 norm"),
            ("scaler_init_scale", d.scaler_init_scale.to_string(), "16-mixed: the grad scaler's first loss scale"),
            ("scaler_growth_interval", d.scaler_growth_interval.to_string(), "16-mixed: clean steps before the loss scale doubles"),
            ("loss_assigner", d.loss_assigner.clone(), "auto (dense on a CUDA device, else host), host (the reference's data-dependent assigner), or dense (fixed-shape assigner and loss on the device, no host read)"),
            ("fraction", d.fraction.to_string(), "share of the training images to use, in file order (0 < f ≤ 1)"),
            ("patience", d.patience.to_string(), "early stopping: epochs without a better validation fitness (0 = never stop)"),
            ("save_period", d.save_period.to_string(), "also keep weights/epoch{N}.ckpt every N epochs (≤ 0: off)"),
            ("box", d.loss_gains.box_gain.to_string(), "box (CIoU) loss gain"),
            ("cls", d.loss_gains.cls.to_string(), "classification loss gain"),
            ("dfl", d.loss_gains.dfl.to_string(), "gain of the box-side L1 term (Ultralytics' dfl gain, reg_max 1)"),
            ("pose", d.loss_gains.pose.to_string(), "keypoint (OKS) loss gain"),
            ("kobj", d.loss_gains.kobj.to_string(), "keypoint visibility loss gain"),
            ("rle", d.loss_gains.rle.to_string(), "keypoint RLE loss gain"),
            ("max_batches", "all".into(), "stop each epoch after this many batches (quick runs)"),
            ("project", d.project.display().to_string(), "runs folder: the run writes to project/name"),
            ("name", d.name.clone(), "run folder name under project; an existing run there gets a numbered sibling (name2, …)"),
            ("save_dir", d.save_dir.display().to_string(), "the run folder itself (instead of project/name)"),
            ("exist_ok", d.exist_ok.to_string(), "train into an existing project folder instead of a new numbered one"),
            ("freeze", "none".into(), "freeze layers: N = layers 0…N−1, or a list 0,3,5 (frozen parameters get no gradient)"),
            ("resume", "none".into(), "continue from a checkpoint (its settings are restored; only machine keys may change)"),
            ("plots", d.plots.to_string(), "draw results.png, BoxPR_curve.png, PosePR_curve.png and validation predictions at the end"),
            ("progress", d.progress.to_string(), "a line per epoch on stderr, and a progress bar on a terminal (also verbose=, as in Ultralytics)"),
            ("save_json", d.save_json.to_string(), "write predictions.json (COCO results) and val_gt.json (COCO ground truth) at each validation"),
            ("gpu_time", d.gpu_time.to_string(), "trace 16 steps with CUPTI for the GPU time per step (CUDA)"),
            ("profile", d.profile.to_string(), "time each stage with device synchronisation (diagnosis only)"),
            (
                "replay",
                "none".into(),
                "replay plugins to enable, comma-separated (e.g. feature,stem; all = every ptl replay plugin); none = native",
            ),
            ("replay_config", "{}".into(), "JSON settings per replay plugin, e.g. {\"stem\": {\"warmup_calls\": 2}}"),
        ]
    }
}

/// The whole training split.
fn default_fraction() -> f64 {
    1.0
}

/// Ultralytics' default patience.
fn default_patience() -> usize {
    100
}

/// The six loss gains (docs/training.md §1: box 7.5, cls 0.5, dfl 1.5, pose 12, kobj 1, rle 1).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossGains {
    /// `box`.
    #[serde(rename = "box")]
    pub box_gain: f64,
    /// `cls`.
    pub cls: f64,
    /// `dfl` (the box-side L1 term).
    pub dfl: f64,
    /// `pose`.
    pub pose: f64,
    /// `kobj`.
    pub kobj: f64,
    /// `rle`.
    pub rle: f64,
}

impl Default for LossGains {
    fn default() -> Self {
        let l = crate::loss::LossConfig::default();
        LossGains { box_gain: l.box_gain, cls: l.cls_gain, dfl: l.l1_gain, pose: l.pose_gain, kobj: l.kobj_gain, rle: l.rle_gain }
    }
}

/// The model a run trains when `model` is not given.
pub const DEFAULT_MODEL: &str = "yolo26n-pose.yaml";

/// Largest `epochs`.
pub const MAX_EPOCHS: usize = 100_000;
/// Largest `batch`.
pub const MAX_BATCH: usize = 4096;
/// Largest `imgsz` (a 2·imgsz mosaic canvas of 8192 px is 0.8 GB of pixels).
pub const MAX_IMGSZ: usize = 8192;
/// Largest batch × imgsz² (pixels of one batch).
pub const MAX_BATCH_PIXELS: u64 = 1 << 30;

/// Settings a resumed run may change: where and how it runs, not what it computes.
pub const MACHINE_KEYS: [&str; 15] = [
    "device",
    "workers",
    "progress",
    "plots",
    "save_json",
    "gpu_time",
    "profile",
    "timing_warmup_steps",
    "save_dir",
    "project",
    "name",
    "exist_ok",
    "resume",
    "stop_after_epochs",
    "inject_loader_panic_at",
];

impl PoseTrainConfig {
    /// The settings a checkpoint's run was trained with.
    pub fn from_checkpoint(path: &std::path::Path) -> Result<PoseTrainConfig> {
        let manifest = crate::fit::checkpoint::read_manifest(path)?;
        serde_json::from_value(manifest.train_args).map_err(|e| TrainerError::Checkpoint {
            path: path.to_path_buf(),
            msg: format!("its run settings cannot be read ({e}); it was written by ptl {}", manifest.ptl_version),
        })
    }

    /// The configuration to resume `path` with: the run's own settings, then `overrides`
    /// (`key=value`, as on the command line). A machine setting may change; a setting that
    /// changes the training is a [`TrainerError::ResumeMismatch`] naming both values.
    pub fn for_resume(path: &std::path::Path, overrides: &[(String, String)]) -> Result<PoseTrainConfig> {
        crate::fit::checkpoint::refuse_resume_from_weights(path, &crate::fit::checkpoint::read_manifest(path)?)?;
        let stored = PoseTrainConfig::from_checkpoint(path)?;
        let mut cfg = stored.clone();
        // ptl writes only where the user says, never where the file says: a checkpoint in a run's
        // `weights/` folder resumes into that run folder (even if moved); one elsewhere into
        // save_dir=/project=+name= as given, else a new numbered folder of the default project.
        let defaults = PoseTrainConfig::default();
        (cfg.project, cfg.name, cfg.exist_ok) = (defaults.project, defaults.name, false);
        cfg.save_dir = Self::run_dir_of(path).unwrap_or(defaults.save_dir);
        cfg.resume = Some(path.to_path_buf());
        // How the earlier process was to end is not part of the run.
        cfg.stop_after_epochs = None;
        cfg.inject_loader_panic_at = None;
        for (k, v) in overrides.iter().filter(|(k, _)| k != "resume") {
            cfg.set(k, v)?;
        }
        cfg.resume = Some(path.to_path_buf());
        cfg.check_resume_against(&stored, path)?;
        Ok(cfg)
    }

    /// The run folder a checkpoint belongs to: `<run>/weights/<file>` → `<run>`.
    pub fn run_dir_of(checkpoint: &std::path::Path) -> Option<PathBuf> {
        let weights = checkpoint.parent().filter(|p| p.file_name().is_some_and(|n| n == "weights"))?;
        Some(weights.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new(".")).to_path_buf())
    }

    /// Checks that every setting that shapes the training equals the checkpoint's.
    pub fn check_resume(&self, path: &std::path::Path) -> Result<()> {
        self.check_resume_against(&PoseTrainConfig::from_checkpoint(path)?, path)
    }

    /// [`PoseTrainConfig::check_resume`] against the settings `stored` read from `path`.
    fn check_resume_against(&self, stored: &PoseTrainConfig, path: &std::path::Path) -> Result<()> {
        let json = |c: &PoseTrainConfig| serde_json::to_value(c).unwrap_or(serde_json::Value::Null);
        let (a, b) = (json(stored), json(self));
        let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
            return Ok(());
        };
        for (key, stored_v) in a {
            if MACHINE_KEYS.contains(&key.as_str()) {
                continue;
            }
            let given = b.get(key).cloned().unwrap_or(serde_json::Value::Null);
            if given != *stored_v {
                return Err(TrainerError::ResumeMismatch {
                    path: path.to_path_buf(),
                    key: key.clone(),
                    stored: stored_v.to_string(),
                    given: given.to_string(),
                });
            }
        }
        Ok(())
    }
}

/// The accepted key nearest to `key` by edit distance (at most a third of its length, and 3), for
/// "did you mean …" on a typo.
pub(super) fn closest_key(key: &str) -> Option<&'static str> {
    nearest_key(key, PoseTrainConfig::keys().into_iter().map(|(k, _, _)| k))
}

/// The candidate nearest to `key` by edit distance (at most a third of its length, and 3; ties to
/// the alphabetically first), for "did you mean …" wherever keys are typed (`ptl val` too).
pub fn nearest_key<'a>(key: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (key.chars().count() / 3).clamp(1, 3);
    candidates.into_iter().map(|k| (edit_distance(key, k), k)).filter(|(d, _)| *d <= limit).min_by_key(|(d, k)| (*d, *k)).map(|(_, k)| k)
}

/// Levenshtein distance over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1).min(row[j] + 1).min(diag + usize::from(ca != *cb));
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

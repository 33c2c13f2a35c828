//! Run configuration for pose training, with Ultralytics' defaults (training.md §1) and
//! `key=value` overrides.

use std::path::PathBuf;

use ptl_autograd::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// Numeric precision of the training step (trainer.md §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

impl Precision {
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

/// Everything a pose training run needs. Defaults follow Ultralytics 8.4.190.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PoseTrainConfig {
    /// Dataset yaml (Ultralytics layout).
    pub data: PathBuf,
    pub epochs: usize,
    pub batch: usize,
    pub imgsz: usize,
    #[serde(with = "device_serde")]
    pub device: Device,
    pub precision: Precision,
    pub seed: u64,
    /// Model scale letter (n, s, m, l, x).
    pub scale: String,
    pub optimizer: String,
    pub lr0: f64,
    pub lrf: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub warmup_epochs: f64,
    pub warmup_momentum: f64,
    pub warmup_bias_lr: f64,
    pub cos_lr: bool,
    pub nbs: usize,
    pub close_mosaic: usize,
    pub mosaic: f64,
    /// Loader worker threads. `None` (the default): Ultralytics' rule on a GPU — min(8, CPU
    /// cores, batches per epoch), 0 for one batch — and on the CPU min(2, cores / 8), so
    /// that workers do not fight the CPU backend's own threads. 0 builds batches on the
    /// training thread.
    pub workers: Option<usize>,
    /// Gradient clipping max norm (10 in the reference).
    pub clip_max_norm: f64,
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
    /// Output folder (checkpoints, results.csv, summary.json, plots).
    pub save_dir: PathBuf,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Replay plugins to enable (`None` = all registered, `Some([])` = native).
    pub plugins: Option<Vec<String>>,
    /// End this invocation after this many epochs (checkpoint written), as if the process was
    /// killed there; `resume` continues. Used for time-boxed runs and kill/resume tests.
    pub stop_after_epochs: Option<usize>,
    /// Draw plots and prediction images at the end.
    pub plots: bool,
    /// Print a progress bar.
    pub progress: bool,
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

impl Default for PoseTrainConfig {
    fn default() -> Self {
        PoseTrainConfig {
            data: PathBuf::from("data.yaml"),
            epochs: 100,
            batch: 16,
            imgsz: 640,
            device: Device::Cpu,
            precision: Precision::F32,
            seed: 0,
            scale: "n".into(),
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
            mosaic: 1.0,
            workers: None,
            clip_max_norm: 10.0,
            val: true,
            max_batches: None,
            timing_warmup_steps: 10,
            gpu_time: true,
            profile: false,
            inject_loader_panic_at: None,
            save_dir: PathBuf::from("runs/pose/train"),
            resume: None,
            plugins: Some(Vec::new()),
            stop_after_epochs: None,
            plots: true,
            progress: true,
        }
    }
}

impl PoseTrainConfig {
    /// Loader workers for a run of `batches_per_epoch` batches on `device` (see [`Self::workers`]).
    pub fn effective_workers(&self, batches_per_epoch: usize) -> usize {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let n = match (self.workers, self.device) {
            (Some(w), _) => w,
            (None, Device::Cuda(_)) => 8.min(cores),
            (None, Device::Cpu) => 2.min(cores / 8),
        };
        if batches_per_epoch <= 1 {
            0
        } else {
            n.min(batches_per_epoch)
        }
    }

    /// Applies one `key=value` override (Ultralytics spelling).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let bad = |reason: String| TrainerError::InvalidArgument { what: "override", reason };
        let num = |v: &str| v.parse::<f64>().map_err(|_| bad(format!("`{key}={v}`: expected a number")));
        let int = |v: &str| v.parse::<usize>().map_err(|_| bad(format!("`{key}={v}`: expected a non-negative integer")));
        let boolean = |v: &str| match v.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => Err(bad(format!("`{key}={v}`: expected true or false"))),
        };
        match key {
            "data" => self.data = PathBuf::from(value),
            "epochs" => self.epochs = int(value)?,
            "batch" => self.batch = int(value)?,
            "imgsz" => self.imgsz = int(value)?,
            "device" => self.device = Device::parse(value).map_err(|e| bad(e.to_string()))?,
            "precision" | "amp" => self.precision = Precision::parse(value)?,
            "seed" => self.seed = int(value)? as u64,
            "scale" | "model" => self.scale = value.to_string(),
            "optimizer" => self.optimizer = value.to_string(),
            "lr0" => self.lr0 = num(value)?,
            "lrf" => self.lrf = num(value)?,
            "momentum" => self.momentum = num(value)?,
            "weight_decay" => self.weight_decay = num(value)?,
            "warmup_epochs" => self.warmup_epochs = num(value)?,
            "warmup_momentum" => self.warmup_momentum = num(value)?,
            "warmup_bias_lr" => self.warmup_bias_lr = num(value)?,
            "cos_lr" => self.cos_lr = boolean(value)?,
            "nbs" => self.nbs = int(value)?,
            "close_mosaic" => self.close_mosaic = int(value)?,
            "mosaic" => self.mosaic = num(value)?,
            "workers" => self.workers = Some(int(value)?),
            "val" => self.val = boolean(value)?,
            "max_batches" => self.max_batches = Some(int(value)?),
            "project" | "save_dir" => self.save_dir = PathBuf::from(value),
            "resume" => self.resume = Some(PathBuf::from(value)),
            "plots" => self.plots = boolean(value)?,
            "gpu_time" => self.gpu_time = boolean(value)?,
            "profile" => self.profile = boolean(value)?,
            "plugins" => self.plugins = Some(value.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect()),
            _ => return Err(bad(format!("unknown key `{key}` (see `ptl train --help` for the list)"))),
        }
        Ok(())
    }

    /// Checks values that would otherwise fail deep inside the run.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(TrainerError::InvalidArgument { what: "config", reason });
        if self.epochs == 0 {
            return bad("epochs must be at least 1".into());
        }
        if self.batch == 0 {
            return bad("batch must be at least 1".into());
        }
        if self.imgsz < 32 || self.imgsz % 32 != 0 {
            return bad(format!("imgsz {} must be a multiple of 32 (≥ 32)", self.imgsz));
        }
        if !(self.lr0 > 0.0 && self.lr0.is_finite()) {
            return bad(format!("lr0 {} must be positive", self.lr0));
        }
        Ok(())
    }
}

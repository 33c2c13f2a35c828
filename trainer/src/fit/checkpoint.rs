//! Checkpoints: one safetensors file holding every tensor (model, EMA, optimizer state) under a
//! prefix, with a JSON manifest (loop counters, RNG, scheduler/scaler/callback/plugin state) in
//! the header metadata. Written atomically: temporary file, fsync, rename.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use ptl_autograd::module::{from_safetensors_bytes, safetensors_metadata, to_safetensors_bytes_with_metadata};
use ptl_autograd::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// Version of the manifest layout; bump when fields change meaning.
pub const CHECKPOINT_FORMAT: u32 = 1;
const MANIFEST_KEY: &str = "ptl.manifest";

/// Loop counters and RNG state needed to continue a run exactly.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// Last completed epoch (0-based); −1 before the first epoch ends.
    pub epoch: i64,
    /// Optimizer steps taken.
    pub global_step: u64,
    /// Global batch index of the last optimizer step (−1 before the first).
    pub last_opt_step: i64,
    /// Per-step losses so far (the run's loss sequence, hashed in the summary).
    pub step_losses: Vec<f64>,
    pub best_fitness: Option<f64>,
}

/// Everything except tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub ptl_version: String,
    pub loop_state: LoopState,
    /// Run arguments as given (config + overrides).
    pub train_args: serde_json::Value,
    /// Optimizer/scheduler/scaler/EMA scalar state (tensors live in the file body).
    pub optimizer: serde_json::Value,
    pub scaler: serde_json::Value,
    pub ema: serde_json::Value,
    pub criterion: serde_json::Value,
    pub callbacks: serde_json::Map<String, serde_json::Value>,
    pub plugins: serde_json::Map<String, serde_json::Value>,
    /// CUDA-graph recordings are never serialised: they are rebuilt after a restore.
    pub recordings: String,
}

/// A loaded or to-be-saved checkpoint.
pub struct Checkpoint {
    pub manifest: Manifest,
    /// Named tensors; prefixes `model.`, `ema.`, `optim.` keep the parts apart.
    pub tensors: Vec<(String, Tensor)>,
}

impl Checkpoint {
    /// Tensors under `prefix.` with the prefix stripped.
    pub fn part(&self, prefix: &str) -> HashMap<String, Tensor> {
        let p = format!("{prefix}.");
        self.tensors.iter().filter_map(|(n, t)| n.strip_prefix(&p).map(|k| (k.to_string(), t.clone()))).collect()
    }
}

fn io(path: &Path, source: std::io::Error) -> TrainerError {
    TrainerError::Io { path: path.to_path_buf(), source }
}

/// Writes `ckpt` to `path` atomically.
pub fn save_checkpoint(path: &Path, ckpt: &Checkpoint) -> Result<()> {
    let manifest = serde_json::to_string(&ckpt.manifest)
        .map_err(|e| TrainerError::InvalidArgument { what: "checkpoint manifest", reason: e.to_string() })?;
    let meta = HashMap::from([(MANIFEST_KEY.to_string(), manifest)]);
    let bytes = to_safetensors_bytes_with_metadata(&ckpt.tensors, Some(meta))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(&bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

/// Reads a checkpoint; a truncated or foreign file is a [`TrainerError::Checkpoint`].
pub fn load_checkpoint(path: &Path, device: Device) -> Result<Checkpoint> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    let origin = path.display().to_string();
    let corrupt = |msg: String| TrainerError::Checkpoint { path: path.to_path_buf(), msg };
    let meta =
        safetensors_metadata(&bytes, &origin).map_err(|e| corrupt(format!("{e} (the file is truncated or not a ptl checkpoint)")))?;
    let raw = meta.get(MANIFEST_KEY).ok_or_else(|| corrupt("no ptl manifest in the header (not a ptl checkpoint?)".into()))?;
    let manifest: Manifest = serde_json::from_str(raw).map_err(|e| corrupt(format!("unreadable manifest: {e}")))?;
    if manifest.format != CHECKPOINT_FORMAT {
        return Err(corrupt(format!("checkpoint format {} is not supported (this build reads {CHECKPOINT_FORMAT})", manifest.format)));
    }
    let tensors = from_safetensors_bytes(&bytes, device, &origin).map_err(|e| corrupt(e.to_string()))?;
    Ok(Checkpoint { manifest, tensors })
}

//! Checkpoints: one safetensors file holding every tensor (model, EMA, optimizer state) under a
//! prefix, with a JSON manifest (loop counters, RNG, scheduler/scaler/callback/plugin state) in
//! the header metadata. Written atomically: temporary file, fsync, rename.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use ptl_autograd::module::{from_safetensors_bytes, safetensors_metadata, to_safetensors_bytes_with_metadata};
use ptl_autograd::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// Version of the manifest layout; bump when fields change meaning. Older formats are migrated on
/// load: format 1 kept no run history; up to format 2 the settings' `scale` was the model size
/// (now `model`, with `scale` the augmentation gain).
pub const CHECKPOINT_FORMAT: u32 = 3;
/// The oldest format this build migrates.
pub const OLDEST_CHECKPOINT_FORMAT: u32 = 1;
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
    /// The best validation fitness so far.
    pub best_fitness: Option<f64>,
    /// The early stopper's state (docs/training.md §9): its best fitness and the 1-based epoch of it.
    #[serde(default)]
    pub stopper: crate::fit::EarlyStopping,
    /// Where an interrupted epoch stopped (`None` at an epoch boundary): a resume continues it
    /// from the next batch.
    #[serde(default)]
    pub partial_epoch: Option<PartialEpoch>,
}

/// The place inside an epoch that a signal stopped the fit at.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PartialEpoch {
    /// The epoch (0-based) the fit was in.
    pub epoch: usize,
    /// The first batch not trained yet.
    pub next_batch: usize,
    /// The epoch's loss item sums so far (results.csv's train losses are their means).
    pub loss_sums: [f64; 6],
    /// Losses booked into the sums.
    pub absorbed: usize,
}

/// What a run has produced so far, kept in every checkpoint so that a resumed run continues the
/// same `results.csv` and summary (format 2).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunHistory {
    /// `results.csv` header and one formatted row per completed epoch (the file is rewritten from
    /// these, so a kill between checkpoint and CSV can never duplicate or lose a row).
    pub columns: Vec<String>,
    /// results.csv's rows so far.
    pub rows: Vec<String>,
    /// Validation metrics per completed epoch (`None` for a non-finite value).
    pub metrics: Vec<Vec<(String, Option<f64>)>>,
    /// Seconds of fitting before this checkpoint (the CSV's time column continues from it).
    pub fit_time_s: f64,
}

/// Everything except tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Checkpoint format version.
    pub format: u32,
    /// The ptl version that wrote it.
    pub ptl_version: String,
    /// Epoch, steps and best fitness.
    pub loop_state: LoopState,
    /// Run arguments as given (config + overrides).
    pub train_args: serde_json::Value,
    /// Optimizer/scheduler/scaler/EMA scalar state (tensors live in the file body).
    pub optimizer: serde_json::Value,
    /// The loss scaler's state.
    pub scaler: serde_json::Value,
    /// The EMA's scalars.
    pub ema: serde_json::Value,
    /// The loss's state (branch-weight counter).
    pub criterion: serde_json::Value,
    /// Callbacks' states by state key.
    pub callbacks: serde_json::Map<String, serde_json::Value>,
    /// Replay plugins' states by name.
    pub plugins: serde_json::Map<String, serde_json::Value>,
    /// CUDA-graph recordings are never serialised: they are rebuilt after a restore.
    pub recordings: String,
    /// Results so far (format 2; empty after migrating a format-1 checkpoint).
    #[serde(default)]
    pub history: RunHistory,
    /// The model's class names by id (the training data's `names`); empty in checkpoints written
    /// before multi-class training, whose one class is `person`.
    #[serde(default)]
    pub names: Vec<String>,
}

/// A loaded or to-be-saved checkpoint.
pub struct Checkpoint {
    /// Everything but the tensors.
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

/// The key of a weights-only checkpoint's optimizer entry (the EMA model in half precision and
/// the run's settings: what `best.ckpt` holds).
pub const WEIGHTS_ONLY: &str = "weights_only";

/// The run's weights-only copy of its latest epoch in `weights/` (Ultralytics' lean `last.pt`),
/// beside the full, resumable `last.ckpt` and the best epoch's `best.ckpt`.
pub const LAST_WEIGHTS: &str = "last_weights.ckpt";

/// Whether a manifest is that of a weights-only checkpoint.
pub fn is_weights_only(manifest: &Manifest) -> bool {
    manifest.optimizer[WEIGHTS_ONLY].as_bool() == Some(true)
}

/// Refuses to resume from `path` when it holds weights only, naming the full checkpoint beside it.
pub fn refuse_resume_from_weights(path: &Path, manifest: &Manifest) -> Result<()> {
    if !is_weights_only(manifest) {
        return Ok(());
    }
    Err(TrainerError::Checkpoint {
        path: path.to_path_buf(),
        msg: format!(
            "it holds weights only (the EMA model in half precision, as best.ckpt and last_weights.ckpt do): a run resumes from the full \
             checkpoint beside it, {}; to train on from these weights, pass model={} instead",
            path.with_file_name("last.ckpt").display(),
            path.display()
        ),
    })
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
    // Disk full or similar leaves no half-written file behind: the previous checkpoint stays.
    Ok(ptl_files::write_atomic(path, &bytes, 0o644)?)
}

/// Reads a checkpoint; a truncated or foreign file is a [`TrainerError::Checkpoint`].
pub fn load_checkpoint(path: &Path, device: Device) -> Result<Checkpoint> {
    let bytes = ptl_files::read_regular(path)?;
    refuse_pickle(path, &bytes)?;
    let origin = path.display().to_string();
    let corrupt = |msg: String| TrainerError::Checkpoint { path: path.to_path_buf(), msg };
    let meta =
        safetensors_metadata(&bytes, &origin).map_err(|e| corrupt(format!("{e} (the file is truncated or not a ptl checkpoint)")))?;
    let manifest = parse_manifest(path, &meta)?;
    let tensors = from_safetensors_bytes(&bytes, device, &origin).map_err(|e| corrupt(e.to_string()))?;
    Ok(Checkpoint { manifest, tensors })
}

/// Reads only a checkpoint's manifest (settings, counters, history) from the file's header —
/// not its tensors, which [`load_checkpoint`] reads and checks.
pub fn read_manifest(path: &Path) -> Result<Manifest> {
    parse_manifest(path, &read_header_metadata(path)?)
}

/// The `__metadata__` of a safetensors file from its header alone.
fn read_header_metadata(path: &Path) -> Result<HashMap<String, String>> {
    let header = read_header(path, "not a ptl checkpoint")?;
    let meta = header.get("__metadata__").cloned().unwrap_or_else(|| serde_json::Value::Object(Default::default()));
    serde_json::from_value(meta).map_err(|e| TrainerError::Checkpoint {
        path: path.to_path_buf(),
        msg: format!("unreadable header: {e} (the file is truncated or not a ptl checkpoint)"),
    })
}

/// The name and shape of every tensor of a safetensors file, from its header alone (no tensor
/// data is read: enough to tell a model's size before building it).
pub fn tensor_shapes(path: &Path) -> Result<HashMap<String, Vec<usize>>> {
    let header = read_header(path, "not a safetensors file")?;
    let mut shapes = HashMap::new();
    for (name, entry) in header.into_iter().filter(|(n, _)| n != "__metadata__") {
        let shape: Option<Vec<usize>> = entry["shape"].as_array().and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
        let shape = shape.ok_or_else(|| TrainerError::Checkpoint {
            path: path.to_path_buf(),
            msg: format!("tensor `{name}` has no readable shape in the header (not a safetensors file)"),
        })?;
        shapes.insert(name, shape);
    }
    Ok(shapes)
}

/// A safetensors file's header JSON: an 8-byte little-endian length, then that many bytes.
/// `foreign` completes the message for a file that is not one (`not a ptl checkpoint`).
fn read_header(path: &Path, foreign: &str) -> Result<serde_json::Map<String, serde_json::Value>> {
    /// Larger headers are refused (the safetensors format's own limit).
    const MAX_HEADER: u64 = 100_000_000;
    let corrupt =
        |msg: String| TrainerError::Checkpoint { path: path.to_path_buf(), msg: format!("{msg} (the file is truncated or {foreign})") };
    let mut file = ptl_files::open_regular(path)?;
    let file_len = file.metadata().map_err(|e| io(path, e))?.len();
    // The length and the header's first byte (`{` in a safetensors file).
    let mut start = [0u8; 9];
    file.read_exact(&mut start).map_err(|_| corrupt(format!("{file_len} bytes: shorter than a safetensors header")))?;
    refuse_pickle(path, &start)?;
    let len = u64::from_le_bytes([start[0], start[1], start[2], start[3], start[4], start[5], start[6], start[7]]);
    if len == 0 || len > MAX_HEADER || len.saturating_add(8) > file_len {
        return Err(corrupt(format!("header length {len} does not fit the file ({file_len} bytes)")));
    }
    let mut header = vec![0u8; len as usize];
    header[0] = start[8];
    file.read_exact(&mut header[1..]).map_err(|e| io(path, e))?;
    serde_json::from_slice(&header).map_err(|e| corrupt(format!("unreadable header: {e}")))
}

/// A PyTorch file (a zip archive, or a bare pickle) where a safetensors file was expected gets a
/// message saying so and how to convert it, instead of a header error.
pub fn refuse_pickle(path: &Path, first_bytes: &[u8]) -> Result<()> {
    let zip = first_bytes.starts_with(b"PK\x03\x04");
    // A pickle starts with PROTO (0x80) and its protocol; a safetensors header length can start
    // with the same two bytes, but then its JSON header opens at byte 8.
    let json_header = first_bytes.get(8) == Some(&b'{');
    let pickle = !json_header && first_bytes.first() == Some(&0x80) && first_bytes.get(1).is_some_and(|p| (2..=5).contains(p));
    if zip || pickle {
        return Err(TrainerError::Checkpoint {
            path: path.to_path_buf(),
            msg: "a pickled PyTorch file (.pt), not safetensors: ptl reads no pickled files; convert it once with \
                  `python scripts/ultralytics_pt_to_safetensors.py FILE.pt weights.safetensors`"
                .into(),
        });
    }
    Ok(())
}

fn parse_manifest(path: &Path, meta: &HashMap<String, String>) -> Result<Manifest> {
    let corrupt = |msg: String| TrainerError::Checkpoint { path: path.to_path_buf(), msg };
    let raw = meta.get(MANIFEST_KEY).ok_or_else(|| corrupt("no ptl manifest in the header (not a ptl checkpoint?)".into()))?;
    let value = serde_json::from_str::<serde_json::Value>(raw).map_err(|e| {
        corrupt(format!(
            "the manifest is not valid JSON ({e}; NaN and infinities are not JSON): the file was not written by ptl or was edited"
        ))
    })?;
    let format = value["format"].as_u64().ok_or_else(|| corrupt("the manifest has no format number: not a ptl checkpoint".into()))?;
    if !(OLDEST_CHECKPOINT_FORMAT as u64..=CHECKPOINT_FORMAT as u64).contains(&format) {
        return Err(corrupt(format!(
            "checkpoint format {format} is not supported: this build reads formats {OLDEST_CHECKPOINT_FORMAT} to {CHECKPOINT_FORMAT}{}",
            if format > CHECKPOINT_FORMAT as u64 { " (written by a newer ptl: update ptl)" } else { "" }
        )));
    }
    let mut manifest: Manifest = serde_json::from_str(raw).map_err(|e| corrupt(format!("unreadable manifest: {e}")))?;
    if manifest.format == 1 {
        // Format 1 kept no run history: a resumed run's results.csv and summary start at the resume.
        log::warn!(
            "ptl: {}: checkpoint format 1 (ptl {}) migrated: it has no epoch history, so results.csv and the summary list only the epochs after the resume",
            path.display(),
            manifest.ptl_version
        );
    }
    if manifest.format <= 2 {
        migrate_model_size(&mut manifest.train_args);
    }
    manifest.format = CHECKPOINT_FORMAT;
    Ok(manifest)
}

/// Format 2 → 3: the settings' `scale` held the model size letter; it becomes `model` =
/// `yolo26{letter}-pose.yaml`, and `scale` (now the augmentation gain) takes its default — the
/// gain those runs trained with.
fn migrate_model_size(train_args: &mut serde_json::Value) {
    let Some(args) = train_args.as_object_mut() else {
        return;
    };
    if let Some(serde_json::Value::String(size)) = args.get("scale").cloned() {
        args.remove("scale");
        args.insert("model".into(), format!("yolo26{}-pose.yaml", size.trim().to_ascii_lowercase()).into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file whose header length begins with a pickle's first two bytes (0x80, 2) is
    /// not mistaken for one; a real pickle's start and a zip archive are refused.
    #[test]
    fn pickles_are_told_from_safetensors_by_the_header() {
        let path = Path::new("x.ckpt");
        let mut st = 0x0280u64.to_le_bytes().to_vec();
        st.push(b'{');
        assert!(refuse_pickle(path, &st).is_ok());
        let pickle = [0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20];
        assert!(refuse_pickle(path, &pickle).is_err());
        assert!(refuse_pickle(path, b"PK\x03\x04rest").is_err());
    }
}

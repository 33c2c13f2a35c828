//! The `model` setting: which size to build and, for a weights file, what to start from — a
//! safetensors state dict with Ultralytics' names (what `scripts/ultralytics_pt_to_safetensors.py`
//! writes, the goldens' layout) or a ptl checkpoint. ptl reads no pickled `.pt` files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ptl_autograd::{module, DType, Device, Tensor};
use ptl_heads::{PoseModel, Scale};

use crate::fit::checkpoint::{load_checkpoint, tensor_shapes};
use crate::{Result, TrainerError};

/// What `model=` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A fresh model of this size (`yolo26s-pose.yaml`, or just `s`).
    Size(Scale),
    /// A safetensors state dict with Ultralytics' names.
    Safetensors(PathBuf),
    /// A ptl checkpoint: the model starts from its EMA weights (Ultralytics starts from a `.pt`'s
    /// EMA too); its optimizer state and counters are not used — that is `resume`.
    Checkpoint(PathBuf),
}

impl ModelSource {
    /// Reads a `model` value (no file is opened).
    pub fn parse(s: &str) -> Result<ModelSource> {
        let bad = |reason: String| TrainerError::InvalidArgument { what: "model", reason };
        let t = s.trim();
        let lower = t.to_ascii_lowercase();
        if lower.len() == 1 {
            return Scale::parse(&lower).map(ModelSource::Size).map_err(|_| bad(format!("`{t}`: the size letter is n, s, m, l or x")));
        }
        let ext = Path::new(&lower).extension().and_then(|e| e.to_str()).unwrap_or("");
        match ext {
            "yaml" | "yml" => {
                let file = Path::new(&lower).file_stem().and_then(|f| f.to_str()).unwrap_or("");
                let size = file.strip_prefix("yolo26").and_then(|r| r.strip_suffix("-pose")).and_then(|l| Scale::parse(l).ok());
                size.map(ModelSource::Size).ok_or_else(|| {
                    bad(format!("`{t}`: ptl builds YOLO26 pose models: yolo26n-pose.yaml, yolo26s-pose.yaml, … yolo26x-pose.yaml"))
                })
            }
            "safetensors" => Ok(ModelSource::Safetensors(PathBuf::from(t))),
            "ckpt" => Ok(ModelSource::Checkpoint(PathBuf::from(t))),
            "pt" | "pth" => Err(bad(format!(
                "`{t}`: ptl reads no pickled PyTorch files; convert it once with \
                 `python scripts/ultralytics_pt_to_safetensors.py {t} weights.safetensors` and pass model=weights.safetensors"
            ))),
            _ => Err(bad(format!(
                "`{t}`: expected a model yaml (yolo26n-pose.yaml … yolo26x-pose.yaml), a size letter, \
                 a .safetensors state dict or a ptl .ckpt"
            ))),
        }
    }

    /// The weights file, if any.
    pub fn weights_path(&self) -> Option<&Path> {
        match self {
            ModelSource::Size(_) => None,
            ModelSource::Safetensors(p) | ModelSource::Checkpoint(p) => Some(p),
        }
    }

    /// The model size: named, or read from the weights file's header (no tensor data).
    pub fn scale(&self) -> Result<Scale> {
        match self {
            ModelSource::Size(s) => Ok(*s),
            ModelSource::Safetensors(p) => scale_in_file(p, ""),
            ModelSource::Checkpoint(p) => scale_in_file(p, "ema."),
        }
    }

    /// The state dict to start from (`None` for a fresh model), on the CPU.
    pub fn start_weights(&self) -> Result<Option<HashMap<String, Tensor>>> {
        match self {
            ModelSource::Size(_) => Ok(None),
            ModelSource::Safetensors(p) => {
                Ok(Some(module::load_safetensors(p, Device::Cpu).map_err(|e| checkpoint_err(p, e.to_string()))?))
            }
            ModelSource::Checkpoint(p) => Ok(Some(load_checkpoint(p, Device::Cpu)?.part("ema"))),
        }
    }
}

fn checkpoint_err(path: &Path, msg: String) -> TrainerError {
    TrainerError::Checkpoint { path: path.to_path_buf(), msg }
}

/// The size of the model whose tensors (names under `prefix`) a safetensors file holds.
pub fn scale_in_file(path: &Path, prefix: &str) -> Result<Scale> {
    let shapes: HashMap<String, Vec<usize>> =
        tensor_shapes(path)?.into_iter().filter_map(|(n, s)| n.strip_prefix(prefix).map(|n| (n.to_string(), s))).collect();
    scale_of(&shapes).ok_or_else(|| {
        checkpoint_err(
            path,
            format!(
                "no YOLO26 pose model in it: `{prefix}model.0.conv.weight` is missing or not 16, 32, 64 or 96 filters wide \
                 (a state dict with Ultralytics' names is expected)"
            ),
        )
    })
}

/// The size whose tensors these are: the stem's width (16 n, 32 s, 64 m or l, 96 x) and, for 64,
/// the depth (l repeats layer 2's bottleneck, m does not). Loading then checks every tensor.
pub fn scale_of(shapes: &HashMap<String, Vec<usize>>) -> Option<Scale> {
    let width = shapes.get("model.0.conv.weight")?.first().copied()?;
    match width {
        16 => Some(Scale::N),
        32 => Some(Scale::S),
        64 if shapes.keys().any(|k| k.starts_with("model.2.m.1.")) => Some(Scale::L),
        64 => Some(Scale::M),
        96 => Some(Scale::X),
        _ => None,
    }
}

/// Whether `name` is a class stem's final convolution (`cv3.i.2`, `one2one_cv3.i.2`): the only
/// tensors whose shape follows the class count.
fn is_class_prediction(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("model.23.").map(|r| r.strip_prefix("one2one_").unwrap_or(r)) else { return false };
    let parts: Vec<&str> = rest.split('.').collect();
    matches!(parts.as_slice(), ["cv3", level, "2", "weight" | "bias"] if level.parse::<usize>().is_ok())
}

/// Start weights for a model whose class count may differ from the file's (Ultralytics
/// transfers every tensor of matching shape): as [`load_start_weights`], except that the class
/// stems' final convolutions, where their shapes differ, keep the model's initial values.
/// Returns how many tensors were kept so.
pub fn load_start_weights_for_classes(model: &PoseModel, values: &HashMap<String, Tensor>, path: &Path) -> Result<usize> {
    let shapes: HashMap<String, Vec<usize>> = model.state_dict().into_iter().map(|(n, t, _)| (n, t.dims().to_vec())).collect();
    let differs = |n: &String, t: &Tensor| is_class_prediction(n) && shapes.get(n).is_some_and(|s| s.as_slice() != t.dims());
    let kept: Vec<&String> = values.iter().filter(|(n, t)| differs(n, t)).map(|(n, _)| n).collect();
    if kept.is_empty() {
        load_start_weights(model, values, path)?;
        return Ok(0);
    }
    let mut merged = values.clone();
    for (name, t, _) in model.state_dict() {
        if kept.contains(&&name) {
            merged.insert(name, t);
        }
    }
    load_start_weights(model, &merged, path)?;
    Ok(kept.len())
}

/// Copies `values` into `model`. Every entry of the model must be there with its shape, except
/// integer buffers (BN's `num_batches_tracked`, which a ptl checkpoint's EMA does not keep and
/// nothing reads); an entry the model lacks is refused too. Errors name the tensor.
pub fn load_start_weights(model: &PoseModel, values: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let mismatch = |tensor: &str, reason: String| TrainerError::StartWeights { path: path.to_path_buf(), tensor: tensor.into(), reason };
    let entries = model.state_dict();
    for (name, t, _) in &entries {
        match values.get(name) {
            Some(v) if v.dims() != t.dims() => {
                return Err(mismatch(name, format!("has shape {:?} in the file but {:?} in the model", v.dims(), t.dims())));
            }
            Some(_) => {}
            None if t.dtype() == DType::I64 => {}
            None => {
                let n = entries.iter().filter(|(n, t, _)| t.dtype() != DType::I64 && !values.contains_key(n)).count();
                return Err(mismatch(name, format!("is missing from the file ({n} model tensors are; is it another model?)")));
            }
        }
    }
    let mut extra: Vec<&String> = values.keys().filter(|k| !entries.iter().any(|(n, _, _)| n == *k)).collect();
    extra.sort();
    if let Some(first) = extra.first() {
        return Err(mismatch(first, format!("is not in the model ({} file tensors are not)", extra.len())));
    }
    model.load_state_dict(values, false)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn class_predictions_are_named_by_their_stem() {
        for n in ["model.23.cv3.0.2.weight", "model.23.one2one_cv3.2.2.bias"] {
            assert!(super::is_class_prediction(n), "{n}");
        }
        for n in ["model.23.cv3.0.1.1.conv.weight", "model.23.cv2.0.2.weight", "model.22.cv3.0.2.weight", "model.23.cv3.x.2.weight"] {
            assert!(!super::is_class_prediction(n), "{n}");
        }
    }
}

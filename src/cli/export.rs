//! `ptl export format=onnx model=W imgsz=640 [out=path]`: the eval model as a file for other
//! runtimes (see `ptl-export` for what the file computes).

use std::path::{Path, PathBuf};

use clap::Args;
use ptl_autograd::{Device, Module};
use ptl_export::ExportFormat;
use ptl_heads::{ModelConfig, PoseModel};
use ptl_trainer::pose::weights::load_start_weights;
use ptl_trainer::pose::ModelSource;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// `key=value` settings, Ultralytics style: format=onnx, model= (alias weights=; a ptl
    /// checkpoint, a safetensors state dict, or a size such as yolo26n-pose.yaml), imgsz=,
    /// out= (alias file=; default: next to the weights, with the format's extension).
    pub settings: Vec<String>,
}

/// The keys `ptl export` accepts as `key=value`.
const EXPORT_KEYS: &str = "format, model, imgsz, out";

/// What to export, read from the settings.
#[derive(Debug)]
struct ExportSettings {
    format: ExportFormat,
    model: String,
    imgsz: usize,
    out: Option<PathBuf>,
}

/// Reads the settings and nothing else (the key walk's view: whether each key is taken).
#[cfg(test)]
pub(crate) fn parse_keys(settings: &[String]) -> Result<(), String> {
    parse_settings(settings).map(|_| ()).or_else(|e| if e.starts_with("no format") || e.starts_with("no model") { Ok(()) } else { Err(e) })
}

fn parse_settings(settings: &[String]) -> Result<ExportSettings, String> {
    let (mut format, mut model, mut imgsz, mut out) = (None, None, 640usize, None);
    for s in settings {
        let (k, v) = s.split_once('=').ok_or_else(|| format!("`{s}` is not key=value (ptl export takes {EXPORT_KEYS})"))?;
        match k {
            "format" => format = Some(ExportFormat::parse(v).map_err(|e| e.to_string())?),
            "model" | "weights" => model = Some(v.to_string()),
            "imgsz" => imgsz = v.parse().map_err(|_| format!("`{k}={v}`: expected a positive multiple of 32, e.g. imgsz=640"))?,
            "out" | "file" => out = Some(PathBuf::from(v)),
            _ => {
                if let Some(answered) = super::ultralytics_keys::answer("export", k, v) {
                    answered?;
                    continue;
                }
                let accepted = EXPORT_KEYS.split(", ").chain(["weights", "file"]);
                let hint = ptl_trainer::pose::nearest_key(k, accepted).map(|c| format!("did you mean `{c}`? ")).unwrap_or_default();
                return Err(format!("unknown key `{k}` for ptl export ({hint}it takes {EXPORT_KEYS})"));
            }
        }
    }
    Ok(ExportSettings {
        format: format.ok_or_else(|| format!("no format: pass format=onnx (ptl exports {})", ExportFormat::KNOWN))?,
        model: model.ok_or("no model to export: pass model=weights/best.ckpt (a ptl checkpoint or a .safetensors state dict)")?,
        imgsz,
        out,
    })
}

/// Builds the model `model=` names (its size and keypoint count read from the weights) in eval
/// mode on the CPU, with its weights loaded (a checkpoint's EMA, as `ptl val`).
fn eval_model(source: &ModelSource) -> Result<PoseModel, String> {
    let scale = source.scale().map_err(|e| e.to_string())?;
    let weights = source.start_weights().map_err(|e| e.to_string())?;
    let nkpt = match &weights {
        None => 17,
        Some(w) => {
            let path = source.weights_path().map(Path::display).map(|p| p.to_string()).unwrap_or_default();
            let k3 = w
                .iter()
                .find(|(n, _)| n.ends_with("cv4_kpts.0.weight"))
                .and_then(|(_, t)| t.dims().first().copied())
                .ok_or_else(|| format!("{path}: no keypoint head (cv4_kpts) in it: not a pose model"))?;
            if k3 == 0 || k3 % 3 != 0 {
                return Err(format!("{path}: the keypoint view has {k3} outputs, not 3 per keypoint"));
            }
            k3 / 3
        }
    };
    let mut model = PoseModel::new(ModelConfig { nc: 1, kpt_shape: (nkpt, 3), scale }, Device::Cpu, 0).map_err(|e| e.to_string())?;
    if let (Some(w), Some(path)) = (&weights, source.weights_path()) {
        load_start_weights(&model, w, path).map_err(|e| e.to_string())?;
    }
    model.set_training(false);
    Ok(model)
}

/// Where the file goes: `out=`, else next to the weights, else `yolo26<size>-pose.<ext>` here.
fn out_path(s: &ExportSettings, source: &ModelSource, model: &PoseModel) -> PathBuf {
    if let Some(p) = &s.out {
        return p.clone();
    }
    match source.weights_path() {
        Some(w) => w.with_extension(s.format.extension()),
        None => PathBuf::from(format!("yolo26{}-pose.{}", model.config.scale.letter(), s.format.extension())),
    }
}

pub fn run_export(a: ExportArgs) -> Result<(), String> {
    let s = parse_settings(&a.settings)?;
    let source = ModelSource::parse(&s.model).map_err(|e| e.to_string())?;
    let model = eval_model(&source)?;
    let path = out_path(&s, &source, &model);
    match s.format {
        ExportFormat::Onnx => {
            let onnx = ptl_export::export_onnx(&model, (s.imgsz, s.imgsz)).map_err(|e| e.to_string())?;
            onnx.write(&path).map_err(|e| e.to_string())?;
            let dims: Vec<String> = onnx.output_dims().iter().map(|d| d.map_or("batch".to_string(), |n| n.to_string())).collect();
            println!(
                "exported {} ({} parameters, opset {}) for {}×{} input `{}` (batch, 3, {}, {}) -> output `{}` ({}) to {}",
                s.model,
                onnx.num_parameters(),
                onnx.opset,
                s.imgsz,
                s.imgsz,
                onnx.input.0,
                s.imgsz,
                s.imgsz,
                onnx.output.0,
                dims.join(", "),
                path.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn settings_are_read_and_mistakes_named() {
        let s = parse_settings(&strings(&["format=onnx", "weights=a.ckpt", "imgsz=320", "file=x.onnx"])).unwrap();
        assert_eq!((s.format, s.model.as_str(), s.imgsz, s.out), (ExportFormat::Onnx, "a.ckpt", 320, Some(PathBuf::from("x.onnx"))));
        let e = parse_settings(&strings(&["format=onnx", "model=a.ckpt", "imgz=320"])).unwrap_err();
        assert!(e.contains("did you mean `imgsz`?"), "{e}");
        let e = parse_settings(&strings(&["format=coreml", "model=a.ckpt"])).unwrap_err();
        assert!(e.contains("`coreml`") && e.contains("onnx"), "{e}");
        let e = parse_settings(&strings(&["model=a.ckpt"])).unwrap_err();
        assert!(e.contains("format=onnx"), "{e}");
        let e = parse_settings(&strings(&["format=onnx"])).unwrap_err();
        assert!(e.contains("model="), "{e}");
        let e = parse_settings(&strings(&["format=onnx", "model=a.ckpt", "imgsz=big"])).unwrap_err();
        assert!(e.contains("imgsz=big"), "{e}");
    }
}

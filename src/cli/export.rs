//! `ptl export format=onnx model=W imgsz=640 [out=path]`: the eval model as a file for other
//! runtimes (see `ptl-export` for what the file computes).

use std::path::{Path, PathBuf};

use clap::Args;
use ptl_autograd::{Device, Module};
use ptl_export::{ExportFormat, ExportOptions, ExportOutput, NmsSettings};
use ptl_heads::{ModelConfig, PoseModel};
use ptl_trainer::pose::weights::load_start_weights;
use ptl_trainer::pose::ModelSource;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// `key=value` settings, Ultralytics style: format=onnx, model= (alias weights=; a ptl
    /// checkpoint, a safetensors state dict, or a size such as yolo26n-pose.yaml), imgsz=,
    /// half=, opset=, dynamic=, nms= (True: NMS in the graph with conf=, iou=, max_det=; False: the
    /// end-to-end one-to-one output with max_det=), out= (alias file=; default: next to the
    /// weights, with the format's extension).
    pub settings: Vec<String>,
}

/// The keys `ptl export` accepts as `key=value`.
const EXPORT_KEYS: &str = "format, model, imgsz, half, opset, nms, conf, iou, max_det, dynamic, simplify, out";

/// What to export, read from the settings.
#[derive(Debug)]
struct ExportSettings {
    format: ExportFormat,
    model: String,
    imgsz: usize,
    out: Option<PathBuf>,
    options: ExportOptions,
}

/// Reads the settings and nothing else (the key walk's view: whether each key is taken).
#[cfg(test)]
pub(crate) fn parse_keys(settings: &[String]) -> Result<(), String> {
    parse_settings(settings).map(|_| ()).or_else(|e| if e.starts_with("no format") || e.starts_with("no model") { Ok(()) } else { Err(e) })
}

/// A Python-style switch (`True`, `false`, `1`, …).
fn switch(k: &str, v: &str) -> Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("`{k}={v}`: expected True or False")),
    }
}

fn number<T: std::str::FromStr>(k: &str, v: &str, what: &str) -> Result<T, String> {
    v.trim().parse().map_err(|_| format!("`{k}={v}`: expected {what}"))
}

fn parse_settings(settings: &[String]) -> Result<ExportSettings, String> {
    let (mut format, mut model, mut imgsz, mut out) = (None, None, 640usize, None);
    let (mut half, mut opset, mut nms, mut conf, mut iou, mut max_det) = (false, ptl_export::OPSET, None, None, None, None);
    let mut dynamic = false;
    for s in settings {
        let (k, v) = s.split_once('=').ok_or_else(|| format!("`{s}` is not key=value (ptl export takes {EXPORT_KEYS})"))?;
        let empty = v.trim().is_empty() || v.trim().eq_ignore_ascii_case("none");
        match k {
            "format" => format = Some(ExportFormat::parse(v).map_err(|e| e.to_string())?),
            "model" | "weights" => model = Some(v.to_string()),
            "imgsz" => imgsz = number(k, v, "a positive multiple of 32, e.g. imgsz=640")?,
            "out" | "file" => out = Some(PathBuf::from(v)),
            "half" => half = switch(k, v)?,
            "opset" if empty => opset = ptl_export::OPSET,
            "opset" => opset = number(k, v, "an ONNX opset number, e.g. opset=17")?,
            "nms" if empty => nms = None,
            "nms" => nms = Some(switch(k, v)?),
            "conf" if empty => conf = None,
            "conf" => conf = Some(number::<f32>(k, v, "a score threshold in [0, 1], e.g. conf=0.25")?),
            "iou" => iou = Some(number::<f32>(k, v, "an IoU threshold in [0, 1], e.g. iou=0.7")?),
            "max_det" => max_det = Some(number::<usize>(k, v, "a number of detections per image, e.g. max_det=300")?),
            // Height and width; the batch is dynamic in every file.
            "dynamic" => dynamic = switch(k, v)?,
            // The graph is written simplified (BatchNorm folded, no constant subgraphs): the
            // same file either way.
            "simplify" => {
                switch(k, v)?;
            }
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
    let output = match nms {
        None => {
            if let Some((k, _)) =
                [("conf", conf.is_some()), ("iou", iou.is_some()), ("max_det", max_det.is_some())].iter().find(|(_, given)| *given)
            {
                return Err(format!(
                    "`{k}=` shapes the detections of nms=True (NMS in the graph) or nms=False (the end-to-end output); without nms= \
                     the file outputs the decoded predictions before NMS"
                ));
            }
            ExportOutput::Decoded
        }
        Some(true) => {
            ExportOutput::Nms(NmsSettings { conf: conf.unwrap_or(0.25), iou: iou.unwrap_or(0.7), max_det: max_det.unwrap_or(300) })
        }
        Some(false) => {
            if let Some(k) = [("conf", conf.is_some()), ("iou", iou.is_some())].iter().find(|(_, g)| *g).map(|(k, _)| k) {
                return Err(format!(
                    "`{k}=` is a setting of NMS (nms=True); the end-to-end output (nms=False) has no NMS: filter its rows by score"
                ));
            }
            ExportOutput::EndToEnd { max_det: max_det.unwrap_or(300) }
        }
    };
    Ok(ExportSettings {
        format: format.ok_or_else(|| format!("no format: pass format=onnx (ptl exports {})", ExportFormat::KNOWN))?,
        model: model.ok_or("no model to export: pass model=weights/best.ckpt (a ptl checkpoint or a .safetensors state dict)")?,
        imgsz,
        out,
        options: ExportOptions { imgsz: (imgsz, imgsz), half, opset, dynamic, output },
    })
}

/// Builds the model `model=` names (its size, class and keypoint count read from the weights) in
/// eval mode on the CPU, with its weights loaded (a checkpoint's EMA, as `ptl val`), and its
/// class names.
fn eval_model(source: &ModelSource) -> Result<(PoseModel, Vec<String>), String> {
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
    // One output per class in the class stems' final convolution.
    let nc = weights
        .as_ref()
        .and_then(|w| w.iter().find(|(n, _)| n.ends_with("23.cv3.0.2.weight")).and_then(|(_, t)| t.dims().first().copied()))
        .unwrap_or(1);
    let mut model = PoseModel::new(ModelConfig { nc, kpt_shape: (nkpt, 3), scale }, Device::Cpu, 0).map_err(|e| e.to_string())?;
    if let (Some(w), Some(path)) = (&weights, source.weights_path()) {
        load_start_weights(&model, w, path).map_err(|e| e.to_string())?;
    }
    model.set_training(false);
    // A ptl checkpoint names its classes; a state dict or a bare size does not.
    let stored = match source.weights_path() {
        Some(p) if !p.extension().is_some_and(|e| e.eq_ignore_ascii_case("safetensors")) => {
            ptl_trainer::fit::read_manifest(p).map(|m| m.names).unwrap_or_default()
        }
        _ => Vec::new(),
    };
    Ok((model, ptl_trainer::pose::predict::class_names(&stored, nc)))
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
    let (model, names) = eval_model(&source)?;
    let path = out_path(&s, &source, &model);
    match s.format {
        ExportFormat::Onnx => {
            let mut onnx = ptl_export::export_onnx_with(&model, &s.options).map_err(|e| e.to_string())?;
            onnx.set_class_names(&names);
            onnx.write(&path).map_err(|e| e.to_string())?;
            let shown = |dims: &[ptl_export::Dim]| {
                let names: Vec<String> = dims
                    .iter()
                    .map(|d| match d {
                        ptl_export::Dim::Fixed(n) => n.to_string(),
                        ptl_export::Dim::Named(name) => name.clone(),
                    })
                    .collect();
                names.join(", ")
            };
            println!(
                "exported {} ({} parameters, opset {}, {}) at {}×{}: input `{}` ({}) -> output `{}` ({}) to {}",
                s.model,
                onnx.num_parameters(),
                onnx.opset,
                if onnx.half { "f16" } else { "f32" },
                s.imgsz,
                s.imgsz,
                onnx.input.0,
                shown(&onnx.input.1),
                onnx.output.0,
                shown(&onnx.output.1),
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

    /// Ultralytics' export keys: nms= picks the output form, its thresholds only go with it.
    #[test]
    fn export_variants_are_read_as_ultralytics_spells_them() {
        let opts = |v: &[&str]| parse_settings(&strings(&[&["format=onnx", "model=a.ckpt"], v].concat())).map(|s| s.options);
        let o = opts(&["half=True", "opset=", "nms=", "simplify=True", "dynamic=False"]).unwrap();
        assert_eq!((o.half, o.opset, o.dynamic, o.output), (true, ptl_export::OPSET, false, ExportOutput::Decoded));
        assert!(opts(&["dynamic=True"]).unwrap().dynamic);
        assert_eq!(opts(&["opset=13"]).unwrap().opset, 13);
        assert_eq!(opts(&["nms=True"]).unwrap().output, ExportOutput::Nms(NmsSettings { conf: 0.25, iou: 0.7, max_det: 300 }));
        assert_eq!(
            opts(&["nms=true", "conf=0.5", "iou=0.6", "max_det=10"]).unwrap().output,
            ExportOutput::Nms(NmsSettings { conf: 0.5, iou: 0.6, max_det: 10 })
        );
        assert_eq!(opts(&["nms=False", "max_det=20"]).unwrap().output, ExportOutput::EndToEnd { max_det: 20 });
        for (bad, said) in [
            (vec!["conf=0.3"], "nms=True"),
            (vec!["nms=False", "iou=0.5"], "no NMS"),
            (vec!["half=maybe"], "True or False"),
            (vec!["opset=x"], "opset=x"),
        ] {
            let e = opts(&bad).unwrap_err();
            assert!(e.contains(said), "{bad:?}: {e}");
        }
    }
}

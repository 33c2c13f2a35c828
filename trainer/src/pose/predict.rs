//! Prediction as a library: a model from a weights file, and the persons it finds in an image —
//! letterboxed as Ultralytics' predictor does (padded to the next multiple of 32 only), decoded, NMS'd and mapped back to the image's pixels. `ptl
//! predict` is these two calls, drawing and file writing.

use std::collections::HashMap;
use std::path::Path;

use ptl_autograd::{no_grad, Device, Module, Tensor};
use ptl_data::augment::{letterbox_min, Instances};
use ptl_data::image::Image;
use ptl_heads::{ModelConfig, PoseModel};

use crate::fit::checkpoint::{load_checkpoint, refuse_pickle};
use crate::metrics::nms::non_max_suppression_batch;
use crate::metrics::NmsConfig;
use crate::{Result, TrainerError};

use super::images::images_to_tensor;
use super::weights::{load_start_weights, scale_of, ModelSource};

/// One person found in an image, in the image's own pixels.
#[derive(Clone, Debug, PartialEq)]
pub struct PersonPrediction {
    /// Box corners (x1, y1, x2, y2).
    pub bbox_xyxy: [f32; 4],
    /// Confidence.
    pub score: f32,
    /// Class index (into the checkpoint's `names`).
    pub class: usize,
    /// (x, y, visibility score) per keypoint.
    pub keypoints: Vec<[f32; 3]>,
}

/// The model a ptl checkpoint (its EMA weights) or a safetensors state dict with Ultralytics'
/// names holds, in eval mode on `device`, with the checkpoint's training settings (`Null` for a
/// state dict, which holds none) plus `names`, the model's class names ([`class_names`]). Size,
/// class count and keypoint count are read from the weights; every tensor must fit and the file
/// may hold nothing else. Pickled PyTorch files are refused with the way to
/// convert them.
pub fn load_eval_model(path: &Path, device: Device) -> Result<(PoseModel, serde_json::Value)> {
    // `.pt` files get the conversion hint; anything else is read by its contents.
    if path.extension().is_some_and(|x| x.eq_ignore_ascii_case("pt") || x.eq_ignore_ascii_case("pth")) {
        ModelSource::parse(&path.to_string_lossy())?;
    }
    let bad = |msg: String| TrainerError::Checkpoint { path: path.to_path_buf(), msg };
    let mut names: Vec<String> = Vec::new();
    let is_state_dict = path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    let (weights, args): (HashMap<String, Tensor>, serde_json::Value) = if is_state_dict {
        let bytes = ptl_files::read_regular(path)?;
        refuse_pickle(path, &bytes)?;
        let w =
            ptl_autograd::module::from_safetensors_bytes(&bytes, device, &path.display().to_string()).map_err(|e| bad(e.to_string()))?;
        (w.into_iter().collect(), serde_json::Value::Null)
    } else {
        let ck = load_checkpoint(path, device)?;
        let ema = ck.part("ema");
        names.clone_from(&ck.manifest.names);
        (if ema.is_empty() { ck.part("model") } else { ema }, ck.manifest.train_args.clone())
    };
    // The size is the weights' own (the settings may name a start-weights file instead of a size).
    let shapes = weights.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect();
    let scale = scale_of(&shapes).ok_or_else(|| bad("not a YOLO26 pose model (no stem convolution of a known width)".into()))?;
    // The keypoint count is the model's own: the keypoint view `cv4_kpts.0` has K·3 outputs.
    let nkpt = weights
        .iter()
        .find(|(n, _)| n.ends_with("cv4_kpts.0.weight"))
        .and_then(|(_, t)| t.dims().first().map(|k3| k3 / 3))
        .ok_or_else(|| bad("no keypoint head (cv4_kpts) in it: not a pose model".into()))?;
    // The class count too: the class stems' final convolution has one output per class.
    let nc = weights.iter().find(|(n, _)| n.ends_with("23.cv3.0.2.weight")).and_then(|(_, t)| t.dims().first().copied()).unwrap_or(1);
    let mut model = PoseModel::new(ModelConfig { nc, kpt_shape: (nkpt, 3), scale }, device, 0)?;
    load_start_weights(&model, &weights, path)?;
    model.set_training(false);
    let mut args = args;
    if let Some(map) = args.as_object_mut() {
        map.insert("names".into(), serde_json::json!(class_names(&names, nc)));
    }
    Ok((model, args))
}

/// The class names of a model with `nc` classes: `stored` (a checkpoint's) when it has them all,
/// else `person` for a one-class model (what checkpoints before multi-class training hold) and
/// `class<i>` otherwise.
pub fn class_names(stored: &[String], nc: usize) -> Vec<String> {
    match stored.len() == nc {
        true => stored.to_vec(),
        false if nc == 1 => vec!["person".into()],
        false => (0..nc).map(|i| format!("class{i}")).collect(),
    }
}

/// Prediction thresholds, with Ultralytics' predict defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct PredictOptions {
    /// Confidence threshold (`conf`).
    pub conf: f32,
    /// NMS IoU threshold (`iou`).
    pub iou: f64,
    /// Most persons kept per image (`max_det`).
    pub max_det: usize,
    /// Only these classes (`classes`; empty: every class).
    pub classes: Vec<usize>,
}

impl Default for PredictOptions {
    fn default() -> Self {
        PredictOptions { conf: 0.25, iou: 0.7, max_det: 300, classes: Vec::new() }
    }
}

/// The persons `model` finds in `img` (a BGR image) at input size `imgsz` (a multiple of 32),
/// above confidence `conf`, in the image's pixels.
pub fn predict_image(model: &PoseModel, img: &Image, imgsz: u32, conf: f32, device: Device) -> Result<Vec<PersonPrediction>> {
    predict_image_with(model, img, imgsz, &PredictOptions { conf, ..PredictOptions::default() }, device)
}

/// [`predict_image`] with every threshold given.
pub fn predict_image_with(
    model: &PoseModel,
    img: &Image,
    imgsz: u32,
    opts: &PredictOptions,
    device: Device,
) -> Result<Vec<PersonPrediction>> {
    let nk = model.head().kpt_shape.0;
    let mut inst = Instances::empty(nk);
    // As Ultralytics' predictor (rect=True): padded only to the next multiple of the stride.
    let (lb, info) = letterbox_min(img, &mut inst, imgsz, imgsz, true, 32);
    let rgb = lb.to_rgb();
    let (h, w) = (lb.h as usize, lb.w as usize);
    let mut chw = vec![0u8; 3 * h * w];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for (c, v) in px.iter().enumerate() {
            chw[c * h * w + i] = *v;
        }
    }
    let x = images_to_tensor(&chw, [1, 3, h, w], device)?;
    let pred = no_grad(|| model.predict(&x))?;
    let dims = pred.decoded.dims().to_vec();
    let host = pred.decoded.to_vec::<f32>()?;
    let cfg = NmsConfig {
        conf_thres: opts.conf,
        iou_thres: opts.iou,
        max_det: opts.max_det,
        classes: opts.classes.clone(),
        multi_label: false,
        ..NmsConfig::default()
    };
    let outs = non_max_suppression_batch(&host, 1, dims[2], model.head().nc, nk, &cfg)?;
    let det = &outs[0].detections;
    // Back to the image's pixels, clipped to the image as Ultralytics' scale_boxes/scale_coords do.
    let (iw, ih) = (img.w as f32, img.h as f32);
    let unmap = |x: f32, y: f32| (((x - info.left as f32) / info.r).clamp(0.0, iw), ((y - info.top as f32) / info.r).clamp(0.0, ih));
    Ok(det
        .boxes
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let (x1, y1) = unmap(b[0], b[1]);
            let (x2, y2) = unmap(b[2], b[3]);
            let keypoints = (0..nk)
                .map(|k| {
                    let o = (i * nk + k) * 3;
                    let (kx, ky) = unmap(det.keypoints[o], det.keypoints[o + 1]);
                    [kx, ky, det.keypoints[o + 2]]
                })
                .collect();
            PersonPrediction { bbox_xyxy: [x1, y1, x2, y2], score: det.scores[i], class: det.classes[i], keypoints }
        })
        .collect())
}

/// One line of a YOLO pose label file for `p` in an image of `width` × `height` pixels, as
/// Ultralytics' `save_txt` writes it: class, box centre and size, then x, y and visibility score of
/// each keypoint — positions as fractions of the image — and with `save_conf` the confidence last,
/// each number as C's `%g` prints it.
pub fn yolo_label_line(p: &PersonPrediction, width: u32, height: u32, save_conf: bool) -> String {
    let (w, h) = (width.max(1) as f64, height.max(1) as f64);
    let [x1, y1, x2, y2] = p.bbox_xyxy.map(f64::from);
    let mut v = vec![p.class as f64, (x1 + x2) / 2.0 / w, (y1 + y2) / 2.0 / h, (x2 - x1) / w, (y2 - y1) / h];
    for [kx, ky, kv] in &p.keypoints {
        v.extend([f64::from(*kx) / w, f64::from(*ky) / h, f64::from(*kv)]);
    }
    if save_conf {
        v.push(f64::from(p.score));
    }
    v.iter().map(|x| super::fit::epoch_line::fmt_g(*x, 6)).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Normalised centre, size and keypoints in Ultralytics' order, `%g` numbers, confidence last.
    #[test]
    fn label_lines_follow_ultralytics_save_txt() {
        let mut p = PersonPrediction {
            bbox_xyxy: [10.0, 20.0, 30.0, 60.0],
            score: 0.875,
            class: 0,
            keypoints: vec![[20.0, 40.0, 0.5], [0.0, 0.0, 0.0]],
        };
        assert_eq!(yolo_label_line(&p, 100, 200, false), "0 0.2 0.2 0.2 0.2 0.2 0.2 0.5 0 0 0");
        assert_eq!(yolo_label_line(&p, 100, 200, true), "0 0.2 0.2 0.2 0.2 0.2 0.2 0.5 0 0 0 0.875");
        p.class = 3;
        assert!(yolo_label_line(&p, 100, 200, false).starts_with("3 0.2 "));
    }
}

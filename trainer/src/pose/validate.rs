//! Validation of the (EMA) model: letterboxed val batches → eval forward → NMS on the o2m branch
//! → box/pose metrics (docs/metrics.md), in the network's input space.

use std::path::PathBuf;
use std::sync::Arc;

use ptl_autograd::{no_grad, Device};
use ptl_data::{PoseDataset, ValLoader};
use ptl_heads::PoseModel;

use super::coco_json::{CocoJsonFiles, JsonWriter};
use super::config::Precision;
use super::images::images_to_tensor;
use super::plots::PrCurve;
use super::val_loss::ValLoss;
use crate::loss::LossConfig;
use crate::metrics::confusion::ConfusionMatrix;
use crate::metrics::nms::non_max_suppression_batch;
use crate::metrics::{GroundTruth, NmsConfig, PoseValidator};
use crate::Result;

/// Metrics of one validation pass.
#[derive(Clone, Debug, Default)]
pub struct ValResult {
    /// Ultralytics' result keys and fitness, in order.
    pub metrics: Vec<(String, f64)>,
    /// mAP50-95(B) + mAP50-95(P).
    pub fitness: f64,
    /// Images validated.
    pub images: usize,
    /// The COCO files written when [`ValOptions::save_json`] was set.
    pub coco_json: Option<CocoJsonFiles>,
    /// Box and pose precision–recall curves at 0.5 (what `BoxPR_curve.png`/`PosePR_curve.png` draw).
    pub pr_curves: Vec<PrCurve>,
    /// Mean `[box, pose, kobj, cls, l1, rle]` loss over the batches when [`ValOptions::loss`] was set.
    pub losses: Option<[f64; 6]>,
    /// The detection confusion matrix (Ultralytics' thresholds: confidence 0.25, IoU 0.45).
    pub confusion: ConfusionMatrix,
    /// One row per class with targets, as Ultralytics' per-class table (nc > 1).
    pub per_class: Vec<ClassRow>,
}

/// A class's validation row: its name, the images that hold it, its instances, then P, R,
/// mAP50 and mAP50-95 for boxes and for keypoints.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassRow {
    /// Class name.
    pub name: String,
    /// Images with the class.
    pub images: usize,
    /// Objects of the class.
    pub instances: usize,
    /// In [`ValResult::metric_names`] order.
    pub metrics: [f64; 8],
}

/// The per-class rows of `m` (classes with targets; `images[c]`: images that hold class c).
fn class_rows(m: &crate::metrics::PoseMetrics, names: &[String], images: &[usize]) -> Vec<ClassRow> {
    let (b, p) = (&m.box_metrics.per_class, &m.pose_metrics.per_class);
    let mean = |ap: &[f64]| ap.iter().sum::<f64>() / ap.len().max(1) as f64;
    b.classes
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let j = p.classes.iter().position(|&pc| pc == c);
            let pose = |v: &[f64]| j.and_then(|j| v.get(j).copied()).unwrap_or(0.0);
            let pose_ap = j.and_then(|j| p.ap.get(j));
            ClassRow {
                name: names.get(c).cloned().unwrap_or_else(|| format!("class{c}")),
                images: images.get(c).copied().unwrap_or(0),
                instances: b.n_targets.get(i).copied().unwrap_or(0),
                metrics: [
                    b.p[i],
                    b.r[i],
                    b.ap[i][0],
                    mean(&b.ap[i]),
                    pose(&p.p),
                    pose(&p.r),
                    pose_ap.map_or(0.0, |a| a[0]),
                    pose_ap.map_or(0.0, |a| mean(a)),
                ],
            }
        })
        .collect()
}

/// What a validation pass does beyond scoring the model.
#[derive(Clone, Debug, PartialEq)]
pub struct ValOptions {
    /// NMS confidence threshold (Ultralytics' val default 0.001).
    pub conf: f32,
    /// NMS IoU threshold (Ultralytics' 0.7).
    pub iou: f64,
    /// Detections kept per image (Ultralytics' 300, raised to the most objects of one image).
    pub max_det: usize,
    /// Write `predictions.json` and `val_gt.json` (COCO, original pixels) into this folder.
    pub save_json: Option<PathBuf>,
    /// Also compute the criterion with these gains on every batch (results.csv's `val/` losses).
    pub loss: Option<LossConfig>,
}

impl Default for ValOptions {
    fn default() -> Self {
        let nms = NmsConfig::default();
        ValOptions { conf: nms.conf_thres, iou: nms.iou_thres, max_det: nms.max_det, save_json: None, loss: None }
    }
}

impl ValResult {
    /// The eight metric keys, in Ultralytics' order.
    pub fn metric_names() -> [&'static str; 8] {
        [
            "metrics/precision(B)",
            "metrics/recall(B)",
            "metrics/mAP50(B)",
            "metrics/mAP50-95(B)",
            "metrics/precision(P)",
            "metrics/recall(P)",
            "metrics/mAP50(P)",
            "metrics/mAP50-95(P)",
        ]
    }
    /// Values in [`ValResult::metric_names`] order.
    pub fn metric_values(&self) -> Vec<f64> {
        Self::metric_names().iter().map(|n| self.metrics.iter().find(|(k, _)| k == n).map_or(f64::NAN, |(_, v)| *v)).collect()
    }
    /// The metric named `name`.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.metrics.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
    }
}

/// Runs the model (eval mode expected) over the validation set.
pub fn validate(model: &PoseModel, ds: &Arc<PoseDataset>, batch: usize, device: Device, precision: Precision) -> Result<ValResult> {
    validate_with(model, ds, batch, device, precision, &ValOptions::default())
}

/// [`validate`] with a confidence threshold and optional COCO JSON output.
pub fn validate_with(
    model: &PoseModel,
    ds: &Arc<PoseDataset>,
    batch: usize,
    device: Device,
    precision: Precision,
    opts: &ValOptions,
) -> Result<ValResult> {
    let loader = ValLoader::new(ds.clone(), batch.max(1), 0)?;
    let nk = ds.nkpt();
    let mut v = match ds.meta.custom_oks_sigmas() {
        Some(s) => PoseValidator::with_sigmas(s.to_vec())?,
        None => PoseValidator::new(nk)?,
    };
    let nms = NmsConfig { conf_thres: opts.conf, iou_thres: opts.iou, max_det: opts.max_det, ..NmsConfig::default() };
    let mut json = opts.save_json.as_deref().map(|dir| JsonWriter::new(dir, ds)).transpose()?;
    let mut losses = opts.loss.clone().map(ValLoss::new);
    let mut images = 0;
    // The model's classes (a model trained on other data may have another count than the set).
    let nc = model.head().nc;
    let mut confusion = ConfusionMatrix::new(nc.max(ds.meta.nc));
    let mut class_images: Vec<usize> = Vec::new();
    for b in loader.iter() {
        let b = b?;
        let x = pad_to_batch(images_to_tensor(&b.img, b.shape, device)?, batch, device)?;
        let pred = no_grad(|| ptl_autograd::autocast(precision.autocast(), || model.predict(&x)))?;
        if let Some(l) = losses.as_mut() {
            ptl_autograd::autocast(precision.autocast(), || l.add(&pred.raw, &b))?;
        }
        let decoded = pred.decoded.to_dtype(ptl_autograd::DType::F32)?;
        let dims = decoded.dims().to_vec();
        let host = decoded.to_vec::<f32>()?;
        // A padded batch's blank images come last: their outputs are not read.
        let real = b.len().min(dims[0]);
        let per_image = host.len() / dims[0].max(1);
        let outs = non_max_suppression_batch(&host[..real * per_image], real, dims[2], nc, nk, &nms)?;
        let (h, w) = (b.shape[2] as u32, b.shape[3] as u32);
        let gts = GroundTruth::from_batch(&b.batch_idx, &b.cls, &b.bboxes, &b.keypoints, b.len(), nk, w, h)?;
        for (i, (o, gt)) in outs.iter().zip(&gts).enumerate() {
            let mut held: Vec<usize> = gt.classes.clone();
            held.sort_unstable();
            held.dedup();
            for c in held {
                if class_images.len() <= c {
                    class_images.resize(c + 1, 0);
                }
                class_images[c] += 1;
            }
            v.update(&o.detections, gt)?;
            confusion.update(&o.detections, gt);
            if let Some(w) = json.as_mut() {
                w.add(&b, i, &o.detections)?;
            }
        }
        images += b.len();
    }
    let m = v.compute();
    let metrics: Vec<(String, f64)> = m.results_dict().into_iter().map(|(k, x)| (k.to_string(), x)).collect();
    let coco_json = json.map(|w| w.finish(ds)).transpose()?;
    let names: Vec<&str> = ds.meta.names.iter().map(String::as_str).collect();
    let pr_curves =
        vec![PrCurve::from_ap("Box", &m.box_metrics.per_class, &names), PrCurve::from_ap("Pose", &m.pose_metrics.per_class, &names)];
    let per_class = class_rows(&m, &ds.meta.names, &class_images);
    Ok(ValResult { fitness: m.fitness, metrics, images, coco_json, pr_curves, losses: losses.map(|l| l.means()), confusion, per_class })
}

/// On a GPU, a last partial batch padded with blank images to `batch`: every validation batch
/// then has one shape, and a new shape costs a cuDNN plan per convolution (≈ 50 ms each on the
/// H200: 1.4 s for the model's). Eval-mode outputs are per image, so the real images' outputs
/// are the same values and the blank ones are dropped. The CPU has no plans to save.
fn pad_to_batch(x: ptl_autograd::Tensor, batch: usize, device: Device) -> Result<ptl_autograd::Tensor> {
    let dims = x.dims().to_vec();
    match dims.first() {
        Some(&n) if device.is_cuda() && n < batch => {
            let mut blank_dims = dims.clone();
            blank_dims[0] = batch - n;
            let blank = ptl_autograd::Tensor::zeros(blank_dims, x.dtype(), device)?;
            Ok(ptl_autograd::Tensor::cat(&[&x, &blank], 0)?)
        }
        _ => Ok(x),
    }
}

/// Ultralytics' `val_batch0_labels.jpg` and `val_batch0_pred.jpg`: the first validation batch (up
/// to 16 images, letterboxed as validated) as a grid with its labels, and the same grid with the
/// model's predictions (NMS, confidence ≥ 0.25, each with its score). Returns the two files.
pub fn draw_val_batch(model: &PoseModel, ds: &Arc<PoseDataset>, device: Device, dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    let loader = ValLoader::new(ds.clone(), 16, 0)?;
    let Some(b) = loader.iter().next() else { return Ok(Vec::new()) };
    let b = b?;
    let nk = ds.nkpt();
    let labels = super::plots::LabelledBatch {
        pixels: &b.img,
        shape: b.shape,
        batch_idx: &b.batch_idx,
        bboxes: &b.bboxes,
        keypoints: &b.keypoints,
        nkpt: nk,
        scores: None,
        classes: None,
    };
    let mut written = vec![super::plots::plot_batch(&labels, &dir.join("val_batch0_labels.jpg"))?];
    let x = images_to_tensor(&b.img, b.shape, device)?;
    let pred = no_grad(|| model.predict(&x))?;
    let decoded = pred.decoded.to_dtype(ptl_autograd::DType::F32)?;
    let dims = decoded.dims().to_vec();
    let cfg = NmsConfig { conf_thres: 0.25, ..NmsConfig::default() };
    let outs = non_max_suppression_batch(&decoded.to_vec::<f32>()?, dims[0], dims[2], model.head().nc, nk, &cfg)?;
    // Predictions in the labels' form: normalised centre and size, normalised keypoints.
    let (h, w) = (b.shape[2] as f32, b.shape[3] as f32);
    let (mut idx, mut boxes, mut kpts, mut scores, mut classes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, o) in outs.iter().enumerate() {
        let det = &o.detections;
        for (k, bx) in det.boxes.iter().enumerate() {
            idx.push(i as f32);
            boxes.extend([(bx[0] + bx[2]) / 2.0 / w, (bx[1] + bx[3]) / 2.0 / h, (bx[2] - bx[0]) / w, (bx[3] - bx[1]) / h]);
            for j in 0..nk {
                let q = (k * nk + j) * 3;
                kpts.extend([det.keypoints[q] / w, det.keypoints[q + 1] / h, det.keypoints[q + 2]]);
            }
            scores.push(det.scores.get(k).copied().unwrap_or(0.0));
            classes.push(det.classes.get(k).copied().unwrap_or(0));
        }
    }
    let preds = super::plots::LabelledBatch {
        pixels: &b.img,
        shape: b.shape,
        batch_idx: &idx,
        bboxes: &boxes,
        keypoints: &kpts,
        nkpt: nk,
        scores: Some(&scores),
        classes: Some((&classes, &ds.meta.names)),
    };
    written.push(super::plots::plot_batch(&preds, &dir.join("val_batch0_pred.jpg"))?);
    Ok(written)
}

/// Draws the model's predictions (NMS on the o2m branch, confidence ≥ 0.25) on the first
/// validation images and writes `val_pred_<i>.png` into `dir`; returns the files written.
pub fn draw_val_predictions(
    model: &PoseModel,
    ds: &Arc<PoseDataset>,
    max_images: usize,
    device: Device,
    dir: &std::path::Path,
) -> Result<Vec<std::path::PathBuf>> {
    let loader = ValLoader::new(ds.clone(), max_images.max(1), 0)?;
    let Some(b) = loader.iter().next() else { return Ok(Vec::new()) };
    let b = b?;
    let nk = ds.nkpt();
    let x = images_to_tensor(&b.img, b.shape, device)?;
    let pred = no_grad(|| model.predict(&x))?;
    let decoded = pred.decoded.to_dtype(ptl_autograd::DType::F32)?;
    let dims = decoded.dims().to_vec();
    let outs = non_max_suppression_batch(
        &decoded.to_vec::<f32>()?,
        dims[0],
        dims[2],
        model.head().nc,
        nk,
        &NmsConfig { conf_thres: 0.25, ..NmsConfig::default() },
    )?;
    let (h, w) = (b.shape[2], b.shape[3]);
    let mut written = Vec::new();
    for (i, o) in outs.iter().enumerate().take(max_images) {
        let plane = &b.img[i * 3 * h * w..(i + 1) * 3 * h * w];
        let rgb: Vec<u8> = (0..h * w).flat_map(|p| [plane[p], plane[h * w + p], plane[2 * h * w + p]]).collect();
        let mut img = ptl_data::image::Image::from_rgb(w as u32, h as u32, rgb);
        let det = &o.detections;
        let kps: Vec<Vec<[f32; 3]>> = (0..det.boxes.len())
            .map(|k| {
                (0..nk)
                    .map(|j| {
                        let q = (k * nk + j) * 3;
                        [det.keypoints[q], det.keypoints[q + 1], det.keypoints[q + 2]]
                    })
                    .collect()
            })
            .collect();
        let drawn: Vec<super::draw::Person<'_>> = det
            .boxes
            .iter()
            .zip(&kps)
            .enumerate()
            .map(|(k, (bx, kp))| {
                let name = det.classes.get(k).and_then(|&c| ds.meta.names.get(c)).map_or("person", String::as_str);
                super::draw::Person { bbox: *bx, kpts: kp, score: det.scores.get(k).copied(), name }
            })
            .collect();
        super::draw::people(&mut img, &drawn, 0.5)?;
        let path = dir.join(format!("val_pred_{i}.png"));
        ptl_data::image::write_png(&img, &path)?;
        written.push(path);
    }
    Ok(written)
}

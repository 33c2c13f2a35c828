//! Validation of the (EMA) model: letterboxed val batches → eval forward → NMS on the o2m branch
//! → box/pose metrics (metrics.md), in the network's input space.

use std::sync::Arc;

use ptl_autograd::{no_grad, Device};
use ptl_data::{PoseDataset, ValLoader};
use ptl_heads::PoseModel;

use super::config::Precision;
use super::fit::images_to_tensor;
use crate::metrics::nms::non_max_suppression_batch;
use crate::metrics::{GroundTruth, NmsConfig, PoseValidator};
use crate::Result;

/// Metrics of one validation pass.
#[derive(Clone, Debug, Default)]
pub struct ValResult {
    /// Ultralytics' result keys and fitness, in order.
    pub metrics: Vec<(String, f64)>,
    pub fitness: f64,
    pub images: usize,
}

impl ValResult {
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
    pub fn get(&self, name: &str) -> Option<f64> {
        self.metrics.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
    }
}

/// Runs the model (eval mode expected) over the validation set.
pub fn validate(model: &PoseModel, ds: &Arc<PoseDataset>, batch: usize, device: Device, precision: Precision) -> Result<ValResult> {
    let loader = ValLoader::new(ds.clone(), batch.max(1), 0)?;
    let nk = ds.nkpt();
    let mut v = PoseValidator::new(nk)?;
    let nms = NmsConfig::default();
    let mut images = 0;
    for b in loader.iter() {
        let b = b?;
        let x = images_to_tensor(&b.img, b.shape, device)?;
        let pred = no_grad(|| ptl_autograd::autocast(precision.autocast(), || model.predict(&x)))?;
        let decoded = pred.decoded.to_dtype(ptl_autograd::DType::F32)?;
        let dims = decoded.dims().to_vec();
        let host = decoded.to_vec::<f32>()?;
        let outs = non_max_suppression_batch(&host, dims[0], dims[2], 1, nk, &nms)?;
        let (h, w) = (b.shape[2] as u32, b.shape[3] as u32);
        let gts = GroundTruth::from_batch(&b.batch_idx, &b.cls, &b.bboxes, &b.keypoints, b.len(), nk, w, h)?;
        for (o, gt) in outs.iter().zip(&gts) {
            v.update(&o.detections, gt)?;
        }
        images += b.len();
    }
    let m = v.compute();
    let metrics: Vec<(String, f64)> = m.results_dict().into_iter().map(|(k, x)| (k.to_string(), x)).collect();
    Ok(ValResult { fitness: m.fitness, metrics, images })
}

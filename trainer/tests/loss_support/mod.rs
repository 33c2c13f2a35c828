//! Shared helpers for the loss tests: golden loading, the flow, comparisons.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use ptl_autograd::{module, DType, Device, Rng, Tensor};
use ptl_heads::nn::Init;
use ptl_heads::RealNvp;
use ptl_trainer::loss::{Anchors, BranchOutputs, LossConfig, TargetBatch};

/// The goldens' folder ([`ptl_goldens::folder`]), or `None` with a loud skip line (a failure
/// under CI).
pub fn goldens() -> Option<PathBuf> {
    ptl_goldens::folder()
}

pub fn load(path: PathBuf) -> HashMap<String, Tensor> {
    module::load_safetensors(&path, Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn get<'a>(m: &'a HashMap<String, Tensor>, k: &str) -> &'a Tensor {
    m.get(k).unwrap_or_else(|| panic!("missing golden tensor {k}"))
}

pub fn f32v(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

pub fn f64v(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

/// The training batch stored under `prefix` (`batch.`).
pub fn target_batch(m: &HashMap<String, Tensor>, prefix: &str) -> TargetBatch {
    let kp = get(m, &format!("{prefix}keypoints"));
    TargetBatch {
        batch_idx: f32v(get(m, &format!("{prefix}batch_idx"))),
        cls: f32v(get(m, &format!("{prefix}cls"))),
        bboxes: f32v(get(m, &format!("{prefix}bboxes"))),
        keypoints: f32v(kp),
        nkpt: kp.dims().get(1).copied().unwrap_or(17),
    }
}

/// Raw outputs of a branch as leaves that record gradients.
pub fn branch_leaves(m: &HashMap<String, Tensor>, prefix: &str) -> BranchOutputs {
    branch_leaves_on(m, prefix, Device::Cpu)
}

/// [`branch_leaves`] on `device`.
pub fn branch_leaves_on(m: &HashMap<String, Tensor>, prefix: &str, device: Device) -> BranchOutputs {
    let leaf = |k: &str| get(m, &format!("{prefix}{k}")).to_device(device).unwrap().deep_copy().unwrap().requires_grad_(true).unwrap();
    BranchOutputs { boxes: leaf("boxes"), scores: leaf("scores"), kpts: leaf("kpts"), kpts_sigma: Some(leaf("kpts_sigma")) }
}

/// The RealNVP flow loaded from `values` (keys relative to the flow, e.g. `s.0.0.weight`).
pub fn flow_from(values: &HashMap<String, Tensor>) -> RealNvp {
    flow_on(values, Device::Cpu)
}

/// [`flow_from`] on `device`.
pub fn flow_on(values: &HashMap<String, Tensor>, device: Device) -> RealNvp {
    let mut rng = Rng::new(0);
    let flow = RealNvp::new(&mut Init { rng: &mut rng, device }).unwrap();
    module::load_state_dict(&flow, values, true).unwrap();
    flow
}

/// max |a − b| / max |b| (scale floor `floor`).
pub fn rel_dev(a: &[f64], b: &[f64], floor: f64) -> f64 {
    assert_eq!(a.len(), b.len(), "length");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(floor);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// |a − b| / |b| for scalars (absolute when |b| < 1e-6... scaled by max(|b|, 1e-6)).
pub fn rel_scalar(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-6)
}

/// A golden loss case's anchors (from its image size, the default strides) and targets.
pub fn case_anchors_and_targets(g: &HashMap<String, Tensor>) -> (Anchors, TargetBatch) {
    let hw = f64v(get(g, "input.image_hw"));
    let anchors = Anchors::from_image_hw((hw[0] as usize, hw[1] as usize), &LossConfig::default().strides).expect("anchors");
    (anchors, target_batch(g, "batch."))
}

/// What the dense assigner reads for one branch of a golden case on `device`: the padded targets
/// uploaded in their bucket, the branch's geometry, and the predictions decoded for assignment
/// (scores, boxes, keypoints).
pub struct DenseCase {
    /// The padded targets on the device.
    pub targets: ptl_trainer::loss::assign_dense::DeviceTargets,
    /// The branch's anchor geometry (its keypoint sigmas, the outputs' class count).
    pub geometry: ptl_trainer::loss::assign_dense::DenseGeometry,
    /// Decoded (scores, boxes, keypoints).
    pub decoded: (Tensor, Tensor, Tensor),
}

/// [`DenseCase`] of `outs` against `targets` with the assigner's `sigmas`.
pub fn dense_case(outs: &BranchOutputs, targets: &TargetBatch, anchors: &Anchors, sigmas: &[f32], device: Device) -> DenseCase {
    use ptl_trainer::loss::assign_dense::{decode_for_assignment, target_bucket, DenseGeometry, DeviceTargets};
    let bs = outs.boxes.dims()[0];
    let padded = ptl_trainer::loss::targets::pad_targets(targets, bs, anchors.image_hw()).unwrap();
    let dt = DeviceTargets::upload(&padded, target_bucket(padded.max_boxes).unwrap(), device).unwrap();
    let geometry = DenseGeometry::new(anchors, sigmas, outs.scores.dims()[1], device).unwrap();
    let decoded = decode_for_assignment(
        &outs.boxes,
        &outs.scores,
        &outs.kpts,
        &DenseGeometry::new(anchors, &LossConfig::default().sigmas, 1, device).unwrap(),
    )
    .unwrap();
    DenseCase { targets: dt, geometry, decoded }
}

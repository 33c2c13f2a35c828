//! The box loss's CIoU on CUDA in one forward and one backward kernel (`ciou_fused.cu`) instead of
//! ≈ 155 composed ops per branch and step (the largest share of the dense loss's launches after the
//! RLE flow). The forward follows [`super::boxes::ciou`]'s operations in order; the backward writes
//! out their chain rule with the composed ops' conventions (ties of minimum/maximum split the
//! gradient, α constant), checked against finite differences; a CUDA test compares both with the
//! composed op.
//!
//! [`box_rows`] goes one step further for the dense loss: the predicted box from the row's
//! distances, the CIoU term and the side-L1 term of every foreground row in one kernel each way.
//!
//! On by default on CUDA; [`set_enabled`] or `PTL_FUSED_CIOU=0` turns it off (the composed op is
//! used then, and on every other device).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ptl_autograd::internal::cuda::KernelArg;
use ptl_autograd::{BackwardOp, DType, Device, Tensor};

use super::boxes::CIOU_EPS;
use super::device_kernels::{backward_error, f32_grads, grad_arg, kernels, launch_grid, rows_mismatch, uninit, FusedSwitch};
use crate::error::{Result, TrainerError};

const SOURCE: &str = include_str!("ciou_fused.cu");
const MODULE: &str = "ptl_trainer_ciou";
const FUNCTIONS: [&str; 4] = ["ciou_fwd", "ciou_bwd", "box_rows_fwd", "box_rows_bwd"];
const BLOCK: u32 = 256;

static SWITCH: FusedSwitch = FusedSwitch::new("PTL_FUSED_CIOU");

/// Turns the fused CIoU on or off for this process (default: on, unless `PTL_FUSED_CIOU=0` is in
/// the environment).
pub fn set_enabled(on: bool) {
    SWITCH.set(on);
}

/// Whether the fused CIoU is on (see [`set_enabled`]).
pub fn enabled() -> bool {
    SWITCH.enabled()
}

/// Whether the fused kernels take these boxes: enabled, CUDA, f32 (N, 4) pairs on one device, and
/// a constant target (the box loss's case; a target needing a gradient goes the composed way).
pub fn supports(pred: &Tensor, target: &Tensor) -> bool {
    enabled()
        && pred.device().is_cuda()
        && pred.device() == target.device()
        && pred.dtype() == DType::F32
        && target.dtype() == DType::F32
        && pred.rank() == 2
        && pred.dims()[1] == 4
        && target.dims() == pred.dims()
        && !target.requires_grad()
        && u32::try_from(pred.dims()[0]).is_ok()
}

fn four_over_pi2() -> f32 {
    (4.0 / (std::f64::consts::PI * std::f64::consts::PI)) as f32
}

/// CIoU (N, 1) of predictions `pred` (N, 4, differentiable) and constant targets `target` (N, 4),
/// both xyxy; the caller checked [`supports`].
pub fn ciou(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let device = pred.device();
    let n = pred.dims()[0];
    let n32 = u32::try_from(n).map_err(|_| TrainerError::InvalidArgument { what: "ciou", reason: format!("{n} boxes") })?;
    let out = uninit(device, DType::F32, vec![n, 1])?;
    if n > 0 {
        let k = kernels(device, MODULE, SOURCE, FUNCTIONS)?;
        // SAFETY: the arguments match `ciou_fwd`'s parameters; pred and target are (n, 4) f32, out
        // is (n, 1); the grid-stride loop stays below n.
        unsafe {
            use KernelArg::{Tensor as T, F32, U32};
            k[0].launch(
                (launch_grid(n, BLOCK), 1, 1),
                (BLOCK, 1, 1),
                &[T(pred), T(target), T(&out), U32(n32), F32(CIOU_EPS), F32(four_over_pi2())],
            )?;
        }
    }
    let backward = CiouBackward { pred: pred.detach(), target: target.detach(), n: n32, device };
    Ok(ptl_autograd::attach_custom_node(Arc::new(backward), &[pred], &[out]).remove(0))
}

struct CiouBackward {
    pred: Tensor,
    target: Tensor,
    n: u32,
    device: Device,
}

impl BackwardOp for CiouBackward {
    fn name(&self) -> &str {
        "ciou_fused"
    }

    fn backward(&self, grad_outputs: &[Option<Tensor>]) -> ptl_autograd::Result<Vec<Option<Tensor>>> {
        let Some(g) = grad_outputs.first().cloned().flatten() else { return Ok(vec![None]) };
        let run = || -> Result<Tensor> {
            let g = if g.dtype() == DType::F32 { g.clone() } else { g.to_dtype(DType::F32)? };
            let d = uninit(self.device, DType::F32, vec![self.n as usize, 4])?;
            if self.n > 0 {
                let k = kernels(self.device, MODULE, SOURCE, FUNCTIONS)?;
                // SAFETY: the arguments match `ciou_bwd`'s parameters; pred and target are (n, 4),
                // g (n, 1) and d (n, 4) f32; the grid-stride loop stays below n.
                unsafe {
                    use KernelArg::{Tensor as T, F32, U32};
                    k[1].launch(
                        (launch_grid(self.n as usize, BLOCK), 1, 1),
                        (BLOCK, 1, 1),
                        &[T(&self.pred), T(&self.target), T(&g), T(&d), U32(self.n), F32(CIOU_EPS), F32(four_over_pi2())],
                    )?;
                }
            }
            Ok(d)
        };
        run().map(|d| vec![Some(d)]).map_err(|e| backward_error("ciou_fused", e))
    }
}

/// The dense loss's foreground box rows: each row's predicted distances, anchor point, stride,
/// target box, validity and weight (all f32 on one CUDA device).
pub struct BoxRows<'a> {
    /// (F, 4) predicted distances left, top, right, bottom from the anchor point, grid units
    /// (differentiable).
    pub ltrb: &'a Tensor,
    /// (F, 2) anchor points, grid units.
    pub anchor: &'a Tensor,
    /// (F, 1) strides.
    pub stride: &'a Tensor,
    /// (F, 4) target boxes, xyxy in grid units.
    pub target_box: &'a Tensor,
    /// (F, 1) 1 on real rows, 0 on padding rows.
    pub valid: &'a Tensor,
    /// (F, 1) each row's weight (its target scores' sum; 0 on padding rows).
    pub weight: &'a Tensor,
    /// (1, 4) image width, height, width, height.
    pub whwh: &'a Tensor,
}

/// Whether [`box_rows`] takes these rows: enabled, CUDA, f32, the shapes above, constants without
/// gradient, and a row count that fits the kernels' 32-bit index.
pub fn supports_rows(rows: &BoxRows<'_>) -> bool {
    let d = rows.ltrb.dims();
    if !enabled() || !rows.ltrb.device().is_cuda() || d.len() != 2 || d[1] != 4 {
        return false;
    }
    let f = d[0];
    let shapes: [(&str, &Tensor, &[usize]); 7] = [
        ("ltrb", rows.ltrb, &[f, 4]),
        ("anchor", rows.anchor, &[f, 2]),
        ("stride", rows.stride, &[f, 1]),
        ("target_box", rows.target_box, &[f, 4]),
        ("valid", rows.valid, &[f, 1]),
        ("weight", rows.weight, &[f, 1]),
        ("whwh", rows.whwh, &[1, 4]),
    ];
    rows_mismatch(rows.ltrb.device(), &shapes, 1).is_none() && u32::try_from(f).is_ok()
}

/// Each row's CIoU term (1 − CIoU)·w and side-L1 term mean₄ |pred − target|·w, (F, 1) each, as
/// `dense::dense_branch_parts` composes them (the caller checked [`supports_rows`]).
pub fn box_rows(rows: &BoxRows<'_>) -> Result<(Tensor, Tensor)> {
    let device = rows.ltrb.device();
    let f = rows.ltrb.dims()[0];
    let n32 = u32::try_from(f).map_err(|_| TrainerError::InvalidArgument { what: "box_rows", reason: format!("{f} rows") })?;
    let box_terms = uninit(device, DType::F32, vec![f, 1])?;
    let l1_terms = uninit(device, DType::F32, vec![f, 1])?;
    BOX_ROWS_CALLS.fetch_add(1, Ordering::Relaxed);
    let saved = BoxRowsBackward {
        ltrb: rows.ltrb.detach(),
        constants: [rows.anchor, rows.stride, rows.target_box, rows.valid, rows.weight, rows.whwh].map(Tensor::detach),
        n: n32,
        device,
    };
    if f > 0 {
        let k = kernels(device, MODULE, SOURCE, FUNCTIONS)?;
        let [anchor, stride, target_box, valid, weight, whwh] = &saved.constants;
        // SAFETY: the arguments match `box_rows_fwd`'s parameters; `supports_rows` checked every
        // input's shape and dtype, both outputs are (F, 1) f32; the grid-stride loop stays below F.
        unsafe {
            use KernelArg::{Tensor as T, F32, U32};
            k[2].launch(
                (launch_grid(f, BLOCK), 1, 1),
                (BLOCK, 1, 1),
                &[
                    T(rows.ltrb),
                    T(anchor),
                    T(stride),
                    T(target_box),
                    T(valid),
                    T(weight),
                    T(whwh),
                    T(&box_terms),
                    T(&l1_terms),
                    U32(n32),
                    F32(CIOU_EPS),
                    F32(four_over_pi2()),
                ],
            )?;
        }
    }
    let mut out = ptl_autograd::attach_custom_node(Arc::new(saved), &[rows.ltrb], &[box_terms, l1_terms]);
    let l1 = out.pop();
    let bx = out.pop();
    match (bx, l1) {
        (Some(b), Some(l)) => Ok((b, l)),
        _ => Err(TrainerError::InvalidArgument { what: "box_rows", reason: "outputs lost".into() }),
    }
}

/// [`box_rows`] calls made by this process (tests check that the fused path ran).
pub fn box_rows_calls() -> u64 {
    BOX_ROWS_CALLS.load(Ordering::Relaxed)
}

static BOX_ROWS_CALLS: AtomicU64 = AtomicU64::new(0);

struct BoxRowsBackward {
    ltrb: Tensor,
    /// anchor, stride, target box, valid, weight, whwh.
    constants: [Tensor; 6],
    n: u32,
    device: Device,
}

impl BackwardOp for BoxRowsBackward {
    fn name(&self) -> &str {
        "box_rows_fused"
    }

    fn backward(&self, grad_outputs: &[Option<Tensor>]) -> ptl_autograd::Result<Vec<Option<Tensor>>> {
        if grad_outputs.iter().all(Option::is_none) {
            return Ok(vec![None]);
        }
        let run = || -> Result<Tensor> {
            let grads = f32_grads(grad_outputs)?;
            let d = uninit(self.device, DType::F32, vec![self.n as usize, 4])?;
            if self.n > 0 {
                let k = kernels(self.device, MODULE, SOURCE, FUNCTIONS)?;
                let [anchor, stride, target_box, valid, weight, whwh] = &self.constants;
                // SAFETY: the arguments match `box_rows_bwd`'s parameters; the saved inputs have
                // the shapes `supports_rows` checked, each present gradient (F, 1) (a null address
                // stands for an absent one), d (F, 4) f32; the grid-stride loop stays below F.
                unsafe {
                    use KernelArg::{Tensor as T, F32, U32};
                    k[3].launch(
                        (launch_grid(self.n as usize, BLOCK), 1, 1),
                        (BLOCK, 1, 1),
                        &[
                            T(&self.ltrb),
                            T(anchor),
                            T(stride),
                            T(target_box),
                            T(valid),
                            T(weight),
                            T(whwh),
                            grad_arg(&grads, 0),
                            grad_arg(&grads, 1),
                            T(&d),
                            U32(self.n),
                            F32(CIOU_EPS),
                            F32(four_over_pi2()),
                        ],
                    )?;
                }
            }
            Ok(d)
        };
        run().map(|d| vec![Some(d)]).map_err(|e| backward_error("box_rows_fused", e))
    }
}

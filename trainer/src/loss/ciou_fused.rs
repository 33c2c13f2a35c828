//! The box loss's CIoU on CUDA in one forward and one backward kernel (`ciou_fused.cu`) instead of
//! ≈ 155 composed ops per branch and step (the largest share of the dense loss's launches after the
//! RLE flow). The forward follows [`super::boxes::ciou`]'s operations in order; the backward writes
//! out their chain rule with the composed ops' conventions (ties of minimum/maximum split the
//! gradient, α constant), checked against finite differences; a CUDA test compares both with the
//! composed op.
//!
//! On by default on CUDA; [`set_enabled`] or `PTL_FUSED_CIOU=0` turns it off (the composed op is
//! used then, and on every other device).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use ptl_autograd::internal::cuda::KernelArg;
use ptl_autograd::{BackwardOp, DType, Device, Tensor};

use super::boxes::CIOU_EPS;
use super::device_kernels::{backward_error, kernels, uninit};
use crate::error::{Result, TrainerError};

const SOURCE: &str = include_str!("ciou_fused.cu");
const MODULE: &str = "ptl_trainer_ciou";
const FUNCTIONS: [&str; 2] = ["ciou_fwd", "ciou_bwd"];
const BLOCK: u32 = 256;

/// 0: not decided yet (read `PTL_FUSED_CIOU` at first use), 1: off, 2: on.
static ENABLED: AtomicU8 = AtomicU8::new(0);

/// Turns the fused CIoU on or off for this process (default: on, unless `PTL_FUSED_CIOU=0` is in
/// the environment).
pub fn set_enabled(on: bool) {
    ENABLED.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether the fused CIoU is on (see [`set_enabled`]).
pub fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("PTL_FUSED_CIOU").map_or(true, |v| v != "0");
            set_enabled(on);
            on
        }
        v => v == 2,
    }
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

fn launch_grid(n: usize) -> u32 {
    n.div_ceil(BLOCK as usize).clamp(1, 65_535) as u32
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
                (launch_grid(n), 1, 1),
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
                        (launch_grid(self.n as usize), 1, 1),
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

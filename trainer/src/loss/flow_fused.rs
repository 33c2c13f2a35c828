//! The RLE's RealNVP flow (`RealNvp::log_prob`) on CUDA in one forward kernel and three backward
//! kernels (`flow_fused.cu`) instead of ≈ 600 composed tensor ops per step (six coupling layers ×
//! two three-layer nets, forward and backward). The kernels follow the composed ops operation by
//! operation — under autocast they round every value the composed ops would store in the compute
//! dtype — so they give the composed flow's values up to the order of the sums (tested on a GPU
//! against the composed flow in f32, bf16 and f16); every sum has a fixed order, so results are
//! deterministic and a recorded step replays them exactly.
//!
//! The coupling masks are the reference's fixed `[[0, 1], [1, 0]] × 3` (docs/model.md §5.4): the
//! kernels hard-code them, and [`log_prob`] takes only a flow of the reference's shape.

use std::sync::Arc;

use ptl_autograd::internal::cuda::KernelArg;
use ptl_autograd::{BackwardOp, DType, Device, Tensor};
use ptl_heads::flow::{FLOW_HIDDEN, FLOW_LAYERS};
use ptl_heads::RealNvp;

use super::device_kernels::{backward_error, kernels, uninit};
use crate::error::{Result, TrainerError};

const SOURCE: &str = include_str!("flow_fused.cu");
const MODULE: &str = "ptl_trainer_flow";
const FUNCTIONS: [&str; 4] = ["flow_forward", "flow_backward_rows", "flow_weight_grads", "flow_reduce"];
/// Threads per block (`HIDDEN` in the source: one per hidden unit).
const BLOCK: u32 = FLOW_HIDDEN as u32;
/// Threads of a row-kernel block (`flow_forward`, `flow_backward_rows`): `GROUPS` groups of a
/// net's hidden units, each group on a quarter of the tile's rows.
const ROW_BLOCK: u32 = 4 * BLOCK;
/// Rows per tile (`ROWS`).
const ROWS: usize = 16;
/// Blocks per net of the weight-gradient kernel; each sums every `CHUNKS`-th tile.
const CHUNKS: usize = 48;
/// Floats per net in the packed parameter layout (`NET_PARAMS`).
const NET_PARAMS: usize = 4482;
/// Saved floats per row between forward and backward, and per-(row, layer) floats of the backward.
const SAVED_PER_ROW: usize = 8;
const NETS_PER_ROW: usize = 3 * FLOW_LAYERS;

/// The flow's 72 parameter tensors in the kernels' order: net `s.0 … s.5, t.0 … t.5`, each
/// `W0 (64×2), b0, W2 (64×64), b2, W4 (2×64), b4`.
fn parameters(flow: &RealNvp) -> Vec<Tensor> {
    flow.s
        .iter()
        .chain(&flow.t)
        .flat_map(|net| [&net.l0.weight, &net.l0.bias, &net.l2.weight, &net.l2.bias, &net.l4.weight, &net.l4.bias].map(|t| t.clone()))
        .collect()
}

/// The flow's parameters in the kernels' order ([`parameters`]) when the fused kernels can evaluate
/// `flow` on `e`: CUDA, (N, 2) residuals, and a flow of the reference's shape with f32 parameters
/// on the same device; `None` otherwise.
fn supported_parameters(flow: &RealNvp, e: &Tensor) -> Option<Vec<Tensor>> {
    let h = FLOW_HIDDEN;
    let shapes: [&[usize]; 6] = [&[h, 2], &[h], &[h, h], &[h], &[2, h], &[2]];
    let input_ok = e.device().is_cuda() && e.rank() == 2 && e.dims()[1] == 2 && u32::try_from(e.dims()[0]).is_ok();
    let nets_ok =
        flow.s.len() == FLOW_LAYERS && flow.t.len() == FLOW_LAYERS && flow.s.iter().all(|n| n.tanh) && flow.t.iter().all(|n| !n.tanh);
    if !(input_ok && nets_ok) {
        return None;
    }
    let params = parameters(flow);
    let ok = params.iter().enumerate().all(|(i, p)| p.dtype() == DType::F32 && p.device() == e.device() && p.dims() == shapes[i % 6]);
    ok.then_some(params)
}

/// The compute dtype the composed ops would round to: 0 f32, 1 bf16, 2 f16.
fn rounding_mode() -> i32 {
    match ptl_autograd::autocast_dtype() {
        Some(DType::BF16) => 1,
        Some(DType::F16) => 2,
        _ => 0,
    }
}

fn grid_of(what: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| TrainerError::InvalidArgument { what, reason: format!("{v} does not fit the kernels' 32-bit grid") })
}

/// `log p(e)` (N) of the flow for residuals `e` (N, 2), differentiable in `e` and the flow's
/// parameters — `None` when the fused kernels cannot take this flow or input (not CUDA, another
/// shape): the caller runs the composed flow then.
pub fn log_prob(flow: &RealNvp, e: &Tensor) -> Result<Option<Tensor>> {
    let Some(params) = supported_parameters(flow, e) else { return Ok(None) };
    let device = e.device();
    let n = e.dims()[0];
    let e = if e.dtype() == DType::F32 { e.clone() } else { e.to_dtype(DType::F32)? };
    let mode = rounding_mode();
    let lp = uninit(device, DType::F32, vec![n])?;
    let saved = uninit(device, DType::F32, vec![n, SAVED_PER_ROW])?;
    if n > 0 {
        let k = kernels(device, MODULE, SOURCE, FUNCTIONS)?;
        let neg_ln2pi = -(2.0 * std::f64::consts::PI).ln() as f32;
        let n32 = grid_of("flow rows", n)?;
        // SAFETY: the arguments match `flow_forward`'s parameters; `params` are the 72 f32 tensors
        // of the shapes the kernel indexes (checked by `supports`), `e` is (n, 2), `lp` (n) and
        // `saved` (n, 8); the kernel guards every row index against n.
        unsafe {
            use KernelArg::{Tensor as T, TensorArray, F32, I32, U32};
            k[0].launch(
                (grid_of("flow tiles", n.div_ceil(ROWS))?, 1, 1),
                (ROW_BLOCK, 1, 1),
                &[T(&e), TensorArray(&params), T(&lp), T(&saved), U32(n32), I32(mode), F32(neg_ln2pi)],
            )?;
        }
    }
    let backward = FlowBackward { params: params.iter().map(Tensor::detach).collect(), saved, n, mode, device };
    let mut inputs: Vec<&Tensor> = vec![&e];
    inputs.extend(params.iter());
    Ok(Some(ptl_autograd::attach_custom_node(Arc::new(backward), &inputs, &[lp]).remove(0)))
}

/// The backward of [`log_prob`]: ∂/∂e and the 72 parameter gradients (present even where the
/// reference's are zero: the masked column of each first layer, the kept row of each last).
struct FlowBackward {
    params: Vec<Tensor>,
    saved: Tensor,
    n: usize,
    mode: i32,
    device: Device,
}

impl BackwardOp for FlowBackward {
    fn name(&self) -> &str {
        "flow_log_prob_fused"
    }

    fn backward(&self, grad_outputs: &[Option<Tensor>]) -> ptl_autograd::Result<Vec<Option<Tensor>>> {
        self.run(grad_outputs).map_err(|e| backward_error("flow_log_prob_fused", e))
    }
}

impl FlowBackward {
    fn run(&self, grad_outputs: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = grad_outputs.first().cloned().flatten() else {
            return Ok(vec![None; 1 + self.params.len()]);
        };
        let g = if g.dtype() == DType::F32 { g } else { g.to_dtype(DType::F32)? };
        let (device, n) = (self.device, self.n);
        let de = uninit(device, DType::F32, vec![n, 2])?;
        let grads: Vec<Tensor> = self.params.iter().map(|p| uninit(device, DType::F32, p.dims().to_vec())).collect::<Result<_>>()?;
        let nets = uninit(device, DType::F32, vec![n.max(1), NETS_PER_ROW])?;
        let partial = uninit(device, DType::F32, vec![CHUNKS, 2 * FLOW_LAYERS, NET_PARAMS])?;
        let k = kernels(device, MODULE, SOURCE, FUNCTIONS)?;
        let n32 = grid_of("flow rows", n)?;
        let total = grid_of("flow parameters", 2 * FLOW_LAYERS * NET_PARAMS)?;
        // SAFETY: each argument list matches its kernel's parameters; `g` is (n), `saved` (n, 8),
        // `de` (n, 2), `nets` (≥ n, 18), `partial` (CHUNKS, 12, NET_PARAMS) and the 72 gradients have
        // their parameters' shapes; rows are guarded against n and `flow_reduce` against `total`.
        unsafe {
            use KernelArg::{Tensor as T, TensorArray, I32, U32};
            if n > 0 {
                k[1].launch(
                    (grid_of("flow tiles", n.div_ceil(ROWS))?, 1, 1),
                    (ROW_BLOCK, 1, 1),
                    &[T(&g), T(&self.saved), TensorArray(&self.params), T(&de), T(&nets), U32(n32), I32(self.mode)],
                )?;
            }
            k[2].launch(
                (CHUNKS as u32, 2 * FLOW_LAYERS as u32, 1),
                (BLOCK, 1, 1),
                &[T(&nets), TensorArray(&self.params), T(&partial), U32(n32), I32(self.mode)],
            )?;
            k[3].launch((total.div_ceil(256), 1, 1), (256, 1, 1), &[T(&partial), TensorArray(&grads), U32(CHUNKS as u32), I32(self.mode)])?;
        }
        let mut out = Vec::with_capacity(1 + grads.len());
        out.push(Some(de));
        out.extend(grads.into_iter().map(Some));
        Ok(out)
    }
}

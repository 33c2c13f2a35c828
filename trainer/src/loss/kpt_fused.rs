//! The dense loss's keypoint terms on CUDA in one forward and one backward kernel (`kpt_fused.cu`)
//! instead of ≈ 60 composed ops forward and ≈ 80 backward per branch and step: the OKS keypoint
//! term, the visibility BCE and the RLE rows (clamped errors, σ, keep mask) that go into the flow,
//! element by element over the foreground rows. The forward follows
//! [`super::dense::dense_branch_parts`]' composed ops in order; the backward writes out their chain
//! rule; a CUDA test compares values and gradients with the composed path.
//!
//! [`rle_rows`] does the same for the RLE term's rows after the flow.
//!
//! On by default on CUDA; [`set_enabled`] or `PTL_FUSED_KPT=0` turns it off (the composed ops are
//! used then, and on every other device).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ptl_autograd::internal::cuda::KernelArg;
use ptl_autograd::{BackwardOp, DType, Device, Tensor};

use super::device_kernels::{backward_error, f32_grads, grad_arg, kernels, launch_grid, rows_mismatch, uninit, FusedSwitch};
use crate::error::{Result, TrainerError};

const SOURCE: &str = include_str!("kpt_fused.cu");
const MODULE: &str = "ptl_trainer_kpt";
const FUNCTIONS: [&str; 4] = ["kpt_fwd", "kpt_bwd", "rle_fwd", "rle_bwd"];
const BLOCK: u32 = 256;

static SWITCH: FusedSwitch = FusedSwitch::new("PTL_FUSED_KPT");

/// Turns the fused keypoint terms on or off for this process (default: on, unless
/// `PTL_FUSED_KPT=0` is in the environment).
pub fn set_enabled(on: bool) {
    SWITCH.set(on);
}

/// Whether the fused keypoint terms are on (see [`set_enabled`]).
pub fn enabled() -> bool {
    SWITCH.enabled()
}

/// The foreground rows the keypoint terms read: F rows of K keypoints, every tensor f32,
/// contiguous, on one CUDA device.
pub struct KptRows<'a> {
    /// (F, K, 3) predicted keypoints: x, y offsets (grid units) and the visibility logit
    /// (differentiable).
    pub kp: &'a Tensor,
    /// (F, K, 2) σ logits (differentiable).
    pub sigma_logits: &'a Tensor,
    /// (F, 2) anchor points (grid units).
    pub anchor: &'a Tensor,
    /// (F, 1) strides.
    pub stride: &'a Tensor,
    /// (F, 4) target boxes, xyxy in grid units.
    pub target_box: &'a Tensor,
    /// (F, 1) 1 on real rows, 0 on padding rows.
    pub valid: &'a Tensor,
    /// (F, K, 3) target keypoints: x, y (pixels) and visibility.
    pub target_kpts: &'a Tensor,
    /// (1, K) the OKS factors (2σ)².
    pub two_sigma_sq: &'a Tensor,
    /// The floor of σ (the sigma dtype's smallest normal).
    pub sigma_floor: f64,
}

/// What the fused forward gives: per (row, keypoint) terms whose sums are the raw keypoint and
/// visibility terms (before the 1/(N·K) factor), and the RLE's rows.
pub struct KptTerms {
    /// (F, K) factor · (1 − exp(−d / denom)) · visible · valid.
    pub kpt: Tensor,
    /// (F, K) BCE(visibility logit, visible) · valid.
    pub kobj: Tensor,
    /// (F, K, 2) the clamped errors (0 where not kept).
    pub error: Tensor,
    /// (F, K, 2) σ (1 where not kept).
    pub sigma: Tensor,
    /// (F, K, 1) visible, real and finite (no gradient).
    pub keep: Tensor,
}

/// Whether the fused kernels take these rows: enabled, CUDA, f32, the shapes above, constant
/// targets, and a row count that fits the kernels' 32-bit index (see [`unsupported_because`]).
pub fn supports(rows: &KptRows<'_>) -> bool {
    unsupported_because(rows).is_none()
}

/// Why the fused kernels do not take these rows, or `None` when they do.
pub fn unsupported_because(rows: &KptRows<'_>) -> Option<String> {
    let kp = rows.kp;
    let d = kp.dims();
    if !enabled() {
        return Some("turned off".into());
    }
    if !kp.device().is_cuda() {
        return Some(format!("on {:?}", kp.device()));
    }
    if d.len() != 3 || d[2] != 3 {
        return Some(format!("keypoint rows of shape {d:?}"));
    }
    let (f, k) = (d[0], d[1]);
    let shapes: [(&str, &Tensor, &[usize]); 8] = [
        ("kp", rows.kp, &[f, k, 3]),
        ("sigma_logits", rows.sigma_logits, &[f, k, 2]),
        ("anchor", rows.anchor, &[f, 2]),
        ("stride", rows.stride, &[f, 1]),
        ("target_box", rows.target_box, &[f, 4]),
        ("valid", rows.valid, &[f, 1]),
        ("target_kpts", rows.target_kpts, &[f, k, 3]),
        ("two_sigma_sq", rows.two_sigma_sq, &[1, k]),
    ];
    if let Some(why) = rows_mismatch(kp.device(), &shapes, 2) {
        return Some(why);
    }
    if u32::try_from(f * k).is_err() {
        return Some(format!("{f} × {k} elements"));
    }
    None
}

/// Why the last call that could have taken the fused kernels did not (see
/// [`unsupported_because`]), for tests and diagnostics; `None` when every call took them.
pub fn last_refusal() -> Option<String> {
    LAST_REFUSAL.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Whether the fused kernels take `rows`; a refusal is kept for [`last_refusal`].
pub(crate) fn take(rows: &KptRows<'_>) -> bool {
    let why = unsupported_because(rows);
    let ok = why.is_none();
    if let Some(why) = why {
        *LAST_REFUSAL.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }
    ok
}

static LAST_REFUSAL: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Fused forward calls made by this process (tests check that the fused path ran).
pub fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

static CALLS: AtomicU64 = AtomicU64::new(0);

/// The keypoint terms of `rows` (the caller checked [`supports`]); `nkpt` is K as the loss's
/// visibility-factor numerator.
pub fn kpt_terms(rows: &KptRows<'_>) -> Result<KptTerms> {
    let device = rows.kp.device();
    let (f, nk) = (rows.kp.dims()[0], rows.kp.dims()[1]);
    let n = f * nk;
    let too_many = || TrainerError::InvalidArgument { what: "kpt_terms", reason: format!("{f} rows × {nk} keypoints") };
    let (f32_, nk32) = (u32::try_from(f).map_err(|_| too_many())?, u32::try_from(nk).map_err(|_| too_many())?);
    let kpt = uninit(device, DType::F32, vec![f, nk])?;
    let kobj = uninit(device, DType::F32, vec![f, nk])?;
    let error = uninit(device, DType::F32, vec![f, nk, 2])?;
    let sigma = uninit(device, DType::F32, vec![f, nk, 2])?;
    let keep = uninit(device, DType::F32, vec![f, nk, 1])?;
    let consts = Constants::of(rows);
    CALLS.fetch_add(1, Ordering::Relaxed);
    if n > 0 {
        let k = kernels(device, MODULE, SOURCE, FUNCTIONS)?;
        // SAFETY: the arguments match `kpt_fwd`'s parameters; `supports` checked every input's
        // shape and dtype, the outputs are (F, K) / (F, K, 2) / (F, K, 1) f32; the grid-stride
        // loop stays below F·K.
        unsafe {
            use KernelArg::{Tensor as T, F32, U32};
            k[0].launch(
                (launch_grid(n, BLOCK), 1, 1),
                (BLOCK, 1, 1),
                &[
                    T(rows.kp),
                    T(rows.sigma_logits),
                    T(rows.anchor),
                    T(rows.stride),
                    T(rows.target_box),
                    T(rows.valid),
                    T(rows.target_kpts),
                    T(rows.two_sigma_sq),
                    T(&kpt),
                    T(&kobj),
                    T(&error),
                    T(&sigma),
                    T(&keep),
                    U32(f32_),
                    U32(nk32),
                    F32(nk as f32),
                    F32(rows.sigma_floor as f32),
                ],
            )?;
        }
    }
    let backward = KptBackward { kp: rows.kp.detach(), sigma_logits: rows.sigma_logits.detach(), consts, f: f32_, nk: nk32, device };
    let mut out = ptl_autograd::attach_custom_node(Arc::new(backward), &[rows.kp, rows.sigma_logits], &[kpt, kobj, error, sigma]);
    let sigma = out.pop().ok_or_else(too_many)?;
    let error = out.pop().ok_or_else(too_many)?;
    let kobj = out.pop().ok_or_else(too_many)?;
    let kpt = out.pop().ok_or_else(too_many)?;
    Ok(KptTerms { kpt, kobj, error, sigma, keep })
}

/// The constant inputs, kept for the backward (which recomputes the forward's values per thread).
struct Constants {
    anchor: Tensor,
    stride: Tensor,
    target_box: Tensor,
    valid: Tensor,
    target_kpts: Tensor,
    two_sigma_sq: Tensor,
    sigma_floor: f32,
}

impl Constants {
    fn of(rows: &KptRows<'_>) -> Constants {
        Constants {
            anchor: rows.anchor.detach(),
            stride: rows.stride.detach(),
            target_box: rows.target_box.detach(),
            valid: rows.valid.detach(),
            target_kpts: rows.target_kpts.detach(),
            two_sigma_sq: rows.two_sigma_sq.detach(),
            sigma_floor: rows.sigma_floor as f32,
        }
    }
}

struct KptBackward {
    kp: Tensor,
    sigma_logits: Tensor,
    consts: Constants,
    f: u32,
    nk: u32,
    device: Device,
}

impl BackwardOp for KptBackward {
    fn name(&self) -> &str {
        "kpt_fused"
    }

    fn backward(&self, grad_outputs: &[Option<Tensor>]) -> ptl_autograd::Result<Vec<Option<Tensor>>> {
        if grad_outputs.iter().all(Option::is_none) {
            return Ok(vec![None, None]);
        }
        let run = || -> Result<(Tensor, Tensor)> {
            let (f, nk) = (self.f as usize, self.nk as usize);
            let grads = f32_grads(grad_outputs)?;
            let d_kp = uninit(self.device, DType::F32, vec![f, nk, 3])?;
            let d_sg = uninit(self.device, DType::F32, vec![f, nk, 2])?;
            if f * nk > 0 {
                let k = kernels(self.device, MODULE, SOURCE, FUNCTIONS)?;
                let c = &self.consts;
                // SAFETY: the arguments match `kpt_bwd`'s parameters; the saved inputs have the
                // shapes `supports` checked, each present gradient the shape of its output (a
                // null address stands for an absent one), d_kp (F, K, 3) and d_sg (F, K, 2) f32;
                // the grid-stride loop stays below F·K.
                unsafe {
                    use KernelArg::{Tensor as T, F32, U32};
                    k[1].launch(
                        (launch_grid(f * nk, BLOCK), 1, 1),
                        (BLOCK, 1, 1),
                        &[
                            T(&self.kp),
                            T(&self.sigma_logits),
                            T(&c.anchor),
                            T(&c.stride),
                            T(&c.target_box),
                            T(&c.valid),
                            T(&c.target_kpts),
                            T(&c.two_sigma_sq),
                            grad_arg(&grads, 0),
                            grad_arg(&grads, 1),
                            grad_arg(&grads, 2),
                            grad_arg(&grads, 3),
                            T(&d_kp),
                            T(&d_sg),
                            U32(self.f),
                            U32(self.nk),
                            F32(nk as f32),
                            F32(c.sigma_floor),
                        ],
                    )?;
                }
            }
            Ok((d_kp, d_sg))
        };
        run().map(|(a, b)| vec![Some(a), Some(b)]).map_err(|e| backward_error("kpt_fused", e))
    }
}

/// The RLE term's rows after the flow: σ (F, K, 2), log φ (F·K), errors (F·K, 2) (these three
/// differentiable), keypoint weights (1, K, 1), keep (F, K, 1) and the kept count n_keep (a
/// 1-element device tensor), all f32 on one CUDA device.
pub struct RleRowsIn<'a> {
    /// (F, K, 2) σ (1 where not kept).
    pub sigma: &'a Tensor,
    /// (F·K,) the flow's log-density of each row's error.
    pub log_phi: &'a Tensor,
    /// (F·K, 2) the clamped errors.
    pub error: &'a Tensor,
    /// (1, K, 1) the keypoint weights.
    pub weights: &'a Tensor,
    /// (F, K, 1) the keep mask.
    pub keep: &'a Tensor,
    /// The kept rows' count, at least 1 (one element).
    pub n_keep: &'a Tensor,
}

/// Whether [`rle_rows`] takes these rows (enabled, CUDA, f32, the shapes of [`RleRowsIn`],
/// constants without gradient, a 32-bit element count).
pub fn supports_rle(rows: &RleRowsIn<'_>) -> bool {
    let d = rows.sigma.dims();
    if !enabled() || !rows.sigma.device().is_cuda() || d.len() != 3 || d[2] != 2 {
        return false;
    }
    let (f, k) = (d[0], d[1]);
    let shapes: [(&str, &Tensor, &[usize]); 6] = [
        ("sigma", rows.sigma, &[f, k, 2]),
        ("log_phi", rows.log_phi, &[f * k]),
        ("error", rows.error, &[f * k, 2]),
        ("weights", rows.weights, &[1, k, 1]),
        ("keep", rows.keep, &[f, k, 1]),
        ("n_keep", rows.n_keep, rows.n_keep.dims()),
    ];
    rows_mismatch(rows.sigma.device(), &shapes, 3).is_none()
        && rows.n_keep.dims().iter().product::<usize>() == 1
        && u32::try_from(f * k).is_ok()
}

/// Each row's RLE term before the sum, (F, K, 2): ((log σ − log φ) + (log 2σ + |e|)) · w · keep /
/// n_keep, as `dense::rle_terms` composes it (the caller checked [`supports_rle`]).
pub fn rle_rows(rows: &RleRowsIn<'_>) -> Result<Tensor> {
    let device = rows.sigma.device();
    let (f, nk) = (rows.sigma.dims()[0], rows.sigma.dims()[1]);
    let too_many = || TrainerError::InvalidArgument { what: "rle_rows", reason: format!("{f} rows × {nk} keypoints") };
    let (f32_, nk32) = (u32::try_from(f).map_err(|_| too_many())?, u32::try_from(nk).map_err(|_| too_many())?);
    let out = uninit(device, DType::F32, vec![f, nk, 2])?;
    let saved = RleBackward {
        sigma: rows.sigma.detach(),
        error: rows.error.detach(),
        weights: rows.weights.detach(),
        keep: rows.keep.detach(),
        n_keep: rows.n_keep.detach(),
        f: f32_,
        nk: nk32,
        device,
    };
    if f * nk > 0 {
        let k = kernels(device, MODULE, SOURCE, FUNCTIONS)?;
        // SAFETY: the arguments match `rle_fwd`'s parameters; `supports_rle` checked every input's
        // shape and dtype, out is (F, K, 2) f32; the grid-stride loop stays below F·K.
        unsafe {
            use KernelArg::{Tensor as T, U32};
            k[2].launch(
                (launch_grid(f * nk, BLOCK), 1, 1),
                (BLOCK, 1, 1),
                &[
                    T(rows.sigma),
                    T(rows.log_phi),
                    T(rows.error),
                    T(rows.weights),
                    T(rows.keep),
                    T(rows.n_keep),
                    T(&out),
                    U32(f32_),
                    U32(nk32),
                ],
            )?;
        }
    }
    let mut v = ptl_autograd::attach_custom_node(Arc::new(saved), &[rows.sigma, rows.log_phi, rows.error], &[out]);
    v.pop().ok_or_else(too_many)
}

struct RleBackward {
    sigma: Tensor,
    error: Tensor,
    weights: Tensor,
    keep: Tensor,
    n_keep: Tensor,
    f: u32,
    nk: u32,
    device: Device,
}

impl BackwardOp for RleBackward {
    fn name(&self) -> &str {
        "rle_rows_fused"
    }

    fn backward(&self, grad_outputs: &[Option<Tensor>]) -> ptl_autograd::Result<Vec<Option<Tensor>>> {
        let Some(g) = grad_outputs.first().cloned().flatten() else { return Ok(vec![None, None, None]) };
        let run = || -> Result<[Tensor; 3]> {
            let (f, nk) = (self.f as usize, self.nk as usize);
            let g = if g.dtype() == DType::F32 { g.clone() } else { g.to_dtype(DType::F32)? };
            let d_s = uninit(self.device, DType::F32, vec![f, nk, 2])?;
            let d_lp = uninit(self.device, DType::F32, vec![f * nk])?;
            let d_e = uninit(self.device, DType::F32, vec![f * nk, 2])?;
            if f * nk > 0 {
                let k = kernels(self.device, MODULE, SOURCE, FUNCTIONS)?;
                // SAFETY: the arguments match `rle_bwd`'s parameters; the saved inputs have the
                // shapes `supports_rle` checked, g is (F, K, 2), the outputs (F, K, 2), (F·K) and
                // (F·K, 2) f32; the grid-stride loop stays below F·K.
                unsafe {
                    use KernelArg::{Tensor as T, U32};
                    k[3].launch(
                        (launch_grid(f * nk, BLOCK), 1, 1),
                        (BLOCK, 1, 1),
                        &[
                            T(&self.sigma),
                            T(&self.error),
                            T(&self.weights),
                            T(&self.keep),
                            T(&self.n_keep),
                            T(&g),
                            T(&d_s),
                            T(&d_lp),
                            T(&d_e),
                            U32(self.f),
                            U32(self.nk),
                        ],
                    )?;
                }
            }
            Ok([d_s, d_lp, d_e])
        };
        run().map(|d| d.into_iter().map(Some).collect()).map_err(|e| backward_error("rle_rows_fused", e))
    }
}

//! The dense assigner on CUDA in five kernel launches (`assign_fused.cu`) instead of ≈ 240
//! composed tensor ops per branch: the same operations in the same f32 order, so on a GPU it gives
//! the composed assigner's bytes (tested), with the (image, slot, anchor, keypoint) intermediates
//! never written to memory.

use ptl_autograd::internal::cuda::KernelArg;
use ptl_autograd::{DType, Tensor};

use super::assign_dense::{DenseAssignment, DenseInputs};
use super::assigner::AssignParams;
use super::boxes::CIOU_EPS;
use super::device_kernels::{kernels, uninit};
use crate::error::{Result, TrainerError};

const SOURCE: &str = include_str!("assign_fused.cu");
const MODULE: &str = "ptl_trainer_assign";
const FUNCTIONS: [&str; 5] = ["candidates", "slot_topk", "resolve_claims", "second_topk", "targets"];
/// Threads of the per-slot kernels (`BLOCK` in the source).
const SLOT_BLOCK: u32 = 512;
/// Anchors per block of the candidates kernel: a slot's overlaps spread over several blocks (one
/// block per slot left most of the GPU idle while a few slots' blocks ran ≈ 120 µs).
const CANDIDATE_SPAN: usize = 1024;
/// Keypoints and top-k picks the per-slot kernels hold in shared memory (`MAX_K`).
pub const MAX_PICKS: usize = 64;

fn u32_of(what: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| TrainerError::InvalidArgument { what, reason: format!("{v} does not fit the kernels' 32-bit sizes") })
}

/// Whether the fused kernels can run these inputs (CUDA, ≤ 64 keypoints and picks).
pub fn supports(inp: &DenseInputs<'_>, p: &AssignParams) -> bool {
    inp.scores.device().is_cuda() && p.sigmas.len() <= MAX_PICKS && p.topk <= MAX_PICKS && p.topk2 <= MAX_PICKS
}

/// Runs the assigner of docs/loss.md §2 with the fused kernels; the shapes were checked by the caller
/// ([`super::assign_dense::assign_dense`]).
pub(crate) fn assign_fused(inp: &DenseInputs<'_>, p: &AssignParams) -> Result<DenseAssignment> {
    let t = inp.targets;
    let geo = inp.geometry;
    let (bs, na, nc) = (inp.scores.dims()[0], inp.scores.dims()[1], inp.scores.dims()[2]);
    let (m, nk) = (t.slots, t.kpts.dims()[2]);
    let device = inp.scores.device();
    let [k_cand, k_topk, k_resolve, k_second, k_targets] = kernels(device, MODULE, SOURCE, FUNCTIONS)?;
    let f32_in = |x: &Tensor| -> Result<Tensor> { Ok(x.to_dtype(DType::F32)?) };
    let (scores, boxes, kpts) = (f32_in(inp.scores)?, f32_in(inp.boxes)?, f32_in(inp.kpts)?);
    let (b32, m32, a32, k32, nc32) =
        (u32_of("batch", bs)?, u32_of("slots", m)?, u32_of("anchors", na)?, u32_of("keypoints", nk)?, u32_of("classes", nc)?);
    let slots_grid = u32_of("batch × slots", bs * m)?;
    let rows_grid = u32_of("batch × anchors", (bs * na).div_ceil(256).clamp(1, 65_535))?;
    // Every element of these is written by the kernels: no fill launches.
    let uninit = |dims: Vec<usize>, dtype: DType| uninit(device, dtype, dims);
    let (overlaps, metric, pos) =
        (uninit(vec![bs, m, na], DType::F32)?, uninit(vec![bs, m, na], DType::F32)?, uninit(vec![bs, m, na], DType::F32)?);
    let (pos_align, pos_overlap) = (uninit(vec![bs, m], DType::F32)?, uninit(vec![bs, m], DType::F32)?);
    let fg_mask = uninit(vec![bs, na], DType::F32)?;
    let (gt_idx, target_labels) = (uninit(vec![bs, na], DType::I64)?, uninit(vec![bs, na], DType::I64)?);
    let (target_bboxes, target_scores) = (uninit(vec![bs, na, 4], DType::F32)?, uninit(vec![bs, na, nc], DType::F32)?);
    let four_over_pi2 = (4.0 / (std::f64::consts::PI * std::f64::consts::PI)) as f32;
    let ciou_one_plus_eps = (1.0 + f64::from(CIOU_EPS)) as f32;
    // SAFETY: each argument list matches its kernel's parameters in order and type; every tensor
    // is a contiguous f32/i64 buffer of the shape named in the source (checked by the caller), and
    // the grids (B·M blocks, by anchor slices for the candidates; grid-stride loops over B·A)
    // keep each access inside them.
    unsafe {
        use KernelArg::{Tensor as T, F32, U32};
        k_cand.launch(
            (slots_grid, u32_of("anchor slices", na.div_ceil(CANDIDATE_SPAN).max(1))?, 1),
            (SLOT_BLOCK, 1, 1),
            &[
                T(&t.boxes),
                T(&t.mask),
                T(&t.labels),
                T(&t.kpts),
                T(&scores),
                T(&boxes),
                T(&kpts),
                T(&geo.anchors_px),
                T(&geo.strides),
                T(&geo.sigma_sq),
                T(&overlaps),
                T(&metric),
                T(&pos),
                U32(m32),
                U32(a32),
                U32(k32),
                U32(nc32),
                U32(CANDIDATE_SPAN as u32),
                F32(p.eps),
                F32(p.size_floor),
                F32(p.level_range.0),
                F32(p.level_range.1),
                F32(p.min_stride),
                F32(p.max_stride),
                F32(p.area_factor),
                F32(CIOU_EPS),
                F32(ciou_one_plus_eps),
                F32(four_over_pi2),
            ],
        )?;
        k_topk.launch(
            (slots_grid, 1, 1),
            (SLOT_BLOCK, 1, 1),
            &[T(&t.mask), T(&metric), T(&pos), U32(a32), U32(u32_of("top-k", p.topk)?)],
        )?;
        k_resolve.launch((rows_grid, 1, 1), (256, 1, 1), &[T(&overlaps), T(&pos), U32(b32), U32(m32), U32(a32)])?;
        k_second.launch(
            (slots_grid, 1, 1),
            (SLOT_BLOCK, 1, 1),
            &[
                T(&overlaps),
                T(&metric),
                T(&pos),
                T(&pos_align),
                T(&pos_overlap),
                U32(a32),
                U32(u32_of("second top-k", p.topk2)?),
                U32(u32::from(p.topk2 != p.topk)),
            ],
        )?;
        k_targets.launch(
            (rows_grid, 1, 1),
            (256, 1, 1),
            &[
                T(&metric),
                T(&pos),
                T(&pos_align),
                T(&pos_overlap),
                T(&t.labels),
                T(&t.boxes),
                T(&fg_mask),
                T(&gt_idx),
                T(&target_labels),
                T(&target_bboxes),
                T(&target_scores),
                U32(b32),
                U32(m32),
                U32(a32),
                U32(nc32),
                F32(p.eps),
            ],
        )?;
    }
    Ok(DenseAssignment { fg_mask, target_gt_idx: gt_idx, target_labels, target_bboxes, target_scores })
}

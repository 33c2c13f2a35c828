//! Weight gradients of planar 1×1 convolutions with rows that are not 16-byte aligned (the head's
//! 4-, 1-, 51- and 34-channel projections) at small batches: the launcher of `narrow_wgrad.cu`.
//! cuBLAS needed one GEMM per batch item for them (its batched kernel for these shapes is slower
//! still below about a dozen items), each split in two by its heuristic, plus a cast; with this
//! kernel a batch-4 step on an H100 has 2,172 kernels instead of 2,308 and 9.4 ms of them instead
//! of 9.7 (24 layers, 0.20 ms in this kernel). Blocks take bands of the contraction over (item,
//! position) and tiles of the weight; the bands' f32 partials are added in order by each tile's
//! last block (one launch, no separate sum), so the bytes are fixed for a shape.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use super::super::device::sfx;
use super::super::storage::CudaStorage;
use crate::backend::Conv2dParams;
use crate::{DType, Result};

use super::geometry::*;

/// Weight rows (outputs) and columns (inputs) per block tile (`NW_TO`, `NW_TC` in the kernel).
const TILE_OUT: usize = 64;
const TILE_IN: usize = 32;
/// Contraction positions per shared chunk (`NW_KC`): a band is a whole number of chunks.
const CHUNK: usize = 32;
/// Blocks a launch aims at: about four per SM of the largest GPUs, so that the bands' loads
/// overlap; the partials stay small (bands × Co × Ci floats).
const TARGET_BLOCKS: usize = 528;

static NARROW_WGRADS: AtomicU64 = AtomicU64::new(0);

/// How many weight gradients the narrow pointwise kernel computed in this process (to check which
/// path a shape takes).
pub(crate) fn narrow_weight_gradients() -> u64 {
    NARROW_WGRADS.load(Ordering::Relaxed)
}

/// Bands of the contraction for `k` positions and `tiles` weight tiles: enough blocks to fill the
/// GPU, at least one chunk per band. Returns (bands, positions per band).
fn bands(k: usize, tiles: usize) -> (usize, usize) {
    let chunks = k.div_ceil(CHUNK).max(1);
    let wanted = TARGET_BLOCKS.div_ceil(tiles.max(1)).clamp(1, chunks);
    let per = chunks.div_ceil(wanted) * CHUNK;
    (k.div_ceil(per).max(1), per)
}

/// How many of those also computed their convolution's bias gradient in the same launch.
static NARROW_BIAS_GRADIENTS: AtomicU64 = AtomicU64::new(0);

/// How many bias gradients the narrow pointwise kernel computed beside a weight gradient in this
/// process (instead of a reduction of its own).
pub(crate) fn narrow_bias_gradients() -> u64 {
    NARROW_BIAS_GRADIENTS.load(Ordering::Relaxed)
}

/// The weight gradient of the 1×1 stride-1 convolution `p` from `dy` (N, Co, H, W) and `x`
/// (N, Ci, H, W), planar, into `out` (Co·Ci values of `dy`'s dtype: f32, bf16 or f16).
pub(crate) fn narrow_pointwise_weight_gradient(
    dy: &CudaStorage,
    x: &CudaStorage,
    p: &Conv2dParams,
    out: CudaStorage,
) -> Result<CudaStorage> {
    narrow_pointwise_gradients(dy, x, p, out, None)
}

/// [`narrow_pointwise_weight_gradient`] and, into `bias` (Co values of `dy`'s dtype), the bias
/// gradient Σ over items and positions of `dy`, in the same launch: the blocks that hold a band
/// of `dy` for the weight add it up per output too, and the tile's last block adds the bands in
/// order, so the bytes are fixed for a shape.
pub(crate) fn narrow_pointwise_weight_and_bias_gradients(
    dy: &CudaStorage,
    x: &CudaStorage,
    p: &Conv2dParams,
    out: CudaStorage,
    bias: CudaStorage,
) -> Result<(CudaStorage, CudaStorage)> {
    if bias.len != p.c_out || bias.dtype != dy.dtype {
        return Err(crate::Error::invalid(
            "conv2d_backward_weight_and_bias (narrow 1×1)",
            format!("{} {} bias values for {} {} outputs", bias.len, bias.dtype, p.c_out, dy.dtype),
        ));
    }
    let w = narrow_pointwise_gradients(dy, x, p, out, Some(&bias))?;
    NARROW_BIAS_GRADIENTS.fetch_add(1, Ordering::Relaxed);
    Ok((w, bias))
}

fn narrow_pointwise_gradients(
    dy: &CudaStorage,
    x: &CudaStorage,
    p: &Conv2dParams,
    out: CudaStorage,
    bias: Option<&CudaStorage>,
) -> Result<CudaStorage> {
    const OP: &str = "conv2d_backward_weight (narrow 1×1)";
    let dev = &dy.buf.dev;
    let c = |v| u32c(OP, v);
    let positions = p.h_in * p.w_in;
    let k = p.batch * positions;
    let (to, tc) = (p.c_out.div_ceil(TILE_OUT), p.c_in.div_ceil(TILE_IN));
    let (nb, per) = bands(k, to * tc);
    if to * tc > super::super::device::BN_TICKETS {
        return Err(crate::Error::invalid(OP, format!("{} weight tiles exceed the {} tickets", to * tc, super::super::device::BN_TICKETS)));
    }
    let part = CudaStorage::alloc(dev, DType::F32, nb * p.c_out * p.c_in)?;
    let bias_part = bias.map(|_| CudaStorage::alloc(dev, DType::F32, nb * p.c_out)).transpose()?;
    let (pa, pb, pp, po) = (ptr(dy), ptr(x), ptr(&part), ptr(&out));
    // Null pointers: no bias gradient.
    let (pbp, pbo) = match (&bias_part, bias) {
        (Some(bp), Some(b)) => (ptr(bp), ptr(b)),
        _ => (0u64, 0u64),
    };
    let (co, ci, pn, kk, pr, pnb) = (c(p.c_out)?, c(p.c_in)?, c(positions)?, c(k)?, c(per)?, c(nb)?);
    // The stream's batch-norm tickets: kernels of one stream run one after another.
    let tickets = dev.bn_tickets();
    let f = dev.func("narrow_wgrad", sfx(dy.dtype))?;
    dev.launch(f, (pnb, c(to)?, c(tc)?), (256, 1, 1), &mut args!(pa, pb, pp, po, pbp, pbo, co, ci, pn, kk, pr, pnb, tickets))?;
    NARROW_WGRADS.fetch_add(1, Ordering::Relaxed);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_cover_the_contraction_in_whole_chunks() {
        for (k, tiles) in [(1, 1), (31, 1), (25_600, 2), (25_600, 6), (6_400 * 15, 1), (1_600 * 4, 3), (100, 600)] {
            let (nb, per) = bands(k, tiles);
            assert_eq!(per % CHUNK, 0, "k {k}: {per} not whole chunks");
            assert!(nb * per >= k && (nb - 1) * per < k, "k {k}: {nb} bands of {per} miss or repeat positions");
            assert!(nb * tiles <= TARGET_BLOCKS.max(tiles), "k {k}, {tiles} tiles: {nb} bands");
        }
        // The head's 85 → 51 projection at batch 4 on the stride-8 map (80 × 80): 2 × 3 tiles want
        // 88 bands of the 800 chunks, 10 chunks each, so 80 bands of 320 positions.
        assert_eq!(bands(4 * 6_400, 6), (80, 320));
    }
}

//! Weight gradients of planar convolutions with few input channels (the model's first layer, RGB
//! in): the launcher of `thin_conv.cu`. cuDNN's heuristic picked a direct engine for this shape at
//! batch 64 that took ≈ 9 ms of an 77 ms step on an H100; the reduction has N·Ho·Wo terms for
//! only Co·Ci·KH·KW outputs, so blocks take bands of output rows, each thread one output, and the
//! bands' partials are added in order: the bytes are fixed for a shape.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use super::super::device::sfx;
use super::super::storage::CudaStorage;
use crate::backend::Conv2dParams;
use crate::{DType, Result};

use super::geometry::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct ThinGeo {
    n: u32,
    ci: u32,
    h: u32,
    w: u32,
    co: u32,
    ho: u32,
    wo: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    ph: u32,
    pw: u32,
    tw: u32,
}

/// Input channels up to which a convolution counts as thin.
const THIN_MAX_INPUT_CHANNELS: usize = 4;
/// Floats of shared memory a block has (`THIN_SMEM` in `thin_conv.cu`).
const THIN_SMEM: usize = 12000;
/// Bands of output rows (blocks): a few per SM of the largest GPUs, whose partials the second
/// launch adds.
const THIN_BANDS: usize = 264;

static THIN_WGRADS: AtomicU64 = AtomicU64::new(0);

/// How many weight gradients the thin-input kernels computed in this process (to check which path
/// a shape takes).
pub(crate) fn thin_weight_gradients() -> u64 {
    THIN_WGRADS.load(Ordering::Relaxed)
}

/// Output columns per tile: as many as fit the shared memory (all of a row where they fit), at
/// least 8; `None` when even 8 do not fit.
fn tile_width(p: &Conv2dParams) -> Option<usize> {
    let (co, ci, kh, kw, sw) = (p.c_out, p.c_in, p.kh, p.kw, p.stride.1);
    // co·tw + ci·kh·((tw − 1)·sw + kw) ≤ THIN_SMEM, i.e. tw·(co + ci·kh·sw) ≤ THIN_SMEM − ci·kh·(kw − sw).
    let fixed = ci * kh * kw.saturating_sub(sw);
    let tw = (THIN_SMEM.checked_sub(fixed)? / (co + ci * kh * sw).max(1)).min(p.w_out());
    (tw >= 8.min(p.w_out()).max(1)).then_some(tw)
}

/// Whether the thin-input kernel computes this weight gradient: planar storage, one group, at most
/// [`THIN_MAX_INPUT_CHANNELS`] input channels, one thread per weight (≤ 1024), a tile that fits,
/// a dtype it computes (f64 stays with cuDNN).
pub(crate) fn takes_thin_weight_gradient(p: &Conv2dParams, dtype: DType) -> bool {
    let weights = p.c_out * p.c_in * p.kh * p.kw;
    !p.channels_last
        && p.groups == 1
        && p.c_in <= THIN_MAX_INPUT_CHANNELS
        && (1..=1024).contains(&weights)
        && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        && tile_width(p).is_some()
}

/// The weight gradient of `p` ([`takes_thin_weight_gradient`]) from `dy` and `x` into `out`
/// (Co·Ci·KH·KW values of `dy`'s dtype).
pub(crate) fn thin_weight_gradient(dy: &CudaStorage, x: &CudaStorage, p: &Conv2dParams, out: CudaStorage) -> Result<CudaStorage> {
    const OP: &str = "conv2d_backward_weight (thin input)";
    let dev = &dy.buf.dev;
    let tw = tile_width(p).ok_or_else(|| crate::Error::invalid(OP, format!("no tile of {p:?} fits {THIN_SMEM} floats")))?;
    let c = |v| u32c(OP, v);
    let g = ThinGeo {
        n: c(p.batch)?,
        ci: c(p.c_in)?,
        h: c(p.h_in)?,
        w: c(p.w_in)?,
        co: c(p.c_out)?,
        ho: c(p.h_out())?,
        wo: c(p.w_out())?,
        kh: c(p.kh)?,
        kw: c(p.kw)?,
        sh: c(p.stride.0)?,
        sw: c(p.stride.1)?,
        ph: c(p.padding.0)?,
        pw: c(p.padding.1)?,
        tw: c(tw)?,
    };
    let rows = p.batch * p.h_out();
    let weights = p.c_out * p.c_in * p.kh * p.kw;
    let bands = THIN_BANDS.min(rows).max(1);
    let part = CudaStorage::alloc(dev, DType::F32, bands * weights)?;
    let (pa, pb, pp, rr, pn) = (ptr(dy), ptr(x), ptr(&part), c(rows)?, bands as u32);
    let f = dev.func("thin_weight_grad_part", sfx(dy.dtype))?;
    let threads = weights.div_ceil(32) * 32;
    dev.launch(f, (pn, 1, 1), (threads as u32, 1, 1), &mut args!(pa, pb, pp, g, rr, pn))?;
    super::reduce::sum_partials(&part, bands, &out)?;
    THIN_WGRADS.fetch_add(1, Ordering::Relaxed);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(c_in: usize, c_out: usize, k: usize, stride: usize, w_in: usize) -> Conv2dParams {
        Conv2dParams {
            channels_last: false,
            weight_channels_last: false,
            grad_channels_last: false,
            input_channels_last: false,
            batch: 64,
            c_in,
            h_in: w_in,
            w_in,
            c_out,
            kh: k,
            kw: k,
            stride: (stride, stride),
            padding: (k / 2, k / 2),
            groups: 1,
        }
    }

    #[test]
    fn the_stem_takes_a_whole_row_per_tile() {
        // 640 px in, 3×3 stride 2: 320 output columns, 16·320 + 3·3·641 = 10,889 floats.
        let stem = conv(3, 16, 3, 2, 640);
        assert_eq!(tile_width(&stem), Some(320));
        assert!(takes_thin_weight_gradient(&stem, DType::BF16));
        assert!(!takes_thin_weight_gradient(&stem, DType::F64), "f64 stays with cuDNN");
        // 32 outputs at stride 1: (12,000 − 18) / 41 = 292 columns per tile.
        assert_eq!(tile_width(&conv(3, 32, 3, 1, 300)), Some(292));
    }

    #[test]
    fn wide_or_grouped_or_channels_last_shapes_stay_with_cudnn() {
        assert!(!takes_thin_weight_gradient(&conv(16, 16, 3, 1, 64), DType::F32), "16 input channels");
        assert!(!takes_thin_weight_gradient(&conv(4, 64, 3, 1, 64), DType::F32), "2,304 weights > 1,024 threads");
        let mut cl = conv(3, 16, 3, 2, 64);
        cl.channels_last = true;
        assert!(!takes_thin_weight_gradient(&cl, DType::F32));
        let mut grouped = conv(4, 4, 3, 1, 64);
        grouped.groups = 2;
        assert!(!takes_thin_weight_gradient(&grouped, DType::F32));
    }
}

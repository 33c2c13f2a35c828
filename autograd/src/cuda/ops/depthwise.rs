//! Depthwise convolutions (one filter per channel) on channels-last storage: the launchers of
//! `depthwise.cu`. cuDNN runs these shapes in NHWC with direct kernels several times slower than
//! its planar engines (and pads the channels first); these kernels read whole rows of channels.
//! Each direction computes in a fixed order, so the bytes are fixed for a shape.

use std::ffi::c_void;

use super::super::conv_graph::Dir;
use super::super::device::sfx;
use super::super::storage::CudaStorage;
use crate::backend::Conv2dParams;
use crate::{DType, Result};

use super::geometry::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct DwGeo {
    n: u32,
    h: u32,
    w: u32,
    c: u32,
    ho: u32,
    wo: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    ph: u32,
    pw: u32,
}

/// Whether these kernels take the convolution: channels-last, one filter per channel, a dtype
/// they compute (f64 stays with cuDNN).
pub(crate) fn takes_depthwise(p: &Conv2dParams, dtype: DType) -> bool {
    p.channels_last && p.groups > 1 && p.groups == p.c_in && p.c_out == p.c_in && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

fn geo(op: &'static str, p: &Conv2dParams) -> Result<DwGeo> {
    let c = |v| u32c(op, v);
    Ok(DwGeo {
        n: c(p.batch)?,
        h: c(p.h_in)?,
        w: c(p.w_in)?,
        c: c(p.c_in)?,
        ho: c(p.h_out())?,
        wo: c(p.w_out())?,
        kh: c(p.kh)?,
        kw: c(p.kw)?,
        sh: c(p.stride.0)?,
        sw: c(p.stride.1)?,
        ph: c(p.padding.0)?,
        pw: c(p.padding.1)?,
    })
}

/// Blocks per (channel tile, tap) of the weight gradient: about two blocks per SM in all (264),
/// at least 64 rows per lane (8 lanes a block), at most 1024.
fn wgrad_parts(rows: usize, tiles: usize, taps: usize) -> usize {
    264usize.div_ceil(tiles * taps).min(rows.div_ceil(8 * 64)).clamp(1, 1024)
}

/// One direction of a depthwise convolution `p` ([`takes_depthwise`]) into `out`: forward (a = x,
/// b = w), data gradient (a = dy, b = w), weight gradient (a = dy, b = x).
pub(crate) fn depthwise_channels_last(
    dir: Dir,
    a: &CudaStorage,
    b: &CudaStorage,
    p: &Conv2dParams,
    out: CudaStorage,
) -> Result<CudaStorage> {
    const OP: &str = "depthwise_conv2d";
    let dev = &a.buf.dev;
    let g = geo(OP, p)?;
    let (pa, pb, po) = (ptr(a), ptr(b), ptr(&out));
    match dir {
        Dir::Fwd | Dir::BwdData => {
            let total = u32c(OP, out.len)?;
            let f = dev.func(if matches!(dir, Dir::Fwd) { "dw_fwd" } else { "dw_dgrad" }, sfx(a.dtype))?;
            dev.launch1d(f, out.len, &mut args!(pa, pb, po, g, total))?;
        }
        Dir::BwdFilter => {
            let rows = p.batch * p.h_out() * p.w_out();
            let (taps, tiles) = (p.kh * p.kw, p.c_in.div_ceil(32));
            let parts = wgrad_parts(rows, tiles, taps);
            let part = CudaStorage::alloc(dev, DType::F32, parts * p.c_in * taps)?;
            let (pp, rr, pn) = (ptr(&part), u32c(OP, rows)?, parts as u32);
            let f = dev.func("dw_wgrad_part", sfx(a.dtype))?;
            dev.launch(f, (pn, tiles as u32, taps as u32), (32, 8, 1), &mut args!(pa, pb, pp, g, rr, pn))?;
            super::reduce::sum_partials(&part, parts, &out)?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_gradient_fills_the_gpu_without_thin_blocks() {
        // 160×160 at batch 4, 32 channels, 3×3: one tile, 9 taps, 30 blocks each.
        assert_eq!(wgrad_parts(102_400, 1, 9), 30);
        // 20×20 at batch 4: 4 blocks of ≥ 64 rows per lane.
        assert_eq!(wgrad_parts(1600, 8, 9), 4);
        assert_eq!(wgrad_parts(10, 1, 9), 1);
    }

    #[test]
    fn only_channels_last_depthwise_shapes_in_f32_and_halves_come_here() {
        let p = Conv2dParams {
            channels_last: true,
            weight_channels_last: false,
            grad_channels_last: false,
            input_channels_last: false,
            batch: 2,
            c_in: 16,
            h_in: 8,
            w_in: 8,
            c_out: 16,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            padding: (1, 1),
            groups: 16,
        };
        assert!(takes_depthwise(&p, DType::BF16) && takes_depthwise(&p, DType::F32));
        assert!(!takes_depthwise(&p, DType::F64));
        assert!(!takes_depthwise(&Conv2dParams { channels_last: false, ..p }, DType::BF16));
        assert!(!takes_depthwise(&Conv2dParams { groups: 1, ..p }, DType::BF16));
        assert!(!takes_depthwise(&Conv2dParams { c_out: 32, ..p }, DType::BF16), "a channel multiplier of 2");
    }
}

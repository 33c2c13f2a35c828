//! Batch normalisation (+SiLU) and the per-channel affine on channels-last storage (N, H, W, C):
//! the launchers of `norm.cu`'s channels-last kernels. `norm.rs` checks the arguments and hands
//! channels-last tensors here. A block takes a tile of consecutive channels and row lanes; the
//! sums keep a fixed order, so a shape's bytes are fixed (not those of the N, C, H, W kernels:
//! the summation order differs).

use std::ffi::c_void;

use super::super::device::sfx;
use super::super::storage::CudaStorage;
use super::geometry::*;
use super::norm_rules::{bn_channels, bn_one_block_max, bn_one_launch, bn_vector};
use crate::Result;

/// The statistics' per-channel arguments: weight, bias and running statistics in, the affine and
/// normalisation parameters out (all in the statistics dtype); `nbt` the batch counter's address
/// or 0.
pub(super) struct Stats<'a> {
    pub w: &'a CudaStorage,
    pub b: &'a CudaStorage,
    pub rm: &'a CudaStorage,
    pub rv: &'a CudaStorage,
    pub nbt: u64,
    pub eps: f64,
    pub momentum: f64,
    pub aff: &'a CudaStorage,
    pub nrm: &'a CudaStorage,
}

/// The backward's per-channel arguments: the forward's parameters and weight in, the weight and
/// bias gradients and dx's coefficients out.
pub(super) struct Grads<'a> {
    pub aff: &'a CudaStorage,
    pub nrm: &'a CudaStorage,
    pub w: &'a CudaStorage,
    pub gw: &'a CudaStorage,
    pub gb: &'a CudaStorage,
    pub coef: &'a CudaStorage,
}

/// How a layer of `rows` = N·H·W rows and `c` channels is launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Split {
    /// Channels per block (≤ 32; the block is (tile, 256 / tile)).
    pub tile: u32,
    /// Blocks per tile (1: one launch may also apply y or dx).
    pub parts: u32,
}

/// A layer whose channels have at most `one_block_max` values (the N, C, H, W kernels' one-block
/// rule) runs one block per tile of 8 channels (more blocks for the small layers), and may fuse
/// its two passes; larger ones take tiles of 32 (a warp reads 64–128 contiguous bytes of a row)
/// split over about two blocks per SM in all (264), at least 64 rows a block, at most 1024.
pub(super) fn split(rows: usize, c: usize, one_block_max: usize) -> Split {
    if rows <= one_block_max {
        return Split { tile: 8, parts: 1 };
    }
    let tile = if c >= 32 { 32 } else { 8 };
    let tiles = c.div_ceil(tile);
    let parts = 264usize.div_ceil(tiles).min(rows.div_ceil(64)).clamp(1, 1024);
    Split { tile: tile as u32, parts: parts as u32 }
}

fn grid(s: Split, c: usize) -> ((u32, u32, u32), (u32, u32, u32)) {
    ((s.parts, c.div_ceil(s.tile as usize) as u32, 1), (s.tile, 256 / s.tile, 1))
}

/// Training statistics of channels-last `x` (`rows` × `c`); with `apply` = `Some(silu)` and a
/// one-block split, y in the same launch, which it returns.
pub(super) fn train(x: &CudaStorage, rows: usize, c: usize, st: &Stats, apply: Option<bool>) -> Result<Option<CudaStorage>> {
    const OP: &str = "batch_norm_train_stats";
    let dev = &x.buf.dev;
    let (rr, cc) = (u32c(OP, rows)?, bn_channels(OP, c)?);
    u32c(OP, x.len)?;
    let s = split(rows, c, bn_one_block_max());
    let (g, b) = grid(s, c);
    let count = rows as f64;
    let (px, pw, pb, prm, prv, pa, pq, nbt) = (ptr(x), ptr(st.w), ptr(st.b), ptr(st.rm), ptr(st.rv), ptr(st.aff), ptr(st.nrm), st.nbt);
    let (eps, mom) = (st.eps, st.momentum);
    if let (Some(silu), true) = (apply, bn_one_launch(dev, s.parts as usize)) {
        let y = CudaStorage::alloc(dev, x.dtype, x.len)?;
        let (py, act) = (ptr(&y), silu as i32);
        let f = dev.func("bncl_fwd1", sfx(x.dtype))?;
        dev.launch(f, g, b, &mut args!(px, py, rr, cc, count, pw, pb, prm, prv, eps, mom, pa, pq, nbt, act))?;
        return Ok(Some(y));
    }
    let part = super::super::alloc::DevBuf::alloc(dev, c * s.parts as usize * 16)?;
    let (pp, pn, tickets) = (part.ptr, s.parts, dev.bn_tickets);
    let f = dev.func("bncl_stats", sfx(x.dtype))?;
    dev.launch(f, g, b, &mut args!(px, pp, rr, cc, pn, tickets, count, pw, pb, prm, prv, eps, mom, pa, pq, nbt))?;
    drop(part);
    Ok(None)
}

/// `out = act(x·p[c] + p[C + c])` over channels-last `x` (`c` channels).
pub(super) fn affine(x: &CudaStorage, c: usize, p: &CudaStorage, silu: bool, out: &CudaStorage) -> Result<()> {
    const OP: &str = "channel_affine";
    let dev = &x.buf.dev;
    // A vector of V values never crosses a row when C is a multiple of V.
    let (vsfx, v) = bn_vector(x.dtype, c, &[x, out]);
    let f = dev.func(if vsfx.is_empty() { "chaffine_cl" } else { "chaffine_cl_v" }, sfx(x.dtype))?;
    u32c(OP, x.len)?;
    let (px, pp, py, nvec, cc, act) = (ptr(x), ptr(p), ptr(out), (x.len / v) as u32, u32c(OP, c)?, silu as i32);
    dev.launch1d(f, x.len / v, &mut args!(px, pp, py, nvec, cc, act))
}

/// The backward of channels-last `x` with output gradient `g` into `dx` (returned): the
/// reduction (and dx in the same launch for a one-block split), else the reduction and one dx pass.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    x: &CudaStorage,
    g: &CudaStorage,
    rows: usize,
    c: usize,
    gr: &Grads,
    silu: bool,
    training: bool,
    dx: CudaStorage,
) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_act_backward";
    let dev = &x.buf.dev;
    let (rr, cc) = (u32c(OP, rows)?, bn_channels(OP, c)?);
    u32c(OP, x.len)?;
    let s = split(rows, c, bn_one_block_max());
    let (gd, bd) = grid(s, c);
    let (px, pg, pa, pn, pw, pdx) = (ptr(x), ptr(g), ptr(gr.aff), ptr(gr.nrm), ptr(gr.w), ptr(&dx));
    let (pgw, pgb, pc) = (ptr(gr.gw), ptr(gr.gb), ptr(gr.coef));
    let (act, train, count) = (silu as i32, training as i32, rows as f64);
    if bn_one_launch(dev, s.parts as usize) {
        let f = dev.func("bnbcl_fused1", sfx(x.dtype))?;
        dev.launch(f, gd, bd, &mut args!(px, pg, pa, pn, rr, cc, act, count, pw, train, pgw, pgb, pc, pdx))?;
        return Ok(dx);
    }
    let part = super::super::alloc::DevBuf::alloc(dev, c * s.parts as usize * 16)?;
    let (pp, pnum, tickets) = (part.ptr, s.parts, dev.bn_tickets);
    let f = dev.func("bnbcl_reduce", sfx(x.dtype))?;
    dev.launch(f, gd, bd, &mut args!(px, pg, pa, pn, pp, rr, cc, pnum, act, tickets, count, pw, train, pgw, pgb, pc))?;
    let (vsfx, v) = bn_vector(x.dtype, c, &[x, g, &dx]);
    let f = dev.func(if vsfx.is_empty() { "bnbcl_dx" } else { "bnbcl_dx_v" }, sfx(x.dtype))?;
    let nvec = (x.len / v) as u32;
    dev.launch1d(f, x.len / v, &mut args!(px, pg, pa, pn, pc, pdx, nvec, cc, act))?;
    drop(part);
    Ok(dx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_layers_take_one_block_per_tile_and_large_ones_fill_the_gpu() {
        assert_eq!(split(1600, 256, 4096), Split { tile: 8, parts: 1 });
        // 160×160 at batch 4, 32 channels: one tile of 32, 264 blocks of ≥ 64 rows.
        assert_eq!(split(102_400, 32, 4096), Split { tile: 32, parts: 264 });
        // 16 channels: tiles of 8 (two), 132 blocks each.
        assert_eq!(split(102_400, 16, 4096), Split { tile: 8, parts: 132 });
        // Few rows: no block below 64 rows.
        assert_eq!(split(4160, 32, 4096), Split { tile: 32, parts: 65 });
        // Many channels: fewer blocks per tile.
        assert_eq!(split(8192, 2048, 4096), Split { tile: 32, parts: 5 });
    }
}

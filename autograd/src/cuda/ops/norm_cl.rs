//! Batch normalisation (+SiLU) and the per-channel affine on channels-last storage (N, H, W, C):
//! the launchers of `norm.cu`'s channels-last kernels. `norm.rs` checks the arguments and hands
//! channels-last tensors here. A thread owns a 16-byte vector of consecutive channels, a block a
//! tile of such vectors side by side (so a warp reads contiguous bytes of whole rows) and row
//! lanes; the sums keep a fixed order, so a shape's bytes are fixed (not those of the N, C, H, W
//! kernels: the summation order differs).

use std::ffi::c_void;

use super::super::device::sfx;
use super::super::storage::CudaStorage;
use super::geometry::*;
use super::norm_rules::{bn_channels, bn_one_launch, bn_vector};
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
    /// Channel vectors per block, a power of two ≤ 32 (the block is (vectors, 256 / vectors)).
    pub vectors: u32,
    /// Blocks per tile (1: one launch may also apply y or dx).
    pub parts: u32,
}

/// A tile is as many channel vectors of `v` values as the layer has, up to 32 (a power of two, so
/// the row lanes, 256 / tile, are one too); its rows split over about two blocks per SM in all
/// (264), at least 8 rows per lane, at most 1024 blocks. The layer is one block per tile only when
/// it has so few rows (≤ 8 per lane) or so many tiles: a block per tile alone would leave most of
/// the GPU idle on the model's layers, whose channels fill one or a few tiles.
pub(super) fn split(rows: usize, c: usize, v: usize) -> Split {
    let vectors = c.div_ceil(v.max(1));
    let tile = vectors.next_power_of_two().min(32);
    let lanes = 256 / tile;
    let tiles = vectors.div_ceil(tile);
    let parts = 264usize.div_ceil(tiles).min(rows.div_ceil(lanes * 8)).clamp(1, 1024);
    Split { vectors: tile as u32, parts: parts as u32 }
}

fn grid(s: Split, c: usize, v: usize) -> ((u32, u32, u32), (u32, u32, u32)) {
    let tiles = c.div_ceil(v).div_ceil(s.vectors as usize);
    ((s.parts, tiles as u32, 1), (s.vectors, 256 / s.vectors, 1))
}

/// The kernel of `names` (scalar, vector) for the vector width of `bufs` (`c` values per row), and
/// that width.
fn vector_func(names: [&'static str; 2], dtype: crate::DType, c: usize, bufs: &[&CudaStorage]) -> (&'static str, usize) {
    let (vsfx, v) = bn_vector(dtype, c, bufs);
    (names[!vsfx.is_empty() as usize], v)
}

/// Training statistics of channels-last `x` (`rows` × `c`); with `apply` = `Some(silu)` and a
/// one-block split, y in the same launch, which it returns.
pub(super) fn train(x: &CudaStorage, rows: usize, c: usize, st: &Stats, apply: Option<bool>) -> Result<Option<CudaStorage>> {
    const OP: &str = "batch_norm_train_stats";
    let dev = &x.buf.dev;
    let (rr, cc) = (u32c(OP, rows)?, bn_channels(OP, c)?);
    u32c(OP, x.len)?;
    let (stats, v) = vector_func(["bncl_stats", "bncl_stats_v"], x.dtype, c, &[x]);
    let fwd1 = if v > 1 { "bncl_fwd1_v" } else { "bncl_fwd1" };
    let s = split(rows, c, v);
    let (g, b) = grid(s, c, v);
    let count = rows as f64;
    let (px, pw, pb, prm, prv, pa, pq, nbt) = (ptr(x), ptr(st.w), ptr(st.b), ptr(st.rm), ptr(st.rv), ptr(st.aff), ptr(st.nrm), st.nbt);
    let (eps, mom) = (st.eps, st.momentum);
    if let (Some(silu), true) = (apply, bn_one_launch(dev, s.parts as usize)) {
        let y = CudaStorage::alloc(dev, x.dtype, x.len)?;
        let (py, act) = (ptr(&y), silu as i32);
        let f = dev.func(fwd1, sfx(x.dtype))?;
        dev.launch(f, g, b, &mut args!(px, py, rr, cc, count, pw, pb, prm, prv, eps, mom, pa, pq, nbt, act))?;
        return Ok(Some(y));
    }
    let part = super::super::alloc::DevBuf::alloc(dev, c * s.parts as usize * 16)?;
    let (pp, pn, tickets) = (part.ptr, s.parts, dev.bn_tickets());
    let f = dev.func(stats, sfx(x.dtype))?;
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
    let (reduce, v) = vector_func(["bnbcl_reduce", "bnbcl_reduce_v"], x.dtype, c, &[x, g, &dx]);
    let fused1 = if v > 1 { "bnbcl_fused1_v" } else { "bnbcl_fused1" };
    let s = split(rows, c, v);
    let (gd, bd) = grid(s, c, v);
    let (px, pg, pa, pn, pw, pdx) = (ptr(x), ptr(g), ptr(gr.aff), ptr(gr.nrm), ptr(gr.w), ptr(&dx));
    let (pgw, pgb, pc) = (ptr(gr.gw), ptr(gr.gb), ptr(gr.coef));
    let (act, train, count) = (silu as i32, training as i32, rows as f64);
    if bn_one_launch(dev, s.parts as usize) {
        let f = dev.func(fused1, sfx(x.dtype))?;
        dev.launch(f, gd, bd, &mut args!(px, pg, pa, pn, rr, cc, act, count, pw, train, pgw, pgb, pc, pdx))?;
        return Ok(dx);
    }
    let part = super::super::alloc::DevBuf::alloc(dev, c * s.parts as usize * 16)?;
    let (pp, pnum, tickets) = (part.ptr, s.parts, dev.bn_tickets());
    let f = dev.func(reduce, sfx(x.dtype))?;
    dev.launch(f, gd, bd, &mut args!(px, pg, pa, pn, pp, rr, cc, pnum, act, tickets, count, pw, train, pgw, pgb, pc))?;
    let f = dev.func(if v > 1 { "bnbcl_dx_v" } else { "bnbcl_dx" }, sfx(x.dtype))?;
    let nvec = (x.len / v) as u32;
    dev.launch1d(f, x.len / v, &mut args!(px, pg, pa, pn, pc, pdx, nvec, cc, act))?;
    drop(part);
    Ok(dx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tile_spans_the_channels_and_the_rows_fill_the_gpu() {
        // 320×320 at batch 4, 16 bf16 channels: a tile of two vectors, 128 row lanes, 264 blocks.
        assert_eq!(split(409_600, 16, 8), Split { vectors: 2, parts: 264 });
        // 20×20 at batch 4, 256 channels: one tile of 32 vectors, 8 lanes, 25 blocks of 64 rows.
        assert_eq!(split(1600, 256, 8), Split { vectors: 32, parts: 25 });
        // 1024 channels: four tiles, fewer blocks each.
        assert_eq!(split(102_400, 1024, 8), Split { vectors: 32, parts: 66 });
        // Odd channels (V = 1): 51 vectors, two tiles of 32, 8 lanes, 100 blocks of 64 rows each.
        assert_eq!(split(6400, 51, 1), Split { vectors: 32, parts: 100 });
        // Few rows: one block per tile (the fused one-launch kernels).
        assert_eq!(split(40, 64, 8), Split { vectors: 8, parts: 1 });
        assert_eq!(grid(split(40, 64, 8), 64, 8), ((1, 1, 1), (8, 32, 1)));
        assert_eq!(grid(split(6400, 51, 1), 51, 1), ((100, 2, 1), (32, 8, 1)));
    }
}

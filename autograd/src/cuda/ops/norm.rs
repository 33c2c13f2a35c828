//! Batch normalisation (training statistics and apply, backward, eval parameters) and the
//! per-channel affine.

use std::ffi::c_void;

use super::super::device::sfx;
use super::super::storage::CudaStorage;
use crate::{DType, Error, Result};

use super::geometry::*;
use super::norm_rules::*;

/// Deterministic one-launch batch statistics: per-(channel, block) f64 partial sums, the last
/// block of each channel finishing its parameters, running statistics and (optionally) the
/// `num_batches_tracked` counter (see norm.cu).
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_train_stats(
    x: &CudaStorage,
    shape: &[usize],
    w: &CudaStorage,
    b: &CudaStorage,
    rm: &mut CudaStorage,
    rv: &mut CudaStorage,
    batches: Option<&mut CudaStorage>,
    eps: f64,
    momentum: f64,
    channels_last: bool,
) -> Result<(CudaStorage, CudaStorage)> {
    let (_, aff, nrm) = bn_train(x, shape, w, b, rm, rv, batches, eps, momentum, None, channels_last)?;
    Ok((aff, nrm))
}

/// The statistics and `y = act(x·scale + shift)`: for a channel small enough for one block
/// (`bn_parts` = 1) in one launch (`bn_fwd1`, the two kernels' arithmetic), for one of 2–8 blocks
/// in one launch of a cluster per channel (`bn_fwdc`, the same arithmetic), else the statistics
/// launch and [`channel_affine`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_train_apply(
    x: &CudaStorage,
    shape: &[usize],
    w: &CudaStorage,
    b: &CudaStorage,
    rm: &mut CudaStorage,
    rv: &mut CudaStorage,
    batches: Option<&mut CudaStorage>,
    eps: f64,
    momentum: f64,
    silu: bool,
    residual: Option<&CudaStorage>,
    channels_last: bool,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    if let Some(r) = residual {
        if r.dtype != x.dtype || r.len != x.len || channels_last {
            return Err(Error::invalid(
                "batch_norm_train_apply",
                format!("a residual ({} × {}) must match the planar input ({} × {})", r.len, r.dtype, x.len, x.dtype),
            ));
        }
        x.same_device("batch_norm_train_apply", r)?;
    }
    match bn_train(x, shape, w, b, rm, rv, batches, eps, momentum, Some((silu, residual)), channels_last)? {
        (Some(y), aff, nrm) => Ok((y, aff, nrm)),
        (None, aff, nrm) => {
            let y = channel_affine_adding(x, shape, &aff, silu, residual, channels_last)?;
            Ok((y, aff, nrm))
        }
    }
}

/// The statistics launch; with `apply` = `Some((silu, residual))` and one block per channel (or
/// one cluster), the fused statistics-and-apply launch, whose output it returns. Channels-last storage goes to
/// [`super::norm_cl`] after the same checks.
#[allow(clippy::too_many_arguments)]
pub(super) fn bn_train(
    x: &CudaStorage,
    shape: &[usize],
    w: &CudaStorage,
    b: &CudaStorage,
    rm: &mut CudaStorage,
    rv: &mut CudaStorage,
    batches: Option<&mut CudaStorage>,
    eps: f64,
    momentum: f64,
    apply: Option<(bool, Option<&CudaStorage>)>,
    channels_last: bool,
) -> Result<(Option<CudaStorage>, CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_train_stats";
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: x.dtype, expected: "a float dtype" });
    }
    let (n, c, hw) = nchw(OP, shape, x.len)?;
    let sd = crate::backend::stats_dtype(x.dtype);
    for s in [w, b, &*rm, &*rv] {
        stats_arg(OP, s, sd, c)?;
        x.same_device(OP, s)?;
    }
    let nbt = match batches {
        Some(s) => {
            if s.dtype != DType::I64 || s.len != 1 {
                return Err(Error::invalid(OP, format!("the batch counter must be one i64, got {} of {}", s.len, s.dtype)));
            }
            x.same_device(OP, s)?;
            ptr(s)
        }
        None => 0u64,
    };
    let dev = &x.buf.dev;
    let total = n * hw;
    if c == 0 || total == 0 {
        return Err(Error::invalid(OP, format!("empty batch for shape {shape:?}")));
    }
    let aff = CudaStorage::alloc(dev, sd, 2 * c)?;
    let nrm = CudaStorage::alloc(dev, sd, 2 * c)?;
    if channels_last {
        let stats = super::norm_cl::Stats { w, b, rm, rv, nbt, eps, momentum, aff: &aff, nrm: &nrm };
        let y = super::norm_cl::train(x, n * hw, c, &stats, apply.map(|(silu, _)| silu))?;
        return Ok((y, aff, nrm));
    }
    let parts = bn_parts(total, c);
    // The statistics' summation order follows x's vector width alone; the fused launch also
    // stores y with it, so y must allow it too.
    let (vsfx, _) = bn_vector(x.dtype, hw, &[x]);
    let (px, nn, cc, hh) = (ptr(x), u32c(OP, n)?, bn_channels(OP, c)?, u32c(OP, hw)?);
    u32c(OP, x.len)?;
    let count = total as f64;
    let (pw, pb, prm, prv, pa, pq) = (ptr(w), ptr(b), ptr(rm), ptr(rv), ptr(&aff), ptr(&nrm));
    // The residual's pointer (0: none); it takes part in the vector-width choice like y.
    let (pr, with_residual): (u64, Vec<&CudaStorage>) = match apply {
        Some((_, Some(r))) => (ptr(r), vec![r]),
        _ => (0, vec![]),
    };
    if let (Some((silu, _)), true) = (apply, bn_one_launch(dev, parts)) {
        let y = CudaStorage::alloc(dev, x.dtype, x.len)?;
        if bn_vector(x.dtype, hw, &[&[x, &y][..], &with_residual].concat()).0 == vsfx {
            let f = dev.func(if vsfx.is_empty() { "bn_fwd1" } else { "bn_fwd1_v" }, sfx(x.dtype))?;
            let (py, act) = (ptr(&y), silu as i32);
            dev.launch(
                f,
                (1, cc, 1),
                (256, 1, 1),
                &mut args!(px, pr, py, nn, cc, hh, count, pw, pb, prm, prv, eps, momentum, pa, pq, nbt, act),
            )?;
            return Ok((Some(y), aff, nrm));
        }
    }
    if let (Some((silu, _)), true) = (apply, bn_cluster(dev, parts)) {
        // 2–8 blocks per channel: one cluster each, the statistics and y in one launch.
        let y = CudaStorage::alloc(dev, x.dtype, x.len)?;
        if bn_vector(x.dtype, hw, &[&[x, &y][..], &with_residual].concat()).0 == vsfx {
            let f = dev.func(if vsfx.is_empty() { "bn_fwdc" } else { "bn_fwdc_v" }, sfx(x.dtype))?;
            let (py, act, pn) = (ptr(&y), silu as i32, parts as u32);
            dev.launch_cluster(
                f,
                (pn, cc, 1),
                (256, 1, 1),
                pn,
                &mut args!(px, pr, py, nn, cc, hh, pn, count, pw, pb, prm, prv, eps, momentum, pa, pq, nbt, act),
            )?;
            count_bn_cluster_launch();
            return Ok((Some(y), aff, nrm));
        }
    }
    let part = super::super::alloc::DevBuf::alloc(dev, c * parts * 16)?;
    let (pp, pn) = (part.ptr, parts as u32);
    let f = dev.func(if vsfx.is_empty() { "bn_stats" } else { "bn_stats_v" }, sfx(x.dtype))?;
    let tickets = dev.bn_tickets();
    dev.launch(
        f,
        (pn, cc, 1),
        (256, 1, 1),
        &mut args!(px, pp, nn, cc, hh, pn, tickets, count, pw, pb, prm, prv, eps, momentum, pa, pq, nbt),
    )?;
    drop(part);
    Ok((None, aff, nrm))
}

/// See `BackendStorage::batch_norm_act_backward`: two launches — per-(channel, block) f64 partial
/// sums of `gz` and `gz·x̂` whose last block per channel writes the weight and bias gradients and
/// dx's coefficients (fixed order), then one elementwise pass for dx; one launch doing both when
/// a channel fits one block or one cluster of 2–8 blocks. With `g2` the output gradient is
/// `g + g2`, added inside the planar kernels as the addition kernel stores it (channels-last
/// storage adds first).
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_act_backward(
    x: &CudaStorage,
    g: &CudaStorage,
    g2: Option<&CudaStorage>,
    shape: &[usize],
    aff: &CudaStorage,
    nrm: &CudaStorage,
    w: &CudaStorage,
    silu: bool,
    training: bool,
    channels_last: bool,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_act_backward";
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: x.dtype, expected: "a float dtype" });
    }
    for g in std::iter::once(g).chain(g2) {
        if g.dtype != x.dtype || g.len != x.len {
            return Err(Error::invalid(OP, format!("g ({} × {}) must match x ({} × {})", g.len, g.dtype, x.len, x.dtype)));
        }
        x.same_device(OP, g)?;
    }
    let (n, c, hw) = nchw(OP, shape, x.len)?;
    let sd = crate::backend::stats_dtype(x.dtype);
    stats_arg(OP, aff, sd, 2 * c)?;
    stats_arg(OP, nrm, sd, 2 * c)?;
    stats_arg(OP, w, sd, c)?;
    for s in [g, aff, nrm, w] {
        x.same_device(OP, s)?;
    }
    let dev = &x.buf.dev;
    let total = n * hw;
    if c == 0 || total == 0 {
        return Err(Error::invalid(OP, format!("empty batch for shape {shape:?}")));
    }
    let dx = CudaStorage::alloc(dev, x.dtype, x.len)?;
    let gw = CudaStorage::alloc(dev, sd, c)?;
    let gb = CudaStorage::alloc(dev, sd, c)?;
    let coef = CudaStorage::alloc(dev, sd, 3 * c)?;
    if channels_last {
        let grads = super::norm_cl::Grads { aff, nrm, w, gw: &gw, gb: &gb, coef: &coef };
        let sum = match g2 {
            Some(g2) => {
                let all = crate::shape::Layout::contiguous(&[x.len]);
                Some(super::elementwise::binary(g, &all, g2, &all, crate::backend::BinaryOp::Add)?)
            }
            None => None,
        };
        let dx = super::norm_cl::backward(x, sum.as_ref().unwrap_or(g), n * hw, c, &grads, silu, training, dx)?;
        return Ok((dx, gw, gb));
    }
    let parts = bn_parts(total, c);
    // Vector loads need every buffer aligned (`x` stands in for an absent second gradient).
    let (vsfx, v) = bn_vector(x.dtype, hw, &[x, g, &dx, g2.unwrap_or(x)]);
    let (px, pg, pa, pn, pw) = (ptr(x), ptr(g), ptr(aff), ptr(nrm), ptr(w));
    // A null second gradient: the kernels read `g` alone.
    let pg2: u64 = g2.map_or(0, ptr);
    let (nn, cc, hh, pnum) = (u32c(OP, n)?, bn_channels(OP, c)?, u32c(OP, hw)?, parts as u32);
    u32c(OP, x.len)?;
    let (act, train, count) = (silu as i32, training as i32, total as f64);
    let (pgw, pgb, pc, tickets) = (ptr(&gw), ptr(&gb), ptr(&coef), dev.bn_tickets());
    if bn_one_launch(dev, parts) {
        // One block per channel: the reduction and dx in one launch (the two kernels' arithmetic).
        let f = dev.func(if vsfx.is_empty() { "bnb_fused1" } else { "bnb_fused1_v" }, sfx(x.dtype))?;
        let pdx = ptr(&dx);
        dev.launch(f, (1, cc, 1), (256, 1, 1), &mut args!(px, pg, pg2, pa, pn, nn, cc, hh, act, count, pw, train, pgw, pgb, pc, pdx))?;
        return Ok((dx, gw, gb));
    }
    if bn_cluster(dev, parts) {
        // 2–8 blocks per channel: one cluster each, the reduction and dx in one launch.
        let f = dev.func(if vsfx.is_empty() { "bnb_fusedc" } else { "bnb_fusedc_v" }, sfx(x.dtype))?;
        let pdx = ptr(&dx);
        dev.launch_cluster(
            f,
            (pnum, cc, 1),
            (256, 1, 1),
            pnum,
            &mut args!(px, pg, pg2, pa, pn, nn, cc, hh, pnum, act, count, pw, train, pgw, pgb, pc, pdx),
        )?;
        count_bn_cluster_launch();
        return Ok((dx, gw, gb));
    }
    let part = super::super::alloc::DevBuf::alloc(dev, c * parts * 16)?;
    let pp = part.ptr;
    let f = dev.func(if vsfx.is_empty() { "bnb_reduce" } else { "bnb_reduce_v" }, sfx(x.dtype))?;
    dev.launch(
        f,
        (pnum, cc, 1),
        (256, 1, 1),
        &mut args!(px, pg, pg2, pa, pn, pp, nn, cc, hh, pnum, act, tickets, count, pw, train, pgw, pgb, pc),
    )?;
    let f = dev.func(if vsfx.is_empty() { "bnb_dx" } else { "bnb_dx_v" }, sfx(x.dtype))?;
    let (pdx, nvec, hv) = (ptr(&dx), (x.len / v) as u32, (hw / v) as u32);
    dev.launch1d(f, x.len / v, &mut args!(px, pg, pg2, pa, pn, pc, pdx, nvec, hv, cc, act))?;
    drop(part);
    Ok((dx, gw, gb))
}

/// `y = act(x·p[c] + p[C + c])`, stored as `x` is (N, H, W, C when `channels_last`).
pub(crate) fn channel_affine(x: &CudaStorage, shape: &[usize], p: &CudaStorage, silu: bool, channels_last: bool) -> Result<CudaStorage> {
    channel_affine_adding(x, shape, p, silu, None, channels_last)
}

/// [`channel_affine`] with a residual added to its output (planar only), as the addition kernel
/// would add it afterwards.
fn channel_affine_adding(
    x: &CudaStorage,
    shape: &[usize],
    p: &CudaStorage,
    silu: bool,
    residual: Option<&CudaStorage>,
    channels_last: bool,
) -> Result<CudaStorage> {
    const OP: &str = "channel_affine";
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: x.dtype, expected: "a float dtype" });
    }
    let (_, c, hw) = nchw(OP, shape, x.len)?;
    stats_arg(OP, p, crate::backend::stats_dtype(x.dtype), 2 * c)?;
    x.same_device(OP, p)?;
    let dev = &x.buf.dev;
    let out = CudaStorage::alloc(dev, x.dtype, x.len)?;
    if x.len == 0 {
        return Ok(out);
    }
    if channels_last {
        super::norm_cl::affine(x, c, p, silu, &out)?;
        return Ok(out);
    }
    if channels_last && residual.is_some() {
        return Err(Error::invalid(OP, "a residual is added to planar outputs only".to_string()));
    }
    let with_residual: Vec<&CudaStorage> = residual.into_iter().collect();
    let (vsfx, v) = bn_vector(x.dtype, hw, &[&[x, &out][..], &with_residual].concat());
    let f = dev.func(if vsfx.is_empty() { "chaffine" } else { "chaffine_v" }, sfx(x.dtype))?;
    let (px, pp, pr, py) = (ptr(x), ptr(p), residual.map_or(0, ptr), ptr(&out));
    u32c(OP, x.len)?;
    let (nvec, hv, cc, act) = ((x.len / v) as u32, (hw / v) as u32, u32c(OP, c)?, silu as i32);
    dev.launch1d(f, x.len / v, &mut args!(px, pp, pr, py, nvec, hv, cc, act))?;
    Ok(out)
}

pub(crate) fn batch_norm_eval_params(
    w: &CudaStorage,
    b: &CudaStorage,
    rm: &CudaStorage,
    rv: &CudaStorage,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_eval_params";
    let (sd, c) = (w.dtype, w.len);
    if !matches!(sd, DType::F32 | DType::F64) {
        return Err(Error::UnsupportedDType { op: OP, dtype: sd, expected: "F32 or F64 statistics" });
    }
    for s in [b, rm, rv] {
        stats_arg(OP, s, sd, c)?;
        w.same_device(OP, s)?;
    }
    let dev = &w.buf.dev;
    let aff = CudaStorage::alloc(dev, sd, 2 * c)?;
    let nrm = CudaStorage::alloc(dev, sd, 2 * c)?;
    if c == 0 {
        return Ok((aff, nrm));
    }
    let f = dev.func("bn_eval", sfx(sd))?;
    let (pw, pb, pm, pv, pa, pn, cc) = (ptr(w), ptr(b), ptr(rm), ptr(rv), ptr(&aff), ptr(&nrm), u32c(OP, c)?);
    dev.launch1d(f, c, &mut args!(pw, pb, pm, pv, eps, pa, pn, cc))?;
    Ok((aff, nrm))
}

//! Max pooling and nearest upsampling.

use std::ffi::c_void;

use super::super::device::sfx;
use super::super::storage::CudaStorage;
use crate::backend::Pool2dParams;
use crate::{DType, Error, Result};

use super::geometry::*;
use super::index::need_i64;

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct PoolGeo {
    planes: u32,
    h: u32,
    w: u32,
    oh: u32,
    ow: u32,
    k: u32,
    s: u32,
    p: u32,
    /// Channels (planes per image) and whether the data lie N, H, W, C (1) or N, C, H, W (0).
    c: u32,
    cl: u32,
}

pub(super) fn pool_geo(p: &Pool2dParams) -> Result<PoolGeo> {
    let c = |v| u32c("max_pool2d", v);
    Ok(PoolGeo {
        planes: c(p.batch * p.channels)?,
        h: c(p.h_in)?,
        w: c(p.w_in)?,
        oh: c(p.h_out())?,
        ow: c(p.w_out())?,
        k: c(p.kernel)?,
        s: c(p.stride)?,
        p: c(p.padding)?,
        c: c(p.channels.max(1))?,
        cl: p.channels_last as u32,
    })
}

pub(crate) fn max_pool2d(x: &CudaStorage, p: &Pool2dParams) -> Result<(CudaStorage, CudaStorage)> {
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: "max_pool2d", dtype: x.dtype, expected: "a float dtype" });
    }
    let dev = &x.buf.dev;
    let n = p.batch * p.channels * p.h_out() * p.w_out();
    let vals = CudaStorage::alloc(dev, x.dtype, n)?;
    let idx = CudaStorage::alloc(dev, DType::I64, n)?;
    if n == 0 {
        return Ok((vals, idx));
    }
    let g = pool_geo(p)?;
    let f = dev.func("maxpool_fwd", sfx(x.dtype))?;
    let (px, pv, pi) = (ptr(x), ptr(&vals), ptr(&idx));
    dev.launch1d(f, n, &mut args!(px, pv, pi, g))?;
    Ok((vals, idx))
}

pub(crate) fn max_pool2d_backward(dy: &CudaStorage, idx: &CudaStorage, p: &Pool2dParams) -> Result<CudaStorage> {
    need_i64("max_pool2d_backward", idx)?;
    if !dy.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: "max_pool2d_backward", dtype: dy.dtype, expected: "a float dtype" });
    }
    dy.same_device("max_pool2d_backward", idx)?;
    let dev = &dy.buf.dev;
    let n = p.batch * p.channels * p.h_in * p.w_in;
    let dx = CudaStorage::alloc(dev, dy.dtype, n)?;
    if n == 0 {
        return Ok(dx);
    }
    let g = pool_geo(p)?;
    let f = dev.func("maxpool_bwd", sfx(dy.dtype))?;
    let (pd, pi, px) = (ptr(dy), ptr(idx), ptr(&dx));
    dev.launch1d(f, n, &mut args!(pd, pi, px, g))?;
    Ok(dx)
}

/// `x` (`shape` = [n, c, h, w]) upsampled by `f` (forward) or, with `backward`, the f×f block sums
/// of an output gradient `x` ([n, c, h·f, w·f]) back to `shape`; stored N, H, W, C both ways when
/// `channels_last`.
pub(crate) fn upsample_nearest2d(x: &CudaStorage, shape: [usize; 4], f: usize, backward: bool, channels_last: bool) -> Result<CudaStorage> {
    let op = if backward { "upsample_nearest2d_backward" } else { "upsample_nearest2d" };
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op, dtype: x.dtype, expected: "a float dtype" });
    }
    let dev = &x.buf.dev;
    let n_in: usize = shape.iter().product();
    let out = CudaStorage::alloc(dev, x.dtype, if backward { n_in } else { n_in * f * f })?;
    if n_in == 0 {
        return Ok(out);
    }
    let (px, py) = (ptr(x), ptr(&out));
    let (nn, h, w, ff) = (u32c(op, n_in)?, u32c(op, shape[2])?, u32c(op, shape[3])?, u32c(op, f)?);
    u32c(op, n_in * f * f)?;
    if channels_last {
        let name = if backward { "upsample_bwd_nhwc" } else { "upsample_fwd_nhwc" };
        let k = dev.func(name, sfx(x.dtype))?;
        let c = u32c(op, shape[1])?;
        dev.launch1d(k, n_in, &mut args!(px, py, nn, c, h, w, ff))?;
        return Ok(out);
    }
    let k = dev.func(if backward { "upsample_bwd" } else { "upsample_fwd" }, sfx(x.dtype))?;
    dev.launch1d(k, n_in, &mut args!(px, py, nn, h, w, ff))?;
    Ok(out)
}

//! Softmax and log-softmax along one dimension.

use std::ffi::c_void;

use super::super::device::sfx;
use super::super::storage::CudaStorage;
use crate::{Error, Result};

use super::geometry::*;
use super::reduce::split3;

pub(crate) fn softmax(x: &CudaStorage, shape: &[usize], dim: usize, log: bool) -> Result<CudaStorage> {
    if !x.dtype.is_float() {
        return Err(Error::UnsupportedDType { op: "softmax", dtype: x.dtype, expected: "a float dtype" });
    }
    let (outer, d, inner) = split3(shape, dim);
    let dev = &x.buf.dev;
    let out = CudaStorage::alloc(dev, x.dtype, x.len)?;
    if x.len == 0 {
        return Ok(out);
    }
    let (px, py, dd, ii, lg) = (ptr(x), ptr(&out), u32c("softmax", d)?, u32c("softmax", inner)?, log as i32);
    u32c("softmax", x.len)?;
    if inner == 1 && d <= 1024 {
        // Short rows: a warp per row, the row in registers (8 rows per 256-thread block), with
        // as few register slots per lane as the row needs.
        let name = match d.div_ceil(32) {
            0..=4 => "softmax_warp4",
            5..=8 => "softmax_warp8",
            9..=16 => "softmax_warp16",
            _ => "softmax_warp32",
        };
        let f = dev.func(name, sfx(x.dtype))?;
        let rows = u32c("softmax", outer)?;
        dev.launch(f, (outer.div_ceil(8).clamp(1, 1 << 20) as u32, 1, 1), (256, 1, 1), &mut args!(px, py, rows, dd, lg))
    } else if inner == 1 {
        let f = dev.func("softmax_rows", sfx(x.dtype))?;
        dev.launch(f, (u32c("softmax", outer)?, 1, 1), (256, 1, 1), &mut args!(px, py, dd, lg))
    } else {
        let f = dev.func("softmax_cols", sfx(x.dtype))?;
        let n = u32c("softmax", outer * inner)?;
        dev.launch1d(f, outer * inner, &mut args!(px, py, n, dd, ii, lg))
    }?;
    Ok(out)
}

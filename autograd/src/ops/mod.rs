//! Differentiable operations. Each file keeps an op's forward and backward side by side; every
//! backward is written with other tensor ops, so it runs on whatever device the forward ran on.

pub(crate) mod binary;
pub(crate) mod cast;
pub(crate) mod conv;
pub(crate) mod fused;
pub(crate) mod index;
pub(crate) mod linalg;
pub(crate) mod loss;
pub(crate) mod norm;
pub(crate) mod optim;
pub(crate) mod reduce;
pub(crate) mod shape;
pub(crate) mod softmax;
pub(crate) mod unary;

use crate::shape::{broadcast_shapes, broadcast_strides, Layout};
use crate::{Error, Result, Tensor};

/// Output shape and read layouts of a broadcast binary op.
pub(crate) fn broadcast_layouts(op: &'static str, a: &Tensor, b: &Tensor) -> Result<(Vec<usize>, Layout, Layout)> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() });
    }
    let out = broadcast_shapes(op, a.dims(), b.dims())?;
    let la = Layout { shape: out.clone(), strides: broadcast_strides(a.dims(), &out), offset: 0 };
    let lb = Layout { shape: out.clone(), strides: broadcast_strides(b.dims(), &out), offset: 0 };
    Ok((out, la, lb))
}

pub(crate) fn same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op, lhs: a.dtype(), rhs: b.dtype() });
    }
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() });
    }
    Ok(())
}

impl Tensor {
    /// Sums a broadcast gradient back down to `shape` (the inverse of broadcasting).
    pub fn sum_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.dims() == shape {
            return Ok(self.clone());
        }
        let extra = self
            .rank()
            .checked_sub(shape.len())
            .ok_or_else(|| Error::invalid("sum_to", format!("cannot sum {:?} to {:?}", self.dims(), shape)))?;
        let mut t = self.clone();
        for _ in 0..extra {
            t = t.sum_dim(0, false)?;
        }
        for (d, &s) in shape.iter().enumerate() {
            if s == 1 && t.dims()[d] != 1 {
                t = t.sum_dim(d as isize, true)?;
            }
        }
        if t.dims() != shape {
            return Err(Error::invalid("sum_to", format!("cannot sum {:?} to {:?}", self.dims(), shape)));
        }
        Ok(t)
    }
}

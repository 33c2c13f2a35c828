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
pub mod pack;
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
        if let Some(t) = self.sum_to_in_one_pass(shape, extra)? {
            return Ok(t);
        }
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

    /// `sum_to` as one reduction when the kept dims are one contiguous block (a bias gradient:
    /// [N, C, H, W] to [1, C, 1, 1]) and the backend has the pass (CUDA), outside autograd
    /// recording (gradients are computed without it). `None`: reduce dim by dim.
    fn sum_to_in_one_pass(&self, shape: &[usize], extra: usize) -> Result<Option<Tensor>> {
        if (self.requires_grad() && crate::is_grad_enabled()) || !self.dtype().is_float() {
            return Ok(None);
        }
        let dims = self.dims();
        let target: Vec<usize> = std::iter::repeat_n(1, extra).chain(shape.iter().copied()).collect();
        let kept: Vec<usize> = (0..dims.len()).filter(|&d| target[d] != 1).collect();
        let (outer, mid, inner) = match (kept.first(), kept.last()) {
            (Some(&a), Some(&b)) => {
                if (a..=b).any(|d| target[d] != dims[d]) {
                    return Ok(None);
                }
                (dims[..a].iter().product(), dims[a..=b].iter().product(), dims[b + 1..].iter().product())
            }
            // Everything summed into one value (the bias gradient of a one-channel output).
            _ => (1, 1, self.numel()),
        };
        // One block per kept value: worth it for few kept values with many summed ones each.
        if inner < 2 || mid > 4096 || outer * inner < 256 {
            return Ok(None);
        }
        match self.read_storage()?.sum_mid(outer, mid, inner)? {
            Some(s) => Ok(Some(Tensor::from_storage(s, shape.to_vec())?)),
            None => Ok(None),
        }
    }
}

//! Softmax and log-softmax along a dimension, numerically stabilised by the row maximum.

use crate::autograd::{record1, FnBackward};
use crate::{Result, Tensor};

impl Tensor {
    /// One fused (log-)softmax primitive over `dim` (no autograd).
    fn raw_softmax(&self, dim: isize, log: bool) -> Result<Tensor> {
        let d = crate::shape::normalize_dim("softmax", dim, self.rank())?;
        let s = self.read_storage()?.softmax(self.dims(), d, log)?;
        Tensor::from_storage(s, self.dims().to_vec())
    }

    /// Softmax along `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let y = self.raw_softmax(dim, false)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let ys = y.detach();
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "softmax",
                // dx = y · (g − Σ g·y)
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None]) };
                    let s = g.mul(&ys)?.sum_dim(dim, true)?;
                    Ok(vec![Some(ys.mul(&g.sub(&s)?)?)])
                },
            },
        ))
    }

    /// Log-softmax along `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let y = self.raw_softmax(dim, true)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let ys = y.detach();
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "log_softmax",
                // dx = g − softmax · Σ g
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None]) };
                    Ok(vec![Some(g.sub(&ys.exp()?.mul(&g.sum_dim(dim, true)?)?)?)])
                },
            },
        ))
    }
}

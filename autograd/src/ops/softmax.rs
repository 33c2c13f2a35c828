//! Softmax and log-softmax along a dimension, numerically stabilised by the row maximum.

use crate::autograd::{record1, FnBackward};
use crate::{Result, Tensor};

impl Tensor {
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let y = crate::no_grad(|| -> Result<Tensor> {
            let x = self.detach();
            let m = x.max_dim(dim, true)?.0;
            let e = x.sub(&m)?.exp()?;
            e.div(&e.sum_dim(dim, true)?)
        })?;
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

    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let y = crate::no_grad(|| -> Result<Tensor> {
            let x = self.detach();
            let m = x.max_dim(dim, true)?.0;
            let xm = x.sub(&m)?;
            xm.sub(&xm.exp()?.sum_dim(dim, true)?.log()?)
        })?;
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

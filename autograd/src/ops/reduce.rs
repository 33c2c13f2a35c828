//! Reductions (sum, mean, max/min with indices, argmax/argmin, top-k) and their gradients.

use crate::autograd::{record1, FnBackward};
use crate::backend::ReduceOp;
use crate::shape::normalize_dim;
use crate::{Result, Tensor};

fn keep_shape(dims: &[usize], d: usize) -> Vec<usize> {
    let mut k = dims.to_vec();
    k[d] = 1;
    k
}

fn drop_dim(dims: &[usize], d: usize) -> Vec<usize> {
    let mut k = dims.to_vec();
    k.remove(d);
    k
}

fn raw_reduce(x: &Tensor, d: usize, op: ReduceOp) -> Result<Tensor> {
    let s = x.read_storage()?.reduce(x.dims(), d, op)?;
    Tensor::from_storage(s, keep_shape(x.dims(), d))
}

impl Tensor {
    /// Sum over `dim` (kept as size 1 when `keepdim`).
    pub fn sum_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = normalize_dim("sum", dim, self.rank())?;
        let y = raw_reduce(self, d, ReduceOp::Sum)?;
        let in_dims = self.dims().to_vec();
        let y = if self.requires_grad() && crate::is_grad_enabled() {
            record1(
                &[self],
                y,
                FnBackward {
                    name: "sum",
                    f: move |g: &[Option<Tensor>]| {
                        Ok(vec![match &g[0] {
                            Some(g) => Some(g.expand(&in_dims)?),
                            None => None,
                        }])
                    },
                },
            )
        } else {
            y
        };
        if keepdim {
            Ok(y)
        } else {
            y.reshape(drop_dim(self.dims(), d))
        }
    }

    /// Sum over several dims.
    pub fn sum_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let mut ds: Vec<usize> = dims.iter().map(|&d| normalize_dim("sum", d, self.rank())).collect::<Result<_>>()?;
        ds.sort_unstable();
        ds.dedup();
        let mut t = self.clone();
        for &d in ds.iter().rev() {
            t = t.sum_dim(d as isize, keepdim)?;
        }
        Ok(t)
    }

    /// Sum of all elements as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.flatten_all()?.sum_dim(0, false)
    }

    /// Mean over `dim`.
    pub fn mean_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let n = self.dim(dim)?;
        self.sum_dim(dim, keepdim)?.affine(1.0 / n as f64, 0.0)
    }

    /// Mean over `dims`.
    pub fn mean_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let mut n = 1usize;
        for &d in dims {
            n *= self.dim(d)?;
        }
        self.sum_dims(dims, keepdim)?.affine(1.0 / n as f64, 0.0)
    }

    /// Mean of every element (a scalar).
    pub fn mean_all(&self) -> Result<Tensor> {
        let n = self.numel();
        self.sum_all()?.affine(1.0 / n as f64, 0.0)
    }

    fn select_reduce(&self, dim: isize, keepdim: bool, max: bool) -> Result<(Tensor, Tensor)> {
        let d = normalize_dim(if max { "max" } else { "min" }, dim, self.rank())?;
        let idx = raw_reduce(self, d, if max { ReduceOp::ArgMax } else { ReduceOp::ArgMin })?;
        // Values via gather so the gradient goes exactly to the selected element.
        let vals = self.gather(d as isize, &idx)?;
        if keepdim {
            Ok((vals, idx))
        } else {
            let s = drop_dim(self.dims(), d);
            Ok((vals.reshape(s.clone())?, idx.reshape(s)?))
        }
    }

    /// Maximum over `dim` with the index of the first maximum.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.select_reduce(dim, keepdim, true)
    }
    /// Minimum over `dim` with the index of the first minimum.
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.select_reduce(dim, keepdim, false)
    }
    /// Index of the largest value along `dim`.
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = normalize_dim("argmax", dim, self.rank())?;
        let i = raw_reduce(self, d, ReduceOp::ArgMax)?;
        if keepdim {
            Ok(i)
        } else {
            i.reshape(drop_dim(self.dims(), d))
        }
    }
    /// Index of the smallest value along `dim`.
    pub fn argmin(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = normalize_dim("argmin", dim, self.rank())?;
        let i = raw_reduce(self, d, ReduceOp::ArgMin)?;
        if keepdim {
            Ok(i)
        } else {
            i.reshape(drop_dim(self.dims(), d))
        }
    }
    /// Maximum of all elements (no gradient; use `max_dim` for a differentiable max).
    pub fn max_all(&self) -> Result<Tensor> {
        raw_reduce(&self.flatten_all()?.detach(), 0, ReduceOp::Max)?.reshape(Vec::<usize>::new())
    }
    /// Smallest element (a scalar).
    pub fn min_all(&self) -> Result<Tensor> {
        raw_reduce(&self.flatten_all()?.detach(), 0, ReduceOp::Min)?.reshape(Vec::<usize>::new())
    }

    /// Top-k values and indices along `dim`, sorted; ties keep the lower index first. No gradient.
    pub fn topk(&self, k: usize, dim: isize, largest: bool) -> Result<(Tensor, Tensor)> {
        let d = normalize_dim("topk", dim, self.rank())?;
        let (v, i) = self.read_storage()?.topk(self.dims(), d, k, largest)?;
        let mut s = self.dims().to_vec();
        s[d] = k;
        Ok((Tensor::from_storage(v, s.clone())?, Tensor::from_storage(i, s)?))
    }
}

//! Index ops: `index_select`, `gather`, `scatter_add` and their (deterministic) adjoints.

use crate::autograd::{record, record1, FnBackward};
use crate::shape::normalize_dim;
use crate::storage::Storage;
use crate::{DType, Error, Result, Tensor};

fn check_index(op: &'static str, idx: &Tensor) -> Result<()> {
    if idx.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType { op, dtype: idx.dtype(), expected: "I64 indices" });
    }
    Ok(())
}

impl Tensor {
    /// Rows `idx` (1-d I64) along `dim`.
    pub fn index_select(&self, dim: isize, idx: &Tensor) -> Result<Tensor> {
        check_index("index_select", idx)?;
        if idx.rank() != 1 {
            return Err(Error::invalid("index_select", format!("index must be 1-d, got {:?}", idx.dims())));
        }
        let d = normalize_dim("index_select", dim, self.rank())?;
        let s = self.read_storage()?.index_select(self.dims(), d, &*idx.read_storage()?)?;
        let mut shape = self.dims().to_vec();
        shape[d] = idx.numel();
        let y = Tensor::from_storage(s, shape)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let (idx, in_dims) = (idx.detach(), self.dims().to_vec());
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "index_select",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None]) };
                    let s = Storage::index_add_to_zeros(&in_dims, d, &*idx.read_storage()?, &*g.read_storage()?)?;
                    Ok(vec![Some(Tensor::from_storage(s, in_dims.clone())?)])
                },
            },
        ))
    }

    /// `out[i][j][k] = self[i][idx[i][j][k]][k]` for `dim = 1` (PyTorch `gather`).
    pub fn gather(&self, dim: isize, idx: &Tensor) -> Result<Tensor> {
        check_index("gather", idx)?;
        let d = normalize_dim("gather", dim, self.rank())?;
        let s = self.read_storage()?.gather(self.dims(), d, &*idx.read_storage()?, idx.dims())?;
        let y = Tensor::from_storage(s, idx.dims().to_vec())?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let (idx, in_dims) = (idx.detach(), self.dims().to_vec());
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "gather",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None]) };
                    let z = Storage::zeros(g.device(), g.dtype(), in_dims.iter().product())?;
                    let s = z.scatter_add(&in_dims, d, &*idx.read_storage()?, idx.dims(), &*g.read_storage()?)?;
                    Ok(vec![Some(Tensor::from_storage(s, in_dims.clone())?)])
                },
            },
        ))
    }

    /// `self` with `src` added at `idx` along `dim` (PyTorch `scatter_add`, out of place).
    pub fn scatter_add(&self, dim: isize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        check_index("scatter_add", idx)?;
        super::same_dtype("scatter_add", self, src)?;
        if src.dims() != idx.dims() {
            return Err(Error::ShapeMismatch { op: "scatter_add", lhs: idx.dims().to_vec(), rhs: src.dims().to_vec() });
        }
        let d = normalize_dim("scatter_add", dim, self.rank())?;
        let s = self.read_storage()?.scatter_add(self.dims(), d, &*idx.read_storage()?, idx.dims(), &*src.read_storage()?)?;
        let y = Tensor::from_storage(s, self.dims().to_vec())?;
        if !(self.requires_grad() || src.requires_grad()) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let idx = idx.detach();
        let (need_self, need_src) = (self.requires_grad(), src.requires_grad());
        Ok(record(
            &[self, src],
            vec![y],
            FnBackward {
                name: "scatter_add",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None, None]) };
                    let gs = if need_self { Some(g.clone()) } else { None };
                    let gsrc = if need_src { Some(g.gather(d as isize, &idx)?) } else { None };
                    Ok(vec![gs, gsrc])
                },
            },
        )
        .remove(0))
    }

    /// Positions (I64, ascending) of the first `size` non-zero elements of the flattened tensor,
    /// padded with `fill` (PyTorch `nonzero_static`): a fixed shape and no host read, so a
    /// recorded region can compact a mask. Elements beyond the first `size` are left out. No gradient.
    pub fn nonzero_static(&self, size: usize, fill: i64) -> Result<Tensor> {
        let s = self.read_storage()?.nonzero_static(size, fill)?;
        Tensor::from_storage(s, vec![size])
    }

    /// Positions of non-zero elements of a 1-d tensor, as I64 (a host read: not for hot paths).
    pub fn nonzero_1d(&self) -> Result<Tensor> {
        let v = self.to_f64_vec()?;
        let idx: Vec<i64> = v.iter().enumerate().filter(|(_, &x)| x != 0.0).map(|(i, _)| i as i64).collect();
        let n = idx.len();
        Tensor::from_vec(idx, n, self.device())
    }
}

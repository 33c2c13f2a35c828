//! dtype casts and device moves; gradients flow back through both.

use crate::autograd::{record, record1, FnBackward};
use crate::storage::Storage;
use crate::{DType, Device, Result, Tensor};

impl Tensor {
    /// Converts to `dtype`; for float→float casts the gradient is cast back. Element by element, so
    /// the result keeps this tensor's memory format (autocast's casts keep a channels-last
    /// activation channels-last).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let s = self.raw_storage().to_dtype(dtype)?;
        let y = Tensor::from_storage_in(s, self.shape().clone(), self.memory_format())?;
        if !self.requires_grad() || !dtype.is_float() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let src = self.dtype();
        Ok(record1(
            &[self],
            y,
            FnBackward { name: "to_dtype", f: move |g: &[Option<Tensor>]| Ok(vec![g[0].as_ref().map(|g| g.to_dtype(src)).transpose()?]) },
        ))
    }
}

impl Tensor {
    /// Every tensor cast to `dtype`, the same values as [`Tensor::to_dtype`] on each. The casts are
    /// one autograd node (its backward casts the gradients back, batched as well) and on CUDA one
    /// launch per 40 tensors of f32 ↔ bf16/f16: autocast's weight copies for a whole forward.
    /// Tensors already of `dtype` come back as they are.
    pub fn to_dtype_many(xs: &[Tensor], dtype: DType) -> Result<Vec<Tensor>> {
        let idx: Vec<usize> = (0..xs.len()).filter(|&i| xs[i].dtype() != dtype).collect();
        let mut out: Vec<Tensor> = xs.to_vec();
        if idx.is_empty() {
            return Ok(out);
        }
        let src = xs[idx[0]].dtype();
        if idx.iter().any(|&i| xs[i].dtype() != src) {
            return xs.iter().map(|x| x.to_dtype(dtype)).collect();
        }
        let cast: Vec<Tensor> = {
            let guards = idx.iter().map(|&i| xs[i].read_storage()).collect::<Result<Vec<_>>>()?;
            let refs: Vec<&Storage> = guards.iter().map(|g| &**g).collect();
            Storage::to_dtype_many(&refs, dtype)?
                .into_iter()
                .zip(&idx)
                .map(|(s, &i)| Tensor::from_storage(s, xs[i].shape().clone()))
                .collect::<Result<Vec<_>>>()?
        };
        let inputs: Vec<&Tensor> = idx.iter().map(|&i| &xs[i]).collect();
        let cast = if dtype.is_float() && crate::is_grad_enabled() && inputs.iter().any(|t| t.requires_grad()) {
            record(
                &inputs,
                cast,
                FnBackward {
                    name: "to_dtype_many",
                    f: move |g: &[Option<Tensor>]| {
                        let present: Vec<Tensor> = g.iter().flatten().cloned().collect();
                        let mut back = Tensor::to_dtype_many(&present, src)?.into_iter();
                        Ok(g.iter().map(|g| g.as_ref().and_then(|_| back.next())).collect())
                    },
                },
            )
        } else {
            cast
        };
        for (t, &i) in cast.into_iter().zip(&idx) {
            out[i] = t;
        }
        Ok(out)
    }
}

pub(crate) fn to_device(x: &Tensor, device: Device) -> Result<Tensor> {
    if device == x.device() {
        return Ok(x.clone());
    }
    let host = x.read_storage()?.to_cpu()?;
    let y = Tensor::from_storage(Storage::from_cpu(host, device)?, x.shape().clone())?;
    if !x.requires_grad() || !crate::is_grad_enabled() {
        return Ok(y);
    }
    let src = x.device();
    Ok(record1(
        &[x],
        y,
        FnBackward { name: "to_device", f: move |g: &[Option<Tensor>]| Ok(vec![g[0].as_ref().map(|g| g.to_device(src)).transpose()?]) },
    ))
}

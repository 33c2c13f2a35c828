//! dtype casts and device moves; gradients flow back through both.

use crate::autograd::{record1, FnBackward};
use crate::storage::Storage;
use crate::{DType, Device, Result, Tensor};

impl Tensor {
    /// Converts to `dtype`; for float→float casts the gradient is cast back.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let s = self.read_storage().to_dtype(dtype)?;
        let y = Tensor::from_storage(s, self.shape().clone())?;
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

pub(crate) fn to_device(x: &Tensor, device: Device) -> Result<Tensor> {
    if device == x.device() {
        return Ok(x.clone());
    }
    let host = x.read_storage().to_cpu()?;
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

//! dtype casts and device moves; gradients flow back through both.

use crate::autograd::{record, record1, FnBackward};
use crate::storage::Storage;
use crate::{DType, Device, Error, MemoryFormat, Result, Tensor};

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
        let formats: Vec<MemoryFormat> = xs.iter().map(Tensor::memory_format).collect();
        Tensor::to_dtype_many_in(xs, dtype, &formats)
    }

    /// [`Tensor::to_dtype_many`] with result `k` in memory format `formats[k]` (a 4-D tensor may
    /// change between contiguous and channels-last in the same launch: autocast's weight copies in
    /// the O, H, W, I order cuDNN's engines read). The backward casts each gradient back into its
    /// tensor's format, batched too. Tensors already of `dtype` and format come back as they are.
    pub fn to_dtype_many_in(xs: &[Tensor], dtype: DType, formats: &[MemoryFormat]) -> Result<Vec<Tensor>> {
        if formats.len() != xs.len() {
            return Err(Error::invalid("to_dtype_many_in", format!("{} formats for {} tensors", formats.len(), xs.len())));
        }
        let idx: Vec<usize> = (0..xs.len()).filter(|&i| xs[i].dtype() != dtype || xs[i].memory_format() != formats[i]).collect();
        let mut out: Vec<Tensor> = xs.to_vec();
        if idx.is_empty() {
            return Ok(out);
        }
        let transposes = idx.iter().map(|&i| transpose_between(&xs[i], formats[i])).collect::<Result<Vec<_>>>()?;
        let src = xs[idx[0]].dtype();
        if src == dtype || idx.iter().any(|&i| xs[i].dtype() != src) {
            // Not one batched cast: tensor by tensor, each op with its own backward.
            for &i in &idx {
                out[i] = xs[i].to_dtype(dtype)?.to_memory_format(formats[i])?;
            }
            return Ok(out);
        }
        let cast: Vec<Tensor> = {
            let guards: Vec<_> = idx.iter().map(|&i| xs[i].raw_storage()).collect();
            let refs: Vec<&Storage> = guards.iter().map(|g| &**g).collect();
            Storage::to_dtype_many(&refs, dtype, &transposes)?
                .into_iter()
                .zip(&idx)
                .map(|(s, &i)| Tensor::from_storage_in(s, xs[i].shape().clone(), formats[i]))
                .collect::<Result<Vec<_>>>()?
        };
        let inputs: Vec<&Tensor> = idx.iter().map(|&i| &xs[i]).collect();
        let cast = if dtype.is_float() && crate::is_grad_enabled() && inputs.iter().any(|t| t.requires_grad()) {
            let back_formats: Vec<MemoryFormat> = inputs.iter().map(|t| t.memory_format()).collect();
            record(
                &inputs,
                cast,
                FnBackward {
                    name: "to_dtype_many",
                    f: move |g: &[Option<Tensor>]| {
                        let present: Vec<Tensor> = g.iter().flatten().cloned().collect();
                        let formats: Vec<MemoryFormat> =
                            g.iter().zip(&back_formats).filter(|(g, _)| g.is_some()).map(|(_, f)| *f).collect();
                        let mut back = Tensor::to_dtype_many_in(&present, src, &formats)?.into_iter();
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

/// The transpose that takes `x`'s storage into `to`'s order: a 4-D (N, C, H, W) tensor is stored
/// (N, C, H·W) contiguous and (N, H·W, C) channels-last, so either way is swapping the last two.
fn transpose_between(x: &Tensor, to: MemoryFormat) -> Result<Option<(usize, usize)>> {
    let from = x.memory_format();
    if from == to {
        return Ok(None);
    }
    let d = x.dims();
    if d.len() != 4 {
        return Err(Error::invalid("to_dtype_many_in", format!("channels-last is a format of 4-D tensors; this one has shape {d:?}")));
    }
    let (c, hw) = (d[1], d[2] * d[3]);
    Ok(Some(match to {
        MemoryFormat::ChannelsLast => (c, hw),
        MemoryFormat::Contiguous => (hw, c),
    }))
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

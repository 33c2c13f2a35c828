//! Memory formats of 4-D tensors: how a tensor's elements lie in its storage, beside its logical
//! shape (design: `docs/channels-last.md`).
//!
//! A tensor's shape is always its logical NCHW shape — for user code, state dicts, checkpoints and
//! goldens. [`MemoryFormat::ChannelsLast`] stores a 4-D tensor's elements in N, H, W, C order
//! (PyTorch's `torch.channels_last`), the order cuDNN's fast convolution engines compute in.
//!
//! The entry rule: an op reads its operands through `Tensor::read_storage`, which hands a
//! channels-last operand over converted to the contiguous order (one strided copy), so every op
//! computes correctly on either format and returns a contiguous result; an op that computes on
//! channels-last data itself reads the raw storage instead and says so. In-place writes into a
//! channels-last tensor are refused (convert it first).

use std::ops::Deref;
use std::sync::RwLockReadGuard;

use crate::autograd::{record1, FnBackward};
use crate::shape::{contiguous_strides, Layout};
use crate::storage::Storage;
use crate::{Error, Result, Tensor};

/// How a tensor's elements are ordered in its storage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MemoryFormat {
    /// Row-major in the logical shape's order (every tensor unless converted).
    #[default]
    Contiguous,
    /// A 4-D tensor of logical shape (N, C, H, W) stored as (N, H, W, C).
    ChannelsLast,
}

/// The storage as an op reads it: the tensor's own (contiguous) storage under its read lock, or
/// a contiguous copy of a channels-last one.
pub(crate) enum StorageRead<'a> {
    Shared(RwLockReadGuard<'a, Storage>),
    Converted(Storage),
}

impl Deref for StorageRead<'_> {
    type Target = Storage;
    fn deref(&self) -> &Storage {
        match self {
            StorageRead::Shared(g) => g,
            StorageRead::Converted(s) => s,
        }
    }
}

/// The channels-last storage of logical `(n, c, h, w)` seen as a strided view in logical order.
pub(crate) fn channels_last_as_logical(dims: &[usize]) -> Layout {
    let (c, h, w) = (dims[1], dims[2], dims[3]);
    Layout { shape: dims.to_vec(), strides: vec![h * w * c, 1, w * c, c], offset: 0 }
}

/// The contiguous storage of logical `(n, c, h, w)` seen as a strided view in (n, h, w, c) order.
fn logical_as_channels_last(dims: &[usize]) -> Layout {
    let st = contiguous_strides(dims);
    Layout { shape: vec![dims[0], dims[2], dims[3], dims[1]], strides: vec![st[0], st[2], st[3], st[1]], offset: 0 }
}

/// `src` (the storage of a tensor of logical `dims` in format `from`) rearranged into format `to`.
pub(crate) fn rearranged(src: &Storage, dims: &[usize], from: MemoryFormat, to: MemoryFormat) -> Result<Storage> {
    let n: usize = dims.iter().product();
    let mut out = Storage::uninit(src.device(), src.dtype(), n)?;
    match (from, to) {
        (MemoryFormat::ChannelsLast, MemoryFormat::Contiguous) => {
            src.copy_strided(&channels_last_as_logical(dims), &mut out, &Layout::contiguous(dims))?
        }
        (MemoryFormat::Contiguous, MemoryFormat::ChannelsLast) => {
            let view = logical_as_channels_last(dims);
            src.copy_strided(&view, &mut out, &Layout::contiguous(&view.shape))?
        }
        _ => src.copy_strided(&Layout::contiguous(dims), &mut out, &Layout::contiguous(dims))?,
    }
    Ok(out)
}

impl Tensor {
    /// How this tensor's elements lie in its storage.
    pub fn memory_format(&self) -> MemoryFormat {
        self.0.format
    }

    /// This tensor in `format` (itself when it already is): one strided copy. Channels-last is for
    /// 4-D tensors only. The gradient flows back converted to this tensor's format.
    pub fn to_memory_format(&self, format: MemoryFormat) -> Result<Tensor> {
        let from = self.memory_format();
        if from == format {
            return Ok(self.clone());
        }
        if self.rank() != 4 {
            return Err(Error::invalid(
                "to_memory_format",
                format!("channels-last is a format of 4-D (N, C, H, W) tensors; this one has shape {:?}", self.dims()),
            ));
        }
        let out = rearranged(&self.raw_storage(), self.dims(), from, format)?;
        let y = Tensor::from_storage_in(out, self.shape().clone(), format)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "to_memory_format",
                f: move |g: &[Option<Tensor>]| Ok(vec![g[0].as_ref().map(|g| g.to_memory_format(from)).transpose()?]),
            },
        ))
    }
}

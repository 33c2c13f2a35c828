//! What the loss's fused CUDA kernels (`assign_fused`, `flow_fused`, `ciou_fused`) share: their
//! compiled functions (`UserKernel::compile` caches modules and functions per device, so this is
//! a lookup after the first call), output buffers the kernels fill completely, and the error a
//! custom autograd node hands the engine.

use ptl_autograd::internal::cuda::UserKernel;
use ptl_autograd::{DType, Device, Tensor};

use crate::error::{Result, TrainerError};

/// The functions `names` of module `module` (compiled from `source` on first use) on `device`.
pub(crate) fn kernels<const N: usize>(device: Device, module: &str, source: &str, names: [&str; N]) -> Result<[UserKernel; N]> {
    let mut v = Vec::with_capacity(N);
    for f in names {
        v.push(UserKernel::compile(device, module, source, f)?);
    }
    v.try_into().map_err(|v: Vec<UserKernel>| TrainerError::InvalidArgument {
        what: "kernels",
        reason: format!("{module}: {} of {N} functions", v.len()),
    })
}

/// A `dtype` tensor of shape `dims` on `device` whose every element a kernel writes (no fill
/// launch).
pub(crate) fn uninit(device: Device, dtype: DType, dims: Vec<usize>) -> Result<Tensor> {
    let n = dims.iter().product();
    Ok(Tensor::from_storage(ptl_autograd::internal::storage::Storage::uninit(device, dtype, n)?, dims)?)
}

/// A trainer error as the autograd engine's error type, for a custom node's backward (`op` names
/// the node).
pub(crate) fn backward_error(op: &'static str, e: TrainerError) -> ptl_autograd::Error {
    match e {
        TrainerError::Tensor(t) => t,
        other => ptl_autograd::Error::InvalidArgument { op, msg: other.to_string() },
    }
}

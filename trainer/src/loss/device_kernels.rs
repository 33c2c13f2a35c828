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

/// Why `rows` do not suit a fused row kernel, `None` when they do: every tensor f32 with its
/// shape and on `device`, and those after the first `differentiable` ones without gradient (the
/// kernels give gradients to the differentiable ones only).
pub(crate) fn rows_mismatch(device: Device, rows: &[(&str, &Tensor, &[usize])], differentiable: usize) -> Option<String> {
    for (name, t, dims) in rows {
        if t.device() != device || t.dtype() != DType::F32 || t.dims() != *dims {
            return Some(format!("{name}: {:?} {:?} on {:?}, wanted f32 {dims:?}", t.dtype(), t.dims(), t.device()));
        }
    }
    rows.iter().skip(differentiable).find(|(_, t, _)| t.requires_grad()).map(|(name, _, _)| format!("{name} requires a gradient"))
}

/// A trainer error as the autograd engine's error type, for a custom node's backward (`op` names
/// the node).
pub(crate) fn backward_error(op: &'static str, e: TrainerError) -> ptl_autograd::Error {
    match e {
        TrainerError::Tensor(t) => t,
        other => ptl_autograd::Error::InvalidArgument { op, msg: other.to_string() },
    }
}

/// An on/off switch of one family of fused kernels: on unless its environment variable is `0`
/// (read at first use), and settable per process (tests compare the fused and composed paths).
pub(crate) struct FusedSwitch {
    /// 0: not decided yet, 1: off, 2: on.
    state: std::sync::atomic::AtomicU8,
    /// The variable that turns the family off (`=0`).
    env: &'static str,
}

impl FusedSwitch {
    /// A switch read from `env` at first use.
    pub(crate) const fn new(env: &'static str) -> FusedSwitch {
        FusedSwitch { state: std::sync::atomic::AtomicU8::new(0), env }
    }

    /// Turns the family on or off for this process.
    pub(crate) fn set(&self, on: bool) {
        self.state.store(if on { 2 } else { 1 }, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the family is on.
    pub(crate) fn enabled(&self) -> bool {
        match self.state.load(std::sync::atomic::Ordering::Relaxed) {
            0 => {
                let on = std::env::var(self.env).map_or(true, |v| v != "0");
                self.set(on);
                on
            }
            v => v == 2,
        }
    }
}

/// Blocks of `block` threads for a grid-stride loop over `n` items (at most 65,535).
pub(crate) fn launch_grid(n: usize, block: u32) -> u32 {
    n.div_ceil(block as usize).clamp(1, 65_535) as u32
}

/// A custom node's output gradients in f32 (absent ones stay absent).
pub(crate) fn f32_grads(grad_outputs: &[Option<Tensor>]) -> ptl_autograd::Result<Vec<Option<Tensor>>> {
    grad_outputs
        .iter()
        .map(|g| g.as_ref().map(|g| if g.dtype() == DType::F32 { Ok(g.clone()) } else { g.to_dtype(DType::F32) }).transpose())
        .collect()
}

/// Gradient `i` of `grads` as a kernel argument: its address, or a null address for an absent one
/// (the kernels read it as zero).
pub(crate) fn grad_arg(grads: &[Option<Tensor>], i: usize) -> ptl_autograd::internal::cuda::KernelArg<'_> {
    use ptl_autograd::internal::cuda::KernelArg;
    grads.get(i).and_then(Option::as_ref).map_or(KernelArg::U64(0), KernelArg::Tensor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_mismatch_names_the_tensor_that_does_not_fit() -> Result<()> {
        let cpu = Device::Cpu;
        let pred = Tensor::zeros(vec![3, 4], DType::F32, cpu)?.requires_grad_(true)?;
        let target = Tensor::zeros(vec![3, 4], DType::F32, cpu)?;
        let ok = [("pred", &pred, &[3usize, 4][..]), ("target", &target, &[3, 4][..])];
        assert_eq!(rows_mismatch(cpu, &ok, 1), None);
        let short = [("pred", &pred, &[3usize, 4][..]), ("target", &target, &[2, 4][..])];
        assert!(rows_mismatch(cpu, &short, 1).is_some_and(|w| w.starts_with("target:")));
        let halves = Tensor::zeros(vec![3, 4], DType::BF16, cpu)?;
        let wrong_dtype = [("pred", &pred, &[3usize, 4][..]), ("target", &halves, &[3, 4][..])];
        assert!(rows_mismatch(cpu, &wrong_dtype, 1).is_some_and(|w| w.contains("BF16")));
        // A constant (after the differentiable ones) that asks for a gradient is refused.
        let grad_target = [("pred", &pred, &[3usize, 4][..]), ("target", &pred, &[3, 4][..])];
        assert_eq!(rows_mismatch(cpu, &grad_target, 1).as_deref(), Some("target requires a gradient"));
        assert_eq!(rows_mismatch(cpu, &grad_target, 2), None, "both differentiable");
        Ok(())
    }
}

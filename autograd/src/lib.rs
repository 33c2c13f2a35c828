//! # ptl-autograd
//!
//! Tensors (f32/f64/f16/bf16, i64, u8, bool) on a CPU backend (and CUDA, behind the `cuda`
//! feature), a set of differentiable ops, and a tape autograd in which an unused path leaves a
//! gradient **absent** (`None`), never zero.
//!
//! Layout: [`shape`] (shapes, layouts), [`backend`] (the primitive kernel contract every device
//! implements), `cpu` (the host backend), `storage` (device dispatch), [`tensor`] (the handle),
//! [`autograd`] (nodes and the engine), `ops/` (each op's forward and backward side by side),
//! [`module`] (parameters, state dicts, safetensors), [`rng`] (Philox), [`hash`], [`cuda`] (the
//! GPU backend: devices, memory statistics, kernel options). [`internal`] gathers what the
//! sibling crates need beyond that (capture support, pools, stage tags, storage).
//!
//! ## Ops and their gradient checks
//! Every differentiable op is checked against central finite differences in f64 in
//! `tests/gradcheck.rs`:
//! neg, exp, log, sqrt, abs, sigmoid, silu, tanh, softplus, atan, recip, square, relu, powf,
//! clamp, affine; add, sub, mul, div, maximum, minimum, pow, atan2 (all with broadcasting);
//! where_cond; sum/mean over dims, max_dim/min_dim; reshape, permute/transpose, narrow, cat,
//! split/chunk, expand, squeeze/unsqueeze, upsample_nearest; index_select, gather, scatter_add;
//! conv2d (stride 1/2, padding, groups incl. depthwise, 1×1 and 3×3, bias); batch_norm2d (train
//! and eval); max_pool2d; matmul/bmm (incl. broadcast batch), linear; softmax, log_softmax;
//! bce_with_logits; to_dtype; attention-like matmul+softmax chains.
//! Non-differentiable: comparisons, argmax/argmin, topk, sign/floor/ceil (zero gradient).
//!
//! ## A first fit
//! A linear regression trained by gradient descent on the CPU: tensors, a loss, `backward`, and
//! an in-place update under `no_grad` (parameters keep their storage).
//!
//! ```
//! use ptl_autograd::{module::parameter, no_grad, DType, Device, Rng, Tensor};
//!
//! let mut rng = Rng::new(0);
//! // y = 3·x − 1, 64 samples.
//! let x = Tensor::rand(vec![64, 1], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng)?;
//! let y = x.affine(3.0, -1.0)?;
//! let w = parameter(Tensor::zeros(vec![1, 1], DType::F32, Device::Cpu)?)?;
//! let b = parameter(Tensor::zeros(vec![1], DType::F32, Device::Cpu)?)?;
//! for _ in 0..200 {
//!     let loss = x.linear(&w, Some(&b))?.sub(&y)?.square()?.mean_all()?;
//!     loss.backward()?;
//!     no_grad(|| -> ptl_autograd::Result<()> {
//!         for p in [&w, &b] {
//!             let g = p.grad().expect("every parameter is on the loss's path");
//!             p.copy_(&p.sub(&g.mul_scalar(0.5)?)?)?;
//!             p.set_grad(None);
//!         }
//!         Ok(())
//!     })?;
//! }
//! let (w, b) = (w.to_vec::<f32>()?[0], b.to_vec::<f32>()?[0]);
//! assert!((w - 3.0).abs() < 1e-3 && (b + 1.0).abs() < 1e-3, "w = {w}, b = {b}");
//! # Ok::<(), ptl_autograd::Error>(())
//! ```

#![warn(missing_docs)]
mod arena_plan;
pub mod autocast;
pub mod autograd;
pub mod backend;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
mod graph_rng;
pub mod hash;
pub mod internal;
pub mod memory_format;
pub mod module;
mod ops;
mod pending;
pub mod rng;
pub mod shape;
mod stage;
mod storage;
pub mod streams;
pub mod tensor;
mod warmup;
mod write_journal;

pub use autocast::{autocast, autocast_dtype, autocast_with_weights, cast_weight, AutocastGuard};
pub use autograd::{attach_custom_node, is_grad_enabled, no_grad, BackwardOp, GradModeGuard, GradReady};
pub use cpu::CpuStorage;
pub use device::Device;
pub use dtype::DType;
pub use error::{CudaSetupError, Error, Result};
pub use graph_rng::GraphSafeRng;
pub use memory_format::MemoryFormat;
pub use module::{Module, TensorKind};
pub use ops::norm::BatchNormOptions;
pub use ops::optim::{adamw_composed, lerp, AdamWItem, DeviceScalars, SgdStep, ADAMW_SCALARS};
pub use ops::pack::{PackedMatrix, Unpacked};
pub use pending::{host_reads, host_reads_on_this_thread, HostReads, PendingRead};
pub use rng::Rng;
pub use shape::Shape;
pub use tensor::{Element, GradState, Tensor, TensorId};

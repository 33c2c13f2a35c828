//! # ptl-capture
//!
//! Records a region of the training step — a callable over tensors, e.g. a backbone or a head —
//! as two CUDA graphs (its forward, and its backward per *gradient mask*) and replays them inside
//! the `ptl-autograd` tape as one custom node, byte-identical to running the region natively.
//!
//! ```
//! use std::sync::Arc;
//! use ptl_autograd::{Device, Tensor, TensorKind};
//! use ptl_capture::{testing::ReplayNatively, Recorder, RecorderConfig, RegionSpec};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // `Recorder::cuda(RecorderConfig::default())` on a GPU; the test double replays by re-running.
//! let rec = Recorder::with_backend(RecorderConfig::default(), Arc::new(ReplayNatively::default()));
//! let w = Tensor::from_vec(vec![0.5f32, -1.0, 2.0], 3, Device::Cpu)?.requires_grad_(true)?;
//! let (surface_w, body_w) = (w.clone(), w.clone());
//! let scale = rec.region(RegionSpec::new(
//!     "scale",
//!     move || vec![("w".to_string(), surface_w.clone(), TensorKind::Parameter)], // what the body reads
//!     move |xs| Ok(vec![xs[0].mul(&body_w)?]),
//! ));
//! for _ in 0..3 {
//!     let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], 3, Device::Cpu)?;
//!     let y = scale.call(&[x])?.remove(0); // native warm-up, then capture and replay, then replays
//!     y.sum_all()?.backward()?; // the region is one autograd node: w's gradient accumulates
//! }
//! assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![3.0, 6.0, 9.0]);
//! let stats = scale.stats();
//! assert_eq!((stats.captures, stats.replays), (1, 2));
//! println!("{}", rec.summary_line());
//! # Ok(())
//! # }
//! ```
//!
//! How a call is served:
//! - **Signature** ([`Signature`]): shapes, dtypes, devices and `requires_grad` of the inputs,
//!   grad mode, train/eval and the autocast precision. Each region keeps at most
//!   [`RecorderConfig::max_recordings`] recordings; a miss beyond the bound runs natively and is
//!   counted (temporary shape fallback). A new signature first runs natively
//!   [`RecorderConfig::warmup_calls`] times.
//! - **Capture**: warmup iterations on the capture stream with a snapshot of the region's buffers
//!   (BatchNorm running statistics, counters) and of registered host state taken before and
//!   restored after, so warmup is observationally free; then the forward and the all-outputs
//!   backward are captured into recording-owned arenas (a private pool per recording). Other
//!   gradient masks are captured the first time they occur.
//! - **Replay**: inputs are copied into static buffers, one graph launch, outputs are handed out
//!   as fresh tensors. In backward, parameter gradients are accumulated into each parameter's own
//!   gradient (never the recording's buffers); an output that receives no gradient contributes
//!   nothing, and parameters reached only from such outputs keep `grad() == None`.
//! - **Safety checks** (per recording): storage fingerprints of parameters and buffers (a change
//!   retires the recording), hooks (run natively), precision changes (retire), a forward while the
//!   previous backward is outstanding (native, or [`CaptureError::PendingBackward`] when strict),
//!   illegal work during capture (typed error, native fallback with a warning).
//! - **Observability**: [`RegionStats`] per region and [`Recorder::summary_line`].
//!
//! The [`Backend`] trait separates the state machine from CUDA: [`CudaBackend`] (feature `cuda`)
//! captures real graphs; [`testing::ReplayNatively`] "records" by keeping the body and re-running
//! it on replay, so CPU CI exercises signatures, masks, counters and retire/fallback decisions.

#![warn(missing_docs)]
mod backend;
mod error;
mod recorder;
mod region;
mod signature;
mod stats;
pub mod testing;

#[cfg(feature = "cuda")]
mod cuda_backend;

pub use backend::{ArenaSpec, Backend, Body, Footprint, Graph, PoolHandle};
#[cfg(feature = "cuda")]
pub use cuda_backend::{shared_arena_growths, CudaBackend};
pub use error::{CaptureError, Result};
pub use recorder::{Recorder, RecorderConfig};
pub use region::{BodyFn, HostState, RegionHandle, RegionSpec, SurfaceFn};
pub use signature::{InputSig, Signature};
pub use stats::{FallbackReason, RegionStats, RetireReason};

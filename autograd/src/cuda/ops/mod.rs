//! Launchers for the NVRTC kernels: element-wise, casts, strided copies, reductions, index ops,
//! top-k and max pooling. Every launcher allocates its output stream-ordered and queues the kernel
//! on the device's compute stream; nothing here synchronises or reads device memory on the host.
//!
//! One module per op family, each next to the kernels it launches (`<family>.cu`, compiled behind `prelude.cuh`; see `kernel_units.rs`).

#[macro_use]
mod geometry;
mod depthwise;
mod elementwise;
mod index;
mod multi_tensor;
mod narrow_wgrad;
mod norm;
mod norm_cl;
mod norm_rules;
pub use norm_rules::bn_cluster_launches;
mod pack;
mod pool;
mod reduce;
mod rng;
mod softmax;
mod thin_conv;

pub(crate) use depthwise::*;
pub(crate) use elementwise::*;
pub(crate) use index::*;
pub(crate) use multi_tensor::*;
pub(crate) use narrow_wgrad::*;
pub(crate) use norm::*;
pub(crate) use pool::*;
pub(crate) use reduce::*;
pub(crate) use softmax::*;
pub(crate) use thin_conv::*;

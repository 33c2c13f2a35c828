//! Device memory the math libraries hold: a view over the cuBLAS and cuDNN state of a device,
//! above both library modules.

use super::blas::Blas;
use super::conv::Dnn;
use crate::{Device, Result};

/// Bytes of device memory held by the math libraries' workspaces on `device` (the cuBLAS/cuBLASLt
/// workspace and every cached cuDNN plan's), part of [`super::MemoryStats::allocated`]. They stay for
/// the process lifetime, since recorded graphs keep their addresses.
pub fn library_workspace_bytes(device: Device) -> Result<u64> {
    let dev = super::device::dev_of(device)?;
    let blas = dev.blas.peek(|b: &Blas| b.workspace_bytes()).unwrap_or(0);
    let dnn = dev.dnn.peek(|d: &Dnn| d.workspace_bytes()).unwrap_or(0);
    Ok(blas + dnn)
}

//! The graph-safe Philox generator: keep masks and the device RNG state.

use std::ffi::c_void;

use super::super::storage::CudaStorage;
use crate::backend::{PhiloxStart, RandomStorage};
use crate::{DType, Result};

use super::geometry::*;

/// A u8 keep mask of `n` elements (1 with probability `keep`), see `philox_keep_mask` in rng.cu.
/// `state` = the generator's device `[seed, base offset]` when recording into a graph.
fn philox_keep_mask(
    device: crate::Device,
    n: usize,
    keep: f32,
    seed: u64,
    offset: u64,
    state: Option<&CudaStorage>,
    intra: u64,
) -> Result<CudaStorage> {
    let dev = super::super::device::dev_of(device)?;
    let out = CudaStorage::alloc(&dev, DType::U8, n)?;
    if n == 0 {
        return Ok(out);
    }
    let f = dev.func("philox_keep_mask", "")?;
    let (py, nn) = (ptr(&out), u32c("dropout", n)?);
    let sp: u64 = state.map_or(0, ptr);
    dev.launch1d(f, n.div_ceil(4), &mut args!(py, nn, keep, seed, offset, sp, intra))?;
    Ok(out)
}

/// Writes `(seed, offset)` into a generator's device state `[u64; 2]` (on the stream).
fn rng_state_set(state: &CudaStorage, seed: u64, offset: u64) -> Result<()> {
    let dev = &state.buf.dev;
    let f = dev.func("rng_state_set", "")?;
    let sp = ptr(state);
    dev.launch(f, (1, 1, 1), (1, 1, 1), &mut args!(sp, seed, offset))
}

impl RandomStorage for CudaStorage {
    fn keep_mask(device: crate::Device, n: usize, keep: f32, start: PhiloxStart<'_, Self>) -> Result<Self> {
        match start {
            PhiloxStart::Value { seed, offset } => philox_keep_mask(device, n, keep, seed, offset, None, 0),
            PhiloxStart::State { state, intra } => philox_keep_mask(device, n, keep, 0, 0, Some(state), intra),
        }
    }

    fn set_rng_state(&mut self, seed: u64, offset: u64) -> Result<()> {
        rng_state_set(self, seed, offset)
    }
}

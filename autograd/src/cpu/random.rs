//! The graph-safe generator's draws on the CPU: the reference of `cuda/ops/rng.cu`.

use super::CpuStorage;
use crate::backend::{PhiloxStart, RandomStorage};
use crate::rng::philox4x32;
use crate::{Device, Error, Result};

/// Element i is word i % 4 of the Philox block for counter `offset + i / 4`, kept when
/// `(word >> 8)·2⁻²⁴ < keep` (f32, as the kernel compares).
fn keep_mask_bytes(n: usize, keep: f32, seed: u64, offset: u64) -> Vec<u8> {
    let key = [seed as u32, (seed >> 32) as u32];
    let mut out = vec![0u8; n];
    for (b, chunk) in out.chunks_mut(4).enumerate() {
        let c = offset.wrapping_add(b as u64);
        let w = philox4x32([c as u32, (c >> 32) as u32, 0, 0], key);
        for (j, y) in chunk.iter_mut().enumerate() {
            *y = (((w[j] >> 8) as f32) * (1.0 / 16_777_216.0) < keep) as u8;
        }
    }
    out
}

impl RandomStorage for CpuStorage {
    fn keep_mask(device: Device, n: usize, keep: f32, start: PhiloxStart<'_, Self>) -> Result<Self> {
        if device != Device::Cpu {
            return Err(Error::invalid("keep_mask", format!("the CPU backend draws no mask for {device}")));
        }
        let (seed, offset) = match start {
            PhiloxStart::Value { seed, offset } => (seed, offset),
            PhiloxStart::State { state: CpuStorage::I64(v), intra } if v.len() >= 2 => (v[0] as u64, (v[1] as u64).wrapping_add(intra)),
            PhiloxStart::State { .. } => return Err(Error::invalid("keep_mask", "a generator state is two i64 values")),
        };
        Ok(CpuStorage::U8(keep_mask_bytes(n, keep, seed, offset)))
    }

    fn set_rng_state(&mut self, seed: u64, offset: u64) -> Result<()> {
        match self {
            CpuStorage::I64(v) if v.len() >= 2 => {
                (v[0], v[1]) = (seed as i64, offset as i64);
                Ok(())
            }
            _ => Err(Error::invalid("set_rng_state", "a generator state is two i64 values")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state buffer's `[seed, base]` plus `intra` blocks draws what `(seed, base + intra)` does.
    #[test]
    fn a_state_buffer_draws_what_its_values_do() {
        let mut state = CpuStorage::I64(vec![0, 0]);
        state.set_rng_state(0xDEAD_BEEF_1234, 40).unwrap();
        let from_state = CpuStorage::keep_mask(Device::Cpu, 37, 0.7, PhiloxStart::State { state: &state, intra: 3 }).unwrap();
        let by_value = CpuStorage::keep_mask(Device::Cpu, 37, 0.7, PhiloxStart::Value { seed: 0xDEAD_BEEF_1234, offset: 43 }).unwrap();
        assert_eq!(from_state, by_value);
        let CpuStorage::U8(v) = &by_value else { panic!("a u8 mask") };
        assert!(v.contains(&0) && v.contains(&1), "{v:?}");
        assert!(CpuStorage::keep_mask(Device::Cpu, 4, 0.5, PhiloxStart::State { state: &CpuStorage::F32(vec![0.0; 2]), intra: 0 }).is_err());
    }
}

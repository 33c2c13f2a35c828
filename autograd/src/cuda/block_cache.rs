//! The host-side block cache in front of a device's default pool (see `alloc`): free lists of
//! freed blocks by size, with the limits that decide what is kept. Plain data: the allocator
//! hands blocks in and out, the device holds one.

use cudarc::driver::sys;

/// Most bytes the block cache holds by default: none, the cache is off. Measured on the H200
/// (native bf16 training, batch 4, same summed GPU time in every setting): limits 512 MiB / blocks
/// ≤ 64 MiB reserved 1,376 MiB of pool memory for 846 MiB allocated; 256 / 16 MiB 1,216; 128 / 8
/// MiB 1,408; even 64 / 1 MiB (small blocks only) 1,504–1,568 — parked blocks, however small, keep
/// the pool's chunks from being reused for other sizes; off: 864–896. Host time per allocation is
/// the cost (~0.6–1.1 µs per alloc + free pair in the driver), which replayed regions do not pay.
pub const CACHE_LIMIT: u64 = 0;
/// Larger blocks are not cached (with [`CACHE_ENV`] set).
const CACHE_MAX_BLOCK: usize = 0;
/// The environment variable that sets both limits: `<limit MiB>,<largest cached block MiB>`
/// (e.g. `512,64` to trade reserved memory for host time per allocation; `0,0`, the default, is off).
pub const CACHE_ENV: &str = "PTL_CUDA_BLOCK_CACHE";

/// The block cache's limits from [`CACHE_ENV`] (defaults when unset).
pub(crate) fn cache_limits_from_env() -> std::result::Result<(u64, usize), String> {
    match std::env::var(CACHE_ENV) {
        Ok(v) => parse_cache_limits(&v),
        Err(_) => Ok((CACHE_LIMIT, CACHE_MAX_BLOCK)),
    }
}

/// `<limit MiB>,<largest cached block MiB>` in bytes, or a message naming the variable and the form.
fn parse_cache_limits(v: &str) -> std::result::Result<(u64, usize), String> {
    let bad = || format!("{CACHE_ENV}={v:?}: expected `<limit MiB>,<largest cached block MiB>`, e.g. `256,16`");
    let (a, b) = v.split_once(',').ok_or_else(bad)?;
    let limit: u64 = a.trim().parse().map_err(|_| bad())?;
    let block: usize = b.trim().parse().map_err(|_| bad())?;
    if limit > (1 << 24) || block > (1 << 24) {
        return Err(format!("{CACHE_ENV}={v:?}: a limit above 16 TiB is not a memory size"));
    }
    Ok((limit << 20, block << 20))
}

/// Free lists of default-pool blocks by block size (see the module docs).
///
/// A request takes the smallest cached block that fits with at most 1/8 to spare. Only small
/// blocks are cached by default (see [`CACHE_MAX_BLOCK`]): a pool allocation of a large output
/// costs a little GPU time in isolation (a 5 MB softmax 6.6 → 7.5 µs, an earlier micro-benchmark),
/// but in a training step the summed kernel time was the same with the cache off, and the pool's
/// reuse across sizes saved 480 MiB of reserved memory. Handing parked blocks back to the pool on
/// every miss was tried earlier and dropped (it evicted blocks the step needed next).
pub(crate) struct BlockCache {
    free: std::collections::BTreeMap<usize, Vec<sys::CUdeviceptr>>,
    bytes: u64,
    limit: u64,
    max_block: usize,
}

impl Default for BlockCache {
    fn default() -> Self {
        BlockCache::with_limits(CACHE_LIMIT, CACHE_MAX_BLOCK)
    }
}

impl BlockCache {
    pub(crate) fn with_limits(limit: u64, max_block: usize) -> Self {
        BlockCache { free: Default::default(), bytes: 0, limit, max_block }
    }

    /// A cached block of at least `block` bytes (at most 1/8 more) and its size.
    pub(crate) fn take(&mut self, block: usize) -> Option<(sys::CUdeviceptr, usize)> {
        let (&size, list) = self.free.range_mut(block..=block + block / 8).find(|(_, l)| !l.is_empty())?;
        let p = list.pop()?;
        if list.is_empty() {
            self.free.remove(&size);
        }
        self.bytes -= size as u64;
        Some((p, size))
    }

    /// Keeps `ptr` for reuse unless the cache is full; `false` means the caller frees it.
    pub(crate) fn put(&mut self, block: usize, ptr: sys::CUdeviceptr) -> bool {
        if block > self.max_block || self.bytes + block as u64 > self.limit {
            return false;
        }
        self.free.entry(block).or_default().push(ptr);
        self.bytes += block as u64;
        true
    }

    /// Bytes cached now.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Sets the limits (bytes in all, largest cached block), returning the previous ones.
    pub(crate) fn set_limits(&mut self, limit: u64, max_block: usize) -> (u64, usize) {
        let before = (self.limit, self.max_block);
        (self.limit, self.max_block) = (limit, max_block);
        before
    }

    /// Every cached block, emptying the cache.
    pub(crate) fn drain(&mut self) -> Vec<sys::CUdeviceptr> {
        self.bytes = 0;
        std::mem::take(&mut self.free).into_values().flatten().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_cache_best_fit_and_limits() {
        const LIMIT: u64 = 512 << 20;
        const MAX_BLOCK: usize = 64 << 20;
        assert!(!BlockCache::default().put(512, 0x1000), "off by default");
        let mut c = BlockCache::with_limits(LIMIT, MAX_BLOCK);
        assert!(c.put(4096, 0x1000));
        assert!(c.put(8192, 0x2000));
        assert!(c.put(4608, 0x3000));
        assert_eq!(c.bytes, 4096 + 8192 + 4608);
        // Smallest fit with at most 1/8 to spare: 4096 exactly, then 4608 (= 4096 + 1/8) for the next.
        assert_eq!(c.take(4096), Some((0x1000, 4096)));
        assert_eq!(c.take(4096), Some((0x3000, 4608)));
        // 8192 is more than 1/8 above 4096: not handed out for it.
        assert_eq!(c.take(4096), None);
        assert_eq!(c.take(8000), Some((0x2000, 8192)));
        assert_eq!(c.bytes, 0);
        assert!(c.free.is_empty(), "no empty lists are kept");
        // Limits: blocks above the size cap are refused.
        assert!(!c.put(MAX_BLOCK + 512, 0x4000));
        // The byte limit.
        let mut c = BlockCache::with_limits(LIMIT, MAX_BLOCK);
        let mut n = 0;
        while c.put(MAX_BLOCK, n) {
            n += 1;
        }
        assert_eq!(n, LIMIT / MAX_BLOCK as u64);
        assert_eq!(c.drain().len() as u64, n);
        assert_eq!(c.bytes, 0);
        // Configured limits (PTL_CUDA_BLOCK_CACHE): 1 MiB in all, blocks up to 512 KiB.
        let mut c = BlockCache::with_limits(1 << 20, 512 << 10);
        assert!(!c.put((512 << 10) + 512, 0x1000));
        assert!(c.put(512 << 10, 0x2000) && c.put(512 << 10, 0x3000));
        assert!(!c.put(512, 0x4000), "full");
        let mut off = BlockCache::with_limits(0, 0);
        assert!(!off.put(512, 0x1000), "0,0 turns the cache off");
    }

    #[test]
    fn cache_limits_parse_or_name_the_variable() {
        assert_eq!(parse_cache_limits("256,16"), Ok((256 << 20, 16 << 20)));
        assert_eq!(parse_cache_limits(" 0 , 0 "), Ok((0, 0)));
        for bad in ["256", "a,b", "256;16", "-1,2", "99999999999,1"] {
            let e = parse_cache_limits(bad).unwrap_err();
            assert!(e.contains(CACHE_ENV), "{bad}: {e}");
        }
    }
}

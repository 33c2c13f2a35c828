//! The batch-norm launchers' shared rules: argument checks, vector width, how a layer is split
//! into blocks, and the one-launch switch. Below both layouts' launchers (`norm`, `norm_cl`).

use super::super::storage::CudaStorage;
use crate::{DType, Error, Result};

use super::geometry::*;

pub(super) fn nchw(op: &'static str, shape: &[usize], len: usize) -> Result<(usize, usize, usize)> {
    if shape.len() != 4 || shape.iter().product::<usize>() != len {
        return Err(Error::invalid(op, format!("expected a contiguous NCHW tensor, got shape {shape:?} for {len} elements")));
    }
    Ok((shape[0], shape[1], shape[2] * shape[3]))
}

pub(super) fn stats_arg(op: &'static str, s: &CudaStorage, want: DType, c: usize) -> Result<()> {
    if s.dtype != want || s.len != c {
        return Err(Error::invalid(op, format!("expected {c} values of {want}, got {} of {}", s.len, s.dtype)));
    }
    Ok(())
}

/// Vector width of the batch-norm kernels (see norm.cu): 16-byte loads when every run of HW
/// elements is a whole number of vectors and the buffers are 16-byte aligned, else 1.
pub(super) fn bn_vector(dtype: DType, hw: usize, bufs: &[&CudaStorage]) -> (&'static str, usize) {
    let v = 16 / dtype.size_in_bytes();
    if hw.is_multiple_of(v) && bufs.iter().all(|b| ptr(b).is_multiple_of(16)) {
        ("_v", v)
    } else {
        ("", 1)
    }
}

/// Blocks per channel of the batch-norm reductions: ≤ 8192 elements each and about two blocks per
/// SM in all (264), but one block for a channel of ≤ 4096 elements, which then needs no second
/// phase (the combine of partials is a serial tail of a few µs per launch, measured as most of a
/// small layer's time). The forward and backward use the same split.
pub(super) fn bn_parts(total: usize, c: usize) -> usize {
    let one = bn_one_block_max();
    if total <= one {
        return 1;
    }
    total.div_ceil(8192).max(264usize.div_ceil(c)).min(total.div_ceil(4096)).clamp(1, 1024)
}

/// The largest channel (values) one block reduces alone: 4096, or `PTL_BN_ONE_BLOCK_MAX` (for
/// measuring; a different value changes the summation order of the layers it moves, so the
/// bytes of a run, which stay fixed for any one setting).
pub(super) fn bn_one_block_max() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| match std::env::var("PTL_BN_ONE_BLOCK_MAX") {
        Err(_) => 4096,
        Ok(v) => v.trim().parse::<usize>().ok().filter(|&m| (1..=1 << 20).contains(&m)).unwrap_or_else(|| {
            log::warn!("ptl: PTL_BN_ONE_BLOCK_MAX={v:?} is not a count of values from 1 to 1048576; using 4096");
            4096
        }),
    })
}

/// Whether a batch-norm layer of `parts` channel blocks runs as one launch on `dev`
/// ([`super::super::DeviceOptions::bn_one_launch`]).
pub(super) fn bn_one_launch(dev: &super::super::device::Dev, parts: usize) -> bool {
    parts == 1 && dev.options().bn_one_launch
}

/// Whether a batch-norm layer of `parts` channel blocks runs one launch per direction as one
/// thread-block cluster per channel (2–8 blocks, the portable cluster size; sm_90 and later), the
/// two-launch kernels' arithmetic: under [`super::super::DeviceOptions::bn_one_launch`], unless
/// `PTL_BN_CLUSTER=0`.
pub(super) fn bn_cluster(dev: &super::super::device::Dev, parts: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("PTL_BN_CLUSTER").map_or(true, |v| v != "0"));
    (2..=BN_CLUSTER_MAX).contains(&parts) && on && dev.clusters && dev.options().bn_one_launch
}

/// Batch-norm launches made as one cluster per channel in this process ([`bn_cluster`]).
static CLUSTER_LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts one cluster launch of the batch norm.
pub(super) fn count_bn_cluster_launch() {
    CLUSTER_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// How many batch-norm launches (forward or backward) ran as one thread-block cluster per
/// channel in this process, to check which path a shape takes.
pub fn bn_cluster_launches() -> u64 {
    CLUSTER_LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

/// The most blocks per channel [`bn_cluster`] groups in one cluster.
pub(super) const BN_CLUSTER_MAX: usize = 8;

pub(super) fn bn_channels(op: &'static str, c: usize) -> Result<u32> {
    if c > super::super::device::BN_TICKETS {
        return Err(Error::invalid(op, format!("{c} channels; the CUDA batch norm handles at most {}", super::super::device::BN_TICKETS)));
    }
    u32c(op, c)
}

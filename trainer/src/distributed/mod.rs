//! Data-parallel training: how the global batch and each epoch's order are split over the
//! ranks, how gradients are grouped into all-reduce buckets and averaged (absent gradients
//! included), the [`Collective`] transports that run them — in CI the threads-in-one-process
//! [`ThreadGroup`], on GPUs NCCL ([`NcclCollective`], CUDA builds) — the [`DataParallel`] handle
//! the fit loop uses, the TCP rendezvous store through which the ranks meet, and the launcher
//! behind `ptl train device=0,1` ([`launch_local`], [`WorkerEnv`]). Ultralytics' semantics
//! throughout: `batch` is global and floored per rank, each epoch's order is padded and strided
//! over the ranks as PyTorch's `DistributedSampler` does, gradients are averaged over the world
//! size, rank 0 writes.

mod agree;
mod buckets;
mod collective;
mod data_parallel;
mod launch;
#[cfg(feature = "cuda")]
mod nccl_group;
mod overlap;
mod shard;
mod store;

pub use agree::{agree_bucket, Issued, LoggedCollective};
pub use buckets::{average_gradients, Bucket, BucketPlan, DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
pub use collective::{Collective, ThreadCollective, ThreadGroup, DEFAULT_COLLECTIVE_TIMEOUT};
pub use data_parallel::DataParallel;
pub use launch::{device_list, launch_local, supervise, WorkerEnv, STOP_GRACE, STORE_ADDR_ENV};
#[cfg(feature = "cuda")]
pub use nccl_group::NcclCollective;
pub use overlap::OverlappedSums;
pub use shard::{per_rank_batch, shard_order};
pub use store::{store_get, store_set, StoreServer, MAX_VALUE};

/// Runs `f` on every rank of a `world`-rank [`ThreadGroup`], each in its thread; the ranks'
/// results in rank order.
#[cfg(test)]
pub(crate) fn on_ranks<T: Send + 'static>(world: usize, f: impl Fn(ThreadCollective) -> T + Send + Sync + 'static) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = ThreadGroup::new(world)
        .expect("a group of at least one rank")
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
}

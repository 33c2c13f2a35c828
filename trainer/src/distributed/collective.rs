//! The operations data-parallel training needs from its transport, and a transport of threads in
//! one process, which runs the multi-rank rules in CI without GPUs.

use std::sync::{Arc, Barrier, Mutex};

use crate::error::{Result, TrainerError};

/// Collective operations over `world` ranks. Every rank must call the same operations in the
/// same order with buffers of the same length (NCCL's rule too); the results are the same bytes
/// on every rank.
pub trait Collective: Send {
    /// This rank (0-based).
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world(&self) -> usize;
    /// Replaces `buf` with the element-wise sum over the ranks, added in rank order.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Replaces `buf` with the element-wise maximum over the ranks (the ranks' agreement on a
    /// step's target bucket, which gradients are present).
    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<()>;
}

/// The ranks' deposits of the operation in progress.
struct Slots {
    f32s: Vec<Vec<f32>>,
    u64s: Vec<Vec<u64>>,
}

/// What the ranks of a [`ThreadGroup`] share.
struct Shared {
    world: usize,
    slots: Mutex<Slots>,
    barrier: Barrier,
}

/// A group of ranks that are threads of one process: [`ThreadGroup::new`] gives one
/// [`ThreadCollective`] per rank, each moved to its thread.
pub struct ThreadGroup;

impl ThreadGroup {
    /// One collective per rank of a `world`-rank group.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize) -> Result<Vec<ThreadCollective>> {
        if world == 0 {
            return Err(TrainerError::InvalidArgument { what: "world size", reason: "at least one rank is needed".into() });
        }
        let shared = Arc::new(Shared {
            world,
            slots: Mutex::new(Slots { f32s: vec![Vec::new(); world], u64s: vec![Vec::new(); world] }),
            barrier: Barrier::new(world),
        });
        Ok((0..world).map(|rank| ThreadCollective { rank, shared: shared.clone() }).collect())
    }
}

/// One rank of a [`ThreadGroup`].
pub struct ThreadCollective {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadCollective {
    /// Deposits this rank's buffer, waits for every rank, combines the deposits in rank order,
    /// and waits again before the slots are reused.
    fn exchange<T: Copy + Send>(
        &self,
        buf: &mut [T],
        slot: impl Fn(&mut Slots) -> &mut Vec<Vec<T>>,
        combine: impl Fn(T, T) -> T,
    ) -> Result<()> {
        let lock =
            || self.shared.slots.lock().map_err(|_| TrainerError::InvalidArgument { what: "collective", reason: "a rank panicked".into() });
        slot(&mut *lock()?)[self.rank] = buf.to_vec();
        self.shared.barrier.wait();
        {
            let mut slots = lock()?;
            let deposits = slot(&mut slots);
            if deposits.iter().any(|d| d.len() != buf.len()) {
                return Err(TrainerError::InvalidArgument {
                    what: "collective",
                    reason: format!(
                        "the ranks passed buffers of different lengths: {:?}",
                        deposits.iter().map(Vec::len).collect::<Vec<_>>()
                    ),
                });
            }
            for (i, v) in buf.iter_mut().enumerate() {
                *v = deposits[1..].iter().fold(deposits[0][i], |acc, d| combine(acc, d[i]));
            }
        }
        self.shared.barrier.wait();
        Ok(())
    }
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.exchange(buf, |s| &mut s.f32s, |a, b| a + b)
    }

    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<()> {
        self.exchange(buf, |s| &mut s.u64s, u64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::super::on_ranks;
    use super::*;

    #[test]
    fn every_rank_gets_the_same_bytes_summed_in_rank_order() {
        let sums = on_ranks(4, |c| {
            // Values whose sum depends on the order in f32.
            let mut buf = vec![[1e8f32, 1.0, -1e8, 0.5][c.rank()], c.rank() as f32];
            c.all_reduce_sum(&mut buf).unwrap();
            let mut m = vec![c.rank() as u64 * 3, 7];
            c.all_reduce_max(&mut m).unwrap();
            (buf, m)
        });
        let in_order = ((1e8f32 + 1.0) + -1e8) + 0.5;
        for (buf, m) in &sums {
            assert_eq!(buf[0].to_bits(), in_order.to_bits());
            assert_eq!(buf[1], 6.0);
            assert_eq!(m, &vec![9, 7]);
        }
    }

    #[test]
    fn buffers_of_different_lengths_are_an_error_on_every_rank() {
        let results = on_ranks(2, |c| {
            let mut buf = vec![0f32; 1 + c.rank()];
            c.all_reduce_sum(&mut buf).map_err(|e| e.to_string())
        });
        assert!(results.iter().all(|r| r.as_ref().is_err_and(|e| e.contains("different lengths"))), "{results:?}");
        assert!(ThreadGroup::new(0).is_err());
    }
}

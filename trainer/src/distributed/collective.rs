//! The operations data-parallel training needs from its transport, and a transport of threads in
//! one process, which runs the multi-rank rules in CI without GPUs.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ptl_autograd::{no_grad, DType, Tensor};

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
    /// Whether [`Collective::all_reduce_sum_tensor`] is work on the device's stream (recorded into
    /// a graph when that stream is captured) rather than host work. The default: host work.
    fn sums_on_device(&self) -> bool {
        false
    }
    /// Replaces `t` with the element-wise sum over the ranks, in place. This default goes through
    /// a host copy and [`Collective::all_reduce_sum`]; a device transport sums where `t` lies.
    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<()> {
        let mut v = t.to_dtype(DType::F32)?.to_vec::<f32>()?;
        self.all_reduce_sum(&mut v)?;
        no_grad(|| t.copy_(&Tensor::from_vec(v, t.shape().clone(), t.device())?.to_dtype(t.dtype())?))?;
        Ok(())
    }
    /// Starts [`Collective::all_reduce_sum_tensor`] of `t` so that it may complete beside the
    /// work that follows (a device transport sums on its own stream while the backward goes on);
    /// `t` is not to be read, written or freed before [`Collective::wait_started`]. Sums started
    /// complete in order, and no other collective may be issued while any is pending. This
    /// default sums at once.
    fn start_all_reduce_sum_tensor(&self, t: &Tensor) -> Result<()> {
        self.all_reduce_sum_tensor(t)
    }
    /// Waits until every sum started by [`Collective::start_all_reduce_sum_tensor`] has completed
    /// and is visible to the work queued after this. The default has nothing pending.
    fn wait_started(&self) -> Result<()> {
        Ok(())
    }
}

/// How long a rank of a [`ThreadGroup`] waits for the others at one collective before it gives
/// up (the watchdog: a rank stuck elsewhere must not hang the others for ever).
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(600);

/// The deposits of one kind of operation and the last result.
struct Slot<T> {
    deposits: Vec<Vec<T>>,
    result: std::result::Result<Vec<T>, String>,
}

impl<T> Slot<T> {
    fn new(world: usize) -> Self {
        Slot { deposits: (0..world).map(|_| Vec::new()).collect(), result: Ok(Vec::new()) }
    }
}

/// Where the ranks of a [`ThreadGroup`] stand.
struct State {
    /// Completed collectives.
    generation: u64,
    /// Ranks waiting in the current one.
    arrived: usize,
    /// The first rank that left the group (its collective dropped: it ended or failed).
    left: Option<usize>,
    /// The operation each rank called in the current collective.
    ops: Vec<&'static str>,
    /// Why the group is out of step, once a collective met ranks calling different operations
    /// (every later collective fails too: the ranks' sequences no longer pair up).
    out_of_step: Option<String>,
    f32s: Slot<f32>,
    u64s: Slot<u64>,
}

/// What the ranks of a [`ThreadGroup`] share.
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    arrived: Condvar,
}

/// A group of ranks that are threads of one process: [`ThreadGroup::new`] gives one
/// [`ThreadCollective`] per rank, each moved to its thread. A rank that drops its collective
/// (its fit ended or failed) leaves the group: a rank waiting for it, or arriving later, gets an
/// error naming it instead of waiting for ever; so does a rank that waits longer than the
/// group's timeout.
pub struct ThreadGroup;

impl ThreadGroup {
    /// One collective per rank of a `world`-rank group, with [`DEFAULT_COLLECTIVE_TIMEOUT`].
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize) -> Result<Vec<ThreadCollective>> {
        ThreadGroup::with_timeout(world, DEFAULT_COLLECTIVE_TIMEOUT)
    }

    /// One collective per rank of a `world`-rank group whose ranks wait at most `timeout` for
    /// each other at one collective.
    pub fn with_timeout(world: usize, timeout: Duration) -> Result<Vec<ThreadCollective>> {
        if world == 0 {
            return Err(TrainerError::InvalidArgument { what: "world size", reason: "at least one rank is needed".into() });
        }
        let state = State {
            generation: 0,
            arrived: 0,
            left: None,
            ops: vec![""; world],
            out_of_step: None,
            f32s: Slot::new(world),
            u64s: Slot::new(world),
        };
        let shared = Arc::new(Shared { world, timeout, state: Mutex::new(state), arrived: Condvar::new() });
        Ok((0..world).map(|rank| ThreadCollective { rank, shared: shared.clone() }).collect())
    }
}

/// One rank of a [`ThreadGroup`].
pub struct ThreadCollective {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadCollective {
    fn error(&self, reason: String) -> TrainerError {
        TrainerError::Collective { rank: self.rank, reason }
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(|_| self.error("a rank panicked inside a collective".into()))
    }

    /// Deposits this rank's buffer; the last rank to arrive combines the deposits in rank order
    /// and wakes the others; every rank then copies the result (which stays until the next
    /// collective completes, which needs every rank again).
    fn exchange<T: Copy + Send>(
        &self,
        op: &'static str,
        buf: &mut [T],
        slot: impl Fn(&mut State) -> &mut Slot<T>,
        combine: impl Fn(T, T) -> T,
    ) -> Result<()> {
        let mut st = self.lock()?;
        // The cause first: a group out of step also sees its ranks leave as they fail.
        if let Some(why) = &st.out_of_step {
            return Err(self.error(why.clone()));
        }
        if let Some(r) = st.left {
            return Err(self.error(format!("rank {r} left the group before this collective")));
        }
        let generation = st.generation;
        slot(&mut st).deposits[self.rank] = buf.to_vec();
        st.ops[self.rank] = op;
        st.arrived += 1;
        if st.arrived == self.shared.world && st.ops.iter().any(|o| *o != op) {
            // The ranks' sequences diverged (one rank issued a collective the others did not):
            // every rank of this collective, and every later one, fails.
            st.out_of_step = Some(format!("the ranks' collectives are out of step: the ranks called {:?}", st.ops));
            st.arrived = 0;
            st.generation += 1;
            self.shared.arrived.notify_all();
        } else if st.arrived == self.shared.world {
            let s = slot(&mut st);
            s.result = match s.deposits.iter().all(|d| d.len() == buf.len()) {
                true => Ok((0..buf.len()).map(|i| s.deposits[1..].iter().fold(s.deposits[0][i], |acc, d| combine(acc, d[i]))).collect()),
                false => {
                    Err(format!("the ranks passed buffers of different lengths: {:?}", s.deposits.iter().map(Vec::len).collect::<Vec<_>>()))
                }
            };
            st.arrived = 0;
            st.generation += 1;
            self.shared.arrived.notify_all();
        } else {
            let deadline = Instant::now() + self.shared.timeout;
            while st.generation == generation {
                if let Some(r) = st.left {
                    return Err(self.error(format!("rank {r} left the group while this rank waited for it")));
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(self.error(format!(
                        "a collective did not complete within {:.0} s ({} of {} ranks arrived)",
                        self.shared.timeout.as_secs_f64(),
                        st.arrived,
                        self.shared.world
                    )));
                }
                st = self
                    .shared
                    .arrived
                    .wait_timeout(st, deadline - now)
                    .map_err(|_| self.error("a rank panicked inside a collective".into()))?
                    .0;
            }
        }
        if let Some(why) = &st.out_of_step {
            return Err(self.error(why.clone()));
        }
        match &slot(&mut st).result {
            Ok(v) => buf.copy_from_slice(v),
            Err(reason) => return Err(self.error(reason.clone())),
        }
        Ok(())
    }
}

impl Drop for ThreadCollective {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.left.get_or_insert(self.rank);
        self.shared.arrived.notify_all();
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
        self.exchange("all_reduce_sum", buf, |s| &mut s.f32s, |a, b| a + b)
    }

    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<()> {
        self.exchange("all_reduce_max", buf, |s| &mut s.u64s, u64::max)
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

    /// Ranks whose sequences diverged — one sums while the other takes a maximum — fail at that
    /// collective and at every later one, instead of pairing one rank's call with another's.
    #[test]
    fn ranks_calling_different_collectives_are_an_error_on_every_rank_from_then_on() {
        let results = on_ranks(2, |c| {
            let first = match c.rank() {
                0 => c.all_reduce_sum(&mut [1.0]).map_err(|e| e.to_string()),
                _ => c.all_reduce_max(&mut [1]).map_err(|e| e.to_string()),
            };
            let then = c.all_reduce_max(&mut [2]).map_err(|e| e.to_string());
            (first, then)
        });
        for (first, then) in &results {
            assert!(first.as_ref().is_err_and(|e| e.contains("out of step")), "{first:?}");
            assert!(then.as_ref().is_err_and(|e| e.contains("out of step")), "{then:?}");
        }
    }

    /// A rank that leaves (its fit failed before a collective the others reached) fails the
    /// ranks waiting for it, naming it; one that never arrives fails them after the timeout.
    #[test]
    fn a_rank_that_leaves_or_stalls_fails_the_others_instead_of_hanging_them() {
        let results = on_ranks(3, |c| {
            if c.rank() == 1 {
                return Ok(()); // leaves: its collective is dropped here
            }
            c.all_reduce_max(&mut [1]).map_err(|e| e.to_string())
        });
        for r in [&results[0], &results[2]] {
            let e = r.as_ref().unwrap_err();
            assert!(e.contains("rank 1 left the group"), "{e}");
        }
        let mut group = ThreadGroup::with_timeout(2, Duration::from_millis(50)).unwrap();
        let stalled = group.pop().unwrap();
        let e = group[0].all_reduce_sum(&mut [1.0]).unwrap_err().to_string();
        assert!(e.contains("did not complete within") && e.contains("1 of 2 ranks"), "{e}");
        drop(stalled);
    }
}

//! The gradient sum over the ranks started during backward (docs/multi-gpu.md, "Overlapping the
//! all-reduce with backward"): the engine reports each parameter whose gradient is final
//! ([`ptl_autograd::Tensor::backward_with_ready`]); a bucket is summed as soon as all its
//! parameters are, in plan order only; what is left is summed when backward ends, then the ranks
//! agree on which gradients are present and the averages are written into them.
//!
//! Unlike [`DataParallel::sum_gradients`], whose buckets hold the gradients present on some rank
//! (decided before the sum), a bucket here holds every trainable parameter of its plan entry, with
//! zeros for a gradient absent on this rank: the layout cannot wait for the agreement. Each
//! element is the same sum of the same values in rank order (a rank without the gradient adds
//! zeros either way), so the averages are the same bytes on the CPU group; a gradient absent on
//! every rank sums to zeros, which the agreement then leaves absent. Every rank issues the same
//! buckets in the same order — during backward where its gradients are final, after it otherwise.

use std::collections::HashMap;

use ptl_autograd::{no_grad, DType, Tensor};

use super::buckets::BucketPlan;
use super::data_parallel::{trainable, DataParallel};
use crate::error::Result;

/// The buckets of one update's gradient sum, issued while backward runs.
pub struct OverlappedSums {
    plan: BucketPlan,
    trainable: Vec<Tensor>,
    /// Trainable index by the parameter's storage.
    slot: HashMap<usize, usize>,
    ready: Vec<bool>,
    /// The summed buckets so far, in plan order.
    sums: Vec<Tensor>,
}

impl OverlappedSums {
    /// The sums of the update whose last backward is about to run, over the trainable parameters
    /// among `params` (the bucket plan of [`DataParallel::agree_on_update`]).
    pub fn new(dp: &mut DataParallel, params: &[(String, Tensor)]) -> Result<OverlappedSums> {
        let trainable: Vec<Tensor> = trainable(params).into_iter().cloned().collect();
        let plan = dp.bucket_plan(&trainable.iter().collect::<Vec<_>>())?;
        let slot = trainable.iter().enumerate().map(|(i, t)| (t.storage_ptr(), i)).collect();
        let ready = vec![false; trainable.len()];
        Ok(OverlappedSums { plan, trainable, slot, ready, sums: Vec::new() })
    }

    /// Buckets summed so far.
    pub fn issued(&self) -> usize {
        self.sums.len()
    }

    /// `leaf`'s gradient is final for this backward (the engine's report): sums every bucket
    /// that is now complete, in plan order. A leaf that is not a trainable parameter is ignored.
    pub fn ready(&mut self, dp: &DataParallel, leaf: &Tensor) -> Result<()> {
        if let Some(&i) = self.slot.get(&leaf.storage_ptr()) {
            self.ready[i] = true;
        }
        while let Some(bucket) = self.plan.buckets.get(self.sums.len()) {
            if !bucket.params.iter().all(|&i| self.ready[i]) {
                break;
            }
            self.issue_next(dp)?;
        }
        Ok(())
    }

    /// [`OverlappedSums::ready`] as the engine's callback for
    /// [`ptl_autograd::Tensor::backward_with_ready`] (an error stops the backward, naming it).
    pub fn ready_hook<'a>(&'a mut self, dp: &'a DataParallel) -> impl FnMut(&Tensor) -> ptl_autograd::Result<()> + 'a {
        move |leaf| {
            self.ready(dp, leaf).map_err(|e| ptl_autograd::Error::Backward { msg: format!("gradient all-reduce during backward: {e}") })
        }
    }

    /// After backward: sums the buckets not yet issued, agrees with the other ranks on the
    /// update ([`DataParallel::agree_on_update`]: which gradients are present, a non-finite
    /// window anywhere — the result —, rank 0's `buffers`), and writes each present gradient's
    /// average over the ranks into its own buffer.
    pub fn finish(mut self, dp: &mut DataParallel, params: &[(String, Tensor)], nonfinite_here: bool, buffers: &[Tensor]) -> Result<bool> {
        while self.sums.len() < self.plan.buckets.len() {
            self.issue_next(dp)?;
        }
        // The sums ran beside the backward: wait for them before the agreement (the next
        // collective) and before reading them.
        dp.collective().wait_started()?;
        let anywhere = dp.agree_on_update(params, nonfinite_here, buffers)?;
        let scale = 1.0 / dp.world() as f64;
        no_grad(|| -> Result<()> {
            for (bucket, sum) in self.plan.buckets.iter().zip(&self.sums) {
                let mean = sum.mul_scalar(scale)?;
                let mut at = 0;
                for &i in &bucket.params {
                    let t = &self.trainable[i];
                    if let Some(g) = t.grad() {
                        g.copy_(&mean.narrow(0, at, t.numel())?.reshape(g.shape().clone())?.to_dtype(g.dtype())?)?;
                    }
                    at += t.numel();
                }
            }
            Ok(())
        })?;
        Ok(anywhere)
    }

    /// Flattens the next bucket (zeros for a gradient absent here) and sums it over the ranks.
    fn issue_next(&mut self, dp: &DataParallel) -> Result<()> {
        let bucket = &self.plan.buckets[self.sums.len()];
        let flat = no_grad(|| -> Result<Tensor> {
            let parts = bucket
                .params
                .iter()
                .map(|&i| {
                    let t = &self.trainable[i];
                    match t.grad() {
                        Some(g) => g.to_dtype(DType::F32)?.reshape(vec![t.numel()]),
                        None => Tensor::zeros(vec![t.numel()], DType::F32, t.device()),
                    }
                })
                .collect::<ptl_autograd::Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?)
        })?;
        // As in `DataParallel::sum_gradients`: nothing is exchanged in a recorder's warm-up.
        if !ptl_autograd::internal::warmup::active() {
            dp.collective().start_all_reduce_sum_tensor(&flat)?;
        }
        self.sums.push(flat);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::collective::{Collective, ThreadCollective};
    use super::super::on_ranks;
    use super::*;
    use ptl_autograd::Device;

    fn param(values: &[f32]) -> Tensor {
        Tensor::from_vec(values.to_vec(), vec![values.len()], Device::Cpu).unwrap().requires_grad_(true).unwrap()
    }

    fn input(rank: usize, k: usize, n: usize) -> Tensor {
        let v: Vec<f32> = (0..n).map(|j| 0.1 + 0.37 * (rank * 7 + k * 3 + j) as f32 % 1.3).collect();
        Tensor::from_vec(v, vec![n], Device::Cpu).unwrap()
    }

    /// p0 (3 values) is read by no rank, p2 (4) by ranks 0 and 2 only; p1, p2, p3, p4 are read in
    /// that order, so backward finishes p4 first. Buckets of 12 bytes from the last parameter:
    /// [p4, p3], [p2], [p1], [p0].
    fn model(rank: usize) -> (Vec<(String, Tensor)>, Tensor) {
        let p: Vec<Tensor> =
            [&[0.5f32, 1.0, 1.5][..], &[0.2, -0.4], &[1.1, 0.9, -0.3, 0.7], &[0.8], &[-0.6, 0.25]].iter().map(|v| param(v)).collect();
        let term = |k: usize| p[k].mul(&input(rank, k, p[k].numel())).unwrap().sum_all().unwrap();
        let mut h = term(1);
        if rank != 1 {
            h = h.mul(&term(2)).unwrap();
        }
        let loss = h.mul(&term(3)).unwrap().mul(&term(4)).unwrap();
        (p.into_iter().enumerate().map(|(i, t)| (format!("p{i}"), t)).collect(), loss)
    }

    /// A transport whose started sums complete only at [`Collective::wait_started`] (as a
    /// device transport's run beside the backward): a sum read before the wait still holds this
    /// rank's own values, and a collective issued while sums are pending is refused.
    struct Deferred {
        inner: ThreadCollective,
        pending: std::sync::Mutex<Vec<Tensor>>,
        /// Sums started so far (shared with the test, which reads it after the transport's use).
        started: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Deferred {
        fn idle(&self) -> Result<()> {
            match self.pending.lock().unwrap().len() {
                0 => Ok(()),
                n => Err(crate::TrainerError::Collective {
                    rank: self.inner.rank(),
                    reason: format!("a collective was issued while {n} started sums were pending"),
                }),
            }
        }
    }

    impl Collective for Deferred {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world(&self) -> usize {
            self.inner.world()
        }
        fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
            self.idle()?;
            self.inner.all_reduce_sum(buf)
        }
        fn all_reduce_max(&self, buf: &mut [u64]) -> Result<()> {
            self.idle()?;
            self.inner.all_reduce_max(buf)
        }
        fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<()> {
            self.idle()?;
            self.inner.all_reduce_sum_tensor(t)
        }
        fn start_all_reduce_sum_tensor(&self, t: &Tensor) -> Result<()> {
            self.started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.pending.lock().unwrap().push(t.clone());
            Ok(())
        }
        fn wait_started(&self) -> Result<()> {
            let pending = std::mem::take(&mut *self.pending.lock().unwrap());
            pending.iter().try_for_each(|t| self.inner.all_reduce_sum_tensor(t))
        }
    }

    fn grads(params: &[(String, Tensor)]) -> Vec<Option<Vec<u32>>> {
        params.iter().map(|(_, t)| t.grad().map(|g| g.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())).collect()
    }

    /// Sums issued during backward (in plan order, as far as each rank's gradients allow), the
    /// rest after it: every rank ends with the bytes of `average_gradients` after a plain
    /// backward, a gradient absent on one rank averaged with zeros there, one absent everywhere
    /// absent, and the ranks' collectives in step (the group fails otherwise).
    #[test]
    fn sums_started_during_backward_give_the_bytes_of_the_average_after_it() {
        let results = on_ranks(3, |c: ThreadCollective| {
            let rank = c.rank();
            let mut dp = DataParallel::with_bucket_bytes(Box::new(c), 12);
            // Reference: a plain backward, then the average.
            let (params, loss) = model(rank);
            loss.backward().unwrap();
            dp.average_gradients(&params).unwrap();
            let reference = grads(&params);
            // Overlapped, on fresh parameters.
            let (params, loss) = model(rank);
            let mut sums = OverlappedSums::new(&mut dp, &params).unwrap();
            loss.backward_with_ready(&loss.ones_like().unwrap(), &mut sums.ready_hook(&dp)).unwrap();
            let during = sums.issued();
            let flag = sums.finish(&mut dp, &params, rank == 2, &[]).unwrap();
            (reference, grads(&params), during, flag)
        });
        for (rank, (reference, overlapped, during, flag)) in results.into_iter().enumerate() {
            assert_eq!(overlapped, reference, "rank {rank}: the average's bytes");
            assert!(overlapped[0].is_none(), "rank {rank}: p0, absent everywhere, stays absent");
            assert!(overlapped[2].is_some(), "rank {rank}: p2, present on two ranks, is present");
            // Ranks 0 and 2 have p4, p3, p2, p1 final during backward (p0's bucket waits); rank 1
            // lacks p2, so only [p4, p3] goes before the end.
            assert_eq!(during, if rank == 1 { 1 } else { 3 }, "rank {rank}: buckets summed during backward");
            assert!(flag, "rank {rank}: rank 2's non-finite window reaches every rank");
        }
    }

    /// Sums that complete only when waited for (a communication stream's) give the same bytes:
    /// the update waits for every started sum before its agreement and before reading them, and
    /// issues no other collective while they are pending (the transport refuses one).
    #[test]
    fn sums_completing_beside_the_backward_are_waited_for_before_use() {
        let results = on_ranks(3, |c: ThreadCollective| {
            let rank = c.rank();
            let started = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let deferred = Deferred { inner: c, pending: Default::default(), started: started.clone() };
            let mut dp = DataParallel::with_bucket_bytes(Box::new(deferred), 12);
            let (params, loss) = model(rank);
            loss.backward().unwrap();
            dp.average_gradients(&params).unwrap();
            let reference = grads(&params);
            assert_eq!(started.load(std::sync::atomic::Ordering::Relaxed), 0, "the plain average starts nothing");
            let (params, loss) = model(rank);
            let mut sums = OverlappedSums::new(&mut dp, &params).unwrap();
            loss.backward_with_ready(&loss.ones_like().unwrap(), &mut sums.ready_hook(&dp)).unwrap();
            sums.finish(&mut dp, &params, false, &[]).unwrap();
            (reference, grads(&params), started.load(std::sync::atomic::Ordering::Relaxed))
        });
        for (rank, (reference, overlapped, started)) in results.into_iter().enumerate() {
            assert_eq!(overlapped, reference, "rank {rank}: the average's bytes");
            assert_eq!(started, 4, "rank {rank}: every bucket's sum was started, none summed at once");
        }
    }
}

//! What the fit loop asks of a data-parallel group: gradients averaged over the ranks, and the
//! few decisions every rank must take alike (stop, recover, which folder rank 0 writes to).

use ptl_autograd::{no_grad, DType, Device, Tensor};

use super::buckets::{BucketPlan, DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
use super::collective::Collective;
use crate::error::{Result, TrainerError};

/// One rank of a data-parallel fit: its collective and the gradient buckets of the model it
/// trains (planned at the first average, from the trainable parameters, the same on every rank).
pub struct DataParallel {
    collective: Box<dyn Collective>,
    plan: Option<(BucketPlan, Vec<usize>)>,
    bucket_bytes: usize,
}

impl DataParallel {
    /// A rank of the group `collective` belongs to.
    pub fn new(collective: Box<dyn Collective>) -> DataParallel {
        DataParallel::with_bucket_bytes(collective, DEFAULT_BUCKET_BYTES)
    }

    /// [`DataParallel::new`] with all-reduce buckets of at most `bucket_bytes` of f32 gradients
    /// (PyTorch DDP's `bucket_cap_mb`; [`DEFAULT_BUCKET_BYTES`] by default), the first one at most
    /// [`DEFAULT_FIRST_BUCKET_BYTES`] (as DDP's).
    pub fn with_bucket_bytes(collective: Box<dyn Collective>, bucket_bytes: usize) -> DataParallel {
        DataParallel { collective, plan: None, bucket_bytes }
    }

    /// This rank (0-based).
    pub fn rank(&self) -> usize {
        self.collective.rank()
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.collective.world()
    }

    /// The most objects any rank's batch has in one image this step (one max all-reduce of
    /// `mine`): the dense criterion pads every rank's targets to that count's bucket, so the ranks
    /// record and replay the same step shape, and a batch beyond the largest bucket on one rank
    /// sends every rank to the host path ([`super::agree_bucket`] over counts rather than buckets).
    pub fn agree_max_boxes(&mut self, mine: usize) -> Result<usize> {
        let mut v = [mine as u64];
        self.collective.all_reduce_max(&mut v)?;
        Ok(usize::try_from(v[0]).unwrap_or(usize::MAX))
    }

    /// Rank 0: the one that validates, writes and prints (Ultralytics' `RANK in {-1, 0}`).
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    /// Averages the gradients of the trainable parameters among `params` (those with
    /// `requires_grad`, in order) over the ranks, in place: [`DataParallel::agree_on_gradients`]
    /// then [`DataParallel::sum_gradients`]. A present gradient keeps its buffer (a recorded
    /// graph may read it there), a gradient absent here but present on another rank counts as
    /// zeros here, one absent everywhere stays absent.
    pub fn average_gradients(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        self.agree_on_gradients(params)?;
        self.sum_gradients(params)
    }

    /// The host half of the average: [`DataParallel::agree_on_update`] with nothing else to agree.
    pub fn agree_on_gradients(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        self.agree_on_update(params, false, &[]).map(|_| ())
    }

    /// The host half of an update, in one max all-reduce: which trainable parameters have a
    /// gradient on any rank (a gradient absent here but present elsewhere becomes zeros here, so
    /// every rank enters [`DataParallel::sum_gradients`] with the same gradients present — the
    /// same buckets, the same collectives), whether any rank's window saw a non-finite loss (the
    /// result), and rank 0's values of `buffers` bit for bit (as [`DataParallel::buffers_from_main`]).
    pub fn agree_on_update(&mut self, params: &[(String, Tensor)], nonfinite_here: bool, buffers: &[Tensor]) -> Result<bool> {
        let trainable = trainable(params);
        self.bucket_plan(&trainable)?;
        let mut v: Vec<u64> = trainable.iter().map(|t| t.grad().is_some() as u64).collect();
        v.push(nonfinite_here as u64);
        let head = v.len();
        self.push_buffer_bits(&mut v, buffers)?;
        self.collective.all_reduce_max(&mut v)?;
        no_grad(|| -> Result<()> {
            for (t, &p) in trainable.iter().zip(&v) {
                if p != 0 && t.grad().is_none() {
                    t.add_to_grad(&Tensor::zeros(t.shape().clone(), t.dtype(), t.device())?)?;
                }
            }
            Ok(())
        })?;
        self.take_buffer_bits(&v[head..], buffers)?;
        Ok(v[head - 1] != 0)
    }

    /// The bucket plan of the trainable parameters `trainable` (made at the first call; an error
    /// when they changed since).
    pub(super) fn bucket_plan(&mut self, trainable: &[&Tensor]) -> Result<BucketPlan> {
        let sizes: Vec<usize> = trainable.iter().map(|t| t.numel()).collect();
        let cap = self.bucket_bytes;
        let (plan, planned) =
            self.plan.get_or_insert_with(|| (BucketPlan::with_first(&sizes, DEFAULT_FIRST_BUCKET_BYTES, cap), sizes.clone()));
        if *planned != sizes {
            return Err(TrainerError::InvalidArgument {
                what: "data-parallel gradients",
                reason: format!("the trainable parameters changed during the fit ({} values, planned for {})", sizes.len(), planned.len()),
            });
        }
        Ok(plan.clone())
    }

    /// The group's transport.
    pub(super) fn collective(&self) -> &dyn Collective {
        self.collective.as_ref()
    }

    /// The device half of the average, after [`DataParallel::agree_on_gradients`]: per bucket
    /// (≤ 25 MiB, from the last parameter) the f32 gradients flattened into one tensor where they
    /// lie (zeros for a parameter whose gradient is absent everywhere: a fixed layout), summed over the ranks by the transport ([`Collective::all_reduce_sum_tensor`]:
    /// NCCL on the device, the CPU group through the host), divided by the world size and copied
    /// back into the gradients' own buffers. No host decision: a recorded region may hold it
    /// (see [`DataParallel::sums_in_regions`]).
    pub fn sum_gradients(&self, params: &[(String, Tensor)]) -> Result<()> {
        let Some((plan, _)) = &self.plan else {
            return Err(TrainerError::InvalidArgument {
                what: "data-parallel gradients",
                reason: "summed before the ranks agreed on which gradients are present".into(),
            });
        };
        let trainable = trainable(params);
        let scale = 1.0 / self.collective.world() as f64;
        no_grad(|| -> Result<()> {
            for bucket in &plan.buckets {
                let grads: Vec<Option<Tensor>> = bucket.params.iter().map(|&i| trainable[i].grad()).collect();
                if grads.iter().all(Option::is_none) {
                    continue;
                }
                // Every parameter of the bucket, zeros where absent everywhere: the layout of the
                // sums started during backward (`OverlappedSums`), so both give the same bytes
                // whatever order the transport sums a buffer's positions in.
                let parts = bucket
                    .params
                    .iter()
                    .zip(&grads)
                    .map(|(&i, g)| match g {
                        Some(g) => g.to_dtype(DType::F32)?.reshape(vec![g.numel()]),
                        None => Tensor::zeros(vec![trainable[i].numel()], DType::F32, trainable[i].device()),
                    })
                    .collect::<ptl_autograd::Result<Vec<_>>>()?;
                let flat = Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?;
                // A recorder's warm-up runs this natively and rolls its writes back: its sum
                // counts for nothing, and leaving it out keeps one collective per call on every
                // rank — also on a rank that records while the others replay.
                if !ptl_autograd::internal::warmup::active() {
                    self.collective.all_reduce_sum_tensor(&flat)?;
                }
                let flat = flat.mul_scalar(scale)?;
                let mut at = 0;
                for (&i, g) in bucket.params.iter().zip(&grads) {
                    if let Some(g) = g {
                        g.copy_(&flat.narrow(0, at, g.numel())?.reshape(g.shape().clone())?.to_dtype(g.dtype())?)?;
                    }
                    at += trainable[i].numel();
                }
            }
            Ok(())
        })
    }

    /// Whether [`DataParallel::sum_gradients`] may run inside a recorded region on `device`: when
    /// the transport sums on the device's stream (NCCL: the all-reduce is recorded into the
    /// graph), or on the CPU, whose recordings run their bodies again at every replay.
    pub fn sums_in_regions(&self, device: Device) -> bool {
        !device.is_cuda() || self.collective.sums_on_device()
    }

    /// Rank 0's values of `buffers` (BatchNorm's running statistics) on every rank, bit for bit —
    /// PyTorch DDP's `broadcast_buffers`: each rank's batch moves its own statistics, rank 0's are
    /// the run's. Sent as bit patterns through a max all-reduce to which the others give zeros.
    pub fn buffers_from_main(&self, buffers: &[Tensor]) -> Result<()> {
        let mut bits = Vec::with_capacity(buffers.iter().map(Tensor::numel).sum());
        self.push_buffer_bits(&mut bits, buffers)?;
        self.collective.all_reduce_max(&mut bits)?;
        self.take_buffer_bits(&bits, buffers)
    }

    /// Appends `buffers`' f32 bit patterns on rank 0, as many zeros elsewhere.
    fn push_buffer_bits(&self, bits: &mut Vec<u64>, buffers: &[Tensor]) -> Result<()> {
        for b in buffers {
            match self.is_main() {
                true => bits.extend(b.to_dtype(DType::F32)?.to_vec::<f32>()?.into_iter().map(|v| v.to_bits() as u64)),
                false => bits.resize(bits.len() + b.numel(), 0),
            }
        }
        Ok(())
    }

    /// Writes the bit patterns rank 0 sent into `buffers` (rank 0 keeps its own).
    fn take_buffer_bits(&self, bits: &[u64], buffers: &[Tensor]) -> Result<()> {
        if self.is_main() {
            return Ok(());
        }
        let mut at = 0;
        no_grad(|| -> Result<()> {
            for b in buffers {
                let values: Vec<f32> = bits[at..at + b.numel()].iter().map(|&v| f32::from_bits(v as u32)).collect();
                at += b.numel();
                b.copy_(&Tensor::from_vec(values, b.shape().clone(), b.device())?.to_dtype(b.dtype())?)?;
            }
            Ok(())
        })
    }

    /// Whether `flag` holds on any rank (every rank gets the same answer).
    pub fn any(&self, flag: bool) -> Result<bool> {
        let mut v = [flag as u64];
        self.collective.all_reduce_max(&mut v)?;
        Ok(v[0] != 0)
    }

    /// Rank 0's `value` on every rank (the others' arguments are ignored).
    pub fn from_main(&self, value: u64) -> Result<u64> {
        let mut v = [if self.is_main() { value } else { 0 }];
        self.collective.all_reduce_max(&mut v)?;
        Ok(v[0])
    }

    /// Rank 0's `bytes` on every rank (the others' arguments are ignored): its run folder, say.
    pub fn bytes_from_main(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        let len = self.from_main(bytes.len() as u64)? as usize;
        let mut v = vec![0u64; len];
        if self.is_main() {
            v.iter_mut().zip(bytes).for_each(|(d, &b)| *d = b as u64);
        }
        self.collective.all_reduce_max(&mut v)?;
        Ok(v.into_iter().map(|b| b as u8).collect())
    }
}

/// The parameters that train (`requires_grad`), in order.
pub(super) fn trainable(params: &[(String, Tensor)]) -> Vec<&Tensor> {
    params.iter().map(|(_, t)| t).filter(|t| t.requires_grad()).collect()
}

#[cfg(test)]
mod tests {
    use super::super::collective::ThreadCollective;
    use super::super::on_ranks;
    use super::*;
    use ptl_autograd::Device;

    fn leaf(values: Vec<f32>) -> Tensor {
        let n = values.len();
        Tensor::from_vec(values, vec![n], Device::Cpu).unwrap().requires_grad_(true).unwrap()
    }

    /// Gradients average into their own buffers; absent ones follow the ranks; frozen parameters
    /// are not exchanged; decisions and bytes from rank 0 reach every rank.
    #[test]
    fn gradients_average_in_place_and_rank_0_decides() {
        let results = on_ranks(2, |c: ThreadCollective| {
            let rank = c.rank() as f32;
            let mut dp = DataParallel::new(Box::new(c));
            let (a, b, frozen) = (leaf(vec![0.0; 2]), leaf(vec![0.0; 3]), leaf(vec![0.0; 1]));
            frozen.set_requires_grad(false).unwrap();
            a.set_grad(Some(Tensor::from_vec(vec![1.0 + rank, 4.0 * rank], vec![2], Device::Cpu).unwrap()));
            if rank == 1.0 {
                b.set_grad(Some(Tensor::from_vec(vec![2.0f32, 4.0, 6.0], vec![3], Device::Cpu).unwrap()));
            }
            let buffer = a.grad().unwrap().storage_ptr();
            let params = vec![("a".to_string(), a.clone()), ("frozen".to_string(), frozen), ("b".to_string(), b.clone())];
            dp.average_gradients(&params).unwrap();
            assert_eq!(a.grad().unwrap().storage_ptr(), buffer, "averaged into the gradient's own buffer");
            let any = (dp.any(rank == 1.0).unwrap(), dp.any(false).unwrap());
            // The update's decisions in one exchange: rank 1's non-finite window reaches rank 0.
            assert!(dp.agree_on_update(&params, rank == 1.0, &[]).unwrap(), "a non-finite window on any rank");
            let stats = Tensor::from_vec(
                match rank == 0.0 {
                    true => vec![-0.0f32, f32::NAN, 1e-40],
                    false => vec![5.0, 2.0, 1e-39],
                },
                vec![3],
                Device::Cpu,
            )
            .unwrap();
            dp.buffers_from_main(std::slice::from_ref(&stats)).unwrap();
            let stats: Vec<u32> = stats.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect();
            let main = dp.from_main(7 + rank as u64).unwrap();
            let folder = dp.bytes_from_main(if dp.is_main() { b"runs/pose/train2" } else { b"other" }).unwrap();
            (a.grad().unwrap().to_vec::<f32>().unwrap(), b.grad().unwrap().to_vec::<f32>().unwrap(), any, main, folder, stats)
        });
        let rank_0_stats: Vec<u32> = [-0.0f32, f32::NAN, 1e-40].iter().map(|v| v.to_bits()).collect();
        for (a, b, any, main, folder, stats) in results {
            assert_eq!(stats, rank_0_stats, "rank 0's buffers bit for bit (a negative zero, a NaN, a subnormal)");
            assert_eq!(a, vec![1.5, 2.0]);
            assert_eq!(b, vec![1.0, 2.0, 3.0], "absent on rank 0: zeros there");
            assert_eq!(any, (true, false));
            assert_eq!(main, 7);
            assert_eq!(folder, b"runs/pose/train2");
        }
    }
}

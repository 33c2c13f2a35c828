//! Gradient all-reduce buckets and the averaging of gradients over the ranks.

use super::collective::Collective;
use crate::error::{Result, TrainerError};

/// PyTorch DDP's default bucket size: 25 MiB of gradients per all-reduce.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// PyTorch DDP's cap on the first bucket: 1 MiB, so that the first all-reduce can start early in
/// backward. YOLO26n-pose's 3.7 M parameters are 14.7 MB of f32 gradients — one bucket of 25 MiB,
/// ready only when backward ends, without it.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1 << 20;

/// One all-reduce: the parameters whose gradients it carries (indices in parameter order, listed
/// in reverse, the order backward produces them) and its length in values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Parameter indices, last parameter first.
    pub params: Vec<usize>,
    /// Values in the bucket (the parameters' sizes summed).
    pub len: usize,
}

/// The parameters grouped into buckets of at most `cap_bytes` of f32 gradients, from the last
/// parameter to the first, so the first bucket is complete first during backward (what overlapping
/// the all-reduce with backward needs); a parameter larger than the cap is a bucket of its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    /// The buckets, in all-reduce order.
    pub buckets: Vec<Bucket>,
}

impl BucketPlan {
    /// The plan for parameters of `sizes` values each (parameter order).
    pub fn new(sizes: &[usize], cap_bytes: usize) -> BucketPlan {
        BucketPlan::with_first(sizes, cap_bytes, cap_bytes)
    }

    /// As [`BucketPlan::new`], the first bucket capped at `first_cap_bytes` (at most `cap_bytes`),
    /// as DDP does.
    pub fn with_first(sizes: &[usize], first_cap_bytes: usize, cap_bytes: usize) -> BucketPlan {
        let cap = (cap_bytes / 4).max(1);
        let first_cap = (first_cap_bytes.min(cap_bytes) / 4).max(1);
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut cur = Bucket { params: Vec::new(), len: 0 };
        for i in (0..sizes.len()).rev() {
            let cap = if buckets.is_empty() { first_cap } else { cap };
            if !cur.params.is_empty() && cur.len + sizes[i] > cap {
                buckets.push(std::mem::replace(&mut cur, Bucket { params: Vec::new(), len: 0 }));
            }
            cur.params.push(i);
            cur.len += sizes[i];
        }
        if !cur.params.is_empty() {
            buckets.push(cur);
        }
        BucketPlan { buckets }
    }
}

/// Averages this rank's gradients with every other rank's: first one all-reduce-max of which
/// parameters have a gradient on any rank, then one all-reduce (sum in rank order) per bucket of
/// the flattened gradients, divided by the world size. A gradient absent on every rank stays
/// absent (the optimizer skips it, as on one GPU); absent on some ranks, it counts as zeros there.
pub fn average_gradients(c: &dyn Collective, plan: &BucketPlan, sizes: &[usize], grads: &mut [Option<Vec<f32>>]) -> Result<()> {
    if grads.len() != sizes.len() {
        return Err(TrainerError::InvalidArgument {
            what: "gradients",
            reason: format!("{} gradients for {} parameters", grads.len(), sizes.len()),
        });
    }
    if let Some((i, g)) = grads.iter().enumerate().find_map(|(i, g)| g.as_ref().filter(|g| g.len() != sizes[i]).map(|g| (i, g))) {
        return Err(TrainerError::ShapeMismatch { what: "gradient", shape: format!("parameter {i}"), expected: sizes[i], got: g.len() });
    }
    let mut present: Vec<u64> = grads.iter().map(|g| g.is_some() as u64).collect();
    c.all_reduce_max(&mut present)?;
    let scale = 1.0 / c.world() as f32;
    for bucket in &plan.buckets {
        let mut flat = Vec::with_capacity(bucket.len);
        for &i in &bucket.params {
            match &grads[i] {
                Some(g) => flat.extend_from_slice(g),
                None => flat.resize(flat.len() + sizes[i], 0.0),
            }
        }
        c.all_reduce_sum(&mut flat)?;
        let mut at = 0;
        for &i in &bucket.params {
            let avg: Vec<f32> = flat[at..at + sizes[i]].iter().map(|v| v * scale).collect();
            at += sizes[i];
            grads[i] = (present[i] != 0).then_some(avg);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::collective::ThreadGroup;
    use super::super::on_ranks;
    use super::*;

    #[test]
    fn the_first_bucket_is_capped_apart() {
        // Caps of 4 values first, then 8, from the last parameter: (1, 2) | (3, 4) | (4, 1).
        let plan = BucketPlan::with_first(&[1, 4, 4, 3, 2, 1], 16, 32);
        let got: Vec<Vec<usize>> = plan.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(got, vec![vec![5, 4], vec![3, 2], vec![1, 0]]);
        assert_eq!(plan.buckets.iter().map(|b| b.len).collect::<Vec<_>>(), vec![3, 7, 5]);
        // A first cap above the others counts as the others'.
        assert_eq!(BucketPlan::with_first(&[1, 4, 4, 3, 2, 1], 64, 32), BucketPlan::new(&[1, 4, 4, 3, 2, 1], 32));
        // YOLO26n-pose's gradients: a 1 MiB bucket, then the rest in one.
        let sizes = [3_679_464 - 200_000, 200_000];
        let plan = BucketPlan::with_first(&sizes, DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES);
        assert_eq!(plan.buckets.len(), 2);
    }

    #[test]
    fn buckets_run_from_the_last_parameter_and_hold_at_most_the_cap() {
        // Caps in values: 16 bytes = 4 values.
        let plan = BucketPlan::new(&[3, 1, 2, 6, 1], 16);
        let params: Vec<Vec<usize>> = plan.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![vec![4], vec![3], vec![2, 1], vec![0]], "a 6-value parameter is a bucket of its own");
        assert_eq!(plan.buckets.iter().map(|b| b.len).sum::<usize>(), 13);
        let mut seen: Vec<usize> = params.concat();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2, 3, 4], "every parameter exactly once");
        assert_eq!(BucketPlan::new(&[], DEFAULT_BUCKET_BYTES).buckets, vec![]);
    }

    #[test]
    fn gradients_average_and_absent_ones_follow_the_ranks() {
        let sizes = vec![2, 1, 3];
        let plan = BucketPlan::new(&sizes, 8);
        let results = on_ranks(2, move |c| {
            let r = c.rank() as f32;
            // Parameter 1 has no gradient anywhere; parameter 2 only on rank 1.
            let mut grads = vec![Some(vec![1.0 + r, 2.0 * r]), None, (r == 1.0).then(|| vec![4.0, 6.0, 8.0])];
            average_gradients(&c, &plan, &sizes, &mut grads).unwrap();
            grads
        });
        for grads in results {
            assert_eq!(grads[0], Some(vec![1.5, 1.0]));
            assert_eq!(grads[1], None, "absent on every rank stays absent");
            assert_eq!(grads[2], Some(vec![2.0, 3.0, 4.0]), "absent on one rank counts as zeros there");
        }
    }

    #[test]
    fn a_gradient_of_the_wrong_size_is_refused_before_any_exchange() {
        let c = ThreadGroup::new(1).unwrap().remove(0);
        let plan = BucketPlan::new(&[2], DEFAULT_BUCKET_BYTES);
        let e = average_gradients(&c, &plan, &[2], &mut [Some(vec![1.0])]).unwrap_err().to_string();
        assert!(e.contains("expected 2"), "{e}");
    }
}

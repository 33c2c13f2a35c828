//! Agreement on a step's target bucket, and a log of the collectives a rank issued.
//!
//! A replayed step is recorded per target bucket (the padded number of targets per image). Every
//! rank must issue the same collectives in the same order — a graph recorded for one bucket on one
//! rank and another bucket on another would hang or mix buffers — so before a step records or
//! replays, the ranks agree on one bucket: the largest any of them needs.

use std::sync::Mutex;

use super::collective::Collective;
use crate::error::Result;

/// The target bucket every rank uses this step: the largest of the ranks' own (`mine`).
pub fn agree_bucket(c: &dyn Collective, mine: usize) -> Result<usize> {
    let mut v = [mine as u64];
    c.all_reduce_max(&mut v)?;
    Ok(v[0] as usize)
}

/// One collective as issued: which operation and how many values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Issued {
    /// A sum all-reduce of this many values.
    Sum(usize),
    /// A max all-reduce of this many values.
    Max(usize),
}

/// A [`Collective`] that records what its rank issued, for tests that every rank issues the same
/// sequence.
pub struct LoggedCollective<C: Collective> {
    inner: C,
    log: Mutex<Vec<Issued>>,
}

impl<C: Collective> LoggedCollective<C> {
    /// Wraps `inner`.
    pub fn new(inner: C) -> Self {
        LoggedCollective { inner, log: Mutex::new(Vec::new()) }
    }

    /// What this rank issued so far, in order.
    pub fn issued(&self) -> Vec<Issued> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    fn note(&self, op: Issued) {
        if let Ok(mut l) = self.log.lock() {
            l.push(op);
        }
    }
}

impl<C: Collective> Collective for LoggedCollective<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.note(Issued::Sum(buf.len()));
        self.inner.all_reduce_sum(buf)
    }

    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<()> {
        self.note(Issued::Max(buf.len()));
        self.inner.all_reduce_max(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::super::buckets::{average_gradients, BucketPlan};
    use super::super::on_ranks;
    use super::*;

    /// Ranks whose batches need different buckets agree on the largest, and then issue identical
    /// sequences of collectives (the agreement, the presence max, one sum per gradient bucket).
    #[test]
    fn ranks_with_different_buckets_issue_the_same_collectives() {
        let sizes = vec![5, 3, 8];
        let plan = BucketPlan::new(&sizes, 32);
        let per_step = 2 + plan.buckets.len();
        let results = on_ranks(3, move |c| {
            let c = LoggedCollective::new(c);
            let mut agreed = Vec::new();
            for step in 0..3 {
                // Rank r's own bucket this step.
                let mine = [8, 16, 8][(c.rank() + step) % 3];
                agreed.push(agree_bucket(&c, mine).unwrap());
                let mut grads: Vec<Option<Vec<f32>>> = sizes.iter().map(|&n| (c.rank() != 1).then(|| vec![1.0; n])).collect();
                average_gradients(&c, &plan, &sizes, &mut grads).unwrap();
            }
            (agreed, c.issued())
        });
        for (agreed, issued) in &results {
            assert_eq!(agreed, &vec![16, 16, 16], "every step takes the largest bucket any rank needs");
            assert_eq!(issued, &results[0].1, "the same collectives in the same order on every rank");
        }
        assert_eq!(results[0].1.len(), 3 * per_step);
        assert_eq!(results[0].1[..2], [Issued::Max(1), Issued::Max(3)]);
    }
}

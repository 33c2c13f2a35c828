//! The global batch and each epoch's sample order, split over the ranks.

use crate::error::{Result, TrainerError};

/// Each rank's batch for a global `batch` over `world` ranks: floored, as Ultralytics does
/// (`batch // world_size`); a global batch smaller than the world is an error naming the smallest
/// batch that splits.
pub fn per_rank_batch(batch: usize, world: usize) -> Result<usize> {
    if world == 0 {
        return Err(TrainerError::InvalidArgument { what: "world size", reason: "at least one rank is needed".into() });
    }
    match batch / world {
        0 => Err(TrainerError::InvalidArgument {
            what: "batch",
            reason: format!("batch={batch} is the global batch and cannot be split over {world} GPUs; give batch={world} or more"),
        }),
        b => Ok(b),
    }
}

/// Rank `rank`'s share of one epoch's `order` (the same on every rank, drawn from the run's seed):
/// the order padded to a multiple of `world` by repeating its head, then every `world`-th sample
/// from position `rank` — PyTorch's `DistributedSampler`; the loader's [`ptl_data::Shard`] rule.
pub fn shard_order(order: &[usize], rank: usize, world: usize) -> Vec<usize> {
    ptl_data::Shard { rank, world }.of(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_global_batch_is_floored_per_rank_and_too_small_a_batch_names_the_fix() {
        assert_eq!(per_rank_batch(16, 2).unwrap(), 8);
        assert_eq!(per_rank_batch(17, 4).unwrap(), 4);
        let e = per_rank_batch(1, 2).unwrap_err().to_string();
        assert!(e.contains("batch=2 or more"), "{e}");
        assert!(per_rank_batch(8, 0).is_err());
    }

    #[test]
    fn shards_cover_the_epoch_with_equal_counts_padding_from_the_head() {
        let order: Vec<usize> = vec![4, 0, 3, 1, 2];
        let shards: Vec<Vec<usize>> = (0..2).map(|r| shard_order(&order, r, 2)).collect();
        assert_eq!(shards[0], vec![4, 3, 2]);
        assert_eq!(shards[1], vec![0, 1, 4], "padded with the order's first sample");
        let mut all: Vec<usize> = shards.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all, vec![0, 1, 2, 3, 4]);
        assert_eq!(shard_order(&order, 0, 1), order, "one rank takes the epoch as it is");
        assert!(shard_order(&order, 2, 2).is_empty());
    }
}

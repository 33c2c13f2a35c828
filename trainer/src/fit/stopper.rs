//! Early stopping on the validation fitness (docs/training.md §9, Ultralytics' `EarlyStopping`).

use serde::{Deserialize, Serialize};

/// Records the best fitness and its 1-based epoch; training stops once `patience` epochs have
/// passed without a better one. A best of 0 (nothing detected yet) keeps moving the best epoch,
/// as in the reference, so a run that has not started to learn is not stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EarlyStopping {
    /// Best fitness so far.
    pub best_fitness: f64,
    /// Epoch (1-based) of the best fitness.
    pub best_epoch: usize,
}

impl EarlyStopping {
    /// Books epoch `epoch` (1-based) with `fitness`; whether training should stop now.
    /// `patience` 0 disables stopping (Ultralytics: `patience or inf`).
    pub fn update(&mut self, epoch: usize, fitness: f64, patience: usize) -> bool {
        if fitness > self.best_fitness || self.best_fitness == 0.0 {
            self.best_epoch = epoch;
            self.best_fitness = fitness;
        }
        patience > 0 && epoch.saturating_sub(self.best_epoch) >= patience
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_after_patience_epochs_without_a_better_fitness() {
        let mut s = EarlyStopping::default();
        // Zero fitness keeps moving the best epoch: no stop while nothing is detected.
        assert!(!s.update(1, 0.0, 2) && !s.update(2, 0.0, 2) && !s.update(3, 0.0, 2));
        assert!(!s.update(4, 0.3, 2), "a first real fitness");
        assert!(!s.update(5, 0.2, 2), "1 epoch without a better one");
        assert!(s.update(6, 0.3, 2), "equal is not better: 2 epochs, stop");
        let mut t = EarlyStopping::default();
        assert!(!t.update(1, 0.5, 0) && !t.update(50, 0.1, 0), "patience 0: never");
        assert_eq!((t.best_epoch, t.best_fitness), (1, 0.5));
    }
}

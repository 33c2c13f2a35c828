//! Whether this thread runs a recorder's warm-up: real execution right before a capture whose
//! writes are rolled back (the write journal), so that nothing it computes counts. Work that must
//! happen the same number of times on several processes — a collective over the ranks of a
//! data-parallel group — is left out there: a rank that records a region while the others replay
//! it then still issues one collective per call, as they do.

use std::cell::Cell;

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether a recorder's warm-up runs on this thread now.
pub fn active() -> bool {
    DEPTH.with(|d| d.get() > 0)
}

/// Marks the rest of the scope as a recorder's warm-up on this thread (nests).
#[must_use = "the mark holds only while the guard lives"]
pub struct WarmupGuard(());

impl WarmupGuard {
    /// Marks this thread until the guard drops.
    pub fn new() -> WarmupGuard {
        DEPTH.with(|d| d.set(d.get() + 1));
        WarmupGuard(())
    }
}

impl Default for WarmupGuard {
    fn default() -> Self {
        WarmupGuard::new()
    }
}

impl Drop for WarmupGuard {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_nests_and_ends_with_its_guard() {
        assert!(!active());
        {
            let _a = WarmupGuard::new();
            assert!(active());
            {
                let _b = WarmupGuard::new();
                assert!(active());
            }
            assert!(active(), "the outer guard still holds");
            let other = std::thread::spawn(active).join().unwrap();
            assert!(!other, "another thread is not in this warm-up");
        }
        assert!(!active());
    }
}

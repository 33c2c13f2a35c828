//! Stage tags: which part of a training step (upload, model forward, loss, optimizer, …) the work
//! on this thread belongs to, for GPU-time breakdowns. A tag is a small number the caller names
//! ([`StageGuard`] sets it for a scope); tape nodes remember the tag they were created under, and
//! the engine runs each node's backward under `tag | BACKWARD_OF`, so "the model's backward" and
//! "the loss's backward" can be told apart although both run inside one `backward()` call.
//! Tags never change what is computed; while a detailed CUDA kernel trace runs they label its
//! kernels (CUPTI external correlation), otherwise setting one costs a thread-local write.

use std::cell::Cell;

/// Set on the tag of work done by the backward of nodes created under the tag without it.
pub const BACKWARD_OF: u8 = 0x80;

thread_local! {
    static STAGE: Cell<u8> = const { Cell::new(0) };
}

/// The tag work on this thread runs under now (0: none).
pub fn current() -> u8 {
    STAGE.with(|s| s.get())
}

fn set(tag: u8) -> u8 {
    let prev = STAGE.with(|s| s.replace(tag));
    if prev != tag {
        #[cfg(feature = "cuda")]
        crate::cuda::stage_changed(tag);
    }
    prev
}

/// Restores the previous tag when dropped.
#[must_use = "the tag holds only while the guard lives"]
pub struct StageGuard(u8);

impl StageGuard {
    /// Runs the rest of the scope under `tag` on this thread.
    pub fn new(tag: u8) -> StageGuard {
        StageGuard(set(tag))
    }
}

impl Drop for StageGuard {
    fn drop(&mut self) {
        set(self.0);
    }
}

/// Labels this thread's CUDA launches with a name (a backward node's) while a detailed kernel
/// trace runs, for the trace file; restores the previous label when dropped. Costs a relaxed load
/// otherwise.
#[must_use = "the label holds only while the guard lives"]
pub struct LabelGuard(#[cfg_attr(not(feature = "cuda"), allow(dead_code))] u32);

impl LabelGuard {
    /// Labels the rest of the scope with `name`.
    pub fn new(name: &str) -> LabelGuard {
        #[cfg(feature = "cuda")]
        return LabelGuard(crate::cuda::set_label(name));
        #[cfg(not(feature = "cuda"))]
        {
            let _ = name;
            LabelGuard(0)
        }
    }
}

impl Drop for LabelGuard {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        crate::cuda::restore_label(self.0);
    }
}

/// Runs `f` under `tag`.
pub fn in_stage<R>(tag: u8, f: impl FnOnce() -> R) -> R {
    let _g = StageGuard::new(tag);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_nest_and_restore() {
        assert_eq!(current(), 0);
        {
            let _a = StageGuard::new(2);
            assert_eq!(current(), 2);
            in_stage(3, || assert_eq!(current(), 3));
            assert_eq!(current(), 2);
        }
        assert_eq!(current(), 0);
    }
}

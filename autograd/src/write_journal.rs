//! A journal of in-place writes. While one is open on this thread, the first write to each storage
//! that existed before it opened is preceded by a copy of that storage's bytes, and
//! [`WriteJournal::restore`] copies them back (in place: the storage keeps its address).
//!
//! Why: a recorder's warmup is real execution (docs/capture.md §2.3). It updates BatchNorm statistics
//! and — for a region that contains an optimizer step — parameters, optimizer moments, EMA shadows
//! and scaler state. Rule 2.1 asks for the whole write-set to be rolled back; the journal finds it
//! by watching writes, so a region does not have to name what it writes. Storages created while
//! the journal is open (temporaries, fresh gradients) are not copied. Every in-place write of
//! `ptl-autograd` goes through one lock (`Tensor::write_storage`), which is where it is noted;
//! a kernel writing through a raw device address (`cuda::UserKernel`) is not seen.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::sync::{Arc, RwLock};

use crate::shape::Layout;
use crate::storage::Storage;
use crate::{Error, Result};

/// One open journal: what it saw created, what it saved (pre-write copies, first write first).
#[derive(Default)]
struct Open {
    fresh: HashSet<usize>,
    saved_at: HashSet<usize>,
    saved: Vec<(Arc<RwLock<Storage>>, Storage)>,
    error: Option<Error>,
}

thread_local! {
    static OPEN: RefCell<Vec<Open>> = const { RefCell::new(Vec::new()) };
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
}

fn key(s: &Arc<RwLock<Storage>>) -> usize {
    Arc::as_ptr(s) as *const () as usize
}

/// Notes a storage created while a journal is open (it needs no copy).
pub(crate) fn note_created(s: &Arc<RwLock<Storage>>) {
    if !ACTIVE.with(Cell::get) {
        return;
    }
    OPEN.with(|o| {
        for j in o.borrow_mut().iter_mut() {
            j.fresh.insert(key(s));
        }
    });
}

/// Runs `f` with the warm-up's allocation trace paused (CUDA builds).
fn unmeasured<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::capture_support::unmeasured(f)
    }
    #[cfg(not(feature = "cuda"))]
    {
        f()
    }
}

/// Called before a write lock on `s` is taken: copies `s` for every open journal that has not
/// yet saved it and did not see it created.
pub(crate) fn before_write(s: &Arc<RwLock<Storage>>) {
    if !ACTIVE.with(Cell::get) {
        return;
    }
    OPEN.with(|o| {
        let k = key(s);
        for j in o.borrow_mut().iter_mut() {
            if j.fresh.contains(&k) || !j.saved_at.insert(k) {
                continue;
            }
            // The copy is the recorder's bookkeeping, not the region's work: a warm-up's
            // allocation trace (which lays out the arena) leaves it out.
            match unmeasured(|| s.read().unwrap_or_else(|e| e.into_inner()).try_clone()) {
                Ok(c) => j.saved.push((s.clone(), c)),
                Err(e) => {
                    j.error.get_or_insert(Error::InPlace {
                        what: "write journal".into(),
                        msg: format!("could not copy a storage before its write: {e}"),
                    });
                }
            }
        }
    });
}

/// The pre-write copies of the storages written while a journal was open.
pub struct WriteJournal {
    saved: Vec<(Arc<RwLock<Storage>>, Storage)>,
}

impl WriteJournal {
    /// How many storages were written (and saved).
    pub fn len(&self) -> usize {
        self.saved.len()
    }
    /// Whether nothing was journaled.
    pub fn is_empty(&self) -> bool {
        self.saved.is_empty()
    }
    /// Bytes held by the copies.
    pub fn bytes(&self) -> usize {
        self.saved.iter().map(|(_, c)| c.len() * c.dtype().size_in_bytes()).sum()
    }
    /// Copies every saved storage back, bitwise and in place (addresses unchanged).
    pub fn restore(self) -> Result<()> {
        for (s, copy) in self.saved.iter().rev() {
            let lay = Layout::contiguous(&[copy.len()]);
            let mut dst = s.write().unwrap_or_else(|e| e.into_inner());
            copy.copy_strided(&lay, &mut dst, &lay)?;
        }
        Ok(())
    }
}

/// Runs `f` with a journal open on this thread (journals nest: each saves what it needs) and
/// returns `f`'s result with the journal. A copy that could not be made (device memory) is an
/// error: the write-set could not be kept.
pub fn journal_writes<R>(f: impl FnOnce() -> R) -> Result<(R, WriteJournal)> {
    /// Closes this journal if `f` unwinds, so the thread is not left journaling.
    struct CloseOnUnwind;
    impl Drop for CloseOnUnwind {
        fn drop(&mut self) {
            close();
        }
    }
    OPEN.with(|o| o.borrow_mut().push(Open::default()));
    ACTIVE.with(|a| a.set(true));
    let guard = CloseOnUnwind;
    let r = f();
    std::mem::forget(guard);
    let open = close();
    if let Some(e) = open.error {
        return Err(e);
    }
    Ok((r, WriteJournal { saved: open.saved }))
}

/// Pops the innermost journal.
fn close() -> Open {
    OPEN.with(|o| {
        let mut v = o.borrow_mut();
        let j = v.pop().unwrap_or_default();
        ACTIVE.with(|a| a.set(!v.is_empty()));
        j
    })
}

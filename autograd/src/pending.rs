//! Host reads that complete later, and a count of the reads that wait.
//!
//! A training step that reads its loss back right away drains the GPU: the host waits for every
//! kernel queued before the read. [`Tensor::read_later`] queues the copy instead (pinned host
//! memory and an event on CUDA) and hands back a [`PendingRead`] that the caller polls a step or
//! more later, when the copy is long done. On the CPU the values are there at once.
//!
//! [`host_reads`] counts, on every backend, the reads that return data to the host right away
//! (`to_vec`, `to_f64_vec`, `item`, `to_bytes`) and the deferred ones apart, so a test on the CPU
//! can prove that a steady-state step reads nothing back synchronously.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::HostRead;
use crate::{DType, Result, Tensor};

static READS: AtomicU64 = AtomicU64::new(0);
static DEFERRED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's counts (tests running side by side in one process see only their own).
    static THREAD: std::cell::Cell<HostReads> = const { std::cell::Cell::new(HostReads { immediate: 0, deferred: 0 }) };
}

/// Process-wide counts of host reads of tensor data (all devices, all threads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostReads {
    /// Reads that returned the data at once (each one waits for the device on a GPU).
    pub immediate: u64,
    /// Reads queued with [`Tensor::read_later`].
    pub deferred: u64,
}

impl HostReads {
    /// Counts since `earlier`.
    pub fn since(&self, earlier: &HostReads) -> HostReads {
        HostReads { immediate: self.immediate.saturating_sub(earlier.immediate), deferred: self.deferred.saturating_sub(earlier.deferred) }
    }
}

/// The current counts.
pub fn host_reads() -> HostReads {
    HostReads { immediate: READS.load(Ordering::Relaxed), deferred: DEFERRED.load(Ordering::Relaxed) }
}

/// The current counts of the calling thread's reads.
pub fn host_reads_on_this_thread() -> HostReads {
    THREAD.with(|t| t.get())
}

pub(crate) fn count_immediate_read() {
    READS.fetch_add(1, Ordering::Relaxed);
    THREAD.with(|t| t.set(HostReads { immediate: t.get().immediate + 1, ..t.get() }));
}

fn count_deferred_read() {
    DEFERRED.fetch_add(1, Ordering::Relaxed);
    THREAD.with(|t| t.set(HostReads { deferred: t.get().deferred + 1, ..t.get() }));
}

/// The f32 values of a tensor on their way to the host (see the module doc).
#[derive(Debug)]
pub struct PendingRead {
    inner: Box<dyn HostRead>,
}

impl Tensor {
    /// Queues a copy of this tensor's values (as f32) to the host and returns at once: no
    /// synchronisation. Meant for a few values per step (loss items).
    pub fn read_later(&self) -> Result<PendingRead> {
        // The copy is read as it lies: f32 in the logical order.
        let t = crate::no_grad(|| self.to_dtype(DType::F32)?.to_memory_format(crate::MemoryFormat::Contiguous))?;
        count_deferred_read();
        let inner = t.with_storage(|s| s.read_later())?;
        Ok(PendingRead { inner })
    }
}

impl PendingRead {
    /// The values if the copy has finished (a non-blocking query), else `None`.
    pub fn poll(&mut self) -> Result<Option<Vec<f32>>> {
        Ok(if self.inner.poll()? { Some(self.inner.values()) } else { None })
    }

    /// The values, waiting for the copy if it has not finished (counted as a host sync then).
    pub fn wait(mut self) -> Result<Vec<f32>> {
        self.inner.wait()?;
        Ok(self.inner.values())
    }
}

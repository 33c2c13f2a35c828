//! The GPU transport of a data-parallel group: one NCCL communicator per rank, whose identifier
//! travels through the rendezvous store, watched by a thread that aborts it when a collective
//! does not complete in time or NCCL reports an asynchronous error.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ptl_autograd::cuda::{NcclComm, NcclId};
use ptl_autograd::{Device, Tensor};

use super::collective::Collective;
use super::launch::WorkerEnv;
use super::store::{store_get, store_set, StoreServer};
use crate::error::{Result, TrainerError};

/// The store key under which rank 0 leaves the communicator's identifier.
const ID_KEY: &str = "ptl-nccl-unique-id";

/// How often the watchdog looks.
const WATCH_EVERY: Duration = Duration::from_millis(500);

/// What the fit's thread and the watchdog share.
struct Watched {
    comm: NcclComm,
    /// Milliseconds since `epoch` at which the collective in flight began (0: none in flight).
    began_ms: AtomicU64,
    epoch: Instant,
    /// Set by the watchdog when it aborted the communicator, with why.
    aborted: std::sync::Mutex<Option<String>>,
    stop: AtomicBool,
}

/// One rank's NCCL communicator as a [`Collective`].
pub struct NcclCollective {
    watched: Arc<Watched>,
    device: Device,
    watchdog: Option<std::thread::JoinHandle<()>>,
    /// The rendezvous store when this rank serves it (rank 0 outside ptl's launcher), kept while
    /// the group lives.
    _store: Option<StoreServer>,
}

impl NcclCollective {
    /// Joins the group `env` describes on `device`: rank 0 makes the identifier and leaves it in
    /// the store (serving the store itself when no launcher does), the others wait up to
    /// `timeout` for it; then every rank joins the communicator. A collective that has not
    /// completed after `timeout` aborts the communicator (NCCL's kernels spin rather than fail
    /// when a peer dies), and so does an asynchronous error NCCL reports.
    pub fn join(device: Device, env: &WorkerEnv, timeout: Duration) -> Result<NcclCollective> {
        let (addr, serve) = env.store_addr()?;
        let store = match serve {
            true => Some(StoreServer::serve(&addr)?),
            false => None,
        };
        let id = match env.rank {
            0 => {
                let id = NcclId::new()?;
                store_set(&addr, ID_KEY, &id.0, timeout)?;
                id
            }
            _ => {
                let bytes = store_get(&addr, ID_KEY, timeout)?;
                NcclId(bytes.as_slice().try_into().map_err(|_| TrainerError::Collective {
                    rank: env.rank,
                    reason: format!("the store at {addr} holds a {}-byte NCCL identifier, not 128 bytes", bytes.len()),
                })?)
            }
        };
        let comm = NcclComm::init(device, env.world, env.rank, &id, timeout)?;
        let watched = Arc::new(Watched {
            comm,
            began_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            aborted: std::sync::Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let w = watched.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("ptl-nccl-watchdog-{}", env.rank))
            .spawn(move || watch(&w, timeout))
            .map_err(|e| TrainerError::Collective { rank: env.rank, reason: format!("cannot start the watchdog thread: {e}") })?;
        Ok(NcclCollective { watched, device, watchdog: Some(watchdog), _store: store })
    }

    /// A group of this process alone (rank 0 of 1) on `device`, with its own store on a free local
    /// port: the data-parallel loop on one GPU through real NCCL collectives (the CUDA tests check
    /// it trains the plain fit's bytes).
    pub fn alone(device: Device, timeout: Duration) -> Result<NcclCollective> {
        let server = StoreServer::serve("127.0.0.1:0")?;
        let addr = server.addr().to_string();
        let env = WorkerEnv { rank: 0, world: 1, local_rank: 0, master: addr.clone(), store: Some(addr), under_torchrun: false };
        let mut group = Self::join(device, &env, timeout)?;
        group._store = Some(server);
        Ok(group)
    }

    /// Runs one collective under the watchdog's eye; after an abort, the error says why.
    fn watched<R>(&self, f: impl FnOnce(&NcclComm) -> ptl_autograd::Result<R>) -> Result<R> {
        self.open_window();
        let r = f(&self.watched.comm);
        self.close_window(r)
    }

    /// The watchdog's window opens, unless started sums keep it open already (its age counts
    /// from the first of them).
    fn open_window(&self) {
        let w = &self.watched;
        let now = (w.epoch.elapsed().as_millis() as u64).max(1);
        let _ = w.began_ms.compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The window closes with `r`; after an abort, the error says why.
    fn close_window<R>(&self, r: ptl_autograd::Result<R>) -> Result<R> {
        let w = &self.watched;
        w.began_ms.store(0, Ordering::Release);
        let aborted = w.aborted.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match (r, aborted) {
            (_, Some(why)) => Err(TrainerError::Collective { rank: w.comm.rank(), reason: why }),
            (r, None) => Ok(r?),
        }
    }
}

/// The watchdog: aborts the communicator when NCCL reports an asynchronous error or when the
/// collective in flight began more than `timeout` ago.
fn watch(w: &Watched, timeout: Duration) {
    while !w.stop.load(Ordering::Acquire) {
        std::thread::sleep(WATCH_EVERY);
        let began = w.began_ms.load(Ordering::Acquire);
        let late = began != 0 && w.epoch.elapsed().as_millis() as u64 > began + timeout.as_millis() as u64;
        let why = match (w.comm.async_error(), late) {
            (Err(e), _) => Some(format!("NCCL reported an error while the ranks trained ({e}); communicator aborted")),
            (Ok(()), true) => Some(format!(
                "a collective did not complete within {:.0} s (another rank has likely died); communicator aborted",
                timeout.as_secs_f64()
            )),
            _ => None,
        };
        if let Some(why) = why {
            log::error!("ptl: rank {}: {why}", w.comm.rank());
            *w.aborted.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
            w.comm.abort();
            return;
        }
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        self.watched.stop.store(true, Ordering::Release);
        if let Some(h) = self.watchdog.take() {
            let _ = h.join();
        }
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.watched.comm.rank()
    }

    fn world(&self) -> usize {
        self.watched.comm.world()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let t = Tensor::from_vec(buf.to_vec(), vec![buf.len()], self.device)?;
        let summed = self.watched(|comm| {
            comm.all_reduce_sum(&t)?;
            t.to_vec::<f32>()
        })?;
        buf.copy_from_slice(&summed);
        Ok(())
    }

    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<()> {
        self.watched(|comm| comm.all_reduce_max(buf))
    }

    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<()> {
        // The wait for the device is inside the watchdog's window: a collective that a dead peer
        // never joins spins there. Inside a capture there is no wait: the all-reduce is recorded
        // and runs with its graph.
        self.watched(|comm| comm.all_reduce_sum_waited(t))
    }

    fn start_all_reduce_sum_tensor(&self, t: &Tensor) -> Result<()> {
        // The window opens with the first sum started and closes when they have been waited for.
        self.open_window();
        match self.watched.comm.all_reduce_sum_beside(t) {
            Ok(()) => Ok(()),
            Err(e) => self.close_window(Err(e)),
        }
    }

    fn wait_started(&self) -> Result<()> {
        let r = self.watched.comm.join_beside();
        self.close_window(r)
    }

    fn sums_on_device(&self) -> bool {
        true
    }
}

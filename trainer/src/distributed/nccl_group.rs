//! The GPU transport of a data-parallel group: one NCCL communicator per rank, whose identifier
//! travels through the rendezvous store.

use std::time::Duration;

use ptl_autograd::cuda::{NcclComm, NcclId};
use ptl_autograd::{Device, Tensor};

use super::collective::Collective;
use super::launch::WorkerEnv;
use super::store::{store_get, store_set, StoreServer};
use crate::error::{Result, TrainerError};

/// The store key under which rank 0 leaves the communicator's identifier.
const ID_KEY: &str = "ptl-nccl-unique-id";

/// One rank's NCCL communicator as a [`Collective`].
pub struct NcclCollective {
    comm: NcclComm,
    device: Device,
    /// The rendezvous store when this rank serves it (rank 0 outside ptl's launcher), kept while
    /// the group lives.
    _store: Option<StoreServer>,
}

impl NcclCollective {
    /// Joins the group `env` describes on `device`: rank 0 makes the identifier and leaves it in
    /// the store (serving the store itself when no launcher does), the others wait up to
    /// `timeout` for it; then every rank joins the communicator.
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
        let comm = NcclComm::init(device, env.world, env.rank, &id)?;
        Ok(NcclCollective { comm, device, _store: store })
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let t = Tensor::from_vec(buf.to_vec(), vec![buf.len()], self.device)?;
        self.comm.all_reduce_sum(&t)?;
        buf.copy_from_slice(&t.to_vec::<f32>()?);
        Ok(())
    }

    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<()> {
        Ok(self.comm.all_reduce_max(buf)?)
    }
}

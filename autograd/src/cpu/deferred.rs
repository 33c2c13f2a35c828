//! Deferred reads on the CPU: the values are there at once.

use super::CpuStorage;
use crate::backend::{DeferredReadStorage, HostRead};
use crate::Result;

/// Values already on the host.
#[derive(Debug)]
struct Ready(Vec<f32>);

impl HostRead for Ready {
    fn poll(&mut self) -> Result<bool> {
        Ok(true)
    }
    fn wait(&mut self) -> Result<()> {
        Ok(())
    }
    fn values(&self) -> Vec<f32> {
        self.0.clone()
    }
}

impl DeferredReadStorage for CpuStorage {
    fn read_later(&self) -> Result<Box<dyn HostRead>> {
        Ok(Box::new(Ready(self.to_f64_vec().into_iter().map(|v| v as f32).collect())))
    }
}

//! A device buffer with its element type (what a CUDA tensor holds): allocation, uploads,
//! downloads and copies. The backend contract's ops on it live in the parent module.

use std::sync::Arc;

use cudarc::driver::result as dr;

use super::alloc::DevBuf;
use super::device::{cu_err, dev_of, Dev};
use super::{capture_scope, counters};
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::{DType, Device, Error, Result};

/// A device buffer with its element type. Contiguous; `len` elements.
pub struct CudaStorage {
    pub(crate) buf: DevBuf,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({}, {} x {})", self.device(), self.len, self.dtype)
    }
}

impl CudaStorage {
    pub(crate) fn alloc(dev: &Arc<Dev>, dtype: DType, len: usize) -> Result<CudaStorage> {
        Ok(CudaStorage { buf: DevBuf::alloc(dev, len * dtype.size_in_bytes())?, dtype, len })
    }

    /// An unfilled buffer (poisoned when [`set_poison_allocations`] is on).
    pub(crate) fn uninit(device: Device, dtype: DType, len: usize) -> Result<CudaStorage> {
        CudaStorage::alloc(&dev_of(device)?, dtype, len)
    }

    pub(crate) fn same_device(&self, op: &'static str, other: &CudaStorage) -> Result<()> {
        if self.buf.dev.ordinal != other.buf.dev.ordinal {
            return Err(Error::DeviceMismatch { op, lhs: self.device(), rhs: other.device() });
        }
        Ok(())
    }

    /// Uploads a host buffer (an explicit host→device copy, queued on the compute stream).
    pub(crate) fn from_cpu(s: &CpuStorage, device: Device) -> Result<CudaStorage> {
        capture_scope::check_host_upload("from_cpu")?;
        let dev = dev_of(device)?;
        let out = CudaStorage::alloc(&dev, s.dtype(), s.len())?;
        let bytes = s.as_bytes();
        if !bytes.is_empty() {
            // Pageable source: the driver stages it before returning, so `s` may be dropped after.
            counters::count(counters::Count::HostToDevice);
            unsafe { dr::memcpy_htod_async(out.buf.ptr, bytes, dev.stream()) }.map_err(|e| cu_err("cuMemcpyHtoDAsync", e))?;
        }
        Ok(out)
    }

    /// Writes host bytes into this storage at byte offset `at`, in place (an explicit host→device
    /// copy on the compute stream; the driver stages the pageable source before returning).
    pub(crate) fn write_from_host(&self, at: usize, bytes: &[u8]) -> Result<()> {
        capture_scope::check_host_upload("write_from_host")?;
        if at + bytes.len() > self.len * self.dtype.size_in_bytes() {
            return Err(Error::invalid("write_from_host", format!("{} bytes at {at} exceed the storage", bytes.len())));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let dev = &self.buf.dev;
        dev.bind()?;
        counters::count(counters::Count::HostToDevice);
        unsafe { dr::memcpy_htod_async(self.buf.ptr + at as u64, bytes, dev.stream()) }.map_err(|e| cu_err("cuMemcpyHtoDAsync", e))
    }

    /// Downloads to the host: waits for the stream, then copies (a synchronisation point).
    pub(crate) fn to_cpu(&self) -> Result<CpuStorage> {
        capture_scope::check_host_sync("to_cpu")?;
        let dev = &self.buf.dev;
        dev.bind()?;
        // What side tasks wrote is read after the compute stream joins them.
        dev.join_side_tasks()?;
        let mut bytes = vec![0u8; self.len * self.dtype.size_in_bytes()];
        if !bytes.is_empty() {
            counters::count(counters::Count::DeviceToHost);
            unsafe { dr::memcpy_dtoh_async(&mut bytes, self.buf.ptr, dev.stream()) }.map_err(|e| cu_err("cuMemcpyDtoHAsync", e))?;
        }
        dev.synchronize()?;
        CpuStorage::from_bytes(self.dtype, &bytes)
    }

    /// A device-side deep copy.
    pub(crate) fn try_clone(&self) -> Result<CudaStorage> {
        let dev = &self.buf.dev;
        let out = CudaStorage::alloc(dev, self.dtype, self.len)?;
        let n = self.len * self.dtype.size_in_bytes();
        if n > 0 {
            counters::count(counters::Count::DeviceToDevice);
            unsafe { dr::memcpy_dtod_async(out.buf.ptr, self.buf.ptr, n, dev.stream()) }.map_err(|e| cu_err("cuMemcpyDtoDAsync", e))?;
        }
        Ok(out)
    }

    /// Device address of the first element (for graph recorders and interop).
    pub fn device_ptr(&self) -> u64 {
        self.buf.ptr
    }
}

//! Kernels that other crates bring as CUDA source (e.g. ptl-data's fused HSV jitter).
//!
//! The core op set stays generic; a crate that needs one fused, domain-specific kernel compiles
//! it here with the same NVRTC options as the core kernels (CUBIN for this GPU's architecture,
//! the CUDA include path, the same on-disk cache) and launches it on the device's one compute stream, so it is ordered with every
//! other op, asynchronous, and recordable into a CUDA graph like them. Modules are compiled once
//! per device and name and cached for the life of the process.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result as dr, sys};

use super::device::dev_of;
use super::device::{cu_err, Dev};
use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor};

/// One argument of a [`UserKernel`] launch, in the kernel's parameter order.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg<'a> {
    /// A CUDA tensor on the kernel's device, passed as its buffer's device address.
    Tensor(&'a Tensor),
    /// CUDA tensors passed as one by-value struct of their device addresses, in order (the kernel
    /// declares e.g. `struct { const float* p[72]; }`): for kernels that read or write many
    /// tensors, such as every weight of a small network, without packing them into one buffer.
    TensorArray(&'a [Tensor]),
    /// A u32 by value.
    U32(u32),
    /// An i32 by value.
    I32(i32),
    /// A u64 by value (also a device address).
    U64(u64),
    /// An f32 by value.
    F32(f32),
    /// An f64 by value.
    F64(f64),
}

/// A `__global__` function compiled from user source.
#[derive(Clone)]
pub struct UserKernel {
    dev: Arc<Dev>,
    func: sys::CUfunction,
    name: String,
}

// SAFETY: a CUfunction is a process-global handle kept alive by the cached module.
unsafe impl Send for UserKernel {}
unsafe impl Sync for UserKernel {}

impl std::fmt::Debug for UserKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UserKernel({} on {:?})", self.name, self.dev)
    }
}

impl UserKernel {
    /// Compiles `source` as module `module` on `device` (once; later calls reuse the cached module,
    /// so a module name must always come with the same source) and looks up `function`
    /// (declare it `extern "C"`; also once: callers may call this at every launch).
    pub fn compile(device: Device, module: &str, source: &str, function: &str) -> Result<UserKernel> {
        let dev = dev_of(device)?;
        let key = (module.to_string(), function.to_string());
        let name = format!("{module}::{function}");
        let cached = dev.user_functions.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied();
        if let Some(func) = cached {
            return Ok(UserKernel { dev, func, name });
        }
        dev.bind()?;
        let m = {
            let mut cache = dev.user_modules.lock().unwrap_or_else(|e| e.into_inner());
            match cache.get(module) {
                Some(m) => m.clone(),
                None => {
                    let (major, minor) = dev.ctx.compute_capability().map_err(|e| cu_err("compute capability", e))?;
                    let m = super::module_cache::load_module(&dev.ctx, module, source, major, minor)
                        .map_err(|e| Error::Cuda(format!("user module {module}: {e}")))?;
                    cache.insert(module.to_string(), m.clone());
                    m
                }
            }
        };
        let f = m.load_function(function).map_err(|e| cu_err(&format!("kernel {function} in module {module}"), e))?;
        let func = f.cu_function();
        // The cached module (kept by the device for the whole process) keeps the function valid.
        std::mem::forget(f);
        dev.user_functions.lock().unwrap_or_else(|e| e.into_inner()).insert(key, func);
        Ok(UserKernel { dev, func, name })
    }

    /// The device the kernel was compiled for.
    pub fn device(&self) -> Device {
        Device::Cuda(self.dev.ordinal)
    }

    /// The device address of `t`'s buffer, checked to be a CUDA tensor on this kernel's device
    /// (`arg` names the argument in the error).
    fn address_of(&self, t: &Tensor, arg: usize) -> Result<u64> {
        if t.device() != self.device() {
            return Err(Error::invalid(
                "UserKernel::launch",
                format!("{}: argument {arg} is on {}, the kernel runs on {}", self.name, t.device(), self.device()),
            ));
        }
        let ptr = t.with_storage(|s| match s {
            Storage::Cuda(c) => Some(c.device_ptr()),
            #[allow(unreachable_patterns)]
            _ => None,
        });
        ptr.ok_or_else(|| Error::invalid("UserKernel::launch", format!("{}: argument {arg} is not a CUDA tensor", self.name)))
    }

    /// Queues the kernel on the device's compute stream (asynchronous, no host sync).
    ///
    /// Tensor arguments must live on the kernel's device; the kernel sees their contiguous buffers.
    /// A kernel that writes should write into tensors the caller has just created for it
    /// (e.g. [`Tensor::zeros`]): tensors share storage, so writing into an input changes every view of it.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list in number, order and type, and the grid must
    /// keep every access inside the buffers passed.
    pub unsafe fn launch(&self, grid: (u32, u32, u32), block: (u32, u32, u32), args: &[KernelArg<'_>]) -> Result<()> {
        enum Slot {
            Ptr(u64),
            Words(Vec<u64>),
            U32(u32),
            I32(i32),
            U64(u64),
            F32(f32),
            F64(f64),
        }
        let mut slots = Vec::with_capacity(args.len());
        for (i, a) in args.iter().enumerate() {
            slots.push(match *a {
                KernelArg::Tensor(t) => Slot::Ptr(self.address_of(t, i)?),
                KernelArg::TensorArray(ts) => Slot::Words(ts.iter().map(|t| self.address_of(t, i)).collect::<Result<_>>()?),
                KernelArg::U32(v) => Slot::U32(v),
                KernelArg::I32(v) => Slot::I32(v),
                KernelArg::U64(v) => Slot::U64(v),
                KernelArg::F32(v) => Slot::F32(v),
                KernelArg::F64(v) => Slot::F64(v),
            });
        }
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| match s {
                Slot::Ptr(v) | Slot::U64(v) => v as *mut u64 as *mut c_void,
                Slot::Words(w) => w.as_mut_ptr() as *mut c_void,
                Slot::U32(v) => v as *mut u32 as *mut c_void,
                Slot::I32(v) => v as *mut i32 as *mut c_void,
                Slot::F32(v) => v as *mut f32 as *mut c_void,
                Slot::F64(v) => v as *mut f64 as *mut c_void,
            })
            .collect();
        self.dev.bind()?;
        super::counters::count(super::counters::Count::KernelLaunch);
        // SAFETY: the caller guarantees the signature; `slots` outlives the launch call, which copies the values.
        unsafe { dr::launch_kernel(self.func, grid, block, 0, self.dev.stream(), &mut params) }
            .map_err(|e| cu_err(&format!("launch of {}", self.name), e))
    }
}

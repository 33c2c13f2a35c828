//! Where a tensor lives.

/// A compute device. `Cuda(n)` is the n-th visible GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Parses `cpu`, `cuda`, `cuda:N` (and `auto`, which picks `cuda:0` when a GPU is usable).
    pub fn parse(s: &str) -> crate::Result<Device> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            "auto" => Ok(Device::auto()),
            _ => {
                if let Some(n) = t.strip_prefix("cuda:") {
                    n.parse::<usize>()
                        .map(Device::Cuda)
                        .map_err(|_| crate::Error::invalid("Device::parse", format!("bad device `{s}`: use cpu, cuda, cuda:N or auto")))
                } else {
                    Err(crate::Error::invalid("Device::parse", format!("unknown device `{s}`: use cpu, cuda, cuda:N or auto")))
                }
            }
        }
    }

    /// Why this device cannot be used in this process, or `Ok(())` when it can: a named device
    /// that is not there is an error, never a silent fall-back to another one.
    pub fn ensure_usable(self) -> crate::Result<()> {
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => crate::cuda::check(n).map_err(|e| {
                let count = crate::cuda::device_count();
                let choices = match count {
                    0 => "device=cpu".to_string(),
                    1 => "device=cuda:0 or device=cpu".to_string(),
                    c => format!("device=cuda:0 … cuda:{} or device=cpu", c - 1),
                };
                crate::Error::invalid("device", format!("cuda:{n} cannot be used: {e}; use {choices}"))
            }),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(n) => Err(crate::Error::invalid(
                "device",
                format!("cuda:{n} cannot be used: this ptl was built without its CUDA backend (feature `cuda`); use device=cpu"),
            )),
        }
    }

    /// The best available device: `Cuda(0)` when a usable GPU answers, else `Cpu`.
    pub fn auto() -> Device {
        if crate::storage::cuda_usable(0) {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

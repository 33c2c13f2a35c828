//! Where a tensor lives.

/// A compute device. `Cuda(n)` is the n-th visible GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host.
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// Whether it is a CUDA device.
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
                // Ultralytics' and PyTorch's spellings: a bare ordinal is that GPU ("0" = cuda:0).
                let ordinals = t.strip_prefix("cuda:").unwrap_or(&t);
                if ordinals.contains(',') {
                    return Err(crate::Error::invalid(
                        "Device::parse",
                        format!(
                            "`{s}` names several GPUs: one device is needed here (e.g. device=0); `ptl train device=0,1` trains on several"
                        ),
                    ));
                }
                match ordinals.parse::<usize>() {
                    Ok(n) => Ok(Device::Cuda(n)),
                    Err(_) if t.starts_with("cuda:") => {
                        Err(crate::Error::invalid("Device::parse", format!("bad device `{s}`: use cpu, cuda, cuda:N, N or auto")))
                    }
                    Err(_) => {
                        Err(crate::Error::invalid("Device::parse", format!("unknown device `{s}`: use cpu, cuda, cuda:N, N or auto")))
                    }
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

#[cfg(test)]
mod tests {
    use super::Device;

    /// Ultralytics' spellings parse as PyTorch reads them; several GPUs are a clear error for now.
    #[test]
    fn devices_parse_as_ultralytics_spells_them() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("0").unwrap(), Device::Cuda(0));
        assert_eq!(Device::parse(" 1 ").unwrap(), Device::Cuda(1));
        assert_eq!(Device::parse("cuda:2").unwrap(), Device::Cuda(2));
        assert_eq!(Device::parse("CUDA").unwrap(), Device::Cuda(0));
        for several in ["0,1", "cuda:0,1"] {
            let e = Device::parse(several).unwrap_err().to_string();
            assert!(e.contains("several GPUs") && e.contains("device=0"), "{e}");
        }
        let e = Device::parse("mps").unwrap_err().to_string();
        assert!(e.contains("unknown device `mps`") && e.contains("cuda:N, N"), "{e}");
        assert!(Device::parse("cuda:x").unwrap_err().to_string().contains("bad device"));
    }
}

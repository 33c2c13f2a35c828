pub mod export;
pub mod logger;
pub mod predict;
pub mod train;
pub mod ultralytics_keys;

use ptl_autograd::Device;

/// Why a command failed: the message (printed after `error: `) and the process's exit code.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub code: u8,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure { message, code: 1 }
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Failure { message: message.into(), code: 1 }
    }
}

/// Parses a device setting and says clearly which device will be used for `doing` (training,
/// …). `auto` takes the first GPU, or the CPU when none answers (and says so); a named device
/// that cannot be used is an error naming why, never a fall-back.
pub fn resolve_device(s: &str, doing: &str) -> Result<Device, String> {
    let d = Device::parse(s).map_err(|e| e.to_string())?;
    if s.trim().eq_ignore_ascii_case("auto") {
        match d {
            Device::Cpu => log::info!("ptl: no usable CUDA GPU found; {doing} on the CPU"),
            Device::Cuda(n) => log::info!("ptl: {doing} on GPU cuda:{n}"),
        }
        return Ok(d);
    }
    d.ensure_usable().map_err(|e| match e {
        ptl_autograd::Error::InvalidArgument { msg, .. } => format!("device={s}: {msg}"),
        other => format!("device={s}: {other}"),
    })?;
    Ok(d)
}

//! Stopping a fit cleanly on SIGINT (Ctrl-C) or SIGTERM.
//!
//! The handlers only note the signal; the fit loop looks after every batch, finishes that step,
//! writes a checkpoint holding its place inside the epoch and returns
//! [`crate::TrainerError::Interrupted`] (the command line then exits 130 or 143 and says how to
//! resume). A second signal ends the process at once, as a user pressing Ctrl-C twice expects.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// SIGINT's number.
pub const SIGINT: i32 = 2;
/// SIGTERM's number.
pub const SIGTERM: i32 = 15;

struct Flags {
    /// The signal noted (0: none).
    which: Arc<AtomicUsize>,
    /// Set with it: a second signal while this is set exits the process.
    any: Arc<AtomicBool>,
}

fn flags() -> &'static Flags {
    static F: OnceLock<Flags> = OnceLock::new();
    F.get_or_init(|| Flags { which: Arc::new(AtomicUsize::new(0)), any: Arc::new(AtomicBool::new(false)) })
}

/// Installs the SIGINT and SIGTERM handlers (once per process; later calls do nothing). Until
/// then signals keep their default action.
pub fn install_signal_handlers() -> std::io::Result<()> {
    static DONE: OnceLock<std::io::Result<()>> = OnceLock::new();
    let r = DONE.get_or_init(|| {
        let f = flags();
        for sig in [SIGINT, SIGTERM] {
            // Registered first, so it sees the flag as it was before this signal: the second
            // signal exits with the shell's code for it.
            signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, f.any.clone())?;
            signal_hook::flag::register_usize(sig, f.which.clone(), sig as usize)?;
            signal_hook::flag::register(sig, f.any.clone())?;
        }
        Ok(())
    });
    match r {
        Ok(()) => Ok(()),
        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
    }
}

/// Asks a running fit to stop as if `signal` had arrived (for library users and tests).
pub fn request(signal: i32) {
    let f = flags();
    f.which.store(signal.max(1) as usize, Ordering::SeqCst);
    f.any.store(true, Ordering::SeqCst);
}

/// The signal that asked the fit to stop, if one did (not cleared).
pub fn requested() -> Option<i32> {
    match flags().which.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s as i32),
    }
}

/// Clears a request once the fit has stopped for it (a later fit in the process starts clean).
pub fn clear() {
    let f = flags();
    f.which.store(0, Ordering::SeqCst);
    f.any.store(false, Ordering::SeqCst);
}

/// The signal's name for messages.
pub fn signal_name(signal: i32) -> String {
    match signal {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_seen_until_cleared() {
        clear();
        assert_eq!(requested(), None);
        request(SIGTERM);
        assert_eq!(requested(), Some(SIGTERM));
        assert_eq!(signal_name(SIGTERM), "SIGTERM");
        clear();
        assert_eq!(requested(), None);
    }
}

//! How ptl touches the file system where a user's or another user's file could hurt it.
//!
//! - [`open_regular`] and the readers built on it open without blocking and check the type on the
//!   open handle: a FIFO, socket, device or folder given where a file is read is refused at once,
//!   never waited on (no stat-then-open race either).
//! - [`private_dir`] makes or accepts a cache folder only if it is this user's and not writable by
//!   others; [`write_atomic`] writes through a fresh temporary (never a planted link) and renames.
//! - [`RunLock`] holds a run folder for one process; [`Sealer`] signs cache files with a key kept
//!   in the user's private cache folder, so a file another local user planted fails the check.
//!
//! Every failure is a [`FileError`] naming the path and what to do.

#![warn(missing_docs)]
mod atomic;
mod cache;
mod error;
mod lock;
mod private;
mod regular;
mod seal;

pub use atomic::{write_atomic, write_atomic_with};
pub use cache::{cache_dir, cache_root, user_sealer};
pub use error::{FileError, FileKind, Result};
pub use lock::RunLock;
pub use private::{check_private, private_dir, DirOwner, Trust};
pub use regular::{open_regular, read_limited, read_regular, read_to_string, MAX_TEXT_BYTES};
pub use seal::{Sealer, SEAL_LEN};

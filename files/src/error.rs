//! The crate's one error type.

use std::path::PathBuf;

/// What a path turned out to be when a regular file was expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// A folder.
    Directory,
    /// A named pipe: reading it would wait for a writer.
    Fifo,
    /// A Unix socket.
    Socket,
    /// A character device (a terminal, `/dev/zero`, …).
    CharDevice,
    /// A block device (a disk).
    BlockDevice,
    /// Anything else that is not a regular file.
    Other,
}

impl std::fmt::Display for FileKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileKind::Directory => "a folder",
            FileKind::Fifo => "a named pipe (FIFO)",
            FileKind::Socket => "a socket",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Other => "not a regular file",
        })
    }
}

/// Every failure of `ptl-files`; each names the path and the fix.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The path could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file was expected and the path is something else.
    #[error("{path} is {kind}, not a regular file: give the path of a file")]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What it is instead.
        kind: FileKind,
    },
    /// The file is larger than what the reader accepts.
    #[error("{path} is {len} bytes, more than the {limit} a {what} may have: is it the right file?")]
    TooLarge {
        /// The path.
        path: PathBuf,
        /// Its size in bytes.
        len: u64,
        /// The largest size accepted.
        limit: u64,
        /// What kind of file was expected.
        what: &'static str,
    },
    /// A text file that is not UTF-8.
    #[error("{path} is not UTF-8 text (byte {at}): save it as UTF-8")]
    NotUtf8 {
        /// The path.
        path: PathBuf,
        /// Offset of the first byte that is not UTF-8.
        at: usize,
    },
    /// A cache folder that another user could have prepared or could change.
    #[error("{path}: {reason}; ptl keeps its caches in folders only you can write — remove it, or point PTL_CACHE at a folder of yours")]
    NotPrivate {
        /// The path.
        path: PathBuf,
        /// Why it is not private.
        reason: String,
    },
    /// Another process holds the run folder.
    #[error("{path} is in use by another ptl process ({holder}): wait for it to finish, or train into another folder (name=…)")]
    InUse {
        /// The path.
        path: PathBuf,
        /// The process holding it.
        holder: String,
    },
}

impl FileError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FileError::Io { path: path.into(), source }
    }
}

/// Result alias of this crate.
pub type Result<T, E = FileError> = std::result::Result<T, E>;

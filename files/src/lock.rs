//! One process per run folder.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::error::{FileError, Result};

/// An exclusive advisory lock (`flock`) on `<run folder>/.ptl.lock`, held until dropped or the
/// process ends (also when it is killed: the kernel releases it). The file keeps the holder's
/// process id for the message a second process gets.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

/// The lock file's name inside a run folder.
const LOCK_NAME: &str = ".ptl.lock";

impl RunLock {
    /// Takes the lock of run folder `dir` (which must exist), or [`FileError::InUse`] naming the
    /// process that holds it. Never waits.
    pub fn acquire(dir: &Path) -> Result<RunLock> {
        let path = dir.join(LOCK_NAME);
        let mut file = open_lock_file(&path).map_err(|e| FileError::io(&path, e))?;
        if !try_lock(&file).map_err(|e| FileError::io(&path, e))? {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "a process that is starting".to_string(),
                pid => format!("process {pid}"),
            };
            return Err(FileError::InUse { path: dir.to_path_buf(), holder });
        }
        let me = std::process::id().to_string();
        let stamp = file.set_len(0).and_then(|()| file.rewind()).and_then(|()| file.write_all(me.as_bytes()));
        stamp.map_err(|e| FileError::io(&path, e))?;
        Ok(RunLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(unix)]
fn open_lock_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_lock_file(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)
}

/// `Ok(false)` when another open file description holds the lock.
#[cfg(unix)]
fn try_lock(file: &File) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor owned by `file`.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

#[cfg(not(unix))]
fn try_lock(_file: &File) -> std::io::Result<bool> {
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn a_second_holder_is_told_who_has_it_and_a_dropped_lock_is_free() {
        let d = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(d.path()).unwrap();
        // flock locks belong to the open file description: a second open in this process
        // conflicts exactly as another process's would.
        let e = RunLock::acquire(d.path()).unwrap_err();
        assert!(matches!(e, FileError::InUse { .. }), "{e}");
        assert!(e.to_string().contains(&format!("process {}", std::process::id())), "{e}");
        drop(first);
        RunLock::acquire(d.path()).unwrap();
    }
}

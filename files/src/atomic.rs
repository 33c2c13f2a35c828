//! Whole-file writes that a kill or a planted link cannot half-do.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{FileError, Result};

/// Writes `bytes` to `path` through a temporary beside it, then renames (readers see the old file
/// or the new one, never a part). See [`write_atomic_with`].
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    write_atomic_with(path, mode, |f| f.write_all(bytes))
}

/// Writes `path` with `fill` through a fresh temporary in the same folder: created with
/// `O_CREAT | O_EXCL | O_NOFOLLOW` and permissions `mode` (so a link or file another user put at
/// the temporary's name is never written through), synced, then renamed over `path`. The
/// temporary's name is unique to the process and call, so two writers never share one; on failure
/// it is removed.
pub fn write_atomic_with(path: &Path, mode: u32, fill: impl FnOnce(&mut File) -> std::io::Result<()>) -> Result<()> {
    let tmp = temporary_name(path);
    let mut f = create_new(&tmp, mode).map_err(|e| FileError::io(&tmp, e))?;
    let written = fill(&mut f).and_then(|()| f.sync_all());
    drop(f);
    let renamed = written.and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = renamed {
        let _ = std::fs::remove_file(&tmp);
        return Err(FileError::io(path, e));
    }
    Ok(())
}

/// `.<name>.<pid>.<n>.tmp` beside `path`.
fn temporary_name(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "file".into());
    path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

#[cfg(unix)]
fn create_new(path: &Path, mode: u32) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path)
}

#[cfg(not(unix))]
fn create_new(path: &Path, _mode: u32) -> std::io::Result<File> {
    std::fs::OpenOptions::new().write(true).create_new(true).open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.json");
        write_atomic(&p, b"one", 0o600).unwrap();
        write_atomic(&p, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        }
    }

    /// A link planted at a name the writer might use is never written through.
    #[cfg(unix)]
    #[test]
    fn a_planted_link_is_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let p = d.path().join("f");
        // The names the writer will use next (other tests of this process draw from the same
        // counter, so a run of them is planted).
        let n: u64 = temporary_name(&p).to_string_lossy().rsplit('.').nth(1).unwrap().parse().unwrap();
        for next in n + 1..=n + 64 {
            std::os::unix::fs::symlink(&victim, d.path().join(format!(".f.{}.{next}.tmp", std::process::id()))).unwrap();
        }
        assert!(write_atomic(&p, b"new", 0o600).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    }
}

//! Opening files that must be regular files, without ever blocking on something else.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::error::{FileError, FileKind, Result};

/// The most bytes [`read_to_string`] reads: larger than any dataset yaml, label file or COCO
/// annotation file (COCO's train2017 keypoints are ≈ 240 MB).
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

/// Opens `path` for reading if it is a regular file. The open does not block (`O_NONBLOCK`: a
/// FIFO opens at once instead of waiting for a writer) and the type is checked on the open handle
/// (`fstat`), so a path swapped between a check and the open cannot slip through. Folders, FIFOs,
/// sockets and devices are a [`FileError::NotRegular`] naming what the path is.
pub fn open_regular(path: &Path) -> Result<File> {
    let file = open_nonblocking(path).map_err(|e| classify_open_error(path, e))?;
    let meta = file.metadata().map_err(|e| FileError::io(path, e))?;
    if !meta.file_type().is_file() {
        return Err(FileError::NotRegular { path: path.to_path_buf(), kind: kind_of(&meta.file_type()) });
    }
    restore_blocking(&file).map_err(|e| FileError::io(path, e))?;
    Ok(file)
}

/// The whole of the regular file `path`.
pub fn read_regular(path: &Path) -> Result<Vec<u8>> {
    read_limited(path, u64::MAX, "file")
}

/// The whole of the regular file `path`, refused when it is longer than `limit` bytes (`what`
/// names the kind of file in the error). Never allocates more than the file's length.
pub fn read_limited(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>> {
    let mut f = open_regular(path)?;
    let len = f.metadata().map_err(|e| FileError::io(path, e))?.len();
    if len > limit {
        return Err(FileError::TooLarge { path: path.to_path_buf(), len, limit, what });
    }
    let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    // A file that grows while it is read is cut at the limit, not followed.
    f.by_ref().take(limit.saturating_add(1)).read_to_end(&mut out).map_err(|e| FileError::io(path, e))?;
    if out.len() as u64 > limit {
        return Err(FileError::TooLarge { path: path.to_path_buf(), len: out.len() as u64, limit, what });
    }
    Ok(out)
}

/// The UTF-8 text of the regular file `path` (at most [`MAX_TEXT_BYTES`]), without a leading
/// byte-order mark (editors on Windows write one; YAML and JSON readers treat it as text).
pub fn read_to_string(path: &Path) -> Result<String> {
    let bytes = read_limited(path, MAX_TEXT_BYTES, "text file")?;
    let mut text =
        String::from_utf8(bytes).map_err(|e| FileError::NotUtf8 { path: path.to_path_buf(), at: e.utf8_error().valid_up_to() })?;
    if text.starts_with('\u{feff}') {
        text.drain(..'\u{feff}'.len_utf8());
    }
    Ok(text)
}

#[cfg(unix)]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC).open(path)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    File::open(path)
}

/// Reads of a regular file never block, but the flag is cleared so that the handle behaves like
/// any other once it is handed on.
#[cfg(unix)]
fn restore_blocking(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function borrows; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(unix))]
fn restore_blocking(_file: &File) -> std::io::Result<()> {
    Ok(())
}

/// A socket cannot be opened at all (`ENXIO`): say what the path is instead of the raw errno.
fn classify_open_error(path: &Path, e: std::io::Error) -> FileError {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() && !m.is_dir() => FileError::NotRegular { path: path.to_path_buf(), kind: kind_of(&m.file_type()) },
        _ => FileError::io(path, e),
    }
}

fn kind_of(t: &std::fs::FileType) -> FileKind {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return FileKind::Fifo;
        }
        if t.is_socket() {
            return FileKind::Socket;
        }
        if t.is_char_device() {
            return FileKind::CharDevice;
        }
        if t.is_block_device() {
            return FileKind::BlockDevice;
        }
    }
    if t.is_dir() {
        FileKind::Directory
    } else {
        FileKind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    fn mkfifo(p: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    #[test]
    fn regular_files_read_and_a_bom_is_dropped() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.yaml");
        std::fs::write(&p, "\u{feff}nc: 1\n").unwrap();
        assert_eq!(read_to_string(&p).unwrap(), "nc: 1\n");
        assert_eq!(read_regular(&p).unwrap().len(), 9);
        let e = read_limited(&p, 4, "label file").unwrap_err();
        assert!(matches!(e, FileError::TooLarge { len: 9, limit: 4, .. }), "{e}");
        std::fs::write(&p, b"a\xffb").unwrap();
        assert!(matches!(read_to_string(&p).unwrap_err(), FileError::NotUtf8 { at: 1, .. }));
    }

    #[test]
    fn folders_fifos_and_devices_are_refused_at_once() {
        let d = tempfile::tempdir().unwrap();
        let e = open_regular(d.path()).unwrap_err();
        assert!(matches!(e, FileError::NotRegular { kind: FileKind::Directory, .. }), "{e}");
        assert!(e.to_string().contains("is a folder, not a regular file"), "{e}");
        #[cfg(unix)]
        {
            let fifo = d.path().join("pipe");
            mkfifo(&fifo);
            // With no writer a blocking open would wait forever: this returns at once.
            let e = read_to_string(&fifo).unwrap_err();
            assert!(matches!(e, FileError::NotRegular { kind: FileKind::Fifo, .. }), "{e}");
            let e = open_regular(Path::new("/dev/null")).unwrap_err();
            assert!(matches!(e, FileError::NotRegular { kind: FileKind::CharDevice, .. }), "{e}");
            let sock = d.path().join("s.sock");
            let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
            let e = open_regular(&sock).unwrap_err();
            assert!(matches!(e, FileError::NotRegular { kind: FileKind::Socket, .. }), "{e}");
        }
        let e = open_regular(&d.path().join("missing")).unwrap_err();
        assert!(matches!(e, FileError::Io { .. }), "{e}");
    }
}

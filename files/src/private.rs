//! Cache folders that only their user can change.
//!
//! A cache another local user prepared (made first in a shared place such as `/tmp`, or left
//! group- or world-writable) could feed ptl their dataset, kernels or plans. ptl's own cache
//! folders are therefore made with mode 0700 and, when they exist already, accepted only if this
//! user owns them and nobody else can write them.

use std::path::{Path, PathBuf};

use crate::error::{FileError, Result};

/// Who chose the folder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trust {
    /// ptl's default location: checked for owner and permissions.
    Default,
    /// The user named the folder (an environment variable or an option): used as given, and made
    /// private when ptl creates it.
    Explicit,
}

/// The ownership facts [`check_private`] decides on (read from the folder, or made up in tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirOwner {
    /// Owner's user id.
    pub uid: u32,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Whether the path itself is a symbolic link.
    pub is_symlink: bool,
    /// Whether it is a folder.
    pub is_dir: bool,
}

/// Why `owner` may not serve as a private cache folder of user `me`; `Ok` if it may.
pub fn check_private(owner: DirOwner, me: u32) -> std::result::Result<(), String> {
    if owner.is_symlink {
        return Err("it is a symbolic link (another user could point it anywhere)".into());
    }
    if !owner.is_dir {
        return Err("it is not a folder".into());
    }
    if owner.uid != me {
        return Err(format!("it belongs to user id {}, not to you (user id {me})", owner.uid));
    }
    if owner.mode & 0o022 != 0 {
        return Err(format!("others can write into it (mode {:o})", owner.mode & 0o777));
    }
    Ok(())
}

/// Makes `dir` (and missing parents) with mode 0700, or accepts it if it is there. With
/// [`Trust::Default`] an existing folder must pass [`check_private`]; with [`Trust::Explicit`]
/// only the folder ptl creates is made private.
pub fn private_dir(dir: &Path, trust: Trust) -> Result<PathBuf> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| FileError::io(parent, e))?;
    }
    match make_private(dir) {
        Ok(()) => return Ok(dir.to_path_buf()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(FileError::io(dir, e)),
    }
    if trust == Trust::Explicit {
        return Ok(dir.to_path_buf());
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| FileError::io(dir, e))?;
    check_private(owner_of(&meta), current_uid()).map_err(|reason| FileError::NotPrivate { path: dir.to_path_buf(), reason })?;
    Ok(dir.to_path_buf())
}

#[cfg(unix)]
fn make_private(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(dir)
}

#[cfg(not(unix))]
fn make_private(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir(dir)
}

#[cfg(unix)]
fn owner_of(meta: &std::fs::Metadata) -> DirOwner {
    use std::os::unix::fs::MetadataExt;
    DirOwner { uid: meta.uid(), mode: meta.mode() & 0o7777, is_symlink: meta.file_type().is_symlink(), is_dir: meta.is_dir() }
}

#[cfg(not(unix))]
fn owner_of(meta: &std::fs::Metadata) -> DirOwner {
    DirOwner { uid: 0, mode: 0o700, is_symlink: meta.file_type().is_symlink(), is_dir: meta.is_dir() }
}

/// This process's effective user id.
#[cfg(unix)]
pub(crate) fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(not(unix))]
pub(crate) fn current_uid() -> u32 {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: u32 = 1000;

    fn dir(uid: u32, mode: u32) -> DirOwner {
        DirOwner { uid, mode, is_symlink: false, is_dir: true }
    }

    #[test]
    fn only_an_own_folder_nobody_else_writes_is_private() {
        assert!(check_private(dir(ME, 0o700), ME).is_ok());
        assert!(check_private(dir(ME, 0o755), ME).is_ok(), "others may read, not write");
        let e = check_private(dir(1001, 0o700), ME).unwrap_err();
        assert!(e.contains("user id 1001, not to you"), "{e}");
        assert!(check_private(dir(ME, 0o770), ME).unwrap_err().contains("others can write"));
        assert!(check_private(dir(ME, 0o1777), ME).unwrap_err().contains("mode 777"));
        assert!(check_private(DirOwner { is_symlink: true, ..dir(ME, 0o700) }, ME).unwrap_err().contains("symbolic link"));
        assert!(check_private(DirOwner { is_dir: false, ..dir(ME, 0o600) }, ME).unwrap_err().contains("not a folder"));
    }

    #[cfg(unix)]
    #[test]
    fn made_private_and_a_shared_one_refused_unless_explicit() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("cache").join("ptl");
        private_dir(&p, Trust::Default).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o700);
        private_dir(&p, Trust::Default).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&p, Trust::Default).unwrap_err();
        assert!(matches!(e, FileError::NotPrivate { .. }) && e.to_string().contains("PTL_CACHE"), "{e}");
        assert!(private_dir(&p, Trust::Explicit).is_ok());
        let link = d.path().join("link");
        std::os::unix::fs::symlink(d.path().join("cache"), &link).unwrap();
        assert!(private_dir(&link, Trust::Default).unwrap_err().to_string().contains("symbolic link"));
    }
}

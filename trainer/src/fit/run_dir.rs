//! Claiming a run folder: one process per folder, decided atomically.
//!
//! A folder is a run's when its process holds the folder's lock ([`ptl_files::RunLock`]) and the
//! folder holds no earlier run. Two fits started together with the same `project`/`name` thus
//! get `train` and `train2`, never one folder; `exist_ok` trains into the named folder itself but
//! refuses it while another process holds it, and so does a resume.

use std::path::{Path, PathBuf};

use ptl_files::{FileError, RunLock};

use crate::{Result, TrainerError};

/// A run folder and the lock that makes it this process's until dropped.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    _lock: RunLock,
}

impl RunDir {
    /// The folder.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// For a new run: `dir` if it can be claimed and holds no earlier run, else the first of
    /// `dir2`, `dir3`, … that can (Ultralytics' `increment_path`, made safe between processes).
    pub fn claim_new(dir: &Path) -> Result<RunDir> {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "train".into());
        for n in 1..=MAX_NUMBERED {
            let candidate = if n == 1 { dir.to_path_buf() } else { dir.with_file_name(format!("{name}{n}")) };
            match make_dir(&candidate) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(TrainerError::Io { path: candidate, source: e }),
            }
            match RunLock::acquire(&candidate) {
                Ok(lock) if !holds_run(&candidate) => return Ok(RunDir { path: candidate, _lock: lock }),
                Ok(_) | Err(FileError::InUse { .. }) => continue,
                // A file, or a folder we may not write, at that name: the next name may do.
                Err(FileError::Io { .. }) if !candidate.is_dir() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(TrainerError::InvalidArgument {
            what: "save_dir",
            reason: format!("{} and its {MAX_NUMBERED} numbered siblings are all taken: choose another name=", dir.display()),
        })
    }

    /// `dir` itself (made if missing), for `exist_ok` and resumes: an error naming the holder
    /// while another process has it.
    pub fn claim_existing(dir: &Path) -> Result<RunDir> {
        std::fs::create_dir_all(dir).map_err(|e| TrainerError::Io { path: dir.to_path_buf(), source: e })?;
        Ok(RunDir { path: dir.to_path_buf(), _lock: RunLock::acquire(dir)? })
    }
}

/// Numbered siblings tried before giving up.
const MAX_NUMBERED: usize = 9999;

fn make_dir(dir: &Path) -> std::io::Result<()> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::create_dir(dir)
}

/// Whether `dir` holds an earlier run's results.
pub fn holds_run(dir: &Path) -> bool {
    ["weights/last.ckpt", "results.csv", "summary.json"].iter().any(|f| dir.join(f).exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_or_used_folders_are_skipped_and_exist_ok_is_refused_while_held() {
        let d = tempfile::tempdir().unwrap();
        let want = d.path().join("runs").join("train");
        let a = RunDir::claim_new(&want).unwrap();
        assert_eq!(a.path(), want);
        // Held by a running fit: the next name.
        let b = RunDir::claim_new(&want).unwrap();
        assert_eq!(b.path(), d.path().join("runs").join("train2"));
        let e = RunDir::claim_existing(&want).unwrap_err().to_string();
        assert!(e.contains("in use by another ptl process"), "{e}");
        // A finished run (released, with results) is skipped too; an empty released folder is reused.
        std::fs::write(want.join("results.csv"), "epoch\n").unwrap();
        drop(a);
        drop(b);
        assert_eq!(RunDir::claim_new(&want).unwrap().path(), d.path().join("runs").join("train2"));
        assert_eq!(RunDir::claim_existing(&want).unwrap().path(), want);
        // A file in the way of a name is passed over.
        std::fs::write(d.path().join("runs").join("exp"), "x").unwrap();
        assert_eq!(RunDir::claim_new(&d.path().join("runs").join("exp")).unwrap().path(), d.path().join("runs").join("exp2"));
    }
}

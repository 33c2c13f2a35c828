//! `cargo xtask record DIR…`: packs a measurement record (`results/<date>-<commit>/`) for the
//! repository: its README, pictures and run scripts stay as they are; every other file — logs,
//! tables, `runs.jsonl`, bench JSON, the per-run folders — goes into one `raw.tar.xz` beside them,
//! `.xz` members decompressed first so that one solid stream compresses the similar logs of a
//! record together (the records came to 5.7 MB as single compressed files; a solid archive per
//! record is a fraction of that, which keeps the repository under its 50 MB). The archive is
//! reproducible: members sorted by name, no owners, one fixed time. `tar -xJf raw.tar.xz` in the
//! folder restores the files its README names.

use std::path::{Path, PathBuf};
use std::process::Command;

const HELP: &str = "usage: cargo xtask record DIR...
  packs each record folder's files but README.md, *.png and *.sh into DIR/raw.tar.xz";

/// The archive a record's raw files go into.
pub(crate) const RAW_ARCHIVE: &str = "raw.tar.xz";

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if args.is_empty() || args.iter().any(|a| a.starts_with('-')) {
        return Err(HELP.into());
    }
    for dir in args {
        pack(Path::new(dir))?;
    }
    Ok(())
}

/// Whether `rel` (a path inside a record) stays beside the archive: the README, pictures, run
/// scripts and the archive itself.
pub(crate) fn stays_outside(rel: &Path) -> bool {
    let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let top = rel.components().count() == 1;
    (top && (name == "README.md" || name == RAW_ARCHIVE)) || name.ends_with(".png") || name.ends_with(".sh")
}

/// The name a member gets in the archive: `x.log.xz` is stored decompressed as `x.log`.
fn member_name(rel: &Path) -> PathBuf {
    match rel.to_str().and_then(|s| s.strip_suffix(".xz")) {
        Some(plain) => PathBuf::from(plain),
        None => rel.to_path_buf(),
    }
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in entries {
        let p = e.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        if p.is_dir() {
            walk(root, &p, out)?;
        } else {
            out.push(p.strip_prefix(root).map_err(|e| e.to_string())?.to_path_buf());
        }
    }
    Ok(())
}

fn pack(dir: &Path) -> Result<(), String> {
    if !dir.join("README.md").is_file() {
        return Err(format!("{}: no README.md (a record says what ran before its files are packed)", dir.display()));
    }
    let mut files = Vec::new();
    walk(dir, dir, &mut files)?;
    files.sort();
    let inside: Vec<&PathBuf> = files.iter().filter(|f| !stays_outside(f)).collect();
    if inside.is_empty() {
        println!("record: {}: nothing to pack", dir.display());
        return Ok(());
    }
    let archive = dir.join(RAW_ARCHIVE);
    if archive.exists() {
        return Err(format!("{}: already has {RAW_ARCHIVE} and unpacked files beside it; unpack it first", dir.display()));
    }
    // Stage the members (decompressed) in a private folder, then one tar | xz.
    let stage = std::env::temp_dir().join(format!("ptl-record-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&stage);
    let mut names = Vec::new();
    let mut before = 0u64;
    for rel in &inside {
        let src = dir.join(rel);
        before += std::fs::metadata(&src).map_err(|e| format!("{}: {e}", src.display()))?.len();
        let name = member_name(rel);
        if names.contains(&name) {
            return Err(format!("{}: both {} and its compressed copy exist", dir.display(), name.display()));
        }
        let dst = stage.join(&name);
        std::fs::create_dir_all(dst.parent().unwrap_or(&stage)).map_err(|e| format!("{}: {e}", stage.display()))?;
        if name != **rel {
            let out = Command::new("xz").arg("-dc").arg(&src).output().map_err(|e| format!("xz: {e} (is the xz tool installed?)"))?;
            if !out.status.success() {
                return Err(format!("xz -dc {}: {}", src.display(), String::from_utf8_lossy(&out.stderr)));
            }
            std::fs::write(&dst, out.stdout).map_err(|e| format!("{}: {e}", dst.display()))?;
        } else {
            std::fs::copy(&src, &dst).map_err(|e| format!("{}: {e}", src.display()))?;
        }
        names.push(name);
    }
    let list = stage.join(".members");
    let listing: String = names.iter().map(|n| format!("{}\n", n.display())).collect();
    std::fs::write(&list, listing).map_err(|e| format!("{}: {e}", list.display()))?;
    let status = Command::new("sh")
        .arg("-c")
        .arg("tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C \"$1\" -cf - -T \"$1/.members\" | xz -9e -T1 > \"$2\"")
        .arg("sh")
        .arg(&stage)
        .arg(&archive)
        .status()
        .map_err(|e| format!("tar | xz: {e}"))?;
    let _ = std::fs::remove_dir_all(&stage);
    if !status.success() {
        let _ = std::fs::remove_file(&archive);
        return Err(format!("{}: tar | xz failed ({status})", archive.display()));
    }
    // Check the archive lists every member before removing a file.
    let listed = Command::new("tar").arg("-tJf").arg(&archive).output().map_err(|e| format!("tar -t: {e}"))?;
    let listed = String::from_utf8_lossy(&listed.stdout);
    let listed: Vec<&str> = listed.lines().collect();
    if let Some(missing) = names.iter().find(|n| !listed.iter().any(|l| Path::new(l) == n.as_path())) {
        let _ = std::fs::remove_file(&archive);
        return Err(format!("{}: {} is missing from the archive; nothing removed", archive.display(), missing.display()));
    }
    for rel in &inside {
        std::fs::remove_file(dir.join(rel)).map_err(|e| format!("{}: {e}", dir.join(rel).display()))?;
    }
    remove_empty_dirs(dir)?;
    let after = std::fs::metadata(&archive).map(|m| m.len()).unwrap_or(0);
    println!("record: {}: {} files, {before} bytes → {RAW_ARCHIVE} {after} bytes", dir.display(), inside.len());
    Ok(())
}

fn remove_empty_dirs(dir: &Path) -> Result<bool, String> {
    let mut empty = true;
    for e in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let p = e.map_err(|e| e.to_string())?.path();
        if p.is_dir() && remove_empty_dirs(&p)? {
            std::fs::remove_dir(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        } else {
            empty = false;
        }
    }
    Ok(empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_pictures_and_scripts_stay_beside_the_archive() {
        for kept in ["README.md", "raw.tar.xz", "outcome/outcome.png", "run.sh", "run-1/script.sh"] {
            assert!(stays_outside(Path::new(kept)), "{kept}");
        }
        for packed in ["bench.md", "b64/README.md", "runs.jsonl.xz", "t/test.log", "b4/raw.tar.xz"] {
            assert!(!stays_outside(Path::new(packed)), "{packed}");
        }
        assert_eq!(member_name(Path::new("b4/runs.jsonl.xz")), PathBuf::from("b4/runs.jsonl"));
        assert_eq!(member_name(Path::new("bench.md")), PathBuf::from("bench.md"));
    }

    #[test]
    fn a_record_is_packed_and_its_files_restored() {
        let tool = |name: &str| Command::new(name).arg("--version").output().is_ok_and(|o| o.status.success());
        assert!(tool("tar") && tool("xz"), "the record packer needs tar and xz (CI installs them)");
        let dir = std::env::temp_dir().join(format!("ptl-record-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("b4")).unwrap();
        std::fs::write(dir.join("README.md"), "what ran\n").unwrap();
        std::fs::write(dir.join("run.sh"), "echo\n").unwrap();
        std::fs::write(dir.join("b4/bench.md"), "| table |\n".repeat(50)).unwrap();
        std::fs::write(dir.join("b4/log.txt"), "a log line\n".repeat(100)).unwrap();
        assert!(Command::new("xz").arg(dir.join("b4/log.txt")).status().unwrap().success());
        pack(&dir).expect("pack");
        let mut left = Vec::new();
        walk(&dir, &dir, &mut left).unwrap();
        left.sort();
        assert_eq!(left, [PathBuf::from("README.md"), PathBuf::from("raw.tar.xz"), PathBuf::from("run.sh")]);
        assert!(pack(&dir).is_ok(), "a packed record has nothing left to pack");
        let out = Command::new("tar").arg("-xJf").arg("raw.tar.xz").current_dir(&dir).status().unwrap();
        assert!(out.success());
        assert_eq!(std::fs::read_to_string(dir.join("b4/log.txt")).unwrap(), "a log line\n".repeat(100));
        assert_eq!(std::fs::read_to_string(dir.join("b4/bench.md")).unwrap(), "| table |\n".repeat(50));
        std::fs::remove_file(dir.join("README.md")).unwrap();
        assert!(pack(&dir).unwrap_err().contains("no README.md"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

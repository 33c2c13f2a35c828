//! Release builds whose test/bench executables the device packs copy (shared by `device-pack`
//! and `heads-pack`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// One executable cargo produced.
pub(crate) struct Artifact {
    pub exe: PathBuf,
    /// Target name (e.g. `cuda_ops`).
    pub name: String,
    /// `test`, `bench`, `bin`, …
    pub kind: String,
    /// Package name without the `ptl-` prefix (e.g. `capture`).
    pub krate: String,
    /// Built as a test harness (`--tests` also builds each binary target as one).
    pub test_harness: bool,
}

/// Runs `cargo build --release <args> <extra>` in the workspace root and returns the executables.
pub(crate) fn build(step: &str, args: &[&str], extra: &[String]) -> Result<Vec<Artifact>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(crate::workspace_root())
        .args(["build", "--release", "--message-format=json-render-diagnostics"])
        .args(args)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    eprintln!("{step}: {cmd:?}");
    let out = cmd.output().map_err(|e| format!("{step}: running cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("{step}: cargo build failed ({})", out.status));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if v["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = v["executable"].as_str() else { continue };
        // package id: "path+file:///…/capture#ptl-capture@0.1.0" -> "capture"
        let pkg = v["package_id"].as_str().unwrap_or("").rsplit('#').next().unwrap_or("").split('@').next().unwrap_or("");
        found.push(Artifact {
            exe: PathBuf::from(exe),
            name: v["target"]["name"].as_str().unwrap_or("").to_string(),
            kind: v["target"]["kind"][0].as_str().unwrap_or("").to_string(),
            krate: pkg.strip_prefix("ptl-").unwrap_or(pkg).to_string(),
            test_harness: v["profile"]["test"].as_bool().unwrap_or(false),
        });
    }
    Ok(found)
}

/// Copies `src` to `dst`, strips it, and returns its size.
pub(crate) fn copy_stripped(src: &Path, dst: &Path) -> Result<u64, String> {
    std::fs::copy(src, dst).map_err(|e| format!("copying {} -> {}: {e}", src.display(), dst.display()))?;
    let _ = Command::new("strip").arg(dst).status();
    Ok(std::fs::metadata(dst).map(|m| m.len()).unwrap_or(0))
}

/// `bin`, unpacked from `bin.xz` first when only the compressed copy is there (a pack's binaries
/// travel xz-compressed); the path to run.
pub(crate) fn unpacked(bin: &Path) -> Result<PathBuf, String> {
    let xz = PathBuf::from(format!("{}.xz", bin.display()));
    if !bin.exists() && xz.exists() {
        let status = std::process::Command::new("xz")
            .args(["-d", "-f"])
            .arg(&xz)
            .status()
            .map_err(|e| format!("unpacking {} (is xz installed?): {e}", xz.display()))?;
        if !status.success() {
            return Err(format!("unpacking {} failed ({status})", xz.display()));
        }
    }
    Ok(bin.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packed `name.xz` unpacks to `name` on first use; an unpacked binary is used as it is.
    #[test]
    fn a_compressed_binary_unpacks_on_first_use() {
        let dir = std::env::temp_dir().join(format!("ptl-unpacked-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("tool");
        std::fs::write(&bin, b"#!/bin/sh\necho packed\n").unwrap();
        assert_eq!(unpacked(&bin).unwrap(), bin, "an unpacked file is used as it is");
        match Command::new("xz").arg("-f").arg(&bin).status() {
            Ok(st) if st.success() => {
                assert!(!bin.exists());
                assert_eq!(unpacked(&bin).unwrap(), bin);
                assert_eq!(std::fs::read(&bin).unwrap(), b"#!/bin/sh\necho packed\n");
            }
            _ => println!("no xz tool on this machine: only the unpacked case was checked"),
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

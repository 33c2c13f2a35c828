//! The repository stays small enough to clone and to carry: its tracked files under 50 MB, the
//! reference tensors (`goldens/`) at most 25 MB, the shipped checkpoint at most 8 MB, and every
//! measurement record packed (`results/<record>/`: README, pictures, run scripts and one
//! `raw.tar.xz`, written by `cargo xtask record`). Reads the file list from git; without git (an
//! unpacked source archive) the test says so and passes, except under `CI`, where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

const TRACKED_MAX: u64 = 50_000_000;
const GOLDENS_MAX: u64 = 25_000_000;
const CHECKPOINT_MAX: u64 = 8_000_000;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The tracked files that exist in the working tree (a deletion not yet committed does not count).
fn tracked() -> Option<Vec<(PathBuf, u64)>> {
    let out = Command::new("git").args(["ls-files", "-z"]).current_dir(root()).output().ok().filter(|o| o.status.success())?;
    let files = out
        .stdout
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .filter_map(|p| {
            let rel = PathBuf::from(String::from_utf8_lossy(p).into_owned());
            std::fs::metadata(root().join(&rel)).ok().map(|m| (rel, m.len()))
        })
        .collect();
    Some(files)
}

fn total(files: &[(PathBuf, u64)], under: &str) -> u64 {
    files.iter().filter(|(p, _)| p.starts_with(under)).map(|(_, n)| n).sum()
}

#[test]
fn tracked_files_stay_within_their_budgets() {
    let Some(files) = tracked() else {
        assert!(std::env::var_os("CI").is_none(), "CI is set but `git ls-files` did not run: the size check needs the checkout's git");
        println!("skipping: no git checkout here, the repository's size is not checked");
        return;
    };
    assert!(files.len() > 100, "only {} tracked files found: the file list is wrong", files.len());
    let all: u64 = files.iter().map(|(_, n)| n).sum();
    let goldens = total(&files, "goldens");
    let checkpoint = total(&files, "assets/yolo26n-pose-synth.ckpt");
    println!("tracked files {all} bytes, goldens {goldens}, shipped checkpoint {checkpoint}, results {}", total(&files, "results"));
    assert!(checkpoint > 0, "assets/yolo26n-pose-synth.ckpt is not tracked: the README's main job needs it");
    assert!(all <= TRACKED_MAX, "the tracked files take {all} bytes, over {TRACKED_MAX}");
    assert!(goldens <= GOLDENS_MAX, "goldens/ takes {goldens} bytes, over {GOLDENS_MAX}");
    assert!(checkpoint <= CHECKPOINT_MAX, "the shipped checkpoint takes {checkpoint} bytes, over {CHECKPOINT_MAX}");
}

#[test]
fn every_record_is_packed() {
    let Some(files) = tracked() else {
        assert!(std::env::var_os("CI").is_none(), "CI is set but `git ls-files` did not run: the record check needs the checkout's git");
        println!("skipping: no git checkout here, the records are not checked");
        return;
    };
    let loose: Vec<String> = files
        .iter()
        .filter_map(|(p, _)| p.strip_prefix("results").ok())
        .filter(|rel| rel.components().count() >= 2)
        .filter(|rel| {
            let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let top = rel.components().count() == 2;
            !((top && (name == "README.md" || name == "raw.tar.xz")) || name.ends_with(".png") || name.ends_with(".sh"))
        })
        .map(|rel| rel.display().to_string())
        .collect();
    assert!(loose.is_empty(), "records with files outside their raw.tar.xz (pack them: cargo xtask record results/<record>): {loose:?}");
}

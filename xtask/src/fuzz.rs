//! `cargo xtask fuzz`: long fuzzing runs of the parsers that read user files.
//!
//! Default: libFuzzer through `cargo +nightly fuzz` (coverage-guided; `cargo install cargo-fuzz`),
//! each target `--runs` executions (default 1,000,000) starting from `fuzz/corpus/<target>`; new
//! inputs that add coverage are merged with that corpus into its smallest set of the same coverage
//! (it is committed, and CI's smoke test replays it). `--runs 0` only minimises the corpus. `--stable`: the mutation harness of `ptl_data::fuzz` (no coverage feedback) in a
//! release build, for machines without nightly.

use std::process::Command;

const TARGETS: [&str; 4] = ["labels", "dataset_yaml", "coco_json", "image_header"];

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut runs: u64 = 1_000_000;
    let mut only: Option<String> = None;
    let mut stable = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runs" => runs = it.next().and_then(|v| v.parse().ok()).ok_or("--runs wants a number")?,
            "--target" => only = Some(it.next().cloned().ok_or("--target wants a name")?),
            "--stable" => stable = true,
            other => return Err(format!("unknown option {other} (--runs N, --target {}, --stable)", TARGETS.join("|"))),
        }
    }
    let targets: Vec<&str> = TARGETS.iter().copied().filter(|t| only.as_deref().is_none_or(|o| o == *t)).collect();
    if targets.is_empty() {
        return Err(format!("unknown target (one of {})", TARGETS.join(", ")));
    }
    let root = crate::workspace_root();
    if stable {
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["test", "--release", "-p", "ptl-data", "--test", "fuzz_smoke", "--", "--nocapture", "every_target"])
            .env("PTL_FUZZ_EXECS", runs.to_string())
            .current_dir(&root)
            .status()
            .map_err(|e| format!("cargo: {e}"))?;
        return if status.success() { Ok(()) } else { Err(format!("stable fuzzing failed ({status})")) };
    }
    let fuzz = root.join("fuzz");
    let mut report = Vec::new();
    for t in targets {
        let work = std::env::temp_dir().join(format!("ptl-fuzz-{t}"));
        std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
        let corpus = fuzz.join("corpus").join(t);
        eprintln!("fuzz: {t}: {runs} runs (libFuzzer), corpus {}", corpus.display());
        let out = Command::new("cargo")
            .args(["+nightly", "fuzz", "run", "-O", t])
            .arg(&work)
            .arg(&corpus)
            .arg("--")
            .args([format!("-runs={runs}"), "-max_len=65536".into(), "-rss_limit_mb=4096".into(), "-malloc_limit_mb=2048".into()])
            .args(["-timeout=10", "-print_final_stats=1"])
            .current_dir(&fuzz)
            .output()
            .map_err(|e| format!("cargo +nightly fuzz: {e} (install it: cargo install cargo-fuzz; or use --stable)"))?;
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        let done = log.lines().find(|l| l.starts_with("Done ")).unwrap_or("(no summary)").to_string();
        if !out.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            return Err(format!(
                "{t}: libFuzzer found a crash ({}):\n{}",
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            ));
        }
        // Keep the smallest set of inputs with the coverage of the old corpus and the new finds
        // (libFuzzer's merge into an empty folder), so the committed corpus stays small; the old
        // corpus is replaced only when the merge succeeded.
        let minimal = std::env::temp_dir().join(format!("ptl-fuzz-{t}-minimal"));
        let _ = std::fs::remove_dir_all(&minimal);
        std::fs::create_dir_all(&minimal).map_err(|e| format!("{}: {e}", minimal.display()))?;
        let merged = Command::new("cargo")
            .args(["+nightly", "fuzz", "run", "-O", t])
            .arg(&minimal)
            .arg(&corpus)
            .arg(&work)
            .args(["--", "-merge=1", "-max_len=65536", "-rss_limit_mb=4096", "-malloc_limit_mb=2048", "-timeout=10"])
            .current_dir(&fuzz)
            .output()
            .map_err(|e| format!("merge: {e}"))?;
        if merged.status.success() {
            replace_corpus(&corpus, &minimal)?;
        }
        let files = std::fs::read_dir(&corpus).map(|r| r.count()).unwrap_or(0);
        report
            .push(format!("{t}: {done}; 0 crashes; corpus {files} files{}", if merged.status.success() { "" } else { " (merge failed)" }));
    }
    for r in &report {
        println!("{r}");
    }
    Ok(())
}

/// Replaces the files of `corpus` with those of `minimal` (a libFuzzer merge's result, which keeps
/// every coverage feature of the inputs it read): new files are copied in first, then the files
/// `minimal` does not hold are removed.
fn replace_corpus(corpus: &std::path::Path, minimal: &std::path::Path) -> Result<(), String> {
    let names = |dir: &std::path::Path| -> Result<std::collections::BTreeSet<std::ffi::OsString>, String> {
        Ok(std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?.flatten().map(|e| e.file_name()).collect())
    };
    let keep = names(minimal)?;
    if keep.is_empty() {
        return Err(format!("the merge into {} kept no input: the corpus stays as it was", minimal.display()));
    }
    for name in &keep {
        let dst = corpus.join(name);
        if !dst.exists() {
            std::fs::copy(minimal.join(name), &dst).map_err(|e| format!("{}: {e}", dst.display()))?;
        }
    }
    for name in names(corpus)?.difference(&keep) {
        let old = corpus.join(name);
        std::fs::remove_file(&old).map_err(|e| format!("{}: {e}", old.display()))?;
    }
    Ok(())
}

//! What the CLI test binaries share: running `ptl-ext` and a tiny synthetic dataset.
#![allow(dead_code)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};

/// `ptl data synth` options of the tiny dataset: 8 + 2 background training images at 64 px.
pub const SYNTH_OPTIONS: [&str; 10] = ["--train", "8", "--background", "2", "--val", "2", "--imgsz", "64", "--seed", "3"];

/// The `ptl-ext` binary: `$PTL_BIN` when set (the GPU pack carries its own copy), else the one
/// cargo built.
pub fn ptl_bin() -> PathBuf {
    std::env::var_os("PTL_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ptl-ext")))
}

/// Runs `ptl-ext ARGS` in `cwd` (kernel cache inside it) to completion.
pub fn ptl(args: &[&str], cwd: &Path) -> Output {
    Command::new(ptl_bin()).args(args).current_dir(cwd).env("PTL_CACHE", cwd.join("cache")).output().expect("run ptl-ext")
}

/// stdout then stderr.
pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The tiny dataset made under `dir`; its `data.yaml`.
pub fn synth(dir: &Path) -> PathBuf {
    let out = dir.join("ds");
    let out_arg = out.display().to_string();
    let mut args = vec!["data", "synth", "--out", &out_arg];
    args.extend(SYNTH_OPTIONS);
    let o = ptl(&args, dir);
    assert!(o.status.success(), "{}", text(&o));
    out.join("data.yaml")
}

/// A run's `summary.json`.
pub fn summary(dir: &Path) -> serde_json::Value {
    let path = dir.join("summary.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `ptl-ext train ARGS EXTRA` in `cwd` to completion.
pub fn train(args: &[String], extra: &[&str], cwd: &Path) -> Output {
    let mut all: Vec<&str> = vec!["train"];
    all.extend(args.iter().map(String::as_str));
    all.extend(extra);
    ptl(&all, cwd)
}

/// A child process that is killed (and reaped) if the test ends while it runs.
pub struct Running(pub Option<Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

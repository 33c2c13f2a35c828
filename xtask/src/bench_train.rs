//! `cargo xtask bench-train`: the benchmark workload of issue 8 (YOLO26n-pose, batch 4, 640 px,
//! bf16-mixed, mosaic every epoch, MuSGD forced, nominal batch 64, seed 347, 5 epochs over the
//! synthetic 512-image set with 226 backgrounds and 15 validation images), each run in a fresh
//! process. `--pack` writes the release `ptl` binary and a `bench_train.sh` into `train-pack/`
//! for the GPU machine instead of running here.

use std::path::{Path, PathBuf};
use std::process::Command;

const SCRIPT: &str = r#"#!/usr/bin/env bash
# Benchmark workload on the GPU machine. Usage: bash bench_train.sh [epochs] [precisions...]
set -u
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
EPOCHS=${1:-5}; shift || true
PRECS=${*:-bf16-mixed bf16-mixed 32-true 16-mixed}
WORK=${WORK:-/tmp/ptl-bench}
mkdir -p "$WORK"
[ -f "$WORK/synth/data.yaml" ] || ./ptl data synth --out "$WORK/synth" --train 512 --background 226 --val 15 --imgsz 640 --seed 347 || exit 1
i=0
for p in $PRECS; do
  i=$((i+1))
  echo "=== run $i: $p, $EPOCHS epochs"
  ./ptl train data="$WORK/synth/data.yaml" epochs="$EPOCHS" batch=4 imgsz=640 optimizer=MuSGD close_mosaic=0 seed=347 \
      plots=false project="$WORK/run$i-$p" --device cuda:0 --precision "$p" > "$OUT/train_run$i.log" 2>&1
  echo "exit $?"; tail -n 14 "$OUT/train_run$i.log"
  cp "$WORK/run$i-$p/summary.json" "$OUT/summary_run$i.json" 2>/dev/null
done
"#;

fn root() -> PathBuf {
    crate::workspace_root()
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    crate::cargo("build ptl (release)", &["build", "--release", "-p", "ptl"])?;
    let bin = root().join("target/release/ptl");
    if args.iter().any(|a| a == "--pack") {
        let pack = root().join("train-pack");
        let _ = std::fs::remove_dir_all(&pack);
        std::fs::create_dir_all(&pack).map_err(|e| format!("creating {}: {e}", pack.display()))?;
        std::fs::copy(&bin, pack.join("ptl")).map_err(|e| format!("copying ptl: {e}"))?;
        let _ = Command::new("strip").arg(pack.join("ptl")).status();
        std::fs::write(pack.join("bench_train.sh"), SCRIPT).map_err(|e| format!("writing bench_train.sh: {e}"))?;
        eprintln!("bench-train: packed {} (run `bash train-pack/bench_train.sh` on the GPU machine)", pack.display());
        return Ok(());
    }
    let work = std::env::temp_dir().join("ptl-bench-train");
    run_workload(&bin, &work, args.iter().find_map(|a| a.strip_prefix("--epochs=")).unwrap_or("5"))
}

fn run_workload(bin: &Path, work: &Path, epochs: &str) -> Result<(), String> {
    let synth = work.join("synth");
    if !synth.join("data.yaml").exists() {
        let st = Command::new(bin)
            .args(["data", "synth", "--out"])
            .arg(&synth)
            .args(["--train", "512", "--background", "226", "--val", "15", "--imgsz", "640", "--seed", "347"])
            .status()
            .map_err(|e| format!("starting ptl: {e}"))?;
        if !st.success() {
            return Err("ptl data synth failed".into());
        }
    }
    let device = if cfg!(target_os = "linux") { "auto" } else { "cpu" };
    let st = Command::new(bin)
        .arg("train")
        .arg(format!("data={}", synth.join("data.yaml").display()))
        .args([
            format!("epochs={epochs}"),
            "batch=4".into(),
            "imgsz=640".into(),
            "optimizer=MuSGD".into(),
            "close_mosaic=0".into(),
            "seed=347".into(),
        ])
        .arg(format!("project={}", work.join("run").display()))
        .args(["--device", device, "--precision", "bf16-mixed"])
        .status()
        .map_err(|e| format!("starting ptl: {e}"))?;
    if !st.success() {
        return Err("ptl train failed".into());
    }
    let summary = std::fs::read_to_string(work.join("run/summary.json")).map_err(|e| format!("reading summary: {e}"))?;
    println!("{summary}");
    Ok(())
}

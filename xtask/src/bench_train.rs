//! `cargo xtask bench-train`: the benchmark workload of issue 8 (YOLO26n-pose, batch 4, 640 px,
//! bf16-mixed, mosaic every epoch, MuSGD forced, nominal batch 64, seed 347, 5 epochs over the
//! synthetic 512-image set with 226 backgrounds and 15 validation images), each run in a fresh
//! process. `--pack` writes the release `ptl` binary and a `bench_train.sh` into `train-pack/`
//! for the GPU machine instead of running here; `--with-ultralytics` adds the Ultralytics wheels and
//! the reference driver (into `ultra-pack/`) so the same script trains Ultralytics on the same dataset
//! folder (`ULTRA=…`).

use std::path::{Path, PathBuf};
use std::process::Command;

const SCRIPT: &str = r#"#!/usr/bin/env bash
# Benchmark workload (issue 8) on the GPU machine, optionally next to Ultralytics on the same folder.
# Usage: bash bench_train.sh [epochs] [runs...]   (default: 5 epochs; bf16-mixed bf16-mixed 32-true 16-mixed)
#   a run is a precision, optionally with an optimizer: 16-mixed@auto (default optimizer: MuSGD, the workload's)
# Env: OUT (logs, default ./out), WORK (scratch, default /tmp/ptl-bench),
#      ULTRA="auto MuSGD": also train Ultralytics 8.4.190 with those optimizers on the dataset `ptl data synth`
#      wrote (wheels and anchor_train.py from $ULTRA_PACK, default ../ultra-pack); ULTRA_FIRST=1 runs them first.
set -u
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
ULTRA_PACK=${ULTRA_PACK:-../ultra-pack}
EPOCHS=${1:-5}; shift || true
PRECS=${*:-bf16-mixed bf16-mixed 32-true 16-mixed}
WORK=${WORK:-/tmp/ptl-bench}
mkdir -p "$WORK"
now() { date +%s.%N; }
since() { python3 -c "print(round($(now) - $1, 1))"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; echo "cores: $(nproc)"
t=$(now)
[ -f "$WORK/synth/data.yaml" ] || ./ptl data synth --out "$WORK/synth" --train 512 --background 226 --val 15 --imgsz 640 --seed 347 \
    > "$OUT/synth.log" 2>&1 || { tail "$OUT/synth.log"; exit 1; }
echo "dataset ready ($(since $t) s): $WORK/synth"
status=0

run_ptl() {
  local i=0
  for spec in $PRECS; do
    i=$((i+1))
    local p=${spec%@*} opt=MuSGD
    [ "$spec" != "$p" ] && opt=${spec#*@}
    echo "=== ptl run $i: $p, optimizer $opt, $EPOCHS epochs"
    local t0; t0=$(now)
    ./ptl train data="$WORK/synth/data.yaml" epochs="$EPOCHS" batch=4 imgsz=640 optimizer="$opt" close_mosaic=0 seed=347 \
        plots=false project="$WORK/run$i-$p-$opt" --device cuda:0 --precision "$p" > "$OUT/train_run$i.log" 2>&1
    local rc=$?
    echo "exit $rc, process wall $(since $t0) s"; [ $rc -eq 0 ] || status=1
    tail -n 6 "$OUT/train_run$i.log"
    cp "$WORK/run$i-$p-$opt/summary.json" "$OUT/summary_run$i.json" 2>/dev/null
    cp "$WORK/run$i-$p-$opt/results.csv" "$OUT/results_run$i.csv" 2>/dev/null
  done
}

run_ultra() {
  [ -d "$ULTRA_PACK/whl" ] && [ -f "$ULTRA_PACK/anchor_train.py" ] || { echo "ULTRA set but no $ULTRA_PACK/{whl,anchor_train.py}"; status=1; return; }
  export PYTHONPATH=/tmp/ul_site YOLO_OFFLINE=1 YOLO_CONFIG_DIR=/tmp/ul_cfg PYTHONUNBUFFERED=1
  [ -d /tmp/ul_site/ultralytics ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/ul_site "$ULTRA_PACK"/whl/*.whl || { echo "pip install of the Ultralytics wheels failed"; status=1; return; }
  for opt in $ULTRA; do
    echo "=== ultralytics optimizer=$opt, $EPOCHS epochs"
    local t0; t0=$(now)
    ANCHOR_WORK=/tmp/ul_work-$opt python3 "$ULTRA_PACK/anchor_train.py" --data "$WORK/synth/data.yaml" --out "$OUT/ultra-$opt" \
        --epochs "$EPOCHS" --optimizer "$opt" > "$OUT/ultra-$opt.log" 2>&1
    local rc=$?
    echo "exit $rc, process wall $(since $t0) s"; [ $rc -eq 0 ] || status=1
    grep -a "\[anchor\] epoch\|optimizer:\|AMP" "$OUT/ultra-$opt.log" | cut -c1-300 | tail -n 8
  done
}

if [ -n "${ULTRA:-}" ] && [ "${ULTRA_FIRST:-0}" = 1 ]; then run_ultra; fi
[ "$PRECS" != none ] && run_ptl
if [ -n "${ULTRA:-}" ] && [ "${ULTRA_FIRST:-0}" != 1 ]; then run_ultra; fi

python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
print("\n| run | precision / optimizer | complete s | step median ms (p10-p90) | peak alloc/reserved MiB | pose mAP50 per epoch | losses sha256 | library workspaces MiB |")
print("|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(out, "summary_run*.json"))):
    s = json.load(open(f))
    st = s.get("step_time") or {}
    mp = [dict(m).get("metrics/mAP50(P)") for m in s.get("metrics_per_epoch", [])]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"
    print(f"| ptl {os.path.basename(f)[8:-5]} | {s['precision']} / {s['optimizer']} | {s['total_runtime_s']:.1f} | "
          f"{st.get('median_ms', float('nan')):.1f} ({st.get('p10_ms', float('nan')):.1f}-{st.get('p90_ms', float('nan')):.1f}) | "
          f"{mib(s.get('peak_allocated_bytes'))}/{mib(s.get('peak_reserved_bytes'))} | "
          f"{' '.join('-' if v is None else f'{v:.3f}' for v in mp)} | {s['hashes'].get('step_losses', '')[:16]} | {mib(s.get('library_workspace_bytes'))} |")
for f in sorted(glob.glob(os.path.join(out, "ultra-*", "anchor_train.json"))):
    r = json.load(open(f))
    st = r.get("step_time_post_warmup") or {}
    mp = [m.get("metrics/mAP50(P)") for m in r.get("metrics", [])]
    print(f"| ultralytics | {r.get('precision')} / {r.get('optimizer')} | {r.get('wall_total_s', float('nan')):.1f} | "
          f"{st.get('median_ms', float('nan')):.1f} ({st.get('p10_ms', float('nan')):.1f}-{st.get('p90_ms', float('nan')):.1f}) | "
          f"{r.get('max_memory_allocated_MiB', float('nan')):.0f}/{r.get('max_memory_reserved_MiB', float('nan')):.0f} | "
          f"{' '.join('-' if v is None else f'{v:.3f}' for v in mp)} | |")
hs = {}
for f in sorted(glob.glob(os.path.join(out, "summary_run*.json"))):
    s = json.load(open(f))
    hs.setdefault(f'{s["precision"]} / {s["optimizer"]}', []).append((os.path.basename(f), s["hashes"]))
for p, runs in hs.items():
    if len(runs) > 1:
        same = all(h == runs[0][1] for _, h in runs[1:])
        print(f"{p}: {len(runs)} runs, all hashes identical: {same}")
EOF
echo "bench-train exit status $status"
exit $status
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
        if args.iter().any(|a| a == "--with-ultralytics") {
            pack_ultralytics(&root().join("ultra-pack"))?;
        }
        eprintln!("bench-train: packed {} (run `bash train-pack/bench_train.sh` on the GPU machine)", pack.display());
        return Ok(());
    }
    let work = std::env::temp_dir().join("ptl-bench-train");
    run_workload(&bin, &work, args.iter().find_map(|a| a.strip_prefix("--epochs=")).unwrap_or("5"))
}

/// Copies the Ultralytics wheels (`$PTL_ULTRA_WHEELS`, default `.whl/`) and the reference driver
/// `anchor_train.py` (`$PTL_ULTRA_ANCHOR`, default `../shared/reference/ultralytics-anchor/`) into
/// `ultra-pack/` (kept apart from `train-pack/`: the wheels are ~56 MB), so that
/// `ULTRA="auto MuSGD" bash train-pack/bench_train.sh` trains Ultralytics on the same dataset folder.
fn pack_ultralytics(pack: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(pack);
    let wheels = std::env::var_os("PTL_ULTRA_WHEELS").map(PathBuf::from).unwrap_or_else(|| root().join(".whl"));
    let anchor = std::env::var_os("PTL_ULTRA_ANCHOR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("../shared/reference/ultralytics-anchor/anchor_train.py"));
    let dst = pack.join("whl");
    std::fs::create_dir_all(&dst).map_err(|e| format!("creating {}: {e}", dst.display()))?;
    let entries = std::fs::read_dir(&wheels).map_err(|e| {
        format!(
            "{}: {e} (download ultralytics==8.4.190, ultralytics-thop==2.2.3, polars==2.1.0, polars-runtime-32==2.1.0 \
             wheels there, or set PTL_ULTRA_WHEELS)",
            wheels.display()
        )
    })?;
    let mut n = 0;
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "whl") {
            std::fs::copy(&p, dst.join(e.file_name())).map_err(|e| format!("copying {}: {e}", p.display()))?;
            n += 1;
        }
    }
    if n == 0 {
        return Err(format!("no .whl files in {}", wheels.display()));
    }
    std::fs::copy(&anchor, pack.join("anchor_train.py"))
        .map_err(|e| format!("copying {}: {e} (set PTL_ULTRA_ANCHOR)", anchor.display()))?;
    eprintln!("bench-train: packed {n} Ultralytics wheels and anchor_train.py");
    Ok(())
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

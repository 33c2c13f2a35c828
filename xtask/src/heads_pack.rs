//! `cargo xtask heads-pack`: the model (ptl-heads) on the GPU machine, next to PyTorch.
//!
//! Builds ptl-heads' golden tests (`golden_forward`, `stems_and_grads`; CUDA fp32 and bf16
//! variants included) and the `forward_backward` bench (release, `cuda`), and packs them with the
//! golden model files they read, `torch_heads.py` (Ultralytics' own YOLO26n-pose in PyTorch: the
//! same forward+backward timing, and bf16-vs-fp32 deviation with the golden weights) and the two
//! wheels it needs (ultralytics, ultralytics-thop from `$PTL_ULTRA_WHEELS`, default `.whl/`) into
//! `heads-pack/` (git-ignored). On the GPU machine: `bash heads-pack/run.sh`; logs go to `$OUT`.

use std::path::{Path, PathBuf};

const RUN_SH: &str = r#"#!/usr/bin/env bash
# ptl-heads on the GPU: golden tests (CUDA fp32/bf16), forward+backward bench, PyTorch side by side.
set -u
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PTL_GOLDENS=$PWD/goldens
status=0
for t in test_*; do
  echo "=== $t"
  timeout 300 ./"$t" --test-threads=1 --nocapture > "$OUT/$t.log" 2>&1
  rc=$?
  grep -E "^(test |ok |skipping|SKIP|test result|failures:|.*panicked)|max rel|rel dev" "$OUT/$t.log" | cut -c1-300 | head -n 60
  [ $rc -eq 0 ] || { status=1; tail -n 30 "$OUT/$t.log"; }
done
echo "=== ptl forward+backward (b4, 640 px)"
for mode in "" --bf16; do ./bench_forward_backward --device cuda:0 --iters 10 $mode 2>&1 | tail -n 2; done | tee "$OUT/bench_ptl.log"
echo "=== PyTorch (Ultralytics YOLO26n-pose)"
# A fresh private folder for the install (never one that was there before).
site=$(mktemp -d "${TMPDIR:-/tmp}/heads_site.XXXXXX") && cfg=$(mktemp -d "${TMPDIR:-/tmp}/heads_cfg.XXXXXX") || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" whl/*.whl || status=1
PYTHONPATH="$site" YOLO_OFFLINE=1 YOLO_CONFIG_DIR="$cfg" timeout 300 python3 torch_heads.py "$PTL_GOLDENS" "$OUT" \
    > "$OUT/torch_heads.log" 2>&1 || { status=1; tail -n 30 "$OUT/torch_heads.log"; }
grep -E "^pytorch|^  " "$OUT/torch_heads.log"
echo "heads-pack exit status $status"
exit $status
"#;

fn root() -> PathBuf {
    crate::workspace_root()
}

fn copy(src: &Path, dst: &Path) -> Result<u64, String> {
    std::fs::copy(src, dst).map_err(|e| format!("copying {} -> {}: {e}", src.display(), dst.display()))
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let root = root();
    let pack = root.join("heads-pack");
    let artifacts = crate::artifacts::build(
        "heads-pack",
        &["-p", "ptl-heads", "--features", "cuda", "--test", "golden_forward", "--test", "stems_and_grads", "--bench", "forward_backward"],
        args,
    )?;
    let _ = std::fs::remove_dir_all(&pack);
    std::fs::create_dir_all(pack.join("goldens/model")).map_err(|e| format!("creating {}: {e}", pack.display()))?;
    std::fs::create_dir_all(pack.join("whl")).map_err(|e| format!("creating {}: {e}", pack.display()))?;
    let mut total = 0u64;
    for a in artifacts {
        total += crate::artifacts::copy_stripped(&a.exe, &pack.join(format!("{}_{}", a.kind, a.name)))?;
    }
    let goldens = ptl_goldens::dir();
    for f in ["weights.safetensors", "forward.safetensors", "forward_layers.safetensors", "forward.json", "params.json"] {
        total += copy(&goldens.join("model").join(f), &pack.join("goldens/model").join(f))?;
    }
    let wheels = std::env::var_os("PTL_ULTRA_WHEELS").map(PathBuf::from).unwrap_or_else(|| root.join(".whl"));
    let mut n = 0;
    for e in std::fs::read_dir(&wheels).map_err(|e| format!("{}: {e} (set PTL_ULTRA_WHEELS)", wheels.display()))?.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with("ultralytics") && name.ends_with(".whl") {
            total += copy(&e.path(), &pack.join("whl").join(&name))?;
            n += 1;
        }
    }
    if n < 2 {
        return Err(format!("expected the ultralytics and ultralytics-thop wheels in {}", wheels.display()));
    }
    copy(&root.join("heads/benches/torch_heads.py"), &pack.join("torch_heads.py"))?;
    std::fs::write(pack.join("run.sh"), RUN_SH).map_err(|e| format!("writing run.sh: {e}"))?;
    eprintln!(
        "heads-pack: {:.1} MiB in {}; run `bash heads-pack/run.sh` on the GPU machine",
        total as f64 / (1 << 20) as f64,
        pack.display()
    );
    Ok(())
}

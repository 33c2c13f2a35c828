//! `cargo xtask device-pack`: builds the CUDA test and bench binaries of ptl-autograd, ptl-data,
//! ptl-capture and ptl-trainer (release, `cuda` feature), strips them and copies them with `run.sh`,
//! the PyTorch reference script and the goldens' unpacker into `device-pack/` (git-ignored): the
//! pack lives in the checkout, so run.sh unpacks the goldens the GPU tests read from the
//! repository's packed copy (`goldens/data`) instead of carrying a second one. On the GPU machine run `bash device-pack/run.sh`; logs go to `$OUT`.
//! Binaries are named `test_<crate>_<target>`; the weight-copy test of `cuda_ops` and the replay
//! fits of `cuda_replay` run a second time with the weight copies in O, I, H, W order
//! (`PTL_WEIGHT_KRSC=0`), and `cuda_ops`, ptl-capture's `cuda_capture` and the replay fits without
//! programmatic dependent launch (`PTL_PDL=0`); `T14` of ptl-capture also runs under
//! `compute-sanitizer` when the GPU machine has it; `NCU_BN=1` profiles the BatchNorm kernels of the
//! CUDA fit test with Nsight Compute. The binaries travel xz-compressed (`<name>.xz`, a third of
//! their size; run.sh unpacks them first) when the `xz` tool is here.

use std::path::{Path, PathBuf};

const MAX_BYTES: u64 = 64 << 20;

const RUN_SH: &str = r#"#!/usr/bin/env bash
# CUDA tests + GPU micro-benchmark (ptl vs PyTorch). Logs go to $OUT (default: ./out beside this file).
set -u
cd "$(dirname "$0")"
# Binaries packed xz-compressed are unpacked once (the .xz goes).
for z in *.xz; do
  [ -f "$z" ] && { xz -d -f "$z" && chmod +x "${z%.xz}"; }
done
# The goldens: the repository's packed copy beside this folder, unpacked here once (or
# $PTL_GOLDENS when set).
if [ -z "${PTL_GOLDENS:-}" ] && [ -d ../goldens/data ]; then
  [ -d goldens ] || python3 unpack_goldens.py ../goldens/data goldens || echo "run.sh: unpacking ../goldens/data failed"
fi
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export OUT
(nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv) > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
status=0
[ -z "${PTL_GOLDENS:-}" ] && [ -d goldens ] && export PTL_GOLDENS=$PWD/goldens
# The optimizer goldens run on the GPU here (on the CPU in CI).
export PTL_OPTIM_DEVICE=cuda:0
# The command line's CUDA tests run the packed ptl binary.
[ -x ptl-ext ] && export PTL_BIN=$PWD/ptl-ext
for t in test_*; do
  [ -x "$t" ] || continue
  echo "=== $t"
  start=$(date +%s.%N)
  timeout 300 ./"$t" --test-threads=1 --nocapture > "$OUT/$t.log" 2>&1
  rc=$?
  echo "($t: rc=$rc, $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s)"
  grep -E "^(ok |bench |skipping|test result|test .* FAILED|failures:|.*panicked|loss case|warning: ptl-capture)" "$OUT/$t.log" | cut -c1-400
  [ $rc -eq 0 ] || { status=1; tail -n 40 "$OUT/$t.log"; }
done
# Switches of the defaults, a second run of the tests they touch: the weight copies in O, I, H, W
# order (PTL_WEIGHT_KRSC=0: the copies' test and the replayed fits) and no programmatic dependent
# launch (PTL_PDL=0: every op test, the recorder's tests and the replayed fits).
switched() { # VAR=VALUE binary filter
  [ -x "$2" ] || return 0
  echo "=== $1 $2 $3"
  local log="$OUT/${1%%=*}_$2.log"
  env "$1" timeout 300 ./"$2" "$3" --test-threads=1 --nocapture > "$log" 2>&1
  local rc=$?
  grep -E "^(ok |test result|test .* FAILED|.*panicked|dependent launch)" "$log" | cut -c1-400
  [ $rc -eq 0 ] || { status=1; tail -n 40 "$log"; }
}
switched PTL_WEIGHT_KRSC=0 test_autograd_cuda_ops autocast_weight_copies
switched PTL_WEIGHT_KRSC=0 test_plugins_cuda_replay cuda_
switched PTL_PDL=0 test_autograd_cuda_ops ""
switched PTL_PDL=0 test_capture_cuda_capture ""
switched PTL_PDL=0 test_plugins_cuda_replay cuda_
# Under the memory checker: teardown safety (docs/capture.md I14) and the allocator's block cache
# (reuse across an eager/captured boundary).
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
memcheck() { # log-name binary filter
  echo "=== compute-sanitizer memcheck: $2 $3"
  timeout 300 "$SAN" --tool memcheck --error-exitcode 7 ./"$2" "$3" --test-threads=1 --nocapture > "$OUT/sanitizer_$1.log" 2>&1
  local rc=$?
  grep -E "ERROR SUMMARY|^ok |test result" "$OUT/sanitizer_$1.log"
  [ $rc -eq 0 ] || { status=1; tail -n 40 "$OUT/sanitizer_$1.log"; }
}
if [ -n "$SAN" ] && [ -x test_capture_cuda_capture ] && [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  memcheck t14 test_capture_cuda_capture t14
  memcheck block_cache test_autograd_cuda_ops block_cache
else
  echo "memcheck runs skipped (SKIP_SANITIZER=1, or no compute-sanitizer on this machine)"
fi
# NCU_BN=1: Nsight Compute on the BatchNorm kernels of the CUDA fit test (occupancy, launch
# statistics, warp stalls, speed of light: why the reductions run far from bandwidth).
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ "${NCU_BN:-0}" = 1 ] && [ -n "$NCU" ] && [ -x test_trainer_cuda_fit ]; then
  echo "=== ncu: batch-norm kernels"
  timeout 400 "$NCU" --clock-control none --kernel-name regex:'bn_stats|bnb_reduce|chaffine|bnb_dx' --launch-skip 1000 --launch-count 48 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --csv \
    ./test_trainer_cuda_fit --test-threads=1 > "$OUT/ncu_bn.csv" 2> "$OUT/ncu_bn.log"
  echo "(ncu rc=$?, $(wc -l < "$OUT/ncu_bn.csv") lines in ncu_bn.csv)"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "=== bench_cuda_ops"
  ./bench_cuda_ops > "$OUT/bench_ours.log" 2>&1 || status=1
  PY=/opt/torch/.venv/bin/python3
  [ -x "$PY" ] || PY=python3
  "$PY" torch_ops.py "$OUT" > "$OUT/bench_torch.log" 2>&1 || status=1
  "$PY" torch_ops.py --table "$OUT" | tee "$OUT/bench_table.md"
  grep -E "peak" "$OUT/bench_ours.log"
fi
echo "device-pack exit status $status"
exit $status
"#;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

/// The test binaries that read goldens (packed beside the `cuda_*` ones).
const GOLDEN_TESTS: [&str; 2] = ["loss_cuda", "optim_golden"];

/// Compresses each binary in place to `<name>.xz` with the `xz` tool
/// (multi-threaded, preset 6); returns the bytes saved, or `None` when there is no `xz` here (the
/// pack stays uncompressed).
pub(crate) fn compress(binaries: &[PathBuf]) -> Result<Option<u64>, String> {
    if std::process::Command::new("xz").arg("--version").output().is_err() {
        eprintln!("device-pack: no `xz` tool here; the binaries travel uncompressed");
        return Ok(None);
    }
    let mut saved = 0u64;
    for b in binaries {
        let before = std::fs::metadata(b).map(|m| m.len()).map_err(|e| format!("{}: {e}", b.display()))?;
        let status = std::process::Command::new("xz")
            .args(["-T0", "-6", "-f"])
            .arg(b)
            .status()
            .map_err(|e| format!("running xz on {}: {e}", b.display()))?;
        if !status.success() {
            return Err(format!("xz failed on {} ({status})", b.display()));
        }
        let xz = PathBuf::from(format!("{}.xz", b.display()));
        let after = std::fs::metadata(&xz).map(|m| m.len()).map_err(|e| format!("{}: {e}", xz.display()))?;
        saved += before.saturating_sub(after);
    }
    Ok(Some(saved))
}

pub fn run(args: &[String]) -> Result<(), String> {
    // `--only a,b`: pack only the binaries whose names contain one of these (the 64 MiB carry
    // limit holds a subset when large goldens travel too); the rest goes to cargo.
    let mut only: Vec<String> = Vec::new();
    let mut rest: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--only" => only = it.next().ok_or("--only needs a list of names")?.split(',').map(str::to_string).collect(),
            _ => rest.push(a.clone()),
        }
    }
    let args = &rest[..];
    let root = root();
    let pack = root.join("device-pack");
    let mut artifacts = crate::artifacts::build(
        "device-pack",
        &[
            "-p",
            "ptl-autograd",
            "-p",
            "ptl-data",
            "-p",
            "ptl-capture",
            "-p",
            "ptl-trainer",
            "-p",
            "ptl-plugins",
            "--features",
            "cuda",
            "--tests",
            "--benches",
        ],
        args,
    )?;
    // The command line's CUDA tests (`tests/tests/cuda_*.rs`: `cuda_cli`, `cuda_multi_gpu`) run
    // the `ptl-ext` binary, packed beside them (run.sh points PTL_BIN at it).
    let cli_wanted = only.is_empty() || only.iter().any(|o| o.contains("cli") || o.contains("multi_gpu"));
    if cli_wanted {
        artifacts.extend(crate::artifacts::build("device-pack", &["-p", "ptl-tests", "--tests", "--bins"], args)?);
    }
    let _ = std::fs::remove_dir_all(&pack);
    std::fs::create_dir_all(&pack).map_err(|e| format!("creating {}: {e}", pack.display()))?;
    let mut total = 0u64;
    let mut copied = Vec::new();
    for a in artifacts {
        let (name, kind) = (a.name.as_str(), a.kind.as_str());
        if kind == "bin" && name == "ptl-ext" && cli_wanted && !a.test_harness {
            total += crate::artifacts::copy_stripped(&a.exe, &pack.join("ptl-ext"))?;
            continue;
        }
        let wanted = name.starts_with("cuda_") || (kind == "test" && GOLDEN_TESTS.contains(&name));
        let selected = only.is_empty() || only.iter().any(|o| name.contains(o.as_str()));
        if !wanted || !selected || !(kind == "test" || kind == "bench") {
            continue;
        }
        let dst = pack.join(if kind == "bench" { format!("{kind}_{name}") } else { format!("{kind}_{}_{name}", a.krate) });
        total += crate::artifacts::copy_stripped(&a.exe, &dst)?;
        copied.push(dst);
    }
    if copied.is_empty() {
        return Err("no CUDA test/bench binaries were produced (is the `cuda` feature wired?)".into());
    }
    std::fs::copy(root.join("autograd/benches/torch_ops.py"), pack.join("torch_ops.py"))
        .map_err(|e| format!("copying torch_ops.py: {e}"))?;
    std::fs::copy(root.join("xtask/assets/unpack_goldens.py"), pack.join("unpack_goldens.py"))
        .map_err(|e| format!("copying unpack_goldens.py: {e}"))?;
    let run = pack.join("run.sh");
    std::fs::write(&run, RUN_SH).map_err(|e| format!("writing run.sh: {e}"))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755));
    }
    let packed: Vec<PathBuf> = copied.iter().cloned().chain(cli_wanted.then(|| pack.join("ptl-ext")).filter(|p| p.exists())).collect();
    if let Some(saved) = compress(&packed)? {
        total -= saved;
    }
    if total > MAX_BYTES {
        return Err(format!("device pack is {total} bytes, over the 64 MiB limit"));
    }
    for c in &copied {
        eprintln!("device-pack: {}", c.display());
    }
    eprintln!(
        "device-pack: {} binaries, {:.1} MiB, in {}; run `bash device-pack/run.sh` on the GPU machine",
        copied.len(),
        total as f64 / (1 << 20) as f64,
        pack.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With the `xz` tool a binary is replaced by `<name>.xz` that unpacks to the same bytes (what
    /// run.sh does on the GPU machine); without it the file stays as it was.
    #[test]
    fn binaries_travel_compressed_and_unpack_to_their_bytes() {
        let dir = std::env::temp_dir().join(format!("ptl-device-pack-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("test_x");
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&bin, &bytes).unwrap();
        match compress(std::slice::from_ref(&bin)).unwrap() {
            Some(saved) => {
                let xz = dir.join("test_x.xz");
                assert!(!bin.exists() && xz.exists(), "replaced by its .xz");
                assert!(saved > 100_000, "a repetitive file shrinks: saved {saved}");
                let status = std::process::Command::new("xz").args(["-d", "-f"]).arg(&xz).status().unwrap();
                assert!(status.success());
                assert_eq!(std::fs::read(&bin).unwrap(), bytes, "unpacks to the same bytes");
            }
            None => {
                println!("no xz tool on this machine: the pack stays uncompressed (checked: the file is untouched)");
                assert_eq!(std::fs::read(&bin).unwrap(), bytes);
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

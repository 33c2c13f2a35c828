//! `cargo xtask goldens --from DIR`: packs a full copy of the reference tensors (the files the
//! golden tests read, as the reference generator wrote them) into the repository's `goldens/data/`:
//! every file xz-compressed, a safetensors file's data section first split into four byte planes
//! (the float exponents then lie together and compress: ~8 % smaller than xz alone), and the one
//! reduction that keeps the copy under 25 MB: `model/loss.safetensors`' parameter gradients of
//! more than [`FULL_MAX`] values are kept as [`SAMPLES`] values at fixed positions
//! (`grad_sample.<name>`, positions ⌊j·n / SAMPLES⌋); the tests compare those and each tensor's
//! L2 norm and largest magnitude, which `model/loss.json` holds for every gradient.
//! `ptl-goldens`' build script undoes the planes and the compression.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Map, Value};

/// Gradients with at most this many values stay whole (what the tests expect: ptl-goldens says).
pub(crate) const FULL_MAX: usize = ptl_goldens::WHOLE_GRADIENT_MAX;
/// Values kept of a larger gradient, at `ptl_goldens::sample_positions`.
pub(crate) const SAMPLES: usize = ptl_goldens::GRADIENT_SAMPLES;

const HELP: &str = "usage: cargo xtask goldens --from DIR [--out goldens/data]
  packs the reference tensors of DIR (a full copy, e.g. ../shared/goldens) into the repository";

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let (mut from, mut out) = (None, root.join("goldens/data"));
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--from" => from = Some(PathBuf::from(it.next().ok_or("--from needs a folder")?)),
            "--out" => out = PathBuf::from(it.next().ok_or("--out needs a folder")?),
            _ => return Err(HELP.into()),
        }
    }
    let from = from.ok_or(HELP)?;
    let mut files = Vec::new();
    walk(&from, &mut files)?;
    files.sort();
    let (mut raw, mut packed) = (0u64, 0u64);
    for f in files {
        let rel = f.strip_prefix(&from).map_err(|e| e.to_string())?;
        if rel.extension().is_some_and(|e| e == "md") {
            continue; // the generator's notes: goldens/README.md says what the files are
        }
        let bytes = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        raw += bytes.len() as u64;
        let body = if rel.extension().is_some_and(|e| e == "safetensors") {
            let st = if rel == Path::new("model/loss.safetensors") { reduce_gradients(&bytes)? } else { bytes };
            ptl_goldens::to_planes(&st).map_err(|e| format!("{}: {e}", rel.display()))?
        } else {
            bytes
        };
        let dst = out.join(format!("{}.xz", rel.display()));
        std::fs::create_dir_all(dst.parent().unwrap_or(&out)).map_err(|e| e.to_string())?;
        let z = xz(&body)?;
        packed += z.len() as u64;
        std::fs::write(&dst, z).map_err(|e| format!("{}: {e}", dst.display()))?;
        eprintln!("goldens: {}", dst.display());
    }
    eprintln!("goldens: {:.1} MB of reference files packed into {:.1} MB in {}", raw as f64 / 1e6, packed as f64 / 1e6, out.display());
    Ok(())
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    for e in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let p = e.map_err(|e| e.to_string())?.path();
        if p.is_dir() {
            walk(&p, out)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

/// `xz -9e` of `data`, one thread (one block: what a plain decoder expects).
fn xz(data: &[u8]) -> Result<Vec<u8>, String> {
    let mut child = Command::new("xz")
        .args(["-9e", "-T1", "-c"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting xz (install xz-utils): {e}"))?;
    let mut stdin = child.stdin.take().ok_or("xz: no stdin")?;
    let input = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().map_err(|e| format!("xz: {e}"))?;
    writer.join().map_err(|_| "xz: writer panicked")?.map_err(|e| format!("xz: {e}"))?;
    if !out.status.success() {
        return Err(format!("xz failed: {}", out.status));
    }
    Ok(out.stdout)
}

/// `model/loss.safetensors` with every `grad.<name>` of more than [`FULL_MAX`] f32 values replaced
/// by `grad_sample.<name>`: [`SAMPLES`] values at positions ⌊j·n / SAMPLES⌋.
pub(crate) fn reduce_gradients(st: &[u8]) -> Result<Vec<u8>, String> {
    let (map, data) = ptl_goldens::safetensors_split(st).map_err(|e| e.to_string())?;
    let mut entries: Vec<(String, Value)> = map.into_iter().collect();
    let meta = entries.iter().position(|(k, _)| k == "__metadata__").map(|i| entries.remove(i));
    entries.sort_by_key(|(_, v)| v["data_offsets"][0].as_u64().unwrap_or(0));
    let mut header = Map::new();
    let mut meta_map = meta.and_then(|(_, v)| v.as_object().cloned()).unwrap_or_default();
    meta_map.insert(
        "ptl_reduced".into(),
        Value::String(format!(
            "grad.<name> of more than {FULL_MAX} values kept as grad_sample.<name>: {SAMPLES} values at positions floor(j*n/{SAMPLES})"
        )),
    );
    header.insert("__metadata__".into(), Value::Object(meta_map));
    let mut body = Vec::new();
    for (name, v) in entries {
        let (s, e) = (v["data_offsets"][0].as_u64().unwrap_or(0) as usize, v["data_offsets"][1].as_u64().unwrap_or(0) as usize);
        let bytes = data.get(s..e).ok_or_else(|| format!("{name}: offsets past the data"))?;
        let (key, kept, shape) = match name.strip_prefix("grad.") {
            Some(param) if v["dtype"] == "F32" && bytes.len() / 4 > FULL_MAX => {
                let n = bytes.len() / 4;
                let kept: Vec<u8> = ptl_goldens::sample_positions(n).flat_map(|i| bytes[4 * i..][..4].to_vec()).collect();
                (format!("grad_sample.{param}"), kept, Value::from(vec![SAMPLES]))
            }
            _ => (name.clone(), bytes.to_vec(), v["shape"].clone()),
        };
        let start = body.len();
        body.extend_from_slice(&kept);
        header.insert(key, serde_json::json!({ "dtype": v["dtype"], "shape": shape, "data_offsets": [start, body.len()] }));
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).map_err(|e| e.to_string())?;
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&body);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let mut header = Map::new();
        let mut body = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let s = body.len();
            body.extend_from_slice(bytes);
            header.insert(name.to_string(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [s, body.len()]}));
        }
        let h = serde_json::to_vec(&Value::Object(header)).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn large_gradients_keep_samples_at_fixed_positions_small_ones_stay_whole() {
        let big: Vec<u8> = (0..4096u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let small: Vec<u8> = (0..8u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let st = file(&[("grad.w", "F32", vec![64, 64], big), ("grad.b", "F32", vec![8], small.clone()), ("x", "F32", vec![8], small)]);
        let r = reduce_gradients(&st).unwrap();
        let (map, data) = ptl_goldens::safetensors_split(&r).unwrap();
        assert!(map.get("grad.w").is_none());
        let s = &map["grad_sample.w"];
        assert_eq!(s["shape"], serde_json::json!([SAMPLES]));
        let (a, b) = (s["data_offsets"][0].as_u64().unwrap() as usize, s["data_offsets"][1].as_u64().unwrap() as usize);
        let vals: Vec<f32> = data[a..b].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(vals.len(), SAMPLES);
        assert_eq!(vals[3], (3 * 4096 / SAMPLES) as f32);
        assert_eq!(map["grad.b"]["shape"], serde_json::json!([8]));
        assert!(map["__metadata__"]["ptl_reduced"].as_str().unwrap().contains("grad_sample"));
    }

    /// The unpacker a device pack's run.sh runs (Python: the GPU machine has no Rust toolchain)
    /// gives the bytes the build script gives.
    #[test]
    fn the_device_pack_unpacker_matches_the_build_script() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let dst = std::env::temp_dir().join(format!("ptl-unpack-goldens-{}", std::process::id()));
        let run =
            Command::new("python3").arg(root.join("xtask/assets/unpack_goldens.py")).arg(root.join("goldens/data")).arg(&dst).status();
        match run {
            Ok(st) => assert!(st.success(), "unpack_goldens.py failed: {st}"),
            Err(e) => {
                assert!(std::env::var_os("CI").is_none_or(|v| v.is_empty()), "python3 is needed (CI): {e}");
                eprintln!("SKIPPED: no python3 here ({e}): the device pack's unpacker was NOT checked");
                return;
            }
        }
        let mut ours = Vec::new();
        walk(ptl_goldens::unpacked(), &mut ours).unwrap();
        assert!(ours.len() > 20, "the build script unpacked {} files", ours.len());
        for f in ours {
            let rel = f.strip_prefix(ptl_goldens::unpacked()).unwrap();
            let theirs = std::fs::read(dst.join(rel)).unwrap_or_else(|e| panic!("{}: {e}", rel.display()));
            assert!(std::fs::read(&f).unwrap() == theirs, "{}: the unpackers differ", rel.display());
        }
        std::fs::remove_dir_all(&dst).ok();
    }
}

//! Unpacks `data/` (written by `cargo xtask goldens`) into `$OUT_DIR/goldens`: each `X.xz`
//! decompressed to `X`, and a safetensors file's data section put back from its four byte planes.

use std::path::{Path, PathBuf};

fn main() {
    // A build script reports a failure by exiting non-zero; cargo shows what it printed.
    if let Err(e) = unpack() {
        eprintln!("ptl-goldens: {e}");
        std::process::exit(1);
    }
}

fn unpack() -> Result<(), String> {
    let env = |k: &str| std::env::var(k).map(PathBuf::from).map_err(|e| format!("{k}: {e} (run by cargo?)"));
    let data = env("CARGO_MANIFEST_DIR")?.join("data");
    let out = env("OUT_DIR")?.join("goldens");
    println!("cargo:rerun-if-changed=data");
    let mut files = Vec::new();
    walk(&data, &mut files);
    if files.is_empty() {
        return Err(format!("no packed goldens under {} (a partial checkout?)", data.display()));
    }
    for f in files {
        let Some(name) = f.strip_prefix(&data).ok().and_then(|rel| rel.to_str()).and_then(|s| s.strip_suffix(".xz")) else { continue };
        let packed = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        let mut bytes = Vec::new();
        lzma_rs::xz_decompress(&mut packed.as_slice(), &mut bytes).map_err(|e| format!("{}: not an xz file: {e:?}", f.display()))?;
        if name.ends_with(".safetensors") {
            bytes = from_planes(&bytes).map_err(|e| format!("{}: {e}", f.display()))?;
        }
        let dst = out.join(name);
        if let Some(dir) = dst.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::write(&dst, bytes).map_err(|e| format!("{}: {e}", dst.display()))?;
    }
    Ok(())
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// The inverse of the packer's planes: the header as is, then byte i of the data section from
/// plane i % 4 at i / 4; the data section's length is the largest end offset the header names.
fn from_planes(st: &[u8]) -> Result<Vec<u8>, String> {
    let n = u64::from_le_bytes(st.get(..8).ok_or("short file")?.try_into().map_err(|_| "header length")?) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(st.get(8..8 + n).ok_or("header past the end")?).map_err(|e| format!("header: {e}"))?;
    let len = header.values().filter_map(|v| v["data_offsets"][1].as_u64()).max().unwrap_or(0) as usize;
    let words = len.div_ceil(4);
    let planes = st.get(8 + n..).ok_or("no data")?;
    if planes.len() != 4 * words {
        return Err(format!("data section of {} bytes, expected {} for {len} bytes in planes", planes.len(), 4 * words));
    }
    let mut out = st[..8 + n].to_vec();
    out.extend((0..len).map(|i| planes[(i % 4) * words + i / 4]));
    Ok(out)
}

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

// to_planes / from_planes: the format, written once (src/planes.rs).
#[allow(dead_code)]
mod planes {
    include!("src/planes.rs");
}
use planes::from_planes;

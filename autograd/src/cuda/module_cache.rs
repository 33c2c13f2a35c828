//! Device code for this GPU, compiled once per machine: NVRTC emits CUBIN (machine code for the
//! GPU's own `sm_XY`, so the driver does not JIT-compile PTX again at every process start) and
//! the CUBIN is kept in an on-disk cache across processes.
//!
//! An entry's file name is the SHA-256 of everything that shapes the code — source, NVRTC
//! options, architecture, NVRTC and driver versions — so a changed input never finds a stale
//! entry. The file carries the SHA-256 of its payload: a truncated or corrupt entry is rebuilt,
//! never trusted, and an entry the driver refuses to load is rebuilt too. Writes go through a
//! temporary file and a rename, so a concurrent process never reads half a file.
//!
//! Folder: `$PTL_KERNEL_CACHE`, else `$PTL_CACHE/kernels`, else `$XDG_CACHE_HOME/ptl/kernels`,
//! else `~/.cache/ptl/kernels`; `PTL_KERNEL_CACHE=off` disables it.

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::sys as nv;
use sha2::{Digest, Sha256};

use super::device::cuda_home;

const MAGIC: &[u8; 10] = b"PTLCUBIN1\n";

/// How a module's device code was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleSource {
    /// Read from the on-disk cache.
    CacheHit,
    /// Compiled now (no entry yet) and stored.
    Compiled,
    /// Compiled now because the entry was corrupt or refused by the driver; the entry was replaced.
    Rebuilt,
    /// Compiled now; the cache is off or its folder is not writable.
    Uncached,
}

/// Start-up cost of one module: NVRTC compilation and the driver's module load.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleReport {
    pub name: String,
    pub source: ModuleSource,
    pub compile_s: f64,
    pub load_s: f64,
    /// Why the cache was not used or an entry was rebuilt, if it was not a plain hit or miss.
    pub note: Option<String>,
}

fn reports() -> &'static Mutex<Vec<ModuleReport>> {
    static R: std::sync::OnceLock<Mutex<Vec<ModuleReport>>> = std::sync::OnceLock::new();
    R.get_or_init(|| Mutex::new(Vec::new()))
}

/// Every module loaded in this process so far, in load order.
pub fn module_reports() -> Vec<ModuleReport> {
    reports().lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The cache folder, or `None` when it is switched off or no home is known.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    cache_dir("PTL_KERNEL_CACHE", "kernels")
}

/// One of ptl's cache folders: `$<own_var>` (`off`, `0` or `false` switch it off), else
/// `$PTL_CACHE/<sub>`, else `$XDG_CACHE_HOME/ptl/<sub>`, else `~/.cache/ptl/<sub>`.
pub(crate) fn cache_dir(own_var: &str, sub: &str) -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(v) = var(own_var) {
        return (!matches!(v.to_str(), Some("off" | "0" | "false"))).then_some(v);
    }
    var("PTL_CACHE")
        .map(|d| d.join(sub))
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("ptl").join(sub)))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("ptl").join(sub)))
}

/// NVRTC options for `sm_{major}{minor}` (machine code for this GPU, the CUDA include path).
pub(crate) fn nvrtc_flags(major: i32, minor: i32) -> Vec<String> {
    vec![format!("--gpu-architecture=sm_{major}{minor}"), "--std=c++17".into(), format!("--include-path={}/include", cuda_home())]
}

/// The cache key: SHA-256 over every input of the compilation, length-prefixed.
pub(crate) fn cache_key(source: &str, flags: &[String], versions: &str) -> String {
    let mut h = Sha256::new();
    for part in std::iter::once(source).chain(flags.iter().map(String::as_str)).chain(std::iter::once(versions)) {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The payload of a cache file, or why it is not usable.
pub(crate) fn parse_entry(bytes: &[u8]) -> std::result::Result<&[u8], &'static str> {
    let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or("not a ptl CUBIN cache file")?;
    if rest.len() < 40 {
        return Err("truncated header");
    }
    let (digest, rest) = rest.split_at(32);
    let (len, payload) = rest.split_at(8);
    let len = u64::from_le_bytes(len.try_into().map_err(|_| "bad length")?) as usize;
    if payload.len() != len {
        return Err("truncated payload");
    }
    if Sha256::digest(payload).as_slice() != digest {
        return Err("checksum mismatch");
    }
    Ok(payload)
}

/// A cache file for `payload` (magic, SHA-256 of the payload, length, payload).
pub(crate) fn encode_entry(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAGIC.len() + 40 + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&Sha256::digest(payload));
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{}.{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"), std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn versions() -> String {
    let (mut maj, mut min) = (0 as c_int, 0 as c_int);
    // SAFETY: plain out-parameters; NVRTC was probed before any module is built.
    let nvrtc = unsafe { nv::nvrtcVersion(&mut maj, &mut min) };
    let mut drv = 0 as c_int;
    // SAFETY: out-parameter.
    let driver = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut drv) };
    format!("nvrtc {maj}.{min} ({nvrtc:?}); driver {drv} ({driver:?}); ptl-autograd {}", env!("CARGO_PKG_VERSION"))
}

/// Compiles `source` to CUBIN with NVRTC.
fn compile_cubin(name: &str, source: &str, flags: &[String]) -> std::result::Result<Vec<u8>, String> {
    let src = CString::new(source).map_err(|_| format!("{name}: source contains a NUL byte"))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| format!("{name}: bad module name"))?;
    let prog = cudarc::nvrtc::result::create_program(&src, Some(&cname)).map_err(|e| format!("{name}: nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` was created above and is destroyed once, at the end.
    let out = unsafe {
        let compiled = cudarc::nvrtc::result::compile_program(prog, flags);
        if let Err(e) = compiled {
            let log = cudarc::nvrtc::result::get_program_log(prog)
                .map(|l| String::from_utf8_lossy(&l.iter().map(|&c| c as u8).collect::<Vec<_>>()).trim_end_matches('\0').to_string())
                .unwrap_or_default();
            Err(format!("{name}: NVRTC compile failed ({e:?}) with {flags:?}:\n{log}"))
        } else {
            let mut size = 0usize;
            match nv::nvrtcGetCUBINSize(prog, &mut size).result() {
                Ok(()) if size > 0 => {
                    let mut buf = vec![0u8; size];
                    nv::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                        .result()
                        .map(|()| buf)
                        .map_err(|e| format!("{name}: nvrtcGetCUBIN: {e:?}"))
                }
                Ok(()) => Err(format!("{name}: NVRTC produced no CUBIN (flags {flags:?})")),
                Err(e) => Err(format!("{name}: nvrtcGetCUBINSize: {e:?}")),
            }
        }
    };
    // SAFETY: created above, not used after this.
    let _ = unsafe { cudarc::nvrtc::result::destroy_program(prog) };
    out
}

fn load(ctx: &Arc<CudaContext>, cubin: Vec<u8>) -> std::result::Result<Arc<CudaModule>, String> {
    ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(|e| format!("cuModuleLoadData: {e:?}"))
}

/// Loads module `name` built from `source` for `sm_{major}{minor}`, from the cache when a valid
/// entry exists, else compiled now (and stored). Records a [`ModuleReport`].
pub(crate) fn load_module(
    ctx: &Arc<CudaContext>,
    name: &str,
    source: &str,
    major: i32,
    minor: i32,
) -> std::result::Result<Arc<CudaModule>, String> {
    let flags = nvrtc_flags(major, minor);
    let dir = kernel_cache_dir();
    let entry = dir.as_ref().map(|d| d.join(format!("{name}-{}.cubin", &cache_key(source, &flags, &versions())[..32])));
    let mut note = None;
    let mut stale = false;
    if let Some(path) = &entry {
        match std::fs::read(path) {
            Ok(bytes) => match parse_entry(&bytes) {
                Ok(payload) => {
                    let t = Instant::now();
                    match load(ctx, payload.to_vec()) {
                        Ok(m) => {
                            record(name, ModuleSource::CacheHit, 0.0, t.elapsed().as_secs_f64(), None);
                            return Ok(m);
                        }
                        Err(e) => (stale, note) = (true, Some(format!("cached entry {} refused ({e}); rebuilt", path.display()))),
                    }
                }
                Err(why) => (stale, note) = (true, Some(format!("cached entry {} unusable ({why}); rebuilt", path.display()))),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => note = Some(format!("cannot read {}: {e}", path.display())),
        }
    }
    let t = Instant::now();
    let cubin = compile_cubin(name, source, &flags)?;
    let compile_s = t.elapsed().as_secs_f64();
    let mut how = if stale { ModuleSource::Rebuilt } else { ModuleSource::Compiled };
    match &entry {
        Some(path) => {
            if let Err(e) = write_atomically(path, &encode_entry(&cubin)) {
                how = ModuleSource::Uncached;
                note = Some(format!("kernel cache not written to {}: {e}", path.display()));
            }
        }
        None => how = ModuleSource::Uncached,
    }
    let t = Instant::now();
    let m = load(ctx, cubin).map_err(|e| format!("{name}: {e}"))?;
    record(name, how, compile_s, t.elapsed().as_secs_f64(), note);
    Ok(m)
}

/// Loads `source` as module `name` through the on-disk cache, bypassing the process's own module
/// table, checks that `function` is in it, and says how its code was obtained (so a test can play
/// several processes in one).
#[doc(hidden)]
pub fn probe_module_cache(device: crate::Device, name: &str, source: &str, function: &str) -> crate::Result<ModuleSource> {
    let dev = super::dev_of(device)?;
    dev.bind()?;
    let (major, minor) = dev.ctx.compute_capability().map_err(|e| super::device::cu_err("compute capability", e))?;
    let m = load_module(&dev.ctx, name, source, major, minor).map_err(crate::Error::Cuda)?;
    m.load_function(function).map_err(|e| super::device::cu_err(&format!("kernel {function} in module {name}"), e))?;
    module_reports()
        .iter()
        .rev()
        .find(|r| r.name == name)
        .map(|r| r.source)
        .ok_or_else(|| crate::Error::Cuda(format!("module {name}: no load report")))
}

fn record(name: &str, source: ModuleSource, compile_s: f64, load_s: f64, note: Option<String>) {
    if let Some(n) = &note {
        eprintln!("ptl: {n}");
    }
    reports().lock().unwrap_or_else(|e| e.into_inner()).push(ModuleReport { name: name.into(), source, compile_s, load_s, note });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_damage_is_detected() {
        let payload = b"\x7fELF fake cubin bytes".to_vec();
        let file = encode_entry(&payload);
        assert_eq!(parse_entry(&file), Ok(payload.as_slice()));
        let mut flipped = file.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(parse_entry(&flipped), Err("checksum mismatch"));
        assert_eq!(parse_entry(&file[..file.len() - 1]), Err("truncated payload"));
        assert_eq!(parse_entry(&file[..20]), Err("truncated header"));
        assert_eq!(parse_entry(b"garbage"), Err("not a ptl CUBIN cache file"));
    }

    #[test]
    fn the_key_changes_with_every_input() {
        let f = vec!["--gpu-architecture=sm_90".to_string()];
        let base = cache_key("src", &f, "v1");
        assert_eq!(base, cache_key("src", &f, "v1"));
        assert_ne!(base, cache_key("src2", &f, "v1"));
        assert_ne!(base, cache_key("src", &["--gpu-architecture=sm_89".to_string()], "v1"));
        assert_ne!(base, cache_key("src", &f, "v2"));
        // Length prefixes: moving a byte between parts changes the key.
        assert_ne!(cache_key("ab", &["c".to_string()], ""), cache_key("a", &["bc".to_string()], ""));
    }

    #[test]
    fn atomic_write_replaces_the_file() {
        let dir = std::env::temp_dir().join(format!("ptl-kcache-{}", std::process::id()));
        let p = dir.join("m.cubin");
        write_atomically(&p, b"one").unwrap();
        write_atomically(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let leftovers = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary files left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

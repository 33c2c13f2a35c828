//! Device code for this GPU, compiled once per machine: NVRTC emits CUBIN (machine code for the
//! GPU's own `sm_XY`, so the driver does not JIT-compile PTX again at every process start) and
//! the CUBIN is kept in an on-disk cache across processes.
//!
//! An entry's file name is the SHA-256 of everything that shapes the code — source, NVRTC
//! options, architecture, NVRTC and driver versions — so a changed input never finds a stale
//! entry. The file is sealed with the user's key (HMAC-SHA-256, `ptl_files::Sealer`): a damaged
//! entry, or one another local user put there, is rebuilt, never loaded; so is an entry the driver
//! refuses. Writes go through a fresh temporary file and a rename, so a concurrent process never
//! reads half a file.
//!
//! Folder: `$PTL_KERNEL_CACHE`, else `$PTL_CACHE/kernels`, else `$XDG_CACHE_HOME/ptl/kernels`,
//! else `~/.cache/ptl/kernels`; `PTL_KERNEL_CACHE=off` disables it. A folder ptl picks itself is
//! private (0700) and refused, with a message, when another user owns it or can write it.

use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::sys as nv;
use sha2::{Digest, Sha256};

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
    /// The kernel unit.
    pub name: String,
    /// Compiled now or loaded from the cache.
    pub source: ModuleSource,
    /// Seconds of compilation.
    pub compile_s: f64,
    /// Seconds of loading.
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

/// The kernel cache folder, or `None` when it is switched off or cannot be used safely.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    sealed_cache("PTL_KERNEL_CACHE", "kernels").map(|(d, _)| d)
}

/// One of ptl's cache folders (its own variable `own_var` or `sub` of the cache root; see
/// `ptl_files::cache_dir`) and the user's sealer, or `None` — saying why once per folder — when
/// the cache is off, its folder is not private, or the key cannot be made.
pub(crate) fn sealed_cache(own_var: &str, sub: &str) -> Option<(PathBuf, ptl_files::Sealer)> {
    static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let say = |e: &dyn std::fmt::Display| {
        let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
        if !said.iter().any(|s| s == sub) {
            said.push(sub.to_string());
            log::warn!("ptl: the {sub} cache is not used: {e}");
        }
    };
    let dir = match ptl_files::cache_dir(Some(own_var), sub) {
        Ok(d) => d?,
        Err(e) => {
            say(&e);
            return None;
        }
    };
    match ptl_files::user_sealer() {
        Ok(s) => Some((dir, s)),
        Err(e) => {
            say(&e);
            None
        }
    }
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
    let mut loaded = load_modules(ctx, &[(name, source)], major, minor)?;
    loaded.pop().ok_or_else(|| format!("{name}: no module loaded"))
}

/// Loads several `(name, source)` modules like [`load_module`], obtaining their code in parallel:
/// NVRTC compiles independent programs concurrently, so a cold start costs the largest unit,
/// not the sum. The driver loads them one by one, in order.
pub(crate) fn load_modules(
    ctx: &Arc<CudaContext>,
    units: &[(&str, &str)],
    major: i32,
    minor: i32,
) -> std::result::Result<Vec<Arc<CudaModule>>, String> {
    let flags = nvrtc_flags(major, minor);
    let cache = sealed_cache("PTL_KERNEL_CACHE", "kernels");
    let versions = versions();
    let inputs = Inputs { flags: &flags, cache: cache.as_ref(), versions: &versions };
    let obtained: Vec<_> = std::thread::scope(|s| {
        let threads: Vec<_> = units.iter().map(|&(name, source)| s.spawn(move || inputs.obtain(name, source, false))).collect();
        threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err("a kernel compilation thread panicked".to_string()))).collect()
    });
    let mut modules = Vec::with_capacity(units.len());
    for (&(name, source), code) in units.iter().zip(obtained) {
        let code = code?;
        let t = Instant::now();
        match load(ctx, code.cubin) {
            Ok(m) => {
                record(name, code.how, code.compile_s, t.elapsed().as_secs_f64(), code.note);
                modules.push(m);
            }
            Err(e) if code.how == ModuleSource::CacheHit => {
                let mut fresh = inputs.obtain(name, source, true)?;
                let why =
                    format!("cached entry {} refused ({e}); rebuilt", code.entry.map(|p| p.display().to_string()).unwrap_or_default());
                fresh.note = Some(fresh.note.map_or(why.clone(), |n| format!("{why}; {n}")));
                let t = Instant::now();
                let m = load(ctx, fresh.cubin).map_err(|e| format!("{name}: {e}"))?;
                record(name, fresh.how, fresh.compile_s, t.elapsed().as_secs_f64(), fresh.note);
                modules.push(m);
            }
            Err(e) => return Err(format!("{name}: {e}")),
        }
    }
    Ok(modules)
}

/// What shapes a compilation besides the source, and where its results are kept.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    flags: &'a [String],
    cache: Option<&'a (PathBuf, ptl_files::Sealer)>,
    versions: &'a str,
}

/// One unit's CUBIN before the driver loads it, and how it was obtained.
struct Code {
    cubin: Vec<u8>,
    how: ModuleSource,
    compile_s: f64,
    note: Option<String>,
    /// The cache entry it was read from or written to.
    entry: Option<PathBuf>,
}

impl Inputs<'_> {
    /// The cached CUBIN of `source` when a sealed entry exists (unless `rebuild`), else compiled
    /// now and stored.
    fn obtain(&self, name: &str, source: &str, rebuild: bool) -> std::result::Result<Code, String> {
        let entry = self.cache.map(|(d, s)| (d.join(format!("{name}-{}.cubin", &cache_key(source, self.flags, self.versions)[..32])), s));
        let mut note = None;
        let mut stale = rebuild;
        if let (Some((path, sealer)), false) = (&entry, rebuild) {
            match ptl_files::read_regular(path) {
                Ok(bytes) => match sealer.unseal(&bytes) {
                    Ok(payload) => {
                        return Ok(Code {
                            cubin: payload.to_vec(),
                            how: ModuleSource::CacheHit,
                            compile_s: 0.0,
                            note: None,
                            entry: Some(path.clone()),
                        })
                    }
                    Err(why) => (stale, note) = (true, Some(format!("cached entry {} unusable ({why}); rebuilt", path.display()))),
                },
                Err(ptl_files::FileError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => (stale, note) = (true, Some(format!("cached entry unusable ({e}); rebuilt"))),
            }
        }
        let t = Instant::now();
        let cubin = compile_cubin(name, source, self.flags)?;
        let compile_s = t.elapsed().as_secs_f64();
        let mut how = if stale { ModuleSource::Rebuilt } else { ModuleSource::Compiled };
        match &entry {
            Some((path, sealer)) => {
                if let Err(e) = ptl_files::write_atomic(path, &sealer.seal(&cubin), 0o600) {
                    how = ModuleSource::Uncached;
                    note = Some(format!("kernel cache not written to {}: {e}", path.display()));
                }
            }
            None => how = ModuleSource::Uncached,
        }
        Ok(Code { cubin, how, compile_s, note, entry: entry.map(|(p, _)| p) })
    }
}

fn record(name: &str, source: ModuleSource, compile_s: f64, load_s: f64, note: Option<String>) {
    if let Some(n) = &note {
        log::warn!("ptl: {n}");
    }
    reports().lock().unwrap_or_else(|e| e.into_inner()).push(ModuleReport { name: name.into(), source, compile_s, load_s, note });
}

/// Where the CUDA headers live (`CUDA_HOME`, `CUDA_PATH`, else `/usr/local/cuda`).
pub(crate) fn cuda_home() -> String {
    std::env::var("CUDA_HOME").or_else(|_| std::env::var("CUDA_PATH")).unwrap_or_else(|_| "/usr/local/cuda".into())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

//! Building the convolution plans a process is about to need on several threads at once.
//!
//! Why: a warm process (engine choices remembered, `conv_choice`) still finalizes one execution
//! plan per convolution shape and direction; on the H200 a YOLO26n-pose fit finalized 128 of them
//! at ≈ 44 ms each, 5.7 s of host time in its first step and first validation, one after another.
//! The plans do not depend on each other, and cuDNN allows concurrent calls on separate handles.
//!
//! A manifest next to the engine choices lists the shapes recent processes used, each with the
//! "generation" of the last process that wrote it (a process writes the manifest only when it
//! built a plan the manifest did not give it, so a warm run leaves it untouched). The first
//! convolution of a process builds every manifest entry of the last [`GENERATIONS_PREFETCHED`]
//! writing generations whose engine is remembered, on up to [`max_threads`] threads with a cuDNN
//! handle each, and waits for them: no other cuDNN call of the process runs meanwhile, so each
//! handle is only ever used by one thread at a time. A plan built this way is executed with the
//! device's own handle (same device, same stream); it is the same engine, the same bytes, as one
//! built on demand. An entry that fails to build is left to the on-demand path.
//!
//! `PTL_CUDNN_PREFETCH=off` (or `0`) switches it off; a number sets the thread count.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use super::conv_graph::Dir;
use crate::backend::Conv2dParams;
use crate::DType;

const MAGIC: &str = "PTLPLANS1";
/// Entries of the last this many writing processes are prefetched.
const GENERATIONS_PREFETCHED: u64 = 3;
/// Entries kept in the file (the oldest generations go first).
const KEPT: usize = 1024;

/// A plan's identity: shape, dtype and direction.
pub(crate) type PlanKey = (Conv2dParams, DType, Dir);

/// Threads used for prefetching (`PTL_CUDNN_PREFETCH`, else the machine's parallelism up to 16;
/// 0: off).
pub(crate) fn max_threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        let auto = || std::thread::available_parallelism().map_or(1, |n| n.get()).min(16);
        match std::env::var("PTL_CUDNN_PREFETCH").as_deref() {
            Err(_) | Ok("") | Ok("on") => auto(),
            Ok("off") => 0,
            Ok(v) => v.parse().unwrap_or_else(|_| {
                eprintln!("ptl: PTL_CUDNN_PREFETCH={v:?} is not `off` or a thread count; using {}", auto());
                auto()
            }),
        }
    })
}

/// The manifest of one device context (cuDNN version, GPU, heuristics, workspace limit).
pub(crate) struct PlanManifest {
    path: Option<PathBuf>,
    context: String,
    /// What the file held when the process started: generation per key.
    earlier: HashMap<PlanKey, u64>,
    /// This process's generation (one above the file's newest).
    generation: u64,
    /// Keys this process used, in order of first use.
    used: Vec<PlanKey>,
    used_set: HashSet<PlanKey>,
}

impl PlanManifest {
    /// Reads the manifest in `dir` for `context` (an unreadable or foreign file counts as empty).
    pub(crate) fn load(dir: Option<PathBuf>, context: &str) -> PlanManifest {
        let path = dir.map(|d| {
            let mut h = Sha256::new();
            h.update(context.as_bytes());
            let hex: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
            d.join(format!("{hex}.plans"))
        });
        let text = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()).unwrap_or_default();
        let earlier = parse(&text, context);
        let generation = earlier.values().copied().max().map_or(1, |g| g + 1);
        PlanManifest { path, context: context.into(), earlier, generation, used: Vec::new(), used_set: HashSet::new() }
    }

    /// Entries worth building ahead: those of the last [`GENERATIONS_PREFETCHED`] writers.
    pub(crate) fn prefetch_keys(&self) -> Vec<PlanKey> {
        let newest = self.generation - 1;
        let mut keys: Vec<(u64, PlanKey)> =
            self.earlier.iter().filter(|(_, g)| newest.saturating_sub(**g) < GENERATIONS_PREFETCHED).map(|(k, g)| (*g, *k)).collect();
        // Newest first; ties in a fixed order so every process walks the same list.
        keys.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| encode_key(&a.1).cmp(&encode_key(&b.1))));
        keys.into_iter().map(|(_, k)| k).collect()
    }

    /// Notes that this process used `key`.
    pub(crate) fn record_use(&mut self, key: PlanKey) {
        if self.used_set.insert(key) {
            self.used.push(key);
        }
    }

    /// Writes the manifest: this process's keys at its generation, then the earlier entries (best
    /// effort: a manifest that cannot be written only costs later processes the prefetch).
    pub(crate) fn save(&self) {
        let Some(path) = &self.path else { return };
        let mut text = format!("{MAGIC}\n{}\n", self.context);
        for k in &self.used {
            text.push_str(&format!("{} {}\n", self.generation, encode_key(k)));
        }
        let mut rest: Vec<(&PlanKey, &u64)> = self.earlier.iter().filter(|(k, _)| !self.used_set.contains(*k)).collect();
        rest.sort_by(|a, b| b.1.cmp(a.1).then_with(|| encode_key(a.0).cmp(&encode_key(b.0))));
        for (k, g) in rest.into_iter().take(KEPT.saturating_sub(self.used.len())) {
            text.push_str(&format!("{g} {}\n", encode_key(k)));
        }
        if let Err(e) = super::module_cache::write_atomically(path, text.as_bytes()) {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("ptl: cuDNN plan manifest not written to {}: {e}", path.display()));
        }
    }
}

fn parse(text: &str, context: &str) -> HashMap<PlanKey, u64> {
    let mut lines = text.lines();
    if lines.next() != Some(MAGIC) || lines.next() != Some(context) {
        return HashMap::new();
    }
    lines
        .filter_map(|l| {
            let (g, k) = l.split_once(' ')?;
            Some((decode_key(k)?, g.parse().ok()?))
        })
        .collect()
}

fn dtype_name(dt: DType) -> Option<&'static str> {
    match dt {
        DType::F32 => Some("f32"),
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        _ => None,
    }
}

fn dir_name(dir: Dir) -> &'static str {
    match dir {
        Dir::Fwd => "fwd",
        Dir::BwdData => "bwd-data",
        Dir::BwdFilter => "bwd-filter",
    }
}

/// `batch c_in h_in w_in c_out kh kw stride.0 stride.1 pad.0 pad.1 groups dtype dir`.
fn encode_key((p, dt, dir): &PlanKey) -> String {
    format!(
        "{} {} {} {} {} {} {} {} {} {} {} {} {} {}",
        p.batch,
        p.c_in,
        p.h_in,
        p.w_in,
        p.c_out,
        p.kh,
        p.kw,
        p.stride.0,
        p.stride.1,
        p.padding.0,
        p.padding.1,
        p.groups,
        dtype_name(*dt).unwrap_or("?"),
        dir_name(*dir)
    )
}

fn decode_key(s: &str) -> Option<PlanKey> {
    let f: Vec<&str> = s.split(' ').collect();
    if f.len() != 14 {
        return None;
    }
    let n: Vec<usize> = f[..12].iter().map(|v| v.parse().ok()).collect::<Option<_>>()?;
    let p = Conv2dParams {
        batch: n[0],
        c_in: n[1],
        h_in: n[2],
        w_in: n[3],
        c_out: n[4],
        kh: n[5],
        kw: n[6],
        stride: (n[7], n[8]),
        padding: (n[9], n[10]),
        groups: n[11],
    };
    // Shapes no convolution could have are not trusted (a damaged line).
    if p.groups == 0 || p.stride.0 == 0 || p.stride.1 == 0 || p.h_in + 2 * p.padding.0 < p.kh || p.w_in + 2 * p.padding.1 < p.kw {
        return None;
    }
    let dt = [DType::F32, DType::BF16, DType::F16].into_iter().find(|d| dtype_name(*d) == Some(f[12]))?;
    let dir = [Dir::Fwd, Dir::BwdData, Dir::BwdFilter].into_iter().find(|d| dir_name(*d) == f[13])?;
    Some((p, dt, dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(batch: usize, dir: Dir) -> PlanKey {
        let p = Conv2dParams { batch, c_in: 16, h_in: 40, w_in: 40, c_out: 32, kh: 3, kw: 3, stride: (2, 2), padding: (1, 1), groups: 1 };
        (p, DType::BF16, dir)
    }

    struct Scratch(PathBuf);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn scratch(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("ptl-conv-prefetch-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch folder");
        Scratch(d)
    }

    #[test]
    fn keys_round_trip_and_damaged_lines_are_dropped() {
        for dir in [Dir::Fwd, Dir::BwdData, Dir::BwdFilter] {
            let k = key(4, dir);
            assert_eq!(decode_key(&encode_key(&k)), Some(k));
        }
        assert_eq!(decode_key("4 16 40 40 32 3 3 0 2 1 1 1 bf16 fwd"), None, "stride 0");
        assert_eq!(decode_key("4 16 40 40 32 3 3 2 2 1 1 1 f64 fwd"), None, "dtype");
        assert_eq!(decode_key("4 16 40 40 32 3 3 2 2 1 1 1 bf16"), None, "short");
    }

    #[test]
    fn a_writer_starts_a_generation_and_old_generations_stop_being_prefetched() {
        let dir = scratch("generations");
        let ctx = "cudnn 91400 sm_90";
        let fresh = PlanManifest::load(Some(dir.0.clone()), ctx);
        assert!(fresh.prefetch_keys().is_empty());
        // Process 1 uses two shapes; process 2 only a third one, then three more writers.
        let mut m = fresh;
        m.record_use(key(4, Dir::Fwd));
        m.record_use(key(4, Dir::BwdData));
        m.record_use(key(4, Dir::Fwd));
        m.save();
        let mut m = PlanManifest::load(Some(dir.0.clone()), ctx);
        assert_eq!(m.prefetch_keys().len(), 2);
        m.record_use(key(8, Dir::Fwd));
        m.save();
        let m = PlanManifest::load(Some(dir.0.clone()), ctx);
        let keys = m.prefetch_keys();
        assert_eq!(keys[0], key(8, Dir::Fwd), "newest generation first");
        assert_eq!(keys.len(), 3);
        for b in [16, 32] {
            let mut m = PlanManifest::load(Some(dir.0.clone()), ctx);
            m.record_use(key(b, Dir::Fwd));
            m.save();
        }
        let keys = PlanManifest::load(Some(dir.0.clone()), ctx).prefetch_keys();
        assert_eq!(keys.len(), 3, "generations 2, 3, 4: {keys:?}");
        assert!(!keys.contains(&key(4, Dir::BwdData)), "generation 1 is no longer prefetched");
        // Another context reads nothing from this file.
        assert!(PlanManifest::load(Some(dir.0.clone()), "cudnn 91500 sm_90").prefetch_keys().is_empty());
    }
}

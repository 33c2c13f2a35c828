//! Which cuDNN engine each convolution shape ended up with, remembered across processes.
//!
//! Why: building a graph-API plan means walking cuDNN's heuristic list and finalizing an execution
//! plan per engine until one is deterministic and fits the workspace limit; on the H200 a
//! YOLO26n-pose fit spent 7–8 s of its 13 s in 168 such set-ups, most of it in shapes where every
//! engine was finalized and refused (≈ 30 per shape) before the legacy API took over. The ranking
//! is deterministic (heuristic mode INSTANT), so the outcome of that walk is a function of the
//! shape, the cuDNN version, the GPU and the limit: a warm process finalizes only the engine that
//! won (or goes straight to the legacy API) and gets the same engine — the same bytes — as the
//! process that searched.
//!
//! An entry is one small text file named by the SHA-256 of its context and key; it repeats both,
//! so a hash collision or a damaged file is never trusted, only searched again. A remembered
//! engine that no longer builds is searched again from the top and the entry rewritten.
//!
//! A plan whose engine compiles its kernel at run time (NVRTC inside cuDNN, ≈ 150 ms a plan on the
//! H200, in every process) is also kept in cuDNN's serialized form (`<hash>.plan`, headed by the
//! context, the key and the engine's position), which a later process whose remembered choice is
//! that engine restores without compiling.
//!
//! Entries and plans are sealed with the user's key (HMAC-SHA-256, `ptl_files::Sealer`): cuDNN
//! executes a restored plan as it reads it, so a plan body another local user wrote is rebuilt,
//! never restored.
//!
//! Folder: `$PTL_CUDNN_CACHE`, else `$PTL_CACHE/cudnn`, else `$XDG_CACHE_HOME/ptl/cudnn`, else
//! `~/.cache/ptl/cudnn`; `PTL_CUDNN_CACHE=off` disables it. A folder ptl picks itself is private.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

const MAGIC: &str = "PTLCONV1";
const PLAN_MAGIC: &str = "PTLPLAN1";

/// The first lines of a stored plan: what it is for (context, key, engine position).
fn plan_head(context: &str, key: &str, engine: usize) -> String {
    format!("{PLAN_MAGIC}\n{context}\n{key}\nengine {engine}\n")
}

/// The outcome of the engine walk for one shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// The position in cuDNN's heuristic list of the engine that built.
    Engine(usize),
    /// No engine qualified: the shape runs through the legacy API.
    Legacy,
}

impl Choice {
    fn encode(self) -> String {
        match self {
            Choice::Engine(k) => format!("engine {k}"),
            Choice::Legacy => "legacy".into(),
        }
    }

    fn decode(s: &str) -> Option<Choice> {
        match s.split_once(' ') {
            Some(("engine", k)) => k.parse().ok().map(Choice::Engine),
            None if s == "legacy" => Some(Choice::Legacy),
            _ => None,
        }
    }
}

/// The remembered choices of one device (`context`: everything besides the shape that the walk
/// depends on — cuDNN version, compute capability, heuristic mode, workspace limit).
pub(crate) struct ChoiceCache {
    /// The folder and the key its files are sealed with (`None`: the cache is off).
    store: Option<(PathBuf, ptl_files::Sealer)>,
    context: String,
}

/// The cache folder, or `None` when it is switched off or cannot be used safely.
pub fn cudnn_cache_dir() -> Option<PathBuf> {
    super::module_cache::sealed_cache("PTL_CUDNN_CACHE", "cudnn").map(|(d, _)| d)
}

impl ChoiceCache {
    pub(crate) fn new(context: String) -> ChoiceCache {
        ChoiceCache { store: super::module_cache::sealed_cache("PTL_CUDNN_CACHE", "cudnn"), context }
    }

    #[cfg(test)]
    fn in_dir(dir: &Path, context: &str) -> ChoiceCache {
        ChoiceCache { store: Some((dir.to_path_buf(), ptl_files::Sealer::in_dir(dir).expect("key"))), context: context.into() }
    }

    /// The payload of a stored file, if it is there and its seal holds.
    fn read(&self, path: Option<PathBuf>) -> Option<Vec<u8>> {
        let (_, sealer) = self.store.as_ref()?;
        let bytes = ptl_files::read_regular(&path?).ok()?;
        sealer.unseal(&bytes).ok().map(<[u8]>::to_vec)
    }

    fn path(&self, key: &str) -> Option<PathBuf> {
        self.path_with(key, "conv")
    }

    fn path_with(&self, key: &str, ext: &str) -> Option<PathBuf> {
        let (dir, _) = self.store.as_ref()?;
        let mut h = Sha256::new();
        for part in [self.context.as_str(), key] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        let hex: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
        Some(dir.join(format!("{hex}.{ext}")))
    }

    /// The remembered choice for `key`, if a valid entry for this context exists.
    pub(crate) fn get(&self, key: &str) -> Option<Choice> {
        let text = String::from_utf8(self.read(self.path(key))?).ok()?;
        let mut lines = text.lines();
        if lines.next()? != MAGIC || lines.next()? != self.context || lines.next()? != key {
            return None;
        }
        let choice = Choice::decode(lines.next()?)?;
        lines.next().is_none().then_some(choice)
    }

    /// Remembers `choice` for `key` (best effort, see [`ChoiceCache::store`]).
    pub(crate) fn put(&self, key: &str, choice: Choice) {
        let text = format!("{MAGIC}\n{}\n{key}\n{}\n", self.context, choice.encode());
        self.store(self.path(key), text.as_bytes());
    }

    /// The serialized plan stored for `key` with the engine at position `engine` of cuDNN's ranking
    /// (cuDNN's JSON form of a plan whose engine compiles its kernel at run time), if a valid one
    /// exists for this context. A plan of another engine (the choice changed since) is not taken.
    pub(crate) fn get_plan(&self, key: &str, engine: usize) -> Option<Vec<u8>> {
        let bytes = self.read(self.path_with(key, "plan"))?;
        let head = plan_head(&self.context, key, engine);
        let body = bytes.strip_prefix(head.as_bytes())?;
        (!body.is_empty()).then(|| body.to_vec())
    }

    /// Stores the serialized plan for `key` built with the engine at position `engine` (best effort).
    pub(crate) fn put_plan(&self, key: &str, engine: usize, json: &[u8]) {
        let mut bytes = plan_head(&self.context, key, engine).into_bytes();
        bytes.extend_from_slice(json);
        self.store(self.path_with(key, "plan"), &bytes);
    }

    /// Writes one entry (best effort: a cache that cannot be written only costs later processes
    /// the search or the compile; the first failure is reported once).
    fn store(&self, path: Option<PathBuf>, bytes: &[u8]) {
        let (Some(path), Some((_, sealer))) = (path, self.store.as_ref()) else { return };
        if let Err(e) = ptl_files::write_atomic(&path, &sealer.seal(bytes), 0o600) {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| log::warn!("ptl: cuDNN engine choices and plans not stored in {}: {e}", path.display()));
        }
    }

    /// Where entries go (for messages).
    pub(crate) fn dir(&self) -> Option<&Path> {
        self.store.as_ref().map(|(d, _)| d.as_path())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder of this test's own (removed when dropped).
    struct Scratch(PathBuf);
    impl Scratch {
        fn new(name: &str) -> Scratch {
            let d = std::env::temp_dir().join(format!("ptl-conv-choice-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).expect("scratch folder");
            Scratch(d)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn serialized_plans_round_trip_per_context_and_key() {
        let dir = Scratch::new("plans");
        let a = ChoiceCache::in_dir(dir.path(), "cudnn 91400 sm90");
        assert_eq!(a.get_plan("shape 1", 2), None);
        a.put_plan("shape 1", 2, b"{\"plan\": 1}");
        assert_eq!(a.get_plan("shape 1", 2).as_deref(), Some(&b"{\"plan\": 1}"[..]));
        assert_eq!(a.get_plan("shape 1", 3), None, "a plan of another engine");
        assert_eq!(a.get_plan("shape 2", 2), None, "another key");
        let b = ChoiceCache::in_dir(dir.path(), "cudnn 91500 sm90");
        assert_eq!(b.get_plan("shape 1", 2), None, "another cuDNN");
        // An empty body is not a plan; the engine-choice entry of the same key is unaffected.
        a.put_plan("shape 3", 0, b"");
        assert_eq!(a.get_plan("shape 3", 0), None);
        a.put("shape 1", Choice::Engine(2));
        assert_eq!(a.get("shape 1"), Some(Choice::Engine(2)));
        assert!(a.get_plan("shape 1", 2).is_some());
    }

    #[test]
    fn choices_round_trip_per_context_and_key() {
        let dir = Scratch::new("round-trip");
        let a = ChoiceCache::in_dir(dir.path(), "cudnn 91400 sm90 instant ws 33554432");
        assert_eq!(a.get("shape 1"), None);
        a.put("shape 1", Choice::Engine(3));
        a.put("shape 2", Choice::Legacy);
        assert_eq!(a.get("shape 1"), Some(Choice::Engine(3)));
        assert_eq!(a.get("shape 2"), Some(Choice::Legacy));
        a.put("shape 1", Choice::Engine(0));
        assert_eq!(a.get("shape 1"), Some(Choice::Engine(0)));
        // Another cuDNN, GPU or limit never sees these entries.
        let b = ChoiceCache::in_dir(dir.path(), "cudnn 91500 sm90 instant ws 33554432");
        assert_eq!(b.get("shape 1"), None);
    }

    #[test]
    fn damaged_or_foreign_entries_are_not_trusted() {
        let dir = Scratch::new("damaged");
        let c = ChoiceCache::in_dir(dir.path(), "ctx");
        c.put("k", Choice::Engine(2));
        let path = c.path("k").expect("path");
        let good = String::from_utf8(c.read(Some(path.clone())).expect("entry")).expect("text");
        let sealer = &c.store.as_ref().expect("on").1;
        // Well sealed but wrong inside: refused by the content checks.
        for bad in [
            good.replace("engine 2", "engine two"),
            good.replace("\nk\n", "\nother key\n"),
            good.replace(MAGIC, "PTLCONV0"),
            format!("{good}extra\n"),
            good[..good.len() / 2].to_string(),
        ] {
            std::fs::write(&path, sealer.seal(bad.as_bytes())).expect("write");
            assert_eq!(c.get("k"), None);
        }
        // Right inside but not sealed with this user's key: plain text, or another key's seal.
        std::fs::write(&path, &good).expect("write");
        assert_eq!(c.get("k"), None);
        let other = Scratch::new("other-key");
        std::fs::write(&path, ptl_files::Sealer::in_dir(other.path()).expect("key").seal(good.as_bytes())).expect("write");
        assert_eq!(c.get("k"), None);
        std::fs::write(&path, sealer.seal(good.as_bytes())).expect("write");
        assert_eq!(c.get("k"), Some(Choice::Engine(2)));
    }

    /// A stored plan body changed by someone without the key is rebuilt, not restored.
    #[test]
    fn a_forged_plan_is_not_restored() {
        let dir = Scratch::new("forged-plan");
        let c = ChoiceCache::in_dir(dir.path(), "ctx");
        c.put_plan("k", 1, b"{\"plan\": 1}");
        let path = c.path_with("k", "plan").expect("path");
        let mut bytes = std::fs::read(&path).expect("plan");
        let last = bytes.len() - 2;
        bytes[last] ^= 0x01;
        std::fs::write(&path, bytes).expect("write");
        assert_eq!(c.get_plan("k", 1), None);
    }

    #[test]
    fn a_switched_off_cache_remembers_nothing() {
        let c = ChoiceCache { store: None, context: "ctx".into() };
        c.put("k", Choice::Legacy);
        assert_eq!(c.get("k"), None);
    }
}

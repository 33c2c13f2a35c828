//! The CUDA backend's modules form layers: each imports only modules below it, never its parent's
//! own items (the parent, `cuda/mod.rs` or `cuda/ops/mod.rs`, only declares modules, re-exports
//! and implements the backend contract on top). Read from the sources, so it runs without a GPU.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module name → its source without comments, for the files of one folder (`mod.rs` excluded).
fn modules(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("read the module folder") {
        let path = entry.expect("folder entry").path();
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        if path.extension().is_some_and(|e| e == "rs") && name != "mod" {
            let src = std::fs::read_to_string(&path).expect("read a module");
            // A file's unit tests (at its end) name the file's own module `super`.
            let src = src.split("#[cfg(test)]").next().unwrap_or_default();
            let code: Vec<&str> = src.lines().map(|l| l.split("//").next().unwrap_or("")).collect();
            out.insert(name, code.join("\n"));
        }
    }
    out
}

/// The identifiers that follow `prefix` in `src`, also inside `prefix{a, b::c}` groups (first
/// segment of each).
fn names_after(src: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    for (i, _) in src.match_indices(prefix) {
        // `super::super::x` is not `super::x` seen one level down.
        if prefix == "super::" && src[..i].ends_with("super::") {
            continue;
        }
        let rest = &src[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            for item in group.split('}').next().unwrap_or("").split(',') {
                out.insert(ident(item.trim()));
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|n| !n.is_empty() && n != "super");
    out
}

/// A cycle of `edges`, if there is one.
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(1) => return Some(path[path.iter().position(|p| p == n).unwrap_or(0)..].to_vec()),
            Some(_) => return None,
            None => {}
        }
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, edges, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    edges.keys().find_map(|n| visit(n, edges, &mut state, &mut Vec::new()))
}

/// Checks one folder: `parent` is how a module there names the folder's parent module.
fn check(dir: &Path, parent: &str) {
    let mods = modules(dir);
    let known: BTreeSet<String> = mods.keys().cloned().collect();
    let mut edges = BTreeMap::new();
    for (name, src) in &mods {
        let used = names_after(src, parent);
        let from_parent: Vec<&String> = used.iter().filter(|u| !known.contains(*u)).collect();
        // `ops` (a folder) is a module of `cuda/` too.
        let from_parent: Vec<&String> = from_parent.into_iter().filter(|u| !(parent == "super::" && *u == "ops")).collect();
        assert!(
            from_parent.is_empty(),
            "{}/{name}.rs uses its parent's own items {from_parent:?}: move them into a module below",
            dir.display()
        );
        edges.insert(name.clone(), used.into_iter().filter(|u| known.contains(u) && u != name).collect::<BTreeSet<_>>());
    }
    assert_eq!(cycle(&edges), None, "an import circle in {}", dir.display());
}

#[test]
fn cuda_modules_import_only_what_is_below_them() {
    let cuda = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda");
    check(&cuda, "super::");
    // A family module names its siblings `super::x` and cuda's modules `super::super::x`.
    check(&cuda.join("ops"), "super::");
    let mut edges = BTreeMap::new();
    for (name, src) in modules(&cuda.join("ops")) {
        edges.insert(format!("ops/{name}"), names_after(&src, "super::super::"));
    }
    for used in edges.values() {
        assert!(!used.contains("ops"), "an op family imports `ops` back: {edges:?}");
    }
}

#[test]
fn the_checker_finds_a_circle() {
    let edges: BTreeMap<String, BTreeSet<String>> =
        [("a".to_string(), BTreeSet::from(["b".to_string()])), ("b".to_string(), BTreeSet::from(["a".to_string()]))].into();
    assert_eq!(cycle(&edges), Some(vec!["a".to_string(), "b".to_string()]));
    assert_eq!(
        names_after("use super::{device::Dev, alloc};\nsuper::super::x; super::counters::count", "super::"),
        BTreeSet::from(["alloc".into(), "counters".into(), "device".into()])
    );
}

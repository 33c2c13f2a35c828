//! Where ptl keeps its caches (the embedded default dataset, compiled kernels, cuDNN choices and
//! plans, the seal key), and how those folders are made safe to read back.
//!
//! The root is `$PTL_CACHE` (the user's choice, used as given), else `$XDG_CACHE_HOME/ptl`, else
//! `~/.cache/ptl`, else `<temp>/ptl-cache-<uid>`; each cache may have its own variable
//! (`PTL_KERNEL_CACHE`, …) that overrides its folder, `off` switching it off. Folders ptl picks
//! itself are made 0700 and refused when another user owns them or can write them.

use std::path::PathBuf;

use crate::error::Result;
use crate::private::{current_uid, private_dir, Trust};
use crate::seal::Sealer;

fn var(k: &str) -> Option<PathBuf> {
    std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The cache root and whether the user named it.
pub fn cache_root() -> (PathBuf, Trust) {
    if let Some(p) = var("PTL_CACHE") {
        return (p, Trust::Explicit);
    }
    let picked = var("XDG_CACHE_HOME")
        .map(|d| d.join("ptl"))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("ptl")))
        .unwrap_or_else(|| std::env::temp_dir().join(format!("ptl-cache-{}", current_uid())));
    (picked, Trust::Default)
}

/// Cache `sub` of the root, or `$<own_var>` when set (`off`, `0` or `false`: `None`, the cache is
/// switched off). Made private as the module says; not created when switched off.
pub fn cache_dir(own_var: Option<&str>, sub: &str) -> Result<Option<PathBuf>> {
    if let Some(v) = own_var.and_then(var) {
        if matches!(v.to_str(), Some("off" | "0" | "false")) {
            return Ok(None);
        }
        return private_dir(&v, Trust::Explicit).map(Some);
    }
    let (root, trust) = cache_root();
    private_dir(&root, trust)?;
    private_dir(&root.join(sub), trust).map(Some)
}

/// The user's seal key, kept in the cache root (see [`Sealer`]).
pub fn user_sealer() -> Result<Sealer> {
    let (root, trust) = cache_root();
    Sealer::in_dir(&private_dir(&root, trust)?)
}

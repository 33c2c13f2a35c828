//! The reference tensors ptl's tests compare against: forward outputs, per-layer activations,
//! losses, gradients, optimizer and EMA steps and metrics of Ultralytics 8.4.190's YOLO26n-pose,
//! made on the CPU in float32. The repository keeps them packed in `goldens/data/` (see
//! `goldens/README.md`: what each file holds, how they were made, what was reduced); this crate's
//! build script unpacks them, so a clean clone runs every golden test.
//!
//! ```
//! let weights = ptl_goldens::folder().expect("the goldens unpack at build time").join("model/weights.safetensors");
//! assert!(weights.is_file());
//! ```

#![warn(missing_docs)]

use std::path::{Path, PathBuf};

mod planes;
pub use planes::{from_planes, safetensors_split, to_planes, PlanesError};

/// The repository's goldens, unpacked when this crate was built.
pub fn unpacked() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/goldens"))
}

/// Where the tests read goldens: `$PTL_GOLDENS` when set (a full copy, or the one a device pack
/// carries to a machine that runs packed test binaries), else [`unpacked`].
pub fn dir() -> PathBuf {
    match std::env::var_os("PTL_GOLDENS").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => unpacked().to_path_buf(),
    }
}

/// [`dir`] when it exists. When it does not, a test cannot check what it exists to check: under
/// CI (the `CI` variable set) that fails the test; elsewhere it prints a loud skip line and
/// returns `None`.
pub fn folder() -> Option<PathBuf> {
    let d = dir();
    if d.is_dir() {
        return Some(d);
    }
    let msg = format!("golden folder {} not found: the golden comparisons did NOT run", d.display());
    if std::env::var_os("CI").is_some_and(|v| !v.is_empty()) {
        panic!("{msg} (CI)");
    }
    eprintln!("SKIPPED: {msg}");
    None
}

/// The largest parameter gradient the repository's `model/loss.safetensors` keeps whole
/// (`grad.<name>`).
pub const WHOLE_GRADIENT_MAX: usize = 2048;

/// Values kept of a larger gradient: `grad_sample.<name>`, this many values at positions
/// ⌊j·n / GRADIENT_SAMPLES⌋ ([`sample_positions`]), instead of `grad.<name>`.
pub const GRADIENT_SAMPLES: usize = 512;

/// The positions of a reduced gradient's samples in a tensor of `n` values.
pub fn sample_positions(n: usize) -> impl Iterator<Item = usize> {
    (0..GRADIENT_SAMPLES).map(move |j| j * n / GRADIENT_SAMPLES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_round_trip_and_put_byte_k_of_every_word_together() {
        let header = br#"{"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]}}"#;
        let mut st = (header.len() as u64).to_le_bytes().to_vec();
        st.extend_from_slice(header);
        st.extend_from_slice(&[1, 2, 3, 4, 5, 6]);
        let p = to_planes(&st).unwrap();
        assert_eq!(&p[..st.len() - 6], &st[..st.len() - 6], "the header stays");
        assert_eq!(&p[st.len() - 6..], &[1, 5, 2, 6, 3, 0, 4, 0]);
        assert_eq!(from_planes(&p).unwrap(), st);
        assert!(from_planes(&p[..p.len() - 1]).is_err(), "a cut data section is refused");
    }
}

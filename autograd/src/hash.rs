//! Content hashes for byte-identity checks (SHA-256 over dtype, shape and raw bytes).

use sha2::{Digest, Sha256};

use crate::{Result, Tensor};

fn feed(h: &mut Sha256, t: &Tensor) -> Result<()> {
    h.update(t.dtype().as_str().as_bytes());
    for d in t.dims() {
        h.update((*d as u64).to_le_bytes());
    }
    h.update(t.to_bytes()?);
    Ok(())
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of one tensor's dtype, shape and bytes, as hex.
pub fn tensor_hash(t: &Tensor) -> Result<String> {
    let mut h = Sha256::new();
    feed(&mut h, t)?;
    Ok(hex(&h.finalize()))
}

/// SHA-256 over named tensors in the given order (names included).
pub fn named_tensors_hash<'a>(items: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<String> {
    let mut h = Sha256::new();
    for (n, t) in items {
        h.update((n.len() as u64).to_le_bytes());
        h.update(n.as_bytes());
        feed(&mut h, t)?;
    }
    Ok(hex(&h.finalize()))
}

/// SHA-256 of raw bytes, as hex.
pub fn bytes_hash(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

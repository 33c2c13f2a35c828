// The byte-plane layout of a packed safetensors file, both directions. Shared by the crate (for
// the packer, `cargo xtask goldens`) and its build script (the unpacker) through `include!`, so
// the format is written once. A file keeps its header; its data section becomes four planes (byte
// k of every 4-byte word, then k + 1, …; zero-padded to a multiple of 4), and its original length
// is the largest end offset the header names.

/// A file that is not a (packed) safetensors file: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanesError(pub String);

impl std::fmt::Display for PlanesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed safetensors file: {}", self.0)
    }
}

impl std::error::Error for PlanesError {}

impl From<&str> for PlanesError {
    fn from(s: &str) -> Self {
        PlanesError(s.to_string())
    }
}

/// A safetensors file's header (8-byte length, JSON) and data section.
pub fn safetensors_split(st: &[u8]) -> Result<(serde_json::Map<String, serde_json::Value>, &[u8]), PlanesError> {
    let n = u64::from_le_bytes(st.get(..8).ok_or("short file")?.try_into().map_err(|_| "header length")?) as usize;
    let header = st.get(8..8 + n).ok_or("header past the end")?;
    let map = serde_json::from_slice(header).map_err(|e| PlanesError(format!("header: {e}")))?;
    Ok((map, &st[8 + n..]))
}

/// The file with its data section as four byte planes.
pub fn to_planes(st: &[u8]) -> Result<Vec<u8>, PlanesError> {
    let (_, data) = safetensors_split(st)?;
    let head = st.len() - data.len();
    let words = data.len().div_ceil(4);
    let mut out = st[..head].to_vec();
    out.resize(head + 4 * words, 0);
    for (i, b) in data.iter().enumerate() {
        out[head + (i % 4) * words + i / 4] = *b;
    }
    Ok(out)
}

/// The inverse of [`to_planes`].
pub fn from_planes(st: &[u8]) -> Result<Vec<u8>, PlanesError> {
    let (header, planes) = safetensors_split(st)?;
    let len = header.values().filter_map(|v| v["data_offsets"][1].as_u64()).max().unwrap_or(0) as usize;
    let words = len.div_ceil(4);
    if planes.len() != 4 * words {
        return Err(PlanesError(format!("data section of {} bytes, expected {} for {len} bytes in planes", planes.len(), 4 * words)));
    }
    let mut out = st[..st.len() - planes.len()].to_vec();
    out.extend((0..len).map(|i| planes[(i % 4) * words + i / 4]));
    Ok(out)
}

//! Shared helpers for golden tests: locate the goldens, read safetensors into host vectors.
#![allow(dead_code)]

use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};

/// The goldens' folder ([`ptl_goldens::folder`]: the repository's copy, or `$PTL_GOLDENS`), or
/// `None` with a loud skip line (a failure under CI) when there is none.
pub fn goldens() -> Option<PathBuf> {
    ptl_goldens::folder()
}

/// A host copy of one tensor.
pub struct Tensor {
    pub shape: Vec<usize>,
    pub f32: Vec<f32>,
    pub i64: Vec<i64>,
}

/// All tensors of a safetensors file, converted to f32 (F32, U8) or i64 (I64).
pub struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    pub fn open(path: PathBuf) -> Golden {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        Golden { bytes }
    }

    pub fn names(&self) -> Vec<String> {
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors header");
        st.names().into_iter().map(|s| s.to_string()).collect()
    }

    pub fn get(&self, name: &str) -> Tensor {
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors header");
        let v = st.tensor(name).unwrap_or_else(|e| panic!("tensor {name}: {e}"));
        let d = v.data();
        let shape = v.shape().to_vec();
        match v.dtype() {
            Dtype::F32 => {
                Tensor { shape, f32: d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(), i64: vec![] }
            }
            Dtype::U8 => Tensor { shape, f32: d.iter().map(|&b| b as f32).collect(), i64: vec![] },
            Dtype::I64 => {
                Tensor { shape, f32: vec![], i64: d.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect() }
            }
            other => panic!("unsupported dtype {other:?} for {name}"),
        }
    }

    pub fn f32(&self, name: &str) -> Vec<f32> {
        self.get(name).f32
    }
}

/// max |a − b| over two equal-length slices.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

pub fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

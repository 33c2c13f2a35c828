//! Shared helpers of the golden tests: locating the goldens, loading tensors, comparing with the
//! README's convention (max |a − b| / max |b| per tensor).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use ptl_autograd::{DType, Device, Tensor};
use ptl_heads::{ModelConfig, PoseModel};

/// The golden `model/` folder (under [`ptl_goldens::folder`]: the repository's copy, or
/// `$PTL_GOLDENS` on a machine that runs packed test binaries), or `None` with a loud skip line (a
/// failure under CI) when there are no goldens; a missing file in it fails the test that loads it.
pub fn model_dir() -> Option<PathBuf> {
    Some(ptl_goldens::folder()?.join("model"))
}

pub fn load(dir: &std::path::Path, file: &str, device: Device) -> HashMap<String, Tensor> {
    ptl_autograd::module::load_safetensors(&dir.join(file), device).unwrap_or_else(|e| panic!("loading {file}: {e}"))
}

pub fn get<'a>(m: &'a HashMap<String, Tensor>, k: &str) -> &'a Tensor {
    m.get(k).unwrap_or_else(|| panic!("golden key `{k}` missing"))
}

/// max |a − b| / max |b| (as f64), checking shapes.
pub fn rel_dev(name: &str, a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "{name}: shape");
    let av = a.to_dtype(DType::F64).and_then(|t| t.to_f64_vec()).expect("a");
    let bv = b.to_dtype(DType::F64).and_then(|t| t.to_f64_vec()).expect("b");
    let scale = bv.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let dev = av.iter().zip(&bv).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(av.iter().all(|v| v.is_finite()), "{name}: non-finite values");
    if scale == 0.0 {
        dev
    } else {
        dev / scale
    }
}

/// Collects per-group worst deviations and asserts them against `tol`.
#[derive(Default)]
pub struct Report {
    pub groups: Vec<(String, f64, String)>,
}

impl Report {
    pub fn add(&mut self, group: &str, name: &str, d: f64) {
        match self.groups.iter_mut().find(|g| g.0 == group) {
            Some(g) => {
                if d > g.1 {
                    g.1 = d;
                    g.2 = name.to_string();
                }
            }
            None => self.groups.push((group.to_string(), d, name.to_string())),
        }
    }
    pub fn check(&mut self, group: &str, name: &str, a: &Tensor, b: &Tensor) {
        let d = rel_dev(name, a, b);
        self.add(group, name, d);
    }
    pub fn assert_below(&self, tol: f64, what: &str) {
        for (g, d, n) in &self.groups {
            println!("[{what}] {g:<28} max rel dev {d:.3e}  (worst: {n})");
        }
        for (g, d, n) in &self.groups {
            assert!(*d <= tol, "[{what}] {g}: {n} deviates {d:.3e} > {tol:.1e}");
        }
    }
}

/// The nc = 1, 17×3, scale-n model with the golden weights on `device`.
pub fn golden_model(dir: &std::path::Path, device: Device) -> PoseModel {
    let m = PoseModel::new(ModelConfig::default(), device, 0).expect("build");
    let w = load(dir, "weights.safetensors", device);
    m.load_state_dict(&w, true).expect("load golden weights");
    m
}

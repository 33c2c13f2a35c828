//! Helpers of the optimisation tests: golden files as `ptl_autograd` tensors, deviations.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use ptl_autograd::{module, Device, Tensor};

/// The goldens' folder ([`ptl_goldens::folder`]), or `None` with a loud skip line (a failure
/// under CI).
pub fn goldens() -> Option<PathBuf> {
    ptl_goldens::folder()
}

/// Where the golden cases run: the CPU, or `$PTL_OPTIM_DEVICE` (the GPU machine's device pack
/// sets `cuda:0`: the same cases on the CUDA backend).
pub fn device() -> Device {
    match std::env::var("PTL_OPTIM_DEVICE") {
        Ok(d) if !d.is_empty() => Device::parse(&d).unwrap_or_else(|e| panic!("PTL_OPTIM_DEVICE={d}: {e}")),
        _ => Device::Cpu,
    }
}

/// A golden file's tensors, on [`device`].
pub fn load(rel: &str) -> HashMap<String, Tensor> {
    let root = goldens().expect("goldens present");
    module::load_safetensors(&root.join(rel), device()).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

pub fn json(rel: &str) -> serde_json::Value {
    let root = goldens().expect("goldens present");
    let s = std::fs::read_to_string(root.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// `named_parameters` order of the model.
pub fn parameter_order() -> Vec<String> {
    let v = json("model/params.json");
    v["parameter_order"].as_array().expect("parameter_order").iter().map(|x| x.as_str().expect("name").to_string()).collect()
}

/// Fresh trainable copies of every model parameter (from `weights.safetensors`), in optimizer
/// walk order.
pub fn fresh_params() -> Vec<(String, Tensor)> {
    let w = load("model/weights.safetensors");
    parameter_order()
        .into_iter()
        .map(|n| {
            let t = w.get(&n).unwrap_or_else(|| panic!("weights lack {n}"));
            let p = module::parameter(t.deep_copy().expect("copy")).expect("parameter");
            (n, p)
        })
        .collect()
}

/// (max |a − b|, max |b|).
pub fn dev(a: &Tensor, b: &Tensor) -> (f64, f64) {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let (x, y) = (a.to_f64_vec().expect("a"), b.to_f64_vec().expect("b"));
    let mut d: f64 = 0.0;
    let mut m: f64 = 0.0;
    for (p, q) in x.iter().zip(&y) {
        d = d.max((p - q).abs());
        m = m.max(q.abs());
    }
    (d, m)
}

/// Tracks the worst relative (to max |reference|) deviation of a family of comparisons.
#[derive(Default)]
pub struct Worst {
    pub rel: f64,
    pub abs: f64,
    pub what: String,
}

impl Worst {
    pub fn add(&mut self, what: &str, a: &Tensor, b: &Tensor) -> f64 {
        let (d, m) = dev(a, b);
        let r = if m > 0.0 { d / m } else { d };
        if r > self.rel {
            self.rel = r;
            self.what = what.to_string();
        }
        self.abs = self.abs.max(d);
        r
    }
    pub fn report(&self, label: &str) {
        println!("{label}: max rel dev {:.3e} (at {}), max abs dev {:.3e}", self.rel, self.what, self.abs);
    }
}

//! A small conv/BN/SiLU network with a trunk and two heads (head B has two outputs), SGD, and a
//! step runner that goes either native or through recorded regions.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use ptl_autograd::{no_grad, BatchNormOptions, DType, Device, Result, Rng, Tensor, TensorKind};
use ptl_capture::{Recorder, RegionHandle, RegionSpec};

/// Named tensors; a slot can be replaced by a new tensor (a storage change).
#[derive(Clone)]
pub struct Params(pub Arc<RwLock<BTreeMap<String, (Tensor, TensorKind)>>>);

impl Params {
    pub fn get(&self, n: &str) -> Tensor {
        self.0.read().unwrap().get(n).unwrap_or_else(|| panic!("no tensor {n}")).0.clone()
    }
    pub fn replace(&self, n: &str, t: Tensor) {
        let mut m = self.0.write().unwrap();
        let k = m[n].1;
        m.insert(n.to_string(), (t, k));
    }
    pub fn with_prefix(&self, p: &str) -> Vec<(String, Tensor, TensorKind)> {
        self.0.read().unwrap().iter().filter(|(n, _)| n.starts_with(p)).map(|(n, (t, k))| (n.clone(), t.clone(), *k)).collect()
    }
    pub fn all(&self) -> Vec<(String, Tensor, TensorKind)> {
        self.with_prefix("")
    }
    pub fn trainable(&self) -> Vec<(String, Tensor)> {
        self.all().into_iter().filter(|e| e.2 == TensorKind::Parameter).map(|e| (e.0, e.1)).collect()
    }
    pub fn bytes(&self) -> Vec<(String, Vec<u8>)> {
        self.all().into_iter().map(|(n, t, _)| (n, t.to_bytes().unwrap())).collect()
    }
}

pub struct Net {
    pub p: Params,
    pub dev: Device,
    pub dt: DType,
}

const OPTS: BatchNormOptions = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };

impl Net {
    pub fn new(dev: Device, dt: DType, seed: u64) -> Net {
        let mut rng = Rng::new(seed);
        let mut m = BTreeMap::new();
        let mut p = |n: &str, s: Vec<usize>, lo: f64, hi: f64, rng: &mut Rng| {
            let t = Tensor::rand(s, lo, hi, dt, dev, rng).unwrap().requires_grad_(true).unwrap();
            m.insert(n.to_string(), (t, TensorKind::Parameter));
        };
        p("trunk.w1", vec![8, 3, 3, 3], -0.3, 0.3, &mut rng);
        p("trunk.g1", vec![8], 0.5, 1.5, &mut rng);
        p("trunk.b1", vec![8], -0.5, 0.5, &mut rng);
        p("trunk.w2", vec![16, 8, 3, 3], -0.15, 0.15, &mut rng);
        p("trunk.g2", vec![16], 0.5, 1.5, &mut rng);
        p("trunk.b2", vec![16], -0.5, 0.5, &mut rng);
        p("ha.w", vec![4, 16, 1, 1], -0.3, 0.3, &mut rng);
        p("ha.b", vec![4], -0.1, 0.1, &mut rng);
        p("hb.w1", vec![8, 16, 3, 3], -0.1, 0.1, &mut rng);
        p("hb.g", vec![8], 0.5, 1.5, &mut rng);
        p("hb.b", vec![8], -0.5, 0.5, &mut rng);
        p("hb.w2", vec![2, 8, 1, 1], -0.3, 0.3, &mut rng);
        p("hb.w3", vec![3, 8, 1, 1], -0.3, 0.3, &mut rng);
        let mut b = |n: &str, v: f64| {
            m.insert(
                n.to_string(),
                (
                    Tensor::full(
                        vec![if n.starts_with("trunk.rm1") || n.starts_with("trunk.rv1") || n.starts_with("hb") { 8 } else { 16 }],
                        v,
                        DType::F32,
                        dev,
                    )
                    .unwrap(),
                    TensorKind::Buffer,
                ),
            );
        };
        b("trunk.rm1", 0.0);
        b("trunk.rv1", 1.0);
        b("trunk.rm2", 0.0);
        b("trunk.rv2", 1.0);
        b("hb.rm", 0.0);
        b("hb.rv", 1.0);
        Net { p: Params(Arc::new(RwLock::new(m))), dev, dt }
    }

    pub fn trunk(p: &Params, x: &Tensor) -> Result<Tensor> {
        let a = x.conv2d(&p.get("trunk.w1"), None, (1, 1), (1, 1), 1)?.batch_norm2d_silu(
            &p.get("trunk.g1"),
            &p.get("trunk.b1"),
            &p.get("trunk.rm1"),
            &p.get("trunk.rv1"),
            OPTS,
        )?;
        a.conv2d(&p.get("trunk.w2"), None, (2, 2), (1, 1), 1)?
            .batch_norm2d(&p.get("trunk.g2"), &p.get("trunk.b2"), &p.get("trunk.rm2"), &p.get("trunk.rv2"), OPTS)?
            .silu()
    }
    pub fn head_a(p: &Params, f: &Tensor) -> Result<Tensor> {
        f.conv2d(&p.get("ha.w"), Some(&p.get("ha.b")), (1, 1), (0, 0), 1)
    }
    pub fn head_b(p: &Params, f: &Tensor) -> Result<(Tensor, Tensor)> {
        let h = f.conv2d(&p.get("hb.w1"), None, (1, 1), (1, 1), 1)?.batch_norm2d_silu(
            &p.get("hb.g"),
            &p.get("hb.b"),
            &p.get("hb.rm"),
            &p.get("hb.rv"),
            OPTS,
        )?;
        Ok((h.conv2d(&p.get("hb.w2"), None, (1, 1), (0, 0), 1)?, h.conv2d(&p.get("hb.w3"), None, (1, 1), (0, 0), 1)?))
    }
}

/// The trunk and both heads as recorded regions.
pub struct Regions {
    pub trunk: RegionHandle,
    pub a: RegionHandle,
    pub b: RegionHandle,
}

impl Regions {
    pub fn new(rec: &Recorder, p: &Params) -> Regions {
        let (p1, p2, p3, s1, s2, s3) = (p.clone(), p.clone(), p.clone(), p.clone(), p.clone(), p.clone());
        Regions {
            trunk: rec.region(RegionSpec::new("trunk", move || s1.with_prefix("trunk."), move |xs| Ok(vec![Net::trunk(&p1, &xs[0])?]))),
            a: rec.region(RegionSpec::new("head_a", move || s2.with_prefix("ha."), move |xs| Ok(vec![Net::head_a(&p2, &xs[0])?]))),
            b: rec.region(RegionSpec::new(
                "head_b",
                move || s3.with_prefix("hb."),
                move |xs| {
                    let (u, v) = Net::head_b(&p3, &xs[0])?;
                    Ok(vec![u, v])
                },
            )),
        }
    }
}

/// Fixed data of a run.
pub struct Data {
    pub x: Tensor,
    pub ra: Tensor,
    pub rb1: Tensor,
    pub rb2: Tensor,
}

impl Data {
    pub fn new(dev: Device, dt: DType, n: usize, hw: usize, seed: u64) -> Data {
        let mut rng = Rng::new(seed);
        let h = hw / 2;
        Data {
            x: Tensor::rand(vec![n, 3, hw, hw], -1.0, 1.0, dt, dev, &mut rng).unwrap(),
            ra: Tensor::rand(vec![n, 4, h, h], -1.0, 1.0, dt, dev, &mut rng).unwrap(),
            rb1: Tensor::rand(vec![n, 2, h, h], -1.0, 1.0, dt, dev, &mut rng).unwrap(),
            rb2: Tensor::rand(vec![n, 3, h, h], -1.0, 1.0, dt, dev, &mut rng).unwrap(),
        }
    }
}

/// Which outputs the loss uses on step `i`: 2 = all, 1 = head B's first output only, 0 = head A only.
pub fn mode(i: usize) -> usize {
    match i % 4 {
        3 => 0,
        2 => 1,
        _ => 2,
    }
}

pub struct StepOut {
    pub loss: Vec<u8>,
    /// Which parameters had a gradient after backward (name order).
    pub has_grad: Vec<(String, bool)>,
}

/// Trunk, head A and head B's two outputs on `x`; `regions = None` runs natively.
pub fn forward(net: &Net, regions: Option<&Regions>, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    match regions {
        None => {
            let f = Net::trunk(&net.p, x)?;
            let a = Net::head_a(&net.p, &f)?;
            let (b1, b2) = Net::head_b(&net.p, &f)?;
            Ok((a, b1, b2))
        }
        Some(r) => {
            let f = r.trunk.call(std::slice::from_ref(x)).map_err(ptl_autograd::Error::from)?.remove(0);
            let a = r.a.call(std::slice::from_ref(&f)).map_err(ptl_autograd::Error::from)?.remove(0);
            let mut b = r.b.call(std::slice::from_ref(&f)).map_err(ptl_autograd::Error::from)?;
            let b2 = b.remove(1);
            Ok((a, b.remove(0), b2))
        }
    }
}

/// One SGD step; `regions = None` runs natively.
pub fn step(net: &Net, regions: Option<&Regions>, d: &Data, mode: usize, lr: f64) -> Result<StepOut> {
    for (_, p) in net.p.trainable() {
        p.set_grad(None);
    }
    let (a, b1, b2) = forward(net, regions, &d.x)?;
    let mut loss = a.mul(&d.ra)?.mean_all()?;
    if mode >= 1 {
        loss = loss.add(&b1.mul(&d.rb1)?.mean_all()?)?;
    }
    if mode == 2 {
        loss = loss.add(&b2.mul(&d.rb2)?.mean_all()?)?;
    }
    loss.backward()?;
    let has_grad = net.p.trainable().iter().map(|(n, p)| (n.clone(), p.grad().is_some())).collect();
    no_grad(|| -> Result<()> {
        for (_, p) in net.p.trainable() {
            if let Some(g) = p.grad() {
                p.add_(&g.mul_scalar(-lr)?)?;
            }
        }
        Ok(())
    })?;
    Ok(StepOut { loss: loss.to_bytes()?, has_grad })
}

/// Runs `steps` steps natively and recorded from the same initial state; returns
/// (native losses, recorded losses, native state, recorded state, grad presence both).
pub struct Pair {
    pub native_losses: Vec<Vec<u8>>,
    pub rec_losses: Vec<Vec<u8>>,
    pub native_state: Vec<(String, Vec<u8>)>,
    pub rec_state: Vec<(String, Vec<u8>)>,
    pub native_presence: Vec<Vec<(String, bool)>>,
    pub rec_presence: Vec<Vec<(String, bool)>>,
}

pub fn run_pair(rec: &Recorder, dev: Device, dt: DType, steps: usize) -> Result<(Pair, Regions)> {
    let n1 = Net::new(dev, dt, 11);
    let n2 = Net::new(dev, dt, 11);
    let d = Data::new(dev, dt, 2, 16, 5);
    let regions = Regions::new(rec, &n2.p);
    let mut pair = Pair {
        native_losses: vec![],
        rec_losses: vec![],
        native_state: vec![],
        rec_state: vec![],
        native_presence: vec![],
        rec_presence: vec![],
    };
    for i in 0..steps {
        let a = step(&n1, None, &d, mode(i), 0.05)?;
        let b = step(&n2, Some(&regions), &d, mode(i), 0.05)?;
        pair.native_losses.push(a.loss);
        pair.rec_losses.push(b.loss);
        pair.native_presence.push(a.has_grad);
        pair.rec_presence.push(b.has_grad);
    }
    pair.native_state = n1.p.bytes();
    pair.rec_state = n2.p.bytes();
    Ok((pair, regions))
}

/// Asserts bit identity and the absent-gradient pattern.
pub fn check_pair(p: &Pair, what: &str) {
    assert_eq!(p.native_losses, p.rec_losses, "{what}: per-step losses differ");
    assert_eq!(p.native_state, p.rec_state, "{what}: final parameters/buffers differ");
    assert_eq!(p.native_presence, p.rec_presence, "{what}: gradient presence differs");
    for (i, pres) in p.rec_presence.iter().enumerate() {
        for (n, has) in pres {
            let expect = match mode(i) {
                0 => !n.starts_with("hb."),
                1 => n != "hb.w3",
                _ => true,
            };
            assert_eq!(*has, expect, "{what}: step {i} (mode {}): `{n}` grad presence {has}, expected {expect}", mode(i));
        }
    }
}

/// Three gradient-accumulation windows of three micro-batches each, with persistent gradients
/// (`set_keep_grad_buffer`) and a zero-grad after each window: the gradients' bytes and buffer
/// addresses at the end of every window. A recorded backward writes or adds the gradients inside
/// its graph here (docs/capture.md §13.1), so the addresses must never move.
pub fn persistent_windows(net: &Net, regions: Option<&Regions>, dev: Device, dt: DType, hw: usize) -> (Vec<Vec<Vec<u8>>>, Vec<Vec<usize>>) {
    for (_, p) in net.p.trainable() {
        p.set_keep_grad_buffer(true);
    }
    let (mut bytes, mut ptrs) = (Vec::new(), Vec::new());
    for w in 0..3u64 {
        for m in 0..3u64 {
            let d = Data::new(dev, dt, 2, hw, 20 + 3 * w + m);
            let (a, b1, _) = forward(net, regions, &d.x).unwrap();
            a.mul(&d.ra).unwrap().mean_all().unwrap().add(&b1.mul(&d.rb1).unwrap().mean_all().unwrap()).unwrap().backward().unwrap();
        }
        // (The second output of head b is unused: its own parameters get no gradient.)
        let grads: Vec<Tensor> = net.p.trainable().iter().filter_map(|(_, p)| p.grad()).collect();
        assert!(grads.len() >= 8, "most parameters have a gradient: {}", grads.len());
        bytes.push(grads.iter().map(|g| g.to_bytes().unwrap()).collect());
        ptrs.push(grads.iter().map(|g| g.storage_ptr()).collect());
        for (_, p) in net.p.trainable() {
            p.zero_grad();
        }
    }
    (bytes, ptrs)
}

/// [`persistent_windows`] natively and through `rec`'s regions: the same bytes, buffers that never
/// move, and per region exactly the expected backward recordings — static buffers on the first
/// replay, then write-into and add-into (region b's capture also recorded the backward of both its
/// outputs, which this loss never uses) — and a backward replay for each of the 9 micro-batches.
pub fn check_persistent_windows(rec: &ptl_capture::Recorder, dev: Device, hw: usize) {
    let native = persistent_windows(&Net::new(dev, DType::F32, 9), None, dev, DType::F32, hw);
    let net = Net::new(dev, DType::F32, 9);
    let regions = Regions::new(rec, &net.p);
    let (bytes, ptrs) = persistent_windows(&net, Some(&regions), dev, DType::F32, hw);
    assert_eq!(bytes, native.0, "accumulated inside the graph like native");
    assert!(ptrs.iter().all(|p| *p == ptrs[0]), "gradient buffers moved: {ptrs:?}");
    for (name, r, bwd) in [("trunk", &regions.trunk, 3), ("a", &regions.a, 3), ("b", &regions.b, 4)] {
        let st = r.stats();
        assert_eq!(st.backward_captures, bwd, "{name}: static buffers, then write-into and add-into: {st:?}");
        assert_eq!(st.backward_replays, 9, "{name}: {st:?}");
    }
}

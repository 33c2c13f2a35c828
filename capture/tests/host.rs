//! Host-side tests of the recorder's state machine on CPU, with the `ReplayNatively` test double
//! (recording keeps the body; every launch runs it). GPU behaviour is in `cuda_capture.rs`.

mod common;

use std::sync::Arc;

use common::*;
use ptl_autograd::{autocast, no_grad, DType, Device, Rng, Tensor, TensorKind};
use ptl_capture::testing::ReplayNatively;
use ptl_capture::{CaptureError, FallbackReason, Recorder, RecorderConfig, RegionSpec, RetireReason};

fn recorder(cfg: RecorderConfig) -> (Recorder, Arc<ReplayNatively>) {
    let b = Arc::new(ReplayNatively::default());
    (Recorder::with_backend(cfg, b.clone()), b)
}

#[test]
fn t3_t5_parity_and_absent_gradients_on_the_double() {
    for dt in [DType::F32, DType::BF16] {
        let (rec, _) = recorder(RecorderConfig::default());
        let (pair, regions) = run_pair(&rec, Device::Cpu, dt, 12).unwrap();
        check_pair(&pair, &format!("cpu {dt}"));
        let t = regions.trunk.stats();
        assert_eq!((t.captures, t.replays, t.native_for(FallbackReason::Warmup)), (1, 11, 1), "{t:?}");
        let b = regions.b.stats();
        // Masks seen by head B: all outputs, first output only; none (no backward at all).
        assert_eq!(b.backward_captures, 2, "{b:?}");
        assert!(b.eager_dispatches_during_replay > 0, "the double re-runs the body on replay");
        println!("{}", rec.summary_line());
    }
}

#[test]
fn t4_key_discipline_and_shape_fallback() {
    let (rec, _) = recorder(RecorderConfig { max_recordings: 1, ..Default::default() });
    let net = Net::new(Device::Cpu, DType::F32, 3);
    let p = net.p.clone();
    let s = net.p.clone();
    let r = rec.region(RegionSpec::new("trunk", move || s.with_prefix("trunk."), move |xs| Ok(vec![Net::trunk(&p, &xs[0])?])));
    let big = Data::new(Device::Cpu, DType::F32, 2, 8, 1).x;
    let small = Data::new(Device::Cpu, DType::F32, 1, 8, 1).x;
    for _ in 0..3 {
        r.call(std::slice::from_ref(&big)).unwrap();
    }
    let s0 = r.stats();
    assert_eq!((s0.captures, s0.replays), (1, 2));
    // A smaller last batch: native (first as warmup of its signature, then cache full), counted.
    r.call(std::slice::from_ref(&small)).unwrap();
    r.call(std::slice::from_ref(&small)).unwrap();
    let s1 = r.stats();
    assert_eq!(s1.replays, 2);
    assert_eq!(s1.native_for(FallbackReason::CacheFull), 1, "{s1:?}");
    // Back to the recorded shape: replays again.
    r.call(std::slice::from_ref(&big)).unwrap();
    assert_eq!(r.stats().replays, 3);
    // Flipping train/eval or requires_grad is a different signature.
    r.set_training(false);
    r.call(std::slice::from_ref(&big)).unwrap();
    r.set_training(true);
    let big_rg = big.detach().requires_grad_(true).unwrap();
    r.call(std::slice::from_ref(&big_rg)).unwrap();
    no_grad(|| r.call(std::slice::from_ref(&big)).unwrap());
    let s2 = r.stats();
    assert_eq!(s2.replays, 3, "{s2:?}");
    assert_eq!(s2.native_for(FallbackReason::Warmup), 5, "{s2:?}");
}

#[test]
fn t6_gradient_accumulation_over_two_replays() {
    let run = |recorded: bool| -> Vec<Vec<u8>> {
        let (rec, _) = recorder(RecorderConfig { warmup_calls: 0, ..Default::default() });
        let net = Net::new(Device::Cpu, DType::F32, 9);
        let regions = Regions::new(&rec, &net.p);
        let d1 = Data::new(Device::Cpu, DType::F32, 2, 8, 1);
        let d2 = Data::new(Device::Cpu, DType::F32, 2, 8, 2);
        for d in [&d1, &d2] {
            let (a, b1, _) = forward(&net, recorded.then_some(&regions), &d.x).unwrap();
            a.mul(&d.ra).unwrap().mean_all().unwrap().add(&b1.mul(&d.rb1).unwrap().mean_all().unwrap()).unwrap().backward().unwrap();
        }
        net.p.trainable().iter().map(|(_, p)| p.grad().map(|g| g.to_bytes().unwrap()).unwrap_or_default()).collect()
    };
    assert_eq!(run(false), run(true), "g1 + g2 must match native accumulation");
}

/// Persistent gradients: after the first backward replay of a mask, the recorded backward writes
/// (first micro-batch of a window) or adds (the others) the parameters' gradients into their kept
/// buffers inside the graph — two more backward recordings per region, then none — with the
/// bytes of native accumulation, and the buffers never move.
#[test]
fn t6_persistent_gradients_accumulate_inside_the_backward_graph() {
    let (rec, _) = recorder(RecorderConfig { warmup_calls: 0, ..Default::default() });
    check_persistent_windows(&rec, Device::Cpu, 8);
}

#[test]
fn t7_pending_backward_runs_native_or_errors() {
    for strict in [false, true] {
        let (rec, _) = recorder(RecorderConfig { warmup_calls: 0, strict_pending: strict, ..Default::default() });
        let net = Net::new(Device::Cpu, DType::F32, 4);
        let p = net.p.clone();
        let s = net.p.clone();
        let r = rec.region(RegionSpec::new("head_a", move || s.with_prefix("ha."), move |xs| Ok(vec![Net::head_a(&p, &xs[0])?])));
        let x = Data::new(Device::Cpu, DType::F32, 1, 8, 1).x;
        let f = Tensor::rand(vec![1, 16, 4, 4], -1.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
        let _ = x;
        let y1 = r.call(std::slice::from_ref(&f)).unwrap().remove(0);
        let second = r.call(std::slice::from_ref(&f));
        if strict {
            assert!(matches!(second, Err(CaptureError::PendingBackward { .. })), "{second:?}");
        } else {
            let y2 = second.unwrap().remove(0);
            assert_eq!(y1.to_bytes().unwrap(), y2.to_bytes().unwrap());
            assert_eq!(r.stats().native_for(FallbackReason::PendingBackward), 1);
        }
        y1.sum_all().unwrap().backward().unwrap();
        let g_after = net.p.get("ha.w").grad().unwrap().to_bytes().unwrap();
        // Native reference for the same gradient.
        let n2 = Net::new(Device::Cpu, DType::F32, 4);
        Net::head_a(&n2.p, &f).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(g_after, n2.p.get("ha.w").grad().unwrap().to_bytes().unwrap());
        // Dropping the outputs without backward discards the pending token: the next call replays.
        let before = r.stats().replays;
        drop(r.call(std::slice::from_ref(&f)).unwrap());
        r.call(std::slice::from_ref(&f)).unwrap();
        assert_eq!(r.stats().replays, before + 2);
        // Explicit discard: a pending forward whose backward then errors.
        let y = r.call(std::slice::from_ref(&f)).unwrap().remove(0);
        r.discard_pending();
        assert!(y.sum_all().unwrap().backward().is_err());
    }
}

#[test]
fn t8_storage_change_retires_only_that_region() {
    let (rec, _) = recorder(RecorderConfig::default());
    let net = Net::new(Device::Cpu, DType::F32, 5);
    let regions = Regions::new(&rec, &net.p);
    let d = Data::new(Device::Cpu, DType::F32, 2, 8, 1);
    for i in 0..3 {
        step(&net, Some(&regions), &d, mode(i), 0.01).unwrap();
    }
    // In-place load keeps the recording.
    let w = net.p.get("ha.w");
    no_grad(|| w.copy_(&w.mul_scalar(0.5).unwrap())).unwrap();
    step(&net, Some(&regions), &d, 2, 0.01).unwrap();
    assert_eq!(regions.a.stats().retired_for(RetireReason::Storage), 0);
    // A new tensor retires head A only.
    net.p.replace("ha.w", w.deep_copy().unwrap().requires_grad_(true).unwrap());
    step(&net, Some(&regions), &d, 2, 0.01).unwrap();
    let a = regions.a.stats();
    assert_eq!(a.retired_for(RetireReason::Storage), 1, "{a:?}");
    assert_eq!(a.native_for(FallbackReason::Stale), 1);
    assert_eq!(regions.trunk.stats().retired.len(), 0);
    assert_eq!(regions.b.stats().retired.len(), 0);
    // Head A re-warms and records again; the new parameter receives gradients.
    for i in 0..3 {
        step(&net, Some(&regions), &d, mode(i), 0.01).unwrap();
    }
    assert_eq!(regions.a.stats().captures, 2);
    assert!(regions.a.stats().warnings.iter().any(|w| w.contains("ha.w")));
}

#[test]
fn hooks_precision_failures_release_clone_serde() {
    let (rec, backend) = recorder(RecorderConfig { warmup_calls: 0, ..Default::default() });
    let net = Net::new(Device::Cpu, DType::F32, 6);
    let regions = Regions::new(&rec, &net.p);
    let d = Data::new(Device::Cpu, DType::F32, 2, 8, 1);
    // Hooks: native.
    regions.a.set_hooks(true);
    step(&net, Some(&regions), &d, 2, 0.01).unwrap();
    assert_eq!(regions.a.stats().native_for(FallbackReason::Hooks), 1);
    regions.a.set_hooks(false);
    step(&net, Some(&regions), &d, 2, 0.01).unwrap();
    assert_eq!(regions.a.stats().captures, 1);
    // Precision change retires.
    autocast(Some(DType::BF16), || step(&net, Some(&regions), &d, 2, 0.01)).unwrap();
    assert_eq!(regions.a.stats().retired_for(RetireReason::Precision), 1);
    // A failed capture falls back natively with a warning, counted by error kind.
    backend.fail_next.lock().unwrap().push(CaptureError::HostSync { region: "trunk".into(), op: "to_cpu".into() });
    let r2 = rec.region(RegionSpec::new("extra", Vec::new, |xs: &[Tensor]| Ok(vec![xs[0].mul_scalar(2.0)?])));
    let x = Tensor::ones(vec![2], DType::F32, Device::Cpu).unwrap();
    assert_eq!(r2.call(std::slice::from_ref(&x)).unwrap()[0].to_vec::<f32>().unwrap(), vec![2.0, 2.0]);
    let s = r2.stats();
    assert_eq!(s.capture_failures.get("host_sync"), Some(&1));
    assert_eq!(s.native_for(FallbackReason::CaptureFailed), 1);
    assert!(s.warnings[0].contains("runs natively"));
    // Release all, Clone and serde start empty.
    assert!(regions.trunk.live_recordings() > 0);
    let cloned = regions.trunk.clone();
    assert_eq!(cloned.live_recordings(), 0);
    assert_eq!(cloned.stats().captures, 0);
    rec.release_all();
    assert_eq!(regions.trunk.live_recordings(), 0);
    assert!(regions.trunk.stats().retired_for(RetireReason::Released) > 0);
    let json = serde_json::to_string(&rec).unwrap();
    let back: Recorder = serde_json::from_str(&json).unwrap();
    assert!(back.stats().is_empty());
    assert_eq!(rec.clone().stats().len(), 0);
    assert!(rec.summary_line().starts_with("capture[replay-natively]: trunk:"));
    let _ = TensorKind::Buffer;
}

#[test]
fn disabled_recorder_is_native() {
    let (rec, backend) = recorder(RecorderConfig { enabled: false, ..Default::default() });
    let (pair, regions) = run_pair(&rec, Device::Cpu, DType::F32, 4).unwrap();
    check_pair(&pair, "disabled");
    assert_eq!(regions.trunk.stats().native_for(FallbackReason::Disabled), 4);
    assert_eq!(backend.records.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// T10 on the double: a region drawing from a graph-safe generator gives the eager sequence call
/// for call (the double's replays run the body in the generator's replay mode), and the host
/// offset advances exactly as eager.
#[test]
fn t10_graph_safe_rng_on_the_double_matches_eager() {
    use ptl_autograd::GraphSafeRng;
    let body = |rng: &GraphSafeRng, x: &Tensor| -> ptl_autograd::Result<Vec<Tensor>> {
        Ok(vec![x.dropout(0.5, rng)?, x.narrow(0, 0, 37)?.dropout(0.25, rng)?])
    };
    let (rec, _) = recorder(RecorderConfig { warmup_calls: 1, ..Default::default() });
    let eager = GraphSafeRng::new(42, Device::Cpu).unwrap();
    let rng = Arc::new(GraphSafeRng::new(42, Device::Cpu).unwrap());
    let r2 = rng.clone();
    let region = rec.region(RegionSpec::new("dropout", Vec::new, move |xs: &[Tensor]| body(&r2, &xs[0])).with_graph_rng(rng.clone()));
    let x = Tensor::rand(vec![4096], 0.5, 1.5, DType::F32, Device::Cpu, &mut Rng::new(7)).unwrap();
    let mut first = Vec::new();
    for i in 0..5 {
        let want = body(&eager, &x).unwrap();
        let got = region.call(std::slice::from_ref(&x)).unwrap();
        for k in 0..2 {
            assert_eq!(got[k].to_bytes().unwrap(), want[k].to_bytes().unwrap(), "call {i}, output {k}");
        }
        assert_eq!(rng.offset(), eager.offset(), "call {i}");
        first.push(got[0].to_bytes().unwrap());
    }
    assert_ne!(first[1], first[2]);
    let s = region.stats();
    assert_eq!((s.captures, s.replays), (1, 4), "{s:?}");
}

/// Rule 2.1 for a region that writes state it does not declare — an optimizer-like body moving a
/// parameter and its momentum in place (no surface, no buffers): the warmup's writes are found by
/// the write journal and copied back, so after every call (native warmup call, warmup iteration +
/// capture, replays) the state is eager execution's, byte for byte.
#[test]
fn t2_warmup_rolls_back_undeclared_writes() {
    let (rec, _) = recorder(RecorderConfig::default());
    let state = || {
        let p = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], 3, Device::Cpu).unwrap();
        (p, Tensor::zeros(vec![3], DType::F32, Device::Cpu).unwrap())
    };
    fn step(p: &Tensor, m: &Tensor, x: &Tensor) -> ptl_autograd::Result<Tensor> {
        no_grad(|| -> ptl_autograd::Result<()> {
            m.copy_(&m.mul_scalar(0.9)?.add(x)?)?;
            p.add_(&m.mul_scalar(-0.1)?)
        })?;
        p.mul(x)
    }
    let (pe, me) = state();
    let (pr, mr) = state();
    let (p2, m2) = (pr.clone(), mr.clone());
    let region = rec.region(RegionSpec::new("update", Vec::new, move |xs| Ok(vec![step(&p2, &m2, &xs[0])?])));
    for i in 0..5 {
        let x = Tensor::from_vec(vec![0.5 * i as f32, 1.0, -1.0], 3, Device::Cpu).unwrap();
        let a = step(&pe, &me, &x).unwrap();
        let b = region.call(std::slice::from_ref(&x)).unwrap().remove(0);
        assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "call {i}: outputs");
        assert_eq!(pe.to_bytes().unwrap(), pr.to_bytes().unwrap(), "call {i}: the parameter moved once per call");
        assert_eq!(me.to_bytes().unwrap(), mr.to_bytes().unwrap(), "call {i}: the momentum moved once per call");
    }
    let s = region.stats();
    assert_eq!((s.captures, s.replays), (1, 4), "{s:?}");
}

/// `prepare` records a signature ahead of use without running it: the body's writes are rolled
/// back (the state is as before), the call that follows with that signature replays at once (no
/// native warm-up call), and a signature already held, or a disabled recorder, prepares nothing.
#[test]
fn prepare_records_a_signature_without_running_it() {
    fn step(p: &Tensor, x: &Tensor) -> ptl_autograd::Result<Tensor> {
        no_grad(|| p.add_(&x.mul_scalar(0.5)?))?;
        p.mul(x)
    }
    let (rec, backend) = recorder(RecorderConfig::default());
    let p = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], 3, Device::Cpu).unwrap();
    let reference = p.deep_copy().unwrap();
    let p2 = p.clone();
    let region = rec.region(RegionSpec::new("prepared", Vec::new, move |xs| Ok(vec![step(&p2, &xs[0])?])));
    let x = Tensor::from_vec(vec![0.5f32, 1.0, -1.0], 3, Device::Cpu).unwrap();
    let surface: Vec<(String, Tensor, TensorKind)> = Vec::new();
    let body = |xs: &[Tensor]| Ok(vec![step(&p, &xs[0])?]);
    assert!(region.prepare(std::slice::from_ref(&x), &surface, &body).unwrap(), "recorded");
    assert_eq!(p.to_bytes().unwrap(), reference.to_bytes().unwrap(), "nothing the body wrote stayed");
    assert_eq!(backend.records.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert!(!region.prepare(std::slice::from_ref(&x), &surface, &body).unwrap(), "held already");
    let y = region.call(std::slice::from_ref(&x)).unwrap().remove(0);
    let want = step(&reference, &x).unwrap();
    assert_eq!(y.to_bytes().unwrap(), want.to_bytes().unwrap(), "the first call replays the prepared recording");
    let s = region.stats();
    assert_eq!((s.captures, s.replays, s.native_for(FallbackReason::Warmup)), (1, 1, 0), "{s:?}");
    let (off, _) = recorder(RecorderConfig { enabled: false, ..Default::default() });
    let r2 = off.region(RegionSpec::new("off", Vec::new, |xs| Ok(vec![xs[0].clone()])));
    assert!(!r2.prepare(std::slice::from_ref(&x), &surface, &|xs: &[Tensor]| Ok(vec![xs[0].clone()])).unwrap());
}

/// Regions that take turns over a shared forward arena (the `step` plugin's target buckets): a
/// signature seen after the first recording is captured at its first call, with the shared
/// arenas set aside during its warm-up and put back before its capture; while another region's
/// backward is pending they stay where they are. Replays of every signature still match the
/// native results.
#[test]
fn a_later_signature_warms_up_with_the_shared_arenas_set_aside() {
    let (rec, backend) = recorder(RecorderConfig { share_forward_arena: true, ..Default::default() });
    let net = Net::new(Device::Cpu, DType::F32, 5);
    let region = |name: &str| {
        let (p, s) = (net.p.clone(), net.p.clone());
        rec.region(RegionSpec::new(name, move || s.with_prefix("trunk."), move |xs| Ok(vec![Net::trunk(&p, &xs[0])?])))
    };
    let (r1, r2) = (region("bucket.0"), region("bucket.1"));
    let (a, b) = (Data::new(Device::Cpu, DType::F32, 2, 8, 1).x, Data::new(Device::Cpu, DType::F32, 1, 8, 2).x);
    let step = |r: &ptl_capture::RegionHandle, x: &Tensor| -> Vec<u8> {
        let y = r.call(std::slice::from_ref(x)).unwrap().remove(0);
        let bytes = y.to_bytes().unwrap();
        y.mean_all().unwrap().backward().unwrap();
        bytes
    };
    let native = |x: &Tensor| no_grad(|| Net::trunk(&net.p, x).unwrap().to_bytes().unwrap());
    // The first signature: one native warm-up call, then its capture (nothing to set aside yet).
    for _ in 0..3 {
        step(&r1, &a);
    }
    let s1 = r1.stats();
    assert_eq!((s1.native_for(FallbackReason::Warmup), s1.captures, s1.replays), (1, 1, 2), "{s1:?}");
    assert_eq!(backend.evictions.load(std::sync::atomic::Ordering::Relaxed), 0);
    // A new signature: captured at its first call; both shared arenas (forward and backward)
    // were set aside for its warm-up and put back.
    let first = step(&r1, &b);
    let s1 = r1.stats();
    assert_eq!((s1.native_for(FallbackReason::Warmup), s1.captures, s1.replays), (1, 2, 3), "{s1:?}");
    let (ev, re) =
        (backend.evictions.load(std::sync::atomic::Ordering::Relaxed), backend.restores.load(std::sync::atomic::Ordering::Relaxed));
    assert_eq!((ev, re), (2, 2));
    assert_eq!(first, native(&b), "the new signature's first (replayed) call equals native");
    assert_eq!(step(&r1, &a), native(&a), "the first signature replays after the arenas came back");
    // Another region's forward waits for its backward: a capture now leaves the arenas alone.
    let pending = r1.call(std::slice::from_ref(&a)).unwrap().remove(0);
    let c = Data::new(Device::Cpu, DType::F32, 3, 8, 3).x;
    let y = r2.call(std::slice::from_ref(&c)).unwrap().remove(0);
    assert_eq!(r2.stats().captures, 1, "{:?}", r2.stats());
    assert_eq!(backend.evictions.load(std::sync::atomic::Ordering::Relaxed), 2, "no eviction under a pending backward");
    assert!(!rec.set_shared_arenas_aside().unwrap(), "set aside under a pending backward");
    pending.mean_all().unwrap().add(&y.mean_all().unwrap()).unwrap().backward().unwrap();
    // Between steps (validation): set aside on request; the next replay maps them again.
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert!(rec.set_shared_arenas_aside().unwrap());
    assert_eq!((load(&backend.evictions), load(&backend.restores)), (4, 2));
    assert_eq!(step(&r1, &b), native(&b), "a replay after the arenas were set aside");
    assert_eq!(load(&backend.restores), 4, "both came back at their graphs' launches");
    assert_eq!(step(&r1, &a), native(&a));
    assert_eq!(load(&backend.restores), 4, "once");
}

/// Recorders that take turns (`take_turns`: the step's backward graphs, the optimizer's update)
/// record the graphs that keep nothing past their end into the backend's one turn arena: the
/// update's forward graph (no backward) shares the other recorder's backward arena, so setting
/// that recorder's arenas aside also sets the update's aside, and its next replay maps it again.
/// Results stay the native ones; without `take_turns` the update keeps an arena of its own.
#[test]
fn recorders_that_take_turns_share_one_arena() {
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    for take_turns in [true, false] {
        let backend = Arc::new(ReplayNatively::default());
        let cfg = RecorderConfig { take_turns, ..Default::default() };
        let (step_rec, update_rec) = (Recorder::with_backend(cfg.clone(), backend.clone()), Recorder::with_backend(cfg, backend.clone()));
        let net = Net::new(Device::Cpu, DType::F32, 5);
        let (p, s) = (net.p.clone(), net.p.clone());
        let step = step_rec.region(RegionSpec::new("step", move || s.with_prefix("trunk."), move |xs| Ok(vec![Net::trunk(&p, &xs[0])?])));
        let m = Tensor::zeros(vec![3], DType::F32, Device::Cpu).unwrap();
        let (m2, m_native) = (m.clone(), m.deep_copy().unwrap());
        let bump = |m: &Tensor, x: &Tensor| no_grad(|| m.add_(&x.mul_scalar(0.5)?));
        let update = update_rec.region(RegionSpec::new("update", Vec::new, move |xs| {
            bump(&m2, &xs[0])?;
            Ok(Vec::new())
        }));
        let x = Data::new(Device::Cpu, DType::F32, 2, 8, 1).x;
        for i in 0..4 {
            let y = step.call(std::slice::from_ref(&x)).unwrap().remove(0);
            assert_eq!(y.to_bytes().unwrap(), no_grad(|| Net::trunk(&net.p, &x).unwrap().to_bytes().unwrap()), "call {i}");
            y.mean_all().unwrap().backward().unwrap();
            let g = Tensor::from_vec(vec![i as f32, 1.0, -1.0], 3, Device::Cpu).unwrap();
            update.call(std::slice::from_ref(&g)).unwrap();
            bump(&m_native, &g).unwrap();
            assert_eq!(m.to_bytes().unwrap(), m_native.to_bytes().unwrap(), "call {i}: the update wrote in place as natively");
        }
        assert_eq!((step.stats().captures, update.stats().captures), (1, 1));
        // Set the step recorder's arenas aside (validation), then replay the update alone.
        let restores = load(&backend.restores);
        assert!(step_rec.set_shared_arenas_aside().unwrap(), "the step's backward arena was set aside");
        let g = Tensor::from_vec(vec![2.0f32, 2.0, 2.0], 3, Device::Cpu).unwrap();
        update.call(std::slice::from_ref(&g)).unwrap();
        bump(&m_native, &g).unwrap();
        assert_eq!(m.to_bytes().unwrap(), m_native.to_bytes().unwrap());
        let put_back = load(&backend.restores) - restores;
        match take_turns {
            true => assert_eq!(put_back, 1, "the update's graph is in the step's backward arena: its replay mapped it again"),
            false => assert_eq!(put_back, 0, "the update's graph has an arena of its own"),
        }
    }
}

/// A channels-last input reaches a region's body in the logical order (converted at entry): the
/// region's outputs and the input's gradient equal those of the contiguous input, call after
/// call through warm-up, capture and replays.
#[test]
fn channels_last_inputs_are_taken_in_the_logical_order() {
    use ptl_autograd::MemoryFormat;
    let (rec, _) = recorder(RecorderConfig::default());
    let mut rng = Rng::new(21);
    let w = Tensor::rand(vec![4, 3, 3, 3], -0.5, 0.5, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let (ws, wb) = (w.clone(), w.clone());
    let region = rec.region(RegionSpec::new(
        "conv",
        move || vec![("w".to_string(), ws.clone(), TensorKind::Parameter)],
        move |xs| Ok(vec![xs[0].conv2d(&wb, None, (1, 1), (1, 1), 1)?.silu()?]),
    ));
    for i in 0..4u64 {
        let x = Tensor::rand(vec![2, 3, 5, 5], -1.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(i)).unwrap();
        let plain = x.detach().requires_grad_(true).unwrap();
        let expected = plain.conv2d(&w.detach(), None, (1, 1), (1, 1), 1).unwrap().silu().unwrap();
        expected.sum_all().unwrap().backward().unwrap();
        let leaf = x.detach().requires_grad_(true).unwrap();
        let cl = leaf.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
        let y = region.call(std::slice::from_ref(&cl)).unwrap().remove(0);
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(y.to_bytes().unwrap(), expected.to_bytes().unwrap(), "call {i}: output");
        assert_eq!(leaf.grad().unwrap().to_bytes().unwrap(), plain.grad().unwrap().to_bytes().unwrap(), "call {i}: input gradient");
    }
    let s = region.stats();
    assert!(s.replays >= 2, "the calls replayed: {s:?}");
}

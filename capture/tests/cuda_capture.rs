//! GPU acceptance tests of the recorder (docs/capture.md §18: T1–T10, T13, T14), bit identity of a
//! trunk + two heads network trained natively and recorded (fp32, bf16), shape change and
//! parameter replacement mid-run, and a native-vs-recorded benchmark.
#![cfg(feature = "cuda")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::*;
use ptl_autograd::{cuda, no_grad, DType, Device, GraphSafeRng, Rng, Tensor};
use ptl_capture::{ArenaSpec, Backend, CaptureError, CudaBackend, FallbackReason, Recorder, RecorderConfig, RegionSpec, RetireReason};

fn device() -> Option<Device> {
    match cuda::check(0) {
        Ok(()) => Some(Device::Cuda(0)),
        Err(e) => {
            println!("skipping: no usable CUDA device: {e}");
            None
        }
    }
}

fn cfg() -> RecorderConfig {
    RecorderConfig::default()
}

/// T1 scenario: returns Err when replay is not a graph launch.
/// `planned`: arenas laid out from a traced capture, which runs the closure once more before the
/// real capture — never during a replay.
fn t1_scenario(dev: Device, enabled: bool, planned: bool) -> Result<(), String> {
    let calls = Arc::new(AtomicUsize::new(0));
    let k = Arc::new(Mutex::new(1.0f64));
    let (c, kk) = (calls.clone(), k.clone());
    let rec = Recorder::cuda(RecorderConfig { warmup_calls: 1, enabled, plan_arenas: planned, ..cfg() });
    let region = rec.region(RegionSpec::new("scale", Vec::new, move |xs: &[Tensor]| {
        c.fetch_add(1, Ordering::SeqCst);
        let k = *kk.lock().unwrap();
        Ok(vec![xs[0].mul_scalar(k)?])
    }));
    let x = Tensor::from_vec(vec![1.0f32, 2.0], 2, dev).map_err(|e| e.to_string())?;
    let x = x.requires_grad_(true).map_err(|e| e.to_string())?;
    let y1 = region.call(std::slice::from_ref(&x)).map_err(|e| e.to_string())?.remove(0);
    drop(y1);
    *k.lock().unwrap() = 2.0;
    let y2 = region.call(std::slice::from_ref(&x)).map_err(|e| e.to_string())?.remove(0);
    drop(y2);
    *k.lock().unwrap() = 3.0;
    let y = region.call(std::slice::from_ref(&x)).map_err(|e| e.to_string())?.remove(0);
    y.sum_all().and_then(|l| l.backward()).map_err(|e| e.to_string())?;
    let got = y.to_vec::<f32>().map_err(|e| e.to_string())?;
    let g = x.grad().ok_or("no grad")?.to_vec::<f32>().map_err(|e| e.to_string())?;
    if got != vec![2.0, 4.0] {
        return Err(format!("replay must use the captured k=2, got {got:?} (3.0 means native re-execution)"));
    }
    if g != vec![2.0, 2.0] {
        return Err(format!("backward replay must use k=2, got {g:?}"));
    }
    let s = region.stats();
    let expected = if planned { 4 } else { 3 };
    if calls.load(Ordering::SeqCst) != expected {
        return Err(format!(
            "closure ran {} times; expected {expected} (native warmup call, warmup iteration,{} capture)",
            calls.load(Ordering::SeqCst),
            if planned { " traced capture," } else { "" }
        ));
    }
    if s.graph_launches != 3 || s.replays != 2 || s.eager_dispatches_during_replay != 0 {
        return Err(format!("counters {s:?}"));
    }
    Ok(())
}

#[test]
fn t1_replay_is_not_native() {
    let Some(dev) = device() else { return };
    for planned in [true, false] {
        t1_scenario(dev, true, planned).unwrap();
    }
    // Mutation: with dispatch to the graphs disabled the same scenario must fail.
    let e = t1_scenario(dev, false, true).expect_err("T1 must fail when replay degrades into native execution");
    println!("ok T1: replay froze k=2, closure ran 4 times (3 without planned arenas), 3 graph launches; with dispatch disabled: {e}");
}

#[test]
fn t2_warmup_is_observationally_free() {
    let Some(dev) = device() else { return };
    let n1 = Net::new(dev, DType::F32, 21);
    let n2 = Net::new(dev, DType::F32, 21);
    let d = Data::new(dev, DType::F32, 2, 16, 3);
    let rng = Arc::new(Mutex::new(Rng::new(5)));
    let (p, s, r) = (n2.p.clone(), n2.p.clone(), rng.clone());
    let rec = Recorder::cuda(cfg());
    let region = rec.region(
        RegionSpec::new(
            "trunk",
            move || s.with_prefix("trunk."),
            move |xs| {
                r.lock().unwrap().next_u32();
                Ok(vec![Net::trunk(&p, &xs[0])?])
            },
        )
        .with_host_state(rng.clone()),
    );
    let mut after_one = None;
    for i in 0..3 {
        let a = Net::trunk(&n1.p, &d.x).unwrap();
        let b = region.call(std::slice::from_ref(&d.x)).unwrap().remove(0);
        assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "call {i}: outputs differ");
        assert_eq!(n1.p.bytes(), n2.p.bytes(), "call {i}: buffers (BN running stats) differ after warmup/capture");
        if i == 0 {
            after_one = Some(rng.lock().unwrap().state());
        }
    }
    assert_eq!(Some(rng.lock().unwrap().state()), after_one, "host RNG advanced by warmup or capture");
    let st = region.stats();
    assert_eq!((st.captures, st.replays), (1, 2));
    println!("ok T2: BN running stats bitwise equal to native after warmup+capture+replays; host RNG rolled back; {}", st.line("trunk"));
}

#[test]
fn t3_t5_bit_identity_trunk_and_two_heads() {
    let Some(dev) = device() else { return };
    for dt in [DType::F32, DType::BF16] {
        let rec = Recorder::cuda(cfg());
        let (pair, regions) = run_pair(&rec, dev, dt, 20).unwrap();
        check_pair(&pair, &format!("cuda {dt}"));
        for (n, r) in [("trunk", &regions.trunk), ("head_a", &regions.a), ("head_b", &regions.b)] {
            let s = r.stats();
            assert_eq!(s.captures, 1, "{n} {s:?}");
            assert_eq!(s.replays, 19, "{n} {s:?}");
            assert_eq!(s.eager_dispatches_during_replay, 0);
        }
        assert_eq!(regions.b.stats().backward_captures, 2, "head B: all-outputs mask + first-output-only mask");
        println!("ok T3/T5 {dt}: 20 SGD steps, losses/params/buffers bit-identical, absent grads stay None; {}", rec.summary_line());
    }
}

#[test]
fn t4_key_discipline_shape_change_and_parameter_replacement() {
    let Some(dev) = device() else { return };
    let rec = Recorder::cuda(RecorderConfig { max_recordings: 1, ..cfg() });
    let n1 = Net::new(dev, DType::F32, 31);
    let n2 = Net::new(dev, DType::F32, 31);
    let regions = Regions::new(&rec, &n2.p);
    let big = Data::new(dev, DType::F32, 2, 16, 7);
    let small = Data::new(dev, DType::F32, 1, 16, 8);
    let mut replays_before_small = 0;
    for i in 0..14 {
        let d = if i == 5 || i == 6 { &small } else { &big };
        if i == 5 {
            replays_before_small = regions.trunk.stats().replays;
        }
        if i == 9 {
            for n in [&n1, &n2] {
                let w = n.p.get("ha.w");
                n.p.replace("ha.w", w.deep_copy().unwrap().requires_grad_(true).unwrap());
            }
        }
        let a = step(&n1, None, d, mode(i), 0.05).unwrap();
        let b = step(&n2, Some(&regions), d, mode(i), 0.05).unwrap();
        assert_eq!(a.loss, b.loss, "step {i}: loss differs");
        if i == 6 {
            assert_eq!(regions.trunk.stats().replays, replays_before_small, "a smaller batch must not replay");
        }
    }
    assert_eq!(n1.p.bytes(), n2.p.bytes());
    let t = regions.trunk.stats();
    let a = regions.a.stats();
    assert_eq!(t.native_for(FallbackReason::CacheFull), 1, "{t:?}");
    assert_eq!(t.native_for(FallbackReason::Warmup), 2, "{t:?}");
    assert_eq!(t.replays, 14 - 3, "{t:?}");
    assert_eq!(a.retired_for(RetireReason::Storage), 1, "{a:?}");
    assert_eq!(t.retired_for(RetireReason::Storage) + regions.b.stats().retired_for(RetireReason::Storage), 0);
    // train/eval and requires_grad flips are misses, never replays.
    let before = regions.trunk.stats().replays;
    regions.trunk.set_training(false);
    let _ = regions.trunk.call(std::slice::from_ref(&big.x)).unwrap();
    regions.trunk.set_training(true);
    let xr = big.x.detach().requires_grad_(true).unwrap();
    let _ = regions.trunk.call(std::slice::from_ref(&xr)).unwrap();
    assert_eq!(regions.trunk.stats().replays, before);
    println!("ok T4: shape change fell back and returned to replay, param replacement retired head_a only; {}", rec.summary_line());
}

#[test]
fn t6_accumulation_over_two_replays_equals_native() {
    let Some(dev) = device() else { return };
    let run = |recorded: bool| -> Vec<Vec<u8>> {
        let rec = Recorder::cuda(RecorderConfig { warmup_calls: 0, ..cfg() });
        let net = Net::new(dev, DType::F32, 9);
        let regions = Regions::new(&rec, &net.p);
        let ds = [Data::new(dev, DType::F32, 2, 16, 1), Data::new(dev, DType::F32, 2, 16, 2), Data::new(dev, DType::F32, 2, 16, 3)];
        let mut out = vec![];
        for (k, d) in ds.iter().enumerate() {
            let (a, b1, _) = forward(&net, recorded.then_some(&regions), &d.x).unwrap();
            a.mul(&d.ra).unwrap().mean_all().unwrap().add(&b1.mul(&d.rb1).unwrap().mean_all().unwrap()).unwrap().backward().unwrap();
            if k == 0 {
                // Keep a handle on the first gradient: later replays must not overwrite it.
                out.push(net.p.get("trunk.w1").grad().unwrap().to_bytes().unwrap());
            }
        }
        out.extend(net.p.trainable().iter().map(|(_, p)| p.grad().map(|g| g.to_bytes().unwrap()).unwrap_or_default()));
        out
    };
    assert_eq!(run(false), run(true), "accumulated gradients differ from native");
    println!("ok T6: 3 micro-batches accumulate bitwise like native; no static buffer escapes");
}

/// Persistent gradients on real graphs: the backward graphs write or add the parameters'
/// gradients into their kept buffers (one shared backward arena per recording), with the bytes
/// of native accumulation over three windows, and the buffers never move.
#[test]
fn t6_persistent_gradients_accumulate_inside_the_backward_graph() {
    let Some(dev) = device() else { return };
    let rec = Recorder::cuda(RecorderConfig { warmup_calls: 0, ..cfg() });
    check_persistent_windows(&rec, dev, 16);
    println!("ok T6 persistent: 3 windows × 3 micro-batches accumulate inside the backward graphs, bitwise like native");
}

#[test]
fn t7_pending_backward() {
    let Some(dev) = device() else { return };
    for strict in [false, true] {
        let rec = Recorder::cuda(RecorderConfig { warmup_calls: 0, strict_pending: strict, ..cfg() });
        let net = Net::new(dev, DType::F32, 4);
        let (p, s) = (net.p.clone(), net.p.clone());
        let r = rec.region(RegionSpec::new("head_a", move || s.with_prefix("ha."), move |xs| Ok(vec![Net::head_a(&p, &xs[0])?])));
        let f1 = Tensor::rand(vec![2, 16, 8, 8], -1.0, 1.0, DType::F32, dev, &mut Rng::new(1)).unwrap();
        let f2 = Tensor::rand(vec![2, 16, 8, 8], -1.0, 1.0, DType::F32, dev, &mut Rng::new(2)).unwrap();
        let y1 = r.call(std::slice::from_ref(&f1)).unwrap().remove(0);
        let second = r.call(std::slice::from_ref(&f2));
        if strict {
            assert!(matches!(second, Err(CaptureError::PendingBackward { .. })), "{second:?}");
        } else {
            drop(second.unwrap());
            assert_eq!(r.stats().native_for(FallbackReason::PendingBackward), 1);
        }
        y1.sum_all().unwrap().backward().unwrap();
        let n2 = Net::new(dev, DType::F32, 4);
        Net::head_a(&n2.p, &f1).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(net.p.get("ha.w").grad().unwrap().to_bytes().unwrap(), n2.p.get("ha.w").grad().unwrap().to_bytes().unwrap());
        let before = r.stats().replays;
        drop(r.call(std::slice::from_ref(&f2)).unwrap());
        drop(r.call(std::slice::from_ref(&f1)).unwrap());
        assert_eq!(r.stats().replays, before + 2, "fwd, discard (drop), fwd must replay");
    }
    println!("ok T7: second forward before backward ran natively (or PendingBackward when strict); backward of the first is exact");
}

#[test]
fn t8_stable_addresses() {
    let Some(dev) = device() else { return };
    let rec = Recorder::cuda(RecorderConfig { warmup_calls: 0, ..cfg() });
    let net = Net::new(dev, DType::F32, 4);
    let regions = Regions::new(&rec, &net.p);
    let d = Data::new(dev, DType::F32, 2, 16, 1);
    step(&net, Some(&regions), &d, 2, 0.01).unwrap();
    let w = net.p.get("ha.w");
    no_grad(|| w.copy_(&w.mul_scalar(0.5).unwrap())).unwrap(); // in-place load
    step(&net, Some(&regions), &d, 2, 0.01).unwrap();
    assert_eq!(regions.a.stats().replays, 2);
    net.p.replace("ha.w", w.deep_copy().unwrap().requires_grad_(true).unwrap());
    step(&net, Some(&regions), &d, 2, 0.01).unwrap();
    let a = regions.a.stats();
    assert_eq!((a.retired_for(RetireReason::Storage), a.native_for(FallbackReason::Stale)), (1, 1), "{a:?}");
    assert!(a.warnings.iter().any(|w| w.contains("changed storage")));
    assert!(net.p.get("ha.w").grad().is_some(), "the new parameter trains");
    println!("ok T8: in-place load kept the recording; a new tensor retired it (StaleRecording)");
}

fn hygiene_case(
    dev: Device,
    name: &str,
    f: impl Fn(&[Tensor], usize) -> ptl_autograd::Result<Vec<Tensor>> + Send + Sync + 'static,
) -> ptl_capture::RegionStats {
    let rec = Recorder::cuda(RecorderConfig { warmup_calls: 1, ..cfg() });
    let n = Arc::new(AtomicUsize::new(0));
    let r = rec.region(RegionSpec::new(name, Vec::new, move |xs: &[Tensor]| f(xs, n.fetch_add(1, Ordering::SeqCst))));
    let x = Tensor::ones(vec![4, 4], DType::F32, dev).unwrap();
    for _ in 0..3 {
        let y = r.call(std::slice::from_ref(&x)).unwrap();
        if let Some(y) = y.first() {
            assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.0f32; 16], "{name}: native fallback result");
        }
    }
    cuda::synchronize(dev).unwrap();
    r.stats()
}

#[test]
fn t9_capture_hygiene() {
    let Some(dev) = device() else { return };
    let cases: Vec<(&str, &str, ptl_capture::RegionStats)> = vec![
        (
            "host read",
            "host_sync",
            hygiene_case(dev, "host_read", |xs, _| {
                let _ = xs[0].to_vec::<f32>()?;
                Ok(vec![xs[0].mul_scalar(2.0)?])
            }),
        ),
        (
            "synchronize",
            "host_sync",
            hygiene_case(dev, "sync", move |xs, _| {
                cuda::synchronize(Device::Cuda(0))?;
                Ok(vec![xs[0].mul_scalar(2.0)?])
            }),
        ),
        (
            "fresh upload",
            "host_upload",
            hygiene_case(dev, "upload", |xs, _| {
                let two = Tensor::from_vec(vec![2.0f32], 1, xs[0].device())?;
                Ok(vec![xs[0].mul(&two)?])
            }),
        ),
        (
            "allocation beyond the pool",
            "alloc_outside_pool",
            hygiene_case(dev, "alloc", |xs, n| {
                // Every capture attempt (the planned arena's, then the unplanned retry's).
                if n >= 2 {
                    let _big = Tensor::zeros(vec![64 << 20], DType::F32, xs[0].device())?;
                }
                Ok(vec![xs[0].mul_scalar(2.0)?])
            }),
        ),
        ("empty graph", "empty_graph", hygiene_case(dev, "empty", |_, _| Ok(vec![]))),
    ];
    for (what, kind, s) in &cases {
        assert_eq!(s.capture_failures.get(*kind), Some(&1), "{what}: {s:?}");
        assert_eq!(s.replays, 0, "{what}");
        // The failed call and the next one (the signature stays native) both run natively.
        assert_eq!(s.native_for(FallbackReason::CaptureFailed), 2, "{what}: {s:?}");
        println!("ok T9 {what}: {kind} -> native fallback; warning: {}", s.warnings.first().map(String::as_str).unwrap_or(""));
    }
    // Nested capture: an inner region whose capture would start inside the outer capture.
    let inner_rec = Recorder::cuda(RecorderConfig { warmup_calls: 2, ..cfg() });
    let inner = inner_rec.region(RegionSpec::new("inner", Vec::new, |xs: &[Tensor]| Ok(vec![xs[0].mul_scalar(2.0)?])));
    let outer_rec = Recorder::cuda(RecorderConfig { warmup_calls: 1, ..cfg() });
    let inner_h = Arc::new(inner);
    let ih = inner_h.clone();
    let outer = outer_rec.region(RegionSpec::new("outer", Vec::new, move |xs: &[Tensor]| {
        let y = ih.call(xs).map_err(ptl_autograd::Error::from)?;
        Ok(vec![y[0].add_scalar(1.0)?])
    }));
    let x = Tensor::ones(vec![4], DType::F32, dev).unwrap();
    for _ in 0..4 {
        assert_eq!(outer.call(std::slice::from_ref(&x)).unwrap()[0].to_vec::<f32>().unwrap(), vec![3.0f32; 4]);
    }
    let si = inner_h.stats();
    // The outer region's traced capture and its real one each find the inner region inside a capture.
    assert_eq!(si.native_for(FallbackReason::InsideCapture), 2, "{si:?}");
    assert_eq!(si.captures, 0, "{si:?}");
    assert_eq!(outer.stats().replays, 3);
    // A direct nested capture attempt is a typed error.
    let inner_kind = Arc::new(Mutex::new(None));
    let (ik, x2) = (inner_kind.clone(), x.clone());
    let mib = ArenaSpec { plan: Default::default(), tail: 1 << 20 };
    let inner_spec = mib.clone();
    let g = CudaBackend.record(
        "outer",
        dev,
        &mib,
        None,
        Arc::new(move || {
            let r = CudaBackend.record("inner", Device::Cuda(0), &inner_spec, None, Arc::new(|| Ok(())));
            *ik.lock().unwrap() = r.err().map(|e| e.kind());
            let _y = x2.mul_scalar(2.0)?;
            Ok(())
        }),
    );
    assert!(g.is_ok(), "outer capture must survive the refused inner one");
    assert_eq!(*inner_kind.lock().unwrap(), Some("nested_capture"));
    println!("ok T9 nested capture: the inner region ran natively inside the outer capture (InsideCapture), outer recorded and replayed");
}

/// T10 body: two dropouts of different sizes drawing from one generator.
fn t10_body(rng: &GraphSafeRng, x: &Tensor) -> ptl_autograd::Result<Vec<Tensor>> {
    let a = x.dropout(0.5, rng)?;
    let b = x.narrow(0, 0, 37)?.dropout(0.25, rng)?;
    Ok(vec![a, b])
}

#[test]
fn t10_graph_safe_rng_replays_draw_the_eager_sequence() {
    let Some(dev) = device() else { return };
    let eager = GraphSafeRng::new(42, dev).unwrap();
    let rng = Arc::new(GraphSafeRng::new(42, dev).unwrap());
    let r2 = rng.clone();
    let rec = Recorder::cuda(RecorderConfig { warmup_calls: 1, ..cfg() });
    let region = rec.region(RegionSpec::new("dropout", Vec::new, move |xs: &[Tensor]| t10_body(&r2, &xs[0])).with_graph_rng(rng.clone()));
    let x0 = Tensor::rand(vec![4096], 0.5, 1.5, DType::F32, dev, &mut Rng::new(7)).unwrap();
    let mut masks = Vec::new();
    let mut last_offset = 0;
    for i in 0..6 {
        // eager reference: same generator state, same ops, gradients through the masks
        let xe = x0.detach().requires_grad_(true).unwrap();
        let want = t10_body(&eager, &xe).unwrap();
        want[0].sum_all().unwrap().add(&want[1].sum_all().unwrap()).unwrap().backward().unwrap();
        let xr = x0.detach().requires_grad_(true).unwrap();
        let got = region.call(std::slice::from_ref(&xr)).unwrap();
        got[0].sum_all().unwrap().add(&got[1].sum_all().unwrap()).unwrap().backward().unwrap();
        for k in 0..2 {
            assert_eq!(got[k].to_bytes().unwrap(), want[k].to_bytes().unwrap(), "call {i}, output {k}: differs from the eager sequence");
        }
        assert_eq!(xr.grad().unwrap().to_bytes().unwrap(), xe.grad().unwrap().to_bytes().unwrap(), "call {i}: input gradient");
        assert_eq!(rng.offset(), eager.offset(), "call {i}: host offset");
        // whole-graph increment: 4096/4 = 1024 blocks, then ceil(37/4) = 10 -> 12; multiples of 4
        assert_eq!(rng.offset() - last_offset, 1024 + 12, "call {i}: offset advance");
        assert_eq!(rng.offset() % 4, 0);
        last_offset = rng.offset();
        masks.push(got[0].to_bytes().unwrap());
    }
    let s = region.stats();
    assert_eq!((s.captures, s.replays, s.native_total()), (1, 5, 1), "{s:?}");
    for w in masks.windows(2) {
        assert_ne!(w[0], w[1], "consecutive calls must draw fresh masks");
    }
    println!(
        "ok T10: graph-safe Philox RNG: 1 warmup + 5 calls (1 capture, 5 replays) equal 6 eager steps bitwise (outputs and input gradients); \
         masks differ per replay; host offset advances by the whole-graph increment 1036 (multiple of 4) per call"
    );
}

#[test]
fn t10b_host_rng_regions_fall_back_and_match_native_sequence() {
    let Some(dev) = device() else { return };
    let dropout = |rng: &Mutex<Rng>, x: &Tensor| -> ptl_autograd::Result<Tensor> {
        let keep = Tensor::rand(x.dims().to_vec(), 0.0, 1.0, DType::F32, x.device(), &mut rng.lock().unwrap())?
            .ge_scalar(0.5)?
            .to_dtype(DType::F32)?;
        x.mul(&keep)?.mul_scalar(2.0)
    };
    let native_rng = Mutex::new(Rng::new(42));
    let rng = Arc::new(Mutex::new(Rng::new(42)));
    let r2 = rng.clone();
    let rec = Recorder::cuda(cfg());
    let region =
        rec.region(RegionSpec::new("dropout", Vec::new, move |xs: &[Tensor]| Ok(vec![dropout(&r2, &xs[0])?])).with_host_state(rng.clone()));
    let x = Tensor::ones(vec![64], DType::F32, dev).unwrap();
    let mut masks = vec![];
    for i in 0..4 {
        let a = dropout(&native_rng, &x).unwrap().to_bytes().unwrap();
        let b = region.call(std::slice::from_ref(&x)).unwrap()[0].to_bytes().unwrap();
        assert_eq!(a, b, "call {i}: mask differs from the native sequence");
        masks.push(b);
    }
    assert_ne!(masks[0], masks[1]);
    let s = region.stats();
    assert_eq!(s.capture_failures.get("host_upload"), Some(&1), "{s:?}");
    println!(
        "ok T10b: a region drawing from a host RNG refuses capture (HostUpload) and falls back; masks differ per call and equal the native sequence"
    );
}

#[test]
fn t13_replay_order_with_private_pools() {
    let Some(dev) = device() else { return };
    let rec = Recorder::cuda(RecorderConfig { warmup_calls: 0, ..cfg() });
    let net = Net::new(dev, DType::F32, 8);
    let regions = Regions::new(&rec, &net.p);
    let z = |s| Tensor::rand(vec![2, 16, 8, 8], -1.0, 1.0, DType::F32, dev, &mut Rng::new(s)).unwrap();
    let x = |s| Tensor::rand(vec![2, 3, 16, 16], -1.0, 1.0, DType::F32, dev, &mut Rng::new(s)).unwrap();
    // Capture in order trunk, head A; then replay in other orders.
    let f = regions.trunk.call(&[x(1)]).unwrap().remove(0);
    drop(regions.a.call(&[f]).unwrap());
    for s in 0..6u64 {
        let zz = z(100 + s);
        let xx = x(200 + s);
        let (ya, yt) = if s % 2 == 0 {
            let ya = regions.a.call(std::slice::from_ref(&zz)).unwrap().remove(0);
            (ya, regions.trunk.call(std::slice::from_ref(&xx)).unwrap().remove(0))
        } else {
            let yt = regions.trunk.call(std::slice::from_ref(&xx)).unwrap().remove(0);
            (regions.a.call(std::slice::from_ref(&zz)).unwrap().remove(0), yt)
        };
        no_grad(|| {
            assert_eq!(ya.to_bytes().unwrap(), Net::head_a(&net.p, &zz).unwrap().to_bytes().unwrap(), "order {s}: head A");
        });
        let _ = yt;
    }
    assert_eq!(regions.a.stats().replays, 7);
    println!("ok T13: regions replayed out of capture order stay exact (each recording owns its pool; no shared-pool groups)");
}

#[test]
fn t14_teardown_while_replay_in_flight() {
    let Some(dev) = device() else { return };
    let before = cuda::memory_stats(dev).unwrap();
    for round in 0..4 {
        let rec = Recorder::cuda(RecorderConfig { warmup_calls: 0, ..cfg() });
        let w = Tensor::rand(vec![64, 64, 3, 3], -0.05, 0.05, DType::F32, dev, &mut Rng::new(3)).unwrap().requires_grad_(true).unwrap();
        let (w1, w2) = (w.clone(), w.clone());
        let r = rec.region(RegionSpec::new(
            "conv",
            move || vec![("w".into(), w1.clone(), ptl_autograd::TensorKind::Parameter)],
            move |xs: &[Tensor]| {
                let mut y = xs[0].clone();
                for _ in 0..8 {
                    y = y.conv2d(&w2, None, (1, 1), (1, 1), 1)?.silu()?;
                }
                Ok(vec![y])
            },
        ));
        let x = Tensor::rand(vec![8, 64, 64, 64], -1.0, 1.0, DType::F32, dev, &mut Rng::new(round)).unwrap();
        // Grad recording: capture + replay, then a no-grad recording: capture + replay, replay.
        let y1 = r.call(std::slice::from_ref(&x)).unwrap().remove(0).to_bytes().unwrap();
        let y2 = no_grad(|| r.call(std::slice::from_ref(&x))).unwrap().remove(0);
        let y = no_grad(|| r.call(std::slice::from_ref(&x))).unwrap().remove(0);
        assert_eq!(r.stats().replays, 3, "round {round}: {:?}", r.stats());
        rec.release_all(); // while the replay may still be running
        drop(r);
        drop(rec);
        let scratch = Tensor::zeros(vec![8, 64, 64, 64], DType::F32, dev).unwrap();
        let _ = scratch.add_scalar(1.0).unwrap();
        assert_eq!(y.to_bytes().unwrap(), y1, "round {round}: output after teardown");
        assert_eq!(y2.to_bytes().unwrap(), y1, "round {round}: no-grad recording output");
    }
    cuda::synchronize(dev).unwrap();
    let after = cuda::memory_stats(dev).unwrap();
    println!(
        "ok T14: 4 teardowns during in-flight replays, outputs intact; allocated before {} after {} bytes",
        before.allocated, after.allocated
    );
}

#[test]
fn bench_native_vs_recorded() {
    let Some(dev) = device() else { return };
    for dt in [DType::F32, DType::BF16] {
        let steps = 100;
        let n1 = Net::new(dev, dt, 1);
        let n2 = Net::new(dev, dt, 1);
        let d = Data::new(dev, dt, 4, 32, 2);
        let rec = Recorder::cuda(cfg());
        let regions = Regions::new(&rec, &n2.p);
        for i in 0..5 {
            step(&n1, None, &d, 2, 1e-3).unwrap();
            step(&n2, Some(&regions), &d, mode(i).max(2), 1e-3).unwrap();
        }
        cuda::synchronize(dev).unwrap();
        let t = Instant::now();
        for _ in 0..steps {
            step(&n1, None, &d, 2, 1e-3).unwrap();
        }
        cuda::synchronize(dev).unwrap();
        let native_ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        let s0: Vec<_> = rec.stats();
        let t = Instant::now();
        for _ in 0..steps {
            step(&n2, Some(&regions), &d, 2, 1e-3).unwrap();
        }
        cuda::synchronize(dev).unwrap();
        let rec_ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        let s1 = rec.stats();
        let nodes: u64 = s1.iter().map(|(_, s)| s.graph_nodes).sum();
        let launches: u64 = s1.iter().zip(&s0).map(|((_, a), (_, b))| a.graph_launches - b.graph_launches).sum::<u64>() / steps as u64;
        let host_ops: u64 = s1.iter().zip(&s0).map(|((_, a), (_, b))| a.host_ops - b.host_ops).sum::<u64>() / steps as u64;
        println!(
            "bench {dt} (batch 4, 32x32, trunk + 2 heads, SGD, loss read back each step): native {native_ms:.3} ms/step, recorded {rec_ms:.3} ms/step ({:.2}x); regions natively ≈ {nodes} device ops/step (graph nodes) vs recorded {launches} graph launches + {host_ops} host copies/accumulations per step",
            native_ms / rec_ms
        );
    }
}

/// A channels-last input into a recorded region on the GPU: the region's static input buffer gets
/// the input in the logical order (converted at entry), so replays give the contiguous input's
/// output and input gradient bytes; every call after the warm-up replays a graph.
#[test]
fn channels_last_inputs_replay_in_the_logical_order() {
    use ptl_autograd::{MemoryFormat, TensorKind};
    let Some(dev) = device() else { return };
    let rec = Recorder::cuda(cfg());
    let mut rng = Rng::new(21);
    let w = Tensor::rand(vec![4, 3, 3, 3], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
    let (ws, wb) = (w.clone(), w.clone());
    let region = rec.region(RegionSpec::new(
        "conv",
        move || vec![("w".to_string(), ws.clone(), TensorKind::Parameter)],
        move |xs| Ok(vec![xs[0].conv2d(&wb, None, (1, 1), (1, 1), 1)?.silu()?]),
    ));
    for i in 0..5u64 {
        let x = Tensor::rand(vec![2, 3, 5, 5], -1.0, 1.0, DType::F32, dev, &mut Rng::new(i)).unwrap();
        let plain = x.detach().requires_grad_(true).unwrap();
        let expected = plain.conv2d(&w.detach(), None, (1, 1), (1, 1), 1).unwrap().silu().unwrap();
        expected.sum_all().unwrap().backward().unwrap();
        let leaf = x.detach().requires_grad_(true).unwrap();
        let cl = leaf.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
        assert_ne!(cl.with_storage(|s| s.to_cpu().unwrap().as_bytes().to_vec()), x.to_bytes().unwrap(), "stored as NHWC");
        let y = region.call(std::slice::from_ref(&cl)).unwrap().remove(0);
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(y.to_bytes().unwrap(), expected.to_bytes().unwrap(), "call {i}: output");
        assert_eq!(leaf.grad().unwrap().to_bytes().unwrap(), plain.grad().unwrap().to_bytes().unwrap(), "call {i}: input gradient");
    }
    let s = region.stats();
    assert!(s.replays >= 3 && s.eager_dispatches_during_replay == 0, "every call after the warm-up replayed: {s:?}");
    println!("ok channels-last region input: {s:?}");
}

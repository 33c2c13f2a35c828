//! Regions whose body and surface come with every call (over a live model, no `'static` copy of
//! its modules), and regions without tensor inputs — on the CPU test double.

use std::sync::Arc;

use ptl_autograd::{DType, Device, Tensor, TensorKind};
use ptl_capture::testing::ReplayNatively;
use ptl_capture::{CaptureError, FallbackReason, Recorder, RecorderConfig, RegionSpec};

/// A tiny "model" that lives on the stack: the region borrows it per call.
struct Live {
    w: Tensor,
    b: Tensor,
}

impl Live {
    fn new() -> Live {
        let w = Tensor::from_vec(vec![0.5f32, -1.0, 2.0, 0.25], vec![2, 2], Device::Cpu).unwrap().requires_grad_(true).unwrap();
        let b = Tensor::from_vec(vec![0.1f32, -0.2], vec![2], Device::Cpu).unwrap().requires_grad_(true).unwrap();
        Live { w, b }
    }
    fn surface(&self) -> Vec<(String, Tensor, TensorKind)> {
        vec![("w".into(), self.w.clone(), TensorKind::Parameter), ("b".into(), self.b.clone(), TensorKind::Parameter)]
    }
    fn forward(&self, x: &Tensor) -> ptl_autograd::Result<Tensor> {
        x.matmul(&self.w)?.add(&self.b)?.silu()
    }
}

fn recorder() -> (Recorder, Arc<ReplayNatively>) {
    let b = Arc::new(ReplayNatively::default());
    (Recorder::with_backend(RecorderConfig::default(), b.clone()), b)
}

#[test]
fn a_per_call_body_replays_and_matches_native() {
    let (rec, backend) = recorder();
    let region = rec.region(RegionSpec::per_call("live"));
    let x = Tensor::from_vec(vec![1.0f32, 2.0, -3.0, 0.5, 0.0, 1.5], vec![3, 2], Device::Cpu).unwrap();
    let mut replayed = Vec::new();
    let mut native = Vec::new();
    for step in 0..5 {
        let model = Live::new(); // a fresh model every step: nothing 'static is kept
        let _ = step;
        let body = |xs: &[Tensor]| Ok(vec![model.forward(&xs[0])?]);
        let y = region.call_with(std::slice::from_ref(&x), &model.surface(), &body).unwrap().remove(0);
        y.sum_all().unwrap().backward().unwrap();
        replayed.push((y.to_vec::<f32>().unwrap(), model.w.grad().unwrap().to_vec::<f32>().unwrap()));
        let reference = Live::new();
        let y = reference.forward(&x).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        native.push((y.to_vec::<f32>().unwrap(), reference.w.grad().unwrap().to_vec::<f32>().unwrap()));
    }
    assert_eq!(replayed, native, "values and gradients equal the native run");
    let s = region.stats();
    // A new model each step has new storage: the recording is retired as stale and the region
    // runs natively, then records again — the counters say so.
    assert!(s.captures >= 1 && s.native_total() >= 1, "{s:?}");
    assert!(backend.records.load(std::sync::atomic::Ordering::Relaxed) >= 1);
}

#[test]
fn the_same_live_model_replays_after_warmup() {
    let (rec, _) = recorder();
    let region = rec.region(RegionSpec::per_call("live"));
    let model = Live::new();
    let x = Tensor::from_vec(vec![1.0f32, 2.0], vec![1, 2], Device::Cpu).unwrap();
    for _ in 0..6 {
        let body = |xs: &[Tensor]| Ok(vec![model.forward(&xs[0])?]);
        region.call_with(std::slice::from_ref(&x), &model.surface(), &body).unwrap();
    }
    let s = region.stats();
    assert_eq!((s.native_for(FallbackReason::Warmup), s.captures, s.replays), (1, 1, 5), "{s:?}");
}

#[test]
fn a_region_without_inputs_reads_only_its_surface() {
    let (rec, _) = recorder();
    let region = rec.region(RegionSpec::per_call("update"));
    let acc = Tensor::zeros(vec![2], DType::F32, Device::Cpu).unwrap();
    let step = Tensor::from_vec(vec![1.0f32, 0.5], vec![2], Device::Cpu).unwrap();
    let surface = vec![("acc".to_string(), acc.clone(), TensorKind::Buffer), ("step".to_string(), step.clone(), TensorKind::Buffer)];
    for _ in 0..4 {
        let body = |_: &[Tensor]| -> ptl_autograd::Result<Vec<Tensor>> {
            ptl_autograd::no_grad(|| acc.add_(&step))?;
            Ok(vec![acc.sum_all()?])
        };
        region.call_with(&[], &surface, &body).unwrap();
    }
    let s = region.stats();
    assert!(s.replays >= 2, "a region with no tensor inputs records and replays: {s:?}");
    assert_eq!(s.native_for(FallbackReason::Unsupported), 0);
    // Warmup is rolled back (buffers restored), so exactly four updates happened.
    assert_eq!(acc.to_vec::<f32>().unwrap(), vec![4.0, 2.0]);
}

#[test]
fn call_on_a_per_call_region_is_a_typed_error() {
    let (rec, _) = recorder();
    let region = rec.region(RegionSpec::per_call("live"));
    let e = region.call(&[]).unwrap_err();
    assert!(matches!(e, CaptureError::Region { .. }) && e.to_string().contains("call_with"), "{e}");
}

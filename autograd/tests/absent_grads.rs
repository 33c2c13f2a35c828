//! Absent-gradient semantics: unused paths leave `grad() == None`; custom multi-output nodes get
//! `None` for outputs that received no gradient and are not called at all when none did.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ptl_autograd::{attach_custom_node, no_grad, BackwardOp, Device, Result, Tensor};

fn leaf(v: Vec<f32>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, n, Device::Cpu).unwrap().requires_grad_(true).unwrap()
}

#[test]
fn unused_branch_keeps_none() {
    let a = leaf(vec![1.0, 2.0]);
    let b = leaf(vec![3.0, 4.0]);
    let _unused = b.exp().unwrap();
    let loss = a.square().unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
    assert!(b.grad().is_none(), "b was not used by the loss: its gradient must be absent");
}

#[test]
fn zero_valued_path_gives_present_zero() {
    // A used path whose derivative is zero is *present* and zero (as in PyTorch).
    let a = leaf(vec![1.0, 2.0]);
    let loss = a.mul_scalar(0.0).unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
}

#[test]
fn zero_grad_sets_none_and_grads_accumulate() {
    let a = leaf(vec![1.0, -1.0]);
    for _ in 0..2 {
        a.mul_scalar(3.0).unwrap().sum_all().unwrap().backward().unwrap();
    }
    assert_eq!(a.grad().unwrap().to_vec::<f32>().unwrap(), vec![6.0, 6.0]);
    let addr = a.grad().unwrap().storage_ptr();
    a.mul_scalar(1.0).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(a.grad().unwrap().storage_ptr(), addr, "accumulation keeps the gradient buffer");
    a.zero_grad();
    assert!(a.grad().is_none());
}

#[test]
fn no_grad_and_detach_record_nothing() {
    let a = leaf(vec![1.0, 2.0]);
    let y = no_grad(|| a.exp().unwrap());
    assert!(!y.requires_grad());
    let d = a.detach().exp().unwrap();
    assert!(!d.requires_grad());
    assert!(a.square().unwrap().requires_grad());
}

/// Two outputs: `x·2` and `x·3`; records what backward receives and counts calls.
struct TwoOut {
    calls: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<(bool, bool)>>>,
}

impl BackwardOp for TwoOut {
    fn name(&self) -> &str {
        "two_out"
    }
    fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push((g[0].is_some(), g[1].is_some()));
        let mut acc: Option<Tensor> = None;
        if let Some(g0) = &g[0] {
            acc = Some(g0.mul_scalar(2.0)?);
        }
        if let Some(g1) = &g[1] {
            let t = g1.mul_scalar(3.0)?;
            acc = Some(match acc {
                Some(a) => a.add(&t)?,
                None => t,
            });
        }
        Ok(vec![acc])
    }
}

fn two_out(x: &Tensor, calls: &Arc<AtomicUsize>, seen: &Arc<Mutex<Vec<(bool, bool)>>>) -> Vec<Tensor> {
    let outs = no_grad(|| vec![x.mul_scalar(2.0).unwrap(), x.mul_scalar(3.0).unwrap()]);
    attach_custom_node(Arc::new(TwoOut { calls: calls.clone(), seen: seen.clone() }), &[x], &outs)
}

#[test]
fn custom_node_gets_some_none_for_one_used_output() {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let x = leaf(vec![1.0, 2.0]);
    let outs = two_out(&x, &calls, &seen);
    outs[1].sum_all().unwrap().backward().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(seen.lock().unwrap()[0], (false, true));
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
}

/// Passes gradient only to its second input: the first input's producer is reachable from the
/// loss but receives `None`.
struct SecondOnly;

impl BackwardOp for SecondOnly {
    fn name(&self) -> &str {
        "second_only"
    }
    fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![None, g[0].clone()])
    }
}

#[test]
fn custom_node_not_called_when_no_output_used() {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let x = leaf(vec![1.0, 2.0]);
    let other = leaf(vec![5.0, 6.0]);
    let outs = two_out(&x, &calls, &seen);
    // `joined` depends on outs[0] and `other`, but routes gradient only to `other`.
    let value = no_grad(|| outs[0].add(&other).unwrap());
    let joined = attach_custom_node(Arc::new(SecondOnly), &[&outs[0], &other], &[value]).remove(0);
    joined.sum_all().unwrap().backward().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 0, "a reachable node whose outputs got no gradient must not run");
    assert!(x.grad().is_none(), "x is reached only through the unused outputs");
    assert_eq!(other.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0, 1.0]);
}

#[test]
fn custom_node_both_outputs() {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let x = leaf(vec![1.0]);
    let outs = two_out(&x, &calls, &seen);
    outs[0].add(&outs[1]).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(seen.lock().unwrap()[0], (true, true));
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![5.0]);
}

#[test]
fn backward_errors_are_typed() {
    let x = Tensor::from_vec(vec![1.0f32, 2.0], 2, Device::Cpu).unwrap();
    assert!(x.backward().is_err(), "non-scalar and no grad: error, not panic");
    let y = leaf(vec![1.0, 2.0]).exp().unwrap();
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("one-element"), "{e}");
}

/// `split` is one node: a piece that received no gradient contributes zeros to the input's
/// gradient, and when no piece did the input's gradient stays absent.
#[test]
fn split_pieces_without_gradient() {
    let x = leaf(vec![1.0, 2.0, 3.0, 4.0, 5.0]);
    let p = x.split(&[2, 3], 0).unwrap();
    p[1].square().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![0.0, 0.0, 6.0, 8.0, 10.0]);

    let y = leaf(vec![1.0, 2.0, 3.0]);
    let z = leaf(vec![1.0]);
    let _pieces = y.split(&[1, 2], 0).unwrap();
    z.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert!(y.grad().is_none(), "no piece of y reached the loss: its gradient must be absent");
}

/// Persistent gradients: with `set_keep_grad_buffer(true)`, `zero_grad` makes the gradient absent
/// but keeps its buffer, and the next gradient is written into it (same storage address, the fresh
/// values); a step in which the leaf gets no gradient leaves it absent; accumulation without a
/// zero_grad adds in place as before.
#[test]
fn kept_gradient_buffers_keep_their_address_and_absent_its_meaning() {
    let w = leaf(vec![1.0, 2.0, 3.0]);
    w.set_keep_grad_buffer(true);
    let loss = |x: f32| w.mul_scalar(x as f64).unwrap().square().unwrap().sum_all().unwrap();
    loss(1.0).backward().unwrap();
    let first = w.grad().expect("gradient after backward");
    let addr = first.storage_ptr();
    assert_eq!(first.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    w.zero_grad();
    assert!(w.grad().is_none(), "zero_grad makes it absent");
    // A step where w gets no gradient: still absent.
    let other = leaf(vec![1.0]);
    other.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert!(w.grad().is_none(), "no gradient reached w");
    loss(2.0).backward().unwrap();
    let second = w.grad().expect("gradient again");
    assert_eq!(second.storage_ptr(), addr, "written into the kept buffer");
    assert_eq!(second.to_vec::<f32>().unwrap(), vec![8.0, 16.0, 24.0], "the fresh gradient, not a sum with the old one");
    loss(1.0).backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![10.0, 20.0, 30.0], "accumulation adds in place");
    assert_eq!(w.grad().unwrap().storage_ptr(), addr);
    // Turning it off drops the kept buffer; set_grad replaces it.
    w.zero_grad();
    w.set_keep_grad_buffer(false);
    loss(1.0).backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
}

/// `take_grad_state` takes the gradient and the kept buffer out, so a backward meanwhile (a
/// recorder's warmup) neither adds to the gradient nor writes into the buffer; `restore_grad_state`
/// puts both back, and `add_to_grad` fills a kept buffer as the engine does.
#[test]
fn taken_gradient_state_is_untouched_by_a_backward_meanwhile() {
    let w = leaf(vec![1.0, 2.0]);
    w.set_keep_grad_buffer(true);
    w.square().unwrap().sum_all().unwrap().backward().unwrap();
    let addr = w.grad().unwrap().storage_ptr();
    w.zero_grad(); // absent, buffer kept
    let state = w.take_grad_state();
    w.mul_scalar(3.0).unwrap().sum_all().unwrap().backward().unwrap();
    assert_ne!(w.grad().unwrap().storage_ptr(), addr, "the backward meanwhile got its own buffer");
    w.restore_grad_state(state);
    assert!(w.grad().is_none(), "absent again");
    w.add_to_grad(&Tensor::from_vec(vec![5.0f32, 6.0], 2, Device::Cpu).unwrap()).unwrap();
    assert_eq!(w.grad().unwrap().storage_ptr(), addr, "the kept buffer came back and took the gradient");
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![5.0, 6.0]);
}

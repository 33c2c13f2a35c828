//! The engine keeps an absent gradient absent: when a node's backward returns `None` for one of
//! its inputs, that input receives nothing: a leaf's `grad()` stays `None` (never a materialised
//! zero), and a gradient it already has is left as it is.

use std::sync::Arc;

use ptl_autograd::{attach_custom_node, no_grad, BackwardOp, Device, Result, Tensor};

fn leaf(v: Vec<f32>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, n, Device::Cpu).expect("tensor").requires_grad_(true).expect("leaf")
}

/// `out = a + b` whose backward routes the gradient to `b` only (`None` for `a`).
struct ToSecondOnly;

impl BackwardOp for ToSecondOnly {
    fn name(&self) -> &str {
        "to_second_only"
    }
    fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![None, g[0].clone()])
    }
}

fn add_to_second_only(a: &Tensor, b: &Tensor) -> Tensor {
    let value = no_grad(|| a.add(b).expect("add"));
    attach_custom_node(Arc::new(ToSecondOnly), &[a, b], &[value]).remove(0)
}

/// A leaf that is a direct input of the node keeps `grad() == None`; the other gets its gradient.
#[test]
fn leaf_given_none_by_its_node_keeps_no_gradient() {
    let a = leaf(vec![1.0, 2.0]);
    let b = leaf(vec![3.0, 4.0]);
    add_to_second_only(&a, &b).sum_all().expect("sum").backward().expect("backward");
    assert!(a.grad().is_none(), "the node returned None for `a`: its gradient must be absent, not zero");
    assert_eq!(b.grad().expect("b has a gradient").to_vec::<f32>().expect("host"), vec![1.0, 1.0]);
}

/// An existing gradient of such a leaf is left untouched (not accumulated with a zero, not
/// replaced), and the absent one stays absent over several backward passes.
#[test]
fn none_leaves_existing_gradients_alone() {
    let a = leaf(vec![1.0, 2.0]);
    let b = leaf(vec![3.0, 4.0]);
    a.mul_scalar(5.0).expect("mul").sum_all().expect("sum").backward().expect("first backward");
    let before = a.grad().expect("a has a gradient");
    let addr = before.storage_ptr();
    for _ in 0..2 {
        add_to_second_only(&a, &b).sum_all().expect("sum").backward().expect("backward");
    }
    let after = a.grad().expect("a keeps its gradient");
    assert_eq!(after.storage_ptr(), addr, "no new buffer for `a`");
    assert_eq!(after.to_vec::<f32>().expect("host"), vec![5.0, 5.0]);
    assert_eq!(b.grad().expect("b").to_vec::<f32>().expect("host"), vec![2.0, 2.0]);
}

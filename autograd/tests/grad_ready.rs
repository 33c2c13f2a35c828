//! `Tensor::backward_with_ready`: each leaf is reported once, as soon as its gradient for this
//! backward is final, and the gradients are the bytes of a plain backward.

use std::collections::HashMap;

use ptl_autograd::{DType, Device, Tensor};

fn leaf(v: &[f32], dims: Vec<usize>) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, Device::Cpu).expect("tensor").requires_grad_(true).expect("leaf")
}

/// A chain of three "layers" read in order w1, w2, w3 in the forward, w1 read twice (at the start
/// and again at the end), a leaf `unused` that only a detached path reads, and a leaf `dead`
/// whose only reader routes nothing to it.
struct Net {
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    unused: Tensor,
    x: Tensor,
}

impl Net {
    fn new() -> Net {
        Net {
            w1: leaf(&[0.5, -1.25, 2.0, 0.75], vec![2, 2]),
            w2: leaf(&[1.5, 0.25, -0.5, 1.0], vec![2, 2]),
            w3: leaf(&[0.3, -0.7], vec![2]),
            unused: leaf(&[3.0, 4.0], vec![2]),
            x: Tensor::from_vec(vec![0.1f32, -0.2, 0.3, 0.4, -0.5, 0.6], vec![3, 2], Device::Cpu).expect("x"),
        }
    }

    fn loss(&self) -> Tensor {
        let h = self.x.matmul(&self.w1).expect("h").tanh().expect("tanh");
        let h = h.matmul(&self.w2).expect("h2").add(&self.w3).expect("bias");
        let h = h.matmul(&self.w1).expect("w1 again");
        let side = self.unused.detach().sum_all().expect("side");
        h.square().expect("square").sum_all().expect("sum").add(&side).expect("loss")
    }

    fn leaves(&self) -> [(&'static str, &Tensor); 4] {
        [("w1", &self.w1), ("w2", &self.w2), ("w3", &self.w3), ("unused", &self.unused)]
    }
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.to_bytes().expect("bytes")
}

#[test]
fn leaves_are_reported_once_when_final_with_the_plain_backward_bytes() {
    let plain = Net::new();
    plain.loss().backward().expect("backward");
    let with_ready = Net::new();
    let loss = with_ready.loss();
    let names: HashMap<usize, &str> = with_ready.leaves().iter().map(|(n, t)| (t.storage_ptr(), *n)).collect();
    let mut reported: Vec<(&str, Vec<u8>)> = Vec::new();
    loss.backward_with_ready(&loss.ones_like().expect("seed"), &mut |t| {
        let name = names.get(&t.storage_ptr()).copied().unwrap_or("?");
        reported.push((name, bytes(&t.grad().expect("a reported leaf has its gradient"))));
        Ok(())
    })
    .expect("backward");
    let order: Vec<&str> = reported.iter().map(|(n, _)| *n).collect();
    // w3 and w2 are read once, late; w1 is read first and last, so it is final only at the end;
    // `unused` gets no gradient and is not reported.
    assert_eq!(order, ["w3", "w2", "w1"], "report order");
    for (name, at_report) in &reported {
        let (_, t) = with_ready.leaves().into_iter().find(|(n, _)| n == name).expect("leaf");
        let (_, p) = plain.leaves().into_iter().find(|(n, _)| n == name).expect("leaf");
        assert_eq!(at_report, &bytes(&t.grad().expect("grad")), "{name}: changed after it was reported");
        assert_eq!(at_report, &bytes(&p.grad().expect("grad")), "{name}: differs from the plain backward");
    }
    assert!(with_ready.unused.grad().is_none() && plain.unused.grad().is_none());
}

#[test]
fn a_second_backward_adds_and_reports_again() {
    let (plain, with_ready) = (Net::new(), Net::new());
    for _ in 0..2 {
        plain.loss().backward().expect("backward");
        let loss = with_ready.loss();
        let mut n = 0;
        loss.backward_with_ready(&loss.ones_like().expect("seed"), &mut |_| {
            n += 1;
            Ok(())
        })
        .expect("backward");
        assert_eq!(n, 3, "w1, w2, w3 each once per backward");
    }
    for ((name, a), (_, b)) in plain.leaves().iter().zip(with_ready.leaves().iter()).take(3) {
        assert_eq!(bytes(&a.grad().expect("grad")), bytes(&b.grad().expect("grad")), "{name} after two backwards");
    }
}

#[test]
fn an_error_from_the_callback_stops_the_backward() {
    let net = Net::new();
    let loss = net.loss();
    let err = loss
        .backward_with_ready(&loss.ones_like().expect("seed"), &mut |_| Err(ptl_autograd::Error::Backward { msg: "stop here".into() }))
        .expect_err("the callback's error");
    assert!(err.to_string().contains("stop here"), "{err}");
}

#[test]
fn a_leaf_root_is_reported() {
    let w = leaf(&[1.0, 2.0], vec![2]);
    let mut n = 0;
    w.backward_with_ready(&Tensor::ones(vec![2], DType::F32, Device::Cpu).expect("ones"), &mut |t| {
        assert_eq!(t.storage_ptr(), w.storage_ptr());
        n += 1;
        Ok(())
    })
    .expect("backward");
    assert_eq!(n, 1);
}

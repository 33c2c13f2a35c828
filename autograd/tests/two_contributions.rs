//! A node that adds two gradient contributions itself (`BackwardOp::adds_two_contributions`)
//! receives them unsummed when exactly two arrive — the later-created consumer's first, the order
//! in which the engine adds — and the summed gradient otherwise (one, or three and more).

use std::sync::{Arc, Mutex};

use ptl_autograd::{attach_custom_node, no_grad, BackwardOp, Device, Result, Tensor};

/// An identity node that records how its gradient arrived.
struct Recording {
    seen: Arc<Mutex<Vec<String>>>,
}

impl BackwardOp for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let g = g[0].clone().expect("a gradient");
        self.seen.lock().unwrap().push(format!("sum {:?}", g.to_vec::<f32>()?));
        Ok(vec![Some(g)])
    }
    fn adds_two_contributions(&self) -> bool {
        true
    }
    fn backward_two(&self, a: &Tensor, b: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.seen.lock().unwrap().push(format!("two {:?} {:?}", a.to_vec::<f32>()?, b.to_vec::<f32>()?));
        Ok(vec![Some(a.add(b)?)])
    }
}

fn run(factors: &[f32]) -> (Vec<String>, Vec<f32>) {
    let x = Tensor::from_vec(vec![1.0f32, 2.0], 2, Device::Cpu).unwrap().requires_grad_(true).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let value = no_grad(|| x.mul_scalar(1.0)).unwrap();
    let y = attach_custom_node(Arc::new(Recording { seen: seen.clone() }), &[&x], &[value]).remove(0);
    // Consumers in creation order; the loss adds their sums.
    let mut loss: Option<Tensor> = None;
    for f in factors {
        let term = y.mul_scalar(f64::from(*f)).unwrap().sum_all().unwrap();
        loss = Some(match loss {
            Some(l) => l.add(&term).unwrap(),
            None => term,
        });
    }
    loss.unwrap().backward().unwrap();
    let seen = seen.lock().unwrap().clone();
    (seen, x.grad().unwrap().to_vec::<f32>().unwrap())
}

#[test]
fn two_contributions_arrive_unsummed_in_the_engines_order() {
    let (seen, grad) = run(&[2.0, 3.0]);
    assert_eq!(seen, vec!["two [3.0, 3.0] [2.0, 2.0]".to_string()], "the later consumer's contribution first");
    assert_eq!(grad, vec![5.0, 5.0]);
}

#[test]
fn one_or_three_contributions_arrive_summed() {
    let (seen, grad) = run(&[2.0]);
    assert_eq!(seen, vec!["sum [2.0, 2.0]".to_string()]);
    assert_eq!(grad, vec![2.0, 2.0]);
    let (seen, grad) = run(&[2.0, 3.0, 4.0]);
    assert_eq!(seen, vec!["sum [9.0, 9.0]".to_string()]);
    assert_eq!(grad, vec![9.0, 9.0]);
}

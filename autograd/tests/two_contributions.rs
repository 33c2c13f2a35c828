//! A node that adds two gradient contributions itself (`BackwardOp::adds_two_contributions`)
//! receives them unsummed when exactly two arrive — the later-created consumer's first, the order
//! in which the engine adds — and the summed gradient otherwise (one, or three and more). A
//! node of several outputs gets each output's contributions unsummed when none received more
//! than two (`BackwardOp::backward_parts`), as `Tensor::split` does.

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

/// A two-output identity node that records each output's contributions as they arrived.
struct RecordingParts {
    seen: Arc<Mutex<Vec<String>>>,
}

impl BackwardOp for RecordingParts {
    fn name(&self) -> &str {
        "recording-parts"
    }
    fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let v = |g: &Option<Tensor>| g.as_ref().map(|t| t.to_vec::<f32>()).transpose();
        self.seen.lock().unwrap().push(format!("sums {:?} {:?}", v(&g[0])?, v(&g[1])?));
        Ok(vec![g[0].clone(), g[1].clone()])
    }
    fn adds_two_contributions(&self) -> bool {
        true
    }
    fn backward_parts(&self, parts: Vec<Vec<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        let v = |p: &Vec<Tensor>| p.iter().map(|t| t.to_vec::<f32>()).collect::<Result<Vec<_>>>();
        self.seen.lock().unwrap().push(format!("parts {:?} {:?}", v(&parts[0])?, v(&parts[1])?));
        let mut out = Vec::new();
        for p in parts {
            let mut it = p.into_iter();
            out.push(match it.next() {
                Some(first) => Some(it.try_fold(first, |a, b| a.add(&b))?),
                None => None,
            });
        }
        Ok(out)
    }
}

/// Output 0 read by consumers with `factors.0`, output 1 by consumers with `factors.1`.
fn run_parts(factors: (&[f32], &[f32])) -> (Vec<String>, Vec<f32>) {
    let x = Tensor::from_vec(vec![1.0f32, 2.0], 2, Device::Cpu).unwrap().requires_grad_(true).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (a, b) = (no_grad(|| x.mul_scalar(1.0)).unwrap(), no_grad(|| x.mul_scalar(1.0)).unwrap());
    let ys = attach_custom_node(Arc::new(RecordingParts { seen: seen.clone() }), &[&x, &x], &[a, b]);
    let mut loss: Option<Tensor> = None;
    for (y, fs) in ys.iter().zip([factors.0, factors.1]) {
        for f in fs {
            let term = y.mul_scalar(f64::from(*f)).unwrap().sum_all().unwrap();
            loss = Some(match loss {
                Some(l) => l.add(&term).unwrap(),
                None => term,
            });
        }
    }
    loss.unwrap().backward().unwrap();
    let seen = seen.lock().unwrap().clone();
    (seen, x.grad().unwrap().to_vec::<f32>().unwrap())
}

#[test]
fn several_outputs_get_their_contributions_unsummed_when_none_has_more_than_two() {
    let (seen, grad) = run_parts((&[2.0, 3.0], &[5.0]));
    assert_eq!(seen, vec!["parts [[3.0, 3.0], [2.0, 2.0]] [[5.0, 5.0]]".to_string()], "each output's, the later consumer's first");
    assert_eq!(grad, vec![10.0, 10.0]);
    let (seen, _) = run_parts((&[2.0], &[5.0]));
    assert_eq!(seen, vec!["sums Some([2.0, 2.0]) Some([5.0, 5.0])".to_string()], "no output with two: summed");
    let (seen, grad) = run_parts((&[2.0, 3.0, 4.0], &[5.0, 6.0]));
    assert_eq!(seen, vec!["sums Some([9.0, 9.0]) Some([11.0, 11.0])".to_string()], "three contributions: summed");
    assert_eq!(grad, vec![20.0, 20.0]);
}

/// A split piece read twice and another once: the engine hands the split's backward both
/// pieces' contributions; the gradient is the concatenation of their sums (zeros for a piece
/// read by nothing).
#[test]
fn a_split_piece_read_twice_gets_the_sum_of_both() {
    let x = Tensor::from_vec((0..6).map(|v| v as f32).collect(), vec![6], Device::Cpu).unwrap().requires_grad_(true).unwrap();
    let p = x.split(&[2, 2, 2], 0).unwrap();
    let loss = p[0].mul_scalar(2.0).unwrap().sum_all().unwrap();
    let loss = loss.add(&p[1].mul_scalar(5.0).unwrap().sum_all().unwrap()).unwrap();
    let loss = loss.add(&p[0].mul_scalar(3.0).unwrap().sum_all().unwrap()).unwrap();
    loss.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![5.0, 5.0, 5.0, 5.0, 0.0, 0.0]);
}

//! `Tensor::copy_many_`: each destination ends with its source's bytes (as `copy_` gives), in
//! every dtype, with a pair whose source is another pair's destination copied on its own; shape and
//! dtype mismatches are refused. On CUDA (`cuda_ops.rs`) the batched launch against `copy_`.

use ptl_autograd::{DType, Device, Rng, Tensor};

fn rand(n: usize, dt: DType, seed: u64) -> Tensor {
    Tensor::rand(vec![n], -1.0, 1.0, dt, Device::Cpu, &mut Rng::new(seed)).unwrap()
}

#[test]
fn every_destination_gets_its_sources_bytes() {
    let sizes = [1usize, 3, 7, 1000];
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let src: Vec<Tensor> = sizes.iter().enumerate().map(|(i, &n)| rand(n, dt, 10 + i as u64)).collect();
        let dst: Vec<Tensor> = sizes.iter().enumerate().map(|(i, &n)| rand(n, dt, 50 + i as u64)).collect();
        let pairs: Vec<(&Tensor, &Tensor)> = dst.iter().zip(&src).collect();
        Tensor::copy_many_(&pairs).unwrap();
        for (d, s) in dst.iter().zip(&src) {
            assert_eq!(d.to_bytes().unwrap(), s.to_bytes().unwrap(), "{dt}, {} values", s.numel());
        }
    }
}

#[test]
fn a_source_that_is_another_destination_is_copied_in_order() {
    let (a, b, c) = (rand(5, DType::F32, 1), rand(5, DType::F32, 2), rand(5, DType::F32, 3));
    let c_bytes = c.to_bytes().unwrap();
    // b ← c, then a ← b: as two copy_ calls in order, a ends with c's bytes.
    Tensor::copy_many_(&[(&b, &c), (&a, &b)]).unwrap();
    assert_eq!(b.to_bytes().unwrap(), c_bytes);
    assert_eq!(a.to_bytes().unwrap(), c_bytes);
}

#[test]
fn mismatched_pairs_are_refused() {
    let (a, b) = (rand(4, DType::F32, 1), rand(5, DType::F32, 2));
    assert!(Tensor::copy_many_(&[(&a, &b)]).unwrap_err().to_string().contains("copy_many_"));
    let h = rand(4, DType::BF16, 3);
    assert!(Tensor::copy_many_(&[(&a, &h)]).unwrap_err().to_string().contains("copy_many_"));
}

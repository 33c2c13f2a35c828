//! `batch_norm2d_fused_add` on the CPU: the bytes of the addition after the batch norm (output,
//! every gradient, running statistics) in training, where the backend adds the residual inside
//! its call, and in evaluation, where the op is the addition itself. The CUDA kernels' version
//! of this check is `cuda_ops.rs::bn_adds_a_residual_itself`.

use ptl_autograd::{BatchNormOptions, DType, Device, Rng, Tensor};

fn run(fused: bool, training: bool, silu: bool, dt: DType) -> Vec<Vec<u8>> {
    let mut rng = Rng::new(31);
    let shape = vec![2, 3, 5, 4];
    let x = Tensor::rand(shape.clone(), -2.0, 2.0, dt, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let res = Tensor::rand(shape.clone(), -1.0, 1.0, dt, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let w = Tensor::rand(vec![3], 0.5, 1.5, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let b = Tensor::rand(vec![3], -0.5, 0.5, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let rm = Tensor::full(vec![3], 0.1, DType::F32, Device::Cpu).unwrap();
    let rv = Tensor::full(vec![3], 0.8, DType::F32, Device::Cpu).unwrap();
    let opts = BatchNormOptions { training, momentum: 0.03, eps: 1e-3 };
    let y = match fused {
        true => x.batch_norm2d_fused_add(&w, &b, &rm, &rv, None, opts, silu, &res).unwrap(),
        false => res.add(&x.batch_norm2d_fused_tracked(&w, &b, &rm, &rv, None, opts, silu).unwrap()).unwrap(),
    };
    let r = Tensor::rand(shape, -1.0, 1.0, dt, Device::Cpu, &mut rng).unwrap();
    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = [x.grad(), w.grad(), b.grad(), res.grad()].map(|g| g.expect("every input receives a gradient"));
    [&y, &grads[0], &grads[1], &grads[2], &grads[3], &rm, &rv].iter().map(|t| t.to_bytes().unwrap()).collect()
}

#[test]
fn a_residual_added_by_the_batch_norm_gives_the_bytes_of_the_addition_after_it() {
    for dt in [DType::F32, DType::BF16, DType::F64] {
        for (training, silu) in [(true, true), (true, false), (false, true)] {
            let (fused, composed) = (run(true, training, silu, dt), run(false, training, silu, dt));
            for (k, (a, b)) in fused.iter().zip(&composed).enumerate() {
                assert!(a == b, "{dt} training={training} silu={silu}: output #{k} differs");
            }
        }
    }
}

#[test]
fn a_residual_of_another_shape_is_refused_by_the_addition() {
    let mut rng = Rng::new(5);
    let x = Tensor::rand(vec![2, 3, 4, 4], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
    let res = Tensor::rand(vec![2, 3, 4, 5], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
    let (w, b) = (Tensor::ones(3, DType::F32, Device::Cpu).unwrap(), Tensor::zeros(3, DType::F32, Device::Cpu).unwrap());
    let (rm, rv) = (Tensor::zeros(3, DType::F32, Device::Cpu).unwrap(), Tensor::ones(3, DType::F32, Device::Cpu).unwrap());
    let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
    let err = x.batch_norm2d_fused_add(&w, &b, &rm, &rv, None, opts, true, &res).unwrap_err();
    assert!(err.to_string().contains("broadcast"), "{err}");
}

//! CPU throughput of the hot kernels (run: `cargo bench -p ptl-autograd --bench cpu_ops`).
//! Prints GFLOP/s for conv2d forward+backward at the model's first-layer shapes and a 512³ matmul.

use std::time::Instant;

use ptl_autograd::{DType, Device, Rng, Tensor};

fn time<F: FnMut()>(mut f: F, reps: usize) -> f64 {
    f(); // warm-up
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() / reps as f64
}

fn conv_case(label: &str, x: [usize; 4], w: [usize; 4], stride: usize) {
    let mut rng = Rng::new(1);
    let xt = Tensor::randn(x.to_vec(), 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let wt = Tensor::randn(w.to_vec(), 0.0, 0.1, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let pad = w[2] / 2;
    let y = xt.conv2d(&wt, None, (stride, stride), (pad, pad), 1).unwrap();
    let (oh, ow) = (y.dims()[2], y.dims()[3]);
    let macs = (x[0] * w[0] * oh * ow * w[1] * w[2] * w[3]) as f64;
    let fwd = time(
        || {
            ptl_autograd::no_grad(|| xt.conv2d(&wt, None, (stride, stride), (pad, pad), 1).unwrap());
        },
        10,
    );
    let fb = time(
        || {
            xt.zero_grad();
            wt.zero_grad();
            xt.conv2d(&wt, None, (stride, stride), (pad, pad), 1).unwrap().sum_all().unwrap().backward().unwrap();
        },
        10,
    );
    // forward = 2·MACs flops; backward (data + weight) = 4·MACs.
    println!(
        "{label:<34} fwd {:>8.3} ms {:>7.2} GFLOP/s | fwd+bwd {:>8.3} ms {:>7.2} GFLOP/s",
        fwd * 1e3,
        2.0 * macs / fwd / 1e9,
        fb * 1e3,
        6.0 * macs / fb / 1e9
    );
}

fn main() {
    println!("ptl-autograd CPU benchmark, {} rayon threads", rayon::current_num_threads());
    conv_case("conv2d b2 3->16 k3 s2 @256", [2, 3, 256, 256], [16, 3, 3, 3], 2);
    conv_case("conv2d b2 32->32 k3 s1 @64", [2, 32, 64, 64], [32, 32, 3, 3], 1);
    let mut rng = Rng::new(2);
    let a = Tensor::randn(vec![512, 512], 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
    let b = Tensor::randn(vec![512, 512], 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
    let t = time(
        || {
            a.matmul(&b).unwrap();
        },
        20,
    );
    println!("{:<34} {:>8.3} ms {:>7.2} GFLOP/s", "matmul 512x512x512 f32", t * 1e3, 2.0 * 512f64.powi(3) / t / 1e9);
}

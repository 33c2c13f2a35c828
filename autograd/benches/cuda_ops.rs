//! GPU micro-benchmark: per-op GPU time at the YOLO26n-pose shapes (batch 4, 640 px) and the host
//! cost of one eager op launch. Prints a table and writes JSON lines (`name`, `dtype`, `us`) to
//! `$OUT/ours.jsonl` (or `./ours.jsonl`) for the side-by-side with PyTorch (`torch_ops.py`).
//! Run on a GPU machine: `cargo bench -p ptl-autograd --bench cuda_ops` (or the device pack).

#[cfg(feature = "cuda")]
fn main() {
    bench::main();
}

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("skipping: built without the `cuda` feature");
}

#[cfg(feature = "cuda")]
mod bench {
    use std::io::Write;
    use std::time::Instant;

    use ptl_autograd::cuda;
    use ptl_autograd::{no_grad, BatchNormOptions, DType, Device, Rng, Tensor};

    const DEV: Device = Device::Cuda(0);

    struct Out {
        file: std::fs::File,
    }

    impl Out {
        fn row(&mut self, name: &str, dt: DType, us: f64) {
            println!("{name:<44} {:<5} {us:>10.1} us", dt.as_str());
            let _ = writeln!(self.file, "{{\"name\": \"{name}\", \"dtype\": \"{}\", \"us\": {us:.3}}}", dt.as_str());
        }
    }

    fn rnd(shape: &[usize], dt: DType, rng: &mut Rng) -> Tensor {
        Tensor::randn(shape.to_vec(), 0.0, 1.0, dt, DEV, rng).unwrap()
    }

    /// GPU time per call in µs: 3 warm-ups, then `reps` calls between two events, queued behind a
    /// ~20 ms spin kernel so the whole loop is on the stream before the first event runs (the
    /// events then time GPU execution, not the host's launch rate).
    fn gpu_us(reps: usize, mut f: impl FnMut()) -> f64 {
        for _ in 0..3 {
            f();
        }
        cuda::synchronize(DEV).unwrap();
        ptl_autograd::internal::cuda::gpu_spin(DEV, 40_000_000).unwrap();
        let (_, ms) = ptl_autograd::internal::cuda::time_on_stream(DEV, || {
            for _ in 0..reps {
                f();
            }
        })
        .unwrap();
        ms * 1000.0 / reps as f64
    }

    /// Host time per call in µs: the median over 5 batches of `reps` calls, each batch timed
    /// without synchronisation inside (robust to a burst of interference on the machine).
    fn host_us(reps: usize, mut f: impl FnMut()) -> f64 {
        for _ in 0..10 {
            f();
        }
        let mut batches: Vec<f64> = (0..5)
            .map(|_| {
                cuda::synchronize(DEV).unwrap();
                let t = Instant::now();
                for _ in 0..reps {
                    f();
                }
                t.elapsed().as_secs_f64() * 1e6 / reps as f64
            })
            .collect();
        cuda::synchronize(DEV).unwrap();
        batches.sort_by(f64::total_cmp);
        batches[2]
    }

    // (channels, spatial) per pyramid level of YOLO26n-pose at 640 px.
    const LEVELS: [(usize, usize); 5] = [(16, 320), (32, 160), (64, 80), (128, 40), (256, 20)];
    const B: usize = 4;

    pub fn main() {
        if let Err(e) = cuda::check(0) {
            println!("skipping: {e}");
            return;
        }
        let dir = std::env::var("OUT").unwrap_or_else(|_| ".".into());
        let mut out = Out { file: std::fs::File::create(format!("{dir}/ours.jsonl")).unwrap() };
        println!("device: {}", cuda::device_name(0).unwrap());
        let mut rng = Rng::new(1);
        for dt in [DType::F32, DType::BF16] {
            no_grad(|| {
                for (i, &(c, s)) in LEVELS.iter().enumerate() {
                    let x = rnd(&[B, c, s, s], dt, &mut rng);
                    let w3 = rnd(&[c, c, 3, 3], dt, &mut rng);
                    let w1 = rnd(&[c, c, 1, 1], dt, &mut rng);
                    let reps = if s >= 160 { 20 } else { 50 };
                    out.row(&format!("conv3x3_s1 {c}x{s}"), dt, gpu_us(reps, || drop(x.conv2d(&w3, None, (1, 1), (1, 1), 1).unwrap())));
                    out.row(&format!("conv1x1 {c}x{s}"), dt, gpu_us(reps, || drop(x.conv2d(&w1, None, (1, 1), (0, 0), 1).unwrap())));
                    let cin = if i == 0 { 3 } else { LEVELS[i - 1].0 };
                    let xin = rnd(&[B, cin, 2 * s, 2 * s], dt, &mut rng);
                    let ws2 = rnd(&[c, cin, 3, 3], dt, &mut rng);
                    out.row(
                        &format!("conv3x3_s2 {cin}->{c}x{s}"),
                        dt,
                        gpu_us(reps, || drop(xin.conv2d(&ws2, None, (2, 2), (1, 1), 1).unwrap())),
                    );
                }
            });
            // Conv backward (data + weight) at each level, 3x3 s1.
            for &(c, s) in LEVELS.iter() {
                let x = rnd(&[B, c, s, s], dt, &mut rng).requires_grad_(true).unwrap();
                let w = rnd(&[c, c, 3, 3], dt, &mut rng).requires_grad_(true).unwrap();
                let y = x.conv2d(&w, None, (1, 1), (1, 1), 1).unwrap();
                let g = rnd(y.dims(), dt, &mut rng);
                let reps = if s >= 160 { 10 } else { 30 };
                out.row(
                    &format!("conv3x3_s1_bwd {c}x{s}"),
                    dt,
                    gpu_us(reps, || {
                        let y = x.conv2d(&w, None, (1, 1), (1, 1), 1).unwrap();
                        y.backward_with(&g).unwrap();
                        x.set_grad(None);
                        w.set_grad(None);
                    }) - gpu_us(reps, || drop(no_grad(|| x.conv2d(&w, None, (1, 1), (1, 1), 1).unwrap()))),
                );
            }
            no_grad(|| {
                let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
                for &(c, s) in &LEVELS[1..4] {
                    let x = rnd(&[B, c, s, s], dt, &mut rng);
                    let (g, b) = (Tensor::ones(vec![c], dt, DEV).unwrap(), Tensor::zeros(vec![c], dt, DEV).unwrap());
                    let (rm, rv) = (Tensor::zeros(vec![c], DType::F32, DEV).unwrap(), Tensor::ones(vec![c], DType::F32, DEV).unwrap());
                    out.row(
                        &format!("bn_train_silu {c}x{s}"),
                        dt,
                        gpu_us(20, || drop(x.batch_norm2d_silu(&g, &b, &rm, &rv, opts).unwrap())),
                    );
                    let eval = BatchNormOptions { training: false, ..opts };
                    out.row(
                        &format!("bn_eval_silu {c}x{s}"),
                        dt,
                        gpu_us(50, || drop(x.batch_norm2d_silu(&g, &b, &rm, &rv, eval).unwrap())),
                    );
                    out.row(
                        &format!("bn_train_silu_composed {c}x{s}"),
                        dt,
                        gpu_us(20, || drop(x.batch_norm2d(&g, &b, &rm, &rv, opts).unwrap().silu().unwrap())),
                    );
                }
                for &(c, s) in &LEVELS[2..4] {
                    let a = rnd(&[B, c, s, s], dt, &mut rng);
                    let b = rnd(&[B, c, s, s], dt, &mut rng);
                    out.row(&format!("concat 2x{c}x{s}"), dt, gpu_us(50, || drop(Tensor::cat(&[&a, &b], 1).unwrap())));
                }
                for &(c, s) in &[(256usize, 20usize), (128, 40)] {
                    let x = rnd(&[B, c, s, s], dt, &mut rng);
                    out.row(&format!("upsample2x {c}x{s}"), dt, gpu_us(50, || drop(x.upsample_nearest(2).unwrap())));
                }
                let x = rnd(&[B, 128, 20, 20], dt, &mut rng);
                out.row("maxpool_k5 128x20", dt, gpu_us(50, || drop(x.max_pool2d(5, 1, 2).unwrap())));
                let att = rnd(&[B * 2, 400, 400], dt, &mut rng);
                out.row("softmax 8x400x400", dt, gpu_us(50, || drop(att.softmax(-1).unwrap())));
                let q = rnd(&[B * 2, 400, 32], dt, &mut rng);
                let k = rnd(&[B * 2, 32, 400], dt, &mut rng);
                let v = rnd(&[B * 2, 400, 64], dt, &mut rng);
                out.row("matmul 8x400x32x400", dt, gpu_us(50, || drop(q.bmm(&k).unwrap())));
                out.row("matmul 8x400x400x64", dt, gpu_us(50, || drop(att.bmm(&v).unwrap())));
            });
        }
        // Host cost per eager op launch (small tensors; the loop is not synchronised).
        let a = Tensor::ones(vec![64], DType::F32, DEV).unwrap();
        let b = Tensor::ones(vec![64], DType::F32, DEV).unwrap();
        let x = Tensor::ones(vec![1, 8, 8, 8], DType::F32, DEV).unwrap();
        let w = Tensor::ones(vec![8, 8, 3, 3], DType::F32, DEV).unwrap();
        let m = Tensor::ones(vec![16, 16], DType::F32, DEV).unwrap();
        no_grad(|| {
            out.row("host add", DType::F32, host_us(500, || drop(a.add(&b).unwrap())));
            out.row("host silu", DType::F32, host_us(500, || drop(a.silu().unwrap())));
            out.row("host sum_dim", DType::F32, host_us(500, || drop(a.sum_dim(0, true).unwrap())));
            out.row("host conv2d", DType::F32, host_us(500, || drop(x.conv2d(&w, None, (1, 1), (1, 1), 1).unwrap())));
            out.row("host matmul", DType::F32, host_us(500, || drop(m.matmul(&m).unwrap())));
            let (xb, wb, mb) = (x.to_dtype(DType::BF16).unwrap(), w.to_dtype(DType::BF16).unwrap(), m.to_dtype(DType::BF16).unwrap());
            out.row("host conv2d", DType::BF16, host_us(500, || drop(xb.conv2d(&wb, None, (1, 1), (1, 1), 1).unwrap())));
            out.row("host matmul", DType::BF16, host_us(500, || drop(mb.matmul(&mb).unwrap())));
        });
        let ag = a.requires_grad_(true).unwrap();
        out.row("host add (grad recorded)", DType::F32, host_us(500, || drop(ag.add(&b).unwrap())));
        // Both gradients of a 3x3 conv (two cuDNN calls plus the tape's bookkeeping).
        let (xg, wg) = (x.requires_grad_(true).unwrap(), w.requires_grad_(true).unwrap());
        let yg = xg.conv2d(&wg, None, (1, 1), (1, 1), 1).unwrap();
        let gy = yg.ones_like().unwrap();
        out.row(
            "host conv2d backward (data + weight)",
            DType::F32,
            host_us(200, || {
                xg.set_grad(None);
                wg.set_grad(None);
                yg.backward_with(&gy).unwrap();
            }),
        );
        // Where an op's host time goes (pieces timed alone; no PyTorch counterpart).
        for (what, us) in ptl_autograd::internal::cuda::host_probe::host_cost_breakdown(DEV, 300).unwrap() {
            out.row(&format!("breakdown: {what}"), DType::F32, us);
        }
        cuda::synchronize(DEV).unwrap();
        println!("peak allocated {:.1} MiB", cuda::memory_stats(DEV).unwrap().peak_allocated as f64 / (1 << 20) as f64);
    }
}

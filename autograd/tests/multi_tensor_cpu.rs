//! The CPU's multi-tensor optimizer kernels (`MultiTensorStorage` for the CPU backend) give the
//! bytes of the composed ops they stand for — the reference the CUDA kernels are tested against —
//! for SGD (buffer or none, Nesterov, decay), the momentum blend, the EMA lerp (both branches) and
//! AdamW, with host and device scalars, and a set skip flag leaves everything as it was.

use ptl_autograd::{adamw_composed, lerp, no_grad, AdamWItem, DType, Device, DeviceScalars, Rng, SgdStep, Tensor, ADAMW_SCALARS};

fn rand(n: usize, seed: u64) -> Tensor {
    Tensor::rand(vec![n], -1.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(seed)).unwrap()
}

fn bytes(ts: &[&Tensor]) -> Vec<Vec<u8>> {
    ts.iter().map(|t| t.to_bytes().unwrap()).collect()
}

/// Two independent copies of the same tensors.
fn twins(sizes: &[usize], seed: u64) -> (Vec<Tensor>, Vec<Tensor>) {
    let a: Vec<Tensor> = sizes.iter().enumerate().map(|(i, &n)| rand(n, seed + i as u64)).collect();
    let b = a.iter().map(|t| t.deep_copy().unwrap()).collect();
    (a, b)
}

const SIZES: [usize; 3] = [7, 1000, 40_000];

#[test]
fn sgd_matches_the_composed_step() {
    for (wd, nesterov) in [(0.0, false), (5e-4, false), (5e-4, true)] {
        let h = SgdStep { weight_decay: wd, momentum: 0.9, neg_lr: -0.01, nesterov };
        for with_buf in [true, false] {
            let (p1, p2) = twins(&SIZES, 1);
            let (g1, g2) = twins(&SIZES, 10);
            let (b1, b2) = twins(&SIZES, 20);
            let items: Vec<_> = (0..3).map(|i| (&p1[i], &g1[i], with_buf.then_some(&b1[i]))).collect();
            Tensor::sgd_step_many(&items, h).unwrap();
            for i in 0..3 {
                Tensor::sgd_step_composed(&p2[i], &g2[i], with_buf.then_some(&b2[i]), h).unwrap();
            }
            let (x, y): (Vec<&Tensor>, Vec<&Tensor>) = (p1.iter().chain(&b1).collect(), p2.iter().chain(&b2).collect());
            assert_eq!(bytes(&x), bytes(&y), "wd {wd} nesterov {nesterov} buffer {with_buf}");
        }
    }
}

#[test]
fn device_scalar_updates_match_their_composed_forms_and_skip() {
    let values = Tensor::zeros(vec![12], DType::F64, Device::Cpu).unwrap();
    let h = [5e-4, 0.9, -0.01];
    values.write_f64(0, &h).unwrap();
    let adamw: [f64; ADAMW_SCALARS] = [1.0 - 1e-3 * 5e-4, 1.0 - 0.9, 0.999, 1.0 - 0.999, 1e-8, 1e-3, 0.9];
    values.write_f64(3, &adamw).unwrap();
    values.write_f64(10, &[0.95, 0.3]).unwrap();
    for skip in [0.0f32, 1.0] {
        let flag = Tensor::from_vec(vec![skip], vec![], Device::Cpu).unwrap();
        let s = DeviceScalars::new(&values, 0).skipping_if(Some(&flag));
        let skipped = skip != 0.0;
        // SGD with device scalars.
        let (p1, p2) = twins(&SIZES, 2);
        let (g, _) = twins(&SIZES, 11);
        let (b1, b2) = twins(&SIZES, 21);
        let items: Vec<_> = (0..3).map(|i| (&p1[i], &g[i], Some(&b1[i]))).collect();
        Tensor::sgd_step_many_dev(&items, s, true, true).unwrap();
        if !skipped {
            let step = SgdStep { weight_decay: h[0], momentum: h[1], neg_lr: h[2], nesterov: true };
            (0..3).for_each(|i| Tensor::sgd_step_composed(&p2[i], &g[i], Some(&b2[i]), step).unwrap());
        }
        assert_eq!(bytes(&p1.iter().chain(&b1).collect::<Vec<_>>()), bytes(&p2.iter().chain(&b2).collect::<Vec<_>>()), "sgd skip {skip}");
        // The momentum blend (β = 0.95): under a skip the momenta stay, the blends are computed.
        let (m1, m2) = twins(&SIZES, 3);
        let pairs: Vec<_> = (0..3).map(|i| (&g[i], &m1[i])).collect();
        let u1 = Tensor::momentum_blend_many_dev(&pairs, DeviceScalars::new(&values, 10).skipping_if(Some(&flag)), true).unwrap();
        let u2: Vec<Tensor> = (0..3)
            .map(|i| {
                let m = if skipped { m2[i].deep_copy().unwrap() } else { m2[i].clone() };
                Tensor::momentum_blend_composed(&g[i], &m, 0.95, true).unwrap()
            })
            .collect();
        assert_eq!(bytes(&u1.iter().chain(&m1).collect::<Vec<_>>()), bytes(&u2.iter().chain(&m2).collect::<Vec<_>>()), "blend skip {skip}");
        // The EMA lerp with the weight on the device (0.3: the `start +` branch).
        let (d1, d2) = twins(&SIZES, 4);
        let pairs: Vec<_> = (0..3).map(|i| (&d1[i], &g[i])).collect();
        Tensor::lerp_many_dev_(&pairs, DeviceScalars::new(&values, 11)).unwrap();
        (0..3).for_each(|i| no_grad(|| d2[i].copy_(&lerp(&d2[i], &g[i], 0.3).unwrap())).unwrap());
        assert_eq!(bytes(&d1.iter().collect::<Vec<_>>()), bytes(&d2.iter().collect::<Vec<_>>()), "lerp_dev");
        // AdamW at step 3 (counts 2 → 3), decay on.
        let (x1, x2) = twins(&SIZES, 5);
        let (ma1, ma2) = twins(&SIZES, 6);
        let (v1, v2) = twins(&SIZES, 7);
        let (v1, v2): (Vec<Tensor>, Vec<Tensor>) =
            (v1.iter().map(|t| t.abs().unwrap()).collect(), v2.iter().map(|t| t.abs().unwrap()).collect());
        let counts: Vec<Tensor> = (0..3).map(|_| Tensor::from_vec(vec![2.0f64], vec![1], Device::Cpu).unwrap()).collect();
        let items: Vec<AdamWItem<'_>> =
            (0..3).map(|i| AdamWItem { param: &x1[i], grad: &g[i], exp_avg: &ma1[i], exp_avg_sq: &v1[i], step: &counts[i] }).collect();
        Tensor::adamw_step_many_dev(&items, DeviceScalars::new(&values, 3).skipping_if(Some(&flag)), true).unwrap();
        if !skipped {
            (0..3).for_each(|i| adamw_composed(&x2[i], &g[i], &ma2[i], &v2[i], &adamw, 3.0, true).unwrap());
        }
        let all1: Vec<&Tensor> = x1.iter().chain(&ma1).chain(&v1).collect();
        let all2: Vec<&Tensor> = x2.iter().chain(&ma2).chain(&v2).collect();
        assert_eq!(bytes(&all1), bytes(&all2), "adamw skip {skip}");
        let expected = if skipped { 2.0 } else { 3.0 };
        assert!(counts.iter().all(|c| c.to_vec::<f64>().unwrap() == vec![expected]), "counts under skip {skip}");
    }
}

#[test]
fn host_scalar_blend_and_lerp_match_their_composed_forms() {
    let (g, _) = twins(&SIZES, 30);
    for (beta, nesterov) in [(0.95, true), (0.3, false)] {
        let (m1, m2) = twins(&SIZES, 31);
        let pairs: Vec<_> = (0..3).map(|i| (&g[i], &m1[i])).collect();
        let u1 = Tensor::momentum_blend_many(&pairs, beta, nesterov).unwrap();
        let u2: Vec<Tensor> = (0..3).map(|i| Tensor::momentum_blend_composed(&g[i], &m2[i], beta, nesterov).unwrap()).collect();
        assert_eq!(bytes(&u1.iter().chain(&m1).collect::<Vec<_>>()), bytes(&u2.iter().chain(&m2).collect::<Vec<_>>()), "β {beta}");
    }
    // Both branches of lerp: w < 0.5 and w ≥ 0.5 (an EMA's decay is near 1).
    for w in [0.001, 0.9999] {
        let (d1, d2) = twins(&SIZES, 32);
        let pairs: Vec<_> = (0..3).map(|i| (&d1[i], &g[i])).collect();
        Tensor::lerp_many_(&pairs, w).unwrap();
        (0..3).for_each(|i| no_grad(|| d2[i].copy_(&lerp(&d2[i], &g[i], w).unwrap())).unwrap());
        assert_eq!(bytes(&d1.iter().collect::<Vec<_>>()), bytes(&d2.iter().collect::<Vec<_>>()), "w {w}");
    }
}

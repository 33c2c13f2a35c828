//! Timing of the criterion at training size (a benchmark, not a test):
//! `cargo bench -p ptl-trainer --bench loss` (uses the GPU when one is present).

use std::time::Instant;

use ptl_autograd::{Device, Rng, Tensor};
use ptl_heads::nn::Init;
use ptl_heads::RealNvp;
use ptl_trainer::loss::{Anchors, BranchOutputs, E2ELoss, LossConfig, TargetBatch};

fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn main() {
    let device = Device::auto();
    let (bs, per_img) = (16usize, 12usize);
    let anchors = Anchors::from_image_hw((640, 640), &LossConfig::default().strides).unwrap();
    let a = anchors.len();
    let leaf = |v: Vec<f32>, c: usize| Tensor::from_vec(v, (bs, c, a), device).unwrap().requires_grad_(true).unwrap();
    let mk = |seed: u64| BranchOutputs {
        boxes: leaf(values(bs * 4 * a, seed, 0.5, 4.0), 4),
        scores: leaf(values(bs * a, seed + 1, -8.0, 1.0), 1),
        kpts: leaf(values(bs * 51 * a, seed + 2, -2.0, 2.0), 51),
        kpts_sigma: Some(leaf(values(bs * 34 * a, seed + 3, -3.0, 1.0), 34)),
    };
    let (o2m, o2o) = (mk(1), mk(11));
    let mut t = TargetBatch { nkpt: 17, ..Default::default() };
    let r = values(bs * per_img * 4, 99, 0.0, 1.0);
    for i in 0..bs * per_img {
        let (cx, cy, w, h) = (0.1 + 0.8 * r[4 * i], 0.1 + 0.8 * r[4 * i + 1], 0.02 + 0.3 * r[4 * i + 2], 0.02 + 0.5 * r[4 * i + 3]);
        t.batch_idx.push((i / per_img) as f32);
        t.cls.push(0.0);
        t.bboxes.extend_from_slice(&[cx, cy, w, h]);
        let k = values(34, i as u64, -0.4, 0.4);
        for j in 0..17 {
            t.keypoints.extend_from_slice(&[cx + k[2 * j] * w, cy + k[2 * j + 1] * h, 2.0]);
        }
    }
    let mut rng = Rng::new(3);
    let flow = RealNvp::new(&mut Init { rng: &mut rng, device }).unwrap();
    let crit = E2ELoss::new(LossConfig::default(), 100);
    for it in 0..3 {
        let t0 = Instant::now();
        let out = crit.loss(&o2m, &o2o, &t, &anchors, Some(&flow)).unwrap();
        let t1 = t0.elapsed();
        out.total.backward().unwrap();
        eprintln!(
            "[{device}] B={bs} 640² {} GTs: loss {:.1?}, backward {:.1?} (iter {it}, total {:.3}, o2m fg {})",
            bs * per_img,
            t1,
            t0.elapsed() - t1,
            out.total.item().unwrap(),
            out.one2many.assignment.as_ref().map_or(0, |a| a.fg_indices().len())
        );
        for (name, b) in [("o2m", &out.one2many), ("o2o", &out.one2one)] {
            let p = b.phase_ms;
            eprintln!(
                "    {name}: host copies+decode {:.1} ms, assign {:.1} ms, enqueue terms {:.1} ms, read items {:.1} ms",
                p[0], p[1], p[2], p[3]
            );
        }
    }
}

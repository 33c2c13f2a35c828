//! Finite-difference gradient checks in f64 for every differentiable op.
//!
//! Each check builds a random weighting `R` and compares the autograd gradient of `Σ R·f(x)` with
//! central differences `(L(x+h) − L(x−h)) / 2h` for every input element.

use ptl_autograd::{BatchNormOptions, DType, Device, Result, Rng, Tensor};

const H: f64 = 1e-6;

fn rnd(shape: &[usize], lo: f64, hi: f64, rng: &mut Rng) -> Tensor {
    Tensor::rand(shape.to_vec(), lo, hi, DType::F64, Device::Cpu, rng).unwrap()
}

/// Checks d(Σ R·f(inputs))/d(inputs) against finite differences.
fn gradcheck(name: &str, inputs: Vec<Tensor>, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let mut rng = Rng::new(7);
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.requires_grad_(true).unwrap()).collect();
    let out = f(&leaves).unwrap();
    let weights = rnd(out.dims(), -1.0, 1.0, &mut rng);
    let loss = out.mul(&weights).unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let scalar = |xs: &[Tensor]| -> f64 { f(xs).unwrap().mul(&weights).unwrap().sum_all().unwrap().item().unwrap() };
    for (i, leaf) in leaves.iter().enumerate() {
        let analytic = leaf.grad().unwrap_or_else(|| panic!("{name}: input {i} got no gradient")).to_vec::<f64>().unwrap();
        let base = inputs[i].to_vec::<f64>().unwrap();
        for k in 0..base.len() {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[k] += delta;
                let mut xs: Vec<Tensor> = inputs.clone();
                xs[i] = Tensor::from_vec(v, inputs[i].dims().to_vec(), Device::Cpu).unwrap();
                scalar(&xs)
            };
            let numeric = (eval(H) - eval(-H)) / (2.0 * H);
            let a = analytic[k];
            let tol = 1e-5 * (1.0 + numeric.abs().max(a.abs()));
            assert!((a - numeric).abs() <= tol, "{name}: input {i} element {k}: analytic {a} vs numeric {numeric}");
        }
    }
}

#[test]
fn unary_ops() {
    let mut rng = Rng::new(1);
    let x = rnd(&[3, 4], -2.0, 2.0, &mut rng);
    let pos = rnd(&[3, 4], 0.3, 2.0, &mut rng);
    gradcheck("neg", vec![x.clone()], |v| v[0].neg());
    gradcheck("exp", vec![x.clone()], |v| v[0].exp());
    gradcheck("log", vec![pos.clone()], |v| v[0].log());
    gradcheck("sqrt", vec![pos.clone()], |v| v[0].sqrt());
    gradcheck("abs", vec![x.clone()], |v| v[0].abs());
    gradcheck("sigmoid", vec![x.clone()], |v| v[0].sigmoid());
    gradcheck("silu", vec![x.clone()], |v| v[0].silu());
    gradcheck("tanh", vec![x.clone()], |v| v[0].tanh());
    gradcheck("softplus", vec![x.clone()], |v| v[0].softplus());
    gradcheck("atan", vec![x.clone()], |v| v[0].atan());
    gradcheck("recip", vec![pos.clone()], |v| v[0].recip());
    gradcheck("square", vec![x.clone()], |v| v[0].square());
    gradcheck("relu", vec![x.clone()], |v| v[0].relu());
    gradcheck("powf", vec![pos.clone()], |v| v[0].powf(2.7));
    gradcheck("clamp", vec![x.clone()], |v| v[0].clamp(-0.5, 0.7));
    gradcheck("affine", vec![x.clone()], |v| v[0].affine(-1.5, 0.25));
}

#[test]
fn binary_ops_with_broadcasting() {
    let mut rng = Rng::new(2);
    let a = rnd(&[2, 3, 4], -2.0, 2.0, &mut rng);
    let b = rnd(&[3, 1], -2.0, 2.0, &mut rng);
    let bpos = rnd(&[3, 1], 0.5, 2.0, &mut rng);
    let apos = rnd(&[2, 3, 4], 0.5, 2.0, &mut rng);
    gradcheck("add", vec![a.clone(), b.clone()], |v| v[0].add(&v[1]));
    gradcheck("sub", vec![a.clone(), b.clone()], |v| v[0].sub(&v[1]));
    gradcheck("mul", vec![a.clone(), b.clone()], |v| v[0].mul(&v[1]));
    gradcheck("div", vec![a.clone(), bpos.clone()], |v| v[0].div(&v[1]));
    gradcheck("maximum", vec![a.clone(), b.clone()], |v| v[0].maximum(&v[1]));
    gradcheck("minimum", vec![a.clone(), b.clone()], |v| v[0].minimum(&v[1]));
    gradcheck("pow", vec![apos.clone(), b.clone()], |v| v[0].pow(&v[1]));
    gradcheck("atan2", vec![a.clone(), bpos.clone()], |v| v[0].atan2(&v[1]));
    let c = rnd(&[4], -1.0, 1.0, &mut rng);
    gradcheck("mul_rank_extend", vec![c.clone(), a.clone()], |v| v[0].mul(&v[1]));
}

#[test]
fn where_and_reductions() {
    let mut rng = Rng::new(3);
    let a = rnd(&[3, 5], -2.0, 2.0, &mut rng);
    let b = rnd(&[1, 5], -2.0, 2.0, &mut rng);
    let cond = a.gt_scalar(0.0).unwrap();
    gradcheck("where_cond", vec![a.clone(), b.clone()], move |v| cond.where_cond(&v[0], &v[1]));
    let x = rnd(&[2, 3, 4], -2.0, 2.0, &mut rng);
    gradcheck("sum_dim", vec![x.clone()], |v| v[0].sum_dim(1, false));
    gradcheck("sum_dims_keep", vec![x.clone()], |v| v[0].sum_dims(&[0, 2], true));
    gradcheck("mean_dim", vec![x.clone()], |v| v[0].mean_dim(-1, true));
    gradcheck("mean_all", vec![x.clone()], |v| v[0].mean_all());
    gradcheck("max_dim", vec![x.clone()], |v| Ok(v[0].max_dim(2, false)?.0));
    gradcheck("min_dim", vec![x.clone()], |v| Ok(v[0].min_dim(0, true)?.0));
}

#[test]
fn shape_ops() {
    let mut rng = Rng::new(4);
    let x = rnd(&[2, 3, 4], -2.0, 2.0, &mut rng);
    gradcheck("reshape", vec![x.clone()], |v| v[0].reshape(vec![6, 4])?.exp());
    gradcheck("permute", vec![x.clone()], |v| v[0].permute(&[2, 0, 1]));
    gradcheck("transpose", vec![x.clone()], |v| v[0].transpose(0, 2));
    gradcheck("narrow", vec![x.clone()], |v| v[0].narrow(2, 1, 2));
    let y = rnd(&[2, 2, 4], -2.0, 2.0, &mut rng);
    gradcheck("cat", vec![x.clone(), y.clone()], |v| Tensor::cat(&[&v[0], &v[1]], 1));
    gradcheck("split", vec![x.clone()], |v| {
        let p = v[0].split(&[1, 3], 2)?;
        p[0].mul(&p[1].sum_dim(2, true)?)
    });
    gradcheck("chunk", vec![x.clone()], |v| {
        let p = v[0].chunk(2, 2)?;
        p[0].mul(&p[1])
    });
    let s = rnd(&[3, 1], -2.0, 2.0, &mut rng);
    gradcheck("expand", vec![s.clone()], |v| v[0].expand(&[2, 3, 4]));
    gradcheck("squeeze_unsqueeze", vec![s.clone()], |v| v[0].squeeze(1)?.unsqueeze(0)?.exp());
    let img = rnd(&[1, 2, 3, 3], -1.0, 1.0, &mut rng);
    gradcheck("upsample_nearest", vec![img], |v| v[0].upsample_nearest(2));
}

#[test]
fn index_ops() {
    let mut rng = Rng::new(5);
    let x = rnd(&[4, 3], -2.0, 2.0, &mut rng);
    let idx = Tensor::from_vec(vec![2i64, 0, 2, 3], 4, Device::Cpu).unwrap();
    let i2 = idx.clone();
    gradcheck("index_select", vec![x.clone()], move |v| v[0].index_select(0, &i2));
    let g = Tensor::from_vec(vec![0i64, 2, 2, 1, 0, 0], vec![2, 3], Device::Cpu).unwrap();
    let g2 = g.clone();
    gradcheck("gather", vec![x.clone()], move |v| v[0].gather(0, &g2));
    let src = rnd(&[2, 3], -1.0, 1.0, &mut rng);
    gradcheck("scatter_add", vec![x.clone(), src], move |v| v[0].scatter_add(0, &g, &v[1]));
}

#[allow(clippy::too_many_arguments)]
fn conv_case(name: &str, x: &[usize], w: &[usize], stride: usize, pad: usize, groups: usize, bias: bool, seed: u64) {
    let mut rng = Rng::new(seed);
    let xs = rnd(x, -1.0, 1.0, &mut rng);
    let ws = rnd(w, -1.0, 1.0, &mut rng);
    let mut inputs = vec![xs, ws];
    if bias {
        inputs.push(rnd(&[w[0]], -1.0, 1.0, &mut rng));
    }
    gradcheck(name, inputs, |v| v[0].conv2d(&v[1], v.get(2), (stride, stride), (pad, pad), groups));
}

#[test]
fn conv2d_variants() {
    conv_case("conv3x3_s1_p1", &[2, 3, 5, 5], &[4, 3, 3, 3], 1, 1, 1, true, 10);
    conv_case("conv3x3_s2_p1", &[2, 3, 6, 5], &[2, 3, 3, 3], 2, 1, 1, false, 11);
    conv_case("conv1x1", &[2, 4, 3, 3], &[3, 4, 1, 1], 1, 0, 1, true, 12);
    conv_case("conv_groups2", &[1, 4, 4, 4], &[6, 2, 3, 3], 1, 1, 2, false, 13);
    conv_case("conv_depthwise", &[2, 3, 5, 4], &[3, 1, 3, 3], 2, 1, 3, true, 14);
    conv_case("conv_nopad", &[1, 2, 5, 5], &[2, 2, 3, 3], 1, 0, 1, false, 15);
}

#[test]
fn batch_norm_train_and_eval() {
    let mut rng = Rng::new(20);
    let x = rnd(&[3, 2, 3, 2], -2.0, 2.0, &mut rng);
    let w = rnd(&[2], 0.5, 1.5, &mut rng);
    let b = rnd(&[2], -0.5, 0.5, &mut rng);
    let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
    gradcheck("batch_norm2d_train", vec![x.clone(), w.clone(), b.clone()], move |v| {
        let rm = Tensor::zeros(vec![2], DType::F64, Device::Cpu)?;
        let rv = Tensor::ones(vec![2], DType::F64, Device::Cpu)?;
        v[0].batch_norm2d(&v[1], &v[2], &rm, &rv, opts)
    });
    let rm = rnd(&[2], -0.2, 0.2, &mut rng);
    let rv = rnd(&[2], 0.5, 1.5, &mut rng);
    let eval = BatchNormOptions { training: false, ..opts };
    gradcheck("batch_norm2d_eval", vec![x, w, b], move |v| v[0].batch_norm2d(&v[1], &v[2], &rm, &rv, eval));
}

#[test]
fn pool_matmul_softmax_loss() {
    let mut rng = Rng::new(30);
    let x = rnd(&[2, 2, 6, 5], -3.0, 3.0, &mut rng);
    gradcheck("max_pool2d_k5_s1_p2", vec![x.clone()], |v| v[0].max_pool2d(5, 1, 2));
    gradcheck("max_pool2d_k2_s2", vec![x.clone()], |v| v[0].max_pool2d(2, 2, 0));
    let a = rnd(&[2, 3, 4], -1.0, 1.0, &mut rng);
    let b = rnd(&[2, 4, 5], -1.0, 1.0, &mut rng);
    let b2 = rnd(&[4, 5], -1.0, 1.0, &mut rng);
    gradcheck("bmm", vec![a.clone(), b.clone()], |v| v[0].bmm(&v[1]));
    gradcheck("matmul_broadcast", vec![a.clone(), b2.clone()], |v| v[0].matmul(&v[1]));
    // matmul_t: every transpose combination (on the CPU the transposes are materialised; the CUDA
    // case in cuda_ops compares the GEMM's transposed reads with it).
    let at = rnd(&[2, 4, 3], -1.0, 1.0, &mut rng);
    let bt = rnd(&[2, 5, 4], -1.0, 1.0, &mut rng);
    for (lt, rt) in [(false, false), (true, false), (false, true), (true, true)] {
        let (l, r) = (if lt { at.clone() } else { a.clone() }, if rt { bt.clone() } else { b.clone() });
        gradcheck(&format!("matmul_t({lt}, {rt})"), vec![l, r], move |v| v[0].matmul_t(&v[1], lt, rt));
    }
    let c = rnd(&[2, 3, 5], -1.0, 1.0, &mut rng);
    gradcheck("baddbmm", vec![c, a.clone(), b.clone()], |v| v[0].baddbmm(&v[1], &v[2], -0.7, 1.9));
    let w = rnd(&[3, 4], -1.0, 1.0, &mut rng);
    let bias = rnd(&[3], -1.0, 1.0, &mut rng);
    gradcheck("linear", vec![a.clone(), w, bias], |v| v[0].linear(&v[1], Some(&v[2])));
    gradcheck("softmax", vec![a.clone()], |v| v[0].softmax(-1));
    gradcheck("log_softmax", vec![a.clone()], |v| v[0].log_softmax(1));
    let z = rnd(&[2, 3, 4], 0.0, 1.0, &mut rng);
    gradcheck("bce_with_logits", vec![a.clone(), z], |v| v[0].bce_with_logits(&v[1]));
    // Attention-like chain: softmax(q·kᵀ·s)·v
    let q = rnd(&[2, 3, 4], -1.0, 1.0, &mut rng);
    let k = rnd(&[2, 5, 4], -1.0, 1.0, &mut rng);
    let vv = rnd(&[2, 5, 3], -1.0, 1.0, &mut rng);
    gradcheck("attention", vec![q, k, vv], |v| v[0].matmul(&v[1].transpose(1, 2)?)?.affine(0.5, 0.0)?.softmax(-1)?.matmul(&v[2]));
}

#[test]
fn cast_passes_gradient_back() {
    let x = Tensor::from_vec(vec![1.0f64, -2.0, 3.0], 3, Device::Cpu).unwrap().requires_grad_(true).unwrap();
    let y = x.to_dtype(DType::F32).unwrap().square().unwrap().sum_all().unwrap();
    y.backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::F64);
    assert_eq!(g.to_vec::<f64>().unwrap(), vec![2.0, -4.0, 6.0]);
}

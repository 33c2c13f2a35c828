//! CUDA vs CPU for every op, forward and backward, in f32 / bf16 / f16 (f64 for a subset).
//!
//! Each case draws fresh random inputs, runs `Σ R·f(x)` (R random) forward and backward on the CPU
//! (f32 on the same rounded inputs for the half types) and on the GPU, and requires
//! ‖cuda − cpu‖ / ‖cpu‖ ≤ 1e-5 (f32/f64) or ≤ 1e-2 (bf16/f16) for the output and every gradient,
//! the same absent gradients, and bit-identical bytes when the GPU run is repeated. Every device
//! allocation is poisoned (0xFF) first, so an unwritten output element shows up as NaN / −1.
//! Without a usable GPU each test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use ptl_autograd::{BatchNormOptions, DType, Device, Result, Rng, Tensor};

fn gpu() -> Option<Device> {
    let dev = ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))?;
    ptl_autograd::internal::cuda::set_poison_allocations(true);
    Some(dev)
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

fn tol(dt: DType) -> f64 {
    if dt.is_half() {
        1e-2
    } else {
        1e-5
    }
}

fn ref_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Random values rounded to `dt` (so CPU and GPU see the same numbers).
fn values(shape: &[usize], lo: f64, hi: f64, dt: DType, rng: &mut Rng) -> Vec<f64> {
    let t = Tensor::rand(shape.to_vec(), lo, hi, dt, Device::Cpu, rng).unwrap();
    t.to_f64_vec().unwrap()
}

struct Run {
    out: Vec<f64>,
    out_bytes: Vec<u8>,
    grads: Vec<Option<(Vec<f64>, Vec<u8>)>>,
}

type OpFn<'a> = &'a dyn Fn(&[Tensor], Device) -> Result<Tensor>;

fn run(dev: Device, dt: DType, inputs: &[(Vec<usize>, Vec<f64>, bool)], weights: &[f64], f: OpFn) -> Run {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|(s, v, g)| {
            let t = Tensor::from_f64(v, s.clone(), dt, dev).unwrap();
            if *g {
                t.requires_grad_(true).unwrap()
            } else {
                t
            }
        })
        .collect();
    let out = f(&leaves, dev).unwrap_or_else(|e| panic!("forward on {dev}: {e}"));
    let outd = out.dtype();
    let res_out = out.to_f64_vec().unwrap();
    let out_bytes = out.to_bytes().unwrap();
    let mut grads = Vec::new();
    if outd.is_float() && out.requires_grad() {
        let w = Tensor::from_f64(weights, out.dims().to_vec(), outd, dev).unwrap();
        let loss = out.mul(&w).unwrap().sum_all().unwrap();
        loss.backward().unwrap_or_else(|e| panic!("backward on {dev}: {e}"));
        for l in &leaves {
            grads.push(l.grad().map(|g| (g.to_f64_vec().unwrap(), g.to_bytes().unwrap())));
        }
    }
    Run { out: res_out, out_bytes, grads }
}

/// Compares CUDA with the CPU for `f` on random inputs `(shape, lo, hi)`; `grad[i]` says whether
/// input i requires a gradient.
fn case(name: &str, dts: &[DType], inputs: &[(&[usize], f64, f64)], f: OpFn) {
    let Some(dev) = gpu() else { return };
    for (k, &dt) in dts.iter().enumerate() {
        let mut rng = Rng::new(1000 + k as u64 + name.len() as u64 * 7);
        let ins: Vec<(Vec<usize>, Vec<f64>, bool)> =
            inputs.iter().map(|(s, lo, hi)| (s.to_vec(), values(s, *lo, *hi, dt, &mut rng), true)).collect();
        // Output shape from a CPU dry run (no grad) to draw the weights.
        let probe = run(Device::Cpu, ref_dtype(dt), &ins.iter().map(|(s, v, _)| (s.clone(), v.clone(), false)).collect::<Vec<_>>(), &[], f);
        let w = {
            let n = probe.out.len();
            values(&[n], -1.0, 1.0, dt, &mut rng)
        };
        let cpu = run(Device::Cpu, ref_dtype(dt), &ins, &w, f);
        let g1 = run(dev, dt, &ins, &w, f);
        let g2 = run(dev, dt, &ins, &w, f);
        let t = tol(dt);
        let e = rel(&g1.out, &cpu.out);
        assert!(e <= t, "{name} {dt}: forward rel err {e:.3e} > {t:e}");
        assert!(
            g1.out.iter().all(|x| !x.is_nan()) || cpu.out.iter().any(|x| x.is_nan()),
            "{name} {dt}: NaN in output (unwritten element?)"
        );
        assert_eq!(g1.out_bytes, g2.out_bytes, "{name} {dt}: forward not deterministic");
        assert_eq!(g1.grads.len(), cpu.grads.len(), "{name} {dt}: gradient count");
        for (i, (gc, gg)) in cpu.grads.iter().zip(&g1.grads).enumerate() {
            match (gc, gg) {
                (None, None) => {}
                (Some((c, _)), Some((g, gb))) => {
                    let e = rel(g, c);
                    assert!(e <= t, "{name} {dt}: grad {i} rel err {e:.3e} > {t:e}");
                    let again = g2.grads[i].as_ref().map(|x| &x.1);
                    assert_eq!(Some(gb), again, "{name} {dt}: grad {i} not deterministic");
                }
                (c, g) => panic!("{name} {dt}: grad {i} presence differs: cpu {} vs cuda {}", c.is_some(), g.is_some()),
            }
        }
        println!("ok {name} {dt}");
    }
}

/// Exact comparison for non-differentiable / integer results.
fn exact(name: &str, dts: &[DType], inputs: &[(&[usize], f64, f64)], f: OpFn) {
    let Some(dev) = gpu() else { return };
    for (k, &dt) in dts.iter().enumerate() {
        let mut rng = Rng::new(2000 + k as u64 + name.len() as u64);
        let ins: Vec<(Vec<usize>, Vec<f64>, bool)> =
            inputs.iter().map(|(s, lo, hi)| (s.to_vec(), values(s, *lo, *hi, dt, &mut rng), false)).collect();
        let cpu = run(Device::Cpu, dt, &ins, &[], f);
        let g1 = run(dev, dt, &ins, &[], f);
        let g2 = run(dev, dt, &ins, &[], f);
        assert_eq!(g1.out, cpu.out, "{name} {dt}: differs from CPU");
        assert_eq!(g1.out_bytes, g2.out_bytes, "{name} {dt}: not deterministic");
        println!("ok {name} {dt}");
    }
}

const FP: &[DType] = &[DType::F32, DType::BF16, DType::F16];
const FP64: &[DType] = &[DType::F32, DType::BF16, DType::F16, DType::F64];

#[test]
fn unary() {
    let s: &[usize] = &[3, 7, 11];
    type U = fn(&Tensor) -> Result<Tensor>;
    let all: &[(&str, U)] = &[
        ("neg", |x| x.neg()),
        ("exp", |x| x.exp()),
        ("abs", |x| x.abs()),
        ("sigmoid", |x| x.sigmoid()),
        ("silu", |x| x.silu()),
        ("tanh", |x| x.tanh()),
        ("softplus", |x| x.softplus()),
        ("atan", |x| x.atan()),
        ("square", |x| x.square()),
        ("relu", |x| x.relu()),
        ("clamp", |x| x.clamp(-0.5, 0.7)),
        ("affine", |x| x.affine(-1.5, 0.25)),
        ("sign", |x| x.sign()),
        ("floor", |x| x.floor()),
        ("ceil", |x| x.ceil()),
    ];
    for (name, f) in all {
        case(name, FP64, &[(s, -3.0, 3.0)], &move |v, _| f(&v[0]));
    }
    let pos: &[(&str, U)] = &[("log", |x| x.log()), ("sqrt", |x| x.sqrt()), ("recip", |x| x.recip()), ("powf", |x| x.powf(2.7))];
    for (name, f) in pos {
        case(name, FP64, &[(s, 0.3, 3.0)], &move |v, _| f(&v[0]));
    }
    case("softplus_big", &[DType::F32], &[(s, 15.0, 25.0)], &|v, _| v[0].softplus());
}

#[test]
fn binary_broadcast() {
    type B = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: &[(&str, B)] = &[
        ("add", |a, b| a.add(b)),
        ("sub", |a, b| a.sub(b)),
        ("mul", |a, b| a.mul(b)),
        ("maximum", |a, b| a.maximum(b)),
        ("minimum", |a, b| a.minimum(b)),
        ("atan2", |a, b| a.atan2(b)),
    ];
    let shapes: &[(&[usize], &[usize])] =
        // 120 equal-shape elements take the 16-byte vector kernel for every dtype, 105 the scalar one.
        &[(&[4, 5, 6], &[4, 5, 6]), (&[3, 5, 7], &[3, 5, 7]), (&[4, 5, 6], &[5, 1]), (&[6], &[2, 3, 6]), (&[2, 16, 9, 9], &[1, 16, 1, 1])];
    for (name, f) in ops {
        for (sa, sb) in shapes {
            case(name, FP64, &[(sa, -2.0, 2.0), (sb, -2.0, 2.0)], &move |v, _| f(&v[0], &v[1]));
        }
    }
    for (sa, sb) in shapes {
        case("div", FP64, &[(sa, -2.0, 2.0), (sb, 0.5, 2.0)], &|v, _| v[0].div(&v[1]));
        case("pow", FP64, &[(sa, 0.5, 2.0), (sb, -1.5, 1.5)], &|v, _| v[0].pow(&v[1]));
    }
}

#[test]
fn compare_where_cast() {
    type C = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: &[(&str, C)] = &[
        ("eq", |a, b| a.eq(b)),
        ("ne", |a, b| a.ne(b)),
        ("lt", |a, b| a.lt(b)),
        ("le", |a, b| a.le(b)),
        ("gt", |a, b| a.gt(b)),
        ("ge", |a, b| a.ge(b)),
    ];
    for (name, f) in ops {
        // Coarse values so that equality happens.
        exact(name, FP64, &[(&[5, 6], -2.0, 2.0), (&[1, 6], -2.0, 2.0)], &move |v, _| f(&v[0].floor()?, &v[1].floor()?));
    }
    case("where_cond", FP, &[(&[5, 6], -2.0, 2.0), (&[1, 6], -2.0, 2.0)], &|v, _| {
        let c = v[0].detach().gt_scalar(0.0)?;
        c.where_cond(&v[0], &v[1])
    });
    for to in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        case("to_dtype", FP64, &[(&[4, 9], -3.0, 3.0)], &move |v, _| v[0].to_dtype(to)?.to_dtype(v[0].dtype()));
    }
    for to in [DType::I64, DType::U8, DType::Bool] {
        exact("cast_int", FP64, &[(&[4, 9], -300.0, 300.0)], &move |v, _| v[0].to_dtype(to)?.to_dtype(DType::F64));
        exact("cast_int_back", FP64, &[(&[4, 9], 0.0, 300.0)], &move |v, _| v[0].to_dtype(DType::I64)?.to_dtype(to)?.to_dtype(DType::F32));
    }
}

#[test]
fn reductions() {
    let s: &[usize] = &[4, 37, 5];
    for d in 0..3isize {
        case("sum_dim", FP64, &[(s, -2.0, 2.0)], &move |v, _| v[0].sum_dim(d, false));
        case("max_dim", FP64, &[(s, -2.0, 2.0)], &move |v, _| Ok(v[0].max_dim(d, true)?.0));
        case("min_dim", FP64, &[(s, -2.0, 2.0)], &move |v, _| Ok(v[0].min_dim(d, false)?.0));
        exact("argmax", FP64, &[(s, -2.0, 2.0)], &move |v, _| v[0].argmax(d, false));
        exact("argmin", FP64, &[(s, -2.0, 2.0)], &move |v, _| v[0].argmin(d, true));
        exact("argmax_ties", &[DType::F32], &[(s, -2.0, 2.0)], &move |v, _| v[0].floor()?.argmax(d, false));
    }
    case("sum_dims", FP64, &[(&[2, 16, 9, 9], -2.0, 2.0)], &|v, _| v[0].sum_dims(&[0, 2, 3], true));
    // A per-channel bias's gradient (`sum_mid`: its eight-loads-in-flight loop and its tail): rows
    // longer and shorter than the block, totals not a multiple of 2,048.
    case("bias_add_long_rows", FP64, &[(&[8, 3, 40, 41], -2.0, 2.0), (&[1, 3, 1, 1], -1.0, 1.0)], &|v, _| v[0].add(&v[1]));
    case("bias_add_short_rows", FP64, &[(&[37, 4, 7, 13], -2.0, 2.0), (&[1, 4, 1, 1], -1.0, 1.0)], &|v, _| v[0].add(&v[1]));
    case("mean_all", FP64, &[(&[3, 1000], -2.0, 2.0)], &|v, _| v[0].mean_all());
    case("sum_long_row", FP, &[(&[3, 70000], -1.0, 1.0)], &|v, _| v[0].sum_dim(1, false));
    // Column reduction with more than 65535 outer rows (the grid's y limit): chunked launches.
    case("sum_many_columns", &[DType::F32], &[(&[70000, 3, 2], -1.0, 1.0)], &|v, _| v[0].sum_dim(1, true));
    for k in [1usize, 5, 37] {
        exact("topk_largest", FP64, &[(s, -2.0, 2.0)], &move |v, _| {
            let (a, i) = v[0].floor()?.topk(k.min(5), 2, true)?;
            let (b, j) = v[0].topk(k, 1, false)?;
            Tensor::cat(
                &[
                    &a.flatten_all()?,
                    &i.to_dtype(v[0].dtype())?.flatten_all()?,
                    &b.flatten_all()?,
                    &j.to_dtype(v[0].dtype())?.flatten_all()?,
                ],
                0,
            )
        });
    }
    exact("max_all", FP64, &[(s, -2.0, 2.0)], &|v, _| {
        Tensor::cat(&[&v[0].max_all()?.reshape(vec![1])?, &v[0].min_all()?.reshape(vec![1])?], 0)
    });
    exact("sum_i64", &[DType::I64], &[(s, -50.0, 50.0)], &|v, _| v[0].sum_dim(1, false));
    exact("sum_bool", &[DType::F32], &[(s, -2.0, 2.0)], &|v, _| v[0].gt_scalar(0.0)?.sum_dim(1, false));
}

#[test]
fn shapes() {
    let s: &[usize] = &[2, 3, 4, 5];
    case("permute", FP64, &[(s, -2.0, 2.0)], &|v, _| v[0].permute(&[3, 1, 0, 2]));
    case("transpose", FP64, &[(s, -2.0, 2.0)], &|v, _| v[0].transpose(1, 3));
    case("narrow", FP64, &[(s, -2.0, 2.0)], &|v, _| v[0].narrow(2, 1, 2));
    case("cat", FP64, &[(s, -2.0, 2.0), (&[2, 5, 4, 5], -2.0, 2.0)], &|v, _| Tensor::cat(&[&v[0], &v[1]], 1));
    case("cat_last", FP64, &[(s, -2.0, 2.0), (&[2, 3, 4, 2], -2.0, 2.0)], &|v, _| Tensor::cat(&[&v[0], &v[1]], 3));
    // Fused one-launch concatenation: three inputs along dim 0 (one row), odd widths (narrow
    // accesses), the model's channel concat of four 16-byte-aligned inputs; and nine inputs (more
    // than one launch takes: the per-input fallback).
    case("cat3_dim0", FP64, &[(&[1, 3, 5], -2.0, 2.0), (&[2, 3, 5], -2.0, 2.0), (&[1, 3, 5], -2.0, 2.0)], &|v, _| {
        Tensor::cat(&[&v[0], &v[1], &v[2]], 0)
    });
    case(
        "cat4_channels",
        FP64,
        &[(&[2, 8, 4, 4], -2.0, 2.0), (&[2, 8, 4, 4], -2.0, 2.0), (&[2, 16, 4, 4], -2.0, 2.0), (&[2, 8, 4, 4], -2.0, 2.0)],
        &|v, _| Tensor::cat(&[&v[0], &v[1], &v[2], &v[3]], 1),
    );
    case("cat9", FP64, &[(&[2, 1, 3], -2.0, 2.0), (&[2, 2, 3], -2.0, 2.0)], &|v, _| {
        Tensor::cat(&[&v[0], &v[1], &v[0], &v[1], &v[0], &v[1], &v[0], &v[1], &v[0]], 1)
    });
    case("split", FP64, &[(s, -2.0, 2.0)], &|v, _| {
        let p = v[0].split(&[1, 3], 2)?;
        p[0].mul(&p[1].sum_dim(2, true)?)
    });
    case("chunk", FP64, &[(s, -2.0, 2.0)], &|v, _| {
        let p = v[0].chunk(2, 3)?;
        p[0].narrow(3, 0, 2)?.mul(&p[1])
    });
    case("expand", FP64, &[(&[3, 1], -2.0, 2.0)], &|v, _| v[0].expand(&[2, 3, 4]));
    case("upsample_nearest", FP64, &[(&[2, 3, 5, 4], -2.0, 2.0)], &|v, _| v[0].upsample_nearest(2));
    case("squeeze", FP64, &[(&[3, 1, 4], -2.0, 2.0)], &|v, _| v[0].squeeze(1)?.unsqueeze(0)?.exp());
}

#[test]
fn index_ops() {
    case("index_select", FP64, &[(&[6, 5, 3], -2.0, 2.0)], &|v, d| {
        let idx = Tensor::from_vec(vec![2i64, 0, 2, 5, 5, 1], 6, d)?;
        v[0].index_select(1, &Tensor::from_vec(vec![4i64, 0, 4, 2], 4, d)?)?.index_select(0, &idx)
    });
    case("gather", FP64, &[(&[4, 3], -2.0, 2.0)], &|v, d| {
        let g = Tensor::from_vec(vec![0i64, 2, 2, 1, 0, 0, 3, 3, 1], vec![3, 3], d)?;
        v[0].gather(0, &g)
    });
    case("gather_dim1", FP64, &[(&[4, 6], -2.0, 2.0)], &|v, d| {
        let g = Tensor::from_vec(vec![0i64, 5, 5, 1, 2, 2, 3, 3, 4, 0, 0, 0], vec![4, 3], d)?;
        v[0].gather(1, &g)
    });
    case("scatter_add", FP64, &[(&[4, 3], -2.0, 2.0), (&[3, 3], -1.0, 1.0)], &|v, d| {
        let g = Tensor::from_vec(vec![0i64, 2, 2, 1, 0, 0, 0, 2, 2], vec![3, 3], d)?;
        v[0].scatter_add(0, &g, &v[1])
    });
    case("scatter_add_dim1", FP64, &[(&[3, 5], -2.0, 2.0), (&[2, 4], -1.0, 1.0)], &|v, d| {
        let g = Tensor::from_vec(vec![4i64, 4, 0, 4, 1, 1, 1, 3], vec![2, 4], d)?;
        v[0].scatter_add(1, &g, &v[1])
    });
}

fn conv(name: &str, x: &[usize], w: &[usize], stride: usize, pad: usize, groups: usize, bias: bool) {
    let b = [w[0]];
    let mut ins: Vec<(&[usize], f64, f64)> = vec![(x, -1.0, 1.0), (w, -1.0, 1.0)];
    if bias {
        ins.push((&b, -1.0, 1.0));
    }
    case(name, FP64, &ins, &move |v, _| v[0].conv2d(&v[1], v.get(2), (stride, stride), (pad, pad), groups));
}

#[test]
fn conv2d() {
    conv("conv3x3_s1", &[2, 8, 17, 15], &[16, 8, 3, 3], 1, 1, 1, true);
    conv("conv3x3_s2", &[2, 8, 17, 16], &[12, 8, 3, 3], 2, 1, 1, false);
    // 1×1: HW = 81 (no 16-byte rows: a GEMM per item), HW = 64 (one batched GEMM of partials).
    conv("conv1x1", &[2, 16, 9, 9], &[8, 16, 1, 1], 1, 0, 1, true);
    conv("conv1x1_rows16", &[3, 16, 8, 8], &[8, 16, 1, 1], 1, 0, 1, false);
    // No 16-byte rows but 16 items or more: the batched GEMM of partials as well (the head's 1-
    // and 51-channel outputs at training batch sizes).
    conv("conv1x1_unaligned_batched", &[18, 16, 9, 9], &[3, 16, 1, 1], 1, 0, 1, true);
    conv("conv1x1_one_output_batched", &[16, 8, 5, 5], &[1, 8, 1, 1], 1, 0, 1, false);
    // No 16-byte rows below 16 items: the weight gradient from the own narrow kernel — the head's
    // 85 → 51 projection (two input tiles, one output tile partly used, bands crossing items), its
    // 64 → 1 and 16 → 4 projections, more than one output tile (70 outputs), and a contraction
    // shorter than one chunk.
    // With a bias, the same launch computes its gradient (compared with the CPU's reduction like
    // every other gradient here).
    let narrow_before =
        gpu().map(|_| (ptl_autograd::internal::cuda::narrow_weight_gradients(), ptl_autograd::internal::cuda::narrow_bias_gradients()));
    conv("conv1x1_narrow_points", &[4, 85, 20, 20], &[51, 85, 1, 1], 1, 0, 1, true);
    conv("conv1x1_narrow_class", &[3, 64, 9, 7], &[1, 64, 1, 1], 1, 0, 1, true);
    conv("conv1x1_narrow_box", &[15, 16, 9, 9], &[4, 16, 1, 1], 1, 0, 1, true);
    conv("conv1x1_narrow_tiles", &[2, 33, 13, 11], &[70, 33, 1, 1], 1, 0, 1, true);
    conv("conv1x1_narrow_short", &[1, 5, 3, 3], &[3, 5, 1, 1], 1, 0, 1, false);
    if let Some((before, bias_before)) = narrow_before {
        let ran = ptl_autograd::internal::cuda::narrow_weight_gradients() - before;
        let with_bias = ptl_autograd::internal::cuda::narrow_bias_gradients() - bias_before;
        // Five shapes, three dtypes (f64 keeps cuBLAS), two runs each; four of them with a bias.
        assert!(ran >= 30, "the narrow 1×1 weight gradient ran {ran} times, expected 30");
        assert!(with_bias >= 24, "the narrow kernel computed {with_bias} bias gradients, expected 24");
        println!("ok narrow 1×1 weight gradients: {ran} through the own kernel, {with_bias} with the bias gradient");
    }
    conv("conv_groups2", &[1, 8, 10, 10], &[12, 4, 3, 3], 1, 1, 2, false);
    conv("conv_depthwise", &[2, 16, 11, 9], &[16, 1, 3, 3], 2, 1, 16, true);
    conv("conv_nopad", &[1, 4, 9, 9], &[4, 4, 3, 3], 1, 0, 1, false);
    conv("conv_rect", &[2, 4, 8, 8], &[6, 4, 1, 5], 1, 0, 1, true);
    // Thin input (≤ 4 channels, the first layer's RGB): the weight gradient from the own kernel —
    // the stem's shape at an odd width, rows wider than one shared tile (292 + 8 columns), one
    // input channel with a rectangular kernel.
    let thin_before = gpu().map(|_| ptl_autograd::internal::cuda::thin_weight_gradients());
    conv("conv_thin_stem", &[3, 3, 34, 41], &[16, 3, 3, 3], 2, 1, 1, false);
    conv("conv_thin_tiles", &[1, 3, 4, 300], &[32, 3, 3, 3], 1, 1, 1, true);
    conv("conv_thin_one_channel", &[2, 1, 9, 11], &[4, 1, 3, 5], 1, 1, 1, false);
    if let Some(before) = thin_before {
        let ran = ptl_autograd::internal::cuda::thin_weight_gradients() - before;
        // Three shapes, three dtypes, two runs each (the second checks the bytes repeat).
        assert!(ran >= 18, "the thin-input weight gradient ran {ran} times, expected 18");
        println!("ok thin-input weight gradients: {ran} through the own kernel");
    }
}

#[test]
fn batch_norm_pool_matmul() {
    let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
    case("batch_norm_train", FP64, &[(&[3, 8, 7, 6], -2.0, 2.0), (&[8], 0.5, 1.5), (&[8], -0.5, 0.5)], &move |v, d| {
        let rm = Tensor::zeros(vec![8], DType::F32, d)?;
        let rv = Tensor::ones(vec![8], DType::F32, d)?;
        v[0].batch_norm2d(&v[1], &v[2], &rm, &rv, opts)?.silu()
    });
    case("batch_norm_eval", FP64, &[(&[3, 8, 7, 6], -2.0, 2.0), (&[8], 0.5, 1.5), (&[8], -0.5, 0.5)], &move |v, d| {
        let rm = Tensor::full(vec![8], 0.1, DType::F32, d)?;
        let rv = Tensor::full(vec![8], 0.8, DType::F32, d)?;
        v[0].batch_norm2d(&v[1], &v[2], &rm, &rv, BatchNormOptions { training: false, ..opts })
    });
    // Fused BN (+SiLU) on the GPU against the composed CPU ops (forward, backward, running stats).
    // Shapes: HW = 42 (16-byte vectors only for f64; scalar kernels otherwise, one block per
    // channel), HW = 1600 (vectors for every dtype, 25 blocks per channel combined by the last
    // one), and 4 channels × 24,576 values (96 blocks per channel).
    for (training, silu, shape) in [
        (true, true, [3, 8, 7, 6]),
        (false, true, [3, 8, 7, 6]),
        (true, false, [3, 8, 7, 6]),
        (true, true, [4, 16, 40, 40]),
        (false, true, [4, 16, 40, 40]),
        (true, false, [2, 4, 128, 96]),
    ] {
        let o = BatchNormOptions { training, ..opts };
        let c = shape[1];
        case("batch_norm_silu_fused", FP64, &[(&shape, -2.0, 2.0), (&[c], 0.5, 1.5), (&[c], -0.5, 0.5)], &move |v, d| {
            let rm = Tensor::full(vec![c], 0.1, DType::F32, d)?;
            let rv = Tensor::full(vec![c], 0.8, DType::F32, d)?;
            let y = if d == Device::Cpu {
                let y = v[0].batch_norm2d(&v[1], &v[2], &rm, &rv, o)?;
                if silu {
                    y.silu()?
                } else {
                    y
                }
            } else {
                v[0].batch_norm2d_fused(&v[1], &v[2], &rm, &rv, o, silu)?
            };
            // Fold the updated running statistics into the output so they are compared too.
            y.add(&rm.add(&rv)?.to_dtype(y.dtype())?.reshape(vec![1, c, 1, 1])?.detach())
        });
    }
    case("max_pool_k5_s1_p2", FP64, &[(&[2, 3, 13, 11], -3.0, 3.0)], &|v, _| v[0].max_pool2d(5, 1, 2));
    case("max_pool_k2_s2", FP64, &[(&[2, 3, 12, 10], -3.0, 3.0)], &|v, _| v[0].max_pool2d(2, 2, 0));
    case("max_pool_k3_s2_p1", FP64, &[(&[2, 3, 12, 9], -3.0, 3.0)], &|v, _| v[0].max_pool2d(3, 2, 1));
    case("bmm", FP64, &[(&[3, 17, 24], -1.0, 1.0), (&[3, 24, 9], -1.0, 1.0)], &|v, _| v[0].bmm(&v[1]));
    case("matmul_broadcast", FP64, &[(&[2, 5, 7], -1.0, 1.0), (&[7, 6], -1.0, 1.0)], &|v, _| v[0].matmul(&v[1]));
    for (lt, rt) in [(true, false), (false, true), (true, true)] {
        let (ls, rs): (&[usize], &[usize]) = (if lt { &[2, 7, 5] } else { &[2, 5, 7] }, if rt { &[2, 6, 7] } else { &[2, 7, 6] });
        case("matmul_t", FP64, &[(ls, -1.0, 1.0), (rs, -1.0, 1.0)], &move |v, _| v[0].matmul_t(&v[1], lt, rt));
    }
    case("matmul_transposed", FP64, &[(&[2, 7, 5], -1.0, 1.0), (&[2, 6, 7], -1.0, 1.0)], &|v, _| {
        v[0].transpose(1, 2)?.matmul(&v[1].transpose(1, 2)?)
    });
    case("linear", FP64, &[(&[4, 6, 32], -1.0, 1.0), (&[20, 32], -1.0, 1.0), (&[20], -1.0, 1.0)], &|v, _| v[0].linear(&v[1], Some(&v[2])));
    // 2-wide layers over many rows (the RLE flow's first and last): their weight gradients split
    // the long shared dimension into pieces (5 of 512 rows and one of 440 here).
    case("linear_2_to_64_tall", FP64, &[(&[3000, 2], -1.0, 1.0), (&[64, 2], -1.0, 1.0), (&[64], -1.0, 1.0)], &|v, _| {
        v[0].linear(&v[1], Some(&v[2]))
    });
    case("linear_64_to_2_tall", FP64, &[(&[3000, 64], -1.0, 1.0), (&[2, 64], -1.0, 1.0), (&[2], -1.0, 1.0)], &|v, _| {
        v[0].linear(&v[1], Some(&v[2]))
    });
    case("softmax", FP64, &[(&[3, 5, 33], -3.0, 3.0)], &|v, _| v[0].softmax(-1));
    // rows of the attention length (warp-per-row kernel) and longer than 1024 (block-per-row kernel)
    case("softmax_rows400", FP64, &[(&[6, 400], -3.0, 3.0)], &|v, _| v[0].softmax(-1));
    case("softmax_rows1500", FP64, &[(&[3, 1500], -3.0, 3.0)], &|v, _| v[0].softmax(-1));
    case("softmax_dim1", FP64, &[(&[3, 17, 4], -3.0, 3.0)], &|v, _| v[0].softmax(1));
    case("log_softmax", FP64, &[(&[3, 5, 33], -3.0, 3.0)], &|v, _| v[0].log_softmax(2));
    case("bce_with_logits", FP64, &[(&[3, 5, 8], -4.0, 4.0), (&[3, 5, 8], 0.0, 1.0)], &|v, _| v[0].bce_with_logits(&v[1]));
    case("attention", FP64, &[(&[2, 6, 8], -1.0, 1.0), (&[2, 9, 8], -1.0, 1.0), (&[2, 9, 5], -1.0, 1.0)], &|v, _| {
        v[0].matmul(&v[1].transpose(1, 2)?)?.affine(0.5, 0.0)?.softmax(-1)?.matmul(&v[2])
    });
}

/// f32/bf16/f16 GEMMs (matmul with broadcast and transposes, 1×1 convolutions forward and
/// backward, including the weight gradient: one batched GEMM of f32 partials) run through
/// cuBLASLt's cached plans, not the classic cuBLAS call; values are checked by the cases above.
#[test]
fn gemms_use_cublaslt() {
    let Some(dev) = gpu() else { return };
    let (lt0, classic0) = ptl_autograd::internal::cuda::gemm_paths();
    let mut rng = Rng::new(11);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let a = Tensor::rand(vec![2, 7, 5], -1.0, 1.0, dt, dev, &mut rng).unwrap();
        let b = Tensor::rand(vec![6, 7], -1.0, 1.0, dt, dev, &mut rng).unwrap();
        let y1 = a.transpose(1, 2).unwrap().matmul(&b.transpose(0, 1).unwrap()).unwrap();
        let y2 = a.transpose(1, 2).unwrap().matmul(&b.transpose(0, 1).unwrap()).unwrap();
        assert_eq!(y1.to_bytes().unwrap(), y2.to_bytes().unwrap(), "{dt}: matmul repeat differs");
        // 16-byte rows in every dtype: the weight gradient is a GEMM too (unaligned ones at this
        // batch take the own narrow kernel).
        let x = Tensor::rand(vec![2, 8, 4, 4], -1.0, 1.0, dt, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        let w = Tensor::rand(vec![8, 8, 1, 1], -1.0, 1.0, dt, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        x.conv2d(&w, None, (1, 1), (0, 0), 1).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(x.grad().is_some() && w.grad().is_some());
    }
    let (lt1, classic1) = ptl_autograd::internal::cuda::gemm_paths();
    println!("ok gemms: {} through cuBLASLt, {} through classic cuBLAS", lt1 - lt0, classic1 - classic0);
    assert_eq!(classic1 - classic0, 0, "a GEMM fell back to the classic cuBLAS call");
    assert!(lt1 - lt0 >= 3 * (2 + 1 + 1 + 1), "expected every GEMM through cuBLASLt ({} lt)", lt1 - lt0);
}

#[test]
fn absent_gradients_match_cpu() {
    // b does not reach the output: its gradient stays None on both devices.
    case("absent", FP, &[(&[3, 4], -1.0, 1.0), (&[3, 4], -1.0, 1.0)], &|v, _| {
        let _unused = v[1].exp()?;
        v[0].square()
    });
    // A path cut by detach.
    case("detached", FP, &[(&[3, 4], -1.0, 1.0), (&[3, 4], -1.0, 1.0)], &|v, _| v[0].mul(&v[1].detach()));
}

#[test]
fn transfers_and_memory_api() {
    let Some(dev) = gpu() else { return };
    use ptl_autograd::cuda;
    let x = Tensor::from_vec((0..1000).map(|i| i as f32).collect::<Vec<_>>(), vec![10, 100], dev).unwrap();
    let back = x.to_device(Device::Cpu).unwrap();
    assert_eq!(back.device(), Device::Cpu);
    assert_eq!(back.to_vec::<f32>().unwrap()[999], 999.0);
    assert_eq!(x.sum_all().unwrap().item().unwrap(), 499500.0);
    // Pinned u8 upload.
    let mut pb = ptl_autograd::internal::cuda::PinnedBuffer::new(dev, 2 * 3 * 4).unwrap();
    pb.as_mut_slice().unwrap().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8 * 7);
    let img = pb.upload(vec![2, 3, 4]).unwrap();
    assert_eq!(img.dtype(), DType::U8);
    assert_eq!(img.to_vec::<u8>().unwrap(), (0..24).map(|i| i as u8 * 7).collect::<Vec<_>>());
    // Stats: an allocation raises allocated and its peak; reset brings the peak down after free.
    cuda::synchronize(dev).unwrap();
    let s0 = cuda::memory_stats(dev).unwrap();
    let big = Tensor::zeros(vec![64, 1024, 1024], DType::F32, dev).unwrap();
    let s1 = cuda::memory_stats(dev).unwrap();
    assert!(s1.allocated >= s0.allocated + (256 << 20), "{s0:?} -> {s1:?}");
    assert!(s1.peak_allocated >= s1.allocated && s1.reserved >= s1.allocated - s0.allocated);
    drop(big);
    cuda::synchronize(dev).unwrap();
    let s2 = cuda::memory_stats(dev).unwrap();
    assert!(s2.allocated < s1.allocated && s2.peak_allocated >= s1.allocated);
    assert!(s2.reserved >= 256 << 20, "release threshold keeps memory cached: {s2:?}");
    cuda::reset_peak_memory_stats(dev).unwrap();
    let s3 = cuda::memory_stats(dev).unwrap();
    assert_eq!(s3.peak_allocated, s3.allocated);
    // A private pool owns what is allocated while it is entered and releases it as a whole.
    let pool = ptl_autograd::internal::cuda::MemPool::new(dev).unwrap();
    let t = pool.scope(|| Tensor::ones(vec![1 << 20], DType::F32, dev).unwrap());
    let ps = pool.stats().unwrap();
    assert!(ps.allocated >= 4 << 20 && ps.reserved >= 4 << 20, "{ps:?}");
    assert_eq!(t.sum_all().unwrap().item().unwrap(), (1 << 20) as f64);
    drop(t);
    pool.trim().unwrap();
    assert_eq!(pool.stats().unwrap().reserved, 0);
    // A destroyed private pool's high-water mark stays in the device's reserved peak (a fit
    // reads its peaks after the recordings, and their pools, are gone).
    cuda::reset_peak_memory_stats(dev).unwrap();
    let before = cuda::memory_stats(dev).unwrap();
    let pool = ptl_autograd::internal::cuda::MemPool::new(dev).unwrap();
    drop(pool.scope(|| Tensor::ones(vec![16 << 20], DType::F32, dev).unwrap()));
    drop(pool);
    cuda::synchronize(dev).unwrap();
    let after = cuda::memory_stats(dev).unwrap();
    assert!(after.peak_reserved >= before.peak_reserved + (64 << 20), "{before:?} -> {after:?}");
    assert!(after.peak_reserved >= after.peak_allocated, "reserved peak ≥ allocated peak: {after:?}");
    // Errors: a bad ordinal is a typed error, not a panic.
    let e = Tensor::zeros(vec![2], DType::F32, Device::Cuda(99)).unwrap_err();
    assert!(format!("{e}").contains("cuda:99"), "{e}");
    println!("ok transfers, pinned upload, memory stats, pools, {}", cuda::device_name(0).unwrap());
}

/// The host-side block cache: a freed block is handed back to the next request of its size
/// without a driver call (same address), statistics still count only live tensors, private pools
/// and stream captures bypass it, a captured graph replays correctly while eager code allocates
/// around it, and `empty_cache` returns everything to the driver.
#[test]
fn block_cache_reuse_capture_and_empty() {
    let Some(dev) = gpu() else { return };
    use ptl_autograd::{cuda, internal::cuda::capture_support::device_ptr};
    // The cache is off by default; this test turns it on and restores the limits at the end.
    let before = cuda::set_block_cache_limits(dev, 512 << 20, 64 << 20).unwrap();
    cuda::synchronize(dev).unwrap();
    let base = cuda::memory_stats(dev).unwrap().allocated;
    // 3000 f32 = 12000 B: an odd size no other test of this thread leaves cached.
    let a = Tensor::full(vec![3000], 2.0, DType::F32, dev).unwrap();
    let pa = device_ptr(&a).unwrap();
    assert_eq!(cuda::memory_stats(dev).unwrap().allocated, base + 12000);
    drop(a);
    assert_eq!(cuda::memory_stats(dev).unwrap().allocated, base, "a cached block is not counted as allocated");
    let b = Tensor::full(vec![3000], 3.0, DType::F32, dev).unwrap();
    assert_eq!(device_ptr(&b).unwrap(), pa, "the freed block is reused for the same size");
    assert_eq!(b.sum_all().unwrap().item().unwrap(), 9000.0, "the new owner's values, not the old ones");
    // A private pool never takes a cached block.
    drop(b);
    let pool = ptl_autograd::internal::cuda::MemPool::new(dev).unwrap();
    let c = pool.scope(|| Tensor::full(vec![3000], 1.0, DType::F32, dev).unwrap());
    assert_ne!(device_ptr(&c).unwrap(), pa, "private-pool allocation came from the block cache");
    drop(c);
    // Raw stream capture: allocations inside come from the pool (graph-owned), not the cache;
    // replays stay right while eager code reuses cached blocks in between.
    let x = Tensor::full(vec![3000], 1.5, DType::F32, dev).unwrap();
    let out = Tensor::zeros(vec![3000], DType::F32, dev).unwrap();
    let spare = Tensor::zeros(vec![3000], DType::F32, dev).unwrap();
    let ps = device_ptr(&spare).unwrap();
    drop(spare); // now cached
    cuda::synchronize(dev).unwrap();
    ptl_autograd::internal::cuda::begin_capture(dev).unwrap();
    let t = x.mul_scalar(2.0).unwrap();
    assert_ne!(device_ptr(&t).unwrap(), ps, "an allocation inside a capture came from the block cache");
    let y = t.add_scalar(1.0).unwrap();
    drop(t);
    out.copy_(&y).unwrap();
    drop(y);
    let graph = ptl_autograd::internal::cuda::end_capture(dev).unwrap();
    for k in 0..5 {
        let noise = Tensor::full(vec![3000], k as f64, DType::F32, dev).unwrap();
        assert_eq!(device_ptr(&noise).unwrap(), ps, "eager allocations still use the cache after the capture");
        graph.launch().unwrap();
        drop(noise);
        assert_eq!(out.sum_all().unwrap().item().unwrap(), 3000.0 * 4.0, "replay {k}");
    }
    drop((x, out, graph));
    cuda::empty_cache(dev).unwrap();
    let s = cuda::memory_stats(dev).unwrap();
    assert_eq!(s.allocated, base);
    println!("ok block cache: reuse, pools and captures bypass it, replays correct, empty_cache ({} B reserved after)", s.reserved);
    cuda::set_block_cache_limits(dev, before.0, before.1).unwrap();
}

/// Runs everywhere (CPU): the fused BN (+SiLU) matches `batch_norm2d(..)` (`.silu()`) in f64, forward,
/// backward and running statistics.
#[test]
fn fused_bn_silu_matches_composed_on_cpu() {
    for (training, silu) in [(true, true), (false, true), (true, false), (false, false)] {
        let opts = BatchNormOptions { training, momentum: 0.1, eps: 1e-5 };
        let mut rng = Rng::new(9);
        let x = Tensor::rand(vec![3, 4, 5, 6], -2.0, 2.0, DType::F64, Device::Cpu, &mut rng).unwrap();
        let w = Tensor::rand(vec![4], 0.5, 1.5, DType::F64, Device::Cpu, &mut rng).unwrap();
        let b = Tensor::rand(vec![4], -0.5, 0.5, DType::F64, Device::Cpu, &mut rng).unwrap();
        let r = Tensor::rand(vec![3, 4, 5, 6], -1.0, 1.0, DType::F64, Device::Cpu, &mut rng).unwrap();
        let mut res = Vec::new();
        for fused in [false, true] {
            let (xl, wl, bl) = (x.requires_grad_(true).unwrap(), w.requires_grad_(true).unwrap(), b.requires_grad_(true).unwrap());
            let rm = Tensor::full(vec![4], 0.2, DType::F64, Device::Cpu).unwrap();
            let rv = Tensor::full(vec![4], 0.7, DType::F64, Device::Cpu).unwrap();
            let y = if fused {
                xl.batch_norm2d_fused(&wl, &bl, &rm, &rv, opts, silu)
            } else {
                xl.batch_norm2d(&wl, &bl, &rm, &rv, opts).and_then(|t| if silu { t.silu() } else { Ok(t) })
            }
            .unwrap();
            y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            let v: Vec<Vec<f64>> =
                [y, xl.grad().unwrap(), wl.grad().unwrap(), bl.grad().unwrap(), rm, rv].iter().map(|t| t.to_f64_vec().unwrap()).collect();
            res.push(v);
        }
        for (k, (a, b)) in res[0].iter().zip(&res[1]).enumerate() {
            let e = rel(b, a);
            assert!(e < 1e-12, "training={training} silu={silu} item {k}: rel err {e:e}");
        }
    }
}

/// The fused BN counts training batches in `num_batches_tracked` inside its statistics kernel
/// (CPU, and CUDA when present), leaves it alone in eval mode, and rejects a counter that is not
/// one i64.
#[test]
fn fused_bn_counts_batches() {
    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu()).collect();
    for dev in devices {
        let mut rng = Rng::new(5);
        let x = Tensor::rand(vec![2, 8, 4, 4], -1.0, 1.0, DType::F32, dev, &mut rng).unwrap();
        let (w, b) = (Tensor::ones(vec![8], DType::F32, dev).unwrap(), Tensor::zeros(vec![8], DType::F32, dev).unwrap());
        let (rm, rv) = (Tensor::zeros(vec![8], DType::F32, dev).unwrap(), Tensor::ones(vec![8], DType::F32, dev).unwrap());
        let nbt = Tensor::zeros((), DType::I64, dev).unwrap();
        let train = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
        for _ in 0..3 {
            x.batch_norm2d_fused_tracked(&w, &b, &rm, &rv, Some(&nbt), train, true).unwrap();
        }
        x.batch_norm2d_fused_tracked(&w, &b, &rm, &rv, Some(&nbt), BatchNormOptions { training: false, ..train }, true).unwrap();
        assert_eq!(nbt.to_vec::<i64>().unwrap(), vec![3], "{dev}: three training batches counted");
        let wrong = Tensor::zeros(vec![2], DType::I64, dev).unwrap();
        let err = x.batch_norm2d_fused_tracked(&w, &b, &rm, &rv, Some(&wrong), train, true).unwrap_err().to_string();
        assert!(err.contains("num_batches_tracked"), "{dev}: {err}");
    }
}

/// A large `index_add` (the gradient of `index_select`, as the loss takes it) runs sorted — up to
/// 4,096 indices sorted in one block, then summed: two launches — or by buckets — count, scan,
/// fill, sort, sum — instead of scanning every index per output element: the same bytes (each
/// target's rows summed in ascending order every way), with repeated targets, untouched targets,
/// and a target hit by many rows; f32, bf16 and f64.
#[test]
fn index_add_sorted_and_by_buckets_match_the_full_scan() {
    let Some(dev) = gpu() else { return };
    // Sorted: 500 indices (not a power of two), 3,000 and exactly 4,096; by buckets: 3 blocks of
    // counts, and 40 (the scan by blocks: 40,000 targets as in the loss's gathers).
    for (outer, d, inner, n) in
        [(2usize, 3000usize, 17usize, 500usize), (1, 40_000, 2, 3000), (1, 40_000, 3, 4096), (1, 3000, 5, 6000), (1, 40_000, 2, 9000)]
    {
        index_add_cases(dev, outer, d, inner, n);
    }
    println!("ok index_add sorted and by buckets: f32, bf16, f64 byte-identical to the full scan");
}

fn index_add_cases(dev: Device, outer: usize, d: usize, inner: usize, n: usize) {
    let mut rng = Rng::new(17);
    let mut idx: Vec<i64> = (0..n).map(|r| ((r * 7919) % (d * 2 / 5)) as i64).collect();
    idx[10..60].iter_mut().for_each(|v| *v = 42); // one target hit by 50 rows
    let idx = Tensor::from_vec(idx, n, dev).unwrap();
    for dt in [DType::F32, DType::BF16, DType::F64] {
        let x0 = Tensor::rand(vec![outer, d, inner], -1.0, 1.0, dt, dev, &mut rng).unwrap();
        let r = Tensor::rand(vec![outer, n, inner], -1.0, 1.0, dt, dev, &mut rng).unwrap();
        let grad = |buckets: bool| -> Vec<u8> {
            ptl_autograd::cuda::set_device_options(
                dev,
                ptl_autograd::cuda::DeviceOptions { index_add_by_buckets: buckets, ..Default::default() },
            )
            .unwrap();
            let x = x0.detach().requires_grad_(true).unwrap();
            x.index_select(1, &idx).unwrap().mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            x.grad().expect("gradient").to_bytes().unwrap()
        };
        let (a, b) = (grad(true), grad(false));
        ptl_autograd::cuda::set_device_options(dev, ptl_autograd::cuda::DeviceOptions { index_add_by_buckets: true, ..Default::default() })
            .unwrap();
        assert!(a == b, "{dt}: index_add by buckets differs from the full scan (d = {d})");
    }
}

/// A batch-norm layer whose channels fit one block (≤ 4096 values), or 2–8 blocks as one
/// thread-block cluster per channel (sm_90 and later), runs its forward and its backward as one
/// launch each; their bytes equal the two-launch path's — output, input, weight and bias
/// gradients, running statistics and batch counter — for scalar (HW = 42, 4900) and
/// 16-byte-vector (HW = 400, 1600, 6400) shapes, training and eval, with and without SiLU, in
/// f32/bf16/f16; a layer of more than 8 blocks per channel stays two launches.
#[test]
fn bn_one_launch_matches_two_launches() {
    let Some(dev) = gpu() else { return };
    let run = |one: bool, dt: DType, shape: [usize; 4], training: bool, silu: bool| -> Vec<Vec<u8>> {
        ptl_autograd::cuda::set_device_options(dev, ptl_autograd::cuda::DeviceOptions { bn_one_launch: one, ..Default::default() })
            .unwrap();
        let mut rng = Rng::new(21);
        let c = shape[1];
        let x = Tensor::rand(shape.to_vec(), -2.0, 2.0, dt, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        let w = Tensor::rand(vec![c], 0.5, 1.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        let b = Tensor::rand(vec![c], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        let rm = Tensor::full(vec![c], 0.1, DType::F32, dev).unwrap();
        let rv = Tensor::full(vec![c], 0.8, DType::F32, dev).unwrap();
        let nbt = Tensor::zeros((), DType::I64, dev).unwrap();
        let opts = BatchNormOptions { training, momentum: 0.03, eps: 1e-3 };
        let y = x.batch_norm2d_fused_tracked(&w, &b, &rm, &rv, Some(&nbt), opts, silu).unwrap();
        let r = Tensor::rand(shape.to_vec(), -1.0, 1.0, dt, dev, &mut rng).unwrap();
        y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        let grads = [x.grad(), w.grad(), b.grad()].map(|g| g.expect("every input receives a gradient"));
        [&y, &grads[0], &grads[1], &grads[2], &rm, &rv, &nbt].iter().map(|t| t.to_bytes().unwrap()).collect()
    };
    let mut cases = 0;
    let clusters_before = ptl_autograd::internal::cuda::bn_cluster_launches();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        // Blocks per channel: 1, 1, 2, 3 (scalar loads), 7, 25.
        for shape in [[3, 8, 7, 6], [4, 32, 20, 20], [4, 64, 40, 40], [2, 8, 70, 70], [4, 16, 80, 80], [4, 8, 160, 160]] {
            for (training, silu) in [(true, true), (true, false), (false, true)] {
                let (one, two) = (run(true, dt, shape, training, silu), run(false, dt, shape, training, silu));
                for (k, (a, b)) in one.iter().zip(&two).enumerate() {
                    assert!(a == b, "{dt} {shape:?} training={training} silu={silu}: output #{k} differs between one and two launches");
                }
                cases += 1;
            }
        }
    }
    ptl_autograd::cuda::set_device_options(dev, ptl_autograd::cuda::DeviceOptions { bn_one_launch: true, ..Default::default() }).unwrap();
    let clusters = ptl_autograd::internal::cuda::bn_cluster_launches() - clusters_before;
    println!("ok bn one launch: {cases} cases byte-identical to two launches ({clusters} cluster launches)");
    if ptl_autograd::cuda::has_clusters(dev) {
        // Three cluster shapes × three dtypes × three modes: a forward each in training, a backward each.
        assert_eq!(clusters, 3 * 3 * (2 * 2 + 1), "every layer of 2–8 blocks per channel should have run as clusters");
    } else {
        println!("NOTE: {dev} has no thread-block clusters; the cluster form was not run");
    }
}

/// A block's shortcut added inside the batch norm's kernels (`batch_norm2d_fused_add`) gives the
/// bytes of the addition after it (`residual.add(batch_norm2d_fused(x))`): output, the input,
/// weight, bias and residual gradients, running statistics and batch counter — one-block, cluster
/// and two-launch forms (blocks per channel 1, 2, 25), scalar and vector shapes, with and without
/// SiLU, f32/bf16/f16; and the output read by two consumers (the residual takes the sum).
#[test]
fn bn_adds_a_residual_itself() {
    let Some(dev) = gpu() else { return };
    let run = |fused: bool, dt: DType, shape: [usize; 4], silu: bool, two_readers: bool| -> Vec<Vec<u8>> {
        let mut rng = Rng::new(29);
        let c = shape[1];
        let x = Tensor::rand(shape.to_vec(), -2.0, 2.0, dt, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        let res = Tensor::rand(shape.to_vec(), -1.0, 1.0, dt, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        let w = Tensor::rand(vec![c], 0.5, 1.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        let b = Tensor::rand(vec![c], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
        let rm = Tensor::full(vec![c], 0.1, DType::F32, dev).unwrap();
        let rv = Tensor::full(vec![c], 0.8, DType::F32, dev).unwrap();
        let nbt = Tensor::zeros((), DType::I64, dev).unwrap();
        let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
        // The residual also feeds something else, as a block's input does.
        let res_in = res.mul_scalar(1.0).unwrap();
        let y = match fused {
            true => x.batch_norm2d_fused_add(&w, &b, &rm, &rv, Some(&nbt), opts, silu, &res_in).unwrap(),
            false => res_in.add(&x.batch_norm2d_fused_tracked(&w, &b, &rm, &rv, Some(&nbt), opts, silu).unwrap()).unwrap(),
        };
        let r = Tensor::rand(shape.to_vec(), -1.0, 1.0, dt, dev, &mut rng).unwrap();
        let mut loss = y.mul(&r).unwrap().sum_all().unwrap();
        if two_readers {
            loss = loss.add(&y.square().unwrap().sum_all().unwrap()).unwrap();
        }
        loss.backward().unwrap();
        let grads = [x.grad(), w.grad(), b.grad(), res.grad()].map(|g| g.expect("every input receives a gradient"));
        [&y, &grads[0], &grads[1], &grads[2], &grads[3], &rm, &rv, &nbt].iter().map(|t| t.to_bytes().unwrap()).collect()
    };
    let mut cases = 0;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for shape in [[3, 8, 7, 6], [4, 32, 20, 20], [4, 64, 40, 40], [4, 8, 160, 160]] {
            for (silu, two_readers) in [(true, false), (false, false), (true, true)] {
                let (fused, composed) = (run(true, dt, shape, silu, two_readers), run(false, dt, shape, silu, two_readers));
                for (k, (a, b)) in fused.iter().zip(&composed).enumerate() {
                    assert!(a == b, "{dt} {shape:?} silu={silu} two readers={two_readers}: output #{k} differs from the addition after it");
                }
                cases += 1;
            }
        }
    }
    println!("ok bn residual: {cases} cases byte-identical to the addition after the batch norm");
}

/// A batch norm whose output two consumers read gets its gradient as the two contributions and
/// adds them inside its kernels: the bytes equal those of the backward from the sum (added as
/// the engine adds contributions: the later consumer's first) — input, weight and bias gradients —
/// in the one-block, cluster and two-launch forms, scalar and vector shapes, f32/bf16/f16, and
/// with channels-last storage (added before the kernels).
#[test]
fn bn_adds_two_gradient_contributions_itself() {
    use ptl_autograd::MemoryFormat;
    let Some(dev) = gpu() else { return };
    let mut cases = 0;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for shape in [[3, 8, 7, 6], [4, 32, 20, 20], [4, 64, 40, 40], [4, 8, 160, 160]] {
            for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
                let mut rng = Rng::new(23);
                let c = shape[1];
                let x0 = Tensor::rand(shape.to_vec(), -2.0, 2.0, dt, dev, &mut rng).unwrap();
                let w0 = Tensor::rand(vec![c], 0.5, 1.5, DType::F32, dev, &mut rng).unwrap();
                let b0 = Tensor::rand(vec![c], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap();
                let (r1, r2) = (
                    Tensor::rand(shape.to_vec(), -1.0, 1.0, dt, dev, &mut rng).unwrap(),
                    Tensor::rand(shape.to_vec(), -1.0, 1.0, dt, dev, &mut rng).unwrap(),
                );
                // `two`: y read by y·r1 and then y·r2; else the backward from r2 + r1.
                let run = |two: bool| -> Vec<Vec<u8>> {
                    let x = x0.detach().to_memory_format(format).unwrap().requires_grad_(true).unwrap();
                    let (w, b) = (w0.detach().requires_grad_(true).unwrap(), b0.detach().requires_grad_(true).unwrap());
                    let (rm, rv) =
                        (Tensor::full(vec![c], 0.1, DType::F32, dev).unwrap(), Tensor::full(vec![c], 0.8, DType::F32, dev).unwrap());
                    let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
                    let y = x.batch_norm2d_silu(&w, &b, &rm, &rv, opts).unwrap();
                    let (r1, r2) = (r1.to_memory_format(format).unwrap(), r2.to_memory_format(format).unwrap());
                    if two {
                        y.mul(&r1).unwrap().sum_all().unwrap().add(&y.mul(&r2).unwrap().sum_all().unwrap()).unwrap().backward().unwrap();
                    } else {
                        y.backward_with(&r2.add(&r1).unwrap()).unwrap();
                    }
                    [x.grad(), w.grad(), b.grad()].map(|g| g.expect("every input receives a gradient").to_bytes().unwrap()).to_vec()
                };
                let (fused, summed) = (run(true), run(false));
                for (k, what) in ["input", "weight", "bias"].iter().enumerate() {
                    assert!(fused[k] == summed[k], "{dt} {shape:?} {format:?}: {what} gradient differs from the backward of the sum");
                }
                cases += 1;
            }
        }
    }
    println!("ok bn two contributions: {cases} cases byte-identical to adding first");
}

/// A split whose pieces' gradients arrive as two contributions (a C2f/C3k2 chunk read by the
/// concatenation and by the next block), one, or none has the two added inside the
/// concatenation's one pass: the input gradient's bytes equal those of adding first and
/// concatenating after (the backward of the summed gradients), in f32, bf16 and f16, along C of
/// NCHW and along the last dimension.
#[test]
fn split_adds_two_gradient_contributions_itself() {
    let Some(dev) = gpu() else { return };
    let mut cases = 0;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (shape, dim, sizes) in
            [(vec![4, 64, 20, 20], 1, vec![32, 32]), (vec![2, 48, 9, 7], 1, vec![16, 16, 16]), (vec![3, 5, 30], 2, vec![10, 20])]
        {
            let mut rng = Rng::new(41);
            let x0 = Tensor::rand(shape.clone(), -2.0, 2.0, dt, dev, &mut rng).unwrap();
            let weights: Vec<(Tensor, Tensor)> = sizes
                .iter()
                .map(|&l| {
                    let mut s = shape.clone();
                    s[dim] = l;
                    (Tensor::rand(s.clone(), -1.0, 1.0, dt, dev, &mut rng).unwrap(), Tensor::rand(s, -1.0, 1.0, dt, dev, &mut rng).unwrap())
                })
                .collect();
            // Piece 0 is read twice (r1 then r2), piece 1 once, a third piece (if any) not at all.
            let run = |two: bool| -> Vec<u8> {
                let x = x0.detach().requires_grad_(true).unwrap();
                let pieces = x.split(&sizes, dim as isize).unwrap();
                let (r1, r2) = &weights[0];
                let first = pieces[0].mul(r1).unwrap().sum_all().unwrap();
                let once = pieces[1].mul(&weights[1].0).unwrap().sum_all().unwrap();
                if two {
                    first.add(&once).unwrap().add(&pieces[0].mul(r2).unwrap().sum_all().unwrap()).unwrap().backward().unwrap();
                } else {
                    let g0 = r2.add(r1).unwrap();
                    let mut grads: Vec<Tensor> = vec![g0, weights[1].0.clone()];
                    for &l in &sizes[2..] {
                        let mut s = shape.clone();
                        s[dim] = l;
                        grads.push(Tensor::zeros(s, dt, dev).unwrap());
                    }
                    let refs: Vec<&Tensor> = grads.iter().collect();
                    x.backward_with(&Tensor::cat(&refs, dim as isize).unwrap()).unwrap();
                }
                x.grad().expect("the input receives a gradient").to_bytes().unwrap()
            };
            assert!(run(true) == run(false), "{dt} {shape:?} split along {dim}: the gradient differs from adding first");
            cases += 1;
        }
    }
    println!("ok split two contributions: {cases} cases byte-identical to adding first");
}

/// The graph-safe Philox keep mask and dropout: identical bytes on CPU and CUDA for the same
/// generator state (sizes not a multiple of 4 included), same offsets, and the dropout gradient.
#[test]
fn philox_dropout_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let (cpu_rng, gpu_rng) = (ptl_autograd::GraphSafeRng::new(9, Device::Cpu).unwrap(), ptl_autograd::GraphSafeRng::new(9, dev).unwrap());
    for (n, keep) in [(1usize, 0.5), (3, 0.9), (4099, 0.5), (1 << 20, 0.125)] {
        let a = Tensor::keep_mask([n], keep, &cpu_rng).unwrap().to_vec::<u8>().unwrap();
        let b = Tensor::keep_mask([n], keep, &gpu_rng).unwrap().to_vec::<u8>().unwrap();
        assert_eq!(a, b, "keep mask n={n} keep={keep}");
        assert_eq!(cpu_rng.offset(), gpu_rng.offset());
    }
    let xc = Tensor::rand(vec![33, 65], -1.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap().requires_grad_(true).unwrap();
    let xg = xc.detach().to_device(dev).unwrap().requires_grad_(true).unwrap();
    let (yc, yg) = (xc.dropout(0.3, &cpu_rng).unwrap(), xg.dropout(0.3, &gpu_rng).unwrap());
    yc.sum_all().unwrap().backward().unwrap();
    yg.sum_all().unwrap().backward().unwrap();
    assert_eq!(yc.to_vec::<f32>().unwrap(), yg.to_vec::<f32>().unwrap(), "dropout output");
    assert_eq!(xc.grad().unwrap().to_vec::<f32>().unwrap(), xg.grad().unwrap().to_vec::<f32>().unwrap(), "dropout gradient");
    println!("ok philox keep mask / dropout: CPU and CUDA bytes identical");
}

/// f32/bf16/f16 convolutions — forward, backward-data and backward-filter — go through cuDNN's
/// graph API (built plans, a few µs of host time per call), not the legacy fallback, at the model's
/// 3×3 shapes (stride 1 and 2, depthwise): results match the CPU within the dtype's tolerance
/// (f32 ≤ 1e-5: no TF32 engine slipped in) and repeat bit for bit.
#[test]
fn convs_use_the_graph_api() {
    let Some(dev) = gpu() else { return };
    let (g0, l0) = ptl_autograd::internal::cuda::conv_paths();
    let nhwc0 = ptl_autograd::internal::cuda::channels_last_output_gradient_reads();
    let input0 = ptl_autograd::internal::cuda::channels_last_input_reads();
    let mut rng = Rng::new(5);
    let cases: [(&[usize], &[usize], usize, usize); 3] =
        [(&[2, 64, 40, 40], &[64, 64, 3, 3], 1, 1), (&[2, 32, 40, 40], &[64, 32, 3, 3], 2, 1), (&[2, 64, 20, 20], &[64, 1, 3, 3], 1, 64)];
    // Forward and both gradients of Σ R·conv(x, w) on `device`, as f64 values and raw bytes.
    let grads = |x: &Tensor, w: &Tensor, r: &Tensor, stride: usize, groups: usize, device: Device| {
        let (x, w, r) = (x.to_device(device).unwrap(), w.to_device(device).unwrap(), r.to_device(device).unwrap());
        let (x, w) = (x.requires_grad_(true).unwrap(), w.requires_grad_(true).unwrap());
        let y = x.conv2d(&w, None, (stride, stride), (1, 1), groups).unwrap();
        y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        [y, x.grad().unwrap(), w.grad().unwrap()].map(|t| (t.to_dtype(DType::F64).unwrap().to_f64_vec().unwrap(), t.to_bytes().unwrap()))
    };
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (xs, ws, stride, groups) in cases {
            let x = Tensor::rand(xs.to_vec(), -1.0, 1.0, dt, Device::Cpu, &mut rng).unwrap();
            let w = Tensor::rand(ws.to_vec(), -0.2, 0.2, dt, Device::Cpu, &mut rng).unwrap();
            let [n, c, h, wd] = [xs[0], ws[0], (xs[2] - 1) / stride + 1, (xs[3] - 1) / stride + 1];
            let r = Tensor::rand(vec![n, c, h, wd], -1.0, 1.0, dt, Device::Cpu, &mut rng).unwrap();
            let f64_of = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            let want = grads(&f64_of(&x), &f64_of(&w), &f64_of(&r), stride, groups, Device::Cpu);
            let got = grads(&x, &w, &r, stride, groups, dev);
            let again = grads(&x, &w, &r, stride, groups, dev);
            for (k, what) in ["output", "input gradient", "weight gradient"].iter().enumerate() {
                assert_eq!(got[k].1, again[k].1, "{dt} {xs:?} w {ws:?}: {what} differs on repeat");
                let e = rel(&got[k].0, &want[k].0);
                assert!(e <= tol(dt), "{dt} {xs:?} w {ws:?}: {what} rel {e:.2e}");
            }
        }
    }
    let (g1, l1) = ptl_autograd::internal::cuda::conv_paths();
    println!("ok convs: {} through the cuDNN graph API, {} through the legacy fallback", g1 - g0, l1 - l0);
    assert_eq!(l1 - l0, 0, "a convolution fell back to the legacy API ({} graph)", g1 - g0);
    assert_eq!(g1 - g0, 3 * 3 * 3 * 2, "expected every convolution through the graph API");
    // The two ungrouped shapes' output gradients are converted to N, H, W, C once and read as
    // they lie by both gradients (three dtypes, two runs); the depthwise one keeps cuDNN's planar
    // kernels.
    let nhwc = ptl_autograd::internal::cuda::channels_last_output_gradient_reads() - nhwc0;
    assert_eq!(nhwc, 2 * 2 * 3 * 2, "gradients reading a channels-last output gradient");
    // Their inputs are converted once too, in the forward call, which reads the copy as it lies,
    // and the weight gradient reads the same copy.
    let input = ptl_autograd::internal::cuda::channels_last_input_reads() - input0;
    assert_eq!(input, 2 * 2 * 3 * 2, "forward calls and weight gradients reading a channels-last input");
}

/// Layout conversions (N, C, H, W ↔ N, H, W, C, the tiled batched transposes of `copy_strided`)
/// are exact copies: the bytes of the CPU's permutation, in 2-, 4- and 8-byte types, at shapes
/// with partial tiles, one image and more than one, and back again.
#[test]
fn layout_conversions_are_exact_copies() {
    use ptl_autograd::MemoryFormat;
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(11);
    for dt in [DType::BF16, DType::F16, DType::F32, DType::F64] {
        for dims in [[1usize, 3, 5, 7], [2, 40, 33, 35], [3, 85, 20, 20], [4, 32, 64, 64], [1, 1, 9, 9]] {
            let cpu = Tensor::rand(dims.to_vec(), -1.0, 1.0, dt, Device::Cpu, &mut rng).unwrap();
            let x = cpu.to_device(dev).unwrap();
            let cl = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
            let raw = cl.with_storage(|s| s.to_cpu().unwrap().as_bytes().to_vec());
            assert_eq!(raw, cpu.permute(&[0, 2, 3, 1]).unwrap().to_bytes().unwrap(), "{dt} {dims:?}: stored as (N, H, W, C)");
            let back = cl.to_memory_format(MemoryFormat::Contiguous).unwrap();
            assert_eq!(back.to_bytes().unwrap(), cpu.to_bytes().unwrap(), "{dt} {dims:?}: back to (N, C, H, W)");
        }
    }
    println!("ok layout conversions on {dev}: exact in bf16, f16, f32 and f64");
}

/// Gradient accumulation into existing `.grad`s runs batched (one multi-tensor launch per dtype
/// and 40 tensors on CUDA): 45 leaves (two launches' worth) of sizes around the 2048-element
/// chunk, f32 and bf16, a leaf read three times in one backward (three rounds), and one gradient
/// tensor shared by two leaves (`a + b`). Values are small integers, so every sum is exact and the
/// second backward must leave exactly twice the first one's gradients.
#[test]
fn batched_gradient_accumulation_matches_one_add_each() {
    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu()).collect();
    for dev in devices {
        for dt in [DType::F32, DType::BF16] {
            let mut rng = Rng::new(21);
            let mut ints = |n: usize| -> Tensor {
                let v: Vec<f64> = values(&[n], -4.0, 4.0, DType::F64, &mut rng).iter().map(|x| x.round()).collect();
                Tensor::from_f64(&v, vec![n], dt, dev).unwrap()
            };
            let mut sizes: Vec<usize> = (0..45).map(|k| [1usize, 7, 2048, 2049, 5000][k % 5] + k).collect();
            sizes[10] = sizes[5];
            let leaves: Vec<Tensor> = sizes.iter().map(|&n| ints(n).requires_grad_(true).unwrap()).collect();
            let weights: Vec<Tensor> = sizes.iter().map(|&n| ints(n)).collect();
            // Σ_k w_k·x_k + Σ (x_0·x_0)·w_0 (x_0 read three times) + Σ (x_5 + x_10) (one shared gradient).
            let loss = |leaves: &[Tensor]| -> Tensor {
                let mut total = leaves[0].mul(&leaves[0]).unwrap().mul(&weights[0]).unwrap().sum_all().unwrap();
                for (x, w) in leaves.iter().zip(&weights) {
                    total = total.add(&x.mul(w).unwrap().sum_all().unwrap()).unwrap();
                }
                total.add(&leaves[5].add(&leaves[10]).unwrap().sum_all().unwrap()).unwrap()
            };
            loss(&leaves).backward().unwrap();
            let first: Vec<Tensor> = leaves.iter().map(|l| l.grad().unwrap().deep_copy().unwrap()).collect();
            assert_eq!(
                first[5].to_f64_vec().unwrap(),
                weights[5].add(&Tensor::ones(vec![sizes[5]], dt, dev).unwrap()).unwrap().to_f64_vec().unwrap()
            );
            loss(&leaves).backward().unwrap();
            for (k, l) in leaves.iter().enumerate() {
                let want = first[k].add(&first[k]).unwrap();
                assert_eq!(l.grad().unwrap().to_bytes().unwrap(), want.to_bytes().unwrap(), "{dev} {dt}: leaf {k} (size {})", sizes[k]);
            }
        }
    }
}

/// `autocast_with_weights` (the weight copies of a forward made once, in one batched cast and one
/// autograd node) gives the bytes of plain `autocast` — output and every gradient, bf16 and f16,
/// with a weight used twice and one not listed — on the CPU and on CUDA.
#[test]
fn batched_weight_casts_match_autocast() {
    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu()).collect();
    for dev in devices {
        for dt in [DType::BF16, DType::F16] {
            let mut rng = Rng::new(33);
            let x = Tensor::rand(vec![2, 4, 9, 9], -1.0, 1.0, DType::F32, dev, &mut rng).unwrap();
            let w1 = Tensor::rand(vec![8, 4, 3, 3], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
            let w2 = Tensor::rand(vec![8, 8, 1, 1], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
            let b2 = Tensor::rand(vec![8], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
            let run = |batched: bool| -> Vec<Vec<u8>> {
                for t in [&w1, &w2, &b2] {
                    t.zero_grad();
                }
                let f = || -> Tensor {
                    let h = x.conv2d(&w1, None, (1, 1), (1, 1), 1).unwrap();
                    let h = h.conv2d(&w2, Some(&b2), (1, 1), (0, 0), 1).unwrap();
                    h.conv2d(&w2, None, (1, 1), (0, 0), 1).unwrap()
                };
                let y = if batched {
                    ptl_autograd::autocast_with_weights(Some(dt), &[w1.clone(), w2.clone()], f).unwrap()
                } else {
                    ptl_autograd::autocast(Some(dt), f)
                };
                y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
                let mut v = vec![y.to_bytes().unwrap()];
                v.extend([&w1, &w2, &b2].iter().map(|t| t.grad().expect("gradient").to_bytes().unwrap()));
                v
            };
            assert_eq!(run(true), run(false), "{dev} {dt}: batched weight casts changed a result");
        }
    }
}

/// Inside `autocast_with_weights` a listed weight's first cast is the up-front copy (made by the
/// batched node), a second cast of it is a fresh one, and an unlisted tensor is cast at use.
#[test]
fn weight_copies_are_handed_out_once() {
    let mut rng = Rng::new(3);
    let w = Tensor::rand(vec![4, 3], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let other = Tensor::rand(vec![3], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let names = ptl_autograd::autocast_with_weights(Some(DType::BF16), std::slice::from_ref(&w), || {
        [
            ptl_autograd::cast_weight(&w, DType::BF16),
            ptl_autograd::cast_weight(&w, DType::BF16),
            ptl_autograd::cast_weight(&other, DType::BF16),
        ]
        .map(|t| t.unwrap().grad_fn_name())
    })
    .unwrap();
    assert_eq!(names, [Some("to_dtype_many".to_string()), Some("to_dtype".to_string()), Some("to_dtype".to_string())]);
    // Outside the scope nothing is cached.
    assert_eq!(ptl_autograd::cast_weight(&w, DType::BF16).unwrap().grad_fn_name().as_deref(), Some("to_dtype"));
}

/// In-place adds (the output is the first operand) through the vector and the scalar kernel give
/// the CPU's values.
#[test]
fn in_place_add_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for n in [4096usize, 4099] {
            let mut rng = Rng::new(n as u64);
            let (a, b) = (values(&[n], -2.0, 2.0, dt, &mut rng), values(&[n], -2.0, 2.0, dt, &mut rng));
            let on = |d: Device| {
                let x = Tensor::from_f64(&a, vec![n], dt, d).unwrap();
                x.add_(&Tensor::from_f64(&b, vec![n], dt, d).unwrap()).unwrap();
                x.to_f64_vec().unwrap()
            };
            assert_eq!(on(dev), on(Device::Cpu), "{dt} n={n}");
        }
    }
}

/// The fused multi-tensor SGD step leaves every parameter and momentum buffer with the bytes of
/// the composed tensor ops, on CUDA (45 f32 parameters around the 2048-element chunk, Nesterov or
/// not, with and without weight decay, with and without a buffer, three steps); on the CPU it is
/// the composed ops.
#[test]
fn fused_sgd_matches_the_composed_step() {
    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu()).collect();
    for dev in devices {
        for (nesterov, wd, with_buf) in [(true, 5e-4, true), (false, 5e-4, true), (true, 0.0, true), (false, 5e-4, false)] {
            let h = ptl_autograd::SgdStep { weight_decay: wd, momentum: 0.937, neg_lr: -(0.01 * 1.0), nesterov };
            let mut rng = Rng::new(8);
            let sizes: Vec<usize> = (0..45).map(|k| [1usize, 9, 2048, 2049, 4000][k % 5] + k).collect();
            let make = |rng: &mut Rng| -> Vec<Tensor> {
                sizes.iter().map(|&n| Tensor::rand(vec![n], -1.0, 1.0, DType::F32, dev, rng).unwrap()).collect()
            };
            let (p0, b0) = (make(&mut rng), make(&mut rng));
            let grads: Vec<Vec<Tensor>> = (0..3).map(|_| make(&mut rng)).collect();
            let run = |fused: bool| -> Vec<Vec<u8>> {
                let ps: Vec<Tensor> = p0.iter().map(|t| t.deep_copy().unwrap()).collect();
                let bs: Vec<Tensor> = b0.iter().map(|t| t.deep_copy().unwrap()).collect();
                for gs in &grads {
                    let items: Vec<(&Tensor, &Tensor, Option<&Tensor>)> =
                        ps.iter().zip(gs).zip(&bs).map(|((p, g), b)| (p, g, with_buf.then_some(b))).collect();
                    if fused {
                        Tensor::sgd_step_many(&items, h).unwrap();
                    } else {
                        for (p, g, b) in items {
                            Tensor::sgd_step_composed(p, g, b, h).unwrap();
                        }
                    }
                }
                ps.iter().chain(&bs).map(|t| t.to_bytes().unwrap()).collect()
            };
            assert_eq!(run(true), run(false), "{dev} nesterov={nesterov} wd={wd} buffer={with_buf}");
        }
    }
}

/// The `*_dev` optimizer ops read their scalars from a device f64 vector written before each step
/// (`write_f64`): the same bytes as the host-scalar forms, with the values changing every step
/// (a schedule) — SGD (decay on/off, Nesterov or not, with and without buffers), the momentum
/// blend (β on both sides of lerp's 0.5 branch) and the EMA lerp; 45 f32 tensors, on the CPU and,
/// when present, CUDA. Malformed scalar vectors are typed errors.
#[test]
fn device_scalar_optimizer_ops_match_the_host_scalar_ones() {
    use ptl_autograd::DeviceScalars;
    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu()).collect();
    for dev in devices {
        let mut rng = Rng::new(31);
        let sizes: Vec<usize> = (0..45).map(|k| [1usize, 9, 2048, 2049, 4000][k % 5] + k).collect();
        let make = |rng: &mut Rng| -> Vec<Tensor> {
            sizes.iter().map(|&n| Tensor::rand(vec![n], -1.0, 1.0, DType::F32, dev, rng).unwrap()).collect()
        };
        let (p0, b0) = (make(&mut rng), make(&mut rng));
        let grads: Vec<Vec<Tensor>> = (0..3).map(|_| make(&mut rng)).collect();
        let copies = |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(|t| t.deep_copy().unwrap()).collect() };
        let bytes = |ts: &[Tensor]| -> Vec<Vec<u8>> { ts.iter().map(|t| t.to_bytes().unwrap()).collect() };
        let hp = Tensor::zeros(vec![8], DType::F64, dev).unwrap();
        let at = |k: usize| DeviceScalars::new(&hp, k);
        // SGD: [wd, μ, −lr] at 2.., a different lr each step.
        for (nesterov, wd, with_buf) in [(true, 5e-4, true), (false, 5e-4, true), (true, 0.0, true), (false, 5e-4, false)] {
            let (pa, ba, pb, bb) = (copies(&p0), copies(&b0), copies(&p0), copies(&b0));
            for (step, gs) in grads.iter().enumerate() {
                let h = ptl_autograd::SgdStep { weight_decay: wd, momentum: 0.937, neg_lr: -(0.01 / (step + 1) as f64), nesterov };
                hp.write_f64(2, &[h.weight_decay, h.momentum, h.neg_lr]).unwrap();
                let ta: Vec<(&Tensor, &Tensor, Option<&Tensor>)> =
                    pa.iter().zip(gs).zip(&ba).map(|((p, g), b)| (p, g, with_buf.then_some(b))).collect();
                let tb: Vec<(&Tensor, &Tensor, Option<&Tensor>)> =
                    pb.iter().zip(gs).zip(&bb).map(|((p, g), b)| (p, g, with_buf.then_some(b))).collect();
                Tensor::sgd_step_many(&ta, h).unwrap();
                Tensor::sgd_step_many_dev(&tb, at(2), wd != 0.0, nesterov).unwrap();
            }
            assert_eq!((bytes(&pa), bytes(&ba)), (bytes(&pb), bytes(&bb)), "{dev} sgd nesterov={nesterov} wd={wd} buffer={with_buf}");
        }
        // Momentum blend: β at 5, a different β each step (0.3 and 0.7 take lerp's two branches).
        for nesterov in [true, false] {
            let (ma, mb) = (copies(&b0), copies(&b0));
            for (gs, beta) in grads.iter().zip([0.937, 0.3, 0.7]) {
                hp.write_f64(5, &[beta]).unwrap();
                let pa: Vec<(&Tensor, &Tensor)> = gs.iter().zip(&ma).collect();
                let pb: Vec<(&Tensor, &Tensor)> = gs.iter().zip(&mb).collect();
                let ua = Tensor::momentum_blend_many(&pa, beta, nesterov).unwrap();
                let ub = Tensor::momentum_blend_many_dev(&pb, at(5), nesterov).unwrap();
                assert_eq!(bytes(&ua), bytes(&ub), "{dev} blend β={beta} nesterov={nesterov}: updates");
            }
            assert_eq!(bytes(&ma), bytes(&mb), "{dev} blend nesterov={nesterov}: momenta");
        }
        // EMA lerp: the weight at 0, 1 − d for a decay that grows each step.
        let (ea, eb) = (copies(&p0), copies(&p0));
        for (gs, w) in grads.iter().zip([0.9, 0.5, 0.0002]) {
            hp.write_f64(0, &[w]).unwrap();
            let pa: Vec<(&Tensor, &Tensor)> = ea.iter().zip(gs).collect();
            let pb: Vec<(&Tensor, &Tensor)> = eb.iter().zip(gs).collect();
            Tensor::lerp_many_(&pa, w).unwrap();
            Tensor::lerp_many_dev_(&pb, at(0)).unwrap();
        }
        assert_eq!(bytes(&ea), bytes(&eb), "{dev} lerp");
        // AdamW: the 7 scalars in a vector of their own, a different lr each step, each parameter's
        // step count on the device; against the composed update at the host-known step.
        let ahp = Tensor::zeros(vec![ptl_autograd::ADAMW_SCALARS], DType::F64, dev).unwrap();
        for wd in [0.0, 5e-4] {
            let (pa, ma, va, pb, mb, vb) = (copies(&p0), copies(&b0), copies(&b0), copies(&p0), copies(&b0), copies(&b0));
            // Second moments start non-negative (squares), as in a real run.
            for v in va.iter().chain(&vb) {
                v.copy_(&v.square().unwrap()).unwrap();
            }
            let counts: Vec<Tensor> = sizes.iter().map(|_| Tensor::zeros(vec![1], DType::F64, dev).unwrap()).collect();
            for (step, gs) in grads.iter().enumerate() {
                let (lr, b1, b2) = (0.002 / (step + 1) as f64, 0.9, 0.999);
                let h = [1.0 - lr * wd, 1.0 - b1, b2, 1.0 - b2, 1e-8, lr, b1];
                ahp.write_f64(0, &h).unwrap();
                for (((p, g), m), v) in pa.iter().zip(gs).zip(&ma).zip(&va) {
                    ptl_autograd::adamw_composed(p, g, m, v, &h, (step + 1) as f64, wd != 0.0).unwrap();
                }
                let items: Vec<ptl_autograd::AdamWItem<'_>> = pb
                    .iter()
                    .zip(gs)
                    .zip(&mb)
                    .zip(&vb)
                    .zip(&counts)
                    .map(|((((p, g), m), v), c)| ptl_autograd::AdamWItem { param: p, grad: g, exp_avg: m, exp_avg_sq: v, step: c })
                    .collect();
                Tensor::adamw_step_many_dev(&items, DeviceScalars::new(&ahp, 0), wd != 0.0).unwrap();
            }
            assert_eq!((bytes(&pa), bytes(&ma), bytes(&va)), (bytes(&pb), bytes(&mb), bytes(&vb)), "{dev} adamw wd={wd}");
            assert!(counts.iter().all(|c| c.to_vec::<f64>().unwrap() == [3.0]), "{dev}: every count at 3");
            // Under a set skip flag nothing moves, counts included.
            let flag = Tensor::full(vec![1], 1.0, DType::F32, dev).unwrap();
            let before = (bytes(&pb), bytes(&mb), bytes(&vb));
            let items: Vec<ptl_autograd::AdamWItem<'_>> = pb
                .iter()
                .zip(&grads[0])
                .zip(&mb)
                .zip(&vb)
                .zip(&counts)
                .map(|((((p, g), m), v), c)| ptl_autograd::AdamWItem { param: p, grad: g, exp_avg: m, exp_avg_sq: v, step: c })
                .collect();
            Tensor::adamw_step_many_dev(&items, DeviceScalars::new(&ahp, 0).skipping_if(Some(&flag)), wd != 0.0).unwrap();
            assert_eq!((bytes(&pb), bytes(&mb), bytes(&vb)), before, "{dev} adamw skipped");
            assert!(counts.iter().all(|c| c.to_vec::<f64>().unwrap() == [3.0]), "{dev}: skipped counts stay");
        }
        // A scalar vector that is too short or not f64 is refused.
        let short = Tensor::zeros(vec![2], DType::F64, dev).unwrap();
        let wrong = Tensor::zeros(vec![8], DType::F32, dev).unwrap();
        let pairs: Vec<(&Tensor, &Tensor)> = ea.iter().zip(&grads[0]).collect();
        for (s, what) in [(DeviceScalars::new(&short, 2), "short"), (DeviceScalars::new(&wrong, 0), "f32")] {
            let e = Tensor::lerp_many_dev_(&pairs, s).unwrap_err().to_string();
            assert!(e.contains("device scalars"), "{dev} {what}: {e}");
        }
        assert!(wrong.write_f64(0, &[1.0]).is_err() && hp.write_f64(7, &[1.0, 2.0]).is_err(), "write_f64 checks dtype and range");
    }
}

/// The fused momentum blend (Muon's lerp pair) gives the composed ops' bytes for the momentum and
/// the blend, on CUDA (45 f32 tensors, Nesterov or not, three steps; β = 0.937 takes lerp's two
/// branches); on the CPU it is the composed ops.
#[test]
fn fused_momentum_blend_matches_the_composed_one() {
    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu()).collect();
    for dev in devices {
        for nesterov in [true, false] {
            let mut rng = Rng::new(12);
            let sizes: Vec<usize> = (0..45).map(|k| [1usize, 9, 2048, 2049, 4000][k % 5] + k).collect();
            let make = |rng: &mut Rng| -> Vec<Tensor> {
                sizes.iter().map(|&n| Tensor::rand(vec![n], -1.0, 1.0, DType::F32, dev, rng).unwrap()).collect()
            };
            let m0 = make(&mut rng);
            let grads: Vec<Vec<Tensor>> = (0..3).map(|_| make(&mut rng)).collect();
            let run = |fused: bool| -> Vec<Vec<u8>> {
                let ms: Vec<Tensor> = m0.iter().map(|t| t.deep_copy().unwrap()).collect();
                let mut out = Vec::new();
                for gs in &grads {
                    let pairs: Vec<(&Tensor, &Tensor)> = gs.iter().zip(&ms).collect();
                    let us = if fused {
                        Tensor::momentum_blend_many(&pairs, 0.937, nesterov).unwrap()
                    } else {
                        pairs.iter().map(|(g, m)| Tensor::momentum_blend_composed(g, m, 0.937, nesterov).unwrap()).collect()
                    };
                    out.extend(us.iter().map(|u| u.to_bytes().unwrap()));
                }
                out.extend(ms.iter().map(|m| m.to_bytes().unwrap()));
                out
            };
            assert_eq!(run(true), run(false), "{dev} nesterov={nesterov}");
        }
    }
}

/// The fused in-place lerp (EMA update) gives `dst.copy_(lerp(dst, src, w))`'s bytes, on CUDA
/// (45 f32 tensors, both lerp branches); on the CPU it is the composed ops.
#[test]
fn fused_lerp_matches_the_composed_one() {
    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu()).collect();
    for dev in devices {
        for w in [1.0 - 0.9999, 0.75] {
            let mut rng = Rng::new(14);
            let sizes: Vec<usize> = (0..45).map(|k| [1usize, 9, 2048, 2049, 4000][k % 5] + k).collect();
            let make = |rng: &mut Rng| -> Vec<Tensor> {
                sizes.iter().map(|&n| Tensor::rand(vec![n], -1.0, 1.0, DType::F32, dev, rng).unwrap()).collect()
            };
            let (d0, src) = (make(&mut rng), make(&mut rng));
            let run = |fused: bool| -> Vec<Vec<u8>> {
                let ds: Vec<Tensor> = d0.iter().map(|t| t.deep_copy().unwrap()).collect();
                let pairs: Vec<(&Tensor, &Tensor)> = ds.iter().zip(&src).collect();
                if fused {
                    Tensor::lerp_many_(&pairs, w).unwrap();
                } else {
                    for (d, s) in pairs {
                        d.copy_(&ptl_autograd::lerp(d, s, w).unwrap()).unwrap();
                    }
                }
                ds.iter().map(|t| t.to_bytes().unwrap()).collect()
            };
            assert_eq!(run(true), run(false), "{dev} w={w}");
        }
    }
}

/// Fused gradient clipping (`Tensor::clip_norm_many_`) on CUDA: the total norm within 1e-6 of the
/// f64 one, every gradient scaled by the composed coefficient's value (within one rounding), the
/// same bytes run to run, untouched bytes when the norm is under the limit; on the CPU it declines.
#[test]
fn fused_clipping_matches_the_composed_norm() {
    let cpu = Tensor::rand(vec![5], -1.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
    assert!(Tensor::clip_norm_many_(&[&cpu], 1.0).unwrap().is_none(), "the CPU runs the composed ops");
    let Some(dev) = gpu() else { return };
    ptl_autograd::cuda::set_device_options(dev, ptl_autograd::cuda::DeviceOptions { fused_clip: true, ..Default::default() }).unwrap();
    let sizes: Vec<usize> = (0..93).map(|k| [1usize, 9, 2048, 2049, 70_000][k % 5] + 3 * k).collect();
    let make = || -> Vec<Tensor> {
        let mut rng = Rng::new(77);
        sizes.iter().map(|&n| Tensor::rand(vec![n], -1.0, 1.0, DType::F32, dev, &mut rng).unwrap()).collect()
    };
    let host: Vec<Vec<f32>> = make().iter().map(|t| t.to_vec::<f32>().unwrap()).collect();
    let exact = host.iter().flatten().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    for max_norm in [10.0, 1e9] {
        let (a, b) = (make(), make());
        let ra: Vec<&Tensor> = a.iter().collect();
        let total = Tensor::clip_norm_many_(&ra, max_norm).unwrap().expect("fused on CUDA").item().unwrap();
        let rb: Vec<&Tensor> = b.iter().collect();
        Tensor::clip_norm_many_(&rb, max_norm).unwrap().expect("fused");
        assert_eq!(
            a.iter().map(|t| t.to_bytes().unwrap()).collect::<Vec<_>>(),
            b.iter().map(|t| t.to_bytes().unwrap()).collect::<Vec<_>>()
        );
        assert!((total - exact).abs() <= 1e-6 * exact, "total {total} vs {exact}");
        let coef = (max_norm as f32 / (total as f32 + 1e-6)).min(1.0);
        for (t, h) in a.iter().zip(&host) {
            for (x, y) in t.to_vec::<f32>().unwrap().iter().zip(h) {
                let want = y * coef;
                assert!((x - want).abs() <= want.abs() * 5e-7, "{x} vs {want}");
                if max_norm > 1e8 {
                    assert_eq!(x.to_bits(), y.to_bits(), "under the limit: untouched");
                }
            }
        }
    }
}

/// `baddbmm` on CUDA (cuBLASLt's alpha/beta epilogue, one rounding) against the CPU's: f32
/// within summation-order error, bf16 within one bf16 rounding of the CPU result, f64 closely;
/// the same bytes run to run.
#[test]
fn baddbmm_matches_the_cpu_reference() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(41);
    let (c, a, b) = (
        Tensor::rand(vec![3, 17, 9], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap(),
        Tensor::rand(vec![3, 17, 40], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap(),
        Tensor::rand(vec![3, 40, 9], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap(),
    );
    for (dt, tol) in [(DType::F32, 2e-5), (DType::F64, 1e-12), (DType::BF16, 1.6e-2)] {
        let cast = |t: &Tensor, d: Device| t.to_dtype(dt).unwrap().to_device(d).unwrap();
        let want = cast(&c, Device::Cpu).baddbmm(&cast(&a, Device::Cpu), &cast(&b, Device::Cpu), -4.775, 2.0315).unwrap();
        let run = || cast(&c, dev).baddbmm(&cast(&a, dev), &cast(&b, dev), -4.775, 2.0315).unwrap();
        let (got, again) = (run(), run());
        assert_eq!(got.to_bytes().unwrap(), again.to_bytes().unwrap(), "{dt}: run to run");
        let (g, w) =
            (got.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(), want.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap());
        for (x, y) in g.iter().zip(&w) {
            assert!((x - y).abs() <= tol * y.abs().max(1.0), "{dt}: {x} vs {y}");
        }
    }
}

/// The fused pack and unpack kernels give the composed ops' bytes (the CPU's): wide, tall and
/// single-element matrices in bf16, f32 and f64 slots, more than one 40-matrix table, scales of 1
/// and others.
#[test]
fn padded_batches_pack_and_unpack_as_composed() {
    use ptl_autograd::{PackedMatrix, Unpacked};
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(43);
    let shapes: Vec<(usize, usize)> = (0..45).map(|i| [(3, 70), (64, 5), (1, 1), (16, 16), (9, 64)][i % 5]).collect();
    let host: Vec<Tensor> =
        shapes.iter().map(|&(r, c)| Tensor::rand(vec![r, c], -2.0, 2.0, DType::F32, Device::Cpu, &mut rng).unwrap()).collect();
    let on_dev: Vec<Tensor> = host.iter().map(|t| t.to_device(dev).unwrap()).collect();
    let mats = |ts: &[Tensor]| -> Vec<(Tensor, PackedMatrix)> {
        ts.iter().zip(&shapes).map(|(t, &(rows, cols))| (t.clone(), PackedMatrix { rows, cols, transposed: rows > cols })).collect()
    };
    let (mh, md) = (mats(&host), mats(&on_dev));
    fn refs(m: &[(Tensor, PackedMatrix)]) -> Vec<(&Tensor, PackedMatrix)> {
        m.iter().map(|(t, p)| (t, *p)).collect()
    }
    for dt in [DType::BF16, DType::F32, DType::F64] {
        let want = Tensor::pack_padded(&refs(&mh), 16, 72, dt).unwrap();
        let got = Tensor::pack_padded(&refs(&md), 16, 72, dt).unwrap();
        assert_eq!(got.to_bytes().unwrap(), want.to_bytes().unwrap(), "pack into {dt}");
        let items: Vec<Unpacked> = mh
            .iter()
            .enumerate()
            .map(|(i, (t, m))| Unpacked { matrix: *m, dims: t.dims().to_vec(), scale: if i % 2 == 0 { 1.0 } else { 1.7320508 } })
            .collect();
        let back_want = want.unpack_padded(&items, DType::F32).unwrap();
        let back_got = got.unpack_padded(&items, DType::F32).unwrap();
        for (i, (g, w)) in back_got.iter().zip(&back_want).enumerate() {
            assert_eq!(g.dims(), w.dims());
            assert_eq!(g.to_bytes().unwrap(), w.to_bytes().unwrap(), "unpack {dt} slot {i}");
        }
    }
}

/// The fused unscale (`Tensor::unscale_many_`) gives the composed ops' bytes on CUDA — every
/// gradient times the f32 inverse scale — and its flag is 0 on finite gradients, 1 when one of 45
/// gradients (over two tables) holds an inf or a NaN; the flag starts from 0 whatever it held.
#[test]
fn fused_unscale_matches_the_composed_ops() {
    let cpu = Tensor::zeros(vec![3], DType::F32, Device::Cpu).unwrap();
    let (ci, cf) = (Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap(), Tensor::scalar(0.0, DType::F32, Device::Cpu).unwrap());
    assert!(!Tensor::unscale_many_(&[&cpu], &ci, &cf).unwrap(), "the CPU runs the composed ops");
    let Some(dev) = gpu() else { return };
    let sizes: Vec<usize> = (0..45).map(|k| [1usize, 7, 2048, 2049, 9000][k % 5] + k).collect();
    let inv = Tensor::scalar(1.0 / 65536.0, DType::F32, dev).unwrap();
    for poison in [None, Some(f32::INFINITY), Some(f32::NAN)] {
        let mut rng = Rng::new(91);
        let host: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let mut v = Tensor::rand(vec![n], -3e4, 3e4, DType::F32, Device::Cpu, &mut rng).unwrap().to_vec::<f32>().unwrap();
                if let (Some(p), 43) = (poison, k) {
                    v[n / 2] = p;
                }
                v
            })
            .collect();
        let grads: Vec<Tensor> = host.iter().map(|v| Tensor::from_vec(v.clone(), vec![v.len()], dev).unwrap()).collect();
        let found = Tensor::scalar(7.0, DType::F32, dev).unwrap();
        assert!(Tensor::unscale_many_(&grads.iter().collect::<Vec<_>>(), &inv, &found).unwrap(), "fused on CUDA");
        let flag = found.to_vec::<f32>().unwrap()[0];
        assert_eq!(flag, if poison.is_some() { 1.0 } else { 0.0 }, "{poison:?}");
        for (g, v) in grads.iter().zip(&host) {
            let want = Tensor::from_vec(v.clone(), vec![v.len()], dev).unwrap().mul(&inv).unwrap();
            assert_eq!(g.to_bytes().unwrap(), want.to_bytes().unwrap());
        }
    }
}

/// Top-k of long rows with few picks (the selection kernel) gives the CPU's values and indices,
/// ties by the lower index: rows of 8,400 values drawn from a few levels (many ties, many zeros),
/// largest and smallest, k of 1, 7, 10 and 64, along the last and a middle dimension.
#[test]
fn topk_of_long_rows_matches_the_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(12);
    let levels =
        Tensor::rand(vec![6, 8400, 2], 0.0, 4.0, DType::F32, Device::Cpu, &mut rng).unwrap().floor().unwrap().mul_scalar(0.25).unwrap();
    let on_dev = levels.to_device(dev).unwrap();
    for (k, dim, largest) in [(1, 1, true), (7, 1, true), (10, 1, false), (64, 1, true), (10, 1, true)] {
        let (cv, ci) = levels.topk(k, dim, largest).unwrap();
        let (gv, gi) = on_dev.topk(k, dim, largest).unwrap();
        assert_eq!(gv.to_bytes().unwrap(), cv.to_bytes().unwrap(), "values k {k} largest {largest}");
        assert_eq!(gi.to_vec::<i64>().unwrap(), ci.to_vec::<i64>().unwrap(), "indices k {k} largest {largest}");
    }
    let rows = levels.transpose(1, 2).unwrap();
    let (cv, ci) = rows.topk(10, -1, true).unwrap();
    let (gv, gi) = rows.to_device(dev).unwrap().topk(10, -1, true).unwrap();
    assert_eq!(
        (gv.to_bytes().unwrap(), gi.to_vec::<i64>().unwrap()),
        (cv.to_bytes().unwrap(), ci.to_vec::<i64>().unwrap()),
        "last dimension"
    );
}

/// `nonzero_static` on the GPU gives the CPU's positions: sparse and dense masks of 33,600 and
/// 571,200 elements (f32 and u8), a size below the count (truncated), above it (padded with the
/// fill) and of 0, an all-zero mask; and it reads nothing back to the host.
#[test]
fn nonzero_static_matches_the_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(31);
    for (n, p) in [(33_600usize, 0.02f64), (571_200, 0.001), (5_000, 0.7), (1_000, 0.0), (16_389, 0.5), (40_000, 1.0)] {
        let u = Tensor::rand(vec![n], 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
        let mask = u.lt_scalar(p).unwrap().to_dtype(DType::F32).unwrap();
        let count = mask.to_vec::<f32>().unwrap().iter().filter(|&&v| v != 0.0).count();
        for size in [0, count / 2, count, count + 37] {
            for m in [mask.clone(), mask.to_dtype(DType::U8).unwrap()] {
                let want = m.nonzero_static(size, -1).unwrap().to_vec::<i64>().unwrap();
                let on_dev = m.to_device(dev).unwrap();
                let before = ptl_autograd::internal::cuda::counters();
                let got = on_dev.nonzero_static(size, -1).unwrap();
                let c = ptl_autograd::internal::cuda::counters().since(&before);
                assert_eq!((c.host_syncs, c.device_to_host_copies), (0, 0), "no host read");
                assert_eq!(got.to_vec::<i64>().unwrap(), want, "n {n}, {count} set, size {size}, {:?}", m.dtype());
            }
        }
    }
}

/// `read_later` queues the copy without waiting (no host sync counted), and the values arrive:
/// polled after later work, or waited for; f32 and bf16 (read as f32); pinned buffers are reused
/// across reads; a read larger than the pooled size works too.
#[test]
fn deferred_reads_arrive_without_a_sync() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(41);
    for (n, dtype) in [(13usize, DType::F32), (13, DType::BF16), (5000, DType::F32)] {
        let x = Tensor::rand(vec![n], -3.0, 3.0, DType::F32, Device::Cpu, &mut rng).unwrap().to_dtype(dtype).unwrap();
        let want: Vec<f32> = x.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        let on_dev = x.to_device(dev).unwrap();
        for round in 0..3 {
            let before = ptl_autograd::internal::cuda::counters();
            let mut pending = on_dev.read_later().unwrap();
            let queued = ptl_autograd::internal::cuda::counters().since(&before);
            assert_eq!(queued.host_syncs, 0, "queueing waits for nothing");
            // Later work, then the values.
            let _busy = on_dev.to_dtype(DType::F32).unwrap().exp().unwrap();
            let got = if round == 0 {
                pending.wait().unwrap()
            } else {
                ptl_autograd::cuda::synchronize(dev).unwrap();
                pending.poll().unwrap().expect("done after a synchronize")
            };
            assert_eq!(got, want, "n {n} {dtype:?} round {round}");
        }
    }
}

/// `DeviceOptions::tf32_convolutions` (PyTorch's `cudnn.allow_tf32`): f32 convolutions — a 3×3
/// through cuDNN and a 1×1 through the GEMM path; output, input and weight gradients — with the
/// option on stay within TF32's bound of the CPU's f32, |Δ| ≤ 2⁻⁸·Σ|a||b| + 1e-6 per element
/// (inputs rounded to 10 mantissa bits: ≤ 2⁻¹⁰ per product, ×4 for the transform algorithms
/// cuDNN may pick), where Σ|a||b| is the same convolution of the absolute values; with it off
/// they are strict FP32 (≤ 2⁻¹⁶·Σ|a||b|), and the strict bytes are the same before and after a
/// TF32 run (plans and remembered engine choices are kept apart). TF32 must be in use: at least
/// one result differs from the strict bytes with the option on.
#[test]
fn tf32_convolutions_are_a_device_option() {
    use ptl_autograd::cuda::{set_device_options, DeviceOptions};
    let Some(dev) = gpu() else { return };
    let set = |tf32: bool| set_device_options(dev, DeviceOptions { tf32_convolutions: tf32, ..Default::default() }).unwrap();
    // y = conv(x, w); Σ g·y backwards: [y, dx, dw] on `device`.
    let run = |x: &Tensor, w: &Tensor, g: &Tensor, pad: usize, device: Device| -> Vec<Tensor> {
        let x = x.to_device(device).unwrap().requires_grad_(true).unwrap();
        let w = w.to_device(device).unwrap().requires_grad_(true).unwrap();
        let y = x.conv2d(&w, None, (1, 1), (pad, pad), 1).unwrap();
        y.mul(&g.to_device(device).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        vec![y.detach(), x.grad().expect("dx"), w.grad().expect("dw")]
    };
    let mut rng = Rng::new(41);
    let mut differs = 0;
    for (name, cin, cout, k, pad, hw) in [("3x3", 64usize, 64usize, 3usize, 1usize, 40usize), ("1x1", 128, 128, 1, 0, 40)] {
        let x = Tensor::rand(vec![2, cin, hw, hw], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
        let w = Tensor::rand(vec![cout, cin, k, k], -0.5, 0.5, DType::F32, Device::Cpu, &mut rng).unwrap();
        let g = Tensor::rand(vec![2, cout, hw, hw], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
        let cpu = run(&x, &w, &g, pad, Device::Cpu);
        let bound = run(&x.abs().unwrap(), &w.abs().unwrap(), &g.abs().unwrap(), pad, Device::Cpu);
        let bytes = |ts: &[Tensor]| ts.iter().map(|t| t.to_bytes().unwrap()).collect::<Vec<_>>();
        set(false);
        let strict = run(&x, &w, &g, pad, dev);
        set(true);
        let tf32 = run(&x, &w, &g, pad, dev);
        set(false);
        let strict_again = run(&x, &w, &g, pad, dev);
        assert!(bytes(&strict) == bytes(&strict_again), "{name}: strict FP32 bytes changed after a TF32 run");
        for (i, part) in ["y", "dx", "dw"].iter().enumerate() {
            let (c, b) = (cpu[i].to_f64_vec().unwrap(), bound[i].to_f64_vec().unwrap());
            for (label, got, scale) in [("strict", &strict[i], 2f64.powi(-16)), ("tf32", &tf32[i], 2f64.powi(-8))] {
                let got = got.to_f64_vec().unwrap();
                let worst = got.iter().zip(&c).zip(&b).map(|((g, c), b)| (g - c).abs() / (scale * b + 1e-6)).fold(0f64, f64::max);
                assert!(worst <= 1.0, "{name} {part} {label}: {worst:.3} of the bound");
                println!("{name} {part} {label}: worst |Δ| at {worst:.3} of its bound");
            }
            if tf32[i].to_bytes().unwrap() != strict[i].to_bytes().unwrap() {
                differs += 1;
            }
        }
    }
    set(false);
    assert!(differs > 0, "with tf32_convolutions on, no convolution result differs from strict FP32: TF32 is not in use");
    println!("ok tf32 convolutions: {differs} of 6 results differ from strict FP32, all within TF32's bound; strict bytes unchanged");
}

/// Channels-last cat and split along C on the GPU (step 2 of docs/channels-last.md): inputs that
/// are all channels-last are joined as rows of channels in one pass and stay channels-last, and
/// split gives channels-last pieces; the values and the gradients are those of the contiguous ops.
#[test]
fn channels_last_cat_and_split_along_c_stay_channels_last() {
    use ptl_autograd::MemoryFormat;
    let Some(dev) = gpu() else { return };
    let rand = |dims: &[usize], seed: u64| Tensor::rand(dims.to_vec(), -1.0, 1.0, DType::F32, dev, &mut Rng::new(seed)).unwrap();
    let (a, b) = (rand(&[2, 8, 5, 7], 1), rand(&[2, 24, 5, 7], 2));
    let run = |channels_last: bool| -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let (la, lb) = (a.detach().requires_grad_(true).unwrap(), b.detach().requires_grad_(true).unwrap());
        let f = if channels_last { MemoryFormat::ChannelsLast } else { MemoryFormat::Contiguous };
        let (ia, ib) = (la.to_memory_format(f).unwrap(), lb.to_memory_format(f).unwrap());
        let y = Tensor::cat(&[&ia, &ib], 1).unwrap();
        assert_eq!(y.memory_format(), f, "cat's output format");
        let parts = y.split(&[16, 16], 1).unwrap();
        assert!(parts.iter().all(|p| p.memory_format() == f), "split's pieces' format");
        let mix = rand(&[2, 16, 5, 7], 3);
        parts[1].mul(&mix).unwrap().add(&parts[0]).unwrap().sum_all().unwrap().backward().unwrap();
        (y.to_bytes().unwrap(), la.grad().expect("a's gradient").to_bytes().unwrap(), lb.grad().expect("b's gradient").to_bytes().unwrap())
    };
    let (plain, cl) = (run(false), run(true));
    assert_eq!(cl.0, plain.0, "cat output");
    assert_eq!(cl.1, plain.1, "first input's gradient");
    assert_eq!(cl.2, plain.2, "second input's gradient");
    println!("ok channels-last cat and split along C");
}

/// Channels-last convolutions on the GPU (step 2 of docs/channels-last.md): a channels-last input
/// is convolved as it lies (cuDNN NHWC descriptors; 1×1 as one GEMM over N·H·W) and gives a
/// channels-last output; output, input gradient and weight gradient match the contiguous
/// convolution within the rounding of another engine (f32 strict: 1e-5 of the largest value;
/// bf16: 2^-7), for 3×3, strided, depthwise and 1×1 shapes.
#[test]
fn channels_last_convolutions_compute_in_nhwc() {
    use ptl_autograd::MemoryFormat;
    let Some(dev) = gpu() else { return };
    let rand = |dims: &[usize], seed: u64| Tensor::rand(dims.to_vec(), -1.0, 1.0, DType::F32, dev, &mut Rng::new(seed)).unwrap();
    /// Input, weight, stride, padding, groups.
    type Shape = ([usize; 4], [usize; 4], usize, usize, usize);
    // The depthwise shapes run ptl's own channels-last kernels (cuda/ops/depthwise.rs): strided,
    // 5×5, and one whose weight gradient splits its rows over several blocks.
    let shapes: [Shape; 7] = [
        ([2, 16, 12, 12], [32, 16, 3, 3], 1, 1, 1),
        ([2, 16, 12, 12], [32, 16, 3, 3], 2, 1, 1),
        ([2, 32, 10, 10], [32, 1, 3, 3], 1, 1, 32),
        ([2, 24, 9, 9], [40, 24, 1, 1], 1, 0, 1),
        ([2, 24, 11, 11], [24, 1, 3, 3], 2, 1, 24),
        ([1, 8, 13, 13], [8, 1, 5, 5], 1, 2, 8),
        ([2, 48, 40, 40], [48, 1, 3, 3], 1, 1, 48),
    ];
    for (i, (xs, ws, stride, pad, groups)) in shapes.into_iter().enumerate() {
        for dt in [DType::F32, DType::BF16] {
            let run = |channels_last: bool| -> [Vec<f32>; 3] {
                let x = rand(&xs, 10 + i as u64).requires_grad_(true).unwrap();
                let w = rand(&ws, 20 + i as u64).requires_grad_(true).unwrap();
                let input = if channels_last { x.to_memory_format(MemoryFormat::ChannelsLast).unwrap() } else { x.clone() };
                let auto = (dt != DType::F32).then_some(dt);
                let y = ptl_autograd::autocast(auto, || input.conv2d(&w, None, (stride, stride), (pad, pad), groups).unwrap());
                let want = if channels_last { MemoryFormat::ChannelsLast } else { MemoryFormat::Contiguous };
                assert_eq!(y.memory_format(), want, "shape {i} {dt:?}: the output's format");
                let y = y.to_dtype(DType::F32).unwrap();
                // A weighted sum, so every output position sends back a different gradient.
                let mix = rand(y.dims(), 30 + i as u64);
                y.mul(&mix).unwrap().sum_all().unwrap().backward().unwrap();
                let vals = |t: &Tensor| t.to_memory_format(MemoryFormat::Contiguous).unwrap().to_vec::<f32>().unwrap();
                [vals(&y), vals(&x.grad().expect("input gradient")), vals(&w.grad().expect("weight gradient"))]
            };
            let (plain, nhwc) = (run(false), run(true));
            let tol = if dt == DType::F32 { 1e-5 } else { 1.0 / 128.0 };
            for (k, part) in ["output", "input gradient", "weight gradient"].iter().enumerate() {
                let scale = plain[k].iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                let worst = plain[k].iter().zip(&nhwc[k]).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                assert!(worst <= tol, "shape {i} {dt:?} {part}: max |Δ| {worst:.2e} of the largest value (tolerance {tol:.1e})");
                println!("ok channels-last conv shape {i} {dt:?} {part}: max |Δ| {worst:.2e} of the largest value");
            }
        }
    }
}

/// A channels-last weight (stored O, H, W, I: autocast's weight copies on CUDA) computes what the
/// OIHW weight computes — output and both gradients within the convolution tolerance of the OIHW
/// run (cuDNN may pick another engine for it) — through the graph API (f32, bf16), the legacy API
/// (f64: an OIHW copy in, the gradient reordered out), ptl's thin-input weight gradient (3 input
/// channels) and a grouped convolution with 4 input channels per group.
#[test]
fn channels_last_weights_compute_as_oihw_ones() {
    use ptl_autograd::MemoryFormat;
    let Some(dev) = gpu() else { return };
    let rand = |dims: &[usize], seed: u64, dt: DType| Tensor::rand(dims.to_vec(), -1.0, 1.0, dt, dev, &mut Rng::new(seed)).unwrap();
    /// Input, weight, stride, padding, groups.
    type Shape = ([usize; 4], [usize; 4], usize, usize, usize);
    let shapes: [Shape; 4] = [
        ([2, 16, 12, 12], [32, 16, 3, 3], 1, 1, 1),
        ([2, 16, 12, 12], [24, 16, 3, 3], 2, 1, 1),
        ([2, 3, 32, 32], [16, 3, 3, 3], 2, 1, 1),
        ([2, 16, 10, 10], [16, 4, 3, 3], 1, 1, 4),
    ];
    let (g0, l0) = ptl_autograd::internal::cuda::conv_paths();
    for (i, (xs, ws, stride, pad, groups)) in shapes.into_iter().enumerate() {
        for dt in [DType::F32, DType::BF16, DType::F64] {
            let run = |weight_cl: bool| -> [Vec<f64>; 3] {
                let x = rand(&xs, 10 + i as u64, dt).requires_grad_(true).unwrap();
                let w = rand(&ws, 20 + i as u64, dt);
                let w = if weight_cl { w.to_memory_format(MemoryFormat::ChannelsLast).unwrap() } else { w };
                let w = w.requires_grad_(true).unwrap();
                let y = x.conv2d(&w, None, (stride, stride), (pad, pad), groups).unwrap();
                assert_eq!(y.memory_format(), MemoryFormat::Contiguous, "shape {i} {dt:?}: the output's format");
                let mix = rand(y.dims(), 30 + i as u64, dt);
                y.mul(&mix).unwrap().sum_all().unwrap().backward().unwrap();
                let vals =
                    |t: &Tensor| t.to_memory_format(MemoryFormat::Contiguous).unwrap().to_dtype(DType::F64).unwrap().to_f64_vec().unwrap();
                [vals(&y), vals(&x.grad().expect("input gradient")), vals(&w.grad().expect("weight gradient"))]
            };
            let (oihw, ohwi) = (run(false), run(true));
            let tol = match dt {
                DType::F64 => 1e-12,
                DType::F32 => 1e-5,
                _ => 1.0 / 128.0,
            };
            for (k, part) in ["output", "input gradient", "weight gradient"].iter().enumerate() {
                let scale = oihw[k].iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-6);
                let worst = oihw[k].iter().zip(&ohwi[k]).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale;
                assert!(worst <= tol, "shape {i} {dt:?} {part}: max |Δ| {worst:.2e} of the largest value (tolerance {tol:.1e})");
                println!("ok channels-last weight shape {i} {dt:?} {part}: max |Δ| {worst:.2e} of the largest value");
            }
        }
    }
    let (g1, l1) = ptl_autograd::internal::cuda::conv_paths();
    println!("ok channels-last weights: {} convolutions through the graph API, {} through the legacy API", g1 - g0, l1 - l0);
    assert!(l1 - l0 > 0, "the f64 runs should have taken the legacy API");
}

/// Autocast's up-front weight copies on CUDA with K, R, S, C copies (device-pack runs this test
/// with `PTL_WEIGHT_KRSC=1` and without): a 3×3 weight with several input channels is copied channels-last
/// (O, H, W, I) in the batched cast (with the copies off: contiguous), a 1×1 and a depthwise weight keep their format
/// (the same bytes either way); the copy holds the plain cast's values, and the batched cast's
/// backward hands the f32 weight an OIHW gradient with plain autocast's values (within the
/// convolution tolerance: cuDNN reads the weight in another order).
#[test]
fn autocast_weight_copies_are_channels_last_on_cuda() {
    use ptl_autograd::MemoryFormat;
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(41);
    let x = Tensor::rand(vec![2, 8, 12, 12], -1.0, 1.0, DType::F32, dev, &mut rng).unwrap();
    let w3 = Tensor::rand(vec![16, 8, 3, 3], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
    let w1 = Tensor::rand(vec![16, 16, 1, 1], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
    let wd = Tensor::rand(vec![16, 1, 3, 3], -0.5, 0.5, DType::F32, dev, &mut rng).unwrap().requires_grad_(true).unwrap();
    let weights = [w3.clone(), w1.clone(), wd.clone()];
    let formats = ptl_autograd::autocast_with_weights(Some(DType::BF16), &weights, || {
        weights.iter().map(|w| ptl_autograd::cast_weight(w, DType::BF16).unwrap()).collect::<Vec<_>>()
    })
    .unwrap();
    // `PTL_WEIGHT_KRSC=0`: every copy keeps the weight's format.
    let krsc = ptl_autograd::autocast::krsc_copies();
    let want = if krsc { MemoryFormat::ChannelsLast } else { MemoryFormat::Contiguous };
    assert_eq!(formats.iter().map(Tensor::memory_format).collect::<Vec<_>>(), [want, MemoryFormat::Contiguous, MemoryFormat::Contiguous]);
    let copy = &formats[0];
    let plain = w3.to_dtype(DType::BF16).unwrap();
    assert_eq!(
        copy.to_memory_format(MemoryFormat::Contiguous).unwrap().to_bytes().unwrap(),
        plain.to_bytes().unwrap(),
        "the copy's values"
    );
    let run = |batched: bool| -> Vec<Vec<f64>> {
        for t in &weights {
            t.zero_grad();
        }
        let f = || -> Tensor {
            let h = x.conv2d(&w3, None, (1, 1), (1, 1), 1).unwrap();
            let h = h.conv2d(&w1, None, (1, 1), (0, 0), 1).unwrap();
            h.conv2d(&wd, None, (1, 1), (1, 1), 16).unwrap()
        };
        let y = if batched {
            ptl_autograd::autocast_with_weights(Some(DType::BF16), &weights, f).unwrap()
        } else {
            ptl_autograd::autocast(Some(DType::BF16), f)
        };
        y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
        let mut v = vec![y.to_dtype(DType::F64).unwrap().to_f64_vec().unwrap()];
        for t in &weights {
            let g = t.grad().expect("gradient");
            assert_eq!((g.dtype(), g.memory_format()), (DType::F32, MemoryFormat::Contiguous), "a master weight's gradient");
            v.push(g.to_dtype(DType::F64).unwrap().to_f64_vec().unwrap());
        }
        v
    };
    let (batched, plain) = (run(true), run(false));
    for (k, part) in ["output", "3×3 weight gradient", "1×1 weight gradient", "depthwise weight gradient"].iter().enumerate() {
        let scale = plain[k].iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-6);
        let worst = plain[k].iter().zip(&batched[k]).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale;
        assert!(worst <= 1.0 / 128.0, "{part}: max |Δ| {worst:.2e} of the largest value");
        println!("ok autocast weight copies {part}: max |Δ| {worst:.2e} of the largest value (bytes equal: {})", worst == 0.0);
    }
}

/// Channels-last on the GPU (step 1 of docs/channels-last.md): the conversion stores (N, H, W, C)
/// and back, and the model's op families read a channels-last operand in the logical order —
/// the contiguous input's output and input-gradient bytes.
#[test]
fn channels_last_tensors_compute_as_contiguous_ones() {
    use ptl_autograd::MemoryFormat;
    let Some(dev) = gpu() else { return };
    let rand = |dims: &[usize], seed: u64| Tensor::rand(dims.to_vec(), -1.0, 1.0, DType::F32, dev, &mut Rng::new(seed)).unwrap();
    let x = rand(&[2, 3, 6, 6], 1);
    let cl = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    let raw = cl.with_storage(|s| s.to_cpu().unwrap().as_bytes().to_vec());
    assert_eq!(raw, x.permute(&[0, 2, 3, 1]).unwrap().to_bytes().unwrap(), "stored as (N, H, W, C)");
    assert_eq!(cl.to_memory_format(MemoryFormat::Contiguous).unwrap().to_bytes().unwrap(), x.to_bytes().unwrap());
    let other = rand(&[2, 3, 6, 6], 3);
    type Op<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;
    let ops: Vec<(&str, Op)> = vec![
        ("cat along C", Box::new(|x: &Tensor| Tensor::cat(&[x, &other], 1).unwrap())),
        ("upsample", Box::new(|x: &Tensor| x.upsample_nearest(2).unwrap())),
        ("max pool", Box::new(|x: &Tensor| x.max_pool2d(5, 1, 2).unwrap())),
        ("add", Box::new(|x: &Tensor| x.add(&other).unwrap().silu().unwrap())),
    ];
    for (name, op) in &ops {
        let run = |channels_last: bool| -> (Vec<u8>, Vec<u8>) {
            let leaf = x.detach().requires_grad_(true).unwrap();
            let input = if channels_last { leaf.to_memory_format(MemoryFormat::ChannelsLast).unwrap() } else { leaf.clone() };
            let y = op(&input);
            y.sum_all().unwrap().backward().unwrap();
            (y.to_bytes().unwrap(), leaf.grad().expect("input gradient").to_bytes().unwrap())
        };
        let (plain, cl) = (run(false), run(true));
        assert_eq!(cl.0, plain.0, "{name}: output");
        assert_eq!(cl.1, plain.1, "{name}: input gradient");
    }
    println!("ok channels-last on {dev}: {} op families", ops.len());
}

/// Batch norm (+SiLU) on channels-last storage (docs/channels-last.md, step 2): its own kernels
/// (tiles of channels, row lanes) sum in another order than the N, C, H, W ones, so y, the running
/// statistics and the three gradients are compared within a tolerance; y and the input gradient
/// stay channels-last, and a second run gives the same bytes. Shapes cover the one-launch split,
/// several blocks per tile, channel counts that are not a multiple of the tile, f32 and bf16.
#[test]
fn channels_last_batch_norm_matches_the_contiguous_kernels() {
    use ptl_autograd::{BatchNormOptions, MemoryFormat};
    let Some(dev) = gpu() else { return };
    let rand = |dims: &[usize], seed: u64| Tensor::rand(dims.to_vec(), -1.0, 1.0, DType::F32, dev, &mut Rng::new(seed)).unwrap();
    // Paths: C = 3 (scalar, one block per tile, fused), C = 40 (vectors, tiles with idle lanes,
    // several blocks per tile), C = 16 and 64 (vectors, many blocks), 1×64×4×4 (vectors, fused).
    let shapes: [[usize; 4]; 5] = [[2, 3, 6, 6], [4, 40, 20, 20], [2, 16, 96, 96], [4, 64, 40, 40], [1, 64, 4, 4]];
    for (i, dims) in shapes.into_iter().enumerate() {
        for dt in [DType::F32, DType::BF16] {
            for silu in [true, false] {
                let c = dims[1];
                let run = |channels_last: bool| -> (Vec<Vec<f32>>, Vec<u8>) {
                    let x = rand(&dims, 40 + i as u64).to_dtype(dt).unwrap().requires_grad_(true).unwrap();
                    let (w, b) = (rand(&[c], 41).requires_grad_(true).unwrap(), rand(&[c], 42).requires_grad_(true).unwrap());
                    let (rm, rv) = (Tensor::zeros(vec![c], DType::F32, dev).unwrap(), Tensor::ones(vec![c], DType::F32, dev).unwrap());
                    let input = if channels_last { x.to_memory_format(MemoryFormat::ChannelsLast).unwrap() } else { x.clone() };
                    let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
                    let y = input.batch_norm2d_fused(&w, &b, &rm, &rv, opts, silu).unwrap();
                    let want = if channels_last { MemoryFormat::ChannelsLast } else { MemoryFormat::Contiguous };
                    assert_eq!(y.memory_format(), want, "shape {i} {dt:?}: y's format");
                    let mix = rand(&dims, 43 + i as u64).to_dtype(dt).unwrap();
                    y.mul(&mix).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
                    let gx = x.grad().expect("input gradient");
                    let vals = |t: &Tensor| {
                        t.to_memory_format(MemoryFormat::Contiguous).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
                    };
                    let raw = y.with_storage(|s| s.to_cpu().unwrap().as_bytes().to_vec());
                    let parts = vec![vals(&y), vals(&rm), vals(&rv), vals(&gx), vals(&w.grad().unwrap()), vals(&b.grad().unwrap())];
                    (parts, raw)
                };
                let (plain, nhwc) = (run(false), run(true));
                assert_eq!(run(true).1, nhwc.1, "shape {i} {dt:?}: a second channels-last run gives other bytes");
                let tol = if dt == DType::F32 { 1e-5 } else { 1.0 / 64.0 };
                for (k, part) in
                    ["y", "running mean", "running var", "input gradient", "weight gradient", "bias gradient"].iter().enumerate()
                {
                    let scale = plain.0[k].iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                    let worst = plain.0[k].iter().zip(&nhwc.0[k]).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                    assert!(
                        worst <= tol,
                        "shape {i} {dt:?} silu={silu} {part}: max |Δ| {worst:.2e} of the largest value (tolerance {tol:.1e})"
                    );
                }
                println!("ok channels-last batch norm shape {i} {dt:?} silu={silu}: within {tol:.1e} of the largest value, bytes repeat");
            }
        }
    }
}

/// Weight gradients on the side stream (`DeviceOptions::concurrent_weight_gradients`): a small
/// network with every weight-gradient path (cuDNN 3×3, the thin-input kernel, depthwise, 1×1 as
/// GEMMs, the narrow 1×1 kernel) and batch norms between, in f32 and under autocast with and
/// without the batched weight casts, gives the single stream's bytes for the output and every
/// gradient — with every allocation poisoned, and side tasks counted.
#[test]
fn side_stream_weight_gradients_match_one_stream() {
    let Some(dev) = gpu() else { return };
    let before = ptl_autograd::cuda::device_options(dev).unwrap();
    let mut rng = Rng::new(77);
    let param =
        |shape: Vec<usize>, rng: &mut Rng| Tensor::rand(shape, -0.3, 0.3, DType::F32, dev, rng).unwrap().requires_grad_(true).unwrap();
    let x = Tensor::rand(vec![2, 3, 32, 32], -1.0, 1.0, DType::F32, dev, &mut rng).unwrap();
    let ws = [
        param(vec![16, 3, 3, 3], &mut rng),
        param(vec![32, 16, 3, 3], &mut rng),
        param(vec![32, 1, 3, 3], &mut rng),
        param(vec![64, 32, 1, 1], &mut rng),
        param(vec![17, 64, 1, 1], &mut rng),
        param(vec![4, 64, 1, 1], &mut rng),
    ];
    let bn: Vec<(Tensor, Tensor)> = [16, 32, 32, 64]
        .iter()
        .map(|&c| (param(vec![c], &mut rng).add_scalar(1.0).unwrap().detach().requires_grad_(true).unwrap(), param(vec![c], &mut rng)))
        .collect();
    let net = |_: ()| -> Tensor {
        let block = |h: &Tensor, k: usize, stride: usize, pad: usize, groups: usize| -> Tensor {
            let h = h.conv2d(&ws[k], None, (stride, stride), (pad, pad), groups).unwrap();
            let (g, b) = &bn[k];
            let rm = Tensor::zeros(vec![g.dims()[0]], DType::F32, dev).unwrap();
            let rv = Tensor::ones(vec![g.dims()[0]], DType::F32, dev).unwrap();
            let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
            h.batch_norm2d_fused_tracked(g, b, &rm, &rv, None, opts, true).unwrap()
        };
        let h = block(&x, 0, 2, 1, 1);
        let h = block(&h, 1, 1, 1, 1);
        let h = block(&h, 2, 1, 1, 32);
        let h = block(&h, 3, 1, 0, 1);
        let a = h.conv2d(&ws[4], None, (1, 1), (0, 0), 1).unwrap().to_dtype(DType::F32).unwrap();
        let b = h.conv2d(&ws[5], None, (1, 1), (0, 0), 1).unwrap().to_dtype(DType::F32).unwrap();
        a.square().unwrap().sum_all().unwrap().add(&b.sum_all().unwrap()).unwrap()
    };
    let params: Vec<Tensor> = ws.iter().cloned().chain(bn.iter().flat_map(|(g, b)| [g.clone(), b.clone()])).collect();
    let run = |side: bool, mode: usize| -> Vec<Vec<u8>> {
        ptl_autograd::cuda::set_device_options(dev, ptl_autograd::cuda::DeviceOptions { concurrent_weight_gradients: side, ..before })
            .unwrap();
        for p in &params {
            p.zero_grad();
        }
        let y = match mode {
            0 => net(()),
            1 => ptl_autograd::autocast(Some(DType::BF16), || net(())),
            _ => ptl_autograd::autocast_with_weights(Some(DType::F16), &ws, || net(())).unwrap(),
        };
        y.backward().unwrap();
        let mut v = vec![y.to_bytes().unwrap()];
        v.extend(params.iter().map(|p| p.grad().expect("every parameter receives a gradient").to_bytes().unwrap()));
        v
    };
    for mode in 0..3 {
        let tasks = ptl_autograd::cuda::side_stream_stats(dev).unwrap().tasks;
        let aside = run(true, mode);
        let tasks = ptl_autograd::cuda::side_stream_stats(dev).unwrap().tasks - tasks;
        let one = run(false, mode);
        // One task per weight gradient, and one per node that casts such gradients back to f32:
        // each weight's own cast (autocast) or the one batched cast (autocast_with_weights).
        assert_eq!(tasks, [6, 12, 7][mode], "mode {mode}: side tasks");
        for (k, (a, b)) in aside.iter().zip(&one).enumerate() {
            assert!(a == b, "mode {mode}: output #{k} differs between the side stream and one stream");
        }
        let again = run(true, mode);
        assert_eq!(again, aside, "mode {mode}: the side stream's bytes differ run to run");
    }
    // Two batch norms large enough for several blocks per channel (whose last block is chosen by
    // counters), one beside the chain and one on it, at once: each with its bytes alone.
    ptl_autograd::cuda::set_device_options(dev, ptl_autograd::cuda::DeviceOptions { concurrent_weight_gradients: true, ..before }).unwrap();
    let norm = |seed: u64| -> Tensor {
        let mut rng = Rng::new(seed);
        let x = Tensor::rand(vec![8, 64, 96, 96], -2.0, 2.0, DType::F32, dev, &mut rng).unwrap();
        let (g, b) = (Tensor::ones(vec![64], DType::F32, dev).unwrap(), Tensor::zeros(vec![64], DType::F32, dev).unwrap());
        let (rm, rv) = (Tensor::zeros(vec![64], DType::F32, dev).unwrap(), Tensor::ones(vec![64], DType::F32, dev).unwrap());
        let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
        x.batch_norm2d_fused_tracked(&g, &b, &rm, &rv, None, opts, true).unwrap()
    };
    let alone = [norm(1).to_bytes().unwrap(), norm(2).to_bytes().unwrap()];
    for _ in 0..3 {
        let beside = ptl_autograd::streams::beside(dev, || -> Result<Tensor> { Ok(norm(1)) }).unwrap();
        let chain = norm(2);
        ptl_autograd::streams::join().unwrap();
        assert!(beside.to_bytes().unwrap() == alone[0] && chain.to_bytes().unwrap() == alone[1], "batch norms at once on two streams");
    }
    let stats = ptl_autograd::cuda::side_stream_stats(dev).unwrap();
    ptl_autograd::cuda::set_device_options(dev, before).unwrap();
    assert_eq!(stats.held_bytes, 0, "every held free is carried out by the end of backward");
    assert!(stats.peak_held_bytes > 0, "frees were held while side tasks ran");
    println!(
        "ok side stream: 3 modes byte-identical to one stream; {} side tasks, {} bytes held at most",
        stats.tasks, stats.peak_held_bytes
    );
}

/// Programmatic dependent launch: each kernel's blocks may be scheduled while its predecessor
/// ends, and must wait for its writes. A chain alternating a kernel of many waves (2^24 elements)
/// with small ones that read the elements its last blocks write, then a reduction over all of it:
/// a kernel that read before its predecessor had finished would see a count one short.
#[test]
fn dependent_launches_see_their_predecessors_writes() {
    let Some(dev) = gpu() else {
        println!("skipping: no usable GPU");
        return;
    };
    let on = ptl_autograd::cuda::dependent_launch(dev);
    match std::env::var("PTL_PDL").as_deref() {
        Ok("1") => assert_eq!(on, ptl_autograd::cuda::has_clusters(dev), "PTL_PDL=1: dependent launches from sm_90 on"),
        Ok("0") => assert!(!on, "PTL_PDL=0: no dependent launches"),
        _ => {}
    }
    println!("dependent launch: {on}");
    let n = 1usize << 24;
    let rounds = 60;
    let mut big = Tensor::zeros(vec![n], DType::F32, dev).unwrap();
    let mut tail = Tensor::zeros(vec![4096], DType::F32, dev).unwrap();
    for _ in 0..rounds {
        big = big.affine(1.0, 1.0).unwrap();
        tail = tail.add(&big.narrow(0, n - 4096, 4096).unwrap()).unwrap();
    }
    let total = big.to_dtype(DType::F64).unwrap().sum_all().unwrap().item().unwrap();
    assert_eq!(total, (n * rounds) as f64, "every element counted {rounds} times");
    let want = (rounds * (rounds + 1) / 2) as f64;
    assert!(tail.to_f64_vec().unwrap().iter().all(|&v| v == want), "the small kernels read each round's count ({want})");
}

/// `Tensor::copy_many_` on the device (the batched first gradients of a recorded backward): one
/// `mt_copy_words` launch per 40 pairs whose bytes are whole 4-byte words, a copy of its own for
/// others (an odd number of half values) — every destination ends with its source's bytes, as
/// `copy_` gives, across 45 pairs (two launches in f32 and f64) and tensors of several chunks.
#[test]
fn copy_many_gives_each_destination_its_sources_bytes() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(29);
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let sizes: Vec<usize> = (0..45).map(|i| [1usize, 3, 8, 1000, 70_001][i % 5]).collect();
        let src: Vec<Tensor> = sizes.iter().map(|&n| Tensor::rand(vec![n], -1.0, 1.0, dt, dev, &mut rng).unwrap()).collect();
        let dst: Vec<Tensor> = sizes.iter().map(|&n| Tensor::rand(vec![n], -1.0, 1.0, dt, dev, &mut rng).unwrap()).collect();
        let before = ptl_autograd::internal::cuda::counters();
        Tensor::copy_many_(&dst.iter().zip(&src).collect::<Vec<_>>()).unwrap();
        let launched = ptl_autograd::internal::cuda::counters().since(&before);
        for (d, s) in dst.iter().zip(&src) {
            assert_eq!(d.to_bytes().unwrap(), s.to_bytes().unwrap(), "{dt}: {} values", s.numel());
        }
        // Halves of an odd length are not whole words: a copy each; the rest go 40 to a launch.
        let odd = if dt.size_in_bytes() == 2 { sizes.iter().filter(|&&n| n % 2 == 1).count() } else { 0 };
        let batched = (sizes.len() - odd).div_ceil(40) as u64;
        assert_eq!(
            (launched.kernel_launches, launched.device_to_device_copies),
            (batched, odd as u64),
            "{dt}: one launch per 40 whole-word pairs, a copy per odd-length half"
        );
    }
    println!("ok copy_many: f32, bf16, f16, f64 byte-equal to copy_, batched");
}

#[test]
fn binary_backward_launches_nothing_for_an_input_without_gradient() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(31);
    let a = Tensor::rand(vec![64, 33], 0.5, 1.5, DType::F32, dev, &mut rng).unwrap();
    let b = Tensor::rand(vec![64, 33], 0.5, 1.5, DType::F32, dev, &mut rng).unwrap();
    let g = Tensor::rand(vec![64, 33], -1.0, 1.0, DType::F32, dev, &mut rng).unwrap();
    type Op = fn(&Tensor, &Tensor) -> ptl_autograd::Result<Tensor>;
    // The kernels the right-hand gradient takes: −g (sub), g·a (mul), −(g·y)/b (div).
    let ops: [(&str, Op, u64); 3] = [("sub", |x, y| x.sub(y), 1), ("mul", |x, y| x.mul(y), 1), ("div", |x, y| x.div(y), 3)];
    for (name, op, rhs_kernels) in ops {
        let mut launched = Vec::new();
        for rhs_needs in [true, false] {
            let (x, y) = (a.detach().requires_grad_(true).unwrap(), b.detach().requires_grad_(rhs_needs).unwrap());
            let out = op(&x, &y).unwrap();
            let before = ptl_autograd::internal::cuda::counters();
            out.backward_with(&g).unwrap();
            launched.push(ptl_autograd::internal::cuda::counters().since(&before).kernel_launches);
            assert_eq!(y.grad().is_some(), rhs_needs, "{name}: the right-hand gradient is there only when asked for");
        }
        assert_eq!(launched[0] - launched[1], rhs_kernels, "{name}: launches with / without the right-hand gradient {launched:?}");
    }
    println!("ok binary backward: sub, mul, div launch no kernel for an input without gradient");
}

#[test]
fn a_one_channel_bias_gradient_is_one_launch() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(37);
    for dt in [DType::F32, DType::BF16] {
        let x_cpu = Tensor::rand(vec![4, 1, 20, 20], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap().to_dtype(dt).unwrap();
        let g_cpu = Tensor::rand(vec![4, 1, 20, 20], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap().to_dtype(dt).unwrap();
        let bias_grad = |device: Device, count: bool| {
            let x = x_cpu.to_device(device).unwrap();
            let b = Tensor::zeros(vec![1], dt, device).unwrap().requires_grad_(true).unwrap();
            let y = x.add(&b.reshape(vec![1, 1, 1, 1]).unwrap()).unwrap();
            let before = ptl_autograd::internal::cuda::counters();
            y.backward_with(&g_cpu.to_device(device).unwrap()).unwrap();
            let launched = ptl_autograd::internal::cuda::counters().since(&before).kernel_launches;
            let grad = b.grad().unwrap().to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()[0];
            (grad, if count { launched } else { 0 })
        };
        let (want, _) = bias_grad(Device::Cpu, false);
        let (got, launches) = bias_grad(dev, true);
        assert!((got - want).abs() <= tol(dt) * want.abs().max(1.0), "{dt}: {got} against the CPU's {want}");
        // The reshape's backward is a view; the sum to one value is one block's pass.
        assert_eq!(launches, 1, "{dt}: launches for the bias gradient");
        assert_eq!(bias_grad(dev, false).0.to_bits(), got.to_bits(), "{dt}: the same bytes again");
    }
    println!("ok one-channel bias gradient: one launch, f32 and bf16 within tolerance of the CPU");
}

/// The gradient of `index_select` is an `index_add` onto zeros that reads no zeroed buffer: no
/// memset, and the CPU's bytes (each target's rows added in ascending order in f32 on both).
#[test]
fn index_select_gradient_needs_no_zeroed_buffer() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(41);
    let idx: Vec<i64> = (0..700).map(|r| ((r * 37) % 300) as i64).collect();
    let x0 = Tensor::rand(vec![2, 300, 3], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
    let g0 = Tensor::rand(vec![2, 700, 3], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
    let grad = |device: Device| {
        let x = x0.to_device(device).unwrap().requires_grad_(true).unwrap();
        let y = x.index_select(1, &Tensor::from_vec(idx.clone(), idx.len(), device).unwrap()).unwrap();
        let before = ptl_autograd::internal::cuda::counters();
        y.backward_with(&g0.to_device(device).unwrap()).unwrap();
        let memsets = ptl_autograd::internal::cuda::counters().since(&before).memsets;
        (x.grad().unwrap().to_bytes().unwrap(), memsets)
    };
    let (want, _) = grad(Device::Cpu);
    let (got, memsets) = grad(dev);
    assert_eq!(memsets, 0, "no zeroed buffer for the gradient");
    assert!(got == want, "the CPU's bytes");
    println!("ok index_select gradient: no memset, the CPU's bytes");
}

#[path = "clamp_mask.rs"]
mod clamp_mask;

/// `clamp`'s one-comparison gradient mask on the GPU: the two comparisons' bytes (see
/// `clamp_mask.rs`), in f32 and f64.
#[test]
fn clamp_gradient_matches_two_comparisons_on_the_gpu() {
    let Some(dev) = gpu() else { return };
    clamp_mask::clamp_gradient_matches_two_comparisons(dev);
    println!("ok clamp gradient: the two comparisons' bytes on the GPU, f32 and f64");
}

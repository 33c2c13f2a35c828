//! Channels-last tensors (step 1 of docs/channels-last.md): a 4-D tensor converted to
//! `MemoryFormat::ChannelsLast` stores (N, H, W, C) and every op still computes what it computes
//! on the contiguous tensor — outputs and gradients byte for byte — because operands are read in
//! the logical order; in-place writes into one are refused.

use ptl_autograd::{BatchNormOptions, DType, Device, MemoryFormat, Rng, Tensor};

fn rand(dims: &[usize], seed: u64) -> Tensor {
    Tensor::rand(dims.to_vec(), -1.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(seed)).unwrap()
}

fn raw_bytes(t: &Tensor) -> Vec<u8> {
    t.with_storage(|s| s.to_cpu().unwrap().as_bytes().to_vec())
}

#[test]
fn channels_last_stores_nhwc_and_reads_as_nchw() {
    let x = rand(&[2, 3, 4, 5], 1);
    let y = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    assert_eq!(x.memory_format(), MemoryFormat::Contiguous);
    assert_eq!(y.memory_format(), MemoryFormat::ChannelsLast);
    assert_eq!(y.dims(), x.dims(), "the shape stays the logical NCHW one");
    assert_eq!(y.to_bytes().unwrap(), x.to_bytes().unwrap(), "reads give the logical order");
    let nhwc = x.permute(&[0, 2, 3, 1]).unwrap().to_bytes().unwrap();
    assert_eq!(raw_bytes(&y), nhwc, "the storage holds (N, H, W, C)");
    assert_ne!(raw_bytes(&y), raw_bytes(&x));
    let back = y.to_memory_format(MemoryFormat::Contiguous).unwrap();
    assert_eq!(back.memory_format(), MemoryFormat::Contiguous);
    assert_eq!(raw_bytes(&back), raw_bytes(&x));
    assert_eq!(y.to_memory_format(MemoryFormat::ChannelsLast).unwrap().storage_ptr(), y.storage_ptr(), "no copy when already there");
    assert_eq!(y.detach().memory_format(), MemoryFormat::ChannelsLast, "a detached handle keeps the format");
    assert_eq!(y.requires_grad_(true).unwrap().memory_format(), MemoryFormat::ChannelsLast);
    assert_eq!(y.deep_copy().unwrap().memory_format(), MemoryFormat::Contiguous, "a deep copy is contiguous");
    assert_eq!(y.deep_copy().unwrap().to_bytes().unwrap(), x.to_bytes().unwrap());
}

#[test]
fn channels_last_is_for_four_dimensions() {
    let e = rand(&[3, 4, 5], 2).to_memory_format(MemoryFormat::ChannelsLast).unwrap_err().to_string();
    assert!(e.contains("4-D") && e.contains("[3, 4, 5]"), "{e}");
}

#[test]
fn in_place_writes_into_channels_last_are_refused() {
    let x = rand(&[1, 2, 3, 3], 3);
    let y = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    for e in [y.copy_(&x).unwrap_err().to_string(), y.add_(&x).unwrap_err().to_string()] {
        assert!(e.contains("in-place") && e.contains("to_memory_format(Contiguous)"), "{e}");
    }
    assert_eq!(y.to_bytes().unwrap(), x.to_bytes().unwrap(), "the refused writes changed nothing");
    // Reading from one in place is fine: the source is read in the logical order.
    let z = Tensor::zeros(vec![1, 2, 3, 3], DType::F32, Device::Cpu).unwrap();
    z.copy_(&y).unwrap();
    assert_eq!(z.to_bytes().unwrap(), x.to_bytes().unwrap());
    z.add_(&y).unwrap();
    assert_eq!(z.to_bytes().unwrap(), x.mul_scalar(2.0).unwrap().to_bytes().unwrap());
}

/// Every op family of the model on a channels-last input: the same output bytes and the same
/// input gradient bytes as on the contiguous input.
#[test]
fn every_op_family_computes_the_same_on_channels_last_inputs() {
    let w = rand(&[4, 3, 3, 3], 5);
    let w1 = rand(&[3, 3, 1, 1], 6);
    let other = rand(&[2, 3, 6, 6], 7);
    let per_channel = rand(&[1, 3, 1, 1], 8);
    let (bn_w, bn_b) = (rand(&[3], 9), rand(&[3], 10));
    type Op<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;
    let ops: Vec<(&str, Op)> = vec![
        ("add same shape", Box::new(|x: &Tensor| x.add(&other).unwrap())),
        ("mul per-channel broadcast", Box::new(|x: &Tensor| x.mul(&per_channel).unwrap())),
        ("add two channels-last", Box::new(|x: &Tensor| x.add(&x.to_memory_format(MemoryFormat::ChannelsLast).unwrap()).unwrap())),
        ("silu", Box::new(|x: &Tensor| x.silu().unwrap())),
        ("affine", Box::new(|x: &Tensor| x.affine(0.5, 0.25).unwrap())),
        ("conv 3x3", Box::new(|x: &Tensor| x.conv2d(&w, None, (1, 1), (1, 1), 1).unwrap())),
        ("conv 1x1", Box::new(|x: &Tensor| x.conv2d(&w1, None, (1, 1), (0, 0), 1).unwrap())),
        ("depthwise conv", Box::new(|x: &Tensor| x.conv2d(&rand(&[3, 1, 3, 3], 11), None, (2, 2), (1, 1), 3).unwrap())),
        ("max pool", Box::new(|x: &Tensor| x.max_pool2d(3, 1, 1).unwrap())),
        ("upsample", Box::new(|x: &Tensor| x.upsample_nearest(2).unwrap())),
        ("cat along C with a contiguous one", Box::new(|x: &Tensor| Tensor::cat(&[x, &other], 1).unwrap())),
        ("chunk along C", Box::new(|x: &Tensor| x.chunk(3, 1).unwrap()[1].clone())),
        ("narrow along W", Box::new(|x: &Tensor| x.narrow(3, 1, 4).unwrap())),
        ("reshape", Box::new(|x: &Tensor| x.reshape(vec![2, 3, 36]).unwrap())),
        ("permute", Box::new(|x: &Tensor| x.permute(&[0, 2, 3, 1]).unwrap())),
        ("softmax over W", Box::new(|x: &Tensor| x.softmax(-1).unwrap())),
        ("sum over H, W", Box::new(|x: &Tensor| x.sum_dims(&[2, 3], false).unwrap())),
        (
            "batch norm + SiLU (training)",
            Box::new(|x: &Tensor| {
                let (rm, rv) =
                    (Tensor::zeros(vec![3], DType::F32, Device::Cpu).unwrap(), Tensor::ones(vec![3], DType::F32, Device::Cpu).unwrap());
                x.batch_norm2d_silu(&bn_w, &bn_b, &rm, &rv, BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 }).unwrap()
            }),
        ),
        ("cast to bf16", Box::new(|x: &Tensor| x.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap())),
        (
            "conv under bf16 autocast",
            Box::new(|x: &Tensor| {
                ptl_autograd::autocast(Some(DType::BF16), || x.conv2d(&w, None, (1, 1), (1, 1), 1).unwrap()).to_dtype(DType::F32).unwrap()
            }),
        ),
    ];
    for (name, op) in &ops {
        let run = |channels_last: bool| -> (Vec<u8>, Vec<u8>) {
            let x = rand(&[2, 3, 6, 6], 4).requires_grad_(true).unwrap();
            let input = if channels_last { x.to_memory_format(MemoryFormat::ChannelsLast).unwrap() } else { x.clone() };
            let y = op(&input);
            y.mul(&y.scalar_like(1.0).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            (y.to_bytes().unwrap(), x.grad().expect("a gradient reaches the input").to_bytes().unwrap())
        };
        let (plain, cl) = (run(false), run(true));
        assert_eq!(cl.0, plain.0, "{name}: output");
        assert_eq!(cl.1, plain.1, "{name}: input gradient");
    }
}

/// The gradient of a channels-last tensor reaches the contiguous leaf it came from in the leaf's
/// order, and accumulates there over two backward passes.
#[test]
fn gradients_flow_back_in_the_source_format() {
    let x = rand(&[1, 2, 3, 3], 12).requires_grad_(true).unwrap();
    let y = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    let scale = rand(&[1, 2, 3, 3], 13);
    for _ in 0..2 {
        y.mul(&scale).unwrap().sum_all().unwrap().backward().unwrap();
    }
    let g = x.grad().unwrap();
    assert_eq!(g.memory_format(), MemoryFormat::Contiguous);
    assert_eq!(g.to_bytes().unwrap(), scale.mul_scalar(2.0).unwrap().to_bytes().unwrap());
    // A channels-last leaf gets its gradient kept contiguous, accumulated in place.
    let leaf = y.detach().requires_grad_(true).unwrap();
    for _ in 0..2 {
        leaf.mul(&scale).unwrap().sum_all().unwrap().backward().unwrap();
    }
    let g = leaf.grad().unwrap();
    assert_eq!(g.memory_format(), MemoryFormat::Contiguous);
    assert_eq!(g.to_bytes().unwrap(), scale.mul_scalar(2.0).unwrap().to_bytes().unwrap());
}

/// Step 2's element-by-element ops: unary ops, casts and binary ops between two channels-last
/// operands of one shape compute on the storage as it lies and stay channels-last; a binary op
/// with a contiguous or broadcast operand reads in the logical order and gives a contiguous
/// result. Values and input gradients are the contiguous ops' bytes either way.
#[test]
fn elementwise_ops_keep_channels_last() {
    let (x, other) = (rand(&[2, 3, 4, 5], 7), rand(&[2, 3, 4, 5], 8));
    let bias = rand(&[1, 3, 1, 1], 9);
    let cl = |t: &Tensor| t.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    // (name, the result's format from a contiguous input, then from a channels-last one, op):
    // an operand that is channels-last with the result's shape makes the result channels-last.
    type Case<'a> = (&'a str, [MemoryFormat; 2], Box<dyn Fn(&Tensor, &Tensor) -> Tensor + 'a>);
    let (c, l) = (MemoryFormat::Contiguous, MemoryFormat::ChannelsLast);
    let cases: Vec<Case> = vec![
        ("silu", [c, l], Box::new(|a: &Tensor, _: &Tensor| a.silu().unwrap())),
        ("affine", [c, l], Box::new(|a: &Tensor, _: &Tensor| a.affine(2.0, -0.5).unwrap())),
        ("cast", [c, l], Box::new(|a: &Tensor, _: &Tensor| a.to_dtype(DType::F64).unwrap())),
        ("add of two", [l, l], Box::new(|a: &Tensor, b: &Tensor| a.add(&cl(b)).unwrap())),
        ("mul of two", [l, l], Box::new(|a: &Tensor, b: &Tensor| a.mul(&cl(b)).unwrap())),
        ("add of a contiguous one", [c, l], Box::new(|a: &Tensor, b: &Tensor| a.add(b).unwrap())),
        ("contiguous one minus it", [c, l], Box::new(|a: &Tensor, b: &Tensor| b.sub(a).unwrap())),
        ("add of a broadcast bias", [c, l], Box::new(|a: &Tensor, _: &Tensor| a.add(&bias).unwrap())),
        ("broadcast bias times it", [c, l], Box::new(|a: &Tensor, _: &Tensor| bias.mul(a).unwrap())),
    ];
    for (name, formats, op) in &cases {
        let run = |channels_last: bool| -> (MemoryFormat, Vec<u8>, Vec<u8>) {
            let leaf = x.detach().requires_grad_(true).unwrap();
            let input = if channels_last { cl(&leaf) } else { leaf.clone() };
            let y = op(&input, &other);
            let f = y.memory_format();
            y.to_dtype(DType::F32).unwrap().mul(&other).unwrap().sum_all().unwrap().backward().unwrap();
            (f, y.to_bytes().unwrap(), leaf.grad().expect("input gradient").to_bytes().unwrap())
        };
        let (plain, nhwc) = (run(false), run(true));
        assert_eq!([plain.0, nhwc.0], *formats, "{name}: the result's format");
        assert_eq!(nhwc.1, plain.1, "{name}: values");
        assert_eq!(nhwc.2, plain.2, "{name}: input gradient");
    }
}

/// Nearest upsampling of a channels-last tensor runs on the N, H, W, C storage (the CPU and CUDA
/// kernels both have the layout) and stays channels-last: values and input gradients are the
/// contiguous op's bytes.
#[test]
fn upsampling_keeps_channels_last() {
    let x = rand(&[2, 3, 4, 5], 11);
    let mix = rand(&[2, 3, 8, 10], 12);
    let run = |channels_last: bool| -> (MemoryFormat, Vec<u8>, Vec<u8>) {
        let leaf = x.detach().requires_grad_(true).unwrap();
        let input = if channels_last { leaf.to_memory_format(MemoryFormat::ChannelsLast).unwrap() } else { leaf.clone() };
        let y = input.upsample_nearest(2).unwrap();
        let f = y.memory_format();
        y.mul(&mix).unwrap().sum_all().unwrap().backward().unwrap();
        (f, y.to_bytes().unwrap(), leaf.grad().expect("input gradient").to_bytes().unwrap())
    };
    let (plain, nhwc) = (run(false), run(true));
    assert_eq!((plain.0, nhwc.0), (MemoryFormat::Contiguous, MemoryFormat::ChannelsLast));
    assert_eq!(nhwc.1, plain.1, "values");
    assert_eq!(nhwc.2, plain.2, "input gradient");
}

/// Max pooling of a channels-last tensor (SPPF's 5×5, stride 1, and a strided 3×3) runs on the
/// N, H, W, C storage and stays channels-last: values and input gradients are the contiguous
/// op's bytes (ties included: the input has repeated values).
#[test]
fn max_pooling_keeps_channels_last() {
    let x = rand(&[2, 3, 6, 7], 13).mul_scalar(4.0).unwrap().floor().unwrap();
    for (k, s, p) in [(5, 1, 2), (3, 2, 1)] {
        let run = |channels_last: bool| -> (MemoryFormat, Vec<u8>, Vec<u8>) {
            let leaf = x.detach().requires_grad_(true).unwrap();
            let input = if channels_last { leaf.to_memory_format(MemoryFormat::ChannelsLast).unwrap() } else { leaf.clone() };
            let y = input.max_pool2d(k, s, p).unwrap();
            let f = y.memory_format();
            let mix = rand(y.dims(), 14);
            y.mul(&mix).unwrap().sum_all().unwrap().backward().unwrap();
            (f, y.to_bytes().unwrap(), leaf.grad().expect("input gradient").to_bytes().unwrap())
        };
        let (plain, nhwc) = (run(false), run(true));
        assert_eq!((plain.0, nhwc.0), (MemoryFormat::Contiguous, MemoryFormat::ChannelsLast), "kernel {k}");
        assert_eq!(nhwc.1, plain.1, "kernel {k}: values");
        assert_eq!(nhwc.2, plain.2, "kernel {k}: input gradient");
    }
}

/// Batch norm (+SiLU) takes a channels-last input as it lies and gives a channels-last output and
/// input gradient (the CPU runs its planar loops on rearranged copies: the contiguous input's
/// bytes), in training and in eval mode, with the same running statistics.
#[test]
fn batch_norm_keeps_channels_last() {
    let x = rand(&[2, 5, 4, 3], 15);
    let (w, b) = (rand(&[5], 16), rand(&[5], 17));
    for training in [true, false] {
        for silu in [true, false] {
            let run = |channels_last: bool| -> (MemoryFormat, Vec<Vec<u8>>) {
                let leaf = x.detach().requires_grad_(true).unwrap();
                let (w, b) = (w.detach().requires_grad_(true).unwrap(), b.detach().requires_grad_(true).unwrap());
                let (rm, rv) = (rand(&[5], 18), rand(&[5], 19).add_scalar(2.0).unwrap());
                let input = if channels_last { leaf.to_memory_format(MemoryFormat::ChannelsLast).unwrap() } else { leaf.clone() };
                let y = input.batch_norm2d_fused(&w, &b, &rm, &rv, BatchNormOptions { training, momentum: 0.03, eps: 1e-3 }, silu).unwrap();
                let f = y.memory_format();
                y.mul(&rand(y.dims(), 20)).unwrap().sum_all().unwrap().backward().unwrap();
                let bytes = [&y, &leaf.grad().unwrap(), &w.grad().unwrap(), &b.grad().unwrap(), &rm, &rv].map(|t| t.to_bytes().unwrap());
                (f, bytes.to_vec())
            };
            let (plain, nhwc) = (run(false), run(true));
            assert_eq!((plain.0, nhwc.0), (MemoryFormat::Contiguous, MemoryFormat::ChannelsLast), "training {training}");
            for (k, part) in ["y", "input gradient", "weight gradient", "bias gradient", "running mean", "running var"].iter().enumerate() {
                assert_eq!(nhwc.1[k], plain.1[k], "training {training} silu {silu}: {part}");
            }
        }
    }
}

/// The batched cast with memory formats (autocast's weight copies): each result holds the bytes
/// of a cast then a conversion, stored in the asked format; the backward hands each input a
/// gradient in its own format with the bytes of the tensor-by-tensor path's; a 2-D tensor
/// cannot be asked for channels-last.
#[test]
fn batched_casts_change_formats_on_the_way() {
    let w3 = rand(&[6, 4, 3, 3], 50).requires_grad_(true).unwrap();
    let w1 = rand(&[6, 6, 1, 1], 51).requires_grad_(true).unwrap();
    let cl_in = rand(&[2, 3, 2, 5], 52).to_memory_format(MemoryFormat::ChannelsLast).unwrap().requires_grad_(true).unwrap();
    let inputs = [w3.clone(), w1.clone(), cl_in.clone()];
    let formats = [MemoryFormat::ChannelsLast, MemoryFormat::Contiguous, MemoryFormat::Contiguous];
    let mix: Vec<Tensor> = inputs.iter().enumerate().map(|(i, t)| rand(t.dims(), 60 + i as u64).to_dtype(DType::BF16).unwrap()).collect();
    let run = |batched: bool| -> Vec<Vec<u8>> {
        for t in &inputs {
            t.zero_grad();
        }
        let out = match batched {
            true => Tensor::to_dtype_many_in(&inputs, DType::BF16, &formats).unwrap(),
            false => inputs.iter().zip(formats).map(|(t, f)| t.to_dtype(DType::BF16).unwrap().to_memory_format(f).unwrap()).collect(),
        };
        let mut v = Vec::new();
        for ((o, f), m) in out.iter().zip(formats).zip(&mix) {
            assert_eq!((o.dtype(), o.memory_format()), (DType::BF16, f));
            v.push(raw_bytes(o));
            o.mul(m).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
        }
        for t in &inputs {
            let g = t.grad().expect("gradient");
            assert_eq!((g.dtype(), g.to_memory_format(t.memory_format()).unwrap().memory_format()), (DType::F32, t.memory_format()));
            v.push(g.to_bytes().unwrap());
        }
        v
    };
    let (batched, single) = (run(true), run(false));
    assert_eq!(batched, single, "batched casts with formats against a cast and a conversion each");
    let nhwc = w3.to_dtype(DType::BF16).unwrap().permute(&[0, 2, 3, 1]).unwrap().to_bytes().unwrap();
    assert_eq!(batched[0], nhwc, "the 3×3 copy is stored (O, H, W, I)");
    let e = Tensor::to_dtype_many_in(&[rand(&[4, 5], 70)], DType::BF16, &[MemoryFormat::ChannelsLast]).unwrap_err().to_string();
    assert!(e.contains("4-D") && e.contains("[4, 5]"), "{e}");
    let e = Tensor::to_dtype_many_in(&[rand(&[4, 5], 70)], DType::BF16, &[]).unwrap_err().to_string();
    assert!(e.contains("0 formats for 1 tensors"), "{e}");
}

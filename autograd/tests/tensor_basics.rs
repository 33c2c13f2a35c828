//! dtypes, casts, safetensors round trips, BatchNorm running statistics, typed errors.

use half::{bf16, f16};
use ptl_autograd::module::{from_safetensors_bytes, to_safetensors_bytes};
use ptl_autograd::{hash, BatchNormOptions, DType, Device, Error, Rng, Tensor};

#[test]
fn half_storage_and_casts() {
    let x = Tensor::from_vec(vec![1.0f32, -2.5, 3.140625, 65504.0], 4, Device::Cpu).unwrap();
    let h = x.to_dtype(DType::F16).unwrap();
    assert_eq!(h.dtype(), DType::F16);
    assert_eq!(h.to_vec::<f16>().unwrap()[2], f16::from_f32(3.140625));
    let b = x.to_dtype(DType::BF16).unwrap();
    assert_eq!(b.to_vec::<bf16>().unwrap()[1], bf16::from_f32(-2.5));
    // Arithmetic on halves is done in f32 and rounded once.
    let s = h.add(&h).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(s[..3], [2.0, -5.0, 6.28125]);
    assert!(s[3].is_infinite(), "65504 + 65504 overflows f16");
    let i = x.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(i, vec![1, -2, 3, 65504]);
    let m = x.gt_scalar(0.0).unwrap();
    assert_eq!(m.dtype(), DType::Bool);
    assert_eq!(m.to_vec::<bool>().unwrap(), vec![true, false, true, true]);
}

#[test]
fn safetensors_round_trip_keeps_names_dtypes_bytes() {
    let mut rng = Rng::new(9);
    let items = vec![
        ("model.0.conv.weight".to_string(), Tensor::randn(vec![4, 3, 3, 3], 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap()),
        ("model.0.bn.num_batches_tracked".to_string(), Tensor::from_vec(vec![7i64], (), Device::Cpu).unwrap()),
        ("h".to_string(), Tensor::randn(vec![5], 0.0, 1.0, DType::BF16, Device::Cpu, &mut rng).unwrap()),
        ("m".to_string(), Tensor::from_vec(vec![1u8, 0, 1], 3, Device::Cpu).unwrap()),
    ];
    let bytes = to_safetensors_bytes(&items).unwrap();
    let back = from_safetensors_bytes(&bytes, Device::Cpu, "memory").unwrap();
    assert_eq!(back.len(), items.len());
    for (n, t) in &items {
        let (_, b) = back.iter().find(|(bn, _)| bn == n).unwrap();
        assert_eq!(b.dtype(), t.dtype());
        assert_eq!(b.dims(), t.dims());
        assert_eq!(hash::tensor_hash(b).unwrap(), hash::tensor_hash(t).unwrap());
    }
    let err = from_safetensors_bytes(&bytes[..bytes.len() / 2], Device::Cpu, "truncated.safetensors").unwrap_err();
    assert!(matches!(err, Error::SafeTensors { .. }), "{err}");
}

#[test]
fn batch_norm_running_stats_hand_values() {
    // One channel, values 1..4: batch mean 2.5, biased var 1.25, unbiased var 5/3.
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], vec![2, 1, 1, 2], Device::Cpu).unwrap();
    let w = Tensor::ones(vec![1], DType::F64, Device::Cpu).unwrap();
    let b = Tensor::zeros(vec![1], DType::F64, Device::Cpu).unwrap();
    let rm = Tensor::zeros(vec![1], DType::F64, Device::Cpu).unwrap();
    let rv = Tensor::ones(vec![1], DType::F64, Device::Cpu).unwrap();
    let (rm_addr, rv_addr) = (rm.storage_ptr(), rv.storage_ptr());
    let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
    let y = x.batch_norm2d(&w, &b, &rm, &rv, opts).unwrap().to_vec::<f64>().unwrap();
    let expect_rm = 0.03 * 2.5;
    let expect_rv = 0.97 * 1.0 + 0.03 * (5.0 / 3.0);
    assert!((rm.item().unwrap() - expect_rm).abs() < 1e-15);
    assert!((rv.item().unwrap() - expect_rv).abs() < 1e-15);
    assert_eq!((rm.storage_ptr(), rv.storage_ptr()), (rm_addr, rv_addr), "running stats updated in place");
    let inv = 1.0 / (1.25f64 + 1e-3).sqrt();
    for (i, v) in [1.0, 2.0, 3.0, 4.0].iter().enumerate() {
        assert!((y[i] - (v - 2.5) * inv).abs() < 1e-12);
    }
    // Eval mode uses the running statistics and leaves them alone.
    let eval = BatchNormOptions { training: false, ..opts };
    let ye = x.batch_norm2d(&w, &b, &rm, &rv, eval).unwrap().to_vec::<f64>().unwrap();
    assert!((ye[0] - (1.0 - expect_rm) / (expect_rv + 1e-3).sqrt()).abs() < 1e-12);
    assert!((rm.item().unwrap() - expect_rm).abs() < 1e-15);
}

#[test]
fn bad_input_is_a_typed_error() {
    let a = Tensor::zeros(vec![2, 3], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros(vec![4, 3], DType::F32, Device::Cpu).unwrap();
    assert!(matches!(a.add(&b), Err(Error::BroadcastIncompatible { op: "binary", .. }) | Err(Error::BroadcastIncompatible { .. })));
    assert!(matches!(a.matmul(&b), Err(Error::ShapeMismatch { op: "matmul", .. })));
    assert!(matches!(a.sum_dim(2, false), Err(Error::DimOutOfRange { .. })));
    assert!(matches!(a.reshape(vec![5]), Err(Error::ReshapeNumel { .. })));
    let h = a.to_dtype(DType::F16).unwrap();
    assert_eq!(a.add(&h).unwrap().dtype(), DType::F32, "mixed float operands promote to the wider type");
    let i = a.to_dtype(DType::I64).unwrap();
    assert!(matches!(a.add(&i), Err(Error::DTypeMismatch { .. })));
    let idx = Tensor::from_vec(vec![0i64, 5], 2, Device::Cpu).unwrap();
    assert!(matches!(a.index_select(1, &idx), Err(Error::IndexOutOfRange { index: 5, size: 3, .. })));
    let img = Tensor::zeros(vec![1, 3, 8, 8], DType::F32, Device::Cpu).unwrap();
    let w = Tensor::zeros(vec![4, 2, 3, 3], DType::F32, Device::Cpu).unwrap();
    let e = img.conv2d(&w, None, (1, 1), (1, 1), 1).unwrap_err().to_string();
    assert!(e.contains("conv2d") && e.contains("[4, 2, 3, 3]"), "{e}");
    assert!(Tensor::from_vec(vec![1.0f32; 5], vec![2, 3], Device::Cpu).is_err());
    assert!(Device::parse("tpu").is_err());
    assert_eq!(Device::parse("cuda:1").unwrap(), Device::Cuda(1));
}

#[test]
fn topk_argmax_and_ties() {
    let x = Tensor::from_vec(vec![1.0f32, 3.0, 3.0, 0.5, 2.0, 2.0], vec![2, 3], Device::Cpu).unwrap();
    let (v, i) = x.topk(2, 1, true).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![3.0, 3.0, 2.0, 2.0]);
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 2, 1, 2], "ties keep the lower index first");
    assert_eq!(x.argmax(1, false).unwrap().to_vec::<i64>().unwrap(), vec![1, 1]);
    let (mv, mi) = x.max_dim(0, false).unwrap();
    assert_eq!(mv.to_vec::<f32>().unwrap(), vec![1.0, 3.0, 3.0]);
    assert_eq!(mi.to_vec::<i64>().unwrap(), vec![0, 0, 0]);
}

#[test]
fn in_place_updates_keep_storage_identity() {
    let p = Tensor::zeros(vec![3], DType::F32, Device::Cpu).unwrap().requires_grad_(true).unwrap();
    let addr = p.storage_ptr();
    let new = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], 3, Device::Cpu).unwrap();
    p.copy_(&new).unwrap();
    p.add_(&new).unwrap();
    assert_eq!(p.storage_ptr(), addr);
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    assert!(p.copy_(&Tensor::zeros(vec![4], DType::F32, Device::Cpu).unwrap()).is_err());
}

#[test]
fn rng_is_deterministic_and_hash_detects_changes() {
    let a = Tensor::rand(vec![64], 0.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
    let b = Tensor::rand(vec![64], 0.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
    let c = Tensor::rand(vec![64], 0.0, 1.0, DType::F32, Device::Cpu, &mut Rng::new(2)).unwrap();
    assert_eq!(hash::tensor_hash(&a).unwrap(), hash::tensor_hash(&b).unwrap());
    assert_ne!(hash::tensor_hash(&a).unwrap(), hash::tensor_hash(&c).unwrap());
    let mut r = Rng::new(5);
    let first: Vec<u32> = (0..6).map(|_| r.next_u32()).collect();
    let (seed, off, used) = r.state();
    let next = r.next_u32();
    let mut restored = Rng::from_state(seed, off, used);
    assert_eq!(restored.next_u32(), next);
    assert_ne!(first[0], first[1]);
}

#[test]
fn autocast_runs_conv_in_bf16_and_grads_reach_f32_weights() {
    let mut rng = Rng::new(3);
    let x = Tensor::randn(vec![1, 2, 5, 5], 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
    let w = Tensor::randn(vec![3, 2, 3, 3], 0.0, 0.5, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let y = ptl_autograd::autocast(Some(DType::BF16), || x.conv2d(&w, None, (1, 1), (1, 1), 1)).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let exact = x.conv2d(&w.detach(), None, (1, 1), (1, 1), 1).unwrap().to_f64_vec().unwrap();
    let low = y.to_f64_vec().unwrap();
    let max = exact.iter().fold(0f64, |m, v| m.max(v.abs()));
    let dev = exact.iter().zip(&low).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(dev / max < 2e-2, "bf16 conv deviates {dev} of {max}");
    y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
}

#[test]
fn nonzero_static_keeps_the_first_positions_and_pads() {
    let m = Tensor::from_vec(vec![0.0f32, 2.0, 0.0, -1.0, f32::NAN, 0.0, 3.0], vec![7], Device::Cpu).unwrap();
    let at = |size: usize| m.nonzero_static(size, -1).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(at(4), vec![1, 3, 4, 6], "NaN counts as non-zero, as in PyTorch");
    assert_eq!(at(2), vec![1, 3], "truncated to the size");
    assert_eq!(at(6), vec![1, 3, 4, 6, -1, -1], "padded with the fill");
    assert!(at(0).is_empty());
    let grid = Tensor::from_vec(vec![0u8, 1, 1, 0, 0, 1], vec![2, 3], Device::Cpu).unwrap();
    assert_eq!(grid.nonzero_static(3, 0).unwrap().to_vec::<i64>().unwrap(), vec![1, 2, 5], "flat positions of a 2-d mask");
}

/// A permutation that moves only dims of size 1 is a view of the same storage (no copy), with the
/// values and gradient of a copying permute; other permutations still copy.
#[test]
fn permuting_unit_dims_is_a_view() {
    let mut rng = Rng::new(3);
    let x = Tensor::rand(vec![2, 1, 5], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap().requires_grad_(true).unwrap();
    let y = x.permute(&[0, 2, 1]).unwrap();
    assert_eq!(y.dims(), [2, 5, 1]);
    assert_eq!(y.storage_ptr(), x.storage_ptr(), "moving the size-1 dim keeps the storage");
    assert_eq!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap(), "the same order of values");
    let w = Tensor::rand(vec![2, 5, 1], -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap();
    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().dims(), [2, 1, 5]);
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap(), "the gradient comes back in x's order");
    // A real transpose copies, and its values are the transposed ones.
    let z = Tensor::from_vec((0..6).map(|v| v as f32).collect::<Vec<_>>(), vec![1, 2, 3], Device::Cpu).unwrap();
    let t = z.permute(&[0, 2, 1]).unwrap();
    assert_ne!(t.storage_ptr(), z.storage_ptr());
    assert_eq!(t.to_vec::<f32>().unwrap(), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    // Moving two size-1 dims around the others, order of the others kept: a view too.
    let u = Tensor::zeros(vec![1, 3, 1, 4], DType::F32, Device::Cpu).unwrap();
    assert_eq!(u.permute(&[1, 0, 3, 2]).unwrap().storage_ptr(), u.storage_ptr());
}

//! The CPU backend: `Vec`-backed storage, rayon-parallel loops, GEMM through the `gemm` crate.
//! Half types (f16/bf16) are widened to f32 for arithmetic and narrowed on output.

mod conv;
mod deferred;
mod elementwise;
mod fused;
mod index;
mod matmul;
mod multi_tensor;
mod pack;
mod random;
mod reduce;

use half::{bf16, f16};

use crate::backend::{BackendStorage, BinaryOp, CmpOp, Conv2dParams, MatmulParams, Pool2dParams, ReduceOp, UnaryOp};
use crate::shape::Layout;
use crate::{DType, Device, Error, Result};

/// Host storage, one variant per dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// i64 elements.
    I64(Vec<i64>),
    /// u8 elements.
    U8(Vec<u8>),
    /// bool elements (0 or 1 bytes).
    Bool(Vec<u8>),
}

/// Work below this many elements stays on one thread (rayon overhead dominates).
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

pub(crate) fn widen_f16(v: &[f16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}
pub(crate) fn widen_bf16(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}
pub(crate) fn narrow_f16(v: Vec<f32>) -> Vec<f16> {
    v.into_iter().map(f16::from_f32).collect()
}
pub(crate) fn narrow_bf16(v: Vec<f32>) -> Vec<bf16> {
    v.into_iter().map(bf16::from_f32).collect()
}

/// Runs a float kernel on any float storage: f32/f64 directly, halves through f32.
macro_rules! float_map {
    ($s:expr, $op:expr, |$v:ident| $body:expr) => {
        match $s {
            CpuStorage::F32($v) => Ok(CpuStorage::F32($body)),
            CpuStorage::F64($v) => Ok(CpuStorage::F64($body)),
            CpuStorage::F16(h) => {
                let w = crate::cpu::widen_f16(h);
                let $v = &w;
                Ok(CpuStorage::F16(crate::cpu::narrow_f16($body)))
            }
            CpuStorage::BF16(h) => {
                let w = crate::cpu::widen_bf16(h);
                let $v = &w;
                Ok(CpuStorage::BF16(crate::cpu::narrow_bf16($body)))
            }
            other => Err(Error::UnsupportedDType { op: $op, dtype: other.dtype(), expected: "a float dtype" }),
        }
    };
}

/// Runs a kernel on any storage (all dtypes keep their own element type).
macro_rules! any_map {
    ($s:expr, |$v:ident| $body:expr) => {
        match $s {
            CpuStorage::F32($v) => CpuStorage::F32($body),
            CpuStorage::F64($v) => CpuStorage::F64($body),
            CpuStorage::F16($v) => CpuStorage::F16($body),
            CpuStorage::BF16($v) => CpuStorage::BF16($body),
            CpuStorage::I64($v) => CpuStorage::I64($body),
            CpuStorage::U8($v) => CpuStorage::U8($body),
            CpuStorage::Bool($v) => CpuStorage::Bool($body),
        }
    };
}
pub(crate) use any_map;
pub(crate) use float_map;

impl CpuStorage {
    /// A zero-filled storage.
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::I64 => CpuStorage::I64(vec![0; n]),
            DType::U8 => CpuStorage::U8(vec![0; n]),
            DType::Bool => CpuStorage::Bool(vec![0; n]),
        }
    }

    /// A storage filled with `value` (converted to `dtype`).
    pub fn full(dtype: DType, n: usize, value: f64) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![value as f32; n]),
            DType::F64 => CpuStorage::F64(vec![value; n]),
            DType::F16 => CpuStorage::F16(vec![f16::from_f64(value); n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::from_f64(value); n]),
            DType::I64 => CpuStorage::I64(vec![value as i64; n]),
            DType::U8 => CpuStorage::U8(vec![value as u8; n]),
            DType::Bool => CpuStorage::Bool(vec![(value != 0.0) as u8; n]),
        }
    }

    /// Builds a storage of `dtype` from f64 values (used by constructors and RNG).
    pub fn from_f64(dtype: DType, v: &[f64]) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F64 => CpuStorage::F64(v.to_vec()),
            DType::F16 => CpuStorage::F16(v.iter().map(|&x| f16::from_f64(x)).collect()),
            DType::BF16 => CpuStorage::BF16(v.iter().map(|&x| bf16::from_f64(x)).collect()),
            DType::I64 => CpuStorage::I64(v.iter().map(|&x| x as i64).collect()),
            DType::U8 => CpuStorage::U8(v.iter().map(|&x| x as u8).collect()),
            DType::Bool => CpuStorage::Bool(v.iter().map(|&x| (x != 0.0) as u8).collect()),
        }
    }

    /// Every element as f64 (exact for all dtypes but very large i64).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self {
            CpuStorage::F32(v) => v.iter().map(|&x| x as f64).collect(),
            CpuStorage::F64(v) => v.clone(),
            CpuStorage::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            CpuStorage::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            CpuStorage::I64(v) => v.iter().map(|&x| x as f64).collect(),
            CpuStorage::U8(v) | CpuStorage::Bool(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// Raw little-endian bytes (for hashing and safetensors).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            CpuStorage::F32(v) => bytemuck::cast_slice(v),
            CpuStorage::F64(v) => bytemuck::cast_slice(v),
            CpuStorage::F16(v) => bytemuck::cast_slice(v),
            CpuStorage::BF16(v) => bytemuck::cast_slice(v),
            CpuStorage::I64(v) => bytemuck::cast_slice(v),
            CpuStorage::U8(v) | CpuStorage::Bool(v) => v,
        }
    }

    /// Rebuilds a storage from little-endian bytes.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<Self> {
        let es = dtype.size_in_bytes();
        if !bytes.len().is_multiple_of(es) {
            return Err(Error::invalid("from_bytes", format!("{} bytes is not a multiple of {es} for {dtype}", bytes.len())));
        }
        fn cast<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
            let n = b.len() / std::mem::size_of::<T>();
            let mut out = vec![T::zeroed(); n];
            bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(b);
            out
        }
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(cast(bytes)),
            DType::F64 => CpuStorage::F64(cast(bytes)),
            DType::F16 => CpuStorage::F16(cast(bytes)),
            DType::BF16 => CpuStorage::BF16(cast(bytes)),
            DType::I64 => CpuStorage::I64(cast(bytes)),
            DType::U8 => CpuStorage::U8(bytes.to_vec()),
            DType::Bool => CpuStorage::Bool(bytes.to_vec()),
        })
    }

    pub(crate) fn as_i64(&self, op: &'static str) -> Result<&[i64]> {
        match self {
            CpuStorage::I64(v) => Ok(v),
            other => Err(Error::UnsupportedDType { op, dtype: other.dtype(), expected: "I64 indices" }),
        }
    }
}

impl BackendStorage for CpuStorage {
    fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
            CpuStorage::Bool(_) => DType::Bool,
        }
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
            CpuStorage::U8(v) | CpuStorage::Bool(v) => v.len(),
        }
    }
    fn unary(&self, op: UnaryOp) -> Result<Self> {
        elementwise::unary(self, op)
    }
    fn binary(&self, l: &Layout, rhs: &Self, r: &Layout, op: BinaryOp) -> Result<Self> {
        elementwise::binary(self, l, rhs, r, op)
    }
    fn cmp(&self, l: &Layout, rhs: &Self, r: &Layout, op: CmpOp) -> Result<Self> {
        elementwise::cmp(self, l, rhs, r, op)
    }
    fn where_cond(&self, cl: &Layout, a: &Self, al: &Layout, b: &Self, bl: &Layout) -> Result<Self> {
        elementwise::where_cond(self, cl, a, al, b, bl)
    }
    fn reduce(&self, shape: &[usize], dim: usize, op: ReduceOp) -> Result<Self> {
        reduce::reduce(self, shape, dim, op)
    }
    fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(elementwise::cast(self, dtype))
    }
    fn copy_strided(&self, src_l: &Layout, dst: &mut Self, dst_l: &Layout) -> Result<()> {
        index::copy_strided(self, src_l, dst, dst_l)
    }
    fn add_assign(&mut self, src: &Self) -> Result<()> {
        elementwise::add_assign(self, src)
    }
    fn index_select(&self, shape: &[usize], dim: usize, idx: &Self) -> Result<Self> {
        index::index_select(self, shape, dim, idx)
    }
    fn index_add(&self, shape: &[usize], dim: usize, idx: &Self, src: &Self) -> Result<Self> {
        index::index_add(self, shape, dim, idx, src)
    }
    fn gather(&self, shape: &[usize], dim: usize, idx: &Self, idx_shape: &[usize]) -> Result<Self> {
        index::gather(self, shape, dim, idx, idx_shape)
    }
    fn scatter_add(&self, shape: &[usize], dim: usize, idx: &Self, idx_shape: &[usize], src: &Self) -> Result<Self> {
        index::scatter_add(self, shape, dim, idx, idx_shape, src)
    }
    fn matmul(&self, rhs: &Self, p: &MatmulParams) -> Result<Self> {
        matmul::matmul(self, rhs, p)
    }
    fn matmul_add(&self, rhs: &Self, c: &Self, p: &MatmulParams, alpha: f64, beta: f64) -> Result<Self> {
        matmul::matmul_add(self, rhs, c, p, alpha, beta)
    }
    fn conv2d(&self, weight: &Self, p: &Conv2dParams) -> Result<Self> {
        conv::conv2d(self, weight, p)
    }
    fn conv2d_backward_input(&self, weight: &Self, p: &Conv2dParams) -> Result<Self> {
        conv::conv2d_backward_input(self, weight, p)
    }
    fn conv2d_backward_weight(&self, input: &Self, p: &Conv2dParams) -> Result<Self> {
        conv::conv2d_backward_weight(self, input, p)
    }
    fn max_pool2d(&self, p: &Pool2dParams) -> Result<(Self, Self)> {
        conv::max_pool2d(self, p)
    }
    fn max_pool2d_backward(&self, indices: &Self, p: &Pool2dParams) -> Result<Self> {
        conv::max_pool2d_backward(self, indices, p)
    }
    fn upsample_nearest2d(&self, shape: [usize; 4], factor: usize, channels_last: bool) -> Result<Self> {
        match channels_last {
            false => float_map!(self, "upsample_nearest2d", |v| conv::upsample_fwd(v, shape, factor)),
            true => float_map!(self, "upsample_nearest2d", |v| conv::upsample_fwd_nhwc(v, shape, factor)),
        }
    }
    fn upsample_nearest2d_backward(&self, shape: [usize; 4], factor: usize, channels_last: bool) -> Result<Self> {
        match channels_last {
            false => float_map!(self, "upsample_nearest2d_backward", |v| conv::upsample_bwd(v, shape, factor)),
            true => float_map!(self, "upsample_nearest2d_backward", |v| conv::upsample_bwd_nhwc(v, shape, factor)),
        }
    }
    fn topk(&self, shape: &[usize], dim: usize, k: usize, largest: bool) -> Result<(Self, Self)> {
        reduce::topk(self, shape, dim, k, largest)
    }
    fn nonzero_static(&self, size: usize, fill: i64) -> Result<Self> {
        Ok(index::nonzero_static(self, size, fill))
    }
    fn batch_norm_train_stats(
        &self,
        shape: &[usize],
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        batches: Option<&mut Self>,
        eps: f64,
        momentum: f64,
        channels_last: bool,
    ) -> Result<(Self, Self)> {
        // The per-channel sums run over the planes (the same bytes as the contiguous tensor's).
        let x = conv::planes_of(self, shape, channels_last)?;
        fused::batch_norm_train_stats(&x, shape, weight, bias, running_mean, running_var, batches, eps, momentum)
    }
    fn channel_affine(&self, shape: &[usize], params: &Self, silu: bool, channels_last: bool) -> Result<Self> {
        let x = conv::planes_of(self, shape, channels_last)?;
        let y = fused::channel_affine(&x, shape, params, silu)?;
        conv::stored_as(y, shape, channels_last)
    }
    fn batch_norm_act_backward(
        &self,
        g: &Self,
        g2: Option<&Self>,
        shape: &[usize],
        aff: &Self,
        nrm: &Self,
        w: &Self,
        silu: bool,
        training: bool,
        channels_last: bool,
    ) -> Result<(Self, Self, Self)> {
        // Two contributions are added first, as the elementwise addition stores them.
        let all = Layout::contiguous(&[self.len()]);
        let sum = g2.map(|g2| g.binary(&all, g2, &all, BinaryOp::Add)).transpose()?;
        let g = sum.as_ref().unwrap_or(g);
        let (x, g) = (conv::planes_of(self, shape, channels_last)?, conv::planes_of(g, shape, channels_last)?);
        let (dx, gw, gb) = fused::batch_norm_act_backward(&x, &g, shape, aff, nrm, w, silu, training)?;
        Ok((conv::stored_as(dx, shape, channels_last)?, gw, gb))
    }
    fn softmax(&self, shape: &[usize], dim: usize, log: bool) -> Result<Self> {
        fused::softmax(self, shape, dim, log)
    }
    fn batch_norm_eval_params(&self, bias: &Self, running_mean: &Self, running_var: &Self, eps: f64) -> Result<(Self, Self)> {
        fused::batch_norm_eval_params(self, bias, running_mean, running_var, eps)
    }
}

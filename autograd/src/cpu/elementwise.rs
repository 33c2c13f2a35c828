//! Element-wise CPU kernels: unary maps, broadcast binary/compare/select, casts.

use num_traits::Float;
use rayon::prelude::*;

use super::{CpuStorage, PAR_THRESHOLD};
use crate::backend::{BackendStorage, BinaryOp, CmpOp, UnaryOp};
use crate::shape::Layout;
use crate::{DType, Error, Result};

#[inline]
fn c<T: Float>(v: f64) -> T {
    T::from(v).unwrap_or_else(T::nan)
}

impl UnaryOp {
    /// The scalar function, shared by every float type.
    #[inline]
    pub fn apply<T: Float>(self, x: T) -> T {
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Abs => x.abs(),
            UnaryOp::Sigmoid => sigmoid(x),
            UnaryOp::Silu => x * sigmoid(x),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Softplus => {
                if x > c(20.0) {
                    x
                } else {
                    x.exp().ln_1p()
                }
            }
            UnaryOp::Atan => x.atan(),
            UnaryOp::Recip => x.recip(),
            UnaryOp::Sign => {
                if x > T::zero() {
                    T::one()
                } else if x < T::zero() {
                    -T::one()
                } else {
                    x * T::zero()
                }
            }
            UnaryOp::Square => x * x,
            UnaryOp::Relu => {
                if x > T::zero() {
                    x
                } else {
                    T::zero()
                }
            }
            UnaryOp::Floor => x.floor(),
            UnaryOp::Ceil => x.ceil(),
            UnaryOp::Powf(p) => x.powf(c(p)),
            UnaryOp::Clamp(lo, hi) => {
                if x.is_nan() {
                    x
                } else {
                    x.max(c(lo)).min(c(hi))
                }
            }
            UnaryOp::Affine(m, a) => x * c(m) + c(a),
            UnaryOp::SiluGrad => {
                let s = sigmoid(x);
                s * (T::one() + x * (T::one() - s))
            }
        }
    }
}

#[inline]
fn sigmoid<T: Float>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

impl BinaryOp {
    /// The op on two floats.
    #[inline]
    pub fn apply<T: Float>(self, a: T, b: T) -> T {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Maximum => {
                if a.is_nan() || b.is_nan() {
                    T::nan()
                } else {
                    a.max(b)
                }
            }
            BinaryOp::Minimum => {
                if a.is_nan() || b.is_nan() {
                    T::nan()
                } else {
                    a.min(b)
                }
            }
            BinaryOp::Pow => a.powf(b),
            BinaryOp::Atan2 => a.atan2(b),
            BinaryOp::BceWithLogits => {
                let relu = if a > T::zero() { a } else { T::zero() };
                relu - a * b + (-a.abs()).exp().ln_1p()
            }
        }
    }

    fn apply_i64(self, a: i64, b: i64) -> Option<i64> {
        Some(match self {
            BinaryOp::Add => a.wrapping_add(b),
            BinaryOp::Sub => a.wrapping_sub(b),
            BinaryOp::Mul => a.wrapping_mul(b),
            BinaryOp::Div => {
                if b == 0 {
                    return None;
                }
                a.div_euclid(b)
            }
            BinaryOp::Maximum => a.max(b),
            BinaryOp::Minimum => a.min(b),
            BinaryOp::Pow | BinaryOp::Atan2 | BinaryOp::BceWithLogits => return None,
        })
    }

    fn apply_u8(self, a: u8, b: u8) -> Option<u8> {
        Some(match self {
            BinaryOp::Add => a.wrapping_add(b),
            BinaryOp::Sub => a.wrapping_sub(b),
            BinaryOp::Mul => a.wrapping_mul(b),
            BinaryOp::Maximum => a.max(b),
            BinaryOp::Minimum => a.min(b),
            _ => return None,
        })
    }
}

impl CmpOp {
    /// The comparison of two values.
    #[inline]
    pub fn apply<T: PartialOrd>(self, a: T, b: T) -> bool {
        match self {
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
        }
    }
}

fn map_slice<T: Copy + Send + Sync, O: Send>(v: &[T], f: impl Fn(T) -> O + Sync + Send) -> Vec<O> {
    if v.len() >= PAR_THRESHOLD {
        v.par_iter().map(|&x| f(x)).collect()
    } else {
        v.iter().map(|&x| f(x)).collect()
    }
}

pub(crate) fn unary(s: &CpuStorage, op: UnaryOp) -> Result<CpuStorage> {
    match (s, op) {
        (CpuStorage::I64(v), UnaryOp::Neg) => return Ok(CpuStorage::I64(map_slice(v, |x| -x))),
        (CpuStorage::I64(v), UnaryOp::Abs) => return Ok(CpuStorage::I64(map_slice(v, |x| x.abs()))),
        (CpuStorage::I64(v), UnaryOp::Affine(m, a)) if m.fract() == 0.0 && a.fract() == 0.0 => {
            let (m, a) = (m as i64, a as i64);
            return Ok(CpuStorage::I64(map_slice(v, move |x| x * m + a)));
        }
        (CpuStorage::I64(v), UnaryOp::Clamp(lo, hi)) => return Ok(CpuStorage::I64(map_slice(v, move |x| (x as f64).clamp(lo, hi) as i64))),
        _ => {}
    }
    super::float_map!(s, "unary", |v| map_slice(v, move |x| op.apply(x)))
}

/// Zips two strided views of the same logical shape through `f`.
pub(crate) fn zip2<A: Copy + Sync, B: Copy + Sync, O: Send + Copy + Default>(
    a: &[A],
    la: &Layout,
    b: &[B],
    lb: &Layout,
    f: impl Fn(A, B) -> O + Sync + Send,
) -> Vec<O> {
    let n = la.numel();
    if la.is_contiguous() && lb.is_contiguous() && la.offset == 0 && lb.offset == 0 {
        let (a, b) = (&a[..n], &b[..n]);
        if n >= PAR_THRESHOLD {
            return a.par_iter().zip(b.par_iter()).map(|(&x, &y)| f(x, y)).collect();
        }
        return a.iter().zip(b.iter()).map(|(&x, &y)| f(x, y)).collect();
    }
    let rank = la.shape.len();
    if rank == 0 {
        return vec![f(a[la.offset], b[lb.offset])];
    }
    // Row-wise: all dims but the last are walked by offset iterators; the last dim is a tight loop.
    let inner = la.shape[rank - 1];
    let (sa, sb) = (la.strides[rank - 1], lb.strides[rank - 1]);
    let outer_a = Layout { shape: la.shape[..rank - 1].to_vec(), strides: la.strides[..rank - 1].to_vec(), offset: la.offset };
    let outer_b = Layout { shape: lb.shape[..rank - 1].to_vec(), strides: lb.strides[..rank - 1].to_vec(), offset: lb.offset };
    let offs: Vec<(usize, usize)> = outer_a.offsets().zip(outer_b.offsets()).collect();
    let mut out = vec![O::default(); n];
    if inner == 0 {
        return out;
    }
    let row = |(o, &(oa, ob)): (&mut [O], &(usize, usize))| {
        for (j, slot) in o.iter_mut().enumerate() {
            *slot = f(a[oa + j * sa], b[ob + j * sb]);
        }
    };
    if n >= PAR_THRESHOLD {
        out.par_chunks_mut(inner).zip(offs.par_iter()).for_each(|(o, off)| row((o, off)));
    } else {
        out.chunks_mut(inner).zip(offs.iter()).for_each(|(o, off)| row((o, off)));
    }
    out
}

pub(crate) fn binary(a: &CpuStorage, la: &Layout, b: &CpuStorage, lb: &Layout, op: BinaryOp) -> Result<CpuStorage> {
    use CpuStorage as S;
    let unsupported = || Error::UnsupportedDType { op: "binary", dtype: a.dtype(), expected: "a float dtype for this op" };
    Ok(match (a, b) {
        (S::F32(x), S::F32(y)) => S::F32(zip2(x, la, y, lb, |p, q| op.apply(p, q))),
        (S::F64(x), S::F64(y)) => S::F64(zip2(x, la, y, lb, |p, q| op.apply(p, q))),
        (S::F16(x), S::F16(y)) => {
            S::F16(zip2(x, la, y, lb, |p: half::f16, q: half::f16| half::f16::from_f32(op.apply(p.to_f32(), q.to_f32()))))
        }
        (S::BF16(x), S::BF16(y)) => {
            S::BF16(zip2(x, la, y, lb, |p: half::bf16, q: half::bf16| half::bf16::from_f32(op.apply(p.to_f32(), q.to_f32()))))
        }
        (S::I64(x), S::I64(y)) => {
            op.apply_i64(1, 1).ok_or_else(unsupported)?;
            if op == BinaryOp::Div && y.contains(&0) {
                return Err(Error::invalid("div", "integer division by zero"));
            }
            S::I64(zip2(x, la, y, lb, |p, q| op.apply_i64(p, q).unwrap_or(0)))
        }
        (S::U8(x), S::U8(y)) => {
            op.apply_u8(1, 1).ok_or_else(unsupported)?;
            S::U8(zip2(x, la, y, lb, |p, q| op.apply_u8(p, q).unwrap_or(0)))
        }
        (S::Bool(x), S::Bool(y)) => {
            op.apply_u8(1, 1).ok_or_else(unsupported)?;
            S::Bool(zip2(x, la, y, lb, |p, q| op.apply_u8(p, q).unwrap_or(0).min(1)))
        }
        _ => return Err(Error::DTypeMismatch { op: "binary", lhs: a.dtype(), rhs: b.dtype() }),
    })
}

pub(crate) fn cmp(a: &CpuStorage, la: &Layout, b: &CpuStorage, lb: &Layout, op: CmpOp) -> Result<CpuStorage> {
    use CpuStorage as S;
    Ok(S::Bool(match (a, b) {
        (S::F32(x), S::F32(y)) => zip2(x, la, y, lb, |p, q| op.apply(p, q) as u8),
        (S::F64(x), S::F64(y)) => zip2(x, la, y, lb, |p, q| op.apply(p, q) as u8),
        (S::F16(x), S::F16(y)) => zip2(x, la, y, lb, |p, q| op.apply(p, q) as u8),
        (S::BF16(x), S::BF16(y)) => zip2(x, la, y, lb, |p, q| op.apply(p, q) as u8),
        (S::I64(x), S::I64(y)) => zip2(x, la, y, lb, |p, q| op.apply(p, q) as u8),
        (S::U8(x), S::U8(y)) | (S::Bool(x), S::Bool(y)) => zip2(x, la, y, lb, |p, q| op.apply(p, q) as u8),
        _ => return Err(Error::DTypeMismatch { op: "cmp", lhs: a.dtype(), rhs: b.dtype() }),
    }))
}

pub(crate) fn where_cond(cond: &CpuStorage, lc: &Layout, a: &CpuStorage, la: &Layout, b: &CpuStorage, lb: &Layout) -> Result<CpuStorage> {
    let c: Vec<u8> = match cond {
        CpuStorage::U8(v) | CpuStorage::Bool(v) => v.clone(),
        other => other.to_f64_vec().iter().map(|&x| (x != 0.0) as u8).collect(),
    };
    // Materialise the condition in the output shape, then select pairwise.
    let out_l = Layout::contiguous(&lc.shape);
    let cm: Vec<u8> = lc.offsets().map(|o| c[o]).collect();
    let pick = |ca: &[u8]| -> Vec<(usize, bool)> { ca.iter().enumerate().map(|(i, &x)| (i, x != 0)).collect() };
    let sel = pick(&cm);
    let _ = out_l;
    macro_rules! sel {
        ($x:expr, $y:expr) => {{
            let xa: Vec<_> = la.offsets().map(|o| $x[o]).collect();
            let yb: Vec<_> = lb.offsets().map(|o| $y[o]).collect();
            sel.iter().map(|&(i, t)| if t { xa[i] } else { yb[i] }).collect()
        }};
    }
    use CpuStorage as S;
    Ok(match (a, b) {
        (S::F32(x), S::F32(y)) => S::F32(sel!(x, y)),
        (S::F64(x), S::F64(y)) => S::F64(sel!(x, y)),
        (S::F16(x), S::F16(y)) => S::F16(sel!(x, y)),
        (S::BF16(x), S::BF16(y)) => S::BF16(sel!(x, y)),
        (S::I64(x), S::I64(y)) => S::I64(sel!(x, y)),
        (S::U8(x), S::U8(y)) => S::U8(sel!(x, y)),
        (S::Bool(x), S::Bool(y)) => S::Bool(sel!(x, y)),
        _ => return Err(Error::DTypeMismatch { op: "where_cond", lhs: a.dtype(), rhs: b.dtype() }),
    })
}

pub(crate) fn cast(s: &CpuStorage, dtype: DType) -> CpuStorage {
    use half::{bf16, f16};
    use CpuStorage as S;
    if s.dtype() == dtype {
        return s.clone();
    }
    match (s, dtype) {
        (S::F32(v), DType::F16) => S::F16(map_slice(v, f16::from_f32)),
        (S::F32(v), DType::BF16) => S::BF16(map_slice(v, bf16::from_f32)),
        (S::F32(v), DType::F64) => S::F64(map_slice(v, |x| x as f64)),
        (S::F16(v), DType::F32) => S::F32(map_slice(v, |x| x.to_f32())),
        (S::BF16(v), DType::F32) => S::F32(map_slice(v, |x| x.to_f32())),
        (S::F64(v), DType::F32) => S::F32(map_slice(v, |x| x as f32)),
        (_, DType::Bool) => S::Bool(s.to_f64_vec().iter().map(|&x| (x != 0.0) as u8).collect()),
        (_, DType::I64) => S::I64(s.to_f64_vec().iter().map(|&x| x as i64).collect()),
        (S::I64(v), _) => CpuStorage::from_f64(dtype, &v.iter().map(|&x| x as f64).collect::<Vec<_>>()),
        _ => CpuStorage::from_f64(dtype, &s.to_f64_vec()),
    }
}

pub(crate) fn add_assign(dst: &mut CpuStorage, src: &CpuStorage) -> Result<()> {
    use CpuStorage as S;
    if dst.len() != src.len() {
        return Err(Error::ShapeMismatch { op: "add_assign", lhs: vec![dst.len()], rhs: vec![src.len()] });
    }
    match (dst, src) {
        (S::F32(d), S::F32(s)) => d.iter_mut().zip(s).for_each(|(a, &b)| *a += b),
        (S::F64(d), S::F64(s)) => d.iter_mut().zip(s).for_each(|(a, &b)| *a += b),
        (S::F16(d), S::F16(s)) => d.iter_mut().zip(s).for_each(|(a, &b)| *a = half::f16::from_f32(a.to_f32() + b.to_f32())),
        (S::BF16(d), S::BF16(s)) => d.iter_mut().zip(s).for_each(|(a, &b)| *a = half::bf16::from_f32(a.to_f32() + b.to_f32())),
        (S::I64(d), S::I64(s)) => d.iter_mut().zip(s).for_each(|(a, &b)| *a += b),
        (d, s) => return Err(Error::DTypeMismatch { op: "add_assign", lhs: d.dtype(), rhs: s.dtype() }),
    }
    Ok(())
}

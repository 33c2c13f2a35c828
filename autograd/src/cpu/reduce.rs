//! Reductions along one dimension and top-k. Sums accumulate in f64 in a fixed order, so results
//! are deterministic and independent of the thread count.

use num_traits::Float;
use rayon::prelude::*;

use super::{CpuStorage, PAR_THRESHOLD};
use crate::backend::{BackendStorage, ReduceOp};
use crate::{Error, Result};

/// (outer, size of dim, inner) of a contiguous shape.
pub(crate) fn split3(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

fn reduce_float<T: Float + Send + Sync>(v: &[T], (outer, d, inner): (usize, usize, usize), op: ReduceOp) -> Vec<T> {
    let cell = |o: usize, i: usize| -> T {
        let at = |j: usize| v[(o * d + j) * inner + i];
        match op {
            ReduceOp::Sum => {
                let mut acc = 0f64;
                for j in 0..d {
                    acc += at(j).to_f64().unwrap_or(f64::NAN);
                }
                T::from(acc).unwrap_or_else(T::nan)
            }
            ReduceOp::Max | ReduceOp::Min => {
                let mut best = at(0);
                for j in 1..d {
                    let x = at(j);
                    if best.is_nan() {
                        break;
                    }
                    if x.is_nan() || (op == ReduceOp::Max && x > best) || (op == ReduceOp::Min && x < best) {
                        best = x;
                    }
                }
                best
            }
            ReduceOp::ArgMax | ReduceOp::ArgMin => unreachable!("handled by arg_reduce"),
        }
    };
    let n = outer * inner;
    if n * d >= PAR_THRESHOLD {
        (0..n).into_par_iter().map(|k| cell(k / inner, k % inner)).collect()
    } else {
        (0..n).map(|k| cell(k / inner, k % inner)).collect()
    }
}

fn arg_reduce<T: PartialOrd + Copy + Send + Sync>(
    v: &[T],
    (outer, d, inner): (usize, usize, usize),
    max: bool,
    is_nan: impl Fn(T) -> bool + Sync,
) -> Vec<i64> {
    (0..outer * inner)
        .map(|k| {
            let (o, i) = (k / inner, k % inner);
            let at = |j: usize| v[(o * d + j) * inner + i];
            let mut best = 0usize;
            for j in 1..d {
                let (x, b) = (at(j), at(best));
                if is_nan(b) {
                    break;
                }
                if is_nan(x) || (max && x > b) || (!max && x < b) {
                    best = j;
                }
            }
            best as i64
        })
        .collect()
}

pub(crate) fn reduce(s: &CpuStorage, shape: &[usize], dim: usize, op: ReduceOp) -> Result<CpuStorage> {
    let geo = split3(shape, dim);
    if geo.1 == 0 && op != ReduceOp::Sum {
        return Err(Error::invalid("reduce", format!("{op:?} over an empty dimension {dim} of {shape:?}")));
    }
    if matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin) {
        let max = op == ReduceOp::ArgMax;
        let out = match s {
            CpuStorage::F32(v) => arg_reduce(v, geo, max, |x: f32| x.is_nan()),
            CpuStorage::F64(v) => arg_reduce(v, geo, max, |x: f64| x.is_nan()),
            CpuStorage::F16(v) => arg_reduce(&super::widen_f16(v), geo, max, |x: f32| x.is_nan()),
            CpuStorage::BF16(v) => arg_reduce(&super::widen_bf16(v), geo, max, |x: f32| x.is_nan()),
            CpuStorage::I64(v) => arg_reduce(v, geo, max, |_| false),
            CpuStorage::U8(v) | CpuStorage::Bool(v) => arg_reduce(v, geo, max, |_| false),
        };
        return Ok(CpuStorage::I64(out));
    }
    match s {
        CpuStorage::I64(v) => {
            let (outer, d, inner) = geo;
            let out = (0..outer * inner)
                .map(|k| {
                    let (o, i) = (k / inner, k % inner);
                    let it = (0..d).map(|j| v[(o * d + j) * inner + i]);
                    match op {
                        ReduceOp::Sum => it.sum(),
                        ReduceOp::Max => it.max().unwrap_or(0),
                        _ => it.min().unwrap_or(0),
                    }
                })
                .collect();
            Ok(CpuStorage::I64(out))
        }
        CpuStorage::U8(_) | CpuStorage::Bool(_) => {
            let wide = super::elementwise::cast(s, crate::DType::I64);
            reduce(&wide, shape, dim, op)
        }
        _ => super::float_map!(s, "reduce", |v| reduce_float(v, geo, op)),
    }
}

fn topk_impl<T: PartialOrd + Copy>(v: &[T], (outer, d, inner): (usize, usize, usize), k: usize, largest: bool) -> (Vec<T>, Vec<i64>) {
    let mut vals = Vec::with_capacity(outer * k * inner);
    let mut idxs = vec![0i64; outer * k * inner];
    let mut tmp_v = Vec::with_capacity(outer * k * inner);
    for o in 0..outer {
        for i in 0..inner {
            let mut items: Vec<(usize, T)> = (0..d).map(|j| (j, v[(o * d + j) * inner + i])).collect();
            // Stable sort: ties keep the lower index first.
            items.sort_by(|a, b| {
                let ord = a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal);
                if largest {
                    ord.reverse()
                } else {
                    ord
                }
            });
            for (r, (j, x)) in items.into_iter().take(k).enumerate() {
                let at = (o * k + r) * inner + i;
                idxs[at] = j as i64;
                tmp_v.push((at, x));
            }
        }
    }
    tmp_v.sort_by_key(|p| p.0);
    vals.extend(tmp_v.into_iter().map(|p| p.1));
    (vals, idxs)
}

pub(crate) fn topk(s: &CpuStorage, shape: &[usize], dim: usize, k: usize, largest: bool) -> Result<(CpuStorage, CpuStorage)> {
    let geo = split3(shape, dim);
    if k > geo.1 {
        return Err(Error::invalid("topk", format!("k = {k} exceeds size {} of dim {dim} in {shape:?}", geo.1)));
    }
    use CpuStorage as S;
    let (v, i) = match s {
        S::F32(v) => {
            let (a, b) = topk_impl(v, geo, k, largest);
            (S::F32(a), b)
        }
        S::F64(v) => {
            let (a, b) = topk_impl(v, geo, k, largest);
            (S::F64(a), b)
        }
        S::F16(v) => {
            let (a, b) = topk_impl(v, geo, k, largest);
            (S::F16(a), b)
        }
        S::BF16(v) => {
            let (a, b) = topk_impl(v, geo, k, largest);
            (S::BF16(a), b)
        }
        S::I64(v) => {
            let (a, b) = topk_impl(v, geo, k, largest);
            (S::I64(a), b)
        }
        S::U8(v) => {
            let (a, b) = topk_impl(v, geo, k, largest);
            (S::U8(a), b)
        }
        S::Bool(v) => {
            let (a, b) = topk_impl(v, geo, k, largest);
            (S::Bool(a), b)
        }
    };
    Ok((v, S::I64(i)))
}

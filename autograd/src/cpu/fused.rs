//! Fused batch-norm helpers: per-channel statistics and the per-channel affine (+SiLU) map.

use super::CpuStorage;
use crate::backend::{stats_dtype, BackendStorage};
use crate::{Error, Result};

fn nchw(op: &'static str, shape: &[usize], len: usize) -> Result<(usize, usize, usize)> {
    if shape.len() != 4 || shape.iter().product::<usize>() != len {
        return Err(Error::invalid(op, format!("expected a contiguous NCHW tensor, got shape {shape:?} for {len} elements")));
    }
    Ok((shape[0], shape[1], shape[2] * shape[3]))
}

fn stats_vec(op: &'static str, s: &CpuStorage, want: crate::DType, c: usize) -> Result<Vec<f64>> {
    if s.dtype() != want || s.len() != c {
        return Err(Error::invalid(op, format!("expected {c} values of {want}, got {} of {}", s.len(), s.dtype())));
    }
    Ok(s.to_f64_vec())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_train_stats(
    x: &CpuStorage,
    shape: &[usize],
    w: &CpuStorage,
    b: &CpuStorage,
    rm: &mut CpuStorage,
    rv: &mut CpuStorage,
    batches: Option<&mut CpuStorage>,
    eps: f64,
    momentum: f64,
) -> Result<(CpuStorage, CpuStorage)> {
    const OP: &str = "batch_norm_train_stats";
    if !x.dtype().is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: x.dtype(), expected: "a float dtype" });
    }
    let batches = match batches {
        None => None,
        Some(CpuStorage::I64(v)) if v.len() == 1 => Some(v),
        Some(s) => return Err(Error::invalid(OP, format!("the batch counter must be one i64, got {} of {}", s.len(), s.dtype()))),
    };
    let (n, c, hw) = nchw(OP, shape, x.len())?;
    let sd = stats_dtype(x.dtype());
    let (wv, bv, rmv, rvv) = (stats_vec(OP, w, sd, c)?, stats_vec(OP, b, sd, c)?, stats_vec(OP, rm, sd, c)?, stats_vec(OP, rv, sd, c)?);
    let xv = x.to_f64_vec();
    let count = (n * hw) as f64;
    let (mut aff, mut nrm, mut nrm_rm, mut nrm_rv) = (vec![0.0; 2 * c], vec![0.0; 2 * c], rmv.clone(), rvv.clone());
    for ch in 0..c {
        let mut sum = 0.0;
        for ni in 0..n {
            sum += xv[(ni * c + ch) * hw..(ni * c + ch + 1) * hw].iter().sum::<f64>();
        }
        let mean = sum / count;
        let mut sq = 0.0;
        for ni in 0..n {
            sq += xv[(ni * c + ch) * hw..(ni * c + ch + 1) * hw].iter().map(|v| (v - mean) * (v - mean)).sum::<f64>();
        }
        let var = sq / count;
        let invstd = 1.0 / (var + eps).sqrt();
        let scale = wv[ch] * invstd;
        aff[ch] = scale;
        aff[c + ch] = bv[ch] - mean * scale;
        nrm[ch] = invstd;
        nrm[c + ch] = -mean * invstd;
        let unbiased = if count > 1.0 { var * count / (count - 1.0) } else { var };
        nrm_rm[ch] = (1.0 - momentum) * rmv[ch] + momentum * mean;
        nrm_rv[ch] = (1.0 - momentum) * rvv[ch] + momentum * unbiased;
    }
    *rm = CpuStorage::from_f64(sd, &nrm_rm);
    *rv = CpuStorage::from_f64(sd, &nrm_rv);
    if let Some(count) = batches {
        count[0] += 1;
    }
    let _ = (&mut nrm_rm, &mut nrm_rv);
    Ok((CpuStorage::from_f64(sd, &aff), CpuStorage::from_f64(sd, &nrm)))
}

pub(crate) fn channel_affine(x: &CpuStorage, shape: &[usize], p: &CpuStorage, silu: bool) -> Result<CpuStorage> {
    const OP: &str = "channel_affine";
    let (_, c, hw) = nchw(OP, shape, x.len())?;
    let sd = stats_dtype(x.dtype());
    let pv = stats_vec(OP, p, sd, 2 * c)?;
    fn map<T: num_traits::Float>(v: &[T], c: usize, hw: usize, p: &[f64], silu: bool) -> Vec<T> {
        let (sc, sh): (Vec<T>, Vec<T>) = (
            p[..c].iter().map(|&a| T::from(a).unwrap_or_else(T::nan)).collect(),
            p[c..].iter().map(|&a| T::from(a).unwrap_or_else(T::nan)).collect(),
        );
        v.iter()
            .enumerate()
            .map(|(i, &x)| {
                let ch = (i / hw) % c;
                let z = x * sc[ch] + sh[ch];
                if silu {
                    z / (T::one() + (-z).exp())
                } else {
                    z
                }
            })
            .collect()
    }
    super::float_map!(x, OP, |v| map(v, c, hw, &pv, silu))
}

/// See [`BackendStorage::batch_norm_act_backward`]: per channel in f64 (the CPU reference of the
/// CUDA kernels).
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_act_backward(
    x: &CpuStorage,
    g: &CpuStorage,
    shape: &[usize],
    aff: &CpuStorage,
    nrm: &CpuStorage,
    w: &CpuStorage,
    silu: bool,
    training: bool,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    const OP: &str = "batch_norm_act_backward";
    if !x.dtype().is_float() || g.dtype() != x.dtype() || g.len() != x.len() {
        return Err(Error::invalid(
            OP,
            format!("x ({} × {}) and g ({} × {}) must be one float dtype and size", x.len(), x.dtype(), g.len(), g.dtype()),
        ));
    }
    let (n, c, hw) = nchw(OP, shape, x.len())?;
    let sd = stats_dtype(x.dtype());
    let (av, nv, wv) = (stats_vec(OP, aff, sd, 2 * c)?, stats_vec(OP, nrm, sd, 2 * c)?, stats_vec(OP, w, sd, c)?);
    let (xv, gv) = (x.to_f64_vec(), g.to_f64_vec());
    let gz_at = |i: usize, ch: usize| -> (f64, f64) {
        let z = xv[i] * av[ch] + av[c + ch];
        let gz = if silu {
            let s = 1.0 / (1.0 + (-z).exp());
            gv[i] * (s * (1.0 + z * (1.0 - s)))
        } else {
            gv[i]
        };
        (gz, xv[i] * nv[ch] + nv[c + ch])
    };
    let count = (n * hw) as f64;
    let (mut gw, mut gb, mut dx) = (vec![0.0; c], vec![0.0; c], vec![0.0; x.len()]);
    for ch in 0..c {
        let (mut s1, mut s2) = (0.0, 0.0);
        for ni in 0..n {
            for i in (ni * c + ch) * hw..(ni * c + ch + 1) * hw {
                let (gz, xh) = gz_at(i, ch);
                s1 += gz;
                s2 += gz * xh;
            }
        }
        gb[ch] = s1;
        gw[ch] = s2;
        let k = wv[ch] * nv[ch];
        let (b0, c0) = if training { (-k * s1 / count, -k * s2 / count) } else { (0.0, 0.0) };
        for ni in 0..n {
            let start = (ni * c + ch) * hw;
            for (i, d) in dx[start..start + hw].iter_mut().enumerate() {
                let (gz, xh) = gz_at(start + i, ch);
                *d = k * gz + b0 + c0 * xh;
            }
        }
    }
    Ok((CpuStorage::from_f64(x.dtype(), &dx), CpuStorage::from_f64(sd, &gw), CpuStorage::from_f64(sd, &gb)))
}

pub(crate) fn softmax(x: &CpuStorage, shape: &[usize], dim: usize, log: bool) -> Result<CpuStorage> {
    let (outer, d, inner) = super::reduce::split3(shape, dim);
    fn run<T: num_traits::Float>(v: &[T], outer: usize, d: usize, inner: usize, log: bool) -> Vec<T> {
        let mut out = vec![T::zero(); v.len()];
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: usize| (o * d + j) * inner + i;
                let mut m = T::neg_infinity();
                for j in 0..d {
                    let x = v[at(j)];
                    if x > m || x.is_nan() {
                        m = x;
                    }
                }
                let mut s = 0f64;
                for j in 0..d {
                    s += (v[at(j)] - m).exp().to_f64().unwrap_or(f64::NAN);
                }
                let st = T::from(s).unwrap_or_else(T::nan);
                for j in 0..d {
                    let xm = v[at(j)] - m;
                    out[at(j)] = if log { xm - st.ln() } else { xm.exp() / st };
                }
            }
        }
        out
    }
    super::float_map!(x, "softmax", |v| run(v, outer, d, inner, log))
}

pub(crate) fn batch_norm_eval_params(
    w: &CpuStorage,
    b: &CpuStorage,
    rm: &CpuStorage,
    rv: &CpuStorage,
    eps: f64,
) -> Result<(CpuStorage, CpuStorage)> {
    const OP: &str = "batch_norm_eval_params";
    let (sd, c) = (w.dtype(), w.len());
    if !sd.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: sd, expected: "a float dtype" });
    }
    let (wv, bv, mv, vv) = (w.to_f64_vec(), stats_vec(OP, b, sd, c)?, stats_vec(OP, rm, sd, c)?, stats_vec(OP, rv, sd, c)?);
    let (mut aff, mut nrm) = (vec![0.0; 2 * c], vec![0.0; 2 * c]);
    for ch in 0..c {
        let invstd = 1.0 / (vv[ch] + eps).sqrt();
        let scale = wv[ch] * invstd;
        aff[ch] = scale;
        aff[c + ch] = bv[ch] - mv[ch] * scale;
        nrm[ch] = invstd;
        nrm[c + ch] = -mv[ch] * invstd;
    }
    Ok((CpuStorage::from_f64(sd, &aff), CpuStorage::from_f64(sd, &nrm)))
}

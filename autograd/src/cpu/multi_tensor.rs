//! Multi-tensor optimizer updates on the CPU: the element-wise sequence of the composed ops
//! (`ops/optim.rs`), rounding where each of them rounds (`mul_scalar` is `x·s + 0` in f32, `lerp`
//! branches on |w| < 0.5), so these loops give the composed bytes — the reference of the CUDA
//! kernels (`cuda/ops/multi_tensor.rs`). Unscaling and norm clipping are not offered here: the
//! composed ops are the CPU's path for those.

use super::CpuStorage;
use crate::backend::{MultiTensorOp, MultiTensorStorage, Operand, ScalarsAt};
use crate::ops::optim::{SgdStep, ADAMW_SCALARS};
use crate::{Error, Result};

/// `mul_scalar`: `x·s + 0` with `s` rounded to f32 (the `+ 0` turns −0 into +0).
#[inline]
fn scale(x: f32, s: f64) -> f32 {
    x * s as f32 + 0.0
}

/// `lerp(start, end, w)` as `ops::optim::lerp` computes it, one element.
#[inline]
fn lerp1(start: f32, end: f32, w: f64) -> f32 {
    let w32 = w as f32;
    let diff = end - start;
    if w32.abs() < 0.5 {
        start + scale(diff, f64::from(w32))
    } else {
        end - scale(diff, f64::from(1.0f32 - w32))
    }
}

fn f32s<'a>(op: &'static str, o: &'a Operand<'_, CpuStorage>) -> Result<&'a [f32]> {
    match o.get() {
        CpuStorage::F32(v) => Ok(v),
        other => {
            Err(Error::invalid(op, format!("a multi-tensor operand must be f32, got {}", crate::backend::BackendStorage::dtype(other))))
        }
    }
}

fn f32s_mut<'a>(op: &'static str, o: &'a mut Operand<'_, CpuStorage>) -> Result<&'a mut Vec<f32>> {
    match o {
        Operand::Write(CpuStorage::F32(v)) => Ok(v),
        _ => Err(Error::invalid(op, "a written multi-tensor operand must be an f32 storage taken for writing")),
    }
}

/// The `n` scalars and whether the update is skipped.
fn read_scalars(op: &'static str, s: &ScalarsAt<'_, CpuStorage>, n: usize) -> Result<(Vec<f64>, bool)> {
    let CpuStorage::F64(v) = s.values else { return Err(Error::invalid(op, "device scalars must be f64")) };
    let values = v.get(s.at..s.at + n).ok_or_else(|| Error::invalid(op, "too few device scalars"))?.to_vec();
    let skipped = match s.skip {
        Some(CpuStorage::F32(f)) => f.first().is_some_and(|x| *x != 0.0),
        Some(_) => return Err(Error::invalid(op, "the skip flag must be f32")),
        None => false,
    };
    Ok((values, skipped))
}

/// One SGD step of a row `[p, g, b?]`, as `Tensor::sgd_step_composed`.
fn sgd_row(row: &mut [Operand<'_, CpuStorage>], h: SgdStep, with_buf: bool) -> Result<()> {
    const OP: &str = "sgd_step_many";
    let [p, g, rest @ ..] = row else { return Err(Error::invalid(OP, "a row needs a parameter and a gradient")) };
    let g = f32s(OP, g)?.to_vec();
    let p = f32s_mut(OP, p)?;
    let mut b = match (with_buf, rest.first_mut()) {
        (true, Some(b)) => Some(f32s_mut(OP, b)?),
        (true, None) => return Err(Error::invalid(OP, "a row without its momentum buffer")),
        (false, _) => None,
    };
    for i in 0..p.len() {
        let gi = if h.weight_decay != 0.0 { g[i] + scale(p[i], h.weight_decay) } else { g[i] };
        let upd = match b.as_deref_mut() {
            Some(b) => {
                let nb = scale(b[i], h.momentum) + gi;
                b[i] = nb;
                if h.nesterov {
                    gi + scale(nb, h.momentum)
                } else {
                    nb
                }
            }
            None => gi,
        };
        p[i] += scale(upd, h.neg_lr);
    }
    Ok(())
}

/// Muon's blend of a row `[m, g, u]`: m′ = lerp(m, g, 1 − β) (stored unless `keep_momentum`),
/// u = lerp(g, m′, β) with Nesterov, else m′.
fn blend_row(row: &mut [Operand<'_, CpuStorage>], beta: f64, nesterov: bool, keep_momentum: bool) -> Result<()> {
    const OP: &str = "momentum_blend_many";
    let [m, g, u] = row else { return Err(Error::invalid(OP, "a row needs momentum, gradient and blend")) };
    let g = f32s(OP, g)?;
    let m = f32s_mut(OP, m)?;
    let u = f32s_mut(OP, u)?;
    for i in 0..m.len() {
        let mi = lerp1(m[i], g[i], 1.0 - beta);
        if !keep_momentum {
            m[i] = mi;
        }
        u[i] = if nesterov { lerp1(g[i], mi, beta) } else { mi };
    }
    Ok(())
}

/// `dst ← lerp(dst, src, w)` of a row `[dst, src]`.
fn lerp_row(row: &mut [Operand<'_, CpuStorage>], w: f64) -> Result<()> {
    const OP: &str = "lerp_many_";
    let [d, s] = row else { return Err(Error::invalid(OP, "a row needs a destination and a source")) };
    let s = f32s(OP, s)?;
    for (di, si) in f32s_mut(OP, d)?.iter_mut().zip(s) {
        *di = lerp1(*di, *si, w);
    }
    Ok(())
}

/// AdamW of a row `[x, g, m, v, count]`, as `ops::optim::adamw_composed` at the count plus one.
fn adamw_row(row: &mut [Operand<'_, CpuStorage>], h: &[f64], weight_decay: bool) -> Result<()> {
    const OP: &str = "adamw_step_many_dev";
    let [x, g, m, v, count] = row else { return Err(Error::invalid(OP, "a row needs x, g, m, v and its count")) };
    let [keep, w1, b2, one_minus_b2, eps, lr, b1] = <[f64; ADAMW_SCALARS]>::try_from(h).map_err(|_| Error::invalid(OP, "scalars"))?;
    let t = match count {
        Operand::Write(CpuStorage::F64(c)) if c.len() == 1 => {
            c[0] += 1.0;
            c[0]
        }
        _ => return Err(Error::invalid(OP, "a step count must be one f64 value taken for writing")),
    };
    let (bc1, bc2) = (1.0 - b1.powf(t), 1.0 - b2.powf(t));
    let (step, inv_bc2) = (-(lr / bc1), 1.0 / bc2.sqrt());
    let g = f32s(OP, g)?;
    let (x, m, v) = (f32s_mut(OP, x)?, f32s_mut(OP, m)?, f32s_mut(OP, v)?);
    for i in 0..x.len() {
        if weight_decay {
            x[i] = scale(x[i], keep);
        }
        m[i] = lerp1(m[i], g[i], w1);
        v[i] = scale(v[i], b2) + scale(g[i], one_minus_b2) * g[i];
        let denom = scale(v[i].sqrt(), inv_bc2) + eps as f32;
        x[i] += scale(m[i] / denom, step);
    }
    Ok(())
}

impl MultiTensorStorage for CpuStorage {
    fn multi_tensor(op: MultiTensorOp<'_, Self>, mut rows: Vec<Vec<Operand<'_, Self>>>) -> Result<Option<Vec<Self>>> {
        match op {
            MultiTensorOp::Sgd { h, with_buf } => rows.iter_mut().try_for_each(|r| sgd_row(r, h, with_buf))?,
            MultiTensorOp::SgdDev { scalars, weight_decay, nesterov, with_buf } => {
                let (v, skipped) = read_scalars("sgd_step_many_dev", &scalars, 3)?;
                if !skipped {
                    let h = SgdStep { weight_decay: if weight_decay { v[0] } else { 0.0 }, momentum: v[1], neg_lr: v[2], nesterov };
                    rows.iter_mut().try_for_each(|r| sgd_row(r, h, with_buf))?;
                }
            }
            MultiTensorOp::Blend { beta, nesterov } => rows.iter_mut().try_for_each(|r| blend_row(r, beta, nesterov, false))?,
            MultiTensorOp::BlendDev { scalars, nesterov } => {
                let (v, skipped) = read_scalars("momentum_blend_many_dev", &scalars, 1)?;
                rows.iter_mut().try_for_each(|r| blend_row(r, v[0], nesterov, skipped))?;
            }
            MultiTensorOp::Lerp { w } => rows.iter_mut().try_for_each(|r| lerp_row(r, w))?,
            MultiTensorOp::LerpDev { scalars } => {
                let (v, _) = read_scalars("lerp_many_dev_", &scalars, 1)?;
                rows.iter_mut().try_for_each(|r| lerp_row(r, v[0]))?;
            }
            MultiTensorOp::AdamWDev { scalars, weight_decay } => {
                let (h, skipped) = read_scalars("adamw_step_many_dev", &scalars, ADAMW_SCALARS)?;
                if !skipped {
                    rows.iter_mut().try_for_each(|r| adamw_row(r, &h, weight_decay))?;
                }
            }
            MultiTensorOp::Unscale { .. } | MultiTensorOp::ClipNorm { .. } => return Ok(None),
        }
        Ok(Some(Vec::new()))
    }
}

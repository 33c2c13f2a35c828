//! Fused optimizer steps over many tensors (PyTorch's fused / `_foreach` SGD): the bytes of the
//! composed tensor ops they stand for, through the backend's multi-tensor kernels
//! ([`crate::backend::MultiTensorStorage`]: one launch per 40 parameters on CUDA instead of about
//! ten per parameter; on the CPU loops that round as the composed ops do). Items a kernel cannot
//! take (another dtype, views, shared storages), and ops a backend does not offer, run composed.
//! Each takes its scalars from the host (baked into the launch) or, in the `*_dev` forms, from
//! device memory ([`DeviceScalars`]): what a recorded update needs to take each step's learning
//! rate, momentum and decay.

use std::sync::{RwLockReadGuard, RwLockWriteGuard};

use crate::backend::{MultiTensorOp, Operand, ScalarsAt};
use crate::storage::Storage;
use crate::{DType, Result, Tensor};

/// One SGD step's hyperparameters (PyTorch semantics, no dampening).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// Weight decay added to the gradient.
    pub weight_decay: f64,
    /// Momentum of the buffer.
    pub momentum: f64,
    /// `−lr · factor`, computed by the caller as the composed update would (in f64).
    pub neg_lr: f64,
    /// Nesterov's update.
    pub nesterov: bool,
}

/// Where a `*_dev` optimizer op reads its scalars: `values[at..]` of an f64 tensor on the operands'
/// device. The host writes them before the step ([`Tensor::write_f64`], outside any recorded
/// graph) and the kernels read them, so a replay uses the step's values. Items the fused kernel
/// cannot take (not CUDA f32, shared storages) run composed with the values read back to the host
/// (a synchronisation on CUDA; on the CPU every item runs so, reading the tensor directly).
///
/// `skip` is an optional f32 0-d flag on the same device (the grad scaler's found-inf): when it
/// holds a non-zero value the SGD step and the momentum blend leave parameters and buffers as they
/// are — the skipped step of 16-mixed decided on the device, with no host read.
#[derive(Clone, Copy)]
pub struct DeviceScalars<'a> {
    /// The device tensor of scalars.
    pub values: &'a Tensor,
    /// Index of the first scalar the update reads.
    pub at: usize,
    /// A device flag that turns the update into a no-op (a skipped loss-scaled step).
    pub skip: Option<&'a Tensor>,
}

/// A small tensor's values as f64 for a composed op: the storage itself on the CPU (a backend
/// reading its own memory, not a transfer: [`crate::host_reads`] does not count it), a counted,
/// synchronising host read elsewhere.
fn values_of(t: &Tensor) -> Result<Vec<f64>> {
    let on_host = t.with_storage(|s| match s {
        crate::storage::Storage::Cpu(c) => Some(c.to_f64_vec()),
        #[allow(unreachable_patterns)]
        _ => None,
    });
    match on_host {
        Some(v) => Ok(v),
        None => t.to_f64_vec(),
    }
}

impl<'a> DeviceScalars<'a> {
    /// `values[at..]`, never skipping.
    pub fn new(values: &'a Tensor, at: usize) -> DeviceScalars<'a> {
        DeviceScalars { values, at, skip: None }
    }
    /// The same scalars `k` values further on (same skip flag).
    pub fn offset(&self, k: usize) -> DeviceScalars<'a> {
        DeviceScalars { values: self.values, at: self.at + k, skip: self.skip }
    }
    /// The same scalars, skipping the update when `flag` (f32, one value) is non-zero.
    pub fn skipping_if(&self, flag: Option<&'a Tensor>) -> DeviceScalars<'a> {
        DeviceScalars { values: self.values, at: self.at, skip: flag }
    }
}

impl DeviceScalars<'_> {
    fn check(&self, op: &'static str, n: usize, device: crate::Device) -> Result<()> {
        if let Some(f) = self.skip {
            if f.dtype() != DType::F32 || f.numel() != 1 {
                return Err(crate::Error::invalid(op, format!("the skip flag must be one f32 value, got {:?} {}", f.dims(), f.dtype())));
            }
            if f.device() != device {
                return Err(crate::Error::DeviceMismatch { op, lhs: device, rhs: f.device() });
            }
        }
        if self.values.dtype() != DType::F64 || self.values.rank() != 1 || self.values.numel() < self.at + n {
            return Err(crate::Error::invalid(
                op,
                format!(
                    "device scalars must be an f64 vector of at least {} values, got {:?} {}",
                    self.at + n,
                    self.values.dims(),
                    self.values.dtype()
                ),
            ));
        }
        if self.values.device() != device {
            return Err(crate::Error::DeviceMismatch { op, lhs: device, rhs: self.values.device() });
        }
        Ok(())
    }
    /// The `n` values, read back to the host (for the composed path).
    fn host(&self, n: usize) -> Result<Vec<f64>> {
        let all = values_of(self.values)?;
        Ok(all[self.at..self.at + n].to_vec())
    }
    /// Whether the skip flag is set, read back to the host (the composed path's decision; a
    /// synchronisation on CUDA).
    pub fn skipped_on_host(&self) -> Result<bool> {
        match self.skip {
            Some(f) => Ok(values_of(f)?.first().is_some_and(|v| *v != 0.0)),
            None => Ok(false),
        }
    }
}

impl Tensor {
    /// Writes `values` into this f64 vector from element `at` on, in place (on CUDA a host→device
    /// copy queued on the compute stream; not allowed while a graph is being recorded).
    pub fn write_f64(&self, at: usize, values: &[f64]) -> Result<()> {
        if self.dtype() != DType::F64 || at + values.len() > self.numel() {
            return Err(crate::Error::invalid(
                "write_f64",
                format!("{} values at {at} into a {} tensor of {} elements", values.len(), self.dtype(), self.numel()),
            ));
        }
        self.write_storage().write_f64(at, values)
    }

    /// [`Tensor::sgd_step_many`] with `[weight_decay, momentum, neg_lr]` read from `s`; `nesterov`
    /// and `weight_decay` (whether the decay term is applied) are fixed per call.
    pub fn sgd_step_many_dev(
        items: &[(&Tensor, &Tensor, Option<&Tensor>)],
        s: DeviceScalars<'_>,
        weight_decay: bool,
        nesterov: bool,
    ) -> Result<()> {
        let Some(&(first, _, _)) = items.first() else { return Ok(()) };
        s.check("sgd_step_many_dev", 3, first.device())?;
        let mut fused: Vec<(&Tensor, &Tensor, Option<&Tensor>)> = Vec::new();
        let mut composed: Vec<(&Tensor, &Tensor, Option<&Tensor>)> = Vec::new();
        let mut seen = Storages::default();
        for &(p, g, b) in items {
            if fusable(p, g, b) && seen.all_new(&[Some(p), Some(g), b]) {
                fused.push((p, g, b));
            } else {
                composed.push((p, g, b));
            }
        }
        let run_composed = |items: &[(&Tensor, &Tensor, Option<&Tensor>)]| -> Result<()> {
            if items.is_empty() || s.skipped_on_host()? {
                return Ok(());
            }
            let v = s.host(3)?;
            let h = SgdStep { weight_decay: if weight_decay { v[0] } else { 0.0 }, momentum: v[1], neg_lr: v[2], nesterov };
            items.iter().try_for_each(|&(p, g, b)| Tensor::sgd_step_composed(p, g, b, h))
        };
        run_composed(&composed)?;
        match fused_sgd_dev(&fused, s, weight_decay, nesterov)? {
            true => Ok(()),
            false => run_composed(&fused),
        }
    }

    /// [`Tensor::momentum_blend_many`] with β read from `s`. Under a set skip flag the momenta stay
    /// as they are and the blends are computed from the update they would have received.
    pub fn momentum_blend_many_dev(pairs: &[(&Tensor, &Tensor)], s: DeviceScalars<'_>, nesterov: bool) -> Result<Vec<Tensor>> {
        let Some(&(g0, _)) = pairs.first() else { return Ok(Vec::new()) };
        s.check("momentum_blend_many_dev", 1, g0.device())?;
        let mut out: Vec<Option<Tensor>> = vec![None; pairs.len()];
        let mut fused: Vec<usize> = Vec::new();
        let mut seen = Storages::default();
        let mut host = None;
        let mut composed = |i: usize, out: &mut Vec<Option<Tensor>>| -> Result<()> {
            let (g, m) = pairs[i];
            let (b, skipped) = match host {
                Some(h) => h,
                None => *host.insert((s.host(1)?[0], s.skipped_on_host()?)),
            };
            out[i] = Some(match skipped {
                true => Tensor::momentum_blend_composed(g, &m.deep_copy()?, b, nesterov)?,
                false => Tensor::momentum_blend_composed(g, m, b, nesterov)?,
            });
            Ok(())
        };
        for (i, &(g, m)) in pairs.iter().enumerate() {
            if fusable(m, g, None) && seen.all_new(&[Some(m), Some(g)]) {
                fused.push(i);
            } else {
                composed(i, &mut out)?;
            }
        }
        if !fused.is_empty() {
            match fused_blend_dev(pairs, &fused, s, nesterov)? {
                Some(done) => done.into_iter().for_each(|(i, u)| out[i] = Some(u)),
                None => fused.iter().try_for_each(|&i| composed(i, &mut out))?,
            }
        }
        out.into_iter().map(|u| u.ok_or_else(|| crate::Error::invalid("momentum_blend_many_dev", "an item got no result"))).collect()
    }

    /// [`Tensor::lerp_many_`] with the weight read from `s`.
    pub fn lerp_many_dev_(pairs: &[(&Tensor, &Tensor)], s: DeviceScalars<'_>) -> Result<()> {
        let Some(&(d0, _)) = pairs.first() else { return Ok(()) };
        s.check("lerp_many_dev_", 1, d0.device())?;
        let mut fused: Vec<(&Tensor, &Tensor)> = Vec::new();
        let mut composed: Vec<(&Tensor, &Tensor)> = Vec::new();
        let mut seen = Storages::default();
        for &(d, src) in pairs {
            if fusable(d, src, None) && seen.all_new(&[Some(d), Some(src)]) {
                fused.push((d, src));
            } else {
                composed.push((d, src));
            }
        }
        let run_composed = |pairs: &[(&Tensor, &Tensor)]| -> Result<()> {
            if pairs.is_empty() {
                return Ok(());
            }
            let w = s.host(1)?[0];
            pairs.iter().try_for_each(|&(d, src)| crate::no_grad(|| d.copy_(&lerp(d, src, w)?)))
        };
        run_composed(&composed)?;
        match fused_lerp_dev(&fused, s)? {
            true => Ok(()),
            false => run_composed(&fused),
        }
    }
}

impl Tensor {
    /// Global L2-norm clipping of `grads` in place on CUDA (PyTorch `clip_grad_norm_` semantics):
    /// each tensor's norm, the total norm of those, and every gradient times
    /// `min(1, max_norm / (total + 1e-6))` — always multiplied in, no host read. Returns the total
    /// as an f32 0-d tensor, or `None` (nothing done) unless every gradient is a whole f32 CUDA
    /// tensor of its own storage and the kernels are on (`cuda::DeviceOptions::fused_clip`, on by default):
    /// the caller then runs the composed ops. Three launches per 40
    /// tensors and one more instead of about ten per tensor; the sums of squares go by 2048-element
    /// chunks, each tree-summed in a fixed order, then chunk by chunk and tensor by tensor, so the
    /// result is deterministic (its last bits differ from the composed reduction's).
    pub fn clip_norm_many_(grads: &[&Tensor], max_norm: f64) -> Result<Option<Tensor>> {
        let Some(first) = grads.first() else { return Ok(None) };
        let device = first.device();
        let mut seen = Storages::default();
        let whole_f32 = |t: &Tensor| t.dtype() == DType::F32 && t.device() == device && t.numel() > 0 && t.raw_storage().len() == t.numel();
        if !grads.iter().all(|g| whole_f32(g) && seen.all_new(&[Some(*g)])) {
            return Ok(None);
        }
        fused_clip(grads, max_norm)
    }
}

impl Tensor {
    /// GradScaler's unscale in place on CUDA (PyTorch's `_amp_foreach_non_finite_check_and_unscale_`):
    /// every gradient times `inv_scale` (an f32 value), and `found` (an f32 value) set to 1 when a
    /// gradient held an inf or NaN before scaling, else 0 — the bytes of the composed per-gradient
    /// ops, in one launch per 40 gradients. Returns `false` (nothing done) unless every gradient is
    /// a whole f32 CUDA tensor of its own storage and both scalars are one f32 value on that
    /// device: the caller then runs the composed ops.
    pub fn unscale_many_(grads: &[&Tensor], inv_scale: &Tensor, found: &Tensor) -> Result<bool> {
        let Some(first) = grads.first() else { return Ok(false) };
        let device = first.device();
        let mut seen = Storages::default();
        let whole_f32 = |t: &Tensor| t.dtype() == DType::F32 && t.device() == device && t.numel() > 0 && t.raw_storage().len() == t.numel();
        let scalar = |t: &Tensor| t.dtype() == DType::F32 && t.device() == device && t.numel() == 1 && t.raw_storage().len() == 1;
        if !scalar(inv_scale)
            || !scalar(found)
            || !seen.all_new(&[Some(found)])
            || !grads.iter().all(|g| whole_f32(g) && seen.all_new(&[Some(*g)]))
        {
            return Ok(false);
        }
        fused_unscale(grads, inv_scale, found)
    }
}

fn fused_unscale(grads: &[&Tensor], inv_scale: &Tensor, found: &Tensor) -> Result<bool> {
    let inv = inv_scale.raw_storage();
    let mut rows: Vec<Vec<&Tensor>> = grads.iter().map(|g| vec![*g]).collect();
    rows.push(vec![found]);
    run_rows(MultiTensorOp::Unscale { inv_scale: &inv }, &rows, &[true]).map(|r| r.is_some())
}

fn fused_clip(grads: &[&Tensor], max_norm: f64) -> Result<Option<Tensor>> {
    let rows: Vec<Vec<&Tensor>> = grads.iter().map(|g| vec![*g]).collect();
    match run_rows(MultiTensorOp::ClipNorm { max_norm: max_norm as f32 }, &rows, &[true])? {
        Some(mut outs) if outs.len() == 1 => Ok(Some(Tensor::from_storage(outs.remove(0), ())?)),
        Some(_) => Err(crate::Error::invalid("clip_norm_many_", "the backend returned no total norm")),
        None => Ok(None),
    }
}

/// One parameter of [`Tensor::adamw_step_many_dev`]: the parameter, its gradient, its two moments
/// and its step count (an f64 tensor of one value on the same device, which the step increments).
#[derive(Clone, Copy)]
pub struct AdamWItem<'a> {
    /// The parameter.
    pub param: &'a Tensor,
    /// Its gradient.
    pub grad: &'a Tensor,
    /// First moment.
    pub exp_avg: &'a Tensor,
    /// Second moment.
    pub exp_avg_sq: &'a Tensor,
    /// Its step count (a device scalar).
    pub step: &'a Tensor,
}

/// How many scalars [`Tensor::adamw_step_many_dev`] reads: `[1 − lr·wd, 1 − β1, β2, 1 − β2, eps,
/// lr, β1]`, each computed on the host in f64 as the composed update computes it.
pub const ADAMW_SCALARS: usize = 7;

impl Tensor {
    /// AdamW (PyTorch single-tensor semantics: decoupled decay, bias-corrected moments) over many
    /// parameters with the group's scalars read from `s` and each parameter's step count read from
    /// and incremented in its `step` tensor — the bytes of [`adamw_composed`], whose bias
    /// corrections use that count. On CUDA one launch per parameter (f32) plus one for the counts;
    /// under a set skip flag nothing moves, counts included (a skipped 16-mixed step).
    pub fn adamw_step_many_dev(items: &[AdamWItem<'_>], s: DeviceScalars<'_>, weight_decay: bool) -> Result<()> {
        let Some(first) = items.first() else { return Ok(()) };
        s.check("adamw_step_many_dev", ADAMW_SCALARS, first.param.device())?;
        let mut fused: Vec<AdamWItem<'_>> = Vec::new();
        let mut composed: Vec<AdamWItem<'_>> = Vec::new();
        let mut seen = Storages::default();
        for it in items {
            if it.step.dtype() != DType::F64 || it.step.numel() != 1 || it.step.device() != it.param.device() {
                return Err(crate::Error::invalid("adamw_step_many_dev", "a step count must be one f64 value on the parameter's device"));
            }
            let all = [Some(it.param), Some(it.grad), Some(it.exp_avg), Some(it.exp_avg_sq), Some(it.step)];
            if fusable(it.param, it.grad, Some(it.exp_avg)) && fusable(it.param, it.exp_avg_sq, None) && seen.all_new(&all) {
                fused.push(*it);
            } else {
                composed.push(*it);
            }
        }
        let run_composed = |items: &[AdamWItem<'_>]| -> Result<()> {
            if items.is_empty() || s.skipped_on_host()? {
                return Ok(());
            }
            let v = s.host(ADAMW_SCALARS)?;
            let h: [f64; ADAMW_SCALARS] = std::array::from_fn(|i| v[i]);
            for it in items {
                let t = it.step.to_vec::<f64>()?.first().copied().unwrap_or(0.0) + 1.0;
                adamw_composed(it.param, it.grad, it.exp_avg, it.exp_avg_sq, &h, t, weight_decay)?;
                it.step.write_f64(0, &[t])?;
            }
            Ok(())
        };
        run_composed(&composed)?;
        match fused_adamw_dev(&fused, s, weight_decay)? {
            true => Ok(()),
            false => run_composed(&fused),
        }
    }
}

/// AdamW's composed update of parameter `x` (gradient `g`, moments `m`, `v`, all in place) at step
/// `t` with the scalars of [`Tensor::adamw_step_many_dev`]: the reference the fused kernel
/// reproduces op by op.
pub fn adamw_composed(x: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, h: &[f64; ADAMW_SCALARS], t: f64, weight_decay: bool) -> Result<()> {
    let [keep, w1, b2, one_minus_b2, eps, lr, b1] = *h;
    crate::no_grad(|| -> Result<()> {
        if weight_decay {
            x.copy_(&x.mul_scalar(keep)?)?;
        }
        m.copy_(&lerp(m, g, w1)?)?;
        v.copy_(&v.mul_scalar(b2)?.add(&g.mul_scalar(one_minus_b2)?.mul(g)?)?)?;
        let bc1 = 1.0 - b1.powf(t);
        let bc2 = 1.0 - b2.powf(t);
        let step_size = lr / bc1;
        let denom = v.sqrt()?.div_scalar(bc2.sqrt())?.add_scalar(eps)?;
        x.copy_(&x.add(&m.div(&denom)?.mul_scalar(-step_size)?)?)?;
        Ok(())
    })
}

/// The storages of a `*_dev` update's scalars, locked for reading while its launch runs.
struct HeldScalars<'t> {
    values: RwLockReadGuard<'t, Storage>,
    skip: Option<RwLockReadGuard<'t, Storage>>,
    at: usize,
}

impl<'t> HeldScalars<'t> {
    fn new(s: &DeviceScalars<'t>) -> HeldScalars<'t> {
        HeldScalars { values: s.values.raw_storage(), skip: s.skip.map(|f| f.raw_storage()), at: s.at }
    }
    fn at(&self) -> ScalarsAt<'_, Storage> {
        ScalarsAt { values: &self.values, at: self.at, skip: self.skip.as_deref() }
    }
}

fn fused_adamw_dev(items: &[AdamWItem<'_>], s: DeviceScalars<'_>, weight_decay: bool) -> Result<bool> {
    if items.is_empty() {
        return Ok(true);
    }
    let held = HeldScalars::new(&s);
    let rows: Vec<Vec<&Tensor>> = items.iter().map(|it| vec![it.param, it.grad, it.exp_avg, it.exp_avg_sq, it.step]).collect();
    let op = MultiTensorOp::AdamWDev { scalars: held.at(), weight_decay };
    run_rows(op, &rows, &[true, false, true, true, true]).map(|r| r.is_some())
}

fn fused_sgd_dev(items: &[(&Tensor, &Tensor, Option<&Tensor>)], s: DeviceScalars<'_>, weight_decay: bool, nesterov: bool) -> Result<bool> {
    let held = HeldScalars::new(&s);
    for with_buf in [true, false] {
        let rows = sgd_rows(items, with_buf);
        if !rows.is_empty() {
            let op = MultiTensorOp::SgdDev { scalars: held.at(), weight_decay, nesterov, with_buf };
            if run_rows(op, &rows, &[true, false, true])?.is_none() {
                // Only the first launch can be refused (a backend offers an op or not).
                return Ok(false);
            }
        }
    }
    Ok(true)
}

fn fused_blend_dev(
    pairs: &[(&Tensor, &Tensor)],
    idx: &[usize],
    s: DeviceScalars<'_>,
    nesterov: bool,
) -> Result<Option<Vec<(usize, Tensor)>>> {
    let held = HeldScalars::new(&s);
    let outs = blend_outputs(pairs, idx)?;
    let rows = blend_rows(pairs, idx, &outs);
    match run_rows(MultiTensorOp::BlendDev { scalars: held.at(), nesterov }, &rows, &[true, false, true])? {
        Some(_) => Ok(Some(idx.iter().copied().zip(outs).collect())),
        None => Ok(None),
    }
}

fn fused_lerp_dev(pairs: &[(&Tensor, &Tensor)], s: DeviceScalars<'_>) -> Result<bool> {
    if pairs.is_empty() {
        return Ok(true);
    }
    let held = HeldScalars::new(&s);
    let rows: Vec<Vec<&Tensor>> = pairs.iter().map(|&(d, src)| vec![d, src]).collect();
    run_rows(MultiTensorOp::LerpDev { scalars: held.at() }, &rows, &[true, false]).map(|r| r.is_some())
}

impl Tensor {
    /// In place for every `(parameter, gradient, momentum buffer)`: g′ = g + λ·p (λ ≠ 0);
    /// b ← μ·b + g′; p ← p − lr·(g′ + μ·b) with Nesterov, p − lr·b without; without a buffer
    /// p ← p − lr·g′. The same bytes as [`Tensor::sgd_step_composed`] on each item; on CUDA, f32
    /// items with their own storages run as one kernel per 40, the others composed.
    pub fn sgd_step_many(items: &[(&Tensor, &Tensor, Option<&Tensor>)], h: SgdStep) -> Result<()> {
        let mut fused: Vec<(&Tensor, &Tensor, Option<&Tensor>)> = Vec::new();
        let mut seen = Storages::default();
        for &(p, g, b) in items {
            if fusable(p, g, b) && seen.all_new(&[Some(p), Some(g), b]) {
                fused.push((p, g, b));
            } else {
                Tensor::sgd_step_composed(p, g, b, h)?;
            }
        }
        match fused_sgd(&fused, h)? {
            true => Ok(()),
            false => fused.iter().try_for_each(|&(p, g, b)| Tensor::sgd_step_composed(p, g, b, h)),
        }
    }

    /// The SGD step of one parameter as tensor ops (the reference of [`Tensor::sgd_step_many`]).
    pub fn sgd_step_composed(p: &Tensor, g: &Tensor, buf: Option<&Tensor>, h: SgdStep) -> Result<()> {
        crate::no_grad(|| -> Result<()> {
            let g = if h.weight_decay != 0.0 { g.add(&p.mul_scalar(h.weight_decay)?)? } else { g.clone() };
            let upd = match buf {
                Some(buf) => {
                    let nb = buf.mul_scalar(h.momentum)?.add(&g)?;
                    buf.copy_(&nb)?;
                    if h.nesterov {
                        g.add(&buf.mul_scalar(h.momentum)?)?
                    } else {
                        nb
                    }
                }
                None => g,
            };
            p.copy_(&p.add(&upd.mul_scalar(h.neg_lr)?)?)
        })
    }
}

/// The storages a fused launch already holds: an item that shares one runs composed (a launch
/// locks every storage once, and a kernel item must not alias another's).
#[derive(Default)]
struct Storages(std::collections::HashSet<usize>);

impl Storages {
    /// Whether none of `ts` is held yet; if so they are held from now on.
    fn all_new(&mut self, ts: &[Option<&Tensor>]) -> bool {
        let ptrs: Vec<usize> = ts.iter().flatten().map(|t| t.storage_ptr()).collect();
        if ptrs.iter().any(|p| self.0.contains(p)) {
            return false;
        }
        self.0.extend(ptrs);
        true
    }
}

/// Whether an item can go to the backend's multi-tensor kernel: f32, one shape and device, whole
/// storages, and no storage shared between its tensors (a backend without the kernel then
/// composes it all the same).
fn fusable(p: &Tensor, g: &Tensor, b: Option<&Tensor>) -> bool {
    let f32_same =
        |t: &Tensor| t.dtype() == DType::F32 && t.dims() == p.dims() && t.device() == p.device() && t.raw_storage().len() == t.numel();
    let distinct =
        g.storage_ptr() != p.storage_ptr() && b.is_none_or(|b| b.storage_ptr() != p.storage_ptr() && b.storage_ptr() != g.storage_ptr());
    f32_same(p) && f32_same(g) && b.is_none_or(f32_same) && distinct
}

/// The rows `[param, grad, buffer]` (or `[param, grad]`) of the items with (without) a buffer.
fn sgd_rows<'a>(items: &[(&'a Tensor, &'a Tensor, Option<&'a Tensor>)], with_buf: bool) -> Vec<Vec<&'a Tensor>> {
    items
        .iter()
        .filter(|(_, _, b)| b.is_some() == with_buf)
        .map(|&(p, g, b)| std::iter::once(p).chain(std::iter::once(g)).chain(b).collect())
        .collect()
}

fn fused_sgd(items: &[(&Tensor, &Tensor, Option<&Tensor>)], h: SgdStep) -> Result<bool> {
    // Items with and without a buffer take different kernel flags.
    for with_buf in [true, false] {
        let rows = sgd_rows(items, with_buf);
        if !rows.is_empty() && run_rows(MultiTensorOp::Sgd { h, with_buf }, &rows, &[true, false, true])?.is_none() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A storage locked for one multi-tensor launch.
enum Held<'t> {
    Read(RwLockReadGuard<'t, Storage>),
    Write(RwLockWriteGuard<'t, Storage>),
}

/// Runs `op` over `rows` (each an item's operands in the op's order; `written[k]` says whether
/// operand k is written, and so locked for writing) through the backend's
/// [`crate::backend::MultiTensorStorage`], holding every storage's lock until it returns.
/// `None`: the backend has no kernel for it, nothing was done.
fn run_rows(op: MultiTensorOp<'_, Storage>, rows: &[Vec<&Tensor>], written: &[bool]) -> Result<Option<Vec<Storage>>> {
    let mut held: Vec<Vec<Held<'_>>> = rows
        .iter()
        .map(|r| {
            r.iter()
                .enumerate()
                .map(|(k, t)| match written.get(k).copied().unwrap_or(false) {
                    true => Held::Write(t.write_storage()),
                    false => Held::Read(t.raw_storage()),
                })
                .collect()
        })
        .collect();
    let operands: Vec<Vec<Operand<'_, Storage>>> = held
        .iter_mut()
        .map(|r| {
            r.iter_mut()
                .map(|h| match h {
                    Held::Read(g) => Operand::Read(&**g),
                    Held::Write(g) => Operand::Write(&mut **g),
                })
                .collect()
        })
        .collect();
    Storage::multi_tensor(op, operands)
}

/// `lerp(start, end, w)` as PyTorch computes it for f32 (`w` rounded to f32 first; the branch on
/// |w| < 0.5 keeps both ends exact): start + (end − start)·w, or end − (end − start)·(1 − w).
pub fn lerp(start: &Tensor, end: &Tensor, w: f64) -> Result<Tensor> {
    let w32 = w as f32;
    let diff = end.sub(start)?;
    if w32.abs() < 0.5 {
        start.add(&diff.mul_scalar(f64::from(w32))?)
    } else {
        end.sub(&diff.mul_scalar(f64::from(1.0f32 - w32))?)
    }
}

/// The factor [`lerp`] multiplies by, and whether it takes the `start +` branch.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn lerp_factor(w: f64) -> (f32, bool) {
    let w32 = w as f32;
    if w32.abs() < 0.5 {
        (w32, true)
    } else {
        (1.0f32 - w32, false)
    }
}

impl Tensor {
    /// Muon's momentum and Nesterov blend of one tensor, in place on `momentum`:
    /// M ← lerp(M, g, 1 − β); returns U = lerp(g, M, β) (or M's new value without Nesterov).
    pub fn momentum_blend_composed(grad: &Tensor, momentum: &Tensor, beta: f64, nesterov: bool) -> Result<Tensor> {
        crate::no_grad(|| -> Result<Tensor> {
            let m = lerp(momentum, grad, 1.0 - beta)?;
            momentum.copy_(&m)?;
            if nesterov {
                lerp(grad, momentum, beta)
            } else {
                Ok(m)
            }
        })
    }

    /// [`Tensor::momentum_blend_composed`] for every `(gradient, momentum)` pair, the same bytes;
    /// on CUDA f32 pairs with their own storages run as one kernel per 40.
    pub fn momentum_blend_many(pairs: &[(&Tensor, &Tensor)], beta: f64, nesterov: bool) -> Result<Vec<Tensor>> {
        let mut out: Vec<Option<Tensor>> = vec![None; pairs.len()];
        let mut fused: Vec<usize> = Vec::new();
        let mut seen = Storages::default();
        for (i, &(g, m)) in pairs.iter().enumerate() {
            if fusable(m, g, None) && seen.all_new(&[Some(m), Some(g)]) {
                fused.push(i);
            } else {
                out[i] = Some(Tensor::momentum_blend_composed(g, m, beta, nesterov)?);
            }
        }
        if !fused.is_empty() {
            match fused_blend(pairs, &fused, beta, nesterov)? {
                Some(done) => done.into_iter().for_each(|(i, u)| out[i] = Some(u)),
                None => {
                    for &i in &fused {
                        out[i] = Some(Tensor::momentum_blend_composed(pairs[i].0, pairs[i].1, beta, nesterov)?);
                    }
                }
            }
        }
        out.into_iter().map(|u| u.ok_or_else(|| crate::Error::invalid("momentum_blend_many", "an item got no result"))).collect()
    }
}

/// The blends' output buffers of the fused momentum blend (uninitialised: the kernel writes every
/// element), one per selected pair, shaped like its momentum.
fn blend_outputs(pairs: &[(&Tensor, &Tensor)], idx: &[usize]) -> Result<Vec<Tensor>> {
    idx.iter()
        .map(|&i| {
            let m = pairs[i].1;
            Tensor::from_storage(Storage::uninit(m.device(), m.dtype(), m.numel())?, m.shape().clone())
        })
        .collect()
}

/// The rows `[momentum, gradient, blend]` of the selected pairs.
fn blend_rows<'a>(pairs: &[(&'a Tensor, &'a Tensor)], idx: &[usize], outs: &'a [Tensor]) -> Vec<Vec<&'a Tensor>> {
    idx.iter().zip(outs).map(|(&i, u)| vec![pairs[i].1, pairs[i].0, u]).collect()
}

fn fused_blend(pairs: &[(&Tensor, &Tensor)], idx: &[usize], beta: f64, nesterov: bool) -> Result<Option<Vec<(usize, Tensor)>>> {
    let outs = blend_outputs(pairs, idx)?;
    let rows = blend_rows(pairs, idx, &outs);
    match run_rows(MultiTensorOp::Blend { beta, nesterov }, &rows, &[true, false, true])? {
        Some(_) => Ok(Some(idx.iter().copied().zip(outs).collect())),
        None => Ok(None),
    }
}

impl Tensor {
    /// `dst.copy_(&lerp(dst, src, w))` for every pair (an EMA update), the same bytes; on CUDA f32
    /// pairs with their own storages run as one kernel per 40.
    pub fn lerp_many_(pairs: &[(&Tensor, &Tensor)], w: f64) -> Result<()> {
        let mut fused: Vec<(&Tensor, &Tensor)> = Vec::new();
        let mut seen = Storages::default();
        for &(d, s) in pairs {
            if fusable(d, s, None) && seen.all_new(&[Some(d), Some(s)]) {
                fused.push((d, s));
            } else {
                crate::no_grad(|| d.copy_(&lerp(d, s, w)?))?;
            }
        }
        match fused_lerp(&fused, w)? {
            true => Ok(()),
            false => fused.iter().try_for_each(|&(d, s)| crate::no_grad(|| d.copy_(&lerp(d, s, w)?))),
        }
    }
}

fn fused_lerp(pairs: &[(&Tensor, &Tensor)], w: f64) -> Result<bool> {
    if pairs.is_empty() {
        return Ok(true);
    }
    let rows: Vec<Vec<&Tensor>> = pairs.iter().map(|&(d, s)| vec![d, s]).collect();
    run_rows(MultiTensorOp::Lerp { w }, &rows, &[true, false]).map(|r| r.is_some())
}

//! Fused optimizer steps over many tensors (PyTorch's fused / `_foreach` SGD): the bytes of the
//! composed tensor ops they stand for, with one launch per 40 parameters on CUDA instead of about
//! ten per parameter. Each takes its scalars from the host (baked into the launch) or, in the
//! `*_dev` forms, from device memory ([`DeviceScalars`]): what a recorded update needs to take each
//! step's learning rate, momentum and decay (capture.md §16).

use crate::{DType, Result, Tensor};

/// One SGD step's hyperparameters (PyTorch semantics, no dampening).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    pub weight_decay: f64,
    pub momentum: f64,
    /// `−lr · factor`, computed by the caller as the composed update would (in f64).
    pub neg_lr: f64,
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
    pub values: &'a Tensor,
    pub at: usize,
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
    /// The skip flag's device address (0: none).
    #[cfg(feature = "cuda")]
    fn skip_ptr(&self) -> Result<u64> {
        let Some(f) = self.skip else { return Ok(0) };
        match &*f.read_storage() {
            crate::storage::Storage::Cuda(c) => Ok(c.device_ptr()),
            #[allow(unreachable_patterns)]
            _ => Err(crate::Error::invalid("device scalars", "the skip flag is not on a CUDA device")),
        }
    }
    #[cfg(feature = "cuda")]
    fn device_ptr(&self) -> Result<u64> {
        match &*self.values.read_storage() {
            crate::storage::Storage::Cuda(c) => Ok(c.device_ptr() + 8 * self.at as u64),
            #[allow(unreachable_patterns)]
            _ => Err(crate::Error::invalid("device scalars", "not on a CUDA device")),
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
        let mut st = self.write_storage();
        match &mut *st {
            crate::storage::Storage::Cpu(crate::CpuStorage::F64(v)) => {
                v[at..at + values.len()].copy_from_slice(values);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            crate::storage::Storage::Cuda(c) => {
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                c.write_from_host(8 * at, &bytes)
            }
            #[allow(unreachable_patterns)]
            _ => Err(crate::Error::invalid("write_f64", "not an f64 storage")),
        }
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
        if !composed.is_empty() && !s.skipped_on_host()? {
            let v = s.host(3)?;
            let h = SgdStep { weight_decay: if weight_decay { v[0] } else { 0.0 }, momentum: v[1], neg_lr: v[2], nesterov };
            for (p, g, b) in composed {
                Tensor::sgd_step_composed(p, g, b, h)?;
            }
        }
        fused_sgd_dev(&fused, s, weight_decay, nesterov)
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
        for (i, &(g, m)) in pairs.iter().enumerate() {
            if fusable(m, g, None) && seen.all_new(&[Some(m), Some(g)]) {
                fused.push(i);
            } else {
                let (b, skipped) = match host {
                    Some(h) => h,
                    None => *host.insert((s.host(1)?[0], s.skipped_on_host()?)),
                };
                let u = match skipped {
                    true => Tensor::momentum_blend_composed(g, &m.deep_copy()?, b, nesterov)?,
                    false => Tensor::momentum_blend_composed(g, m, b, nesterov)?,
                };
                out[i] = Some(u);
            }
        }
        if !fused.is_empty() {
            for (i, u) in fused_blend_dev(pairs, &fused, s, nesterov)? {
                out[i] = Some(u);
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
        if !composed.is_empty() {
            let w = s.host(1)?[0];
            for (d, src) in composed {
                crate::no_grad(|| d.copy_(&lerp(d, src, w)?))?;
            }
        }
        fused_lerp_dev(&fused, s)
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
        let whole_f32 =
            |t: &Tensor| t.dtype() == DType::F32 && t.device() == device && t.numel() > 0 && t.read_storage().len() == t.numel();
        if !matches!(device, crate::Device::Cuda(_)) || !grads.iter().all(|g| whole_f32(g) && seen.all_new(&[Some(*g)])) {
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
        let whole_f32 =
            |t: &Tensor| t.dtype() == DType::F32 && t.device() == device && t.numel() > 0 && t.read_storage().len() == t.numel();
        let scalar = |t: &Tensor| t.dtype() == DType::F32 && t.device() == device && t.numel() == 1 && t.read_storage().len() == 1;
        if !matches!(device, crate::Device::Cuda(_))
            || !scalar(inv_scale)
            || !scalar(found)
            || !seen.all_new(&[Some(found)])
            || !grads.iter().all(|g| whole_f32(g) && seen.all_new(&[Some(*g)]))
        {
            return Ok(false);
        }
        fused_unscale(grads, inv_scale, found)?;
        Ok(true)
    }
}

#[cfg(feature = "cuda")]
fn fused_unscale(grads: &[&Tensor], inv_scale: &Tensor, found: &Tensor) -> Result<()> {
    use crate::storage::Storage;
    let inv = match &*inv_scale.read_storage() {
        Storage::Cuda(c) => c.device_ptr(),
        #[allow(unreachable_patterns)]
        _ => return Err(crate::Error::invalid("unscale_many_", "the inverse scale is not on CUDA")),
    };
    let flag = found.write_storage();
    let Storage::Cuda(f) = &*flag else { return Err(crate::Error::invalid("unscale_many_", "the found-inf flag is not on CUDA")) };
    let fp = f.device_ptr();
    let items: Vec<[Option<&Tensor>; 3]> = grads.iter().map(|g| [Some(*g), None, None]).collect();
    on_device_rows("unscale_many_", &items, [true, false, false], |dev, rows| crate::cuda::ops::unscale_many(dev, rows, inv, fp))
}

#[cfg(not(feature = "cuda"))]
fn fused_unscale(_grads: &[&Tensor], _inv_scale: &Tensor, _found: &Tensor) -> Result<()> {
    Err(crate::Error::invalid("unscale_many_", "CUDA gradients without the CUDA backend"))
}

#[cfg(feature = "cuda")]
fn fused_clip(grads: &[&Tensor], max_norm: f64) -> Result<Option<Tensor>> {
    use crate::storage::Storage;
    if !crate::cuda::ops::fused_clip_enabled(grads[0].device()) {
        return Ok(None);
    }
    let device = grads[0].device();
    let items: Vec<[Option<&Tensor>; 3]> = grads.iter().map(|g| [Some(*g), None, None]).collect();
    let blocks: usize = grads.iter().map(|g| g.numel().div_ceil(crate::cuda::ops::MT_CHUNK)).sum();
    let partials = Tensor::from_storage(Storage::uninit(device, DType::F32, blocks.max(1))?, blocks.max(1))?;
    let norms = Tensor::from_storage(Storage::uninit(device, DType::F32, grads.len())?, grads.len())?;
    let total = Tensor::from_storage(Storage::uninit(device, DType::F32, 1)?, ())?;
    let coef = Tensor::from_storage(Storage::uninit(device, DType::F32, 1)?, 1)?;
    let ptr = |t: &Tensor| -> Result<u64> {
        match &*t.read_storage() {
            Storage::Cuda(c) => Ok(c.device_ptr()),
            #[allow(unreachable_patterns)]
            _ => Err(crate::Error::invalid("clip_norm_many_", "scratch not on CUDA")),
        }
    };
    let (pp, np, tp, cp) = (ptr(&partials)?, ptr(&norms)?, ptr(&total)?, ptr(&coef)?);
    on_device_rows("clip_norm_many_", &items, [true, false, false], |dev, rows| {
        crate::cuda::ops::clip_norm_many(dev, rows, [pp, np, tp, cp], max_norm as f32)
    })?;
    Ok(Some(total))
}

#[cfg(not(feature = "cuda"))]
fn fused_clip(_grads: &[&Tensor], _max_norm: f64) -> Result<Option<Tensor>> {
    Err(crate::Error::invalid("clip_norm_many_", "CUDA gradients without the CUDA backend"))
}

/// One parameter of [`Tensor::adamw_step_many_dev`]: the parameter, its gradient, its two moments
/// and its step count (an f64 tensor of one value on the same device, which the step increments).
#[derive(Clone, Copy)]
pub struct AdamWItem<'a> {
    pub param: &'a Tensor,
    pub grad: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
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
        if !composed.is_empty() && !s.skipped_on_host()? {
            let v = s.host(ADAMW_SCALARS)?;
            let h: [f64; ADAMW_SCALARS] = std::array::from_fn(|i| v[i]);
            for it in &composed {
                let t = it.step.to_vec::<f64>()?.first().copied().unwrap_or(0.0) + 1.0;
                adamw_composed(it.param, it.grad, it.exp_avg, it.exp_avg_sq, &h, t, weight_decay)?;
                it.step.write_f64(0, &[t])?;
            }
        }
        fused_adamw_dev(&fused, s, weight_decay)
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

#[cfg(feature = "cuda")]
fn fused_adamw_dev(items: &[AdamWItem<'_>], s: DeviceScalars<'_>, weight_decay: bool) -> Result<()> {
    use crate::storage::Storage;
    if items.is_empty() {
        return Ok(());
    }
    let (hp, skip) = (s.device_ptr()?, s.skip_ptr()?);
    let mut counts: Vec<[Option<&Tensor>; 3]> = Vec::with_capacity(items.len());
    for it in items {
        let (p, m, v, st) = (it.param.write_storage(), it.exp_avg.write_storage(), it.exp_avg_sq.write_storage(), it.step.read_storage());
        let g = it.grad.read_storage();
        let (Storage::Cuda(pc), Storage::Cuda(gc), Storage::Cuda(mc), Storage::Cuda(vc), Storage::Cuda(sc)) = (&*p, &*g, &*m, &*v, &*st)
        else {
            return Err(crate::Error::invalid("adamw_step_many_dev", "a fused item is not on CUDA"));
        };
        let ptrs = [pc.device_ptr(), gc.device_ptr(), mc.device_ptr(), vc.device_ptr(), sc.device_ptr()];
        crate::cuda::ops::adamw_dev(pc, ptrs, p.len(), hp, skip, weight_decay)?;
        counts.push([Some(it.step), None, None]);
    }
    // Every update above read its count before any count moves (stream order).
    on_device_rows("adamw_step_many_dev", &counts, [true, false, false], |dev, rows| crate::cuda::ops::count_many_dev(dev, rows, skip))
}

#[cfg(not(feature = "cuda"))]
fn fused_adamw_dev(items: &[AdamWItem<'_>], _s: DeviceScalars<'_>, _weight_decay: bool) -> Result<()> {
    match items.is_empty() {
        true => Ok(()),
        false => Err(crate::Error::invalid("adamw_step_many_dev", "fused items without the CUDA backend")),
    }
}

#[cfg(feature = "cuda")]
fn fused_sgd_dev(items: &[(&Tensor, &Tensor, Option<&Tensor>)], s: DeviceScalars<'_>, weight_decay: bool, nesterov: bool) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    let (hp, skip) = (s.device_ptr()?, s.skip_ptr()?);
    for with_buf in [true, false] {
        let part: Vec<[Option<&Tensor>; 3]> =
            items.iter().filter(|(_, _, b)| b.is_some() == with_buf).map(|&(p, g, b)| [Some(p), Some(g), b]).collect();
        if !part.is_empty() {
            on_device_rows("sgd_step_many_dev", &part, [true, false, true], |dev, rows| {
                crate::cuda::ops::sgd_many_dev(dev, rows, hp, skip, weight_decay, with_buf, nesterov)
            })?;
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn fused_sgd_dev(items: &[(&Tensor, &Tensor, Option<&Tensor>)], _s: DeviceScalars<'_>, _weight_decay: bool, _nesterov: bool) -> Result<()> {
    match items.is_empty() {
        true => Ok(()),
        false => Err(crate::Error::invalid("sgd_step_many_dev", "fused items without the CUDA backend")),
    }
}

#[cfg(feature = "cuda")]
fn fused_blend_dev(pairs: &[(&Tensor, &Tensor)], idx: &[usize], s: DeviceScalars<'_>, nesterov: bool) -> Result<Vec<(usize, Tensor)>> {
    let (hp, skip) = (s.device_ptr()?, s.skip_ptr()?);
    let outs = blend_outputs(pairs, idx)?;
    let items = blend_items(pairs, idx, &outs);
    on_device_rows("momentum_blend_many_dev", &items, [true, false, true], |dev, rows| {
        crate::cuda::ops::blend_many_dev(dev, rows, hp, skip, nesterov)
    })?;
    Ok(idx.iter().copied().zip(outs).collect())
}

#[cfg(not(feature = "cuda"))]
fn fused_blend_dev(_pairs: &[(&Tensor, &Tensor)], idx: &[usize], _s: DeviceScalars<'_>, _nesterov: bool) -> Result<Vec<(usize, Tensor)>> {
    match idx.is_empty() {
        true => Ok(Vec::new()),
        false => Err(crate::Error::invalid("momentum_blend_many_dev", "fused items without the CUDA backend")),
    }
}

#[cfg(feature = "cuda")]
fn fused_lerp_dev(pairs: &[(&Tensor, &Tensor)], s: DeviceScalars<'_>) -> Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let hp = s.device_ptr()?;
    let items: Vec<[Option<&Tensor>; 3]> = pairs.iter().map(|&(d, src)| [Some(d), Some(src), None]).collect();
    on_device_rows("lerp_many_dev_", &items, [true, false, false], |dev, rows| crate::cuda::ops::lerp_many_dev(dev, rows, hp))
}

#[cfg(not(feature = "cuda"))]
fn fused_lerp_dev(pairs: &[(&Tensor, &Tensor)], _s: DeviceScalars<'_>) -> Result<()> {
    match pairs.is_empty() {
        true => Ok(()),
        false => Err(crate::Error::invalid("lerp_many_dev_", "fused items without the CUDA backend")),
    }
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
        fused_sgd(&fused, h)
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

/// Whether an item can go through the fused kernel: CUDA, f32, one shape, whole storages, and no
/// storage shared between its tensors.
fn fusable(p: &Tensor, g: &Tensor, b: Option<&Tensor>) -> bool {
    let cuda = matches!(p.device(), crate::Device::Cuda(_));
    let f32_same =
        |t: &Tensor| t.dtype() == DType::F32 && t.dims() == p.dims() && t.device() == p.device() && t.read_storage().len() == t.numel();
    let distinct =
        g.storage_ptr() != p.storage_ptr() && b.is_none_or(|b| b.storage_ptr() != p.storage_ptr() && b.storage_ptr() != g.storage_ptr());
    cuda && f32_same(p) && f32_same(g) && b.is_none_or(f32_same) && distinct
}

#[cfg(feature = "cuda")]
fn fused_sgd(items: &[(&Tensor, &Tensor, Option<&Tensor>)], h: SgdStep) -> Result<()> {
    // Items with and without a buffer take different kernel flags.
    for with_buf in [true, false] {
        let part: Vec<[Option<&Tensor>; 3]> =
            items.iter().filter(|(_, _, b)| b.is_some() == with_buf).map(|&(p, g, b)| [Some(p), Some(g), b]).collect();
        if !part.is_empty() {
            on_device_rows("sgd_step_many", &part, [true, false, true], |dev, rows| crate::cuda::ops::sgd_many(dev, rows, h, with_buf))?;
        }
    }
    Ok(())
}

/// Runs `launch` with the device addresses of `items` (up to three operands each; `written` says
/// which operand slots the kernel writes, locked for writing) and the first operand's length,
/// holding every storage's lock until it returns. `items` are fusable CUDA tensors.
#[cfg(feature = "cuda")]
fn on_device_rows(
    op: &'static str,
    items: &[[Option<&Tensor>; 3]],
    written: [bool; 3],
    launch: impl FnOnce(&crate::cuda::CudaStorage, &[([u64; 3], usize)]) -> Result<()>,
) -> Result<()> {
    use crate::storage::Storage;
    use std::ops::Deref;
    let mut held: Vec<Box<dyn Deref<Target = Storage> + '_>> = Vec::new();
    let mut rows = Vec::with_capacity(items.len());
    for item in items {
        let mut ptrs = [0u64; 3];
        let mut len = 0;
        for (slot, t) in item.iter().enumerate() {
            let Some(t) = t else { continue };
            let guard: Box<dyn Deref<Target = Storage>> =
                if written[slot] { Box::new(t.write_storage()) } else { Box::new(t.read_storage()) };
            let Storage::Cuda(c) = &**guard else { return Err(crate::Error::invalid(op, "a fused item is not on CUDA")) };
            ptrs[slot] = c.device_ptr();
            if slot == 0 {
                len = guard.len();
            }
            held.push(guard);
        }
        rows.push((ptrs, len));
    }
    match held.first().map(|g| &***g) {
        Some(Storage::Cuda(first)) => launch(first, &rows),
        Some(_) => Err(crate::Error::invalid(op, "a fused item is not on CUDA")),
        None => Ok(()),
    }
}

#[cfg(not(feature = "cuda"))]
fn fused_sgd(items: &[(&Tensor, &Tensor, Option<&Tensor>)], h: SgdStep) -> Result<()> {
    for &(p, g, b) in items {
        Tensor::sgd_step_composed(p, g, b, h)?;
    }
    Ok(())
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
#[cfg(feature = "cuda")]
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
            for (i, u) in fused_blend(pairs, &fused, beta, nesterov)? {
                out[i] = Some(u);
            }
        }
        out.into_iter().map(|u| u.ok_or_else(|| crate::Error::invalid("momentum_blend_many", "an item got no result"))).collect()
    }
}

/// The blends' output buffers of the fused momentum blend (uninitialised: the kernel writes every
/// element), one per selected pair, shaped like its momentum.
#[cfg(feature = "cuda")]
fn blend_outputs(pairs: &[(&Tensor, &Tensor)], idx: &[usize]) -> Result<Vec<Tensor>> {
    use crate::storage::Storage;
    idx.iter()
        .map(|&i| {
            let m = pairs[i].1;
            Tensor::from_storage(Storage::uninit(m.device(), m.dtype(), m.numel())?, m.shape().clone())
        })
        .collect()
}

/// The kernel rows `[momentum, gradient, blend]` of the selected pairs.
#[cfg(feature = "cuda")]
fn blend_items<'a>(pairs: &[(&'a Tensor, &'a Tensor)], idx: &[usize], outs: &'a [Tensor]) -> Vec<[Option<&'a Tensor>; 3]> {
    idx.iter().zip(outs).map(|(&i, u)| [Some(pairs[i].1), Some(pairs[i].0), Some(u)]).collect()
}

#[cfg(feature = "cuda")]
fn fused_blend(pairs: &[(&Tensor, &Tensor)], idx: &[usize], beta: f64, nesterov: bool) -> Result<Vec<(usize, Tensor)>> {
    let outs = blend_outputs(pairs, idx)?;
    let items = blend_items(pairs, idx, &outs);
    let factors = [lerp_factor(1.0 - beta), lerp_factor(beta)];
    on_device_rows("momentum_blend_many", &items, [true, false, true], |dev, rows| {
        crate::cuda::ops::blend_many(dev, rows, factors, nesterov)
    })?;
    Ok(idx.iter().copied().zip(outs).collect())
}

#[cfg(not(feature = "cuda"))]
fn fused_blend(pairs: &[(&Tensor, &Tensor)], idx: &[usize], beta: f64, nesterov: bool) -> Result<Vec<(usize, Tensor)>> {
    idx.iter().map(|&i| Ok((i, Tensor::momentum_blend_composed(pairs[i].0, pairs[i].1, beta, nesterov)?))).collect()
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
        fused_lerp(&fused, w)
    }
}

#[cfg(feature = "cuda")]
fn fused_lerp(pairs: &[(&Tensor, &Tensor)], w: f64) -> Result<()> {
    let items: Vec<[Option<&Tensor>; 3]> = pairs.iter().map(|&(d, s)| [Some(d), Some(s), None]).collect();
    let (f, small) = lerp_factor(w);
    on_device_rows("lerp_many_", &items, [true, false, false], |dev, rows| crate::cuda::ops::lerp_many(dev, rows, f, small))
}

#[cfg(not(feature = "cuda"))]
fn fused_lerp(pairs: &[(&Tensor, &Tensor)], w: f64) -> Result<()> {
    for &(d, s) in pairs {
        crate::no_grad(|| d.copy_(&lerp(d, s, w)?))?;
    }
    Ok(())
}

//! Fused optimizer steps over many tensors (PyTorch's fused / `_foreach` SGD): the bytes of the
//! composed tensor ops they stand for, with one launch per 40 parameters on CUDA instead of about
//! ten per parameter.

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

#[cfg(feature = "cuda")]
fn fused_blend(pairs: &[(&Tensor, &Tensor)], idx: &[usize], beta: f64, nesterov: bool) -> Result<Vec<(usize, Tensor)>> {
    use crate::storage::Storage;
    // Every element of an output is written by the kernel.
    let outs: Vec<Tensor> = idx
        .iter()
        .map(|&i| {
            let m = pairs[i].1;
            Tensor::from_storage(Storage::uninit(m.device(), m.dtype(), m.numel())?, m.shape().clone())
        })
        .collect::<Result<_>>()?;
    let items: Vec<[Option<&Tensor>; 3]> = idx.iter().zip(&outs).map(|(&i, u)| [Some(pairs[i].1), Some(pairs[i].0), Some(u)]).collect();
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

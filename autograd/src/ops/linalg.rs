//! Matrix products: `matmul` (batched, broadcasting batch dims) and `linear`.

use crate::autograd::{record, FnBackward};
use crate::backend::MatmulParams;
use crate::{Error, Result, Tensor};

/// `op(a) · op(b)` on the storage, without history.
fn mm_raw(a: &Tensor, b: &Tensor, p: MatmulParams) -> Result<Tensor> {
    let s = a.read_storage()?.matmul(&*b.read_storage()?, &p)?;
    Tensor::from_storage(s, vec![p.batch(), p.m, p.n])
}

impl Tensor {
    /// Matrix product over the last two dims; leading dims broadcast when one side has a single
    /// batch (e.g. `[B, M, K] · [K, N]`) or both have the same batch dims.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        if crate::autocast::autocast_dtype().is_some() {
            let (a, b) = (crate::autocast::cast_for_compute(self)?, crate::autocast::cast_for_compute(rhs)?);
            return crate::autocast::autocast(None, || a.matmul(&b));
        }
        super::same_dtype("matmul", self, rhs)?;
        let (ad, bd) = (self.dims(), rhs.dims());
        if ad.len() < 2 || bd.len() < 2 || ad[ad.len() - 1] != bd[bd.len() - 2] {
            return Err(Error::ShapeMismatch { op: "matmul", lhs: ad.to_vec(), rhs: bd.to_vec() });
        }
        let (m, k, n) = (ad[ad.len() - 2], ad[ad.len() - 1], bd[bd.len() - 1]);
        let (a_lead, b_lead) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
        let (ab, bb): (usize, usize) = (a_lead.iter().product(), b_lead.iter().product());
        let lead = if ab == 1 && a_lead.len() <= b_lead.len() {
            b_lead.to_vec()
        } else if bb == 1 && b_lead.len() <= a_lead.len() || a_lead == b_lead {
            a_lead.to_vec()
        } else {
            return Err(Error::BroadcastIncompatible { op: "matmul", lhs: ad.to_vec(), rhs: bd.to_vec() });
        };
        let p = MatmulParams { lhs_batch: ab, rhs_batch: bb, m, n, k, lhs_t: false, rhs_t: false };
        let mut out_shape = lead.clone();
        out_shape.extend([m, n]);
        let y = mm_raw(self, rhs, p)?.reshape(out_shape)?;
        if !(self.requires_grad() || rhs.requires_grad()) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let (a, b) = (self.detach(), rhs.detach());
        let (need_a, need_b) = (self.requires_grad(), rhs.requires_grad());
        let batch = p.batch();
        Ok(record(
            &[self, rhs],
            vec![y],
            FnBackward {
                name: "matmul",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None, None]) };
                    let g3 = g.reshape(vec![batch, m, n])?;
                    let ga = if need_a {
                        // dA = dC · Bᵀ
                        let pa = MatmulParams { lhs_batch: batch, rhs_batch: p.rhs_batch, m, n: k, k: n, lhs_t: false, rhs_t: true };
                        let t = mm_raw(&g3, &b, pa)?;
                        let t = if p.lhs_batch == 1 && batch > 1 { t.sum_dim(0, false)? } else { t };
                        Some(t.reshape(a.shape().clone())?)
                    } else {
                        None
                    };
                    let gb = if need_b {
                        // dB = Aᵀ · dC
                        let pb = MatmulParams { lhs_batch: p.lhs_batch, rhs_batch: batch, m: k, n, k: m, lhs_t: true, rhs_t: false };
                        let t = mm_raw(&a, &g3, pb)?;
                        let t = if p.rhs_batch == 1 && batch > 1 { t.sum_dim(0, false)? } else { t };
                        Some(t.reshape(b.shape().clone())?)
                    } else {
                        None
                    };
                    Ok(vec![ga, gb])
                },
            },
        )
        .remove(0))
    }

    /// `op(self) · op(rhs)` over the last two dims, `op` a transpose where `lhs_t` / `rhs_t` ask
    /// for one: on CUDA the GEMM reads the operand transposed, so no transposed copy is made
    /// (forward or backward); on the CPU it is `matmul` of the transposes (the CPU GEMM's sums
    /// follow the operands' layout, and CPU runs keep their bytes). Leading dims must be equal (no
    /// broadcasting).
    pub fn matmul_t(&self, rhs: &Tensor, lhs_t: bool, rhs_t: bool) -> Result<Tensor> {
        if crate::autocast::autocast_dtype().is_some() {
            let (a, b) = (crate::autocast::cast_for_compute(self)?, crate::autocast::cast_for_compute(rhs)?);
            return crate::autocast::autocast(None, || a.matmul_t(&b, lhs_t, rhs_t));
        }
        if self.device() == crate::Device::Cpu {
            let tr = |t: &Tensor, yes: bool| if yes { t.transpose(-2, -1) } else { Ok(t.clone()) };
            return tr(self, lhs_t)?.matmul(&tr(rhs, rhs_t)?);
        }
        super::same_dtype("matmul_t", self, rhs)?;
        let (ad, bd) = (self.dims(), rhs.dims());
        let mismatch = || Error::ShapeMismatch { op: "matmul_t", lhs: ad.to_vec(), rhs: bd.to_vec() };
        if ad.len() < 2 || ad.len() != bd.len() || ad[..ad.len() - 2] != bd[..bd.len() - 2] {
            return Err(mismatch());
        }
        let (ar, ac, br, bc) = (ad[ad.len() - 2], ad[ad.len() - 1], bd[bd.len() - 2], bd[bd.len() - 1]);
        let (m, k) = if lhs_t { (ac, ar) } else { (ar, ac) };
        let (k2, n) = if rhs_t { (bc, br) } else { (br, bc) };
        if k != k2 {
            return Err(mismatch());
        }
        let lead = ad[..ad.len() - 2].to_vec();
        let batch: usize = lead.iter().product();
        let p = MatmulParams { lhs_batch: batch, rhs_batch: batch, m, n, k, lhs_t, rhs_t };
        let mut out_shape = lead;
        out_shape.extend([m, n]);
        let y = mm_raw(self, rhs, p)?.reshape(out_shape)?;
        if !(self.requires_grad() || rhs.requires_grad()) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let (a, b) = (self.detach(), rhs.detach());
        let (need_a, need_b) = (self.requires_grad(), rhs.requires_grad());
        let mp = move |m, n, k, lhs_t, rhs_t| MatmulParams { lhs_batch: batch, rhs_batch: batch, m, n, k, lhs_t, rhs_t };
        Ok(record(
            &[self, rhs],
            vec![y],
            FnBackward {
                name: "matmul_t",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None, None]) };
                    let g3 = g.reshape(vec![batch, m, n])?;
                    // A stored [m, k]: dA = dC · op(B)ᵀ; stored [k, m]: dA = op(B) · dCᵀ.
                    let ga = if !need_a {
                        None
                    } else if lhs_t {
                        Some(mm_raw(&b, &g3, mp(k, m, n, rhs_t, true))?.reshape(a.shape().clone())?)
                    } else {
                        Some(mm_raw(&g3, &b, mp(m, k, n, false, !rhs_t))?.reshape(a.shape().clone())?)
                    };
                    // B stored [k, n]: dB = op(A)ᵀ · dC; stored [n, k]: dB = dCᵀ · op(A).
                    let gb = if !need_b {
                        None
                    } else if rhs_t {
                        Some(mm_raw(&g3, &a, mp(n, k, m, true, lhs_t))?.reshape(b.shape().clone())?)
                    } else {
                        Some(mm_raw(&a, &g3, mp(k, n, m, !lhs_t, false))?.reshape(b.shape().clone())?)
                    };
                    Ok(vec![ga, gb])
                },
            },
        )
        .remove(0))
    }

    /// `beta·self + alpha·(a · b)` over the last two dims, equal leading dims (PyTorch `baddbmm`,
    /// without broadcasting or autocast): the products accumulated in f32 (f64 for f64) and the sum
    /// rounded once to the dtype — the fused form of Newton–Schulz's reference (docs/training.md §3.5).
    pub fn baddbmm(&self, a: &Tensor, b: &Tensor, beta: f64, alpha: f64) -> Result<Tensor> {
        super::same_dtype("baddbmm", a, b)?;
        super::same_dtype("baddbmm", self, a)?;
        let (cd, ad, bd) = (self.dims(), a.dims(), b.dims());
        let mismatch = || Error::ShapeMismatch { op: "baddbmm", lhs: ad.to_vec(), rhs: bd.to_vec() };
        let r = ad.len();
        if r < 2 || bd.len() != r || cd.len() != r || ad[..r - 2] != bd[..r - 2] || ad[..r - 2] != cd[..r - 2] {
            return Err(mismatch());
        }
        let (m, k, n) = (ad[r - 2], ad[r - 1], bd[r - 1]);
        if bd[r - 2] != k || cd[r - 2] != m || cd[r - 1] != n {
            return Err(mismatch());
        }
        if k == 0 {
            return self.affine(beta, 0.0);
        }
        let batch: usize = ad[..r - 2].iter().product();
        let p = MatmulParams { lhs_batch: batch, rhs_batch: batch, m, n, k, lhs_t: false, rhs_t: false };
        let st = a.read_storage()?.matmul_add(&*b.read_storage()?, &*self.read_storage()?, &p, alpha, beta)?;
        let y = Tensor::from_storage(st, cd.to_vec())?;
        let needs = [self.requires_grad(), a.requires_grad(), b.requires_grad()];
        if !needs.iter().any(|&x| x) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let (ad_, bd_) = (a.detach(), b.detach());
        let mp = move |m, n, k, lhs_t, rhs_t| MatmulParams { lhs_batch: batch, rhs_batch: batch, m, n, k, lhs_t, rhs_t };
        Ok(record(
            &[self, a, b],
            vec![y],
            FnBackward {
                name: "baddbmm",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None, None, None]) };
                    let g3 = g.reshape(vec![batch, m, n])?;
                    let gc = if needs[0] { Some(g.affine(beta, 0.0)?) } else { None };
                    // dA = alpha·dD·Bᵀ, dB = alpha·Aᵀ·dD.
                    let ga = if needs[1] {
                        Some(mm_raw(&g3, &bd_, mp(m, k, n, false, true))?.affine(alpha, 0.0)?.reshape(ad_.shape().clone())?)
                    } else {
                        None
                    };
                    let gb = if needs[2] {
                        Some(mm_raw(&ad_, &g3, mp(k, n, m, true, false))?.affine(alpha, 0.0)?.reshape(bd_.shape().clone())?)
                    } else {
                        None
                    };
                    Ok(vec![gc, ga, gb])
                },
            },
        )
        .remove(0))
    }

    /// Batched matmul of two 3-d tensors (alias of `matmul` with a rank check).
    pub fn bmm(&self, rhs: &Tensor) -> Result<Tensor> {
        if self.rank() != 3 || rhs.rank() != 3 {
            return Err(Error::invalid("bmm", format!("expected 3-d operands, got {:?} and {:?}", self.dims(), rhs.dims())));
        }
        self.matmul(rhs)
    }

    /// `x · wᵀ + b` with `w: [out, in]` (PyTorch `Linear`).
    pub fn linear(&self, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        if crate::autocast::autocast_dtype().is_some() {
            let (x, w) = (crate::autocast::cast_for_compute(self)?, crate::autocast::cast_for_compute(w)?);
            let b = b.map(crate::autocast::cast_for_compute).transpose()?;
            return crate::autocast::autocast(None, || x.linear(&w, b.as_ref()));
        }
        super::same_dtype("linear", self, w)?;
        let xd = self.dims();
        if w.rank() != 2 || xd.is_empty() || xd[xd.len() - 1] != w.dims()[1] {
            return Err(Error::ShapeMismatch { op: "linear", lhs: xd.to_vec(), rhs: w.dims().to_vec() });
        }
        let (inp, out) = (w.dims()[1], w.dims()[0]);
        let rows = self.numel() / inp.max(1);
        let p = MatmulParams { lhs_batch: 1, rhs_batch: 1, m: rows, n: out, k: inp, lhs_t: false, rhs_t: true };
        let mut shape = xd.to_vec();
        *shape.last_mut().unwrap_or(&mut 0) = out;
        let y = mm_raw(self, w, p)?.reshape(shape)?;
        let y = if (self.requires_grad() || w.requires_grad()) && crate::is_grad_enabled() {
            let (x, wd) = (self.detach(), w.detach());
            let (need_x, need_w) = (self.requires_grad(), w.requires_grad());
            record(
                &[self, w],
                vec![y],
                FnBackward {
                    name: "linear",
                    f: move |g: &[Option<Tensor>]| {
                        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
                        let gx = if need_x {
                            let pg = MatmulParams { lhs_batch: 1, rhs_batch: 1, m: rows, n: inp, k: out, lhs_t: false, rhs_t: false };
                            Some(mm_raw(g, &wd, pg)?.reshape(x.shape().clone())?)
                        } else {
                            None
                        };
                        let gw = if need_w {
                            let pg = MatmulParams { lhs_batch: 1, rhs_batch: 1, m: out, n: inp, k: rows, lhs_t: true, rhs_t: false };
                            Some(mm_raw(g, &x, pg)?.reshape(vec![out, inp])?)
                        } else {
                            None
                        };
                        Ok(vec![gx, gw])
                    },
                },
            )
            .remove(0)
        } else {
            y
        };
        match b {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}

//! Convolution (im2col + GEMM) and max-pooling on the CPU. Batch items run in parallel; gradient
//! sums over the batch are reduced in batch order so the bytes never depend on the thread count.

use num_traits::Float;
use rayon::prelude::*;

use super::matmul::{gemm_rm, GemmElem};
use super::CpuStorage;
use crate::backend::{BackendStorage, Conv2dParams, Pool2dParams};
use crate::{Error, Result};

trait ConvElem: GemmElem + Float {}
impl ConvElem for f32 {}
impl ConvElem for f64 {}

fn is_pointwise(p: &Conv2dParams) -> bool {
    p.kh == 1 && p.kw == 1 && p.stride == (1, 1) && p.padding == (0, 0)
}

/// Unfolds one group of one image (`x`: cg×H×W) into `col` ((cg·kh·kw) × (oh·ow)).
fn im2col<T: ConvElem>(x: &[T], cg: usize, p: &Conv2dParams, col: &mut [T]) {
    let (oh, ow) = (p.h_out(), p.w_out());
    let (h, w) = (p.h_in, p.w_in);
    for c in 0..cg {
        for ky in 0..p.kh {
            for kx in 0..p.kw {
                let r = (c * p.kh + ky) * p.kw + kx;
                let row = &mut col[r * oh * ow..(r + 1) * oh * ow];
                for oy in 0..oh {
                    let iy = (oy * p.stride.0 + ky) as isize - p.padding.0 as isize;
                    let dst = &mut row[oy * ow..(oy + 1) * ow];
                    if iy < 0 || iy >= h as isize {
                        dst.iter_mut().for_each(|v| *v = T::zero());
                        continue;
                    }
                    let src = &x[(c * h + iy as usize) * w..(c * h + iy as usize + 1) * w];
                    for (ox, d) in dst.iter_mut().enumerate() {
                        let ix = (ox * p.stride.1 + kx) as isize - p.padding.1 as isize;
                        *d = if ix < 0 || ix >= w as isize { T::zero() } else { src[ix as usize] };
                    }
                }
            }
        }
    }
}

/// Folds `col` back into `dx` (cg×H×W), accumulating overlaps in a fixed order.
fn col2im<T: ConvElem>(col: &[T], cg: usize, p: &Conv2dParams, dx: &mut [T]) {
    let (oh, ow) = (p.h_out(), p.w_out());
    let (h, w) = (p.h_in, p.w_in);
    for c in 0..cg {
        for ky in 0..p.kh {
            for kx in 0..p.kw {
                let r = (c * p.kh + ky) * p.kw + kx;
                for oy in 0..oh {
                    let iy = (oy * p.stride.0 + ky) as isize - p.padding.0 as isize;
                    if iy < 0 || iy >= h as isize {
                        continue;
                    }
                    for ox in 0..ow {
                        let ix = (ox * p.stride.1 + kx) as isize - p.padding.1 as isize;
                        if ix >= 0 && ix < w as isize {
                            dx[(c * h + iy as usize) * w + ix as usize] =
                                dx[(c * h + iy as usize) * w + ix as usize] + col[r * oh * ow + oy * ow + ox];
                        }
                    }
                }
            }
        }
    }
}

fn threads_inside(batch: usize) -> usize {
    let t = rayon::current_num_threads();
    if batch >= t {
        1
    } else {
        t
    }
}

fn fwd<T: ConvElem>(x: &[T], wt: &[T], p: &Conv2dParams) -> Vec<T> {
    let (g, cg, og) = (p.groups, p.c_in / p.groups, p.c_out / p.groups);
    let (ohw, kk) = (p.h_out() * p.w_out(), cg * p.kh * p.kw);
    let in_img = p.c_in * p.h_in * p.w_in;
    let mut out = vec![T::zero(); p.batch * p.c_out * ohw];
    let th = threads_inside(p.batch);
    out.par_chunks_mut((p.c_out * ohw).max(1)).enumerate().for_each(|(n, o)| {
        let mut col = if is_pointwise(p) { Vec::new() } else { vec![T::zero(); kk * ohw] };
        for gi in 0..g {
            let xg = &x[n * in_img + gi * cg * p.h_in * p.w_in..n * in_img + (gi + 1) * cg * p.h_in * p.w_in];
            let colr: &[T] = if is_pointwise(p) {
                xg
            } else {
                im2col(xg, cg, p, &mut col);
                &col
            };
            gemm_rm(
                og,
                ohw,
                kk,
                &wt[gi * og * kk..(gi + 1) * og * kk],
                false,
                colr,
                false,
                &mut o[gi * og * ohw..(gi + 1) * og * ohw],
                false,
                th,
            );
        }
    });
    out
}

fn bwd_input<T: ConvElem>(dy: &[T], wt: &[T], p: &Conv2dParams) -> Vec<T> {
    let (g, cg, og) = (p.groups, p.c_in / p.groups, p.c_out / p.groups);
    let (ohw, kk) = (p.h_out() * p.w_out(), cg * p.kh * p.kw);
    let in_img = p.c_in * p.h_in * p.w_in;
    let mut dx = vec![T::zero(); p.batch * in_img];
    let th = threads_inside(p.batch);
    dx.par_chunks_mut(in_img.max(1)).enumerate().for_each(|(n, dxi)| {
        let mut col = vec![T::zero(); kk * ohw];
        for gi in 0..g {
            let dyg = &dy[(n * p.c_out + gi * og) * ohw..(n * p.c_out + (gi + 1) * og) * ohw];
            let dxg = &mut dxi[gi * cg * p.h_in * p.w_in..(gi + 1) * cg * p.h_in * p.w_in];
            if is_pointwise(p) {
                gemm_rm(kk, ohw, og, &wt[gi * og * kk..(gi + 1) * og * kk], true, dyg, false, dxg, false, th);
            } else {
                gemm_rm(kk, ohw, og, &wt[gi * og * kk..(gi + 1) * og * kk], true, dyg, false, &mut col, false, th);
                col2im(&col, cg, p, dxg);
            }
        }
    });
    dx
}

fn bwd_weight<T: ConvElem>(dy: &[T], x: &[T], p: &Conv2dParams) -> Vec<T> {
    let (g, cg, og) = (p.groups, p.c_in / p.groups, p.c_out / p.groups);
    let (ohw, kk) = (p.h_out() * p.w_out(), cg * p.kh * p.kw);
    let in_img = p.c_in * p.h_in * p.w_in;
    let wlen = p.c_out * kk;
    let th = threads_inside(p.batch);
    let partial: Vec<Vec<T>> = (0..p.batch)
        .into_par_iter()
        .map(|n| {
            let mut dw = vec![T::zero(); wlen];
            let mut col = if is_pointwise(p) { Vec::new() } else { vec![T::zero(); kk * ohw] };
            for gi in 0..g {
                let xg = &x[n * in_img + gi * cg * p.h_in * p.w_in..n * in_img + (gi + 1) * cg * p.h_in * p.w_in];
                let colr: &[T] = if is_pointwise(p) {
                    xg
                } else {
                    im2col(xg, cg, p, &mut col);
                    &col
                };
                let dyg = &dy[(n * p.c_out + gi * og) * ohw..(n * p.c_out + (gi + 1) * og) * ohw];
                gemm_rm(og, kk, ohw, dyg, false, colr, true, &mut dw[gi * og * kk..(gi + 1) * og * kk], false, th);
            }
            dw
        })
        .collect();
    let mut out = vec![T::zero(); wlen];
    for part in partial {
        out.iter_mut().zip(part).for_each(|(a, b)| *a = *a + b);
    }
    out
}

fn check(op: &'static str, x: &CpuStorage, w: &CpuStorage) -> Result<()> {
    if x.dtype() != w.dtype() {
        return Err(Error::DTypeMismatch { op, lhs: x.dtype(), rhs: w.dtype() });
    }
    Ok(())
}

macro_rules! conv_dispatch {
    ($op:literal, $a:expr, $b:expr, $f:ident, $p:expr) => {{
        check($op, $a, $b)?;
        if $p.channels_last {
            return Err(Error::invalid($op, "channels-last data: the CPU computes contiguous NCHW (convert at the op's entry)"));
        }
        use CpuStorage as S;
        Ok(match ($a, $b) {
            (S::F32(x), S::F32(y)) => S::F32($f(x, y, $p)),
            (S::F64(x), S::F64(y)) => S::F64($f(x, y, $p)),
            (S::F16(x), S::F16(y)) => S::F16(super::narrow_f16($f(&super::widen_f16(x), &super::widen_f16(y), $p))),
            (S::BF16(x), S::BF16(y)) => S::BF16(super::narrow_bf16($f(&super::widen_bf16(x), &super::widen_bf16(y), $p))),
            _ => return Err(Error::UnsupportedDType { op: $op, dtype: $a.dtype(), expected: "a float dtype" }),
        })
    }};
}

pub(crate) fn conv2d(x: &CpuStorage, w: &CpuStorage, p: &Conv2dParams) -> Result<CpuStorage> {
    conv_dispatch!("conv2d", x, w, fwd, p)
}
pub(crate) fn conv2d_backward_input(dy: &CpuStorage, w: &CpuStorage, p: &Conv2dParams) -> Result<CpuStorage> {
    conv_dispatch!("conv2d_backward_input", dy, w, bwd_input, p)
}
pub(crate) fn conv2d_backward_weight(dy: &CpuStorage, x: &CpuStorage, p: &Conv2dParams) -> Result<CpuStorage> {
    conv_dispatch!("conv2d_backward_weight", dy, x, bwd_weight, p)
}

fn pool_fwd<T: Float + Send + Sync>(x: &[T], p: &Pool2dParams) -> (Vec<T>, Vec<i64>) {
    let (oh, ow) = (p.h_out(), p.w_out());
    let planes = p.batch * p.channels;
    let plane = p.h_in * p.w_in;
    let res: Vec<(Vec<T>, Vec<i64>)> = (0..planes)
        .into_par_iter()
        .map(|pl| {
            let xp = &x[pl * plane..(pl + 1) * plane];
            let mut v = Vec::with_capacity(oh * ow);
            let mut ix = Vec::with_capacity(oh * ow);
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut best = T::neg_infinity();
                    let mut bi = -1i64;
                    for ky in 0..p.kernel {
                        let iy = (oy * p.stride + ky) as isize - p.padding as isize;
                        if iy < 0 || iy >= p.h_in as isize {
                            continue;
                        }
                        for kx in 0..p.kernel {
                            let jx = (ox * p.stride + kx) as isize - p.padding as isize;
                            if jx < 0 || jx >= p.w_in as isize {
                                continue;
                            }
                            let k = iy as usize * p.w_in + jx as usize;
                            let val = xp[k];
                            if bi < 0 || val > best || val.is_nan() && !best.is_nan() {
                                best = val;
                                bi = k as i64;
                            }
                        }
                    }
                    v.push(best);
                    ix.push(bi.max(0));
                }
            }
            (v, ix)
        })
        .collect();
    let mut vals = Vec::with_capacity(planes * oh * ow);
    let mut idx = Vec::with_capacity(planes * oh * ow);
    for (v, i) in res {
        vals.extend(v);
        idx.extend(i);
    }
    (vals, idx)
}

/// `v` (one value per element of logical `[n, c, h, w]`) moved from N, H, W, C order to N, C, H, W
/// (`to_planes`) or back.
fn relayout<T: Copy>(v: &[T], [n, c, h, w]: [usize; 4], to_planes: bool) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    match to_planes {
        true => {
            for i in 0..n * c * h * w {
                let (x, y, ch, img) = (i % w, (i / w) % h, (i / (w * h)) % c, i / (w * h * c));
                out.push(v[((img * h + y) * w + x) * c + ch]);
            }
        }
        false => {
            for i in 0..n * h * w * c {
                let (ch, x, y, img) = (i % c, (i / c) % w, (i / (c * w)) % h, i / (c * w * h));
                out.push(v[((img * c + ch) * h + y) * w + x]);
            }
        }
    }
    out
}

/// `s` (logical NCHW `shape`) in N, C, H, W order: itself, or a rearranged copy when it is
/// stored N, H, W, C (`channels_last`). Ops that have only the planar loops run on it.
pub(crate) fn planes_of<'a>(s: &'a CpuStorage, shape: &[usize], channels_last: bool) -> Result<std::borrow::Cow<'a, CpuStorage>> {
    if !channels_last {
        return Ok(std::borrow::Cow::Borrowed(s));
    }
    Ok(std::borrow::Cow::Owned(relayout_storage(s, dims4(s, shape)?, true)?))
}

/// `s` (N, C, H, W order, logical `shape`) stored N, H, W, C when `channels_last`, else as it is.
pub(crate) fn stored_as(s: CpuStorage, shape: &[usize], channels_last: bool) -> Result<CpuStorage> {
    if !channels_last {
        return Ok(s);
    }
    relayout_storage(&s, dims4(&s, shape)?, false)
}

/// `shape` as four dimensions whose product is the storage's length.
fn dims4(s: &CpuStorage, shape: &[usize]) -> Result<[usize; 4]> {
    match shape {
        [n, c, h, w] if n * c * h * w == s.len() => Ok([*n, *c, *h, *w]),
        _ => Err(Error::invalid("channels-last storage", format!("shape {shape:?} is not four dimensions of {} elements", s.len()))),
    }
}

/// A storage of logical `dims` moved between N, H, W, C and N, C, H, W order (see [`relayout`]).
fn relayout_storage(s: &CpuStorage, dims: [usize; 4], to_planes: bool) -> Result<CpuStorage> {
    use CpuStorage as S;
    Ok(match s {
        S::F32(v) => S::F32(relayout(v, dims, to_planes)),
        S::F64(v) => S::F64(relayout(v, dims, to_planes)),
        S::F16(v) => S::F16(relayout(v, dims, to_planes)),
        S::BF16(v) => S::BF16(relayout(v, dims, to_planes)),
        S::I64(v) => S::I64(relayout(v, dims, to_planes)),
        other => {
            return Err(Error::UnsupportedDType {
                op: "channels-last storage",
                dtype: other.dtype(),
                expected: "a float dtype or i64 indices",
            })
        }
    })
}

pub(crate) fn max_pool2d(x: &CpuStorage, p: &Pool2dParams) -> Result<(CpuStorage, CpuStorage)> {
    if p.channels_last {
        // The NCHW loops on rearranged copies: the same values and indices, stored N, H, W, C.
        let planar = Pool2dParams { channels_last: false, ..*p };
        let (v, i) = max_pool2d(&relayout_storage(x, [p.batch, p.channels, p.h_in, p.w_in], true)?, &planar)?;
        let out = [p.batch, p.channels, p.h_out(), p.w_out()];
        return Ok((relayout_storage(&v, out, false)?, relayout_storage(&i, out, false)?));
    }
    use CpuStorage as S;
    let (v, i) = match x {
        S::F32(v) => {
            let (a, b) = pool_fwd(v, p);
            (S::F32(a), b)
        }
        S::F64(v) => {
            let (a, b) = pool_fwd(v, p);
            (S::F64(a), b)
        }
        S::F16(v) => {
            let (a, b) = pool_fwd(&super::widen_f16(v), p);
            (S::F16(super::narrow_f16(a)), b)
        }
        S::BF16(v) => {
            let (a, b) = pool_fwd(&super::widen_bf16(v), p);
            (S::BF16(super::narrow_bf16(a)), b)
        }
        other => return Err(Error::UnsupportedDType { op: "max_pool2d", dtype: other.dtype(), expected: "a float dtype" }),
    };
    Ok((v, S::I64(i)))
}

fn pool_bwd<T: Float + Send + Sync>(dy: &[T], idx: &[i64], p: &Pool2dParams) -> Vec<T> {
    let (ohw, plane) = (p.h_out() * p.w_out(), p.h_in * p.w_in);
    let mut dx = vec![T::zero(); p.batch * p.channels * plane];
    dx.par_chunks_mut(plane.max(1)).enumerate().for_each(|(pl, d)| {
        for k in 0..ohw {
            let j = idx[pl * ohw + k] as usize;
            d[j] = d[j] + dy[pl * ohw + k];
        }
    });
    dx
}

pub(crate) fn max_pool2d_backward(dy: &CpuStorage, idx: &CpuStorage, p: &Pool2dParams) -> Result<CpuStorage> {
    if p.channels_last {
        let planar = Pool2dParams { channels_last: false, ..*p };
        let out = [p.batch, p.channels, p.h_out(), p.w_out()];
        let (dy, idx) = (relayout_storage(dy, out, true)?, relayout_storage(idx, out, true)?);
        let dx = max_pool2d_backward(&dy, &idx, &planar)?;
        return relayout_storage(&dx, [p.batch, p.channels, p.h_in, p.w_in], false);
    }
    let idx = idx.as_i64("max_pool2d_backward")?;
    super::float_map!(dy, "max_pool2d_backward", |v| pool_bwd(v, idx, p))
}

/// Nearest upsampling by `f` of `x` (`shape` = [n, c, h, w]): each value fills its f×f block.
pub(crate) fn upsample_fwd<T: Float + Send + Sync>(x: &[T], shape: [usize; 4], f: usize) -> Vec<T> {
    let (h, w) = (shape[2], shape[3]);
    let (oh, ow) = (h * f, w * f);
    let mut y = vec![T::zero(); x.len() * f * f];
    y.par_chunks_mut((oh * ow).max(1)).zip(x.par_chunks((h * w).max(1))).for_each(|(o, i)| {
        for r in 0..oh {
            for c in 0..ow {
                o[r * ow + c] = i[(r / f) * w + c / f];
            }
        }
    });
    y
}

/// [`upsample_fwd`] on N, H, W, C storage: each output position copies its source position's
/// channels.
pub(crate) fn upsample_fwd_nhwc<T: Float + Send + Sync>(x: &[T], shape: [usize; 4], f: usize) -> Vec<T> {
    let (c, h, w) = (shape[1], shape[2], shape[3]);
    let (oh, ow) = (h * f, w * f);
    let mut y = vec![T::zero(); x.len() * f * f];
    y.par_chunks_mut((oh * ow * c).max(1)).zip(x.par_chunks((h * w * c).max(1))).for_each(|(o, i)| {
        for r in 0..oh {
            for col in 0..ow {
                let (dst, src) = ((r * ow + col) * c, ((r / f) * w + col / f) * c);
                o[dst..dst + c].copy_from_slice(&i[src..src + c]);
            }
        }
    });
    y
}

/// [`upsample_bwd`] on N, H, W, C storage: each input position sums its f×f block of `dy`,
/// row-major, channel by channel.
pub(crate) fn upsample_bwd_nhwc<T: Float + Send + Sync>(dy: &[T], shape: [usize; 4], f: usize) -> Vec<T> {
    let (c, h, w) = (shape[1], shape[2], shape[3]);
    let ow = w * f;
    let mut dx = vec![T::zero(); shape.iter().product()];
    dx.par_chunks_mut((h * w * c).max(1)).zip(dy.par_chunks((h * w * f * f * c).max(1))).for_each(|(d, g)| {
        for r in 0..h {
            for col in 0..w {
                for ch in 0..c {
                    let mut s = T::zero();
                    for a in 0..f {
                        for b in 0..f {
                            s = s + g[((r * f + a) * ow + col * f + b) * c + ch];
                        }
                    }
                    d[(r * w + col) * c + ch] = s;
                }
            }
        }
    });
    dx
}

/// Gradient of [`upsample_fwd`]: each input position sums its f×f block of `dy`, row-major.
pub(crate) fn upsample_bwd<T: Float + Send + Sync>(dy: &[T], shape: [usize; 4], f: usize) -> Vec<T> {
    let (h, w) = (shape[2], shape[3]);
    let ow = w * f;
    let mut dx = vec![T::zero(); shape.iter().product()];
    dx.par_chunks_mut((h * w).max(1)).zip(dy.par_chunks((h * w * f * f).max(1))).for_each(|(d, g)| {
        for r in 0..h {
            for c in 0..w {
                let mut s = T::zero();
                for a in 0..f {
                    for b in 0..f {
                        s = s + g[(r * f + a) * ow + c * f + b];
                    }
                }
                d[r * w + c] = s;
            }
        }
    });
    dx
}

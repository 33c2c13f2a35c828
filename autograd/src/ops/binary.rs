//! Broadcasting binary ops, comparisons and `where_cond`, with their gradients.

use super::{broadcast_layouts, same_dtype};
use crate::autograd::{record, record1, FnBackward};
use crate::backend::{BinaryOp, CmpOp};
use crate::shape::Layout;
use crate::{Error, MemoryFormat, Result, Tensor};

fn forward(a: &Tensor, b: &Tensor, op: BinaryOp, name: &'static str) -> Result<Tensor> {
    same_dtype(name, a, b)?;
    let (out, la, lb) = broadcast_layouts(name, a, b)?;
    if let Some([pa, pb]) = channels_last_space(&out, [(a, &la), (b, &lb)]) {
        // Iterated in the N, H, W, C order of the channels-last operand's storage: each operand
        // read where it lies (a channels-last one as stored, a contiguous or broadcast one through
        // its strides), the result stored channels-last — no conversion pass.
        let cl = |t: &Tensor| t.memory_format() == MemoryFormat::ChannelsLast;
        let s = a.storage_for(cl(a))?.binary(&pa, &*b.storage_for(cl(b))?, &pb, op)?;
        return Tensor::from_storage_in(s, out.into(), MemoryFormat::ChannelsLast);
    }
    let s = a.read_storage()?.binary(&la, &*b.read_storage()?, &lb, op)?;
    Tensor::from_storage(s, out)
}

/// The operands' layouts over the N, H, W, C iteration order, when the result is 4-D and some
/// operand is channels-last with the result's shape (every channels-last operand must have it; a
/// broadcast channels-last one keeps the entry rule). `None`: compute in the logical order.
fn channels_last_space(out: &[usize], ops: [(&Tensor, &Layout); 2]) -> Option<[Layout; 2]> {
    let &[n, c, h, w] = out else { return None };
    let cl = |t: &Tensor| t.memory_format() == MemoryFormat::ChannelsLast;
    if !ops.iter().any(|(t, _)| cl(t)) || ops.iter().any(|(t, _)| cl(t) && t.dims() != out) {
        return None;
    }
    let shape = vec![n, h, w, c];
    Some(ops.map(|(t, l)| {
        let strides = match cl(t) {
            true => vec![h * w * c, w * c, c, 1],
            false => vec![l.strides[0], l.strides[2], l.strides[3], l.strides[1]],
        };
        Layout { shape: shape.clone(), strides, offset: l.offset }
    }))
}

/// (g, a, b, y, which inputs need a gradient) → the unreduced gradients; an input that needs none
/// gets `None` without its kernels being launched (a mask, a target or a normaliser is often one
/// side of a binary op in a loss).
type PairGrad = dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor, Need) -> Result<(Option<Tensor>, Option<Tensor>)> + Send + Sync;

/// Which inputs of a binary op need a gradient.
#[derive(Clone, Copy)]
struct Need {
    a: bool,
    b: bool,
}

/// `f()` when `need`, else nothing (and nothing launched).
fn when(need: bool, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    need.then(f).transpose()
}

/// Runs `op` and records a backward that computes (unreduced) input gradients with `grads`
/// from (g, a, b, y) and sums them back to each input's shape.
fn binary_with_grad(a: &Tensor, b: &Tensor, op: BinaryOp, name: &'static str, grads: Box<PairGrad>) -> Result<Tensor> {
    let (a, b) = crate::autocast::promote(a, b)?;
    let (a, b) = (&a, &b);
    let y = forward(a, b, op, name)?;
    if !(a.requires_grad() || b.requires_grad()) || !crate::is_grad_enabled() {
        return Ok(y);
    }
    let (xa, xb, ys) = (a.detach(), b.detach(), y.detach());
    let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
    Ok(record1(
        &[a, b],
        y,
        FnBackward {
            name,
            f: move |g: &[Option<Tensor>]| {
                let Some(g) = g[0].as_ref() else { return Ok(vec![None, None]) };
                let (ga, gb) = grads(g, &xa, &xb, &ys, Need { a: need_a, b: need_b })?;
                let ga = match (need_a, ga) {
                    (true, Some(t)) => Some(t.sum_to(xa.dims())?),
                    _ => None,
                };
                let gb = match (need_b, gb) {
                    (true, Some(t)) => Some(t.sum_to(xb.dims())?),
                    _ => None,
                };
                Ok(vec![ga, gb])
            },
        },
    ))
}

/// Half of `g` where a == b, all of it where `pick` holds, none elsewhere (PyTorch's rule for
/// maximum/minimum ties).
fn tie_split(g: &Tensor, pick: &Tensor, tie: &Tensor) -> Result<Tensor> {
    let dt = g.dtype();
    let w = pick.to_dtype(dt)?.add(&tie.to_dtype(dt)?.affine(0.5, 0.0)?)?;
    g.mul(&w)
}

impl Tensor {
    /// `self + rhs`, broadcasting.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        binary_with_grad(self, rhs, BinaryOp::Add, "add", Box::new(|g, _, _, _, _| Ok((Some(g.clone()), Some(g.clone())))))
    }
    /// `self − rhs`, broadcasting.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        binary_with_grad(self, rhs, BinaryOp::Sub, "sub", Box::new(|g, _, _, _, n| Ok((Some(g.clone()), when(n.b, || g.neg())?))))
    }
    /// `self·rhs`, broadcasting.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        binary_with_grad(self, rhs, BinaryOp::Mul, "mul", Box::new(|g, a, b, _, n| Ok((when(n.a, || g.mul(b))?, when(n.b, || g.mul(a))?))))
    }
    /// `self / rhs`, broadcasting.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        // d(a/b)/da = 1/b, d(a/b)/db = −a/b² = −y/b
        binary_with_grad(
            self,
            rhs,
            BinaryOp::Div,
            "div",
            Box::new(|g, _, b, y, n| Ok((when(n.a, || g.div(b))?, when(n.b, || g.mul(y)?.div(b)?.neg())?))),
        )
    }
    /// Element-wise maximum (ties split the gradient).
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        binary_with_grad(
            self,
            rhs,
            BinaryOp::Maximum,
            "maximum",
            Box::new(|g, a, b, _, n| {
                let tie = a.eq(b)?;
                Ok((when(n.a, || tie_split(g, &a.gt(b)?, &tie))?, when(n.b, || tie_split(g, &b.gt(a)?, &tie))?))
            }),
        )
    }
    /// Element-wise minimum (ties split the gradient).
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        binary_with_grad(
            self,
            rhs,
            BinaryOp::Minimum,
            "minimum",
            Box::new(|g, a, b, _, n| {
                let tie = a.eq(b)?;
                Ok((when(n.a, || tie_split(g, &a.lt(b)?, &tie))?, when(n.b, || tie_split(g, &b.lt(a)?, &tie))?))
            }),
        )
    }
    /// `aᵇ` element-wise.
    pub fn pow(&self, rhs: &Tensor) -> Result<Tensor> {
        // d/da = b·a^(b−1), d/db = y·ln a
        binary_with_grad(
            self,
            rhs,
            BinaryOp::Pow,
            "pow",
            Box::new(|g, a, b, y, n| {
                let ga = when(n.a, || g.mul(&b.mul(&a.pow(&b.sub_scalar(1.0)?)?)?))?;
                let gb = when(n.b, || g.mul(&y.mul(&a.log()?)?))?;
                Ok((ga, gb))
            }),
        )
    }
    /// `atan2(a, b)` element-wise.
    pub fn atan2(&self, rhs: &Tensor) -> Result<Tensor> {
        binary_with_grad(
            self,
            rhs,
            BinaryOp::Atan2,
            "atan2",
            Box::new(|g, a, b, _, n| {
                let r2 = a.square()?.add(&b.square()?)?;
                Ok((when(n.a, || g.mul(b)?.div(&r2))?, when(n.b, || g.mul(a)?.div(&r2)?.neg())?))
            }),
        )
    }

    /// A 0-d tensor of `v` with this tensor's dtype and device.
    pub fn scalar_like(&self, v: f64) -> Result<Tensor> {
        Tensor::scalar(v, self.dtype(), self.device())
    }

    fn compare(&self, rhs: &Tensor, op: CmpOp) -> Result<Tensor> {
        let (lhs, rhs) = crate::autocast::promote(self, rhs)?;
        let (lhs, rhs) = (&lhs, &rhs);
        same_dtype("cmp", lhs, rhs)?;
        let (out, la, lb) = broadcast_layouts("cmp", lhs, rhs)?;
        let s = lhs.read_storage()?.cmp(&la, &*rhs.read_storage()?, &lb, op)?;
        Tensor::from_storage(s, out)
    }
    /// `self = rhs` as bool.
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Eq)
    }
    /// `self ≠ rhs` as bool.
    pub fn ne(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Ne)
    }
    /// `self < rhs` as bool.
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Lt)
    }
    /// `self ≤ rhs` as bool.
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Le)
    }
    /// `self > rhs` as bool.
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Gt)
    }
    /// `self ≥ rhs` as bool.
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Ge)
    }
    /// `self = v` as bool.
    pub fn eq_scalar(&self, v: f64) -> Result<Tensor> {
        self.compare(&self.scalar_like(v)?, CmpOp::Eq)
    }
    /// `self < v` as bool.
    pub fn lt_scalar(&self, v: f64) -> Result<Tensor> {
        self.compare(&self.scalar_like(v)?, CmpOp::Lt)
    }
    /// `self ≤ v` as bool.
    pub fn le_scalar(&self, v: f64) -> Result<Tensor> {
        self.compare(&self.scalar_like(v)?, CmpOp::Le)
    }
    /// `self > v` as bool.
    pub fn gt_scalar(&self, v: f64) -> Result<Tensor> {
        self.compare(&self.scalar_like(v)?, CmpOp::Gt)
    }
    /// `self ≥ v` as bool.
    pub fn ge_scalar(&self, v: f64) -> Result<Tensor> {
        self.compare(&self.scalar_like(v)?, CmpOp::Ge)
    }

    /// Logical and of two bool/u8 masks.
    pub fn logical_and(&self, rhs: &Tensor) -> Result<Tensor> {
        forward(&self.to_dtype(crate::DType::Bool)?, &rhs.to_dtype(crate::DType::Bool)?, BinaryOp::Minimum, "logical_and")
    }
    /// Logical or of two bool/u8 masks.
    pub fn logical_or(&self, rhs: &Tensor) -> Result<Tensor> {
        forward(&self.to_dtype(crate::DType::Bool)?, &rhs.to_dtype(crate::DType::Bool)?, BinaryOp::Maximum, "logical_or")
    }

    /// `self` is the condition: picks `a` where it is non-zero and `b` elsewhere (all broadcast).
    pub fn where_cond(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (a, b) = crate::autocast::promote(a, b)?;
        let (a, b) = (&a, &b);
        same_dtype("where_cond", a, b)?;
        let (ab, _, _) = broadcast_layouts("where_cond", a, b)?;
        let out = crate::shape::broadcast_shapes("where_cond", self.dims(), &ab)?;
        let lay = |t: &Tensor| Layout { shape: out.clone(), strides: crate::shape::broadcast_strides(t.dims(), &out), offset: 0 };
        if self.device() != a.device() {
            return Err(Error::DeviceMismatch { op: "where_cond", lhs: self.device(), rhs: a.device() });
        }
        let s = self.read_storage()?.where_cond(&lay(self), &*a.read_storage()?, &lay(a), &*b.read_storage()?, &lay(b))?;
        let y = Tensor::from_storage(s, out)?;
        if !(a.requires_grad() || b.requires_grad()) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let cond = self.detach();
        let (da, db) = (a.dims().to_vec(), b.dims().to_vec());
        let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
        Ok(record(
            &[a, b],
            vec![y],
            FnBackward {
                name: "where_cond",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = g[0].as_ref() else { return Ok(vec![None, None]) };
                    let z = g.zeros_like()?;
                    let ga = if need_a { Some(cond.where_cond(g, &z)?.sum_to(&da)?) } else { None };
                    let gb = if need_b { Some(cond.where_cond(&z, g)?.sum_to(&db)?) } else { None };
                    Ok(vec![ga, gb])
                },
            },
        )
        .remove(0))
    }
}

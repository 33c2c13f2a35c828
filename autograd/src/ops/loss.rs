//! Loss primitives that need a numerically careful form.

use crate::autograd::{record, FnBackward};
use crate::{Result, Tensor};

impl Tensor {
    /// Element-wise binary cross-entropy on logits (no reduction), in the stable form
    /// `max(x, 0) − x·z + log(1 + e^(−|x|))`. Gradients: `dx = σ(x) − z`, `dz = −x`.
    pub fn bce_with_logits(&self, target: &Tensor) -> Result<Tensor> {
        super::same_dtype("bce_with_logits", self, target)?;
        // One fused element-wise pass (see BinaryOp::BceWithLogits).
        let y = crate::no_grad(|| -> Result<Tensor> {
            let (out, la, lb) = super::broadcast_layouts("bce_with_logits", self, target)?;
            let s = self.read_storage()?.binary(&la, &*target.read_storage()?, &lb, crate::backend::BinaryOp::BceWithLogits)?;
            Tensor::from_storage(s, out)
        })?;
        if !(self.requires_grad() || target.requires_grad()) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let (x, z) = (self.detach(), target.detach());
        let (nx, nz) = (self.requires_grad(), target.requires_grad());
        Ok(record(
            &[self, target],
            vec![y],
            FnBackward {
                name: "bce_with_logits",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None, None]) };
                    let gx = if nx { Some(g.mul(&x.sigmoid()?.sub(&z)?)?.sum_to(x.dims())?) } else { None };
                    let gz = if nz { Some(g.mul(&x)?.neg()?.sum_to(z.dims())?) } else { None };
                    Ok(vec![gx, gz])
                },
            },
        )
        .remove(0))
    }
}

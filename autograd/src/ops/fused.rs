//! Fused BatchNorm2d (+ SiLU): forward in two kernels on CUDA (deterministic per-channel statistics
//! whose last block per channel also updates the running statistics, then one affine+SiLU pass),
//! backward in two (per-channel sums of gz and gz·x̂ whose last block per channel finishes it, one
//! pass for dx) where the composed ops take about twenty. The CPU runs the same algorithm in f64.

use crate::autograd::{record, BackwardOp};
use crate::backend::stats_dtype;
use crate::storage::Storage;
use crate::{BatchNormOptions, Error, MemoryFormat, Result, Tensor};

impl Tensor {
    /// `silu(batch_norm2d(x))`, numerically the same as `x.batch_norm2d(..)?.silu()` up to rounding
    /// (same running-statistics rule), fused.
    pub fn batch_norm2d_silu(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        opts: BatchNormOptions,
    ) -> Result<Tensor> {
        self.batch_norm2d_fused(weight, bias, running_mean, running_var, opts, true)
    }

    /// `batch_norm2d(x)`, followed by SiLU when `silu`, fused (see the module doc); equal to the
    /// composed ops up to rounding.
    pub fn batch_norm2d_fused(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        opts: BatchNormOptions,
        silu: bool,
    ) -> Result<Tensor> {
        self.batch_norm2d_fused_tracked(weight, bias, running_mean, running_var, None, opts, silu)
    }

    /// [`Tensor::batch_norm2d_fused`] that also counts the batch in `num_batches_tracked` (a scalar
    /// i64, incremented in training mode) inside the statistics kernel, instead of two more
    /// launches per layer for `+= 1`.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm2d_fused_tracked(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        num_batches_tracked: Option<&Tensor>,
        opts: BatchNormOptions,
        silu: bool,
    ) -> Result<Tensor> {
        self.batch_norm2d_fused_inner(weight, bias, running_mean, running_var, num_batches_tracked, opts, silu, None)
    }

    /// `residual + batch_norm2d_fused_tracked(x)`: a block's shortcut added to its last
    /// convolution's normalised output, the same bytes as the addition after it. In training, on
    /// a backend that adds it inside its normalisation kernels (CUDA, planar data), the addition
    /// costs no launch of its own and the node hands the output gradient to the residual as the
    /// addition's node would; elsewhere (evaluation, channels-last, another dtype or shape) it is
    /// the addition itself.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm2d_fused_add(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        num_batches_tracked: Option<&Tensor>,
        opts: BatchNormOptions,
        silu: bool,
        residual: &Tensor,
    ) -> Result<Tensor> {
        self.batch_norm2d_fused_inner(weight, bias, running_mean, running_var, num_batches_tracked, opts, silu, Some(residual))
    }

    #[allow(clippy::too_many_arguments)]
    fn batch_norm2d_fused_inner(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        running_mean: &Tensor,
        running_var: &Tensor,
        num_batches_tracked: Option<&Tensor>,
        opts: BatchNormOptions,
        silu: bool,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        if let Some(r) = residual {
            let inside = opts.training
                && r.dims() == self.dims()
                && r.dtype() == self.dtype()
                && self.memory_format() == MemoryFormat::Contiguous
                && r.memory_format() == MemoryFormat::Contiguous;
            if !inside {
                let y = self.batch_norm2d_fused_inner(weight, bias, running_mean, running_var, num_batches_tracked, opts, silu, None)?;
                return r.add(&y);
            }
        }
        if let Some(t) = num_batches_tracked {
            if t.dtype() != crate::DType::I64 || t.numel() != 1 || t.raw_storage().len() != 1 {
                return Err(Error::invalid(
                    "batch_norm2d_silu",
                    format!(
                        "num_batches_tracked must be a one-element i64 tensor with its own storage, got {} of shape {:?}",
                        t.dtype(),
                        t.dims()
                    ),
                ));
            }
        }
        let d = self.dims().to_vec();
        if d.len() != 4 {
            return Err(Error::invalid("batch_norm2d_silu", format!("expected NCHW input, got {d:?}")));
        }
        let c = d[1];
        for (name, t) in [("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)] {
            if t.dims() != [c] {
                return Err(Error::invalid(
                    "batch_norm2d_silu",
                    format!("{name} has shape {:?}, expected [{c}] for input {d:?}", t.dims()),
                ));
            }
        }
        let sd = stats_dtype(self.dtype());
        let n = d[0] * d[2] * d[3];
        // A channels-last input is normalised as it lies (every backend takes the layout); y and
        // the input gradient are channels-last too.
        let format = self.memory_format();
        let channels_last = format == MemoryFormat::ChannelsLast;
        // Per-channel parameters in the statistics dtype: aff = [scale; shift], nrm = [invstd; −mean·invstd].
        let w_sd = crate::no_grad(|| weight.detach().to_dtype(sd))?;
        // Training: statistics and y in one backend call (fused on CUDA for small layers); eval:
        // parameters from the running statistics, then y.
        let (y, aff, nrm) = crate::no_grad(|| -> Result<(Storage, Tensor, Tensor)> {
            let (w, b) = (w_sd.clone(), bias.detach().to_dtype(sd)?);
            if opts.training {
                if n < 2 {
                    return Err(Error::invalid(
                        "batch_norm2d_silu",
                        format!("training needs more than one value per channel, got input {d:?}"),
                    ));
                }
                let (rm, rv) = (running_mean.to_dtype(sd)?, running_var.to_dtype(sd)?);
                // Private copies when a cast was needed, so the update below writes through.
                let (y, a, q) = {
                    let x = self.storage_for(channels_last)?;
                    let (ws, bs) = (w.read_storage()?, b.read_storage()?);
                    let mut rms = rm.write_storage();
                    let mut rvs = rv.write_storage();
                    let mut counter = num_batches_tracked.map(|t| t.write_storage());
                    let rs = residual.map(|r| r.storage_for(false)).transpose()?;
                    x.batch_norm_train_apply(
                        &d,
                        &ws,
                        &bs,
                        &mut rms,
                        &mut rvs,
                        counter.as_deref_mut(),
                        opts.eps,
                        opts.momentum,
                        silu,
                        rs.as_deref(),
                        channels_last,
                    )?
                };
                if rm.storage_ptr() != running_mean.storage_ptr() {
                    running_mean.copy_(&rm.to_dtype(running_mean.dtype())?)?;
                }
                if rv.storage_ptr() != running_var.storage_ptr() {
                    running_var.copy_(&rv.to_dtype(running_var.dtype())?)?;
                }
                Ok((y, Tensor::from_storage(a, vec![2 * c])?, Tensor::from_storage(q, vec![2 * c])?))
            } else {
                let (rm, rv) = (running_mean.to_dtype(sd)?, running_var.to_dtype(sd)?);
                let (a, q) =
                    w.read_storage()?.batch_norm_eval_params(&*b.read_storage()?, &*rm.read_storage()?, &*rv.read_storage()?, opts.eps)?;
                let y = self.storage_for(channels_last)?.channel_affine(&d, &a, silu, channels_last)?;
                Ok((y, Tensor::from_storage(a, vec![2 * c])?, Tensor::from_storage(q, vec![2 * c])?))
            }
        })?;
        let y = Tensor::from_storage_in(y, d.clone().into(), format)?;
        let residual_needs = residual.is_some_and(|r| r.requires_grad());
        if !(self.requires_grad() || weight.requires_grad() || bias.requires_grad() || residual_needs) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let node = BatchNormBackward {
            x: self.detach(),
            wd: weight.detach(),
            d,
            aff,
            nrm,
            w_sd,
            silu,
            training: opts.training,
            format,
            needs: [self.requires_grad(), weight.requires_grad(), bias.requires_grad()],
            residual: residual.map(|_| residual_needs),
        };
        let inputs: Vec<&Tensor> = [self, weight, bias].into_iter().chain(residual).collect();
        Ok(record(&inputs, vec![y], node).remove(0))
    }
}

/// The fused batch norm's backward node: what it saved, and the backend call that computes the
/// input, weight and bias gradients from the output gradient — or from its two contributions,
/// added inside the backend's kernels where it can (a tensor read by two consumers: the addition
/// the engine would launch goes).
struct BatchNormBackward {
    x: Tensor,
    wd: Tensor,
    d: Vec<usize>,
    aff: Tensor,
    nrm: Tensor,
    w_sd: Tensor,
    silu: bool,
    training: bool,
    format: MemoryFormat,
    needs: [bool; 3],
    /// With a residual added inside (`Some(whether it needs a gradient)`): a fourth input, whose
    /// gradient is the output gradient, as the addition's node hands it out.
    residual: Option<bool>,
}

impl BatchNormBackward {
    /// The gradient as this node's kernels read it: x's dtype, y's format.
    fn prepared(&self, g: &Tensor) -> Result<Tensor> {
        let g = if g.dtype() == self.x.dtype() { g.clone() } else { g.to_dtype(self.x.dtype())? };
        g.to_memory_format(self.format)
    }

    /// The gradients from the output gradient `g` (plus `g2`, added as the engine would, when
    /// given).
    fn gradients(&self, g: &Tensor, g2: Option<&Tensor>) -> Result<Vec<Option<Tensor>>> {
        let channels_last = self.format == MemoryFormat::ChannelsLast;
        let c = self.d[1];
        let (dx, gw, gb) = {
            let xs = self.x.storage_for(channels_last)?;
            let gs = g.storage_for(channels_last)?;
            let (aff, nrm, w) = (self.aff.read_storage()?, self.nrm.read_storage()?, self.w_sd.read_storage()?);
            let g2s = g2.map(|g2| g2.storage_for(channels_last)).transpose()?;
            xs.batch_norm_act_backward(&gs, g2s.as_deref(), &self.d, &aff, &nrm, &w, self.silu, self.training, channels_last)?
        };
        let gx = if self.needs[0] { Some(Tensor::from_storage_in(dx, self.d.clone().into(), self.format)?) } else { None };
        let gw = if self.needs[1] { Some(Tensor::from_storage(gw, vec![c])?.to_dtype(self.wd.dtype())?) } else { None };
        let gbias = if self.needs[2] { Some(Tensor::from_storage(gb, vec![c])?.to_dtype(self.wd.dtype())?) } else { None };
        Ok(vec![gx, gw, gbias])
    }

    /// [`Self::gradients`] plus the residual's gradient (the output gradient as it arrived: `g`,
    /// or the engine's sum of its two contributions) where the node has a residual.
    fn with_residual(&self, mut grads: Vec<Option<Tensor>>, g: impl FnOnce() -> Result<Tensor>) -> Result<Vec<Option<Tensor>>> {
        match self.residual {
            Some(true) => grads.push(Some(g()?)),
            Some(false) => grads.push(None),
            None => {}
        }
        Ok(grads)
    }
}

impl BackwardOp for BatchNormBackward {
    fn name(&self) -> &str {
        if self.silu {
            "batch_norm2d_silu"
        } else {
            "batch_norm2d_fused"
        }
    }
    fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 3 + usize::from(self.residual.is_some())]) };
        let grads = self.gradients(&self.prepared(g)?, None)?;
        self.with_residual(grads, || Ok(g.clone()))
    }
    /// Reads only what it saved and writes fresh gradients.
    fn runs_aside(&self) -> bool {
        true
    }
    fn adds_two_contributions(&self) -> bool {
        true
    }
    /// Contributions already in x's dtype and y's format are added inside the backend's kernels
    /// (the sum's bytes as the engine's addition would give them); others are added first.
    fn backward_two(&self, a: &Tensor, b: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let ready = |t: &Tensor| t.dtype() == self.x.dtype() && t.memory_format() == self.format;
        if ready(a) && ready(b) && self.residual != Some(true) {
            let mut grads = self.gradients(a, Some(b))?;
            if self.residual.is_some() {
                // A residual that needs no gradient.
                grads.push(None);
            }
            return Ok(grads);
        }
        // The residual needs the sum itself: added once, as the engine would, and read by both.
        let g = crate::autograd::add_grads(a.clone(), b.clone())?;
        let grads = self.gradients(&self.prepared(&g)?, None)?;
        self.with_residual(grads, || Ok(g))
    }
}

//! 2-D convolution and max-pooling with their gradients.

use crate::autograd::{record, record1, FnBackward};
use crate::backend::{Conv2dParams, Pool2dParams};
use crate::{Error, MemoryFormat, Result, Tensor};

impl Tensor {
    /// NCHW convolution with an OIHW weight, optional bias, dilation 1. A channels-last input on a
    /// backend that computes so (CUDA) is convolved as it lies and gives a channels-last output
    /// (and input gradient); elsewhere it is converted at entry (docs/channels-last.md). A
    /// channels-last weight (O, H, W, I storage, as autocast's weight copies are on CUDA) is read
    /// as it lies there too, and its gradient comes back in that order.
    pub fn conv2d(
        &self,
        w: &Tensor,
        bias: Option<&Tensor>,
        stride: (usize, usize),
        padding: (usize, usize),
        groups: usize,
    ) -> Result<Tensor> {
        if crate::autocast::autocast_dtype().is_some() {
            let (x, w) = (crate::autocast::cast_for_compute(self)?, crate::autocast::cast_conv_weight_for_compute(w)?);
            let b = bias.map(crate::autocast::cast_for_compute).transpose()?;
            return crate::autocast::autocast(None, || x.conv2d(&w, b.as_ref(), stride, padding, groups));
        }
        super::same_dtype("conv2d", self, w)?;
        let (xd, wd) = (self.dims(), w.dims());
        let bad = |msg: String| {
            Error::invalid(
                "conv2d",
                format!("{msg} (input {xd:?}, weight {wd:?}, stride {stride:?}, padding {padding:?}, groups {groups})"),
            )
        };
        if xd.len() != 4 || wd.len() != 4 {
            return Err(bad("expected 4-d input and weight".into()));
        }
        if groups == 0 || xd[1] % groups != 0 || wd[0] % groups != 0 || wd[1] * groups != xd[1] {
            return Err(bad("channels do not match the groups".into()));
        }
        if stride.0 == 0 || stride.1 == 0 || xd[2] + 2 * padding.0 < wd[2] || xd[3] + 2 * padding.1 < wd[3] {
            return Err(bad("kernel larger than the padded input or zero stride".into()));
        }
        let computes_cl = self.with_storage(|s| s.computes_channels_last_convolutions());
        let channels_last = self.memory_format() == MemoryFormat::ChannelsLast && computes_cl;
        let format = if channels_last { MemoryFormat::ChannelsLast } else { MemoryFormat::Contiguous };
        // A channels-last (O, H, W, I) weight is read as it lies where the backend computes so;
        // for a 1×1 kernel or one input channel per group both orders are the same bytes.
        let weight_format = w.memory_format();
        let same_bytes = wd[1] == 1 || wd[2] * wd[3] == 1;
        let weight_channels_last = weight_format == MemoryFormat::ChannelsLast && computes_cl && !same_bytes;
        let weight_as_it_lies = weight_channels_last || same_bytes;
        let p = Conv2dParams {
            channels_last,
            weight_channels_last,
            grad_channels_last: false,
            input_channels_last: false,
            batch: xd[0],
            c_in: xd[1],
            h_in: xd[2],
            w_in: xd[3],
            c_out: wd[0],
            kh: wd[2],
            kw: wd[3],
            stride,
            padding,
            groups,
        };
        let recorded = (self.requires_grad() || w.requires_grad()) && crate::is_grad_enabled();
        let (need_x, need_w) = (self.requires_grad(), w.requires_grad());
        // Where the forward call and the weight gradient would each convert a contiguous input to
        // N, H, W, C inside the library, it is converted once here: the forward call reads the
        // copy as it lies and the convolution keeps the copy, not the input, for its weight
        // gradient.
        let input_once = recorded && need_w && !channels_last && self.with_storage(|s| s.reads_channels_last_input(&p));
        let (x, p) = match input_once {
            true => (self.detach().to_memory_format(MemoryFormat::ChannelsLast)?, Conv2dParams { input_channels_last: true, ..p }),
            false => (self.detach(), p),
        };
        let s = x.storage_for(channels_last || input_once)?.conv2d(&*w.storage_for(weight_as_it_lies)?, &p)?;
        let y = Tensor::from_storage_in(s, p.out_shape().to_vec().into(), format)?;
        if let Some(b) = bias {
            if b.dims() != [p.c_out] {
                return Err(bad(format!("bias shape {:?} should be [{}]", b.dims(), p.c_out)));
            }
        }
        // Where the backend computes the bias gradient in the weight gradient's launch, the bias
        // is added here (the same addition, untracked) and the convolution's node hands out its
        // gradient; elsewhere the addition is a node of its own below.
        let fused_bias = match bias {
            Some(b) if recorded && need_w && b.requires_grad() && b.dtype() == self.dtype() => {
                self.with_storage(|s| s.fuses_bias_gradient(&p)).then_some(b)
            }
            _ => None,
        };
        let y = match fused_bias {
            Some(b) => {
                let _untracked = crate::GradModeGuard::new(false);
                y.add(&b.detach().reshape(vec![1, p.c_out, 1, 1])?)?
            }
            None => y,
        };
        let y = if recorded {
            let wt = w.detach();
            let (device, x_shape) = (self.device(), self.shape().clone());
            let inputs: Vec<&Tensor> = match fused_bias {
                Some(b) => vec![self, w, b],
                None => vec![self, w],
            };
            let with_bias = fused_bias.is_some();
            record(
                &inputs,
                vec![y],
                FnBackward {
                    name: "conv2d",
                    f: move |g: &[Option<Tensor>]| {
                        let Some(g) = &g[0] else { return Ok(vec![None; 2 + usize::from(with_bias)]) };
                        // The output gradient in the output's format: as it lies for a
                        // channels-last convolution (converted first if it arrived otherwise).
                        // Where both gradients would each convert a contiguous one to N, H, W, C
                        // inside the library, it is converted once here and read as it lies.
                        let g = g.to_memory_format(format)?;
                        let once = need_x && need_w && g.with_storage(|s| s.reads_channels_last_output_gradient(&p));
                        let (g, p) = match once {
                            true => (g.to_memory_format(MemoryFormat::ChannelsLast)?, Conv2dParams { grad_channels_last: true, ..p }),
                            false => (g, p),
                        };
                        let gs = g.storage_for(channels_last || once)?;
                        // The weight gradient first, beside the data-gradient chain where the
                        // backend can (`streams`): nothing but the optimizer waits for it.
                        let (gw, gb) = if need_w {
                            crate::streams::beside(device, || -> Result<(Option<Tensor>, Option<Tensor>)> {
                                let xs = x.storage_for(channels_last || input_once)?;
                                let (gw, gb) = match with_bias {
                                    true => {
                                        let (gw, gb) = gs.conv2d_backward_weight_and_bias(&xs, &p)?;
                                        (gw, Some(Tensor::from_storage_in(gb, vec![p.c_out].into(), MemoryFormat::Contiguous)?))
                                    }
                                    false => (gs.conv2d_backward_weight(&xs, &p)?, None),
                                };
                                // In the weight's order where it was read as it lies.
                                let gw_format = if weight_as_it_lies { weight_format } else { MemoryFormat::Contiguous };
                                Ok((Some(Tensor::from_storage_in(gw, wt.shape().clone(), gw_format)?), gb))
                            })?
                        } else {
                            (None, None)
                        };
                        let gx = if need_x {
                            let ws = wt.storage_for(weight_as_it_lies)?;
                            // Written in the activations' format whatever the input copy's.
                            let p = Conv2dParams { input_channels_last: false, ..p };
                            Some(Tensor::from_storage_in(gs.conv2d_backward_input(&ws, &p)?, x_shape.clone(), format)?)
                        } else {
                            None
                        };
                        Ok(match with_bias {
                            true => vec![gx, gw, gb],
                            false => vec![gx, gw],
                        })
                    },
                },
            )
            .remove(0)
        } else {
            y
        };
        match bias {
            Some(b) if fused_bias.is_none() => y.add(&b.reshape(vec![1, p.c_out, 1, 1])?),
            _ => Ok(y),
        }
    }

    /// Max-pooling over square windows (padding with −∞, as PyTorch); a channels-last input gives
    /// a channels-last output.
    pub fn max_pool2d(&self, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
        let d = self.dims();
        if d.len() != 4 || kernel == 0 || stride == 0 || padding * 2 > kernel || d[2] + 2 * padding < kernel || d[3] + 2 * padding < kernel
        {
            return Err(Error::invalid("max_pool2d", format!("input {d:?} with kernel {kernel}, stride {stride}, padding {padding}")));
        }
        // A channels-last input is pooled as it lies (both backends have the layout); the values,
        // indices and input gradient are channels-last too.
        let format = self.memory_format();
        let channels_last = format == MemoryFormat::ChannelsLast;
        let p = Pool2dParams { channels_last, batch: d[0], channels: d[1], h_in: d[2], w_in: d[3], kernel, stride, padding };
        let (v, idx) = self.raw_storage().max_pool2d(&p)?;
        let y = Tensor::from_storage_in(v, vec![d[0], d[1], p.h_out(), p.w_out()].into(), format)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let (idx, in_dims) = (Tensor::from_storage_in(idx, y.dims().to_vec().into(), format)?, d.to_vec());
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "max_pool2d",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None]) };
                    // The output gradient in the output's format (converted if it arrived otherwise).
                    let g = g.to_memory_format(format)?;
                    let s = g.raw_storage().max_pool2d_backward(&idx.raw_storage(), &p)?;
                    Ok(vec![Some(Tensor::from_storage_in(s, in_dims.clone().into(), format)?)])
                },
            },
        ))
    }
}

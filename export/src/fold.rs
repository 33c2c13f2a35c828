//! Convolutions as ONNX wants them: weight (OIHW) and bias as f32, with an eval BatchNorm folded
//! into them (`w·γ/√(var+eps)`, `β − mean·γ/√(var+eps)`, computed in f64) — what deployment
//! exporters do, and one Conv node per layer instead of Conv + BatchNormalization.

use ptl_autograd::Tensor;
use ptl_heads::nn::{Conv, Conv2d};

use crate::{ExportError, Result};

/// One convolution ready to be stored: weight `[c_out, c_in/groups, k, k]`, bias `[c_out]`.
#[derive(Clone, Debug)]
pub struct FoldedConv {
    pub weight: Vec<f32>,
    pub dims: [usize; 4],
    pub bias: Vec<f32>,
    pub stride: usize,
    pub padding: usize,
    pub groups: usize,
}

fn host_f64(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_f64_vec()?)
}

fn weight_dims(c: &Conv2d, module: &str) -> Result<[usize; 4]> {
    match c.weight.dims() {
        &[o, i, kh, kw] => Ok([o, i, kh, kw]),
        d => Err(ExportError::unsupported(module, format!("convolution weight of shape {d:?}, expected [out, in, kh, kw]"))),
    }
}

/// A `Conv2d` as it is (its bias, or zeros when it has none).
pub fn plain(c: &Conv2d, module: &str) -> Result<FoldedConv> {
    let dims = weight_dims(c, module)?;
    let weight = c.weight.to_vec::<f32>()?;
    let bias = match &c.bias {
        Some(b) => b.to_vec::<f32>()?,
        None => vec![0.0; dims[0]],
    };
    if bias.len() != dims[0] {
        return Err(ExportError::unsupported(module, format!("{} bias values for {} filters", bias.len(), dims[0])));
    }
    Ok(FoldedConv { weight, dims, bias, stride: c.stride, padding: c.padding, groups: c.groups })
}

/// Ultralytics' `Conv` (Conv2d + BatchNorm) with the BatchNorm's running statistics folded in.
pub fn folded(c: &Conv, module: &str) -> Result<FoldedConv> {
    let dims = weight_dims(&c.conv, module)?;
    let o = dims[0];
    let w = host_f64(&c.conv.weight)?;
    let conv_bias = match &c.conv.bias {
        Some(b) => host_f64(b)?,
        None => vec![0.0; o],
    };
    let (gamma, beta) = (host_f64(&c.bn.weight)?, host_f64(&c.bn.bias)?);
    let (mean, var) = (host_f64(&c.bn.running_mean)?, host_f64(&c.bn.running_var)?);
    if [gamma.len(), beta.len(), mean.len(), var.len(), conv_bias.len()].iter().any(|&n| n != o) {
        return Err(ExportError::unsupported(module, format!("BatchNorm of the wrong width for {o} filters")));
    }
    let per_filter = w.len() / o.max(1);
    let mut weight = Vec::with_capacity(w.len());
    let mut bias = Vec::with_capacity(o);
    for f in 0..o {
        let scale = gamma[f] / (var[f] + c.bn.eps).sqrt();
        weight.extend(w[f * per_filter..(f + 1) * per_filter].iter().map(|&v| (v * scale) as f32));
        bias.push((beta[f] + (conv_bias[f] - mean[f]) * scale) as f32);
    }
    Ok(FoldedConv { weight, dims, bias, stride: c.conv.stride, padding: c.conv.padding, groups: c.conv.groups })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ptl_autograd::{no_grad, Device, Rng};
    use ptl_heads::nn::Init;

    /// Folding then convolving gives the eval Conv's output (the model's own forward).
    #[test]
    fn folded_conv_matches_the_eval_conv() {
        let mut rng = Rng::new(7);
        let mut conv = Conv::new(4, 6, 3, 2, 2, false, &mut Init { rng: &mut rng, device: Device::Cpu }).unwrap();
        let vals =
            |n: usize, lo: f64, hi: f64, rng: &mut Rng| Tensor::rand(vec![n], lo, hi, ptl_autograd::DType::F32, Device::Cpu, rng).unwrap();
        no_grad(|| -> ptl_autograd::Result<()> {
            conv.bn.running_mean.copy_(&vals(6, -0.5, 0.5, &mut rng))?;
            conv.bn.running_var.copy_(&vals(6, 0.2, 2.0, &mut rng))?;
            conv.bn.weight.copy_(&vals(6, 0.5, 1.5, &mut rng))?;
            conv.bn.bias.copy_(&vals(6, -0.3, 0.3, &mut rng))
        })
        .unwrap();
        use ptl_autograd::Module;
        conv.set_training(false);
        let x = Tensor::rand(vec![1, 4, 7, 7], -1.0, 1.0, ptl_autograd::DType::F32, Device::Cpu, &mut rng).unwrap();
        let want = no_grad(|| conv.forward(&x)).unwrap().to_vec::<f32>().unwrap();
        let f = folded(&conv, "test").unwrap();
        let w = Tensor::from_vec(f.weight.clone(), f.dims.to_vec(), Device::Cpu).unwrap();
        let b = Tensor::from_vec(f.bias.clone(), vec![6], Device::Cpu).unwrap();
        let got = x.conv2d(&w, Some(&b), (2, 2), (1, 1), 2).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 1e-5 * scale, "max |folded − eval| = {worst} at scale {scale}");
        assert!((f.stride, f.padding, f.groups) == (2, 1, 2));
    }
}

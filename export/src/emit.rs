//! The ONNX ops the model is made of, one method each, tracking channels and spatial size so
//! reshapes can name them (the batch stays dynamic: reshapes copy it with `0`).

use ptl_heads::nn::{Conv, Conv2d};

use crate::fold::{folded, plain, FoldedConv};
use crate::graph::{AttrValue, Graph};
use crate::{ExportError, Result};

/// A `(B, c, h, w)` value of the graph.
#[derive(Clone, Debug)]
pub struct Value {
    pub name: String,
    pub c: usize,
    pub h: usize,
    pub w: usize,
}

/// ONNX's element type numbers for `Cast`.
pub const ONNX_FLOAT: i64 = 1;
/// See [`ONNX_FLOAT`].
pub const ONNX_FLOAT16: i64 = 10;

/// Emits ops into a [`Graph`].
pub struct Emitter {
    pub g: Graph,
    /// The opset the file declares (a few ops take their axes as an input from opset 18 on).
    pub opset: i64,
    /// The model computes in half precision (weights, activations, input and output).
    pub half: bool,
    /// Height and width are dynamic: sizes come from the tensors' shapes at run time, and the
    /// static sizes tracked in [`Value`] are those of the nominal export size only.
    pub dynamic: bool,
}

fn ints(v: &[usize]) -> AttrValue {
    AttrValue::Ints(v.iter().map(|&x| x as i64).collect())
}

impl Emitter {
    /// A Conv node from a prepared convolution; `name` is the module path (`model.2.cv1`).
    fn conv_node(&mut self, f: FoldedConv, x: &Value, name: &str) -> Result<Value> {
        let [o, i, kh, kw] = f.dims;
        if i * f.groups != x.c {
            return Err(ExportError::unsupported(name, format!("reads {} channels in {} groups but gets {}", i * f.groups, f.groups, x.c)));
        }
        let w = self.g.init_f32(&format!("{name}.weight"), &f.dims, f.weight);
        let b = self.g.init_f32(&format!("{name}.bias"), &[o], f.bias);
        let (s, p) = (f.stride, f.padding);
        let out = self.g.op(
            "Conv",
            name,
            &[&x.name, &w, &b],
            vec![
                ("kernel_shape", ints(&[kh, kw])),
                ("strides", ints(&[s, s])),
                ("pads", ints(&[p, p, p, p])),
                ("group", AttrValue::Int(f.groups as i64)),
            ],
        );
        Ok(Value { name: out, c: o, h: (x.h + 2 * p - kh) / s + 1, w: (x.w + 2 * p - kw) / s + 1 })
    }

    /// Ultralytics' `Conv`: the folded convolution, then SiLU when the module has it.
    pub fn conv(&mut self, m: &Conv, x: &Value, name: &str) -> Result<Value> {
        let y = self.conv_node(folded(m, name)?, x, name)?;
        Ok(if m.act { self.silu(&y, name) } else { y })
    }

    /// A plain `Conv2d` (the head's 1×1 predictions, with their bias).
    pub fn conv2d(&mut self, m: &Conv2d, x: &Value, name: &str) -> Result<Value> {
        self.conv_node(plain(m, name)?, x, name)
    }

    /// `x · sigmoid(x)` (opset 17 has no SiLU op).
    pub fn silu(&mut self, x: &Value, name: &str) -> Value {
        let s = self.g.op("Sigmoid", &format!("{name}.sigmoid"), &[&x.name], vec![]);
        let y = self.g.op("Mul", &format!("{name}.silu"), &[&x.name, &s], vec![]);
        Value { name: y, ..x.clone() }
    }

    /// Elementwise `a + b` (same shape).
    pub fn add(&mut self, a: &Value, b: &Value, name: &str) -> Value {
        let y = self.g.op("Add", name, &[&a.name, &b.name], vec![]);
        Value { name: y, ..a.clone() }
    }

    /// Channel concatenation.
    pub fn concat(&mut self, xs: &[&Value], name: &str) -> Result<Value> {
        let first = xs.first().ok_or_else(|| ExportError::unsupported(name, "concatenation of nothing"))?;
        if xs.iter().any(|x| (x.h, x.w) != (first.h, first.w)) {
            return Err(ExportError::unsupported(name, "concatenated maps of different sizes"));
        }
        let names: Vec<&str> = xs.iter().map(|x| x.name.as_str()).collect();
        let y = self.g.op("Concat", name, &names, vec![("axis", AttrValue::Int(1))]);
        Ok(Value { name: y, c: xs.iter().map(|x| x.c).sum(), h: first.h, w: first.w })
    }

    /// Splits the channels into pieces of `sizes`.
    pub fn split_channels(&mut self, x: &Value, sizes: &[usize], name: &str) -> Result<Vec<Value>> {
        if sizes.iter().sum::<usize>() != x.c {
            return Err(ExportError::unsupported(name, format!("split {sizes:?} of {} channels", x.c)));
        }
        let split = self.g.const_i64(&sizes.iter().map(|&s| s as i64).collect::<Vec<_>>());
        let outs = self.g.op_n("Split", name, &[&x.name, &split], sizes.len(), vec![("axis", AttrValue::Int(1))]);
        Ok(outs.into_iter().zip(sizes).map(|(n, &c)| Value { name: n, c, h: x.h, w: x.w }).collect())
    }

    /// `MaxPool(k, stride 1, padding k/2)` (size-preserving, as in SPPF).
    pub fn max_pool_same(&mut self, x: &Value, k: usize, name: &str) -> Value {
        let p = k / 2;
        let y = self.g.op(
            "MaxPool",
            name,
            &[&x.name],
            vec![("kernel_shape", ints(&[k, k])), ("strides", ints(&[1, 1])), ("pads", ints(&[p, p, p, p]))],
        );
        Value { name: y, ..x.clone() }
    }

    /// Nearest-neighbour upsampling by an integer factor (`Resize`, asymmetric + floor: each
    /// output pixel copies input pixel `⌊i / factor⌋`, as `nn.Upsample(mode="nearest")`).
    pub fn upsample_nearest(&mut self, x: &Value, factor: usize, name: &str) -> Value {
        let scales = self.g.init_f32_param(&format!("{name}.scales"), &[4], vec![1.0, 1.0, factor as f32, factor as f32]);
        let y = self.g.op(
            "Resize",
            name,
            &[&x.name, "", &scales],
            vec![
                ("mode", AttrValue::Str("nearest".into())),
                ("coordinate_transformation_mode", AttrValue::Str("asymmetric".into())),
                ("nearest_mode", AttrValue::Str("floor".into())),
            ],
        );
        Value { name: y, c: x.c, h: x.h * factor, w: x.w * factor }
    }

    /// `ReduceMax` over `axis` without keeping it, in the form of the file's opset (the axes an
    /// attribute before 18, an input from 18 on).
    pub fn reduce_max(&mut self, x: &str, axis: i64, name: &str) -> String {
        if self.opset >= 18 {
            let axes = self.g.const_i64(&[axis]);
            self.g.op("ReduceMax", name, &[x, &axes], vec![("keepdims", AttrValue::Int(0))])
        } else {
            self.g.op("ReduceMax", name, &[x], vec![("axes", AttrValue::Ints(vec![axis])), ("keepdims", AttrValue::Int(0))])
        }
    }

    /// `Unsqueeze` at `axis` (axes as an input: opset 13 on).
    pub fn unsqueeze(&mut self, x: &str, axis: i64, name: &str) -> String {
        let axes = self.g.const_i64(&[axis]);
        self.g.op("Unsqueeze", name, &[x, &axes], vec![])
    }

    /// `x` as f32 for the selection steps (a no-op in an f32 file).
    pub fn in_f32(&mut self, x: &str, name: &str) -> String {
        match self.half {
            true => self.g.op("Cast", name, &[x], vec![("to", AttrValue::Int(ONNX_FLOAT))]),
            false => x.to_string(),
        }
    }

    /// The graph output `output` made by `last` (an op computing in f32, given the name to
    /// use): named `output` in an f32 file, cast to half under that name in a half one.
    pub fn in_output_precision(&mut self, output: &str, last: impl FnOnce(&mut Emitter, &str) -> String) -> String {
        if !self.half {
            return last(self, output);
        }
        let y = last(self, &format!("{output}_f32"));
        self.g.op("Cast", output, &[&y], vec![("to", AttrValue::Int(ONNX_FLOAT16))])
    }

    /// `x` reshaped to the shape of `like` (a map of the same size), static or read at run time.
    pub fn reshape_like(&mut self, x: &str, like: &Value, name: &str) -> String {
        if self.dynamic {
            let shape = self.g.op("Shape", &format!("{name}.shape"), &[&like.name], vec![]);
            return self.g.op("Reshape", name, &[x, &shape], vec![]);
        }
        self.reshape(x, &[0, like.c as i64, like.h as i64, like.w as i64], name)
    }

    /// The position count `h·w` of a map for a reshape: −1 (inferred) when sizes are dynamic.
    pub fn positions(&self, x: &Value) -> i64 {
        if self.dynamic {
            -1
        } else {
            (x.h * x.w) as i64
        }
    }

    /// `Reshape` to `shape` (0 copies the batch); returns the output name.
    pub fn reshape(&mut self, x: &str, shape: &[i64], name: &str) -> String {
        let s = self.g.const_i64(shape);
        self.g.op("Reshape", name, &[x, &s], vec![])
    }
}

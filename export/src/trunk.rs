//! Backbone and neck (`model.0` … `model.22`): each Ultralytics block as the ONNX ops of its
//! eval forward in `ptl-heads` (`blocks.rs`), in the same order of operations.

use ptl_heads::blocks::{Attention, Bottleneck, C2Psa, C3k, C3k2, C3k2Block, PsaBlock, Sppf};
use ptl_heads::model::{LayerKind, HEAD_FROM};
use ptl_heads::PoseModel;

use crate::emit::{Emitter, Value};
use crate::{ExportError, Result};

impl Emitter {
    fn bottleneck(&mut self, m: &Bottleneck, x: &Value, name: &str) -> Result<Value> {
        let a = self.conv(&m.cv1, x, &format!("{name}.cv1"))?;
        let y = self.conv(&m.cv2, &a, &format!("{name}.cv2"))?;
        Ok(if m.add { self.add(x, &y, &format!("{name}.add")) } else { y })
    }

    fn c3k(&mut self, m: &C3k, x: &Value, name: &str) -> Result<Value> {
        let mut a = self.conv(&m.cv1, x, &format!("{name}.cv1"))?;
        for (i, b) in m.m.iter().enumerate() {
            a = self.bottleneck(b, &a, &format!("{name}.m.{i}"))?;
        }
        let b = self.conv(&m.cv2, x, &format!("{name}.cv2"))?;
        let cat = self.concat(&[&a, &b], &format!("{name}.cat"))?;
        self.conv(&m.cv3, &cat, &format!("{name}.cv3"))
    }

    fn c3k2(&mut self, m: &C3k2, x: &Value, name: &str) -> Result<Value> {
        let y = self.conv(&m.cv1, x, &format!("{name}.cv1"))?;
        let mut ys = self.split_channels(&y, &[m.c, m.c], &format!("{name}.split"))?;
        for (i, block) in m.m.iter().enumerate() {
            let prev = ys.last().cloned().unwrap_or_else(|| y.clone());
            let bn = format!("{name}.m.{i}");
            let next = match block {
                C3k2Block::Bottleneck(b) => self.bottleneck(b, &prev, &bn)?,
                C3k2Block::C3k(b) => self.c3k(b, &prev, &bn)?,
                C3k2Block::Attn(b, p) => {
                    let t = self.bottleneck(b, &prev, &format!("{bn}.0"))?;
                    self.psa_block(p, &t, &format!("{bn}.1"))?
                }
            };
            ys.push(next);
        }
        let refs: Vec<&Value> = ys.iter().collect();
        let cat = self.concat(&refs, &format!("{name}.cat"))?;
        self.conv(&m.cv2, &cat, &format!("{name}.cv2"))
    }

    fn sppf(&mut self, m: &Sppf, x: &Value, name: &str) -> Result<Value> {
        let mut ys = vec![self.conv(&m.cv1, x, &format!("{name}.cv1"))?];
        for i in 0..m.n {
            let p = self.max_pool_same(&ys[i], m.k, &format!("{name}.pool{i}"));
            ys.push(p);
        }
        let refs: Vec<&Value> = ys.iter().collect();
        let cat = self.concat(&refs, &format!("{name}.cat"))?;
        let y = self.conv(&m.cv2, &cat, &format!("{name}.cv2"))?;
        Ok(if m.add { self.add(&y, x, &format!("{name}.add")) } else { y })
    }

    /// Multi-head attention over the h·w positions, as `Attention::forward`: per head
    /// `attn = softmax((qᵀk)·scale)` over the keys, `v·attnᵀ`, plus the depthwise positional
    /// term on v, then the output projection.
    fn attention(&mut self, m: &Attention, x: &Value, name: &str) -> Result<Value> {
        let (heads, kd, hd) = (m.num_heads as i64, m.key_dim, m.head_dim);
        let n = self.positions(x);
        let qkv = self.conv(&m.qkv, x, &format!("{name}.qkv"))?;
        let per_head = (2 * kd + hd) as i64;
        if heads * per_head != qkv.c as i64 || m.num_heads * hd != x.c {
            return Err(ExportError::unsupported(name, format!("{} qkv channels for {heads} heads of {kd}+{kd}+{hd}", qkv.c)));
        }
        let qkv4 = self.reshape(&qkv.name, &[0, heads, per_head, n], &format!("{name}.qkv_heads"));
        let split = self.g.const_i64(&[kd as i64, kd as i64, hd as i64]);
        let qkv_parts =
            self.g.op_n("Split", &format!("{name}.split"), &[&qkv4, &split], 3, vec![("axis", crate::graph::AttrValue::Int(2))]);
        let (q, k, v) = (&qkv_parts[0], &qkv_parts[1], &qkv_parts[2]);
        let perm = crate::graph::AttrValue::Ints(vec![0, 1, 3, 2]);
        let qt = self.g.op("Transpose", &format!("{name}.q_t"), &[q], vec![("perm", perm.clone())]);
        let qk = self.g.op("MatMul", &format!("{name}.qk"), &[&qt, k], vec![]);
        let scale = self.g.const_f32(m.scale as f32);
        let scaled = self.g.op("Mul", &format!("{name}.scaled"), &[&qk, &scale], vec![]);
        let attn = self.g.op("Softmax", &format!("{name}.softmax"), &[&scaled], vec![("axis", crate::graph::AttrValue::Int(-1))]);
        let attn_t = self.g.op("Transpose", &format!("{name}.attn_t"), &[&attn], vec![("perm", perm)]);
        let o = self.g.op("MatMul", &format!("{name}.v_attn"), &[v, &attn_t], vec![]);
        let o = Value { name: self.reshape_like(&o, x, &format!("{name}.o")), ..x.clone() };
        let v_map = Value { name: self.reshape_like(v, x, &format!("{name}.v")), ..x.clone() };
        let pe = self.conv(&m.pe, &v_map, &format!("{name}.pe"))?;
        let sum = self.add(&o, &pe, &format!("{name}.o_pe"));
        self.conv(&m.proj, &sum, &format!("{name}.proj"))
    }

    fn psa_block(&mut self, m: &PsaBlock, x: &Value, name: &str) -> Result<Value> {
        let a = self.attention(&m.attn, x, &format!("{name}.attn"))?;
        let x = if m.add { self.add(x, &a, &format!("{name}.add_attn")) } else { a };
        let f0 = self.conv(&m.ffn0, &x, &format!("{name}.ffn.0"))?;
        let f = self.conv(&m.ffn1, &f0, &format!("{name}.ffn.1"))?;
        Ok(if m.add { self.add(&x, &f, &format!("{name}.add_ffn")) } else { f })
    }

    fn c2psa(&mut self, m: &C2Psa, x: &Value, name: &str) -> Result<Value> {
        let y = self.conv(&m.cv1, x, &format!("{name}.cv1"))?;
        let parts = self.split_channels(&y, &[m.c, m.c], &format!("{name}.split"))?;
        let mut b = parts[1].clone();
        for (i, p) in m.m.iter().enumerate() {
            b = self.psa_block(p, &b, &format!("{name}.m.{i}"))?;
        }
        let cat = self.concat(&[&parts[0], &b], &format!("{name}.cat"))?;
        self.conv(&m.cv2, &cat, &format!("{name}.cv2"))
    }

    /// Layers 0…22 on `image`; returns the three neck features (P3, P4, P5).
    pub fn trunk(&mut self, model: &PoseModel, image: &Value) -> Result<Vec<Value>> {
        let mut outs: Vec<Value> = Vec::new();
        for l in model.layers() {
            let name = format!("model.{}", l.index);
            let input = |f: isize| -> Result<Value> {
                let i = if f < 0 { l.index as isize + f } else { f };
                match i {
                    -1 => Ok(image.clone()),
                    i if i >= 0 && (i as usize) < outs.len() => Ok(outs[i as usize].clone()),
                    _ => Err(ExportError::unsupported(&name, format!("reads layer {i}, which is not before it"))),
                }
            };
            let first = || l.from.first().copied().ok_or_else(|| ExportError::unsupported(&name, "a layer without input"));
            let y = match &l.kind {
                LayerKind::Conv(m) => self.conv(m, &input(first()?)?, &name)?,
                LayerKind::C3k2(m) => self.c3k2(m, &input(first()?)?, &name)?,
                LayerKind::Sppf(m) => self.sppf(m, &input(first()?)?, &name)?,
                LayerKind::C2Psa(m) => self.c2psa(m, &input(first()?)?, &name)?,
                LayerKind::Upsample(f) => self.upsample_nearest(&input(first()?)?, *f, &name),
                LayerKind::Concat => {
                    let ins = l.from.iter().map(|&f| input(f)).collect::<Result<Vec<_>>>()?;
                    let refs: Vec<&Value> = ins.iter().collect();
                    self.concat(&refs, &name)?
                }
                LayerKind::Pose(_) => break,
            };
            outs.push(y);
        }
        HEAD_FROM
            .iter()
            .map(|&i| outs.get(i).cloned().ok_or_else(|| ExportError::unsupported("model", format!("neck output {i} missing"))))
            .collect()
    }
}

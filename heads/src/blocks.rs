//! Ultralytics building blocks (docs/model.md §2): Bottleneck, C3k, C3k2, SPPF (YOLO26 and v8 forms),
//! Attention, PSABlock, C2PSA. Field names follow the reference attribute names so that
//! `visit` produces the reference state-dict keys.

use ptl_autograd::impl_module;
use ptl_autograd::module::join_name;
use ptl_autograd::{Module, Tensor, TensorKind};

use crate::nn::{Conv, Init};
use crate::Result;

/// `Bottleneck(c1, c2, shortcut, k=(k1,k2), e)`: `x + cv2(cv1(x))` when shortcut and c1 = c2.
pub struct Bottleneck {
    /// First convolution, to the hidden width.
    pub cv1: Conv,
    /// Second convolution, to the output width.
    pub cv2: Conv,
    /// Whether the input is added (a shortcut between equal widths).
    pub add: bool,
}

impl Bottleneck {
    /// Builds the block with Ultralytics' arguments, weights drawn from `init`.
    pub fn new(c1: usize, c2: usize, shortcut: bool, k: (usize, usize), e: f64, init: &mut Init<'_>) -> Result<Self> {
        let h = (c2 as f64 * e) as usize;
        Ok(Bottleneck { cv1: Conv::silu(c1, h, k.0, 1, init)?, cv2: Conv::silu(h, c2, k.1, 1, init)?, add: shortcut && c1 == c2 })
    }
    /// The block's output for `x` (N, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.cv1.forward(x)?;
        if self.add {
            self.cv2.forward_add(&h, x)
        } else {
            self.cv2.forward(&h)
        }
    }
}

impl_module!(Bottleneck { "cv1" => one cv1, "cv2" => one cv2 });

/// `C3k(c1, c2, n, shortcut, e=0.5, k=3)`: `cv3(cat[m(cv1(x)), cv2(x)])`.
pub struct C3k {
    /// 1×1 convolution into the bottleneck branch.
    pub cv1: Conv,
    /// 1×1 convolution of the side branch.
    pub cv2: Conv,
    /// 1×1 convolution joining both branches.
    pub cv3: Conv,
    /// The bottlenecks, in order.
    pub m: Vec<Bottleneck>,
}

impl C3k {
    /// Builds the block with Ultralytics' arguments, weights drawn from `init`.
    pub fn new(c1: usize, c2: usize, n: usize, shortcut: bool, e: f64, k: usize, init: &mut Init<'_>) -> Result<Self> {
        let c_ = (c2 as f64 * e) as usize;
        let cv1 = Conv::silu(c1, c_, 1, 1, init)?;
        let cv2 = Conv::silu(c1, c_, 1, 1, init)?;
        let cv3 = Conv::silu(2 * c_, c2, 1, 1, init)?;
        let m = (0..n).map(|_| Bottleneck::new(c_, c_, shortcut, (k, k), 1.0, init)).collect::<Result<Vec<_>>>()?;
        Ok(C3k { cv1, cv2, cv3, m })
    }
    /// The block's output for `x` (N, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut a = self.cv1.forward(x)?;
        for b in &self.m {
            a = b.forward(&a)?;
        }
        let b = self.cv2.forward(x)?;
        self.cv3.forward(&Tensor::cat(&[&a, &b], 1)?)
    }
}

impl_module!(C3k { "cv1" => one cv1, "cv2" => one cv2, "cv3" => one cv3, "m" => seq m });

/// One inner block of a C3k2.
pub enum C3k2Block {
    /// `Bottleneck(c, c, shortcut, (3,3), 0.5)` (c3k = False).
    Bottleneck(Bottleneck),
    /// `C3k(c, c, 2, shortcut)` (c3k = True).
    C3k(C3k),
    /// `Sequential(Bottleneck(c, c, shortcut), PSABlock(c, 0.5, max(c/64, 1)))` (attn = True).
    Attn(Box<Bottleneck>, Box<PsaBlock>),
}

impl C3k2Block {
    /// The block's output for `x` (N, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            C3k2Block::Bottleneck(b) => b.forward(x),
            C3k2Block::C3k(b) => b.forward(x),
            C3k2Block::Attn(b, p) => p.forward(&b.forward(x)?),
        }
    }
}

impl Module for C3k2Block {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        match self {
            C3k2Block::Bottleneck(b) => b.visit(prefix, f),
            C3k2Block::C3k(b) => b.visit(prefix, f),
            C3k2Block::Attn(b, p) => {
                b.visit(&join_name(prefix, "0"), f);
                p.visit(&join_name(prefix, "1"), f);
            }
        }
    }
    fn set_training(&mut self, t: bool) {
        match self {
            C3k2Block::Bottleneck(b) => b.set_training(t),
            C3k2Block::C3k(b) => b.set_training(t),
            C3k2Block::Attn(b, p) => {
                b.set_training(t);
                p.set_training(t);
            }
        }
    }
}

/// `C3k2(c1, c2, n, c3k, e, attn, shortcut=True)` (C2f-style split/extend/concat).
pub struct C3k2 {
    /// Hidden width (each half of `cv1`'s output).
    pub c: usize,
    /// 1×1 convolution whose output is split in two halves.
    pub cv1: Conv,
    /// 1×1 convolution of all pieces concatenated.
    pub cv2: Conv,
    /// The blocks, each taking the latest output.
    pub m: Vec<C3k2Block>,
}

impl C3k2 {
    /// Builds the block with Ultralytics' arguments, weights drawn from `init`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(c1: usize, c2: usize, n: usize, c3k: bool, e: f64, attn: bool, shortcut: bool, init: &mut Init<'_>) -> Result<Self> {
        let c = (c2 as f64 * e) as usize;
        let cv1 = Conv::silu(c1, 2 * c, 1, 1, init)?;
        let cv2 = Conv::silu((2 + n) * c, c2, 1, 1, init)?;
        let mut m = Vec::with_capacity(n);
        for _ in 0..n {
            m.push(if attn {
                let b = Bottleneck::new(c, c, shortcut, (3, 3), 0.5, init)?;
                let p = PsaBlock::new(c, 0.5, (c / 64).max(1), true, init)?;
                C3k2Block::Attn(Box::new(b), Box::new(p))
            } else if c3k {
                C3k2Block::C3k(C3k::new(c, c, 2, shortcut, 0.5, 3, init)?)
            } else {
                C3k2Block::Bottleneck(Bottleneck::new(c, c, shortcut, (3, 3), 0.5, init)?)
            });
        }
        Ok(C3k2 { c, cv1, cv2, m })
    }
    /// The block's output for `x` (N, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.cv1.forward(x)?;
        let mut ys = y.split(&[self.c, self.c], 1)?;
        for b in &self.m {
            let next = b.forward(ys.last().unwrap_or(&y))?;
            ys.push(next);
        }
        let refs: Vec<&Tensor> = ys.iter().collect();
        self.cv2.forward(&Tensor::cat(&refs, 1)?)
    }
}

impl_module!(C3k2 { "cv1" => one cv1, "cv2" => one cv2, "m" => seq m });

/// `SPPF(c1, c2, k, n, shortcut)`. YOLO26 form: `cv1` without activation and a residual when
/// `shortcut` and c1 = c2; YOLOv8/11 form: `cv1` with SiLU, no residual.
pub struct Sppf {
    /// 1×1 convolution halving the channels (no activation in YOLO26).
    pub cv1: Conv,
    /// 1×1 convolution of the pooled maps concatenated.
    pub cv2: Conv,
    /// Max-pool window (stride 1, same padding).
    pub k: usize,
    /// Max pools in a row.
    pub n: usize,
    /// Whether the input is added.
    pub add: bool,
}

impl Sppf {
    /// Builds the block with Ultralytics' arguments, weights drawn from `init`.
    pub fn new(c1: usize, c2: usize, k: usize, n: usize, shortcut: bool, cv1_act: bool, init: &mut Init<'_>) -> Result<Self> {
        let h = c1 / 2;
        let cv1 = Conv::new(c1, h, 1, 1, 1, cv1_act, init)?;
        let cv2 = Conv::silu(h * (n + 1), c2, 1, 1, init)?;
        Ok(Sppf { cv1, cv2, k, n, add: shortcut && c1 == c2 })
    }
    /// The block's output for `x` (N, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut ys = vec![self.cv1.forward(x)?];
        for i in 0..self.n {
            let p = ys[i].max_pool2d(self.k, 1, self.k / 2)?;
            ys.push(p);
        }
        let refs: Vec<&Tensor> = ys.iter().collect();
        let c = Tensor::cat(&refs, 1)?;
        if self.add {
            self.cv2.forward_add(&c, x)
        } else {
            self.cv2.forward(&c)
        }
    }
}

impl_module!(Sppf { "cv1" => one cv1, "cv2" => one cv2 });

/// Multi-head self-attention over the H·W positions with a depthwise positional term.
pub struct Attention {
    /// Attention heads.
    pub num_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Query and key channels per head.
    pub key_dim: usize,
    /// Factor of the query·key products (key_dim^−½).
    pub scale: f64,
    /// 1×1 projection to queries, keys and values, head by head.
    pub qkv: Conv,
    /// 1×1 output projection.
    pub proj: Conv,
    /// Depthwise 3×3 positional convolution of the values.
    pub pe: Conv,
}

impl Attention {
    /// Builds the block with Ultralytics' arguments, weights drawn from `init`.
    pub fn new(dim: usize, num_heads: usize, attn_ratio: f64, init: &mut Init<'_>) -> Result<Self> {
        if num_heads == 0 || dim % num_heads != 0 {
            return Err(crate::HeadsError::Config(format!("Attention: dim {dim} not divisible by {num_heads} heads")));
        }
        let head_dim = dim / num_heads;
        let key_dim = (head_dim as f64 * attn_ratio) as usize;
        let h = dim + key_dim * num_heads * 2;
        Ok(Attention {
            num_heads,
            head_dim,
            key_dim,
            scale: (key_dim as f64).powf(-0.5),
            qkv: Conv::new(dim, h, 1, 1, 1, false, init)?,
            proj: Conv::new(dim, dim, 1, 1, 1, false, init)?,
            pe: Conv::new(dim, dim, 3, 1, dim, false, init)?,
        })
    }
    /// The block's output for `x` (N, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.dims();
        let (b, c, h, w) = (d[0], d[1], d[2], d[3]);
        let n = h * w;
        let qkv = self.qkv.forward(x)?.reshape(vec![b, self.num_heads, 2 * self.key_dim + self.head_dim, n])?;
        let parts = qkv.split(&[self.key_dim, self.key_dim, self.head_dim], 2)?;
        let (q, k, v) = (&parts[0], &parts[1], &parts[2]);
        // qᵀ·k and v·attnᵀ with the GEMMs reading the transposes (no transposed copies); mixed
        // precision is `ptl_autograd::autocast`'s (operands and result in the compute dtype).
        let attn = q.matmul_t(k, true, false)?.mul_scalar(self.scale)?.softmax(-1)?;
        let o = v.matmul_t(&attn, false, true)?.reshape(vec![b, c, h, w])?;
        let pe = self.pe.forward(&v.reshape(vec![b, c, h, w])?)?;
        self.proj.forward(&o.add(&pe)?)
    }
}

impl_module!(Attention { "qkv" => one qkv, "proj" => one proj, "pe" => one pe });

/// `PSABlock(c, attn_ratio, num_heads, shortcut)`: attention and a 2-layer FFN, each residual.
pub struct PsaBlock {
    /// The attention.
    pub attn: Attention,
    /// Feed-forward 1×1 convolution to twice the width (SiLU).
    pub ffn0: Conv,
    /// Feed-forward 1×1 convolution back (no activation).
    pub ffn1: Conv,
    /// Whether the two residuals are added.
    pub add: bool,
}

impl PsaBlock {
    /// Builds the block with Ultralytics' arguments, weights drawn from `init`.
    pub fn new(c: usize, attn_ratio: f64, num_heads: usize, shortcut: bool, init: &mut Init<'_>) -> Result<Self> {
        Ok(PsaBlock {
            attn: Attention::new(c, num_heads, attn_ratio, init)?,
            ffn0: Conv::silu(c, 2 * c, 1, 1, init)?,
            ffn1: Conv::new(2 * c, c, 1, 1, 1, false, init)?,
            add: shortcut,
        })
    }
    /// The block's output for `x` (N, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let a = self.attn.forward(x)?;
        let x = if self.add { x.add(&a)? } else { a };
        let h = self.ffn0.forward(&x)?;
        if self.add {
            self.ffn1.forward_add(&h, &x)
        } else {
            self.ffn1.forward(&h)
        }
    }
}

impl_module!(PsaBlock { "attn" => one attn, "ffn.0" => one ffn0, "ffn.1" => one ffn1 });

/// `C2PSA(c1, c2 = c1, n, e=0.5)`.
pub struct C2Psa {
    /// Hidden width (each half of `cv1`'s output).
    pub c: usize,
    /// 1×1 convolution whose output is split in two halves.
    pub cv1: Conv,
    /// 1×1 convolution joining the halves.
    pub cv2: Conv,
    /// The PSA blocks applied to the second half.
    pub m: Vec<PsaBlock>,
}

impl C2Psa {
    /// Builds the block with Ultralytics' arguments, weights drawn from `init`.
    pub fn new(c1: usize, c2: usize, n: usize, e: f64, init: &mut Init<'_>) -> Result<Self> {
        if c1 != c2 {
            return Err(crate::HeadsError::Config(format!("C2PSA needs c1 == c2, got {c1} and {c2}")));
        }
        let c = (c1 as f64 * e) as usize;
        let cv1 = Conv::silu(c1, 2 * c, 1, 1, init)?;
        let cv2 = Conv::silu(2 * c, c1, 1, 1, init)?;
        let m = (0..n).map(|_| PsaBlock::new(c, 0.5, (c / 64).max(1), true, init)).collect::<Result<Vec<_>>>()?;
        Ok(C2Psa { c, cv1, cv2, m })
    }
    /// The block's output for `x` (N, C, H, W).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.cv1.forward(x)?;
        let parts = y.split(&[self.c, self.c], 1)?;
        let a = &parts[0];
        let mut b = parts[1].clone();
        for p in &self.m {
            b = p.forward(&b)?;
        }
        self.cv2.forward(&Tensor::cat(&[a, &b], 1)?)
    }
}

impl_module!(C2Psa { "cv1" => one cv1, "cv2" => one cv2, "m" => seq m });

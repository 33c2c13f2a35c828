//! The whole YOLO26-pose model: backbone + neck (docs/model.md §3) and the `Pose26` head, built from
//! a yaml-like layer table scaled by the n/s/m/l/x multipliers.

use std::collections::HashMap;
use std::path::Path;

use ptl_autograd::module::{join_name, load_state_dict, state_dict};
use ptl_autograd::{DType, Device, MemoryFormat, Module, Rng, Tensor, TensorKind};

use crate::blocks::{C2Psa, C3k2, Sppf};
use crate::head::{HeadOutput, Pose26};
use crate::nn::{Conv, Init};
use crate::{HeadsError, Result};

/// Model scale (depth, width, max channels as in `yolo26-pose.yaml`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scale {
    /// Nano: depth 0.50, width 0.25, at most 1024 channels.
    N,
    /// Small: depth 0.50, width 0.50, at most 1024 channels.
    S,
    /// Medium: depth 0.50, width 1.00, at most 512 channels.
    M,
    /// Large: depth 1.00, width 1.00, at most 512 channels.
    L,
    /// Extra large: depth 1.00, width 1.50, at most 512 channels.
    X,
}

impl Scale {
    /// `(depth multiple, width multiple, max channels)`.
    pub fn multipliers(self) -> (f64, f64, usize) {
        match self {
            Scale::N => (0.50, 0.25, 1024),
            Scale::S => (0.50, 0.50, 1024),
            Scale::M => (0.50, 1.00, 512),
            Scale::L => (1.00, 1.00, 512),
            Scale::X => (1.00, 1.50, 512),
        }
    }
    /// The scale's letter in a model name (`n` in `yolo26n-pose`).
    pub fn letter(self) -> char {
        match self {
            Scale::N => 'n',
            Scale::S => 's',
            Scale::M => 'm',
            Scale::L => 'l',
            Scale::X => 'x',
        }
    }
    /// Parses `n`, `s`, `m`, `l`, `x` (case-insensitive).
    pub fn parse(s: &str) -> Result<Scale> {
        match s.trim().to_ascii_lowercase().as_str() {
            "n" => Ok(Scale::N),
            "s" => Ok(Scale::S),
            "m" => Ok(Scale::M),
            "l" => Ok(Scale::L),
            "x" => Ok(Scale::X),
            other => Err(HeadsError::Config(format!("unknown scale `{other}`: use n, s, m, l or x"))),
        }
    }
}

/// What to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Number of classes (1 for "person").
    pub nc: usize,
    /// `(keypoints, values per keypoint)`, e.g. `(17, 3)`.
    pub kpt_shape: (usize, usize),
    /// Model size (n, s, m, l, x).
    pub scale: Scale,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig { nc: 1, kpt_shape: (17, 3), scale: Scale::N }
    }
}

/// Strides of the three detection levels (P3, P4, P5).
pub const STRIDES: [f64; 3] = [8.0, 16.0, 32.0];

/// One layer of the network.
pub enum LayerKind {
    /// Conv (convolution, BN, SiLU).
    Conv(Conv),
    /// C3k2 block.
    C3k2(C3k2),
    /// SPPF block.
    Sppf(Sppf),
    /// C2PSA block.
    C2Psa(C2Psa),
    /// Nearest-neighbour upsampling by the factor.
    Upsample(usize),
    /// Channel concatenation of the `from` inputs.
    Concat,
    /// The Pose26 head.
    Pose(Box<Pose26>),
}

impl LayerKind {
    /// Reference class name (for the summary).
    pub fn type_name(&self) -> &'static str {
        match self {
            LayerKind::Conv(_) => "Conv",
            LayerKind::C3k2(_) => "C3k2",
            LayerKind::Sppf(_) => "SPPF",
            LayerKind::C2Psa(_) => "C2PSA",
            LayerKind::Upsample(_) => "Upsample",
            LayerKind::Concat => "Concat",
            LayerKind::Pose(_) => "Pose26",
        }
    }
    pub(crate) fn as_module(&self) -> Option<&dyn Module> {
        match self {
            LayerKind::Conv(m) => Some(m),
            LayerKind::C3k2(m) => Some(m),
            LayerKind::Sppf(m) => Some(m),
            LayerKind::C2Psa(m) => Some(m),
            LayerKind::Pose(m) => Some(m.as_ref()),
            LayerKind::Upsample(_) | LayerKind::Concat => None,
        }
    }
    fn as_module_mut(&mut self) -> Option<&mut dyn Module> {
        match self {
            LayerKind::Conv(m) => Some(m),
            LayerKind::C3k2(m) => Some(m),
            LayerKind::Sppf(m) => Some(m),
            LayerKind::C2Psa(m) => Some(m),
            LayerKind::Pose(m) => Some(m.as_mut()),
            LayerKind::Upsample(_) | LayerKind::Concat => None,
        }
    }
}

/// A layer with its graph position (`model.<index>`).
pub struct Layer {
    /// Position in the model (`model.<index>` in the state dict).
    pub index: usize,
    /// Input layers: −1 = previous layer, otherwise an absolute index.
    pub from: Vec<isize>,
    /// Repeats after depth scaling (the `n` column).
    pub repeats: usize,
    /// Resolved constructor arguments, for the summary (e.g. `[3, 16, 3, 2]`).
    pub args: String,
    /// Output channels (per level for the head).
    pub c_out: usize,
    /// Output stride relative to the input.
    pub stride: usize,
    /// The module.
    pub kind: LayerKind,
}

impl Layer {
    /// Number of parameter elements of this layer.
    pub fn num_params(&self) -> usize {
        self.kind.as_module().map(crate::nn::param_count).unwrap_or(0)
    }
}

/// The rows of `yolo26-pose.yaml`: `(from, n, module, args)` before scaling.
enum Row {
    Conv(usize, usize, usize),
    C3k2 { c2: usize, c3k: bool, e: f64, attn: bool },
    Sppf(usize, usize, usize, bool),
    C2Psa(usize),
    Upsample,
    Concat,
}

fn yaml() -> Vec<(Vec<isize>, usize, Row)> {
    use Row::*;
    vec![
        (vec![-1], 1, Conv(64, 3, 2)),
        (vec![-1], 1, Conv(128, 3, 2)),
        (vec![-1], 2, C3k2 { c2: 256, c3k: false, e: 0.25, attn: false }),
        (vec![-1], 1, Conv(256, 3, 2)),
        (vec![-1], 2, C3k2 { c2: 512, c3k: false, e: 0.25, attn: false }),
        (vec![-1], 1, Conv(512, 3, 2)),
        (vec![-1], 2, C3k2 { c2: 512, c3k: true, e: 0.5, attn: false }),
        (vec![-1], 1, Conv(1024, 3, 2)),
        (vec![-1], 2, C3k2 { c2: 1024, c3k: true, e: 0.5, attn: false }),
        (vec![-1], 1, Sppf(1024, 5, 3, true)),
        (vec![-1], 2, C2Psa(1024)),
        (vec![-1], 1, Upsample),
        (vec![-1, 6], 1, Concat),
        (vec![-1], 2, C3k2 { c2: 512, c3k: true, e: 0.5, attn: false }),
        (vec![-1], 1, Upsample),
        (vec![-1, 4], 1, Concat),
        (vec![-1], 2, C3k2 { c2: 256, c3k: true, e: 0.5, attn: false }),
        (vec![-1], 1, Conv(256, 3, 2)),
        (vec![-1, 13], 1, Concat),
        (vec![-1], 2, C3k2 { c2: 512, c3k: true, e: 0.5, attn: false }),
        (vec![-1], 1, Conv(512, 3, 2)),
        (vec![-1, 10], 1, Concat),
        (vec![-1], 1, C3k2 { c2: 1024, c3k: true, e: 0.5, attn: true }),
    ]
}

/// Layers feeding the head (P3, P4, P5).
pub const HEAD_FROM: [usize; 3] = [16, 19, 22];

/// Kernel-trace labels of the layers, by index (static, so labelling allocates nothing).
const LAYER_LABELS: [&str; 24] = [
    "layer 0", "layer 1", "layer 2", "layer 3", "layer 4", "layer 5", "layer 6", "layer 7", "layer 8", "layer 9", "layer 10", "layer 11",
    "layer 12", "layer 13", "layer 14", "layer 15", "layer 16", "layer 17", "layer 18", "layer 19", "layer 20", "layer 21", "layer 22",
    "layer 23",
];

/// YOLO26-pose: `model.0` … `model.22` and the `Pose26` head `model.23`.
pub struct PoseModel {
    /// Classes, keypoints and scale.
    pub config: ModelConfig,
    /// Private so that the last layer is always the head (see [`PoseModel::layers`]).
    layers: Vec<Layer>,
    /// Layer outputs that later layers read (kept during the forward).
    pub save: Vec<usize>,
    /// The device the weights are on.
    pub device: Device,
    training: bool,
    /// The storage order of the trunk's and neck's activations ([`PoseModel::set_activation_format`]).
    activations: MemoryFormat,
    /// Identity of the current head (changes with [`PoseModel::replace_head`]).
    head_id: u64,
    /// [`PoseModel::piece_surface`] by piece: built once (a replay plugin asks every step),
    /// dropped when the head is replaced — the only structural change a model has.
    pub(crate) surfaces: std::sync::Mutex<HashMap<crate::Piece, crate::PieceSurface>>,
}

/// A fresh head identity.
fn next_head_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Eval-mode output.
#[derive(Clone, Debug)]
pub struct Prediction {
    /// `(B, 4 + nc + K·D, A)` from the one-to-many branch: (cx, cy, w, h) px, sigmoid scores,
    /// keypoints (x px, y px, sigmoid v). The caller runs NMS.
    pub decoded: Tensor,
    /// Raw outputs of both branches (the o2o ones feed the end-to-end decode/top-k).
    pub raw: HeadOutput,
    /// `(A, 2)` anchor centres (grid units).
    pub anchors: Tensor,
    /// `(A, 1)` anchor strides.
    pub strides: Tensor,
}

fn make_divisible(x: f64, d: usize) -> usize {
    ((x / d as f64).ceil() as usize) * d
}

impl PoseModel {
    /// Builds the model with PyTorch-default initialisation drawn from `Rng::new(seed)`, BN eps
    /// 1e-3 / momentum 0.03, and the head bias init. The model starts in training mode.
    pub fn new(config: ModelConfig, device: Device, seed: u64) -> Result<Self> {
        let (depth, width, max_ch) = config.scale.multipliers();
        let mut rng = Rng::new(seed);
        let mut init = Init { rng: &mut rng, device };
        let mut layers: Vec<Layer> = Vec::new();
        let mut ch: Vec<usize> = Vec::new(); // output channels per layer
        let mut strides: Vec<usize> = Vec::new();
        let scale_c = |c: usize| make_divisible(c.min(max_ch) as f64 * width, 8);
        let scale_n = |n: usize| if n > 1 { ((n as f64 * depth).round() as usize).max(1) } else { n };
        let mlx = matches!(config.scale, Scale::M | Scale::L | Scale::X);
        for (i, (from, n, row)) in yaml().into_iter().enumerate() {
            let resolve = |f: isize| if f < 0 { (i as isize + f) as usize } else { f as usize };
            let c1 = if i == 0 { 3 } else { ch[resolve(from[0])] };
            let s1 = if i == 0 { 1 } else { strides[resolve(from[0])] };
            let n = scale_n(n);
            let (kind, c2, s, args) = match row {
                Row::Conv(c, k, s) => {
                    let c2 = scale_c(c);
                    (LayerKind::Conv(Conv::silu(c1, c2, k, s, &mut init)?), c2, s1 * s, format!("[{c1}, {c2}, {k}, {s}]"))
                }
                Row::C3k2 { c2, c3k, e, attn } => {
                    let c2 = scale_c(c2);
                    let c3k = c3k || mlx;
                    let m = C3k2::new(c1, c2, n, c3k, e, attn, true, &mut init)?;
                    let args =
                        if attn { format!("[{c1}, {c2}, {n}, {c3k}, {e}, {attn}]") } else { format!("[{c1}, {c2}, {n}, {c3k}, {e}]") };
                    (LayerKind::C3k2(m), c2, s1, args)
                }
                Row::Sppf(c, k, nn, shortcut) => {
                    let c2 = scale_c(c);
                    (
                        LayerKind::Sppf(Sppf::new(c1, c2, k, nn, shortcut, false, &mut init)?),
                        c2,
                        s1,
                        format!("[{c1}, {c2}, {k}, {nn}, {shortcut}]"),
                    )
                }
                Row::C2Psa(c) => {
                    let c2 = scale_c(c);
                    (LayerKind::C2Psa(C2Psa::new(c1, c2, n, 0.5, &mut init)?), c2, s1, format!("[{c1}, {c2}, {n}]"))
                }
                Row::Upsample => (LayerKind::Upsample(2), c1, s1 / 2, "[None, 2, 'nearest']".to_string()),
                Row::Concat => {
                    let c2 = from.iter().map(|&f| ch[resolve(f)]).sum();
                    (LayerKind::Concat, c2, s1, "[1]".to_string())
                }
            };
            let from_abs: Vec<isize> = from.clone();
            let repeats = if matches!(kind, LayerKind::C3k2(_) | LayerKind::C2Psa(_)) { n } else { 1 };
            layers.push(Layer { index: i, from: from_abs, repeats, args, c_out: c2, stride: s, kind });
            ch.push(c2);
            strides.push(s);
        }
        let head_ch: Vec<usize> = HEAD_FROM.iter().map(|&i| ch[i]).collect();
        let head_strides: Vec<f64> = HEAD_FROM.iter().map(|&i| strides[i] as f64).collect();
        if head_strides != STRIDES {
            return Err(HeadsError::Config(format!("unexpected head strides {head_strides:?}")));
        }
        let head = Pose26::new(config.nc, config.kpt_shape, &head_ch, &head_strides, &mut init)?;
        let args = format!("[{}, {:?}, {:?}]", config.nc, [config.kpt_shape.0, config.kpt_shape.1], head_ch);
        layers.push(Layer {
            index: layers.len(),
            from: HEAD_FROM.iter().map(|&i| i as isize).collect(),
            repeats: 1,
            args,
            c_out: head_ch[0],
            stride: 8,
            kind: LayerKind::Pose(Box::new(head)),
        });
        let mut save: Vec<usize> = Vec::new();
        for l in &layers {
            for &f in &l.from {
                if f >= 0 && !save.contains(&(f as usize)) {
                    save.push(f as usize);
                }
            }
        }
        save.sort_unstable();
        Ok(PoseModel {
            config,
            layers,
            save,
            device,
            training: true,
            activations: MemoryFormat::Contiguous,
            head_id: next_head_id(),
            surfaces: Default::default(),
        })
    }

    /// All layers, `model.0` … `model.23` (the last one is the `Pose26` head).
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// Identity of the current head: it changes whenever the head is replaced, so that anything
    /// recorded against the old head (e.g. a replay plugin's recordings) knows to let go.
    pub fn head_id(&self) -> u64 {
        self.head_id
    }

    /// Swaps in `head` (e.g. for another number of keypoints: see [`PoseModel::rehead`]) and
    /// returns the old one. Its input channels and strides must match the neck's.
    pub fn replace_head(&mut self, mut head: Pose26) -> Result<Pose26> {
        let cur = self.head();
        if head.ch != cur.ch || head.strides != cur.strides {
            return Err(HeadsError::Config(format!(
                "replace_head: the new head reads channels {:?} at strides {:?}, the neck gives {:?} at {:?}",
                head.ch, head.strides, cur.ch, cur.strides
            )));
        }
        head.set_training(self.training);
        let last = self.layers.last_mut().ok_or_else(|| HeadsError::Config("model without layers".into()))?;
        let old = match std::mem::replace(&mut last.kind, LayerKind::Pose(Box::new(head))) {
            LayerKind::Pose(h) => *h,
            _ => return Err(HeadsError::Config("the last layer was not the head".into())),
        };
        self.config.nc = self.head().nc;
        self.config.kpt_shape = self.head().kpt_shape;
        self.head_id = next_head_id();
        self.surfaces.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(old)
    }

    /// Replaces the head by a freshly initialised one for `nc` classes and `kpt_shape`
    /// keypoints (drawn from `seed`), returning the old head.
    pub fn rehead(&mut self, nc: usize, kpt_shape: (usize, usize), seed: u64) -> Result<Pose26> {
        let (ch, strides) = (self.head().ch.clone(), self.head().strides.clone());
        let mut rng = Rng::new(seed);
        let head = Pose26::new(nc, kpt_shape, &ch, &strides, &mut Init { rng: &mut rng, device: self.device })?;
        self.replace_head(head)
    }

    /// The `Pose26` head.
    pub fn head(&self) -> &Pose26 {
        match self.layers.last().map(|l| &l.kind) {
            Some(LayerKind::Pose(h)) => h,
            _ => unreachable!("PoseModel always ends with the Pose26 head"),
        }
    }

    /// Whether the model is in training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// Stores the trunk's and neck's activations channels-last (N, H, W, C: cuDNN's own layout on
    /// a GPU, no conversions around its convolutions) or contiguous (the default). The input is
    /// converted once; a layer whose output comes back in the other order (C2PSA's attention
    /// reshapes) is converted after it. Values are the same up to the kernels' summation orders;
    /// parameters, state dicts and outputs' shapes do not change.
    pub fn set_activation_format(&mut self, format: MemoryFormat) {
        self.activations = format;
    }

    /// The activations' storage order (see [`PoseModel::set_activation_format`]).
    pub fn activation_format(&self) -> MemoryFormat {
        self.activations
    }

    /// Number of parameter elements (3,679,464 for nc = 1 YOLO26n-pose).
    pub fn num_params(&self) -> usize {
        crate::nn::param_count(self)
    }

    /// Runs layers 0…22 and returns the three neck features (P3, P4, P5). `hook` sees every
    /// layer's output (index, tensor).
    pub fn forward_features_with(&self, x: &Tensor, hook: &mut dyn FnMut(usize, &Tensor)) -> Result<Vec<Tensor>> {
        if x.rank() != 4 || x.dims()[1] != 3 || x.dims()[2] % 32 != 0 || x.dims()[3] % 32 != 0 {
            return Err(HeadsError::input(
                "PoseModel::forward",
                format!("expected (B, 3, H, W) with H, W multiples of 32, got {:?}", x.dims()),
            ));
        }
        let mut kept: HashMap<usize, Tensor> = HashMap::new();
        let mut prev = x.to_memory_format(self.activations)?;
        for l in &self.layers {
            let input = |f: isize| -> Result<Tensor> {
                if f < 0 {
                    Ok(prev.clone())
                } else {
                    kept.get(&(f as usize))
                        .cloned()
                        .ok_or_else(|| HeadsError::Config(format!("layer {} reads missing output {f}", l.index)))
                }
            };
            // Names the layer's kernels in a kernel trace (`PTL_KERNEL_TRACE`); nothing otherwise.
            let _label = ptl_autograd::internal::stage::LabelGuard::new(LAYER_LABELS.get(l.index).copied().unwrap_or("layer"));
            let y = match &l.kind {
                LayerKind::Conv(m) => m.forward(&input(l.from[0])?)?,
                LayerKind::C3k2(m) => m.forward(&input(l.from[0])?)?,
                LayerKind::Sppf(m) => m.forward(&input(l.from[0])?)?,
                LayerKind::C2Psa(m) => m.forward(&input(l.from[0])?)?,
                LayerKind::Upsample(fct) => crate::nn::upsample_nearest(&input(l.from[0])?, *fct)?,
                LayerKind::Concat => {
                    let ins = l.from.iter().map(|&f| input(f)).collect::<Result<Vec<_>>>()?;
                    let r: Vec<&Tensor> = ins.iter().collect();
                    Tensor::cat(&r, 1)?
                }
                LayerKind::Pose(_) => break,
            };
            // A no-op for an output already in the activations' order.
            let y = y.to_memory_format(self.activations)?;
            hook(l.index, &y);
            if self.save.contains(&l.index) {
                kept.insert(l.index, y.clone());
            }
            prev = y;
        }
        HEAD_FROM.iter().map(|i| kept.get(i).cloned().ok_or_else(|| HeadsError::Config(format!("neck output {i} missing")))).collect()
    }

    /// Layers 0…22: the three neck features (P3, P4, P5).
    pub fn forward_features(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.forward_features_with(x, &mut |_, _| {})
    }

    /// Full forward. Training mode: raw outputs of both branch sets (with sigma views); eval
    /// mode: the same without sigma views (see [`PoseModel::predict`] for decoding).
    pub fn forward(&self, x: &Tensor) -> Result<HeadOutput> {
        self.forward_with(x, &crate::pieces::NativeRunner)
    }

    /// Eval-style inference (call `set_training(false)` first for running BN statistics): the
    /// decoded o2m output plus the raw outputs of both branches and the anchors.
    pub fn predict(&self, x: &Tensor) -> Result<Prediction> {
        let raw = self.forward(x)?;
        let head = self.head();
        let (anchors, strides) = head.anchors(&raw.feats)?;
        let decoded = head.decode(&raw.one2many, &anchors, &strides, true)?;
        Ok(Prediction { decoded, raw, anchors, strides })
    }

    /// Loads a state dict (reference names). `strict`: every key must match, nothing extra.
    pub fn load_state_dict(&self, values: &HashMap<String, Tensor>, strict: bool) -> Result<()> {
        Ok(load_state_dict(self, values, strict)?)
    }

    /// Loads a safetensors checkpoint (e.g. the golden `weights.safetensors`), strictly.
    pub fn load_safetensors(&self, path: &Path) -> Result<()> {
        let values = ptl_autograd::module::load_safetensors(path, Device::Cpu)?;
        self.load_state_dict(&values, true)
    }

    /// Saves the state dict as safetensors (loadable by PyTorch with the same names).
    pub fn save_safetensors(&self, path: &Path) -> Result<()> {
        Ok(ptl_autograd::module::save_module(self, path)?)
    }

    /// All state-dict entries `(name, tensor, kind)` in reference order.
    pub fn state_dict(&self) -> Vec<(String, Tensor, TensorKind)> {
        state_dict(self)
    }

    /// The input dtype the model computes in (f32 master weights).
    pub fn dtype(&self) -> DType {
        DType::F32
    }
}

impl Module for PoseModel {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        let p = join_name(prefix, "model");
        for l in &self.layers {
            if let Some(m) = l.kind.as_module() {
                m.visit(&join_name(&p, &l.index.to_string()), f);
            }
        }
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
        for l in &mut self.layers {
            if let Some(m) = l.kind.as_module_mut() {
                m.set_training(training);
            }
        }
    }
}

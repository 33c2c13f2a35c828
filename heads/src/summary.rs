//! A model summary computed from the model itself: one row per layer (index, from, repeats,
//! parameters, module type, resolved arguments, output shape for a square input), the 18 head
//! stems with their parameter counts, totals, and convolution compute.

use std::fmt;

use ptl_autograd::{Module, TensorKind};

use crate::head::{Branch, Pose26, StemKind};
use crate::model::{LayerKind, PoseModel};

/// One layer of the summary table.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRow {
    /// The layer's index.
    pub index: usize,
    /// `-1`, or a list such as `[-1, 6]`.
    pub from: String,
    /// Repeats after depth scaling.
    pub repeats: usize,
    /// Parameters of the layer.
    pub params: usize,
    /// Module type.
    pub module: String,
    /// Resolved constructor arguments.
    pub args: String,
    /// Output shape for batch 1 at the summary's image size (the head: decoded eval output).
    pub out_shape: Vec<usize>,
    /// Convolution multiply–accumulates of this layer at that image size.
    pub conv_macs: u64,
}

/// One head stem (or view) of the summary.
#[derive(Clone, Debug, PartialEq)]
pub struct StemRow {
    /// Its branch set.
    pub branch: Branch,
    /// Its pyramid level (0 = P3).
    pub level: usize,
    /// `box`, `class`, `point`, `kpt view`, `sigma view`.
    pub kind: String,
    /// State-dict prefix, e.g. `model.23.one2one_cv4.1`.
    pub name: String,
    /// Parameters of the stem or view.
    pub params: usize,
    /// Output channels.
    pub out_channels: usize,
}

/// The whole summary; `Display` renders it as a table.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSummary {
    /// The model's name (e.g. `yolo26n-pose`).
    pub name: String,
    /// The image size the shapes are for.
    pub imgsz: usize,
    /// One row per layer.
    pub layers: Vec<LayerRow>,
    /// One row per head stem and view.
    pub stems: Vec<StemRow>,
    /// Parameter elements in all.
    pub num_params: usize,
    /// Parameter tensors.
    pub num_parameter_tensors: usize,
    /// Buffer tensors (BN statistics, counters, flow masks).
    pub num_buffers: usize,
    /// Total convolution MACs (both branch sets, sigma views; flow excluded).
    pub conv_macs: u64,
    /// Parameters of the deployed graph (one branch set, no sigma views, no flow, BN folded).
    pub deploy_params: usize,
}

fn count(m: &dyn Module, prefix: &str) -> (usize, usize, usize) {
    let (mut n, mut t, mut b) = (0, 0, 0);
    m.visit(prefix, &mut |_, x, k| match k {
        TensorKind::Parameter => {
            n += x.numel();
            t += 1;
        }
        TensorKind::Buffer => b += 1,
    });
    (n, t, b)
}

/// Convolution MACs of a module whose convs all produce `hw` output positions.
fn conv_macs(m: &dyn Module, hw: usize) -> u64 {
    let mut macs = 0u64;
    m.visit("", &mut |name, t, k| {
        if k == TensorKind::Parameter && t.rank() == 4 && name.ends_with("weight") {
            macs += (t.numel() * hw) as u64;
        }
    });
    macs
}

fn head_macs(head: &Pose26, imgsz: usize) -> u64 {
    let mut macs = 0;
    for b in Branch::ALL {
        for (l, &s) in head.strides.iter().enumerate() {
            let side = imgsz / s as usize;
            let hw = side * side;
            for k in StemKind::ALL {
                if let Some(stem) = head.stem(b, l, k) {
                    stem.visit("", &mut |name, t, kind| {
                        if kind == TensorKind::Parameter && t.rank() == 4 && name.ends_with("weight") {
                            macs += (t.numel() * hw) as u64;
                        }
                    });
                }
            }
            for v in [head.kpt_view(b, l), head.sigma_view(b, l)].into_iter().flatten() {
                macs += conv_macs(v, hw);
            }
        }
    }
    macs
}

impl ModelSummary {
    /// Summarises `model` for a square `imgsz` input (a multiple of 32).
    pub fn new(model: &PoseModel, imgsz: usize) -> Self {
        let cfg = model.config;
        let head = model.head();
        let anchors: usize = head.strides.iter().map(|&s| (imgsz / s as usize).pow(2)).sum();
        let mut layers = Vec::new();
        for l in model.layers() {
            let from = if l.from.len() == 1 { l.from[0].to_string() } else { format!("{:?}", l.from) };
            let (params, macs, shape) = match &l.kind {
                LayerKind::Pose(h) => {
                    (count(h.as_ref(), "").0, head_macs(h, imgsz), vec![1, 4 + cfg.nc + cfg.kpt_shape.0 * cfg.kpt_shape.1, anchors])
                }
                _ => {
                    let side = imgsz / l.stride;
                    let (p, m) = match &l.kind {
                        LayerKind::Conv(m) => (count(m, "").0, conv_macs(m, side * side)),
                        LayerKind::C3k2(m) => (count(m, "").0, conv_macs(m, side * side)),
                        LayerKind::Sppf(m) => (count(m, "").0, conv_macs(m, side * side)),
                        LayerKind::C2Psa(m) => (count(m, "").0, conv_macs(m, side * side)),
                        _ => (0, 0),
                    };
                    (p, m, vec![1, l.c_out, side, side])
                }
            };
            layers.push(LayerRow {
                index: l.index,
                from,
                repeats: l.repeats,
                params,
                module: l.kind.type_name().to_string(),
                args: l.args.clone(),
                out_shape: shape,
                conv_macs: macs,
            });
        }
        let mut stems = Vec::new();
        for b in Branch::ALL {
            for l in 0..head.num_levels() {
                for k in StemKind::ALL {
                    if let Some(s) = head.stem(b, l, k) {
                        let name = format!("model.23.{}", Pose26::stem_name(b, l, k));
                        let mut p = 0;
                        s.visit("", &mut |_, t, kind| {
                            if kind == TensorKind::Parameter {
                                p += t.numel()
                            }
                        });
                        let (kind, out) = match k {
                            StemKind::Box => ("box", 4 * head.reg_max),
                            StemKind::Class => ("class", head.nc),
                            StemKind::Point => ("point", head.widths.c4),
                        };
                        stems.push(StemRow { branch: b, level: l, kind: kind.into(), name, params: p, out_channels: out });
                    }
                }
                for (kind, attr, view, out) in [
                    ("kpt view", "cv4_kpts", head.kpt_view(b, l), head.nk()),
                    ("sigma view", "cv4_sigma", head.sigma_view(b, l), head.nk_sigma()),
                ] {
                    if let Some(v) = view {
                        let name = format!("model.23.{}{attr}.{l}", b.attr_prefix());
                        stems.push(StemRow { branch: b, level: l, kind: kind.into(), name, params: count(v, "").0, out_channels: out });
                    }
                }
            }
        }
        let (num_params, num_parameter_tensors, num_buffers) = count(model, "");
        // Deployed graph: drop the o2o set, the sigma views and the flow; fold BN into the convs
        // (BN γ/β become conv biases, and stems that already have a bias keep one).
        let o2o: usize = stems.iter().filter(|s| s.branch == Branch::OneToOne).map(|s| s.params).sum();
        let sigma: usize = stems.iter().filter(|s| s.branch == Branch::OneToMany && s.kind == "sigma view").map(|s| s.params).sum();
        let mut bn_params = 0;
        model.visit("", &mut |name, t, k| {
            if k == TensorKind::Parameter && name.contains(".bn.") && !name.contains("one2one_") {
                bn_params += t.numel();
            }
        });
        let deploy_params = num_params - o2o - sigma - head.flow_model.num_params() - bn_params / 2;
        let scale = cfg.scale.letter();
        ModelSummary {
            name: format!("yolo26{scale}-pose"),
            imgsz,
            conv_macs: layers.iter().map(|l| l.conv_macs).sum(),
            layers,
            stems,
            num_params,
            num_parameter_tensors,
            num_buffers,
            deploy_params,
        }
    }

    /// 2 × convolution MACs, in G (convolutions only; thop also counts BN and reports slightly more).
    pub fn conv_gflops(&self) -> f64 {
        2.0 * self.conv_macs as f64 / 1e9
    }
}

fn fmt_shape(s: &[usize]) -> String {
    format!("({})", s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl fmt::Display for ModelSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} summary at {}x{}", self.name, self.imgsz, self.imgsz)?;
        writeln!(f, "{:>3}  {:>14}  {:>2}  {:>10}  {:<9}  {:<34}  output", "#", "from", "n", "params", "module", "arguments")?;
        for l in &self.layers {
            writeln!(
                f,
                "{:>3}  {:>14}  {:>2}  {:>10}  {:<9}  {:<34}  {}",
                l.index,
                l.from,
                l.repeats,
                thousands(l.params),
                l.module,
                l.args,
                fmt_shape(&l.out_shape)
            )?;
        }
        writeln!(f)?;
        writeln!(f, "head stems ({} modules)", self.stems.len())?;
        writeln!(f, "{:<9}  {:>5}  {:<10}  {:<28}  {:>8}   out", "branch", "level", "kind", "name", "params")?;
        for s in &self.stems {
            writeln!(
                f,
                "{:<9}  {:>5}  {:<10}  {:<28}  {:>8}  {:>4}",
                s.branch.name(),
                s.level,
                s.kind,
                s.name,
                thousands(s.params),
                s.out_channels
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "{} layers, {} parameters ({} tensors), {} buffers, {:.2} conv GFLOPs (2 x {:.3} GMAC)",
            self.layers.len(),
            thousands(self.num_params),
            self.num_parameter_tensors,
            self.num_buffers,
            self.conv_gflops(),
            self.conv_macs as f64 / 1e9
        )?;
        write!(f, "deployed graph (o2m only, no sigma views/flow, BN folded): {} parameters", thousands(self.deploy_params))
    }
}

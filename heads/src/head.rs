//! The `Pose26` head (docs/model.md §4): for each of the 3 levels a box stem (`cv2`), a class stem
//! (`cv3`) and a point stem (`cv4`) with its keypoint view (`cv4_kpts`) and uncertainty view
//! (`cv4_sigma`), all twice (one-to-many and `one2one_*`), plus the RealNVP flow.
//!
//! Every stem is its own module with its own parameters, addressable by
//! `(Branch, level, StemKind)` through [`Pose26::stem`], and callable on its own.

use ptl_autograd::impl_module;
use ptl_autograd::module::join_name;
use ptl_autograd::{DType, Module, Tensor, TensorKind};

use crate::decode::{decode_predictions, make_anchors};
use crate::flow::RealNvp;
use crate::nn::{Conv, Conv2d, Init};
use crate::{HeadsError, Result};

/// Which branch set of the end-to-end head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Branch {
    /// Trained with top-10 assignment; default inference path (with NMS).
    OneToMany,
    /// Trained with top-1 assignment on detached features; the NMS-free path.
    OneToOne,
}

impl Branch {
    /// Both branch sets, o2m first.
    pub const ALL: [Branch; 2] = [Branch::OneToMany, Branch::OneToOne];
    /// Attribute prefix of this branch's modules (`""` or `"one2one_"`).
    pub fn attr_prefix(self) -> &'static str {
        match self {
            Branch::OneToMany => "",
            Branch::OneToOne => "one2one_",
        }
    }
    /// Name used in golden files and logs (`one2many` / `one2one`).
    pub fn name(self) -> &'static str {
        match self {
            Branch::OneToMany => "one2many",
            Branch::OneToOne => "one2one",
        }
    }
}

/// The three stem kinds of a level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StemKind {
    /// Box stem: 4 side distances.
    Box,
    /// Class stem: nc logits.
    Class,
    /// Point stem with its keypoint and sigma views.
    Point,
}

impl StemKind {
    /// The three kinds in state-dict order (`cv2`, `cv3`, `cv4`).
    pub const ALL: [StemKind; 3] = [StemKind::Box, StemKind::Class, StemKind::Point];
    /// Reference attribute name (`cv2`, `cv3`, `cv4`).
    pub fn attr(self) -> &'static str {
        match self {
            StemKind::Box => "cv2",
            StemKind::Class => "cv3",
            StemKind::Point => "cv4",
        }
    }
}

/// Box stem `cv2[i]`: `Conv(x→c2, 3) → Conv(c2→c2, 3) → Conv2d(c2→4·reg_max, 1, bias)`.
pub struct BoxStem {
    /// First 3×3 Conv.
    pub conv0: Conv,
    /// Second 3×3 Conv.
    pub conv1: Conv,
    /// 1×1 projection to the 4 distances (with bias).
    pub pred: Conv2d,
}

impl BoxStem {
    fn new(c_in: usize, c2: usize, out: usize, init: &mut Init<'_>) -> Result<Self> {
        Ok(BoxStem {
            conv0: Conv::silu(c_in, c2, 3, 1, init)?,
            conv1: Conv::silu(c2, c2, 3, 1, init)?,
            pred: Conv2d::new(c2, out, 1, 1, 1, true, init)?,
        })
    }
    /// `(B, x_i, H, W)` → `(B, 4, H, W)` ltrb distances in grid units.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.pred.forward(&self.conv1.forward(&self.conv0.forward(x)?)?)
    }
}

impl_module!(BoxStem { "0" => one conv0, "1" => one conv1, "2" => one pred });

/// Class stem `cv3[i]`: `[DWConv(x→x, 3) → Conv(x→c3, 1)] → [DWConv(c3→c3, 3) → Conv(c3→c3, 1)]
/// → Conv2d(c3→nc, 1, bias)`.
pub struct ClassStem {
    /// First depthwise 3×3 Conv.
    pub dw0: Conv,
    /// First pointwise 1×1 Conv.
    pub pw0: Conv,
    /// Second depthwise 3×3 Conv.
    pub dw1: Conv,
    /// Second pointwise 1×1 Conv.
    pub pw1: Conv,
    /// 1×1 projection to the class logits (with bias).
    pub pred: Conv2d,
}

impl ClassStem {
    fn new(c_in: usize, c3: usize, nc: usize, init: &mut Init<'_>) -> Result<Self> {
        Ok(ClassStem {
            dw0: Conv::dw(c_in, c_in, 3, init)?,
            pw0: Conv::silu(c_in, c3, 1, 1, init)?,
            dw1: Conv::dw(c3, c3, 3, init)?,
            pw1: Conv::silu(c3, c3, 1, 1, init)?,
            pred: Conv2d::new(c3, nc, 1, 1, 1, true, init)?,
        })
    }
    /// `(B, x_i, H, W)` → `(B, nc, H, W)` class logits.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.pw0.forward(&self.dw0.forward(x)?)?;
        let y = self.pw1.forward(&self.dw1.forward(&y)?)?;
        self.pred.forward(&y)
    }
}

impl_module!(ClassStem { "0.0" => one dw0, "0.1" => one pw0, "1.0" => one dw1, "1.1" => one pw1, "2" => one pred });

/// Point stem `cv4[i]`: `Conv(x→c4, 3) → Conv(c4→c4, 3)`; its output feeds the keypoint view
/// (`cv4_kpts[i]`) and the uncertainty view (`cv4_sigma[i]`).
pub struct PointStem {
    /// First 3×3 Conv.
    pub conv0: Conv,
    /// Second 3×3 Conv (its output feeds both views).
    pub conv1: Conv,
}

impl PointStem {
    fn new(c_in: usize, c4: usize, init: &mut Init<'_>) -> Result<Self> {
        Ok(PointStem { conv0: Conv::silu(c_in, c4, 3, 1, init)?, conv1: Conv::silu(c4, c4, 3, 1, init)? })
    }
    /// `(B, x_i, H, W)` → `(B, c4, H, W)` point features (85 channels for 17×3 keypoints).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv1.forward(&self.conv0.forward(x)?)
    }
}

impl_module!(PointStem { "0" => one conv0, "1" => one conv1 });

/// A borrowed stem of any kind, with a uniform `forward`.
#[derive(Clone, Copy)]
pub enum StemRef<'a> {
    /// A box stem.
    Box(&'a BoxStem),
    /// A class stem.
    Class(&'a ClassStem),
    /// A point stem.
    Point(&'a PointStem),
}

impl StemRef<'_> {
    /// Runs the stem alone: box → 4 ch, class → nc ch, point → c4 (85) feature channels.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            StemRef::Box(s) => s.forward(x),
            StemRef::Class(s) => s.forward(x),
            StemRef::Point(s) => s.forward(x),
        }
    }
    /// Which kind of stem it is.
    pub fn kind(&self) -> StemKind {
        match self {
            StemRef::Box(_) => StemKind::Box,
            StemRef::Class(_) => StemKind::Class,
            StemRef::Point(_) => StemKind::Point,
        }
    }
    /// The stem's own parameters and buffers, names relative to the stem.
    pub fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        match self {
            StemRef::Box(s) => s.visit(prefix, f),
            StemRef::Class(s) => s.visit(prefix, f),
            StemRef::Point(s) => s.visit(prefix, f),
        }
    }
}

/// One complete branch set (one-to-many or one-to-one): 3 levels × (box, class, point) stems
/// and the two 1×1 views per level.
pub struct BranchSet {
    /// Box stems, one per level (P3, P4, P5).
    pub box_stems: Vec<BoxStem>,
    /// Class stems, one per level.
    pub class_stems: Vec<ClassStem>,
    /// Point stems, one per level.
    pub point_stems: Vec<PointStem>,
    /// `cv4_kpts[i]`: Conv2d(c4 → K·D, 1, bias).
    pub kpt_views: Vec<Conv2d>,
    /// `cv4_sigma[i]`: Conv2d(c4 → 2K, 1, bias).
    pub sigma_views: Vec<Conv2d>,
}

/// Head widths derived from the input channels (docs/model.md §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadWidths {
    /// Box stems' width.
    pub c2: usize,
    /// Class stems' width.
    pub c3: usize,
    /// Point stems' width.
    pub c4: usize,
}

impl HeadWidths {
    /// The stems' widths for input channels `ch`, `nc` classes and `kpt_shape` (docs/model.md §4).
    pub fn new(ch: &[usize], nc: usize, kpt_shape: (usize, usize), reg_max: usize) -> Self {
        let x0 = ch.first().copied().unwrap_or(0);
        HeadWidths { c2: 16.max(x0 / 4).max(reg_max * 4), c3: x0.max(nc.min(100)), c4: (x0 / 4).max(kpt_shape.0 * (kpt_shape.1 + 2)) }
    }
}

impl BranchSet {
    fn new_box_cls(ch: &[usize], w: HeadWidths, nc: usize, reg_max: usize, init: &mut Init<'_>) -> Result<(Vec<BoxStem>, Vec<ClassStem>)> {
        let b = ch.iter().map(|&x| BoxStem::new(x, w.c2, 4 * reg_max, init)).collect::<Result<Vec<_>>>()?;
        let c = ch.iter().map(|&x| ClassStem::new(x, w.c3, nc, init)).collect::<Result<Vec<_>>>()?;
        Ok((b, c))
    }
    #[allow(clippy::type_complexity)]
    fn new_point(
        ch: &[usize],
        w: HeadWidths,
        kpt_shape: (usize, usize),
        init: &mut Init<'_>,
    ) -> Result<(Vec<PointStem>, Vec<Conv2d>, Vec<Conv2d>)> {
        let p = ch.iter().map(|&x| PointStem::new(x, w.c4, init)).collect::<Result<Vec<_>>>()?;
        let k = ch.iter().map(|_| Conv2d::new(w.c4, kpt_shape.0 * kpt_shape.1, 1, 1, 1, true, init)).collect::<Result<Vec<_>>>()?;
        let s = ch.iter().map(|_| Conv2d::new(w.c4, kpt_shape.0 * 2, 1, 1, 1, true, init)).collect::<Result<Vec<_>>>()?;
        Ok((p, k, s))
    }

    fn set_training(&mut self, t: bool) {
        self.box_stems.iter_mut().for_each(|s| s.set_training(t));
        self.class_stems.iter_mut().for_each(|s| s.set_training(t));
        self.point_stems.iter_mut().for_each(|s| s.set_training(t));
    }
}

/// Raw outputs of one branch set, in the reference's native layout (levels concatenated P3, P4,
/// P5 along the anchor axis, row-major inside a level).
#[derive(Clone, Debug)]
pub struct BranchOutput {
    /// `(B, 4, A)` ltrb distances in grid units.
    pub boxes: Tensor,
    /// `(B, nc, A)` class logits.
    pub scores: Tensor,
    /// `(B, K·D, A)`: channel 3k+0/1 = x/y offset (grid units), 3k+2 = visibility logit.
    pub kpts: Tensor,
    /// `(B, 2K, A)` σx/σy logits; present in training mode only.
    pub kpts_sigma: Option<Tensor>,
}

/// The head's forward result: both branch sets and the features they saw.
#[derive(Clone, Debug)]
pub struct HeadOutput {
    /// The one-to-many branch's outputs.
    pub one2many: BranchOutput,
    /// The one-to-one branch's outputs.
    pub one2one: BranchOutput,
    /// The three neck feature maps fed to the head (the o2o set received detached copies).
    pub feats: Vec<Tensor>,
}

impl HeadOutput {
    /// The outputs of branch `b`.
    pub fn branch(&self, b: Branch) -> &BranchOutput {
        match b {
            Branch::OneToMany => &self.one2many,
            Branch::OneToOne => &self.one2one,
        }
    }
}

/// `Pose26` (reg_max = 1, end-to-end).
pub struct Pose26 {
    /// Number of classes.
    pub nc: usize,
    /// Keypoints and values per keypoint.
    pub kpt_shape: (usize, usize),
    /// Box bins per side (1: no DFL).
    pub reg_max: usize,
    /// Input channels per level.
    pub ch: Vec<usize>,
    /// Stride of each level (8, 16, 32).
    pub strides: Vec<f64>,
    /// The stems' widths.
    pub widths: HeadWidths,
    /// The one-to-many stems.
    pub one2many: BranchSet,
    /// The one-to-one stems (copies at construction).
    pub one2one: BranchSet,
    /// The RealNVP flow of the RLE loss, shared by both sets.
    pub flow_model: RealNvp,
    /// Training mode (sigma views evaluated).
    pub training: bool,
}

impl Pose26 {
    /// Builds the head; the one-to-one set starts with weights identical to the one-to-many set
    /// (the reference deep-copies it), then the head bias init (§6) is applied to both.
    pub fn new(nc: usize, kpt_shape: (usize, usize), ch: &[usize], strides: &[f64], init: &mut Init<'_>) -> Result<Self> {
        if ch.len() != strides.len() || ch.is_empty() {
            return Err(HeadsError::Config(format!("Pose26: {} input levels but {} strides", ch.len(), strides.len())));
        }
        if nc == 0 || kpt_shape.0 == 0 || !(kpt_shape.1 == 2 || kpt_shape.1 == 3) {
            return Err(HeadsError::Config(format!("Pose26: nc {nc} and kpt_shape {kpt_shape:?} (need nc ≥ 1, K ≥ 1, D ∈ {{2, 3}})")));
        }
        let reg_max = 1;
        let w = HeadWidths::new(ch, nc, kpt_shape, reg_max);
        // Box/class stems, then their one-to-one copies drawn from the same stream position.
        let snap = init.rng.clone();
        let (b_m, c_m) = BranchSet::new_box_cls(ch, w, nc, reg_max, init)?;
        let mut rng2 = snap;
        let (b_o, c_o) = BranchSet::new_box_cls(ch, w, nc, reg_max, &mut Init { rng: &mut rng2, device: init.device })?;
        let snap = init.rng.clone();
        let (p_m, k_m, s_m) = BranchSet::new_point(ch, w, kpt_shape, init)?;
        let mut rng3 = snap;
        let (p_o, k_o, s_o) = BranchSet::new_point(ch, w, kpt_shape, &mut Init { rng: &mut rng3, device: init.device })?;
        let flow_model = RealNvp::new(init)?;
        let head = Pose26 {
            nc,
            kpt_shape,
            reg_max,
            ch: ch.to_vec(),
            strides: strides.to_vec(),
            widths: w,
            one2many: BranchSet { box_stems: b_m, class_stems: c_m, point_stems: p_m, kpt_views: k_m, sigma_views: s_m },
            one2one: BranchSet { box_stems: b_o, class_stems: c_o, point_stems: p_o, kpt_views: k_o, sigma_views: s_o },
            flow_model,
            training: true,
        };
        head.bias_init()?;
        Ok(head)
    }

    /// Head bias init (§6), both sets: box bias 2.0, class bias `ln(5 / nc / (640 / s)²)`.
    pub fn bias_init(&self) -> Result<()> {
        for set in [&self.one2many, &self.one2one] {
            for s in &set.box_stems {
                if let Some(b) = &s.pred.bias {
                    ptl_autograd::no_grad(|| b.copy_(&b.full_like(2.0)?))?;
                }
            }
            for (s, &st) in set.class_stems.iter().zip(&self.strides) {
                if let Some(b) = &s.pred.bias {
                    let v = (5.0 / self.nc as f64 / (640.0 / st).powi(2)).ln();
                    ptl_autograd::no_grad(|| b.copy_(&b.full_like(v)?))?;
                }
            }
        }
        Ok(())
    }

    /// Pyramid levels the head reads (3).
    pub fn num_levels(&self) -> usize {
        self.ch.len()
    }
    /// Number of keypoint-view channels K·D (51).
    pub fn nk(&self) -> usize {
        self.kpt_shape.0 * self.kpt_shape.1
    }
    /// Number of sigma-view channels 2K (34).
    pub fn nk_sigma(&self) -> usize {
        self.kpt_shape.0 * 2
    }

    /// The stems of `branch`.
    pub fn set(&self, branch: Branch) -> &BranchSet {
        match branch {
            Branch::OneToMany => &self.one2many,
            Branch::OneToOne => &self.one2one,
        }
    }

    /// The stem `(branch, level, kind)`; `None` when `level` is out of range.
    pub fn stem(&self, branch: Branch, level: usize, kind: StemKind) -> Option<StemRef<'_>> {
        let s = self.set(branch);
        match kind {
            StemKind::Box => s.box_stems.get(level).map(StemRef::Box),
            StemKind::Class => s.class_stems.get(level).map(StemRef::Class),
            StemKind::Point => s.point_stems.get(level).map(StemRef::Point),
        }
    }

    /// All 18 stems in (branch, level, kind) order.
    pub fn stems(&self) -> Vec<(Branch, usize, StemKind, StemRef<'_>)> {
        let mut v = Vec::new();
        for b in Branch::ALL {
            for l in 0..self.num_levels() {
                for k in StemKind::ALL {
                    if let Some(s) = self.stem(b, l, k) {
                        v.push((b, l, k, s));
                    }
                }
            }
        }
        v
    }

    /// State-dict prefix of a stem relative to the head, e.g. `one2one_cv3.2`.
    pub fn stem_name(branch: Branch, level: usize, kind: StemKind) -> String {
        format!("{}{}.{}", branch.attr_prefix(), kind.attr(), level)
    }

    /// Keypoint view `cv4_kpts[level]` of a branch.
    pub fn kpt_view(&self, branch: Branch, level: usize) -> Option<&Conv2d> {
        self.set(branch).kpt_views.get(level)
    }
    /// Uncertainty view `cv4_sigma[level]` of a branch.
    pub fn sigma_view(&self, branch: Branch, level: usize) -> Option<&Conv2d> {
        self.set(branch).sigma_views.get(level)
    }

    pub(crate) fn check_feats(&self, feats: &[Tensor]) -> Result<()> {
        if feats.len() != self.num_levels() {
            return Err(HeadsError::input("Pose26::forward", format!("expected {} feature maps, got {}", self.num_levels(), feats.len())));
        }
        for (i, (f, &c)) in feats.iter().zip(&self.ch).enumerate() {
            if f.rank() != 4 || f.dims()[1] != c || f.dims()[0] != feats[0].dims()[0] {
                return Err(HeadsError::input("Pose26::forward", format!("level {i}: expected (B, {c}, H, W), got {:?}", f.dims())));
            }
        }
        Ok(())
    }

    /// Runs one branch set on `feats`: every stem, the keypoint views and (when `with_sigma`) the
    /// sigma views; flattened per level and concatenated over levels.
    pub fn forward_branch(&self, branch: Branch, feats: &[Tensor], with_sigma: bool) -> Result<BranchOutput> {
        self.forward_branch_with(branch, feats, with_sigma, &crate::pieces::NativeRunner)
    }

    /// Both branch sets; the one-to-one set receives detached features. Sigma views are
    /// evaluated in training mode only.
    pub fn forward(&self, feats: &[Tensor]) -> Result<HeadOutput> {
        self.forward_with(feats, &crate::pieces::NativeRunner)
    }

    /// Anchors `(A, 2)` and strides `(A, 1)` for these feature maps (f32, their device).
    pub fn anchors(&self, feats: &[Tensor]) -> Result<(Tensor, Tensor)> {
        self.check_feats(feats)?;
        let sizes: Vec<(usize, usize)> = feats.iter().map(|f| (f.dims()[2], f.dims()[3])).collect();
        make_anchors(&sizes, &self.strides, 0.5, DType::F32, feats[0].device())
    }

    /// Default inference output of a branch: `(B, 4 + nc + K·D, A)` with (cx, cy, w, h) px when
    /// `xywh` (the o2m/NMS path), else (x1, y1, x2, y2) px.
    pub fn decode(&self, out: &BranchOutput, anchors: &Tensor, strides: &Tensor, xywh: bool) -> Result<Tensor> {
        decode_predictions(&out.boxes, &out.scores, &out.kpts, anchors, strides, self.kpt_shape, xywh)
    }
}

impl Module for Pose26 {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        // Reference registration order: cv2, cv3, one2one_cv2, one2one_cv3, cv4, one2one_cv4,
        // flow_model, cv4_kpts, cv4_sigma, one2one_cv4_kpts, one2one_cv4_sigma.
        let seq = |name: String, items: &[&dyn Module], f: &mut dyn FnMut(&str, &Tensor, TensorKind)| {
            let p = join_name(prefix, &name);
            for (i, m) in items.iter().enumerate() {
                m.visit(&join_name(&p, &i.to_string()), f);
            }
        };
        for (b, kind) in [
            (Branch::OneToMany, StemKind::Box),
            (Branch::OneToMany, StemKind::Class),
            (Branch::OneToOne, StemKind::Box),
            (Branch::OneToOne, StemKind::Class),
            (Branch::OneToMany, StemKind::Point),
            (Branch::OneToOne, StemKind::Point),
        ] {
            let set = self.set(b);
            let items: Vec<&dyn Module> = match kind {
                StemKind::Box => set.box_stems.iter().map(|s| s as &dyn Module).collect(),
                StemKind::Class => set.class_stems.iter().map(|s| s as &dyn Module).collect(),
                StemKind::Point => set.point_stems.iter().map(|s| s as &dyn Module).collect(),
            };
            seq(format!("{}{}", b.attr_prefix(), kind.attr()), &items, f);
        }
        self.flow_model.visit(&join_name(prefix, "flow_model"), f);
        for b in Branch::ALL {
            let set = self.set(b);
            let k: Vec<&dyn Module> = set.kpt_views.iter().map(|s| s as &dyn Module).collect();
            seq(format!("{}cv4_kpts", b.attr_prefix()), &k, f);
            let s: Vec<&dyn Module> = set.sigma_views.iter().map(|s| s as &dyn Module).collect();
            seq(format!("{}cv4_sigma", b.attr_prefix()), &s, f);
        }
    }
    fn set_training(&mut self, t: bool) {
        self.training = t;
        self.one2many.set_training(t);
        self.one2one.set_training(t);
    }
}

//! The replayable pieces of the model and the runner that executes them.
//!
//! A forward pass is the trunk (backbone + neck: image → three features) followed by the 18 head
//! stems (3 levels × box/class/point × one-to-many/one-to-one). Each piece is handed to a
//! [`PieceRunner`] together with its inputs and its body; the default [`NativeRunner`] runs the
//! body at once, a replay strategy may record it and replay it instead. This crate knows nothing
//! of recorders: it only names the pieces, says which parameters and buffers each one reads
//! ([`PoseModel::piece_surface`]) and keeps everything between pieces (concatenation over levels,
//! the detach of the one-to-one features) outside them, in native order.
//!
//! Piece bodies (outputs flattened to `(B, C, H·W)` inside the piece, so no eager op runs
//! between a point stem and its views):
//! - trunk: `[image]` → `[P3, P4, P5]`;
//! - box stem: `[feature]` → `[boxes (B, 4, N)]`; class stem: `[feature]` → `[scores (B, nc, N)]`;
//! - point stem: `[feature]` → `[keypoints (B, K·D, N)]`, plus `[sigma (B, 2K, N)]` in training.

use ptl_autograd::{Module, Tensor, TensorKind};

use crate::head::{Branch, BranchOutput, HeadOutput, Pose26, StemKind};
use crate::model::PoseModel;
use crate::Result;

/// One replayable piece of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Piece {
    /// Backbone + neck: the image to the three neck features.
    Trunk,
    /// One head stem (a point stem includes its keypoint and uncertainty views).
    Stem {
        /// Its branch set.
        branch: Branch,
        /// Its pyramid level (0 = P3).
        level: usize,
        /// Box, class or point.
        kind: StemKind,
    },
}

impl Piece {
    /// Stable name, e.g. `trunk`, `stem.one2one_cv4.2` (the stem's state-dict prefix).
    pub fn name(&self) -> String {
        match self {
            Piece::Trunk => "trunk".into(),
            Piece::Stem { branch, level, kind } => format!("stem.{}", Pose26::stem_name(*branch, *level, *kind)),
        }
    }

    /// The trunk and the 18 stems of a head with `levels` levels, in execution order.
    pub fn all(levels: usize) -> Vec<Piece> {
        let mut v = vec![Piece::Trunk];
        for branch in Branch::ALL {
            for level in 0..levels {
                for kind in StemKind::ALL {
                    v.push(Piece::Stem { branch, level, kind });
                }
            }
        }
        v
    }
}

impl std::fmt::Display for Piece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// What a piece reads: `(state-dict name, tensor, kind)` in a stable order, shared.
pub type PieceSurface = std::sync::Arc<[(String, Tensor, TensorKind)]>;

/// The body of a piece: its inputs to its outputs, over the live model.
pub type PieceBody<'a> = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + 'a;

/// Executes pieces. A runner must return exactly what `body(inputs)` returns (same values, same
/// autograd behaviour) — natively, or by replaying a recording of it.
pub trait PieceRunner {
    /// Runs `piece` on `inputs`: `body(inputs)` natively, or a replay of its recording.
    fn run(&self, piece: Piece, inputs: &[Tensor], body: &PieceBody<'_>) -> Result<Vec<Tensor>>;

    /// Whether pieces may run beside each other (`ptl_autograd::streams::beside`): only a runner
    /// that runs every body as it is, on the thread's current stream.
    fn may_overlap(&self) -> bool {
        false
    }
}

/// Runs every piece at once (today's forward).
#[derive(Clone, Copy, Debug, Default)]
pub struct NativeRunner;

impl PieceRunner for NativeRunner {
    fn run(&self, _piece: Piece, inputs: &[Tensor], body: &PieceBody<'_>) -> Result<Vec<Tensor>> {
        body(inputs)
    }
    fn may_overlap(&self) -> bool {
        true
    }
}

/// The single input of `piece` (a runner could hand a body anything: a typed error, not a panic).
fn only_input(xs: &[Tensor], piece: Piece) -> Result<&Tensor> {
    match xs {
        [x] => Ok(x),
        _ => Err(crate::HeadsError::Config(format!("piece {piece} was given {} inputs, expected 1", xs.len()))),
    }
}

fn one(mut v: Vec<Tensor>, piece: Piece) -> Result<Tensor> {
    match v.len() {
        1 => Ok(v.remove(0)),
        n => Err(crate::HeadsError::Config(format!("piece {piece} returned {n} outputs, expected 1"))),
    }
}

impl Pose26 {
    /// [`Pose26::forward_branch`] with every stem run through `runner`.
    pub fn forward_branch_with(
        &self,
        branch: Branch,
        feats: &[Tensor],
        with_sigma: bool,
        runner: &dyn PieceRunner,
    ) -> Result<BranchOutput> {
        self.check_feats(feats)?;
        let set = self.set(branch);
        let b = feats[0].dims()[0];
        let flat = move |t: Tensor, c: usize| -> Result<Tensor> {
            let n = t.dims()[2] * t.dims()[3];
            Ok(t.reshape(vec![b, c, n])?)
        };
        let (nc, nbox, nk, nks) = (self.nc, 4 * self.reg_max, self.nk(), self.nk_sigma());
        let (mut boxes, mut scores, mut kpts, mut sigmas) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (level, x) in feats.iter().enumerate() {
            let piece = Piece::Stem { branch, level, kind: StemKind::Box };
            let body =
                |xs: &[Tensor]| -> Result<Vec<Tensor>> { Ok(vec![flat(set.box_stems[level].forward(only_input(xs, piece)?)?, nbox)?]) };
            boxes.push(one(runner.run(piece, std::slice::from_ref(x), &body)?, piece)?);
            let piece = Piece::Stem { branch, level, kind: StemKind::Class };
            let body =
                |xs: &[Tensor]| -> Result<Vec<Tensor>> { Ok(vec![flat(set.class_stems[level].forward(only_input(xs, piece)?)?, nc)?]) };
            scores.push(one(runner.run(piece, std::slice::from_ref(x), &body)?, piece)?);
            let piece = Piece::Stem { branch, level, kind: StemKind::Point };
            let body = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
                let p = set.point_stems[level].forward(only_input(xs, piece)?)?;
                let mut out = vec![flat(set.kpt_views[level].forward(&p)?, nk)?];
                if with_sigma {
                    out.push(flat(set.sigma_views[level].forward(&p)?, nks)?);
                }
                Ok(out)
            };
            let out = runner.run(piece, std::slice::from_ref(x), &body)?;
            let expected = 1 + with_sigma as usize;
            match <[Tensor; 2]>::try_from(out) {
                Ok([k, s]) if with_sigma => {
                    kpts.push(k);
                    sigmas.push(s);
                }
                Err(out) if !with_sigma && out.len() == 1 => kpts.extend(out),
                Ok(_) => return Err(crate::HeadsError::Config(format!("piece {piece} returned 2 outputs, expected 1"))),
                Err(out) => {
                    return Err(crate::HeadsError::Config(format!("piece {piece} returned {} outputs, expected {expected}", out.len())))
                }
            }
        }
        let cat = |v: &[Tensor]| -> Result<Tensor> {
            let r: Vec<&Tensor> = v.iter().collect();
            Ok(Tensor::cat(&r, 2)?)
        };
        Ok(BranchOutput {
            boxes: cat(&boxes)?,
            scores: cat(&scores)?,
            kpts: cat(&kpts)?,
            kpts_sigma: if with_sigma { Some(cat(&sigmas)?) } else { None },
        })
    }

    /// [`Pose26::forward`] with every stem run through `runner`.
    ///
    /// The one-to-one set reads detached features, so nothing of it (forward or backward) waits
    /// for the one-to-many set or feeds it: where the device runs work beside its main chain
    /// (`ptl_autograd::streams`) and the runner allows it, the one-to-one set goes there — queued
    /// first, so that it starts with the one-to-many set — and is joined before this returns.
    /// The same kernels on the same inputs either way: the bytes do not change.
    pub fn forward_with(&self, feats: &[Tensor], runner: &dyn PieceRunner) -> Result<HeadOutput> {
        let detached: Vec<Tensor> = feats.iter().map(|f| f.detach()).collect();
        let device = feats.first().map(Tensor::device);
        if let Some(device) = device.filter(|d| runner.may_overlap() && ptl_autograd::streams::overlapping(*d)) {
            let one2one =
                ptl_autograd::streams::beside(device, || self.forward_branch_with(Branch::OneToOne, &detached, self.training, runner))?;
            let one2many = self.forward_branch_with(Branch::OneToMany, feats, self.training, runner)?;
            ptl_autograd::streams::join()?;
            return Ok(HeadOutput { one2many, one2one, feats: feats.to_vec() });
        }
        let one2many = self.forward_branch_with(Branch::OneToMany, feats, self.training, runner)?;
        let one2one = self.forward_branch_with(Branch::OneToOne, &detached, self.training, runner)?;
        Ok(HeadOutput { one2many, one2one, feats: feats.to_vec() })
    }
}

impl PoseModel {
    /// [`PoseModel::forward`] with the trunk and every stem run through `runner`.
    pub fn forward_with(&self, x: &Tensor, runner: &dyn PieceRunner) -> Result<HeadOutput> {
        let body = |xs: &[Tensor]| self.forward_features(only_input(xs, Piece::Trunk)?);
        let feats = runner.run(Piece::Trunk, std::slice::from_ref(x), &body)?;
        if feats.len() != self.head().num_levels() {
            return Err(crate::HeadsError::Config(format!("piece trunk returned {} features", feats.len())));
        }
        self.head().forward_with(&feats, runner)
    }

    /// Freezes (`false`) or unfreezes (`true`) the parameters of `piece` in place: frozen
    /// parameters receive no gradient (absent, not zero) and the optimizer skips them.
    pub fn set_piece_trainable(&self, piece: Piece, trainable: bool) -> Result<()> {
        for (_, t, k) in self.piece_surface(piece).iter() {
            if *k == TensorKind::Parameter {
                t.set_requires_grad(trainable)?;
            }
        }
        Ok(())
    }

    /// The parameters and buffers `piece` reads, with their state-dict names, in a stable order
    /// (what a recorder fingerprints and snapshots). Built on first use and shared after that:
    /// the tensors are handles, so the entries see in-place updates (optimizer steps, loaded
    /// weights, freezing); replacing the head rebuilds them.
    pub fn piece_surface(&self, piece: Piece) -> PieceSurface {
        let mut cache = self.surfaces.lock().unwrap_or_else(|e| e.into_inner());
        cache.entry(piece).or_insert_with(|| self.build_piece_surface(piece).into()).clone()
    }

    fn build_piece_surface(&self, piece: Piece) -> Vec<(String, Tensor, TensorKind)> {
        let mut out = Vec::new();
        let mut push = |n: &str, t: &Tensor, k: TensorKind| out.push((n.to_string(), t.clone(), k));
        let head_index = self.layers().len() - 1;
        match piece {
            Piece::Trunk => {
                for l in &self.layers()[..head_index] {
                    if let Some(m) = l.kind.as_module() {
                        m.visit(&format!("model.{}", l.index), &mut push);
                    }
                }
            }
            Piece::Stem { branch, level, kind } => {
                let head = self.head();
                let prefix = format!("model.{head_index}.{}", Pose26::stem_name(branch, level, kind));
                if let Some(s) = head.stem(branch, level, kind) {
                    s.visit(&prefix, &mut push);
                }
                if kind == StemKind::Point {
                    let p = branch.attr_prefix();
                    if let Some(v) = head.kpt_view(branch, level) {
                        v.visit(&format!("model.{head_index}.{p}cv4_kpts.{level}"), &mut push);
                    }
                    if let Some(v) = head.sigma_view(branch, level) {
                        v.visit(&format!("model.{head_index}.{p}cv4_sigma.{level}"), &mut push);
                    }
                }
            }
        }
        out
    }
}

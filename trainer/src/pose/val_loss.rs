//! `val/` losses of results.csv: the training criterion on each validation batch's raw (eval-mode)
//! outputs, averaged over batches, as Ultralytics' validator adds `model.loss(batch, preds)[1]`.
//!
//! In eval mode the head emits no keypoint sigmas (Ultralytics' `Pose26` computes them only in
//! training), so `val/rle_loss` is 0 there too; the logged items are the o2o branch's, which do
//! not depend on the o2m/o2o mixing weights.

use ptl_autograd::{no_grad, Tensor};
use ptl_data::Batch;
use ptl_heads::{BranchOutput, HeadOutput};

use crate::loss::{Anchors, BranchOutputs, E2ELoss, LossConfig, TargetBatch};
use crate::Result;

/// Running sums of the six loss items over validation batches.
pub struct ValLoss {
    criterion: E2ELoss,
    sums: [f64; 6],
    batches: usize,
    anchors: Option<((usize, usize), Anchors)>,
}

/// The first `n` images of a branch's outputs (a GPU batch padded with blanks holds more).
fn first(b: &BranchOutput, n: usize) -> Result<BranchOutputs> {
    let take = |t: &Tensor| -> Result<Tensor> {
        match t.dims().first() {
            Some(&bs) if bs > n => Ok(t.narrow(0, 0, n)?),
            _ => Ok(t.clone()),
        }
    };
    Ok(BranchOutputs {
        boxes: take(&b.boxes)?,
        scores: take(&b.scores)?,
        kpts: take(&b.kpts)?,
        kpts_sigma: b.kpts_sigma.as_ref().map(take).transpose()?,
    })
}

impl ValLoss {
    /// A criterion with the run's gains; items are read every batch (no deferral).
    pub fn new(cfg: LossConfig) -> Self {
        let mut criterion = E2ELoss::new(cfg, 1);
        criterion.defer_items = false;
        ValLoss { criterion, sums: [0.0; 6], batches: 0, anchors: None }
    }

    /// Adds one batch: `raw` are the model's outputs for `b` (extra padded images ignored).
    pub fn add(&mut self, raw: &HeadOutput, b: &Batch) -> Result<()> {
        let hw = (b.shape[2], b.shape[3]);
        let anchors = match &self.anchors {
            Some((k, a)) if *k == hw => a.clone(),
            _ => {
                let a = Anchors::from_image_hw(hw, &ptl_heads::model::STRIDES)?;
                self.anchors = Some((hw, a.clone()));
                a
            }
        };
        let targets = TargetBatch {
            batch_idx: b.batch_idx.clone(),
            cls: b.cls.clone(),
            bboxes: b.bboxes.clone(),
            keypoints: b.keypoints.clone(),
            nkpt: b.nkpt,
        };
        let n = b.len();
        let (o2m, o2o) = (first(&raw.one2many, n)?, first(&raw.one2one, n)?);
        // A non-finite loss (a diverging model) is a value of the columns, as in Ultralytics, not a
        // reason to stop the fit: the training loop has its own recovery.
        let items = match no_grad(|| self.criterion.loss(&o2m, &o2o, &targets, &anchors, None)) {
            Ok(out) => out.items,
            Err(crate::TrainerError::NonFinite { .. }) => [f64::NAN; 6],
            Err(e) => return Err(e),
        };
        for (s, v) in self.sums.iter_mut().zip(items) {
            *s += v;
        }
        self.batches += 1;
        Ok(())
    }

    /// Mean items over the batches added (`[box, pose, kobj, cls, l1, rle]`; NaN without batches).
    pub fn means(&self) -> [f64; 6] {
        self.sums.map(|s| if self.batches == 0 { f64::NAN } else { s / self.batches as f64 })
    }
}

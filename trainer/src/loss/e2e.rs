//! The two-branch criterion (`E2ELoss`, docs/loss.md §4–§5): o2m (top-10) and o2o (top-7 → top-1)
//! branches with weights that move from 0.8/0.2 to 0.1/0.9 over training.

use ptl_autograd::{DType, Tensor};

use super::anchors::Anchors;
use super::assign_dense::DeviceTargets;
use super::branch::{items_of, BranchLoss, BranchOutputs, PoseLoss26};
use super::targets::TargetBatch;
use super::{FlowLogProb, LossConfig};
use crate::error::Result;

/// Output of one criterion call.
#[derive(Clone, Debug)]
pub struct LossOutput {
    /// The scalar to back-propagate: Σ (w_o2m · B·vec_o2m + w_o2o · B·vec_o2o).
    pub total: Tensor,
    /// The weighted 6-vector before the sum (differentiable).
    pub loss_vec: Tensor,
    /// Logged items: the o2o branch's gain-scaled terms `[box, pose, kobj, cls, l1, rle]`.
    pub items: [f64; 6],
    /// Per-branch results (o2m, o2o).
    pub one2many: BranchLoss,
    /// The o2o branch's result.
    pub one2one: BranchLoss,
    /// Weights used for this call.
    pub w_o2m: f64,
    /// The o2o branch's weight.
    pub w_o2o: f64,
    /// With [`E2ELoss::defer_items`] on the dense path: the values still on the device (then
    /// `items` and the branches' items are NaN until read).
    pub deferred: Option<DeferredItems>,
}

/// A criterion call's loss values left on the device, to be read later (no host sync).
#[derive(Clone, Debug)]
pub struct DeferredItems {
    /// (13,) f32: the one-to-many branch's six gain-scaled terms, the one-to-one branch's six
    /// (the logged items), then the total.
    pub values: Tensor,
    /// (1,) f32: 1 when any of `values` is not finite, else 0.
    pub nonfinite: Tensor,
}

impl DeferredItems {
    /// Index of the total in [`DeferredItems::values`].
    pub const TOTAL: usize = 12;
    /// Range of the logged (one-to-one) items in [`DeferredItems::values`].
    pub const ITEMS: std::ops::Range<usize> = 6..12;
}

/// The criterion: two [`PoseLoss26`] and the moving weights.
#[derive(Clone, Debug)]
pub struct E2ELoss {
    /// The o2m branch's loss (top-10 assigner).
    pub one2many: PoseLoss26,
    /// The o2o branch's loss (top-7, then top-1).
    pub one2one: PoseLoss26,
    /// Completed epochs (number of `update()` calls, or the resume epoch).
    pub updates: usize,
    /// Total epochs E.
    pub epochs: usize,
    /// The o2m weight in the first epoch (0.8).
    pub o2m_initial: f64,
    /// The o2m weight in the last epoch (0.1).
    pub o2m_final: f64,
    /// The current o2m weight.
    pub w_o2m: f64,
    /// The current o2o weight.
    pub w_o2o: f64,
    /// On the dense path, leave the loss values on the device ([`LossOutput::deferred`]) instead
    /// of reading them (the fit loop on a GPU: it reads them a step later and gates the optimizer
    /// step on the device flag). Off: one host read per call, and a non-finite total is an error.
    pub defer_items: bool,
    /// The branch weights on the device ([`E2ELoss::weights_on`]), shared by clones.
    weights: std::sync::Arc<std::sync::Mutex<Option<WeightsKey>>>,
    /// Objects per image the dense path pads the current step's targets to at least
    /// ([`E2ELoss::set_agreed_max_boxes`]), shared by clones.
    agreed_max_boxes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

type WeightsKey = ((f64, f64), ptl_autograd::Device, Tensor);

/// The model's forward for [`E2ELoss::loss_with_forward`]: images to both branches' raw outputs
/// (one-to-many, one-to-one).
pub type ForwardBody<'a> = dyn Fn(&Tensor) -> Result<(BranchOutputs, BranchOutputs)> + 'a;

/// What a step's forward-and-loss body runs on ([`E2ELoss::loss_with_forward`]).
#[derive(Clone, Copy)]
pub struct StepBody<'a> {
    /// The images.
    pub x: &'a Tensor,
    /// The targets padded to a bucket, on the images' device.
    pub targets: &'a DeviceTargets,
    /// The model's forward: both branches' raw outputs.
    pub forward: &'a ForwardBody<'a>,
    /// The batch's targets as loaded (for the input checks).
    pub batch: &'a TargetBatch,
    /// The anchor grid of the images' size.
    pub anchors: &'a Anchors,
    /// The RLE flow (training mode).
    pub flow: Option<&'a dyn FlowLogProb>,
}

/// Both branches' boxes, scores and keypoints, one-to-many first: the head of the dense body's inputs.
fn dense_inputs(o2m: &BranchOutputs, o2o: &BranchOutputs) -> Vec<Tensor> {
    vec![o2m.boxes.clone(), o2m.scores.clone(), o2m.kpts.clone(), o2o.boxes.clone(), o2o.scores.clone(), o2o.kpts.clone()]
}

/// Records a step's inputs and body ahead of use without running them (a replay plugin's
/// `prepare`): `true` when something was recorded.
pub type StepPrepare<'a> = dyn Fn(&[Tensor], &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Result<bool> + 'a;

/// Runs the dense criterion's device work: `route(inputs, body)` returns `body(inputs)`'s tensors
/// (natively or by a replay of a recording of it).
pub type LossRoute<'a> = dyn Fn(&[Tensor], &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>> + 'a;

impl E2ELoss {
    /// Criterion for a run of `epochs` epochs (o2m top-k 10/10, o2o 7/1, weights 0.8 → 0.1).
    pub fn new(cfg: LossConfig, epochs: usize) -> E2ELoss {
        let mut c = E2ELoss {
            one2many: PoseLoss26::new(cfg.clone(), 10, 10),
            one2one: PoseLoss26::new(cfg, 7, 1),
            updates: 0,
            epochs,
            o2m_initial: 0.8,
            o2m_final: 0.1,
            w_o2m: 0.8,
            w_o2o: 0.0,
            defer_items: false,
            weights: Default::default(),
            agreed_max_boxes: Default::default(),
        };
        c.w_o2o = (1.0 - c.w_o2m).max(0.0);
        c
    }

    /// Pads the dense path's targets of the coming steps to the bucket of at least `n` objects per
    /// image: the count a data-parallel group agreed on for the step (the largest any rank's batch
    /// has), so every rank records and replays the same shape and issues the same collectives; 0
    /// (the default): each batch's own count.
    pub fn set_agreed_max_boxes(&self, n: usize) {
        self.agreed_max_boxes.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether both branches assign on the dense path (the fixed-shape criterion).
    pub fn is_dense(&self) -> bool {
        self.one2many.cfg.dense_assignment && self.one2one.cfg.dense_assignment
    }

    fn agreed(&self) -> usize {
        self.agreed_max_boxes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// o2m weight after `u` completed epochs.
    pub fn decay(&self, u: usize) -> f64 {
        let e = (self.epochs as f64 - 1.0).max(1.0);
        (1.0 - u as f64 / e).max(0.0) * (self.o2m_initial - self.o2m_final) + self.o2m_final
    }

    /// Called once at the end of every epoch.
    pub fn update(&mut self) {
        self.set_updates(self.updates + 1);
    }

    /// Sets the number of completed epochs directly (resume: `start_epoch`).
    pub fn set_updates(&mut self, u: usize) {
        self.updates = u;
        self.w_o2m = self.decay(u);
        self.w_o2o = (1.0 - self.w_o2m).max(0.0);
    }

    /// Evaluates both branches and mixes them. `flow` is the shared RealNVP (needed when the
    /// outputs carry sigma views, i.e. in training mode).
    pub fn loss(
        &self,
        o2m: &BranchOutputs,
        o2o: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
    ) -> Result<LossOutput> {
        self.loss_via(o2m, o2o, targets, anchors, flow, None)
    }

    /// [`E2ELoss::loss`] and [`E2ELoss::loss_routed`]: the dense path (through `route` when given),
    /// else — or beyond the largest bucket — both branches on the host path.
    fn loss_via(
        &self,
        o2m: &BranchOutputs,
        o2o: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
        route: Option<&LossRoute<'_>>,
    ) -> Result<LossOutput> {
        let dense = self.one2many.cfg.dense_assignment && self.one2one.cfg.dense_assignment;
        if dense {
            if let Some(out) = self.loss_dense(o2m, o2o, targets, anchors, flow, route)? {
                return Ok(out);
            }
        }
        // Both branches on the host path (the dense path has counted its fallback).
        let (a, b) = if dense {
            (self.one2many.loss_host(o2m, targets, anchors, flow)?, self.one2one.loss_host(o2o, targets, anchors, flow)?)
        } else {
            (self.one2many.loss(o2m, targets, anchors, flow)?, self.one2one.loss(o2o, targets, anchors, flow)?)
        };
        self.mix_host(a, b)
    }

    /// The host path's mix of two branch results, with its host read of the total.
    fn mix_host(&self, a: BranchLoss, b: BranchLoss) -> Result<LossOutput> {
        let dev = a.loss_times_bs.device();
        let wa = Tensor::scalar(self.w_o2m, DType::F32, dev)?;
        let wb = Tensor::scalar(self.w_o2o, DType::F32, dev)?;
        let loss_vec = a.loss_times_bs.mul(&wa)?.add(&b.loss_times_bs.mul(&wb)?)?;
        let total = loss_vec.sum_all()?;
        let t = total.detach().item()?;
        if !t.is_finite() {
            return Err(crate::error::TrainerError::NonFinite { what: "total loss", index: 0, value: t });
        }
        Ok(LossOutput { total, loss_vec, items: b.items, one2many: a, one2one: b, w_o2m: self.w_o2m, w_o2o: self.w_o2o, deferred: None })
    }

    /// [`E2ELoss::loss`] with the dense path's device work handed to `route` (a replay plugin
    /// that records it): `route(inputs, body)` must return what `body(inputs)` returns. The host
    /// path and a batch beyond the largest bucket do not go through it.
    pub fn loss_routed(
        &self,
        o2m: &BranchOutputs,
        o2o: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
        route: &LossRoute<'_>,
    ) -> Result<LossOutput> {
        self.loss_via(o2m, o2o, targets, anchors, flow, Some(route))
    }

    /// The branch weights (w_o2m, w_o2o) as a (2,) f32 device tensor, made when they change (once
    /// per epoch): a recorded loss region reads them from the device.
    fn weights_on(&self, device: ptl_autograd::Device) -> Result<Tensor> {
        let mut cache = self.weights.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((w, dev, t)) = cache.as_ref() {
            if *w == (self.w_o2m, self.w_o2o) && *dev == device {
                return Ok(t.clone());
            }
        }
        let t = Tensor::from_vec(vec![self.w_o2m as f32, self.w_o2o as f32], vec![2], device)?;
        *cache = Some(((self.w_o2m, self.w_o2o), device, t.clone()));
        Ok(t)
    }

    /// Both branches on the dense path: the targets uploaded once, then the device work (both
    /// branches' assignment and terms, one flow evaluation, the mix) as one body over tensors —
    /// `route` may record it — and one host read, or none with [`E2ELoss::defer_items`]. `None`
    /// when a branch needs the host path (targets beyond the largest bucket).
    fn loss_dense(
        &self,
        o2m: &BranchOutputs,
        o2o: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
        route: Option<&LossRoute<'_>>,
    ) -> Result<Option<LossOutput>> {
        let clock = std::time::Instant::now();
        // Whether the targets fit a bucket depends on the targets alone: the same for both branches.
        let Some(dt) = self.one2many.dense_targets_at_least(o2m, targets, anchors, self.agreed())? else {
            self.one2one.count_fallback();
            return Ok(None);
        };
        self.one2one.check_inputs(o2o, targets, anchors)?;
        let weights = self.weights_on(o2m.boxes.device())?;
        let mut inputs = dense_inputs(o2m, o2o);
        inputs.extend([dt.labels.clone(), dt.boxes.clone(), dt.mask.clone(), dt.kpts.clone(), weights]);
        let with_sigma = o2m.kpts_sigma.is_some() && o2o.kpts_sigma.is_some();
        if let (Some(a), Some(b)) = (&o2m.kpts_sigma, &o2o.kpts_sigma) {
            inputs.extend([a.clone(), b.clone()]);
        }
        let slots = dt.slots;
        let body = |xs: &[Tensor]| self.dense_device_work(xs, slots, with_sigma, anchors, flow);
        let outs = match route {
            Some(r) => r(&inputs, &body)?,
            None => body(&inputs)?,
        };
        self.finish_dense(outs, clock).map(Some)
    }

    /// A step's targets padded to their bucket and uploaded to `device`, when the step takes the
    /// dense path (the criterion is dense and every image's targets fit the largest bucket); then
    /// [`E2ELoss::loss_with_forward`] runs the step with them. `None`: nothing uploaded or counted
    /// (the caller's host-path call counts the fallback).
    pub fn dense_step_targets(
        &self,
        targets: &TargetBatch,
        bs: usize,
        anchors: &Anchors,
        device: ptl_autograd::Device,
    ) -> Result<Option<DeviceTargets>> {
        if !(self.one2many.cfg.dense_assignment && self.one2one.cfg.dense_assignment) {
            return Ok(None);
        }
        super::branch::padded_targets_on(targets, bs, anchors, device, self.agreed())
    }

    /// The model's forward and the dense criterion as one body over tensors, which `route` may
    /// record whole (a step's forward and loss in one graph). `route` gets the images, the padded
    /// targets ([`E2ELoss::dense_step_targets`]) and the branch weights; the body runs the step's
    /// forward (both branches' raw outputs) and then what [`E2ELoss::loss_routed`]'s body runs,
    /// so the values are the same.
    pub fn loss_with_forward(&self, step: &StepBody<'_>, route: &LossRoute<'_>) -> Result<LossOutput> {
        let clock = std::time::Instant::now();
        let outs = self.with_step_body(step, |inputs, body| route(inputs, body))?;
        self.finish_dense(outs, clock)
    }

    /// Hands [`E2ELoss::loss_with_forward`]'s inputs and body to `prepare` (a replay plugin that
    /// records them ahead of use without running them) and returns what it says; nothing runs
    /// here. The fit prepares a step with the largest target bucket its data can give.
    pub fn prepare_with_forward(&self, step: &StepBody<'_>, prepare: &StepPrepare<'_>) -> Result<bool> {
        self.with_step_body(step, |inputs, body| prepare(inputs, body))
    }

    /// The step body's inputs (images, padded targets, branch weights) and the body itself,
    /// handed to `f`.
    fn with_step_body<R>(
        &self,
        step: &StepBody<'_>,
        f: impl FnOnce(&[Tensor], &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Result<R>,
    ) -> Result<R> {
        let StepBody { x, targets: dt, forward, batch: targets, anchors, flow } = *step;
        let weights = self.weights_on(x.device())?;
        let inputs = [x.clone(), dt.labels.clone(), dt.boxes.clone(), dt.mask.clone(), dt.kpts.clone(), weights];
        let slots = dt.slots;
        let body = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let [x, labels, boxes, mask, kpts, weights] = xs else {
                return Err(crate::error::TrainerError::InvalidArgument {
                    what: "forward-and-loss route",
                    reason: format!("handed {} tensors to a body that takes 6", xs.len()),
                });
            };
            let (o2m, o2o) = forward(x)?;
            self.one2many.check_inputs(&o2m, targets, anchors)?;
            self.one2one.check_inputs(&o2o, targets, anchors)?;
            let mut inner = dense_inputs(&o2m, &o2o);
            inner.extend([labels.clone(), boxes.clone(), mask.clone(), kpts.clone(), weights.clone()]);
            let with_sigma = o2m.kpts_sigma.is_some() && o2o.kpts_sigma.is_some();
            if let (Some(a), Some(b)) = (o2m.kpts_sigma, o2o.kpts_sigma) {
                inner.extend([a, b]);
            }
            self.dense_device_work(&inner, slots, with_sigma, anchors, flow)
        };
        f(&inputs, &body)
    }

    /// The dense criterion's device work over `xs` = both branches' boxes, scores and keypoints
    /// (o2m then o2o), the padded targets (labels, boxes, mask, keypoints), the branch weights,
    /// and with `with_sigma` both branches' sigma views: `[total, loss_vec, values, nonfinite,
    /// la, lb]`. No host read, no data-dependent shape.
    fn dense_device_work(
        &self,
        xs: &[Tensor],
        slots: usize,
        with_sigma: bool,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
    ) -> Result<Vec<Tensor>> {
        let wanted = 11 + 2 * usize::from(with_sigma);
        if xs.len() != wanted {
            return Err(crate::error::TrainerError::InvalidArgument {
                what: "loss route",
                reason: format!("handed {} tensors to the dense loss body, which takes {wanted}", xs.len()),
            });
        }
        let bs = xs[0].dims().first().copied().unwrap_or(0);
        let branch = |i: usize, s: Option<usize>| BranchOutputs {
            boxes: xs[i].clone(),
            scores: xs[i + 1].clone(),
            kpts: xs[i + 2].clone(),
            kpts_sigma: s.map(|k| xs[k].clone()),
        };
        let (a_out, b_out) = if with_sigma { (branch(0, Some(11)), branch(3, Some(12))) } else { (branch(0, None), branch(3, None)) };
        let dt = DeviceTargets { slots, labels: xs[6].clone(), boxes: xs[7].clone(), mask: xs[8].clone(), kpts: xs[9].clone() };
        let pa = self.one2many.dense_parts_on(&a_out, &dt, anchors)?;
        let pb = self.one2one.dense_parts_on(&b_out, &dt, anchors)?;
        // One flow evaluation for both branches' RLE rows.
        let rle = super::dense::rle_terms(&[&pa, &pb], flow)?;
        let (va, vb) = (pa.finish(&self.one2many.cfg, &rle[0])?, pb.finish(&self.one2one.cfg, &rle[1])?);
        // The batch as an immediate scale (fixed per shape), the epoch's weights from the device.
        let (la, lb) = (va.mul_scalar(bs as f64)?, vb.mul_scalar(bs as f64)?);
        let w = &xs[10];
        let loss_vec = la.mul(&w.narrow(0, 0, 1)?)?.add(&lb.mul(&w.narrow(0, 1, 1)?)?)?;
        let total = loss_vec.sum_all()?;
        let values = Tensor::cat(&[&va.detach(), &vb.detach(), &total.detach().reshape(1)?], 0)?;
        // x − x is 0 for a finite x and NaN otherwise: the flag without a host read.
        let nonfinite = ptl_autograd::no_grad(|| -> Result<Tensor> {
            let finite = values.sub(&values)?.eq_scalar(0.0)?.to_dtype(DType::F32)?;
            Ok(finite.min_dim(0, true)?.0.affine(-1.0, 1.0)?)
        })?;
        Ok(vec![total, loss_vec, values, nonfinite, la, lb])
    }

    /// The dense criterion's result from its device work's tensors: left on the device with
    /// [`E2ELoss::defer_items`], else read once (a non-finite total is an error).
    fn finish_dense(&self, outs: Vec<Tensor>, clock: std::time::Instant) -> Result<LossOutput> {
        let [total, loss_vec, values, nonfinite, la, lb]: [Tensor; 6] =
            outs.try_into().map_err(|v: Vec<Tensor>| crate::error::TrainerError::InvalidArgument {
                what: "loss route",
                reason: format!("returned {} tensors, the loss body makes 6", v.len()),
            })?;
        let enqueued = clock.elapsed().as_secs_f64() * 1e3;
        if self.defer_items {
            let branch = |loss_times_bs: Tensor| BranchLoss {
                loss_times_bs,
                items: [f64::NAN; 6],
                assignment: None,
                phase_ms: [0.0, 0.0, enqueued, 0.0],
            };
            let (a, b) = (branch(la), branch(lb));
            let deferred = Some(DeferredItems { values, nonfinite });
            return Ok(LossOutput {
                total,
                loss_vec,
                items: [f64::NAN; 6],
                one2many: a,
                one2one: b,
                w_o2m: self.w_o2m,
                w_o2o: self.w_o2o,
                deferred,
            });
        }
        let read = values.to_vec::<f32>()?;
        let t = f64::from(read[DeferredItems::TOTAL]);
        if !t.is_finite() {
            return Err(crate::error::TrainerError::NonFinite { what: "total loss", index: 0, value: t });
        }
        let waited = clock.elapsed().as_secs_f64() * 1e3 - enqueued;
        let branch = |loss_times_bs: Tensor, items: [f64; 6]| BranchLoss {
            loss_times_bs,
            items,
            assignment: None,
            phase_ms: [0.0, 0.0, enqueued, waited],
        };
        let (a, b) = (branch(la, items_of(&read[0..6])), branch(lb, items_of(&read[DeferredItems::ITEMS])));
        Ok(LossOutput { total, loss_vec, items: b.items, one2many: a, one2one: b, w_o2m: self.w_o2m, w_o2o: self.w_o2o, deferred: None })
    }
}

//! One branch of the criterion (`PoseLoss26`, docs/loss.md §1 and §3): decode, assign, six terms.

use ptl_autograd::{no_grad, DType, Tensor};

use super::anchors::Anchors;
use super::assigner::{assign, candidate_sets, AssignInputs, AssignParams, Assignment, NOT_LOADED};
use super::targets::{pad_targets, TargetBatch};
use super::terms::{self, constant, zero_connected};
use super::{FlowLogProb, LossConfig};
use crate::error::{Result, TrainerError};

/// Raw training-mode head outputs of one branch set (docs/model.md §4).
#[derive(Clone, Debug)]
pub struct BranchOutputs {
    /// (B, 4, A) (l, t, r, b) distances in grid units.
    pub boxes: Tensor,
    /// (B, nc, A) class logits.
    pub scores: Tensor,
    /// (B, 3K, A) keypoint offsets and visibility logits.
    pub kpts: Tensor,
    /// (B, 2K, A) sigma logits (training mode only).
    pub kpts_sigma: Option<Tensor>,
}

impl From<&ptl_heads::BranchOutput> for BranchOutputs {
    fn from(b: &ptl_heads::BranchOutput) -> Self {
        BranchOutputs { boxes: b.boxes.clone(), scores: b.scores.clone(), kpts: b.kpts.clone(), kpts_sigma: b.kpts_sigma.clone() }
    }
}

/// What one branch returns.
#[derive(Clone, Debug)]
pub struct BranchLoss {
    /// (6,) gain-scaled terms × batch size (differentiable): what E2ELoss weights.
    pub loss_times_bs: Tensor,
    /// The six gain-scaled terms (detached host values): what is logged for this branch.
    pub items: [f64; 6],
    /// The assignment behind it (the host assigner's; `None` on the dense path, whose assignment
    /// stays on the device).
    pub assignment: Option<Assignment>,
    /// Host wall time (ms) of the phases: [device→host copies + decode, assignment,
    /// enqueueing the terms, reading the items back (waits for the device)].
    pub phase_ms: [f64; 4],
}

/// The per-branch criterion.
#[derive(Clone, Debug)]
pub struct PoseLoss26 {
    /// Gains and keypoint constants.
    pub cfg: LossConfig,
    /// The branch's assigner settings.
    pub assign: AssignParams,
    /// Dense-path calls that ran the host path (shared by clones).
    dense_fallbacks: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The dense assigner's constants for the last image size and device.
    dense_cache: std::sync::Arc<std::sync::Mutex<Option<DenseCache>>>,
}

/// The dense path's constants of one image size and device: the assigner's geometry, and the
/// terms' constants per (batch, slots).
#[derive(Debug)]
struct DenseCache {
    levels: Vec<(usize, usize)>,
    device: ptl_autograd::Device,
    geometry: super::assign_dense::DenseGeometry,
    constants: Vec<((usize, usize), super::dense::DenseConstants)>,
}

/// The six items of a gain-scaled term vector read back to the host.
pub(crate) fn items_of(v: &[f32]) -> [f64; 6] {
    let mut items = [0f64; 6];
    for (i, x) in v.iter().take(6).enumerate() {
        items[i] = f64::from(*x);
    }
    items
}

fn host_f32(t: &Tensor, what: &'static str) -> Result<Vec<f32>> {
    let v = no_grad(|| t.detach().to_dtype(DType::F32))?.to_vec::<f32>()?;
    crate::error::check_finite(what, &v)?;
    Ok(v)
}

/// The RLE term's floor for σ: the smallest positive normal number of the sigma logits' dtype
/// (6.1e-5 for f16, 1.18e-38 for f32 and bf16).
pub(crate) fn sigma_floor_of(out: &BranchOutputs) -> f64 {
    match out.kpts_sigma.as_ref().map(Tensor::dtype) {
        Some(DType::F16) => 2f64.powi(-14),
        _ => f64::from(f32::MIN_POSITIVE),
    }
}

/// `t` in f32 (a differentiable cast when it is not already).
pub(crate) fn f32_of(t: &Tensor) -> Result<Tensor> {
    Ok(if t.dtype() == DType::F32 { t.clone() } else { t.to_dtype(DType::F32)? })
}

/// The six raw terms `[box, pose, kobj, cls, l1, rle]` times their gains, as one (6,) tensor.
pub(crate) fn gain_scaled(cfg: &LossConfig, raw: [&Tensor; 6]) -> Result<Tensor> {
    let gains = [cfg.box_gain, cfg.pose_gain, cfg.kobj_gain, cfg.cls_gain, cfg.l1_gain, cfg.rle_gain];
    let scaled: Vec<Tensor> = raw
        .iter()
        .zip(gains)
        // An immediate scale (no upload): the same rounding as a product with an f32 scalar tensor.
        .map(|(l, g)| -> Result<Tensor> { Ok(l.reshape(1)?.mul_scalar(g)?) })
        .collect::<Result<_>>()?;
    Ok(Tensor::cat(&scaled.iter().collect::<Vec<_>>(), 0)?)
}

fn check_dims(what: &'static str, t: &Tensor, want: &[usize]) -> Result<()> {
    if t.dims() != want {
        return Err(TrainerError::ShapeMismatch {
            what,
            shape: format!("expected {want:?}, got {:?}", t.dims()),
            expected: want.iter().product(),
            got: t.numel(),
        });
    }
    Ok(())
}

impl PoseLoss26 {
    /// A branch criterion with the given assigner top-k values (o2m: 10/10, o2o: 7/1).
    pub fn new(cfg: LossConfig, topk: usize, topk2: usize) -> PoseLoss26 {
        let assign = AssignParams::pose(topk, topk2, &cfg.strides, &cfg.sigmas);
        PoseLoss26 { cfg, assign, dense_fallbacks: Default::default(), dense_cache: Default::default() }
    }

    /// Evaluates the branch on raw outputs. `flow` is required when `kpts_sigma` is present.
    pub fn loss(
        &self,
        out: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
    ) -> Result<BranchLoss> {
        if self.cfg.dense_assignment {
            return self.loss_dense(out, targets, anchors, flow);
        }
        self.loss_host(out, targets, anchors, flow)
    }

    /// Notes one call of the dense path that runs the host path.
    pub(crate) fn count_fallback(&self) {
        self.dense_fallbacks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many calls of the dense path fell back to the host path (targets beyond the largest bucket).
    pub fn dense_fallbacks(&self) -> usize {
        self.dense_fallbacks.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The shapes and keypoint count every path needs.
    pub(crate) fn check_inputs(&self, out: &BranchOutputs, targets: &TargetBatch, anchors: &Anchors) -> Result<()> {
        let (nc, nk) = (self.cfg.nc, self.cfg.nkpt);
        let bs = out.boxes.dims().first().copied().unwrap_or(0);
        let na = anchors.len();
        check_dims("boxes (B, 4, A)", &out.boxes, &[bs, 4, na])?;
        check_dims("scores (B, nc, A)", &out.scores, &[bs, nc, na])?;
        check_dims("kpts (B, 3K, A)", &out.kpts, &[bs, 3 * nk, na])?;
        if let Some(s) = &out.kpts_sigma {
            check_dims("kpts_sigma (B, 2K, A)", s, &[bs, 2 * nk, na])?;
        }
        if targets.nkpt != nk {
            return Err(TrainerError::InvalidArgument {
                what: "targets.nkpt",
                reason: format!("{} keypoints in targets, {nk} in the loss config", targets.nkpt),
            });
        }
        Ok(())
    }

    /// The host-assigner path.
    pub(crate) fn loss_host(
        &self,
        out: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
    ) -> Result<BranchLoss> {
        // The loss runs in float32 whatever the head's precision (autocast outputs are cast
        // here, differentiably); the RLE sigma floor follows the outputs' own dtype.
        let sigma_floor = sigma_floor_of(out);
        let cast = BranchOutputs {
            boxes: f32_of(&out.boxes)?,
            scores: f32_of(&out.scores)?,
            kpts: f32_of(&out.kpts)?,
            kpts_sigma: out.kpts_sigma.as_ref().map(f32_of).transpose()?,
        };
        let out = &cast;
        let cfg = &self.cfg;
        let (nc, nk) = (cfg.nc, cfg.nkpt);
        let device = out.boxes.device();
        let bs = out.boxes.dims().first().copied().unwrap_or(0);
        let na = anchors.len();
        self.check_inputs(out, targets, anchors)?;
        let (img_h, img_w) = anchors.image_hw();

        let clock = std::time::Instant::now();
        let mut phase_ms = [0f64; 4];
        let lap = |i: usize, phase_ms: &mut [f64; 4]| {
            let now = clock.elapsed().as_secs_f64() * 1e3;
            phase_ms[i] = now - phase_ms[..i].iter().sum::<f64>();
        };
        // ---- NaN gate: one device-side sum of every output, a host scan only on failure -----
        self.check_finite(out)?;

        // ---- candidates (targets and anchors only), then predictions at those anchors -----
        let padded = pad_targets(targets, bs, (img_h, img_w))?;
        let anchors_px = anchors.points_px();
        let (ap, st) = (&anchors.points, &anchors.strides);
        let cands = candidate_sets(&padded, &anchors_px, st, &self.assign)?;
        let union = cands.union(bs, padded.max_boxes, na);
        let u = union.len();
        let mut rows = vec![NOT_LOADED; bs * na];
        for (r, &f) in union.iter().enumerate() {
            rows[f] = r as u32;
        }
        let (mut sig_scores, mut px_boxes, mut px_kpts) = (vec![0f32; u * nc], vec![0f32; u * 4], vec![0f32; u * nk * 2]);
        if u > 0 {
            let idx = Tensor::from_vec(union.iter().map(|&f| f as i64).collect::<Vec<_>>(), u, device)?;
            let take = |t: &Tensor, c: usize| -> Result<Vec<f32>> {
                let v = no_grad(|| -> Result<Tensor> {
                    let x = t.detach();
                    let x = if x.dtype() == DType::F32 { x } else { x.to_dtype(DType::F32)? };
                    Ok(x.permute(&[0, 2, 1])?.reshape((bs * na, c))?.index_select(0, &idx)?)
                })?;
                Ok(v.to_vec::<f32>()?)
            };
            let (raw_scores, raw_boxes, raw_kpts) = (take(&out.scores, nc)?, take(&out.boxes, 4)?, take(&out.kpts, 3 * nk)?);
            for (r, &f) in union.iter().enumerate() {
                let j = f % na;
                let (ax, ay, s) = (ap[2 * j], ap[2 * j + 1], st[j]);
                for c in 0..nc {
                    sig_scores[r * nc + c] = 1.0 / (1.0 + (-raw_scores[r * nc + c]).exp());
                }
                let rb = &raw_boxes[4 * r..4 * r + 4];
                px_boxes[4 * r..4 * r + 4].copy_from_slice(&[(ax - rb[0]) * s, (ay - rb[1]) * s, (ax + rb[2]) * s, (ay + rb[3]) * s]);
                let rk = &raw_kpts[r * 3 * nk..(r + 1) * 3 * nk];
                for k in 0..nk {
                    px_kpts[(r * nk + k) * 2] = (rk[3 * k] + ax) * s;
                    px_kpts[(r * nk + k) * 2 + 1] = (rk[3 * k + 1] + ay) * s;
                }
            }
        }
        lap(0, &mut phase_ms);
        let asg = assign(
            &AssignInputs {
                batch_size: bs,
                num_anchors: na,
                nc,
                rows: &rows,
                scores: &sig_scores,
                boxes: &px_boxes,
                kpts: &px_kpts,
                strides: st,
                targets: &padded,
                candidates: &cands,
            },
            &self.assign,
        )?;

        lap(1, &mut phase_ms);
        // ---- classification over all anchors ---------------------------------------------
        let tss = asg.target_scores_sum().max(1.0);
        let t = Tensor::scalar(f64::from(tss), DType::F32, device)?;
        let logits = out.scores.permute(&[0, 2, 1])?;
        let cls_t = constant(asg.target_scores.clone(), &[bs, na, nc], device)?;
        let l_cls = terms::cls_loss(&logits, &cls_t, &t)?;

        let fg = asg.fg_indices();
        let n = fg.len();
        let (l_box, l_l1, l_kpt, l_kobj, l_rle);
        if n == 0 {
            l_box = zero_connected(&out.boxes)?;
            l_l1 = zero_connected(&out.boxes)?;
            l_kpt = zero_connected(&out.kpts)?;
            l_kobj = zero_connected(&out.kpts)?;
            l_rle = self.zero_rle(out, flow)?;
        } else {
            let idx = Tensor::from_vec(fg.iter().map(|&i| i as i64).collect::<Vec<_>>(), n, device)?;
            // Constants at the foreground anchors (grid units).
            let mut anc = Vec::with_capacity(2 * n);
            let mut strd = Vec::with_capacity(n);
            let mut tgt = Vec::with_capacity(4 * n);
            let mut w = Vec::with_capacity(n);
            let mut tl1 = Vec::with_capacity(4 * n);
            for &f in &fg {
                let j = f % na;
                let (ax, ay, s) = (ap[2 * j], ap[2 * j + 1], st[j]);
                anc.extend_from_slice(&[ax, ay]);
                strd.push(s);
                let tb: Vec<f32> = asg.target_bboxes[4 * f..4 * f + 4].iter().map(|&v| v / s).collect();
                let ltrb = [ax - tb[0], ay - tb[1], tb[2] - ax, tb[3] - ay];
                tl1.extend_from_slice(&[ltrb[0] * s / img_w, ltrb[1] * s / img_h, ltrb[2] * s / img_w, ltrb[3] * s / img_h]);
                tgt.extend_from_slice(&tb);
                w.push(asg.target_scores[f * nc..(f + 1) * nc].iter().sum::<f32>());
            }
            let anc_t = constant(anc, &[n, 2], device)?;
            let s_t = constant(strd.clone(), &[n, 1], device)?;
            let w_t = constant(w, &[n, 1], device)?;
            let tgt_t = constant(tgt.clone(), &[n, 4], device)?;

            // Box CIoU and side L1.
            let ltrb = out.boxes.permute(&[0, 2, 1])?.reshape((bs * na, 4))?.index_select(0, &idx)?;
            let lt_rb = ltrb.split(&[2, 2], -1)?;
            let pred_xyxy = Tensor::cat(&[&anc_t.sub(&lt_rb[0])?, &anc_t.add(&lt_rb[1])?], -1)?;
            l_box = terms::box_loss(&pred_xyxy, &tgt_t, &w_t, &t)?;
            let whwh = constant(vec![img_w, img_h, img_w, img_h], &[1, 4], device)?;
            let pred_l1 = ltrb.mul(&s_t)?.div(&whwh)?;
            let tl1_t = constant(tl1, &[n, 4], device)?;
            l_l1 = terms::l1_loss(&pred_l1, &tl1_t, &w_t, &t)?;

            // Keypoints at the foreground anchors.
            let kp = out.kpts.permute(&[0, 2, 1])?.reshape((bs * na, nk, 3))?.index_select(0, &idx)?;
            let kp_xy = kp.narrow(-1, 0, 2)?.add(&anc_t.unsqueeze(1)?)?; // (N, K, 2) decoded
            let xy = kp_xy.split(&[1, 1], -1)?;
            let (px, py) = (xy[0].squeeze(-1)?, xy[1].squeeze(-1)?);
            let vlog = kp.narrow(-1, 2, 1)?.squeeze(-1)?;
            let mut gx = Vec::with_capacity(n * nk);
            let mut gy = Vec::with_capacity(n * nk);
            let mut msk = Vec::with_capacity(n * nk);
            let mut denom = Vec::with_capacity(n * nk);
            let mut factor = Vec::with_capacity(n);
            let mut vis_idx = Vec::new();
            let mut vis_gt = Vec::new();
            let mut vis_w = Vec::new();
            for (r, &f) in fg.iter().enumerate() {
                let (b, s) = (f / na, strd[r]);
                let g = asg.target_gt_idx[f];
                let gk = &padded.kpts[(b * padded.max_boxes + g) * nk * 3..][..nk * 3];
                let tb = &tgt[4 * r..4 * r + 4];
                let area = (tb[2] - tb[0]) * (tb[3] - tb[1]);
                let mut nv = 0f32;
                for k in 0..nk {
                    let (x, y, v) = (gk[3 * k] / s, gk[3 * k + 1] / s, gk[3 * k + 2]);
                    gx.push(x);
                    gy.push(y);
                    let m = v != 0.0;
                    msk.push(f32::from(u8::from(m)));
                    let two_s = 2.0 * cfg.sigmas[k];
                    denom.push(two_s * two_s * (area + 1e-9) * 2.0);
                    if m {
                        nv += 1.0;
                        vis_idx.push((r * nk + k) as i64);
                        vis_gt.extend_from_slice(&[x, y]);
                        vis_w.push(cfg.rle_weights[k]);
                    }
                }
                factor.push(nk as f32 / (nv + 1e-9));
            }
            let gx_t = constant(gx, &[n, nk], device)?;
            let gy_t = constant(gy, &[n, nk], device)?;
            let m_t = constant(msk, &[n, nk], device)?;
            let den_t = constant(denom, &[n, nk], device)?;
            let fac_t = constant(factor, &[n, 1], device)?;
            l_kpt = terms::keypoint_loss(&px, &py, &gx_t, &gy_t, &m_t, &den_t, &fac_t)?;
            l_kobj = terms::kobj_loss(&vlog, &m_t)?;

            l_rle = match (&out.kpts_sigma, flow) {
                (Some(sigma), Some(flow)) if !vis_idx.is_empty() => {
                    let nv = vis_idx.len();
                    let vidx = Tensor::from_vec(vis_idx, nv, device)?;
                    let sg = sigma
                        .permute(&[0, 2, 1])?
                        .reshape((bs * na, nk * 2))?
                        .index_select(0, &idx)?
                        .reshape((n * nk, 2))?
                        .index_select(0, &vidx)?;
                    let pv = kp_xy.reshape((n * nk, 2))?.index_select(0, &vidx)?;
                    let gv = constant(vis_gt, &[nv, 2], device)?;
                    match terms::rle_loss(&pv, &sg, &gv, &vis_w, sigma_floor, flow)? {
                        Some(l) => l,
                        None => self.zero_rle(out, Some(flow))?,
                    }
                }
                (Some(_), None) => {
                    return Err(TrainerError::InvalidArgument {
                        what: "flow",
                        reason: "kpts_sigma given but no flow model for the RLE term".into(),
                    })
                }
                _ => self.zero_rle(out, flow)?,
            };
        }

        let vec = gain_scaled(cfg, [&l_box, &l_kpt, &l_kobj, &l_cls, &l_l1, &l_rle])?;
        lap(2, &mut phase_ms);
        let hv = vec.detach().to_vec::<f32>()?;
        let mut items = [0f64; 6];
        for (i, v) in hv.iter().enumerate() {
            items[i] = f64::from(*v);
        }
        let loss_times_bs = vec.mul(&Tensor::scalar(bs as f64, DType::F32, device)?)?;
        lap(3, &mut phase_ms);
        Ok(BranchLoss { loss_times_bs, items, assignment: Some(asg), phase_ms })
    }

    /// The branch on the dense path ([`LossConfig::dense_assignment`]) with its one host read
    /// (the items); see [`PoseLoss26::dense_terms`].
    fn loss_dense(
        &self,
        out: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
    ) -> Result<BranchLoss> {
        let clock = std::time::Instant::now();
        let Some(vec) = self.dense_terms(out, targets, anchors, flow)? else {
            return self.loss_host(out, targets, anchors, flow);
        };
        let enqueued = clock.elapsed().as_secs_f64() * 1e3;
        let items = items_of(&vec.detach().to_vec::<f32>()?);
        let bs = out.boxes.dims().first().copied().unwrap_or(0);
        let loss_times_bs = vec.mul(&Tensor::scalar(bs as f64, DType::F32, out.boxes.device())?)?;
        let read = clock.elapsed().as_secs_f64() * 1e3 - enqueued;
        Ok(BranchLoss { loss_times_bs, items, assignment: None, phase_ms: [0.0, 0.0, enqueued, read] })
    }

    /// The six gain-scaled terms on the dense path as a (6,) tensor on the outputs' device, with
    /// no host read: targets padded to their bucket, the fixed-shape assigner and terms. `None`
    /// (counted in [`PoseLoss26::dense_fallbacks`]) when an image holds more objects than the
    /// largest bucket: the caller runs the host path for that call.
    pub fn dense_terms(
        &self,
        out: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        flow: Option<&dyn FlowLogProb>,
    ) -> Result<Option<Tensor>> {
        let Some(parts) = self.dense_parts(out, targets, anchors)? else { return Ok(None) };
        let rle = super::dense::rle_terms(&[&parts], flow)?;
        Ok(Some(parts.finish(&self.cfg, &rle[0])?))
    }

    /// [`PoseLoss26::dense_terms`] before the RLE's flow (the criterion runs one flow for both
    /// branches: [`super::dense::rle_terms`]).
    pub fn dense_parts(&self, out: &BranchOutputs, targets: &TargetBatch, anchors: &Anchors) -> Result<Option<super::dense::DenseParts>> {
        let Some(dt) = self.dense_targets(out, targets, anchors)? else { return Ok(None) };
        Ok(Some(self.dense_parts_on(out, &dt, anchors)?))
    }

    /// The dense path's targets on the outputs' device, padded to their bucket (one upload per
    /// tensor), after the input checks; `None` (counted) beyond the largest bucket.
    pub fn dense_targets(
        &self,
        out: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
    ) -> Result<Option<super::assign_dense::DeviceTargets>> {
        self.dense_targets_at_least(out, targets, anchors, 0)
    }

    /// [`PoseLoss26::dense_targets`] padded to the bucket of at least `at_least` objects per image
    /// (the count the ranks of a data-parallel fit agreed on), `None` (counted) beyond the largest.
    pub fn dense_targets_at_least(
        &self,
        out: &BranchOutputs,
        targets: &TargetBatch,
        anchors: &Anchors,
        at_least: usize,
    ) -> Result<Option<super::assign_dense::DeviceTargets>> {
        self.check_inputs(out, targets, anchors)?;
        let bs = out.boxes.dims().first().copied().unwrap_or(0);
        let dt = padded_targets_on(targets, bs, anchors, out.boxes.device(), at_least)?;
        if dt.is_none() {
            self.count_fallback();
        }
        Ok(dt)
    }

    /// The branch's dense parts from targets already on the device: device work only (the
    /// constants are cached after the first call), so a replay plugin can record it.
    pub fn dense_parts_on(
        &self,
        out: &BranchOutputs,
        dt: &super::assign_dense::DeviceTargets,
        anchors: &Anchors,
    ) -> Result<super::dense::DenseParts> {
        use super::assign_dense::{assign_dense, decode_for_assignment, DenseInputs};
        let bs = out.boxes.dims().first().copied().unwrap_or(0);
        let (geometry, consts) = self.dense_constants(anchors, bs, dt.slots, out.boxes.device())?;
        // One batched cast to f32, read by the assigner (detached) and the loss terms.
        let f32 = super::dense::F32Outputs::of(out)?;
        let (scores, boxes, kpts) = decode_for_assignment(&f32.boxes, &f32.scores, &f32.kpts, &geometry)?;
        let asg =
            assign_dense(&DenseInputs { scores: &scores, boxes: &boxes, kpts: &kpts, geometry: &geometry, targets: dt }, &self.assign)?;
        super::dense::dense_branch_parts(&self.cfg, out, &f32, &asg, dt, &consts)
    }

    /// The dense path's constants for these anchors, batch size and slots on `device`, made on
    /// first use and kept while the image size and device stay the same (so a call uploads only
    /// its targets).
    fn dense_constants(
        &self,
        anchors: &Anchors,
        batch: usize,
        slots: usize,
        device: ptl_autograd::Device,
    ) -> Result<(super::assign_dense::DenseGeometry, super::dense::DenseConstants)> {
        let mut cache = self.dense_cache.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = !matches!(cache.as_ref(), Some(c) if c.levels == anchors.level_hw && c.device == device);
        if fresh {
            let geometry = super::assign_dense::DenseGeometry::new(anchors, &self.assign.sigmas, self.cfg.nc, device)?;
            *cache = Some(DenseCache { levels: anchors.level_hw.clone(), device, geometry, constants: Vec::new() });
        }
        let c = cache.as_mut().ok_or_else(|| TrainerError::InvalidArgument { what: "dense cache", reason: "not made".into() })?;
        if let Some((_, k)) = c.constants.iter().find(|(key, _)| *key == (batch, slots)) {
            return Ok((c.geometry.clone(), k.clone()));
        }
        let k = super::dense::DenseConstants::new(&self.cfg, &self.assign, anchors, batch, slots, device)?;
        c.constants.push(((batch, slots), k.clone()));
        Ok((c.geometry.clone(), k))
    }

    /// Rejects NaN/inf in the outputs: one device-side sum (a single host sync); only when it is
    /// not finite are the tensors copied to the host to name the first offending element.
    fn check_finite(&self, out: &BranchOutputs) -> Result<()> {
        let mut list: Vec<(&'static str, &Tensor)> =
            vec![("predicted boxes", &out.boxes), ("predicted scores", &out.scores), ("predicted keypoints", &out.kpts)];
        if let Some(s) = &out.kpts_sigma {
            list.push(("predicted keypoint sigmas", s));
        }
        let total = no_grad(|| -> Result<Tensor> {
            let mut acc: Option<Tensor> = None;
            for (_, t) in &list {
                // Rows first, then the row sums: a whole-tensor sum is one block on CUDA
                // (0.2–0.8 ms per output at 640 px); the order does not matter for finiteness
                // (an f64 sum of f32 values cannot overflow).
                let x = t.detach().to_dtype(DType::F64)?;
                let x = if x.rank() >= 2 { x.sum_dim(-1, false)?.sum_all()? } else { x.sum_all()? };
                acc = Some(match acc {
                    None => x,
                    Some(a) => a.add(&x)?,
                });
            }
            Ok(acc.unwrap_or(Tensor::scalar(0.0, DType::F64, out.boxes.device())?))
        })?
        .item()?;
        if !total.is_finite() {
            for (what, t) in &list {
                host_f32(t, what)?;
            }
        }
        Ok(())
    }

    /// A zero RLE term connected to the sigma view and the flow parameters.
    fn zero_rle(&self, out: &BranchOutputs, flow: Option<&dyn FlowLogProb>) -> Result<Tensor> {
        let mut z = match &out.kpts_sigma {
            Some(s) => zero_connected(s)?,
            None => Tensor::scalar(0.0, DType::F32, out.kpts.device())?,
        };
        if let (Some(flow), Some(_)) = (flow, &out.kpts_sigma) {
            let e = Tensor::zeros((1, 2), DType::F32, out.kpts.device())?;
            z = z.add(&zero_connected(&flow.log_prob(&e)?)?)?;
        }
        Ok(z)
    }
}

/// `targets` for a batch of `bs` images padded to the bucket of their largest count per image, or
/// of `at_least` where that is more (the count a data-parallel group agreed on), and uploaded to
/// `device`; `None` beyond the largest bucket (not counted here: the host-path call that follows
/// counts it).
pub(crate) fn padded_targets_on(
    targets: &TargetBatch,
    bs: usize,
    anchors: &Anchors,
    device: ptl_autograd::Device,
    at_least: usize,
) -> Result<Option<super::assign_dense::DeviceTargets>> {
    use super::assign_dense::{target_bucket, DeviceTargets};
    let padded = pad_targets(targets, bs, anchors.image_hw())?;
    match target_bucket(padded.max_boxes.max(at_least)) {
        Some(slots) => Ok(Some(DeviceTargets::upload(&padded, slots, device)?)),
        None => Ok(None),
    }
}

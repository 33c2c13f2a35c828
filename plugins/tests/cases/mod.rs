//! The invariants of the replay plugins (issue "plugins I", point 3), each a function of the device:
//! `invariants.rs` runs them on the CPU (the recorder's test double: the host logic) and
//! `cuda_invariants.rs` on the GPU with real CUDA graphs. Each fails when its rule is broken.
#![allow(dead_code)] // each test binary calls every case; the helpers are shared

use ptl_autograd::{DType, Device, Tensor, TensorKind};
use ptl_capture::{FallbackReason, RecorderConfig, RegionStats, RetireReason};
use ptl_heads::{Branch, ModelConfig, Piece, PieceBody, PieceRunner, PoseModel, Scale, StemKind};
use ptl_plugins::{replay_shortfalls, PieceRegions, PieceReplay, Scope};
use ptl_trainer::fit::{ReplayPlugin, RunSummary};
use ptl_trainer::pose::{fit, PoseTrainConfig};

/// Runs every piece through `regions` (what the trainer's dispatch does for a claiming plugin).
pub struct Through<'a> {
    pub regions: &'a PieceRegions,
    pub model: &'a PoseModel,
}

impl PieceRunner for Through<'_> {
    fn run(&self, piece: Piece, inputs: &[Tensor], body: &PieceBody<'_>) -> ptl_heads::Result<Vec<Tensor>> {
        self.regions.run(self.model, piece, inputs, &self.model.piece_surface(piece), body)
    }
}

pub fn model_with_seed(dev: Device, seed: u64) -> PoseModel {
    PoseModel::new(ModelConfig { nc: 1, kpt_shape: (17, 3), scale: Scale::N }, dev, seed).expect("model")
}

pub fn model(dev: Device) -> PoseModel {
    model_with_seed(dev, 5)
}

pub fn image(dev: Device, b: usize) -> Tensor {
    let mut rng = ptl_autograd::Rng::new(3);
    Tensor::rand(vec![b, 3, 64, 64], 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).and_then(|t| t.to_device(dev)).expect("image")
}

pub fn started_with(dev: Device, config: RecorderConfig) -> PieceRegions {
    let mut r = PieceRegions::new(config);
    r.start(dev);
    r
}

pub fn started(dev: Device) -> PieceRegions {
    started_with(dev, ptl_plugins::plugin_defaults())
}

/// The backward of a step: the sum of every output.
fn backward_all(out: &ptl_heads::HeadOutput) {
    let mut total = out.one2many.boxes.sum_all().unwrap();
    for t in [&out.one2many.scores, &out.one2many.kpts, &out.one2one.boxes, &out.one2one.kpts, &out.one2one.scores] {
        total = total.add(&t.sum_all().unwrap()).unwrap();
    }
    total.backward().unwrap();
}

/// One training step through `runner`: forward + a backward through every output.
pub fn step_with(m: &PoseModel, runner: &dyn PieceRunner, x: &Tensor) -> ptl_heads::HeadOutput {
    let out = m.forward_with(x, runner).expect("forward");
    backward_all(&out);
    out
}

pub fn step(m: &PoseModel, regions: &PieceRegions, x: &Tensor) -> ptl_heads::HeadOutput {
    step_with(m, &Through { regions, model: m }, x)
}

fn stats_of(regions: &PieceRegions, p: Piece) -> RegionStats {
    regions.stats().into_iter().find(|(q, _)| *q == p).map(|(_, s)| s).unwrap_or_else(|| panic!("no region for {p}"))
}

fn stem(branch: Branch, level: usize, kind: StemKind) -> Piece {
    Piece::Stem { branch, level, kind }
}

/// Every parameter's gradient bytes, `None` where absent.
pub fn grads(m: &PoseModel) -> Vec<(String, Option<Vec<u8>>)> {
    ptl_autograd::module::named_parameters(m).into_iter().map(|(n, p)| (n, p.grad().map(|g| g.to_bytes().unwrap()))).collect()
}

pub fn clear_grads(m: &PoseModel) {
    for (_, p) in ptl_autograd::module::named_parameters(m) {
        p.set_grad(None);
    }
}

/// Names whose gradients differ (bytes or presence) between two models.
fn grad_differences(a: &PoseModel, b: &PoseModel) -> Vec<String> {
    grads(a).into_iter().zip(grads(b)).filter(|(x, y)| x.1 != y.1).map(|(x, _)| x.0).collect()
}

/// Every buffer (BatchNorm running statistics, `num_batches_tracked`) of `piece`, by name.
fn piece_buffers(m: &PoseModel, piece: Piece) -> Vec<(String, Vec<u8>)> {
    m.piece_surface(piece).iter().filter(|(_, _, k)| *k == TensorKind::Buffer).map(|(n, t, _)| (n.clone(), t.to_bytes().unwrap())).collect()
}

// ---- a. signatures ------------------------------------------------------------------------------

/// Each stem owns one bounded signature that includes its input's `requires_grad` (one-to-many stems
/// read features that require grad, one-to-one stems detached ones); a replayed differentiable
/// feature keeps `requires_grad`.
pub fn replayed_features_keep_requires_grad_and_stems_key_on_it(dev: Device) {
    let m = model(dev);
    let regions = started(dev);
    let x = image(dev, 2);
    for _ in 0..3 {
        let out = step(&m, &regions, &x);
        assert!(out.feats.iter().all(Tensor::requires_grad), "a replayed differentiable feature keeps requires_grad");
    }
    assert!(stats_of(&regions, Piece::Trunk).replays >= 2);
    for branch in Branch::ALL {
        for kind in [StemKind::Box, StemKind::Class, StemKind::Point] {
            let s = stats_of(&regions, stem(branch, 0, kind));
            assert!(s.replays >= 2 && s.live_recordings == 1 && s.captures == 1, "{branch:?} {kind:?}: one bounded signature: {s:?}");
        }
    }
    // The one-to-one stems' inputs are detached: their regions compute no input gradient, so the
    // trunk's gradient comes from the one-to-many stems alone, exactly as natively.
    let native = model(dev);
    for _ in 0..3 {
        step_with(&native, &ptl_heads::NativeRunner, &x);
    }
    assert_eq!(grad_differences(&native, &m), Vec::<String>::new(), "accumulated gradients equal native");
}

// ---- b. buffer rollback per region --------------------------------------------------------------

/// With three rolled-back warm-up iterations per capture, every region's BatchNorm statistics and
/// `num_batches_tracked` after four steps equal native's: each region restores its own buffers.
pub fn warmup_leaves_every_regions_batchnorm_statistics_as_native(dev: Device) {
    let config = RecorderConfig { warmup_iters: 3, ..ptl_plugins::plugin_defaults() };
    let regions = started_with(dev, config);
    let (native, replayed) = (model(dev), model(dev));
    let x = image(dev, 2);
    for _ in 0..4 {
        step_with(&native, &ptl_heads::NativeRunner, &x);
        step(&replayed, &regions, &x);
    }
    let pieces = Piece::all(3);
    for p in &pieces {
        assert_eq!(piece_buffers(&native, *p), piece_buffers(&replayed, *p), "{p}: buffers after warm-up rollback");
        let s = stats_of(&regions, *p);
        assert!(s.captures == 1 && s.replays >= 2, "{p} was captured and replayed: {s:?}");
    }
    // Not vacuous: three more training forwards do move the statistics.
    for _ in 0..3 {
        native.forward(&x).expect("forward");
    }
    assert!(pieces.iter().all(|p| piece_buffers(&native, *p) != piece_buffers(&replayed, *p)), "extra forwards move BN statistics");
}

// ---- c. storage, hooks, precision, pending backward: per stem -----------------------------------

/// A stem parameter whose storage moved (swapped for a copy) retires that stem's recording only;
/// the stem records again and the others keep replaying. Real graphs only: the check compares
/// device addresses; on the CPU double a buffer's identity is its tensor handle (CPU in-place ops
/// may reallocate the host vector), moved only by replacing the handle — capture's `t8` tests that.
pub fn a_moved_stem_parameter_retires_only_that_stem(dev: Device) {
    if !dev.is_cuda() {
        println!("skipping on the CPU double: storage moves are device-address checks (capture t8 covers the host logic)");
        return;
    }
    let m = model(dev);
    let regions = started(dev);
    let x = image(dev, 2);
    for _ in 0..3 {
        step(&m, &regions, &x);
    }
    let moved = stem(Branch::OneToOne, 2, StemKind::Point);
    let (name, w, _) = m.piece_surface(moved).iter().find(|(_, _, k)| *k == TensorKind::Parameter).cloned().expect("a parameter");
    let copy = w.deep_copy().expect("copy");
    w.with_storage_mut(|a| copy.with_storage_mut(|b| std::mem::swap(a, b)));
    drop(copy);
    for _ in 0..3 {
        step(&m, &regions, &x);
    }
    for (p, s) in regions.stats() {
        let storage = s.retired_for(RetireReason::Storage);
        assert_eq!(storage, (p == moved) as u64, "{p}: storage retirements {s:?}");
        if p == moved {
            assert_eq!(s.native_for(FallbackReason::Stale), 1, "{s:?}");
            assert!(s.warnings.iter().any(|w| w.contains(&name)), "the warning names {name}: {:?}", s.warnings);
            assert_eq!(s.captures, 2, "recorded again: {s:?}");
        } else {
            assert_eq!(s.replays, 5, "{p} kept replaying: {s:?}");
        }
    }
}

/// A hooked stem runs natively while hooked; the other stems replay; it replays again afterwards.
pub fn a_hooked_stem_runs_natively_alone(dev: Device) {
    let m = model(dev);
    let regions = started(dev);
    let x = image(dev, 2);
    let hooked = stem(Branch::OneToMany, 1, StemKind::Class);
    for _ in 0..3 {
        step(&m, &regions, &x);
    }
    regions.set_hooks(hooked, true);
    step(&m, &regions, &x);
    regions.set_hooks(hooked, false);
    step(&m, &regions, &x);
    for (p, s) in regions.stats() {
        assert_eq!(s.native_for(FallbackReason::Hooks), (p == hooked) as u64, "{p}: {s:?}");
        assert_eq!(s.replays, if p == hooked { 3 } else { 4 }, "{p}: {s:?}");
    }
}

/// Runs one piece under bf16 autocast (a user's mixed-precision island) and the rest as the caller does.
struct AutocastOne<'a> {
    inner: Through<'a>,
    piece: Piece,
}

impl PieceRunner for AutocastOne<'_> {
    fn run(&self, piece: Piece, inputs: &[Tensor], body: &PieceBody<'_>) -> ptl_heads::Result<Vec<Tensor>> {
        if piece == self.piece {
            // Its outputs go back to f32 outside the region, where the head concatenates them.
            let outs = ptl_autograd::autocast(Some(DType::BF16), || self.inner.run(piece, inputs, body))?;
            Ok(outs.iter().map(|t| t.to_dtype(DType::F32)).collect::<ptl_autograd::Result<_>>()?)
        } else {
            self.inner.run(piece, inputs, body)
        }
    }
}

/// A stem run under another precision retires its own recording only (recordings key on autocast).
pub fn a_precision_change_retires_only_that_stem(dev: Device) {
    let m = model(dev);
    let regions = started(dev);
    let x = image(dev, 2);
    for _ in 0..3 {
        step(&m, &regions, &x);
    }
    let changed = stem(Branch::OneToMany, 0, StemKind::Point);
    step_with(&m, &AutocastOne { inner: Through { regions: &regions, model: &m }, piece: changed }, &x);
    for (p, s) in regions.stats() {
        assert_eq!(s.retired_for(RetireReason::Precision), (p == changed) as u64, "{p}: {s:?}");
        if p != changed {
            assert_eq!(s.replays, 3, "{p} kept replaying: {s:?}");
        }
    }
}

/// A forward whose outputs are still held when the next forward comes, with only the one-to-many
/// box outputs backwarded: exactly the stems whose backward is pending run natively
/// (`PendingBackward`), each on its own; the gradients equal native's for the same sequence.
pub fn a_pending_backward_is_judged_per_stem(dev: Device) {
    let (native, m) = (model(dev), model(dev));
    let regions = started(dev);
    let x = image(dev, 2);
    let through = Through { regions: &regions, model: &m };
    let run = |model: &PoseModel, runner: &dyn PieceRunner| {
        for _ in 0..3 {
            step_with(model, runner, &x);
        }
        let held = model.forward_with(&x, runner).expect("forward");
        held.one2many.boxes.sum_all().unwrap().backward().unwrap();
        step_with(model, runner, &x);
        drop(held);
    };
    run(&native, &ptl_heads::NativeRunner);
    run(&m, &through);
    assert_eq!(grad_differences(&native, &m), Vec::<String>::new(), "gradients equal native");
    for (p, s) in regions.stats() {
        let pending = matches!(p, Piece::Stem { branch: Branch::OneToOne, .. })
            || matches!(p, Piece::Stem { branch: Branch::OneToMany, kind: StemKind::Class | StemKind::Point, .. });
        assert_eq!(s.native_for(FallbackReason::PendingBackward), pending as u64, "{p}: {s:?}");
    }
}

// ---- d. absent gradients ------------------------------------------------------------------------

/// One step whose objective reads the point outputs only when `with_points`. `materialise_zeros`
/// is the mutation: a joint head backward that feeds zeros to the unread point outputs.
fn changing_supervision_step(m: &PoseModel, runner: &dyn PieceRunner, x: &Tensor, with_points: bool, materialise_zeros: bool) {
    let out = m.forward_with(x, runner).expect("forward");
    let mut total = out.one2many.boxes.sum_all().unwrap().add(&out.one2many.scores.sum_all().unwrap()).unwrap();
    total = total.add(&out.one2one.boxes.sum_all().unwrap()).unwrap();
    let points = [out.one2many.kpts.sum_all().unwrap(), out.one2one.kpts_sigma.as_ref().unwrap().sum_all().unwrap()];
    for p in points {
        if with_points {
            total = total.add(&p).unwrap();
        } else if materialise_zeros {
            total = total.add(&p.mul_scalar(0.0).unwrap()).unwrap();
        }
    }
    total.backward().unwrap();
}

/// AdamW with weight decay: a parameter it did not skip moves even with a zero gradient.
fn adamw(m: &PoseModel) -> Box<dyn ptl_trainer::optim::Optimizer> {
    let cfg = ptl_trainer::optim::OptimizerConfig {
        name: ptl_trainer::optim::OptimizerName::AdamW,
        lr0: 1e-3,
        weight_decay: 0.05,
        ..Default::default()
    };
    ptl_trainer::optim::build_optimizer_for_module(m, &cfg).expect("optimizer")
}

fn params_and_state(m: &PoseModel, opt: &dyn ptl_trainer::optim::Optimizer) -> Vec<(String, Vec<u8>)> {
    let params = ptl_autograd::module::named_parameters(m).into_iter().map(|(n, p)| (n, p.to_bytes().unwrap()));
    params.chain(opt.state_tensors().into_iter().map(|(n, t)| (n, t.to_bytes().unwrap()))).collect()
}

/// The changing-supervision check: each step's gradients and their absence equal native, the point
/// parameters' gradients are absent on the steps without point supervision, the optimizer (AdamW with
/// weight decay) then skips exactly what native skips (parameters and state bytes equal, point
/// parameters unmoved), and the point stems replayed.
fn absent_point_gradients(dev: Device, materialise_zeros: bool) -> Result<(), String> {
    let (native_m, replay_m) = (model(dev), model(dev));
    let (mut native_opt, mut replay_opt) = (adamw(&native_m), adamw(&replay_m));
    let regions = started(dev);
    let through = Through { regions: &regions, model: &replay_m };
    let x = image(dev, 2);
    let point_bytes = |m: &PoseModel| -> Vec<Vec<u8>> {
        ptl_autograd::module::named_parameters(m)
            .into_iter()
            .filter(|(n, _)| n.contains("cv4"))
            .map(|(_, p)| p.to_bytes().unwrap())
            .collect()
    };
    for (i, with_points) in [true, true, false, true, false, false].into_iter().enumerate() {
        native_opt.zero_grad();
        replay_opt.zero_grad();
        changing_supervision_step(&native_m, &ptl_heads::NativeRunner, &x, with_points, false);
        changing_supervision_step(&replay_m, &through, &x, with_points, materialise_zeros);
        let (gn, gr) = (grads(&native_m), grads(&replay_m));
        let differ: Vec<(&String, bool, bool)> =
            gn.iter().zip(&gr).filter(|(a, b)| a.1 != b.1).map(|(a, b)| (&a.0, a.1.is_some(), b.1.is_some())).collect();
        if !differ.is_empty() {
            return Err(format!("step {i}: gradients differ from native (name, native has, replay has): {differ:?}"));
        }
        let point: Vec<&(String, Option<Vec<u8>>)> = gr.iter().filter(|(n, _)| n.contains("cv4")).collect();
        if with_points != point.iter().any(|(_, g)| g.is_some()) {
            return Err(format!("step {i}: point gradients present = {}, supervision = {with_points}", !with_points));
        }
        let before = point_bytes(&replay_m);
        native_opt.step().map_err(|e| e.to_string())?;
        replay_opt.step().map_err(|e| e.to_string())?;
        if params_and_state(&native_m, native_opt.as_ref()) != params_and_state(&replay_m, replay_opt.as_ref()) {
            return Err(format!("step {i}: parameters or optimizer state differ from native after the update"));
        }
        if !with_points && point_bytes(&replay_m) != before {
            return Err(format!("step {i}: the optimizer moved point parameters that had no gradient"));
        }
    }
    let s = stats_of(&regions, stem(Branch::OneToMany, 0, StemKind::Point));
    if s.replays < 4 {
        return Err(format!("the point stems did not replay through the changing supervision: {s:?}"));
    }
    Ok(())
}

/// Batches that do not read the point outputs run no point backward: those gradients stay absent and
/// the optimizer skips those parameters, as natively; a joint backward that materialises zeros fails
/// the same check.
pub fn unread_point_outputs_leave_point_gradients_absent_as_natively(dev: Device) {
    absent_point_gradients(dev, false).unwrap_or_else(|e| panic!("{e}"));
    let mutated = absent_point_gradients(dev, true);
    assert!(mutated.as_ref().is_err_and(|e| e.contains("gradients differ")), "materialised zeros must fail the check: {mutated:?}");
}

// ---- e, f. fit holds, clones, serialisation -----------------------------------------------------

pub fn clones_and_restored_plugins_start_without_recordings_and_fit_end_releases(dev: Device) {
    let m = model(dev);
    let plugin = PieceReplay::new(Scope::Trunk, ptl_plugins::plugin_defaults());
    let mut started = plugin.regions().clone();
    started.start(dev);
    for _ in 0..3 {
        step(&m, &started, &image(dev, 2));
    }
    assert!(!started.stats().is_empty());
    assert_eq!(started.clone().stats().len(), 0, "a clone holds no region and no recording");
    let state = plugin.state();
    let mut restored = PieceReplay::new(Scope::Trunk, RecorderConfig::default());
    restored.load_state(&state).expect("state");
    assert_eq!(restored.regions().stats().len(), 0, "a restored plugin holds no recording");
    assert_eq!(restored.regions().config(), plugin.regions().config(), "its configuration comes back");
    started.release();
    assert!(started.stats().is_empty(), "release drops every region (the fit-end hold reset)");
    plugin.on_fit_end();
}

pub fn tiny_on(dev: Device, save: &str, replay: &[&str]) -> PoseTrainConfig {
    PoseTrainConfig { device: dev, ..crate::common::tiny(&format!("inv-{}-{save}", if dev.is_cuda() { "cuda" } else { "cpu" }), replay) }
}

/// Each plugin of `plugins` replayed every step after its warm-up (the replay guard).
pub fn guard(s: &RunSummary, plugins: &[&str], steps: u64) -> Result<(), String> {
    let short: Vec<String> = plugins.iter().flat_map(|p| replay_shortfalls(s, p, steps, &[])).collect();
    if short.is_empty() {
        Ok(())
    } else {
        Err(short.join("; "))
    }
}

pub fn the_replay_guard_fails_when_nothing_replayed(dev: Device) {
    // Recording switched off: the fit is still byte-identical to native (it *is* native), and the
    // guard must say that this proves nothing.
    let mut off = tiny_on(dev, "off", &["feature", "stem"]);
    off.set("replay_config", r#"{"feature": {"enabled": false}, "stem": {"enabled": false}}"#).unwrap();
    let s = fit(&off, vec![]).expect("fit with recording off");
    assert!(guard(&s, &["feature"], 6).is_err() && guard(&s, &["stem"], 6).is_err(), "{:?}", s.replay_counters);
    let on = fit(&tiny_on(dev, "on", &["feature", "stem"]), vec![]).expect("fit");
    guard(&on, &["feature", "stem"], 6).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(on.hashes, s.hashes);
}

pub fn a_failed_fit_leaves_nothing_for_the_next_one(dev: Device) {
    let mut bad = tiny_on(dev, "fails", &["feature", "stem"]);
    bad.inject_loader_panic_at = Some((1, 1));
    assert!(fit(&bad, vec![]).is_err());
    let s = fit(&tiny_on(dev, "after", &["feature", "stem"]), vec![]).expect("the next fit");
    guard(&s, &["feature", "stem"], 6).unwrap_or_else(|e| panic!("a clean start: {e}"));
}

// ---- g. replacing the head ----------------------------------------------------------------------

pub fn replacing_the_head_retires_the_trunk_and_the_old_stems(dev: Device) {
    let mut m = model(dev);
    let regions = started(dev);
    for _ in 0..3 {
        step(&m, &regions, &image(dev, 2));
    }
    let pools = |r: &PieceRegions| r.stats().iter().map(|(_, s)| s.pool_bytes).sum::<u64>();
    let before = pools(&regions);
    assert!(before > 0, "live recordings hold pools");
    let old = m.rehead(1, (5, 3), 9).expect("re-head to 5 keypoints");
    assert_eq!(old.kpt_shape, (17, 3));
    assert_eq!(m.head().kpt_shape, (5, 3));
    // The next forward with the new head: every old recording goes before anything replays.
    let out = step(&m, &regions, &image(dev, 2));
    assert_eq!(out.one2many.kpts.dims()[1], 15);
    let stats = regions.stats();
    let (_, trunk) = stats.iter().find(|(p, _)| *p == Piece::Trunk).expect("trunk");
    assert_eq!(trunk.retired_for(RetireReason::Released), 1, "the parent feature recording retired: {trunk:?}");
    assert!(stats.iter().all(|(_, s)| s.live_recordings == 0), "no recording survives a new head");
    assert_eq!(pools(&regions), 0, "their pools were released ({before} bytes before)");
    for _ in 0..2 {
        step(&m, &regions, &image(dev, 2));
    }
    assert!(regions.stats().iter().all(|(_, s)| s.live_recordings == 1), "recorded again against the new head");
}

// ---- h. freezing --------------------------------------------------------------------------------

pub fn freezing_one_stem_retires_only_its_recording(dev: Device) {
    let m = model(dev);
    let regions = started(dev);
    for _ in 0..3 {
        step(&m, &regions, &image(dev, 2));
    }
    let frozen = stem(Branch::OneToMany, 1, StemKind::Class);
    m.set_piece_trainable(frozen, false).expect("freeze one stem");
    step(&m, &regions, &image(dev, 2));
    for (p, s) in regions.stats() {
        assert_eq!(s.retired_for(RetireReason::Trainable), (p == frozen) as u64, "{p}: {s:?}");
    }
    let w = &m.piece_surface(frozen)[0].1;
    assert!(w.grad().is_none() || !w.requires_grad(), "a frozen parameter gets no new gradient");
}

pub fn a_frozen_trunk_runs_natively_for_the_whole_fit_and_frozen_layers_do_not_move(dev: Device) {
    let cfg = PoseTrainConfig { freeze: (0..23).collect(), ..tiny_on(dev, "frozen", &["feature", "stem"]) };
    let native = fit(&PoseTrainConfig { replay: vec![], ..cfg.clone() }, vec![]).expect("native frozen fit");
    let replayed = fit(&cfg, vec![]).expect("replayed frozen fit");
    assert_eq!(native.hashes, replayed.hashes);
    assert!(
        replayed.replay_counters.get("feature").is_none_or(|c| c.as_object().is_none_or(|m| m.is_empty())),
        "the trunk was never recorded"
    );
    guard(&replayed, &["stem"], 6).unwrap_or_else(|e| panic!("the stems still replay: {e}"));
    let initial = model_with_seed(dev, 11);
    let ck = ptl_trainer::fit::load_checkpoint(&cfg.save_dir.join("weights/last.ckpt"), Device::Cpu).expect("checkpoint");
    let trained = ck.part("model");
    for (name, t, _) in initial.piece_surface(Piece::Trunk).iter().filter(|(_, _, k)| *k == TensorKind::Parameter) {
        assert_eq!(t.to_bytes().unwrap(), trained[name].to_bytes().unwrap(), "{name} moved although frozen");
    }
}

// ---- i. temporary shapes ------------------------------------------------------------------------

pub fn a_fresh_shape_runs_natively_and_replay_resumes(dev: Device) {
    let m = model(dev);
    let regions = started(dev);
    let (full, partial) = (image(dev, 2), image(dev, 1));
    for x in [&full, &full, &full, &partial, &full, &partial, &full] {
        step(&m, &regions, x);
    }
    let t = stats_of(&regions, Piece::Trunk);
    // full: warm-up, capture+replay, replay; partial: warm-up of its signature; full: replay;
    // partial: cache full (one recording per region); full: replay.
    assert_eq!(t.replays, 4, "{t:?}");
    assert_eq!(t.native_for(FallbackReason::Warmup), 2, "{t:?}");
    assert_eq!(t.native_for(FallbackReason::CacheFull), 1, "{t:?}");
}

// ---- j. mutation: dispatch off ------------------------------------------------------------------

/// The regression check of a replayed fit: the same hashes as native and every region of every
/// plugin in `replay` replayed after its warm-up.
pub fn replay_regression(dev: Device, name: &str, replay: &[&str], replay_config: Option<&str>) -> Result<(), String> {
    let native = fit(&tiny_on(dev, &format!("{name}-native"), &[]), vec![]).map_err(|e| e.to_string())?;
    let mut cfg = tiny_on(dev, name, replay);
    if let Some(c) = replay_config {
        cfg.set("replay_config", c).map_err(|e| e.to_string())?;
    }
    let s = fit(&cfg, vec![]).map_err(|e| e.to_string())?;
    if s.hashes != native.hashes {
        return Err(format!("hashes differ from native: {:?} vs {:?}", s.hashes, native.hashes));
    }
    guard(&s, replay, 6)
}

/// With the trainer's dispatch to a plugin disabled, that plugin's regression check fails (the
/// two fits are both native: equal hashes, and the guard says nothing was replayed).
pub fn the_regression_checks_fail_without_dispatch(dev: Device) {
    replay_regression(dev, "mut-ok", &["feature", "stem"], None).unwrap_or_else(|e| panic!("{e}"));
    let stem_off = replay_regression(dev, "mut-stem", &["feature", "stem"], Some(r#"{"stem": {"dispatch": false}}"#));
    assert!(stem_off.as_ref().is_err_and(|e| e.contains("stem: no region")), "{stem_off:?}");
    let feature_off = replay_regression(dev, "mut-feature", &["feature"], Some(r#"{"feature": {"dispatch": false}}"#));
    assert!(feature_off.as_ref().is_err_and(|e| e.contains("feature: no region")), "{feature_off:?}");
}

/// One `#[test]` per case on the device `$dev` (an `Option<Device>`: `None` skips, the reason printed by it).
#[macro_export]
macro_rules! invariant_tests {
    ($dev:expr) => {
        invariant_tests!(@each $dev;
            replayed_features_keep_requires_grad_and_stems_key_on_it,
            warmup_leaves_every_regions_batchnorm_statistics_as_native,
            a_moved_stem_parameter_retires_only_that_stem,
            a_hooked_stem_runs_natively_alone,
            a_precision_change_retires_only_that_stem,
            a_pending_backward_is_judged_per_stem,
            unread_point_outputs_leave_point_gradients_absent_as_natively,
            clones_and_restored_plugins_start_without_recordings_and_fit_end_releases,
            the_replay_guard_fails_when_nothing_replayed,
            a_failed_fit_leaves_nothing_for_the_next_one,
            replacing_the_head_retires_the_trunk_and_the_old_stems,
            freezing_one_stem_retires_only_its_recording,
            a_frozen_trunk_runs_natively_for_the_whole_fit_and_frozen_layers_do_not_move,
            a_fresh_shape_runs_natively_and_replay_resumes,
            the_regression_checks_fail_without_dispatch);
    };
    (@each $dev:expr; $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                if let Some(dev) = $dev {
                    cases::$case(dev);
                }
            }
        )*
    };
}

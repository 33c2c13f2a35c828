//! Host-logic invariants of the replay plugins on the CPU test double (issue "plugins I", point 3):
//! signatures with `requires_grad`, per-fit holds, clones, temporary shapes, and the replay guard
//! that keeps "equal to native" from passing when nothing was replayed.

mod common;

use ptl_autograd::{DType, Device, Tensor};
use ptl_heads::{Branch, ModelConfig, Piece, PieceBody, PieceRunner, PoseModel, Scale, StemKind};
use ptl_plugins::{PieceRegions, PieceReplay, Scope};
use ptl_trainer::fit::ReplayPlugin;
use ptl_trainer::pose::{fit, PoseTrainConfig};

struct Through<'a> {
    regions: &'a PieceRegions,
    model: &'a PoseModel,
}

impl PieceRunner for Through<'_> {
    fn run(&self, piece: Piece, inputs: &[Tensor], body: &PieceBody<'_>) -> ptl_heads::Result<Vec<Tensor>> {
        self.regions.run(self.model, piece, inputs, &self.model.piece_surface(piece), body)
    }
}

fn model() -> PoseModel {
    PoseModel::new(ModelConfig { nc: 1, kpt_shape: (17, 3), scale: Scale::N }, Device::Cpu, 5).expect("model")
}

fn image(b: usize) -> Tensor {
    let mut rng = ptl_autograd::Rng::new(3);
    Tensor::rand(vec![b, 3, 64, 64], 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).expect("image")
}

fn started() -> PieceRegions {
    let mut r = PieceRegions::new(ptl_plugins::plugin_defaults());
    r.start(Device::Cpu);
    r
}

/// One training step's forward + a backward through every output.
fn step(m: &PoseModel, regions: &PieceRegions, x: &Tensor) -> ptl_heads::HeadOutput {
    let out = m.forward_with(x, &Through { regions, model: m }).expect("forward");
    let mut total = out.one2many.boxes.sum_all().unwrap();
    for t in [&out.one2many.kpts, &out.one2one.boxes, &out.one2one.kpts, &out.one2one.scores] {
        total = total.add(&t.sum_all().unwrap()).unwrap();
    }
    total.backward().unwrap();
    out
}

#[test]
fn replayed_features_keep_requires_grad_and_stems_key_on_it() {
    let m = model();
    let regions = started();
    let x = image(2);
    for _ in 0..3 {
        let out = step(&m, &regions, &x);
        assert!(out.feats.iter().all(Tensor::requires_grad), "a replayed differentiable feature keeps requires_grad");
    }
    let stats = regions.stats();
    let get = |p: Piece| stats.iter().find(|(q, _)| *q == p).map(|(_, s)| s.clone()).expect("region");
    assert!(get(Piece::Trunk).replays >= 2);
    for branch in Branch::ALL {
        let s = get(Piece::Stem { branch, level: 0, kind: StemKind::Box });
        assert!(s.replays >= 2 && s.live_recordings == 1, "{branch:?}: one bounded signature: {s:?}");
    }
}

#[test]
fn a_fresh_shape_runs_natively_and_replay_resumes() {
    let m = model();
    let regions = started();
    let (full, partial) = (image(2), image(1));
    for x in [&full, &full, &full, &partial, &full, &partial, &full] {
        step(&m, &regions, x);
    }
    let (_, t) = regions.stats().into_iter().find(|(p, _)| *p == Piece::Trunk).expect("trunk");
    // full: warm-up, capture+replay, replay; partial: warm-up of its signature; full: replay;
    // partial: cache full (one recording per region); full: replay.
    assert_eq!(t.replays, 4, "{t:?}");
    assert_eq!(t.native_for(ptl_capture::FallbackReason::Warmup), 2, "{t:?}");
    assert_eq!(t.native_for(ptl_capture::FallbackReason::CacheFull), 1, "{t:?}");
}

#[test]
fn clones_and_restored_plugins_start_without_recordings_and_fit_end_releases() {
    let m = model();
    let plugin = PieceReplay::new(Scope::Trunk, ptl_plugins::plugin_defaults());
    let regions_of = |p: &PieceReplay| p.regions().stats().len();
    // Drive the plugin's own regions as a fit would.
    let mut started = plugin.regions().clone();
    started.start(Device::Cpu);
    for _ in 0..3 {
        step(&m, &started, &image(2));
    }
    assert!(!started.stats().is_empty());
    assert_eq!(started.clone().stats().len(), 0, "a clone holds no region and no recording");
    let state = plugin.state();
    let mut restored = PieceReplay::new(Scope::Trunk, ptl_capture::RecorderConfig::default());
    restored.load_state(&state).expect("state");
    assert_eq!(regions_of(&restored), 0, "a restored plugin holds no recording");
    assert_eq!(restored.regions().config(), plugin.regions().config(), "its configuration comes back");
    started.release();
    assert!(started.stats().is_empty(), "release drops every region (the fit-end hold reset)");
    plugin.on_fit_end();
}

fn tiny(save: &str) -> PoseTrainConfig {
    common::tiny(&format!("inv-{save}"), &["feature", "stem"])
}

/// The guard the identity tests use: every region replayed after its warm-up.
fn replayed_every_step(s: &ptl_trainer::fit::RunSummary, plugin: &str, steps: u64) -> bool {
    ptl_plugins::replay_shortfalls(s, plugin, steps, &[]).is_empty()
}

#[test]
fn the_replay_guard_fails_when_nothing_replayed() {
    // Recording switched off: the fit is still byte-identical to native (it *is* native), and the
    // guard must say that this proves nothing.
    let mut off = tiny("off");
    off.set("replay_config", r#"{"feature": {"enabled": false}, "stem": {"enabled": false}}"#).unwrap();
    let s = fit(&off, vec![]).expect("fit with recording off");
    assert!(!replayed_every_step(&s, "feature", 6) && !replayed_every_step(&s, "stem", 6), "{:?}", s.replay_counters);
    let on = fit(&tiny("on"), vec![]).expect("fit");
    assert!(replayed_every_step(&on, "feature", 6) && replayed_every_step(&on, "stem", 6), "{:?}", on.replay_counters);
    assert_eq!(on.hashes, s.hashes);
}

#[test]
fn a_failed_fit_leaves_nothing_for_the_next_one() {
    let mut bad = tiny("fails");
    bad.inject_loader_panic_at = Some((1, 1));
    assert!(fit(&bad, vec![]).is_err());
    let s = fit(&tiny("after"), vec![]).expect("the next fit");
    assert!(replayed_every_step(&s, "stem", 6), "a clean start: {:?}", s.replay_counters);
}

#[test]
fn replacing_the_head_retires_the_trunk_and_the_old_stems() {
    let mut m = model();
    let regions = started();
    for _ in 0..3 {
        step(&m, &regions, &image(2));
    }
    let pools = |r: &PieceRegions| r.stats().iter().map(|(_, s)| s.pool_bytes).sum::<u64>();
    let before = pools(&regions);
    assert!(before > 0, "live recordings hold pools");
    let old = m.rehead(1, (5, 3), 9).expect("re-head to 5 keypoints");
    assert_eq!(old.kpt_shape, (17, 3));
    assert_eq!(m.head().kpt_shape, (5, 3));
    // The next forward with the new head: every old recording goes before anything replays.
    let out = step(&m, &regions, &image(2));
    assert_eq!(out.one2many.kpts.dims()[1], 15);
    let stats = regions.stats();
    let (_, trunk) = stats.iter().find(|(p, _)| *p == Piece::Trunk).expect("trunk");
    assert_eq!(trunk.retired_for(ptl_capture::RetireReason::Released), 1, "the parent feature recording retired: {trunk:?}");
    assert!(stats.iter().all(|(_, s)| s.live_recordings == 0), "no recording survives a new head");
    assert_eq!(pools(&regions), 0, "their pools were released ({before} bytes before)");
    for _ in 0..2 {
        step(&m, &regions, &image(2));
    }
    assert!(regions.stats().iter().all(|(_, s)| s.live_recordings == 1), "recorded again against the new head");
}

#[test]
fn freezing_one_stem_retires_only_its_recording() {
    let m = model();
    let regions = started();
    for _ in 0..3 {
        step(&m, &regions, &image(2));
    }
    let frozen = Piece::Stem { branch: Branch::OneToMany, level: 1, kind: StemKind::Class };
    m.set_piece_trainable(frozen, false).expect("freeze one stem");
    step(&m, &regions, &image(2));
    for (p, s) in regions.stats() {
        let trainable_retired = s.retired_for(ptl_capture::RetireReason::Trainable);
        assert_eq!(trainable_retired, (p == frozen) as u64, "{p}: {s:?}");
    }
    let w = &m.piece_surface(frozen)[0].1;
    assert!(w.grad().is_none() || !w.requires_grad(), "a frozen parameter gets no new gradient");
}

#[test]
fn a_frozen_trunk_runs_natively_for_the_whole_fit_and_frozen_layers_do_not_move() {
    let cfg = PoseTrainConfig { freeze: (0..23).collect(), ..tiny("frozen") };
    let native = fit(&PoseTrainConfig { replay: vec![], ..cfg.clone() }, vec![]).expect("native frozen fit");
    let replayed = fit(&cfg, vec![]).expect("replayed frozen fit");
    assert_eq!(native.hashes, replayed.hashes);
    assert!(
        replayed.replay_counters.get("feature").is_none_or(|c| c.as_object().is_none_or(|m| m.is_empty())),
        "the trunk was never recorded"
    );
    assert!(replayed_every_step(&replayed, "stem", 6), "the stems still replay: {:?}", replayed.replay_counters);
    // The frozen trunk kept its initial weights.
    let initial = model_with_seed(11);
    let ck = ptl_trainer::fit::load_checkpoint(&cfg.save_dir.join("weights/last.ckpt"), Device::Cpu).expect("checkpoint");
    let trained = ck.part("model");
    for (name, t, _) in initial.piece_surface(Piece::Trunk).iter().filter(|(_, _, k)| *k == ptl_autograd::TensorKind::Parameter) {
        assert_eq!(t.to_bytes().unwrap(), trained[name].to_bytes().unwrap(), "{name} moved although frozen");
    }
}

fn model_with_seed(seed: u64) -> PoseModel {
    PoseModel::new(ModelConfig { nc: 1, kpt_shape: (17, 3), scale: Scale::N }, Device::Cpu, seed).expect("model")
}

/// Gradients of every parameter: `None` where absent.
fn grads(m: &PoseModel) -> Vec<(String, Option<Vec<u8>>)> {
    ptl_autograd::module::named_parameters(m).into_iter().map(|(n, p)| (n, p.grad().map(|g| g.to_bytes().unwrap()))).collect()
}

fn clear_grads(m: &PoseModel) {
    for (_, p) in ptl_autograd::module::named_parameters(m) {
        p.set_grad(None);
    }
}

/// One step whose objective reads the point outputs only when `with_points`.
fn changing_supervision_step(m: &PoseModel, runner: &dyn PieceRunner, x: &Tensor, with_points: bool) {
    let out = m.forward_with(x, runner).expect("forward");
    let mut total = out.one2many.boxes.sum_all().unwrap().add(&out.one2many.scores.sum_all().unwrap()).unwrap();
    total = total.add(&out.one2one.boxes.sum_all().unwrap()).unwrap();
    if with_points {
        total = total.add(&out.one2many.kpts.sum_all().unwrap()).unwrap();
        total = total.add(&out.one2one.kpts_sigma.as_ref().unwrap().sum_all().unwrap()).unwrap();
    }
    total.backward().unwrap();
}

#[test]
fn unread_point_outputs_leave_point_gradients_absent_as_natively() {
    let (native_m, replay_m) = (model(), model());
    let regions = started();
    let through = Through { regions: &regions, model: &replay_m };
    let x = image(2);
    for (i, with_points) in [true, true, false, true, false, false].into_iter().enumerate() {
        clear_grads(&native_m);
        clear_grads(&replay_m);
        changing_supervision_step(&native_m, &ptl_heads::NativeRunner, &x, with_points);
        changing_supervision_step(&replay_m, &through, &x, with_points);
        let (gn, gr) = (grads(&native_m), grads(&replay_m));
        let differ: Vec<(&String, bool, bool)> =
            gn.iter().zip(&gr).filter(|(a, b)| a.1 != b.1).map(|(a, b)| (&a.0, a.1.is_some(), b.1.is_some())).collect();
        assert!(
            differ.is_empty(),
            "step {i}: gradients (and their absence) equal native; differ (name, native has, replay has): {differ:?}"
        );
        let point_params: Vec<&(String, Option<Vec<u8>>)> = gr.iter().filter(|(n, _)| n.contains("cv4")).collect();
        if with_points {
            assert!(point_params.iter().any(|(_, g)| g.is_some()));
        } else {
            assert!(point_params.iter().all(|(_, g)| g.is_none()), "step {i}: no point backward ran, point gradients stay absent");
        }
    }
    let stats = regions.stats();
    let point =
        stats.iter().find(|(p, _)| matches!(p, Piece::Stem { kind: StemKind::Point, branch: Branch::OneToMany, level: 0 })).unwrap();
    assert!(point.1.replays >= 4, "the point stems replayed through the changing supervision: {:?}", point.1);
}

//! Fits with `replay=feature` and `replay=feature,stem` on the CPU (the recorder's test double):
//! the same bytes as native, and the counters show that every region replayed after its warm-up
//! — "equal to native" counts only with that proof.

mod common;
mod kill;
mod scaler_skip;

use common::tiny;
use ptl_plugins::{replay_shortfalls, PieceReplay};
use ptl_trainer::pose::{fit, PoseTrainConfig};

/// Every region of `plugin` replayed on every step after its warm-up (native only for warm-up),
/// forward and backward.
fn assert_replayed(s: &ptl_trainer::fit::RunSummary, plugin: &str, regions: usize, steps: u64) {
    let short = replay_shortfalls(s, plugin, steps, &[]);
    assert!(short.is_empty(), "{short:?}");
    let c = s.replay_counters[plugin].as_object().unwrap_or_else(|| panic!("no counters for {plugin}: {s:?}"));
    assert_eq!(c.len(), regions, "{plugin}: regions {:?}", c.keys().collect::<Vec<_>>());
    for (name, st) in c {
        let replays = st["replays"].as_u64().unwrap_or(0);
        assert!(st["backward_replays"].as_u64().unwrap_or(0) >= replays.min(1), "{plugin}/{name}: backward replayed too: {st}");
    }
}

/// The step plugin's regions in a fit whose batches all take one target bucket: that bucket's,
/// and the largest bucket's the data can give where the fit prepared it ahead of use (it is
/// recorded, never called).
fn step_shapes(s: &ptl_trainer::fit::RunSummary) -> usize {
    1 + usize::from(s.planned_target_slots.is_some())
}

#[test]
fn replayed_fits_equal_native_and_the_counters_prove_replay() {
    // Keep the plugin crate linked (its registrations are found through inventory).
    assert_eq!((PieceReplay::FEATURE, PieceReplay::STEM), ("feature", "stem"));
    let native = fit(&tiny("native", &[]), vec![]).expect("native fit");
    let feature = fit(&tiny("feature", &["feature"]), vec![]).expect("feature fit");
    let both = fit(&tiny("both", &["feature", "stem"]), vec![]).expect("feature+stem fit");
    assert_eq!(feature.hashes, native.hashes, "replay=feature changes no byte");
    assert_eq!(both.hashes, native.hashes, "replay=feature,stem changes no byte");
    assert_eq!(feature.metrics_per_epoch, native.metrics_per_epoch);
    let steps = 2 * 3;
    assert_replayed(&feature, "feature", 1, steps);
    assert_replayed(&both, "feature", 1, steps);
    assert_replayed(&both, "stem", 18, steps);
    assert_eq!(both.replay_cadence.get("stem"), Some(&ptl_trainer::fit::ReplayCadence::PerBatch));
    assert!(both.plugins.iter().any(|l| l.starts_with("stem: capture[")), "{:?}", both.plugins);
}

#[test]
fn a_replayed_run_resumes_to_the_native_hashes() {
    let full = fit(&tiny("resume-native", &[]), vec![]).expect("native");
    let cfg = tiny("resume-replay", &["feature", "stem"]);
    fit(&PoseTrainConfig { stop_after_epochs: Some(1), ..cfg.clone() }, vec![]).expect("first epoch");
    let last = cfg.save_dir.join("weights/last.ckpt");
    let resumed = fit(&PoseTrainConfig { resume: Some(last), ..cfg }, vec![]).expect("resumed");
    assert_eq!(resumed.hashes, full.hashes);
    assert_replayed(&resumed, "stem", 18, 3);
}

/// `replay=all` is every plugin of this crate (step, feature, stem, loss, ns, optimizer), in the stack's priority order; a name
/// listed besides it adds nothing twice (a third-party plugin stays out of it: tests/third_party.rs).
#[test]
fn replay_all_is_every_ptl_plugin() {
    use ptl_trainer::fit::{PluginStack, ALL_PLUGINS};
    assert_eq!((PieceReplay::FEATURE, PieceReplay::STEM), ("feature", "stem"));
    let none = serde_json::Map::new();
    let all = PluginStack::from_registry(&[ALL_PLUGINS.to_string()], &none).expect("replay=all");
    let named = PluginStack::from_registry(&["feature".to_string(), "stem".to_string()], &none).expect("feature,stem");
    let named_all =
        PluginStack::from_registry(&["feature", "stem", "ns", "optimizer", "loss", "step"].map(String::from), &none).expect("each named");
    assert_eq!(all.names(), named_all.names());
    assert_eq!(all.names(), vec!["step", "feature", "stem", "loss", "ns", "optimizer"], "priority order");
    let both = PluginStack::from_registry(&[ALL_PLUGINS.to_string(), "stem".to_string()], &none).expect("all,stem");
    assert_eq!(both.names(), all.names());
    assert_eq!(&named.names()[..], &all.names()[1..3]);
    let mut cfg = serde_json::Map::new();
    cfg.insert("feature".into(), serde_json::json!({}));
    assert!(PluginStack::from_registry(&[ALL_PLUGINS.to_string()], &cfg).is_ok(), "settings of a plugin that all enables");
}

#[test]
fn bad_replay_configuration_is_a_typed_error() {
    let mut cfg = tiny("badcfg", &["feature"]);
    cfg.set("replay_config", r#"{"feature": {"warmup_calls": "many"}}"#).expect("JSON parses");
    let e = fit(&cfg, vec![]).expect_err("bad field type");
    assert!(e.to_string().contains("replay_config") && e.to_string().contains("feature"), "{e}");
    let e = fit(&tiny("unknown", &["nope"]), vec![]).expect_err("unknown plugin");
    assert!(e.to_string().contains("no replay plugin named `nope`") && e.to_string().contains("stem"), "{e}");
}

#[test]
fn an_injected_capture_failure_falls_back_to_native_and_changes_no_byte() {
    let native = fit(&tiny("fail-native", &[]), vec![]).expect("native");
    let mut cfg = tiny("fail-replay", &["feature", "stem"]);
    cfg.set("replay_config", r#"{"stem": {"inject_capture_failures": 2}}"#).expect("config");
    let s = fit(&cfg, vec![]).expect("a capture failure is not a fit failure");
    assert_eq!(s.hashes, native.hashes, "the failed regions ran natively, bytes unchanged");
    let stems = s.replay_counters["stem"].as_object().expect("stem counters");
    let failed: Vec<&String> =
        stems.iter().filter(|(_, st)| st["native"]["CaptureFailed"].as_u64().unwrap_or(0) > 0).map(|(n, _)| n).collect();
    assert_eq!(failed.len(), 2, "exactly the two injected failures: {failed:?}");
    for name in &failed {
        let st = &stems[name.as_str()];
        assert_eq!(st["replays"], 0, "{name}: no recording after the failure");
        assert!(
            st["warnings"].as_array().is_some_and(|w| w.iter().any(|m| m.as_str().is_some_and(|m| m.contains(name.as_str())))),
            "{name}: warned: {st}"
        );
    }
    assert_replayed(&s, "feature", 1, 6);
    let replaying = stems.values().filter(|st| st["replays"].as_u64().unwrap_or(0) >= 5).count();
    assert_eq!(replaying, 16, "the other stems still replay");
}

/// SIGKILL-and-resume with `replay=feature,stem` on the CPU double: the resumed run ends with the
/// native hashes and its regions replay every step after their warm-up (the CUDA binary runs it
/// with `replay=all` and real graphs).
#[test]
fn a_replayed_fit_killed_and_resumed_ends_with_the_native_hashes() {
    kill::killed_and_resumed_ends_with_the_native_hashes(
        "a_replayed_fit_killed_and_resumed_ends_with_the_native_hashes",
        "cpu",
        ptl_autograd::Device::Cpu,
        kill::KillRun { replay: "feature,stem", nbs: 64 },
        &["feature", "stem"],
    );
}

/// `replay=ns`: MuSGD's Newton–Schulz groups (one region per matrix shape) replay on every
/// optimizer step after their warm-up, and the fit's bytes are native's; with the optimizer stage
/// not wrapped (`dispatch: false`) no region exists and the guard says so.
#[test]
fn ns_replay_equals_native_and_replays_every_optimizer_step() {
    use ptl_plugins::NsReplay;
    assert_eq!(NsReplay::NAME, "ns");
    let cfg = |save: &str, replay: &[&str]| PoseTrainConfig { optimizer: "MuSGD".into(), nbs: 2, ..tiny(save, replay) };
    let native = fit(&cfg("ns-native", &[]), vec![]).expect("native MuSGD fit");
    let ns = fit(&cfg("ns-replay", &["ns"]), vec![]).expect("ns fit");
    assert_eq!(ns.hashes, native.hashes, "replay=ns changes no byte");
    assert_eq!(ns.optimizer_steps, 6, "an optimizer step per batch (nbs = batch)");
    use ptl_trainer::fit::ReplayCadence;
    assert_eq!(ns.replay_cadence.get("ns"), Some(&ReplayCadence::PerOptimizerStep), "the summary says how often ns is called");
    let short = replay_shortfalls(&ns, "ns", ns.optimizer_steps, &[]);
    assert!(short.is_empty(), "{short:?}");
    let regions = ns.replay_counters["ns"].as_object().expect("ns counters");
    assert!(regions.len() >= 2, "one region per Muon matrix shape: {:?}", regions.keys().collect::<Vec<_>>());
    for (name, st) in regions {
        // A shape may come up in several parameter groups: a call per group and step.
        let replays = st["replays"].as_u64().unwrap_or(0);
        assert!(replays >= ns.optimizer_steps - 1, "{name}: every step after the first replays: {st}");
        assert_eq!(st["native"], serde_json::json!({"Warmup": 1}), "{name}: native only for its warm-up call: {st}");
    }
    let mut off = cfg("ns-off", &["ns"]);
    off.set("replay_config", r#"{"ns": {"dispatch": false}}"#).expect("JSON parses");
    let off = fit(&off, vec![]).expect("ns fit without dispatch");
    assert_eq!(off.hashes, native.hashes);
    assert!(!replay_shortfalls(&off, "ns", off.optimizer_steps, &[]).is_empty(), "the guard fails when nothing replayed");
}

/// A plugin asking for persistent gradients (registered by this test binary, as a third party
/// would): before each optimizer step it notes every parameter's gradient address.
#[derive(Clone, Default)]
struct KeepGrads {
    params: Vec<ptl_autograd::Tensor>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Vec<Option<usize>>>>>,
}

impl ptl_trainer::fit::ReplayPlugin for KeepGrads {
    fn name(&self) -> &'static str {
        "test-keep-grads"
    }
    fn persistent_gradients(&self) -> bool {
        true
    }
    fn setup(&mut self, ctx: &ptl_trainer::fit::PluginSetup<'_>) -> ptl_trainer::Result<()> {
        self.params = ctx.params.iter().map(|(_, t)| t.clone()).collect();
        Ok(())
    }
    fn around(&self, info: ptl_trainer::fit::StageInfo, next: &mut dyn FnMut() -> ptl_trainer::Result<()>) -> ptl_trainer::Result<()> {
        if info.stage == ptl_trainer::fit::Stage::OptimizerStep {
            let addrs = self.params.iter().map(|p| p.grad().map(|g| g.storage_ptr())).collect();
            self.seen.lock().unwrap().push(addrs);
        }
        next()
    }
    fn counters(&self) -> serde_json::Value {
        let seen = self.seen.lock().unwrap();
        serde_json::json!({ "steps": seen.len(), "addresses": *seen })
    }
}

inventory::submit! {
    ptl_trainer::fit::PluginRegistration { name: "test-keep-grads", in_all: false, create: |_| Ok(Box::new(KeepGrads::default())) }
}

/// Persistent gradients on request: with a plugin that asks for them, every parameter's gradient
/// has the same address at every optimizer step (allocated once), and the fit's bytes are native's.
#[test]
fn a_plugin_gets_persistent_gradients_and_the_bytes_stay_native() {
    let cfg = |save: &str, replay: &[&str]| PoseTrainConfig { nbs: 2, ..tiny(save, replay) };
    let native = fit(&cfg("keep-native", &[]), vec![]).expect("native fit");
    let kept = fit(&cfg("keep-grads", &["test-keep-grads"]), vec![]).expect("fit with persistent gradients");
    assert_eq!(kept.hashes, native.hashes, "persistent gradients change no byte");
    let c = &kept.replay_counters["test-keep-grads"];
    let steps: Vec<Vec<Option<u64>>> = serde_json::from_value(c["addresses"].clone()).expect("addresses");
    assert_eq!(steps.len() as u64, kept.optimizer_steps);
    let first = &steps[0];
    assert!(first.iter().all(Option::is_some), "every parameter has a gradient at the first step");
    for (k, s) in steps.iter().enumerate() {
        assert_eq!(s, first, "step {k}: gradient buffers moved");
    }
}

/// `replay=optimizer`: the device parts of every optimizer step (clipping with the SGD / MuSGD
/// update, and the EMA update) replay after their warm-up with the fit's bytes unchanged — the
/// learning rate, momentum and EMA decay change
/// every step of the warm-up, so a replay that froze them would differ — and with `ns` stacked
/// the fit still equals native.
#[test]
fn optimizer_replay_equals_native_and_replays_every_step() {
    use ptl_plugins::UpdateReplay;
    assert_eq!(UpdateReplay::NAME, "optimizer");
    for optimizer in ["SGD", "MuSGD"] {
        let cfg = |save: &str, replay: &[&str]| PoseTrainConfig { optimizer: optimizer.into(), nbs: 2, ..tiny(save, replay) };
        let native = fit(&cfg(&format!("upd-native-{optimizer}"), &[]), vec![]).expect("native fit");
        let upd = fit(&cfg(&format!("upd-{optimizer}"), &["optimizer"]), vec![]).expect("optimizer replay fit");
        assert_eq!(upd.hashes, native.hashes, "{optimizer}: replay=optimizer changes no byte");
        let short = replay_shortfalls(&upd, "optimizer", upd.optimizer_steps, &[]);
        assert!(short.is_empty(), "{optimizer}: {short:?}");
        let regions = upd.replay_counters["optimizer"].as_object().expect("optimizer counters");
        let mut names: Vec<&String> = regions.keys().collect();
        names.sort();
        assert_eq!(names, ["ema", "update.0"], "the EMA and one presence mask");
        if optimizer == "MuSGD" {
            let both = fit(&cfg("upd-ns", &["ns", "optimizer"]), vec![]).expect("ns + optimizer");
            assert_eq!(both.hashes, native.hashes, "ns + optimizer changes no byte");
            // Newton–Schulz runs inside the recorded update: `ns` has no region of its own then
            // (one would only ever see the warm-up), and the update still replays every step.
            assert_eq!(both.replay_counters["ns"].as_object().map(|m| m.len()), Some(0), "{}", both.replay_counters["ns"]);
            assert!(replay_shortfalls(&both, "optimizer", both.optimizer_steps, &[]).is_empty());
        }
    }
    // AdamW: its step counts live on the device too, so its update is recorded like the others.
    let cfg = |save: &str, replay: &[&str]| PoseTrainConfig { optimizer: "AdamW".into(), nbs: 2, ..tiny(save, replay) };
    let native = fit(&cfg("upd-native-adamw", &[]), vec![]).expect("native AdamW");
    let upd = fit(&cfg("upd-adamw", &["optimizer"]), vec![]).expect("AdamW with replay=optimizer");
    assert_eq!(upd.hashes, native.hashes, "AdamW: replay=optimizer changes no byte");
    let regions = upd.replay_counters["optimizer"].as_object().expect("optimizer counters");
    let mut names: Vec<&String> = regions.keys().collect();
    names.sort();
    assert_eq!(names, ["ema", "update.0"], "AdamW: the update and the EMA");
    assert!(replay_shortfalls(&upd, "optimizer", upd.optimizer_steps, &[]).is_empty());
}

/// T12 on the CPU double (the CUDA binary runs it with real graphs): see `scaler_skip`.
#[test]
fn an_injected_inf_skips_the_step_on_the_device_natively_and_replayed() {
    for optimizer in ["SGD", "MuSGD", "AdamW"] {
        let base = PoseTrainConfig { nbs: 2, ..tiny(&format!("t12-{optimizer}"), &[]) };
        scaler_skip::injected_inf_skips_the_step_on_the_device(&base, optimizer, 6);
    }
}

/// A run with `replay=optimizer,ns,feature,stem` stopped after its first epoch and resumed from
/// `last.ckpt` ends with the uninterrupted native run's hashes (the recorded optimizer step and
/// EMA start without recordings after the resume and follow the restored schedule), and the
/// persistent gradients keep their buffers through the feature and stem regions' replayed
/// backwards (a recording would go stale otherwise — the first version of this test caught it).
#[test]
fn an_optimizer_replayed_run_resumes_to_the_native_hashes() {
    let cfg = |save: &str, replay: &[&str]| PoseTrainConfig { optimizer: "MuSGD".into(), nbs: 2, ..tiny(save, replay) };
    let full = fit(&cfg("upd-resume-native", &[]), vec![]).expect("native");
    let run = cfg("upd-resume", &["feature", "stem", "ns", "optimizer"]);
    fit(&PoseTrainConfig { stop_after_epochs: Some(1), ..run.clone() }, vec![]).expect("first epoch");
    let last = run.save_dir.join("weights/last.ckpt");
    let resumed = fit(&PoseTrainConfig { resume: Some(last), ..run }, vec![]).expect("resumed");
    assert_eq!(resumed.hashes, full.hashes);
    // The resumed process made the second epoch's three steps (the counters are its own).
    assert_eq!(resumed.optimizer_steps, 6);
    let short = replay_shortfalls(&resumed, "optimizer", 3, &[]);
    assert!(short.is_empty(), "{short:?} {}", resumed.replay_counters["optimizer"]);
}

fn dense(save: &str, replay: &[&str]) -> PoseTrainConfig {
    let mut c = tiny(save, replay);
    c.set("loss_assigner", "dense").unwrap();
    c
}

/// `replay=loss` (the whole-step issue): the dense criterion recorded as one region and autograd
/// node; with the trunk and stems recorded too, a fit gives the native dense fit's bytes and the
/// loss region replays forward and backward on every step after its warm-up.
#[test]
fn loss_replay_equals_the_native_dense_fit_and_replays_every_step() {
    use ptl_plugins::LossReplay;
    let native = fit(&dense("loss-native", &[]), vec![]).expect("native dense fit");
    let loss = fit(&dense("loss-replay", &[LossReplay::NAME]), vec![]).expect("replay=loss");
    let pieces = fit(&dense("loss-pieces", &["feature", "stem", LossReplay::NAME]), vec![]).expect("replay=feature,stem,loss");
    assert_eq!(loss.hashes, native.hashes, "replay=loss changes no byte");
    assert_eq!(pieces.hashes, native.hashes, "replay=feature,stem,loss changes no byte");
    let steps = 2 * 3;
    assert_replayed(&loss, "loss", 1, steps);
    assert_replayed(&pieces, "loss", 1, steps);
    assert_replayed(&pieces, "stem", 18, steps);
    let all = ptl_trainer::fit::PluginStack::from_registry(&["all".to_string()], &serde_json::Map::new()).unwrap();
    assert!(all.names().contains(&LossReplay::NAME), "in replay=all");
}

/// `replay=step`: a step's whole forward and the dense criterion as one region (one forward and
/// one backward graph per step). Alone and as part of `replay=all` it gives the native dense
/// fit's bytes, replays on every step after its warm-up, and leaves the trunk, stem and loss
/// plugins nothing to record; on the host criterion (the CPU default) it records nothing and the
/// pieces replay as before.
#[test]
fn step_replay_equals_the_native_dense_fit_and_replays_every_step() {
    use ptl_plugins::LossReplay;
    let native = fit(&dense("step-native", &[]), vec![]).expect("native dense fit");
    let step = fit(&dense("step-replay", &[LossReplay::STEP]), vec![]).expect("replay=step");
    let every = fit(&dense("step-all", &["all"]), vec![]).expect("replay=all, dense");
    assert_eq!(step.hashes, native.hashes, "replay=step changes no byte");
    assert_eq!(every.hashes, native.hashes, "replay=all changes no byte");
    let steps = 2 * 3;
    assert_replayed(&step, LossReplay::STEP, step_shapes(&step), steps);
    assert_replayed(&every, LossReplay::STEP, step_shapes(&every), steps);
    assert_eq!(every.replay_cadence.get(LossReplay::STEP), Some(&ptl_trainer::fit::ReplayCadence::OnePerBatch));
    for idle in ["feature", "stem", "loss"] {
        let regions = every.replay_counters.get(idle).and_then(|c| c.as_object()).map_or(0, |m| m.len());
        assert_eq!(regions, 0, "{idle} recorded beside the step region: {:?}", every.replay_counters.get(idle));
    }
    // The host criterion: no step region, the pieces replay.
    let host = fit(&tiny("step-host", &["all"]), vec![]).expect("replay=all, host loss");
    let regions = host.replay_counters.get(LossReplay::STEP).and_then(|c| c.as_object()).map_or(0, |m| m.len());
    assert_eq!(regions, 0, "{:?}", host.replay_counters.get(LossReplay::STEP));
    assert_replayed(&host, "stem", 18, steps);
}

/// Host reads (the backend's counters, this thread) between a batch's start and end hooks.
#[derive(Clone, Default)]
struct ReadsPerStep {
    at_start: Option<ptl_autograd::HostReads>,
    steps: std::sync::Arc<std::sync::Mutex<Vec<ptl_autograd::HostReads>>>,
}

impl ptl_trainer::fit::Callback for ReadsPerStep {
    fn on_train_batch_start(&mut self, _: &ptl_trainer::fit::LoopView) {
        self.at_start = Some(ptl_autograd::host_reads_on_this_thread());
    }
    fn on_train_batch_end(&mut self, _: &ptl_trainer::fit::LoopView) {
        if let Some(s) = self.at_start.take() {
            self.steps.lock().unwrap().push(ptl_autograd::host_reads_on_this_thread().since(&s));
        }
    }
}

/// With every region recorded (`replay=all`, dense loss: the step region) a step after the
/// warm-up reads nothing back synchronously on the CPU test double either: one deferred read of
/// its loss values.
#[test]
fn a_replayed_dense_step_reads_nothing_back() {
    let cfg = dense("loss-reads", &["all"]);
    let reads = ReadsPerStep::default();
    let s = fit(&cfg, vec![Box::new(reads.clone())]).expect("replay=all,loss");
    let steps = reads.steps.lock().unwrap().clone();
    assert_eq!(steps.len(), 6);
    // After the first step (the regions' warm-up and the constants' uploads).
    for (i, r) in steps.iter().enumerate().skip(1) {
        assert_eq!((r.immediate, r.deferred), (0, 1), "step {i}: {r:?}");
    }
    assert_replayed(&s, ptl_plugins::LossReplay::STEP, step_shapes(&s), 6);
}

/// Two ranks of a data-parallel group (threads of one process) replaying their regions end with
/// the native group's bytes on every rank: the gradients are averaged natively between the
/// replayed backward and the update, into the gradients' own buffers. The counters show every
/// region replayed after its warm-up on both ranks: the trunk and the stems (`feature,stem`), and
/// a step's forward and dense loss as one region with the update recorded too (`all` with
/// `loss_assigner=dense`), the sum over the ranks inside the recorded update.
#[test]
fn a_replayed_data_parallel_group_equals_the_native_group() {
    use ptl_trainer::distributed::ThreadGroup;
    use ptl_trainer::pose::fit_data_parallel;
    let on_two_ranks = |cfg: PoseTrainConfig| -> Vec<ptl_trainer::fit::RunSummary> {
        let handles: Vec<_> = ThreadGroup::new(2)
            .expect("a group")
            .into_iter()
            .map(|c| {
                let cfg = cfg.clone();
                std::thread::spawn(move || fit_data_parallel(&cfg, vec![], Box::new(c)).expect("rank fit"))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    };
    let group = |save: &str, replay: &[&str]| PoseTrainConfig { batch: 4, ..tiny(save, replay) };
    let native = on_two_ranks(group("dp-native", &[]));
    let replayed = on_two_ranks(group("dp-replayed", &["feature", "stem"]));
    for (n, r) in native.iter().zip(&replayed) {
        assert_eq!(r.hashes, n.hashes, "each rank's bytes as in the native group");
        assert_replayed(r, "feature", 1, 2 * 2);
        assert_replayed(r, "stem", 18, 2 * 2);
    }
    assert_eq!(replayed[0].hashes.model, replayed[1].hashes.model, "one model on both ranks");
    // An update every step (nbs = the global batch): the sum over the ranks runs inside the
    // recorded update, which replays from its second call on.
    let dense = |save: &str, replay: &[&str]| PoseTrainConfig { loss_assigner: "dense".into(), nbs: 4, ..group(save, replay) };
    let dense_native = on_two_ranks(dense("dp-dense-native", &[]));
    for (n, r) in dense_native.iter().zip(&on_two_ranks(dense("dp-all", &["all"]))) {
        assert_eq!(r.hashes, n.hashes, "replay=all: each rank's bytes as in the native group");
        assert_replayed(r, "step", step_shapes(r), 2 * 2);
        assert_eq!(r.optimizer_steps, 2 * 2);
        let short = replay_shortfalls(r, "optimizer", r.optimizer_steps, &[]);
        assert!(short.is_empty(), "optimizer: {short:?}");
    }
}

/// A rank's collective whose log the test reads after the fit.
struct Tap(std::sync::Arc<ptl_trainer::distributed::LoggedCollective<ptl_trainer::distributed::ThreadCollective>>);

impl ptl_trainer::distributed::Collective for Tap {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world(&self) -> usize {
        self.0.world()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> ptl_trainer::Result<()> {
        self.0.all_reduce_sum(buf)
    }
    fn all_reduce_max(&self, buf: &mut [u64]) -> ptl_trainer::Result<()> {
        self.0.all_reduce_max(buf)
    }
}

/// Two ranks, each with its own settings, through logged collectives: the summaries and what
/// each rank issued.
fn on_two_logged_ranks(cfgs: [PoseTrainConfig; 2]) -> (Vec<ptl_trainer::fit::RunSummary>, Vec<Vec<String>>) {
    use ptl_trainer::distributed::{LoggedCollective, ThreadGroup};
    let taps: Vec<_> = ThreadGroup::new(2).expect("a group").into_iter().map(|c| std::sync::Arc::new(LoggedCollective::new(c))).collect();
    let handles: Vec<_> = taps
        .iter()
        .zip(cfgs)
        .map(|(t, cfg)| {
            let tap = Tap(t.clone());
            std::thread::spawn(move || ptl_trainer::pose::fit_data_parallel(&cfg, vec![], Box::new(tap)).expect("rank fit"))
        })
        .collect();
    let summaries = handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect();
    (summaries, taps.iter().map(|t| t.issued().iter().map(|c| format!("{c:?}")).collect()).collect())
}

/// A recording that fails on one rank alone — its update and its step region, whose update sums
/// the gradients over the ranks — leaves that rank running those regions natively while the
/// other replays them: both still issue the same collectives in the same order, and both end
/// with the native group's bytes.
#[test]
fn a_capture_failure_on_one_rank_keeps_the_ranks_collectives_in_step() {
    let group = |save: &str, replay: &[&str]| PoseTrainConfig { batch: 4, nbs: 4, loss_assigner: "dense".into(), ..tiny(save, replay) };
    // Run folder names of one length: the first agreement carries the run folder's path. The
    // native group sums after backward, as a replayed step does (`overlap_all_reduce=false`).
    let native_group = |save: &str| PoseTrainConfig { overlap_all_reduce: false, ..group(save, &[]) };
    let (native, native_log) = on_two_logged_ranks([native_group("dp-fail-nat"), native_group("dp-fail-nat")]);
    let (_, recorded_log) = on_two_logged_ranks([group("dp-okay-all", &["all"]), group("dp-okay-all", &["all"])]);
    assert_eq!(recorded_log[0], native_log[0], "recording issues no collective of its own (none in a warm-up)");
    let mut failing = group("dp-fail-all", &["all"]);
    failing
        // The step plugin's first capture is the largest bucket's, prepared ahead of use: two
        // failures reach the step shape the rank calls.
        .set("replay_config", r#"{"optimizer": {"inject_capture_failures": 1}, "step": {"inject_capture_failures": 2}}"#)
        .expect("config");
    let (replayed, log) = on_two_logged_ranks([failing, group("dp-fail-all", &["all"])]);
    assert!(!log[0].is_empty() && log[0] == log[1], "the ranks issued different collectives: {log:?}");
    assert_eq!(log[0], native_log[0], "the collectives of the native group");
    for (n, r) in native.iter().zip(&replayed) {
        assert_eq!(r.hashes, n.hashes, "each rank's bytes as in the native group");
    }
    let failed = |s: &ptl_trainer::fit::RunSummary, plugin: &str| -> u64 {
        s.replay_counters[plugin].as_object().map_or(0, |m| m.values().map(|st| st["native"]["CaptureFailed"].as_u64().unwrap_or(0)).sum())
    };
    assert!(
        failed(&replayed[0], "optimizer") > 0 && failed(&replayed[0], "step") > 0,
        "rank 0's injected failures: {:?}",
        replayed[0].replay_counters
    );
    assert_eq!(failed(&replayed[1], "optimizer") + failed(&replayed[1], "step"), 0, "rank 1 recorded");
    assert_replayed(&replayed[1], "step", step_shapes(&replayed[1]), 2 * 2);
    let short = replay_shortfalls(&replayed[1], "optimizer", replayed[1].optimizer_steps, &[]);
    assert!(short.is_empty(), "rank 1's optimizer: {short:?}");
}

/// A rank that records its update while the other still runs it natively (rank 0 records at the
/// second call, rank 1 at the third): the recording's warm-up issues no collective, so both ranks
/// issue one gradient sum per update, as the native group does, and end with its bytes.
#[test]
fn a_rank_recording_alone_stays_in_step_with_the_others() {
    let group =
        |save: &str, replay: &[&str]| PoseTrainConfig { batch: 4, nbs: 4, epochs: 3, loss_assigner: "dense".into(), ..tiny(save, replay) };
    // The native group sums after backward, as the replayed updates do (`overlap_all_reduce=false`).
    let native_group = |save: &str| PoseTrainConfig { overlap_all_reduce: false, ..group(save, &[]) };
    let (native, native_log) = on_two_logged_ranks([native_group("dp-late-nat"), native_group("dp-late-nat")]);
    let ranks = [1, 2].map(|warmup_calls| {
        let mut cfg = group("dp-late-all", &["optimizer"]);
        cfg.set("replay_config", &format!(r#"{{"optimizer": {{"warmup_calls": {warmup_calls}}}}}"#)).expect("config");
        cfg
    });
    let (replayed, log) = on_two_logged_ranks(ranks);
    assert!(!log[0].is_empty() && log[0] == log[1], "the ranks issued different collectives: {log:?}");
    assert_eq!(log[0], native_log[0], "the collectives of the native group");
    for (n, r) in native.iter().zip(&replayed) {
        assert_eq!(r.hashes, n.hashes, "each rank's bytes as in the native group");
    }
    // Each rank's regions (the update's and the EMA's) replayed every call after their warm-up,
    // each of rank 0's once more than rank 1's: it recorded a call earlier, while rank 1 still
    // ran natively.
    let replays: Vec<std::collections::BTreeMap<String, u64>> = replayed
        .iter()
        .map(|r| {
            let short = replay_shortfalls(r, "optimizer", r.optimizer_steps, &[]);
            assert!(short.is_empty(), "optimizer: {short:?}");
            let regions = r.replay_counters["optimizer"].as_object().expect("optimizer counters");
            regions.iter().map(|(name, st)| (name.clone(), st["replays"].as_u64().unwrap_or(0))).collect()
        })
        .collect();
    assert!(!replays[0].is_empty() && replays[0].keys().eq(replays[1].keys()), "{replays:?}");
    for (name, n) in &replays[0] {
        assert_eq!(*n, replays[1][name] + 1, "{name}: rank 0 recorded one call before rank 1: {replays:?}");
    }
}

/// Ranks whose batches need different target buckets — two training images, one of 3 people and
/// one of 12, one image per rank and step, dealt anew every epoch — agree on the larger count
/// every step: both ranks record one step shape (bucket 16), replay it on every later step, end
/// with one model, and issue the same collectives in the same order (the agreement's max, the
/// update's, the gradient sums).
#[test]
fn ranks_with_different_buckets_record_one_step_shape_and_issue_the_same_collectives() {
    use std::sync::Arc;

    use ptl_trainer::distributed::{LoggedCollective, ThreadCollective, ThreadGroup};
    use ptl_trainer::pose::fit_data_parallel;

    let dir = common::scratch("dp-buckets");
    let opts = ptl_data::SynthOptions {
        out: dir.join("ds"),
        train: 2,
        background: 0,
        val: 2,
        imgsz: 64,
        seed: 9,
        threads: 1,
        ..Default::default()
    };
    let set = ptl_data::synth_generate(&opts).expect("synthetic dataset");
    let labels = dir.join("ds/labels/train");
    let mut files: Vec<_> = std::fs::read_dir(&labels).expect("labels").flatten().map(|e| e.path()).collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    common::write_people(&files[0], 3);
    common::write_people(&files[1], 12);
    let epochs = 4;
    let cfg = PoseTrainConfig {
        data: set.yaml,
        epochs,
        batch: 2,
        nbs: 2,
        mosaic: 0.0,
        translate: 0.0,
        scale: 0.0,
        loss_assigner: "dense".into(),
        ..tiny("dp-buckets-run", &["all"])
    };
    let taps: Vec<Arc<LoggedCollective<ThreadCollective>>> =
        ThreadGroup::new(2).expect("a group").into_iter().map(|c| Arc::new(LoggedCollective::new(c))).collect();
    let handles: Vec<_> = taps
        .iter()
        .map(|t| {
            let (cfg, tap) = (cfg.clone(), Tap(t.clone()));
            std::thread::spawn(move || fit_data_parallel(&cfg, vec![], Box::new(tap)).expect("rank fit"))
        })
        .collect();
    let summaries: Vec<_> = handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect();
    let logs: Vec<_> = taps.iter().map(|t| t.issued()).collect();
    assert!(!logs[0].is_empty() && logs[0] == logs[1], "the ranks issued different collectives: {logs:?}");
    assert_eq!(summaries[0].hashes.model, summaries[1].hashes.model, "one model on both ranks");
    for s in &summaries {
        // One step per epoch; one recorded step shape, replayed after its warm-up.
        assert_replayed(s, ptl_plugins::LossReplay::STEP, step_shapes(s), epochs as u64);
        assert_eq!(s.dense_loss_fallbacks, 0);
    }
}

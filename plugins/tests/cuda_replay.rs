//! Real CUDA graphs in real fits: native vs `replay=feature` vs `replay=feature,stem` in every
//! precision, and `replay=ns` / `replay=all` in bf16 — identical hashes, and every region replayed
//! on every step after its warm-up.
//! Without a usable GPU the test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use ptl_autograd::Device;
use ptl_plugins::{replay_shortfalls, PieceReplay};
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

mod common;
use common::cuda_fit_cfg;

fn gpu() -> Option<Device> {
    ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
}

#[test]
fn cuda_replay_equals_native_in_every_precision() {
    let Some(dev) = gpu() else { return };
    assert_eq!((PieceReplay::FEATURE, PieceReplay::STEM), ("feature", "stem"));
    let dir = std::env::temp_dir().join(format!("ptl-cuda-replay-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 40, 10);
    for precision in [Precision::F32, Precision::Bf16Mixed, Precision::F16Mixed] {
        let run = |replay: &[&str]| {
            let save = dir.join(format!("{}-{}", precision.name(), replay.join("+")));
            let cfg = PoseTrainConfig { precision, ..cuda_fit_cfg(&data, dev, 3, replay, save) };
            fit(&cfg, vec![]).expect("fit")
        };
        let native = run(&[]);
        let feature = run(&["feature"]);
        let both = run(&["feature", "stem"]);
        assert_eq!(feature.hashes, native.hashes, "{}: replay=feature", precision.name());
        assert_eq!(both.hashes, native.hashes, "{}: replay=feature,stem", precision.name());
        let steps = 20u64;
        for (s, plugin, regions) in [(&feature, "feature", 1), (&both, "feature", 1), (&both, "stem", 18)] {
            assert_eq!(s.replay_counters[plugin].as_object().map(|c| c.len()), Some(regions), "{}: {plugin}", precision.name());
            let short = replay_shortfalls(s, plugin, steps, &[]);
            assert!(short.is_empty(), "{}: {short:?}", precision.name());
        }
        println!("ok cuda replay {}: {}", precision.name(), both.plugins.join(" || ").chars().take(300).collect::<String>());
    }
}

/// `replay=ns` and `replay=all` (feature, stem, ns, optimizer) on real CUDA graphs, MuSGD stepping
/// every batch (nbs = batch): the hashes of native; under `ns` every Newton–Schulz group replayed on
/// every optimizer step after its warm-up; under `all` the recorded update (Newton–Schulz inside
/// it) on every optimizer step and the model's regions on every batch.
#[test]
fn cuda_ns_replay_equals_native() {
    let Some(dev) = gpu() else { return };
    assert_eq!(ptl_plugins::NsReplay::NAME, "ns");
    let dir = std::env::temp_dir().join(format!("ptl-cuda-ns-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    let run = |replay: &[&str]| {
        let save = dir.join(format!("ns-{}", replay.join("+")));
        let cfg = PoseTrainConfig { nbs: 2, precision: Precision::Bf16Mixed, ..cuda_fit_cfg(&data, dev, 5, replay, save) };
        fit(&cfg, vec![]).expect("fit")
    };
    let native = run(&[]);
    let ns = run(&["ns"]);
    let all = run(&["all"]);
    assert_eq!(ns.hashes, native.hashes, "replay=ns");
    assert_eq!(all.hashes, native.hashes, "replay=all");
    let batches = 12u64;
    assert_eq!(ns.optimizer_steps, batches, "a step per batch");
    // On a GPU the criterion is dense by default: `all` records a step's forward and loss as one
    // region (`step`).
    for (s, plugin, calls) in [(&ns, "ns", ns.optimizer_steps), (&all, "optimizer", all.optimizer_steps), (&all, "step", batches)] {
        let short = replay_shortfalls(s, plugin, calls, &[]);
        assert!(short.is_empty(), "{plugin}: {short:?}");
    }
    println!("ok cuda ns replay: {}", ns.plugins.join(" || ").chars().take(300).collect::<String>());
}

/// `replay=optimizer` on real CUDA graphs (docs/capture.md T11): the recorded update follows the
/// warm-up's learning-rate and momentum schedule (written to the device before each replay) and
/// the fit ends with native's hashes, SGD, MuSGD and AdamW (its bias corrections from device step
/// counts) in bf16, every step after the first replayed.
#[test]
fn cuda_optimizer_replay_follows_the_lr_schedule() {
    let Some(dev) = gpu() else { return };
    assert_eq!(ptl_plugins::UpdateReplay::NAME, "optimizer");
    let dir = std::env::temp_dir().join(format!("ptl-cuda-upd-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    for optimizer in ["SGD", "MuSGD", "AdamW"] {
        let run = |replay: &[&str]| {
            let save = dir.join(format!("upd-{optimizer}-{}", replay.join("+")));
            let cfg = PoseTrainConfig {
                nbs: 2,
                precision: Precision::Bf16Mixed,
                optimizer: optimizer.into(),
                ..cuda_fit_cfg(&data, dev, 6, replay, save)
            };
            fit(&cfg, vec![]).expect("fit")
        };
        let native = run(&[]);
        let upd = run(&["optimizer"]);
        assert_eq!(upd.hashes, native.hashes, "{optimizer}: replay=optimizer");
        let short = replay_shortfalls(&upd, "optimizer", upd.optimizer_steps, &[]);
        assert!(short.is_empty(), "{optimizer}: {short:?}");
        println!("ok cuda optimizer replay {optimizer}: {}", upd.plugins.join(" || ").chars().take(300).collect::<String>());
    }
}

/// A bf16 fit's bytes do not depend on what ran before it in the process: native gives the same
/// hashes first and after a 32-true fit (native and `replay=all`, TF32 convolutions), and
/// `replay=optimizer` after them gives those hashes too. (Named to run first: the tests of this
/// file run in one process, in name order, and the later ones each start with a 32-true fit.)
#[test]
fn cuda_a_bf16_fit_keeps_its_bytes_after_a_32_true_fit() {
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-order-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    let run = |precision: Precision, replay: &[&str], tag: &str| {
        let save = dir.join(format!("order-{tag}"));
        let cfg = PoseTrainConfig { nbs: 2, precision, optimizer: "SGD".into(), ..cuda_fit_cfg(&data, dev, 6, replay, save) };
        fit(&cfg, vec![]).expect("fit")
    };
    let first = run(Precision::Bf16Mixed, &[], "bf16-first");
    run(Precision::F32, &[], "f32-native");
    run(Precision::F32, &["all"], "f32-all");
    let again = run(Precision::Bf16Mixed, &[], "bf16-again");
    let upd = run(Precision::Bf16Mixed, &["optimizer"], "bf16-optimizer");
    assert_eq!(again.hashes, first.hashes, "bf16 native after 32-true fits differs from bf16 native first in the process");
    assert_eq!(upd.hashes, first.hashes, "bf16 replay=optimizer after 32-true fits");
    let short = replay_shortfalls(&upd, "optimizer", upd.optimizer_steps, &[]);
    assert!(short.is_empty(), "{short:?}");
    println!("ok cuda bf16 after 32-true: {}", &first.hashes.model[..16]);
}

/// `replay=all` against native in 32-true, bf16-mixed and 16-mixed, MuSGD stepping every batch:
/// identical hashes, and every region of every plugin replayed after its warm-up (the update's
/// unscale and in-graph skip decision under 16-mixed included).
#[test]
fn cuda_all_replay_equals_native_in_every_precision() {
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-all-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    for precision in [Precision::F32, Precision::Bf16Mixed, Precision::F16Mixed] {
        let run = |replay: &[&str]| {
            let save = dir.join(format!("all-{}-{}", precision.name(), replay.join("+")));
            let cfg = PoseTrainConfig { nbs: 2, precision, ..cuda_fit_cfg(&data, dev, 8, replay, save) };
            fit(&cfg, vec![]).expect("fit")
        };
        let native = run(&[]);
        let all = run(&["all"]);
        assert_eq!(all.hashes, native.hashes, "{}: replay=all", precision.name());
        for (plugin, calls) in [("optimizer", all.optimizer_steps), ("step", 12)] {
            let short = replay_shortfalls(&all, plugin, calls, &[]);
            assert!(short.is_empty(), "{} {plugin}: {short:?}", precision.name());
        }
        let upd = all.replay_counters["optimizer"].as_object().map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
        println!("ok cuda all {}: optimizer regions {upd:?}", precision.name());
    }
}

/// Channels-last activations (`channels_last=true`: cuDNN's NHWC convolutions, the channels-last
/// batch norm, cat/split, pooling, upsampling and element-wise kernels): `replay=all` equals
/// native in bf16-mixed and 32-true with every region replayed after its warm-up. (Its bytes are
/// not the contiguous fit's: the kernels sum in other orders.)
#[test]
fn cuda_channels_last_replay_equals_native() {
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-cl-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    for precision in [Precision::Bf16Mixed, Precision::F32] {
        let run = |replay: &[&str]| {
            let save = dir.join(format!("cl-{}-{}", precision.name(), replay.join("+")));
            let cfg = PoseTrainConfig { nbs: 2, precision, channels_last: true, ..cuda_fit_cfg(&data, dev, 8, replay, save) };
            fit(&cfg, vec![]).expect("fit")
        };
        let native = run(&[]);
        let all = run(&["all"]);
        assert_eq!(all.hashes, native.hashes, "{}: channels-last replay=all", precision.name());
        for (plugin, calls) in [("optimizer", all.optimizer_steps), ("step", 12)] {
            let short = replay_shortfalls(&all, plugin, calls, &[]);
            assert!(short.is_empty(), "{} {plugin}: {short:?}", precision.name());
        }
        println!("ok cuda channels-last {}: replay=all = native, hashes {:?}", precision.name(), native.hashes);
    }
}

/// Planned arenas (buffers of one recording share bytes where the warm-up's lifetimes did not
/// meet) with every fresh allocation poisoned — arena pieces on every replay too: `replay=all`
/// still ends with native's bytes, every region replaying after its warm-up, and the replayed
/// fit's peak is printed next to native's and to the summed (unplanned) arenas'.
#[test]
fn cuda_planned_arenas_poisoned_replay_equals_native() {
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-plan-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    ptl_autograd::internal::cuda::set_poison_allocations(true);
    let run = |replay: &[&str], cfg_json: serde_json::Value, name: &str| {
        let save = dir.join(name);
        let mut cfg = PoseTrainConfig { nbs: 2, precision: Precision::Bf16Mixed, ..cuda_fit_cfg(&data, dev, 8, replay, save) };
        cfg.replay_config = cfg_json.as_object().cloned().unwrap_or_default();
        fit(&cfg, vec![]).expect("fit")
    };
    let native = run(&[], serde_json::json!({}), "native");
    let plans = |on: bool| -> serde_json::Value {
        ["step", "optimizer", "loss", "feature", "stem", "ns"]
            .iter()
            .map(|p| (p.to_string(), serde_json::json!({ "plan_arenas": on })))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let planned = run(&["all"], plans(true), "planned");
    let summed = run(&["all"], plans(false), "summed");
    ptl_autograd::internal::cuda::set_poison_allocations(false);
    assert_eq!(planned.hashes, native.hashes, "planned arenas, poisoned");
    assert_eq!(summed.hashes, native.hashes, "summed arenas, poisoned");
    for s in [&planned, &summed] {
        for (plugin, calls) in [("optimizer", s.optimizer_steps), ("step", 12)] {
            let short = replay_shortfalls(s, plugin, calls, &[]);
            assert!(short.is_empty(), "{plugin}: {short:?}");
        }
    }
    let mib = |b: Option<u64>| b.map_or(f64::NAN, |b| b as f64 / 1048576.0);
    // The recordings' arenas and static buffers, summed over every region of every plugin.
    let pool_bytes = |s: &ptl_trainer::fit::RunSummary| -> u64 {
        let plugins = s.replay_counters.values();
        plugins.flat_map(|p| p.as_object().into_iter().flat_map(|m| m.values())).filter_map(|r| r["pool_bytes"].as_u64()).sum()
    };
    let pools = |s: &ptl_trainer::fit::RunSummary| mib(Some(pool_bytes(s)));
    let placed = |s: &ptl_trainer::fit::RunSummary, key: &str| -> u64 {
        let plugins = s.replay_counters.values();
        plugins.flat_map(|p| p.as_object().into_iter().flat_map(|m| m.values())).filter_map(|r| r[key].as_u64()).sum()
    };
    println!(
        "arena placements: planned {} in place, {} in the tail; summed {} / {}",
        placed(&planned, "arena_planned"),
        placed(&planned, "arena_tail"),
        placed(&summed, "arena_planned"),
        placed(&summed, "arena_tail")
    );
    println!(
        "ok cuda planned arenas (poisoned): peak allocated native {:.1} MiB, replay=all planned {:.1} MiB (pools {:.1}; peak during {}), summed {:.1} MiB (pools {:.1})",
        mib(native.peak_allocated_bytes),
        mib(planned.peak_allocated_bytes),
        pools(&planned),
        planned.peak_allocated_during.as_deref().unwrap_or("?"),
        mib(summed.peak_allocated_bytes),
        pools(&summed)
    );
    assert!(pool_bytes(&planned) > 0 && pool_bytes(&planned) < pool_bytes(&summed), "planning shrinks the arenas");
    // Plans come from traced captures, which the real captures repeat: none overflows its plan.
    assert_eq!(placed(&planned, "arena_replans"), 0, "a planned capture was made again unplanned");
}

mod scaler_skip;

/// docs/capture.md T12 on real CUDA graphs, SGD, MuSGD and AdamW: see `scaler_skip`.
#[test]
fn cuda_t12_an_injected_inf_skips_the_step_on_the_device() {
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-t12-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 16, 4);
    for optimizer in ["SGD", "MuSGD", "AdamW"] {
        // (scaler_skip sets the precision, optimizer and replay of each of its runs.)
        let base = PoseTrainConfig { nbs: 2, ..cuda_fit_cfg(&data, dev, 9, &[], dir.clone()) };
        let s = scaler_skip::injected_inf_skips_the_step_on_the_device(&base, optimizer, 8);
        println!("ok cuda T12 {optimizer}: {}", s.plugins.join(" || ").chars().take(300).collect::<String>());
    }
}

// ---- kill-and-resume with replay on ------------------------------------------------------------

mod kill;

/// SIGKILLs a `replay=all` bf16 fit (an optimizer step every batch) three times mid-run (CUDA
/// graphs live), each time after it wrote a new checkpoint, resumes it from `last.ckpt` each time,
/// and lets the last process finish: its hashes equal an uninterrupted native fit's, and the last
/// process's step (forward and dense loss) and optimizer regions replayed every call after their
/// warm-up.
#[test]
fn cuda_replayed_fit_killed_and_resumed_ends_with_the_native_hashes() {
    let Some(dev) = gpu() else { return };
    kill::killed_and_resumed_ends_with_the_native_hashes(
        "cuda_replayed_fit_killed_and_resumed_ends_with_the_native_hashes",
        "cuda",
        dev,
        kill::KillRun { replay: "all", nbs: 2 },
        &["step", "optimizer"],
    );
}

/// `replay=loss` and `replay=step` on real CUDA graphs (the whole-step issue), in 32-true,
/// bf16-mixed and 16-mixed: the dense criterion recorded as one region beside the trunk and stem
/// regions (`replay=feature,stem,loss`), and a step's whole forward and criterion recorded as one
/// region (`replay=all`: the step region, the recorded update): the hashes of the native dense fit,
/// and every region replayed on every batch (optimizer step) after its warm-up.
#[test]
fn cuda_loss_replay_equals_native() {
    let Some(dev) = gpu() else { return };
    assert_eq!((ptl_plugins::LossReplay::NAME, ptl_plugins::LossReplay::STEP), ("loss", "step"));
    let dir = std::env::temp_dir().join(format!("ptl-cuda-loss-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    for precision in [Precision::Bf16Mixed, Precision::F32, Precision::F16Mixed] {
        let run = |replay: &[&str]| {
            let save = dir.join(format!("loss-{precision:?}-{}", replay.join("+")));
            let mut cfg = PoseTrainConfig { nbs: 2, precision, ..cuda_fit_cfg(&data, dev, 5, replay, save) };
            cfg.set("loss_assigner", "dense").expect("dense");
            fit(&cfg, vec![]).expect("fit")
        };
        let native = run(&[]);
        let pieces = run(&["feature", "stem", "loss"]);
        let every = run(&["all"]);
        assert_eq!(pieces.hashes, native.hashes, "{precision:?}: replay=feature,stem,loss");
        assert_eq!(every.hashes, native.hashes, "{precision:?}: replay=all");
        let batches = 12u64;
        for (s, plugin, calls) in [
            (&pieces, "loss", batches),
            (&pieces, "feature", batches),
            (&pieces, "stem", batches),
            (&every, "step", batches),
            (&every, "optimizer", every.optimizer_steps),
        ] {
            let short = replay_shortfalls(s, plugin, calls, &[]);
            assert!(short.is_empty(), "{precision:?} {plugin}: {short:?}");
        }
        let line = |s: &ptl_trainer::fit::RunSummary, p: &str| s.plugins.iter().find(|l| l.starts_with(p)).cloned().unwrap_or_default();
        println!("ok cuda loss replay {precision:?}: {} || {}", line(&pieces, "loss"), line(&every, "step"));
    }
}

/// One data-parallel rank through NCCL (the identifier through the rendezvous store; the
/// gradients' all-reduce recorded inside the replayed update's graph) with `replay=all`,
/// bf16-mixed: the plain native fit's bytes, every region replayed after its warm-up — native ≡
/// replay at world size 1 on the NCCL path.
#[test]
fn cuda_one_nccl_rank_with_replay_all_equals_the_native_fit() {
    use ptl_trainer::distributed::NcclCollective;
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-dp-all-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    let cfg = |replay: &[&str], save: &str| PoseTrainConfig {
        nbs: 2,
        precision: Precision::Bf16Mixed,
        ..cuda_fit_cfg(&data, dev, 8, replay, dir.join(save))
    };
    let native = fit(&cfg(&[], "native"), vec![]).expect("native fit");
    let group = NcclCollective::alone(dev, std::time::Duration::from_secs(60)).expect("one-rank NCCL group");
    let all = ptl_trainer::pose::fit_data_parallel(&cfg(&["all"], "ranked-all"), vec![], Box::new(group)).expect("ranked replay fit");
    assert_eq!(all.hashes, native.hashes, "one NCCL rank with replay=all: the native bytes");
    for (plugin, calls) in [("optimizer", all.optimizer_steps), ("step", 12)] {
        let short = replay_shortfalls(&all, plugin, calls, &[]);
        assert!(short.is_empty(), "{plugin}: {short:?}");
    }
    println!("ok cuda one NCCL rank replay=all: model {} as native", &native.hashes.model[..16]);
}

/// Weight gradients on the side stream (`DeviceOptions::concurrent_weight_gradients`), every
/// allocation poisoned: a native fit and a `replay=all` fit with side tasks end with the
/// one-stream native fit's hashes in bf16-mixed and 32-true, every region replaying after its
/// warm-up (the recorded step holds the forks and joins as graph edges; its planned arena keeps
/// the held frees apart).
#[test]
fn cuda_side_stream_fits_equal_the_one_stream_fit() {
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-side-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    let before = ptl_autograd::cuda::device_options(dev).expect("device options");
    ptl_autograd::internal::cuda::set_poison_allocations(true);
    for precision in [Precision::Bf16Mixed, Precision::F32] {
        let run = |replay: &[&str], side: bool| {
            ptl_autograd::cuda::set_device_options(dev, ptl_autograd::cuda::DeviceOptions { concurrent_weight_gradients: side, ..before })
                .expect("device options");
            let save = dir.join(format!("side-{}-{}-{side}", precision.name(), replay.join("+")));
            let cfg = PoseTrainConfig { nbs: 2, precision, ..cuda_fit_cfg(&data, dev, 8, replay, save) };
            let tasks = ptl_autograd::cuda::side_stream_stats(dev).expect("side stream stats").tasks;
            let s = fit(&cfg, vec![]).expect("fit");
            (s, ptl_autograd::cuda::side_stream_stats(dev).expect("side stream stats").tasks - tasks)
        };
        let (one, none) = run(&[], false);
        let (native, native_tasks) = run(&[], true);
        let (all, all_tasks) = run(&["all"], true);
        assert_eq!(none, 0, "the one-stream fit forks no side task");
        assert!(native_tasks > 0 && all_tasks > 0, "side tasks: native {native_tasks}, replay=all {all_tasks}");
        assert_eq!(native.hashes, one.hashes, "{}: native with side tasks", precision.name());
        assert_eq!(all.hashes, one.hashes, "{}: replay=all with side tasks", precision.name());
        for (plugin, calls) in [("optimizer", all.optimizer_steps), ("step", 12)] {
            let short = replay_shortfalls(&all, plugin, calls, &[]);
            assert!(short.is_empty(), "{} {plugin}: {short:?}", precision.name());
        }
        println!(
            "ok cuda side stream {}: native ({native_tasks} side tasks) and replay=all ({all_tasks} side tasks, fewer: replays fork none) = one stream",
            precision.name()
        );
    }
    ptl_autograd::internal::cuda::set_poison_allocations(false);
    ptl_autograd::cuda::set_device_options(dev, before).expect("device options");
}

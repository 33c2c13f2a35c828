//! cuDNN workspaces from a capture's arena: with no kept workspace
//! (`PTL_CUDNN_KEPT_WORKSPACE_MIB=0`) every convolution that needs one borrows a buffer for its
//! call — from the pool natively, from the arena inside a capture, where it is one more
//! temporary of the graph's planned layout. With every fresh allocation and arena piece poisoned,
//! `replay=all` gives the native fit's bytes, every region replays after its warm-up, and the
//! captures did take workspaces from their arenas — in bf16-mixed, 16-mixed, 32-true (TF32
//! convolutions) and bf16-mixed with channels-last activations.
//! Without a usable GPU the test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use ptl_plugins::replay_shortfalls;
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

mod common;
use common::cuda_fit_cfg;

#[test]
fn cuda_workspaces_from_capture_arenas_replay_equals_native() {
    // Read once per process, at the first convolution: set before any.
    std::env::set_var("PTL_CUDNN_KEPT_WORKSPACE_MIB", "0");
    let Some(dev) = ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
    else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-arena-ws-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 24, 6);
    ptl_autograd::internal::cuda::set_poison_allocations(true);
    // Each precision (32-true with its TF32 convolutions) and the channels-last activations pick
    // other engines and workspace sizes.
    let settings = [(Precision::Bf16Mixed, false), (Precision::F16Mixed, false), (Precision::F32, false), (Precision::Bf16Mixed, true)];
    let mut failures = Vec::new();
    for (precision, channels_last) in settings {
        let label = format!("{}{}", precision.name(), if channels_last { " channels-last" } else { "" });
        let run = |replay: &[&str], name: &str| {
            let cfg = PoseTrainConfig {
                batch: 4,
                nbs: 4,
                imgsz: 128,
                precision,
                channels_last,
                ..cuda_fit_cfg(&data, dev, 8, replay, dir.join(format!("{name}-{}-{channels_last}", precision.name())))
            };
            fit(&cfg, vec![]).expect("fit")
        };
        let native = run(&[], "native");
        let before = ptl_autograd::cuda::cudnn_workspaces_from_arenas();
        let replayed = run(&["all"], "all");
        let from_arenas = ptl_autograd::cuda::cudnn_workspaces_from_arenas() - before;
        if replayed.hashes != native.hashes {
            failures.push(format!("{label}: replay=all with workspaces from the arenas, poisoned, differs from native"));
        }
        for (plugin, calls) in [("optimizer", replayed.optimizer_steps), ("step", 6)] {
            let short = replay_shortfalls(&replayed, plugin, calls, &[]);
            if !short.is_empty() {
                failures.push(format!("{label}: {plugin}: {short:?}"));
            }
        }
        if from_arenas == 0 {
            failures.push(format!("{label}: no capture took a cuDNN workspace from its arena: the path this test exists for did not run"));
        }
        println!(
            "{label}: {from_arenas} recorded calls took workspaces from arenas, model {} (native {})",
            &replayed.hashes.model[..16],
            &native.hashes.model[..16]
        );
    }
    ptl_autograd::internal::cuda::set_poison_allocations(false);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
    println!("ok cuda workspaces from capture arenas in bf16-mixed, 16-mixed, 32-true and channels-last");
}

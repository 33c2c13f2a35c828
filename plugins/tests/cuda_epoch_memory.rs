//! No growth after the first epoch: in a `replay=all` fit of three epochs neither the allocated
//! nor the reserved peak moves after the first (a target bucket first seen later must fit the
//! arenas planned then). The peaks are the process's, read as each epoch ends
//! (`RunSummary::memory_per_epoch`), validation included; the replay counters show that every
//! region replayed after its warm-up. The recordings made by each epoch's end are printed.
//! Without a usable GPU the test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use ptl_plugins::replay_shortfalls;
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

mod common;
use common::cuda_fit_cfg;

#[test]
fn cuda_replay_memory_does_not_grow_after_the_first_epoch() {
    let Some(dev) = ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
    else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-epoch-memory-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 32, 4);
    let cfg = PoseTrainConfig {
        batch: 4,
        nbs: 4,
        imgsz: 128,
        epochs: 3,
        precision: Precision::Bf16Mixed,
        ..cuda_fit_cfg(&data, dev, 8, &["all"], dir.join("all"))
    };
    let s = fit(&cfg, vec![]).expect("fit");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(s.memory_per_epoch.len(), 3, "one memory record per epoch: {:?}", s.memory_per_epoch);
    for (plugin, calls) in [("optimizer", s.optimizer_steps), ("step", 3 * 8)] {
        let short = replay_shortfalls(&s, plugin, calls, &[]);
        assert!(short.is_empty(), "{plugin}: {short:?}");
    }
    let first = &s.memory_per_epoch[0];
    for later in &s.memory_per_epoch[1..] {
        assert_eq!(
            later.peak_allocated_bytes, first.peak_allocated_bytes,
            "the allocated peak grew after the first epoch: {:?}",
            s.memory_per_epoch
        );
        assert_eq!(
            later.peak_reserved_bytes, first.peak_reserved_bytes,
            "the reserved peak grew after the first epoch: {:?}",
            s.memory_per_epoch
        );
    }
    let recordings: Vec<u64> = s.memory_per_epoch.iter().map(|e| e.recordings).collect();
    println!(
        "ok cuda replay memory: peak {} / {} bytes allocated / reserved after each of 3 epochs; recordings by each epoch's end {recordings:?}",
        first.peak_allocated_bytes, first.peak_reserved_bytes
    );
}

//! No growth after the first epoch: in a `replay=all` fit of three epochs neither the allocated
//! nor the reserved peak moves after the first, and no shared arena grows after it — although
//! the target buckets vary from step to step (one crowded image among sparse ones, mosaics that
//! hold it up to four times), so a bucket first seen in a later epoch is recorded into arenas
//! laid out before it. The fit prepares the largest bucket the data can give before its first
//! recording (`RunSummary::planned_target_slots`). The peaks are the process's, read as each
//! epoch ends (`RunSummary::memory_per_epoch`), validation included; the replay counters show
//! that every region replayed after its warm-up. Without a usable GPU the test prints
//! `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use std::sync::{Arc, Mutex};

use ptl_plugins::replay_shortfalls;
use ptl_trainer::fit::{Callback, LoopView};
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

mod common;
use common::cuda_fit_cfg;

/// The shared arenas' growths so far, as each training epoch ends.
#[derive(Clone, Default)]
struct GrowthsPerEpoch(Arc<Mutex<Vec<u64>>>);

impl Callback for GrowthsPerEpoch {
    fn on_train_epoch_end(&mut self, _: &LoopView) {
        self.0.lock().unwrap().push(ptl_capture::shared_arena_growths());
    }
}

#[test]
fn cuda_replay_memory_does_not_grow_after_the_first_epoch() {
    let Some(dev) = ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
    else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-epoch-memory-{}", std::process::id()));
    let data = ptl_test_support::pose_dataset(&dir, 32, 4);
    // One crowded image: a mosaic holding it one to four times needs 16, 32 or 64 slots, the
    // others 8 or 16.
    let labels = dir.join("ds/labels/train");
    let mut files: Vec<_> = std::fs::read_dir(&labels).expect("labels").flatten().map(|e| e.path()).collect();
    files.sort();
    common::write_people(&files[0], 12);
    let cfg = PoseTrainConfig {
        batch: 4,
        nbs: 4,
        imgsz: 128,
        epochs: 3,
        close_mosaic: 0,
        precision: Precision::Bf16Mixed,
        ..cuda_fit_cfg(&data, dev, 8, &["all"], dir.join("all"))
    };
    let growths = GrowthsPerEpoch::default();
    let s = fit(&cfg, vec![Box::new(growths.clone())]).expect("fit");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(s.memory_per_epoch.len(), 3, "one memory record per epoch: {:?}", s.memory_per_epoch);
    for (plugin, calls) in [("optimizer", s.optimizer_steps), ("step", 3 * 8)] {
        let short = replay_shortfalls(&s, plugin, calls, &[]);
        assert!(short.is_empty(), "{plugin}: {short:?}");
    }
    assert_eq!(s.planned_target_slots, Some(64), "the largest bucket (4 × 12 objects) prepared before the first recording");
    let growths = growths.0.lock().unwrap().clone();
    assert_eq!(growths.len(), 3, "{growths:?}");
    assert!(growths.iter().all(|&g| g == growths[0]), "a shared arena grew after the first epoch: growths by each epoch's end {growths:?}");
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
    let step_regions = s.replay_counters.get("step").and_then(|c| c.as_object()).map_or(0, |m| m.len());
    println!(
        "ok cuda replay memory: peak {} / {} bytes allocated / reserved after each of 3 epochs; recordings by each epoch's end \
         {recordings:?}; {step_regions} step shapes (64 slots prepared first); shared-arena growths by each epoch's end {growths:?}",
        first.peak_allocated_bytes, first.peak_reserved_bytes
    );
}

//! A signal to one rank of a data-parallel group (threads of one process) stops every rank at
//! the group's next agreement inside the epoch, rank 0 keeps the place in its checkpoint, and
//! the resumed group ends with the uninterrupted group's bytes. Its own test binary: the stop
//! request is process-wide, and no other fit may run beside it.

mod fit_support;

use ptl_trainer::distributed::ThreadGroup;
use ptl_trainer::fit::{interrupt, Callback, LoopView, RunSummary};
use ptl_trainer::pose::{fit_data_parallel, PoseTrainConfig};
use ptl_trainer::TrainerError;

/// Asks the process to stop (as SIGTERM would) after batch `batch` of epoch 0.
#[derive(Clone)]
struct SignalAfter {
    batch: usize,
}

impl Callback for SignalAfter {
    fn on_train_batch_end(&mut self, v: &LoopView) {
        if v.epoch == 0 && v.batch_in_epoch == self.batch {
            interrupt::request(interrupt::SIGTERM);
        }
    }
}

/// Every rank fits `cfg`; rank 1 gets `callback`.
fn fit_on_two_ranks(cfg: &PoseTrainConfig, callback: Option<SignalAfter>) -> Vec<Result<RunSummary, TrainerError>> {
    let handles: Vec<_> = ThreadGroup::new(2)
        .expect("a group")
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let cfg = cfg.clone();
            let callbacks: Vec<Box<dyn Callback>> = match (&callback, rank) {
                (Some(cb), 1) => vec![Box::new(cb.clone())],
                _ => vec![],
            };
            std::thread::spawn(move || fit_data_parallel(&cfg, callbacks, Box::new(c)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
}

/// 2 epochs of 10 steps per rank (global batch 2 over two ranks, 20 training images).
fn run(save: &str) -> PoseTrainConfig {
    let dir = fit_support::scratch(save);
    let _ = std::fs::remove_dir_all(&dir);
    let data = ptl_test_support::pose_dataset(&dir, 20, 0);
    PoseTrainConfig { data, batch: 2, max_batches: None, val: false, save_dir: dir.join("run"), ..fit_support::tiny_in(&dir) }
}

#[test]
fn a_signal_on_one_rank_stops_the_group_mid_epoch_and_the_group_resumes() {
    let full = fit_on_two_ranks(&run("dp-signal-full"), None).remove(0).expect("uninterrupted group");
    let cfg = run("dp-signal-stopped");
    // Rank 1 is asked to stop after batch 2; the group agrees after batch 7 (every 8 batches).
    for r in fit_on_two_ranks(&cfg, Some(SignalAfter { batch: 2 })) {
        match r {
            Err(TrainerError::Interrupted { signal, checkpoint }) => {
                assert_eq!(signal, interrupt::SIGTERM);
                assert_eq!(checkpoint.as_deref(), Some(cfg.save_dir.join("weights/last.ckpt").as_path()));
            }
            other => panic!("every rank stops for the signal: {:?}", other.map(|s| s.hashes)),
        }
    }
    interrupt::clear();
    let ck = ptl_trainer::fit::load_checkpoint(&cfg.save_dir.join("weights/last.ckpt"), ptl_autograd::Device::Cpu).expect("checkpoint");
    let place = ck.manifest.loop_state.partial_epoch.as_ref().map(|p| (p.epoch, p.next_batch));
    assert_eq!(place, Some((0, 8)), "rank 0 kept the place where the group stopped");
    drop(ck);
    let resumed = fit_on_two_ranks(&PoseTrainConfig { resume: Some(cfg.save_dir.join("weights/last.ckpt")), ..cfg }, None);
    for r in resumed {
        let r = r.expect("resumed rank");
        assert_eq!((&r.hashes.model, &r.hashes.optimizer, &r.hashes.ema), (&full.hashes.model, &full.hashes.optimizer, &full.hashes.ema));
    }
}

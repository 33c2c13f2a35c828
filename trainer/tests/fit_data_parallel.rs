//! Data-parallel fits on the CPU, the ranks being threads of one process (`ThreadGroup`): the
//! fit loop's use of the multi-rank rules that NCCL ranks will follow on GPUs — shards, the
//! global batch, averaged gradients, rank 0's buffers, rank 0 alone writing, resume.

mod fit_support;

use std::path::Path;

use ptl_trainer::distributed::ThreadGroup;
use std::sync::atomic::{AtomicUsize, Ordering};

use ptl_autograd::Tensor;
use ptl_trainer::fit::{Callback, LoopView, RunSummary};
use ptl_trainer::pose::{fit, fit_data_parallel, PoseTrainConfig};

/// Every rank of a `world`-rank group fits `cfg` in its thread; the ranks' results in rank order.
fn fit_on_ranks(world: usize, cfg: &PoseTrainConfig) -> Vec<Result<RunSummary, String>> {
    fit_on_ranks_with(world, cfg, |_, _| {})
}

/// [`fit_on_ranks`] with `tweak` applied to each rank's settings (a fault on one rank).
fn fit_on_ranks_with(world: usize, cfg: &PoseTrainConfig, tweak: fn(usize, &mut PoseTrainConfig)) -> Vec<Result<RunSummary, String>> {
    fit_on_ranks_full(world, cfg, tweak, |_| vec![])
}

/// [`fit_on_ranks_with`], each rank also with the callbacks `callbacks(rank)` makes.
fn fit_on_ranks_full(
    world: usize,
    cfg: &PoseTrainConfig,
    tweak: fn(usize, &mut PoseTrainConfig),
    callbacks: fn(usize) -> Vec<Box<dyn Callback>>,
) -> Vec<Result<RunSummary, String>> {
    let handles: Vec<_> = ThreadGroup::new(world)
        .expect("a group")
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let mut cfg = cfg.clone();
            tweak(rank, &mut cfg);
            let callbacks = callbacks(rank);
            std::thread::spawn(move || fit_data_parallel(&cfg, callbacks, Box::new(c)).map_err(|e| e.to_string()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
}

/// A global batch of 4 (2 per rank of two), 2 epochs of 2 steps, validation on.
fn two_rank_run(save: &str) -> PoseTrainConfig {
    let save_dir = fit_support::scratch(save);
    let _ = std::fs::remove_dir_all(&save_dir);
    PoseTrainConfig { batch: 4, ..fit_support::tiny_in(&save_dir) }
}

/// The folders in `save_dir`'s parent whose names start with its name (a second rank claiming a
/// folder would add `<name>2`).
fn run_folders(save_dir: &Path) -> Vec<String> {
    let name = save_dir.file_name().unwrap().to_string_lossy().into_owned();
    let mut found: Vec<String> = std::fs::read_dir(save_dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&name))
        .collect();
    found.sort();
    found
}

/// Two ranks end with the same weights, optimizer state, EMA and schedule (their gradients
/// averaged, rank 0's BatchNorm statistics handed on) though each trained on its own share of
/// every epoch (their per-step losses differ); a second run gives the same bytes; one folder is
/// written, by rank 0, holding what a one-rank run writes.
#[test]
fn two_ranks_train_one_model_and_rank_0_alone_writes() {
    let cfg = two_rank_run("dp-two");
    let ranks: Vec<RunSummary> = fit_on_ranks(2, &cfg).into_iter().map(|r| r.expect("rank fit")).collect();
    let (a, b) = (&ranks[0].hashes, &ranks[1].hashes);
    assert_eq!((&a.model, &a.optimizer, &a.ema, &a.scheduler), (&b.model, &b.optimizer, &b.ema, &b.scheduler), "the ranks' states");
    assert_ne!(a.step_losses, b.step_losses, "each rank trains on its own share of the epoch");
    assert_eq!(ranks[0].optimizer_steps, ranks[1].optimizer_steps);
    assert!(!ranks[0].final_metrics.is_empty(), "rank 0 validates");
    assert!(ranks[1].final_metrics.is_empty(), "the other ranks do not");

    assert_eq!(run_folders(&cfg.save_dir), vec!["dp-two".to_string()], "one folder, no second claim");
    for f in ["args.yaml", "results.csv", "summary.json", "weights/last.ckpt", "weights/best.ckpt"] {
        assert!(cfg.save_dir.join(f).is_file(), "rank 0 wrote {f}");
    }
    let rows = std::fs::read_to_string(cfg.save_dir.join("results.csv")).unwrap().lines().count();
    assert_eq!(rows, 1 + cfg.epochs, "a header and one row per epoch, written once");

    let again = fit_on_ranks(2, &two_rank_run("dp-two-again"));
    let again = again[0].as_ref().expect("rank 0 of the second run");
    assert_eq!(again.hashes, ranks[0].hashes, "the same bytes run to run");
}

/// One rank through the group is the plain fit byte for byte (no scaling, no exchange changes a
/// value).
#[test]
fn a_group_of_one_is_the_plain_fit() {
    let alone = fit(&two_rank_run("dp-plain"), vec![]).expect("plain fit");
    let group = fit_on_ranks(1, &two_rank_run("dp-one")).remove(0).expect("one-rank group");
    assert_eq!(group.hashes, alone.hashes);
}

/// Stopped after its first epoch and resumed from rank 0's checkpoint, a two-rank run ends as the
/// uninterrupted one: every rank restores from that one file.
#[test]
fn every_rank_resumes_from_rank_0s_checkpoint() {
    let full = fit_on_ranks(2, &two_rank_run("dp-full")).remove(0).expect("uninterrupted run");
    let cfg = two_rank_run("dp-stopped");
    for r in fit_on_ranks(2, &PoseTrainConfig { stop_after_epochs: Some(1), ..cfg.clone() }) {
        r.expect("first epoch");
    }
    let resumed = fit_on_ranks(2, &PoseTrainConfig { resume: Some(cfg.save_dir.join("weights/last.ckpt")), ..cfg });
    for r in resumed {
        let r = r.expect("resumed rank");
        assert_eq!((&r.hashes.model, &r.hashes.optimizer, &r.hashes.ema), (&full.hashes.model, &full.hashes.optimizer, &full.hashes.ema));
    }
}

/// A rank whose fit fails mid-epoch (here its loader, at epoch 1's second batch) ends the others
/// with an error naming it, instead of leaving them waiting in the next collective; the last
/// checkpoint rank 0 wrote (epoch 0's) stays to resume from.
#[test]
fn a_failing_rank_ends_the_others() {
    let cfg = two_rank_run("dp-fault");
    let results = fit_on_ranks_with(3, &PoseTrainConfig { batch: 6, ..cfg.clone() }, |rank, c| {
        if rank == 2 {
            c.inject_loader_panic_at = Some((1, 1));
        }
    });
    let errors: Vec<String> = results.into_iter().map(|r| r.expect_err("every rank fails")).collect();
    assert!(errors[2].contains("loader") || errors[2].contains("injected"), "{}", errors[2]);
    for e in &errors[..2] {
        assert!(e.contains("rank 2 left the group"), "{e}");
    }
    assert!(cfg.save_dir.join("weights/last.ckpt").is_file(), "epoch 0's checkpoint stays");
}

/// A global batch that does not split over the ranks is refused on every rank with the fix,
/// before the ranks exchange anything.
#[test]
fn a_batch_the_group_cannot_split_is_refused_on_every_rank() {
    let cfg = PoseTrainConfig { batch: 1, ..two_rank_run("dp-batch") };
    for r in fit_on_ranks(2, &cfg) {
        let e = r.expect_err("refused");
        assert!(e.contains("batch=2 or more"), "{e}");
    }
    assert!(!cfg.save_dir.exists(), "nothing written");
}

/// How often rank 1's first batch of epoch 1 started in the recovery test.
static POISONED: AtomicUsize = AtomicUsize::new(0);

/// Puts NaN into rank 1's first convolution gradient at epoch 1's first batch, the first time:
/// averaged, it reaches every rank's weights, and every rank's next loss is non-finite.
#[derive(Clone)]
struct PoisonOnce;

impl Callback for PoisonOnce {
    fn on_after_backward_params(&mut self, v: &LoopView, params: &[(String, Tensor)]) {
        if v.epoch == 1 && v.batch_in_epoch == 0 && POISONED.fetch_add(1, Ordering::SeqCst) == 0 {
            let (_, p) = params.iter().find(|(n, _)| n == "model.0.conv.weight").expect("parameter");
            let g = p.grad().expect("gradient");
            g.copy_(&Tensor::full(g.dims().to_vec(), f64::NAN, g.dtype(), g.device()).unwrap()).unwrap();
        }
    }
}

/// A non-finite gradient on one rank sends every rank back to rank 0's last checkpoint together:
/// epoch 1 runs again on both ranks, and they finish with one model.
#[test]
fn the_ranks_recover_from_a_non_finite_loss_together() {
    let cfg = PoseTrainConfig { nbs: 2, warmup_epochs: 0.0, epochs: 3, ..two_rank_run("dp-nan") };
    let callbacks = |rank: usize| -> Vec<Box<dyn Callback>> {
        match rank {
            1 => vec![Box::new(PoisonOnce)],
            _ => vec![],
        }
    };
    let ranks: Vec<RunSummary> = fit_on_ranks_full(2, &cfg, |_, _| {}, callbacks).into_iter().map(|r| r.expect("recovered rank")).collect();
    assert_eq!(POISONED.load(Ordering::SeqCst), 2, "epoch 1 ran twice on rank 1");
    assert_eq!(ranks[0].hashes.model, ranks[1].hashes.model, "one model after the recovery");
    assert_eq!(ranks[0].metrics_per_epoch.len(), 3, "rank 0 validated every epoch once");
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

/// Two ranks fitting `cfg` through logged collectives: the summaries and what each rank issued.
fn fit_on_two_logged_ranks(cfg: &PoseTrainConfig) -> (Vec<RunSummary>, Vec<Vec<ptl_trainer::distributed::Issued>>) {
    use ptl_trainer::distributed::LoggedCollective;
    let taps: Vec<_> = ThreadGroup::new(2).expect("a group").into_iter().map(|c| std::sync::Arc::new(LoggedCollective::new(c))).collect();
    let handles: Vec<_> = taps
        .iter()
        .map(|t| {
            let (tap, cfg) = (Tap(t.clone()), cfg.clone());
            std::thread::spawn(move || fit_data_parallel(&cfg, vec![], Box::new(tap)).expect("rank fit"))
        })
        .collect();
    let summaries = handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect();
    (summaries, taps.iter().map(|t| t.issued()).collect())
}

/// The gradient sums started during the update's last backward (`overlap_all_reduce`, the
/// default) end with the bytes of the sums after backward: weights, optimizer state, EMA and
/// per-step losses. They are issued before the update's agreement (its max all-reduce) instead of
/// after it, the same collectives on both ranks.
#[test]
fn gradient_sums_during_backward_give_the_bytes_of_sums_after_it() {
    use ptl_trainer::distributed::Issued;
    let (during, during_log) = fit_on_two_logged_ranks(&two_rank_run("dp-overlap"));
    let (after, after_log) = fit_on_two_logged_ranks(&PoseTrainConfig { overlap_all_reduce: false, ..two_rank_run("dp-no-overlap") });
    for (d, a) in during.iter().zip(&after) {
        assert_eq!(d.hashes, a.hashes, "the same bytes with and without the overlap");
    }
    assert_eq!(during_log[0], during_log[1], "both ranks issue the same collectives");
    let sums = |log: &[Issued]| log.iter().filter(|c| matches!(c, Issued::Sum(_))).count();
    assert_eq!(sums(&during_log[0]), sums(&after_log[0]), "as many sums");
    // Without the overlap the first sum follows the first update's agreement (a max over every
    // parameter's presence and more); with it the sums come first and the agreement after them.
    let first_sum = |log: &[Issued]| log.iter().position(|c| matches!(c, Issued::Sum(_))).expect("a sum");
    let (d, a) = (first_sum(&during_log[0]), first_sum(&after_log[0]));
    let Issued::Max(agreement) = after_log[0][a - 1] else { panic!("after backward, a sum follows the agreement: {:?}", after_log[0]) };
    assert!(agreement > 1, "the update's agreement carries the parameters' presence");
    let agreed_at = during_log[0].iter().position(|c| *c == Issued::Max(agreement)).expect("the update's agreement");
    assert!(d < agreed_at, "with the overlap the first sum (at {d}) comes before the update's agreement (at {agreed_at})");
}

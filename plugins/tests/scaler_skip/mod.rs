//! docs/capture.md T12 in a real 16-mixed fit, natively and with `replay=optimizer`: an inf injected
//! into a gradient skips that optimizer step — no parameter changes — decided on the device (the
//! replayed unscale writes the found-inf flag, the replayed update reads it), the loss scale backs
//! off and its growth tracker restarts, and the scale grows again after the configured clean
//! steps. Shared by the CPU binary (the recorder's test double) and the CUDA one (real graphs).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ptl_autograd::Tensor;
use ptl_plugins::replay_shortfalls;
use ptl_trainer::fit::{read_manifest, Callback, LoopView, RunSummary};
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

/// Per optimizer step: (step, whether the parameters came out of it unchanged).
type StepLog = Arc<Mutex<Vec<(u64, bool)>>>;

/// Multiplies one gradient by +inf after the backward of optimizer step `at_step`, and notes
/// whether each step changed the parameters (bytes before the step against bytes after it).
#[derive(Clone)]
struct InjectInf {
    at_step: u64,
    params: Vec<Tensor>,
    before: Vec<Vec<u8>>,
    log: StepLog,
}

fn bytes(ts: &[Tensor]) -> Vec<Vec<u8>> {
    ts.iter().map(|t| t.to_bytes().expect("parameter bytes")).collect()
}

impl Callback for InjectInf {
    fn on_after_backward_params(&mut self, v: &LoopView, params: &[(String, Tensor)]) {
        self.params = params.iter().map(|(_, t)| t.clone()).collect();
        if v.global_step == self.at_step {
            let g = params.iter().find_map(|(_, p)| p.grad()).expect("a parameter with a gradient");
            ptl_autograd::no_grad(|| g.copy_(&g.mul_scalar(f64::INFINITY)?)).expect("inject inf");
        }
    }
    fn on_before_optimizer_step(&mut self, _v: &LoopView) {
        self.before = bytes(&self.params);
    }
    fn on_before_zero_grad(&mut self, v: &LoopView) {
        let same = bytes(&self.params) == self.before;
        self.log.lock().expect("log").push((v.global_step, same));
    }
}

/// Runs the T12 fit natively and with `replay=optimizer` for `optimizer`; `base` supplies data,
/// device, steps and folders. Returns the replayed run's summary (the caller prints it).
pub fn injected_inf_skips_the_step_on_the_device(base: &PoseTrainConfig, optimizer: &str, steps: u64) -> RunSummary {
    const AT: u64 = 3;
    let run = |replay: &[&str]| -> (RunSummary, Vec<(u64, bool)>, PathBuf) {
        let save_dir = base.save_dir.join(format!("t12-{optimizer}-{}", replay.join("+")));
        let cfg = PoseTrainConfig {
            precision: Precision::F16Mixed,
            optimizer: optimizer.into(),
            // A first scale of 1 that doubles after two clean steps (the tiny model's f16 gradients
            // overflow at 128 on their own: a natural skip would blur which step the inf skipped).
            scaler_init_scale: 1.0,
            scaler_growth_interval: 2,
            replay: replay.iter().map(|s| s.to_string()).collect(),
            save_dir: save_dir.clone(),
            ..base.clone()
        };
        let log: StepLog = Arc::default();
        let cb = InjectInf { at_step: AT, params: Vec::new(), before: Vec::new(), log: log.clone() };
        let s = fit(&cfg, vec![Box::new(cb)]).expect("16-mixed fit");
        let steps_log = log.lock().expect("log").clone();
        (s, steps_log, save_dir.join("weights/last.ckpt"))
    };
    let (native, native_log, native_ckpt) = run(&[]);
    let (upd, upd_log, upd_ckpt) = run(&["optimizer"]);
    assert_eq!(native.optimizer_steps, steps, "{optimizer}: an optimizer step per batch");
    for (who, log) in [("native", &native_log), ("replay", &upd_log)] {
        let unchanged: Vec<u64> = log.iter().filter(|(_, same)| *same).map(|(k, _)| *k).collect();
        assert_eq!(unchanged, [AT], "{optimizer} {who}: only the step with the inf leaves the parameters untouched: {log:?}");
    }
    assert_eq!(upd.hashes, native.hashes, "{optimizer}: replay=optimizer under 16-mixed changes no byte");
    // PyTorch's rule by hand: clean steps 0, 1 → ×2 (2), clean 2 (tracker 1), inf at 3 → ×0.5 (1),
    // tracker 0; clean 4, 5 → ×2 (2), tracker 0 — and so on for longer runs.
    let mut scale = 1.0;
    let mut tracker = 0u64;
    for k in 0..steps {
        if k == AT {
            scale *= 0.5;
            tracker = 0;
        } else {
            tracker += 1;
            if tracker == 2 {
                scale *= 2.0;
                tracker = 0;
            }
        }
    }
    for (who, ckpt) in [("native", &native_ckpt), ("replay", &upd_ckpt)] {
        let m = read_manifest(ckpt).expect("manifest");
        assert_eq!(m.scaler["scale"].as_f64(), Some(scale), "{optimizer} {who}: {}", m.scaler);
        assert_eq!(m.scaler["growth_tracker"].as_u64(), Some(tracker), "{optimizer} {who}: {}", m.scaler);
        if optimizer == "AdamW" {
            // The skipped step does not count: every parameter (all have gradients here) made one
            // step fewer than the run has batches.
            let counts = m.optimizer["meta"]["steps"].as_object().expect("AdamW step counts");
            assert!(!counts.is_empty() && counts.values().all(|c| c.as_u64() == Some(steps - 1)), "{who}: {counts:?}");
        }
    }
    let short = replay_shortfalls(&upd, "optimizer", upd.optimizer_steps, &[]);
    assert!(short.is_empty(), "{optimizer}: {short:?}");
    let regions = upd.replay_counters["optimizer"].as_object().expect("optimizer counters");
    let mut names: Vec<&String> = regions.keys().collect();
    names.sort();
    assert_eq!(names, ["ema", "unscale.0", "update.0"], "{optimizer}: unscale, update and EMA, one presence mask");
    upd
}

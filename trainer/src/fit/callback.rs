//! Callbacks: observers of the fit loop, called at Lightning's hook points (docs/trainer.md §3, §9).

use dyn_clone::DynClone;

/// Read-only view of the loop for callbacks.
#[derive(Clone, Debug, Default)]
pub struct LoopView {
    /// Current epoch (0-based).
    pub epoch: usize,
    /// Epochs of the run.
    pub epochs: usize,
    /// Batch index within the epoch.
    pub batch_in_epoch: usize,
    /// Batches per epoch.
    pub batches_per_epoch: usize,
    /// Optimizer steps taken so far.
    pub global_step: u64,
    /// Running mean of the logged loss items this epoch.
    pub mean_items: Vec<f64>,
    /// Each parameter group's learning rate.
    pub lr: Vec<f64>,
    /// Last validation metrics (name, value).
    pub metrics: Vec<(String, f64)>,
}

/// Every hook has an empty default; callbacks override what they observe.
#[allow(unused_variables)]
pub trait Callback: DynClone + Send {
    /// Key of this callback's state in checkpoints.
    fn state_key(&self) -> String {
        std::any::type_name::<Self>().rsplit("::").next().unwrap_or("callback").to_string()
    }
    /// Before anything runs.
    fn setup(&mut self, v: &LoopView) {}
    /// The fit starts.
    fn on_fit_start(&mut self, v: &LoopView) {}
    /// Training starts.
    fn on_train_start(&mut self, v: &LoopView) {}
    /// An epoch starts.
    fn on_train_epoch_start(&mut self, v: &LoopView) {}
    /// A batch starts (before its forward).
    fn on_train_batch_start(&mut self, v: &LoopView) {}
    /// Before the gradients are cleared (first batch of an accumulation window).
    fn on_before_zero_grad(&mut self, v: &LoopView) {}
    /// Before the backward.
    fn on_before_backward(&mut self, v: &LoopView) {}
    /// After the backward.
    fn on_after_backward(&mut self, v: &LoopView) {}
    /// Right after `on_after_backward`, with the model's named parameters (gradients readable and
    /// writable, e.g. for gradient statistics or fault injection in tests).
    fn on_after_backward_params(&mut self, v: &LoopView, params: &[(String, ptl_autograd::Tensor)]) {}
    /// Before the optimizer step (after unscaling, before clipping).
    fn on_before_optimizer_step(&mut self, v: &LoopView) {}
    /// A batch ended.
    fn on_train_batch_end(&mut self, v: &LoopView) {}
    /// Validation starts.
    fn on_validation_start(&mut self, v: &LoopView) {}
    /// The validation pass starts.
    fn on_validation_epoch_start(&mut self, v: &LoopView) {}
    /// The validation pass ended.
    fn on_validation_epoch_end(&mut self, v: &LoopView) {}
    /// Validation ended.
    fn on_validation_end(&mut self, v: &LoopView) {}
    /// An epoch ended (after its validation).
    fn on_train_epoch_end(&mut self, v: &LoopView) {}
    /// A checkpoint is being written.
    fn on_save_checkpoint(&mut self, v: &LoopView) {}
    /// Training ended.
    fn on_train_end(&mut self, v: &LoopView) {}
    /// The fit ended.
    fn on_fit_end(&mut self, v: &LoopView) {}
    /// The last hook of a fit.
    fn teardown(&mut self, v: &LoopView) {}
    /// The fit failed with `error`.
    fn on_exception(&mut self, v: &LoopView, error: &str) {}
    /// State to store in checkpoints under [`Callback::state_key`].
    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

dyn_clone::clone_trait_object!(Callback);

/// Records the hook sequence (used by the hook-order snapshot test and for debugging).
#[derive(Clone, Default)]
pub struct HookTrace {
    /// The hooks called, in order.
    pub events: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl HookTrace {
    fn push(&self, s: String) {
        if let Ok(mut e) = self.events.lock() {
            e.push(s);
        }
    }
    /// The recorded events so far.
    pub fn take(&self) -> Vec<String> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }
}

macro_rules! trace_hooks {
    ($($name:ident),*) => {
        impl Callback for HookTrace {
            $(fn $name(&mut self, v: &LoopView) {
                self.push(format!("{} e{} b{}", stringify!($name), v.epoch, v.batch_in_epoch));
            })*
            fn on_exception(&mut self, v: &LoopView, error: &str) {
                self.push(format!("on_exception e{} b{}: {error}", v.epoch, v.batch_in_epoch));
            }
        }
    };
}

trace_hooks!(
    setup,
    on_fit_start,
    on_train_start,
    on_train_epoch_start,
    on_train_batch_start,
    on_before_zero_grad,
    on_before_backward,
    on_after_backward,
    on_before_optimizer_step,
    on_train_batch_end,
    on_validation_start,
    on_validation_epoch_start,
    on_validation_epoch_end,
    on_validation_end,
    on_train_epoch_end,
    on_save_checkpoint,
    on_train_end,
    on_fit_end,
    teardown
);

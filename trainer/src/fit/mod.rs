//! The fit loop and its parts: callbacks, replay plugins, checkpoints, run artefacts.

pub mod callback;
pub mod checkpoint;
pub mod interrupt;
pub mod plugin;
pub mod run_dir;
pub mod summary;

pub use callback::{Callback, HookTrace, LoopView};
pub use checkpoint::{load_checkpoint, read_manifest, save_checkpoint, Checkpoint, LoopState, Manifest, PartialEpoch, RunHistory};
mod stopper;
pub use plugin::{
    registered_plugins, LossBody, PluginRegistration, PluginSetup, PluginStack, ReplayCadence, ReplayPlugin, StackRunner, Stage, StageInfo,
    UpdatePart, ALL_PLUGINS,
};
pub use run_dir::RunDir;
pub use stopper::EarlyStopping;
pub use summary::{
    GpuWindowReport, KernelBreakdown, KernelModuleTime, KernelRow, KernelShare, LaunchesPerStep, MemoryAtBackward, ResultsCsv, RunHashes,
    RunSummary, StageProfile, StartupReport, StepTiming, TimingReport,
};

//! The fit loop and its parts: callbacks, replay plugins, checkpoints, run artefacts.

pub mod callback;
pub mod checkpoint;
pub mod interrupt;
pub(crate) mod numbers;
pub mod plugin;
pub mod run_dir;
pub mod sites;
pub mod summary;

pub use callback::{Callback, HookTrace, LoopView};
pub use checkpoint::{load_checkpoint, read_manifest, save_checkpoint, Checkpoint, LoopState, Manifest, PartialEpoch, RunHistory};
mod stopper;
pub use plugin::{
    registered_plugins, PluginRegistration, PluginSetup, PluginStack, ReplayCadence, ReplayPlugin, SiteCall, StackRunner, Stage, StageInfo,
    ALL_PLUGINS,
};
pub use run_dir::RunDir;
pub use sites::{NativeSites, NsSite, Site, SiteBody, SiteRunner, Surface, UpdatePart};
pub use stopper::EarlyStopping;
pub use summary::{
    EpochMemory, GpuWindowReport, KernelBreakdown, KernelModuleTime, KernelRow, KernelShare, LaunchesPerStep, MemoryAtBackward, ResultsCsv,
    RunHashes, RunSummary, StageProfile, StartupReport, StepTiming, TimingReport,
};

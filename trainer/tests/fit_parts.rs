//! The fit loop's parts: plugin registry and stacking, checkpoints (atomic, typed corruption
//! errors), step timing statistics.

use std::sync::{Arc, Mutex};

use ptl_autograd::{DType, Device, Tensor};
use ptl_trainer::fit::{
    load_checkpoint, read_manifest, registered_plugins, save_checkpoint, Checkpoint, LoopState, Manifest, PluginRegistration, PluginStack,
    ReplayPlugin, Stage, StageInfo, StepTiming,
};
use ptl_trainer::TrainerError;

/// A plugin as a third-party crate would write it: registered through `inventory`, no fork.
#[derive(Clone, Default)]
struct CountingPlugin {
    log: Arc<Mutex<Vec<String>>>,
}

impl ReplayPlugin for CountingPlugin {
    fn name(&self) -> &'static str {
        "test-counting"
    }
    fn around(&self, info: StageInfo, next: &mut dyn FnMut() -> ptl_trainer::Result<()>) -> ptl_trainer::Result<()> {
        self.log.lock().unwrap().push(format!("enter {:?}", info.stage));
        next()?;
        self.log.lock().unwrap().push(format!("leave {:?}", info.stage));
        Ok(())
    }
}

inventory::submit! {
    PluginRegistration { name: "test-counting", in_all: false, create: |_| Ok(Box::new(CountingPlugin::default())) }
}

#[derive(Clone)]
struct Outer(Arc<Mutex<Vec<String>>>);
impl ReplayPlugin for Outer {
    fn name(&self) -> &'static str {
        "outer"
    }
    fn priority(&self) -> i32 {
        -1
    }
    fn around(&self, _: StageInfo, next: &mut dyn FnMut() -> ptl_trainer::Result<()>) -> ptl_trainer::Result<()> {
        self.0.lock().unwrap().push("outer".into());
        next()
    }
}

fn info() -> StageInfo {
    StageInfo { stage: Stage::Forward, epoch: 0, batch_index: 3, training: true }
}

#[test]
fn registry_discovers_plugins_from_other_crates() {
    assert!(registered_plugins().iter().any(|r| r.name == "test-counting"));
    let none = serde_json::Map::new();
    let stack = PluginStack::from_registry(&["test-counting".to_string()], &none).unwrap();
    assert_eq!(stack.names(), vec!["test-counting"]);
    let mut ran = 0;
    stack
        .run(info(), &mut || {
            ran += 1;
            Ok(())
        })
        .unwrap();
    assert_eq!(ran, 1);
    let err = PluginStack::from_registry(&["nope".to_string()], &none).err().unwrap();
    assert!(err.to_string().contains("no replay plugin named `nope`"), "{err}");
    let twice = ["test-counting".to_string(), "test-counting".to_string()];
    let err = PluginStack::from_registry(&twice, &none).err().unwrap();
    assert!(err.to_string().contains("listed twice"), "{err}");
    let mut cfg = serde_json::Map::new();
    cfg.insert("other".into(), serde_json::json!({}));
    let err = PluginStack::from_registry(&["test-counting".to_string()], &cfg).err().unwrap();
    assert!(err.to_string().contains("does not enable"), "{err}");
    assert!(PluginStack::from_registry(&[], &none).unwrap().is_empty(), "replay= empty: native");
    // This binary links no ptl-plugins: `all` names nothing, and says so instead of running native.
    let err = PluginStack::from_registry(&["all".to_string()], &none).err().unwrap();
    assert!(err.to_string().contains("ptl-plugins"), "{err}");
}

#[test]
fn stacked_plugins_nest_in_priority_order_and_native_runs_once() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let inner = CountingPlugin { log: log.clone() };
    let stack = PluginStack::new(vec![Box::new(inner), Box::new(Outer(log.clone()))]);
    let native_log = log.clone();
    stack
        .run(info(), &mut || {
            native_log.lock().unwrap().push("native".into());
            Ok(())
        })
        .unwrap();
    assert_eq!(*log.lock().unwrap(), vec!["outer", "enter Forward", "native", "leave Forward"]);
    let empty = PluginStack::default();
    let mut n = 0;
    empty
        .run(info(), &mut || {
            n += 1;
            Ok(())
        })
        .unwrap();
    assert_eq!(n, 1, "with no plugin the stage runs natively");
}

fn manifest() -> Manifest {
    Manifest {
        format: ptl_trainer::fit::checkpoint::CHECKPOINT_FORMAT,
        ptl_version: "test".into(),
        loop_state: LoopState {
            epoch: 2,
            global_step: 7,
            last_opt_step: 40,
            step_losses: vec![1.5, 1.25],
            best_fitness: Some(0.25),
            ..LoopState::default()
        },
        names: vec!["person".into(), "dog".into()],
        train_args: serde_json::json!({"epochs": 3}),
        optimizer: serde_json::json!({"lr": [0.01]}),
        scaler: serde_json::Value::Null,
        ema: serde_json::json!({"updates": 7}),
        criterion: serde_json::Value::Null,
        callbacks: Default::default(),
        plugins: Default::default(),
        recordings: "none".into(),
        history: Default::default(),
    }
}

#[test]
fn checkpoint_round_trip_and_corruption_is_typed() {
    let dir = std::env::temp_dir().join(format!("ptl-ckpt-{}", std::process::id()));
    let path = dir.join("last.ckpt");
    let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], 3, Device::Cpu).unwrap();
    let m = Tensor::zeros(vec![2, 2], DType::F32, Device::Cpu).unwrap();
    let ckpt = Checkpoint { manifest: manifest(), tensors: vec![("model.w".into(), w.clone()), ("optim.0.momentum".into(), m)] };
    save_checkpoint(&path, &ckpt).unwrap();
    let leftovers: Vec<_> =
        std::fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".tmp")).collect();
    assert!(leftovers.is_empty(), "temporary file renamed away: {leftovers:?}");
    let back = load_checkpoint(&path, Device::Cpu).unwrap();
    assert_eq!(back.manifest.loop_state, ckpt.manifest.loop_state);
    assert_eq!(back.part("model")["w"].to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);

    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
    assert!(matches!(load_checkpoint(&path, Device::Cpu), Err(TrainerError::Checkpoint { .. })));
    // The manifest comes from the header alone; the tensors are checked when loaded.
    assert_eq!(read_manifest(&path).unwrap().loop_state, ckpt.manifest.loop_state);
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    std::fs::write(&path, &bytes[..8 + header_len / 2]).unwrap();
    let e = read_manifest(&path).err().unwrap();
    assert!(matches!(e, TrainerError::Checkpoint { .. }) && e.to_string().contains("does not fit the file"), "{e}");
    std::fs::write(&path, b"definitely not a checkpoint").unwrap();
    let e = load_checkpoint(&path, Device::Cpu).err().unwrap();
    assert!(matches!(e, TrainerError::Checkpoint { .. }), "{e}");
    let e = read_manifest(&path).err().unwrap();
    assert!(matches!(e, TrainerError::Checkpoint { .. }), "{e}");
    assert!(matches!(load_checkpoint(&dir.join("missing.ckpt"), Device::Cpu), Err(TrainerError::Io { .. })));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn step_timing_statistics() {
    let t = StepTiming::from_samples(&[4.0, 1.0, 3.0, 2.0]);
    assert_eq!((t.timed_steps, t.median_ms, t.min_ms, t.max_ms), (4, 2.5, 1.0, 4.0));
    // sorted[int(q·(n−1))]: int(0.3) = 0, int(2.7) = 2
    assert_eq!((t.p10_ms, t.p90_ms), (1.0, 3.0));
    assert_eq!(StepTiming::from_samples(&[]).timed_steps, 0);
}

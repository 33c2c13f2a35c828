//! `cargo xtask bench`: the training benchmark in alternating fresh processes, next to Ultralytics.
//!
//! Workload (the reference system's benchmark): YOLO26n-pose, batch 4, 640 px, mosaic every epoch, seed 347, on the
//! synthetic set `ptl data synth` writes (512 training images of which 226 backgrounds, 15
//! validation images); both frameworks train on the same folder. Arms run as A B C A B C … per
//! precision, each in a fresh process; every finished run is appended to `runs.jsonl` at once, so a
//! call that is cut short keeps what it measured, and `--report` merges the files of several calls
//! into one table (`bench.md`) and one JSON (`bench.json`).
//!
//! Precision pairing: ptl `16-mixed` ↔ Ultralytics `amp=True` (FP16 + GradScaler), `bf16-mixed` ↔
//! `amp=bf16`, `32-true` ↔ `amp=False`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde_json::{json, Value};

pub(crate) const ULTRA_SCRIPT: &str = include_str!("../assets/ultralytics_bench.py");
const ULTRA: &str = "ultralytics";

const HELP: &str = "usage: cargo xtask bench [options]            run the benchmark here (builds ptl in release)
       cargo xtask bench --pack [options]     write bench-pack/ for the GPU machine: `bash bench-pack/run.sh [options]`
       cargo xtask bench --report DIR|FILE... [--out DIR]   merge the runs.jsonl of earlier calls (or runs files) into one table
options:
  --arms A,B         ptl arms (all but the dense ones on the host loss path): native (default), workers0 (batches built on the training thread),
                     feature (replay=feature), feature+stem (replay=feature,stem), all (replay=all:
                     every replay plugin of ptl-plugins), dense (loss_assigner=dense: the fixed-shape
                     assigner and loss), all+dense (both: with the dense loss `all` records a step's
                     forward and loss as one region, `step`), all+loss (the same, named as before),
                     all+plan, all+summed (all+dense with arena planning named on — the default — or off),
                     all+ownarenas (all+dense without the device's turn arena: the backward graphs'
                     and the optimizer update's arenas apart),
                     pieces+loss (the trunk, each stem and the loss recorded apart, no step region);
                     any arm with +strict (tf32=false), +cl (channels_last=true), +ws
                     (PTL_CUDNN_WORKSPACE_MIB=auto: per-shape cuDNN workspaces) and/or +timed
                     (PTL_CUDNN_TIMED=1: convolution engines chosen by timing among cuDNN's first
                     six) or +timedall (PTL_CUDNN_TIMED=all: among every usable engine),
                     +krsc (PTL_WEIGHT_KRSC=1: autocast's convolution weight copies in K, R, S, C
                     order, which cuDNN reads without converting the filter) or +oihw
                     (PTL_WEIGHT_KRSC=0: in O, I, H, W order), +pdl / +nopdl (PTL_PDL=1 / 0: ptl's
                     kernels with / without programmatic dependent launch; the same bytes),
                     +onestream (PTL_SIDE_STREAM=0: no second stream for weight gradients and the
                     one-to-one head; +side8 with eight side tasks in flight instead of three,
                     +sidenp with both streams at one priority, +held256 joining the oldest
                     side tasks early beyond 256 MiB of frees waiting for them (the default),
                     +heldoff without that cap: all with the same bytes), +wskept32
                     (PTL_CUDNN_KEPT_WORKSPACE_MIB=32: native work borrows a cuDNN workspace
                     above 32 MiB for its call instead of keeping it, the default) or
                     +wskeptoff (=off: the kept workspace grows to the largest need; the
                     same bytes)
  --vs ultralytics   also run Ultralytics 8.4.190 (wheels from .whl/ when packing)
  --ultra-arms A,B   Ultralytics arms with --vs: eager (default; deterministic=True, the reference of
                     the ratios), compile (its compile=True), reduce-overhead (compile=reduce-overhead:
                     CUDA graphs of the model), nondeterministic (eager, deterministic=False); a crash
                     is reported with its error and stops no other arm
  --batches B,C      a sweep: the whole bench once per batch size (e.g. 4,16,32,64), each into
                     <out>/b<batch>/, then one table of every batch in <out>
  --precisions P,Q   bf16-mixed,32-true,16-mixed (default bf16-mixed)
  --pairs N          rounds of every arm per precision (default 3)
  --epochs N         epochs per run (default 1)
  --optimizer O      MuSGD (default), auto, SGD, AdamW
  --budget-s S       start no run that would end after S seconds (estimated from earlier runs)
  --out DIR          results (default $OUT or bench-out)
  --work DIR         dataset, kernel cache and run folders, reused across calls; it must be yours and
                     writable by nobody else (default: a fresh private folder under the temporary
                     directory, removed by nobody: its path is printed)
  --warm             keep the kernel cache (default: the first ptl run starts with an empty one: cold);
                     needs --work, where an earlier call left the caches
  --device D         ptl's device (default cuda:0)
  --devices 0,1      data-parallel runs on these GPUs (Ultralytics' `device=0,1`): ptl trains with
                     `device=0,1` (one worker process per GPU), Ultralytics under
                     torch.distributed.run; --batch is then per GPU (both get the global batch,
                     batch × GPUs, and divide it), the set has 128 × the global batch images, and
                     the report adds images/s per GPU and, beside one-GPU runs of the same arm and
                     per-GPU batch (`--devices 0`, merged with --report), the scaling
  --imgsz N          image size of the dataset and the runs (default 640)
  --images N         training images of the synthetic set (default 128 × batch: 512 at batch 4, 128 steps
                     per epoch at any batch size, so the traced GPU window fits; 44 % backgrounds)
  --batch N          batch size of every run, ptl and Ultralytics (default 4)";

#[derive(Clone, Debug)]
struct Opts {
    arms: Vec<String>,
    ultralytics: bool,
    precisions: Vec<String>,
    pairs: usize,
    epochs: usize,
    optimizer: String,
    budget_s: Option<f64>,
    out: PathBuf,
    /// `None`: a fresh private folder is made at the start.
    work: Option<PathBuf>,
    cold_first: bool,
    device: String,
    imgsz: usize,
    /// `None`: 128 × batch (128 steps per epoch whatever the batch size).
    images: Option<usize>,
    batch: usize,
    /// Batch sizes of a sweep (empty: `batch` alone).
    batches: Vec<usize>,
    /// Ultralytics arms (`--ultra-arms`), run when `ultralytics` is set.
    ultra_arms: Vec<String>,
    /// GPUs of a data-parallel run (`--devices`; empty: one device, `device`).
    gpus: Vec<usize>,
}

impl Opts {
    /// Training images of the synthetic set.
    fn images(&self) -> usize {
        self.images.unwrap_or(128 * self.global_batch())
    }

    /// Ranks of a run: the GPUs `--devices` lists, else one.
    fn world(&self) -> usize {
        self.gpus.len().max(1)
    }

    /// The batch every run is given: `batch` per GPU times the GPUs (Ultralytics' `batch` is global).
    fn global_batch(&self) -> usize {
        self.batch * self.world()
    }

    /// `--devices` as Ultralytics spells it (`0,1`), if given.
    fn device_list(&self) -> Option<String> {
        (!self.gpus.is_empty()).then(|| self.gpus.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(","))
    }
}

/// `--devices`: distinct GPU ordinals.
fn parse_devices(v: &str) -> Result<Vec<usize>, String> {
    let mut gpus = Vec::new();
    for d in v.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let g: usize = d.parse().map_err(|_| format!("--devices: `{d}` is not a GPU number (e.g. --devices 0,1)"))?;
        if gpus.contains(&g) {
            return Err(format!("--devices: GPU {g} is listed twice"));
        }
        gpus.push(g);
    }
    if gpus.is_empty() {
        return Err("--devices needs at least one GPU number (e.g. --devices 0,1)".into());
    }
    Ok(gpus)
}

fn parse(args: &[String]) -> Result<(Opts, Vec<String>), String> {
    let mut o = Opts {
        arms: vec!["native".into()],
        ultralytics: false,
        precisions: vec!["bf16-mixed".into()],
        pairs: 3,
        epochs: 1,
        optimizer: "MuSGD".into(),
        budget_s: None,
        out: std::env::var_os("OUT").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("bench-out")),
        work: None,
        cold_first: true,
        device: "cuda:0".into(),
        imgsz: 640,
        images: None,
        batch: 4,
        batches: Vec::new(),
        ultra_arms: vec!["eager".into()],
        gpus: Vec::new(),
    };
    let mut rest = Vec::new();
    let mut it = args.iter();
    let list = |v: &str| v.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect::<Vec<_>>();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value\n{HELP}"));
        match a.as_str() {
            "--arms" => o.arms = list(&val("--arms")?),
            "--vs" => {
                let v = val("--vs")?;
                if v != ULTRA {
                    return Err(format!("--vs {v}: only `ultralytics` is known"));
                }
                o.ultralytics = true;
            }
            "--precisions" => o.precisions = list(&val("--precisions")?),
            "--pairs" => o.pairs = val("--pairs")?.parse().map_err(|_| "--pairs wants a number".to_string())?,
            "--epochs" => o.epochs = val("--epochs")?.parse().map_err(|_| "--epochs wants a number".to_string())?,
            "--optimizer" => o.optimizer = val("--optimizer")?,
            "--budget-s" => o.budget_s = Some(val("--budget-s")?.parse().map_err(|_| "--budget-s wants seconds".to_string())?),
            "--out" => o.out = PathBuf::from(val("--out")?),
            "--work" => o.work = Some(PathBuf::from(val("--work")?)),
            "--warm" => o.cold_first = false,
            "--device" => o.device = val("--device")?,
            "--imgsz" => o.imgsz = val("--imgsz")?.parse().map_err(|_| "--imgsz wants a number".to_string())?,
            "--images" => o.images = Some(val("--images")?.parse().map_err(|_| "--images wants a number".to_string())?),
            "--batch" => o.batch = val("--batch")?.parse().map_err(|_| "--batch wants a number".to_string())?,
            "--batches" => {
                o.batches = list(&val("--batches")?)
                    .iter()
                    .map(|b| b.parse().map_err(|_| format!("--batches: `{b}` is not a batch size")))
                    .collect::<Result<_, _>>()?
            }
            "--ultra-arms" => o.ultra_arms = list(&val("--ultra-arms")?),
            "--devices" => o.gpus = parse_devices(&val("--devices")?)?,
            "-h" | "--help" => return Err(HELP.into()),
            other => rest.push(other.to_string()),
        }
    }
    for arm in &o.arms {
        arm_overrides(arm)?;
    }
    for p in &o.precisions {
        ultra_amp(p)?;
    }
    for a in &o.ultra_arms {
        ultra_arm(a)?;
    }
    if o.batches.contains(&0) {
        return Err("--batches: a batch size must be at least 1".into());
    }
    if !o.cold_first && o.work.is_none() {
        return Err("--warm reuses the caches of an earlier call: give its --work DIR".into());
    }
    if o.pairs == 0 || o.epochs == 0 || o.batch == 0 {
        return Err("--pairs, --epochs and --batch must be at least 1".into());
    }
    Ok((o, rest))
}

/// The work folder: the one `--work` names, which must be this user's and writable by nobody
/// else (its Ultralytics install goes on PYTHONPATH), or a fresh private one (mode 0700, made
/// here, so nothing in it was put there by someone else).
fn work_folder(o: &Opts) -> Result<PathBuf, String> {
    match &o.work {
        Some(w) => {
            std::fs::create_dir_all(w).map_err(|e| format!("{}: {e}", w.display()))?;
            check_own_private(w)?;
            Ok(w.clone())
        }
        None => {
            let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            let w = std::env::temp_dir().join(format!("ptl-bench-{}-{stamp}", std::process::id()));
            let mut b = std::fs::DirBuilder::new();
            #[cfg(unix)]
            std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
            b.create(&w).map_err(|e| format!("making the work folder {}: {e}", w.display()))?;
            eprintln!("bench: work folder {} (pass --work {} to reuse its caches)", w.display(), w.display());
            Ok(w)
        }
    }
}

/// Refuses a folder of another user, or one others can write (a planted `ul_site` would run as
/// this user through PYTHONPATH).
pub(crate) fn check_own_private(dir: &Path) -> Result<(), String> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        // /proc/self belongs to this process's effective user.
        let me = std::fs::metadata("/proc/self").map_err(|e| format!("/proc/self: {e}"))?.uid();
        if m.file_type().is_symlink() || m.uid() != me || m.mode() & 0o022 != 0 {
            return Err(format!(
                "--work {}: not a folder of yours that only you can write (owner {}, mode {:o}); use another folder",
                dir.display(),
                m.uid(),
                m.mode() & 0o777
            ));
        }
    }
    Ok(())
}

/// `key=value` overrides of a ptl arm.
fn arm_overrides(arm: &str) -> Result<Vec<String>, String> {
    // `<arm>+strict`: the arm with strict FP32 convolutions (32-true's TF32 off); `<arm>+cl`:
    // with channels-last activations; `<arm>+ws`: with per-shape cuDNN workspaces (an
    // environment variable, [`arm_env`]: no key).
    for (suffix, key) in [
        ("+strict", Some("tf32=false")),
        ("+cl", Some("channels_last=true")),
        ("+ws", None),
        ("+timed", None),
        ("+timedall", None),
        ("+krsc", None),
        ("+oihw", None),
        ("+pdl", None),
        ("+nopdl", None),
        ("+onestream", None),
        ("+side8", None),
        ("+sidenp", None),
        ("+held256", None),
        ("+heldoff", None),
        ("+wskept32", None),
        ("+wskeptoff", None),
    ] {
        if let Some(base) = arm.strip_suffix(suffix) {
            let mut o = arm_overrides(base)?;
            o.extend(key.map(str::to_string));
            return Ok(o);
        }
    }
    match arm {
        // The loss path is named on every arm, so arms compare as labelled whatever the default.
        "native" => Ok(vec!["loss_assigner=host".into()]),
        "workers0" => Ok(vec!["workers=0".into(), "loss_assigner=host".into()]),
        "feature" => Ok(vec!["replay=feature".into(), "loss_assigner=host".into()]),
        "feature+stem" => Ok(vec!["replay=feature,stem".into(), "loss_assigner=host".into()]),
        "all" => Ok(vec!["replay=all".into(), "loss_assigner=host".into()]),
        "dense" => Ok(vec!["loss_assigner=dense".into()]),
        "all+dense" => Ok(vec!["replay=all".into(), "loss_assigner=dense".into()]),
        "all+loss" => Ok(vec!["replay=all,loss".into(), "loss_assigner=dense".into()]),
        // `all+dense` with arena planning named on (all+plan) or off (all+summed: each arena the
        // sum of its capture's allocations).
        "all+plan" => Ok(vec!["replay=all".into(), "loss_assigner=dense".into(), format!("replay_config={}", planned_arenas_json(true))]),
        "all+summed" => Ok(vec!["replay=all".into(), "loss_assigner=dense".into(), format!("replay_config={}", planned_arenas_json(false))]),
        // `all+dense` without the device's turn arena: each recorder's backward graphs and the
        // optimizer's update keep arenas of their own.
        "all+ownarenas" => Ok(vec![
            "replay=all".into(),
            "loss_assigner=dense".into(),
            format!("replay_config={}", every_plugin_json(json!({ "take_turns": false }))),
        ]),
        // Every region but the step one: the trunk, each stem and the loss recorded apart.
        "pieces+loss" => Ok(vec!["replay=feature,stem,loss,ns,optimizer".into(), "loss_assigner=dense".into()]),
        other => Err(format!(
            "unknown arm `{other}` (known: native, workers0, feature, feature+stem, all, dense, all+dense, all+loss, all+plan, all+summed, all+ownarenas, pieces+loss; each with +strict for strict FP32 convolutions, +cl for channels-last activations, +ws for per-shape cuDNN workspaces +timed / +timedall for convolution engines chosen by timing among six / all, +krsc / +oihw for K, R, S, C / O, I, H, W weight copies, +pdl / +nopdl with / without programmatic dependent launch and/or +onestream / +side8 / +sidenp / +held256 / +heldoff for the second stream, +wskept32 / +wskeptoff with cuDNN workspaces above 32 MiB borrowed per call / kept)"
        )),
    }
}

/// The numeric variant of an arm: its `+strict`, `+cl`, `+ws`, `+timed`, `+krsc` and `+oihw` suffixes, sorted and joined
/// (empty for none). Arms of one variant run the same convolution engines, so their bytes agree.
fn numeric_variant(arm: &str) -> String {
    let arm = arm.strip_suffix("-cold").unwrap_or(arm);
    let mut parts: Vec<&str> =
        arm.split('+').skip(1).filter(|p| matches!(*p, "strict" | "cl" | "ws" | "timed" | "timedall" | "krsc" | "oihw")).collect();
    parts.sort_unstable();
    parts.iter().map(|p| format!("+{p}")).collect()
}

/// Environment variables of a ptl arm's process: `+ws` sets `PTL_CUDNN_WORKSPACE_MIB=auto` (the
/// cuDNN workspace cap follows each convolution's tensors), `+timed` sets `PTL_CUDNN_TIMED=1`
/// (convolution engines chosen by timing among the first six of cuDNN's ranking), `+timedall`
/// `PTL_CUDNN_TIMED=all` (among every usable engine), `+krsc` `PTL_WEIGHT_KRSC=1` (autocast's
/// weight copies in K, R, S, C order) and `+oihw` `PTL_WEIGHT_KRSC=0` (in O, I, H, W order),
/// `+pdl` / `+nopdl` `PTL_PDL=1` / `0` (kernels launched with / without programmatic dependent
/// launch), `+onestream` `PTL_SIDE_STREAM=0` (no second
/// stream beside the main chain), `+side8` eight side tasks in flight instead of three,
/// `+sidenp` both streams at one priority, `+held256` `PTL_SIDE_HELD_MIB=256` (the oldest side
/// tasks joined early when more than 256 MiB of frees wait for them: the default since 2026-12-07)
/// and `+heldoff` `PTL_SIDE_HELD_MIB=off` (no such cap); `+wskept32` `PTL_CUDNN_KEPT_WORKSPACE_MIB=32`
/// (native work borrows a cuDNN workspace above 32 MiB for its call instead of keeping it: the
/// default since 2026-12-07) and `+wskeptoff` `PTL_CUDNN_KEPT_WORKSPACE_MIB=off` (the kept
/// workspace grows to the largest need).
fn arm_env(arm: &str) -> Vec<(&'static str, &'static str)> {
    let parts: Vec<&str> = arm.split('+').skip(1).collect();
    let mut env = Vec::new();
    if parts.contains(&"ws") {
        env.push(("PTL_CUDNN_WORKSPACE_MIB", "auto"));
    }
    if parts.contains(&"timed") {
        env.push(("PTL_CUDNN_TIMED", "1"));
    }
    if parts.contains(&"timedall") {
        env.push(("PTL_CUDNN_TIMED", "all"));
    }
    if parts.contains(&"krsc") {
        env.push(("PTL_WEIGHT_KRSC", "1"));
    }
    if parts.contains(&"oihw") {
        env.push(("PTL_WEIGHT_KRSC", "0"));
    }
    if parts.contains(&"pdl") {
        env.push(("PTL_PDL", "1"));
    }
    if parts.contains(&"nopdl") {
        env.push(("PTL_PDL", "0"));
    }
    if parts.contains(&"onestream") {
        env.push(("PTL_SIDE_STREAM", "0"));
    }
    if parts.contains(&"sidenp") {
        env.push(("PTL_SIDE_PRIORITY", "0"));
    }
    if parts.contains(&"side8") {
        env.push(("PTL_SIDE_IN_FLIGHT", "8"));
    }
    if parts.contains(&"held256") {
        env.push(("PTL_SIDE_HELD_MIB", "256"));
    }
    if parts.contains(&"heldoff") {
        env.push(("PTL_SIDE_HELD_MIB", "off"));
    }
    if parts.contains(&"wskept32") {
        env.push(("PTL_CUDNN_KEPT_WORKSPACE_MIB", "32"));
    }
    if parts.contains(&"wskeptoff") {
        env.push(("PTL_CUDNN_KEPT_WORKSPACE_MIB", "off"));
    }
    env
}

/// `replay_config` turning arena planning on or off in every replay plugin of ptl-plugins.
fn planned_arenas_json(on: bool) -> Value {
    every_plugin_json(json!({ "plan_arenas": on }))
}

/// `replay_config` giving every replay plugin of ptl-plugins the recorder `setting`.
fn every_plugin_json(setting: Value) -> Value {
    Value::Object(["step", "optimizer", "loss", "feature", "stem", "ns"].into_iter().map(|p| (p.to_string(), setting.clone())).collect())
}

/// An Ultralytics arm: (label in the tables, its `compile=`, its `deterministic=`, PyTorch's
/// `cudnn.allow_tf32`).
type UltraArm = (&'static str, &'static str, &'static str, &'static str);

/// The Ultralytics arms by name.
const ULTRA_ARMS: [&str; 5] = ["eager", "compile", "reduce-overhead", "nondeterministic", "strict"];

fn ultra_arm(name: &str) -> Result<UltraArm, String> {
    match name {
        "eager" => Ok((ULTRA, "False", "True", "True")),
        "compile" => Ok(("ultralytics-compile", "True", "True", "True")),
        "reduce-overhead" => Ok(("ultralytics-reduce-overhead", "reduce-overhead", "True", "True")),
        "nondeterministic" => Ok(("ultralytics-nondeterministic", "False", "False", "True")),
        // Strict FP32 convolutions (PyTorch's TF32 off): 32-true's like for like with `+strict`.
        "strict" => Ok(("ultralytics-strict", "False", "True", "False")),
        other => Err(format!("unknown Ultralytics arm `{other}` ({})", ULTRA_ARMS.join(", "))),
    }
}

/// The Ultralytics arm a table label belongs to.
fn ultra_arm_of_label(label: &str) -> Option<UltraArm> {
    ULTRA_ARMS.iter().filter_map(|a| ultra_arm(a).ok()).find(|a| a.0 == label)
}

/// Ultralytics' `amp` for a ptl precision.
fn ultra_amp(precision: &str) -> Result<&'static str, String> {
    match precision {
        "16-mixed" => Ok("True"),
        "bf16-mixed" => Ok("bf16"),
        "32-true" => Ok("False"),
        other => Err(format!("unknown precision `{other}` (bf16-mixed, 32-true, 16-mixed)")),
    }
}

/// `--report`'s arguments: folders or runs files, and `--out DIR` (default `$OUT`, else
/// `bench-out`).
fn report_args(args: &[String]) -> Result<(Vec<PathBuf>, PathBuf), String> {
    let mut out = std::env::var_os("OUT").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("bench-out"));
    let mut dirs = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = PathBuf::from(it.next().ok_or("--out needs a folder")?),
            x if x.starts_with("--") => {
                return Err(format!("unknown option {x} after --report (it takes folders or runs files, and --out DIR)"))
            }
            _ => dirs.push(PathBuf::from(a)),
        }
    }
    if dirs.is_empty() {
        return Err("--report needs at least one folder (with runs.jsonl) or runs file".into());
    }
    Ok((dirs, out))
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if args.first().map(String::as_str) == Some("--report") {
        let (dirs, out) = report_args(&args[1..])?;
        let mut recs = Vec::new();
        for d in &dirs {
            // A folder's runs.jsonl, or a runs file itself (e.g. a kept `runs-before-….jsonl`).
            recs.extend(read_runs(&if d.is_dir() { d.join("runs.jsonl") } else { d.clone() })?);
        }
        return write_report(&recs, &out);
    }
    if args.first().map(String::as_str) == Some("--here") {
        // On the GPU machine, from bench-pack/run.sh: ptl and the driver lie beside this binary.
        let (mut o, _) = parse(&args[1..])?;
        o.work = Some(work_folder(&o)?);
        let dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_default();
        return run_sweep(&o, &crate::artifacts::unpacked(&dir.join("ptl"))?, &dir.join("ultralytics_bench.py"), Some(&dir.join("whl")));
    }
    let pack = args.iter().any(|a| a == "--pack");
    let args: Vec<String> = args.iter().filter(|a| *a != "--pack").cloned().collect();
    let (o, rest) = parse(&args)?;
    if let Some(x) = rest.first() {
        return Err(format!("unknown option {x}\n{HELP}"));
    }
    let root = crate::workspace_root();
    let ptl = root.join("target/release/ptl");
    if pack {
        // The pack's ptl leaves out the default job's start weights (the bench names its model):
        // 7 MB less to carry to the GPU machine.
        crate::cargo("build ptl (release, lean)", &["build", "--release", "-p", "ptl", "--no-default-features", "--features", "cuda"])?;
        crate::cargo("build xtask (release)", &["build", "--release", "-p", "ptl-xtask"])?;
        return write_pack(&root, &ptl, &args, o.ultralytics);
    }
    crate::cargo("build ptl and xtask (release)", &["build", "--release", "-p", "ptl", "-p", "ptl-xtask"])?;
    let mut o = o;
    o.work = Some(work_folder(&o)?);
    let script = work_of(&o).join("ultralytics_bench.py");
    std::fs::write(&script, ULTRA_SCRIPT).map_err(|e| format!("{}: {e}", script.display()))?;
    let wheels = root.join(".whl");
    run_sweep(&o, &ptl, &script, wheels.is_dir().then_some(wheels.as_path()))
}

fn write_pack(root: &Path, ptl: &Path, args: &[String], ultralytics: bool) -> Result<(), String> {
    let pack = root.join("bench-pack");
    let _ = std::fs::remove_dir_all(&pack);
    std::fs::create_dir_all(&pack).map_err(|e| format!("creating {}: {e}", pack.display()))?;
    // ptl travels xz-compressed (about half its size); the `--here` modes unpack it.
    let mut bytes = crate::artifacts::copy_stripped(ptl, &pack.join("ptl"))?;
    if let Some(saved) = crate::device_pack::compress(&[pack.join("ptl")])? {
        bytes -= saved;
    }
    // The driver travels compressed too; run.sh unpacks it before it runs.
    bytes += crate::artifacts::copy_stripped(&root.join("target/release/ptl-xtask"), &pack.join("xtask"))?;
    if let Some(saved) = crate::device_pack::compress(&[pack.join("xtask")])? {
        bytes -= saved;
    }
    std::fs::write(pack.join("ultralytics_bench.py"), ULTRA_SCRIPT).map_err(|e| format!("writing the driver: {e}"))?;
    if ultralytics {
        bytes += copy_wheels(&root.join(".whl"), &pack.join("whl"))?;
    }
    let defaults = args.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ");
    let script = format!(
        "#!/usr/bin/env bash\n# cargo xtask bench on the GPU machine; arguments replace the packed defaults.\n\
         # Results: $OUT/runs.jsonl, $OUT/bench.md, $OUT/bench.json (OUT defaults to bench-pack/out).\n\
         set -u\ncd \"$(dirname \"$0\")\"\nexport OUT=${{OUT:-$PWD/out}}\n\
         if [ -f xtask.xz ]; then xz -d -f xtask.xz && chmod +x xtask; fi\n\
         for d in /usr/local/cuda/extras/CUPTI/lib64 /usr/local/cuda/lib64; do [ -d $d ] && export LD_LIBRARY_PATH=$d:${{LD_LIBRARY_PATH:-}}; done\n\
         nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; echo \"cores: $(nproc)\"\n\
         if [ $# -gt 0 ]; then exec ./xtask bench --here \"$@\"; else exec ./xtask bench --here {defaults}; fi\n"
    );
    std::fs::write(pack.join("run.sh"), script).map_err(|e| format!("writing run.sh: {e}"))?;
    eprintln!("bench: packed {} ({:.1} MiB); on the GPU machine: bash bench-pack/run.sh", pack.display(), bytes as f64 / 1048576.0);
    Ok(())
}

/// `s` as one shell word: single-quoted, each `'` written as `'\''`.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The work folder once [`work_folder`] has set it.
fn work_of(o: &Opts) -> &Path {
    o.work.as_deref().unwrap_or(Path::new("."))
}

/// Copies the Ultralytics wheels (ultralytics, ultralytics-thop; polars when present, but the
/// driver runs without it) and returns their size.
fn copy_wheels(from: &Path, to: &Path) -> Result<u64, String> {
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    let entries = std::fs::read_dir(from).map_err(|e| {
        format!(
            "{}: {e} (download the wheels there: python3 -m pip download --no-deps --only-binary=:all: -d .whl ultralytics==8.4.190 ultralytics-thop==2.2.3)",
            from.display()
        )
    })?;
    let mut n = 0;
    let mut bytes = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.ends_with(".whl") && name.starts_with("ultralytics") {
            bytes += std::fs::copy(e.path(), to.join(&name)).map_err(|err| format!("copying {name}: {err}"))?;
            n += 1;
        }
    }
    if n < 2 {
        return Err(format!("{}: need the ultralytics and ultralytics-thop wheels, found {n}", from.display()));
    }
    Ok(bytes)
}

/// Which run a record is.
struct RunId<'a> {
    kind: &'a str,
    arm: &'a str,
    precision: &'a str,
    pair: usize,
    /// The first ptl process, with an empty kernel cache.
    cold: bool,
}

/// One finished (or failed) run; `error` is the end of its output when it failed.
fn record(id: RunId<'_>, wall_s: f64, exit: i32, result: Value, error: Option<String>) -> Value {
    json!({ "kind": id.kind, "arm": id.arm, "precision": id.precision, "pair": id.pair, "wall_s": wall_s, "exit": exit,
            "cold": id.cold, "result": result, "error": error })
}

/// The bench at `o.batch`, or once per batch of a `--batches` sweep (each into `<out>/b<batch>`,
/// the caches of the first warming the rest) and then one report of all of them in `<out>`.
fn run_sweep(o: &Opts, ptl: &Path, script: &Path, wheels: Option<&Path>) -> Result<(), String> {
    if o.batches.is_empty() {
        return run_bench(o, ptl, script, wheels);
    }
    let (mut all, mut errors) = (Vec::new(), Vec::new());
    for (i, &b) in o.batches.iter().enumerate() {
        let ob = Opts { batch: b, out: o.out.join(format!("b{b}")), batches: Vec::new(), cold_first: o.cold_first && i == 0, ..o.clone() };
        if let Err(e) = run_bench(&ob, ptl, script, wheels) {
            errors.push(format!("batch {b}: {e}"));
        }
        all.extend(read_runs(&ob.out.join("runs.jsonl")).unwrap_or_default());
    }
    write_report(&all, &o.out)?;
    match errors.is_empty() {
        true => Ok(()),
        false => Err(errors.join("; ")),
    }
}

fn run_bench(o: &Opts, ptl: &Path, script: &Path, wheels: Option<&Path>) -> Result<(), String> {
    let started = Instant::now();
    std::fs::create_dir_all(&o.out).map_err(|e| format!("{}: {e}", o.out.display()))?;
    let data = ensure_dataset(ptl, o)?;
    let site = if o.ultralytics { Some(install_ultralytics(wheels, work_of(o))?) } else { None };
    let kcache = work_of(o).join("kernels");
    if o.cold_first {
        let _ = std::fs::remove_dir_all(&kcache);
        let _ = std::fs::remove_dir_all(cudnn_cache(&kcache));
    }
    let log = o.out.join("runs.jsonl");
    // This call's report covers this call's runs: an earlier call's runs.jsonl in the same folder is
    // kept under a dated name (`--report` merges it back in when wanted).
    if log.exists() {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let kept = o.out.join(format!("runs-before-{secs}.jsonl"));
        std::fs::rename(&log, &kept).map_err(|e| format!("moving the earlier {} aside: {e}", log.display()))?;
        eprintln!("bench: the earlier runs of {} are kept in {}", o.out.display(), kept.display());
    }
    let mut arms: Vec<String> = o.arms.clone();
    if o.ultralytics {
        for a in &o.ultra_arms {
            arms.push(ultra_arm(a)?.0.to_string());
        }
    }
    let mut durations: BTreeMap<String, f64> = BTreeMap::new();
    // A run that fails before any of its kind succeeded (no GPU, a broken install) would fail
    // the same way every time: stop there instead of starting the rest.
    let mut kind_ok: BTreeMap<String, bool> = BTreeMap::new();
    let first_failure = |rec: &Value, kind_ok: &mut BTreeMap<String, bool>| -> Option<String> {
        let ok = rec["exit"] == 0 && !rec["result"].is_null();
        let kind = rec["kind"].as_str().unwrap_or("?").to_string();
        let seen_ok = kind_ok.entry(kind.clone()).or_insert(false);
        *seen_ok |= ok;
        (!*seen_ok).then(|| format!("the first {kind} run failed, so no further run was started"))
    };
    let mut stopped = None;
    let append = |rec: &Value| -> Result<(), String> {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        writeln!(f, "{rec}").map_err(|e| format!("{}: {e}", log.display()))
    };
    if o.cold_first {
        // One extra process with an empty kernel cache, reported apart (arm `<arm>-cold`): the
        // fixed costs of a fresh machine. The paired rounds that follow all start warm.
        if let (Some(arm), Some(precision)) = (o.arms.first(), o.precisions.first()) {
            let rec = run_ptl(o, ptl, &kcache, &data, arm, precision, 0, true)?;
            append(&rec)?;
            eprintln!("bench: cold {arm} {precision}: {}", one_line(&rec));
            durations.insert(arm.clone(), rec["wall_s"].as_f64().unwrap_or(60.0));
            stopped = first_failure(&rec, &mut kind_ok);
        }
    }
    'runs: for precision in &o.precisions {
        for pair in 0..o.pairs {
            for arm in &arms {
                if stopped.is_some() {
                    break 'runs;
                }
                let est = durations.get(&format!("{arm}/{precision}")).or_else(|| durations.get(arm)).copied();
                let est = est.unwrap_or(if arm == ULTRA { 40.0 } else { 30.0 } * o.epochs as f64);
                if let Some(b) = o.budget_s {
                    if started.elapsed().as_secs_f64() + est > b {
                        eprintln!("bench: budget: skipping {arm} {precision} pair {pair} (≈{est:.0} s would end past {b:.0} s)");
                        continue;
                    }
                }
                let t = Instant::now();
                let rec = if let Some(ua) = ultra_arm_of_label(arm) {
                    run_ultralytics(o, script, site.as_deref(), &data, precision, pair, ua)?
                } else {
                    run_ptl(o, ptl, &kcache, &data, arm, precision, pair, false)?
                };
                let took = t.elapsed().as_secs_f64();
                durations.insert(format!("{arm}/{precision}"), took);
                durations.insert(arm.clone(), took);
                append(&rec)?;
                eprintln!("bench: {arm} {precision} pair {pair}: {}", one_line(&rec));
                // Ultralytics' other arms may crash (reduce-overhead does): reported, not a stop.
                if arm == ULTRA || ultra_arm_of_label(arm).is_none() {
                    stopped = first_failure(&rec, &mut kind_ok);
                }
            }
        }
    }
    let report = write_report(&read_runs(&log)?, &o.out);
    match stopped {
        Some(why) => Err(format!("{why}: {}", report.err().unwrap_or_default())),
        None => report,
    }
}

fn ensure_dataset(ptl: &Path, o: &Opts) -> Result<PathBuf, String> {
    let synth = work_of(o).join(format!("synth-{}-{}", o.images(), o.imgsz));
    let yaml = synth.join("data.yaml");
    if yaml.exists() {
        return Ok(yaml);
    }
    let t = Instant::now();
    let run = Command::new(ptl)
        .args(["data", "synth", "--out"])
        .arg(&synth)
        .args(["--train", &o.images().to_string(), "--background", &(o.images() * 226 / 512).to_string(), "--val", "15"])
        .args(["--imgsz", &o.imgsz.to_string(), "--seed", "347"])
        .output()
        .map_err(|e| format!("starting {}: {e}", ptl.display()))?;
    let _ = std::fs::write(o.out.join("synth.log"), [run.stdout.as_slice(), run.stderr.as_slice()].concat());
    if !run.status.success() || !yaml.exists() {
        return Err(format!("ptl data synth failed ({}): {}", run.status, String::from_utf8_lossy(&run.stderr)));
    }
    eprintln!("bench: dataset written in {:.1} s: {}", t.elapsed().as_secs_f64(), synth.display());
    Ok(yaml)
}

pub(crate) fn install_ultralytics(wheels: Option<&Path>, work: &Path) -> Result<PathBuf, String> {
    let site = work.join("ul_site");
    if site.join("ultralytics").is_dir() {
        return Ok(site);
    }
    let wheels = wheels.filter(|w| w.is_dir()).ok_or("--vs ultralytics: no wheel folder (pack with the wheels in .whl/)")?;
    let whl: Vec<PathBuf> = std::fs::read_dir(wheels)
        .map_err(|e| format!("{}: {e}", wheels.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    let st = Command::new("python3")
        .args(["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--target"])
        .arg(&site)
        .args(&whl)
        .status()
        .map_err(|e| format!("starting pip: {e}"))?;
    if !st.success() {
        return Err(format!("pip install of {} wheels failed ({st})", whl.len()));
    }
    Ok(site)
}

/// The cuDNN engine choices of the bench's ptl runs: beside their kernel cache, and cleared with
/// it for a cold run.
fn cudnn_cache(kcache: &Path) -> PathBuf {
    kcache.with_file_name("cudnn")
}

#[allow(clippy::too_many_arguments)]
fn run_ptl(o: &Opts, ptl: &Path, kcache: &Path, data: &Path, arm: &str, precision: &str, pair: usize, cold: bool) -> Result<Value, String> {
    let label = if cold { format!("{arm}-cold") } else { arm.to_string() };
    let project = work_of(o).join(format!("runs/{label}-{precision}-b{}-{pair}", o.batch));
    let _ = std::fs::remove_dir_all(&project);
    let mut cmd = Command::new(ptl);
    cmd.args(ptl_args(o, data, &project, arm, precision)?)
        .env("PTL_KERNEL_CACHE", kcache)
        .env("PTL_CUDNN_CACHE", cudnn_cache(kcache))
        .envs(arm_env(arm));
    let t = Instant::now();
    let out = cmd.output().map_err(|e| format!("starting ptl: {e}"))?;
    let wall = t.elapsed().as_secs_f64();
    // No `+` in log file names (`all+dense` becomes `all_dense`): plain names survive every copy.
    let logname = format!("ptl-{}-{precision}-{pair}.log", label.replace('+', "_"));
    let _ = std::fs::write(o.out.join(&logname), [out.stdout.as_slice(), out.stderr.as_slice()].concat());
    let summary = std::fs::read_to_string(project.join("summary.json")).ok().and_then(|s| serde_json::from_str(&s).ok());
    let exit = out.status.code().unwrap_or(-1);
    let error = (exit != 0).then(|| tail(&out.stderr, 6));
    if let Some(e) = &error {
        eprintln!("bench: ptl {arm} {precision} failed ({}); log {logname}:\n{e}", out.status);
    }
    let mut rec = record(RunId { kind: "ptl", arm: &label, precision, pair, cold }, wall, exit, summary.unwrap_or(Value::Null), error);
    rec["batch"] = json!(o.batch);
    rec["world"] = json!(o.world());
    Ok(rec)
}

/// `ptl`'s arguments for one run of `arm` in `precision`, into `project`: on several GPUs
/// `device=0,1` (ptl's launcher: a worker process per GPU) and the global batch.
fn ptl_args(o: &Opts, data: &Path, project: &Path, arm: &str, precision: &str) -> Result<Vec<String>, String> {
    let mut a = vec!["train".to_string(), format!("data={}", data.display())];
    a.extend([
        format!("epochs={}", o.epochs),
        format!("batch={}", o.global_batch()),
        format!("imgsz={}", o.imgsz),
        format!("optimizer={}", o.optimizer),
    ]);
    a.extend(["close_mosaic=0", "seed=347", "plots=false", "exist_ok=true"].map(str::to_string));
    a.push(format!("save_dir={}", project.display()));
    a.extend(arm_overrides(arm)?);
    match o.device_list() {
        Some(list) => a.push(format!("device={list}")),
        None => a.extend(["--device".to_string(), o.device.clone()]),
    }
    a.extend(["--precision".to_string(), precision.to_string()]);
    Ok(a)
}

fn run_ultralytics(
    o: &Opts,
    script: &Path,
    site: Option<&Path>,
    data: &Path,
    precision: &str,
    pair: usize,
    arm: UltraArm,
) -> Result<Value, String> {
    let (label, compile, deterministic, tf32) = arm;
    let result = work_of(o).join(format!("{label}-{precision}-{pair}.json"));
    let _ = std::fs::remove_file(&result);
    let mut cmd = Command::new("python3");
    cmd.args(ultra_args(o, script, data, &result, precision, (compile, deterministic, tf32))?)
        .env("PYTHONUNBUFFERED", "1")
        .env("ULTRA_WORK", work_of(o).join("ultra"));
    if let Some(s) = site {
        cmd.env("PYTHONPATH", s);
    }
    let t = Instant::now();
    let out = cmd.output().map_err(|e| format!("starting python3: {e}"))?;
    let wall = t.elapsed().as_secs_f64();
    let logname = format!("{label}-{precision}-{pair}.log");
    let _ = std::fs::write(o.out.join(&logname), [out.stdout.as_slice(), out.stderr.as_slice()].concat());
    let res = std::fs::read_to_string(&result).ok().and_then(|s| serde_json::from_str(&s).ok());
    let exit = out.status.code().unwrap_or(-1);
    let error = (exit != 0).then(|| tail(&out.stderr, 6));
    if let Some(e) = &error {
        eprintln!("bench: {label} {precision} failed ({}); log {logname}:\n{e}", out.status);
    }
    // The driver keeps what it measured when the fit raised: that is a crash, reported as one.
    let crashed = res.as_ref().and_then(|r: &Value| r["error"].as_str().map(str::to_string));
    let error = error.or(crashed.map(|e| format!("crashed: {e}")));
    let exit = if error.is_some() && exit == 0 { 1 } else { exit };
    let mut rec = record(RunId { kind: ULTRA, arm: label, precision, pair, cold: false }, wall, exit, res.unwrap_or(Value::Null), error);
    rec["batch"] = json!(o.batch);
    rec["world"] = json!(o.world());
    Ok(rec)
}

/// `python3`'s arguments for one Ultralytics run: the bench script with its options, under
/// `torch.distributed.run` (one process per GPU, as Ultralytics' own DDP launch) on several GPUs,
/// with `--device 0,1` and the global batch. `flags`: compile, deterministic, tf32.
fn ultra_args(
    o: &Opts,
    script: &Path,
    data: &Path,
    result: &Path,
    precision: &str,
    flags: (&str, &str, &str),
) -> Result<Vec<String>, String> {
    let mut a = Vec::new();
    if o.world() > 1 {
        a.extend(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"].map(str::to_string));
        a.push(o.world().to_string());
    }
    a.push(script.display().to_string());
    a.extend(["--data".to_string(), data.display().to_string(), "--out".to_string(), result.display().to_string()]);
    a.extend(["--epochs".to_string(), o.epochs.to_string(), "--amp".to_string(), ultra_amp(precision)?.to_string()]);
    a.extend(["--optimizer".to_string(), o.optimizer.clone(), "--imgsz".to_string(), o.imgsz.to_string()]);
    a.extend(["--batch".to_string(), o.global_batch().to_string()]);
    a.extend(["--compile", flags.0, "--deterministic", flags.1, "--tf32", flags.2].map(str::to_string));
    if let Some(list) = o.device_list() {
        a.extend(["--device".to_string(), list]);
    }
    Ok(a)
}

pub(crate) fn tail(bytes: &[u8], lines: usize) -> String {
    let s = String::from_utf8_lossy(bytes);
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

pub(crate) fn read_runs(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).map_err(|e| format!("{}: {e}", path.display()))).collect()
}

// ---- the report ---------------------------------------------------------------------------------

/// A run's step figure: the median over 16-step stretches of their mean start-to-start time
/// (`window_ms`: a run whose host queues steps ahead of the GPU shows the GPU's pace only over
/// several steps), else — runs recorded before it existed — the median step.
fn step_figure(s2s: &Value) -> Option<f64> {
    if s2s["timed_steps"].as_u64() == Some(0) {
        return None;
    }
    s2s["window_ms"].as_f64().filter(|w| *w > 0.0).or_else(|| s2s["median_ms"].as_f64())
}

/// The figures of one run, whichever framework produced it.
#[derive(Clone, Debug, Default)]
struct Figures {
    wall_s: f64,
    step_ms: Option<f64>,
    /// Images per second at that step (batch × 1000 / step ms).
    images_s: Option<f64>,
    /// What ptl's loader could deliver (its workers' build times), images a second.
    loader_img_s: Option<f64>,
    sync_ms: Option<f64>,
    wait_ms: Option<f64>,
    gpu_ms: Option<f64>,
    /// Kernel time without dependent-launch waits (each kernel from its stream predecessor's end).
    gpu_busy_ms: Option<f64>,
    /// Time with at least one kernel running (the union of the kernels' spans over every stream).
    gpu_active_ms: Option<f64>,
    gpu_kernels: Option<f64>,
    span_ms: Option<f64>,
    launches: Option<f64>,
    copies: Option<f64>,
    syncs: Option<f64>,
    alloc_mib: Option<f64>,
    reserved_mib: Option<f64>,
    map50: Vec<f64>,
    to_first_step_s: Option<f64>,
    hashes: Option<Value>,
}

fn figures(r: &Value) -> Figures {
    let res = &r["result"];
    let f = |v: &Value| v.as_f64();
    let mib = |v: &Value| v.as_f64().map(|b| b / 1048576.0);
    let mut x = Figures { wall_s: r["wall_s"].as_f64().unwrap_or(f64::NAN), ..Figures::default() };
    if r["kind"] == ULTRA {
        x.step_ms = step_figure(&res["start_to_start"]);
        x.sync_ms = f(&res["sync_window_ms_per_step"]);
        x.wait_ms = f(&res["data_wait_ms_mean"]);
        x.to_first_step_s = f(&res["process_to_first_step_s"]);
        x.gpu_ms = f(&res["gpu_breakdown"]["kernel_ms_per_step"]);
        x.gpu_busy_ms = f(&res["gpu_breakdown"]["kernel_busy_ms_per_step"]);
        x.gpu_active_ms = f(&res["gpu_breakdown"]["kernel_active_ms_per_step"]);
        x.gpu_kernels = f(&res["gpu_breakdown"]["kernels_per_step"]);
        x.map50 = res["metrics_per_epoch"]
            .as_array()
            .map(|a| a.iter().filter_map(|m| m["metrics/mAP50(P)"].as_f64()).collect())
            .unwrap_or_default();
    } else {
        let t = &res["timing"];
        // The steady synchronised window where the run has one (the host may queue ahead).
        x.step_ms = f(&t["steady_window_ms_per_step"]).or_else(|| step_figure(&t["start_to_start"]));
        x.sync_ms = f(&t["sync_window_ms_per_step"]);
        x.wait_ms = f(&t["data_wait_ms_mean"]);
        x.gpu_ms = f(&t["gpu"]["kernel_ms_per_step"]);
        // Reports written before the busy time was measured carry 0.
        x.gpu_busy_ms = f(&t["gpu"]["kernel_busy_ms_per_step"]).filter(|v| *v > 0.0);
        x.gpu_active_ms = f(&t["gpu"]["kernel_active_ms_per_step"]).filter(|v| *v > 0.0);
        x.gpu_kernels = f(&t["gpu"]["kernels_per_step"]);
        x.span_ms = f(&t["gpu"]["event_span_ms_per_step"]);
        // The steady-state counts (the traced window) where the run has them.
        let l = if t["launches_steady"].is_object() { &t["launches_steady"] } else { &t["launches"] };
        x.launches = match (f(&l["kernel_launches"]), f(&l["library_calls"]), f(&l["graph_launches"])) {
            (Some(a), Some(b), Some(c)) => Some(a + b + c),
            _ => None,
        };
        x.copies = match (f(&l["host_to_device_copies"]), f(&l["device_to_host_copies"]), f(&l["device_to_device_copies"])) {
            (Some(a), Some(b), Some(c)) => Some(a + b + c),
            _ => None,
        };
        x.syncs = f(&l["host_syncs"]);
        x.to_first_step_s = f(&res["startup"]["process_to_first_step_s"]);
        x.map50 = res["metrics_per_epoch"]
            .as_array()
            .map(|a| {
                a.iter().filter_map(|m| m.as_array()?.iter().find(|kv| kv[0] == "metrics/mAP50(P)").and_then(|kv| kv[1].as_f64())).collect()
            })
            .unwrap_or_default();
        x.hashes = Some(res["hashes"].clone()).filter(|h| !h.is_null());
    }
    x.alloc_mib = mib(&res["peak_allocated_bytes"]);
    x.reserved_mib = mib(&res["peak_reserved_bytes"]);
    // `batch` is per GPU; a step of a data-parallel run takes the global batch.
    let batch = r["batch"].as_f64().unwrap_or(4.0) * world_of(r) as f64;
    x.loader_img_s = res["timing"]["loader_images_per_s"].as_f64();
    x.images_s = x.step_ms.filter(|s| *s > 0.0).map(|s| batch * 1000.0 / s);
    x
}

/// A run's ranks (1 for runs recorded before data-parallel runs existed).
fn world_of(r: &Value) -> u64 {
    r["world"].as_u64().unwrap_or(1).max(1)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) })
}

/// `median (min–max)` of the finite values, or `–`.
fn mr(v: &[Option<f64>], digits: usize) -> String {
    let xs: Vec<f64> = v.iter().flatten().copied().filter(|x| x.is_finite()).collect();
    match median(xs.clone()) {
        None => "–".into(),
        Some(m) if xs.len() == 1 => format!("{m:.digits$}"),
        Some(m) => {
            let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})")
        }
    }
}

/// The precision without a batch suffix (`bf16-mixed · batch 16` → `bf16-mixed`).
fn base_precision(p: &str) -> &str {
    p.split(" · ").next().unwrap_or(p)
}

/// `r` with its batch size (other than 4) and its GPUs (more than one) in its precision label.
fn relabel(r: &Value) -> Value {
    let mut r = r.clone();
    let mut label = r["precision"].as_str().unwrap_or("?").to_string();
    let world = world_of(&r);
    match r["batch"].as_u64() {
        Some(b) if b != 4 || world > 1 => label.push_str(&format!(" · batch {b}")),
        _ => {}
    }
    if world > 1 {
        label.push_str(&format!(" · {world} GPUs"));
    }
    r["precision"] = json!(label);
    r
}

/// (base precision, batch per GPU, arm) of a run.
type ScalingKey = (String, u64, String);

/// Data-parallel scaling: for each (framework and arm, precision, per-GPU batch) with runs on
/// several GPUs and on one, images/s per GPU against the one-GPU run's (medians over runs). Empty
/// without such pairs.
fn scaling_section(ok: &[&Value]) -> String {
    let key = |r: &Value| {
        let arm = r["arm"].as_str().unwrap_or("?").to_string();
        let base = r["precision"].as_str().unwrap_or("?").split(" · ").next().unwrap_or("?").to_string();
        (base, r["batch"].as_u64().unwrap_or(4), arm)
    };
    let mut by: BTreeMap<(ScalingKey, u64), Vec<f64>> = BTreeMap::new();
    for r in ok {
        if let Some(i) = figures(r).images_s {
            by.entry((key(r), world_of(r))).or_default().push(i);
        }
    }
    let mut rows = String::new();
    for (((precision, batch, arm), world), v) in &by {
        if *world < 2 {
            continue;
        }
        let Some(one) = by.get(&((precision.clone(), *batch, arm.clone()), 1)).and_then(|v| median(v.clone())) else { continue };
        let Some(many) = median(v.clone()) else { continue };
        let per_gpu = many / *world as f64;
        rows.push_str(&format!(
            "| {precision} | {arm} | {batch} | {world} | {many:.0} | {per_gpu:.0} | {one:.0} | {:.1} % |\n",
            100.0 * per_gpu / one
        ));
    }
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "\nData-parallel scaling: images/s per GPU on several GPUs against one GPU at the same batch per GPU (medians over runs):\n\n| precision | arm | batch per GPU | GPUs | images/s | images/s per GPU | one GPU images/s | scaling |\n|---|---|---:|---:|---:|---:|---:|---:|\n{rows}"
    )
}

fn write_report(recs: &[Value], out: &Path) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    // Runs of another batch size than the default 4 form their own rows ("bf16-mixed · batch 16"),
    // and so do data-parallel ones ("bf16-mixed · batch 16 · 2 GPUs": the batch per GPU).
    let relabelled: Vec<Value> = recs.iter().map(relabel).collect();
    let recs = relabelled.as_slice();
    let ok: Vec<&Value> = recs.iter().filter(|r| r["exit"] == 0 && !r["result"].is_null()).collect();
    let failed = recs.len() - ok.len();
    // (precision, arm) -> runs, in first-seen order of arms.
    let mut groups: BTreeMap<(String, String), Vec<&Value>> = BTreeMap::new();
    let mut arm_order: Vec<String> = Vec::new();
    for r in &ok {
        let arm = r["arm"].as_str().unwrap_or("?").to_string();
        if !arm_order.contains(&arm) {
            arm_order.push(arm.clone());
        }
        groups.entry((r["precision"].as_str().unwrap_or("?").to_string(), arm)).or_default().push(r);
    }
    let precisions: Vec<String> = {
        let mut p: Vec<String> = groups.keys().map(|k| k.0.clone()).collect();
        p.dedup();
        p
    };
    if ok.is_empty() {
        let md = format!("{} runs, all failed: no figures.\n{}", recs.len(), failed_runs(recs));
        print!("{md}");
        std::fs::write(out.join("bench.md"), &md).map_err(|e| format!("writing bench.md: {e}"))?;
        std::fs::write(out.join("bench.json"), json!({ "groups": [], "failed_runs": failed }).to_string())
            .map_err(|e| format!("writing bench.json: {e}"))?;
        return Err(format!("all {} runs failed (listed in {})", recs.len(), out.join("bench.md").display()));
    }
    let mut md = String::new();
    md.push_str(&format!(
        "{} runs ({} failed). Medians over runs, (min–max) across runs; step = ptl: 16 steps right before the GPU window, the device synchronised at both ends (total / 16; the host may queue steps ahead of the GPU); Ultralytics (a host sync every step): a run's median over 16-step stretches of their mean start-to-start time, after 10 warm-up steps. GPU kernel ms = CUPTI's kernel durations summed; GPU busy ms = the same with each kernel counted from the end of the kernels before it on its stream (ptl's dependently launched kernels start while their predecessor ends and wait for it; Ultralytics' from its profiler trace the same way); GPU active ms = the time with at least one kernel running, the union of the kernels' spans over every stream (kernels side by side on two streams each last longer, so both sums exceed the GPU's working time; the active time does not).\n\n",
        recs.len(),
        failed
    ));
    md.push_str("| precision | arm | runs | complete s | step ms | images/s | sync-window ms | data wait ms | loader images/s | GPU kernel ms/step | GPU busy ms/step | GPU active ms/step | GPU kernels/step | event span ms/step | host launches/step | host copies/step | host syncs/step | peak alloc/reserved MiB | to first step s (cold · warm) | pose mAP50 per epoch |\n");
    md.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    let mut json_groups = Vec::new();
    for p in &precisions {
        for arm in &arm_order {
            let Some(runs) = groups.get(&(p.clone(), arm.clone())) else { continue };
            let fs: Vec<Figures> = runs.iter().map(|r| figures(r)).collect();
            let col = |g: fn(&Figures) -> Option<f64>| fs.iter().map(g).collect::<Vec<_>>();
            let cold: Vec<Option<f64>> = runs.iter().zip(&fs).filter(|(r, _)| r["cold"] == true).map(|(_, f)| f.to_first_step_s).collect();
            let warm: Vec<Option<f64>> = runs.iter().zip(&fs).filter(|(r, _)| r["cold"] != true).map(|(_, f)| f.to_first_step_s).collect();
            let label = if let Some((_, compile, deterministic, tf32)) = ultra_arm_of_label(arm) {
                let extra = match (compile, deterministic, tf32) {
                    ("False", "True", "True") => String::new(),
                    ("False", "True", _) => " strict FP32 (allow_tf32=False)".to_string(),
                    ("False", d, _) => format!(" deterministic={d}"),
                    (c, _, _) => format!(" compile={c}"),
                };
                format!("Ultralytics amp={}{extra}", ultra_amp(base_precision(p)).unwrap_or("?"))
            } else {
                format!("ptl {arm}")
            };
            let map = fs.first().map(|f| f.map50.iter().map(|v| format!("{v:.3}")).collect::<Vec<_>>().join(" ")).unwrap_or_default();
            md.push_str(&format!(
                "| {p} | {label} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} · {} | {} |\n",
                fs.len(),
                mr(&col(|f| Some(f.wall_s)), 1),
                mr(&col(|f| f.step_ms), 1),
                mr(&col(|f| f.images_s), 0),
                mr(&col(|f| f.sync_ms), 1),
                mr(&col(|f| f.wait_ms), 2),
                mr(&col(|f| f.loader_img_s), 0),
                mr(&col(|f| f.gpu_ms), 1),
                mr(&col(|f| f.gpu_busy_ms), 1),
                mr(&col(|f| f.gpu_active_ms), 1),
                mr(&col(|f| f.gpu_kernels), 0),
                mr(&col(|f| f.span_ms), 1),
                mr(&col(|f| f.launches), 1),
                mr(&col(|f| f.copies), 1),
                mr(&col(|f| f.syncs), 2),
                mr(&col(|f| f.alloc_mib), 0),
                mr(&col(|f| f.reserved_mib), 0),
                mr(&cold, 1),
                mr(&warm, 1),
                map
            ));
            json_groups.push(json!({
                "precision": p, "arm": arm, "runs": fs.len(),
                "complete_s": fs.iter().map(|f| f.wall_s).collect::<Vec<_>>(),
                "step_ms": col(|f| f.step_ms), "images_per_s": col(|f| f.images_s), "loader_images_per_s": col(|f| f.loader_img_s), "sync_window_ms": col(|f| f.sync_ms), "data_wait_ms": col(|f| f.wait_ms),
                "gpu_kernel_ms_per_step": col(|f| f.gpu_ms), "gpu_busy_ms_per_step": col(|f| f.gpu_busy_ms), "gpu_active_ms_per_step": col(|f| f.gpu_active_ms), "gpu_kernels_per_step": col(|f| f.gpu_kernels),
                "event_span_ms_per_step": col(|f| f.span_ms), "host_launches_per_step": col(|f| f.launches), "host_copies_per_step": col(|f| f.copies),
                "host_syncs_per_step": col(|f| f.syncs), "peak_allocated_mib": col(|f| f.alloc_mib), "peak_reserved_mib": col(|f| f.reserved_mib),
                "to_first_step_s_cold": cold, "to_first_step_s_warm": warm,
                "map50_per_epoch": fs.iter().map(|f| f.map50.clone()).collect::<Vec<_>>(),
            }));
        }
    }
    md.push_str(&no_gpu_window(&ok));
    // Paired ratios: each arm against Ultralytics (or the first arm) of the same precision and pair.
    let mut ratios = Vec::new();
    md.push_str("\nPaired ratios (same precision, same round; median (min–max) over rounds):\n\n| precision | arm / reference | complete | step | GPU busy | GPU active |\n|---|---|---:|---:|---:|---:|\n");
    for p in &precisions {
        let reference = if groups.contains_key(&(p.clone(), ULTRA.into())) { ULTRA.to_string() } else { arm_order[0].clone() };
        for arm in arm_order.iter().filter(|a| **a != reference && !a.ends_with("-cold")) {
            let (Some(a), Some(b)) = (groups.get(&(p.clone(), arm.clone())), groups.get(&(p.clone(), reference.clone()))) else { continue };
            let mut wall = Vec::new();
            let mut step = Vec::new();
            let mut busy = Vec::new();
            let mut active = Vec::new();
            for ra in a {
                if let Some(rb) = b.iter().find(|rb| rb["pair"] == ra["pair"]) {
                    let (fa, fb) = (figures(ra), figures(rb));
                    wall.push(Some(fa.wall_s / fb.wall_s));
                    step.push(fa.step_ms.zip(fb.step_ms).map(|(x, y)| x / y));
                    busy.push(fa.gpu_busy_ms.zip(fb.gpu_busy_ms).map(|(x, y)| x / y));
                    active.push(fa.gpu_active_ms.zip(fb.gpu_active_ms).map(|(x, y)| x / y));
                }
            }
            md.push_str(&format!(
                "| {p} | {arm} / {reference} | {} | {} | {} | {} |\n",
                mr(&wall, 3),
                mr(&step, 3),
                mr(&busy, 3),
                mr(&active, 3)
            ));
            ratios.push(json!({ "precision": p, "arm": arm, "reference": reference, "complete": wall, "step": step, "gpu_busy": busy, "gpu_active": active }));
        }
    }
    // What removing the serial batch building saved, against what the serial loop waited.
    for p in &precisions {
        let (Some(n), Some(w)) = (groups.get(&(p.clone(), "native".into())), groups.get(&(p.clone(), "workers0".into()))) else { continue };
        let mut saved = Vec::new();
        let mut waited = Vec::new();
        for rw in w {
            if let Some(rn) = n.iter().find(|rn| rn["pair"] == rw["pair"]) {
                let (fw, fnat) = (figures(rw), figures(rn));
                saved.push(Some(fw.wall_s - fnat.wall_s));
                let steps = rw["result"]["timing"]["steps"].as_f64().unwrap_or(0.0);
                waited.push(fw.wait_ms.map(|ms| (ms - fnat.wait_ms.unwrap_or(0.0)) * steps / 1e3));
            }
        }
        md.push_str(&format!(
            "\n{p}: native finishes {} s sooner than workers0; workers0's extra data wait × steps ≈ {} s.\n",
            mr(&saved, 1),
            mr(&waited, 1)
        ));
    }
    // Hashes: every ptl run of one precision, loss algorithm and numeric variant must end with the
    // same bytes (the dense arms compute the loss with another summation order than the host
    // path's; +strict, +cl and +ws pick other convolution engines, so they form their own families
    // in which native and replay must still agree).
    md.push('\n');
    let mut hash_ok = true;
    // A cold run (`<arm>-cold`) belongs to its arm's family: cold and warm processes must agree.
    let dense_arm = |r: &Value| {
        r["arm"]
            .as_str()
            .and_then(|a| arm_overrides(a.strip_suffix("-cold").unwrap_or(a)).ok())
            .is_some_and(|o| o.iter().any(|x| x == "loss_assigner=dense"))
    };
    let mut families: Vec<(String, bool, String)> = Vec::new();
    for r in ok.iter().filter(|r| r["kind"] == "ptl") {
        let key = (r["precision"].as_str().unwrap_or("").to_string(), dense_arm(r), numeric_variant(r["arm"].as_str().unwrap_or("")));
        if !families.contains(&key) {
            families.push(key);
        }
    }
    families.sort();
    for (p, dense, variant) in &families {
        let hs: Vec<(String, Value)> = ok
            .iter()
            .filter(|r| {
                r["precision"] == p.as_str()
                    && r["kind"] == "ptl"
                    && dense_arm(r) == *dense
                    && numeric_variant(r["arm"].as_str().unwrap_or("")) == *variant
            })
            .filter_map(|r| figures(r).hashes.map(|h| (format!("{} #{}", r["arm"].as_str().unwrap_or("?"), r["pair"]), h)))
            .collect();
        if hs.len() > 1 {
            let same = hs.iter().all(|(_, h)| *h == hs[0].1);
            hash_ok &= same;
            let short = hs[0].1["model"].as_str().unwrap_or("").chars().take(16).collect::<String>();
            let loss = if *dense { ", dense loss" } else { "" };
            let variant = if variant.is_empty() { String::new() } else { format!(", {variant}") };
            md.push_str(&format!("{p}{loss}{variant}: {} ptl runs, hashes identical: {same} (model {short}…)\n", hs.len()));
            if !same {
                for (who, h) in &hs {
                    md.push_str(&format!("  {who}: model {} losses {}\n", h["model"], h["step_losses"]));
                }
            }
        }
    }
    // Replay arms count only when every region replayed after its warm-up (the recorder falls
    // back to native on purpose, and then "equal hashes" proves nothing).
    let mut guard_ok = true;
    for r in ok.iter().filter(|r| r["kind"] == "ptl") {
        let counters = &r["result"]["replay_counters"];
        let Some(plugins) = counters.as_object().filter(|m| !m.is_empty()) else { continue };
        let batches = r["result"]["timing"]["steps"].as_u64().unwrap_or(0);
        let optimizer_steps = r["result"]["optimizer_steps"].as_u64().unwrap_or(0);
        // A plugin that made no region saw no call (another plugin took its work: under
        // `replay=all` with the dense loss the `step` region takes the trunk's, the stems' and the
        // loss's); but some plugin must have replayed.
        let active: Vec<(&String, &Value)> =
            plugins.iter().filter(|(_, regions)| regions.as_object().is_some_and(|m| !m.is_empty())).collect();
        if active.is_empty() {
            guard_ok = false;
            md.push_str(&format!(
                "REPLAY GUARD FAILED: {} {} #{}: no plugin made a region\n",
                r["arm"].as_str().unwrap_or("?"),
                r["precision"].as_str().unwrap_or("?"),
                r["pair"]
            ));
        }
        for (plugin, regions) in active {
            // Each plugin says how often its regions are called (the run summary's cadence):
            // optimizer-stage plugins once per optimizer step (at least), the others per batch.
            let steps = match r["result"]["replay_cadence"][plugin.as_str()].as_str() {
                Some("per_optimizer_step") => optimizer_steps,
                _ => batches,
            };
            if r["result"]["replay_cadence"][plugin.as_str()].as_str() == Some("one_per_batch") {
                // One region per batch, chosen by its shapes: the regions' counts add up.
                let (mut replays, mut warm, mut native) = (0u64, 0u64, 0u64);
                for st in regions.as_object().into_iter().flatten().map(|(_, st)| st) {
                    replays += st["replays"].as_u64().unwrap_or(0);
                    warm += st["native"]["CacheFull"].as_u64().unwrap_or(0) + st["native"]["Warmup"].as_u64().unwrap_or(0);
                    native += st["native"].as_object().map(|m| m.values().filter_map(|v| v.as_u64()).sum::<u64>()).unwrap_or(0);
                }
                if replays + warm < batches || native > warm {
                    guard_ok = false;
                    md.push_str(&format!(
                        "REPLAY GUARD FAILED: {} {} #{}: {plugin} (regions together): {replays} replays in {batches} steps, native {native}\n",
                        r["arm"].as_str().unwrap_or("?"),
                        r["precision"].as_str().unwrap_or("?"),
                        r["pair"]
                    ));
                }
                continue;
            }
            for (name, st) in regions.as_object().into_iter().flatten() {
                let native: u64 = st["native"].as_object().map(|m| m.values().filter_map(|v| v.as_u64()).sum()).unwrap_or(0);
                let replays = st["replays"].as_u64().unwrap_or(0);
                // Partial batches (another shape) may run natively; everything else must replay.
                let shape = st["native"]["CacheFull"].as_u64().unwrap_or(0) + st["native"]["Warmup"].as_u64().unwrap_or(0);
                if replays + shape < steps || native > shape {
                    guard_ok = false;
                    md.push_str(&format!(
                        "REPLAY GUARD FAILED: {} {} #{}: {plugin}/{name}: {replays} replays in {steps} steps, native {native} ({})\n",
                        r["arm"].as_str().unwrap_or("?"),
                        r["precision"].as_str().unwrap_or("?"),
                        r["pair"],
                        st["native"]
                    ));
                }
            }
        }
    }
    // The fixed-shape loss: a run whose batches fell back to the host path on more than 1 % of
    // its steps does not measure the dense path.
    for r in ok.iter().filter(|r| r["kind"] == "ptl") {
        let fallbacks = r["result"]["dense_loss_fallbacks"].as_u64().unwrap_or(0);
        let steps = r["result"]["timing"]["steps"].as_u64().unwrap_or(0);
        if fallbacks * 100 > steps {
            guard_ok = false;
            md.push_str(&format!(
                "DENSE LOSS GUARD FAILED: {} {} #{}: {fallbacks} of {steps} steps ran the host loss path (beyond the largest target bucket)\n",
                r["arm"].as_str().unwrap_or("?"),
                r["precision"].as_str().unwrap_or("?"),
                r["pair"]
            ));
        }
    }
    if ok.iter().any(|r| r["result"]["replay_counters"].as_object().is_some_and(|m| !m.is_empty())) {
        md.push_str(&format!(
            "replay guard (every region replayed on every step after warm-up): {}\n",
            if guard_ok { "ok" } else { "FAILED" }
        ));
    }
    md.push_str(&scaling_section(&ok));
    md.push_str(&breakdown_section(&ok));
    md.push_str(&update_steps_section(&ok));
    md.push_str(&memory_section(&ok));
    md.push_str(&startup_table(&ok));
    if failed > 0 {
        md.push_str(&failed_runs(recs));
    }
    print!("{md}");
    std::fs::write(out.join("bench.md"), &md).map_err(|e| format!("writing bench.md: {e}"))?;
    let j =
        json!({ "groups": json_groups, "ratios": ratios, "hashes_identical": hash_ok, "replay_guard_ok": guard_ok, "failed_runs": failed });
    std::fs::write(out.join("bench.json"), serde_json::to_string_pretty(&j).unwrap_or_default())
        .map_err(|e| format!("writing bench.json: {e}"))?;
    // Ultralytics' optional arms (compile, reduce-overhead, nondeterministic) are measured as
    // they are: their crash is a result, listed, not a failure of the bench.
    let optional = |r: &Value| r["arm"].as_str().is_some_and(|a| a != ULTRA && ultra_arm_of_label(a).is_some());
    let failed = recs.iter().filter(|r| (r["exit"] != 0 || r["result"].is_null()) && !optional(r)).count();
    if failed > 0 {
        return Err(format!("{failed} of {} runs failed (listed at the end of {})", recs.len(), out.join("bench.md").display()));
    }
    if !hash_ok {
        return Err("ptl runs of one precision ended with different hashes".into());
    }
    if !guard_ok {
        return Err("a replay arm did not replay every region after its warm-up, or a dense arm ran the host loss on more than 1 % of its steps (bench.md says which)".into());
    }
    Ok(())
}

/// The failed runs with the end of their output.
fn failed_runs(recs: &[Value]) -> String {
    let mut md = String::from("\nFailed runs (their figures are left out):\n\n");
    for r in recs.iter().filter(|r| r["exit"] != 0 || r["result"].is_null()) {
        let err = r["error"].as_str().unwrap_or("no result file was written").replace('\n', " ⏎ ");
        md.push_str(&format!(
            "- {} {} #{}: exit {}: {err}\n",
            r["arm"].as_str().unwrap_or("?"),
            r["precision"].as_str().unwrap_or("?"),
            r["pair"],
            r["exit"]
        ));
    }
    md
}

/// Why ptl runs of a CUDA bench have no kernel figures ("–" in the table), as each run said
/// (epochs too short for the warm-up and the windows, no CUPTI, …).
fn no_gpu_window(ok: &[&Value]) -> String {
    let lines: Vec<String> = ok
        .iter()
        .filter(|r| r["kind"] != ULTRA)
        .filter_map(|r| {
            let why = r["result"]["timing"]["gpu_unavailable"].as_str()?;
            Some(format!("- {} {} #{}: {why}\n", r["arm"].as_str().unwrap_or("?"), r["precision"].as_str().unwrap_or("?"), r["pair"]))
        })
        .collect();
    if lines.is_empty() {
        String::new()
    } else {
        format!("\nRuns without GPU kernel figures, and why:\n\n{}", lines.concat())
    }
}

/// A run's kernel-time breakdown: ptl's traced window, or the Ultralytics driver's profiler window
/// (same shape: `by_stage`, `by_class`, `top`).
fn breakdown_of(r: &Value) -> Option<&Value> {
    let b = if r["kind"] == ULTRA { &r["result"]["gpu_breakdown"] } else { &r["result"]["timing"]["gpu"]["breakdown"] };
    b.is_object().then_some(b)
}

/// Median (ms, kernels) per step of `label` in list `key` over `runs` (absent label: 0 in that run).
fn share_median(runs: &[&Value], key: &str, label: &str) -> (f64, f64) {
    let pick = |f: &str| -> f64 {
        let v: Vec<f64> = runs
            .iter()
            .filter_map(|r| breakdown_of(r))
            .map(|b| b[key].as_array().and_then(|a| a.iter().find(|e| e["label"] == label)).and_then(|e| e[f].as_f64()).unwrap_or(0.0))
            .collect();
        median(v).unwrap_or(0.0)
    };
    (pick("ms_per_step"), pick("kernels_per_step"))
}

/// GPU kernel time per step by stage and by op class for every arm with a breakdown, and the
/// largest kernels of one run per arm: where the GPU time goes, ptl next to Ultralytics.
fn breakdown_section(ok: &[&Value]) -> String {
    let mut groups: Vec<((String, String), Vec<&Value>)> = Vec::new();
    for r in ok.iter().filter(|r| r["cold"] != true && breakdown_of(r).is_some()) {
        let key = (r["precision"].as_str().unwrap_or("?").to_string(), r["arm"].as_str().unwrap_or("?").to_string());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    if groups.is_empty() {
        return String::new();
    }
    groups.sort_by(|a, b| a.0 .0.cmp(&b.0 .0));
    const ORDER: [&str; 9] =
        ["model forward", "model backward", "loss", "loss backward", "backward (engine)", "optimizer", "EMA", "upload", "other"];
    let mut stages: Vec<String> = ORDER.iter().map(|s| s.to_string()).collect();
    for (_, runs) in &groups {
        for b in runs.iter().filter_map(|r| breakdown_of(r)) {
            for e in b["by_stage"].as_array().into_iter().flatten() {
                let l = e["label"].as_str().unwrap_or("?").to_string();
                if !stages.contains(&l) {
                    stages.push(l);
                }
            }
        }
    }
    stages.retain(|st| groups.iter().any(|(_, runs)| share_median(runs, "by_stage", st).0 > 0.0));
    let mut md = String::from(
        "\nGPU kernel time per step by stage, ms (kernels) — median over runs; a replayed graph's kernels count for the stage that launched it:\n\n| precision | arm | total |",
    );
    for st in &stages {
        md.push_str(&format!(" {st} |"));
    }
    md.push_str(&format!("\n|---|---|---:|{}\n", "---:|".repeat(stages.len())));
    for ((p, arm), runs) in &groups {
        let cells: Vec<(f64, f64)> = stages.iter().map(|st| share_median(runs, "by_stage", st)).collect();
        let total: f64 = cells.iter().map(|c| c.0).sum();
        md.push_str(&format!("| {p} | {arm} | {total:.1} |"));
        for (ms, n) in cells {
            md.push_str(&format!(" {ms:.2} ({n:.0}) |"));
        }
        md.push('\n');
    }
    md.push_str("\nBy op class (ms/step, kernels/step; the 12 largest):\n\n");
    for ((p, arm), runs) in &groups {
        let first = runs.iter().find_map(|r| breakdown_of(r));
        let labels: Vec<String> = first
            .and_then(|b| b["by_class"].as_array())
            .map(|a| a.iter().take(12).filter_map(|e| e["label"].as_str().map(str::to_string)).collect())
            .unwrap_or_default();
        let items: Vec<String> = labels
            .iter()
            .map(|l| {
                let (ms, n) = share_median(runs, "by_class", l);
                format!("{l} {ms:.2} ({n:.0})")
            })
            .collect();
        md.push_str(&format!("- {p} {arm}: {}\n", items.join(" · ")));
    }
    // Launch counts matter apart from time: a replayed kernel costs a node's fixed time however
    // little it does, so the (stage, class) pairs that launch most are where fusion pays.
    md.push_str("\nMost launched (stage · class: kernels/step, ms/step; the 16 largest counts of one run per arm):\n\n");
    for ((p, arm), runs) in &groups {
        let Some(b) = runs.iter().find_map(|r| breakdown_of(r)) else { continue };
        let mut rows: Vec<&Value> = b["by_stage_class"].as_array().into_iter().flatten().collect();
        rows.sort_by(|a, b| b["kernels_per_step"].as_f64().unwrap_or(0.0).total_cmp(&a["kernels_per_step"].as_f64().unwrap_or(0.0)));
        let items: Vec<String> = rows
            .iter()
            .take(16)
            .map(|e| {
                format!(
                    "{} · {}: {:.0}, {:.2}",
                    e["stage"].as_str().unwrap_or("?"),
                    e["class"].as_str().unwrap_or("?"),
                    e["kernels_per_step"].as_f64().unwrap_or(0.0),
                    e["ms_per_step"].as_f64().unwrap_or(0.0)
                )
            })
            .collect();
        if !items.is_empty() {
            md.push_str(&format!("- {p} {arm}: {}\n", items.join(" · ")));
        }
    }
    md.push_str("\nLargest kernels of one run per arm (stage · class · kernel: ms/step, kernels/step):\n\n");
    for ((p, arm), runs) in &groups {
        let Some(b) = runs.iter().find_map(|r| breakdown_of(r)) else { continue };
        md.push_str(&format!("- {p} {arm}:\n"));
        for e in b["top"].as_array().into_iter().flatten().take(15) {
            let name: String = e["name"].as_str().unwrap_or("?").chars().take(90).collect();
            md.push_str(&format!(
                "  - {} · {} · `{name}`: {:.3} ({:.0})\n",
                e["stage"].as_str().unwrap_or("?"),
                e["class"].as_str().unwrap_or("?"),
                e["ms_per_step"].as_f64().unwrap_or(0.0),
                e["kernels_per_step"].as_f64().unwrap_or(0.0)
            ));
        }
    }
    md
}

/// Device memory right before backward in one run per (precision, arm): what holds it.
/// Start-to-start medians of the steps that ran an optimizer update and of the others, per ptl
/// arm (each run's medians; median and range over runs): the update's cost is their gap.
fn update_steps_section(ok: &[&Value]) -> String {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in ok.iter().filter(|r| r["kind"] == "ptl") {
        let key = (r["precision"].as_str().unwrap_or("?").to_string(), r["arm"].as_str().unwrap_or("?").to_string());
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    let mut md = String::new();
    for (precision, arm) in keys {
        let runs: Vec<&&Value> =
            ok.iter().filter(|r| r["kind"] == "ptl" && r["precision"] == precision.as_str() && r["arm"] == arm.as_str()).collect();
        let median_of = |r: &Value, k: &str| -> Option<f64> {
            let t = &r["result"]["timing"][k];
            t["median_ms"].as_f64().filter(|_| t["timed_steps"].as_u64().unwrap_or(0) > 0)
        };
        let pairs: Vec<(f64, f64)> =
            runs.iter().filter_map(|r| Some((median_of(r, "start_to_start_update")?, median_of(r, "start_to_start_no_update")?))).collect();
        if pairs.is_empty() {
            continue;
        }
        let (upd, other): (Vec<f64>, Vec<f64>) = pairs.iter().copied().unzip();
        if md.is_empty() {
            md.push_str("\nSteps with an optimizer update against the others (start-to-start median ms of each run; median (min–max) over runs), and the GPU kernel time of one update (optimizer and EMA stages of the traced window ÷ its updates):\n\n");
            md.push_str(
                "| precision | arm | update steps | other steps | difference | update kernel time, ms |\n|---|---|---:|---:|---:|---:|\n",
            );
        }
        let per_update: Vec<f64> = runs.iter().filter_map(|r| update_kernel_ms(r)).collect();
        let gaps: Vec<f64> = pairs.iter().map(|(u, o)| u - o).collect();
        let fmt = |v: &[f64]| {
            let mut s = v.to_vec();
            s.sort_by(|a, b| a.total_cmp(b));
            let m = if s.len() % 2 == 1 { s[s.len() / 2] } else { 0.5 * (s[s.len() / 2 - 1] + s[s.len() / 2]) };
            format!("{m:.1} ({:.1}–{:.1})", s[0], s[s.len() - 1])
        };
        let kernel = if per_update.is_empty() { "–".to_string() } else { fmt(&per_update) };
        md.push_str(&format!("| {precision} | {arm} | {} | {} | {} | {kernel} |\n", fmt(&upd), fmt(&other), fmt(&gaps)));
    }
    md
}

/// One optimizer update's kernel time in a ptl run's traced window: the optimizer and EMA
/// stages' ms per step × the window's steps ÷ its updates (`None` without a window or an update).
fn update_kernel_ms(r: &Value) -> Option<f64> {
    let gpu = &r["result"]["timing"]["gpu"];
    let (steps, updates) = (gpu["steps"].as_f64()?, gpu["optimizer_steps"].as_f64().filter(|&u| u > 0.0)?);
    let stages = gpu["breakdown"]["by_stage"].as_array()?;
    let ms: f64 =
        stages.iter().filter(|e| e["label"] == "optimizer" || e["label"] == "EMA").filter_map(|e| e["ms_per_step"].as_f64()).sum();
    Some(ms * steps / updates)
}

fn memory_section(ok: &[&Value]) -> String {
    let mut seen: Vec<(String, String)> = Vec::new();
    let mut md = String::new();
    for r in ok.iter().filter(|r| r["cold"] != true) {
        let m = if r["kind"] == ULTRA { &r["result"]["memory_at_backward"] } else { &r["result"]["timing"]["gpu"]["memory"] };
        let key = (r["precision"].as_str().unwrap_or("?").to_string(), r["arm"].as_str().unwrap_or("?").to_string());
        if !m.is_object() || seen.contains(&key) {
            continue;
        }
        if md.is_empty() {
            md.push_str("\nDevice memory right before the backward of a traced step (MiB; one run per arm):\n\n");
        }
        let mib = |v: &Value| v.as_f64().unwrap_or(0.0) / 1048576.0;
        let mut parts: Vec<String> =
            m["parts"].as_array().into_iter().flatten().map(|p| format!("{} {:.0}", p[0].as_str().unwrap_or("?"), mib(&p[1]))).collect();
        for (label, k) in [("library workspaces", "library_workspace_bytes"), ("replay pools", "replay_pool_bytes")] {
            if m[k].as_f64().is_some_and(|v| v > 0.0) {
                parts.push(format!("{label} {:.0}", mib(&m[k])));
            }
        }
        parts.push(format!("activations + temporaries {:.0}", mib(&m["activations_and_temporaries_bytes"])));
        md.push_str(&format!(
            "- {} {}: allocated {:.0} = {}; reserved {:.0} (cached free {:.0})\n",
            key.0,
            key.1,
            mib(&m["allocated_bytes"]),
            parts.join(" + "),
            mib(&m["reserved_bytes"]),
            mib(&m["cached_free_bytes"])
        ));
        seen.push(key);
    }
    md.push_str(&epoch_memory_section(ok));
    md
}

/// Runs of several epochs: the peaks and the recordings as each epoch ended, and whether either
/// grew after the first epoch (a late target bucket that needed a larger arena, a recording made
/// late).
fn epoch_memory_section(ok: &[&Value]) -> String {
    let mut md = String::new();
    for r in ok.iter().filter(|r| r["kind"] == "ptl") {
        let epochs = r["result"]["memory_per_epoch"].as_array().map(Vec::as_slice).unwrap_or_default();
        if epochs.len() < 2 {
            continue;
        }
        if md.is_empty() {
            md.push_str(
                "
Device memory as each epoch ended (the process's peaks so far; graphs recorded so far):

",
            );
        }
        let col = |k: &str| -> Vec<u64> { epochs.iter().map(|e| e[k].as_u64().unwrap_or(0)).collect() };
        let (alloc, reserved, recordings) = (col("peak_allocated_bytes"), col("peak_reserved_bytes"), col("recordings"));
        let mibs = |v: &[u64]| v.iter().map(|b| format!("{:.0}", *b as f64 / 1048576.0)).collect::<Vec<_>>().join(", ");
        let grew = |v: &[u64]| v.iter().any(|x| *x > v[0]);
        // Graphs recorded later (a target bucket first seen then) hold no memory of their own
        // when they fit the arenas laid out before: only the peaks decide.
        let verdict = match (grew(&alloc), grew(&reserved)) {
            (false, false) => "nothing grew after the first epoch".to_string(),
            (a, rs) => format!("GREW after the first epoch:{}{}", if a { " allocated" } else { "" }, if rs { " reserved" } else { "" }),
        };
        let later = match recordings.iter().max().copied().unwrap_or(0).saturating_sub(recordings[0]) {
            0 => String::new(),
            1 => " (1 graph recorded after it)".to_string(),
            n => format!(" ({n} graphs recorded after it)"),
        };
        let planned = match r["result"]["planned_target_slots"].as_u64() {
            Some(slots) => format!("; the {slots}-slot target bucket prepared first"),
            None => String::new(),
        };
        md.push_str(&format!(
            "- {} {} #{}: peak allocated {} MiB; peak reserved {} MiB; recordings {}{planned}; {verdict}{later}\n",
            r["precision"].as_str().unwrap_or("?"),
            r["arm"].as_str().unwrap_or("?"),
            r["pair"],
            mibs(&alloc),
            mibs(&reserved),
            recordings.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
        ));
    }
    md
}

/// Reads one figure out of a run's start-up report.
type Pick = fn(&Value) -> Option<f64>;

/// Start-up breakdown of the first (cold) ptl run and the median of the warm ones.
fn startup_table(ok: &[&Value]) -> String {
    let ptl: Vec<&&Value> = ok.iter().filter(|r| r["kind"] == "ptl").collect();
    if ptl.is_empty() {
        return String::new();
    }
    let col = |sel: Pick, cold: bool| -> String {
        let v: Vec<Option<f64>> = ptl.iter().filter(|r| (r["cold"] == true) == cold).map(|r| sel(&r["result"]["startup"])).collect();
        mr(&v, 2)
    };
    let rows: [(&str, Pick); 20] = [
        ("process start → fit", |s| s["process_to_fit_s"].as_f64()),
        ("device open (context, kernels)", |s| s["device_open_s"].as_f64()),
        ("kernel compile (NVRTC)", |s| {
            s["kernel_modules"].as_array().map(|a| a.iter().filter_map(|m| m["compile_s"].as_f64()).fold(0.0, |x, y| x + y))
        }),
        ("dataset scan/decode", |s| s["dataset_open_s"].as_f64()),
        ("model, EMA, optimizer", |s| s["model_build_s"].as_f64()),
        ("fit → first step", |s| s["fit_to_first_step_s"].as_f64()),
        ("process start → first step", |s| s["process_to_first_step_s"].as_f64()),
        ("first step", |s| s["first_step_s"].as_f64()),
        ("cuDNN/cuBLAS set-ups (whole run)", |s| s["library_setup_s"].as_f64()),
        ("  of which cuDNN conv plans", |s| s["conv_plan_s"].as_f64()),
        ("  of which cuBLASLt plans", |s| s["gemm_plan_s"].as_f64()),
        ("  conv plans: engine ranking", |s| s["conv_heuristics_s"].as_f64()),
        ("  conv plans: execution-plan finalizes", |s| s["conv_finalize_s"].as_f64()),
        ("    of which engines compiled at run time", |s| s["conv_runtime_compiled_s"].as_f64()),
        ("  conv plans restored from serialized form", |s| s["conv_plan_load_s"].as_f64()),
        ("cuDNN conv plans built (count)", |s| s["conv_plans"].as_f64()),
        ("  execution-plan finalizes (count)", |s| s["conv_finalizes"].as_f64()),
        ("    of which engines compiled at run time (count)", |s| s["conv_runtime_compiled"].as_f64()),
        ("  plans restored from serialized form (count)", |s| s["conv_plans_loaded"].as_f64()),
        ("cuBLASLt plans built (count)", |s| s["gemm_plans"].as_f64()),
    ];
    let mut md = String::from(
        "\nptl start-up (s; cold = first process with empty kernel and cuDNN caches):\n\n| phase | cold | warm |\n|---|---:|---:|\n",
    );
    for (name, sel) in rows {
        md.push_str(&format!("| {name} | {} | {} |\n", col(sel, true), col(sel, false)));
    }
    let epochs = |cold: bool| -> String {
        ptl.iter()
            .find(|r| (r["cold"] == true) == cold)
            .and_then(|r| {
                r["result"]["startup"]["epoch_s"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_f64).map(|v| format!("{v:.1}")).collect::<Vec<_>>().join(" "))
            })
            .unwrap_or_else(|| "–".into())
    };
    md.push_str(&format!("| epoch times (one run) | {} | {} |\n", epochs(true), epochs(false)));
    md
}

fn one_line(r: &Value) -> String {
    let f = figures(r);
    format!(
        "exit {}, {:.1} s, step {}, GPU {} ms/step, to first step {} s",
        r["exit"],
        f.wall_s,
        f.step_ms.map_or("–".into(), |v| format!("{v:.1} ms")),
        f.gpu_ms.map_or("–".into(), |v| format!("{v:.1}")),
        f.to_first_step_s.map_or("–".into(), |v| format!("{v:.1}"))
    )
}

#[cfg(test)]
mod quoting_tests {
    use super::*;

    /// Packed arguments reach the shell as the words they were.
    #[test]
    fn packed_arguments_are_single_shell_words() {
        for a in ["plain", "it's", "$(touch /tmp/x)", "a b", "'", ""] {
            let out = Command::new("sh").arg("-c").arg(format!("printf %s {}", shell_quote(a))).output().expect("sh");
            assert_eq!(String::from_utf8_lossy(&out.stdout), a);
        }
    }

    /// A --work folder others can write (whose ul_site would go on PYTHONPATH) is refused.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_shared_work_folder_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("ptl-bench-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_own_private(&d).unwrap_err();
        assert!(e.contains("mode 777"), "{e}");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(check_own_private(&d).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn warm_needs_a_work_folder() {
        let e = parse(&["--warm".to_string()]).unwrap_err();
        assert!(e.contains("--work"), "{e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ultralytics' kernel time is summed in its own process by the bench script: its busy and
    /// active sums must be the kernel timer's (`ptl_autograd`'s `kernel_busy_ns` and
    /// `kernel_active_ns` unit tests, the same spans and values).
    #[test]
    fn the_ultralytics_script_sums_kernel_spans_as_the_kernel_timer_does() {
        let code = "import ast, sys\n\
src = sys.stdin.read()\n\
tree = ast.parse(src)\n\
funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ('busy_us', 'active_us')]\n\
ns = {}\n\
exec(compile(ast.Module(funcs, []), 'ultralytics_bench.py', 'exec'), ns)\n\
spans = [(7, 4, 15), (9, 2, 12), (7, 0, 10), (7, 20, 25)]\n\
print(ns['busy_us'](spans), ns['active_us'](spans + [(9, 30, 31)]), ns['active_us']([]))\n";
        let mut child = match Command::new("python3")
            .args(["-c", code])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                assert!(std::env::var_os("CI").is_none_or(|v| v.is_empty()), "python3 is needed (CI): {e}");
                eprintln!("SKIPPED: python3 not found ({e}); the Ultralytics script's span sums are not checked");
                return;
            }
        };
        use std::io::Write;
        child.stdin.take().unwrap().write_all(ULTRA_SCRIPT.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "30.0 21.0 0.0");
    }

    fn ptl_run(arm: &str, pair: usize, wall: f64, step: f64, model: &str) -> Value {
        record(
            RunId { kind: "ptl", arm, precision: "bf16-mixed", pair, cold: pair == 0 && arm == "native" },
            wall,
            0,
            json!({
                "timing": { "start_to_start": { "median_ms": step, "timed_steps": 100 }, "data_wait_ms_mean": 1.0,
                            "start_to_start_update": { "median_ms": step + 4.0, "timed_steps": 6 },
                            "start_to_start_no_update": { "median_ms": step, "timed_steps": 94 },
                            "launches": { "kernel_launches": 9000.0, "library_calls": 900.0, "graph_launches": 0.0, "host_syncs": 3.0 },
                            "gpu": { "kernel_ms_per_step": 40.0, "kernels_per_step": 10000.0, "event_span_ms_per_step": 60.0,
                                     "steps": 16, "optimizer_steps": 2,
                                     "breakdown": { "by_stage": [{ "label": "model backward", "ms_per_step": 30.0, "kernels_per_step": 7000.0 },
                                                                 { "label": "optimizer", "ms_per_step": 0.25, "kernels_per_step": 50.0 },
                                                                 { "label": "model forward", "ms_per_step": 10.0, "kernels_per_step": 3000.0 }],
                                                    "by_class": [{ "label": "reduce_rows", "ms_per_step": 12.5, "kernels_per_step": 900.0 }],
                                                    "top": [{ "stage": "model backward", "class": "reduce_rows", "name": "reduce_rows_f32",
                                                              "ms_per_step": 9.0, "kernels_per_step": 500.0 }] } } },
                "startup": { "process_to_first_step_s": 2.0, "epoch_s": [10.0] },
                "metrics_per_epoch": [[["metrics/mAP50(P)", 0.01]]],
                "hashes": { "model": model, "step_losses": "l" },
                "peak_allocated_bytes": 1048576.0 * 2048.0, "peak_reserved_bytes": 1048576.0 * 3000.0
            }),
            None,
        )
    }

    /// Runs of several epochs say whether a peak grew after the first epoch; graphs recorded
    /// later (into arenas laid out before) are counted but are no growth.
    #[test]
    fn epoch_memory_says_what_grew_after_the_first_epoch() {
        let epochs = |alloc: [u64; 3], recordings: [u64; 3]| -> Value {
            let mut r = ptl_run("all", 1, 10.0, 7.5, "m");
            r["result"]["memory_per_epoch"] = (0..3)
                .map(|e| {
                    json!({ "epoch": e, "peak_allocated_bytes": alloc[e] << 20, "peak_reserved_bytes": 2048u64 << 20,
                                  "reserved_bytes": 2048u64 << 20, "recordings": recordings[e] })
                })
                .collect();
            r
        };
        let steady = epochs([979, 979, 979], [4, 4, 4]);
        let md = epoch_memory_section(&[&steady]);
        assert!(
            md.contains("peak allocated 979, 979, 979 MiB; peak reserved 2048, 2048, 2048 MiB; recordings 4, 4, 4; nothing grew"),
            "{md}"
        );
        let late = epochs([979, 979, 1001], [4, 4, 6]);
        let md = epoch_memory_section(&[&late]);
        assert!(md.contains("GREW after the first epoch: allocated (2 graphs recorded after it)"), "{md}");
        let mut fits = epochs([979, 979, 979], [4, 5, 5]);
        fits["result"]["planned_target_slots"] = json!(64);
        let md = epoch_memory_section(&[&fits]);
        assert!(
            md.contains("the 64-slot target bucket prepared first; nothing grew after the first epoch (1 graph recorded after it)"),
            "{md}"
        );
        let one = ptl_run("all", 1, 10.0, 7.5, "m");
        assert_eq!(epoch_memory_section(&[&one]), "", "a run of one epoch (or on the CPU) says nothing");
    }

    /// Ultralytics' arms get their own rows and labels; a crashed one is listed with its error,
    /// and images/s follow from the batch and the step.
    #[test]
    fn ultralytics_arms_and_crashes_are_reported() {
        let ultra = |arm: &'static str, error: Option<&str>| {
            let mut r = record(
                RunId { kind: ULTRA, arm, precision: "bf16-mixed", pair: 0, cold: false },
                30.0,
                i32::from(error.is_some()),
                json!({ "start_to_start": { "median_ms": 160.0 }, "metrics_per_epoch": [] }),
                error.map(str::to_string),
            );
            r["batch"] = json!(16);
            r
        };
        let recs = vec![
            ultra(ULTRA, None),
            ultra("ultralytics-compile", None),
            ultra("ultralytics-nondeterministic", None),
            ultra("ultralytics-reduce-overhead", Some("crashed: accessing tensor output of CUDAGraphs that has been overwritten")),
        ];
        let out = std::env::temp_dir().join(format!("ptl-bench-ultra-arms-{}", std::process::id()));
        write_report(&recs, &out).expect("report");
        let md = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
        assert!(md.contains("| bf16-mixed · batch 16 | Ultralytics amp=bf16 | 1 | 30.0 | 160.0 | 100 |"), "{md}");
        assert!(md.contains("| Ultralytics amp=bf16 compile=True | 1 |"), "{md}");
        assert!(md.contains("| Ultralytics amp=bf16 deterministic=False | 1 |"), "{md}");
        assert!(md.contains("ultralytics-reduce-overhead") && md.contains("CUDAGraphs that has been overwritten"), "{md}");
        assert_eq!(ultra_arm("compile").unwrap().1, "True");
        assert!(ultra_arm("max-autotune").is_err());
        // 32-true like for like: strict FP32 convolutions on both sides.
        assert_eq!(ultra_arm("strict").unwrap().3, "False");
        assert_eq!(arm_overrides("all+dense+strict").unwrap(), ["replay=all", "loss_assigner=dense", "tf32=false"]);
        assert_eq!(arm_overrides("dense+cl").unwrap(), ["loss_assigner=dense", "channels_last=true"]);
        assert_eq!(
            arm_overrides("all+dense+cl+strict").unwrap(),
            ["replay=all", "loss_assigner=dense", "channels_last=true", "tf32=false"]
        );
        assert!(arm_overrides("nope+strict").is_err());
        assert_eq!(arm_overrides("all+dense+ws").unwrap(), ["replay=all", "loss_assigner=dense"]);
        assert_eq!(arm_overrides("dense+ws+cl").unwrap(), ["loss_assigner=dense", "channels_last=true"]);
        assert_eq!(arm_env("all+dense+ws"), [("PTL_CUDNN_WORKSPACE_MIB", "auto")]);
        assert_eq!(arm_env("dense+ws+cl"), [("PTL_CUDNN_WORKSPACE_MIB", "auto")]);
        assert!(arm_env("all+dense").is_empty() && arm_env("dense+cl").is_empty());
        assert_eq!(arm_env("dense+timed"), [("PTL_CUDNN_TIMED", "1")]);
        assert_eq!(arm_overrides("all+dense+timed").unwrap(), ["replay=all", "loss_assigner=dense"]);
        assert_eq!(numeric_variant("dense+timed+ws"), "+timed+ws");
        assert_eq!(arm_env("all+dense+timedall"), [("PTL_CUDNN_TIMED", "all")]);
        assert_eq!(arm_env("all+dense+onestream"), [("PTL_SIDE_STREAM", "0")]);
        assert_eq!(arm_env("dense+held256"), [("PTL_SIDE_HELD_MIB", "256")]);
        assert_eq!(arm_env("all+dense+heldoff"), [("PTL_SIDE_HELD_MIB", "off")]);
        assert_eq!(arm_env("dense+wskept32"), [("PTL_CUDNN_KEPT_WORKSPACE_MIB", "32")]);
        assert_eq!(arm_env("dense+wskeptoff"), [("PTL_CUDNN_KEPT_WORKSPACE_MIB", "off")]);
        let own = arm_overrides("all+ownarenas").unwrap();
        assert_eq!(own[..2], ["replay=all", "loss_assigner=dense"]);
        let cfg: Value = serde_json::from_str(own[2].strip_prefix("replay_config=").expect("a replay_config")).unwrap();
        assert!(["step", "optimizer"].iter().all(|p| cfg[p]["take_turns"] == json!(false)), "{cfg}");
        assert_eq!(numeric_variant("all+ownarenas"), "", "the arenas change no bytes: its hashes are compared");
        assert_eq!(arm_overrides("all+dense+heldoff").unwrap(), ["replay=all", "loss_assigner=dense"]);
        assert_eq!(arm_overrides("all+dense+held256").unwrap(), ["replay=all", "loss_assigner=dense"]);
        assert_eq!(numeric_variant("all+dense+held256"), "", "joins change no bytes: its hashes are compared");
        assert_eq!(arm_env("all+dense+krsc"), [("PTL_WEIGHT_KRSC", "1")]);
        assert_eq!(arm_env("all+dense+oihw+nopdl"), [("PTL_WEIGHT_KRSC", "0"), ("PTL_PDL", "0")]);
        assert_eq!(arm_env("all+dense+pdl"), [("PTL_PDL", "1")]);
        assert_eq!(numeric_variant("all+dense+nopdl"), "", "the same engines and bytes as all+dense");
        assert_eq!(numeric_variant("all+dense+pdl"), "");
        assert_eq!(numeric_variant("all+dense+oihw"), "+oihw");
        assert_eq!(numeric_variant("all+dense+krsc"), "+krsc", "other engines may run: its own hashes");
        assert_eq!(arm_env("dense+side8"), [("PTL_SIDE_IN_FLIGHT", "8")]);
        assert_eq!(arm_env("dense+sidenp"), [("PTL_SIDE_PRIORITY", "0")]);
        assert_eq!(arm_overrides("all+dense+onestream").unwrap(), ["replay=all", "loss_assigner=dense"]);
        assert_eq!(numeric_variant("all+dense+onestream"), "", "one stream keeps the arm's bytes: its hashes are compared");
        assert_eq!(numeric_variant("all+dense+timedall"), "+timedall");
        assert_eq!(numeric_variant("dense+timed-cold"), "+timed", "the cold run belongs to its arm's family");
        let (o, _) =
            parse(&["--batches".to_string(), "4,16".to_string(), "--ultra-arms".to_string(), "eager,compile".to_string()]).unwrap();
        assert_eq!((o.batches, o.ultra_arms.len()), (vec![4, 16], 2));
    }

    #[test]
    fn report_pairs_arms_and_checks_hashes() {
        let ultra = |pair: usize| {
            record(
                RunId { kind: ULTRA, arm: ULTRA, precision: "bf16-mixed", pair, cold: false },
                30.0,
                0,
                json!({ "start_to_start": { "median_ms": 150.0 }, "metrics_per_epoch": [{ "metrics/mAP50(P)": 0.02 }] }),
                None,
            )
        };
        let recs = vec![ptl_run("native", 0, 15.0, 75.0, "m"), ultra(0), ptl_run("native", 1, 16.0, 76.0, "m"), ultra(1)];
        let out = std::env::temp_dir().join(format!("ptl-bench-report-{}", std::process::id()));
        write_report(&recs, &out).expect("report");
        let md = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
        assert!(md.contains("| bf16-mixed | ptl native | 2 | 15.5 (15.0–16.0) | 75.5 (75.0–76.0) |"), "{md}");
        assert!(md.contains("| bf16-mixed | native / ultralytics | 0.517 (0.500–0.533) | 0.503 (0.500–0.507) |"), "{md}");
        assert!(md.contains("hashes identical: true"), "{md}");
        assert!(md.contains("| bf16-mixed | native | 40.2 | 10.00 (3000) | 30.00 (7000) | 0.25 (50) |"), "stage breakdown: {md}");
        assert!(md.contains("- bf16-mixed native: reduce_rows 12.50 (900)"), "class breakdown: {md}");
        assert!(md.contains("model backward · reduce_rows · `reduce_rows_f32`: 9.000 (500)"), "top kernels: {md}");
        assert!(
            md.contains("| bf16-mixed | native | 79.5 (79.0–80.0) | 75.5 (75.0–76.0) | 4.0 (4.0–4.0) | 2.0 (2.0–2.0) |"),
            "update steps: {md}"
        );
        // Another batch size forms its own rows (and its own hash group).
        let mut b16 = ptl_run("native", 1, 30.0, 120.0, "m16");
        b16["batch"] = json!(16);
        write_report(&[ptl_run("native", 0, 15.0, 75.0, "m"), b16], &out).expect("report with two batch sizes");
        let md = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
        assert!(md.contains("| bf16-mixed · batch 16 | ptl native | 1 | 30.0 |"), "{md}");
        assert!(md.contains("| bf16-mixed | ptl native | 1 | 15.0 |"), "{md}");
        assert!(!md.contains("Runs without GPU kernel figures"), "every run had its window: {md}");
        // A run whose epochs were too short for the GPU window says why under the table.
        let mut short = ptl_run("native", 0, 15.0, 75.0, "m");
        short["result"]["timing"]["gpu"] = Value::Null;
        short["result"]["timing"]["gpu_unavailable"] = json!("epochs of 8 steps are too short");
        write_report(&[short], &out).expect("report without a GPU window");
        let md = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
        assert!(
            md.contains("Runs without GPU kernel figures, and why:\n\n- native bf16-mixed #0: epochs of 8 steps are too short"),
            "{md}"
        );
        // Arms with other convolution engines (+ws, +cl, +strict) are their own hash family: native
        // and replay must agree within it, not with the plain arms.
        assert_eq!((numeric_variant("all+dense+ws+cl"), numeric_variant("all+dense")), ("+cl+ws".to_string(), String::new()));
        let variants = [
            ptl_run("dense", 0, 15.0, 75.0, "d"),
            ptl_run("all+dense", 0, 14.0, 70.0, "d"),
            ptl_run("dense+ws", 0, 15.0, 75.0, "w"),
            ptl_run("all+dense+ws", 0, 14.0, 70.0, "w"),
        ];
        write_report(&variants, &out).expect("each variant agrees with itself");
        let md = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
        assert!(md.contains("bf16-mixed, dense loss, +ws: 2 ptl runs, hashes identical: true"), "{md}");
        // A cold run is compared with its arm's warm runs.
        let mut cold = ptl_run("dense", 0, 15.0, 75.0, "other");
        cold["arm"] = json!("dense-cold");
        cold["cold"] = json!(true);
        assert!(write_report(&[cold, ptl_run("dense", 0, 15.0, 75.0, "d")], &out).is_err(), "a cold run with other bytes fails");
        let mut split = variants.to_vec();
        split[3] = ptl_run("all+dense+ws", 0, 14.0, 70.0, "d");
        assert!(write_report(&split, &out).is_err(), "replay differing from native within +ws fails");
        let bad = vec![ptl_run("native", 0, 15.0, 75.0, "m"), ptl_run("workers0", 0, 20.0, 110.0, "other")];
        assert!(write_report(&bad, &out).is_err(), "differing hashes fail the bench");
        // A replay arm whose region fell back to native (e.g. a capture failure) fails the guard.
        let mut replay = ptl_run("feature", 0, 14.0, 60.0, "m");
        replay["result"]["timing"]["steps"] = json!(100);
        replay["result"]["replay_counters"] = json!({ "feature": { "trunk": { "replays": 99, "native": { "Warmup": 1 } } } });
        assert!(write_report(&[ptl_run("native", 0, 15.0, 75.0, "m"), replay.clone()], &out).is_ok(), "replayed after warm-up");
        replay["result"]["replay_counters"]["feature"]["trunk"] = json!({ "replays": 0, "native": { "Warmup": 1, "CaptureFailed": 99 } });
        assert!(write_report(&[ptl_run("native", 0, 15.0, 75.0, "m"), replay], &out).is_err(), "nothing replayed: the guard fails");
        // The loss regions of a one-per-batch plugin count together (one region per target
        // bucket); a dense arm whose batches fell back to the host loss on > 1 % of steps fails.
        let mut dense = ptl_run("all+loss", 0, 14.0, 60.0, "d");
        dense["result"]["timing"]["steps"] = json!(128);
        dense["result"]["replay_cadence"] = json!({ "loss": "one_per_batch" });
        dense["result"]["replay_counters"] = json!({ "loss": {
            "loss.0": { "replays": 122, "native": { "Warmup": 1 } },
            "loss.1": { "replays": 4, "native": { "Warmup": 1 } } } });
        assert!(write_report(&[dense.clone()], &out).is_ok(), "every call replayed after its region's warm-up");
        dense["result"]["dense_loss_fallbacks"] = json!(2);
        assert!(write_report(&[dense.clone()], &out).is_err(), "2 of 128 steps on the host path");
        let md = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
        assert!(md.contains("DENSE LOSS GUARD FAILED: all+loss bf16-mixed #0: 2 of 128 steps"), "{md}");
        dense["result"]["dense_loss_fallbacks"] = json!(1);
        assert!(write_report(&[dense], &out).is_ok(), "1 of 128 steps is within 1 %");
        // Failed runs (e.g. no GPU) fail the bench and are listed with their error, never an empty table.
        let dead = record(
            RunId { kind: "ptl", arm: "native", precision: "bf16-mixed", pair: 0, cold: false },
            0.1,
            1,
            Value::Null,
            Some("error: CUDA is not usable: no driver".into()),
        );
        let e = write_report(&[dead], &out).expect_err("a failed run fails the report");
        assert!(e.contains("all 1 runs failed"), "{e}");
        let md = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
        assert!(md.contains("native bf16-mixed #0: exit 1: error: CUDA is not usable"), "{md}");
        assert!(md.starts_with("1 runs, all failed: no figures.") && !md.contains("| precision |"), "no empty table: {md}");
        let _ = std::fs::remove_dir_all(&out);
    }

    #[test]
    fn report_takes_folders_and_an_output() {
        let v = |xs: &[&str]| xs.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let (dirs, out) = report_args(&v(&["a", "--out", "merged", "b"])).expect("folders and --out");
        assert_eq!((dirs, out), (vec![PathBuf::from("a"), PathBuf::from("b")], PathBuf::from("merged")));
        assert!(report_args(&v(&["a", "--out"])).is_err(), "--out without a folder");
        assert!(report_args(&v(&["a", "--pairs", "3"])).is_err(), "an option --report does not take");
        assert!(report_args(&v(&[])).is_err(), "no folder");
    }

    #[test]
    fn options_are_checked() {
        assert!(parse(&["--arms".into(), "native,bogus".into()]).is_err());
        assert!(parse(&["--precisions".into(), "fp8".into()]).is_err());
        let (o, _) = parse(&["--arms".into(), "native,workers0".into(), "--vs".into(), "ultralytics".into()]).expect("parse");
        assert_eq!(o.arms, ["native", "workers0"]);
        assert_eq!(o.batch, 4);
        assert_eq!(o.images(), 512, "512 images at batch 4");
        let (b16, _) = parse(&["--batch".into(), "16".into()]).expect("parse");
        assert_eq!((b16.batch, b16.images()), (16, 2048), "128 steps per epoch at batch 16");
        assert_eq!(parse(&["--batch".into(), "16".into(), "--images".into(), "64".into()]).expect("parse").0.images(), 64);
        assert!(parse(&["--batch".into(), "0".into()]).is_err());
        assert!(o.ultralytics);
        assert_eq!(ultra_amp("16-mixed"), Ok("True"));
        assert_eq!(ultra_amp("bf16-mixed"), Ok("bf16"));
        assert_eq!(ultra_amp("32-true"), Ok("False"));
    }
}

#[cfg(test)]
mod data_parallel_tests {
    use super::*;

    fn opts(args: &[&str]) -> Opts {
        parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap().0
    }

    #[test]
    fn devices_are_distinct_gpu_numbers() {
        assert_eq!(parse_devices("0,1").unwrap(), [0, 1]);
        assert_eq!(parse_devices(" 2 , 3,").unwrap(), [2, 3]);
        assert!(parse_devices("0,0").unwrap_err().contains("twice"));
        assert!(parse_devices("cuda:0").unwrap_err().contains("not a GPU number"));
        assert!(parse_devices(",").unwrap_err().contains("at least one"));
    }

    /// On two GPUs both frameworks get the global batch and the GPU list: ptl as `device=0,1`
    /// (its launcher), Ultralytics under torch.distributed.run with one process per GPU.
    #[test]
    fn several_gpus_run_both_frameworks_data_parallel_with_the_global_batch() {
        let o = opts(&["--devices", "0,1", "--batch", "16"]);
        assert_eq!((o.world(), o.global_batch(), o.images()), (2, 32, 4096));
        let (data, project) = (Path::new("/d/data.yaml"), Path::new("/w/run"));
        let a = ptl_args(&o, data, project, "all+dense", "bf16-mixed").unwrap();
        assert!(a.contains(&"batch=32".to_string()) && a.contains(&"device=0,1".to_string()), "{a:?}");
        assert!(a.contains(&"replay=all".to_string()) && !a.contains(&"--device".to_string()), "{a:?}");
        let u = ultra_args(&o, Path::new("/p/ub.py"), data, Path::new("/w/r.json"), "bf16-mixed", ("False", "True", "True")).unwrap();
        assert_eq!(u[..6], ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "/p/ub.py"]);
        let at = |k: &str| u.iter().position(|x| x == k).map(|i| u[i + 1].as_str());
        assert_eq!((at("--batch"), at("--device"), at("--amp")), (Some("32"), Some("0,1"), Some("bf16")));
        // One GPU as before: the device flag, the batch as given, no launcher.
        let one = opts(&["--batch", "16"]);
        let a = ptl_args(&one, data, project, "native", "bf16-mixed").unwrap();
        assert!(a.contains(&"batch=16".to_string()) && a.windows(2).any(|w| w == ["--device", "cuda:0"]), "{a:?}");
        let u = ultra_args(&one, Path::new("/p/ub.py"), data, Path::new("/w/r.json"), "bf16-mixed", ("False", "True", "True")).unwrap();
        assert_eq!(u[0], "/p/ub.py");
        assert!(!u.contains(&"--device".to_string()));
    }

    fn run(kind: &'static str, arm: &'static str, world: u64, step_ms: f64) -> Value {
        let result = match kind {
            ULTRA => json!({ "start_to_start": { "median_ms": step_ms }, "metrics_per_epoch": [] }),
            _ => {
                json!({ "timing": { "start_to_start": { "median_ms": step_ms, "timed_steps": 100 } }, "hashes": { "model": format!("m{world}") } })
            }
        };
        let mut r = record(RunId { kind, arm, precision: "bf16-mixed", pair: 0, cold: false }, 30.0, 0, result, None);
        r["batch"] = json!(16);
        r["world"] = json!(world);
        r
    }

    /// A step of a data-parallel run takes the global batch; its rows are apart; the scaling is
    /// images/s per GPU against the one-GPU run of the same arm and batch per GPU.
    #[test]
    fn data_parallel_runs_report_images_per_gpu_and_their_scaling() {
        let recs =
            [run("ptl", "all+dense", 1, 20.0), run("ptl", "all+dense", 2, 21.0), run(ULTRA, ULTRA, 1, 160.0), run(ULTRA, ULTRA, 2, 200.0)];
        assert_eq!(figures(&recs[1]).images_s.map(|v| v.round()), Some((32.0 * 1000.0 / 21.0f64).round()));
        assert_eq!(relabel(&recs[1])["precision"], "bf16-mixed · batch 16 · 2 GPUs");
        assert_eq!(relabel(&recs[0])["precision"], "bf16-mixed · batch 16");
        let relabelled: Vec<Value> = recs.iter().map(relabel).collect();
        let section = scaling_section(&relabelled.iter().collect::<Vec<_>>());
        // ptl: 1523.8 images/s on two GPUs, 762 per GPU, against 800 on one: 95.2 %.
        assert!(section.contains("| bf16-mixed | all+dense | 16 | 2 | 1524 | 762 | 800 | 95.2 % |"), "{section}");
        // Ultralytics: 32 images in 200 ms on two GPUs, 160 images/s, 80 per GPU, against 16 in
        // 160 ms, 100, on one: 80.0 %.
        assert!(section.contains("| bf16-mixed | ultralytics | 16 | 2 | 160 | 80 | 100 | 80.0 % |"), "{section}");
        assert_eq!(scaling_section(&[&relabelled[0], &relabelled[2]]), "", "no multi-GPU runs, no section");
        let out = std::env::temp_dir().join(format!("ptl-bench-dp-{}", std::process::id()));
        write_report(&recs, &out).unwrap();
        let md = std::fs::read_to_string(out.join("bench.md")).unwrap();
        assert!(md.contains("Data-parallel scaling") && md.contains("bf16-mixed · batch 16 · 2 GPUs"), "{md}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

//! `ptl train` and `ptl val`: configuration (yaml + `key=value` overrides, Ultralytics style),
//! the embedded default run, and printing of the results.

use std::path::{Path, PathBuf};

use clap::Args;
use ptl_autograd::Device;
use ptl_trainer::distributed::{device_list, launch_local, Collective, WorkerEnv};
use ptl_trainer::pose::{fit, fit_data_parallel, PoseTrainConfig, Precision};
use ptl_trainer::TrainerError;

/// Arguments of `ptl train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A yaml file of `key: value` settings and/or `key=value` overrides (data=…, epochs=…, batch=…,
    /// imgsz=…, model=…, optimizer=…, lr0=…, close_mosaic=…, scale=…, project=…, name=…, resume=…, …).
    /// With no `data`, the embedded default trains on a synthetic dataset generated on first use.
    pub settings: Vec<String>,
    /// auto (GPU when present), cpu or cuda:N; the same as the `device=` key (giving both with
    /// different values is an error).
    #[arg(long)]
    pub device: Option<String>,
    /// 32-true, bf16-mixed or 16-mixed.
    #[arg(long)]
    pub precision: Option<String>,
    #[arg(long)]
    pub seed: Option<u64>,
}

/// Where the embedded default dataset is generated (once): a private folder of ptl's cache root
/// (`ptl_files::cache_dir`), so that no other local user can prepare it.
fn default_dataset_dir() -> Result<PathBuf, String> {
    let dir = ptl_files::cache_dir(None, "synth-pose-128-s347").map_err(|e| format!("the embedded default dataset: {e}"))?;
    dir.ok_or_else(|| "the embedded default dataset has no cache folder".to_string())
}

/// Generates the small synthetic dataset of the embedded default if it is not there yet.
fn ensure_default_dataset() -> Result<PathBuf, String> {
    let dir = default_dataset_dir()?;
    let yaml = dir.join("data.yaml");
    if yaml.exists() {
        return Ok(yaml);
    }
    log::info!("ptl: generating the embedded default dataset (synthetic, 128 px) in {} …", dir.display());
    let opts = ptl_data::SynthOptions {
        out: dir.clone(),
        train: DEFAULT_TRAIN_IMAGES,
        background: 16,
        val: 8,
        imgsz: 128,
        seed: 347,
        ..Default::default()
    };
    let stats = ptl_data::synth_generate(&opts).map_err(|e| e.to_string())?;
    Ok(stats.yaml)
}

/// A yaml config's `key: value` settings, in file order, as `key=value` text.
fn yaml_settings(path: &Path) -> Result<Vec<(String, String)>, String> {
    let text = ptl_files::read_to_string(path).map_err(|e| format!("cannot read config: {e}"))?;
    let map: serde_yaml::Mapping = serde_yaml::from_str(&text).map_err(|e| format!("config {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (k, v) in map {
        let key = k.as_str().ok_or_else(|| format!("config {}: keys must be strings", path.display()))?;
        let value = match v {
            serde_yaml::Value::String(s) => s,
            serde_yaml::Value::Number(n) => n.to_string(),
            serde_yaml::Value::Bool(b) => b.to_string(),
            other => return Err(format!("config {}: `{key}` has an unsupported value {other:?}", path.display())),
        };
        out.push((key.to_string(), value));
    }
    Ok(out)
}

/// The device asked for, from `--device` and the `device=` key (command line or yaml); giving
/// both with different values is an error naming both. `None`: not given (auto).
fn device_setting(flag: Option<&str>, keys: &[(String, String)]) -> Result<Option<String>, String> {
    let key = keys.iter().rev().find(|(k, _)| k == "device").map(|(_, v)| v.as_str());
    // `cuda` and `cuda:0` (and `gpu`) are one device.
    let canonical = |s: &str| match s.trim().to_ascii_lowercase().as_str() {
        "cuda" | "gpu" => "cuda:0".to_string(),
        other => other.to_string(),
    };
    match (flag, key) {
        (Some(f), Some(k)) if canonical(f) != canonical(k) => {
            Err(format!("`--device {f}` and `device={k}` disagree: give the device once (either spelling)"))
        }
        (Some(f), _) => Ok(Some(f.to_string())),
        (None, k) => Ok(k.map(str::to_string)),
    }
}

/// Training images of the embedded default's synthetic dataset.
const DEFAULT_TRAIN_IMAGES: usize = 64;

/// The embedded default's start weights: a YOLO26n-pose that ptl trained on a larger synthetic
/// set (`assets/README.md` says how), lean (EMA, f16), so that the default job fine-tunes a model
/// that already finds the synthetic people instead of starting from nothing.
#[cfg(feature = "embedded-start")]
const DEFAULT_START: &[u8] = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/yolo26n-pose-synth.ckpt"));

/// The default start weights as a file in ptl's cache (written once; rewritten when the file
/// there is not these bytes).
#[cfg(feature = "embedded-start")]
fn ensure_default_start_weights() -> Result<PathBuf, String> {
    let dir = ptl_files::cache_dir(None, "default-model").map_err(|e| format!("the default start weights: {e}"))?;
    let dir = dir.ok_or_else(|| "the default start weights have no cache folder".to_string())?;
    let path = dir.join("yolo26n-pose-synth.ckpt");
    if std::fs::read(&path).is_ok_and(|b| b == DEFAULT_START) {
        return Ok(path);
    }
    ptl_files::write_atomic(&path, DEFAULT_START, 0o600).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

/// A binary built without the `embedded-start` feature carries no start weights: the default job
/// says how to run anyway.
#[cfg(not(feature = "embedded-start"))]
fn ensure_default_start_weights() -> Result<PathBuf, String> {
    Err("this ptl was built without its default start weights (cargo feature `embedded-start`): give \
         `model=` (a checkpoint or a model yaml) and `data=`, or build with the default features"
        .to_string())
}

/// The embedded default's settings: a fine-tune of the shipped start weights
/// ([`DEFAULT_START`]) on the small synthetic set, a few minutes on a 2-core CPU (README
/// "Set-up"), with an optimizer step every batch (`nbs` = batch: with Ultralytics' nominal 64 the
/// 40 batches of five epochs made 9 optimizer steps) over 10 epochs of 8 batches: 80 steps.
fn embedded_default(cfg: &mut PoseTrainConfig) {
    cfg.epochs = 10;
    cfg.batch = 8;
    cfg.nbs = 8;
    cfg.imgsz = 128;
    cfg.close_mosaic = 2;
    cfg.optimizer = "auto".into();
    cfg.save_dir = PathBuf::from("runs/pose/default");
}

/// Builds the run configuration: defaults → embedded-default settings (when no data is given)
/// → yaml file(s) → `key=value` overrides → flags.
/// Also says whether the run is the embedded default (no data given).
#[cfg(test)]
fn build_run(a: &TrainArgs) -> Result<(PoseTrainConfig, bool), String> {
    build_run_ranked(a).map(|(cfg, embedded, _)| (cfg, embedded))
}

/// Which process of a run this is: the only one, the launcher of several GPUs (it prepares the
/// run and starts one worker per GPU), or a worker of a group (its GPU is its `LOCAL_RANK`'s).
enum Ranks {
    One,
    Launcher(Vec<usize>),
    Worker(WorkerEnv),
}

impl Ranks {
    /// From the device setting and the environment a launcher (ptl's, torchrun, SLURM) sets.
    fn of(device: Option<&str>) -> Result<Ranks, String> {
        let env = WorkerEnv::from_env(&|k| std::env::var(k).ok()).map_err(|e| e.to_string())?;
        let list = device.map(device_list).transpose().map_err(|e| e.to_string())?.flatten();
        Ok(match (env, list) {
            (Some(w), _) => Ranks::Worker(w),
            (None, Some(list)) => Ranks::Launcher(list),
            (None, None) => Ranks::One,
        })
    }

    /// The one device this process trains on, from the setting `device` (`None`: auto).
    fn device(&self, device: Option<&str>) -> Result<Device, String> {
        match (self, device.map(device_list).transpose().map_err(|e| e.to_string())?.flatten()) {
            // A worker takes its host's LOCAL_RANK-th GPU of the list (or of the host, without one).
            (Ranks::Worker(w), Some(list)) => {
                let n = list
                    .get(w.local_rank)
                    .ok_or_else(|| format!("LOCAL_RANK={} but device={} names {} GPUs", w.local_rank, device.unwrap_or(""), list.len()))?;
                super::resolve_device(&n.to_string(), "training")
            }
            (Ranks::Worker(w), None) if device.is_none_or(|d| d.trim().eq_ignore_ascii_case("auto")) => {
                super::resolve_device(&w.local_rank.to_string(), "training")
            }
            // The launcher checks that every GPU is there before it starts a worker — counted, not
            // opened: it holds no context (nor its memory) on the GPUs its workers train on.
            (Ranks::Launcher(list), _) => {
                let visible = visible_gpus();
                match (list.iter().find(|&&n| n >= visible.as_ref().map_or(0, |v| *v)), &visible) {
                    (Some(n), Ok(v)) => Err(format!(
                        "device={}: training on several GPUs needs each of them; GPU {n} is not there ({v} visible)",
                        device.unwrap_or("")
                    )),
                    (Some(_), Err(why)) => {
                        Err(format!("device={}: training on several GPUs needs each of them; {why}", device.unwrap_or("")))
                    }
                    (None, _) => Ok(Device::Cuda(list[0])),
                }
            }
            _ => super::resolve_device(device.unwrap_or("auto"), "training"),
        }
    }
}

/// The run configuration (as `build_run` says), whether it is the embedded default, and which
/// process of the run this is.
fn build_run_ranked(a: &TrainArgs) -> Result<(PoseTrainConfig, bool, Ranks), String> {
    // Ultralytics' default precision: amp=True (16-mixed on a GPU, 32-true on the CPU) unless
    // amp= or precision= (key, yaml or --precision) says otherwise.
    let mut cfg = PoseTrainConfig { amp: Some(true), ..PoseTrainConfig::default() };
    let mut overrides = Vec::new();
    let mut from_yaml = Vec::new();
    for s in &a.settings {
        if let Some((k, v)) = s.split_once('=') {
            overrides.push((k.to_string(), v.to_string()));
        } else if s.ends_with(".yaml") || s.ends_with(".yml") {
            let path = Path::new(s);
            for (k, v) in yaml_settings(path)? {
                if k != "device" {
                    cfg.set(&k, &v).map_err(|e| format!("config {}: {e}", path.display()))?;
                }
                from_yaml.push((k, v));
            }
        } else {
            return Err(format!("`{s}` is neither key=value nor a .yaml config (`ptl cfg` lists the keys)"));
        }
    }
    // The device is resolved once, after everything else: every spelling counts the same.
    let device_keys: Vec<(String, String)> = from_yaml.iter().chain(&overrides).filter(|(k, _)| k == "device").cloned().collect();
    let device = device_setting(a.device.as_deref(), &device_keys)?;
    // Checked before anything is generated or read: a device that is not there fails at once.
    let ranks = Ranks::of(device.as_deref())?;
    let device = ranks.device(device.as_deref())?;
    overrides.retain(|(k, _)| k != "device");
    // Ultralytics' resume=True continues the newest run (its last.ckpt under the project folder);
    // resume=False is no resume.
    match overrides.iter().position(|(k, _)| k == "resume").map(|i| (i, overrides[i].1.trim().to_ascii_lowercase())) {
        Some((i, v)) if v == "false" => {
            overrides.remove(i);
        }
        Some((i, v)) if v == "true" => {
            let project =
                overrides.iter().rev().find(|(k, _)| k == "project").map_or_else(|| PoseTrainConfig::default().project, |(_, p)| p.into());
            let last = latest_run(&project)?;
            log::info!("ptl: resume=True: the newest run under {} is {}", project.display(), last.display());
            overrides[i].1 = last.display().to_string();
        }
        _ => {}
    }
    if let Some((_, path)) = overrides.iter().find(|(k, _)| k == "resume") {
        // A resume continues the checkpoint's run with its own settings; only machine settings
        // may be given (a training setting that differs is an error naming both values).
        if a.settings.iter().any(|s| !s.contains('=') && (s.ends_with(".yaml") || s.ends_with(".yml"))) {
            return Err("resume= restores the run's settings from the checkpoint: drop the .yaml config".into());
        }
        let mut given = overrides.clone();
        if let Some(p) = &a.precision {
            given.push(("precision".into(), p.clone()));
        }
        if let Some(s) = a.seed {
            given.push(("seed".into(), s.to_string()));
        }
        let mut cfg = PoseTrainConfig::for_resume(Path::new(path), &given).map_err(|e| e.to_string())?;
        cfg.device = device;
        cfg.resolve_amp();
        return Ok((cfg, false, ranks));
    }
    let data_given = a.settings.iter().any(|s| s.starts_with("data=")) || cfg.data != PoseTrainConfig::default().data;
    if !data_given {
        cfg.data = ensure_default_dataset()?;
        embedded_default(&mut cfg);
        cfg.model = ensure_default_start_weights()?.display().to_string();
    }
    for (k, v) in &overrides {
        cfg.set(k, v).map_err(|e| e.to_string())?;
    }
    cfg.device = device;
    cfg.resolve_amp();
    cfg.resolve_autobatch().map_err(|e| e.to_string())?;
    if let Some(p) = &a.precision {
        cfg.precision = Precision::parse(p).map_err(|e| e.to_string())?;
    }
    if let Some(s) = a.seed {
        cfg.seed = s;
    }
    if let Some(up) = imgsz_rounded_up(cfg.imgsz) {
        log::warn!("ptl: imgsz={} must be a multiple of the max stride 32, updating to {up}", cfg.imgsz);
        cfg.imgsz = up;
    }
    cfg.validate().map_err(|e| e.to_string())?;
    Ok((cfg, !data_given, ranks))
}

/// Ultralytics' `check_imgsz`: a size that is not a multiple of the model's largest stride (32)
/// is rounded up to one (at least 32); `None` when it is one already or out of range (an error
/// for `validate` to name).
fn imgsz_rounded_up(imgsz: usize) -> Option<usize> {
    (!imgsz.is_multiple_of(32) && imgsz <= ptl_trainer::pose::MAX_IMGSZ).then(|| imgsz.next_multiple_of(32).max(32))
}

/// The newest `<run>/weights/last.ckpt` under `project` (Ultralytics' `get_latest_run`).
fn latest_run(project: &Path) -> Result<std::path::PathBuf, String> {
    let runs = std::fs::read_dir(project)
        .map_err(|e| format!("resume=True: no runs under {} ({e}): give resume=path/to/last.ckpt", project.display()))?;
    let newest = runs
        .flatten()
        .map(|run| run.path().join("weights").join("last.ckpt"))
        .filter_map(|ckpt| Some((std::fs::metadata(&ckpt).ok()?.modified().ok()?, ckpt)))
        .max_by_key(|(t, _)| *t);
    newest
        .map(|(_, ckpt)| ckpt)
        .ok_or_else(|| format!("resume=True: no run under {} has weights/last.ckpt: give resume=path/to/last.ckpt", project.display()))
}

pub fn run_train(a: TrainArgs) -> Result<(), super::Failure> {
    // Ctrl-C and SIGTERM end the fit after its current step with a resumable checkpoint.
    ptl_trainer::fit::interrupt::install_signal_handlers().map_err(|e| format!("cannot install the SIGINT/SIGTERM handlers: {e}"))?;
    let (cfg, embedded, ranks) = build_run_ranked(&a)?;
    if let Ranks::Launcher(list) = &ranks {
        // The run's settings and data were checked (and the embedded default's files made) here,
        // once; each worker reads them again with its own GPU.
        log::info!("ptl: training on GPUs {list:?}: one worker process per GPU, batch {} in all", cfg.batch);
        let program = std::env::current_exe().map_err(|e| format!("cannot find ptl's own executable to start the workers: {e}"))?;
        let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        launch_local(&program, &args, list).map_err(|e| match e {
            TrainerError::Interrupted { signal, .. } => super::Failure {
                message: format!(
                    "{}: every rank stopped; rank 0 kept the place in its run's weights/last.ckpt (resume with `ptl train resume=…/weights/last.ckpt device={}`)",
                    ptl_trainer::fit::interrupt::signal_name(signal),
                    list.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
                ),
                code: (128 + signal).clamp(0, 255) as u8,
            },
            e => super::Failure::from(e.to_string()),
        })?;
        println!("finished: {} ranks trained (rank 0's lines above name the run folder)", list.len());
        return Ok(());
    }
    let batch = match cfg.autobatch {
        Some(f) => format!("AutoBatch at {:.0} % of the GPU's memory", 100.0 * f),
        None => cfg.batch.to_string(),
    };
    log::info!(
        "ptl: training {} on {} ({} epochs, batch {}, imgsz {}, {}, {})",
        cfg.model,
        cfg.data.display(),
        cfg.epochs,
        batch,
        cfg.imgsz,
        cfg.device,
        cfg.precision.name()
    );
    let fitted = match &ranks {
        Ranks::Worker(w) => join_group(&cfg, w).and_then(|group| fit_data_parallel(&cfg, Vec::new(), group)),
        _ => fit(&cfg, Vec::new()),
    };
    // Only rank 0 reports; the others end quietly.
    if matches!(&ranks, Ranks::Worker(w) if w.rank != 0) {
        return fitted.map(|_| ()).map_err(|e| super::Failure::from(e.to_string()));
    }
    let s = fitted.map_err(|e| match e {
        // The shell's convention: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM).
        TrainerError::Interrupted { signal, .. } => super::Failure { message: e.to_string(), code: (128 + signal).clamp(0, 255) as u8 },
        e => super::Failure::from(e.to_string()),
    })?;
    let t = &s.timing;
    println!(
        "finished in {:.1} s, {} optimizer steps; start-to-start step median {:.1} ms{} (p10 {:.1}, p90 {:.1}, {} steps), \
         data wait {:.2} ms/step, {} loader workers",
        s.total_runtime_s,
        s.optimizer_steps,
        s.step_time.median_ms,
        match t.start_to_start.window_ms {
            w if w > 0.0 => format!(", {w:.1} ms over 16-step stretches"),
            _ => String::new(),
        },
        s.step_time.p10_ms,
        s.step_time.p90_ms,
        s.step_time.timed_steps,
        t.data_wait_ms_mean,
        t.workers
    );
    if let (Some(can), Some(took)) = (t.loader_images_per_s, t.consumed_images_per_s) {
        println!("loader: {can:.0} images/s from {} workers' build times; the steps took {took:.0} images/s", t.workers);
    }
    if let Some(ms) = t.steady_window_ms_per_step {
        println!("steady pace {ms:.1} ms/step (16 steps before the GPU window, synchronised at both ends)");
    }
    if let Some(g) = &t.gpu {
        println!(
            "GPU time {:.1} ms/step in {:.0} kernels on {} streams, {:.1} ms without dependent-launch waits, \
             {:.1} ms with a kernel running (device-event span {:.1} ms/step, {} steps traced)",
            g.kernel_ms_per_step,
            g.kernels_per_step,
            g.kernel_streams,
            g.kernel_busy_ms_per_step,
            g.kernel_active_ms_per_step,
            g.event_span_ms_per_step,
            g.steps
        );
    }
    // The steady state (the traced window near the end) when there is one.
    if let Some(l) = t.launches_steady.as_ref().or(t.launches.as_ref()) {
        let when = if t.launches_steady.is_some() { "steady state" } else { "after the warm-up" };
        println!(
            "per step ({when}): {:.1} kernel launches, {:.1} library calls, {:.1} graph launches, {:.1} copies, {:.2} host syncs",
            l.kernel_launches,
            l.library_calls,
            l.graph_launches,
            l.host_to_device_copies + l.device_to_host_copies + l.device_to_device_copies,
            l.host_syncs
        );
    }
    let st = &s.startup;
    println!(
        "start-up: {} s to the first step (dataset {:.2} s, device {:.2} s, model {:.2} s); first step {:.2} s; \
         {} library set-ups {:.2} s",
        st.process_to_first_step_s.map_or("?".into(), |v| format!("{v:.2}")),
        st.dataset_open_s,
        st.device_open_s,
        st.model_build_s,
        st.first_step_s,
        st.library_setups,
        st.library_setup_s
    );
    if let (Some(a), Some(r)) = (s.peak_allocated_bytes, s.peak_reserved_bytes) {
        let during = s.peak_allocated_during.as_deref().map(|d| format!(", allocated peak during {d}")).unwrap_or_default();
        println!("memory: peak {:.0} MiB allocated, {:.0} MiB reserved{during}", a as f64 / 1048576.0, r as f64 / 1048576.0);
    }
    for line in &s.plugins {
        println!("replay {line}");
    }
    for (k, v) in &s.final_metrics {
        println!("  {k:<24} {v:.4}");
    }
    println!("artefacts: {}", s.save_dir.display());
    if embedded {
        predict_first_val_image(&cfg, &s.save_dir)?;
    }
    Ok(())
}

/// The embedded default ends by predicting with its best weights (the last epoch's without
/// validation) on the first validation image and saying where the drawing is (`<run>/predict/`).
fn predict_first_val_image(cfg: &PoseTrainConfig, run: &Path) -> Result<(), String> {
    let images = cfg.data.parent().map(|d| d.join("images/val")).ok_or("the default dataset has no folder")?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(&images)
        .map_err(|e| format!("{}: {e}", images.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jpg"))
        .collect();
    files.sort();
    let first = files.first().ok_or_else(|| format!("no validation image in {}", images.display()))?;
    // The command line's own defaults for everything else.
    #[derive(clap::Parser)]
    struct Predict {
        #[command(flatten)]
        a: super::predict::PredictArgs,
    }
    // The best epoch's weights; without validation (val=false) there is no best, the last then.
    let best = run.join("weights/best.ckpt");
    let weights = if best.is_file() { best } else { run.join("weights").join(ptl_trainer::fit::checkpoint::LAST_WEIGHTS) };
    let settings = [
        format!("model={}", weights.display()),
        format!("source={}", first.display()),
        format!("project={}", run.join("predict").display()),
        format!("device={}", cfg.device),
    ];
    let parsed =
        <Predict as clap::Parser>::try_parse_from(std::iter::once("predict".to_string()).chain(settings)).map_err(|e| e.to_string())?;
    super::predict::run_predict(parsed.a)
}

/// `ptl cfg`: every training key with its default and meaning.
pub fn print_keys() {
    let keys = PoseTrainConfig::keys();
    let wk = keys.iter().map(|(k, _, _)| k.len()).max().unwrap_or(0);
    let wd = keys.iter().map(|(_, d, _)| d.len()).max().unwrap_or(0).min(28);
    println!("ptl train [cfg.yaml] [key=value …] — keys (default, meaning):");
    for (k, d, help) in keys {
        println!("  {k:<wk$}  {d:<wd$}  {help}");
    }
    let foreign: Vec<&str> = ptl_trainer::pose::foreign_keys::keys().collect();
    println!(
        "Ultralytics keys with no ptl key of their own take the values that change nothing here (their \
         default) and refuse others with the reason: {}",
        foreign.join(", ")
    );
}

/// The number of GPUs the driver shows, or why there are none, without opening any of them.
fn visible_gpus() -> Result<usize, String> {
    #[cfg(feature = "cuda")]
    return ptl_autograd::cuda::visible_devices().map_err(|e| e.to_string());
    #[cfg(not(feature = "cuda"))]
    Err("this ptl was built without its CUDA backend (feature `cuda`)".into())
}

/// This worker's place in its group: the NCCL communicator on its GPU (CUDA builds).
fn join_group(cfg: &PoseTrainConfig, w: &WorkerEnv) -> ptl_trainer::Result<Box<dyn Collective>> {
    #[cfg(feature = "cuda")]
    if cfg.device.is_cuda() {
        let group = ptl_trainer::distributed::NcclCollective::join(cfg.device, w, std::time::Duration::from_secs(600))?;
        return Ok(Box::new(group));
    }
    Err(TrainerError::InvalidArgument {
        what: "device",
        reason: format!("rank {} of {}: several ranks train on CUDA GPUs through NCCL, not on {}", w.rank, w.world, cfg.device),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedded default steps the optimizer on every batch, often enough to learn visibly.
    #[test]
    fn the_embedded_default_takes_an_optimizer_step_per_batch() {
        let mut cfg = PoseTrainConfig::default();
        embedded_default(&mut cfg);
        assert_eq!(cfg.nbs, cfg.batch, "one optimizer step per batch");
        let steps = cfg.epochs * DEFAULT_TRAIN_IMAGES.div_ceil(cfg.batch);
        assert!(steps >= 80, "{steps} optimizer steps");
        assert!(cfg.validate().is_ok());
    }

    /// Ultralytics' default `amp=True` is 32-true on the CPU (16-mixed on a GPU: the CUDA CLI
    /// test), and a precision given by key, yaml or flag is that precision.
    #[test]
    fn amp_is_on_by_default_and_an_explicit_precision_wins() {
        let args = |settings: &[&str], precision: Option<&str>| TrainArgs {
            settings: [&["data=unused.yaml", "device=cpu"], settings].concat().into_iter().map(str::to_string).collect(),
            device: None,
            precision: precision.map(str::to_string),
            seed: None,
        };
        let precision = |a: TrainArgs| build_run(&a).expect("config").0.precision;
        assert_eq!(precision(args(&[], None)), Precision::F32);
        assert_eq!(precision(args(&["precision=bf16-mixed"], None)), Precision::Bf16Mixed);
        assert_eq!(precision(args(&["amp=bf16-mixed"], None)), Precision::Bf16Mixed);
        assert_eq!(precision(args(&["precision=bf16-mixed", "amp=true"], None)), Precision::F32, "the later setting wins");
        assert_eq!(precision(args(&[], Some("16-mixed"))), Precision::F16Mixed);
        let dir = std::env::temp_dir().join(format!("ptl-amp-default-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let yaml = dir.join("cfg.yaml");
        std::fs::write(&yaml, "precision: bf16-mixed\n").unwrap();
        assert_eq!(precision(args(&[yaml.to_str().unwrap()], None)), Precision::Bf16Mixed);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

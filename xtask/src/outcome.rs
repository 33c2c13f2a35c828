//! `cargo xtask outcome`: long training runs of ptl and Ultralytics on one learnable synthetic set,
//! to compare what the fits reach (not how fast they are: that is `cargo xtask bench`).
//!
//! The set is `ptl data synth`'s, sized so that a 100-epoch Ultralytics run fits a few minutes of
//! one GPU (640 training images of which 64 backgrounds, 128 validation images, 320 px). Every run
//! trains YOLO26n-pose from scratch with each tool's defaults (optimizer `auto`, close_mosaic 10,
//! validation every epoch) at the same epochs, batch, image size and seed. A finished run is
//! appended to `runs.jsonl` at once with its per-epoch metrics and its wall time, so runs made in
//! several calls merge: `--report` writes `outcome.md` (final and best figures per run, and whether
//! each ptl arm ends within Ultralytics' seed-to-seed spread) and `outcome.png` (box and pose
//! mAP50-95 per epoch, every run).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use ptl_trainer::pose::plots::{plot_curves, Curve, CurveChart};
use serde_json::{json, Value};

use crate::bench::{check_own_private, install_ultralytics, read_runs, tail, ULTRA_SCRIPT};

const HELP: &str =
    "usage: cargo xtask outcome --here [options]     on the GPU machine, from bench-pack/ (cargo xtask bench --pack --vs ultralytics)
       cargo xtask outcome --report DIR|FILE... [--out DIR]   merge runs.jsonl files into outcome.md and outcome.png
       cargo xtask outcome --import RESULTS_CSV --arm A --seed S --wall-s SECONDS [--note TEXT] [options] --out DIR
                   append a run made outside `--here` (e.g. resumed in parts) from its results.csv
options:
  --arms A,B       runs per seed, each `<tool>[@precision]` (precision 16-mixed unless named):
                   native (ptl), replay (ptl replay=all), ultralytics (amp=True for 16-mixed,
                   amp=bf16 for bf16-mixed, amp=False for 32-true)
                   default: native,replay,ultralytics
  --seeds S,T      seeds (default 0,1)
  --epochs N       epochs (default 100)
  --batch N        batch size (default 16)
  --imgsz N        image size of the set and the runs (default 320)
  --train N        training images of the set (default 640), --background N of them without people
                   (default 64), --val N validation images (default 128), --data-seed N (default 347)
  --work DIR       dataset, caches and run folders (must be yours, writable by nobody else)
  --out DIR        results (default $OUT or outcome-out)
  --device D       ptl's device (default cuda:0)";

/// The metrics a run is judged on, as both tools name them per epoch.
const BOX: &str = "metrics/mAP50-95(B)";
const POSE: &str = "metrics/mAP50-95(P)";
const BOX50: &str = "metrics/mAP50(B)";
const POSE50: &str = "metrics/mAP50(P)";

/// One arm: which tool, at which precision, replayed or not.
#[derive(Clone, Debug, PartialEq)]
struct Arm {
    /// As given (`replay`, `ultralytics@bf16-mixed`): the run's label in the tables.
    label: String,
    ultralytics: bool,
    replay: bool,
    precision: String,
}

fn parse_arm(spec: &str) -> Result<Arm, String> {
    let (tool, precision) = spec.split_once('@').unwrap_or((spec, "16-mixed"));
    if !["16-mixed", "bf16-mixed", "32-true"].contains(&precision) {
        return Err(format!("arm `{spec}`: precision `{precision}` is not 16-mixed, bf16-mixed or 32-true"));
    }
    let (ultralytics, replay) = match tool {
        "native" => (false, false),
        "replay" => (false, true),
        "ultralytics" => (true, false),
        other => return Err(format!("arm `{spec}`: unknown tool `{other}` (native, replay, ultralytics)")),
    };
    Ok(Arm { label: spec.to_string(), ultralytics, replay, precision: precision.to_string() })
}

#[derive(Clone, Debug)]
struct Opts {
    arms: Vec<Arm>,
    seeds: Vec<u64>,
    epochs: usize,
    batch: usize,
    imgsz: usize,
    train: usize,
    background: usize,
    val: usize,
    data_seed: u64,
    work: Option<PathBuf>,
    out: PathBuf,
    device: String,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        arms: ["native", "replay", "ultralytics"].iter().map(|a| parse_arm(a)).collect::<Result<_, _>>()?,
        seeds: vec![0, 1],
        epochs: 100,
        batch: 16,
        imgsz: 320,
        train: 640,
        background: 64,
        val: 128,
        data_seed: 347,
        work: None,
        out: std::env::var_os("OUT").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("outcome-out")),
        device: "cuda:0".into(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value\n{HELP}"));
        let num = |name: &str, v: String| v.parse::<usize>().map_err(|_| format!("{name} wants a whole number, not `{v}`"));
        match a.as_str() {
            "--arms" => o.arms = val("--arms")?.split(',').filter(|s| !s.is_empty()).map(parse_arm).collect::<Result<_, _>>()?,
            "--seeds" => {
                o.seeds = val("--seeds")?
                    .split(',')
                    .map(|s| s.parse().map_err(|_| format!("--seeds: `{s}` is not a seed")))
                    .collect::<Result<_, _>>()?
            }
            "--epochs" => o.epochs = num(a, val(a)?)?,
            "--batch" => o.batch = num(a, val(a)?)?,
            "--imgsz" => o.imgsz = num(a, val(a)?)?,
            "--train" => o.train = num(a, val(a)?)?,
            "--background" => o.background = num(a, val(a)?)?,
            "--val" => o.val = num(a, val(a)?)?,
            "--data-seed" => o.data_seed = num(a, val(a)?)? as u64,
            "--work" => o.work = Some(PathBuf::from(val(a)?)),
            "--out" => o.out = PathBuf::from(val(a)?),
            "--device" => o.device = val(a)?,
            "-h" | "--help" => return Err(HELP.into()),
            other => return Err(format!("unknown option {other}\n{HELP}")),
        }
    }
    if o.arms.is_empty() || o.seeds.is_empty() {
        return Err("--arms and --seeds need at least one entry".into());
    }
    if o.epochs == 0 || o.batch == 0 || o.imgsz < 32 || o.val == 0 || o.background >= o.train {
        return Err("--epochs, --batch and --val must be at least 1, --imgsz at least 32, --background below --train".into());
    }
    Ok(o)
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("--report") => {
            let mut out = std::env::var_os("OUT").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("outcome-out"));
            let mut recs = Vec::new();
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                if a == "--out" {
                    out = PathBuf::from(it.next().ok_or("--out needs a folder")?);
                } else {
                    let p = PathBuf::from(a);
                    recs.extend(read_runs(&if p.is_dir() { p.join("runs.jsonl") } else { p })?);
                }
            }
            if recs.is_empty() {
                return Err("--report needs folders (with runs.jsonl) or runs files holding runs".into());
            }
            write_report(&recs, &out)
        }
        Some("--import") => import(&args[1..]),
        Some("--here") => {
            // On the GPU machine, from bench-pack/: ptl, the Ultralytics driver and its wheels lie
            // beside this binary.
            let o = parse(&args[1..])?;
            let dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_default();
            run_here(&o, &crate::artifacts::unpacked(&dir.join("ptl"))?, &dir.join("ultralytics_bench.py"), &dir.join("whl"))
        }
        _ => Err(format!("outcome runs on the GPU machine (--here) or reports (--report)\n{HELP}")),
    }
}

/// Appends one run made outside `--here` — a run split by `resume`, say — to `--out`'s runs.jsonl
/// from its `results.csv` (Ultralytics' column names, which ptl's results.csv shares), with the
/// wall time and a note on how it ran given by the caller; the set and settings are the options'.
fn import(args: &[String]) -> Result<(), String> {
    let csv = PathBuf::from(args.first().ok_or_else(|| format!("--import needs a results.csv\n{HELP}"))?);
    let (mut arm, mut seed, mut wall, mut note, mut rest) = (None, None, None, None, Vec::new());
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--arm" => arm = Some(parse_arm(&val()?)?),
            "--seed" => seed = Some(val()?.parse::<u64>().map_err(|_| "--seed wants a whole number".to_string())?),
            "--wall-s" => wall = Some(val()?.parse::<f64>().map_err(|_| "--wall-s wants seconds".to_string())?),
            "--note" => note = Some(val()?),
            _ => rest.push(a.clone()),
        }
    }
    let (Some(arm), Some(seed), Some(wall)) = (arm, seed, wall) else {
        return Err("--import needs --arm, --seed and --wall-s".into());
    };
    let o = parse(&rest)?;
    let text = std::fs::read_to_string(&csv).map_err(|e| format!("{}: {e}", csv.display()))?;
    let epochs = epochs_of_csv(&text);
    if epochs.is_empty() {
        return Err(format!("{}: no epoch rows", csv.display()));
    }
    let mut rec = record(&o, &arm, seed, wall, 0, epochs, None);
    rec["imported_from"] = json!(csv.file_name().map(|n| n.to_string_lossy().into_owned()));
    rec["note"] = json!(note);
    std::fs::create_dir_all(&o.out).map_err(|e| format!("{}: {e}", o.out.display()))?;
    let log = o.out.join("runs.jsonl");
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    writeln!(f, "{rec}").map_err(|e| format!("{}: {e}", log.display()))?;
    eprintln!("outcome: imported {} seed {seed}: {}", arm.label, summary_line(&rec));
    Ok(())
}

fn work_folder(o: &Opts) -> Result<PathBuf, String> {
    let w = o.work.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("ptl-outcome-{}", std::process::id())));
    std::fs::create_dir_all(&w).map_err(|e| format!("{}: {e}", w.display()))?;
    check_own_private(&w)?;
    Ok(w)
}

fn run_here(o: &Opts, ptl: &Path, script: &Path, wheels: &Path) -> Result<(), String> {
    let work = work_folder(o)?;
    std::fs::create_dir_all(&o.out).map_err(|e| format!("{}: {e}", o.out.display()))?;
    let data = ensure_dataset(ptl, o, &work)?;
    let site = if o.arms.iter().any(|a| a.ultralytics) { Some(install_ultralytics(Some(wheels), &work)?) } else { None };
    if !script.exists() {
        std::fs::write(script, ULTRA_SCRIPT).map_err(|e| format!("{}: {e}", script.display()))?;
    }
    let log = o.out.join("runs.jsonl");
    for &seed in &o.seeds {
        for arm in &o.arms {
            let rec = if arm.ultralytics {
                run_ultralytics(o, &work, script, site.as_deref(), &data, arm, seed)?
            } else {
                run_ptl(o, &work, ptl, &data, arm, seed)?
            };
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&log).map_err(|e| format!("{}: {e}", log.display()))?;
            writeln!(f, "{rec}").map_err(|e| format!("{}: {e}", log.display()))?;
            eprintln!("outcome: {} seed {seed}: {}", arm.label, summary_line(&rec));
        }
    }
    write_report(&read_runs(&log)?, &o.out)
}

fn ensure_dataset(ptl: &Path, o: &Opts, work: &Path) -> Result<PathBuf, String> {
    let synth = work.join(format!("synth-{}-{}-{}-{}-{}", o.train, o.background, o.val, o.imgsz, o.data_seed));
    let yaml = synth.join("data.yaml");
    if yaml.exists() {
        return Ok(yaml);
    }
    let run = Command::new(ptl)
        .args(["data", "synth", "--out"])
        .arg(&synth)
        .args(["--train", &o.train.to_string(), "--background", &o.background.to_string(), "--val", &o.val.to_string()])
        .args(["--imgsz", &o.imgsz.to_string(), "--seed", &o.data_seed.to_string()])
        .output()
        .map_err(|e| format!("starting {}: {e}", ptl.display()))?;
    if !run.status.success() || !yaml.exists() {
        return Err(format!("ptl data synth failed ({}): {}", run.status, String::from_utf8_lossy(&run.stderr)));
    }
    Ok(yaml)
}

/// What every record carries besides its result: the settings both tools ran with.
fn record(o: &Opts, arm: &Arm, seed: u64, wall_s: f64, exit: i32, epochs: Vec<Value>, error: Option<String>) -> Value {
    json!({
        "arm": arm.label, "tool": if arm.ultralytics { "ultralytics" } else { "ptl" }, "replay": arm.replay,
        "precision": arm.precision, "seed": seed, "epochs_asked": o.epochs, "batch": o.batch, "imgsz": o.imgsz,
        "set": { "train": o.train, "background": o.background, "val": o.val, "seed": o.data_seed },
        "wall_s": wall_s, "exit": exit, "epochs": epochs, "error": error,
    })
}

fn run_ptl(o: &Opts, work: &Path, ptl: &Path, data: &Path, arm: &Arm, seed: u64) -> Result<Value, String> {
    let project = work.join(format!("runs/{}-seed{seed}", arm.label.replace('@', "-")));
    let _ = std::fs::remove_dir_all(&project);
    let mut cmd = Command::new(ptl);
    cmd.arg("train")
        .arg(format!("data={}", data.display()))
        .args([format!("epochs={}", o.epochs), format!("batch={}", o.batch), format!("imgsz={}", o.imgsz), format!("seed={seed}")])
        .args(["plots=false", "exist_ok=true"])
        .arg(format!("save_dir={}", project.display()))
        .args(["--device", &o.device, "--precision", &arm.precision])
        .env("PTL_KERNEL_CACHE", work.join("kernels"))
        .env("PTL_CUDNN_CACHE", work.join("cudnn"));
    if arm.replay {
        cmd.arg("replay=all");
    }
    let t = Instant::now();
    let out = cmd.output().map_err(|e| format!("starting ptl: {e}"))?;
    let wall = t.elapsed().as_secs_f64();
    let logname = format!("ptl-{}-seed{seed}.log", arm.label.replace('@', "-"));
    let _ = std::fs::write(o.out.join(&logname), [out.stdout.as_slice(), out.stderr.as_slice()].concat());
    let csv = project.join("results.csv");
    let _ = std::fs::copy(&csv, o.out.join(format!("results-{}-seed{seed}.csv", arm.label.replace('@', "-"))));
    let epochs = std::fs::read_to_string(&csv).map(|t| epochs_of_csv(&t)).unwrap_or_default();
    let exit = out.status.code().unwrap_or(-1);
    let mut rec = record(o, arm, seed, wall, exit, epochs, (exit != 0).then(|| tail(&out.stderr, 8)));
    rec["summary"] =
        std::fs::read_to_string(project.join("summary.json")).ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or(Value::Null);
    Ok(rec)
}

fn run_ultralytics(o: &Opts, work: &Path, script: &Path, site: Option<&Path>, data: &Path, arm: &Arm, seed: u64) -> Result<Value, String> {
    let amp = match arm.precision.as_str() {
        "bf16-mixed" => "bf16",
        "32-true" => "False",
        _ => "True",
    };
    let result = work.join(format!("{}-seed{seed}.json", arm.label.replace('@', "-")));
    let _ = std::fs::remove_file(&result);
    let mut cmd = Command::new("python3");
    cmd.arg(script)
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(&result)
        .args(["--epochs", &o.epochs.to_string(), "--batch", &o.batch.to_string(), "--imgsz", &o.imgsz.to_string()])
        .args(["--seed", &seed.to_string(), "--amp", amp, "--optimizer", "auto", "--close-mosaic", "10", "--gpu-window", "0"])
        .env("PYTHONUNBUFFERED", "1")
        .env("ULTRA_WORK", work.join("ultra"));
    if let Some(s) = site {
        cmd.env("PYTHONPATH", s);
    }
    let t = Instant::now();
    let out = cmd.output().map_err(|e| format!("starting python3: {e}"))?;
    let wall = t.elapsed().as_secs_f64();
    let logname = format!("{}-seed{seed}.log", arm.label.replace('@', "-"));
    let _ = std::fs::write(o.out.join(&logname), [out.stdout.as_slice(), out.stderr.as_slice()].concat());
    let res: Value = std::fs::read_to_string(&result).ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or(Value::Null);
    let mut epochs: Vec<Value> = res["metrics_per_epoch"]
        .as_array()
        .map(|v| v.iter().enumerate().map(|(i, m)| epoch_entry(i + 1, |k| m[k].as_f64())).collect())
        .unwrap_or_default();
    // A driver that still reports Ultralytics' final validation of best.pt as one more epoch.
    let final_eval = (epochs.len() > o.epochs).then(|| epochs.split_off(o.epochs));
    let exit = out.status.code().unwrap_or(-1);
    let error = (exit != 0).then(|| tail(&out.stderr, 8)).or_else(|| res["error"].as_str().map(|e| format!("crashed: {e}")));
    let mut rec = record(o, arm, seed, wall, if error.is_some() && exit == 0 { 1 } else { exit }, epochs, error);
    rec["precision_ran"] = res["precision"].clone();
    rec["optimizer_ran"] = res["optimizer"].clone();
    rec["final_eval"] = match final_eval {
        Some(mut extra) => extra.pop().unwrap_or(Value::Null),
        None => res["final_eval_metrics"].as_object().map_or(Value::Null, |m| epoch_entry(0, |k| m.get(k).and_then(Value::as_f64))),
    };
    Ok(rec)
}

/// One epoch's four figures (`None` where the run did not report one).
fn epoch_entry(epoch: usize, get: impl Fn(&str) -> Option<f64>) -> Value {
    json!({ "epoch": epoch, "box": get(BOX), "pose": get(POSE), "box50": get(BOX50), "pose50": get(POSE50) })
}

/// Per-epoch figures of a ptl `results.csv` (Ultralytics' column names).
fn epochs_of_csv(text: &str) -> Vec<Value> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').map(str::trim).collect();
    let rows = lines.filter(|l| !l.trim().is_empty()).enumerate().map(|(i, l)| {
        let cells: Vec<&str> = l.split(',').map(str::trim).collect();
        let get = |k: &str| header.iter().position(|h| *h == k).and_then(|j| cells.get(j)).and_then(|v| v.parse::<f64>().ok());
        let epoch = get("epoch").map_or(i + 1, |e| e as usize);
        (epoch, epoch_entry(epoch, get))
    });
    // An epoch that ran twice (a run resumed from a checkpoint older than its last row) keeps
    // its last row, in the place of its first.
    let mut out: Vec<(usize, Value)> = Vec::new();
    for (epoch, entry) in rows {
        match out.iter_mut().find(|(e, _)| *e == epoch) {
            Some(slot) => slot.1 = entry,
            None => out.push((epoch, entry)),
        }
    }
    out.into_iter().map(|(_, v)| v).collect()
}

fn summary_line(rec: &Value) -> String {
    let last = rec["epochs"].as_array().and_then(|v| v.last()).cloned().unwrap_or(Value::Null);
    format!(
        "exit {}, {:.0} s, {} epochs, last box/pose mAP50-95 {}/{}",
        rec["exit"],
        rec["wall_s"].as_f64().unwrap_or(0.0),
        rec["epochs"].as_array().map_or(0, Vec::len),
        fmt(last["box"].as_f64()),
        fmt(last["pose"].as_f64())
    )
}

fn fmt(v: Option<f64>) -> String {
    v.map_or("–".into(), |x| format!("{x:.4}"))
}

// ---- the report ---------------------------------------------------------------------------------

/// A finished run's figures.
#[derive(Clone, Debug)]
struct Figures {
    arm: String,
    seed: u64,
    wall_s: f64,
    epochs: usize,
    last_box: f64,
    last_pose: f64,
    last_pose50: f64,
    best_box: (f64, usize),
    best_pose: (f64, usize),
}

/// A run's training epochs: at most the epochs it was asked for. Ultralytics validates best.pt
/// once more after the last epoch and calls its epoch-end hook for it; records made before the
/// driver kept that apart carry it as an extra entry, which is not an epoch (it is best.pt's
/// figures, not the last epoch's).
fn training_epochs(rec: &Value) -> &[Value] {
    let eps = rec["epochs"].as_array().map_or(&[][..], Vec::as_slice);
    match rec["epochs_asked"].as_u64() {
        Some(asked) => &eps[..eps.len().min(asked as usize)],
        None => eps,
    }
}

fn figures(rec: &Value) -> Option<Figures> {
    let eps = Some(training_epochs(rec)).filter(|v| !v.is_empty())?;
    let series =
        |k: &str| eps.iter().map(|e| (e[k].as_f64().unwrap_or(f64::NAN), e["epoch"].as_u64().unwrap_or(0) as usize)).collect::<Vec<_>>();
    let best = |k: &str| {
        series(k).into_iter().filter(|p| p.0.is_finite()).fold((f64::NAN, 0), |b, p| if b.0.is_nan() || p.0 > b.0 { p } else { b })
    };
    let last = eps.last()?;
    Some(Figures {
        arm: rec["arm"].as_str()?.to_string(),
        seed: rec["seed"].as_u64()?,
        wall_s: rec["wall_s"].as_f64().unwrap_or(f64::NAN),
        epochs: eps.len(),
        last_box: last["box"].as_f64().unwrap_or(f64::NAN),
        last_pose: last["pose"].as_f64().unwrap_or(f64::NAN),
        last_pose50: last["pose50"].as_f64().unwrap_or(f64::NAN),
        best_box: best("box"),
        best_pose: best("pose"),
    })
}

/// Whether `v` lies within the reference runs' seed-to-seed spread, or — where that spread is
/// narrower than 5 % of their mean — within 5 % of the mean; with the band it was judged against.
fn within_reference(v: f64, refs: &[f64]) -> Option<(bool, f64, f64)> {
    if refs.is_empty() {
        return None;
    }
    let lo = refs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = refs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mean = refs.iter().sum::<f64>() / refs.len() as f64;
    let (lo, hi) = if hi - lo < 0.10 * mean { (lo.min(0.95 * mean), hi.max(1.05 * mean)) } else { (lo, hi) };
    Some((v >= lo && v <= hi, lo, hi))
}

fn write_report(recs: &[Value], out: &Path) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let runs: Vec<(&Value, Figures)> = recs.iter().filter_map(|r| figures(r).map(|f| (r, f))).collect();
    let failed: Vec<&Value> = recs.iter().filter(|r| r["exit"] != 0).collect();
    let mut md = String::from("# Training outcome: ptl and Ultralytics on one set\n\n");
    if let Some((r, _)) = runs.first() {
        md += &format!(
            "Set: `ptl data synth --train {} --background {} --val {} --imgsz {} --seed {}`; YOLO26n-pose from scratch, batch {}, imgsz {}, each tool's defaults (optimizer auto, close_mosaic 10).\n\n",
            r["set"]["train"], r["set"]["background"], r["set"]["val"], r["imgsz"], r["set"]["seed"], r["batch"], r["imgsz"]
        );
    }
    md += "| arm | seed | epochs | final box mAP50-95 | final pose mAP50-95 | final pose mAP50 | best box mAP50-95 (epoch) | best pose mAP50-95 (epoch) | wall |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    let mut sorted = runs.clone();
    sorted.sort_by(|a, b| (a.1.arm.as_str(), a.1.seed).cmp(&(b.1.arm.as_str(), b.1.seed)));
    for (_, f) in &sorted {
        md += &format!(
            "| {} | {} | {} | {:.4} | {:.4} | {:.4} | {:.4} ({}) | {:.4} ({}) | {:.0} s |\n",
            f.arm,
            f.seed,
            f.epochs,
            f.last_box,
            f.last_pose,
            f.last_pose50,
            f.best_box.0,
            f.best_box.1,
            f.best_pose.0,
            f.best_pose.1,
            f.wall_s
        );
    }
    let notes: Vec<String> =
        sorted.iter().filter_map(|(r, f)| r["note"].as_str().map(|n| format!("- {} seed {}: {n}\n", f.arm, f.seed))).collect();
    if !notes.is_empty() {
        md += &format!("\nHow some runs ran:\n{}", notes.concat());
    }
    md += &verdicts(&sorted.iter().map(|(_, f)| f.clone()).collect::<Vec<_>>());
    if !failed.is_empty() {
        md += "\nFailed runs:\n";
        for r in failed {
            md += &format!(
                "- {} seed {}: exit {}: {}\n",
                r["arm"].as_str().unwrap_or("?"),
                r["seed"],
                r["exit"],
                r["error"].as_str().unwrap_or("").lines().last().unwrap_or("")
            );
        }
    }
    std::fs::write(out.join("outcome.md"), &md).map_err(|e| format!("writing outcome.md: {e}"))?;
    plot(&runs, &out.join("outcome.png"))?;
    print!("{md}");
    Ok(())
}

/// Each ptl arm's final figures against the Ultralytics runs of the same precision.
fn verdicts(runs: &[Figures]) -> String {
    let mut by_arm: BTreeMap<&str, Vec<&Figures>> = BTreeMap::new();
    for f in runs {
        by_arm.entry(f.arm.as_str()).or_default().push(f);
    }
    let mut s =
        String::from("\nptl against Ultralytics' seed-to-seed spread of the final figures (or ±5 % of its mean where that is wider):\n\n");
    let mut any = false;
    for (arm, fs) in &by_arm {
        let Ok(a) = parse_arm(arm) else { continue };
        if a.ultralytics {
            continue;
        }
        let reference = if a.precision == "16-mixed" { "ultralytics".to_string() } else { format!("ultralytics@{}", a.precision) };
        let Some(refs) = by_arm.get(reference.as_str()) else { continue };
        for (name, get) in [("box", (|f: &Figures| f.last_box) as fn(&Figures) -> f64), ("pose", |f: &Figures| f.last_pose)] {
            let rv: Vec<f64> = refs.iter().map(|f| get(f)).collect();
            for f in fs {
                if let Some((ok, lo, hi)) = within_reference(get(f), &rv) {
                    any = true;
                    s += &format!(
                        "- {arm} seed {}: final {name} mAP50-95 {:.4} {} [{lo:.4}, {hi:.4}] ({reference}, {} runs)\n",
                        f.seed,
                        get(f),
                        if ok {
                            "within"
                        } else if get(f) > hi {
                            "ABOVE"
                        } else {
                            "BELOW"
                        },
                        rv.len()
                    );
                }
            }
            let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
            let (m, r) = (mean(fs.iter().map(|f| get(f)).collect()), mean(rv));
            s += &format!(
                "- {arm}: mean final {name} mAP50-95 over {} seeds {m:.4}, {:+.1} % against {reference}, {r:.4}\n",
                fs.len(),
                100.0 * (m / r - 1.0)
            );
        }
    }
    if any {
        s
    } else {
        String::new()
    }
}

/// Colour per arm (in order of first appearance), dashed from each arm's second seed on.
fn plot(runs: &[(&Value, Figures)], out: &Path) -> Result<(), String> {
    let mut arms: Vec<&str> = Vec::new();
    let mut curves: [Vec<Curve>; 2] = [Vec::new(), Vec::new()];
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (rec, f) in runs {
        let colour = arms.iter().position(|a| *a == f.arm).unwrap_or_else(|| {
            arms.push(f.arm.as_str());
            arms.len() - 1
        });
        let nth = seen.entry(f.arm.as_str()).or_insert(0);
        let dashed = *nth > 0;
        *nth += 1;
        let eps = training_epochs(rec);
        for (k, key) in ["box", "pose"].iter().enumerate() {
            let points = eps.iter().filter_map(|e| Some((e["epoch"].as_f64()?, e[*key].as_f64()?))).collect();
            curves[k].push(Curve { label: format!("{} seed {}", f.arm, f.seed), points, colour, dashed });
        }
    }
    let [b, p] = curves;
    let charts = [
        CurveChart { title: "box mAP50-95 (validation, every epoch)".into(), y_desc: "mAP50-95(B)".into(), curves: b },
        CurveChart { title: "pose mAP50-95 (validation, every epoch)".into(), y_desc: "mAP50-95(P)".into(), curves: p },
    ];
    plot_curves(&charts, out).map_err(|e| format!("drawing {}: {e}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arms_parse_with_their_precision() {
        assert_eq!(
            parse_arm("replay").unwrap(),
            Arm { label: "replay".into(), ultralytics: false, replay: true, precision: "16-mixed".into() }
        );
        let u = parse_arm("ultralytics@bf16-mixed").unwrap();
        assert!(u.ultralytics && u.precision == "bf16-mixed");
        assert!(parse_arm("native@fp8").unwrap_err().contains("fp8"));
        assert!(parse_arm("torch").unwrap_err().contains("torch"));
    }

    #[test]
    fn ptl_results_csv_gives_the_epoch_figures() {
        let csv = "epoch,time,metrics/mAP50(B),metrics/mAP50-95(B),metrics/mAP50(P),metrics/mAP50-95(P)\n1,2.0,0.1,0.05,0.02,0.01\n2,4.0,0.3,0.15,nan,0.04\n";
        let e = epochs_of_csv(csv);
        assert_eq!(e.len(), 2);
        assert_eq!(e[1]["epoch"], 2);
        assert_eq!(e[1]["box"].as_f64(), Some(0.15));
        assert!(e[1]["pose50"].is_null(), "nan is no figure");
    }

    #[test]
    fn the_reference_band_is_the_spread_or_five_percent_of_the_mean() {
        // Wide spread: the band is the spread.
        assert_eq!(within_reference(0.55, &[0.5, 0.6]), Some((true, 0.5, 0.6)));
        assert!(!within_reference(0.49, &[0.5, 0.6]).unwrap().0);
        // Narrow spread (0.50, 0.502): ±5 % of the mean 0.501.
        let (ok, lo, hi) = within_reference(0.48, &[0.5, 0.502]).unwrap();
        assert!(ok && (lo - 0.47595).abs() < 1e-9 && (hi - 0.52605).abs() < 1e-9);
        assert!(!within_reference(0.47, &[0.5, 0.502]).unwrap().0);
        assert_eq!(within_reference(0.5, &[]), None);
    }

    #[test]
    fn figures_stop_at_the_asked_epochs() {
        // An older Ultralytics record: best.pt's final validation reported as a 4th "epoch".
        let mut o = parse(&[]).unwrap();
        o.epochs = 3;
        let mut eps: Vec<Value> = (1..=3).map(|e| epoch_entry(e, |k| Some(if k == BOX { 0.1 * e as f64 } else { 0.05 }))).collect();
        eps.push(epoch_entry(4, |k| Some(if k == BOX { 0.9 } else { 0.05 })));
        let rec = record(&o, &parse_arm("ultralytics").unwrap(), 0, 10.0, 0, eps, None);
        let f = figures(&rec).unwrap();
        assert_eq!(f.epochs, 3);
        assert!((f.last_box - 0.3).abs() < 1e-12, "{}", f.last_box);
        assert_eq!(f.best_box.1, 3);
    }

    #[test]
    fn an_epoch_that_ran_twice_keeps_its_last_row() {
        let csv = format!("epoch,time,{BOX},{POSE},{BOX50},{POSE50}\n1,5.0,0.1,0.05,0.3,0.1\n2,9.0,0.2,0.1,0.4,0.2\n2,3.0,0.25,0.12,0.4,0.2\n3,6.0,0.3,0.2,0.5,0.3\n");
        let e = epochs_of_csv(&csv);
        assert_eq!(e.len(), 3);
        assert_eq!(e.iter().map(|v| v["epoch"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(e[1]["box"].as_f64(), Some(0.25), "the resumed run's row");
    }

    #[test]
    fn import_appends_a_split_run_from_its_results_csv_and_the_report_names_its_note() {
        let dir = std::env::temp_dir().join(format!("ptl-outcome-import-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Two parts: the resumed part's `time` restarts; the epoch column orders the rows.
        let csv = dir.join("results.csv");
        std::fs::write(
            &csv,
            format!("epoch,time,{BOX},{POSE},{BOX50},{POSE50}\n1,5.0,0.1,0.05,0.3,0.1\n2,9.0,0.2,0.1,0.4,0.2\n3,4.0,0.3,0.2,0.5,0.3\n"),
        )
        .unwrap();
        let args: Vec<String> =
            [&csv.to_string_lossy(), "--arm", "ultralytics", "--seed", "1", "--wall-s", "21", "--note", "resumed at epoch 3"]
                .iter()
                .map(|s| s.to_string())
                .chain(["--epochs".into(), "3".into(), "--out".into(), dir.to_string_lossy().into_owned()])
                .collect();
        import(&args).unwrap();
        let recs = read_runs(&dir.join("runs.jsonl")).unwrap();
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0]["epochs"].as_array().unwrap().len(), 3);
        assert_eq!(recs[0]["epochs"][2]["pose"].as_f64(), Some(0.2));
        assert_eq!(recs[0]["wall_s"].as_f64(), Some(21.0));
        write_report(&recs, &dir.join("report")).unwrap();
        let md = std::fs::read_to_string(dir.join("report/outcome.md")).unwrap();
        assert!(md.contains("- ultralytics seed 1: resumed at epoch 3"), "{md}");
        assert!(import(&args[..3]).unwrap_err().contains("--wall-s"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn report_judges_ptl_against_ultralytics_and_draws_the_curves() {
        let o = parse(&[]).unwrap();
        let ep = |b: f64, p: f64| {
            (1..=3).map(|e| epoch_entry(e, |k| Some(if k == BOX { b * e as f64 / 3.0 } else { p * e as f64 / 3.0 }))).collect::<Vec<_>>()
        };
        let recs = vec![
            record(&o, &parse_arm("ultralytics").unwrap(), 0, 100.0, 0, ep(0.55, 0.30), None),
            record(&o, &parse_arm("ultralytics").unwrap(), 1, 100.0, 0, ep(0.70, 0.34), None),
            record(&o, &parse_arm("native").unwrap(), 0, 50.0, 0, ep(0.62, 0.20), None),
            record(&o, &parse_arm("replay").unwrap(), 0, 40.0, 1, vec![], Some("boom".into())),
        ];
        let dir = std::env::temp_dir().join(format!("ptl-outcome-report-{}", std::process::id()));
        write_report(&recs, &dir).unwrap();
        let md = std::fs::read_to_string(dir.join("outcome.md")).unwrap();
        assert!(md.contains("native seed 0: final box mAP50-95 0.6200 within [0.5500, 0.7000]"), "{md}");
        // The pose spread (0.30, 0.34) is wider than ±5 % of its mean: the band is the spread.
        assert!(md.contains("native seed 0: final pose mAP50-95 0.2000 BELOW [0.3000, 0.3400]"), "{md}");
        assert!(md.contains("- replay seed 0: exit 1: boom"), "{md}");
        assert!(dir.join("outcome.png").exists());
        std::fs::remove_dir_all(&dir).ok();
    }
}

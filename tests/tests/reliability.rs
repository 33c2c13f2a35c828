//! The command line tried as a careless user and a local attacker would (reliability II): every
//! case ends in a result or a typed error naming the thing and the fix — no panic, abort or hang,
//! nothing silently dropped, nothing written where the user did not say. Cases that could hang
//! run the CLI in a child process with a time limit.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{ptl, ptl_bin, summary, synth, text, train, Running};

/// How long a case that must not hang may take.
const NO_HANG: Duration = Duration::from_secs(60);

/// A tiny run's settings into `dir/<name>` (CPU, 2 epochs of 2 batches at 64 px).
fn run_args(data: &Path, dir: &Path, name: &str) -> Vec<String> {
    [
        format!("data={}", data.display()),
        "epochs=2".into(),
        "batch=2".into(),
        "imgsz=64".into(),
        "max_batches=2".into(),
        "optimizer=SGD".into(),
        "plots=false".into(),
        format!("project={}", dir.display()),
        format!("name={name}"),
        "device=cpu".into(),
    ]
    .to_vec()
}

/// Starts `ptl ARGS` in `cwd` with piped output.
fn spawn(args: &[String], cwd: &Path) -> Running {
    let child = Command::new(ptl_bin())
        .args(args)
        .current_dir(cwd)
        .env("PTL_CACHE", cwd.join("cache"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ptl");
    Running(Some(child))
}

/// Waits for the child at most `limit` and returns its output; a child still running then is a
/// hang: killed, and the test fails naming the case.
fn finish(mut r: Running, limit: Duration, case: &str) -> Output {
    let start = Instant::now();
    loop {
        let child = r.0.as_mut().expect("child");
        if child.try_wait().expect("poll ptl").is_some() {
            return r.0.take().expect("child").wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            panic!("{case}: ptl still running after {limit:?} (a hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `ptl ARGS` with a time limit.
fn ptl_limited(args: &[&str], cwd: &Path, case: &str) -> Output {
    finish(spawn(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>(), cwd), NO_HANG, case)
}

#[cfg(unix)]
fn mkfifo(p: &Path) {
    let status = Command::new("mkfifo").arg(p).status().expect("mkfifo");
    assert!(status.success(), "mkfifo {}", p.display());
}

/// Sends `signal` to the child.
#[cfg(unix)]
fn signal(r: &Running, signal: &str) {
    let pid = r.0.as_ref().expect("child").id().to_string();
    assert!(Command::new("kill").args(["-s", signal, &pid]).status().expect("kill").success());
}

fn write(p: &Path, text: &str) -> PathBuf {
    if let Some(d) = p.parent() {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(p, text).unwrap();
    p.to_path_buf()
}

/// A dataset yaml beside the tiny dataset's folders with `extra` lines.
fn dataset_yaml(data: &Path, name: &str, extra: &str) -> PathBuf {
    let root = data.parent().unwrap();
    write(&root.join(name), &format!("path: {}\ntrain: images/train\nval: images/val\n{extra}", root.display()))
}

#[test]
fn device_key_yaml_and_flag_are_one_setting_and_a_missing_gpu_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let mut args = run_args(&data, dir.path(), "r");
    args.retain(|a| a != "device=cpu");
    // No GPU on this machine (or not that one): named, it is an error, never the CPU.
    let o = train(&args, &["device=cuda:7"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("cuda:7 cannot be used") && !text(&o).contains("training on the CPU"), "{}", text(&o));
    let yaml = write(&dir.path().join("gpu7.yaml"), "device: cuda:7\n");
    let o = train(&args, &[yaml.to_str().unwrap()], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("cuda:7 cannot be used"), "{}", text(&o));
    let o = train(&args, &["--device", "cpu", "device=cuda:1"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("`--device cpu` and `device=cuda:1` disagree"), "{}", text(&o));
    // The same device both ways is fine; the key alone trains there.
    let o = train(&args, &["--device", "cpu", "device=CPU"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(summary(&dir.path().join("r"))["device"], "cpu");
    let w = dir.path().join("r/weights/last.ckpt");
    let o = ptl(&["val", &format!("model={}", w.display()), "imgsz=64", "--device", "cpu", "device=cuda:0"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("disagree"), "{}", text(&o));
    // amp=true on the CPU is 32-true (16-mixed on a GPU: tests/tests/cuda_cli.rs); amp=false too.
    for (name, amp) in [("amp_on", "amp=true"), ("amp_off", "amp=False")] {
        let mut a = run_args(&data, dir.path(), name);
        a.push(amp.into());
        let o = train(&a, &[], dir.path());
        assert!(o.status.success(), "{amp}: {}", text(&o));
        assert_eq!(summary(&dir.path().join(name))["precision"], "32-true", "{amp}");
    }
}

#[test]
fn sizes_from_files_and_arguments_are_bounded_before_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let names = "names: {0: person}\n";
    for (case, extra, want) in [
        ("kpt_shape u64::MAX", format!("kpt_shape: [18446744073709551615, 3]\n{names}"), "kpt_shape"),
        ("kpt_shape 1e9", format!("kpt_shape: [1000000000, 3]\n{names}"), "more than 1024"),
        ("nc 4e9 without names", "kpt_shape: [17, 3]\nnc: 4000000000\n".to_string(), "4000000000 classes is more than 1000"),
    ] {
        let y = dataset_yaml(&data, "big.yaml", &extra);
        let mut args = run_args(&data, dir.path(), "big");
        args[0] = format!("data={}", y.display());
        let o = finish(spawn(&[vec!["train".to_string()], args].concat(), dir.path()), NO_HANG, case);
        assert_eq!(o.status.code(), Some(1), "{case}: {}", text(&o));
        assert!(text(&o).contains(want), "{case}: {}", text(&o));
    }
    let out = dir.path().join("s");
    let out = out.to_str().unwrap();
    for (case, args, want) in [
        ("synth --train u64::MAX", vec!["--train", "18446744073709551615"], "--train 18446744073709551615 is more than"),
        ("synth --imgsz 100000", vec!["--imgsz", "100000"], "--imgsz 100000 is outside 64..=4096"),
        ("synth --threads 100000", vec!["--threads", "100000"], "--threads 100000 is more than the"),
    ] {
        let mut all = vec!["data", "synth", "--out", out];
        all.extend(args);
        let o = ptl_limited(&all, dir.path(), case);
        assert_eq!(o.status.code(), Some(1), "{case}: {}", text(&o));
        assert!(text(&o).contains(want), "{case}: {}", text(&o));
    }
    let o = train(&run_args(&data, dir.path(), "w"), &["workers=100000"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("workers 100000 is more than the"), "{}", text(&o));
}

#[cfg(unix)]
#[test]
fn fifos_and_folders_given_as_files_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let o = train(&run_args(&data, dir.path(), "r"), &[], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let fifo = dir.path().join("pipe.ckpt");
    mkfifo(&fifo);
    let f = fifo.display().to_string();
    let folder = dir.path().join("folder.ckpt");
    std::fs::create_dir_all(&folder).unwrap();
    let g = folder.display().to_string();
    let base: Vec<String> = run_args(&data, dir.path(), "x");
    let with = |k: &str, v: &str| -> Vec<String> {
        let mut a = vec!["train".to_string()];
        a.extend(base.iter().filter(|s| !s.starts_with(&format!("{k}="))).cloned());
        a.push(format!("{k}={v}"));
        a
    };
    let fifo_yaml = dir.path().join("pipe.yaml");
    mkfifo(&fifo_yaml);
    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        ("data= FIFO", with("data", &fifo_yaml.display().to_string()), "named pipe (FIFO)"),
        ("model= FIFO", with("model", &f), "named pipe (FIFO)"),
        ("resume= FIFO", vec!["train".into(), format!("resume={f}")], "named pipe (FIFO)"),
        ("model= folder", with("model", &g), "is a folder, not a regular file"),
        ("resume= folder", vec!["train".into(), format!("resume={g}")], "is a folder, not a regular file"),
        ("val FIFO", vec!["val".into(), format!("model={f}"), "imgsz=64".into()], "named pipe (FIFO)"),
        (
            "predict FIFO",
            vec!["predict".into(), "--weights".into(), f.clone(), "--source".into(), data.display().to_string()],
            "named pipe",
        ),
        ("export FIFO", vec!["export".into(), "format=onnx".into(), format!("model={f}"), "imgsz=64".into()], "named pipe (FIFO)"),
        ("export folder", vec!["export".into(), "format=onnx".into(), format!("model={g}"), "imgsz=64".into()], "is a folder"),
        ("yaml config FIFO", vec!["train".into(), fifo_yaml.display().to_string()], "named pipe (FIFO)"),
    ];
    for (case, args, want) in cases {
        let o = finish(spawn(&args, dir.path()), NO_HANG, case);
        assert_eq!(o.status.code(), Some(1), "{case}: {}", text(&o));
        assert!(text(&o).contains(want), "{case}: {}", text(&o));
    }
    // A FIFO among the images and one as a label file: those images are skipped with a message,
    // the rest trains.
    let root = data.parent().unwrap();
    mkfifo(&root.join("images/train/zz_pipe.jpg"));
    let first_label = std::fs::read_dir(root.join("labels/train")).unwrap().flatten().map(|e| e.path()).min().unwrap();
    std::fs::remove_file(&first_label).unwrap();
    mkfifo(&first_label);
    let o = finish(spawn(&with("name", "fifo_items"), dir.path()), NO_HANG, "FIFO image and label");
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).matches("named pipe (FIFO)").count() >= 2, "both named: {}", text(&o));
}

#[test]
fn predictions_of_same_named_sources_do_not_overwrite_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let o = train(&run_args(&data, dir.path(), "r"), &[], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let img = std::fs::read_dir(data.parent().unwrap().join("images/val")).unwrap().flatten().next().unwrap().path();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::copy(&img, src.join("a.jpg")).unwrap();
    let (decoded, _) = ptl_data::image::decode_file(&img).unwrap();
    ptl_data::image::write_png(&decoded, &src.join("a.png")).unwrap();
    let mut sources = vec!["a.jpg".to_string(), "a.png".to_string()];
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        for raw in [&b"a\xff.jpg"[..], &b"a\xfe.jpg"[..]] {
            std::fs::copy(&img, src.join(std::ffi::OsStr::from_bytes(raw))).unwrap();
        }
        sources.extend(["a\u{fffd}.jpg".to_string(), "a\u{fffd}.jpg-2".to_string()]);
    }
    let out = dir.path().join("pred");
    let w = dir.path().join("r/weights/last.ckpt");
    let o = ptl(
        &["predict", "--weights", w.to_str().unwrap(), "--source", src.to_str().unwrap(), "--out", out.to_str().unwrap(), "--imgsz", "64"],
        dir.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("predictions.json")).unwrap()).unwrap();
    let entries = json.as_array().unwrap();
    assert_eq!(entries.len(), sources.len(), "one entry per source");
    let mut drawings: Vec<String> = entries.iter().map(|e| e["drawing"].as_str().unwrap().to_string()).collect();
    drawings.sort();
    drawings.dedup();
    assert_eq!(drawings.len(), sources.len(), "one drawing per source: {drawings:?}");
    for d in &drawings {
        assert!(Path::new(d).is_file(), "{d} was written");
    }
    for name in sources {
        assert!(out.join(format!("{name}.png")).is_file(), "{name}.png");
    }
}

/// Waits until the child holds run folder `dir` (its lock file names it), without touching
/// the lock itself.
fn wait_until_held(r: &Running, dir: &Path) {
    let pid = r.0.as_ref().expect("child").id().to_string();
    let start = Instant::now();
    while std::fs::read_to_string(dir.join(".ptl.lock")).map_or(true, |s| s.trim() != pid) {
        assert!(start.elapsed() < NO_HANG, "ptl never took {}", dir.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn run_folders_are_claimed_once_and_a_held_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    // A long run holds `runs/exp` while others start with the same project and name.
    let runs = dir.path().join("runs");
    let mut long = vec!["train".to_string()];
    long.extend(run_args(&data, &runs, "exp"));
    long.push("epochs=400".into());
    let first = spawn(&long, dir.path());
    wait_until_held(&first, &runs.join("exp"));
    let o = train(&run_args(&data, &runs, "exp"), &[], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(runs.join("exp2/weights/last.ckpt").is_file(), "the second run numbered its own folder: {}", text(&o));
    let o = train(&run_args(&data, &runs, "exp"), &["exist_ok=true"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("is in use by another ptl process"), "{}", text(&o));
    // A resume of the run that is training: in use, nothing written.
    let ck = runs.join("exp/weights/last.ckpt");
    let start = Instant::now();
    while !ck.exists() {
        assert!(start.elapsed() < NO_HANG, "the long run wrote no checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = ptl(&["train", &format!("resume={}", ck.display()), "--device", "cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("in use by another ptl process"), "{}", text(&o));
    drop(first);
}

#[test]
fn a_checkpoint_never_chooses_where_ptl_writes() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let o = train(&run_args(&data, dir.path(), "orig"), &[], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    // The checkpoint moved elsewhere still names `orig` as its folder inside.
    let loose = dir.path().join("downloads/model.ckpt");
    std::fs::create_dir_all(loose.parent().unwrap()).unwrap();
    std::fs::copy(dir.path().join("orig/weights/last.ckpt"), &loose).unwrap();
    for f in ["results.csv", "summary.json"] {
        std::fs::remove_file(dir.path().join("orig").join(f)).unwrap();
    }
    let o = ptl(&["train", &format!("resume={}", loose.display()), "--device", "cpu"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    for f in ["results.csv", "summary.json"] {
        assert!(!dir.path().join("orig").join(f).exists(), "{f} written into the folder the checkpoint names: {}", text(&o));
    }
    assert!(dir.path().join("runs/pose/train/results.csv").is_file(), "a new run folder of the default project: {}", text(&o));
    // Where the user says: project= and name=.
    let o = ptl(
        &[
            "train",
            &format!("resume={}", loose.display()),
            "--device",
            "cpu",
            &format!("project={}", dir.path().join("mine").display()),
            "name=here",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(dir.path().join("mine/here/summary.json").is_file(), "{}", text(&o));
    // An empty save_dir names the fix.
    let o = train(&run_args(&data, dir.path(), "e"), &["save_dir="], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("save_dir is empty"), "{}", text(&o));
}

#[cfg(unix)]
#[test]
fn the_default_cache_is_private_and_a_shared_one_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let uid = std::process::Command::new("id").arg("-u").output().unwrap();
    let uid = String::from_utf8_lossy(&uid.stdout).trim().to_string();
    let cache = tmp.join(format!("ptl-cache-{uid}"));
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    let run = |cwd: &Path| {
        Command::new(ptl_bin())
            .args(["train", "epochs=1", "max_batches=1", "plots=false", "val=false", "--device", "cpu"])
            .current_dir(cwd)
            .env_remove("PTL_CACHE")
            .env_remove("HOME")
            .env_remove("XDG_CACHE_HOME")
            .env("TMPDIR", &tmp)
            .output()
            .unwrap()
    };
    let o = run(dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("others can write into it"), "{}", text(&o));
    assert!(!cache.join("synth-pose-128-s347").exists(), "nothing generated in a shared folder");
    std::fs::remove_dir(&cache).unwrap();
    let o = run(dir.path());
    assert!(o.status.success(), "{}", text(&o));
    for d in [cache.clone(), cache.join("synth-pose-128-s347")] {
        assert_eq!(std::fs::metadata(&d).unwrap().permissions().mode() & 0o777, 0o700, "{}", d.display());
    }
}

#[test]
fn unclear_inputs_get_messages_that_name_the_file_or_key_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let o = train(&run_args(&data, dir.path(), "r"), &[], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let w = dir.path().join("r/weights/last.ckpt");
    let w = w.to_str().unwrap();
    // A dataset yaml with a UTF-8 byte-order mark reads as without one.
    let plain = std::fs::read_to_string(&data).unwrap();
    let bom = write(&data.with_file_name("bom.yaml"), &format!("\u{feff}{plain}"));
    let mut args = run_args(&data, dir.path(), "bom");
    args[0] = format!("data={}", bom.display());
    let o = train(&args, &["epochs=1"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    // A manifest that is not JSON (NaN) says so. (Tensor offsets count from the header's end,
    // so the header may change length.)
    let bytes = std::fs::read(w).unwrap();
    let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + hlen]).unwrap();
    let manifest = header["__metadata__"]["ptl.manifest"].as_str().unwrap().to_string();
    let i = manifest.find("\"format\":").expect("format in the manifest");
    let j = i + manifest[i..].find(',').unwrap();
    header["__metadata__"]["ptl.manifest"] = format!("{}\"format\":NaN{}", &manifest[..i], &manifest[j..]).into();
    let header = serde_json::to_vec(&header).unwrap();
    let mut nan = (header.len() as u64).to_le_bytes().to_vec();
    nan.extend_from_slice(&header);
    nan.extend_from_slice(&bytes[8 + hlen..]);
    let nan_ckpt = dir.path().join("nan.ckpt");
    std::fs::write(&nan_ckpt, nan).unwrap();
    let o = ptl(&["train", &format!("resume={}", nan_ckpt.display()), "--device", "cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("the manifest is not valid JSON") && text(&o).contains("nan.ckpt"), "{}", text(&o));
    // A pickled .pt given to val/predict: ptl reads no pickles, and how to convert.
    let pt = write(&dir.path().join("yolo.pt"), "PK\u{3}\u{4}zip of pickles");
    let renamed = dir.path().join("yolo.safetensors");
    std::fs::copy(&pt, &renamed).unwrap();
    for weights in [pt.display().to_string(), renamed.display().to_string()] {
        let o = ptl(&["val", &format!("model={weights}"), "imgsz=64", "--device", "cpu"], dir.path());
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains("pickled PyTorch") && text(&o).contains("ultralytics_pt_to_safetensors.py"), "{}", text(&o));
        let src = data.parent().unwrap().join("images/val");
        let o = ptl(&["predict", "--weights", &weights, "--source", src.to_str().unwrap()], dir.path());
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains("pickled PyTorch"), "{}", text(&o));
    }
    // Sizes val and predict cannot use.
    let src = data.parent().unwrap().join("images/val");
    for imgsz in ["33", "0"] {
        let o = ptl(&["predict", "--weights", w, "--source", src.to_str().unwrap(), "--imgsz", imgsz], dir.path());
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains(&format!("imgsz {imgsz} must be a multiple of 32")), "{}", text(&o));
        let o = ptl(&["val", &format!("model={w}"), &format!("imgsz={imgsz}"), "--device", "cpu"], dir.path());
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains("must be a multiple of 32"), "{}", text(&o));
    }
    let o = ptl(&["val", &format!("model={w}"), "imgsz=64", "batch=0", "--device", "cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("batch 0 must be in 1..="), "{}", text(&o));
}

#[test]
fn settings_that_would_be_ignored_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let o = train(&run_args(&data, dir.path(), "x"), &[r#"replay_config={"stem":{"bogus":1}}"#, "replay=stem"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("unknown setting `bogus`"), "{}", text(&o));
    let o = train(&run_args(&data, dir.path(), "x"), &["max_batches=0"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("max_batches 0 would train nothing"), "{}", text(&o));
    for bad in ["[.nan, 1, 1, 1, 1]", "[.inf, 1, 1, 1, 1]"] {
        let y = dataset_yaml(&data, "sig.yaml", &format!("kpt_shape: [5, 3]\nnames: [person]\nkpt_oks_sigmas: {bad}\n"));
        let mut args = run_args(&data, dir.path(), "x");
        args[0] = format!("data={}", y.display());
        let o = train(&args, &[], dir.path());
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains("kpt_oks_sigmas") && text(&o).contains("positive finite"), "{}", text(&o));
    }
    // A state dict with a tensor the model does not have: val refuses it, as train and export do.
    let o = train(&run_args(&data, dir.path(), "r"), &[], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let ck = ptl_trainer::fit::load_checkpoint(&dir.path().join("r/weights/last.ckpt"), ptl_autograd::Device::Cpu).unwrap();
    let mut ema: Vec<(String, ptl_autograd::Tensor)> = ck.part("ema").into_iter().collect();
    ema.push((
        "model.99.extra.weight".into(),
        ptl_autograd::Tensor::zeros(vec![2], ptl_autograd::DType::F32, ptl_autograd::Device::Cpu).unwrap(),
    ));
    let st = dir.path().join("extra.safetensors");
    ptl_autograd::module::save_safetensors(&st, &ema).unwrap();
    let o =
        ptl(&["val", &format!("model={}", st.display()), &format!("data={}", data.display()), "imgsz=64", "--device", "cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("model.99.extra.weight"), "{}", text(&o));
}

#[cfg(unix)]
#[test]
fn sigint_and_sigterm_checkpoint_the_step_and_resume_to_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    // 8 images, batch 1, 3 epochs: an epoch is 8 optimizer steps (nbs = batch).
    let args = |name: &str| -> Vec<String> {
        let mut a = run_args(&data, dir.path(), name);
        a.retain(|s| !s.starts_with("epochs=") && !s.starts_with("batch=") && !s.starts_with("max_batches="));
        a.extend(["epochs=3".into(), "batch=1".into(), "nbs=1".into(), "val=false".into()]);
        a
    };
    let o = train(&args("whole"), &[], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let whole = summary(&dir.path().join("whole"))["hashes"].clone();
    for (sig, code, name) in [("INT", 130, "int"), ("TERM", 143, "term")] {
        let mut a = vec!["train".to_string()];
        a.extend(args(name));
        let mut r = spawn(&a, dir.path());
        // Once the run holds its folder the handlers are in place: signal it during epoch 1.
        let folder = dir.path().join(name);
        wait_until_held(&r, &folder);
        signal(&r, sig);
        let o = finish(Running(r.0.take()), NO_HANG, name);
        assert_eq!(o.status.code(), Some(code), "SIG{sig}: {}", text(&o));
        let ck = folder.join("weights/last.ckpt");
        assert!(text(&o).contains(&format!("resume with `ptl train resume={}`", ck.display())), "{}", text(&o));
        let m = ptl_trainer::fit::read_manifest(&ck).unwrap();
        let partial = m.loop_state.partial_epoch.clone().expect("a place inside the epoch");
        assert_eq!((m.loop_state.epoch, partial.epoch), (-1, 0), "stopped in the first epoch");
        assert!(partial.next_batch >= 1 && partial.next_batch < 8, "{partial:?}");
        let o = ptl(&["train", &format!("resume={}", ck.display()), "--device", "cpu"], dir.path());
        assert!(o.status.success(), "{}", text(&o));
        assert_eq!(summary(&folder)["hashes"], whole, "SIG{sig} at batch {} then resume = uninterrupted", partial.next_batch);
    }
}

//! The `ptl` command line on bad input (reliability issue): typed errors and non-zero exits,
//! never an abort; resume with the checkpoint's own settings; COCO JSON as `data=`; the per-epoch
//! table when the output is not a terminal.

mod common;

use std::path::Path;
use std::process::Output;

use common::{ptl, synth, text};

/// Trains into `run` as Ultralytics' `project=<its folder> name=<its name>`.
fn train_args(data: &Path, run: &Path) -> Vec<String> {
    let (project, name) = (run.parent().expect("run folder"), run.file_name().expect("run name").to_string_lossy());
    [
        format!("data={}", data.display()),
        "epochs=2".into(),
        "batch=2".into(),
        "imgsz=64".into(),
        "max_batches=2".into(),
        "optimizer=SGD".into(),
        "plots=false".into(),
        format!("project={}", project.display()),
        format!("name={name}"),
        "--device".into(),
        "cpu".into(),
    ]
    .to_vec()
}

fn run_train(args: &[String], cwd: &Path) -> Output {
    let mut all = vec!["train"];
    all.extend(args.iter().map(String::as_str));
    ptl(&all, cwd)
}

#[test]
fn resume_alone_continues_the_checkpoints_run_and_refuses_changed_settings() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let project = dir.path().join("run");
    let o = run_train(&train_args(&data, &project), dir.path());
    assert!(o.status.success(), "{}", text(&o));
    // Output that is not a terminal still gets Ultralytics' per-epoch table: a training row under
    // its header and the validation row under its own, every epoch.
    let out = text(&o);
    let lines: Vec<&str> = out.lines().collect();
    for e in ["1/2", "2/2"] {
        let at =
            lines.iter().position(|l| l.trim_start().starts_with(&format!("{e} "))).unwrap_or_else(|| panic!("no `{e}` row: {}", text(&o)));
        assert!(lines[at - 1].trim_start().starts_with("Epoch") && lines[at - 1].contains("box_loss"), "{}", lines[at - 1]);
        assert!(lines[at + 1].trim_start().starts_with("Class") && lines[at + 1].contains("Pose(P"), "{}", lines[at + 1]);
        assert!(lines[at + 2].trim_start().starts_with("all "), "{}", lines[at + 2]);
        assert_eq!(lines[at].split_whitespace().count(), 11, "epoch, GPU_mem, 6 losses, instances, size, time: {}", lines[at]);
        assert_eq!(lines[at + 2].split_whitespace().count(), 11, "all, images, instances, 8 metrics: {}", lines[at + 2]);
    }
    let ckpt = project.join("weights/last.ckpt");
    // A changed training setting: exit 1, both values named, nothing trained.
    let o = ptl(&["train", &format!("resume={}", ckpt.display()), "batch=4", "--device", "cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("`batch` is 4 here but the run was trained with 2"), "{}", text(&o));
    // resume= alone: the run's own dataset (not the embedded default), into the run's folder.
    let o = ptl(&["train", &format!("resume={}", ckpt.display()), "--device", "cpu"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("embedded default"), "{}", text(&o));
    assert!(text(&o).contains(&data.display().to_string()), "trains on the checkpoint's dataset: {}", text(&o));
    assert!(text(&o).contains("nothing to resume"), "the run had finished: {}", text(&o));
}

#[test]
fn absurd_sizes_and_unknown_keys_exit_with_a_message_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let mut args = train_args(&data, &dir.path().join("big"));
    args.push("imgsz=100000".into());
    let o = run_train(&args, dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("imgsz 100000"), "{}", text(&o));
    let o = ptl(&["train", "bogus_key=1"], dir.path());
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("ptl cfg"), "points to the key list: {}", text(&o));
    let o = ptl(&["cfg"], dir.path());
    assert!(o.status.success() && text(&o).contains("imgsz") && text(&o).contains("exist_ok"), "{}", text(&o));
    // export: an unknown format lists the known ones; a size the model cannot take names the rule.
    let o = ptl(&["export", "format=tflite", "model=n"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("unknown export format `tflite`: ptl exports onnx"), "{}", text(&o));
    let o = ptl(&["export", "format=onnx", "model=n", "imgsz=100"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("imgsz 100×100") && text(&o).contains("multiple of 32"), "{}", text(&o));
    // An Ultralytics export key ptl's export does not have is refused by name and reason; a typo
    // of one of its own is answered with the closest key.
    let o = ptl(&["export", "format=onnx", "model=n", "imgsz=64", "optimize=True"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("`optimize=True` is an Ultralytics setting ptl does not take"), "{}", text(&o));
    // An opset outside what ptl writes names the range.
    let o = ptl(&["export", "format=onnx", "model=n", "imgsz=64", "opset=12"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("opset=12: ptl writes opsets 13 to 21"), "{}", text(&o));
    let o = ptl(&["export", "format=onnx", "model=n", "imgsx=64"], dir.path());
    assert!(o.status.code() == Some(1) && text(&o).contains("unknown key `imgsx` for ptl export (did you mean `imgsz`?"), "{}", text(&o));
}

#[test]
fn predict_and_val_refuse_what_they_cannot_use() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let project = dir.path().join("run");
    let mut args = train_args(&data, &project);
    args[1] = "epochs=1".into();
    let o = run_train(&args, dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let w = project.join("weights/last.ckpt");
    let w = w.to_str().unwrap();
    // Nothing decodes: exit 1.
    let junk = dir.path().join("junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("a.jpg"), b"not a jpeg").unwrap();
    std::fs::write(junk.join("b.png"), b"not a png").unwrap();
    let o = ptl(
        &["predict", "--weights", w, "--source", junk.to_str().unwrap(), "--out", dir.path().join("pred").to_str().unwrap()],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("none of the 2 image files"), "{}", text(&o));
    // A good image next to the junk: predicted, exit 0; the wording names predicting, not training.
    let img = std::fs::read_dir(data.parent().unwrap().join("images/val")).unwrap().flatten().next().unwrap().path();
    std::fs::copy(&img, junk.join("good.jpg")).unwrap();
    let o = ptl(
        &["predict", "--weights", w, "--source", junk.to_str().unwrap(), "--out", dir.path().join("pred").to_str().unwrap()],
        dir.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("training on"), "{}", text(&o));
    // The drawn prediction is a PNG of the source image's size.
    let (src, _) = ptl_data::image::decode_file(&img).unwrap();
    let (drawn, _) = ptl_data::image::decode_file(&dir.path().join("pred/good.jpg.png")).unwrap();
    assert_eq!((drawn.w, drawn.h), (src.w, src.h));
    // `export` of the checkpoint: its EMA weights, written next to it by default.
    let o = ptl(&["export", "format=onnx", &format!("model={w}"), "imgsz=64"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let onnx = project.join("weights/last.onnx");
    assert!(text(&o).contains(&onnx.display().to_string()) && onnx.is_file(), "{}", text(&o));
    // `val` on the run's own dataset: works, and its device line speaks of validating.
    let o = ptl(&["val", "--weights", w, "--imgsz", "64", "--device", "auto"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("validating on") && !text(&o).contains("training on"), "{}", text(&o));
    assert!(!dir.path().join("runs/pose/val/BoxPR_curve.png").exists(), "no plots unless asked");
    // plots=true: the box and pose PR curves beside the metrics.
    let vdir = dir.path().join("val-plots");
    let o =
        ptl(&["val", "--weights", w, "--imgsz", "64", "--device", "cpu", "plots=true", &format!("project={}", vdir.display())], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    for f in ["BoxPR_curve.png", "PosePR_curve.png"] {
        let (pr, _) = ptl_data::image::decode_file(&vdir.join(f)).unwrap();
        assert_eq!((pr.w, pr.h), (900, 600), "{f}");
    }
    // A 5-keypoint dataset for a 17-keypoint model: a clear error.
    let ds5 = dir.path().join("ds5");
    for d in ["images/val", "labels/val"] {
        std::fs::create_dir_all(ds5.join(d)).unwrap();
    }
    std::fs::copy(&img, ds5.join("images/val/a.jpg")).unwrap();
    std::fs::write(ds5.join("labels/val/a.txt"), "0 0.5 0.5 0.2 0.2 0.5 0.5 2 0.5 0.5 2 0.5 0.5 2 0.5 0.5 2 0.5 0.5 2\n").unwrap();
    std::fs::write(ds5.join("d.yaml"), format!("path: {}\nval: images/val\nkpt_shape: [5, 3]\nnames: [person]\n", ds5.display())).unwrap();
    let o = ptl(&["val", "--weights", w, "--data", ds5.join("d.yaml").to_str().unwrap(), "--imgsz", "64", "--device", "cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("predicts 17 keypoints") && text(&o).contains("has 5"), "{}", text(&o));
}

#[test]
fn a_coco_json_trains_as_data() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let root = data.parent().unwrap();
    // Write the synthetic train labels as COCO keypoints JSON next to an images/train2017 folder.
    let coco = dir.path().join("coco");
    std::fs::create_dir_all(coco.join("annotations")).unwrap();
    std::fs::create_dir_all(coco.join("images/train2017")).unwrap();
    let mut images = Vec::new();
    let mut anns = Vec::new();
    for (i, e) in std::fs::read_dir(root.join("images/train")).unwrap().flatten().enumerate() {
        let p = e.path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        std::fs::copy(&p, coco.join("images/train2017").join(&name)).unwrap();
        let (w, h) = (64.0, 64.0);
        images.push(format!(r#"{{"id": {i}, "file_name": "{name}", "width": {w}, "height": {h}}}"#));
        let label = root.join("labels/train").join(p.with_extension("txt").file_name().unwrap());
        for line in std::fs::read_to_string(label).unwrap_or_default().lines() {
            let v: Vec<f64> = line.split_whitespace().map(|t| t.parse().unwrap()).collect();
            let (bw, bh) = (v[3] * w, v[4] * h);
            let kps: Vec<String> = v[5..].chunks(3).map(|k| format!("{}, {}, {}", k[0] * w, k[1] * h, k[2])).collect();
            anns.push(format!(
                r#"{{"image_id": {i}, "category_id": 1, "iscrowd": 0, "bbox": [{}, {}, {bw}, {bh}], "keypoints": [{}]}}"#,
                v[1] * w - bw / 2.0,
                v[2] * h - bh / 2.0,
                kps.join(", ")
            ));
        }
    }
    let json = coco.join("annotations/person_keypoints_train2017.json");
    std::fs::write(&json, format!(r#"{{"images": [{}], "annotations": [{}]}}"#, images.join(","), anns.join(","))).unwrap();
    let mut args = train_args(&json, &dir.path().join("cocorun"));
    args[1] = "epochs=1".into();
    let o = run_train(&args, dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("annotations") && text(&o).contains("used"), "{}", text(&o));
}

#[test]
fn save_json_writes_coco_files_in_train_and_val() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let project = dir.path().join("run");
    let mut args = train_args(&data, &project);
    args[1] = "epochs=1".into();
    args.push("save_json=true".into());
    let o = run_train(&args, dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let (train_pred, train_gt) = (project.join("predictions.json"), project.join("val_gt.json"));
    assert!(text(&o).contains(&train_pred.display().to_string()), "names the file: {}", text(&o));
    // `ptl val` in Ultralytics' key=value form, on the run's last checkpoint.
    let w = project.join("weights/last.ckpt");
    let val_dir = dir.path().join("val");
    let kv = |k: &str, v: &Path| format!("{k}={}", v.display());
    let (model, data_kv, proj) = (kv("model", &w), kv("data", &data), kv("project", &val_dir));
    let o = ptl(&["val", &model, &data_kv, "imgsz=64", "device=cpu", "save_json=true", &proj], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let (val_pred, val_gt) = (val_dir.join("predictions.json"), val_dir.join("val_gt.json"));
    assert!(text(&o).contains(&val_pred.display().to_string()) && text(&o).contains(&val_gt.display().to_string()), "{}", text(&o));
    // Same split ⇒ the same ground truth file; predictions are COCO results of those images.
    assert_eq!(std::fs::read(&train_gt).unwrap(), std::fs::read(&val_gt).unwrap());
    let gt: serde_json::Value = serde_json::from_slice(&std::fs::read(&val_gt).unwrap()).unwrap();
    let ids: Vec<i64> = gt["images"].as_array().unwrap().iter().map(|i| i["id"].as_i64().unwrap()).collect();
    let res: serde_json::Value = serde_json::from_slice(&std::fs::read(&val_pred).unwrap()).unwrap();
    let res = res.as_array().unwrap();
    assert!(!res.is_empty());
    for r in res {
        assert!(ids.contains(&r["image_id"].as_i64().unwrap()), "{r}");
        assert_eq!((r["bbox"].as_array().unwrap().len(), r["keypoints"].as_array().unwrap().len()), (4, 51), "{r}");
    }
    // The same weights as a safetensors state dict (what `model=` takes for fine-tuning): it
    // validates too, with data= given (the file holds no settings) and the checkpoint's metrics.
    let ck = ptl_trainer::fit::load_checkpoint(&w, ptl_autograd::Device::Cpu).unwrap();
    let st = dir.path().join("ema.safetensors");
    let named: Vec<(String, ptl_autograd::Tensor)> = ck.part("ema").into_iter().collect();
    ptl_autograd::module::save_safetensors(&st, &named).unwrap();
    let st_kv = kv("model", &st);
    let o_st = ptl(&["val", &st_kv, &data_kv, "imgsz=64", "device=cpu"], dir.path());
    assert!(o_st.status.success(), "{}", text(&o_st));
    let o_ck = ptl(&["val", &model, &data_kv, "imgsz=64", "device=cpu"], dir.path());
    let metrics = |o: &Output| text(o).lines().filter(|l| l.trim_start().starts_with("metrics/")).map(str::to_string).collect::<Vec<_>>();
    assert!(!metrics(&o_ck).is_empty(), "{}", text(&o_ck));
    assert_eq!(metrics(&o_st), metrics(&o_ck), "the same weights, the same metrics");
    let o = ptl(&["val", &st_kv, "imgsz=64", "device=cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("names no dataset") && text(&o).contains("data="), "{}", text(&o));
    // An unknown key, and a folder that cannot be made (a file on the way): exit 1 naming them.
    let o = ptl(&["val", &model, "save_jsn=true"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("unknown key `save_jsn`"), "{}", text(&o));
    assert!(text(&o).contains("did you mean `save_json`?"), "{}", text(&o));
    let blocked = dir.path().join("a_file");
    std::fs::write(&blocked, b"x").unwrap();
    let proj = kv("project", &blocked.join("val"));
    let o = ptl(&["val", &model, &data_kv, "imgsz=64", "device=cpu", "save_json=true", &proj], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains(&blocked.join("val").display().to_string()), "{}", text(&o));
}

/// Ultralytics' spellings: `device=0,1` on a machine without those GPUs is a clear error (before
/// any worker starts),
/// `imgsz=100` is rounded up to a multiple of the stride with a warning, `verbose=false` quiets the
/// per-epoch lines, `resume=True` continues the newest run of the project.
#[test]
fn ultralytics_spellings_of_device_imgsz_verbose_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let o = run_train(&[format!("data={}", data.display()), "device=0,1".into()], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("several GPUs"), "{}", text(&o));
    let project = dir.path().join("runs");
    let o = run_train(&[train_args(&data, &project.join("a")), vec!["imgsz=100".into(), "verbose=false".into()]].concat(), dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("imgsz=100 must be a multiple of the max stride 32, updating to 128"), "{}", text(&o));
    assert!(text(&o).contains("imgsz 128"), "trains at 128: {}", text(&o));
    assert!(!text(&o).lines().any(|l| l.trim_start().starts_with("1/2 ")), "verbose=false prints no epoch row: {}", text(&o));
    let o = ptl(&["train", "resume=True", &format!("project={}", project.display()), "--device", "cpu"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(&project.join("a").join("weights").join("last.ckpt").display().to_string()), "{}", text(&o));
    assert!(text(&o).contains("nothing to resume"), "the newest run had finished: {}", text(&o));
    let empty = dir.path().join("none");
    let o = ptl(&["train", "resume=True", &format!("project={}", empty.display()), "--device", "cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("resume=path/to/last.ckpt"), "{}", text(&o));
}

/// The folder a run names is the one it writes to (a second run of one name says where it went),
/// and a start that fails on its settings or data creates no run folder.
#[test]
fn the_printed_run_folder_is_the_one_used_and_a_failed_start_leaves_none() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let project = dir.path().join("runs");
    for (n, folder) in [(1, "ft"), (2, "ft2")] {
        let o = run_train(&train_args(&data, &project.join("ft")), dir.path());
        assert!(o.status.success(), "run {n}: {}", text(&o));
        let used = project.join(folder);
        assert!(text(&o).contains(&format!("writing to {}", used.display())), "run {n}: {}", text(&o));
        assert!(used.join("weights/last.ckpt").is_file(), "run {n} wrote {}", used.display());
    }
    let o = run_train(&train_args(&dir.path().join("missing.yaml"), &project.join("x")), dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(!project.join("x").exists(), "a failed start created its run folder: {}", text(&o));
}

/// `ptl val` and `ptl predict` run at the size the checkpoint was trained at unless told otherwise
/// (a 64 px model validated at 640 gives silently worse figures).
#[test]
fn val_and_predict_take_the_image_size_from_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let run = dir.path().join("runs").join("s64");
    let o = run_train(&train_args(&data, &run), dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let ckpt = run.join("weights/last.ckpt").display().to_string();
    let o = ptl(&["val", &format!("model={ckpt}"), "device=cpu"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("at imgsz 64"), "{}", text(&o));
    let o = ptl(&["val", &format!("model={ckpt}"), "device=cpu", "imgsz=96"], dir.path());
    assert!(o.status.success() && text(&o).contains("at imgsz 96"), "{}", text(&o));
    // Ultralytics' val keys: thresholds and the split.
    let o = ptl(&["val", &format!("model={ckpt}"), "device=cpu", "iou=0.5", "max_det=100", "split=val"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let o = ptl(&["val", &format!("model={ckpt}"), "device=cpu", "split=holdout"], dir.path());
    assert!(o.status.code() == Some(1) && text(&o).contains("split=holdout"), "{}", text(&o));
    let images = data.parent().unwrap().join("images").join("val");
    let out = dir.path().join("pred").display().to_string();
    let o = ptl(&["predict", "--weights", &ckpt, "--source", &images.display().to_string(), "--out", &out, "--device", "cpu"], dir.path());
    assert!(o.status.success() && text(&o).contains("predicting at imgsz 64"), "{}", text(&o));
    predict_takes_ultralytics_keys(dir.path(), &run.join("weights/best.ckpt"), &images);
}

/// `ptl predict key=value` as Ultralytics' (with the lean best.ckpt): a glob source, thresholds,
/// and save_txt/save_conf label files — one per image with persons, one line per person of
/// class, normalised box and 17 keypoints (and the confidence); videos, URLs, another class and
/// unknown keys are refused by name.
fn predict_takes_ultralytics_keys(cwd: &std::path::Path, best: &std::path::Path, images: &std::path::Path) {
    let out = cwd.join("pred-keys");
    let glob = images.join("*.jpg").display().to_string();
    let model = format!("model={}", best.display());
    let args = [model.as_str(), &format!("source={glob}"), "conf=0.0", "max_det=2", "save_txt=True", "save_conf=True", "device=cpu"];
    let o = ptl(&[&["predict"][..], &args[..], &[&format!("project={}", out.display())]].concat(), cwd);
    assert!(o.status.success(), "{}", text(&o));
    let sources: Vec<_> =
        std::fs::read_dir(images).unwrap().filter_map(|e| e.ok()).filter(|e| e.path().extension().is_some_and(|x| x == "jpg")).collect();
    assert!(!sources.is_empty());
    let labels: Vec<_> = std::fs::read_dir(out.join("labels")).expect("labels/").filter_map(|e| e.ok().map(|e| e.path())).collect();
    assert_eq!(labels.len(), sources.len(), "conf=0 finds persons in every image: one label file each");
    for l in &labels {
        let lines = std::fs::read_to_string(l).unwrap();
        assert!((1..=2).contains(&lines.lines().count()), "max_det=2: {l:?}");
        for line in lines.lines() {
            let v: Vec<f64> = line.split(' ').map(|x| x.parse().unwrap_or_else(|_| panic!("{line}"))).collect();
            assert_eq!(v.len(), 1 + 4 + 17 * 3 + 1, "{line}");
            assert_eq!(v[0], 0.0, "class 0");
            assert!(v[1..5].iter().all(|x| x.is_finite()) && v[3] >= 0.0 && v[4] >= 0.0, "{line}");
        }
    }
    for (bad, says) in [
        ("source=clip.mp4", "videos are not supported"),
        ("source=http://example.invalid/a.jpg", "not URLs"),
        ("classes=x", "expected class ids"),
        ("max_dets=3", "did you mean `max_det`"),
    ] {
        let o = ptl(&["predict", model.as_str(), bad, "device=cpu"], cwd);
        assert_eq!(o.status.code(), Some(1), "{bad}: {}", text(&o));
        assert!(text(&o).contains(says), "{bad}: {}", text(&o));
    }
}

/// A run writes `args.yaml` with every resolved setting, and `ptl train args.yaml` trains with
/// them again (its own args.yaml then differs only where the command line said).
#[test]
fn args_yaml_holds_every_setting_and_trains_again() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let run = dir.path().join("runs").join("a");
    let o = run_train(&[train_args(&data, &run), vec!["lr0=0.0123".into(), "freeze=[3]".into()]].concat(), dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let first = std::fs::read_to_string(run.join("args.yaml")).expect("args.yaml");
    for line in ["epochs: 2", "batch: 2", "imgsz: 64", "lr0: 0.0123", "freeze: \"[3]\"", "optimizer: SGD", "device: cpu"] {
        assert!(first.lines().any(|l| l == line), "no `{line}` in\n{first}");
    }
    let args_path = run.join("args.yaml").display().to_string();
    let o = ptl(&["train", &args_path, "epochs=1", "exist_ok=false"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let second = std::fs::read_to_string(dir.path().join("runs").join("a2").join("args.yaml")).expect("the second run's args.yaml");
    let differ: Vec<(&str, &str)> = first.lines().zip(second.lines()).filter(|(a, b)| a != b).collect();
    let keys: Vec<&str> = differ.iter().map(|(a, _)| a.split(':').next().unwrap_or("")).collect();
    assert_eq!(keys, ["epochs", "save_dir"], "{differ:?}");
}

/// The `replay_config` example `ptl cfg` prints is a setting the replay plugins take (an unknown
/// plugin setting is refused, so an example that drifted would fail here).
#[test]
fn the_replay_config_example_of_ptl_cfg_trains() {
    let dir = tempfile::tempdir().unwrap();
    let o = ptl(&["cfg"], dir.path());
    let line =
        text(&o).lines().find(|l| l.trim_start().starts_with("replay_config")).map(str::to_string).expect("replay_config in ptl cfg");
    let example = line.split("e.g. ").nth(1).expect("an example").trim().to_string();
    let data = synth(dir.path());
    let args =
        [train_args(&data, &dir.path().join("runs").join("r")), vec!["replay=stem".into(), format!("replay_config={example}")]].concat();
    let o = run_train(&args, dir.path());
    assert!(o.status.success(), "replay_config={example}: {}", text(&o));
}

/// A process started by a launcher (`RANK`, `WORLD_SIZE`, … set, as ptl's `device=0,1`, torchrun
/// and SLURM set them) joins its group instead of training alone: on the CPU it is refused with
/// the reason (ranks train on CUDA GPUs through NCCL), a half-set environment names the missing
/// variable, and neither writes a run folder.
#[test]
fn a_launched_worker_joins_its_group_or_says_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let run = dir.path().join("runs").join("worker");
    let mut args = vec!["train".to_string()];
    args.extend(train_args(&data, &run));
    let with_env = |vars: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(common::ptl_bin());
        cmd.args(&args).current_dir(dir.path()).env("PTL_CACHE", dir.path().join("cache"));
        for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PTL_STORE_ADDR", "TORCHELASTIC_RUN_ID"] {
            cmd.env_remove(var);
        }
        cmd.envs(vars.iter().copied()).output().expect("run ptl-ext")
    };
    let o = with_env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("rank 0 of 1") && text(&o).contains("through NCCL"), "{}", text(&o));
    let o = with_env(&[("RANK", "1"), ("WORLD_SIZE", "2")]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("MASTER_ADDR is not set"), "{}", text(&o));
    assert!(!run.exists(), "no run folder");
}

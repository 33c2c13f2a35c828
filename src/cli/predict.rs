//! `ptl val` and `ptl predict`: load a checkpoint's EMA weights and evaluate or draw predictions.

use std::path::{Path, PathBuf};

use clap::Args;
use ptl_autograd::Device;
use ptl_heads::PoseModel;
use ptl_trainer::pose::predict::{predict_image_with, yolo_label_line};
use ptl_trainer::pose::{draw, MAX_BATCH, MAX_IMGSZ};

#[derive(Args, Debug)]
pub struct ValArgs {
    /// `key=value` settings, Ultralytics style (they override the flags): model= (alias weights=),
    /// data=, imgsz=, batch=, conf=, iou=, max_det=, split=val|test|train, device=,
    /// save_json=true|false, plots=true|false, project= (alias save_dir=).
    pub settings: Vec<String>,
    /// A ptl checkpoint (`weights/best.ckpt`, `last_weights.ckpt` or `last.ckpt`) or a safetensors state dict.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Dataset yaml (defaults to the one the checkpoint was trained on).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Image size (defaults to the one the checkpoint was trained at, else 640).
    #[arg(long)]
    pub imgsz: Option<usize>,
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// auto (GPU when present), cpu or cuda:N (the same as `device=`).
    #[arg(long)]
    pub device: Option<String>,
    /// NMS confidence threshold.
    #[arg(long, default_value_t = 0.001)]
    pub conf: f32,
    /// Write predictions.json (COCO results) and val_gt.json (COCO ground truth) into --project.
    #[arg(long)]
    pub save_json: bool,
    /// Output folder of save_json and plots.
    #[arg(long, default_value = "runs/pose/val")]
    pub project: PathBuf,
    /// Draw BoxPR_curve.png and PosePR_curve.png into --project.
    #[arg(long)]
    pub plots: bool,
    /// NMS IoU threshold.
    #[arg(long, default_value_t = 0.7)]
    pub iou: f64,
    /// Detections kept per image.
    #[arg(long, default_value_t = 300)]
    pub max_det: usize,
    /// The dataset split to validate: val, test or train.
    #[arg(long, default_value = "val")]
    pub split: String,
}

impl ValArgs {
    /// Applies the `key=value` settings over the flags.
    pub(crate) fn apply_settings(&mut self) -> Result<(), String> {
        for s in self.settings.clone() {
            let (k, v) = s.split_once('=').ok_or_else(|| format!("`{s}` is not key=value (ptl val takes {VAL_KEYS})"))?;
            let num = |what: &str| format!("`{k}={v}`: expected {what}");
            match k {
                "model" | "weights" => self.weights = Some(PathBuf::from(v)),
                "data" => self.data = Some(PathBuf::from(v)),
                "imgsz" => self.imgsz = Some(v.parse().map_err(|_| num("a positive integer"))?),
                "batch" => self.batch = v.parse().map_err(|_| num("a positive integer"))?,
                "conf" => self.conf = v.parse().map_err(|_| num("a number in [0, 1]"))?,
                "iou" => self.iou = v.parse().map_err(|_| num("a number in [0, 1]"))?,
                "max_det" => self.max_det = v.parse().map_err(|_| num("a positive integer"))?,
                "split" => self.split = v.to_string(),
                "device" => match &self.device {
                    Some(d) if !d.eq_ignore_ascii_case(v) => {
                        return Err(format!("`--device {d}` and `device={v}` disagree: give the device once (either spelling)"))
                    }
                    _ => self.device = Some(v.to_string()),
                },
                "project" | "save_dir" => self.project = PathBuf::from(v),
                "plots" => self.plots = switch(k, v)?,
                "save_json" => self.save_json = switch(k, v)?,
                _ => {
                    if let Some(answered) = super::ultralytics_keys::answer("val", k, v) {
                        answered?;
                        continue;
                    }
                    let accepted = VAL_KEYS.split(", ").chain(["weights", "save_dir"]);
                    let hint = ptl_trainer::pose::nearest_key(k, accepted).map(|c| format!("did you mean `{c}`? ")).unwrap_or_default();
                    return Err(format!("unknown key `{k}` for ptl val ({hint}it takes {VAL_KEYS})"));
                }
            }
        }
        Ok(())
    }
}

/// The keys `ptl val` accepts as `key=value`.
const VAL_KEYS: &str = "model, data, imgsz, batch, conf, iou, max_det, split, device, save_json, plots, project";

#[derive(Args, Debug)]
pub struct PredictArgs {
    /// `key=value` settings, Ultralytics style (they override the flags): model= (alias
    /// weights=), source=, conf=, iou=, imgsz=, max_det=, device=, save_txt=, save_conf=,
    /// classes=, project= (alias save_dir=, out=).
    pub settings: Vec<String>,
    /// A ptl checkpoint or a safetensors state dict.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// An image, a folder of images, or a glob of image files (`images/*.jpg`).
    #[arg(long)]
    pub source: Option<String>,
    /// Output folder for drawn PNGs, predictions.json and (save_txt) labels/.
    #[arg(long, default_value = "runs/pose/predict")]
    pub out: PathBuf,
    /// Image size (defaults to the one the checkpoint was trained at, else 640).
    #[arg(long)]
    pub imgsz: Option<usize>,
    /// Confidence threshold.
    #[arg(long, default_value_t = 0.25)]
    pub conf: f32,
    /// NMS IoU threshold.
    #[arg(long, default_value_t = 0.7)]
    pub iou: f64,
    /// Most persons kept per image.
    #[arg(long, default_value_t = 300)]
    pub max_det: usize,
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Also write a YOLO pose label file per image into labels/ (Ultralytics' save_txt).
    #[arg(long)]
    pub save_txt: bool,
    /// With save_txt, each line ends with the person's confidence.
    #[arg(long)]
    pub save_conf: bool,
    /// Only these class ids (Ultralytics' `classes=0,2` or `classes=[0, 2]`; none: every class).
    #[arg(skip)]
    pub classes: Vec<usize>,
}

/// Ultralytics' `classes=`: one id, a comma list or a bracketed list; empty or none for all.
fn class_list(v: &str) -> Result<Vec<usize>, String> {
    let inner = v.trim().trim_matches(['[', ']']).trim();
    if inner.is_empty() || inner.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    inner
        .split(',')
        .map(|c| c.trim().parse::<usize>().map_err(|_| format!("`classes={v}`: expected class ids such as classes=0 or classes=0,2")))
        .collect()
}

/// The keys `ptl predict` accepts as `key=value`.
const PREDICT_KEYS: &str = "model, source, conf, iou, imgsz, max_det, device, save_txt, save_conf, classes, project";

/// `true`/`false` as Ultralytics spells them.
fn switch(k: &str, v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(format!("`{k}={v}`: expected true or false")),
    }
}

impl PredictArgs {
    /// Applies the `key=value` settings over the flags.
    pub(crate) fn apply_settings(&mut self) -> Result<(), String> {
        for s in self.settings.clone() {
            let (k, v) = s.split_once('=').ok_or_else(|| format!("`{s}` is not key=value (ptl predict takes {PREDICT_KEYS})"))?;
            let num = |what: &str| format!("`{k}={v}`: expected {what}");
            match k {
                "model" | "weights" => self.weights = Some(PathBuf::from(v)),
                "source" => self.source = Some(v.to_string()),
                "conf" => self.conf = v.parse().map_err(|_| num("a number in [0, 1]"))?,
                "iou" => self.iou = v.parse().map_err(|_| num("a number in [0, 1]"))?,
                "imgsz" => self.imgsz = Some(v.parse().map_err(|_| num("a positive integer"))?),
                "max_det" => self.max_det = v.parse().map_err(|_| num("a positive integer"))?,
                "device" => self.device = v.to_string(),
                "save_txt" => self.save_txt = switch(k, v)?,
                "save_conf" => self.save_conf = switch(k, v)?,
                // Checked against the model's classes once it is loaded.
                "classes" => self.classes = class_list(v)?,
                "project" | "save_dir" | "out" => self.out = PathBuf::from(v),
                _ => {
                    if let Some(answered) = super::ultralytics_keys::answer("predict", k, v) {
                        answered?;
                        continue;
                    }
                    let accepted = PREDICT_KEYS.split(", ").chain(["weights", "save_dir", "out"]);
                    let hint = ptl_trainer::pose::nearest_key(k, accepted).map(|c| format!("did you mean `{c}`? ")).unwrap_or_default();
                    return Err(format!("unknown key `{k}` for ptl predict ({hint}it takes {PREDICT_KEYS})"));
                }
            }
        }
        Ok(())
    }
}

/// The eval model of a ptl checkpoint or a safetensors state dict, with the checkpoint's training
/// settings (see `ptl_trainer::pose::predict::load_eval_model`).
pub fn model_from_checkpoint(path: &Path, device: Device) -> Result<(PoseModel, serde_json::Value), String> {
    ptl_trainer::pose::predict::load_eval_model(path, device).map_err(|e| e.to_string())
}

/// The image size to run at: the one given, else the checkpoint's training size (a model
/// evaluated at another size than it learned gives silently worse figures), else 640; refused
/// when the model cannot take it.
fn imgsz_for(given: Option<usize>, train_args: &serde_json::Value) -> Result<usize, String> {
    let imgsz = given.or_else(|| train_args["imgsz"].as_u64().map(|v| v as usize)).unwrap_or(640);
    check_imgsz(imgsz)?;
    Ok(imgsz)
}

/// Refuses an image size the model cannot take (before anything is loaded).
fn check_imgsz(imgsz: usize) -> Result<(), String> {
    if imgsz < 32 || !imgsz.is_multiple_of(32) || imgsz > MAX_IMGSZ {
        return Err(format!("imgsz {imgsz} must be a multiple of 32 (the model's largest stride) in 32..={MAX_IMGSZ}, e.g. imgsz=640"));
    }
    Ok(())
}

/// Refuses a confidence threshold outside [0, 1].
fn check_conf(conf: f32) -> Result<(), String> {
    if !(0.0..=1.0).contains(&conf) {
        return Err(format!("conf {conf} must be in [0, 1]"));
    }
    Ok(())
}

pub fn run_val(mut a: ValArgs) -> Result<(), String> {
    a.apply_settings()?;
    if let Some(imgsz) = a.imgsz {
        check_imgsz(imgsz)?;
    }
    check_conf(a.conf)?;
    if !(0.0..=1.0).contains(&a.iou) {
        return Err(format!("iou {} must be in [0, 1]", a.iou));
    }
    if a.max_det == 0 || a.max_det > 30_000 {
        return Err(format!("max_det {} must be in 1..=30000", a.max_det));
    }
    if !["val", "test", "train"].contains(&a.split.as_str()) {
        return Err(format!("split={}: a data yaml's splits are val, test and train", a.split));
    }
    if a.batch == 0 || a.batch > MAX_BATCH {
        return Err(format!("batch {} must be in 1..={MAX_BATCH}", a.batch));
    }
    let weights = a.weights.clone().ok_or("no weights to validate: pass model=W.ckpt or model=W.safetensors (or --weights W)")?;
    let device = super::resolve_device(a.device.as_deref().unwrap_or("auto"), "validating")?;
    let (model, args) = model_from_checkpoint(&weights, device)?;
    let imgsz = imgsz_for(a.imgsz, &args)?;
    let data = match &a.data {
        Some(d) => d.clone(),
        None => PathBuf::from(args["data"].as_str().ok_or_else(|| {
            format!("{} names no dataset (a safetensors file holds no settings): pass data=… (or --data)", weights.display())
        })?),
    };
    let open = ptl_data::OpenOptions { imgsz: imgsz as u32, ..Default::default() };
    let ds = std::sync::Arc::new(ptl_data::PoseDataset::open_yaml(&data, &a.split, &open).map_err(|e| e.to_string())?);
    let model_k = model.head().kpt_shape.0;
    if ds.nkpt() != model_k {
        return Err(format!(
            "{} predicts {model_k} keypoints per person but {} has {} (kpt_shape): validate on a dataset with the same keypoints",
            weights.display(),
            data.display(),
            ds.nkpt()
        ));
    }
    let opts = ptl_trainer::pose::ValOptions {
        conf: a.conf,
        iou: a.iou,
        max_det: a.max_det,
        save_json: a.save_json.then(|| a.project.clone()),
        ..Default::default()
    };
    let r = ptl_trainer::pose::validate_with(&model, &ds, a.batch, device, ptl_trainer::pose::Precision::F32, &opts)
        .map_err(|e| e.to_string())?;
    println!("validated {} images of {} at imgsz {imgsz}", r.images, data.display());
    for (k, v) in &r.metrics {
        println!("  {k:<24} {v:.4}");
    }
    // Per class, as Ultralytics' validation table, when there is more than one.
    if r.per_class.len() > 1 {
        for c in &r.per_class {
            let m: Vec<String> = c.metrics.iter().map(|v| format!("{v:.4}")).collect();
            println!(
                "  {:<16} images {:>5}  instances {:>6}  B(P R mAP50 mAP50-95) {}  P(…) {}",
                c.name,
                c.images,
                c.instances,
                m[..4].join(" "),
                m[4..].join(" ")
            );
        }
    }
    if a.plots {
        std::fs::create_dir_all(&a.project).map_err(|e| format!("cannot create {}: {e}", a.project.display()))?;
        for c in &r.pr_curves {
            let png = ptl_trainer::pose::plots::plot_pr_curve(c, &a.project).map_err(|e| e.to_string())?;
            println!("PR curve: {}", png.display());
        }
    }
    if let Some(j) = &r.coco_json {
        println!("COCO results: {} ({} detections)", j.predictions.display(), j.detections);
        println!("COCO ground truth: {} ({} annotations)", j.ground_truth.display(), j.annotations);
    }
    Ok(())
}

/// File names of one prediction run's outputs, each unique in its folder: the drawing keeps the
/// source's name with its extension (`a.jpg` → `a.jpg.png`, so `a.jpg` and `a.png` do not
/// overwrite each other), the label file takes the stem as Ultralytics' (`a.txt`); names that
/// still meet (non-UTF-8 names shown alike, `a.jpg` and `a.png`'s labels) are numbered `-2`, `-3`, ….
#[derive(Default)]
struct UniqueNames {
    used: std::collections::HashSet<String>,
}

impl UniqueNames {
    fn name(&mut self, base: &str, ext: &str) -> String {
        let name = (1..)
            .map(|n| if n == 1 { format!("{base}.{ext}") } else { format!("{base}-{n}.{ext}") })
            .find(|c| !self.used.contains(c))
            .unwrap_or_else(|| format!("{base}.{ext}"));
        self.used.insert(name.clone());
        name
    }

    /// The drawing of `source`.
    fn drawing_for(&mut self, source: &Path) -> String {
        let base = source.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "image".into());
        self.name(&base, "png")
    }

    /// The label file of `source`.
    fn label_for(&mut self, source: &Path) -> String {
        let base = source.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "image".into());
        self.name(&base, "txt")
    }
}

/// Image files Ultralytics' predict reads and ptl decodes.
const IMAGE_EXTENSIONS: [&str; 4] = ["jpg", "jpeg", "png", "bmp"];
/// Video files Ultralytics' predict reads; ptl refuses them by name.
const VIDEO_EXTENSIONS: [&str; 8] = ["mp4", "avi", "mov", "mkv", "webm", "mpeg", "mpg", "m4v"];

fn extension_of(p: &Path) -> String {
    p.extension().and_then(|x| x.to_str()).unwrap_or("").to_ascii_lowercase()
}

/// Whether `name` matches `pattern` (`*`: any run of characters, `?`: one character).
fn glob_match(pattern: &[char], name: &[char]) -> bool {
    match (pattern.first(), name.first()) {
        (None, None) => true,
        (Some('*'), _) => glob_match(&pattern[1..], name) || (!name.is_empty() && glob_match(pattern, &name[1..])),
        (Some('?'), Some(_)) => glob_match(&pattern[1..], &name[1..]),
        (Some(p), Some(n)) if p == n => glob_match(&pattern[1..], &name[1..]),
        _ => false,
    }
}

/// The class names a checkpoint's settings carry (`load_eval_model` puts them there), if any.
pub(crate) fn names_in(args: &serde_json::Value) -> Vec<String> {
    args["names"].as_array().map(|a| a.iter().filter_map(|n| n.as_str().map(str::to_string)).collect()).unwrap_or_default()
}

/// The image files `source` names: one image, the images of a folder, or those a glob matches
/// (`*` and `?` in the file-name part), sorted. A video or a URL is refused by name.
fn images_in(source: &str) -> Result<Vec<PathBuf>, String> {
    if source.contains("://") {
        return Err(format!("source={source}: ptl reads local image files, not URLs or streams"));
    }
    let path = Path::new(source);
    if VIDEO_EXTENSIONS.contains(&extension_of(path).as_str()) {
        return Err(format!("source={source}: videos are not supported: ptl predicts on images (jpg, png, bmp); extract the frames first"));
    }
    let (dir, pattern) = match path.file_name().and_then(|n| n.to_str()).filter(|n| n.contains(['*', '?'])) {
        Some(p) => (path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")), Some(p.chars().collect::<Vec<_>>())),
        None if path.is_file() => return Ok(vec![path.to_path_buf()]),
        None => (path, None),
    };
    let rd = std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| IMAGE_EXTENSIONS.contains(&extension_of(p).as_str()))
        .filter(|p| {
            let name: Vec<char> = p.file_name().map(|n| n.to_string_lossy().chars().collect()).unwrap_or_default();
            pattern.as_ref().is_none_or(|pat| glob_match(pat, &name))
        })
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(format!("no images (jpg, png, bmp) in {source}"));
    }
    Ok(v)
}

pub fn run_predict(mut a: PredictArgs) -> Result<(), String> {
    a.apply_settings()?;
    if let Some(imgsz) = a.imgsz {
        check_imgsz(imgsz)?;
    }
    check_conf(a.conf)?;
    if !(0.0..=1.0).contains(&a.iou) {
        return Err(format!("iou {} must be in [0, 1]", a.iou));
    }
    if a.max_det == 0 || a.max_det > 30_000 {
        return Err(format!("max_det {} must be in 1..=30000", a.max_det));
    }
    let weights = a.weights.clone().ok_or("no weights to predict with: pass model=W.ckpt or model=W.safetensors (or --weights W)")?;
    let source = a.source.clone().ok_or("nothing to predict on: pass source=IMAGE, a folder or a glob (or --source)")?;
    let sources = images_in(&source)?;
    let device = super::resolve_device(&a.device, "predicting")?;
    let (model, args) = model_from_checkpoint(&weights, device)?;
    let imgsz = imgsz_for(a.imgsz, &args)?;
    let nc = model.head().nc;
    let names = ptl_trainer::pose::predict::class_names(&names_in(&args), nc);
    if let Some(c) = a.classes.iter().find(|c| **c >= nc) {
        return Err(format!("`classes=`: class {c} is not one of the model's {nc} ({})", names.join(", ")));
    }
    let opts = ptl_trainer::pose::predict::PredictOptions { conf: a.conf, iou: a.iou, max_det: a.max_det, classes: a.classes.clone() };
    println!("predicting at imgsz {imgsz}, conf {}", a.conf);
    std::fs::create_dir_all(&a.out).map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    let labels = a.out.join("labels");
    if a.save_txt {
        std::fs::create_dir_all(&labels).map_err(|e| format!("cannot create {}: {e}", labels.display()))?;
    }
    let mut unreadable = 0usize;
    let mut all = Vec::new();
    let (mut drawings, mut label_names) = (UniqueNames::default(), UniqueNames::default());
    for path in &sources {
        let (img, _) = match ptl_data::image::decode_file(path) {
            Ok(x) => x,
            Err(e) => {
                log::warn!("ptl: skipping {}: {e}", path.display());
                unreadable += 1;
                continue;
            }
        };
        let found = predict_image_with(&model, &img, imgsz as u32, &opts, device).map_err(|e| e.to_string())?;
        if a.save_txt {
            // Ultralytics' labels/<stem>.txt; an image without persons gets no file, as there.
            let txt = labels.join(label_names.label_for(path));
            let lines: Vec<String> = found.iter().map(|p| yolo_label_line(p, img.w, img.h, a.save_conf)).collect();
            if !lines.is_empty() {
                std::fs::write(&txt, lines.join("\n") + "\n").map_err(|e| format!("cannot write {}: {e}", txt.display()))?;
            }
        }
        let mut drawn = img.clone();
        let persons: Vec<draw::Person<'_>> = found
            .iter()
            .map(|p| draw::Person { bbox: p.bbox_xyxy, kpts: &p.keypoints, score: Some(p.score), name: &names[p.class] })
            .collect();
        draw::people(&mut drawn, &persons, 0.5).map_err(|e| e.to_string())?;
        let png = a.out.join(drawings.drawing_for(path));
        ptl_data::image::write_png(&drawn, &png).map_err(|e| e.to_string())?;
        let what = if nc == 1 { "persons" } else { "detections" };
        println!("{}: {} {what} -> {}", path.display(), found.len(), png.display());
        let people: Vec<serde_json::Value> = found
            .iter()
            .map(|p| {
                let name = names.get(p.class).cloned().unwrap_or_default();
                serde_json::json!({ "box_xyxy": p.bbox_xyxy, "score": p.score, "class": p.class, "name": name, "keypoints": p.keypoints })
            })
            .collect();
        all.push(serde_json::json!({ "image": path.display().to_string(), "drawing": png.display().to_string(), "persons": people }));
    }
    if unreadable == sources.len() {
        return Err(format!(
            "none of the {} image files in {} could be read (see the messages above); nothing was predicted",
            sources.len(),
            source
        ));
    }
    let json = a.out.join("predictions.json");
    std::fs::write(&json, serde_json::to_string_pretty(&all).unwrap_or_default())
        .map_err(|e| format!("cannot write {}: {e}", json.display()))?;
    println!("predictions: {}", json.display());
    Ok(())
}

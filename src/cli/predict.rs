//! `ptl val` and `ptl predict`: load a checkpoint's EMA weights and evaluate or draw predictions.

use std::path::{Path, PathBuf};

use clap::Args;
use ptl_autograd::{no_grad, Device, Module, Tensor};
use ptl_data::augment::{letterbox, Instances};
use ptl_heads::{ModelConfig, PoseModel};
use ptl_trainer::fit::load_checkpoint;
use ptl_trainer::metrics::nms::non_max_suppression_batch;
use ptl_trainer::metrics::NmsConfig;

use ptl_trainer::pose::{draw, ModelSource, MAX_BATCH, MAX_IMGSZ};

#[derive(Args, Debug)]
pub struct ValArgs {
    /// `key=value` settings, Ultralytics style (they override the flags): model= (alias weights=),
    /// data=, imgsz=, batch=, conf=, device=, save_json=true|false, plots=true|false, project= (alias save_dir=).
    pub settings: Vec<String>,
    /// A ptl checkpoint (`weights/last.ckpt` or `best.ckpt`) or a safetensors state dict.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Dataset yaml (defaults to the one the checkpoint was trained on).
    #[arg(long)]
    pub data: Option<PathBuf>,
    #[arg(long, default_value_t = 640)]
    pub imgsz: usize,
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
}

impl ValArgs {
    /// Applies the `key=value` settings over the flags.
    fn apply_settings(&mut self) -> Result<(), String> {
        for s in self.settings.clone() {
            let (k, v) = s.split_once('=').ok_or_else(|| format!("`{s}` is not key=value (ptl val takes {VAL_KEYS})"))?;
            let num = |what: &str| format!("`{k}={v}`: expected {what}");
            match k {
                "model" | "weights" => self.weights = Some(PathBuf::from(v)),
                "data" => self.data = Some(PathBuf::from(v)),
                "imgsz" => self.imgsz = v.parse().map_err(|_| num("a positive integer"))?,
                "batch" => self.batch = v.parse().map_err(|_| num("a positive integer"))?,
                "conf" => self.conf = v.parse().map_err(|_| num("a number in [0, 1]"))?,
                "device" => match &self.device {
                    Some(d) if !d.eq_ignore_ascii_case(v) => {
                        return Err(format!("`--device {d}` and `device={v}` disagree: give the device once (either spelling)"))
                    }
                    _ => self.device = Some(v.to_string()),
                },
                "project" | "save_dir" => self.project = PathBuf::from(v),
                "plots" => {
                    self.plots = match v.to_ascii_lowercase().as_str() {
                        "true" | "1" | "yes" => true,
                        "false" | "0" | "no" => false,
                        _ => return Err(num("true or false")),
                    }
                }
                "save_json" => {
                    self.save_json = match v.to_ascii_lowercase().as_str() {
                        "true" | "1" | "yes" => true,
                        "false" | "0" | "no" => false,
                        _ => return Err(num("true or false")),
                    }
                }
                _ => {
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
const VAL_KEYS: &str = "model, data, imgsz, batch, conf, device, save_json, plots, project";

#[derive(Args, Debug)]
pub struct PredictArgs {
    /// A ptl checkpoint or a safetensors state dict.
    #[arg(long)]
    pub weights: PathBuf,
    /// An image or a folder of images.
    #[arg(long)]
    pub source: PathBuf,
    /// Output folder for drawn PNGs and predictions.json.
    #[arg(long, default_value = "runs/pose/predict")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 640)]
    pub imgsz: usize,
    /// Confidence threshold.
    #[arg(long, default_value_t = 0.25)]
    pub conf: f32,
    #[arg(long, default_value = "auto")]
    pub device: String,
}

/// Builds the model described by a ptl checkpoint (its EMA weights, and its training settings) or by
/// a safetensors state dict with Ultralytics' names (what `model=` accepts for training, e.g. from
/// `scripts/ultralytics_pt_to_safetensors.py`; no settings: `Value::Null`), in eval mode.
pub fn model_from_checkpoint(path: &Path, device: Device) -> Result<(PoseModel, serde_json::Value), String> {
    // `.pt` files get the conversion hint; anything else is read by its contents.
    if let Err(e @ ptl_trainer::TrainerError::InvalidArgument { .. }) = ModelSource::parse(&path.to_string_lossy()) {
        if path.extension().is_some_and(|x| x.eq_ignore_ascii_case("pt") || x.eq_ignore_ascii_case("pth")) {
            return Err(e.to_string());
        }
    }
    let is_state_dict = path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    let (weights_part, args) = if is_state_dict {
        let head = ptl_files::read_regular(path).map_err(|e| e.to_string())?;
        ptl_trainer::fit::checkpoint::refuse_pickle(path, &head).map_err(|e| e.to_string())?;
        let w = ptl_autograd::module::from_safetensors_bytes(&head, device, &path.display().to_string())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        (w.into_iter().collect::<std::collections::HashMap<_, _>>(), serde_json::Value::Null)
    } else {
        let ck = load_checkpoint(path, device).map_err(|e| e.to_string())?;
        let ema = ck.part("ema");
        (if ema.is_empty() { ck.part("model") } else { ema }, ck.manifest.train_args.clone())
    };
    // The size is the weights' own (the settings may name a start-weights file instead of a size).
    let shapes = weights_part.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect();
    let scale = ptl_trainer::pose::weights::scale_of(&shapes)
        .ok_or_else(|| format!("{}: not a YOLO26 pose model (no stem convolution of a known width)", path.display()))?;
    // The keypoint count is the model's own: the keypoint view `cv4_kpts.0` has K·3 outputs.
    let nkpt = weights_part
        .iter()
        .find(|(n, _)| n.ends_with("cv4_kpts.0.weight"))
        .and_then(|(_, t)| t.dims().first().map(|k3| k3 / 3))
        .ok_or_else(|| format!("{}: no keypoint head (cv4_kpts) in the checkpoint: not a pose model", path.display()))?;
    let mut model = PoseModel::new(ModelConfig { nc: 1, kpt_shape: (nkpt, 3), scale }, device, 0).map_err(|e| e.to_string())?;
    // Every tensor must fit, and the file may hold nothing else (as for training and export).
    ptl_trainer::pose::weights::load_start_weights(&model, &weights_part, path).map_err(|e| e.to_string())?;
    model.set_training(false);
    Ok((model, args))
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
    check_imgsz(a.imgsz)?;
    check_conf(a.conf)?;
    if a.batch == 0 || a.batch > MAX_BATCH {
        return Err(format!("batch {} must be in 1..={MAX_BATCH}", a.batch));
    }
    let weights = a.weights.clone().ok_or("no weights to validate: pass model=W.ckpt or model=W.safetensors (or --weights W)")?;
    let device = super::train::resolve_device(a.device.as_deref().unwrap_or("auto"), "validating")?;
    let (model, args) = model_from_checkpoint(&weights, device)?;
    let data = match &a.data {
        Some(d) => d.clone(),
        None => PathBuf::from(args["data"].as_str().ok_or_else(|| {
            format!("{} names no dataset (a safetensors file holds no settings): pass data=… (or --data)", weights.display())
        })?),
    };
    let open = ptl_data::OpenOptions { imgsz: a.imgsz as u32, ..Default::default() };
    let ds = std::sync::Arc::new(ptl_data::PoseDataset::open_yaml(&data, "val", &open).map_err(|e| e.to_string())?);
    let model_k = model.head().kpt_shape.0;
    if ds.nkpt() != model_k {
        return Err(format!(
            "{} predicts {model_k} keypoints per person but {} has {} (kpt_shape): validate on a dataset with the same keypoints",
            weights.display(),
            data.display(),
            ds.nkpt()
        ));
    }
    let opts = ptl_trainer::pose::ValOptions { conf: a.conf, save_json: a.save_json.then(|| a.project.clone()), ..Default::default() };
    let r = ptl_trainer::pose::validate_with(&model, &ds, a.batch, device, ptl_trainer::pose::Precision::F32, &opts)
        .map_err(|e| e.to_string())?;
    println!("validated {} images of {}", r.images, data.display());
    for (k, v) in &r.metrics {
        println!("  {k:<24} {v:.4}");
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

/// File names of the drawings of one prediction run: the source's name with its extension kept
/// (`a.jpg` → `a.jpg.png`, so `a.jpg` and `a.png` do not overwrite each other), and names that
/// still meet (non-UTF-8 names shown alike) numbered `-2`, `-3`, ….
#[derive(Default)]
struct DrawingNames {
    used: std::collections::HashSet<String>,
}

impl DrawingNames {
    fn name_for(&mut self, source: &Path) -> String {
        let base = source.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "image".into());
        let name = (1..)
            .map(|n| if n == 1 { format!("{base}.png") } else { format!("{base}-{n}.png") })
            .find(|c| !self.used.contains(c))
            .unwrap_or_else(|| format!("{base}.png"));
        self.used.insert(name.clone());
        name
    }
}

fn images_in(source: &Path) -> Result<Vec<PathBuf>, String> {
    if source.is_file() {
        return Ok(vec![source.to_path_buf()]);
    }
    let rd = std::fs::read_dir(source).map_err(|e| format!("cannot read {}: {e}", source.display()))?;
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().and_then(|x| x.to_str()).is_some_and(|x| ["jpg", "jpeg", "png", "bmp"].contains(&x.to_ascii_lowercase().as_str()))
        })
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(format!("no images (jpg/png) in {}", source.display()));
    }
    Ok(v)
}

pub fn run_predict(a: PredictArgs) -> Result<(), String> {
    check_imgsz(a.imgsz)?;
    check_conf(a.conf)?;
    let device = super::train::resolve_device(&a.device, "predicting")?;
    let (model, _) = model_from_checkpoint(&a.weights, device)?;
    std::fs::create_dir_all(&a.out).map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    let nk = model.head().kpt_shape.0;
    let sources = images_in(&a.source)?;
    let mut unreadable = 0usize;
    let cfg = NmsConfig { conf_thres: a.conf, ..NmsConfig::default() };
    let mut all = Vec::new();
    let mut drawings = DrawingNames::default();
    for path in &sources {
        let (img, _) = match ptl_data::image::decode_file(path) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("ptl: skipping {}: {e}", path.display());
                unreadable += 1;
                continue;
            }
        };
        let mut inst = Instances::empty(nk);
        let s = a.imgsz as u32;
        let (lb, info) = letterbox(&img, &mut inst, s, s, true);
        let rgb = lb.to_rgb();
        let (h, w) = (lb.h as usize, lb.w as usize);
        let mut chw = vec![0u8; 3 * h * w];
        for (i, px) in rgb.chunks_exact(3).enumerate() {
            for c in 0..3 {
                chw[c * h * w + i] = px[c];
            }
        }
        let x = ptl_trainer::pose::images_to_tensor(&chw, [1, 3, h, w], device).map_err(|e| e.to_string())?;
        let pred = no_grad(|| model.predict(&x)).map_err(|e| e.to_string())?;
        let d: Tensor = pred.decoded;
        let dims = d.dims().to_vec();
        let host = d.to_vec::<f32>().map_err(|e| e.to_string())?;
        let outs = non_max_suppression_batch(&host, 1, dims[2], 1, nk, &cfg).map_err(|e| e.to_string())?;
        let det = &outs[0].detections;
        let unmap = |x: f32, y: f32| ((x - info.left as f32) / info.r, (y - info.top as f32) / info.r);
        let mut drawn = img.clone();
        let mut people = Vec::new();
        let mut kps = Vec::new();
        for (i, b) in det.boxes.iter().enumerate() {
            let (x1, y1) = unmap(b[0], b[1]);
            let (x2, y2) = unmap(b[2], b[3]);
            let kp: Vec<[f32; 3]> = (0..nk)
                .map(|k| {
                    let o = (i * nk + k) * 3;
                    let (kx, ky) = unmap(det.keypoints[o], det.keypoints[o + 1]);
                    [kx, ky, det.keypoints[o + 2]]
                })
                .collect();
            people.push(serde_json::json!({ "box_xyxy": [x1, y1, x2, y2], "score": det.scores[i], "keypoints": kp }));
            kps.push(([x1, y1, x2, y2], kp, det.scores[i]));
        }
        let persons: Vec<draw::Person<'_>> = kps.iter().map(|(b, kp, s)| draw::Person { bbox: *b, kpts: kp, score: Some(*s) }).collect();
        draw::people(&mut drawn, &persons, 0.5).map_err(|e| e.to_string())?;
        let png = a.out.join(drawings.name_for(path));
        ptl_data::image::write_png(&drawn, &png).map_err(|e| e.to_string())?;
        println!("{}: {} persons -> {}", path.display(), people.len(), png.display());
        all.push(serde_json::json!({ "image": path.display().to_string(), "drawing": png.display().to_string(), "persons": people }));
    }
    if unreadable == sources.len() {
        return Err(format!(
            "none of the {} image files in {} could be read (see the messages above); nothing was predicted",
            sources.len(),
            a.source.display()
        ));
    }
    let json = a.out.join("predictions.json");
    std::fs::write(&json, serde_json::to_string_pretty(&all).unwrap_or_default())
        .map_err(|e| format!("cannot write {}: {e}", json.display()))?;
    println!("predictions: {}", json.display());
    Ok(())
}

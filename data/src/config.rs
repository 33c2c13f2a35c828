//! Dataset YAML (docs/data.md §3) and image-path collection.

use std::path::{Path, PathBuf};

use serde_yaml::Value;

use crate::error::{DataError, Result};
use crate::labels::KptShape;

/// COCO keypoint flip permutation.
pub const COCO_FLIP_IDX: [usize; 17] = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15];

/// Most classes a dataset may declare.
pub const MAX_CLASSES: usize = 1000;

/// COCO keypoint names in order.
pub const COCO_KPT_NAMES: [&str; 17] = [
    "nose",
    "left_eye",
    "right_eye",
    "left_ear",
    "right_ear",
    "left_shoulder",
    "right_shoulder",
    "left_elbow",
    "right_elbow",
    "left_wrist",
    "right_wrist",
    "left_hip",
    "right_hip",
    "left_knee",
    "right_knee",
    "left_ankle",
    "right_ankle",
];

/// COCO OKS sigmas (default for kpt_shape [17, 3]).
pub const COCO_OKS_SIGMAS: [f32; 17] =
    [0.026, 0.025, 0.025, 0.035, 0.035, 0.079, 0.079, 0.072, 0.072, 0.062, 0.062, 0.107, 0.107, 0.087, 0.087, 0.089, 0.089];

/// Image suffixes the reference collects (lower case). Only JPEG and PNG decode here; the others are skipped
/// with a warning when met.
pub const IMG_FORMATS: [&str; 13] = ["bmp", "dng", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp", "pfm", "heic", "avif", "jp2"];

/// Most keypoints per instance a dataset may declare (`kpt_shape: [K, D]`).
pub const MAX_KEYPOINTS: usize = 1024;

/// Parsed dataset configuration.
#[derive(Clone, Debug)]
pub struct DatasetConfig {
    /// The yaml file.
    pub yaml_path: PathBuf,
    /// Resolved dataset root (`path`, relative to the yaml's folder; the yaml's folder when absent).
    pub root: PathBuf,
    /// Split entries (directories or list files), resolved against `root`.
    pub train: Vec<PathBuf>,
    /// The validation split's entries.
    pub val: Vec<PathBuf>,
    /// The test split's entries.
    pub test: Vec<PathBuf>,
    /// Class names by id.
    pub names: Vec<String>,
    /// Number of classes.
    pub nc: usize,
    /// Keypoints per object and values per keypoint.
    pub kpt_shape: KptShape,
    /// `None` disables flips (docs/data.md §3).
    pub flip_idx: Option<Vec<usize>>,
    /// Keypoint names (COCO's for 17 keypoints when the yaml gives none).
    pub kpt_names: Vec<String>,
    /// OKS sigmas per keypoint (the yaml's, else COCO's for [17, 3], else 1/K).
    pub kpt_oks_sigmas: Vec<f32>,
    /// Image channels (3).
    pub channels: usize,
    /// Image folders of COCO-JSON splits (`train_images:`, `val_images:`, `test_images:`), resolved
    /// against `root`; without one the folder is looked for next to the JSON ([`coco_image_dir`]).
    pub split_images: Vec<(String, PathBuf)>,
}

fn cfg_err(path: &Path, field: &'static str, message: impl Into<String>) -> DataError {
    DataError::Config { path: path.to_path_buf(), field, message: message.into() }
}

fn as_usize_list(v: &Value, path: &Path, field: &'static str) -> Result<Vec<usize>> {
    let seq = v.as_sequence().ok_or_else(|| cfg_err(path, field, "expected a list of non-negative integers"))?;
    seq.iter()
        .map(|x| {
            x.as_u64()
                .and_then(|u| usize::try_from(u).ok())
                .ok_or_else(|| cfg_err(path, field, format!("`{x:?}` is not a non-negative integer")))
        })
        .collect()
}

impl DatasetConfig {
    /// Reads and validates a dataset yaml.
    pub fn load(yaml_path: &Path) -> Result<Self> {
        let text = ptl_files::read_to_string(yaml_path)?;
        Self::parse(&text, yaml_path)
    }

    /// A COCO keypoints JSON used directly as a dataset: the file is both the train and the val
    /// split (validation then runs on the training annotations), person class, COCO keypoints.
    pub fn coco_json(json: &Path) -> Result<Self> {
        if !json.exists() {
            return Err(DataError::MissingPath { path: json.to_path_buf(), what: "COCO keypoints JSON" });
        }
        // A folder, FIFO or device is refused here, without blocking on it.
        drop(ptl_files::open_regular(json)?);
        let root = json.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(DatasetConfig {
            yaml_path: json.to_path_buf(),
            root,
            train: vec![json.to_path_buf()],
            val: vec![json.to_path_buf()],
            test: Vec::new(),
            names: vec!["person".into()],
            nc: 1,
            kpt_shape: KptShape::COCO,
            flip_idx: Some(COCO_FLIP_IDX.to_vec()),
            kpt_names: COCO_KPT_NAMES.iter().map(|s| s.to_string()).collect(),
            kpt_oks_sigmas: COCO_OKS_SIGMAS.to_vec(),
            channels: 3,
            split_images: Vec::new(),
        })
    }

    /// Reads a dataset yaml, or a COCO keypoints JSON given directly (`.json`).
    pub fn load_any(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
            Self::coco_json(path)
        } else {
            Self::load(path)
        }
    }

    /// Parses yaml text; `yaml_path` locates relative paths and names the file in errors.
    pub fn parse(text: &str, yaml_path: &Path) -> Result<Self> {
        let doc: Value = serde_yaml::from_str(text).map_err(|e| {
            let (line, column) = e.location().map(|l| (l.line(), l.column())).unwrap_or((0, 0));
            DataError::Yaml { path: yaml_path.to_path_buf(), line, column, message: e.to_string() }
        })?;
        let map = doc.as_mapping().ok_or_else(|| DataError::Yaml {
            path: yaml_path.to_path_buf(),
            line: 1,
            column: 1,
            message: "the document is not a mapping of dataset fields".into(),
        })?;
        let get = |k: &str| map.get(Value::String(k.into()));
        let base = yaml_path.parent().map(Path::to_path_buf).unwrap_or_default();
        let root = match get("path") {
            Some(Value::String(s)) => {
                let p = PathBuf::from(s);
                if p.is_absolute() {
                    p
                } else {
                    base.join(p)
                }
            }
            Some(Value::Null) | None => base.clone(),
            Some(other) => return Err(cfg_err(yaml_path, "path", format!("expected a string, got {other:?}"))),
        };
        let split = |name: &'static str| -> Result<Vec<PathBuf>> {
            let resolve = |s: &str| {
                let p = PathBuf::from(s);
                if p.is_absolute() {
                    p
                } else {
                    let cand = root.join(&p);
                    if !cand.exists() {
                        if let Some(rest) = s.strip_prefix("../") {
                            return root.join(rest);
                        }
                    }
                    cand
                }
            };
            match get(name) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::String(s)) => Ok(vec![resolve(s)]),
                Some(Value::Sequence(seq)) => seq
                    .iter()
                    .map(|v| v.as_str().map(resolve).ok_or_else(|| cfg_err(yaml_path, name, "list entries must be strings")))
                    .collect(),
                Some(other) => Err(cfg_err(yaml_path, name, format!("expected a path or list of paths, got {other:?}"))),
            }
        };
        let train = split("train")?;
        let val = split("val")?;
        let test = split("test")?;
        let mut split_images = Vec::new();
        for (name, key) in [("train", "train_images"), ("val", "val_images"), ("test", "test_images")] {
            match get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) => {
                    let p = PathBuf::from(s);
                    split_images.push((name.to_string(), if p.is_absolute() { p } else { root.join(p) }));
                }
                Some(other) => return Err(cfg_err(yaml_path, "train_images", format!("`{key}`: expected a folder path, got {other:?}"))),
            }
        }
        if train.is_empty() && val.is_empty() {
            return Err(cfg_err(yaml_path, "train", "neither `train` nor `val` is given"));
        }
        let names: Vec<String> = match get("names") {
            Some(Value::Sequence(seq)) => seq.iter().map(value_to_string).collect(),
            Some(Value::Mapping(m)) => {
                let mut pairs: Vec<(usize, String)> = Vec::new();
                for (k, v) in m {
                    let id = k.as_u64().ok_or_else(|| cfg_err(yaml_path, "names", format!("key {k:?} is not a class id")))?;
                    pairs.push((id as usize, value_to_string(v)));
                }
                pairs.sort();
                for (i, (id, _)) in pairs.iter().enumerate() {
                    if *id != i {
                        return Err(cfg_err(yaml_path, "names", "class ids must be 0..nc-1 without gaps"));
                    }
                }
                pairs.into_iter().map(|(_, n)| n).collect()
            }
            None | Some(Value::Null) => Vec::new(),
            Some(other) => return Err(cfg_err(yaml_path, "names", format!("expected a list or mapping, got {other:?}"))),
        };
        let nc = match get("nc") {
            Some(v) => v.as_u64().ok_or_else(|| cfg_err(yaml_path, "nc", "expected a non-negative integer"))?,
            None => names.len() as u64,
        };
        if nc == 0 {
            return Err(cfg_err(yaml_path, "names", "no classes: add `names: {0: person}`"));
        }
        // Checked before anything is sized by it (a class-name list, the model's class head).
        if nc > MAX_CLASSES as u64 {
            return Err(cfg_err(
                yaml_path,
                "nc",
                format!("{nc} classes is more than {MAX_CLASSES} (the class head and metrics are sized by it): is it the right number?"),
            ));
        }
        let nc = nc as usize;
        if !names.is_empty() && names.len() != nc {
            return Err(cfg_err(yaml_path, "nc", format!("nc = {nc} but {} names given", names.len())));
        }
        let names = if names.is_empty() { (0..nc).map(|i| format!("class{i}")).collect() } else { names };
        let kpt_shape = match get("kpt_shape") {
            Some(v) => {
                let ks = as_usize_list(v, yaml_path, "kpt_shape")?;
                if ks.len() != 2 || ks[0] == 0 || !(ks[1] == 2 || ks[1] == 3) {
                    return Err(cfg_err(yaml_path, "kpt_shape", "expected [K, D] with K > 0 and D ∈ {2, 3}"));
                }
                if ks[0] > MAX_KEYPOINTS {
                    return Err(cfg_err(
                        yaml_path,
                        "kpt_shape",
                        format!("K = {} keypoints is more than {MAX_KEYPOINTS} (COCO-WholeBody has 133): is it the right number?", ks[0]),
                    ));
                }
                KptShape { k: ks[0], d: ks[1] }
            }
            None => return Err(cfg_err(yaml_path, "kpt_shape", "missing: a pose dataset needs `kpt_shape: [17, 3]`")),
        };
        let flip_idx = match get("flip_idx") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let f = as_usize_list(v, yaml_path, "flip_idx")?;
                if f.len() != kpt_shape.k {
                    return Err(cfg_err(yaml_path, "flip_idx", format!("has {} entries but kpt_shape has K = {}", f.len(), kpt_shape.k)));
                }
                if f.iter().any(|&i| i >= kpt_shape.k) {
                    return Err(cfg_err(yaml_path, "flip_idx", "entries must be keypoint indices < K"));
                }
                let mut seen = vec![false; kpt_shape.k];
                for &i in &f {
                    if std::mem::replace(&mut seen[i], true) {
                        return Err(cfg_err(
                            yaml_path,
                            "flip_idx",
                            format!(
                                "index {i} appears twice: flip_idx must be a permutation of 0..{} (keypoint k swaps with flip_idx[k])",
                                kpt_shape.k
                            ),
                        ));
                    }
                }
                Some(f)
            }
        };
        let coco = kpt_shape == KptShape::COCO;
        let kpt_oks_sigmas = match get("kpt_oks_sigmas") {
            Some(Value::Sequence(seq)) => {
                let s: Option<Vec<f32>> = seq.iter().map(|v| v.as_f64().map(|f| f as f32)).collect();
                let s = s.ok_or_else(|| cfg_err(yaml_path, "kpt_oks_sigmas", "expected numbers"))?;
                if s.len() != kpt_shape.k || s.iter().any(|&x| !(x.is_finite() && x > 0.0)) {
                    return Err(cfg_err(
                        yaml_path,
                        "kpt_oks_sigmas",
                        format!("expected K = {} positive finite numbers (the OKS sigma of each keypoint)", kpt_shape.k),
                    ));
                }
                s
            }
            _ if coco => COCO_OKS_SIGMAS.to_vec(),
            _ => vec![1.0 / kpt_shape.k as f32; kpt_shape.k],
        };
        let kpt_names = if coco {
            COCO_KPT_NAMES.iter().map(|s| s.to_string()).collect()
        } else {
            (0..kpt_shape.k).map(|i| format!("kpt{i}")).collect()
        };
        let channels = get("channels").and_then(Value::as_u64).unwrap_or(3) as usize;
        if channels != 3 {
            return Err(cfg_err(yaml_path, "channels", "only 3-channel images are supported"));
        }
        Ok(DatasetConfig {
            yaml_path: yaml_path.to_path_buf(),
            root,
            train,
            val,
            test,
            names,
            nc,
            kpt_shape,
            flip_idx,
            split_images,
            kpt_names,
            kpt_oks_sigmas,
            channels,
        })
    }

    /// Split entries by name (`train`, `val`, `test`).
    pub fn split(&self, name: &str) -> Result<&[PathBuf]> {
        match name {
            "train" => Ok(&self.train),
            "val" => Ok(&self.val),
            "test" => Ok(&self.test),
            _ => Err(DataError::Invalid(format!("unknown split `{name}` (use train, val or test)"))),
        }
    }
}

fn value_to_string(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other).unwrap_or_default().trim().to_string(),
    }
}

fn has_image_suffix(p: &Path) -> bool {
    p.extension().and_then(|e| e.to_str()).map(|e| IMG_FORMATS.contains(&e.to_ascii_lowercase().as_str())).unwrap_or(false)
}

/// Files found under some folders, and the folder links that were not followed.
#[derive(Debug, Default)]
pub struct Walk {
    /// The files, sorted.
    pub files: Vec<PathBuf>,
    /// Symbolic links to a folder that encloses them or was already walked (a loop, or the same
    /// files twice): skipped.
    pub links_not_followed: Vec<PathBuf>,
    visited: std::collections::HashSet<PathBuf>,
}

impl Walk {
    /// Walks `dir` recursively, keeping files for which `keep` is true. A folder reached through a
    /// symbolic link is entered only if its real path is neither an ancestor of the link nor a
    /// folder walked before.
    pub fn walk(&mut self, dir: &Path, keep: &dyn Fn(&Path) -> bool) -> Result<()> {
        let real = std::fs::canonicalize(dir).map_err(|e| DataError::io(dir, e))?;
        self.visited.insert(real.clone());
        self.walk_real(dir, &real, keep)
    }

    fn walk_real(&mut self, dir: &Path, real: &Path, keep: &dyn Fn(&Path) -> bool) -> Result<()> {
        let rd = std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))?;
        let mut entries: Vec<_> = rd.collect::<std::io::Result<Vec<_>>>().map_err(|e| DataError::io(dir, e))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            // Hidden files and folders (`.x.jpg`, `.cache/`) are not collected, as Ultralytics'
            // `glob` does not collect them.
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let p = entry.path();
            if !p.is_dir() {
                if keep(&p) {
                    self.files.push(p);
                }
                continue;
            }
            let is_link = entry.file_type().map(|t| t.is_symlink()).unwrap_or(false);
            let sub_real = if is_link {
                match std::fs::canonicalize(&p) {
                    Ok(r) => r,
                    Err(_) => {
                        self.links_not_followed.push(p);
                        continue;
                    }
                }
            } else {
                real.join(entry.file_name())
            };
            if is_link && (real.starts_with(&sub_real) || self.visited.contains(&sub_real)) {
                self.links_not_followed.push(p);
                continue;
            }
            self.visited.insert(sub_real.clone());
            self.walk_real(&p, &sub_real, keep)?;
        }
        Ok(())
    }
}

/// Collects the image paths of split entries (directories searched recursively without following
/// folder links into loops, list files with `./` relative to the list file's folder), sorted in
/// string order, and the folder links not followed. Missing entries are errors.
pub fn collect_images(entries: &[PathBuf]) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let mut walk = Walk::default();
    let mut out = Vec::new();
    for e in entries {
        if e.is_dir() {
            walk.walk(e, &has_image_suffix)?;
            out.append(&mut walk.files);
        } else if e.exists() {
            let text = ptl_files::read_to_string(e)?;
            let parent = e.parent().map(Path::to_path_buf).unwrap_or_default();
            for line in text.lines() {
                let line = line.trim();
                if line.is_empty() {
                    continue;
                }
                let p = if let Some(rest) = line.strip_prefix("./") {
                    parent.join(rest)
                } else {
                    let p = PathBuf::from(line);
                    if p.is_absolute() {
                        p
                    } else {
                        parent.join(p)
                    }
                };
                if has_image_suffix(&p) {
                    out.push(p);
                }
            }
        } else {
            return Err(DataError::MissingPath { path: e.clone(), what: "image folder or list file" });
        }
    }
    out.sort_by(|a, b| a.to_string_lossy().cmp(&b.to_string_lossy()));
    out.dedup();
    Ok((out, walk.links_not_followed))
}

/// The image folder of a COCO keypoints JSON: the split's `<split>_images` entry, else the first
/// folder holding images of `<root>/images/<set>`, `<json dir>/../images/<set>`, `<json dir>/../<set>`,
/// `<json dir>/images`, `<json dir>`, where `<set>` is what follows the last `_` of the file stem
/// (`person_keypoints_val2017.json` → `val2017`).
pub fn coco_image_dir(cfg: &DatasetConfig, split: &str, json: &Path) -> Result<PathBuf> {
    if let Some((_, p)) = cfg.split_images.iter().find(|(s, _)| s == split) {
        return Ok(p.clone());
    }
    let stem = json.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let set = stem.rsplit('_').next().unwrap_or(&stem).to_string();
    let dir = json.parent().map(Path::to_path_buf).unwrap_or_default();
    let up = dir.parent().map(Path::to_path_buf).unwrap_or_else(|| dir.clone());
    let candidates = [cfg.root.join("images").join(&set), up.join("images").join(&set), up.join(&set), dir.join("images"), dir.clone()];
    candidates.iter().find(|c| has_images(c)).cloned().ok_or_else(|| DataError::Config {
        path: cfg.yaml_path.clone(),
        field: "train_images",
        message: format!(
            "no image folder for {} (looked in {}): add `{split}_images: <folder>` to the dataset yaml",
            json.display(),
            candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
    })
}

fn has_images(dir: &Path) -> bool {
    std::fs::read_dir(dir).map(|rd| rd.flatten().any(|e| has_image_suffix(&e.path()))).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hidden files and folders are not collected from an image folder (Ultralytics' glob skips
    /// them); a list file's entries are taken as listed.
    #[test]
    fn hidden_images_are_not_collected_from_folders() {
        let d = tempfile::tempdir().unwrap();
        let images = d.path().join("images");
        for f in ["a.jpg", ".b.jpg", ".cache/c.jpg", "sub/d.png"] {
            let p = images.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"x").unwrap();
        }
        let (found, _) = collect_images(std::slice::from_ref(&images)).unwrap();
        assert_eq!(found, vec![images.join("a.jpg"), images.join("sub/d.png")]);
        let list = d.path().join("list.txt");
        std::fs::write(&list, "./images/.b.jpg\n").unwrap();
        assert_eq!(collect_images(&[list]).unwrap().0, vec![d.path().join("images/.b.jpg")]);
    }

    #[test]
    fn parse_coco8_style() {
        let y = "path: ../datasets/coco8-pose\ntrain: images/train\nval: images/val\n\
                 kpt_shape: [17, 3]\nflip_idx: [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]\n\
                 names:\n  0: person\n";
        let c = DatasetConfig::parse(y, Path::new("/x/data.yaml")).unwrap();
        assert_eq!(c.nc, 1);
        assert_eq!(c.names, vec!["person"]);
        assert_eq!(c.flip_idx.as_deref(), Some(&COCO_FLIP_IDX[..]));
        assert_eq!(c.kpt_oks_sigmas.len(), 17);
        assert_eq!(c.train[0], PathBuf::from("/x/../datasets/coco8-pose/images/train"));
    }

    #[test]
    fn errors_have_location() {
        let e = DatasetConfig::parse("train: [a\nval: b\n", Path::new("d.yaml")).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, DataError::Yaml { .. }), "{s}");
        assert!(s.starts_with("d.yaml:"), "{s}");
        let e = DatasetConfig::parse("train: a\nkpt_shape: [17, 3]\nflip_idx: [0, 1]\nnames: [person]\n", Path::new("d.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("flip_idx") && e.contains("K = 17"), "{e}");
        let e = DatasetConfig::parse("train: a\nnames: [person]\n", Path::new("d.yaml")).unwrap_err().to_string();
        assert!(e.contains("kpt_shape"), "{e}");
        let c = DatasetConfig::parse("train: a\nnames: [person]\nkpt_shape: [5, 2]\n", Path::new("d.yaml")).unwrap();
        assert!(c.flip_idx.is_none());
        assert_eq!(c.kpt_oks_sigmas, vec![0.2; 5]);
    }
}

//! Pose datasets: scanning an Ultralytics-layout split or a COCO keypoints JSON, validating labels, decoding and
//! preparing images into the RAM cache (optionally backed by the disk cache).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;

use crate::cache;
use crate::config::{collect_images, DatasetConfig, COCO_FLIP_IDX};
use crate::error::{DataError, Result};
use crate::image::{decode_file, load_resize_shape, resize_bilinear, Image};
use crate::labels::{label_path_for, parse_label_text, KptShape, LabelRules, Labels};

/// Options for opening a dataset.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Long side of prepared images (docs/data.md §5).
    pub imgsz: u32,
    /// Disk cache folder for prepared images; `None` keeps them in RAM only.
    pub cache_dir: Option<PathBuf>,
    /// Map every class to 0.
    pub single_cls: bool,
    /// Threads used to decode; 0 = all cores.
    pub threads: usize,
    /// Print warnings to stderr as they are found (they are always kept in the report).
    pub verbose: bool,
    /// Keep only the first `round(n · fraction)` images of the split in file order (Ultralytics'
    /// `fraction`, for quick runs on part of a training set); 1 keeps them all.
    pub fraction: f64,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions { imgsz: 640, cache_dir: None, single_cls: false, threads: 0, verbose: true, fraction: 1.0 }
    }
}

/// Why a file was skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    /// The image could not be read or decoded (corrupt, truncated, too small, unsupported format).
    BadImage,
    /// The label file could not be read (I/O error, not UTF-8).
    UnreadableLabel,
    /// The label file breaks a label rule (column count, range, NaN, class, …).
    InvalidLabel,
    /// The image is larger than [`crate::image::MAX_PIXELS`] (header checked, never decoded).
    OversizeImage,
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SkipReason::BadImage => "bad image",
            SkipReason::UnreadableLabel => "unreadable label",
            SkipReason::InvalidLabel => "invalid label",
            SkipReason::OversizeImage => "oversize image",
        })
    }
}

/// One skipped image.
#[derive(Clone, Debug)]
pub struct Skipped {
    /// The image.
    pub path: PathBuf,
    /// Why, as a category (counted in the scan report).
    pub reason: SkipReason,
    /// Why, in words naming the file and the fix.
    pub message: String,
}

/// What a scan found.
#[derive(Clone, Debug, Default)]
pub struct ScanReport {
    /// Image files found.
    pub found: usize,
    /// Images kept.
    pub usable: usize,
    /// Kept images with no objects (missing or empty label file).
    pub background: usize,
    /// Kept images without a label file.
    pub missing_labels: usize,
    /// Objects over all kept images.
    pub instances: usize,
    /// Dropped images with reasons.
    pub skipped: Vec<Skipped>,
    /// Label files with no matching image (ignored).
    pub orphan_labels: Vec<PathBuf>,
    /// All warnings, each naming its file.
    pub warnings: Vec<String>,
    /// Folder links not followed (loops, folders reached twice).
    pub links_not_followed: usize,
    /// Annotation counts of a COCO keypoints source.
    pub coco: Option<crate::coco::CocoReport>,
}

impl ScanReport {
    /// Counts of skipped images per reason, e.g. "2 bad image, 1 invalid label".
    pub fn skip_summary(&self) -> String {
        let mut counts: std::collections::BTreeMap<SkipReason, usize> = Default::default();
        for s in &self.skipped {
            *counts.entry(s.reason).or_default() += 1;
        }
        if counts.is_empty() {
            return "none".into();
        }
        counts.iter().map(|(r, n)| format!("{n} {r}")).collect::<Vec<_>>().join(", ")
    }

    /// One-line summary.
    pub fn summary(&self) -> String {
        format!(
            "{} images found, {} usable ({} background, {} without label file), {} instances, {} skipped ({}), {} orphan labels",
            self.found,
            self.usable,
            self.background,
            self.missing_labels,
            self.instances,
            self.skipped.len(),
            self.skip_summary(),
            self.orphan_labels.len()
        ) + &if self.links_not_followed > 0 { format!(", {} folder links not followed", self.links_not_followed) } else { String::new() }
    }
}

/// One usable image: its labels and its prepared (long side = imgsz) BGR pixels, shared.
#[derive(Clone, Debug)]
pub struct Item {
    /// The image file.
    pub im_file: PathBuf,
    /// Its objects, normalised.
    pub labels: Labels,
    /// Original (EXIF-oriented) size (h0, w0).
    pub ori_shape: (u32, u32),
    /// Prepared image (RAM cache).
    pub image: Arc<Image>,
}

/// Dataset metadata needed by the pipeline.
#[derive(Clone, Debug)]
pub struct DatasetMeta {
    /// Class names by id.
    pub names: Vec<String>,
    /// Number of classes.
    pub nc: usize,
    /// Keypoints per object and values per keypoint.
    pub kpt_shape: KptShape,
    /// The keypoint permutation of a flip (`None`: flips off).
    pub flip_idx: Option<Vec<usize>>,
    /// OKS sigmas per keypoint.
    pub kpt_oks_sigmas: Vec<f32>,
}

impl DatasetMeta {
    /// The dataset's own OKS sigmas (`kpt_oks_sigmas` of its yaml) when they differ from the
    /// defaults for its keypoints (COCO's for [17, 3], 1/K otherwise): the pose loss and the
    /// keypoint metrics then use them, as Ultralytics does; `None` leaves both on their defaults.
    pub fn custom_oks_sigmas(&self) -> Option<&[f32]> {
        let k = self.kpt_shape.k;
        let default: Vec<f32> =
            if self.kpt_shape == KptShape::COCO { crate::config::COCO_OKS_SIGMAS.to_vec() } else { vec![1.0 / k as f32; k] };
        (self.kpt_oks_sigmas.len() == k && self.kpt_oks_sigmas != default).then_some(self.kpt_oks_sigmas.as_slice())
    }
}

/// A scanned split with every usable image prepared in RAM.
#[derive(Clone, Debug)]
pub struct PoseDataset {
    /// The split's name (`train`, `val`, …).
    pub split: String,
    /// The long side images were prepared at.
    pub imgsz: u32,
    /// Classes, keypoints and flip of the dataset.
    pub meta: DatasetMeta,
    /// The usable images, in path order.
    pub items: Vec<Item>,
    /// What the scan found and skipped.
    pub report: ScanReport,
}

/// Where the labels of an image come from.
pub(crate) enum LabelSource {
    /// A label file path (may be missing → background).
    File(PathBuf),
    /// Label text made in memory (COCO conversion); `None` = no annotations → background.
    Text(Option<String>, PathBuf),
}

pub(crate) struct Entry {
    pub im_file: PathBuf,
    pub labels: LabelSource,
}

enum Outcome {
    Kept(Item, bool, Vec<String>),
    Skipped(Skipped, Vec<String>),
}

fn prepare_image(path: &Path, opts: &OpenOptions, warnings: &mut Vec<String>) -> Result<(Image, (u32, u32))> {
    if let Some(dir) = &opts.cache_dir {
        if let Some(hit) = cache::load(dir, path, opts.imgsz) {
            return Ok(hit);
        }
    }
    let (img, info) = decode_file(path)?;
    if info.truncated_jpeg {
        warnings.push(format!("{}: truncated JPEG (no FFD9 end marker), decoded leniently; re-save the file to repair it", path.display()));
    }
    let ori = (img.h, img.w);
    let (nw, nh) = load_resize_shape(img.w, img.h, opts.imgsz);
    let img = resize_bilinear(&img, nw, nh);
    if let Some(dir) = &opts.cache_dir {
        if let Err(e) = cache::store(dir, path, opts.imgsz, &img, ori) {
            warnings.push(format!("image cache not written: {e}"));
        }
    }
    Ok((img, ori))
}

/// The largest label file read (a label row is < 1 KiB at COCO's 17 keypoints).
const MAX_LABEL_BYTES: u64 = 64 << 20;

fn process(entry: &Entry, rules: &LabelRules, opts: &OpenOptions) -> Outcome {
    let mut warnings = Vec::new();
    let skip = |path: &Path, reason, message: String, warnings: Vec<String>| {
        Outcome::Skipped(Skipped { path: path.to_path_buf(), reason, message }, warnings)
    };
    let (text, label_path) = match &entry.labels {
        LabelSource::File(p) => match ptl_files::read_limited(p, MAX_LABEL_BYTES, "label file") {
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(t) => (Some(t), p.clone()),
                Err(_) => return skip(p, SkipReason::UnreadableLabel, format!("{}: label file is not UTF-8 text", p.display()), warnings),
            },
            Err(ptl_files::FileError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => (None, p.clone()),
            Err(e) => return skip(p, SkipReason::UnreadableLabel, e.to_string(), warnings),
        },
        LabelSource::Text(t, p) => (t.clone(), p.clone()),
    };
    let has_label_file = text.is_some();
    let labels = match text {
        Some(t) => match parse_label_text(&t, &label_path, rules) {
            Ok((l, w)) => {
                warnings.extend(w);
                l
            }
            Err(e) => return skip(&label_path, SkipReason::InvalidLabel, e.to_string(), warnings),
        },
        None => Labels::default(),
    };
    match prepare_image(&entry.im_file, opts, &mut warnings) {
        Ok((img, ori)) => {
            Outcome::Kept(Item { im_file: entry.im_file.clone(), labels, ori_shape: ori, image: Arc::new(img) }, has_label_file, warnings)
        }
        Err(e @ DataError::ImageTooLarge { .. }) => skip(&entry.im_file, SkipReason::OversizeImage, e.to_string(), warnings),
        Err(e) => skip(&entry.im_file, SkipReason::BadImage, e.to_string(), warnings),
    }
}

impl PoseDataset {
    /// Opens split `split` (`train`, `val`, `test`) of a dataset yaml.
    pub fn open_yaml(yaml: &Path, split: &str, opts: &OpenOptions) -> Result<Self> {
        let cfg = DatasetConfig::load_any(yaml)?;
        Self::open(&cfg, split, opts)
    }

    /// Opens a split of a parsed configuration (Ultralytics layout: `images/…` with `labels/…` beside).
    pub fn open(cfg: &DatasetConfig, split: &str, opts: &OpenOptions) -> Result<Self> {
        let entries = cfg.split(split)?;
        if entries.is_empty() {
            return Err(DataError::Config {
                path: cfg.yaml_path.clone(),
                field: "train",
                message: format!("split `{split}` is not defined in the dataset yaml"),
            });
        }
        let is_json = |p: &PathBuf| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"));
        if entries.iter().any(is_json) {
            let [json] = entries else {
                return Err(DataError::Config {
                    path: cfg.yaml_path.clone(),
                    field: "train",
                    message: format!("split `{split}` mixes a COCO JSON with other entries: give one JSON file per split"),
                });
            };
            let image_dir = crate::config::coco_image_dir(cfg, split, json)?;
            let meta = DatasetMeta {
                names: cfg.names.clone(),
                nc: cfg.nc,
                kpt_shape: cfg.kpt_shape,
                flip_idx: cfg.flip_idx.clone(),
                kpt_oks_sigmas: cfg.kpt_oks_sigmas.clone(),
            };
            return PoseDataset::from_coco_with(json, &image_dir, split, meta, opts);
        }
        let (images, mut links_not_followed) = collect_images(entries)?;
        let mut label_files_found = 0usize;
        let mut known_labels = std::collections::HashSet::new();
        let list: Vec<Entry> = images
            .iter()
            .map(|im| {
                let lp = label_path_for(im);
                if lp.is_file() {
                    label_files_found += 1;
                }
                known_labels.insert(lp.clone());
                Entry { im_file: im.clone(), labels: LabelSource::File(lp) }
            })
            .collect();
        // label files without an image (only for folder entries)
        let mut orphans = Vec::new();
        for e in entries.iter().filter(|e| e.is_dir()) {
            let ldir = label_path_for(&e.join("x")).parent().map(Path::to_path_buf).unwrap_or_default();
            if ldir.is_dir() && ldir != *e {
                let mut walk = crate::config::Walk::default();
                walk.walk(&ldir, &|p: &Path| p.extension().is_some_and(|x| x == "txt"))?;
                let mut txts = walk.files;
                txts.sort();
                orphans.extend(txts.into_iter().filter(|t| !known_labels.contains(t)));
                links_not_followed.append(&mut walk.links_not_followed);
            }
        }
        if split == "train" && label_files_found == 0 && !images.is_empty() {
            let ldir = label_path_for(&images[0]).parent().map(Path::to_path_buf).unwrap_or_default();
            return Err(DataError::NoLabels { split: split.into(), labels_dir: ldir });
        }
        let meta = DatasetMeta {
            names: cfg.names.clone(),
            nc: cfg.nc,
            kpt_shape: cfg.kpt_shape,
            flip_idx: cfg.flip_idx.clone(),
            kpt_oks_sigmas: cfg.kpt_oks_sigmas.clone(),
        };
        Self::build_with(split, meta, list, orphans, &links_not_followed, opts)
    }

    /// Builds a dataset from entries: validates labels, decodes and prepares images (in parallel).
    pub(crate) fn build(split: &str, meta: DatasetMeta, entries: Vec<Entry>, orphans: Vec<PathBuf>, opts: &OpenOptions) -> Result<Self> {
        Self::build_with(split, meta, entries, orphans, &[], opts)
    }

    fn build_with(
        split: &str,
        meta: DatasetMeta,
        entries: Vec<Entry>,
        orphans: Vec<PathBuf>,
        links: &[PathBuf],
        opts: &OpenOptions,
    ) -> Result<Self> {
        if opts.imgsz < 32 {
            return Err(DataError::Invalid(format!("imgsz {} is too small (use ≥ 32)", opts.imgsz)));
        }
        if !(opts.fraction > 0.0 && opts.fraction <= 1.0) {
            return Err(DataError::Invalid(format!(
                "fraction {} is outside (0, 1]: the share of the split's images to use",
                opts.fraction
            )));
        }
        let mut entries = entries;
        let keep = ((entries.len() as f64 * opts.fraction).round() as usize).max(1).min(entries.len());
        entries.truncate(keep);
        let rules = LabelRules { kpt_shape: meta.kpt_shape, nc: meta.nc, single_cls: opts.single_cls };
        let run = || -> Vec<Outcome> { entries.par_iter().map(|e| process(e, &rules, opts)).collect() };
        crate::check_threads("threads", opts.threads)?;
        let outcomes = if opts.threads > 0 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(opts.threads)
                .build()
                .map_err(|e| DataError::Invalid(format!("cannot start decode threads: {e}")))?;
            pool.install(run)
        } else {
            run()
        };
        let mut report = ScanReport { found: entries.len(), ..Default::default() };
        let mut items = Vec::new();
        for o in &orphans {
            report.warnings.push(format!("{}: label file has no matching image (ignored); add the image or delete the label", o.display()));
        }
        report.orphan_labels = orphans;
        for l in links {
            report.warnings.push(format!(
                "{}: folder link not followed (it points to an enclosing folder or to one already read: a loop or the same files twice)",
                l.display()
            ));
        }
        report.links_not_followed = links.len();
        for o in outcomes {
            match o {
                Outcome::Kept(item, has_file, w) => {
                    report.warnings.extend(w);
                    if !has_file {
                        report.missing_labels += 1;
                    }
                    if item.labels.is_empty() {
                        report.background += 1;
                    }
                    report.instances += item.labels.len();
                    items.push(item);
                }
                Outcome::Skipped(s, w) => {
                    report.warnings.extend(w);
                    report.warnings.push(format!("skipped: {}", s.message));
                    report.skipped.push(s);
                }
            }
        }
        report.usable = items.len();
        if opts.verbose {
            for w in &report.warnings {
                log::warn!("ptl-data warning: {w}");
            }
            log::info!("ptl-data: {split}: {}", report.summary());
        }
        if items.is_empty() {
            return Err(DataError::EmptyDataset {
                split: split.into(),
                found: report.found,
                skipped: report.skipped.len(),
                reasons: report.skip_summary(),
            });
        }
        Ok(PoseDataset { split: split.into(), imgsz: opts.imgsz, meta, items, report })
    }

    /// Number of usable images.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True if the dataset holds no image (never true for an opened dataset).
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Keypoints per object.
    pub fn nkpt(&self) -> usize {
        self.meta.kpt_shape.k
    }

    /// The COCO person metadata (used by the COCO and synthetic sources).
    pub fn coco_person_meta() -> DatasetMeta {
        DatasetMeta {
            names: vec!["person".into()],
            nc: 1,
            kpt_shape: KptShape::COCO,
            flip_idx: Some(COCO_FLIP_IDX.to_vec()),
            kpt_oks_sigmas: crate::config::COCO_OKS_SIGMAS.to_vec(),
        }
    }
}

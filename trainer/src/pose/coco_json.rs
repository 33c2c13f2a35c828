//! `save_json=true`: a validation pass written as COCO files in original-image pixels, so that
//! pycocotools (or any COCO tool, or [`crate::metrics::coco::evaluate`]) can score it:
//! `predictions.json` (Ultralytics' `pred_to_json` for pose) and `val_gt.json` (the validation
//! split's labels as a COCO keypoints ground truth, which a YOLO-layout dataset does not have).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use ptl_data::config::COCO_KPT_NAMES;
use ptl_data::{Batch, PoseDataset};

use super::draw::COCO_SKELETON;
use crate::error::{Result, TrainerError};
use crate::metrics::coco::{
    detections_to_results, save_dataset, save_results, CocoAnnotation, CocoCategory, CocoDataset, CocoImage, CocoResult, Letterbox,
};
use crate::metrics::Detections;

/// File name of the COCO results.
pub const PREDICTIONS_FILE: &str = "predictions.json";
/// File name of the COCO ground truth of the validation split.
pub const GROUND_TRUTH_FILE: &str = "val_gt.json";
/// GT area = this × box area: the validator's OKS scale (docs/metrics.md §3), so COCOeval's OKS uses
/// the same area (a YOLO label has no segmentation to measure).
pub const AREA_FROM_BOX: f64 = 0.53;

/// What a validation pass with `save_json` wrote.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CocoJsonFiles {
    /// COCO results (`predictions.json`).
    pub predictions: PathBuf,
    /// COCO ground truth (`val_gt.json`).
    pub ground_truth: PathBuf,
    /// Detections in the results.
    pub detections: usize,
    /// Annotations in the ground truth.
    pub annotations: usize,
}

/// Image ids: the file stems when every stem is a distinct number (COCO's `000000000139.jpg` →
/// 139, as Ultralytics' `pred_to_json`), else 1-based positions in the split's file order (COCO
/// ids are integers; `file_name` in `val_gt.json` keeps the link to the image).
pub fn image_ids(ds: &PoseDataset) -> HashMap<PathBuf, i64> {
    let stems: Vec<Option<i64>> = ds
        .items
        .iter()
        .map(|it| {
            let stem = it.im_file.file_stem()?.to_str()?;
            stem.bytes().all(|b| b.is_ascii_digit()).then(|| stem.parse().ok()).flatten()
        })
        .collect();
    let distinct = stems.iter().flatten().collect::<HashSet<_>>().len() == stems.len();
    ds.items
        .iter()
        .zip(&stems)
        .enumerate()
        .map(|(i, (it, s))| (it.im_file.clone(), if distinct { s.unwrap_or(i as i64 + 1) } else { i as i64 + 1 }))
        .collect()
}

/// The COCO category list: one per class name, with the keypoint names and (17 keypoints) COCO's
/// skeleton.
fn categories(ds: &PoseDataset) -> Vec<CocoCategory> {
    let k = ds.nkpt();
    let keypoints: Vec<String> = if k == COCO_KPT_NAMES.len() {
        COCO_KPT_NAMES.iter().map(|s| s.to_string()).collect()
    } else {
        (0..k).map(|i| format!("kpt_{i}")).collect()
    };
    let skeleton: Vec<[i64; 2]> =
        if k == COCO_KPT_NAMES.len() { COCO_SKELETON.iter().map(|&(a, b)| [a as i64 + 1, b as i64 + 1]).collect() } else { Vec::new() };
    let names: Vec<String> =
        if ds.meta.names.is_empty() { (0..ds.meta.nc.max(1)).map(|i| format!("class{i}")).collect() } else { ds.meta.names.clone() };
    names
        .iter()
        .enumerate()
        .map(|(i, n)| CocoCategory {
            id: i as i64 + 1,
            name: n.clone(),
            supercategory: n.clone(),
            keypoints: keypoints.clone(),
            skeleton: skeleton.clone(),
        })
        .collect()
}

/// The split's labels as a COCO keypoints ground truth in original pixels: box `[x, y, w, h]`,
/// area = [`AREA_FROM_BOX`] × box area, `iscrowd` 0, keypoints `(x, y, v)` with unlabelled
/// ones as (0, 0, 0), `num_keypoints` = labelled keypoints; category id = class + 1.
pub fn ground_truth(ds: &PoseDataset, ids: &HashMap<PathBuf, i64>) -> Result<CocoDataset> {
    let k = ds.nkpt();
    let mut images = Vec::with_capacity(ds.len());
    let mut annotations = Vec::new();
    for it in &ds.items {
        let id = *ids.get(&it.im_file).ok_or_else(|| TrainerError::Coco(format!("no image id for {}", it.im_file.display())))?;
        let (h0, w0) = it.ori_shape;
        let file_name = it.im_file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        images.push(CocoImage { id, file_name, width: w0, height: h0 });
        let l = &it.labels;
        if l.kpts.len() != l.len() * k * 3 || l.boxes.len() != l.len() {
            return Err(TrainerError::shape("labels.kpts", &[l.len(), k, 3], l.kpts.len()));
        }
        let (w0, h0) = (f64::from(w0), f64::from(h0));
        for (j, b) in l.boxes.iter().enumerate() {
            let [cx, cy, w, h] = b.map(f64::from);
            let bbox = [(cx - w / 2.0) * w0, (cy - h / 2.0) * h0, w * w0, h * h0];
            let kp = &l.kpts[j * k * 3..(j + 1) * k * 3];
            let keypoints: Vec<f64> = kp
                .chunks_exact(3)
                .flat_map(|p| if p[2] > 0.0 { [f64::from(p[0]) * w0, f64::from(p[1]) * h0, f64::from(p[2])] } else { [0.0; 3] })
                .collect();
            annotations.push(CocoAnnotation {
                id: annotations.len() as i64 + 1,
                image_id: id,
                category_id: l.cls[j] as i64 + 1,
                iscrowd: false,
                bbox,
                area: AREA_FROM_BOX * bbox[2] * bbox[3],
                num_keypoints: Some(kp.chunks_exact(3).filter(|p| p[2] > 0.0).count() as i64),
                keypoints,
            });
        }
    }
    let mut info = serde_json::Map::new();
    info.insert("description".into(), format!("ptl validation split `{}` (labels as COCO keypoints)", ds.split).into());
    Ok(CocoDataset { info, images, annotations, categories: categories(ds) })
}

/// Collects a validation pass's detections as COCO results and writes both files at the end.
pub(crate) struct JsonWriter {
    dir: PathBuf,
    ids: HashMap<PathBuf, i64>,
    results: Vec<CocoResult>,
}

impl JsonWriter {
    /// Creates `dir` (a typed error naming it when that fails).
    pub(crate) fn new(dir: &Path, ds: &PoseDataset) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|source| TrainerError::Io { path: dir.to_path_buf(), source })?;
        Ok(JsonWriter { dir: dir.to_path_buf(), ids: image_ids(ds), results: Vec::new() })
    }

    /// Adds image `i` of `batch`: its detections (input pixels) mapped back through its letterbox.
    pub(crate) fn add(&mut self, batch: &Batch, i: usize, det: &Detections) -> Result<()> {
        let (Some(file), Some(rp), Some(&[h0, w0])) = (batch.im_file.get(i), batch.ratio_pad.get(i), batch.ori_shape.get(i)) else {
            return Err(TrainerError::InvalidArgument { what: "validation batch", reason: format!("no image {i} in the batch") });
        };
        let id = *self.ids.get(file).ok_or_else(|| TrainerError::Coco(format!("no image id for {}", file.display())))?;
        let [pad_x, pad_y] = rp.pad.unwrap_or([0.0, 0.0]);
        // scale_boxes / scale_coords with ratio_pad: gain = ratio_pad[0][0].
        let lb = Letterbox { gain: rp.ratio[0], pad_x, pad_y, orig_w: w0 as f32, orig_h: h0 as f32 };
        self.results.extend(detections_to_results(id, det, &lb, |c| c as i64 + 1)?);
        Ok(())
    }

    /// Writes `predictions.json` and `val_gt.json` into the folder.
    pub(crate) fn finish(self, ds: &PoseDataset) -> Result<CocoJsonFiles> {
        let gt = ground_truth(ds, &self.ids)?;
        let files = CocoJsonFiles {
            predictions: self.dir.join(PREDICTIONS_FILE),
            ground_truth: self.dir.join(GROUND_TRUTH_FILE),
            detections: self.results.len(),
            annotations: gt.annotations.len(),
        };
        save_results(&files.predictions, &self.results)?;
        save_dataset(&files.ground_truth, &gt)?;
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ptl_data::dataset::{DatasetMeta, Item};
    use ptl_data::image::Image;
    use ptl_data::labels::Labels;
    use ptl_data::KptShape;

    use super::*;

    /// A dataset of `files` (640 × 480 originals) with 2 keypoints per person and no people.
    fn dataset(files: &[&str]) -> PoseDataset {
        let meta =
            DatasetMeta { names: vec!["person".into()], nc: 1, kpt_shape: KptShape { k: 2, d: 3 }, flip_idx: None, kpt_oks_sigmas: vec![] };
        let items = files
            .iter()
            .map(|f| Item {
                im_file: PathBuf::from(f),
                labels: Labels::default(),
                ori_shape: (480, 640),
                image: Arc::new(Image::from_rgb(1, 1, vec![0; 3])),
            })
            .collect();
        PoseDataset { split: "val".into(), imgsz: 64, meta, items, report: Default::default() }
    }

    #[test]
    fn ids_are_numeric_stems_else_positions() {
        let ids = image_ids(&dataset(&["a/000000000139.jpg", "a/42.png"]));
        assert_eq!((ids[Path::new("a/000000000139.jpg")], ids[Path::new("a/42.png")]), (139, 42));
        let ids = image_ids(&dataset(&["a/7.jpg", "a/cat.jpg"]));
        assert_eq!((ids[Path::new("a/7.jpg")], ids[Path::new("a/cat.jpg")]), (1, 2));
        // The same number in two folders: not distinct, so positions.
        let ids = image_ids(&dataset(&["a/5.jpg", "b/5.jpg"]));
        assert_eq!((ids[Path::new("a/5.jpg")], ids[Path::new("b/5.jpg")]), (1, 2));
    }

    #[test]
    fn ground_truth_in_original_pixels() {
        let mut ds = dataset(&["v/3.jpg"]);
        // Box centred at (320, 240), 160 × 240 px; keypoint 0 labelled at (0.5, 0.25), keypoint 1 unlabelled.
        ds.items[0].labels = Labels { cls: vec![0.0], boxes: vec![[0.5, 0.5, 0.25, 0.5]], kpts: vec![0.5, 0.25, 2.0, 0.3, 0.3, 0.0] };
        let gt = ground_truth(&ds, &image_ids(&ds)).unwrap();
        assert_eq!((gt.images[0].id, gt.images[0].width, gt.images[0].height, gt.images[0].file_name.as_str()), (3, 640, 480, "3.jpg"));
        let a = &gt.annotations[0];
        assert_eq!((a.id, a.image_id, a.category_id, a.iscrowd), (1, 3, 1, false));
        assert_eq!(a.bbox, [240.0, 120.0, 160.0, 240.0]);
        assert!((a.area - 0.53 * 160.0 * 240.0).abs() < 1e-9);
        assert_eq!(a.keypoints, vec![320.0, 120.0, 2.0, 0.0, 0.0, 0.0]);
        assert_eq!(a.num_keypoints, Some(1));
        assert_eq!((gt.categories[0].keypoints.len(), gt.categories[0].skeleton.len()), (2, 0), "no COCO skeleton for 2 keypoints");
        // Written with iscrowd as 0, as COCO files are.
        let text = serde_json::to_string(&gt).unwrap();
        assert!(text.contains("\"iscrowd\":0"), "{text}");
    }
}

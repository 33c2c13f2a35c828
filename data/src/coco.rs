//! COCO keypoints JSON (`person_keypoints_*.json`) → YOLO pose labels (docs/data.md §2).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::dataset::{Entry, LabelSource, OpenOptions, PoseDataset};
use crate::error::{DataError, Result};
use crate::labels::fmt_g;

/// COCO-91 category id (1-based) → COCO-80 class; `None` for ids without a class.
const COCO91_TO_80: [Option<u8>; 91] = {
    let ids: [i16; 91] = [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, -1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, -1, 24, 25, -1, -1, 26, 27, 28, 29, 30,
        31, 32, 33, 34, 35, 36, 37, 38, 39, -1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, -1, 60, -1,
        -1, 61, -1, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, -1, 73, 74, 75, 76, 77, 78, 79, -1,
    ];
    let mut out = [None; 91];
    let mut i = 0;
    while i < 91 {
        if ids[i] >= 0 {
            out[i] = Some(ids[i] as u8);
        }
        i += 1;
    }
    out
};

#[derive(Deserialize)]
struct CocoImage {
    id: u64,
    file_name: String,
    width: f64,
    height: f64,
}

#[derive(Deserialize)]
struct CocoAnn {
    image_id: u64,
    category_id: i64,
    bbox: Vec<f64>,
    #[serde(default)]
    iscrowd: serde_json::Value,
    #[serde(default)]
    keypoints: Option<Vec<f64>>,
}

#[derive(Deserialize)]
struct CocoFile {
    images: Vec<CocoImage>,
    #[serde(default)]
    annotations: Vec<CocoAnn>,
}

/// Why COCO annotations were not used, and how many were.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CocoReport {
    /// Images in the file.
    pub images: usize,
    /// Annotations in the file.
    pub annotations: usize,
    /// Annotations that became label rows.
    pub used: usize,
    /// Skipped annotations by reason (docs/data.md §2's rules, plus malformed entries), in first-seen order.
    pub skipped: Vec<(&'static str, usize)>,
}

impl CocoReport {
    fn skip(&mut self, reason: &'static str) {
        match self.skipped.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, n)) => *n += 1,
            None => self.skipped.push((reason, 1)),
        }
    }

    /// E.g. "120 annotations, 100 used; skipped: 12 crowd, 8 no labelled keypoint".
    pub fn summary(&self) -> String {
        let skipped = if self.skipped.is_empty() {
            "none skipped".to_string()
        } else {
            format!("skipped: {}", self.skipped.iter().map(|(r, n)| format!("{n} {r}")).collect::<Vec<_>>().join(", "))
        };
        format!("{} images, {} annotations, {} used; {skipped}", self.images, self.annotations, self.used)
    }
}

/// One image of a converted COCO file: its file name and its label text (`None` = no annotation → no label file).
#[derive(Clone, Debug, PartialEq)]
pub struct CocoLabel {
    /// The image's `file_name`.
    pub file_name: String,
    /// Its YOLO label text (`None`: no annotation, so no label file).
    pub text: Option<String>,
}

fn is_crowd(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::Number(n) => n.as_f64().unwrap_or(0.0) != 0.0,
        _ => false,
    }
}

/// Converts COCO keypoint JSON text into per-image YOLO label text, in the JSON's image order
/// (17 keypoints per annotation).
pub fn convert_coco_text(json: &str, json_path: &Path) -> Result<Vec<CocoLabel>> {
    Ok(convert_coco_counted(json, json_path, 17)?.0)
}

/// [`convert_coco_text`] for `nkpt` keypoints, with every annotation that was not used counted by
/// reason.
pub fn convert_coco_counted(json: &str, json_path: &Path, nkpt: usize) -> Result<(Vec<CocoLabel>, CocoReport)> {
    let file: CocoFile = serde_json::from_str(json).map_err(|e| DataError::Json {
        path: json_path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let mut report = CocoReport { images: file.images.len(), annotations: file.annotations.len(), ..Default::default() };
    let known: std::collections::HashSet<u64> = file.images.iter().map(|im| im.id).collect();
    let mut by_image: HashMap<u64, Vec<&CocoAnn>> = HashMap::new();
    for a in &file.annotations {
        if known.contains(&a.image_id) {
            by_image.entry(a.image_id).or_default().push(a);
        } else {
            report.skip("no image with that image_id");
        }
    }
    let mut out = Vec::with_capacity(file.images.len());
    for im in &file.images {
        let Some(anns) = by_image.get(&im.id) else {
            out.push(CocoLabel { file_name: im.file_name.clone(), text: None });
            continue;
        };
        let (w, h) = (im.width, im.height);
        let mut rows: Vec<Vec<f64>> = Vec::new();
        let mut boxes: Vec<Vec<f64>> = Vec::new();
        for a in anns {
            if is_crowd(&a.iscrowd) {
                report.skip("crowd");
                continue;
            }
            if !(w > 0.0 && h > 0.0 && w.is_finite() && h.is_finite()) {
                report.skip("image without a valid width/height");
                continue;
            }
            if a.bbox.len() != 4 || a.bbox.iter().any(|v| !v.is_finite()) {
                report.skip("bbox is not 4 finite numbers");
                continue;
            }
            let bw = a.bbox[2] / w;
            let bh = a.bbox[3] / h;
            let cx = (a.bbox[0] + a.bbox[2] / 2.0) / w;
            let cy = (a.bbox[1] + a.bbox[3] / 2.0) / h;
            if bw <= 0.0 || bh <= 0.0 {
                report.skip("empty box");
                continue;
            }
            let Some(cls) = usize::try_from(a.category_id - 1).ok().and_then(|i| COCO91_TO_80.get(i).copied().flatten()) else {
                report.skip("category_id without a COCO class");
                continue;
            };
            let Some(kp) = &a.keypoints else {
                report.skip("no keypoints field");
                continue;
            };
            if kp.len() != nkpt * 3 || kp.iter().any(|v| !v.is_finite()) {
                report.skip("keypoints not 3·K finite numbers");
                continue;
            }
            if kp.chunks(3).all(|p| p[2] == 0.0) {
                report.skip("no labelled keypoint");
                continue;
            }
            let bx = vec![cls as f64, cx, cy, bw, bh];
            if boxes.contains(&bx) {
                report.skip("duplicate");
                continue;
            }
            report.used += 1;
            let mut row = bx.clone();
            boxes.push(bx);
            for p in kp.chunks(3) {
                row.extend_from_slice(&[p[0] / w, p[1] / h, p[2]]);
            }
            rows.push(row);
        }
        let mut text = String::new();
        for r in rows {
            let line: Vec<String> = r.iter().map(|&v| fmt_g(v)).collect();
            text.push_str(&line.join(" "));
            text.push('\n');
        }
        out.push(CocoLabel { file_name: im.file_name.clone(), text: Some(text) });
    }
    Ok((out, report))
}

/// Writes the converted labels as `<labels_dir>/<file stem>.txt` (only for images with annotations).
pub fn convert_coco_file(json_path: &Path, labels_dir: &Path) -> Result<usize> {
    let text = ptl_files::read_to_string(json_path)?;
    let labels = convert_coco_text(&text, json_path)?;
    std::fs::create_dir_all(labels_dir).map_err(|e| DataError::io(labels_dir, e))?;
    let mut n = 0;
    for l in labels {
        if let Some(t) = l.text {
            let stem = Path::new(&l.file_name).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let p = labels_dir.join(format!("{stem}.txt"));
            std::fs::write(&p, t).map_err(|e| DataError::io(&p, e))?;
            n += 1;
        }
    }
    Ok(n)
}

impl PoseDataset {
    /// Opens a COCO keypoints JSON with its image folder (`image_dir/<file_name>`), converting labels in memory.
    pub fn from_coco(json_path: &Path, image_dir: &Path, split: &str, opts: &OpenOptions) -> Result<Self> {
        Self::from_coco_with(json_path, image_dir, split, PoseDataset::coco_person_meta(), opts)
    }

    /// [`PoseDataset::from_coco`] with the dataset's own metadata (names, keypoints, flips). Every
    /// annotation that cannot be used is counted by reason in the report; a split left with no
    /// usable annotation at all is an error.
    pub fn from_coco_with(
        json_path: &Path,
        image_dir: &Path,
        split: &str,
        meta: crate::dataset::DatasetMeta,
        opts: &OpenOptions,
    ) -> Result<Self> {
        if !image_dir.is_dir() {
            return Err(DataError::MissingPath { path: image_dir.to_path_buf(), what: "COCO image folder" });
        }
        let text = ptl_files::read_to_string(json_path)?;
        let (labels, report) = convert_coco_counted(&text, json_path, meta.kpt_shape.k)?;
        if opts.verbose {
            log::info!("ptl-data: {split}: COCO {}: {}", json_path.display(), report.summary());
        }
        if report.used == 0 {
            return Err(DataError::NoUsableAnnotations { path: json_path.to_path_buf(), summary: report.summary() });
        }
        let mut entries: Vec<Entry> = labels
            .into_iter()
            .map(|l| {
                let im_file = image_dir.join(&l.file_name);
                let lp = PathBuf::from(format!("{}#{}", json_path.display(), l.file_name));
                Entry { im_file, labels: LabelSource::Text(l.text, lp) }
            })
            .collect();
        entries.sort_by(|a, b| a.im_file.to_string_lossy().cmp(&b.im_file.to_string_lossy()));
        let mut ds = PoseDataset::build(split, meta, entries, Vec::new(), opts)?;
        for (reason, n) in &report.skipped {
            ds.report.warnings.push(format!("{}: {n} annotations skipped: {reason}", json_path.display()));
        }
        ds.report.coco = Some(report);
        Ok(ds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kp(v: f64) -> String {
        let mut s = Vec::new();
        for j in 0..17 {
            s.push(format!("{}, 20, {v}", 10 + j));
        }
        s.join(", ")
    }

    #[test]
    fn conversion_rules() {
        let json = format!(
            r#"{{"images": [{{"id": 1, "file_name": "a.jpg", "width": 200, "height": 100}},
                           {{"id": 2, "file_name": "b.jpg", "width": 200, "height": 100}},
                           {{"id": 3, "file_name": "c.jpg", "width": 200, "height": 100}}],
                "annotations": [
                  {{"image_id": 1, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 0, "keypoints": [{k2}], "num_keypoints": 17}},
                  {{"image_id": 1, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 0, "keypoints": [{k2}]}},
                  {{"image_id": 1, "category_id": 1, "bbox": [0, 0, 50, 50], "iscrowd": 1, "keypoints": [{k2}]}},
                  {{"image_id": 1, "category_id": 1, "bbox": [0, 0, 0, 50], "iscrowd": 0, "keypoints": [{k2}]}},
                  {{"image_id": 1, "category_id": 1, "bbox": [5, 5, 50, 50], "iscrowd": 0, "keypoints": [{k0}]}},
                  {{"image_id": 2, "category_id": 1, "bbox": [5, 5, 50, 50], "iscrowd": 1, "keypoints": [{k2}]}}
                ],
                "categories": [{{"id": 1, "name": "person"}}]}}"#,
            k2 = kp(2.0),
            k0 = kp(0.0)
        );
        let out = convert_coco_text(&json, Path::new("p.json")).unwrap();
        assert_eq!(out.len(), 3);
        let a = out[0].text.as_deref().unwrap();
        assert_eq!(a.lines().count(), 1, "{a}");
        assert!(a.starts_with("0 0.125 0.4 0.15 0.4 0.05 0.2 2 0.055 0.2 2"), "{a}");
        assert_eq!(out[1].text.as_deref(), Some("")); // all annotations skipped → empty file
        assert_eq!(out[2].text, None); // no annotation → background, no file
    }

    #[test]
    fn broken_json_has_location() {
        let e = convert_coco_text("{\"images\": [\n  {\"id\": 1,,}\n]}", Path::new("k.json")).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("k.json:2:"), "{s}");
    }
}

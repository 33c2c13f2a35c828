//! COCO ground-truth / results JSON (de)serialisation and Ultralytics' `pred_to_json` export.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Result, TrainerError};
use crate::metrics::types::Detections;

/// One image entry of a COCO dataset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CocoImage {
    /// Image id.
    pub id: i64,
    /// File name (informational).
    #[serde(default)]
    pub file_name: String,
    /// Original width.
    #[serde(default)]
    pub width: u32,
    /// Original height.
    #[serde(default)]
    pub height: u32,
}

/// One GT annotation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CocoAnnotation {
    /// Annotation id (COCOeval stores it in the match tables; must be non-zero to count as a match).
    pub id: i64,
    /// Image id.
    pub image_id: i64,
    /// Category id.
    pub category_id: i64,
    /// Crowd region (0/1 or bool in the file).
    #[serde(default, deserialize_with = "int_or_bool", serialize_with = "bool_as_int")]
    pub iscrowd: bool,
    /// Box `[x, y, w, h]` in original pixels.
    pub bbox: [f64; 4],
    /// Area used for area ranges and OKS scale.
    pub area: f64,
    /// `3·K` keypoints (x, y, v); empty for non-keypoint datasets.
    #[serde(default)]
    pub keypoints: Vec<f64>,
    /// Labelled keypoints; COCOeval ignores keypoint GTs with 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_keypoints: Option<i64>,
}

/// A category.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CocoCategory {
    /// Category id.
    pub id: i64,
    /// Name.
    #[serde(default)]
    pub name: String,
    /// Supercategory (COCO tools print it; empty is left out).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub supercategory: String,
    /// Keypoint names, in label order (keypoint datasets).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keypoints: Vec<String>,
    /// Limbs as 1-based keypoint index pairs (COCO's convention).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skeleton: Vec<[i64; 2]>,
}

/// A COCO ground-truth file (unknown fields such as `licenses` are ignored).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CocoDataset {
    /// Free-form description (pycocotools' `info()` prints it).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub info: serde_json::Map<String, serde_json::Value>,
    /// Images.
    pub images: Vec<CocoImage>,
    /// Annotations.
    #[serde(default)]
    pub annotations: Vec<CocoAnnotation>,
    /// Categories.
    pub categories: Vec<CocoCategory>,
}

/// One detection in COCO results format (what `pred_to_json` writes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CocoResult {
    /// Image id.
    pub image_id: i64,
    /// Category id.
    pub category_id: i64,
    /// `[x, y, w, h]` rounded to 3 decimals; may be empty for keypoint-only results.
    #[serde(default)]
    pub bbox: Vec<f64>,
    /// Score rounded to 5 decimals.
    pub score: f64,
    /// `3·K` keypoints (x, y, predicted visibility).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keypoints: Vec<f64>,
}

fn int_or_bool<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<bool, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum IntOrBool {
        B(bool),
        I(i64),
    }
    Ok(match IntOrBool::deserialize(d)? {
        IntOrBool::B(b) => b,
        IntOrBool::I(i) => i != 0,
    })
}

/// COCO files write `iscrowd` as 0/1.
fn bool_as_int<S: serde::Serializer>(v: &bool, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_u8(u8::from(*v))
}

fn json_err(path: &Path, e: serde_json::Error) -> TrainerError {
    TrainerError::Json { path: path.to_path_buf(), line: e.line(), column: e.column(), msg: e.to_string() }
}

fn read(path: &Path) -> Result<String> {
    Ok(ptl_files::read_to_string(path)?)
}

/// Parse a COCO GT document; `origin` names it in errors.
pub fn parse_dataset(text: &str, origin: &Path) -> Result<CocoDataset> {
    serde_json::from_str(text).map_err(|e| json_err(origin, e))
}

/// Parse a COCO results document (a JSON array).
pub fn parse_results(text: &str, origin: &Path) -> Result<Vec<CocoResult>> {
    serde_json::from_str(text).map_err(|e| json_err(origin, e))
}

/// Load a COCO GT file.
pub fn load_dataset(path: impl AsRef<Path>) -> Result<CocoDataset> {
    let p = path.as_ref();
    parse_dataset(&read(p)?, p)
}

/// Load a COCO results file.
pub fn load_results(path: impl AsRef<Path>) -> Result<Vec<CocoResult>> {
    let p = path.as_ref();
    parse_results(&read(p)?, p)
}

/// Write results as a JSON array.
pub fn save_results(path: impl AsRef<Path>, results: &[CocoResult]) -> Result<()> {
    let p: PathBuf = path.as_ref().to_path_buf();
    let text = serde_json::to_string(results).map_err(|e| json_err(&p, e))?;
    Ok(ptl_files::write_atomic(&p, text.as_bytes(), 0o644)?)
}

/// Write a COCO ground-truth file.
pub fn save_dataset(path: impl AsRef<Path>, dataset: &CocoDataset) -> Result<()> {
    let p: PathBuf = path.as_ref().to_path_buf();
    let text = serde_json::to_string(dataset).map_err(|e| json_err(&p, e))?;
    Ok(ptl_files::write_atomic(&p, text.as_bytes(), 0o644)?)
}

/// Python's `round(x, n)`: correctly rounded to `n` decimals, ties to even (Rust's formatter does
/// exactly this), read back as the nearest f64.
pub fn py_round(x: f64, n: usize) -> f64 {
    format!("{x:.n$}").parse().unwrap_or(x)
}

/// Undo the letterbox: input pixels → original image pixels (`scale_boxes` / `scale_coords`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Letterbox {
    /// Resize gain (input / original).
    pub gain: f32,
    /// Horizontal padding in input pixels.
    pub pad_x: f32,
    /// Vertical padding in input pixels.
    pub pad_y: f32,
    /// Original image width.
    pub orig_w: f32,
    /// Original image height.
    pub orig_h: f32,
}

impl Letterbox {
    /// No resize, no padding.
    pub fn identity(width: f32, height: f32) -> Self {
        Letterbox { gain: 1.0, pad_x: 0.0, pad_y: 0.0, orig_w: width, orig_h: height }
    }

    fn x(&self, v: f32) -> f32 {
        ((v - self.pad_x) / self.gain).clamp(0.0, self.orig_w)
    }

    fn y(&self, v: f32) -> f32 {
        ((v - self.pad_y) / self.gain).clamp(0.0, self.orig_h)
    }
}

/// Ultralytics `pred_to_json` for one image: map to original pixels, xyxy → `[x, y, w, h]`
/// rounded to 3 decimals, score rounded to 5, keypoints unrounded with predicted visibility,
/// `category_id = class_map(class)`.
pub fn detections_to_results(
    image_id: i64,
    det: &Detections,
    letterbox: &Letterbox,
    class_map: impl Fn(usize) -> i64,
) -> Result<Vec<CocoResult>> {
    det.validate()?;
    let lb = letterbox;
    let finite = [lb.pad_x, lb.pad_y, lb.orig_w, lb.orig_h].iter().all(|v| v.is_finite());
    if !(finite && lb.gain.is_finite() && lb.gain > 0.0) {
        return Err(TrainerError::InvalidArgument {
            what: "letterbox",
            reason: format!("gain must be finite and > 0 and pads/sizes finite, got {lb:?}"),
        });
    }
    let nk3 = det.nk * 3;
    let mut out = Vec::with_capacity(det.len());
    for i in 0..det.len() {
        let b = det.boxes[i];
        let (x1, y1, x2, y2) = (letterbox.x(b[0]), letterbox.y(b[1]), letterbox.x(b[2]), letterbox.y(b[3]));
        // xyxy2xywh then `xy -= wh / 2`, in float32 like the reference tensor ops.
        let (w, h) = (x2 - x1, y2 - y1);
        let (cx, cy) = ((x1 + x2) / 2.0, (y1 + y2) / 2.0);
        let bbox = [cx - w / 2.0, cy - h / 2.0, w, h].iter().map(|&v| py_round(f64::from(v), 3)).collect();
        let kp = &det.keypoints[i * nk3..(i + 1) * nk3];
        let keypoints = kp.chunks_exact(3).flat_map(|k| [letterbox.x(k[0]), letterbox.y(k[1]), k[2]]).map(f64::from).collect();
        out.push(CocoResult {
            image_id,
            category_id: class_map(det.classes[i]),
            bbox,
            score: py_round(f64::from(det.scores[i]), 5),
            keypoints,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_round() {
        assert_eq!(py_round(0.0625, 3), 0.062);
        assert_eq!(py_round(2.5, 0), 2.0);
        assert_eq!(py_round(421.40899658203125, 3), 421.409);
    }

    #[test]
    fn malformed_json_has_location() {
        let e = parse_results("[\n {\"image_id\": 1,,}]", Path::new("x.json")).unwrap_err();
        match e {
            TrainerError::Json { line, .. } => assert_eq!(line, 2),
            other => panic!("unexpected {other:?}"),
        }
    }
}

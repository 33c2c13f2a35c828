//! COCO-style evaluation (pycocotools `COCOeval`, iouType "bbox" and "keypoints") and COCO JSON I/O.
//!
//! Used for standalone validation with JSON saving (docs/metrics.md §7); training-time validation uses
//! [`crate::metrics::PoseValidator`] instead.

pub mod eval;
pub mod json;

pub use eval::{evaluate, CocoEvalResult, EvalParams, IouType};
pub use json::{
    detections_to_results, load_dataset, load_results, parse_dataset, parse_results, py_round, save_dataset, save_results, CocoAnnotation,
    CocoCategory, CocoDataset, CocoImage, CocoResult, Letterbox,
};

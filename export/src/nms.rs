//! Non-maximum suppression inside the graph (`nms=True`): the one-to-many decode followed by
//! what `metrics::nms::non_max_suppression` does with one label per box (Ultralytics' exported
//! `NMSModel`) — each anchor's best class above `conf`, class-aware suppression above `iou`, the
//! `max_det` highest scores of each image — as one `(B, max_det, 6 + K·D)` tensor of rows
//! `[x1, y1, x2, y2, score, class, keypoints…]`, zero-padded after an image's last detection.
//!
//! ONNX has no per-image loop without control flow, so the images are handled together: the
//! kept boxes of all images are sorted by `score − 2·image` (image 0 first, scores descending
//! within an image; scores lie in [0, 1]), ranked inside their image through a running count,
//! and scattered into the padded output at (image, rank).

use crate::emit::{Emitter, ONNX_FLOAT};
use crate::graph::AttrValue;

/// The thresholds of the suppression.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NmsSettings {
    /// A box needs a best class score strictly above this (Ultralytics' export default 0.25).
    pub conf: f32,
    /// A box is suppressed when its IoU with a kept higher-scoring box of its class is strictly above this.
    pub iou: f32,
    /// Detections kept per image (rows of the output).
    pub max_det: usize,
}

fn axis(a: i64) -> Vec<(&'static str, AttrValue)> {
    vec![("axis", AttrValue::Int(a))]
}

impl Emitter {
    /// `x[:, i]` of a `(N, 3)` index table as `(N,)`.
    fn column(&mut self, x: &str, i: i64, name: &str) -> String {
        let idx = self.g.const_i64_scalar(i);
        self.g.op("Gather", name, &[x, &idx], axis(1))
    }

    /// `(N,)` and `(N,)` index vectors as one `(N, 2)` table.
    fn pair(&mut self, a: &str, b: &str, name: &str) -> String {
        let a2 = self.unsqueeze(a, 1, &format!("{name}.first"));
        let b2 = self.unsqueeze(b, 1, &format!("{name}.second"));
        self.g.op("Concat", name, &[&a2, &b2], axis(1))
    }

    /// `decoded` `(B, 4 + nc + K·D, A)` (xywh px, scores, keypoints) → the graph output `output`
    /// `(B, max_det, 6 + K·D)`, see the module docs.
    pub fn nms(&mut self, decoded: &str, nc: usize, kd: usize, s: &NmsSettings, output: &str) -> String {
        let (nc, kd) = (nc as i64, kd as i64);
        let width = 6 + kd;
        let decoded = self.in_f32(decoded, "nms.decoded_f32");
        let rows = self.g.op("Transpose", "nms.by_anchor", &[&decoded], vec![("perm", AttrValue::Ints(vec![0, 2, 1]))]);
        let split = self.g.const_i64(&[4, nc, kd]);
        let parts = self.g.op_n("Split", "nms.parts", &[&rows, &split], 3, axis(2));
        let (xywh, scores, kpts) = (&parts[0], &parts[1], &parts[2]);
        // Corners as the reference computes them: centre ∓ size / 2.
        let halves = self.g.const_i64(&[2, 2]);
        let cw = self.g.op_n("Split", "nms.centre_size", &[xywh, &halves], 2, axis(2));
        let two = self.g.const_f32_param(2.0);
        let half = self.g.op("Div", "nms.half_size", &[&cw[1], &two], vec![]);
        let x1y1 = self.g.op("Sub", "nms.x1y1", &[&cw[0], &half], vec![]);
        let x2y2 = self.g.op("Add", "nms.x2y2", &[&cw[0], &half], vec![]);
        let boxes = self.g.op("Concat", "nms.boxes", &[&x1y1, &x2y2], axis(2));
        // One label per box: its first best class keeps its score, the others 0.
        let best = self.g.op("ArgMax", "nms.best_class", &[scores], vec![("axis", AttrValue::Int(2)), ("keepdims", AttrValue::Int(1))]);
        let classes = self.g.const_i64_shaped(&[1, 1, nc], (0..nc).collect());
        let is_best = self.g.op("Equal", "nms.is_best_class", &[&classes, &best], vec![]);
        let zero = self.g.const_f32_param(0.0);
        let single = self.g.op("Where", "nms.single_label", &[&is_best, scores, &zero], vec![]);
        let by_class = self.g.op("Transpose", "nms.scores_by_class", &[&single], vec![("perm", AttrValue::Ints(vec![0, 2, 1]))]);
        let max_out = self.g.const_i64(&[s.max_det as i64]);
        let iou = self.g.init_f32_param("nms.iou_threshold", &[1], vec![s.iou]);
        let conf = self.g.init_f32_param("nms.score_threshold", &[1], vec![s.conf]);
        let selected = self.g.op("NonMaxSuppression", "nms.selected", &[&boxes, &by_class, &max_out, &iou, &conf], vec![]);
        // Image, class and anchor of each kept box, and its score.
        let score = self.g.op("GatherND", "nms.kept_score", &[&by_class, &selected], vec![]);
        let image = self.column(&selected, 0, "nms.kept_image");
        // Sorted by image, then score descending.
        let image_f = self.g.op("Cast", "nms.kept_image_float", &[&image], vec![("to", AttrValue::Int(ONNX_FLOAT))]);
        let image_key = self.g.op("Mul", "nms.image_key", &[&image_f, &two], vec![]);
        let key = self.g.op("Sub", "nms.sort_key", &[&score, &image_key], vec![]);
        let count = self.g.op("Shape", "nms.kept_count", &[&key], vec![]);
        let order = self.g.op_n(
            "TopK",
            "nms.order",
            &[&key, &count],
            2,
            vec![("axis", AttrValue::Int(0)), ("largest", AttrValue::Int(1)), ("sorted", AttrValue::Int(1))],
        );
        let sorted = self.g.op("Gather", "nms.sorted", &[&selected, &order[1]], axis(0));
        let score_s = self.g.op("Gather", "nms.sorted_score", &[&score, &order[1]], axis(0));
        let (image_s, class_s, anchor_s) = (
            self.column(&sorted, 0, "nms.sorted_image"),
            self.column(&sorted, 1, "nms.sorted_class"),
            self.column(&sorted, 2, "nms.sorted_anchor"),
        );
        // Rank inside the image: position − the number of earlier images' boxes.
        let batch = self.batch_size(&decoded, "nms.batch");
        let off_on = self.g.const_i64(&[0, 1]);
        let one_hot = self.g.op("OneHot", "nms.image_one_hot", &[&image_s, &batch, &off_on], vec![("axis", AttrValue::Int(-1))]);
        let axis0 = self.g.const_i64(&[0]);
        let per_image = self.g.op("ReduceSum", "nms.per_image", &[&one_hot, &axis0], vec![("keepdims", AttrValue::Int(0))]);
        let axis0_scalar = self.g.const_i64_scalar(0);
        let first = self.g.op("CumSum", "nms.first_of_image", &[&per_image, &axis0_scalar], vec![("exclusive", AttrValue::Int(1))]);
        let start = self.g.op("Gather", "nms.image_start", &[&first, &image_s], axis(0));
        let (zero_i, one_i) = (self.g.const_i64_scalar(0), self.g.const_i64_scalar(1));
        let count_scalar = self.g.op("Squeeze", "nms.kept_count_scalar", &[&count, &axis0], vec![]);
        let position = self.g.op("Range", "nms.position", &[&zero_i, &count_scalar, &one_i], vec![]);
        let rank = self.g.op("Sub", "nms.rank", &[&position, &start], vec![]);
        // The first max_det of each image.
        let limit = self.g.const_i64_scalar(s.max_det as i64);
        let within = self.g.op("Less", "nms.within_max_det", &[&rank, &limit], vec![]);
        let keep = self.g.op("NonZero", "nms.keep", &[&within], vec![]);
        let keep = self.g.op("Squeeze", "nms.keep_index", &[&keep, &axis0], vec![]);
        let pick = |e: &mut Emitter, x: &str, name: &str| e.g.op("Gather", name, &[x, &keep], axis(0));
        let (image_k, class_k, anchor_k, score_k, rank_k) = (
            pick(self, &image_s, "nms.out_image"),
            pick(self, &class_s, "nms.out_class"),
            pick(self, &anchor_s, "nms.out_anchor"),
            pick(self, &score_s, "nms.out_score"),
            pick(self, &rank, "nms.out_rank"),
        );
        // Their rows, scattered into the zero-padded output.
        let at = self.pair(&image_k, &anchor_k, "nms.out_at");
        let box_k = self.g.op("GatherND", "nms.out_box", &[&boxes, &at], vec![]);
        let kpt_k = self.g.op("GatherND", "nms.out_keypoints", &[kpts, &at], vec![]);
        let score_col = self.unsqueeze(&score_k, 1, "nms.out_score_column");
        let class_f = self.g.op("Cast", "nms.out_class_float", &[&class_k], vec![("to", AttrValue::Int(ONNX_FLOAT))]);
        let class_col = self.unsqueeze(&class_f, 1, "nms.out_class_column");
        let out_rows = self.g.op("Concat", "nms.out_rows", &[&box_k, &score_col, &class_col, &kpt_k], axis(1));
        let det_width = self.g.const_i64(&[s.max_det as i64, width]);
        let shape = self.g.op("Concat", "nms.out_shape", &[&batch, &det_width], axis(0));
        let zeros = self.g.op("ConstantOfShape", "nms.zeros", &[&shape], vec![]);
        let slot = self.pair(&image_k, &rank_k, "nms.out_slot");
        self.in_output_precision(output, |e, name| e.g.op("ScatterND", name, &[&zeros, &slot, &out_rows], vec![]))
    }

    /// The batch size of `x` as a 1-D `[B]` tensor.
    pub fn batch_size(&mut self, x: &str, name: &str) -> String {
        let shape = self.g.op("Shape", &format!("{name}.shape"), &[x], vec![]);
        let first = self.g.const_i64(&[0]);
        self.g.op("Gather", name, &[&shape, &first], axis(0))
    }
}

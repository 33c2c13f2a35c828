//! The `Pose26` head as `PoseModel::predict` runs it in eval: the one-to-many stems (box, class,
//! point + keypoint view; no sigma views), flattened per level and concatenated P3, P4, P5, then
//! decoded to pixels with the anchors and strides stored as initializers (`decode.rs`'s formulas,
//! in its order of operations).

use ptl_autograd::{DType, Device};
use ptl_heads::{make_anchors, Branch, Pose26};

use crate::emit::{Emitter, Value, ONNX_FLOAT, ONNX_FLOAT16};
use crate::graph::AttrValue;
use crate::{ExportError, Result};

/// The anchor tables of the exported size: centres `(1, 2, A)`, strides `(1, 1, A)`, and A.
struct Anchors {
    centres: String,
    strides: String,
    count: usize,
}

/// Raw outputs of the branch, `(B, C, A)` each.
struct RawBranch {
    boxes: String,
    scores: String,
    kpts: String,
}

impl Emitter {
    /// A `(B, c, h, w)` map as `(B, c, h·w)`.
    fn flatten(&mut self, x: &Value, name: &str) -> String {
        let n = self.positions(x);
        self.reshape(&x.name, &[0, x.c as i64, n], name)
    }

    fn concat_anchors(&mut self, parts: &[String], name: &str) -> String {
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        self.g.op("Concat", name, &refs, vec![("axis", AttrValue::Int(2))])
    }

    fn branch(&mut self, head: &Pose26, branch: Branch, feats: &[Value], prefix: &str) -> Result<RawBranch> {
        let set = head.set(branch);
        let p = branch.attr_prefix();
        let (mut boxes, mut scores, mut kpts) = (Vec::new(), Vec::new(), Vec::new());
        for (i, x) in feats.iter().enumerate() {
            let missing = || ExportError::unsupported(prefix, format!("no stems for level {i}"));
            let b = set.box_stems.get(i).ok_or_else(missing)?;
            let n = format!("{prefix}.{p}cv2.{i}");
            let y = self.conv(&b.conv0, x, &format!("{n}.0"))?;
            let y = self.conv(&b.conv1, &y, &format!("{n}.1"))?;
            let y = self.conv2d(&b.pred, &y, &format!("{n}.2"))?;
            boxes.push(self.flatten(&y, &format!("{n}.flat")));

            let c = set.class_stems.get(i).ok_or_else(missing)?;
            let n = format!("{prefix}.{p}cv3.{i}");
            let y = self.conv(&c.dw0, x, &format!("{n}.0.0"))?;
            let y = self.conv(&c.pw0, &y, &format!("{n}.0.1"))?;
            let y = self.conv(&c.dw1, &y, &format!("{n}.1.0"))?;
            let y = self.conv(&c.pw1, &y, &format!("{n}.1.1"))?;
            let y = self.conv2d(&c.pred, &y, &format!("{n}.2"))?;
            scores.push(self.flatten(&y, &format!("{n}.flat")));

            let s = set.point_stems.get(i).ok_or_else(missing)?;
            let view = set.kpt_views.get(i).ok_or_else(missing)?;
            let n = format!("{prefix}.{p}cv4.{i}");
            let y = self.conv(&s.conv0, x, &format!("{n}.0"))?;
            let y = self.conv(&s.conv1, &y, &format!("{n}.1"))?;
            let y = self.conv2d(view, &y, &format!("{prefix}.{p}cv4_kpts.{i}"))?;
            kpts.push(self.flatten(&y, &format!("{prefix}.{p}cv4_kpts.{i}.flat")));
        }
        Ok(RawBranch {
            boxes: self.concat_anchors(&boxes, &format!("{prefix}.{p}boxes")),
            scores: self.concat_anchors(&scores, &format!("{prefix}.{p}scores")),
            kpts: self.concat_anchors(&kpts, &format!("{prefix}.{p}kpts")),
        })
    }

    /// The anchor centres `(1, 2, A)` (grid units: the x row, then the y row) and strides
    /// `(1, 1, A)` of these feature maps, as initializers.
    fn anchor_tables(&mut self, head: &Pose26, feats: &[Value]) -> Result<Anchors> {
        if self.dynamic {
            return self.anchor_tables_at_run_time(head, feats);
        }
        let sizes: Vec<(usize, usize)> = feats.iter().map(|f| (f.h, f.w)).collect();
        let a: usize = sizes.iter().map(|(h, w)| h * w).sum();
        let (anchors, strides) = make_anchors(&sizes, &head.strides, 0.5, DType::F32, Device::Cpu)?;
        let xy = anchors.to_vec::<f32>()?;
        // (A, 2) row-major → (1, 2, A): broadcasts over (B, K, 2, A) too.
        let rows: Vec<f32> = (0..2).flat_map(|j| (0..a).map(move |i| (i, j))).map(|(i, j)| xy[2 * i + j]).collect();
        let anc = self.g.init_f32("anchors", &[1, 2, a], rows);
        let st = self.g.init_f32("anchor_strides", &[1, 1, a], strides.to_vec::<f32>()?);
        Ok(Anchors { centres: anc, strides: st, count: a })
    }

    /// [`Self::anchor_tables`] computed from the feature maps' shapes when the file runs (any
    /// height and width): per level `(x + 0.5, y + 0.5)` over its `h × w` grid, row-major, and
    /// its stride — `make_anchors` with offset 0.5, the same values.
    fn anchor_tables_at_run_time(&mut self, head: &Pose26, feats: &[Value]) -> Result<Anchors> {
        let axis = |a: i64| vec![("axis", AttrValue::Int(a))];
        let (zero, one) = (self.g.const_i64_scalar(0), self.g.const_i64_scalar(1));
        let half = self.g.const_f32_param(0.5);
        let (mut centres, mut strides) = (Vec::new(), Vec::new());
        for (i, f) in feats.iter().enumerate() {
            let n = format!("anchors.{i}");
            let stride = *head.strides.get(i).ok_or_else(|| ExportError::unsupported("anchors", format!("no stride for level {i}")))?;
            let shape = self.g.op("Shape", &format!("{n}.shape"), &[&f.name], vec![]);
            let (hi, wi) = (self.g.const_i64_scalar(2), self.g.const_i64_scalar(3));
            let h = self.g.op("Gather", &format!("{n}.h"), &[&shape, &hi], axis(0));
            let w = self.g.op("Gather", &format!("{n}.w"), &[&shape, &wi], axis(0));
            let cell = |e: &mut Emitter, len: &str, what: &str| {
                let r = e.g.op("Range", &format!("{n}.{what}_index"), &[&zero, len, &one], vec![]);
                let r = e.g.op("Cast", &format!("{n}.{what}_float"), &[&r], vec![("to", AttrValue::Int(ONNX_FLOAT))]);
                e.g.op("Add", &format!("{n}.{what}"), &[&r, &half], vec![])
            };
            let (xs, ys) = (cell(self, &w, "x"), cell(self, &h, "y"));
            let h1 = self.unsqueeze(&h, 0, &format!("{n}.h_1d"));
            let w1 = self.unsqueeze(&w, 0, &format!("{n}.w_1d"));
            let hw = self.g.op("Concat", &format!("{n}.hw"), &[&h1, &w1], axis(0));
            let xs2 = self.unsqueeze(&xs, 0, &format!("{n}.x_row"));
            let ys2 = self.unsqueeze(&ys, 1, &format!("{n}.y_column"));
            let gx = self.g.op("Expand", &format!("{n}.grid_x"), &[&xs2, &hw], vec![]);
            let gy = self.g.op("Expand", &format!("{n}.grid_y"), &[&ys2, &hw], vec![]);
            let gx = self.reshape(&gx, &[1, -1], &format!("{n}.grid_x_flat"));
            let gy = self.reshape(&gy, &[1, -1], &format!("{n}.grid_y_flat"));
            centres.push(self.g.op("Concat", &format!("{n}.centres"), &[&gx, &gy], axis(0)));
            let s = self.g.init_f32_param(&format!("{n}.stride"), &[1, 1], vec![stride as f32]);
            let positions = self.g.op("Shape", &format!("{n}.positions"), &[&gx], vec![]);
            strides.push(self.g.op("Expand", &format!("{n}.strides"), &[&s, &positions], vec![]));
        }
        let (centre_refs, stride_refs): (Vec<&str>, Vec<&str>) =
            (centres.iter().map(String::as_str).collect(), strides.iter().map(String::as_str).collect());
        let centres = self.g.op("Concat", "anchors.centres", &centre_refs, axis(1));
        let strides = self.g.op("Concat", "anchors.all_strides", &stride_refs, axis(1));
        let centres = self.unsqueeze(&centres, 0, "anchors_f32");
        let strides = self.unsqueeze(&strides, 0, "anchor_strides_f32");
        // In the model's precision.
        let to = if self.half { ONNX_FLOAT16 } else { ONNX_FLOAT };
        let centres = self.g.op("Cast", "anchors", &[&centres], vec![("to", AttrValue::Int(to))]);
        let strides = self.g.op("Cast", "anchor_strides", &[&strides], vec![("to", AttrValue::Int(to))]);
        let count = feats.iter().map(|f| f.h * f.w).sum();
        Ok(Anchors { centres, strides, count })
    }

    /// Decodes a branch's raw outputs to `(B, 4 + nc + K·D, A)`: boxes in pixels — `(cx, cy, w,
    /// h)` as `PoseModel::predict` (`xywh`), else `(x1, y1, x2, y2)` as the end-to-end decode —
    /// sigmoid scores, keypoints (x px, y px[, sigmoid v]); in the model's order of operations.
    fn decode(&mut self, raw: &RawBranch, head: &Pose26, anchors: &Anchors, xywh: bool, prefix: &str, output: &str) -> Result<String> {
        let (anc, st, a) = (anchors.centres.as_str(), anchors.strides.as_str(), anchors.count);
        let split2 = self.g.const_i64(&[2, 2]);
        let ltrb = self.g.op_n("Split", "decode.ltrb", &[&raw.boxes, &split2], 2, vec![("axis", AttrValue::Int(1))]);
        let x1y1 = self.g.op("Sub", "decode.x1y1", &[anc, &ltrb[0]], vec![]);
        let x2y2 = self.g.op("Add", "decode.x2y2", &[anc, &ltrb[1]], vec![]);
        let grid_boxes = if xywh {
            // Centre = (x1y1 + x2y2) / 2, size = x2y2 − x1y1.
            let sum = self.g.op("Add", "decode.corner_sum", &[&x1y1, &x2y2], vec![]);
            let two = self.g.const_f32(2.0);
            let centre = self.g.op("Div", "decode.centre", &[&sum, &two], vec![]);
            let size = self.g.op("Sub", "decode.size", &[&x2y2, &x1y1], vec![]);
            self.g.op("Concat", "decode.xywh", &[&centre, &size], vec![("axis", AttrValue::Int(1))])
        } else {
            self.g.op("Concat", "decode.xyxy", &[&x1y1, &x2y2], vec![("axis", AttrValue::Int(1))])
        };
        let boxes = self.g.op("Mul", "decode.boxes", &[&grid_boxes, st], vec![]);

        let scores = self.g.op("Sigmoid", "decode.scores", &[&raw.scores], vec![]);

        // Keypoints: (B, K·D, A) → (B, K, D, A); xy = (raw + a)·s, v = sigmoid(raw_v).
        let (k, d) = head.kpt_shape;
        if !(d == 2 || d == 3) {
            return Err(ExportError::unsupported(prefix, format!("keypoints with {d} values (2 or 3 are exported)")));
        }
        let (k, d) = (k as i64, d as i64);
        let n = if self.dynamic { -1 } else { a as i64 };
        let per_kpt = self.reshape(&raw.kpts, &[0, k, d, n], "decode.kpts_split");
        let (xy_raw, visibility) = if d == 3 {
            let split = self.g.const_i64(&[2, 1]);
            let parts = self.g.op_n("Split", "decode.kpt_xy_v", &[&per_kpt, &split], 2, vec![("axis", AttrValue::Int(2))]);
            let v = self.g.op("Sigmoid", "decode.kpt_v", &[&parts[1]], vec![]);
            (parts[0].clone(), Some(v))
        } else {
            (per_kpt, None)
        };
        let shifted = self.g.op("Add", "decode.kpt_grid", &[&xy_raw, anc], vec![]);
        let kxy = self.g.op("Mul", "decode.kpt_px", &[&shifted, st], vec![]);
        let kpts4 = match &visibility {
            Some(v) => self.g.op("Concat", "decode.kpt_xyv", &[&kxy, v], vec![("axis", AttrValue::Int(2))]),
            None => kxy,
        };
        let kpts = self.reshape(&kpts4, &[0, k * d, n], "decode.kpts");
        Ok(self.g.op("Concat", output, &[&boxes, &scores, &kpts], vec![("axis", AttrValue::Int(1))]))
    }

    fn check_levels(head: &Pose26, feats: &[Value], prefix: &str) -> Result<()> {
        if feats.len() != head.num_levels() {
            return Err(ExportError::unsupported(prefix, format!("{} feature maps for {} levels", feats.len(), head.num_levels())));
        }
        Ok(())
    }

    /// The eval output `(B, 4 + nc + K·D, A)`: boxes (cx, cy, w, h) px, sigmoid scores,
    /// keypoints (x px, y px[, sigmoid v]) — `PoseModel::predict(..).decoded`. Returns its name.
    pub fn head(&mut self, head: &Pose26, feats: &[Value], prefix: &str, output: &str) -> Result<String> {
        Self::check_levels(head, feats, prefix)?;
        let raw = self.branch(head, Branch::OneToMany, feats, prefix)?;
        let anchors = self.anchor_tables(head, feats)?;
        self.decode(&raw, head, &anchors, true, prefix, output)
    }

    /// The end-to-end output of the one-to-one branch, `(B, k, 6 + K·D)` with k = min(max_det,
    /// A): rows `[x1, y1, x2, y2, score, class, keypoints…]` in descending score — the top k
    /// anchors by their best class score, then the top k of their (anchor, class) scores, as
    /// `metrics::e2e::topk` (Ultralytics' `get_topk_index`); no confidence filter, no NMS.
    pub fn end_to_end(&mut self, head: &Pose26, feats: &[Value], prefix: &str, max_det: usize, output: &str) -> Result<(String, usize)> {
        Self::check_levels(head, feats, prefix)?;
        let raw = self.branch(head, Branch::OneToOne, feats, prefix)?;
        let anchors = self.anchor_tables(head, feats)?;
        let a = anchors.count;
        let decoded = self.decode(&raw, head, &anchors, false, prefix, "e2e.decoded")?;
        // Selection in f32 (a half-precision file casts here; the rows go back to half at the end).
        let decoded = self.in_f32(&decoded, "e2e.decoded_f32");
        let (nc, (nk, d)) = (head.nc as i64, head.kpt_shape);
        let k = max_det.min(a) as i64;
        let width = 4 + nc + (nk * d) as i64;
        // k = min(max_det, A): A read from the decoded output when the size is dynamic.
        let kk = if self.dynamic {
            let shape = self.g.op("Shape", "e2e.decoded_shape", &[&decoded], vec![]);
            let two = self.g.const_i64(&[2]);
            let anchors_now = self.g.op("Gather", "e2e.anchor_count", &[&shape, &two], vec![("axis", AttrValue::Int(0))]);
            let most = self.g.const_i64(&[max_det as i64]);
            self.g.op("Min", "e2e.k", &[&anchors_now, &most], vec![])
        } else {
            self.g.const_i64(&[k])
        };
        let topk = |e: &mut Emitter, x: &str, name: &str| {
            e.g.op_n(
                "TopK",
                name,
                &[x, &kk],
                2,
                vec![("axis", AttrValue::Int(1)), ("largest", AttrValue::Int(1)), ("sorted", AttrValue::Int(1))],
            )
        };
        // Scores (B, nc, A): the best class per anchor, its top k anchors.
        let split = self.g.const_i64(&[4, nc, width - 4 - nc]);
        let parts = self.g.op_n("Split", "e2e.parts", &[&decoded, &split], 3, vec![("axis", AttrValue::Int(1))]);
        let best = self.reduce_max(&parts[1], 1, "e2e.best_class");
        let ori = topk(self, &best, "e2e.top_anchors");
        // Their class scores (B, nc, k) → (B, k·nc) anchor-major, then the top k pairs.
        let ori3 = self.unsqueeze(&ori[1], 1, "e2e.top_anchors_3d");
        let nck = self.g.const_i64(&[1, nc, 1]);
        let ori_nc = self.g.op("Tile", "e2e.top_anchors_per_class", &[&ori3, &nck], vec![]);
        let cand = self.g.op("GatherElements", "e2e.candidate_scores", &[&parts[1], &ori_nc], vec![("axis", AttrValue::Int(2))]);
        let cand_t = self.g.op("Transpose", "e2e.candidates_by_anchor", &[&cand], vec![("perm", AttrValue::Ints(vec![0, 2, 1]))]);
        let flat = self.reshape(&cand_t, &[0, if self.dynamic { -1 } else { k * nc }], "e2e.candidates_flat");
        let pairs = topk(self, &flat, "e2e.top_pairs");
        let nc_c = self.g.const_i64(&[nc]);
        let class = self.g.op("Mod", "e2e.class_index", &[&pairs[1], &nc_c], vec![]);
        let slot = self.g.op("Div", "e2e.anchor_slot", &[&pairs[1], &nc_c], vec![]);
        let anchor = self.g.op("GatherElements", "e2e.anchor_index", &[&ori[1], &slot], vec![("axis", AttrValue::Int(1))]);
        // Rows: the anchors' columns (B, W, k) → (B, k, W); boxes, score, class, keypoints.
        let anchor3 = self.unsqueeze(&anchor, 1, "e2e.anchor_index_3d");
        let wk = self.g.const_i64(&[1, width, 1]);
        let anchor_w = self.g.op("Tile", "e2e.anchor_index_per_channel", &[&anchor3, &wk], vec![]);
        let cols = self.g.op("GatherElements", "e2e.columns", &[&decoded, &anchor_w], vec![("axis", AttrValue::Int(2))]);
        let rows = self.g.op("Transpose", "e2e.rows", &[&cols], vec![("perm", AttrValue::Ints(vec![0, 2, 1]))]);
        let row_parts = self.g.op_n("Split", "e2e.row_parts", &[&rows, &split], 3, vec![("axis", AttrValue::Int(2))]);
        let score = self.unsqueeze(&pairs[0], 2, "e2e.score");
        let class_f = self.g.op("Cast", "e2e.class_float", &[&class], vec![("to", AttrValue::Int(ONNX_FLOAT))]);
        let class3 = self.unsqueeze(&class_f, 2, "e2e.class");
        let parts = [row_parts[0].as_str(), &score, &class3, &row_parts[2]];
        let out = self.in_output_precision(output, |e, name| e.g.op("Concat", name, &parts, vec![("axis", AttrValue::Int(2))]));
        Ok((out, k as usize))
    }
}

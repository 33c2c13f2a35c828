//! # ptl-export
//!
//! Writes the eval YOLO26-pose model of `ptl-heads` in other formats; today ONNX. The exporter
//! lives beside the model rather than in it so that `ptl-heads` keeps no file-format
//! dependency; it reads the model's public modules (layers, blocks, stems) and emits, per
//! module, the ONNX ops of its eval forward in the same order of operations:
//!
//! * every `Conv` (Conv2d + BatchNorm) is one `Conv` node with the BatchNorm's running statistics
//!   folded into its weight and bias, followed by `Sigmoid`·`Mul` where it has SiLU;
//! * C3k2/C3k/Bottleneck/SPPF/C2PSA as `Split`, `Concat`, `Add`, `MaxPool`; attention as
//!   `Reshape`, `Split`, `Transpose`, `MatMul`, `Mul`, `Softmax`; upsampling as `Resize`
//!   (nearest, asymmetric, floor);
//! * the head's one-to-many stems (what `PoseModel::predict` decodes; no sigma views, no
//!   one-to-one set, no flow) and the decode, anchors and strides stored as initializers.
//!
//! By default ([`export_onnx`]) the file has one input and one output, named and laid out as
//! ptl's eval forward:
//!
//! * `images`: `(batch, 3, H, W)` f32 RGB in [0, 1], the batch dynamic, H and W fixed at export;
//! * `decoded`: `(batch, 4 + nc + K·D, A)` = `PoseModel::predict(images).decoded` before NMS —
//!   channels (cx, cy, w, h) in pixels, nc sigmoid class scores, then per keypoint
//!   (x px, y px, sigmoid visibility); anchors `A = Σ (H/s)·(W/s)` over strides 8, 16, 32,
//!   levels P3, P4, P5 in order, row-major inside a level.
//!
//! [`export_onnx_with`] takes Ultralytics' export settings ([`ExportOptions`]): f16 weights,
//! input and output (`half`), the opset (13 to 21), dynamic height and width (`dynamic`: the
//! anchors computed from the feature maps' shapes at run time), and two detection outputs instead of
//! `decoded` ([`ExportOutput`]): NMS in the graph (`nms.rs`) or the one-to-one branch's top k
//! (YOLO26's end-to-end form, `head.rs`), both `(batch, rows, 6 + K·D)`.
//!
//! ```
//! use ptl_autograd::Device;
//! use ptl_heads::{ModelConfig, PoseModel};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut model = PoseModel::new(ModelConfig::default(), Device::Cpu, 0)?;
//! ptl_autograd::Module::set_training(&mut model, false);
//! let onnx = ptl_export::export_onnx(&model, (64, 64))?;
//! assert_eq!(onnx.output_dims(), vec![None, Some(56), Some(84)]); // 8·8 + 4·4 + 2·2 anchors
//! let bytes = onnx.to_bytes();
//! assert!(bytes.len() > 4 * 2_900_000); // the weights, as f32
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
pub mod error;
pub mod graph;

mod emit;
mod encode;
mod fold;
mod head;
mod nms;
mod trunk;

use std::path::Path;

use ptl_heads::PoseModel;

pub use error::{ExportError, Result};

/// Name of the graph input.
pub const INPUT_NAME: &str = "images";
/// Name of the graph output of the decoded (before NMS) form.
pub const OUTPUT_NAME: &str = "decoded";
/// Name of the graph output of the detection forms (NMS in the graph, end-to-end).
pub const DETECTIONS_NAME: &str = "detections";
/// The ONNX operator set written by default.
pub const OPSET: i64 = 17;
/// The opsets the exporter writes: from 13 (`Split`, `Unsqueeze`, `ReduceSum` take their sizes
/// and axes as inputs) to 21 (the newest checked against onnxruntime).
pub const OPSETS: std::ops::RangeInclusive<i64> = 13..=21;
/// Largest exported side (as for training: the anchor tables grow with its square).
pub const MAX_IMGSZ: usize = 8192;
/// The largest stride of the model: H and W must be multiples of it.
const MAX_STRIDE: usize = 32;
/// Most detections per image the detection forms may hold.
pub const MAX_DET: usize = 10_000;

pub use nms::NmsSettings;

/// What the graph's output holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExportOutput {
    /// `decoded` `(B, 4 + nc + K·D, A)`: the one-to-many decode before NMS, as
    /// `PoseModel::predict` (Ultralytics' default ONNX output; `nms` not given).
    Decoded,
    /// `detections` `(B, max_det, 6 + K·D)` after NMS in the graph (`nms=True`).
    Nms(NmsSettings),
    /// `detections` `(B, k, 6 + K·D)`, k = min(max_det, A): the one-to-one branch's top k, no
    /// NMS (`nms=False`: YOLO26's end-to-end output).
    EndToEnd {
        /// The most rows per image (Ultralytics' `max_det`, 300 by default).
        max_det: usize,
    },
}

/// How to export: input size, precision, opset and output form.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExportOptions {
    /// `(H, W)`, each a multiple of 32.
    pub imgsz: (usize, usize),
    /// Weights, input, activations and output in f16 (`half=True`); NMS and top-k run in f32.
    pub half: bool,
    /// The ONNX opset declared (see [`OPSETS`]).
    pub opset: i64,
    /// Height and width dynamic (`dynamic=True`): any multiple of 32 at run time, the anchors
    /// computed from the feature maps' shapes; `imgsz` is then the nominal size. The batch is
    /// dynamic in every file.
    pub dynamic: bool,
    /// What the output holds.
    pub output: ExportOutput,
}

impl ExportOptions {
    /// The defaults for `(H, W)` inputs: f32, opset [`OPSET`], the decoded output.
    pub fn new(imgsz: (usize, usize)) -> ExportOptions {
        ExportOptions { imgsz, half: false, opset: OPSET, dynamic: false, output: ExportOutput::Decoded }
    }

    fn check(&self) -> Result<()> {
        check_imgsz(self.imgsz.0, self.imgsz.1)?;
        if !OPSETS.contains(&self.opset) {
            return Err(ExportError::Option {
                key: "opset",
                reason: format!("{}: ptl writes opsets {} to {} (e.g. opset=17)", self.opset, OPSETS.start(), OPSETS.end()),
            });
        }
        let max_det = match self.output {
            ExportOutput::Decoded => None,
            ExportOutput::Nms(s) => {
                for (key, v) in [("conf", s.conf), ("iou", s.iou)] {
                    if !(0.0..=1.0).contains(&v) {
                        return Err(ExportError::Option { key, reason: format!("{v}: a threshold in [0, 1]") });
                    }
                }
                Some(s.max_det)
            }
            ExportOutput::EndToEnd { max_det } => Some(max_det),
        };
        if let Some(m) = max_det.filter(|m| !(1..=MAX_DET).contains(m)) {
            return Err(ExportError::Option { key: "max_det", reason: format!("{m}: between 1 and {MAX_DET} detections per image") });
        }
        Ok(())
    }
}

/// The ONNX IR version that goes with `opset` (the oldest IR that defines it).
pub fn ir_version(opset: i64) -> i64 {
    match opset {
        ..=14 => 7,
        15..=18 => 8,
        19..=20 => 9,
        _ => 10,
    }
}

/// The formats `ptl export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    /// ONNX (`format=onnx`), the format onnxruntime, TensorRT and OpenVINO read.
    Onnx,
}

impl ExportFormat {
    /// The accepted `format=` values, for messages.
    pub const KNOWN: &'static str = "onnx";

    /// Reads a `format=` value (case-insensitive).
    pub fn parse(s: &str) -> Result<ExportFormat> {
        match s.trim().to_ascii_lowercase().as_str() {
            "onnx" => Ok(ExportFormat::Onnx),
            _ => Err(ExportError::UnknownFormat { given: s.to_string(), known: Self::KNOWN }),
        }
    }

    /// File extension of the format, without the dot.
    pub fn extension(self) -> &'static str {
        match self {
            ExportFormat::Onnx => "onnx",
        }
    }
}

/// One dimension of the graph's input or output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    /// A size fixed in the file.
    Fixed(usize),
    /// A symbolic dimension (`batch`).
    Named(String),
}

/// An exported model, ready to serialise.
#[derive(Debug)]
pub struct OnnxModel {
    /// The nodes and constants.
    pub graph: graph::Graph,
    /// The input's name and dimensions.
    pub input: (String, Vec<Dim>),
    /// The output's name and dimensions.
    pub output: (String, Vec<Dim>),
    /// The ONNX opset the file declares.
    pub opset: i64,
    /// f16 weights, input and output (f32 op parameters stay f32).
    pub half: bool,
    /// What the file computes, for readers of the file (stored as the graph's doc string).
    pub doc: String,
    /// Key/value facts stored in the file (stride, image size, keypoint shape, …).
    pub metadata: Vec<(String, String)>,
}

impl OnnxModel {
    /// The output's dimensions, `None` for the dynamic batch.
    pub fn output_dims(&self) -> Vec<Option<usize>> {
        self.output
            .1
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => Some(*n),
                Dim::Named(_) => None,
            })
            .collect()
    }

    /// Number of weight and bias values stored (the deployed model's parameters).
    pub fn num_parameters(&self) -> usize {
        self.graph
            .initializers
            .iter()
            .filter(|t| t.name.ends_with(".weight") || t.name.ends_with(".bias"))
            .map(|t| t.dims.iter().product::<i64>() as usize)
            .sum()
    }

    /// Stores the class names (Ultralytics' `names` metadata, `{0: 'person', 1: 'dog'}`).
    pub fn set_class_names(&mut self, names: &[String]) {
        let listed: Vec<String> = names.iter().enumerate().map(|(i, n)| format!("{i}: '{}'", n.replace('\'', "\\'"))).collect();
        let value = format!("{{{}}}", listed.join(", "));
        match self.metadata.iter_mut().find(|(k, _)| k == "names") {
            Some(entry) => entry.1 = value,
            None => self.metadata.push(("names".into(), value)),
        }
    }

    /// The ONNX protobuf bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        encode::to_bytes(self)
    }

    /// Writes the file (its folder is created when missing).
    pub fn write(&self, path: &Path) -> Result<()> {
        let io = |source| ExportError::Io { path: path.to_path_buf(), source };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        std::fs::write(path, self.to_bytes()).map_err(io)
    }
}

fn check_imgsz(h: usize, w: usize) -> Result<()> {
    let bad = |reason: String| Err(ExportError::ImageSize { h, w, reason });
    if h == 0 || w == 0 || h % MAX_STRIDE != 0 || w % MAX_STRIDE != 0 {
        return bad(format!("each side must be a positive multiple of {MAX_STRIDE} (the model's largest stride), e.g. imgsz=640"));
    }
    if h > MAX_IMGSZ || w > MAX_IMGSZ {
        return bad(format!("sides above {MAX_IMGSZ} are not exported"));
    }
    Ok(())
}

/// Exports the eval forward of `model` for `(H, W)` inputs: the trunk, the one-to-many head and
/// its decode, BatchNorm folded with its running statistics (so the result is the eval model's
/// whatever the model's training flag). See the crate docs for the input and output layout.
pub fn export_onnx(model: &PoseModel, imgsz: (usize, usize)) -> Result<OnnxModel> {
    export_onnx_with(model, &ExportOptions::new(imgsz))
}

/// Exports `model` as `options` say (see [`ExportOptions`], [`ExportOutput`]).
pub fn export_onnx_with(model: &PoseModel, options: &ExportOptions) -> Result<OnnxModel> {
    options.check()?;
    let (h, w) = options.imgsz;
    let mut e = emit::Emitter { g: graph::Graph::default(), opset: options.opset, half: options.half, dynamic: options.dynamic };
    let input = emit::Value { name: e.g.reserve(INPUT_NAME), c: 3, h, w };
    let feats = e.trunk(model, &input)?;
    let head_index = model.layers().len().saturating_sub(1);
    let prefix = format!("model.{head_index}");
    let head = model.head();
    let (k, d) = head.kpt_shape;
    let anchors: usize = feats.iter().map(|f| f.h * f.w).sum();
    let channels = 4 + head.nc + k * d;
    let batch = || Dim::Named("batch".into());
    let sized = |n: usize, name: &str| if options.dynamic { Dim::Named(name.into()) } else { Dim::Fixed(n) };
    let precision = if options.half { "f16" } else { "f32" };
    let (out, out_dims, layout) = match options.output {
        ExportOutput::Decoded => {
            let out = e.head(head, &feats, &prefix, OUTPUT_NAME)?;
            let layout = format!(
                "Output `{OUTPUT_NAME}` (batch, {channels}, {anchors}): cx, cy, w, h (px), {} sigmoid class score(s), then for each of \
                 {k} keypoints x, y (px){}; anchors over strides 8, 16, 32, levels P3, P4, P5, row-major; before NMS.",
                head.nc,
                if d == 3 { ", sigmoid visibility" } else { "" }
            );
            (out, vec![batch(), Dim::Fixed(channels), sized(anchors, "anchors")], layout)
        }
        ExportOutput::Nms(s) => {
            let decoded = e.head(head, &feats, &prefix, "decoded")?;
            let out = e.nms(&decoded, head.nc, k * d, &s, DETECTIONS_NAME);
            let layout = format!(
                "Output `{DETECTIONS_NAME}` (batch, {}, {}): per image the detections after NMS (best class score > {}, IoU > {} \
                 suppressed within a class), score descending, rows x1, y1, x2, y2 (px), score, class, then {k} keypoints' x, y (px){}; \
                 zero rows after the last.",
                s.max_det,
                6 + k * d,
                s.conf,
                s.iou,
                if d == 3 { ", visibility" } else { "" }
            );
            (out, vec![batch(), Dim::Fixed(s.max_det), Dim::Fixed(6 + k * d)], layout)
        }
        ExportOutput::EndToEnd { max_det } => {
            let (out, rows) = e.end_to_end(head, &feats, &prefix, max_det, DETECTIONS_NAME)?;
            let layout = format!(
                "Output `{DETECTIONS_NAME}` (batch, {rows}, {}): the one-to-one (end-to-end) branch's top {rows} (anchor, class) \
                 scores, no NMS, score descending, rows x1, y1, x2, y2 (px), score, class, then {k} keypoints' x, y (px){}; filter by \
                 score.",
                6 + k * d,
                if d == 3 { ", visibility" } else { "" }
            );
            (out, vec![batch(), sized(rows, "rows"), Dim::Fixed(6 + k * d)], layout)
        }
    };
    if out != out_name(options) {
        return Err(ExportError::unsupported("model", format!("the output came out as `{out}`, not `{}`", out_name(options))));
    }
    let doc = format!(
        "YOLO26{}-pose eval forward (ptl), {precision}. Input `{INPUT_NAME}` (batch, 3, {}): RGB in [0, 1]. {layout}{}",
        model.config.scale.letter(),
        if options.dynamic { "height, width".to_string() } else { format!("{h}, {w}") },
        if options.dynamic {
            format!(" Height and width: any multiples of 32 (exported at {h}×{w}; the anchor count follows the size).")
        } else {
            String::new()
        },
    );
    let form = match options.output {
        ExportOutput::Decoded => "decoded",
        ExportOutput::Nms(_) => "nms",
        ExportOutput::EndToEnd { .. } => "end2end",
    };
    let metadata = vec![
        ("producer".to_string(), "ptl".to_string()),
        ("task".to_string(), "pose".to_string()),
        ("imgsz".to_string(), format!("[{h}, {w}]")),
        ("stride".to_string(), "32".to_string()),
        ("kpt_shape".to_string(), format!("[{k}, {d}]")),
        ("nc".to_string(), head.nc.to_string()),
        ("names".to_string(), default_names(head.nc)),
        ("half".to_string(), if options.half { "True" } else { "False" }.to_string()),
        ("dynamic".to_string(), if options.dynamic { "True" } else { "False" }.to_string()),
        ("output".to_string(), form.to_string()),
    ];
    Ok(OnnxModel {
        graph: e.g,
        input: (INPUT_NAME.to_string(), vec![batch(), Dim::Fixed(3), sized(h, "height"), sized(w, "width")]),
        output: (out, out_dims),
        opset: options.opset,
        half: options.half,
        doc,
        metadata,
    })
}

/// `names` metadata before [`OnnxModel::set_class_names`]: `person` for one class, `class<i>` else.
fn default_names(nc: usize) -> String {
    match nc {
        1 => "{0: 'person'}".to_string(),
        _ => format!("{{{}}}", (0..nc).map(|i| format!("{i}: 'class{i}'")).collect::<Vec<_>>().join(", ")),
    }
}

fn out_name(options: &ExportOptions) -> &'static str {
    match options.output {
        ExportOutput::Decoded => OUTPUT_NAME,
        _ => DETECTIONS_NAME,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_sizes_are_checked() {
        assert_eq!(ExportFormat::parse("ONNX").unwrap(), ExportFormat::Onnx);
        let e = ExportFormat::parse("tflite").unwrap_err();
        assert!(e.to_string().contains("`tflite`") && e.to_string().contains("onnx"), "{e}");
        assert!(check_imgsz(640, 640).is_ok());
        for (h, w) in [(0, 64), (64, 100), (8224, 64)] {
            let e = check_imgsz(h, w).unwrap_err();
            assert!(matches!(e, ExportError::ImageSize { .. }), "{e}");
        }
    }
}

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
//! The file has one input and one output, named and laid out as ptl's eval forward:
//!
//! * `images`: `(batch, 3, H, W)` f32 RGB in [0, 1], the batch dynamic, H and W fixed at export;
//! * `decoded`: `(batch, 4 + nc + K·D, A)` = `PoseModel::predict(images).decoded` before NMS —
//!   channels (cx, cy, w, h) in pixels, nc sigmoid class scores, then per keypoint
//!   (x px, y px, sigmoid visibility); anchors `A = Σ (H/s)·(W/s)` over strides 8, 16, 32,
//!   levels P3, P4, P5 in order, row-major inside a level.
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

pub mod error;
pub mod graph;

mod emit;
mod encode;
mod fold;
mod head;
mod trunk;

use std::path::Path;

use ptl_heads::PoseModel;

pub use encode::IR_VERSION;
pub use error::{ExportError, Result};

/// Name of the graph input.
pub const INPUT_NAME: &str = "images";
/// Name of the graph output.
pub const OUTPUT_NAME: &str = "decoded";
/// The ONNX operator set the graph uses.
pub const OPSET: i64 = 17;
/// Largest exported side (as for training: the anchor tables grow with its square).
pub const MAX_IMGSZ: usize = 8192;
/// The largest stride of the model: H and W must be multiples of it.
const MAX_STRIDE: usize = 32;

/// The formats `ptl export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
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
    Fixed(usize),
    /// A symbolic dimension (`batch`).
    Named(String),
}

/// An exported model, ready to serialise.
#[derive(Debug)]
pub struct OnnxModel {
    pub graph: graph::Graph,
    pub input: (String, Vec<Dim>),
    pub output: (String, Vec<Dim>),
    pub opset: i64,
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
    let (h, w) = imgsz;
    check_imgsz(h, w)?;
    let mut e = emit::Emitter { g: graph::Graph::default() };
    let input = emit::Value { name: e.g.reserve(INPUT_NAME), c: 3, h, w };
    let feats = e.trunk(model, &input)?;
    let head_index = model.layers().len().saturating_sub(1);
    let out = e.head(model.head(), &feats, &format!("model.{head_index}"), OUTPUT_NAME)?;
    if out != OUTPUT_NAME {
        return Err(ExportError::unsupported("model", format!("the output came out as `{out}`, not `{OUTPUT_NAME}`")));
    }
    let head = model.head();
    let (k, d) = head.kpt_shape;
    let anchors: usize = feats.iter().map(|f| f.h * f.w).sum();
    let channels = 4 + head.nc + k * d;
    let batch = || Dim::Named("batch".into());
    let doc = format!(
        "YOLO26{}-pose eval forward (ptl), before NMS. Input `{INPUT_NAME}` (batch, 3, {h}, {w}): RGB in [0, 1]. \
         Output `{OUTPUT_NAME}` (batch, {channels}, {anchors}): cx, cy, w, h (px), {} sigmoid class score(s), then for each of \
         {k} keypoints x, y (px){}; anchors over strides 8, 16, 32, levels P3, P4, P5, row-major.",
        model.config.scale.letter(),
        head.nc,
        if d == 3 { ", sigmoid visibility" } else { "" }
    );
    let metadata = vec![
        ("producer".to_string(), "ptl".to_string()),
        ("task".to_string(), "pose".to_string()),
        ("imgsz".to_string(), format!("[{h}, {w}]")),
        ("stride".to_string(), "32".to_string()),
        ("kpt_shape".to_string(), format!("[{k}, {d}]")),
        ("nc".to_string(), head.nc.to_string()),
        ("names".to_string(), "{0: 'person'}".to_string()),
        ("output_layout".to_string(), "xywh, scores, keypoints (x, y, v); before NMS".to_string()),
    ];
    Ok(OnnxModel {
        graph: e.g,
        input: (INPUT_NAME.to_string(), vec![batch(), Dim::Fixed(3), Dim::Fixed(h), Dim::Fixed(w)]),
        output: (OUTPUT_NAME.to_string(), vec![batch(), Dim::Fixed(channels), Dim::Fixed(anchors)]),
        opset: OPSET,
        doc,
        metadata,
    })
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

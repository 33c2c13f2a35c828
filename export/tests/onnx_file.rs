//! The exported file read back with the protobuf parser (no Python): its input and output, the
//! opset, every node input defined before use, unique names, and the deployed model's parameter
//! count — the reference's figure for YOLO26n-pose with BN folded and one branch set kept
//! (2,926,494, shared/spec/model.md), which no part of the exporter computes.

use std::collections::HashSet;

use onnx_rs::ast::{DataType, Dimension, TypeValue, ValueInfo};
use ptl_autograd::{Device, Module};
use ptl_heads::{ModelConfig, PoseModel, Scale};

/// Dimensions of a graph input/output: `Err(name)` for a symbolic one.
fn dims(v: &ValueInfo<'_>) -> Vec<Result<i64, String>> {
    let Some(TypeValue::Tensor(t)) = v.r#type.as_ref().and_then(|t| t.value.as_ref()) else { panic!("{} is not a tensor", v.name) };
    assert_eq!(t.elem_type, DataType::Float, "{} is f32", v.name);
    t.shape
        .as_ref()
        .expect("shape")
        .dim
        .iter()
        .map(|d| match &d.value {
            Dimension::Value(n) => Ok(*n),
            Dimension::Param(p) => Err(p.to_string()),
        })
        .collect()
}

fn eval_model(scale: Scale, kpt_shape: (usize, usize)) -> PoseModel {
    let mut m = PoseModel::new(ModelConfig { nc: 1, kpt_shape, scale }, Device::Cpu, 3).expect("model");
    m.set_training(false);
    m
}

#[test]
fn the_file_decodes_with_the_documented_interface_and_a_well_formed_graph() {
    let model = eval_model(Scale::N, (17, 3));
    let onnx = ptl_export::export_onnx(&model, (64, 96)).expect("export");
    let bytes = onnx.to_bytes();
    let parsed = onnx_rs::parse(&bytes).expect("the bytes parse as an ONNX model");
    assert_eq!(parsed.ir_version, ptl_export::ir_version(17));
    assert_eq!(parsed.opset_import.len(), 1);
    assert_eq!((parsed.opset_import[0].domain, parsed.opset_import[0].version), ("", 17));
    let g = parsed.graph.as_ref().expect("graph");

    // One input, one output, as documented: A = 8·12 + 4·6 + 2·3 anchors at 64×96.
    assert_eq!(g.input.len(), 1);
    assert_eq!(g.input[0].name, "images");
    assert_eq!(dims(&g.input[0]), vec![Err("batch".into()), Ok(3), Ok(64), Ok(96)]);
    assert_eq!(g.output.len(), 1);
    assert_eq!(g.output[0].name, "decoded");
    assert_eq!(dims(&g.output[0]), vec![Err("batch".into()), Ok(4 + 1 + 51), Ok(96 + 24 + 6)]);

    // Names: initializers and node outputs unique; every node input is the graph input, an
    // initializer, an earlier node's output, or "" (an omitted optional input).
    let inits: HashSet<&str> = g.initializer.iter().map(|t| t.name()).collect();
    assert_eq!(inits.len(), g.initializer.len(), "initializer names are unique");
    let mut defined: HashSet<&str> = inits.clone();
    defined.insert("images");
    for n in &g.node {
        for i in &n.input {
            assert!(i.is_empty() || defined.contains(i), "node {} ({}) reads `{i}` before it is defined", n.name, n.op_type);
        }
        for o in &n.output {
            assert!(defined.insert(o), "`{o}` is produced twice");
        }
    }
    assert!(defined.contains("decoded"), "some node produces the output");

    // Only the ops the crate documents.
    let ops: HashSet<String> = g.node.iter().map(|n| n.op_type.to_string()).collect();
    let allowed: HashSet<String> = [
        "Conv",
        "Sigmoid",
        "Mul",
        "Add",
        "Sub",
        "Div",
        "Concat",
        "Split",
        "MaxPool",
        "Resize",
        "Reshape",
        "Transpose",
        "MatMul",
        "Softmax",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert!(ops.is_subset(&allowed), "unexpected ops {:?}", ops.difference(&allowed).collect::<Vec<_>>());

    // The weights: f32, and as many as the reference's deployed YOLO26n-pose (docs/model.md §Summary).
    let weights: usize = g
        .initializer
        .iter()
        .filter(|t| t.name().ends_with(".weight") || t.name().ends_with(".bias"))
        .map(|t| {
            assert_eq!(t.data_type(), DataType::Float, "{}", t.name());
            let n = t.dims().iter().product::<i64>() as usize;
            assert_eq!(t.as_f32().expect("f32 data").len(), n, "{} holds its elements", t.name());
            n
        })
        .sum();
    assert_eq!(weights, 2_926_494);
    assert_eq!(onnx.num_parameters(), weights);
    // One Conv node per convolution that eval runs: the trunk's and the one-to-many head's,
    // counted from the model's own state dict (sigma views, one-to-one set and flow left out).
    let eval_convs = model
        .state_dict()
        .iter()
        .filter(|(name, t, _)| {
            let head = name.strip_prefix("model.23.");
            t.rank() == 4
                && name.ends_with(".weight")
                && head.is_none_or(|h| ["cv2.", "cv3.", "cv4.", "cv4_kpts."].iter().any(|p| h.starts_with(p)))
        })
        .count();
    assert_eq!(g.node.iter().filter(|n| n.op_type.to_string() == "Conv").count(), eval_convs);
}

#[test]
fn keypoint_shapes_and_writing_follow_the_model() {
    // Five keypoints with (x, y) only: 4 + 1 + 10 channels; the file lands where asked.
    let model = eval_model(Scale::N, (5, 2));
    let onnx = ptl_export::export_onnx(&model, (32, 32)).expect("export");
    assert_eq!(onnx.output_dims(), vec![None, Some(15), Some(16 + 4 + 1)]);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sub/model.onnx");
    onnx.write(&path).expect("write");
    let bytes = std::fs::read(&path).expect("read back");
    assert_eq!(bytes, onnx.to_bytes());
    // An unwritable place: a typed error naming the path.
    let file = dir.path().join("a_file");
    std::fs::write(&file, b"x").expect("file");
    let e = onnx.write(&file.join("model.onnx")).unwrap_err();
    assert!(matches!(&e, ptl_export::ExportError::Io { path, .. } if path.starts_with(&file)), "{e}");
    assert!(e.to_string().contains("a_file"), "{e}");
}

#[test]
fn bad_sizes_are_refused_with_the_rule() {
    let model = eval_model(Scale::N, (17, 3));
    let e = ptl_export::export_onnx(&model, (100, 64)).unwrap_err();
    assert!(e.to_string().contains("multiple of 32"), "{e}");
}

/// The variants' files as parsed back: the declared opset and its IR version, f16 weights and
/// I/O in a half file with the op parameters ONNX types as f32 (`Resize` scales, NMS thresholds)
/// kept f32, the detection outputs' shapes; settings out of range are typed errors naming the key.
#[test]
fn variants_declare_their_opset_precision_and_output() {
    use ptl_export::{export_onnx_with, Dim, ExportError, ExportOptions, ExportOutput, NmsSettings};
    let model = eval_model(Scale::N, (17, 3));
    let base = ExportOptions::new((64, 64));
    for opset in [13, 21] {
        let bytes = export_onnx_with(&model, &ExportOptions { opset, ..base }).expect("export").to_bytes();
        let parsed = onnx_rs::parse(&bytes).expect("parses");
        assert_eq!((parsed.opset_import[0].version, parsed.ir_version), (opset, ptl_export::ir_version(opset)));
    }
    let nms = ExportOutput::Nms(NmsSettings { conf: 0.25, iou: 0.7, max_det: 100 });
    let half = export_onnx_with(&model, &ExportOptions { half: true, output: nms, ..base }).expect("export");
    assert_eq!(half.output_dims(), vec![None, Some(100), Some(6 + 51)]);
    let bytes = half.to_bytes();
    let parsed = onnx_rs::parse(&bytes).expect("parses");
    let g = parsed.graph.as_ref().expect("graph");
    for v in [&g.input[0], &g.output[0]] {
        let Some(TypeValue::Tensor(t)) = v.r#type.as_ref().and_then(|t| t.value.as_ref()) else { panic!("{} is not a tensor", v.name) };
        assert_eq!(t.elem_type, DataType::Float16, "{}", v.name);
    }
    let (mut halves, mut kept_f32) = (0, Vec::new());
    for t in &g.initializer {
        match t.data_type() {
            DataType::Float16 => halves += 1,
            DataType::Float => kept_f32.push(t.name().to_string()),
            _ => {}
        }
    }
    assert!(halves > 100, "{halves} f16 tensors");
    assert!(
        !kept_f32.is_empty()
            && kept_f32.iter().all(|n| n.ends_with(".scales") || n.starts_with("nms.") || n.starts_with("const_f32_param")),
        "{kept_f32:?}"
    );
    let e2e = export_onnx_with(&model, &ExportOptions { output: ExportOutput::EndToEnd { max_det: 300 }, ..base }).expect("export");
    assert_eq!(e2e.output_dims(), vec![None, Some(64 + 16 + 4), Some(57)], "k = min(max_det, anchors)");
    let dynamic = ExportOptions { dynamic: true, output: ExportOutput::EndToEnd { max_det: 300 }, ..base };
    let d = export_onnx_with(&model, &dynamic).expect("export");
    assert_eq!(d.input.1[2..], [Dim::Named("height".into()), Dim::Named("width".into())]);
    assert_eq!(d.output_dims(), vec![None, None, Some(57)], "rows follow the size");
    for (bad, key) in [
        (ExportOptions { opset: 12, ..base }, "opset"),
        (ExportOptions { opset: 22, ..base }, "opset"),
        (ExportOptions { output: ExportOutput::EndToEnd { max_det: 0 }, ..base }, "max_det"),
        (ExportOptions { output: ExportOutput::Nms(NmsSettings { conf: 1.5, iou: 0.7, max_det: 1 }), ..base }, "conf"),
    ] {
        let e = export_onnx_with(&model, &bad).unwrap_err();
        assert!(matches!(&e, ExportError::Option { key: k, .. } if *k == key), "{e}");
        assert!(e.to_string().starts_with(&format!("{key}=")), "{e}");
    }
}

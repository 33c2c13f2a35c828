//! The built graph as ONNX protobuf bytes (through `onnx-rs`'s message types, which borrow the
//! graph's strings and slices).

use onnx_rs::ast::{
    Attribute, AttributeType, DataType, Dimension, Graph as PbGraph, Model, Node as PbNode, OpType, OperatorSetId, StringStringEntry,
    TensorProto, TensorShape, TensorShapeDimension, TensorTypeProto, TypeProto, TypeValue, ValueInfo,
};

use crate::graph::{AttrValue, InitData};
use crate::{Dim, OnnxModel};

fn attribute<'a>(name: &'a str, v: &'a AttrValue) -> Attribute<'a> {
    match v {
        AttrValue::Int(i) => Attribute { name, r#type: AttributeType::Int, i: *i, ..Default::default() },
        AttrValue::Ints(is) => Attribute { name, r#type: AttributeType::Ints, ints: is.clone(), ..Default::default() },
        AttrValue::Str(s) => Attribute { name, r#type: AttributeType::String, s: s.as_bytes(), ..Default::default() },
    }
}

fn value_info<'a>(name: &'a str, dims: &'a [Dim], elem_type: DataType) -> ValueInfo<'a> {
    let dim = dims
        .iter()
        .map(|d| TensorShapeDimension {
            value: match d {
                Dim::Fixed(n) => Dimension::Value(*n as i64),
                Dim::Named(s) => Dimension::Param(s),
            },
            ..Default::default()
        })
        .collect();
    let tensor = TensorTypeProto { elem_type, shape: Some(TensorShape { dim }) };
    ValueInfo { name, r#type: Some(TypeProto { value: Some(TypeValue::Tensor(tensor)), ..Default::default() }), ..Default::default() }
}

/// Serialises `m` (opset `m.opset`, its IR version [`crate::ir_version`]); in a half-precision
/// model every float initializer but the f32 op parameters is stored as f16.
pub fn to_bytes(m: &OnnxModel) -> Vec<u8> {
    let as_half = |t: &crate::graph::Initializer| m.half && !t.always_f32 && matches!(t.data, InitData::F32(_));
    let half_bytes: Vec<Vec<u8>> = m
        .graph
        .initializers
        .iter()
        .map(|t| match &t.data {
            InitData::F32(v) if as_half(t) => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
            _ => Vec::new(),
        })
        .collect();
    let nodes = m
        .graph
        .nodes
        .iter()
        .map(|n| PbNode {
            input: n.inputs.iter().map(String::as_str).collect(),
            output: n.outputs.iter().map(String::as_str).collect(),
            name: &n.name,
            op_type: OpType::from(n.op),
            attribute: n.attrs.iter().map(|(k, v)| attribute(k, v)).collect(),
            ..Default::default()
        })
        .collect();
    let initializer = m
        .graph
        .initializers
        .iter()
        .zip(&half_bytes)
        .map(|(t, h)| match &t.data {
            InitData::F32(_) if as_half(t) => TensorProto::from_raw(&t.name, t.dims.clone(), DataType::Float16, h),
            InitData::F32(v) => TensorProto::from_f32(&t.name, t.dims.clone(), v.clone()),
            InitData::I64(v) => TensorProto::from_i64(&t.name, t.dims.clone(), v.clone()),
        })
        .collect();
    let io_type = if m.half { DataType::Float16 } else { DataType::Float };
    let graph = PbGraph {
        node: nodes,
        name: "ptl_yolo26_pose",
        initializer,
        doc_string: &m.doc,
        input: vec![value_info(&m.input.0, &m.input.1, io_type)],
        output: vec![value_info(&m.output.0, &m.output.1, io_type)],
        ..Default::default()
    };
    let model = Model {
        ir_version: crate::ir_version(m.opset),
        opset_import: vec![OperatorSetId { domain: "", version: m.opset }],
        producer_name: "ptl",
        producer_version: env!("CARGO_PKG_VERSION"),
        doc_string: &m.doc,
        graph: Some(graph),
        metadata_props: m.metadata.iter().map(|(k, v)| StringStringEntry { key: k, value: v }).collect(),
        ..Default::default()
    };
    onnx_rs::encode(&model)
}

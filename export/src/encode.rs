//! The built graph as ONNX protobuf bytes (through `onnx-rs`'s message types, which borrow the
//! graph's strings and slices).

use onnx_rs::ast::{
    Attribute, AttributeType, DataType, Dimension, Graph as PbGraph, Model, Node as PbNode, OpType, OperatorSetId, StringStringEntry,
    TensorProto, TensorShape, TensorShapeDimension, TensorTypeProto, TypeProto, TypeValue, ValueInfo,
};

use crate::graph::{AttrValue, InitData};
use crate::{Dim, OnnxModel};

/// ONNX IR version that goes with opset 17.
pub const IR_VERSION: i64 = 8;

fn attribute<'a>(name: &'a str, v: &'a AttrValue) -> Attribute<'a> {
    match v {
        AttrValue::Int(i) => Attribute { name, r#type: AttributeType::Int, i: *i, ..Default::default() },
        AttrValue::Ints(is) => Attribute { name, r#type: AttributeType::Ints, ints: is.clone(), ..Default::default() },
        AttrValue::Str(s) => Attribute { name, r#type: AttributeType::String, s: s.as_bytes(), ..Default::default() },
    }
}

fn value_info<'a>(name: &'a str, dims: &'a [Dim]) -> ValueInfo<'a> {
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
    let tensor = TensorTypeProto { elem_type: DataType::Float, shape: Some(TensorShape { dim }) };
    ValueInfo { name, r#type: Some(TypeProto { value: Some(TypeValue::Tensor(tensor)), ..Default::default() }), ..Default::default() }
}

/// Serialises `m` (opset `m.opset`, IR version [`IR_VERSION`]).
pub fn to_bytes(m: &OnnxModel) -> Vec<u8> {
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
        .map(|t| match &t.data {
            InitData::F32(v) => TensorProto::from_f32(&t.name, t.dims.clone(), v.clone()),
            InitData::I64(v) => TensorProto::from_i64(&t.name, t.dims.clone(), v.clone()),
        })
        .collect();
    let graph = PbGraph {
        node: nodes,
        name: "ptl_yolo26_pose",
        initializer,
        doc_string: &m.doc,
        input: vec![value_info(&m.input.0, &m.input.1)],
        output: vec![value_info(&m.output.0, &m.output.1)],
        ..Default::default()
    };
    let model = Model {
        ir_version: IR_VERSION,
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

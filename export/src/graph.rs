//! An ONNX graph while it is being built: owned names, attributes and initializers, so the
//! emitters need no lifetimes; `encode` turns it into protobuf bytes at the end.
//!
//! Every value name is unique (a repeated base name gets a `_N` suffix), and a node is only
//! appended after the nodes producing its inputs, so the node list is in topological order.

use std::collections::{HashMap, HashSet};

/// A node attribute value (the few kinds the exporter needs).
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// One integer.
    Int(i64),
    /// A list of integers.
    Ints(Vec<i64>),
    /// A string.
    Str(String),
}

/// One graph node with a single op and its attributes.
#[derive(Clone, Debug)]
pub struct Node {
    /// The ONNX op type (`Conv`, `Reshape`, …).
    pub op: &'static str,
    /// The node's unique name.
    pub name: String,
    /// Names of the values it reads, in the op's input order.
    pub inputs: Vec<String>,
    /// Names of the values it writes.
    pub outputs: Vec<String>,
    /// Its attributes by name.
    pub attrs: Vec<(&'static str, AttrValue)>,
}

/// Initializer payload: weights are f32, shapes and split sizes i64.
#[derive(Clone, Debug)]
pub enum InitData {
    /// Float values (weights, scalars).
    F32(Vec<f32>),
    /// Integer values (shapes, axes, split sizes).
    I64(Vec<i64>),
}

/// A constant tensor stored in the file.
#[derive(Clone, Debug)]
pub struct Initializer {
    /// The value name nodes read it by.
    pub name: String,
    /// Its shape.
    pub dims: Vec<i64>,
    /// Its values, row-major.
    pub data: InitData,
    /// An op parameter that ONNX types as f32 whatever the model computes in (`Resize`'s
    /// scales, `NonMaxSuppression`'s thresholds): kept f32 in a half-precision file.
    pub always_f32: bool,
}

/// Nodes and initializers in emission order.
#[derive(Default, Debug)]
pub struct Graph {
    /// The nodes, each after the nodes producing its inputs.
    pub nodes: Vec<Node>,
    /// The constants, in the order they were made.
    pub initializers: Vec<Initializer>,
    taken: HashSet<String>,
    /// i64 constants by value, so a shape used by many reshapes is stored once.
    i64_consts: HashMap<Vec<i64>, String>,
    /// f32 scalars by bit pattern.
    f32_scalars: HashMap<u32, String>,
    /// i64 constants of other shapes (scalars, tables) by shape and value.
    shaped_i64_consts: HashMap<(Vec<i64>, Vec<i64>), String>,
    /// f32 scalars that stay f32 in a half-precision file, by bit pattern.
    f32_params: HashMap<u32, String>,
}

impl Graph {
    /// Reserves `name` for a graph input (nothing may reuse it).
    pub fn reserve(&mut self, name: &str) -> String {
        self.unique(name)
    }

    /// `base`, or `base_N` when taken.
    fn unique(&mut self, base: &str) -> String {
        let mut name = base.to_string();
        let mut n = 1;
        while self.taken.contains(&name) {
            name = format!("{base}_{n}");
            n += 1;
        }
        self.taken.insert(name.clone());
        name
    }

    /// Stores a float initializer (f16 in a half-precision file); returns its (unique) name.
    pub fn init_f32(&mut self, base: &str, dims: &[usize], data: Vec<f32>) -> String {
        self.init_float(base, dims, data, false)
    }

    /// Stores an f32 op parameter that stays f32 in a half-precision file (see
    /// [`Initializer::always_f32`]); returns its (unique) name.
    pub fn init_f32_param(&mut self, base: &str, dims: &[usize], data: Vec<f32>) -> String {
        self.init_float(base, dims, data, true)
    }

    fn init_float(&mut self, base: &str, dims: &[usize], data: Vec<f32>, always_f32: bool) -> String {
        let name = self.unique(base);
        self.initializers.push(Initializer {
            name: name.clone(),
            dims: dims.iter().map(|&d| d as i64).collect(),
            data: InitData::F32(data),
            always_f32,
        });
        name
    }

    /// A 1-D i64 constant (shapes, split sizes), shared between nodes.
    pub fn const_i64(&mut self, values: &[i64]) -> String {
        if let Some(n) = self.i64_consts.get(values) {
            return n.clone();
        }
        let base = format!("const_i64_{}", values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join("_").replace('-', "m"));
        let name = self.unique(&base);
        let data = InitData::I64(values.to_vec());
        self.initializers.push(Initializer { name: name.clone(), dims: vec![values.len() as i64], data, always_f32: false });
        self.i64_consts.insert(values.to_vec(), name.clone());
        name
    }

    /// A rank-0 i64 constant (an index or a count), shared between nodes.
    pub fn const_i64_scalar(&mut self, value: i64) -> String {
        self.const_i64_shaped(&[], vec![value])
    }

    /// An i64 constant of shape `dims`, shared between nodes of the same shape and values.
    pub fn const_i64_shaped(&mut self, dims: &[i64], values: Vec<i64>) -> String {
        if dims.len() == 1 && dims[0] == values.len() as i64 {
            return self.const_i64(&values);
        }
        let key = (dims.to_vec(), values.clone());
        if let Some(n) = self.shaped_i64_consts.get(&key) {
            return n.clone();
        }
        let name = self.unique(&format!(
            "const_i64_r{}_{}",
            dims.len(),
            values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join("_").replace('-', "m")
        ));
        self.initializers.push(Initializer { name: name.clone(), dims: dims.to_vec(), data: InitData::I64(values), always_f32: false });
        self.shaped_i64_consts.insert(key, name.clone());
        name
    }

    /// A scalar f32 constant that stays f32 in a half-precision file (for the f32 selection
    /// steps after the model), shared between nodes.
    pub fn const_f32_param(&mut self, value: f32) -> String {
        if let Some(n) = self.f32_params.get(&value.to_bits()) {
            return n.clone();
        }
        let name = self.unique(&format!("const_f32_param_{value}").replace('-', "m"));
        self.initializers.push(Initializer { name: name.clone(), dims: vec![], data: InitData::F32(vec![value]), always_f32: true });
        self.f32_params.insert(value.to_bits(), name.clone());
        name
    }

    /// A scalar f32 constant (rank 0), shared between nodes.
    pub fn const_f32(&mut self, value: f32) -> String {
        if let Some(n) = self.f32_scalars.get(&value.to_bits()) {
            return n.clone();
        }
        let name = self.unique(&format!("const_f32_{value}").replace('-', "m"));
        self.initializers.push(Initializer { name: name.clone(), dims: vec![], data: InitData::F32(vec![value]), always_f32: false });
        self.f32_scalars.insert(value.to_bits(), name.clone());
        name
    }

    /// Appends a node with one output, named after the node; returns the output name.
    pub fn op(&mut self, op: &'static str, base: &str, inputs: &[&str], attrs: Vec<(&'static str, AttrValue)>) -> String {
        self.op_n(op, base, inputs, 1, attrs).remove(0)
    }

    /// Appends a node with `outputs` outputs (`<node>:0`, `<node>:1`, …); returns their names.
    pub fn op_n(
        &mut self,
        op: &'static str,
        base: &str,
        inputs: &[&str],
        outputs: usize,
        attrs: Vec<(&'static str, AttrValue)>,
    ) -> Vec<String> {
        let name = self.unique(base);
        let outs: Vec<String> =
            if outputs == 1 { vec![name.clone()] } else { (0..outputs).map(|i| self.unique(&format!("{name}:{i}"))).collect() };
        self.nodes.push(Node { op, name, inputs: inputs.iter().map(|s| s.to_string()).collect(), outputs: outs.clone(), attrs });
        outs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_unique_and_constants_are_shared() {
        let mut g = Graph::default();
        let x = g.reserve("x");
        let a = g.op("Sigmoid", "x", &[&x], vec![]);
        assert_eq!(a, "x_1");
        let s1 = g.const_i64(&[0, 4, -1]);
        let s2 = g.const_i64(&[0, 4, -1]);
        assert_eq!(s1, s2);
        assert_eq!(g.initializers.len(), 1);
        let outs = g.op_n("Split", "split", &[&a, &s1], 3, vec![]);
        assert_eq!(outs, vec!["split:0", "split:1", "split:2"]);
        assert_ne!(g.const_f32(2.0), g.const_f32(0.5));
        assert_eq!(g.const_f32(2.0), g.const_f32(2.0));
    }
}

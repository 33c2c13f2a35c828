//! Modules, named parameters/buffers, state dicts and safetensors I/O.
//!
//! Parameters are leaf tensors with `requires_grad`; buffers are plain tensors. Loading a state
//! dict copies values *into* the existing tensors, so parameter and buffer storage keeps its
//! address for the life of the model (CUDA-graph recordings rely on that).

use std::collections::HashMap;
use std::path::Path;

use crate::cpu::CpuStorage;
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Tensor};

/// Whether a state-dict entry is trained or merely carried (e.g. BN running statistics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// A trainable weight.
    Parameter,
    /// State that is saved but not trained (BN statistics, counters).
    Buffer,
}

/// A network component. `visit` must report tensors in PyTorch `state_dict()` order: a module's own
/// parameters, then its own buffers, then each child in registration order.
pub trait Module {
    /// Calls `f` with every parameter and buffer under its state-dict name (prefixed by `prefix`).
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind));
    /// Switches train/eval behaviour (BatchNorm statistics) recursively.
    fn set_training(&mut self, training: bool);
}

/// Implements [`Module`] for a struct whose state is held by children, from one list of them in
/// state-dict order: `visit` and `set_training` are generated from the same list, so a child
/// cannot be visited (and trained) but left out of the train/eval switch, or the other way round.
///
/// Each entry is `"name" => one field` (a module), `"name" => seq field` (a slice or `Vec` of
/// modules, named `name.0`, `name.1`, …) or `"name" => opt field` (an `Option` of a module). A
/// name may hold dots (`"ffn.0"`).
///
/// ```
/// use ptl_autograd::{impl_module, module, Device, Module, Tensor, TensorKind};
///
/// struct Leaf(Tensor);
/// impl Module for Leaf {
///     fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
///         f(&module::join_name(prefix, "weight"), &self.0, TensorKind::Parameter);
///     }
///     fn set_training(&mut self, _: bool) {}
/// }
/// struct Block {
///     a: Leaf,
///     m: Vec<Leaf>,
/// }
/// impl_module!(Block { "cv1" => one a, "m" => seq m });
///
/// let t = || Tensor::zeros(vec![1], ptl_autograd::DType::F32, Device::Cpu).unwrap();
/// let b = Block { a: Leaf(t()), m: vec![Leaf(t()), Leaf(t())] };
/// let names: Vec<String> = module::state_dict(&b).into_iter().map(|e| e.0).collect();
/// assert_eq!(names, ["cv1.weight", "m.0.weight", "m.1.weight"]);
/// ```
#[macro_export]
macro_rules! impl_module {
    ($ty:ty { $($name:literal => $kind:ident $field:ident),* $(,)? }) => {
        impl $crate::Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &$crate::Tensor, $crate::TensorKind)) {
                $( $crate::impl_module!(@visit $kind, &self.$field, &$crate::module::join_name(prefix, $name), f); )*
            }
            fn set_training(&mut self, training: bool) {
                $( $crate::impl_module!(@train $kind, &mut self.$field, training); )*
            }
        }
    };
    (@visit one, $m:expr, $prefix:expr, $f:expr) => {
        $crate::Module::visit($m, $prefix, $f)
    };
    (@visit seq, $m:expr, $prefix:expr, $f:expr) => {
        for (i, child) in $m.iter().enumerate() {
            $crate::Module::visit(child, &$crate::module::join_name($prefix, &i.to_string()), $f);
        }
    };
    (@visit opt, $m:expr, $prefix:expr, $f:expr) => {
        if let Some(child) = $m {
            $crate::Module::visit(child, $prefix, $f);
        }
    };
    (@train one, $m:expr, $t:expr) => {
        $crate::Module::set_training($m, $t)
    };
    (@train seq, $m:expr, $t:expr) => {
        for child in $m.iter_mut() {
            $crate::Module::set_training(child, $t);
        }
    };
    (@train opt, $m:expr, $t:expr) => {
        if let Some(child) = $m {
            $crate::Module::set_training(child, $t);
        }
    };
}

/// `prefix.name`, or `name` when the prefix is empty.
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// A trainable leaf tensor: float, `requires_grad`.
pub fn parameter(t: Tensor) -> Result<Tensor> {
    t.detach().requires_grad_(true)
}

/// All entries in state-dict order.
pub fn state_dict(m: &dyn Module) -> Vec<(String, Tensor, TensorKind)> {
    let mut out = Vec::new();
    m.visit("", &mut |n, t, k| out.push((n.to_string(), t.clone(), k)));
    out
}

/// Parameters in `named_parameters()` order (which optimizers walk).
pub fn named_parameters(m: &dyn Module) -> Vec<(String, Tensor)> {
    state_dict(m).into_iter().filter(|e| e.2 == TensorKind::Parameter).map(|e| (e.0, e.1)).collect()
}

/// Number of parameter elements.
pub fn parameter_count(m: &dyn Module) -> usize {
    named_parameters(m).iter().map(|(_, t)| t.numel()).sum()
}

/// Clears every parameter gradient to `None`.
pub fn zero_grad(m: &dyn Module) {
    for (_, p) in named_parameters(m) {
        p.zero_grad();
    }
}

/// Copies `values` into the module's tensors. With `strict`, a missing or unexpected key is an
/// error; shapes must always match. dtypes are converted to the module's dtype.
pub fn load_state_dict(m: &dyn Module, values: &HashMap<String, Tensor>, strict: bool) -> Result<()> {
    let entries = state_dict(m);
    let mut missing = Vec::new();
    for (name, t, _) in &entries {
        match values.get(name) {
            Some(v) => {
                if v.dims() != t.dims() {
                    return Err(Error::StateDict {
                        msg: format!("`{name}` has shape {:?} in the file but {:?} in the model", v.dims(), t.dims()),
                    });
                }
                let v = v.to_dtype(t.dtype())?.to_device(t.device())?;
                crate::no_grad(|| t.copy_(&v))?;
            }
            None => missing.push(name.clone()),
        }
    }
    if strict {
        let known: std::collections::HashSet<&String> = entries.iter().map(|e| &e.0).collect();
        let mut unexpected: Vec<&String> = values.keys().filter(|k| !known.contains(k)).collect();
        unexpected.sort();
        if !missing.is_empty() || !unexpected.is_empty() {
            return Err(Error::StateDict {
                msg: format!(
                    "keys do not match: missing {:?}, unexpected {:?}",
                    &missing[..missing.len().min(8)],
                    &unexpected[..unexpected.len().min(8)]
                ),
            });
        }
    }
    Ok(())
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::I64 => safetensors::Dtype::I64,
        DType::U8 => safetensors::Dtype::U8,
        DType::Bool => safetensors::Dtype::BOOL,
    }
}

fn from_st_dtype(path: &str, name: &str, d: safetensors::Dtype) -> Result<DType> {
    Ok(match d {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F64 => DType::F64,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::I64 => DType::I64,
        safetensors::Dtype::U8 => DType::U8,
        safetensors::Dtype::BOOL => DType::Bool,
        other => return Err(Error::SafeTensors { path: path.into(), msg: format!("tensor `{name}` has unsupported dtype {other:?}") }),
    })
}

/// Serialises named tensors to safetensors bytes (names kept exactly).
pub fn to_safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    to_safetensors_bytes_with_metadata(tensors, None)
}

/// Like [`to_safetensors_bytes`], with a string→string metadata map in the header.
pub fn to_safetensors_bytes_with_metadata(tensors: &[(String, Tensor)], metadata: Option<HashMap<String, String>>) -> Result<Vec<u8>> {
    let mut owned = Vec::with_capacity(tensors.len());
    for (n, t) in tensors {
        owned.push((n.clone(), t.dtype(), t.dims().to_vec(), t.to_bytes()?));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(st_dtype(*d), s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::SafeTensors { path: "<memory>".into(), msg: format!("`{n}`: {e}") })
        })
        .collect::<Result<_>>()?;
    safetensors::serialize(views, metadata).map_err(|e| Error::SafeTensors { path: "<memory>".into(), msg: e.to_string() })
}

/// Writes named tensors to `path` atomically (temporary file, then rename).
pub fn save_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let bytes = to_safetensors_bytes(tensors)?;
    Ok(ptl_files::write_atomic(path, &bytes, 0o644)?)
}

/// Parses safetensors bytes into tensors on `device` (order of the file's header is not kept;
/// the names are returned sorted).
pub fn from_safetensors_bytes(bytes: &[u8], device: Device, origin: &str) -> Result<Vec<(String, Tensor)>> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| Error::SafeTensors { path: origin.into(), msg: e.to_string() })?;
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    let mut out = Vec::with_capacity(names.len());
    for n in names {
        let v = st.tensor(&n).map_err(|e| Error::SafeTensors { path: origin.into(), msg: format!("`{n}`: {e}") })?;
        let dt = from_st_dtype(origin, &n, v.dtype())?;
        let cpu = CpuStorage::from_bytes(dt, v.data())?;
        let t = Tensor::from_storage(Storage::from_cpu(cpu, device)?, v.shape().to_vec())?;
        out.push((n, t));
    }
    Ok(out)
}

/// The header metadata of safetensors bytes (empty when there is none).
pub fn safetensors_metadata(bytes: &[u8], origin: &str) -> Result<HashMap<String, String>> {
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| Error::SafeTensors { path: origin.into(), msg: e.to_string() })?;
    Ok(meta.metadata().clone().unwrap_or_default())
}

/// Reads every tensor of a safetensors file.
pub fn load_safetensors(path: &Path, device: Device) -> Result<HashMap<String, Tensor>> {
    let bytes = ptl_files::read_regular(path)?;
    Ok(from_safetensors_bytes(&bytes, device, &path.display().to_string())?.into_iter().collect())
}

/// Saves a module's state dict (parameters and buffers) with its names.
pub fn save_module(m: &dyn Module, path: &Path) -> Result<()> {
    let entries: Vec<(String, Tensor)> = state_dict(m).into_iter().map(|e| (e.0, e.1)).collect();
    save_safetensors(path, &entries)
}

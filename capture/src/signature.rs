//! The key a recording is stored under.

use ptl_autograd::{DType, Device, Tensor};

/// Shape, dtype, device and `requires_grad` of one input.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InputSig {
    /// Its shape.
    pub dims: Vec<usize>,
    /// Its dtype.
    pub dtype: DType,
    /// Its device.
    pub device: Device,
    /// Whether it needs a gradient (docs/capture.md §5).
    pub requires_grad: bool,
}

/// Everything a recording's validity depends on besides the surface buffers' addresses.
/// The gradient mask (which outputs receive gradients) keys the backward graphs inside a
/// recording.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    /// The inputs' signatures, in order.
    pub inputs: Vec<InputSig>,
    /// Grad mode at the call (no grad: a forward-only recording).
    pub grad_enabled: bool,
    /// Train/eval of the region.
    pub training: bool,
    /// The autocast dtype (`None`: full precision).
    pub precision: Option<DType>,
}

impl Signature {
    /// The signature of a call with `inputs` under these modes.
    pub fn of(inputs: &[Tensor], grad_enabled: bool, training: bool, precision: Option<DType>) -> Signature {
        Signature {
            inputs: inputs
                .iter()
                .map(|t| InputSig { dims: t.dims().to_vec(), dtype: t.dtype(), device: t.device(), requires_grad: t.requires_grad() })
                .collect(),
            grad_enabled,
            training,
            precision,
        }
    }

    /// A compact text form for summaries (`2x3x32x32:f32*`, `*` = requires grad).
    pub fn short(&self) -> String {
        let ins: Vec<String> = self
            .inputs
            .iter()
            .map(|i| {
                let d: Vec<String> = i.dims.iter().map(|d| d.to_string()).collect();
                format!("{}:{}{}", d.join("x"), i.dtype, if i.requires_grad { "*" } else { "" })
            })
            .collect();
        format!(
            "[{}]{}{}{}",
            ins.join(","),
            if self.training { " train" } else { " eval" },
            if self.grad_enabled { "" } else { " no_grad" },
            self.precision.map(|p| format!(" autocast:{p}")).unwrap_or_default()
        )
    }
}

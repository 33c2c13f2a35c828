//! The one error type of `ptl-autograd`.
//!
//! Every variant names the operation and the offending shapes/dtypes so that a user reading the
//! message knows which call was wrong and what it expected.

use crate::{DType, Device};

/// Errors raised by tensor operations, the autograd engine and state-dict I/O.
#[derive(thiserror::Error, Debug)]
pub enum Error {
    // ---- shapes -------------------------------------------------------------------------------
    /// Two operands whose shapes must match do not.
    #[error("{op}: shape mismatch, lhs {lhs:?} vs rhs {rhs:?}")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// The first operand's.
        lhs: Vec<usize>,
        /// The second operand's.
        rhs: Vec<usize>,
    },

    /// Two shapes that do not broadcast together.
    #[error("{op}: shapes {lhs:?} and {rhs:?} cannot be broadcast together")]
    BroadcastIncompatible {
        /// The operation.
        op: &'static str,
        /// The first operand's.
        lhs: Vec<usize>,
        /// The second operand's.
        rhs: Vec<usize>,
    },

    /// A dimension index outside the tensor's rank.
    #[error("{op}: dimension {dim} is out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The dimension given.
        dim: isize,
        /// The tensor's rank.
        rank: usize,
    },

    /// An index outside a dimension's size.
    #[error("{op}: index {index} is out of range for size {size}")]
    IndexOutOfRange {
        /// The operation.
        op: &'static str,
        /// The index given.
        index: i64,
        /// The dimension's size.
        size: usize,
    },

    /// A reshape to a shape with another element count.
    #[error("{op}: cannot reshape {from:?} ({from_numel} elements) into {to:?} ({to_numel} elements)")]
    ReshapeNumel {
        /// The operation.
        op: &'static str,
        /// The source shape.
        from: Vec<usize>,
        /// Its element count.
        from_numel: usize,
        /// The target shape.
        to: Vec<usize>,
        /// Its element count.
        to_numel: usize,
    },

    /// An argument the op does not take.
    #[error("{op}: invalid arguments: {msg}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        msg: String,
    },

    /// A file that could not be read safely (not a regular file, unreadable).
    #[error(transparent)]
    File(ptl_files::FileError),

    // ---- dtypes and devices -------------------------------------------------------------------
    /// Two operands of different dtypes where one is needed.
    #[error("{op}: dtype mismatch, lhs {lhs:?} vs rhs {rhs:?} (cast one side with `to_dtype`)")]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// The first operand's.
        lhs: DType,
        /// The second operand's.
        rhs: DType,
    },

    /// A dtype the op does not handle.
    #[error("{op}: dtype {dtype:?} is not supported here (expected {expected})")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype given.
        dtype: DType,
        /// What it takes instead.
        expected: &'static str,
    },

    /// Operands on different devices.
    #[error("{op}: device mismatch, lhs {lhs:?} vs rhs {rhs:?} (move one side with `to_device`)")]
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// The first operand's.
        lhs: Device,
        /// The second operand's.
        rhs: Device,
    },

    /// A device that cannot be used.
    #[error("{op}: device {device:?} is not available: {reason}")]
    DeviceUnavailable {
        /// The operation.
        op: &'static str,
        /// The device.
        device: Device,
        /// Why it cannot be used.
        reason: String,
    },

    // ---- autograd -----------------------------------------------------------------------------
    /// The backward pass failed.
    #[error("backward: {msg}")]
    Backward {
        /// What is wrong.
        msg: String,
    },

    /// A backward function returned a gradient of the wrong shape.
    #[error("backward of {node}: gradient for input {input} has shape {got:?}, expected {expected:?}")]
    GradShape {
        /// The autograd node.
        node: String,
        /// Which of its inputs.
        input: usize,
        /// The gradient's shape.
        got: Vec<usize>,
        /// The input's shape.
        expected: Vec<usize>,
    },

    /// An in-place write that would corrupt autograd or a channels-last tensor.
    #[error("in-place update of {what}: {msg}")]
    InPlace {
        /// What was written to.
        what: String,
        /// What is wrong.
        msg: String,
    },

    // ---- state dicts and files ----------------------------------------------------------------
    /// A state dict that does not fit the module.
    #[error("state dict: {msg}")]
    StateDict {
        /// What is wrong.
        msg: String,
    },

    /// A safetensors file that cannot be read or written.
    #[error("safetensors file {path}: {msg}")]
    SafeTensors {
        /// The file.
        path: String,
        /// What is wrong.
        msg: String,
    },

    /// A file operation failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's error.
        source: std::io::Error,
    },

    // ---- backends -----------------------------------------------------------------------------
    /// A CUDA driver, library or kernel call failed.
    #[error("CUDA backend: {0}")]
    Cuda(String),

    /// The device had no room for an allocation: smaller work (a smaller batch or image size)
    /// may fit.
    #[error("cuda:{device}: out of device memory allocating {bytes} bytes ({free} bytes free on the device)")]
    OutOfMemory {
        /// The CUDA device ordinal.
        device: usize,
        /// Bytes asked for.
        bytes: u64,
        /// Bytes free on the device.
        free: u64,
    },

    /// CUDA cannot be used in this process.
    #[error("CUDA is not usable: {0}")]
    CudaUnavailable(CudaSetupError),
}

/// Why CUDA cannot be used in this process (returned as [`Error::CudaUnavailable`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaSetupError {
    /// The driver library (`libcuda.so`) could not be loaded.
    NoDriver,
    /// The driver loaded but reports no GPU (or failed to initialise).
    NoDevice {
        /// What the driver said.
        detail: String,
    },
    /// `cuda:N` was asked for but only `count` GPUs are visible.
    BadOrdinal {
        /// The GPU asked for.
        ordinal: usize,
        /// GPUs visible.
        count: usize,
    },
    /// A CUDA library we need (nvrtc, cublas, cudnn) could not be loaded.
    MissingLibrary {
        /// The library.
        name: &'static str,
    },
    /// Context creation, kernel compilation or handle creation failed.
    Init {
        /// What the driver said.
        detail: String,
    },
}

impl std::fmt::Display for CudaSetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaSetupError::NoDriver => {
                f.write_str("CUDA driver not found (libcuda.so could not be loaded; is an NVIDIA driver installed?)")
            }
            CudaSetupError::NoDevice { detail } => write!(f, "no CUDA GPU found ({detail})"),
            CudaSetupError::BadOrdinal { ordinal, count } => write!(f, "cuda:{ordinal} requested but {count} GPU(s) are visible"),
            CudaSetupError::MissingLibrary { name } => {
                write!(f, "CUDA library {name} not found (install it or add its directory to LD_LIBRARY_PATH)")
            }
            CudaSetupError::Init { detail } => write!(f, "CUDA initialisation failed: {detail}"),
        }
    }
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument { op, msg: msg.into() }
    }
}

/// A plain read or write failure stays [`Error::Io`]; the rest of `ptl-files`' errors keep their
/// own words.
impl From<ptl_files::FileError> for Error {
    fn from(e: ptl_files::FileError) -> Self {
        match e {
            ptl_files::FileError::Io { path, source } => Error::Io { path: path.display().to_string(), source },
            other => Error::File(other),
        }
    }
}

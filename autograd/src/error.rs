//! The one error type of `ptl-autograd`.
//!
//! Every variant names the operation and the offending shapes/dtypes so that a user reading the
//! message knows which call was wrong and what it expected.

use crate::{DType, Device};

/// Errors raised by tensor operations, the autograd engine and state-dict I/O.
#[derive(thiserror::Error, Debug)]
pub enum Error {
    // ---- shapes -------------------------------------------------------------------------------
    #[error("{op}: shape mismatch, lhs {lhs:?} vs rhs {rhs:?}")]
    ShapeMismatch { op: &'static str, lhs: Vec<usize>, rhs: Vec<usize> },

    #[error("{op}: shapes {lhs:?} and {rhs:?} cannot be broadcast together")]
    BroadcastIncompatible { op: &'static str, lhs: Vec<usize>, rhs: Vec<usize> },

    #[error("{op}: dimension {dim} is out of range for a tensor of rank {rank}")]
    DimOutOfRange { op: &'static str, dim: isize, rank: usize },

    #[error("{op}: index {index} is out of range for size {size}")]
    IndexOutOfRange { op: &'static str, index: i64, size: usize },

    #[error("{op}: cannot reshape {from:?} ({from_numel} elements) into {to:?} ({to_numel} elements)")]
    ReshapeNumel { op: &'static str, from: Vec<usize>, from_numel: usize, to: Vec<usize>, to_numel: usize },

    #[error("{op}: invalid arguments: {msg}")]
    InvalidArgument { op: &'static str, msg: String },

    /// A file that could not be read safely (not a regular file, unreadable).
    #[error(transparent)]
    File(ptl_files::FileError),

    // ---- dtypes and devices -------------------------------------------------------------------
    #[error("{op}: dtype mismatch, lhs {lhs:?} vs rhs {rhs:?} (cast one side with `to_dtype`)")]
    DTypeMismatch { op: &'static str, lhs: DType, rhs: DType },

    #[error("{op}: dtype {dtype:?} is not supported here (expected {expected})")]
    UnsupportedDType { op: &'static str, dtype: DType, expected: &'static str },

    #[error("{op}: device mismatch, lhs {lhs:?} vs rhs {rhs:?} (move one side with `to_device`)")]
    DeviceMismatch { op: &'static str, lhs: Device, rhs: Device },

    #[error("{op}: device {device:?} is not available: {reason}")]
    DeviceUnavailable { op: &'static str, device: Device, reason: String },

    // ---- autograd -----------------------------------------------------------------------------
    #[error("backward: {msg}")]
    Backward { msg: String },

    #[error("backward of {node}: gradient for input {input} has shape {got:?}, expected {expected:?}")]
    GradShape { node: String, input: usize, got: Vec<usize>, expected: Vec<usize> },

    #[error("in-place update of {what}: {msg}")]
    InPlace { what: String, msg: String },

    // ---- state dicts and files ----------------------------------------------------------------
    #[error("state dict: {msg}")]
    StateDict { msg: String },

    #[error("safetensors file {path}: {msg}")]
    SafeTensors { path: String, msg: String },

    #[error("I/O error on {path}: {source}")]
    Io { path: String, source: std::io::Error },

    // ---- backends -----------------------------------------------------------------------------
    #[error("CUDA backend: {0}")]
    Cuda(String),

    /// The device had no room for an allocation: smaller work (a smaller batch or image size)
    /// may fit.
    #[error("cuda:{device}: out of device memory allocating {bytes} bytes ({free} bytes free on the device)")]
    OutOfMemory { device: usize, bytes: u64, free: u64 },

    #[error("CUDA is not usable: {0}")]
    CudaUnavailable(CudaSetupError),
}

/// Why CUDA cannot be used in this process (returned as [`Error::CudaUnavailable`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaSetupError {
    /// The driver library (`libcuda.so`) could not be loaded.
    NoDriver,
    /// The driver loaded but reports no GPU (or failed to initialise).
    NoDevice { detail: String },
    /// `cuda:N` was asked for but only `count` GPUs are visible.
    BadOrdinal { ordinal: usize, count: usize },
    /// A CUDA library we need (nvrtc, cublas, cudnn) could not be loaded.
    MissingLibrary { name: &'static str },
    /// Context creation, kernel compilation or handle creation failed.
    Init { detail: String },
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

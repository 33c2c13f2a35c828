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
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument { op, msg: msg.into() }
    }
}

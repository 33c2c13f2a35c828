//! The one error type of `ptl-export`.

use std::path::PathBuf;

/// Errors raised while exporting a model.
#[derive(thiserror::Error, Debug)]
pub enum ExportError {
    /// `format=` names a format ptl cannot write.
    #[error("unknown export format `{given}`: ptl exports {known} (e.g. format=onnx)")]
    UnknownFormat {
        /// The value given.
        given: String,
        /// The formats ptl writes.
        known: &'static str,
    },

    /// The input size cannot be fed to the model.
    #[error("imgsz {h}×{w}: {reason}")]
    ImageSize {
        /// Requested height.
        h: usize,
        /// Requested width.
        w: usize,
        /// Why it cannot be used.
        reason: String,
    },

    /// An export setting is out of range (names the key and what it takes).
    #[error("{key}={reason}")]
    Option {
        /// The setting's key.
        key: &'static str,
        /// What was given and what the key takes.
        reason: String,
    },

    /// A module of the model has a shape the exporter does not handle (names the module).
    #[error("cannot export {module}: {reason}")]
    Unsupported {
        /// The module's name in the model.
        module: String,
        /// What about it the exporter does not handle.
        reason: String,
    },

    /// Reading a weight from the model failed.
    #[error(transparent)]
    Tensor(#[from] ptl_autograd::Error),

    /// The model itself refused (e.g. anchors for these feature sizes).
    #[error(transparent)]
    Model(#[from] ptl_heads::HeadsError),

    /// The file could not be written.
    #[error("cannot write {path}: {source} (choose another out=)")]
    Io {
        /// The file that could not be written.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, ExportError>;

impl ExportError {
    pub(crate) fn unsupported(module: &str, reason: impl Into<String>) -> Self {
        ExportError::Unsupported { module: module.to_string(), reason: reason.into() }
    }
}

//! The one error type of `ptl-heads`.

/// Errors raised while building, loading or running the model.
#[derive(thiserror::Error, Debug)]
pub enum HeadsError {
    /// A tensor operation, state-dict or safetensors error from `ptl-autograd`.
    #[error(transparent)]
    Tensor(#[from] ptl_autograd::Error),

    /// The model configuration cannot be built (e.g. a keypoint shape without 2 or 3 values).
    #[error("model config: {0}")]
    Config(String),

    /// An input tensor has the wrong rank, size or dtype for this model.
    #[error("{op}: bad input: {msg}")]
    Input {
        /// The operation that refused it.
        op: &'static str,
        /// What is wrong with the input.
        msg: String,
    },

    /// A [`crate::PieceRunner`] could not run a piece (e.g. a replay plugin's recorder failed).
    #[error("piece {piece}: {msg}")]
    Runner {
        /// The piece.
        piece: String,
        /// What went wrong.
        msg: String,
    },
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, HeadsError>;

impl HeadsError {
    pub(crate) fn input(op: &'static str, msg: impl Into<String>) -> Self {
        HeadsError::Input { op, msg: msg.into() }
    }
}

//! The one error type of the crate.

/// Everything that can go wrong while recording or replaying a region.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// An error from a tensor op (inside the region or in the recorder's copies).
    #[error(transparent)]
    Tensor(#[from] ptl_autograd::Error),
    /// A host read or synchronisation during capture.
    #[error("region `{region}`: host synchronisation `{op}` during capture")]
    HostSync {
        /// The region's name.
        region: String,
        /// The operation that did it.
        op: String,
    },
    /// An upload of fresh host data during capture.
    #[error("region `{region}`: host-to-device upload `{op}` during capture")]
    HostUpload {
        /// The region's name.
        region: String,
        /// The operation that did it.
        op: String,
    },
    /// An allocation that the recording's pool could not serve during capture.
    #[error("region `{region}`: allocation of {requested} bytes outside the recording's pool during capture ({free} bytes free)")]
    AllocOutsidePool {
        /// The region's name.
        region: String,
        /// Bytes asked for.
        requested: usize,
        /// Bytes left in the arena.
        free: usize,
    },
    /// A library's workspace (cuDNN, cuBLAS) would have had to grow during capture: device state
    /// that must not come from the recording's arena. The region's warm-up grows it; this means
    /// the capture ran work its warm-up did not.
    #[error("region `{region}`: {library}'s workspace would have to grow to {requested} bytes during capture (its warm-up did not run the same work)")]
    WorkspaceGrowth {
        /// The region's name.
        region: String,
        /// The library whose workspace it is (cuDNN, cuBLAS).
        library: &'static str,
        /// Bytes asked for.
        requested: usize,
    },
    /// A capture started while another capture is running on this thread.
    #[error("region `{region}`: nested capture")]
    NestedCapture {
        /// The region's name.
        region: String,
    },
    /// The capture recorded nothing (work went to another stream or device).
    #[error("region `{region}`: the captured graph is empty")]
    EmptyGraph {
        /// The region's name.
        region: String,
    },
    /// A forward replay was asked for while the previous forward's backward is outstanding.
    #[error("region `{region}`: forward replay while the previous backward is pending")]
    PendingBackward {
        /// The region's name.
        region: String,
    },
    /// A surface buffer changed address since capture.
    #[error("region `{region}`: `{buffer}` changed storage since capture; the recording is stale")]
    StaleRecording {
        /// The region's name.
        region: String,
        /// The surface buffer that moved.
        buffer: String,
    },
    /// A backward with a gradient mask that was not declared (strict masks).
    #[error("region `{region}`: gradient mask {mask:?} was not declared")]
    UnexpectedGradMask {
        /// The region's name.
        region: String,
        /// The call's gradient mask.
        mask: Vec<bool>,
    },
    /// A gradient or input does not match the static buffer it must be copied into.
    #[error("region `{region}`: {what} does not match the recording ({got} vs {expected})")]
    Mismatch {
        /// The region's name.
        region: String,
        /// What does not match.
        what: String,
        /// What the call brought.
        got: String,
        /// What the recording holds.
        expected: String,
    },
    /// The region misbehaved (e.g. returned a different number of outputs).
    #[error("region `{region}`: {msg}")]
    Region {
        /// The region's name.
        region: String,
        /// What went wrong.
        msg: String,
    },
    /// The backend failed (driver error, device unavailable…).
    #[error("capture backend: {0}")]
    Backend(String),
}

impl CaptureError {
    /// A short stable name of the variant (used in counters and warnings).
    pub fn kind(&self) -> &'static str {
        match self {
            CaptureError::Tensor(_) => "tensor",
            CaptureError::HostSync { .. } => "host_sync",
            CaptureError::HostUpload { .. } => "host_upload",
            CaptureError::AllocOutsidePool { .. } => "alloc_outside_pool",
            CaptureError::WorkspaceGrowth { .. } => "workspace_growth",
            CaptureError::NestedCapture { .. } => "nested_capture",
            CaptureError::EmptyGraph { .. } => "empty_graph",
            CaptureError::PendingBackward { .. } => "pending_backward",
            CaptureError::StaleRecording { .. } => "stale_recording",
            CaptureError::UnexpectedGradMask { .. } => "unexpected_grad_mask",
            CaptureError::Mismatch { .. } => "mismatch",
            CaptureError::Region { .. } => "region",
            CaptureError::Backend(_) => "backend",
        }
    }
}

impl From<CaptureError> for ptl_autograd::Error {
    fn from(e: CaptureError) -> Self {
        match e {
            CaptureError::Tensor(e) => e,
            other => ptl_autograd::Error::Backward { msg: other.to_string() },
        }
    }
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, CaptureError>;

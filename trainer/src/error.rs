//! One error type for the crate so callers can `?` through loss, fit and metrics.

use std::path::PathBuf;

/// Crate-wide result alias.
pub type Result<T> = std::result::Result<T, TrainerError>;

/// Errors reachable from user input (shapes, values, files).
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// A buffer does not have the length its declared shape implies.
    #[error("shape mismatch for {what}: expected {expected} elements ({shape}), got {got}")]
    ShapeMismatch {
        /// What was checked.
        what: &'static str,
        /// Its shape.
        shape: String,
        /// The size expected.
        expected: usize,
        /// The size found.
        got: usize,
    },
    /// An invalid argument (e.g. threshold outside [0, 1], zero keypoints).
    #[error("invalid argument {what}: {reason}")]
    InvalidArgument {
        /// What was checked.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A NaN (or infinite) value in predictions or ground truth; metrics would silently be NaN.
    #[error("non-finite value in {what} at flat index {index}: {value}")]
    NonFinite {
        /// What was checked.
        what: &'static str,
        /// The element.
        index: usize,
        /// The value.
        value: f64,
    },
    /// A file could not be read or written.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Malformed JSON (syntax or schema), with the position serde_json reports.
    #[error("malformed JSON in {path} at line {line}, column {column}: {msg}")]
    Json {
        /// The file.
        path: PathBuf,
        /// Line (1-based).
        line: usize,
        /// Column (1-based).
        column: usize,
        /// What is wrong.
        msg: String,
    },
    /// JSON that parses but is inconsistent (e.g. results for an image not in the GT).
    #[error("inconsistent COCO data: {0}")]
    Coco(String),
    /// Resuming with a setting that differs from the run's own (only machine settings may change).
    #[error(
        "resume from {path}: `{key}` is {given} here but the run was trained with {stored}; drop it (resume restores the run's \
         settings) or, to train differently, start a new run from the weights"
    )]
    ResumeMismatch {
        /// The file.
        path: PathBuf,
        /// The setting.
        key: String,
        /// Its value in the checkpoint.
        stored: String,
        /// The value given now.
        given: String,
    },
    /// The loss stayed non-finite after the recovery attempts (docs/training.md §9).
    #[error(
        "non-finite loss at epoch {epoch}, batch {batch} (step {step}): {term} is {value} ({attempts} reloads of the last \
         checkpoint did not help); likely cause: {hint}"
    )]
    NonFiniteLoss {
        /// The epoch.
        epoch: usize,
        /// The batch in the epoch.
        batch: usize,
        /// The optimizer step.
        step: usize,
        /// The loss term.
        term: &'static str,
        /// The value.
        value: f64,
        /// Reloads tried.
        attempts: usize,
        /// What to change.
        hint: String,
    },
    /// Start weights (`model=…safetensors` / `.ckpt`) that do not fit the model: `tensor` names
    /// the first entry that is missing, unexpected or of another shape.
    #[error("start weights {path}: `{tensor}` {reason}")]
    StartWeights {
        /// The file.
        path: PathBuf,
        /// The first tensor that does not fit.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint that cannot be used (truncated, foreign, wrong format version).
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// The fit stopped for a signal after writing a checkpoint at its place (`checkpoint`; `None`
    /// when the interrupted epoch could not be kept and the last epoch's checkpoint stays).
    #[error("{} received: training stopped{}", crate::fit::interrupt::signal_name(*signal), match checkpoint {
        Some(p) => format!("; resume with `ptl train resume={}`", p.display()),
        None => String::new(),
    })]
    Interrupted {
        /// The signal received.
        signal: i32,
        /// The checkpoint written before stopping, if any.
        checkpoint: Option<PathBuf>,
    },
    /// A file that could not be read or written safely (not a regular file, a run folder in use, …).
    #[error(transparent)]
    File(ptl_files::FileError),
    /// The run's batch ran the device out of memory; `fits` is the batch AutoBatch chooses for
    /// 60 % of it.
    #[error(
        "batch={batch} does not fit in the memory of cuda:{device}; batch={fits} would (AutoBatch's choice for 60 % of the \
         memory; batch=-1 picks it itself). The failure: {detail}"
    )]
    BatchDoesNotFit {
        /// The batch in the epoch.
        batch: usize,
        /// The CUDA device ordinal.
        device: usize,
        /// The batch AutoBatch would choose.
        fits: usize,
        /// What ran out.
        detail: String,
    },
    /// A collective of data-parallel training could not complete on rank `rank`: another rank
    /// left the group (it failed or ended) or did not arrive within the watchdog's time.
    #[error("rank {rank}: {reason}")]
    Collective {
        /// The rank reporting it.
        rank: usize,
        /// What happened, naming the other rank where known.
        reason: String,
    },
    /// A worker process of a multi-GPU run ended with a failure; the launcher ended the others.
    #[error("rank {rank}'s worker exited with {status}; the other ranks were ended (resume from the run's weights/last.ckpt)")]
    WorkerFailed {
        /// The worker's rank.
        rank: usize,
        /// How it exited.
        status: String,
    },
    /// An error from the tensor library (shapes, dtypes, devices, backward).
    #[error("tensor error: {0}")]
    Tensor(#[from] ptl_autograd::Error),
    /// An error from the dataset pipeline (files, labels, images).
    #[error("data: {0}")]
    Data(#[from] ptl_data::DataError),
    /// An error from the model crate.
    #[error("model: {0}")]
    Model(#[from] ptl_heads::HeadsError),
    /// A plot or prediction image could not be drawn (`what` names the file or the drawing).
    #[error("plot {what}: {reason}")]
    Plot {
        /// What was checked.
        what: String,
        /// What is wrong.
        reason: String,
    },
}

impl TrainerError {
    /// Build a [`TrainerError::ShapeMismatch`] from a shape slice.
    pub fn shape(what: &'static str, shape: &[usize], got: usize) -> Self {
        TrainerError::ShapeMismatch { what, shape: format!("{shape:?}"), expected: shape.iter().product(), got }
    }
}

/// Check `data.len() == prod(shape)`.
pub(crate) fn check_len<T>(what: &'static str, data: &[T], shape: &[usize]) -> Result<()> {
    let expected: usize = shape.iter().product();
    if data.len() != expected {
        return Err(TrainerError::shape(what, shape, data.len()));
    }
    Ok(())
}

/// Reject NaN/inf: Ultralytics would propagate them into NaN metrics; we fail loudly instead.
pub(crate) fn check_finite(what: &'static str, data: &[f32]) -> Result<()> {
    match data.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(TrainerError::NonFinite { what, index, value: f64::from(data[index]) }),
        None => Ok(()),
    }
}

/// A plain read or write failure stays [`TrainerError::Io`]; the rest of `ptl-files`' errors keep
/// their own words.
impl From<ptl_files::FileError> for TrainerError {
    fn from(e: ptl_files::FileError) -> Self {
        match e {
            ptl_files::FileError::Io { path, source } => TrainerError::Io { path, source },
            other => TrainerError::File(other),
        }
    }
}

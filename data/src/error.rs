//! The crate's single error type.

use std::path::PathBuf;

/// Every failure `ptl-data` reports. Messages name the file (and line/column where known) and say how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or folder could not be read or written.
    #[error("{path}: {source} (check that the path exists and is readable/writable)")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The dataset YAML could not be parsed.
    #[error("{path}:{line}:{column}: invalid dataset yaml: {message} (fix the YAML syntax at that location)")]
    Yaml {
        /// The file or folder.
        path: PathBuf,
        /// Line (1-based).
        line: usize,
        /// Column (1-based).
        column: usize,
        /// What is wrong there.
        message: String,
    },
    /// The dataset YAML parsed but a field is missing or inconsistent.
    #[error("{path}: dataset yaml field `{field}`: {message}")]
    Config {
        /// The file or folder.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// What is wrong there.
        message: String,
    },
    /// A COCO keypoints JSON file could not be parsed.
    #[error("{path}:{line}:{column}: invalid COCO JSON: {message} (fix the JSON at that location)")]
    Json {
        /// The file or folder.
        path: PathBuf,
        /// Line (1-based).
        line: usize,
        /// Column (1-based).
        column: usize,
        /// What is wrong there.
        message: String,
    },
    /// A folder or list file named by the dataset configuration does not exist.
    #[error("{path}: {what} does not exist (check `path` and the split entries of the dataset yaml)")]
    MissingPath {
        /// The file or folder.
        path: PathBuf,
        /// What the path was meant to be.
        what: &'static str,
    },
    /// No label file at all was found for a training split.
    #[error("no label files found for split `{split}` under {labels_dir} (expected labels/<split>/*.txt next to images/<split>/)")]
    NoLabels {
        /// The split (`train`, `val`, …).
        split: String,
        /// Where labels were looked for.
        labels_dir: PathBuf,
    },
    /// Nothing usable is left after skipping bad files.
    #[error("split `{split}` has no usable images ({found} found, {skipped} skipped: {reasons}); fix or remove the bad files listed in the warnings")]
    EmptyDataset {
        /// The split (`train`, `val`, …).
        split: String,
        /// Images found.
        found: usize,
        /// Images skipped.
        skipped: usize,
        /// Why they were skipped.
        reasons: String,
    },
    /// An image could not be decoded.
    #[error("{path}: cannot decode image: {message} (re-save the file as JPEG or PNG)")]
    Decode {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong there.
        message: String,
    },
    /// A COCO keypoints file whose annotations are all unusable.
    #[error("{path}: no usable annotation ({summary}); check the file against the COCO keypoints format")]
    NoUsableAnnotations {
        /// The file or folder.
        path: PathBuf,
        /// How many annotations were skipped, by reason.
        summary: String,
    },
    /// The image header claims more pixels than [`crate::image::MAX_PIXELS`]: not decoded.
    #[error("{path}: image of {w}x{h} pixels is larger than the {max_pixels}-pixel limit (skipped; downscale it)")]
    ImageTooLarge {
        /// The file or folder.
        path: PathBuf,
        /// Width in pixels.
        w: u32,
        /// Height in pixels.
        h: u32,
        /// The limit.
        max_pixels: u64,
    },
    /// An image could not be encoded (synthetic dataset writer).
    #[error("{path}: cannot encode image: {message}")]
    Encode {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong there.
        message: String,
    },
    /// A label file or annotation violates the label rules (docs/data.md §1).
    #[error("{path}{}: {message}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    Label {
        /// The file or folder.
        path: PathBuf,
        /// Line (1-based).
        line: Option<usize>,
        /// What is wrong there.
        message: String,
    },
    /// Invalid arguments given by the caller (loader configuration, synth options, …).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A device operation (upload, kernel compile or launch) failed.
    #[error("device: {0} (check the CUDA setup: `ptl train --device cpu` runs without a GPU)")]
    Device(String),
    /// A file could not be read or written safely (not a regular file, too large, a shared cache
    /// folder, …).
    #[error(transparent)]
    File(ptl_files::FileError),
    /// Building a training batch failed or panicked (the message names the batch and its
    /// images); the prefetching pool was shut down.
    #[error("training batch could not be built: {0}")]
    Worker(String),
}

/// A plain read or write failure stays [`DataError::Io`]; the rest of `ptl-files`' errors (not a
/// regular file, too large, a shared cache folder) keep their own words.
impl From<ptl_files::FileError> for DataError {
    fn from(e: ptl_files::FileError) -> Self {
        match e {
            ptl_files::FileError::Io { path, source } => DataError::Io { path, source },
            other => DataError::File(other),
        }
    }
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io { path: path.into(), source }
    }
}

/// Result alias of this crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

//! Run artefacts: the summary JSON (timings, memory, metrics, hashes) and `results.csv`.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// Median, range and 10th/90th percentiles of timed steps (milliseconds). The percentiles use the
/// same index rule as the Ultralytics reference script (`sorted[int(q·(n−1))]`), so they compare directly.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTiming {
    pub timed_steps: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    #[serde(default)]
    pub p10_ms: f64,
    #[serde(default)]
    pub p90_ms: f64,
}

impl StepTiming {
    /// Statistics of `samples` (ms); empty input gives zeros.
    pub fn from_samples(samples: &[f64]) -> Self {
        if samples.is_empty() {
            return StepTiming::default();
        }
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        let n = s.len();
        let median = if n % 2 == 1 { s[n / 2] } else { 0.5 * (s[n / 2 - 1] + s[n / 2]) };
        let q = |f: f64| s[(f * (n - 1) as f64) as usize];
        StepTiming { timed_steps: n, median_ms: median, min_ms: s[0], max_ms: s[n - 1], p10_ms: q(0.1), p90_ms: q(0.9) }
    }
}

/// SHA-256 hashes of the run's end state (hex).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunHashes {
    pub model: String,
    pub optimizer: String,
    pub scheduler: String,
    pub ema: String,
    pub step_losses: String,
}

/// The run summary written next to the checkpoints.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub device: String,
    pub precision: String,
    pub epochs: usize,
    pub batch: usize,
    pub imgsz: usize,
    pub optimizer: String,
    pub total_runtime_s: f64,
    pub step_time: StepTiming,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    /// Part of the allocated memory held by the math libraries' workspaces (cuBLAS and cached
    /// cuDNN plans) at the end of the run; `None` on the CPU.
    #[serde(default)]
    pub library_workspace_bytes: Option<u64>,
    pub optimizer_steps: u64,
    pub final_metrics: Vec<(String, f64)>,
    pub metrics_per_epoch: Vec<Vec<(String, f64)>>,
    pub hashes: RunHashes,
    pub plugins: Vec<String>,
}

impl RunSummary {
    pub fn write(&self, path: &Path) -> Result<()> {
        let s = serde_json::to_string_pretty(self).map_err(|e| TrainerError::InvalidArgument { what: "summary", reason: e.to_string() })?;
        std::fs::write(path, s).map_err(|e| TrainerError::Io { path: path.to_path_buf(), source: e })
    }
}

/// Appends one row per epoch to `results.csv` (header written with the first row).
pub struct ResultsCsv {
    path: std::path::PathBuf,
    columns: Vec<String>,
}

impl ResultsCsv {
    pub fn new(path: &Path, columns: Vec<String>) -> Self {
        ResultsCsv { path: path.to_path_buf(), columns }
    }

    pub fn append(&self, values: &[f64]) -> Result<()> {
        let io = |e| TrainerError::Io { path: self.path.clone(), source: e };
        let fresh = !self.path.exists();
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&self.path).map_err(io)?;
        if fresh {
            writeln!(f, "{}", self.columns.join(",")).map_err(io)?;
        }
        let row: Vec<String> = values.iter().map(|v| format!("{v:.6}")).collect();
        writeln!(f, "{}", row.join(",")).map_err(io)
    }
}

//! AutoBatch (`batch=-1`, or a fraction of device memory such as `batch=0.7`): Ultralytics' rule
//! for the largest batch that fits a fraction of the GPU, on ptl's own measurements.
//!
//! As in Ultralytics (`utils/autobatch.py`): probe batch sizes 1, 2, 4, …, 64 (16 on a card below
//! 16 GiB; none above the dataset's size), fit a line to memory against batch size over the probes
//! that succeeded with memory still rising, and take the batch where the line meets `fraction`
//! of the memory available (free plus what the pools hold), capped below the first batch that ran
//! out of memory, at least the smallest good probe, at most 1024 and the dataset's size.
//!
//! The probe is a training step of the run's model on the device — forward, the criterion on
//! `max_objects` targets per image (the dataset's most crowded image, so the largest target bucket
//! is counted), backward — at the run's precision; its figure is the device's peak of allocated
//! bytes. A step that replays is counted at [`REPLAY_FACTOR`] times that: replay's planned arenas
//! hold the native step's live peak, and its static inputs, persistent outputs and the optimizer
//! region's arena come on top.

use crate::{Result, TrainerError};

/// Memory of a replayed step relative to a native one: the bound the arena planner is held to
/// (measured 1.14–1.22× at batch 4–64 in bf16-mixed).
pub const REPLAY_FACTOR: f64 = 1.25;

/// Ultralytics' largest AutoBatch size.
pub const MAX_AUTOBATCH: usize = 1024;

const GIB: f64 = (1u64 << 30) as f64;

/// One probed batch size and its memory (`None`: the probe ran out of memory or failed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Probe {
    /// Batch size.
    pub batch: usize,
    /// Device memory the step needed (bytes), if it ran.
    pub bytes: Option<u64>,
}

/// The device's memory when AutoBatch starts (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceMemory {
    /// The card's memory.
    pub total: u64,
    /// What this process's pools hold now (reusable by the run).
    pub reserved: u64,
    /// What the driver reports free.
    pub free: u64,
}

impl DeviceMemory {
    /// Free plus reserved: what the run can use (Ultralytics' "available").
    pub fn available(&self) -> u64 {
        self.free + self.reserved
    }
}

/// AutoBatch's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchChoice {
    /// The batch size to train with.
    pub batch: usize,
    /// Memory the fitted line predicts at that batch (bytes).
    pub predicted_bytes: f64,
}

/// The batch sizes to probe: Ultralytics' list for a card of `total` bytes, none above the
/// dataset's size (`dataset_size` 0: no limit).
pub fn probe_sizes(total: u64, dataset_size: usize) -> Vec<usize> {
    let all: &[usize] = if (total as f64) / GIB < 16.0 { &[1, 2, 4, 8, 16] } else { &[1, 2, 4, 8, 16, 32, 64] };
    all.iter().copied().filter(|&b| dataset_size == 0 || b <= dataset_size).collect()
}

/// The batch size for `fraction` of the available memory from the probes (Ultralytics'
/// arithmetic, in GiB as there, so both give the same batch on the same measurements).
pub fn choose_batch(probes: &[Probe], mem: DeviceMemory, fraction: f64, dataset_size: usize) -> Result<BatchChoice> {
    let t = mem.total as f64 / GIB;
    let f = mem.available() as f64 / GIB;
    let gib = |p: &Probe| p.bytes.map(|b| b as f64 / GIB);
    // Probes that ran, below the card's size, with memory rising from the probe before.
    let xy: Vec<(f64, f64)> = probes
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let y = gib(p)?;
            let rising = i == 0 || probes[i - 1].bytes.is_none() || gib(&probes[i - 1]).is_some_and(|prev| y > prev);
            (y > 0.0 && y < t && rising).then_some((p.batch as f64, y))
        })
        .collect();
    let Some(&(x0, _)) = xy.first() else {
        let tried: Vec<String> = probes.iter().map(|p| p.batch.to_string()).collect();
        return Err(TrainerError::InvalidArgument {
            what: "batch",
            reason: format!(
                "AutoBatch: no usable batch size found while probing batch={} (each ran out of memory or failed): free GPU memory, \
                 reduce imgsz, or give a batch size",
                tried.join(",")
            ),
        });
    };
    let (slope, intercept) = line_fit(&xy);
    let raw = (f * fraction - intercept) / slope;
    if !raw.is_finite() {
        return Err(TrainerError::InvalidArgument {
            what: "batch",
            reason: format!("AutoBatch: the probes' memory does not grow with the batch size ({xy:?} GiB): give a batch size"),
        });
    }
    let mut b = raw.trunc().clamp(i64::MIN as f64, i64::MAX as f64) as i64;
    // The first failure above a good probe is the memory ceiling.
    if let Some(i) = probes.iter().position(|p| p.bytes.is_none() && p.batch as f64 > x0) {
        if b >= probes[i].batch as i64 {
            b = probes[i - 1].batch as i64;
        }
    }
    let mut b = b.max(x0 as i64).min(MAX_AUTOBATCH as i64) as usize;
    if dataset_size > 0 {
        b = b.min(dataset_size);
    }
    Ok(BatchChoice { batch: b, predicted_bytes: (slope * b as f64 + intercept) * GIB })
}

/// Least-squares line `y = slope·x + intercept` (numpy's `polyfit(x, y, 1)`; one point gives
/// lstsq's minimum-norm solution, as there).
fn line_fit(xy: &[(f64, f64)]) -> (f64, f64) {
    if let [(x, y)] = xy {
        let d = x * x + 1.0;
        return (y * x / d, y / d);
    }
    let n = xy.len() as f64;
    let (mx, my) = (xy.iter().map(|p| p.0).sum::<f64>() / n, xy.iter().map(|p| p.1).sum::<f64>() / n);
    let sxy: f64 = xy.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = xy.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let slope = sxy / sxx;
    (slope, my - slope * mx)
}

/// Ultralytics' closing line: `Using batch-size 52 for CUDA:0 47.84G/79.19G (60%) ✅`.
pub fn report_line(choice: &BatchChoice, device: usize, mem: &DeviceMemory) -> String {
    let t = mem.total as f64 / GIB;
    let used = choice.predicted_bytes / GIB;
    format!(
        "AutoBatch: Using batch-size {} for CUDA:{device} {used:.2}G/{t:.2}G ({:.0}%) ✅",
        choice.batch,
        100.0 * used / t.max(f64::MIN_POSITIVE)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_sizes_follow_the_card_and_the_dataset() {
        assert_eq!(probe_sizes(80 << 30, 0), vec![1, 2, 4, 8, 16, 32, 64]);
        assert_eq!(probe_sizes(12 << 30, 0), vec![1, 2, 4, 8, 16]);
        assert_eq!(probe_sizes(80 << 30, 20), vec![1, 2, 4, 8, 16]);
    }

    #[test]
    fn one_point_is_lstsq_minimum_norm() {
        // x·p0 + p1 = y with the smallest (p0, p1): (y·x, y) / (x² + 1).
        let (s, c) = line_fit(&[(2.0, 1.0)]);
        assert!((s - 0.4).abs() < 1e-15 && (c - 0.2).abs() < 1e-15);
    }

    #[test]
    fn nothing_usable_is_a_typed_error() {
        let probes = [Probe { batch: 1, bytes: None }, Probe { batch: 2, bytes: None }];
        let e = choose_batch(&probes, DeviceMemory { total: 8 << 30, reserved: 0, free: 8 << 30 }, 0.6, 0).unwrap_err();
        assert!(e.to_string().contains("batch=1,2"), "{e}");
    }
}

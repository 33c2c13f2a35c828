//! A per-epoch progress bar (loss items, lr, it/s) on stderr.

use indicatif::{ProgressBar, ProgressStyle};

pub(crate) struct EpochBar {
    bar: Option<ProgressBar>,
}

impl EpochBar {
    pub fn new(enabled: bool, epoch: usize, epochs: usize, batches: usize) -> Self {
        if !enabled {
            return EpochBar { bar: None };
        }
        let bar = ProgressBar::new(batches as u64);
        let style = ProgressStyle::with_template("{prefix} [{bar:25}] {pos}/{len} {per_sec} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style.progress_chars("=> "));
        bar.set_prefix(format!("epoch {}/{}", epoch + 1, epochs));
        EpochBar { bar: Some(bar) }
    }

    pub fn update(&self, i: usize, items: &[f64], lr: f64) {
        if let Some(b) = &self.bar {
            let names = ["box", "pose", "kobj", "cls", "l1", "rle"];
            let msg: Vec<String> = names.iter().zip(items).map(|(n, v)| format!("{n} {v:.3}")).collect();
            b.set_message(format!("{} lr {lr:.5}", msg.join(" ")));
            b.set_position(i as u64 + 1);
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

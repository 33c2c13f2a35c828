//! Run plots drawn with `plotters` (axes, ticks, legends and anti-aliased text from a well-kept
//! crate rather than our own rasterisers): `results.png`, the precision–recall curves and the
//! first training batches with their labels, and several runs' curves on one chart.
//!
//! Text uses DejaVu Sans embedded in the binary (`assets/fonts`, Bitstream Vera licence next to
//! it) through plotters' pure-Rust `ab_glyph` backend, so no fontconfig/freetype is needed.

mod batches;
mod confusion;
mod curves;
mod labels;
mod pr;
mod results;

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use ptl_data::image::{write_png, Image};

use crate::{Result, TrainerError};

pub use batches::{batch_grid, plot_batch, plot_train_batch, LabelledBatch};
pub use confusion::plot_confusion_matrix;
pub use curves::{plot_curves, Curve, CurveChart};
pub use labels::plot_labels;
pub use pr::{plot_conf_curves, plot_pr_curve, PrCurve};
pub use results::plot_results;

/// DejaVu Sans (Bitstream Vera licence: `assets/fonts/LICENSE-DejaVu.txt`).
static FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");

/// Registers the embedded font as plotters' `sans-serif` once per process.
pub(crate) fn ensure_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(plot_error("font", "the embedded DejaVu Sans font could not be parsed"))
    }
}

/// A drawing error as [`TrainerError::Plot`].
pub(crate) fn plot_error(what: &str, reason: impl std::fmt::Display) -> TrainerError {
    TrainerError::Plot { what: what.to_string(), reason: reason.to_string() }
}

/// Draws with `f` on a white `w × h` RGB canvas and writes it as a PNG to `out`.
pub(crate) fn render_png<F>(w: u32, h: u32, out: &Path, f: F) -> Result<()>
where
    F: FnOnce(&DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> Result<()>,
{
    ensure_font()?;
    let mut rgb = vec![255u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        f(&root)?;
        root.present().map_err(|e| plot_error(&out.display().to_string(), e))?;
    }
    write_png(&Image::from_rgb(w, h, rgb), out).map_err(TrainerError::from)
}

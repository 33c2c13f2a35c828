//! `labels.jpg`: the training labels at a glance, as Ultralytics' `plot_labels` draws them before
//! training — instances per class, a sample of box shapes drawn from one centre, where the box
//! centres fall (x against y) and how large the boxes are (width against height), the last two as
//! 2-D histograms.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use ptl_data::image::{decode_file, write_jpeg};

use super::{plot_error, render_png};
use crate::Result;

/// Boxes drawn in the shapes panel (Ultralytics draws the first 1000).
const SHAPES: usize = 1000;
/// Bins per axis of the 2-D histograms.
const BINS: usize = 50;

/// Shade of a 2-D histogram bin by its share of the fullest bin (white → dark blue).
fn shade(t: f64) -> RGBColor {
    let t = t.clamp(0.0, 1.0).sqrt();
    let mix = |a: f64, b: f64| (a + (b - a) * t).round() as u8;
    RGBColor(mix(255.0, 8.0), mix(255.0, 48.0), mix(255.0, 107.0))
}

/// A 2-D histogram of `points` (both coordinates in [0, 1]) in `area`, axes named.
fn histogram2d(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    points: &[(f64, f64)],
    x: &str,
    y: &str,
    name: &str,
) -> Result<()> {
    let err = |e: DrawingAreaErrorKind<_>| plot_error(name, e);
    let mut c = ChartBuilder::on(area)
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(44)
        .build_cartesian_2d(0.0..1.0f64, 0.0..1.0f64)
        .map_err(err)?;
    c.configure_mesh().disable_mesh().x_desc(x).y_desc(y).label_style(("sans-serif", 12)).draw().map_err(err)?;
    let mut counts = vec![0usize; BINS * BINS];
    for &(px, py) in points {
        let bin = |v: f64| ((v.clamp(0.0, 1.0) * BINS as f64) as usize).min(BINS - 1);
        counts[bin(py) * BINS + bin(px)] += 1;
    }
    let max = counts.iter().copied().max().unwrap_or(0).max(1) as f64;
    let step = 1.0 / BINS as f64;
    c.draw_series(counts.iter().enumerate().filter(|(_, &n)| n > 0).map(|(i, &n)| {
        let (bx, by) = ((i % BINS) as f64 * step, (i / BINS) as f64 * step);
        Rectangle::new([(bx, by), (bx + step, by + step)], shade(n as f64 / max).filled())
    }))
    .map_err(err)?;
    Ok(())
}

/// Draws `labels.jpg` into `dir` from every object's class and normalised (cx, cy, w, h) box.
pub fn plot_labels(cls: &[usize], boxes: &[[f32; 4]], names: &[String], dir: &Path) -> Result<PathBuf> {
    let out = dir.join("labels.jpg");
    let png = dir.join(".labels.png");
    let name = out.display().to_string();
    let nc = names.len().max(cls.iter().map(|c| c + 1).max().unwrap_or(1));
    let mut per_class = vec![0usize; nc];
    for &c in cls {
        per_class[c.min(nc - 1)] += 1;
    }
    render_png(900, 900, &png, |root| {
        let err = |e: DrawingAreaErrorKind<_>| plot_error(&name, e);
        let panels = root.split_evenly((2, 2));
        // Instances per class.
        let top = per_class.iter().copied().max().unwrap_or(0).max(1) as f64 * 1.1;
        let mut bars = ChartBuilder::on(&panels[0])
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(52)
            .build_cartesian_2d(0.0..nc as f64, 0.0..top)
            .map_err(err)?;
        // Each bar named under its centre (up to 20 classes; more would not be readable).
        let label_of = |v: &f64| {
            let c = v.floor() as usize;
            match (v.fract() - 0.5).abs() < 1e-9 && nc <= 20 {
                true => names.get(c).cloned().unwrap_or_else(|| c.to_string()),
                false => String::new(),
            }
        };
        bars.configure_mesh()
            .disable_x_mesh()
            .x_labels(2 * nc + 1)
            .x_label_formatter(&label_of)
            .x_desc("class")
            .y_desc("instances")
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(err)?;
        bars.draw_series(
            per_class
                .iter()
                .enumerate()
                .map(|(c, &n)| Rectangle::new([(c as f64 + 0.1, 0.0), (c as f64 + 0.9, n as f64)], RGBColor(31, 119, 180).filled())),
        )
        .map_err(err)?;
        // Box shapes from one centre.
        let mut shapes = ChartBuilder::on(&panels[1]).margin(10).build_cartesian_2d(0.0..1.0f64, 0.0..1.0f64).map_err(err)?;
        shapes
            .draw_series(boxes.iter().take(SHAPES).map(|b| {
                let (w, h) = (f64::from(b[2]) / 2.0, f64::from(b[3]) / 2.0);
                Rectangle::new([(0.5 - w, 0.5 - h), (0.5 + w, 0.5 + h)], RGBColor(31, 119, 180).mix(0.3).stroke_width(1))
            }))
            .map_err(err)?;
        let centres: Vec<(f64, f64)> = boxes.iter().map(|b| (f64::from(b[0]), 1.0 - f64::from(b[1]))).collect();
        let sizes: Vec<(f64, f64)> = boxes.iter().map(|b| (f64::from(b[2]), f64::from(b[3]))).collect();
        histogram2d(&panels[2], &centres, "x", "y", &name)?;
        histogram2d(&panels[3], &sizes, "width", "height", &name)?;
        Ok(())
    })?;
    // Ultralytics' file is a JPEG.
    let (img, _) = decode_file(&png)?;
    write_jpeg(&img, &out, 90)?;
    let _ = std::fs::remove_file(&png);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JPEG of 900 × 900 whose four panels hold drawn pixels: bars, shapes and both histograms.
    #[test]
    fn labels_plot_has_four_drawn_panels() {
        let dir = std::env::temp_dir().join(format!("ptl-labels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let boxes: Vec<[f32; 4]> = (0..200).map(|i| [0.2 + 0.003 * i as f32, 0.6, 0.1 + 0.001 * i as f32, 0.3]).collect();
        let out = plot_labels(&vec![0; boxes.len()], &boxes, &["person".to_string()], &dir).unwrap();
        let (img, _) = decode_file(&out).unwrap();
        assert_eq!((img.w, img.h), (900, 900));
        let px = |x: u32, y: u32| &img.data[((y * img.w + x) * 3) as usize..((y * img.w + x) * 3 + 3) as usize];
        let coloured = |x0: u32, y0: u32| {
            (x0..x0 + 450)
                .step_by(3)
                .flat_map(|x| (y0..y0 + 450).step_by(3).map(move |y| (x, y)))
                .filter(|&(x, y)| {
                    let p = px(x, y);
                    i32::from(p[0]) > i32::from(p[2]) + 40 // blue in BGR: more blue than red
                })
                .count()
        };
        for (x0, y0) in [(0, 0), (450, 0), (0, 450), (450, 450)] {
            assert!(coloured(x0, y0) > 10, "panel at ({x0}, {y0}) is empty");
        }
        assert!(!dir.join(".labels.png").exists(), "the intermediate PNG is removed");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

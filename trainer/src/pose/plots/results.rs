//! `results.png`: one chart per `results.csv` column (losses, metrics, learning rates) against
//! the epoch, each with its column name as the title and labelled axes.

use std::path::Path;

use plotters::prelude::*;

use super::{plot_error, render_png};
use crate::Result;

/// Chart cell size in pixels and charts per row.
pub(crate) const CELL: (u32, u32) = (320, 240);
pub(crate) const COLS: usize = 5;
/// Line colour of a series (matplotlib's tab:blue, as Ultralytics draws it).
pub(crate) const SERIES: RGBColor = RGBColor(31, 119, 180);

/// Draws every column but `epoch`/`time` of `results.csv` into `out` (PNG, `COLS` charts a row).
pub fn plot_results(csv: &Path, out: &Path) -> Result<()> {
    let text = ptl_files::read_to_string(csv)?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').map(str::trim).collect();
    let rows: Vec<Vec<f64>> = lines.map(|l| l.split(',').map(|v| v.trim().parse::<f64>().unwrap_or(f64::NAN)).collect()).collect();
    let series: Vec<usize> = (0..header.len()).filter(|&i| !matches!(header[i], "epoch" | "time" | "")).collect();
    let nrows = series.len().div_ceil(COLS).max(1);
    let (w, h) = (CELL.0 * COLS as u32, CELL.1 * nrows as u32);
    render_png(w, h, out, |root| {
        let cells = root.split_evenly((nrows, COLS));
        for (&col, area) in series.iter().zip(&cells) {
            let pts: Vec<(f64, f64)> =
                rows.iter().filter_map(|r| Some((*r.first()?, *r.get(col)?))).filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
            chart(area, header[col], &pts)?;
        }
        Ok(())
    })
}

/// One titled line chart of `(epoch, value)` points; a chart without finite values says so.
fn chart<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>, title: &str, pts: &[(f64, f64)]) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| plot_error(title, e);
    let (e0, e1) = match (pts.first(), pts.last()) {
        (Some(a), Some(b)) if b.0 > a.0 => (a.0, b.0),
        (Some(a), _) => (a.0 - 0.5, a.0 + 0.5),
        _ => (0.0, 1.0),
    };
    let (mut lo, mut hi) = pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if !(hi - lo).is_finite() || hi - lo < 1e-12 {
        let c = if lo.is_finite() { lo } else { 0.0 };
        (lo, hi) = (c - 0.5, c + 0.5);
    } else {
        let pad = 0.05 * (hi - lo);
        (lo, hi) = (lo - pad, hi + pad);
    }
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(52)
        .build_cartesian_2d(e0..e1, lo..hi)
        .map_err(err)?;
    c.configure_mesh()
        .x_desc("epoch")
        .x_labels(6)
        .y_labels(6)
        // Whole epochs only: a short run's fractional ticks would repeat a rounded label.
        .x_label_formatter(&|v| if (v - v.round()).abs() < 1e-6 { format!("{v:.0}") } else { String::new() })
        .y_label_formatter(&|v| fmt_tick(*v))
        .label_style(("sans-serif", 11))
        .axis_desc_style(("sans-serif", 12))
        .light_line_style(WHITE)
        .draw()
        .map_err(err)?;
    if pts.is_empty() {
        let at = (e0 + 0.35 * (e1 - e0), 0.5 * (lo + hi));
        c.plotting_area().draw(&Text::new("no values", at, ("sans-serif", 13).into_font().color(&BLACK))).map_err(err)?;
        return Ok(());
    }
    c.draw_series(LineSeries::new(pts.iter().copied(), SERIES.stroke_width(2))).map_err(err)?;
    c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, SERIES.filled()))).map_err(err)?;
    Ok(())
}

/// Tick labels short enough for a small chart: fixed point in [0.01, 1000), otherwise exponent.
fn fmt_tick(v: f64) -> String {
    if v.abs() < 1e-12 {
        "0".to_string()
    } else if v.abs() >= 0.01 && v.abs() < 1000.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.1e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pixels of `cell` (row-major index) that are neither white nor grey: the plotted series.
    fn coloured(img: &ptl_data::image::Image, cell: usize) -> usize {
        let (cx, cy) = ((cell % COLS) as u32 * CELL.0, (cell / COLS) as u32 * CELL.1);
        let mut n = 0;
        for y in cy..cy + CELL.1 {
            for x in cx..cx + CELL.0 {
                let i = (y as usize * img.w as usize + x as usize) * 3;
                let (b, r) = (img.data[i] as i32, img.data[i + 2] as i32);
                if b - r > 60 && b > 120 {
                    n += 1;
                }
            }
        }
        n
    }

    #[test]
    fn draws_one_titled_chart_per_column() {
        let dir = std::env::temp_dir().join(format!("ptl-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let csv = dir.join("results.csv");
        std::fs::write(
            &csv,
            "epoch,time,train/box_loss,metrics/mAP50(P),val/box_loss\n1,0.5,3.0,0.1,nan\n2,1.0,2.0,0.2,nan\n3,1.5,1.5,nan,nan\n",
        )
        .unwrap();
        let png = dir.join("results.png");
        plot_results(&csv, &png).unwrap();
        let (img, _) = ptl_data::image::decode_file(&png).unwrap();
        assert_eq!((img.w, img.h), (COLS as u32 * CELL.0, CELL.1), "3 series → one row of charts");
        assert!(coloured(&img, 0) > 200, "train/box_loss curve drawn ({} px)", coloured(&img, 0));
        assert!(coloured(&img, 1) > 50, "mAP50 curve drawn ({} px)", coloured(&img, 1));
        assert_eq!(coloured(&img, 2), 0, "an all-NaN column has no curve");
        let dark = |cell: usize| {
            let x0 = cell as u32 * CELL.0;
            (0..30u32)
                .flat_map(|y| (x0..x0 + CELL.0).map(move |x| (x, y)))
                .filter(|&(x, y)| img.data[(y * img.w + x) as usize * 3] < 100)
                .count()
        };
        assert!(dark(0) > 20 && dark(2) > 20, "each chart has a title");
        assert!(plot_results(&dir.join("missing.csv"), &png).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Several runs' per-epoch curves on shared axes (one chart per metric, one line per run, a
//! legend): how runs of different tools, precisions or seeds compare over a fit.

use std::path::Path;

use plotters::prelude::*;

use super::{plot_error, render_png};
use crate::Result;

/// One line of a chart: a run's `(epoch, value)` points under its legend label.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Curve {
    /// Legend text (e.g. `ptl replay seed 0`).
    pub label: String,
    /// `(epoch, value)`, in epoch order; non-finite values are left out.
    pub points: Vec<(f64, f64)>,
    /// Index into the palette: runs of one arm share a colour.
    pub colour: usize,
    /// Drawn dashed (e.g. a second seed), else solid.
    pub dashed: bool,
}

/// One chart: a title, the y axis' name and its lines.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CurveChart {
    /// Chart title.
    pub title: String,
    /// The y axis' description.
    pub y_desc: String,
    /// The lines.
    pub curves: Vec<Curve>,
}

/// matplotlib's tab10 colours (what Ultralytics' plots use), by [`Curve::colour`] modulo 10.
const TAB10: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Chart size in pixels.
const CHART: (u32, u32) = (720, 480);

/// Draws `charts` side by side into `out` (PNG): each chart's lines over the epochs, y from 0 to
/// its largest value, with a legend.
pub fn plot_curves(charts: &[CurveChart], out: &Path) -> Result<()> {
    let n = charts.len().max(1);
    render_png(CHART.0 * n as u32, CHART.1, out, |root| {
        for (chart, area) in charts.iter().zip(root.split_evenly((1, n))) {
            draw_chart(&area, chart)?;
        }
        Ok(())
    })
}

fn draw_chart<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>, chart: &CurveChart) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| plot_error(&chart.title, e);
    let finite = |c: &Curve| c.points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect::<Vec<_>>();
    let all: Vec<(f64, f64)> = chart.curves.iter().flat_map(finite).collect();
    let x_hi = all.iter().map(|p| p.0).fold(1.0_f64, f64::max);
    let y_hi = all.iter().map(|p| p.1).fold(0.0_f64, f64::max);
    let y_hi = if y_hi > 0.0 { 1.05 * y_hi } else { 1.0 };
    let mut c = ChartBuilder::on(area)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_hi, 0.0..y_hi)
        .map_err(err)?;
    c.configure_mesh()
        .x_desc("epoch")
        .y_desc(&chart.y_desc)
        .x_labels(11)
        .y_labels(8)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.2}"))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 15))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(err)?;
    for curve in &chart.curves {
        let colour = TAB10[curve.colour % TAB10.len()];
        let pts = finite(curve);
        let style = colour.stroke_width(2);
        let drawn = if curve.dashed {
            c.draw_series(DashedLineSeries::new(pts, 6, 4, style)).map_err(err)?
        } else {
            c.draw_series(LineSeries::new(pts, style)).map_err(err)?
        };
        let dashed = curve.dashed;
        drawn.label(&curve.label).legend(move |(x, y)| {
            let to = if dashed { x + 10 } else { x + 22 };
            PathElement::new([(x, y), (to, y)], colour.stroke_width(2))
        });
    }
    if !chart.curves.is_empty() {
        c.configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font(("sans-serif", 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pixels of `img` within 30 levels of `c` in every channel (the image is stored BGR).
    fn near(img: &ptl_data::image::Image, c: RGBColor, x0: u32, x1: u32) -> usize {
        let mut n = 0;
        for y in 0..img.h {
            for x in x0..x1 {
                let i = (y as usize * img.w as usize + x as usize) * 3;
                let (b, g, r) = (img.data[i] as i32, img.data[i + 1] as i32, img.data[i + 2] as i32);
                if (r - c.0 as i32).abs() < 30 && (g - c.1 as i32).abs() < 30 && (b - c.2 as i32).abs() < 30 {
                    n += 1;
                }
            }
        }
        n
    }

    #[test]
    fn draws_each_run_in_its_colour_on_its_chart() {
        let dir = std::env::temp_dir().join(format!("ptl-curves-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rising = |k: f64| (1..=20).map(|e| (e as f64, k * e as f64 / 20.0)).collect::<Vec<_>>();
        let charts = vec![
            CurveChart {
                title: "box mAP50-95".into(),
                y_desc: "mAP50-95".into(),
                curves: vec![
                    Curve { label: "a".into(), points: rising(0.6), colour: 0, dashed: false },
                    Curve { label: "b".into(), points: rising(0.5), colour: 1, dashed: true },
                ],
            },
            CurveChart {
                title: "pose mAP50-95".into(),
                y_desc: "mAP50-95".into(),
                curves: vec![Curve { label: "a".into(), points: rising(0.3), colour: 0, dashed: false }],
            },
        ];
        let png = dir.join("curves.png");
        plot_curves(&charts, &png).unwrap();
        let (img, _) = ptl_data::image::decode_file(&png).unwrap();
        assert_eq!((img.w, img.h), (2 * CHART.0, CHART.1));
        let (blue, orange) = (TAB10[0], TAB10[1]);
        assert!(near(&img, blue, 0, CHART.0) > 300, "run a drawn on the first chart");
        assert!(near(&img, orange, 0, CHART.0) > 150, "run b drawn (dashed) on the first chart");
        assert!(near(&img, blue, CHART.0, 2 * CHART.0) > 300, "run a drawn on the second chart");
        assert!(near(&img, orange, CHART.0, 2 * CHART.0) < 20, "run b is not on the second chart");
        std::fs::remove_dir_all(&dir).ok();
    }
}

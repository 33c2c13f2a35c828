//! `BoxPR_curve.png` / `PosePR_curve.png`: precision against recall at IoU (OKS) 0.5, one curve
//! per class and their mean, as Ultralytics' `plot_pr_curve` draws them from `ap_per_class`'s
//! `px, py` (envelope precision sampled at 1000 recall points).

use std::path::Path;

use plotters::prelude::*;

use super::{plot_error, render_png};
use crate::metrics::ApPerClass;
use crate::Result;

/// The class-mean curve's colour (matplotlib's default blue).
const SERIES_MEAN: RGBColor = RGBColor(31, 119, 180);

/// One PR plot's data: the recall grid and each class's precision on it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrCurve {
    /// `Box` or `Pose`: the file is `<prefix>PR_curve.png`.
    pub prefix: String,
    /// Recall grid (1000 points in [0, 1]).
    pub recall: Vec<f64>,
    /// Precision on the grid, per class with predictions.
    pub precision: Vec<Vec<f64>>,
    /// AP at threshold 0.5 of the same classes.
    pub ap50: Vec<f64>,
    /// Class names of the same classes.
    pub names: Vec<String>,
}

impl PrCurve {
    /// The curves of one metric set; classes without predictions have no curve (as in Ultralytics).
    pub fn from_ap(prefix: &str, pc: &ApPerClass, names: &[&str]) -> Self {
        let idx = &pc.prec_classes;
        PrCurve {
            prefix: prefix.to_string(),
            recall: pc.x.clone(),
            precision: pc.prec_values.clone(),
            ap50: idx.iter().map(|&i| pc.ap.get(i).map_or(0.0, |a| a[0])).collect(),
            names: idx
                .iter()
                .map(|&i| pc.classes.get(i).and_then(|c| names.get(*c)).map_or_else(|| format!("class {i}"), |s| s.to_string()))
                .collect(),
        }
    }

    /// Mean precision over classes at each recall point (zeros when no class has a curve).
    pub fn mean(&self) -> Vec<f64> {
        let n = self.precision.len();
        (0..self.recall.len())
            .map(|k| if n == 0 { 0.0 } else { self.precision.iter().map(|c| c.get(k).copied().unwrap_or(0.0)).sum::<f64>() / n as f64 })
            .collect()
    }
}

/// Writes `curve` as `<dir>/<prefix>PR_curve.png` (900 × 600) and returns the path.
pub fn plot_pr_curve(curve: &PrCurve, dir: &Path) -> Result<std::path::PathBuf> {
    let out = dir.join(format!("{}PR_curve.png", curve.prefix));
    let name = out.display().to_string();
    let mean_ap = if curve.ap50.is_empty() { 0.0 } else { curve.ap50.iter().sum::<f64>() / curve.ap50.len() as f64 };
    render_png(900, 600, &out, |root| {
        let err = |e: DrawingAreaErrorKind<_>| plot_error(&name, e);
        let mut c = ChartBuilder::on(root)
            .caption(format!("{} Precision-Recall Curve", curve.prefix), ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..1.0f64, 0.0..1.0f64)
            .map_err(err)?;
        c.configure_mesh()
            .x_desc("Recall")
            .y_desc("Precision")
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .draw()
            .map_err(err)?;
        // Per-class curves only while a legend stays readable (Ultralytics: fewer than 21 classes).
        if curve.precision.len() < 21 {
            for (k, p) in curve.precision.iter().enumerate() {
                let label = format!("{} {:.3}", curve.names.get(k).map_or("", String::as_str), curve.ap50.get(k).copied().unwrap_or(0.0));
                c.draw_series(LineSeries::new(
                    curve.recall.iter().copied().zip(p.iter().copied()),
                    RGBColor(128, 128, 128).stroke_width(1),
                ))
                .map_err(err)?
                .label(label)
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RGBColor(128, 128, 128)));
            }
        }
        c.draw_series(LineSeries::new(curve.recall.iter().copied().zip(curve.mean()), SERIES_MEAN.stroke_width(3)))
            .map_err(err)?
            .label(format!("all classes {mean_ap:.3} mAP@0.5"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], SERIES_MEAN.stroke_width(3)));
        c.configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ap_per_class;

    #[test]
    fn pr_curve_of_the_spec_example() {
        // metrics.md's worked example: 3 GTs, TP pattern (1,0,1,0,1) at every threshold.
        let tp: Vec<[bool; 10]> = [true, false, true, false, true].iter().map(|&t| [t; 10]).collect();
        let pc = ap_per_class(&tp, &[0.9, 0.8, 0.7, 0.6, 0.5], &[0; 5], &[0, 0, 0]).unwrap();
        let c = PrCurve::from_ap("Box", &pc, &["person"]);
        assert_eq!((c.recall.len(), c.precision.len(), c.names.as_slice()), (1000, 1, ["person".to_string()].as_slice()));
        assert!((c.ap50[0] - 0.7530).abs() < 1e-3, "AP50 {}", c.ap50[0]);
        assert!((c.mean()[500] - 0.667).abs() < 1e-3, "envelope precision at recall 0.5: {}", c.mean()[500]);
        let dir = std::env::temp_dir().join(format!("ptl-pr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = plot_pr_curve(&c, &dir).unwrap();
        assert_eq!(png.file_name().and_then(|s| s.to_str()), Some("BoxPR_curve.png"));
        let (img, _) = ptl_data::image::decode_file(&png).unwrap();
        assert_eq!((img.w, img.h), (900, 600));
        let blue = img.data.chunks_exact(3).filter(|p| p == &[180, 119, 31]).count();
        assert!(blue > 500, "the mean curve is drawn ({blue} px)");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

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
    /// Confidence grid of the P, R and F1 curves (1000 points in [0, 1]).
    pub conf: Vec<f64>,
    /// Precision, recall and F1 against confidence, per class with targets.
    pub p_conf: Vec<Vec<f64>>,
    /// Recall against confidence, per class.
    pub r_conf: Vec<Vec<f64>>,
    /// F1 against confidence, per class.
    pub f1_conf: Vec<Vec<f64>>,
    /// Class names of those classes.
    pub conf_names: Vec<String>,
}

impl PrCurve {
    /// The curves of one metric set; classes without predictions have no curve (as in Ultralytics).
    pub fn from_ap(prefix: &str, pc: &ApPerClass, names: &[&str]) -> Self {
        let idx = &pc.prec_classes;
        let name_of = |c: usize| names.get(c).map_or_else(|| format!("class {c}"), |s| s.to_string());
        PrCurve {
            conf: pc.x.clone(),
            p_conf: pc.p_curve.clone(),
            r_conf: pc.r_curve.clone(),
            f1_conf: pc.f1_curve.clone(),
            conf_names: pc.classes.iter().map(|&c| name_of(c)).collect(),
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

/// Which confidence curve ([`plot_conf_curves`]).
#[derive(Clone, Copy)]
enum ConfCurve {
    Precision,
    Recall,
    F1,
}

impl ConfCurve {
    fn name(self) -> (&'static str, &'static str) {
        match self {
            ConfCurve::Precision => ("P", "Precision"),
            ConfCurve::Recall => ("R", "Recall"),
            ConfCurve::F1 => ("F1", "F1"),
        }
    }
}

/// Writes `<prefix>P_curve.png`, `<prefix>R_curve.png` and `<prefix>F1_curve.png` (900 × 600):
/// precision, recall and F1 against the confidence threshold, one curve per class and their mean,
/// labelled as Ultralytics' `plot_mc_curve` labels it (the smoothed mean's best value and the
/// confidence where it is reached). Returns the paths.
pub fn plot_conf_curves(curve: &PrCurve, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut written = Vec::new();
    for kind in [ConfCurve::F1, ConfCurve::Precision, ConfCurve::Recall] {
        let (short, long) = kind.name();
        let per_class = match kind {
            ConfCurve::Precision => &curve.p_conf,
            ConfCurve::Recall => &curve.r_conf,
            ConfCurve::F1 => &curve.f1_conf,
        };
        let n = per_class.len().max(1) as f64;
        let mean: Vec<f64> =
            (0..curve.conf.len()).map(|k| per_class.iter().map(|c| c.get(k).copied().unwrap_or(0.0)).sum::<f64>() / n).collect();
        let smoothed = crate::metrics::ap::smooth(&mean, 0.1);
        let best = smoothed.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
        let at = curve.conf.get(best.0).copied().unwrap_or(0.0);
        let out = dir.join(format!("{}{short}_curve.png", curve.prefix));
        let name = out.display().to_string();
        render_png(900, 600, &out, |root| {
            let err = |e: DrawingAreaErrorKind<_>| plot_error(&name, e);
            let mut c = ChartBuilder::on(root)
                .caption(format!("{} {long}-Confidence Curve", curve.prefix), ("sans-serif", 22))
                .margin(16)
                .x_label_area_size(44)
                .y_label_area_size(56)
                .build_cartesian_2d(0.0..1.0f64, 0.0..1.0f64)
                .map_err(err)?;
            c.configure_mesh()
                .x_desc("Confidence")
                .y_desc(long)
                .label_style(("sans-serif", 14))
                .axis_desc_style(("sans-serif", 16))
                .draw()
                .map_err(err)?;
            if per_class.len() < 21 {
                for (k, y) in per_class.iter().enumerate() {
                    c.draw_series(LineSeries::new(
                        curve.conf.iter().copied().zip(y.iter().copied()),
                        RGBColor(128, 128, 128).stroke_width(1),
                    ))
                    .map_err(err)?
                    .label(curve.conf_names.get(k).cloned().unwrap_or_default())
                    .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RGBColor(128, 128, 128)));
                }
            }
            c.draw_series(LineSeries::new(curve.conf.iter().copied().zip(smoothed.iter().copied()), SERIES_MEAN.stroke_width(3)))
                .map_err(err)?
                .label(format!("all classes {:.2} at {at:.3}", best.1.max(0.0)))
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
        written.push(out);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ap_per_class;

    #[test]
    fn pr_curve_of_the_spec_example() {
        // docs/metrics.md's worked example: 3 GTs, TP pattern (1,0,1,0,1) at every threshold.
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
        // P, R and F1 against confidence: three files, the mean curve drawn on each.
        let files = plot_conf_curves(&c, &dir).unwrap();
        let names: Vec<&str> = files.iter().filter_map(|p| p.file_name().and_then(|s| s.to_str())).collect();
        assert_eq!(names, ["BoxF1_curve.png", "BoxP_curve.png", "BoxR_curve.png"]);
        for f in &files {
            let (img, _) = ptl_data::image::decode_file(f).unwrap();
            let blue = img.data.chunks_exact(3).filter(|p| p == &[180, 119, 31]).count();
            assert!(blue > 300, "{f:?}: the mean curve is drawn ({blue} px)");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

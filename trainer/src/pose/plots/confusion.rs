//! `confusion_matrix.png` and `confusion_matrix_normalized.png`: the detection confusion matrix of
//! the last validation as Ultralytics draws it — predicted class down, true class across, the
//! last row and column "background", each cell shaded by its value (the normalised one by column).

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::{plot_error, render_png};
use crate::metrics::confusion::ConfusionMatrix;
use crate::Result;

/// White to matplotlib's `Blues` dark end, by `t` in [0, 1].
fn blues(t: f64) -> RGBColor {
    let t = t.clamp(0.0, 1.0);
    let mix = |a: f64, b: f64| (a + (b - a) * t).round() as u8;
    RGBColor(mix(247.0, 8.0), mix(251.0, 48.0), mix(255.0, 107.0))
}

/// Draws `values` (`n × n`, `labels` on both axes) as a shaded grid into `out`.
fn draw(values: &[Vec<f64>], labels: &[String], title: &str, integers: bool, out: &Path) -> Result<()> {
    let n = values.len();
    let max = values.iter().flatten().copied().fold(0.0f64, f64::max).max(1e-9);
    let name = out.display().to_string();
    let (left, top, cell) = (160i32, 70i32, (560 / n.max(1)) as i32);
    render_png(800, 720, out, |root| {
        let err = |e: DrawingAreaErrorKind<_>| plot_error(&name, e);
        let text = |size: f64| TextStyle::from(("sans-serif", size).into_font()).color(&BLACK);
        root.draw(&Text::new(title.to_string(), (left, 20), text(22.0))).map_err(err)?;
        for (r, row) in values.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                let (x0, y0) = (left + c as i32 * cell, top + r as i32 * cell);
                root.draw(&Rectangle::new([(x0, y0), (x0 + cell, y0 + cell)], blues(v / max).filled())).map_err(err)?;
                let shown = if integers { format!("{v:.0}") } else { format!("{v:.2}") };
                let ink = if v / max > 0.5 { WHITE } else { BLACK };
                let style = TextStyle::from(("sans-serif", 18).into_font()).color(&ink);
                root.draw(&Text::new(shown, (x0 + cell / 2 - 12, y0 + cell / 2 - 9), style)).map_err(err)?;
            }
        }
        for (k, l) in labels.iter().enumerate() {
            let mid = k as i32 * cell + cell / 2;
            root.draw(&Text::new(l.clone(), (left + mid - 30, top + n as i32 * cell + 8), text(15.0))).map_err(err)?;
            root.draw(&Text::new(l.clone(), (10, top + mid - 8), text(15.0))).map_err(err)?;
        }
        root.draw(&Text::new("True", (left + n as i32 * cell / 2 - 16, top + n as i32 * cell + 40), text(17.0))).map_err(err)?;
        root.draw(&Text::new("Predicted", (10, top - 26), text(17.0))).map_err(err)?;
        Ok(())
    })
}

/// Writes both files into `dir` and returns their paths.
pub fn plot_confusion_matrix(cm: &ConfusionMatrix, names: &[String], dir: &Path) -> Result<Vec<PathBuf>> {
    let labels: Vec<String> =
        (0..cm.nc).map(|c| names.get(c).cloned().unwrap_or_else(|| format!("class {c}"))).chain(["background".to_string()]).collect();
    let (plain, normalized) = (dir.join("confusion_matrix.png"), dir.join("confusion_matrix_normalized.png"));
    draw(&cm.matrix, &labels, "Confusion Matrix", true, &plain)?;
    draw(&cm.normalized(), &labels, "Confusion Matrix Normalized", false, &normalized)?;
    Ok(vec![plain, normalized])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both files, 800 × 720, with the fullest cell in the darkest shade.
    #[test]
    fn both_matrices_are_drawn() {
        let mut cm = ConfusionMatrix::new(1);
        cm.matrix = vec![vec![5.0, 1.0], vec![2.0, 0.0]];
        let dir = std::env::temp_dir().join(format!("ptl-cm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = plot_confusion_matrix(&cm, &["person".to_string()], &dir).unwrap();
        for f in &files {
            let (img, _) = ptl_data::image::decode_file(f).unwrap();
            assert_eq!((img.w, img.h), (800, 720));
            // BGR of the darkest blue.
            let dark = img.data.chunks_exact(3).filter(|p| p == &[107, 48, 8]).count();
            assert!(dark > 1000, "{f:?}: the fullest cell is shaded ({dark} px)");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

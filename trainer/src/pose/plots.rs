//! `results.png`: one small line chart per `results.csv` column (losses, metrics, learning
//! rates) against the epoch, drawn without a plotting dependency (a 5×7 bitmap font for labels).

use std::path::Path;

use ptl_data::image::{write_png, Image};

use crate::{Result, TrainerError};

/// 5×7 glyphs, one byte per row (low 5 bits, MSB = leftmost column).
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_lowercase() {
        'a' => [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'b' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'c' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'd' => [0x1E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1E],
        'e' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'f' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'g' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'h' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'i' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'j' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'k' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'l' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'm' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'n' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'o' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'p' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'r' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        's' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        't' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'u' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'v' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'w' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'x' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'y' => [0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04],
        'z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        '/' => [0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '+' => [0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0],
        _ => [0; 7],
    }
}

fn put(img: &mut Image, x: i64, y: i64, bgr: [u8; 3]) {
    if x >= 0 && y >= 0 && (x as u32) < img.w && (y as u32) < img.h {
        let i = (y as usize * img.w as usize + x as usize) * 3;
        img.data[i..i + 3].copy_from_slice(&bgr);
    }
}

fn text(img: &mut Image, x: i64, y: i64, s: &str, bgr: [u8; 3]) {
    for (k, c) in s.chars().enumerate() {
        let g = glyph(c);
        for (r, row) in g.iter().enumerate() {
            for col in 0..5 {
                if row & (0x10 >> col) != 0 {
                    put(img, x + k as i64 * 6 + col, y + r as i64, bgr);
                }
            }
        }
    }
}

fn line(img: &mut Image, (x0, y0): (f64, f64), (x1, y1): (f64, f64), bgr: [u8; 3]) {
    let n = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
    for i in 0..=n {
        let t = i as f64 / n as f64;
        let (x, y) = ((x0 + (x1 - x0) * t).round() as i64, (y0 + (y1 - y0) * t).round() as i64);
        put(img, x, y, bgr);
        put(img, x, y + 1, bgr);
    }
}

fn fmt_num(v: f64) -> String {
    if v == 0.0 || (v.abs() >= 0.01 && v.abs() < 1000.0) {
        format!("{v:.3}")
    } else {
        format!("{v:.1e}")
    }
}

/// Draws every column but `epoch`/`time` of `results.csv` into `out` (PNG).
pub fn plot_results(csv: &Path, out: &Path) -> Result<()> {
    let io = |e| TrainerError::Io { path: csv.to_path_buf(), source: e };
    let text_in = std::fs::read_to_string(csv).map_err(io)?;
    let mut lines = text_in.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let rows: Vec<Vec<f64>> = lines.map(|l| l.split(',').map(|v| v.trim().parse::<f64>().unwrap_or(f64::NAN)).collect()).collect();
    let series: Vec<usize> = (0..header.len()).filter(|&i| !matches!(header[i], "epoch" | "time")).collect();
    let (cw, ch, cols) = (260i64, 170i64, 5usize);
    let nrows = series.len().div_ceil(cols).max(1);
    let mut img = Image::filled((cw * cols as i64) as u32, (ch * nrows as i64) as u32, [255, 255, 255]);
    for (k, &col) in series.iter().enumerate() {
        let (ox, oy) = ((k % cols) as i64 * cw, (k / cols) as i64 * ch);
        text(&mut img, ox + 8, oy + 6, header[col], [40, 40, 40]);
        let (px0, py0, pw, ph) = (ox + 40, oy + 24, cw - 56, ch - 48);
        for x in 0..=pw {
            put(&mut img, px0 + x, py0 + ph, [160, 160, 160]);
        }
        for y in 0..=ph {
            put(&mut img, px0, py0 + y, [160, 160, 160]);
        }
        let pts: Vec<(f64, f64)> =
            rows.iter().filter_map(|r| Some((*r.first()?, *r.get(col)?))).filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
        if pts.is_empty() {
            continue;
        }
        let (mut lo, mut hi) = pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
        if hi - lo < 1e-12 {
            lo -= 0.5;
            hi += 0.5;
        }
        let (e0, e1) = (pts[0].0, pts[pts.len() - 1].0.max(pts[0].0 + 1.0));
        let map =
            |(e, v): (f64, f64)| (px0 as f64 + (e - e0) / (e1 - e0) * pw as f64, (py0 + ph) as f64 - (v - lo) / (hi - lo) * ph as f64);
        for w in pts.windows(2) {
            line(&mut img, map(w[0]), map(w[1]), [200, 90, 30]);
        }
        for &p in &pts {
            let (x, y) = map(p);
            for d in -1..=1 {
                put(&mut img, x.round() as i64 + d, y.round() as i64, [200, 90, 30]);
                put(&mut img, x.round() as i64, y.round() as i64 + d, [200, 90, 30]);
            }
        }
        text(&mut img, ox + 2, py0, &fmt_num(hi), [90, 90, 90]);
        text(&mut img, ox + 2, py0 + ph - 7, &fmt_num(lo), [90, 90, 90]);
        text(&mut img, px0 + pw - 30, py0 + ph + 6, &format!("ep {}", e1 as i64), [90, 90, 90]);
    }
    write_png(&img, out).map_err(TrainerError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_one_chart_per_column() {
        let dir = std::env::temp_dir().join(format!("ptl-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let csv = dir.join("results.csv");
        std::fs::write(&csv, "epoch,time,train/box_loss,metrics/mAP50(P)\n1,0.5,3.0,0.1\n2,1.0,2.0,0.2\n3,1.5,1.5,nan\n").unwrap();
        let png = dir.join("results.png");
        plot_results(&csv, &png).unwrap();
        let (img, _) = ptl_data::image::decode_file(&png).unwrap();
        assert_eq!((img.w, img.h), (5 * 260, 170), "2 series → one row of 5 chart cells");
        let orange = img.data.chunks_exact(3).filter(|p| p == &[200, 90, 30]).count();
        assert!(orange > 100, "the loss curve is drawn ({orange} px)");
        assert!(plot_results(&dir.join("missing.csv"), &png).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

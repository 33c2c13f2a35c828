//! YOLO pose label files: parsing and the validation rules of docs/data.md §1.

use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};

/// Keypoint layout `[K, D]` with D ∈ {2, 3}.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KptShape {
    /// Keypoints per object.
    pub k: usize,
    /// Values per keypoint: 2 (x, y) or 3 (x, y, visibility).
    pub d: usize,
}

impl KptShape {
    /// COCO pose: 17 keypoints with visibility.
    pub const COCO: KptShape = KptShape { k: 17, d: 3 };

    /// Values per label row: class + box + K·D.
    pub fn columns(&self) -> usize {
        5 + self.k * self.d
    }
}

/// Objects of one image. Keypoints are always stored with a visibility column (K × 3), normalised to [0, 1].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Labels {
    /// Class id per object.
    pub cls: Vec<f32>,
    /// Normalised (cx, cy, w, h) per object.
    pub boxes: Vec<[f32; 4]>,
    /// Normalised (x, y, v) per object and keypoint: `n × K × 3`.
    pub kpts: Vec<f32>,
}

impl Labels {
    /// Number of objects.
    pub fn len(&self) -> usize {
        self.cls.len()
    }

    /// True for a background image.
    pub fn is_empty(&self) -> bool {
        self.cls.is_empty()
    }
}

/// Label settings taken from the dataset configuration.
#[derive(Clone, Debug)]
pub struct LabelRules {
    /// The keypoint layout rows must have.
    pub kpt_shape: KptShape,
    /// Classes must be below this.
    pub nc: usize,
    /// Every object becomes class 0.
    pub single_cls: bool,
}

/// Label path rule: last `/images/` component → `/labels/`, extension → `.txt`.
pub fn label_path_for(image: &Path) -> PathBuf {
    let comps: Vec<_> = image.components().collect();
    let mut out = PathBuf::new();
    let last_images = comps.iter().take(comps.len().saturating_sub(1)).rposition(|c| c.as_os_str() == "images");
    for (i, c) in comps.iter().enumerate() {
        if Some(i) == last_images {
            out.push("labels");
        } else {
            out.push(c.as_os_str());
        }
    }
    out.set_extension("txt");
    out
}

/// The lines of `text` as Python's `str.splitlines` (which Ultralytics reads label files with)
/// cuts them: at `\n`, `\r\n`, a lone `\r` (old Mac files), and the other Unicode line breaks.
pub fn python_lines(text: &str) -> impl Iterator<Item = &str> {
    const BREAKS: [char; 10] = ['\n', '\r', '\u{b}', '\u{c}', '\u{1c}', '\u{1d}', '\u{1e}', '\u{85}', '\u{2028}', '\u{2029}'];
    let mut rest = Some(text);
    std::iter::from_fn(move || {
        let t = rest?;
        if t.is_empty() {
            rest = None;
            return None;
        }
        match t.find(BREAKS) {
            Some(i) => {
                let width = if t[i..].starts_with("\r\n") { 2 } else { t[i..].chars().next().map_or(1, char::len_utf8) };
                rest = Some(&t[i + width..]);
                Some(&t[..i])
            }
            None => {
                rest = None;
                Some(t)
            }
        }
    })
}

fn lerr(path: &Path, line: Option<usize>, message: String) -> DataError {
    DataError::Label { path: path.to_path_buf(), line, message }
}

/// Parses and validates the text of one label file. Returns the labels and warnings (e.g. duplicates removed).
/// Any rule violation is an error naming the file and line: the caller skips the image.
pub fn parse_label_text(text: &str, path: &Path, rules: &LabelRules) -> Result<(Labels, Vec<String>)> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let ncol = rules.kpt_shape.columns();
    let (k, d) = (rules.kpt_shape.k, rules.kpt_shape.d);
    let mut rows: Vec<(usize, Vec<f32>)> = Vec::new();
    for (ln, line) in python_lines(text).enumerate() {
        let ln = ln + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut row = Vec::with_capacity(ncol);
        for tok in line.split_whitespace() {
            let v: f32 = tok.parse().map_err(|_| {
                lerr(path, Some(ln), format!("`{tok}` is not a number (each row is `class cx cy w h` then x y v per keypoint)"))
            })?;
            row.push(v);
        }
        if row.len() != ncol {
            return Err(lerr(
                path,
                Some(ln),
                format!(
                    "{} values, expected {ncol} = 5 + {k}·{d} for kpt_shape [{k}, {d}] (fix the row or the dataset's kpt_shape)",
                    row.len()
                ),
            ));
        }
        if let Some(bad) = row.iter().find(|v| !v.is_finite()) {
            return Err(lerr(path, Some(ln), format!("non-finite value {bad} (NaN/inf are not allowed)")));
        }
        rows.push((ln, row));
    }
    let mut warnings = Vec::new();
    if rows.is_empty() {
        return Ok((Labels::default(), warnings));
    }
    // keypoint x/y upper bound
    for (ln, row) in &rows {
        for j in 0..k {
            for a in 0..2 {
                let v = row[5 + j * d + a];
                if v > 1.01 {
                    return Err(lerr(
                        path,
                        Some(*ln),
                        format!("keypoint {j} coordinate {v} > 1.01: coordinates must be normalised to [0, 1] by the image size"),
                    ));
                }
            }
        }
    }
    // Box centres and sizes are normalised too: Ultralytics checks only the keypoints here, but a
    // centre of 1.7 lies outside the image and would train on nothing (stricter on purpose).
    for (ln, row) in &rows {
        for (name, v) in [("centre x", row[1]), ("centre y", row[2]), ("width", row[3]), ("height", row[4])] {
            if v > 1.01 {
                return Err(lerr(path, Some(*ln), format!("box {name} {v} > 1.01: boxes must be normalised to [0, 1] by the image size")));
            }
        }
    }
    // COCO visibility: 0 = not labelled, 1 = occluded, 2 = visible.
    if d == 3 {
        for (ln, row) in &rows {
            for j in 0..k {
                let v = row[5 + j * d + 2];
                if v != 0.0 && v != 1.0 && v != 2.0 {
                    return Err(lerr(
                        path,
                        Some(*ln),
                        format!("keypoint {j} visibility {v} is not 0, 1 or 2 (0 = not labelled, 1 = occluded, 2 = visible)"),
                    ));
                }
            }
        }
    }
    // lower bound over everything
    let boxes_ok = rows.iter().all(|(_, r)| r[3] >= 0.0 && r[4] >= 0.0);
    let lower = if boxes_ok { -0.01 } else { 0.0 };
    for (ln, row) in &rows {
        if let Some(v) = row.iter().find(|&&v| v < lower) {
            return Err(lerr(path, Some(*ln), format!("negative value {v} (below {lower}): labels must be normalised to [0, 1]")));
        }
    }
    if rules.single_cls {
        for (_, row) in &mut rows {
            row[0] = 0.0;
        }
    } else {
        for (ln, row) in &rows {
            let c = row[0];
            if c.fract() != 0.0 || c as usize >= rules.nc {
                return Err(lerr(
                    path,
                    Some(*ln),
                    format!("class {c} is not an integer below nc = {} (fix the class id or the dataset names)", rules.nc),
                ));
            }
        }
    }
    // exact duplicates: unique rows in lexicographic order (numpy unique side effect)
    let n0 = rows.len();
    let mut plain: Vec<Vec<f32>> = rows.into_iter().map(|(_, r)| r).collect();
    let mut sorted = plain.clone();
    sorted.sort_by(|a, b| {
        for (x, y) in a.iter().zip(b) {
            match x.total_cmp(y) {
                std::cmp::Ordering::Equal => continue,
                o => return o,
            }
        }
        std::cmp::Ordering::Equal
    });
    sorted.dedup();
    if sorted.len() < n0 {
        warnings.push(format!("{}: {} duplicate labels removed", path.display(), n0 - sorted.len()));
        plain = sorted;
    }
    let mut labels = Labels::default();
    for row in &plain {
        labels.cls.push(row[0]);
        labels.boxes.push([row[1], row[2], row[3], row[4]]);
        for j in 0..k {
            let x = row[5 + j * d];
            let y = row[5 + j * d + 1];
            let v = if d == 3 {
                row[5 + j * d + 2]
            } else if x < 0.0 || y < 0.0 {
                0.0
            } else {
                1.0
            };
            labels.kpts.extend_from_slice(&[x, y, v]);
        }
    }
    Ok((labels, warnings))
}

/// Formats a number like C's `%g` (6 significant digits, trailing zeros removed).
pub fn fmt_g(v: f64) -> String {
    if v == 0.0 {
        return if v.is_sign_negative() { "-0".into() } else { "0".into() };
    }
    if !v.is_finite() {
        return format!("{v}");
    }
    let e = format!("{:.5e}", v);
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let _ = mant;
    if !(-4..6).contains(&exp) {
        let (m, _) = e.split_once('e').unwrap_or((&e, ""));
        let m = strip_zeros(m);
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    } else {
        let decimals = (5 - exp).max(0) as usize;
        strip_zeros(&format!("{v:.decimals$}"))
    }
}

fn strip_zeros(s: &str) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> LabelRules {
        LabelRules { kpt_shape: KptShape::COCO, nc: 1, single_cls: false }
    }

    fn row(cls: f32, shift: f32) -> String {
        let mut v = vec![cls, 0.5 + shift, 0.5, 0.2, 0.4];
        for j in 0..17 {
            v.extend_from_slice(&[0.4 + j as f32 * 0.01, 0.3, 2.0]);
        }
        v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn label_path_rule() {
        assert_eq!(label_path_for(Path::new("/d/images/train/a.b.jpg")), PathBuf::from("/d/labels/train/a.b.txt"));
        assert_eq!(label_path_for(Path::new("/images/x/images/train/a.png")), PathBuf::from("/images/x/labels/train/a.txt"));
    }

    #[test]
    fn lines_are_cut_as_pythons_splitlines() {
        fn cut(t: &str) -> Vec<&str> {
            python_lines(t).collect()
        }
        assert_eq!(cut("a\nb\r\nc\rd"), ["a", "b", "c", "d"]);
        assert_eq!(cut("a\n"), ["a"]);
        assert_eq!(cut("a\r\rb"), ["a", "", "b"]);
        assert_eq!(cut("x\u{2028}y\u{85}z"), ["x", "y", "z"]);
        assert!(cut("").is_empty());
        // A label file written with lone CRs reads as its rows.
        let rules = LabelRules { kpt_shape: KptShape { k: 1, d: 2 }, nc: 1, single_cls: false };
        let (l, _) = parse_label_text("0 0.5 0.5 0.2 0.2 0.5 0.5\r0 0.3 0.3 0.1 0.1 0.3 0.3\r", Path::new("a.txt"), &rules).unwrap();
        assert_eq!(l.cls.len(), 2);
    }

    #[test]
    fn parse_ok_bom_blank_lines() {
        let t = format!("\u{feff}{}\n\n{}\n", row(0.0, 0.0), row(0.0, 0.1));
        let (l, w) = parse_label_text(&t, Path::new("a.txt"), &rules()).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l.kpts.len(), 2 * 17 * 3);
        assert!(w.is_empty());
        assert_eq!(l.boxes[1][0], 0.6);
    }

    #[test]
    fn duplicates_removed_sorted() {
        let t = format!("{}\n{}\n{}\n", row(0.0, 0.1), row(0.0, 0.0), row(0.0, 0.1));
        let (l, w) = parse_label_text(&t, Path::new("a.txt"), &rules()).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("a.txt") && w[0].contains("1 duplicate"));
        assert_eq!(l.boxes[0][0], 0.5); // lexicographically sorted
    }

    #[test]
    fn two_column_keypoints_synthesise_visibility() {
        let r = LabelRules { kpt_shape: KptShape { k: 2, d: 2 }, nc: 1, single_cls: false };
        let (l, _) = parse_label_text("0 0.5 0.5 0.1 0.1 0.2 0.3 -0.005 0.5", Path::new("a.txt"), &r).unwrap();
        assert_eq!(l.kpts, vec![0.2, 0.3, 1.0, -0.005, 0.5, 0.0]);
    }

    #[test]
    fn bad_rows() {
        let p = Path::new("bad.txt");
        let cases = [
            ("0 0.5 0.5".to_string(), "expected 56"),
            (row(0.0, 0.0).replacen("0.5", "abc", 1), "not a number"),
            (row(0.0, 0.0).replacen("0.5", "NaN", 1), "non-finite"),
            (row(1.0, 0.0), "class 1"),
            (row(0.5, 0.0), "class 0.5"),
            (row(0.0, 0.0).replace(" 0.3 ", " 1.5 "), "> 1.01"),
            (row(0.0, 0.0).replace(" 0.3 ", " -0.3 "), "negative"),
        ];
        for (text, want) in cases {
            let e = parse_label_text(&text, p, &rules()).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("bad.txt:1"), "{e} (wanted {want})");
        }
        // box values are bound-checked too (stricter than Ultralytics); small negatives allowed when w, h ≥ 0
        let t = row(0.0, 0.0).replacen("0.5", "1.2", 1);
        assert!(parse_label_text(&t, p, &rules()).unwrap_err().to_string().contains("box centre x 1.2 > 1.01"));
        let t = row(0.0, 0.0).replacen("0.5", "1.005", 1);
        assert!(parse_label_text(&t, p, &rules()).is_ok(), "1.01 tolerance as for keypoints");
        let t = row(0.0, 0.0).replace(" 0.3 ", " -0.005 ");
        assert!(parse_label_text(&t, p, &rules()).is_ok());
        assert!(parse_label_text("", p, &rules()).unwrap().0.is_empty());
    }

    #[test]
    fn percent_g() {
        assert_eq!(fmt_g(0.123456789), "0.123457");
        assert_eq!(fmt_g(0.5), "0.5");
        assert_eq!(fmt_g(1.0), "1");
        assert_eq!(fmt_g(0.0), "0");
        assert_eq!(fmt_g(0.00001234), "1.234e-05");
        assert_eq!(fmt_g(123.4567), "123.457");
        assert_eq!(fmt_g(2.0), "2");
    }
}

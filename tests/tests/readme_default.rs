//! The README's first command (`ptl train` with no settings: the embedded default) on a clean
//! machine: a fresh cache folder, so the default dataset and start weights are written anew. It
//! must end with the box and pose mAP50 the README promises (within 0.03: other CPUs round the
//! convolutions' last bits differently), a pose mAP50 of at least 0.1, and a drawn prediction
//! whose path it prints.

mod common;

use common::{ptl, text};

/// The figure the README gives for `key` (written as "`metrics/mAP50(B)` ≈ 0.91").
fn promised(readme: &str, key: &str) -> f64 {
    let marker = format!("`{key}` ≈ ");
    let at = readme.find(&marker).unwrap_or_else(|| panic!("the README gives no figure for {key} (\"{marker}…\")"));
    let rest = &readme[at + marker.len()..];
    let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    rest[..end].parse().unwrap_or_else(|_| panic!("{key}: `{}` is not a number", &rest[..end]))
}

#[test]
fn the_default_job_ends_with_the_readme_figures_and_a_drawing() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).expect("README.md");
    let dir = tempfile::tempdir().expect("tempdir");
    let o = ptl(&["train", "--device", "cpu"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let printed = |key: &str| -> f64 {
        out.lines()
            .find_map(|l| match l.split_whitespace().collect::<Vec<_>>().as_slice() {
                [k, v] if *k == key => v.parse().ok(),
                _ => None,
            })
            .unwrap_or_else(|| panic!("the run printed no {key}:\n{out}"))
    };
    for key in ["metrics/mAP50(B)", "metrics/mAP50(P)"] {
        let (got, want) = (printed(key), promised(&readme, key));
        println!("{key}: printed {got:.4}, README {want}");
        assert!((got - want).abs() <= 0.03, "{key}: the run printed {got:.4}, the README promises {want}");
    }
    assert!(printed("metrics/mAP50(P)") >= 0.1, "the default model finds the people's keypoints");
    let drawing = out
        .lines()
        .find_map(|l| l.split_once(" -> ").map(|(_, p)| p.trim().to_string()))
        .unwrap_or_else(|| panic!("no drawn prediction named:\n{out}"));
    let path = dir.path().join(&drawing);
    assert!(path.is_file(), "{} exists", path.display());
    println!("drawing: {drawing}");
}

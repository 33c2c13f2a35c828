//! Point 7 of the data issue: bad files are skipped with a warning naming them, counted by reason; a dataset with
//! nothing usable and broken configuration are errors with locations; nothing panics.

mod common;

use common::*;
use ptl_data::{DataError, PoseDataset, SkipReason};

fn skipped_reason(ds: &PoseDataset, name: &str) -> Option<SkipReason> {
    ds.report.skipped.iter().find(|s| s.path.to_string_lossy().contains(name)).map(|s| s.reason)
}

fn warned(ds: &PoseDataset, name: &str) -> bool {
    ds.report.warnings.iter().any(|w| w.contains(name))
}

#[test]
fn bad_files_are_skipped_with_named_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    // good image with label, background (missing label), background (empty label)
    l.image("train", "good.jpg", 120, 90, 1);
    l.label("train", "good", &row(0.0));
    l.image("train", "nolabel.jpg", 120, 90, 2);
    l.image("train", "empty.jpg", 120, 90, 3);
    l.label("train", "empty", "\n\n");
    // corrupt and truncated images
    std::fs::write(dir.path().join("images/train/corrupt.jpg"), b"\xFF\xD8\xFF\xE0 garbage garbage").unwrap();
    l.label("train", "corrupt", &row(0.0));
    let t = l.image("train", "truncated.jpg", 120, 90, 4);
    let bytes = std::fs::read(&t).unwrap();
    std::fs::write(&t, &bytes[..200]).unwrap();
    l.label("train", "truncated", &row(0.0));
    let tp = l.image("train", "trunc_png.png", 120, 90, 5);
    let bytes = std::fs::read(&tp).unwrap();
    std::fs::write(&tp, &bytes[..bytes.len() / 2]).unwrap();
    // label problems
    l.image("train", "malformed.jpg", 120, 90, 6);
    l.label("train", "malformed", "0 0.5 0.5 zero 0.2\n");
    l.image("train", "short.jpg", 120, 90, 7);
    let full = row(0.0);
    let short: Vec<&str> = full.split(' ').take(5 + 16 * 3).collect();
    l.label("train", "short", &short.join(" "));
    l.image("train", "outside.jpg", 120, 90, 8);
    l.label("train", "outside", &row(0.0).replacen(" 0.35 ", " 1.35 ", 1));
    l.image("train", "nan.jpg", 120, 90, 9);
    l.label("train", "nan", &row(0.0).replacen(" 0.3 ", " nan ", 1));
    l.image("train", "dup.jpg", 120, 90, 10);
    l.label("train", "dup", &format!("{}\n{}\n", row(0.0), row(0.0)));
    l.image("train", "badcls.jpg", 120, 90, 11);
    l.label("train", "badcls", &row(0.0).replacen('0', "3", 1));
    l.image("train", "tiny.png", 8, 40, 12);
    l.image("train", "notutf8.jpg", 120, 90, 13);
    l.label("train", "notutf8", "\u{0}");
    std::fs::write(dir.path().join("labels/train/notutf8.txt"), [0xFFu8, 0xFE, 0x00]).unwrap();
    std::fs::write(dir.path().join("images/train/fake.webp"), b"RIFF0000WEBPVP8 ").unwrap();
    // label without image
    l.label("train", "orphan", &row(0.0));

    let ds = PoseDataset::open_yaml(&l.yaml(), "train", &quiet(96)).unwrap();
    let r = &ds.report;
    let kept: Vec<String> = ds.items.iter().map(|i| i.im_file.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(kept, vec!["dup.jpg", "empty.jpg", "good.jpg", "nolabel.jpg"], "{r:?}");
    assert_eq!(r.found, 15);
    assert_eq!(r.usable, 4);
    assert_eq!(r.background, 2);
    assert_eq!(r.missing_labels, 1);
    for (name, reason) in [
        ("corrupt.jpg", SkipReason::BadImage),
        ("truncated.jpg", SkipReason::BadImage),
        ("trunc_png.png", SkipReason::BadImage),
        ("tiny.png", SkipReason::BadImage),
        ("fake.webp", SkipReason::BadImage),
        ("malformed.txt", SkipReason::InvalidLabel),
        ("short.txt", SkipReason::InvalidLabel),
        ("outside.txt", SkipReason::InvalidLabel),
        ("nan.txt", SkipReason::InvalidLabel),
        ("badcls.txt", SkipReason::InvalidLabel),
        ("notutf8.txt", SkipReason::UnreadableLabel),
    ] {
        assert_eq!(skipped_reason(&ds, name), Some(reason), "{name}: {r:?}");
        assert!(warned(&ds, name), "no warning names {name}");
    }
    assert_eq!(r.skipped.len(), 11);
    assert_eq!(r.skip_summary(), "5 bad image, 1 unreadable label, 5 invalid label");
    // messages say what is wrong, with line numbers for labels
    let msg = |n: &str| r.skipped.iter().find(|s| s.path.to_string_lossy().contains(n)).unwrap().message.clone();
    assert!(msg("malformed.txt").contains("malformed.txt:1") && msg("malformed.txt").contains("zero"));
    assert!(msg("short.txt").contains("expected 56"));
    assert!(msg("outside.txt").contains("> 1.01"));
    assert!(msg("nan.txt").contains("NaN") || msg("nan.txt").contains("non-finite"));
    assert!(msg("tiny.png").contains("minimum"));
    // duplicates removed with a warning, orphan label warned
    assert!(warned(&ds, "dup.txt"));
    let dup = ds.items.iter().find(|i| i.im_file.ends_with("dup.jpg")).unwrap();
    assert_eq!(dup.labels.len(), 1);
    assert_eq!(r.orphan_labels.len(), 1);
    assert!(warned(&ds, "orphan.txt"));
    assert!(r.summary().contains("11 skipped"));
}

#[test]
fn nothing_usable_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    std::fs::write(dir.path().join("images/train/a.jpg"), b"nope").unwrap();
    l.label("train", "a", &row(0.0));
    let e = PoseDataset::open_yaml(&l.yaml(), "train", &quiet(64)).unwrap_err();
    assert!(matches!(e, DataError::EmptyDataset { skipped: 1, .. }), "{e}");
    assert!(e.to_string().contains("1 bad image"), "{e}");
    // empty image folder
    let e = PoseDataset::open_yaml(&l.yaml(), "val", &quiet(64)).unwrap_err();
    assert!(matches!(e, DataError::EmptyDataset { found: 0, .. }), "{e}");
}

#[test]
fn train_split_without_any_label_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let l = Layout::new(dir.path());
    l.image("train", "a.jpg", 64, 64, 1);
    let e = PoseDataset::open_yaml(&l.yaml(), "train", &quiet(64)).unwrap_err();
    assert!(matches!(e, DataError::NoLabels { .. }), "{e}");
    // val may be all background
    l.image("val", "b.jpg", 64, 64, 1);
    assert_eq!(PoseDataset::open_yaml(&l.yaml(), "val", &quiet(64)).unwrap().len(), 1);
}

#[test]
fn broken_or_missing_yaml_and_folders() {
    let dir = tempfile::tempdir().unwrap();
    let y = dir.path().join("d.yaml");
    std::fs::write(&y, "path: .\ntrain: images/train\nkpt_shape: [17, 3\nnames: [person]\n").unwrap();
    let e = PoseDataset::open_yaml(&y, "train", &quiet(64)).unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, DataError::Yaml { line: 3..=4, .. }), "{s}");
    assert!(s.contains("d.yaml:"), "{s}");
    // unreadable (missing) yaml
    let e = PoseDataset::open_yaml(&dir.path().join("none.yaml"), "train", &quiet(64)).unwrap_err();
    assert!(matches!(e, DataError::Io { .. }) && e.to_string().contains("none.yaml"), "{e}");
    // not a mapping
    std::fs::write(&y, "- a\n- b\n").unwrap();
    assert!(matches!(PoseDataset::open_yaml(&y, "train", &quiet(64)), Err(DataError::Yaml { .. })));
    // missing folder
    std::fs::write(&y, "path: .\ntrain: images/train\nkpt_shape: [17, 3]\nnames: [person]\n").unwrap();
    let e = PoseDataset::open_yaml(&y, "train", &quiet(64)).unwrap_err();
    assert!(matches!(e, DataError::MissingPath { .. }) && e.to_string().contains("images/train"), "{e}");
    // split not defined
    let e = PoseDataset::open_yaml(&y, "val", &quiet(64)).unwrap_err();
    assert!(e.to_string().contains("`val`"), "{e}");
    let e = PoseDataset::open_yaml(&y, "bogus", &quiet(64)).unwrap_err();
    assert!(e.to_string().contains("unknown split"), "{e}");
}

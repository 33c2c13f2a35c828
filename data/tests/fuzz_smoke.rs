//! A short fuzzing run of every parser that reads user files (CI's smoke run): the committed
//! corpus (`fuzz/corpus/<target>/`, grown by libFuzzer runs) plus a few thousand mutated inputs
//! per target from the stable harness. Any panic is a failure; the long runs are
//! `cargo xtask fuzz` (libFuzzer, nightly) or `cargo xtask fuzz --stable`.

use std::path::PathBuf;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(target);
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).flatten().map(|e| e.path()).collect();
    files.sort();
    files.iter().map(|p| std::fs::read(p).expect("corpus file")).collect()
}

#[test]
fn every_target_survives_its_corpus_and_mutations() {
    for target in ptl_data::fuzz::TARGETS {
        let seeds = corpus(target);
        assert!(!seeds.is_empty(), "{target}: empty corpus");
        // `PTL_FUZZ_EXECS` scales the run (`cargo xtask fuzz --stable`); CI keeps it short.
        let scale: u64 = std::env::var("PTL_FUZZ_EXECS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        let execs = if scale > 0 {
            scale
        } else if target == "image_header" {
            1_500
        } else {
            5_000
        };
        let run = ptl_data::fuzz::run(target, &seeds, execs, 0x5eed).expect("known target");
        assert_eq!(run.crash_count, 0, "{target}: {} crashing inputs, first: {:?}", run.crash_count, run.crashes.first());
        println!("{target}: {} executions, 0 crashes", run.executions);
    }
}

#[test]
fn the_harness_reports_a_panicking_target() {
    // The harness must not hide crashes: a parser that panics on some inputs is caught.
    assert!(ptl_data::fuzz::run("no_such_target", &[], 1, 1).is_none());
    let run = ptl_data::fuzz::run_fn(|d| assert!(!d.contains(&b'!'), "bang"), &[b"abc".to_vec()], 2_000, 3);
    assert!(run.crash_count > 0, "mutations that insert '!' must be reported");
}

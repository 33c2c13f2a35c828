//! The command line on a GPU machine: a named device is the device that trains (`device=cpu`
//! trains on the CPU although a GPU is there), a device that is not there is an error, and
//! `amp=true` means 16-mixed on a GPU. Skips, saying so, where no GPU answers.

mod common;

use std::path::Path;

use common::{ptl, summary, synth, text};

/// A one-epoch run's arguments into `dir/<name>`.
fn run_args(data: &Path, dir: &Path, name: &str) -> Vec<String> {
    [
        format!("data={}", data.display()),
        "epochs=1".into(),
        "batch=2".into(),
        "imgsz=64".into(),
        "max_batches=2".into(),
        "optimizer=SGD".into(),
        "plots=false".into(),
        "val=false".into(),
        format!("project={}", dir.display()),
        format!("name={name}"),
    ]
    .to_vec()
}

fn train(args: &[String], extra: &[&str], cwd: &Path) -> std::process::Output {
    let mut all: Vec<&str> = vec!["train"];
    all.extend(args.iter().map(String::as_str));
    all.extend(extra);
    ptl(&all, cwd)
}

#[test]
fn cuda_named_devices_are_used_or_refused() {
    let Some(_) = ptl_autograd::cuda::device_for_tests(0).expect("a GPU that is present must be usable") else { return };
    let count = ptl_autograd::cuda::device_count();
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let device_of = |name: &str| summary(&dir.path().join(name))["device"].as_str().map(str::to_string);
    let precision_of = |name: &str| summary(&dir.path().join(name))["precision"].as_str().map(str::to_string);

    // The key, the flag and a yaml each decide the device.
    let o = train(&run_args(&data, dir.path(), "cpu_key"), &["device=cpu"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(device_of("cpu_key").as_deref(), Some("cpu"), "device=cpu trains on the CPU beside a GPU");
    let o = train(&run_args(&data, dir.path(), "gpu_flag"), &["--device", "cuda:0"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(device_of("gpu_flag").as_deref(), Some("cuda:0"));
    let yaml = dir.path().join("cpu.yaml");
    std::fs::write(&yaml, "device: cpu\n").unwrap();
    let o = train(&run_args(&data, dir.path(), "cpu_yaml"), &[yaml.to_str().unwrap()], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(device_of("cpu_yaml").as_deref(), Some("cpu"));
    // amp=true: 16-mixed on the GPU, 32-true on the CPU.
    let o = train(&run_args(&data, dir.path(), "amp_gpu"), &["device=cuda:0", "amp=true"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(precision_of("amp_gpu").as_deref(), Some("16-mixed"));
    let o = train(&run_args(&data, dir.path(), "amp_cpu"), &["device=cpu", "amp=true"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(precision_of("amp_cpu").as_deref(), Some("32-true"));
    // Neither amp nor precision given: Ultralytics' default amp=True, 16-mixed on the GPU.
    let o = train(&run_args(&data, dir.path(), "default_gpu"), &["device=cuda:0"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(precision_of("default_gpu").as_deref(), Some("16-mixed"));

    // A GPU that is not there: an error naming it, nothing trained, no fall-back.
    let missing = format!("cuda:{count}");
    let o = train(&run_args(&data, dir.path(), "missing"), &[&format!("device={missing}")], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains(&format!("{missing} cannot be used")), "{}", text(&o));
    assert!(!dir.path().join("missing").exists(), "nothing written for a refused device");
    // The flag and the key disagreeing: an error naming both.
    let o = train(&run_args(&data, dir.path(), "both"), &["--device", "cpu", "device=cuda:0"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("`--device cpu` and `device=cuda:0` disagree"), "{}", text(&o));
    // val takes the same rules.
    let w = dir.path().join("gpu_flag/weights/last.ckpt");
    let o = ptl(&["val", &format!("model={}", w.display()), "imgsz=64", &format!("device={missing}")], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains(&format!("{missing} cannot be used")), "{}", text(&o));
}

//! The command line on a GPU machine: a named device is the device that trains (`device=cpu`
//! trains on the CPU although a GPU is there), a device that is not there is an error, and
//! `amp=true` means 16-mixed on a GPU, and AutoBatch sizes the batch to the memory. Skips, saying
//! so, where no GPU answers.

mod common;

use std::path::Path;

use common::{ptl, summary, synth, text, train};

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

/// AutoBatch on a GPU of which this process holds all but 2.5 GiB: `batch=16` at 640 px does not
/// fit, and the error (exit 1, no CUDA abort) names a batch that does — a run with it trains;
/// `batch=-1` chooses a batch by itself, and the run with it trains.
#[test]
fn cuda_autobatch_fits_the_batch_to_the_memory() {
    use ptl_autograd::{DType, Tensor};
    let Some(dev) = ptl_autograd::cuda::device_for_tests(0).expect("a GPU that is present must be usable") else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ds");
    let o = ptl(
        &["data", "synth", "--out", out.to_str().unwrap(), "--train", "32", "--background", "0", "--val", "2", "--imgsz", "320"],
        dir.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    let data = out.join("data.yaml");
    let (free, _) = ptl_autograd::cuda::device_memory(dev).unwrap();
    let keep = 5u64 << 29;
    assert!(free > keep, "the GPU has {free} bytes free: too few for this test");
    let ballast = Tensor::zeros(vec![(free - keep) as usize], DType::U8, dev).unwrap();
    ptl_autograd::cuda::synchronize(dev).unwrap();
    let args = |name: &str, batch: &str| -> Vec<String> {
        [
            format!("data={}", data.display()),
            "epochs=1".into(),
            format!("batch={batch}"),
            "imgsz=640".into(),
            "max_batches=2".into(),
            "plots=false".into(),
            "val=false".into(),
            "device=cuda:0".into(),
            format!("project={}", dir.path().display()),
            format!("name={name}"),
        ]
        .to_vec()
    };
    let o = train(&args("b16", "16"), &[], dir.path());
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "batch=16 at 640 px in 2.5 GiB: {t}");
    let said = "batch=16 does not fit in the memory of cuda:0; batch=";
    let at = t.find(said).unwrap_or_else(|| panic!("the error names a batch that fits: {t}")) + said.len();
    let fits: usize = t[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap();
    assert!((1..16).contains(&fits), "{t}");
    let o = train(&args("fits", &fits.to_string()), &[], dir.path());
    assert!(o.status.success(), "batch={fits}, named by the error: {}", text(&o));
    assert_eq!(summary(&dir.path().join("fits"))["batch"].as_u64(), Some(fits as u64));

    let o = train(&args("auto", "-1"), &[], dir.path());
    let t = text(&o);
    assert!(o.status.success(), "batch=-1: {t}");
    let said = "AutoBatch: Using batch-size ";
    let at = t.find(said).unwrap_or_else(|| panic!("AutoBatch reports its choice: {t}")) + said.len();
    let chosen: u64 = t[at..].split(' ').next().unwrap().parse().unwrap();
    assert_eq!(summary(&dir.path().join("auto"))["batch"].as_u64(), Some(chosen), "{t}");
    println!("ok autobatch: batch=16 refused naming batch={fits} (which trained); batch=-1 chose {chosen}");
    drop(ballast);
}

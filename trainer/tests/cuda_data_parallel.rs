//! A data-parallel fit of one rank on one GPU through NCCL (the identifier through the
//! rendezvous store, the watchdog running, the gradients summed on the device) gives the plain
//! fit's bytes: the NCCL path changes no value when there is no other rank.
//! Without a usable GPU the test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use std::time::Duration;

use ptl_trainer::distributed::NcclCollective;
use ptl_trainer::pose::{fit, fit_data_parallel, PoseTrainConfig, Precision};

#[test]
fn one_nccl_rank_is_the_plain_cuda_fit() {
    let Some(dev) = ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
    else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-dp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = ptl_data::SynthOptions { out: dir.join("ds"), train: 16, background: 4, val: 4, imgsz: 64, seed: 5, ..Default::default() };
    let data = ptl_data::synth_generate(&opts).expect("synthetic dataset").yaml;
    let cfg = |save: &str| PoseTrainConfig {
        data: data.clone(),
        epochs: 2,
        batch: 4,
        imgsz: 64,
        seed: 3,
        device: dev,
        precision: Precision::Bf16Mixed,
        workers: Some(0),
        optimizer: "SGD".into(),
        close_mosaic: 0,
        plots: false,
        progress: false,
        save_dir: dir.join(save),
        ..PoseTrainConfig::default()
    };
    let plain = fit(&cfg("plain"), vec![]).expect("plain fit");
    let group = NcclCollective::alone(dev, Duration::from_secs(60)).expect("one-rank NCCL group");
    let ranked = fit_data_parallel(&cfg("ranked"), vec![], Box::new(group)).expect("one-rank data-parallel fit");
    assert_eq!(ranked.hashes, plain.hashes, "one NCCL rank trains the plain fit's bytes");
    println!("ok one NCCL rank: model {} as the plain fit", &plain.hashes.model[..16]);
}

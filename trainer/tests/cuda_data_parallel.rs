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

/// The sums a backward starts as its buckets become final run on NCCL's own stream beside the
/// rest of the backward and are waited for before the update's agreement: one rank's gradients
/// after them are a plain backward's bytes, with buckets started during the backward.
#[test]
fn one_nccl_rank_sums_buckets_beside_the_backward() {
    use ptl_autograd::{DType, Rng, Tensor};
    use ptl_trainer::distributed::{DataParallel, OverlappedSums};
    let Some(dev) = ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
    else {
        return;
    };
    let values: Vec<Tensor> =
        (0..5).map(|i| Tensor::rand(vec![3000 * (i + 1)], -1.0, 1.0, DType::F32, dev, &mut Rng::new(i as u64)).unwrap()).collect();
    let inputs: Vec<Tensor> =
        (0..5).map(|i| Tensor::rand(vec![3000 * (i + 1)], -1.0, 1.0, DType::F32, dev, &mut Rng::new(50 + i as u64)).unwrap()).collect();
    // p0·x0 first … p4·x4 last: backward finishes p4 first, as a model's last layers.
    let model = || {
        let params: Vec<(String, Tensor)> =
            values.iter().enumerate().map(|(i, v)| (format!("p{i}"), v.mul_scalar(1.0).unwrap().requires_grad_(true).unwrap())).collect();
        let mut loss = params[0].1.mul(&inputs[0]).unwrap().sum_all().unwrap();
        for (i, (_, p)) in params.iter().enumerate().skip(1) {
            loss = loss.mul(&p.mul(&inputs[i]).unwrap().square().unwrap().sum_all().unwrap()).unwrap();
        }
        (params, loss)
    };
    let grads =
        |params: &[(String, Tensor)]| -> Vec<Vec<u8>> { params.iter().map(|(_, p)| p.grad().unwrap().to_bytes().unwrap()).collect() };
    let (params, loss) = model();
    loss.backward().unwrap();
    let reference = grads(&params);

    let group = NcclCollective::alone(dev, Duration::from_secs(60)).expect("one-rank NCCL group");
    // Buckets of 40,000 bytes: the five parameters' 180,000 bytes in several buckets.
    let mut dp = DataParallel::with_bucket_bytes(Box::new(group), 40_000);
    let (params, loss) = model();
    let mut sums = OverlappedSums::new(&mut dp, &params).unwrap();
    loss.backward_with_ready(&loss.ones_like().unwrap(), &mut sums.ready_hook(&dp)).unwrap();
    let during = sums.issued();
    assert!(during >= 2, "buckets started during the backward: {during}");
    let nonfinite = sums.finish(&mut dp, &params, false, &[]).unwrap();
    assert!(!nonfinite);
    assert_eq!(grads(&params), reference, "one rank's averaged gradients are its own");
    println!("ok one NCCL rank: {during} buckets summed beside the backward, the plain gradients' bytes");
}

//! The fused device HSV kernel produces exactly the CPU reference's bytes (docs/data.md §6.3).
//!
//! Exhaustive over colours: one 4096×4096 image holds every 24-bit RGB value once, jittered with
//! several gain triples (Ultralytics' defaults, extremes, negative and zero gains), so every input
//! colour meets every table. A second test runs a real training batch from the loader with
//! `hsv_on_device` and compares it with the same batch built with HSV on the CPU.
//! Without a usable GPU each test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use ptl_autograd::{Device, Tensor};
use ptl_data::device_hsv::apply_hsv_device;
use ptl_data::rng::Rng;
use ptl_data::{apply_hsv_batch_rgb_nchw, HsvGains, OpenOptions, PoseDataset, SynthOptions, TrainConfig, TrainLoader};

fn gpu() -> Option<Device> {
    ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
}

fn on_device(dev: Device, img: &[u8], n: usize, h: usize, w: usize, gains: &[HsvGains]) -> Vec<u8> {
    let x = Tensor::from_vec(img.to_vec(), vec![n, 3, h, w], dev).expect("upload");
    let y = apply_hsv_device(&x, gains).expect("device hsv");
    let out = y.to_vec::<u8>().expect("download");
    // the input is never written
    assert_eq!(x.to_vec::<u8>().expect("download input"), img, "the kernel modified its input");
    out
}

#[test]
fn device_hsv_matches_cpu_bytes_for_every_colour() {
    let Some(dev) = gpu() else { return };
    let (h, w) = (4096usize, 4096usize);
    let plane = h * w;
    let mut rng = Rng::new(347);
    let gains = [
        HsvGains::draw(&mut rng, 0.015, 0.7, 0.4),
        HsvGains::draw(&mut rng, 0.015, 0.7, 0.4),
        HsvGains { h: 0.5, s: 0.9, v: -0.9 },
        HsvGains { h: -0.015, s: -0.7, v: 0.4 },
        HsvGains::default(),
    ];
    let n = gains.len();
    let mut img = vec![0u8; n * 3 * plane];
    for (k, im) in img.chunks_exact_mut(3 * plane).enumerate() {
        // every RGB value once, in a different order per image (so flat runs and neighbours differ)
        for p in 0..plane {
            let c = (p * (2 * k + 1)) % plane; // odd multiplier: a permutation of 0..2^24
            im[p] = (c >> 16) as u8;
            im[plane + p] = (c >> 8) as u8;
            im[2 * plane + p] = c as u8;
        }
    }
    let mut expect = img.clone();
    apply_hsv_batch_rgb_nchw(&mut expect, h, w, &gains);
    let got = on_device(dev, &img, n, h, w, &gains);
    let first_diff = got.iter().zip(&expect).position(|(a, b)| a != b);
    assert!(first_diff.is_none(), "first differing byte at {first_diff:?}");
    // zero gains leave the image untouched (no lossy HSV round trip)
    assert_eq!(&got[(n - 1) * 3 * plane..], &img[(n - 1) * 3 * plane..]);
    // determinism: a second launch gives the same bytes
    assert_eq!(on_device(dev, &img, n, h, w, &gains), got);
    println!("device hsv: {} images × 2^24 colours, identical to the CPU reference", n);
}

#[test]
fn device_hsv_on_a_training_batch_equals_the_cpu_path() {
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ptl-cuda-hsv-{}", std::process::id()));
    let opts = SynthOptions { out: dir.clone(), train: 12, background: 2, val: 2, imgsz: 128, seed: 5, ..SynthOptions::default() };
    ptl_data::synth_generate(&opts).expect("synth");
    let open = OpenOptions { imgsz: 128, ..OpenOptions::default() };
    let ds = Arc::new(PoseDataset::open_yaml(&dir.join("data.yaml"), "train", &open).expect("open"));
    let cfg =
        |on_device: bool| TrainConfig { batch: 4, seed: 9, epochs: 1, workers: 0, hsv_on_device: on_device, ..TrainConfig::default() };
    let cpu = TrainLoader::new(ds.clone(), cfg(false)).expect("loader");
    let gpu_loader = TrainLoader::new(ds, cfg(true)).expect("loader");
    for b in 0..cpu.batches_per_epoch() {
        let want = cpu.build_batch(0, b).expect("cpu batch");
        let raw = gpu_loader.build_batch(0, b).expect("raw batch");
        assert!(want.hsv_applied && !raw.hsv_applied);
        assert_eq!(want.hsv_gains, raw.hsv_gains);
        let [n, _, h, w] = raw.shape;
        let got = on_device(dev, &raw.img, n, h, w, &raw.hsv_gains);
        assert_eq!(got, want.img, "batch {b}: device HSV differs from the CPU path");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

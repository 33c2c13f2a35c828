//! Real CUDA graphs in real fits: native vs `replay=feature` vs `replay=feature,stem` in every
//! precision — identical hashes, and every region replayed on every step after its warm-up.
//! Without a usable GPU the test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

use ptl_autograd::Device;
use ptl_plugins::PieceReplay;
use ptl_trainer::pose::{fit, PoseTrainConfig, Precision};

fn gpu() -> Option<Device> {
    match ptl_autograd::cuda::check(0) {
        Ok(()) => Some(Device::Cuda(0)),
        Err(e @ (ptl_autograd::CudaSetupError::NoDriver | ptl_autograd::CudaSetupError::NoDevice { .. })) => {
            println!("skipping: {e}");
            None
        }
        Err(e) => panic!("a GPU is present but CUDA is not usable: {e}"),
    }
}

#[test]
fn cuda_replay_equals_native_in_every_precision() {
    let Some(dev) = gpu() else { return };
    assert_eq!((PieceReplay::FEATURE, PieceReplay::STEM), ("feature", "stem"));
    let dir = std::env::temp_dir().join(format!("ptl-cuda-replay-{}", std::process::id()));
    let data = ptl_data::synth_generate(&ptl_data::SynthOptions {
        out: dir.join("ds"),
        train: 40,
        background: 10,
        val: 4,
        imgsz: 64,
        seed: 5,
        ..Default::default()
    })
    .expect("dataset")
    .yaml;
    for precision in [Precision::F32, Precision::Bf16Mixed, Precision::F16Mixed] {
        let run = |replay: &[&str]| {
            let cfg = PoseTrainConfig {
                data: data.clone(),
                epochs: 1,
                batch: 2,
                imgsz: 64,
                seed: 3,
                device: dev,
                precision,
                workers: Some(2),
                optimizer: "MuSGD".into(),
                close_mosaic: 0,
                plots: false,
                progress: false,
                gpu_time: false,
                exist_ok: true,
                replay: replay.iter().map(|s| s.to_string()).collect(),
                save_dir: dir.join(format!("{}-{}", precision.name(), replay.join("+"))),
                ..PoseTrainConfig::default()
            };
            fit(&cfg, vec![]).expect("fit")
        };
        let native = run(&[]);
        let feature = run(&["feature"]);
        let both = run(&["feature", "stem"]);
        assert_eq!(feature.hashes, native.hashes, "{}: replay=feature", precision.name());
        assert_eq!(both.hashes, native.hashes, "{}: replay=feature,stem", precision.name());
        let steps = 20u64;
        for (s, plugin, regions) in [(&feature, "feature", 1), (&both, "feature", 1), (&both, "stem", 18)] {
            let c = s.replay_counters[plugin].as_object().expect("counters");
            assert_eq!(c.len(), regions);
            for (name, st) in c {
                let warm = st["native"]["Warmup"].as_u64().unwrap_or(0);
                let native_total: u64 = st["native"].as_object().map(|m| m.values().filter_map(|v| v.as_u64()).sum()).unwrap_or(0);
                assert_eq!(native_total, warm, "{}: {plugin}/{name} ran natively for another reason: {st}", precision.name());
                assert!(st["replays"].as_u64().unwrap_or(0) >= steps - warm, "{}: {plugin}/{name}: {st}", precision.name());
            }
        }
        println!("ok cuda replay {}: {}", precision.name(), both.plugins.join(" || ").chars().take(300).collect::<String>());
    }
}

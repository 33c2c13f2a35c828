//! Training-batch throughput at 640 px with mosaic from the RAM cache, batch 4.
//!
//! `cargo bench -p ptl-data --bench throughput [-- --train N --batches N]`
//!
//! Generates a synthetic dataset into a temporary folder, opens it (RAM cache), then reports:
//! * per-stage cost of one sample (mosaic, affine warp, HSV, collate) on one thread;
//! * images/s with one thread (batches built in the calling thread) and with all threads (prefetch workers),
//!   also with HSV left to the device (the loader of a CUDA fit);
//! * a simulated 10 ms training step at batch 4: how long the consumer waited for data per step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ptl_data::augment::{self, AffineDraw, AugmentConfig};
use ptl_data::rng::Rng;
use ptl_data::{OpenOptions, PoseDataset, SynthOptions, TrainConfig, TrainLoader};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let train = arg("--train", 96);
    let batches = arg("--batches", 60);
    let imgsz = 640u32;
    let batch = 4usize;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let dir = tempfile::tempdir()?;
    let t0 = Instant::now();
    let st = ptl_data::synth_generate(&SynthOptions {
        out: dir.path().to_path_buf(),
        train,
        background: train * 226 / 512,
        val: 0,
        imgsz,
        seed: 347,
        ..Default::default()
    })?;
    let t_synth = t0.elapsed();
    let t0 = Instant::now();
    let ds = Arc::new(PoseDataset::open_yaml(&st.yaml, "train", &OpenOptions { imgsz, verbose: false, ..Default::default() })?);
    let t_open = t0.elapsed();
    println!(
        "machine: {threads} threads; dataset: {} images ({} background) synthesised in {:.2}s, decoded+resized into RAM in {:.2}s",
        ds.len(),
        ds.report.background,
        t_synth.as_secs_f64(),
        t_open.as_secs_f64()
    );

    // Per-stage cost on one thread.
    let reps = 20;
    let a = AugmentConfig::default();
    let (mut tm, mut tw, mut th, mut tc) = (Duration::ZERO, Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for r in 0..reps {
        let mut rng = Rng::new(r as u64);
        let pick = |rng: &mut Rng| &ds.items[rng.below(ds.len() as u64) as usize];
        let it = [pick(&mut rng), pick(&mut rng), pick(&mut rng), pick(&mut rng)];
        let (yc, xc) = augment::draw_mosaic_centre(&mut rng, imgsz);
        let tiles = [
            (&*it[0].image, &it[0].labels),
            (&*it[1].image, &it[1].labels),
            (&*it[2].image, &it[2].labels),
            (&*it[3].image, &it[3].labels),
        ];
        let t = Instant::now();
        let (canvas, inst) = augment::mosaic4(tiles, 17, imgsz, yc, xc);
        tm += t.elapsed();
        let d = AffineDraw::draw(&mut rng, &a);
        let t = Instant::now();
        let (mut img, _) = augment::random_perspective(&canvas, &inst, &d, imgsz);
        tw += t.elapsed();
        augment::recycle(canvas);
        // The loader's path: the warp composes the canvas rows it reads from the tiles.
        let t = Instant::now();
        let (layout, inst) = augment::mosaic4_layout(tiles, 17, imgsz, yc, xc);
        let (composed, _) = augment::random_perspective(&layout, &inst, &d, imgsz);
        tc += t.elapsed();
        assert_eq!(composed, img, "the composed canvas warps to the stored canvas's bytes");
        let g = ptl_data::HsvGains::draw(&mut rng, a.hsv_h, a.hsv_s, a.hsv_v);
        let t = Instant::now();
        augment::hsv(&mut img, &g);
        th += t.elapsed();
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / reps as f64;
    println!(
        "per sample (1 thread): mosaic canvas {:.2} ms, affine warp {:.2} ms (both: {:.2}; the loader's rows composed from the tiles instead: {:.2} ms), HSV {:.2} ms",
        ms(tm),
        ms(tw),
        ms(tm + tw),
        ms(tc),
        ms(th)
    );

    let cfg = |workers: usize| TrainConfig {
        batch,
        seed: 0,
        epochs: 1000,
        close_mosaic: 0,
        workers,
        prefetch: (2 * workers).max(4),
        ..Default::default()
    };
    let nb = TrainLoader::new(ds.clone(), cfg(0))?.batches_per_epoch();

    // One thread: batches built in the calling thread.
    let ld = Arc::new(TrainLoader::new(ds.clone(), cfg(0))?);
    let n1 = (batches / 3).max(5);
    let t = Instant::now();
    let mut p = ld.prefetch(0);
    for _ in 0..n1 {
        p.next_batch().ok_or("loader ended")??;
    }
    let s1 = t.elapsed().as_secs_f64();
    let ips1 = (n1 * batch) as f64 / s1;
    println!("1 thread: {n1} batches of {batch} at {imgsz}px (mosaic, RAM cache): {:.1} batches/s = {:.0} images/s", n1 as f64 / s1, ips1);
    drop(p);

    // All threads as prefetch workers, with HSV on the CPU and left to the device (what the loader
    // of a CUDA fit does).
    let secs_for = |tcfg: TrainConfig| -> Result<f64, Box<dyn std::error::Error>> {
        let ld = Arc::new(TrainLoader::new(ds.clone(), tcfg)?);
        let mut p = ld.prefetch(0);
        // warm-up: let the pool fill its queue once
        for _ in 0..threads.min(nb) {
            p.next_batch().ok_or("loader ended")??;
        }
        let t = Instant::now();
        for _ in 0..batches {
            p.next_batch().ok_or("loader ended")??;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let sn = secs_for(cfg(threads))?;
    let ipsn = (batches * batch) as f64 / sn;
    println!(
        "{threads} threads: {batches} batches of {batch}: {:.1} batches/s = {:.0} images/s ({:.1}x of 1 thread)",
        batches as f64 / sn,
        ipsn,
        ipsn / ips1
    );
    let sd = secs_for(TrainConfig { hsv_on_device: true, ..cfg(threads) })?;
    println!("{threads} threads, HSV on the device: {:.0} images/s", (batches * batch) as f64 / sd);

    // Simulated training step of 10 ms at batch 4.
    let ld = Arc::new(TrainLoader::new(ds, cfg(threads))?);
    let mut p = ld.prefetch(0);
    p.next_batch().ok_or("loader ended")??;
    std::thread::sleep(Duration::from_millis(200));
    let steps = batches;
    let mut waited = Duration::ZERO;
    let t = Instant::now();
    for _ in 0..steps {
        let w = Instant::now();
        p.next_batch().ok_or("loader ended")??;
        waited += w.elapsed();
        std::thread::sleep(Duration::from_millis(10));
    }
    let total = t.elapsed().as_secs_f64();
    println!(
        "10 ms step, batch {batch}, {threads} workers: {steps} steps in {:.2}s, mean wait for data {:.2} ms/step, {:.0} images/s delivered; {}",
        total,
        waited.as_secs_f64() * 1e3 / steps as f64,
        (steps * batch) as f64 / total,
        if ipsn >= 400.0 { "keeps up (>= 400 images/s)" } else { "does NOT keep up (< 400 images/s)" }
    );
    Ok(())
}

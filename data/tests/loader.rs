//! Batching: layout of docs/data.md §9, determinism (seed, epoch, index; worker count), close-mosaic, validation rect
//! batches, prefetch across epochs, deferred (device) HSV equals CPU HSV.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use ptl_data::loader::rect_shape;
use ptl_data::{apply_hsv_batch_rgb_nchw, Batch, PoseDataset, Shard, TrainConfig, TrainLoader, ValLoader};

const S: u32 = 128;

fn dataset() -> Arc<PoseDataset> {
    static DS: OnceLock<(tempfile::TempDir, Arc<PoseDataset>)> = OnceLock::new();
    DS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let st = small_synth(dir.path(), 14, 4, 5, S, 7);
        let ds = PoseDataset::open_yaml(&st.yaml, "train", &quiet(S)).unwrap();
        (dir, Arc::new(ds))
    })
    .1
    .clone()
}

fn val_dataset() -> Arc<PoseDataset> {
    let ds = dataset();
    let yaml = ds.items[0].im_file.parent().unwrap().parent().unwrap().parent().unwrap().join("data.yaml");
    Arc::new(PoseDataset::open_yaml(&yaml, "val", &quiet(S)).unwrap())
}

fn cfg(workers: usize) -> TrainConfig {
    TrainConfig { batch: 4, seed: 5, epochs: 3, close_mosaic: 1, workers, prefetch: 3, ..Default::default() }
}

fn check_layout(b: &Batch, k: usize) {
    let [bs, c, h, w] = b.shape;
    assert_eq!(c, 3);
    assert_eq!(b.img.len(), bs * 3 * h * w);
    let n = b.num_objects();
    assert_eq!(b.batch_idx.len(), n);
    assert_eq!(b.bboxes.len(), n * 4);
    assert_eq!(b.keypoints.len(), n * k * 3);
    assert!(b.batch_idx.windows(2).all(|p| p[0] <= p[1]));
    assert!(b.batch_idx.iter().all(|&i| (i as usize) < bs));
    for bx in b.bboxes.chunks(4) {
        assert!(bx.iter().all(|v| (0.0..=1.0).contains(v)), "{bx:?}");
        assert!(bx[2] > 0.0 && bx[3] > 0.0);
    }
    for p in b.keypoints.chunks(3) {
        assert!((0.0..=1.0).contains(&p[0]) && (0.0..=1.0).contains(&p[1]), "{p:?}");
        assert!(p[2] == 0.0 || p[2] == 1.0 || p[2] == 2.0);
    }
    for v in [b.im_file.len(), b.ori_shape.len(), b.resized_shape.len(), b.ratio_pad.len(), b.hsv_gains.len()] {
        assert_eq!(v, bs);
    }
}

#[test]
fn train_batches_layout_and_close_mosaic() {
    let ds = dataset();
    let ld = TrainLoader::new(ds.clone(), cfg(0)).unwrap();
    assert_eq!(ld.batches_per_epoch(), 4); // ceil(14 / 4), last partial batch kept
    assert!(ld.mosaic_enabled(0) && ld.mosaic_enabled(1) && !ld.mosaic_enabled(2));
    let mut objects = 0;
    for b in 0..4 {
        let bt = ld.build_batch(0, b).unwrap();
        assert_eq!(bt.shape, [if b == 3 { 2 } else { 4 }, 3, S as usize, S as usize]);
        check_layout(&bt, 17);
        objects += bt.num_objects();
        for i in 0..bt.len() {
            assert_eq!(bt.resized_shape[i], [2 * S, 2 * S]);
            assert!(bt.ratio_pad[i].pad.is_none());
            assert!(bt.hsv_applied);
        }
    }
    assert!(objects > 0);
    // an epoch visits every image once
    let mut seen: Vec<_> = (0..4).flat_map(|b| ld.build_batch(1, b).unwrap().im_file).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 14);
    // close-mosaic epoch: letterboxed single images
    let bt = ld.build_batch(2, 0).unwrap();
    check_layout(&bt, 17);
    for i in 0..bt.len() {
        assert_eq!(bt.resized_shape[i], [S, S]);
        let pad = bt.ratio_pad[i].pad.unwrap();
        let [h0, w0] = bt.ori_shape[i];
        // letterbox of the long-side-resized image into S×S: pad on the short axis only
        if w0 >= h0 {
            assert_eq!(pad[0], 0.0);
        } else {
            assert_eq!(pad[1], 0.0);
        }
    }
    // the order changes per epoch, and is deterministic
    assert_ne!(ld.epoch_order(0), ld.epoch_order(1));
    assert_eq!(ld.epoch_order(1), TrainLoader::new(ds, cfg(0)).unwrap().epoch_order(1));
}

#[test]
fn batches_are_deterministic_and_worker_count_independent() {
    let ds = dataset();
    let a = Arc::new(TrainLoader::new(ds.clone(), cfg(0)).unwrap());
    let b = Arc::new(TrainLoader::new(ds.clone(), cfg(3)).unwrap());
    let one: Vec<Batch> = a.prefetch(0).map(|r| r.unwrap()).collect();
    let many: Vec<Batch> = b.prefetch(0).map(|r| r.unwrap()).collect();
    assert_eq!(one.len(), 12);
    assert_eq!(one, many);
    // the same as building directly, and different with another seed
    assert_eq!(one[5], a.build_batch(1, 1).unwrap());
    let other = TrainLoader::new(ds, TrainConfig { seed: 6, ..cfg(0) }).unwrap();
    assert_ne!(one[0].img, other.build_batch(0, 0).unwrap().img);
}

/// Data-parallel shards: each rank's loader takes every `world`-th sample of the one epoch order
/// (padded from its head), with the same batches per epoch on every rank, and a sample is
/// augmented as it is on one rank (its draws follow (seed, epoch, sample), not the rank).
#[test]
fn shards_split_each_epoch_over_the_ranks() {
    let ds = dataset();
    let n = ds.len();
    let whole = TrainLoader::new(ds.clone(), cfg(0)).unwrap();
    for world in [2usize, 3] {
        let ranks: Vec<TrainLoader> =
            (0..world).map(|rank| TrainLoader::new(ds.clone(), TrainConfig { shard: Shard { rank, world }, ..cfg(0) }).unwrap()).collect();
        for epoch in 0..2 {
            let order = whole.epoch_order(epoch);
            let shares: Vec<Vec<usize>> = ranks.iter().map(|l| l.epoch_order(epoch)).collect();
            let per_rank = n.div_ceil(world);
            for (rank, share) in shares.iter().enumerate() {
                assert_eq!(share.len(), per_rank, "world {world} rank {rank}");
                for (k, &i) in share.iter().enumerate() {
                    assert_eq!(i, order[(rank + k * world) % n], "world {world} rank {rank} position {k}");
                }
            }
            let mut all: Vec<usize> = shares.concat();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), n, "every sample is taken (world {world})");
        }
        let nb: Vec<usize> = ranks.iter().map(TrainLoader::batches_per_epoch).collect();
        assert!(nb.iter().all(|&b| b == n.div_ceil(world).div_ceil(4)), "{nb:?}");
        // Rank 1's first batch holds the samples the whole epoch's loader builds for them.
        let first = ranks[1].build_batch(0, 0).unwrap();
        let share = ranks[1].epoch_order(0);
        assert_eq!(first.shape[0], 4);
        let alone = TrainLoader::new(ds.clone(), TrainConfig { batch: 1, shuffle: false, ..cfg(0) }).unwrap();
        let plane = first.img.len() / 4;
        for (k, &i) in share[..4].iter().enumerate() {
            let one = alone.build_batch(0, i).unwrap();
            assert_eq!(&first.img[k * plane..(k + 1) * plane], &one.img[..], "sample {i} as on one rank");
        }
    }
    for bad in [Shard { rank: 2, world: 2 }, Shard { rank: 0, world: 0 }] {
        let e = TrainLoader::new(ds.clone(), TrainConfig { shard: bad, ..cfg(0) }).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
    }
}

#[test]
fn prefetch_epochs_resume_and_drop() {
    let ds = dataset();
    let ld = Arc::new(TrainLoader::new(ds, cfg(2)).unwrap());
    let mut p = ld.prefetch(1);
    assert_eq!(p.current_epoch(), 1);
    let e1: Vec<Batch> = p.epoch().map(|r| r.unwrap()).collect();
    assert_eq!(e1.len(), 4);
    assert!(e1.iter().all(|b| b.epoch == 1));
    assert_eq!(p.current_epoch(), 2);
    // ... validation would run here while workers already build epoch 2 ...
    let first = p.next_batch().unwrap().unwrap();
    assert_eq!((first.epoch, first.index), (2, 0));
    drop(p); // joins workers mid-epoch
    let mut p = ld.prefetch(2);
    assert_eq!(p.epoch().count(), 4);
    assert!(p.next_batch().is_none());
}

#[test]
fn device_hsv_deferral_gives_identical_bytes() {
    let ds = dataset();
    let cpu = TrainLoader::new(ds.clone(), cfg(0)).unwrap();
    let dev = TrainLoader::new(ds, TrainConfig { hsv_on_device: true, ..cfg(0) }).unwrap();
    for (e, b) in [(0, 0), (0, 3), (2, 1)] {
        let want = cpu.build_batch(e, b).unwrap();
        let mut got = dev.build_batch(e, b).unwrap();
        assert!(!got.hsv_applied);
        assert_eq!(got.hsv_gains, want.hsv_gains);
        assert!(got.hsv_gains.iter().all(|g| g.h.abs() <= 0.015 && g.s.abs() <= 0.7 && g.v.abs() <= 0.4));
        assert_ne!(got.img, want.img);
        let [_, _, h, w] = got.shape;
        let gains = got.hsv_gains.clone();
        apply_hsv_batch_rgb_nchw(&mut got.img, h, w, &gains);
        assert_eq!(got.img, want.img);
        assert_eq!(got.bboxes, want.bboxes);
    }
}

#[test]
fn validation_rect_batches_and_letterbox() {
    let ds = val_dataset();
    let vl = ValLoader::new(ds.clone(), 2, 0).unwrap();
    assert_eq!(vl.len(), 3);
    let mut total = 0;
    let mut prev_ar = 0.0f64;
    for (bi, b) in vl.iter().enumerate() {
        let b = b.unwrap();
        check_layout(&b, 17);
        let (hb, wb) = vl.batch_shape(bi).unwrap();
        assert_eq!(b.shape[2..], [hb as usize, wb as usize]);
        let ars: Vec<f64> = b.ori_shape.iter().map(|s| s[0] as f64 / s[1] as f64).collect();
        assert!(ars[0] >= prev_ar);
        prev_ar = *ars.last().unwrap();
        let amin = ars.iter().cloned().fold(f64::INFINITY, f64::min);
        let amax = ars.iter().cloned().fold(0.0, f64::max);
        assert_eq!((hb, wb), rect_shape(amin, amax, S));
        for i in 0..b.len() {
            assert_eq!(b.resized_shape[i], [hb, wb]);
            let rp = b.ratio_pad[i];
            let [h0, w0] = b.ori_shape[i];
            // map back: the image content spans (w0·gain_w, h0·gain_h) centred with the pad
            let pad = rp.pad.unwrap();
            let cw = (w0 as f32 * rp.ratio[1]).round();
            let ch = (h0 as f32 * rp.ratio[0]).round();
            assert!((pad[0] * 2.0 + cw - wb as f32).abs() <= 1.0);
            assert!((pad[1] * 2.0 + ch - hb as f32).abs() <= 1.0);
            // padding value 114 at the corner when there is padding
            if pad[0] > 0.0 || pad[1] > 0.0 {
                let plane = (hb * wb) as usize;
                assert_eq!(b.img[i * 3 * plane], 114);
            }
        }
        total += b.len();
    }
    assert_eq!(total, 5);
}

#[test]
fn worker_failure_is_reported_and_pool_shuts_down() {
    let ds = dataset();
    for workers in [0, 3] {
        let ld = Arc::new(TrainLoader::new(ds.clone(), TrainConfig { inject_panic_at: Some((0, 2)), ..cfg(workers) }).unwrap());
        let mut p = ld.prefetch(0);
        assert!(p.next_batch().unwrap().is_ok());
        assert!(p.next_batch().unwrap().is_ok());
        let e = p.next_batch().unwrap().unwrap_err();
        assert!(matches!(e, ptl_data::DataError::Worker(_)), "{e}");
        assert!(e.to_string().contains("epoch 0 batch 2"), "{e}");
        assert!(p.next_batch().is_none());
        drop(p);
    }
}

//! Debug view: draws boxes and keypoints of raw labels and of augmented training samples into PNG files.
//! `cargo run -p ptl-data --release --example overlay -- DATA.yaml OUT_DIR [N]`

use std::path::PathBuf;
use std::sync::Arc;

use ptl_data::image::{write_png, Image};
use ptl_data::{OpenOptions, PoseDataset, TrainConfig, TrainLoader};

fn dot(img: &mut Image, x: f32, y: f32, col: [u8; 3], r: i32) {
    for dy in -r..=r {
        for dx in -r..=r {
            let (px, py) = (x as i32 + dx, y as i32 + dy);
            if px >= 0 && py >= 0 && (px as u32) < img.w && (py as u32) < img.h {
                let i = ((py as u32 * img.w + px as u32) * 3) as usize;
                img.data[i..i + 3].copy_from_slice(&col);
            }
        }
    }
}

fn rect(img: &mut Image, b: [f32; 4], col: [u8; 3]) {
    let steps = 400;
    for s in 0..=steps {
        let t = s as f32 / steps as f32;
        let x = b[0] + (b[2] - b[0]) * t;
        let y = b[1] + (b[3] - b[1]) * t;
        dot(img, x, b[1], col, 0);
        dot(img, x, b[3], col, 0);
        dot(img, b[0], y, col, 0);
        dot(img, b[2], y, col, 0);
    }
}

fn draw(img: &mut Image, boxes: &[f32], kpts: &[f32], w: f32, h: f32) {
    for (bx, kp) in boxes.chunks(4).zip(kpts.chunks(51)) {
        rect(
            img,
            [(bx[0] - bx[2] / 2.0) * w, (bx[1] - bx[3] / 2.0) * h, (bx[0] + bx[2] / 2.0) * w, (bx[1] + bx[3] / 2.0) * h],
            [0, 255, 0],
        );
        for (j, p) in kp.chunks(3).enumerate() {
            let col = match p[2] as i32 {
                2 => {
                    if j % 2 == 1 && j > 0 {
                        [255, 0, 0]
                    } else {
                        [0, 0, 255]
                    }
                }
                1 => [0, 255, 255],
                _ => continue,
            };
            dot(img, p[0] * w, p[1] * h, col, 2);
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let yaml = PathBuf::from(args.get(1).ok_or("usage: overlay DATA.yaml OUT_DIR [N]")?);
    let out = PathBuf::from(args.get(2).ok_or("usage: overlay DATA.yaml OUT_DIR [N]")?);
    let n: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(4);
    std::fs::create_dir_all(&out)?;
    let ds = Arc::new(PoseDataset::open_yaml(&yaml, "train", &OpenOptions::default())?);
    for (shown, it) in ds.items.iter().filter(|i| !i.labels.is_empty()).take(n).enumerate() {
        let mut img = (*it.image).clone();
        let flat: Vec<f32> = it.labels.boxes.iter().flatten().copied().collect();
        let (iw, ih) = (img.w as f32, img.h as f32);
        draw(&mut img, &flat, &it.labels.kpts, iw, ih);
        write_png(&img, &out.join(format!("raw_{shown}.png")))?;
    }
    let ld = TrainLoader::new(ds, TrainConfig { batch: n, workers: 0, epochs: 100, ..Default::default() })?;
    let b = ld.build_batch(0, 0)?;
    let [bs, _, h, w] = b.shape;
    for i in 0..bs {
        let plane = h * w;
        let mut img = Image::filled(w as u32, h as u32, [0, 0, 0]);
        for p in 0..plane {
            for c in 0..3 {
                img.data[p * 3 + (2 - c)] = b.img[i * 3 * plane + c * plane + p];
            }
        }
        let sel: Vec<usize> = (0..b.num_objects()).filter(|&j| b.batch_idx[j] as usize == i).collect();
        let boxes: Vec<f32> = sel.iter().flat_map(|&j| b.bboxes[j * 4..j * 4 + 4].to_vec()).collect();
        let kpts: Vec<f32> = sel.iter().flat_map(|&j| b.keypoints[j * 51..j * 51 + 51].to_vec()).collect();
        draw(&mut img, &boxes, &kpts, w as f32, h as f32);
        write_png(&img, &out.join(format!("aug_{i}.png")))?;
    }
    Ok(())
}

#![allow(dead_code)]
use std::path::{Path, PathBuf};

use ptl_data::image::{write_jpeg, write_png, Image};
use ptl_data::{synth_generate, OpenOptions, SynthOptions, SynthStats};

pub fn quiet(imgsz: u32) -> OpenOptions {
    OpenOptions { imgsz, verbose: false, ..Default::default() }
}

pub fn small_synth(dir: &Path, train: usize, bg: usize, val: usize, imgsz: u32, seed: u64) -> SynthStats {
    synth_generate(&SynthOptions {
        out: dir.to_path_buf(),
        train,
        background: bg,
        val,
        imgsz,
        seed,
        jpeg_quality: 90,
        threads: 2,
        classes: 1,
    })
    .expect("synth")
}

/// A valid label row with 17 keypoints.
pub fn row(shift: f32) -> String {
    let mut v = vec![0.0f32, 0.5 + shift, 0.5, 0.3, 0.6];
    for j in 0..17 {
        v.extend_from_slice(&[0.35 + 0.015 * j as f32 + shift, 0.3 + 0.02 * j as f32, 2.0]);
    }
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ")
}

pub fn gradient(w: u32, h: u32, seed: u8) -> Image {
    let mut img = Image::filled(w, h, [0, 0, 0]);
    for y in 0..h {
        for x in 0..w {
            let i = ((y * w + x) * 3) as usize;
            img.data[i] = (x * 255 / w) as u8;
            img.data[i + 1] = (y * 255 / h) as u8;
            img.data[i + 2] = seed.wrapping_mul(37);
        }
    }
    img
}

/// Hand-made Ultralytics-layout dataset: returns the yaml path.
pub struct Layout {
    pub root: PathBuf,
}

impl Layout {
    pub fn new(root: &Path) -> Self {
        for d in ["images/train", "labels/train", "images/val", "labels/val"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let yaml = format!(
            "path: {}\ntrain: images/train\nval: images/val\nkpt_shape: [17, 3]\n\
             flip_idx: [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]\nnames:\n  0: person\n",
            root.display()
        );
        std::fs::write(root.join("data.yaml"), yaml).unwrap();
        Layout { root: root.to_path_buf() }
    }

    pub fn yaml(&self) -> PathBuf {
        self.root.join("data.yaml")
    }

    pub fn image(&self, split: &str, name: &str, w: u32, h: u32, seed: u8) -> PathBuf {
        let p = self.root.join("images").join(split).join(name);
        let img = gradient(w, h, seed);
        if name.ends_with(".png") {
            write_png(&img, &p).unwrap();
        } else {
            write_jpeg(&img, &p, 90).unwrap();
        }
        p
    }

    pub fn label(&self, split: &str, stem: &str, text: &str) -> PathBuf {
        let p = self.root.join("labels").join(split).join(format!("{stem}.txt"));
        std::fs::write(&p, text).unwrap();
        p
    }
}

//! Synthetic pose dataset generator (`ptl data synth`): articulated figures with COCO keypoints on cluttered
//! backgrounds, written in the Ultralytics layout (JPEG images, txt labels, data.yaml) so that Ultralytics can train
//! on the same folder. Deterministic for a seed: every image has its own generator derived from
//! (seed, split, index), so the thread count does not change any byte.
//!
//! Modelled on `gen_pose_dataset.py` of the reference tooling (same figure proportions, size list, visibility
//! rules), drawn with our own rasteriser.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::config::COCO_FLIP_IDX;
use crate::error::{DataError, Result};
use crate::image::{resize_bilinear, write_jpeg, Image};
use crate::rng::{stream, Rng};

/// Options of the generator (CLI defaults: 512 train of which 226 background, 15 val, 640 px, seed 347).
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// The folder the dataset is written into.
    pub out: PathBuf,
    /// Training images in total (including the background ones).
    pub train: usize,
    /// Person-free training images.
    pub background: usize,
    /// Validation images.
    pub val: usize,
    /// Long side of the largest image size (sizes scale with imgsz / 640).
    pub imgsz: u32,
    /// Seed of every drawing (the same options write the same bytes).
    pub seed: u64,
    /// JPEG quality of the images written as JPEG (1–100).
    pub jpeg_quality: u8,
    /// 0 = all cores.
    pub threads: usize,
    /// Classes of the labels (1: everyone is `person`). With more, the people of image i get
    /// classes (i + j) mod classes in label order, named `person`, `person1`, …: labels only —
    /// the classes look alike — for trying multi-class training and its tools.
    pub classes: usize,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            out: PathBuf::from("synth-pose"),
            train: 512,
            background: 226,
            val: 15,
            imgsz: 640,
            seed: 347,
            jpeg_quality: 90,
            threads: 0,
            classes: 1,
        }
    }
}

/// Largest `imgsz` of a synthetic dataset (a 4096 px image is 48 MiB of pixels per thread).
pub const MAX_SYNTH_IMGSZ: u32 = 4096;
/// Most images of one synthetic split.
pub const MAX_SYNTH_IMAGES: usize = 1_000_000;

/// What was written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SynthStats {
    /// Training images written.
    pub train_images: usize,
    /// Of them, without people.
    pub train_background: usize,
    /// People in the training labels.
    pub train_instances: usize,
    /// Validation images written.
    pub val_images: usize,
    /// People in the validation labels.
    pub val_instances: usize,
    /// Keypoints with visibility 0, 1, 2 over all labels.
    pub visibility: [usize; 3],
    /// The dataset yaml written.
    pub yaml: PathBuf,
}

const SIZES: [(u32, u32); 8] = [(640, 480), (480, 640), (640, 427), (427, 640), (640, 640), (500, 375), (612, 612), (640, 360)];

const LIMBS: [(usize, usize); 10] = [(5, 7), (7, 9), (6, 8), (8, 10), (11, 13), (13, 15), (12, 14), (14, 16), (5, 6), (11, 12)];

/// Canvas with a per-pixel owner map (0 = background, −1 = occluder, p > 0 = person p).
struct Canvas {
    img: Image,
    id: Vec<i32>,
}

impl Canvas {
    fn w(&self) -> i64 {
        self.img.w as i64
    }
    fn h(&self) -> i64 {
        self.img.h as i64
    }

    #[inline]
    fn put(&mut self, x: i64, y: i64, col: Option<[u8; 3]>, id: Option<i32>) {
        if x < 0 || y < 0 || x >= self.w() || y >= self.h() {
            return;
        }
        let i = (y * self.w() + x) as usize;
        if let Some(c) = col {
            self.img.data[i * 3..i * 3 + 3].copy_from_slice(&c);
        }
        if let Some(id) = id {
            self.id[i] = id;
        }
    }

    /// Filled rectangle with inclusive corners (cv2.rectangle, thickness −1).
    fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, col: Option<[u8; 3]>, id: Option<i32>) {
        let (xa, xb) = (x0.min(x1).max(0), x0.max(x1).min(self.w() - 1));
        let (ya, yb) = (y0.min(y1).max(0), y0.max(y1).min(self.h() - 1));
        for y in ya..=yb {
            for x in xa..=xb {
                self.put(x, y, col, id);
            }
        }
    }

    fn circle(&mut self, cx: f64, cy: f64, r: f64, col: Option<[u8; 3]>, id: Option<i32>) {
        let r2 = r * r;
        let (xa, xb) = ((cx - r).floor() as i64, (cx + r).ceil() as i64);
        let (ya, yb) = ((cy - r).floor() as i64, (cy + r).ceil() as i64);
        for y in ya.max(0)..=yb.min(self.h() - 1) {
            for x in xa.max(0)..=xb.min(self.w() - 1) {
                let (dx, dy) = (x as f64 - cx, y as f64 - cy);
                if dx * dx + dy * dy <= r2 {
                    self.put(x, y, col, id);
                }
            }
        }
    }

    /// Thick segment (capsule of width `t`).
    fn line(&mut self, a: (f64, f64), b: (f64, f64), t: f64, col: Option<[u8; 3]>, id: Option<i32>) {
        let r = (t / 2.0).max(0.5);
        let (xa, xb) = ((a.0.min(b.0) - r).floor() as i64, (a.0.max(b.0) + r).ceil() as i64);
        let (ya, yb) = ((a.1.min(b.1) - r).floor() as i64, (a.1.max(b.1) + r).ceil() as i64);
        let (dx, dy) = (b.0 - a.0, b.1 - a.1);
        let len2 = dx * dx + dy * dy;
        for y in ya.max(0)..=yb.min(self.h() - 1) {
            for x in xa.max(0)..=xb.min(self.w() - 1) {
                let (px, py) = (x as f64 - a.0, y as f64 - a.1);
                let t = if len2 > 0.0 { ((px * dx + py * dy) / len2).clamp(0.0, 1.0) } else { 0.0 };
                let (ex, ey) = (px - t * dx, py - t * dy);
                if ex * ex + ey * ey <= r * r {
                    self.put(x, y, col, id);
                }
            }
        }
    }

    /// Filled polygon (even–odd rule, pixel centres).
    fn poly(&mut self, pts: &[(f64, f64)], col: Option<[u8; 3]>, id: Option<i32>) {
        let xa = pts.iter().map(|p| p.0).fold(f64::INFINITY, f64::min).floor() as i64;
        let xb = pts.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max).ceil() as i64;
        let ya = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min).floor() as i64;
        let yb = pts.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max).ceil() as i64;
        for y in ya.max(0)..=yb.min(self.h() - 1) {
            let yf = y as f64;
            let mut xs: Vec<f64> = Vec::new();
            for i in 0..pts.len() {
                let (p, q) = (pts[i], pts[(i + 1) % pts.len()]);
                if (p.1 <= yf && q.1 > yf) || (q.1 <= yf && p.1 > yf) {
                    xs.push(p.0 + (yf - p.1) / (q.1 - p.1) * (q.0 - p.0));
                }
            }
            xs.sort_by(f64::total_cmp);
            for pair in xs.chunks_exact(2) {
                let x0 = pair[0].round() as i64;
                let x1 = pair[1].round() as i64;
                for x in x0.max(xa).max(0)..=x1.min(xb).min(self.w() - 1) {
                    self.put(x, y, col, id);
                }
            }
        }
    }
}

fn rand_col(rng: &mut Rng, lo: u64) -> [u8; 3] {
    [(lo + rng.below(256 - lo)) as u8, (lo + rng.below(256 - lo)) as u8, (lo + rng.below(256 - lo)) as u8]
}

/// Fast approximately-normal noise (Irwin–Hall of 4 uniforms, unit variance).
#[inline]
fn approx_normal(rng: &mut Rng) -> f32 {
    let v = rng.next_u64();
    let s = (v & 0xFFFF) + ((v >> 16) & 0xFFFF) + ((v >> 32) & 0xFFFF) + (v >> 48);
    (s as f32 / 65535.0 - 2.0) * 1.732_050_8
}

fn background(rng: &mut Rng, w: u32, h: u32) -> Canvas {
    let kind = rng.below(3);
    let c0 = [rng.below(256) as f32, rng.below(256) as f32, rng.below(256) as f32];
    let c1 = [rng.below(256) as f32, rng.below(256) as f32, rng.below(256) as f32];
    let mut img = Image::filled(w, h, [0, 0, 0]);
    match kind {
        0 | 1 => {
            for y in 0..h {
                for x in 0..w {
                    let t = if kind == 0 { y as f32 / (h - 1).max(1) as f32 } else { x as f32 / (w - 1).max(1) as f32 };
                    let i = ((y * w + x) * 3) as usize;
                    for c in 0..3 {
                        img.data[i + c] = (c0[c] * (1.0 - t) + c1[c] * t).clamp(0.0, 255.0) as u8;
                    }
                }
            }
        }
        _ => {
            let sw = (w / 80).max(2);
            let sh = (h / 80).max(2);
            let data = (0..sw * sh * 3).map(|_| rng.below(256) as u8).collect();
            img = resize_bilinear(&Image { w: sw, h: sh, data }, w, h);
        }
    }
    let mut cv = Canvas { img, id: vec![0; (w * h) as usize] };
    let (wi, hi) = (w as i64, h as i64);
    for _ in 0..rng.randint(3, 11) {
        let col = rand_col(rng, 0);
        let shape = rng.below(3);
        let x = rng.randint(0, wi - 1);
        let y = rng.randint(0, hi - 1);
        match shape {
            0 => {
                let x1 = x + rng.randint(10, (wi / 2).max(11) - 1);
                let y1 = y + rng.randint(10, (hi / 2).max(11) - 1);
                cv.rect(x, y, x1, y1, Some(col), None);
            }
            1 => {
                let r = rng.randint(5, (wi.min(hi) / 4).max(6) - 1);
                cv.circle(x as f64, y as f64, r as f64, Some(col), None);
            }
            _ => {
                let x2 = rng.randint(0, wi - 1);
                let y2 = rng.randint(0, hi - 1);
                let t = rng.randint(1, 7);
                cv.line((x as f64, y as f64), (x2 as f64, y2 as f64), t as f64, Some(col), None);
            }
        }
    }
    let sigma = rng.uniform(2.0, 14.0) as f32;
    for v in cv.img.data.iter_mut() {
        *v = (*v as f32 + approx_normal(rng) * sigma).round().clamp(0.0, 255.0) as u8;
    }
    cv.img = blur3(&cv.img);
    cv
}

/// 3×3 Gaussian blur ([1 2 1]/4 separable, edges replicated).
fn blur3(img: &Image) -> Image {
    let (w, h) = (img.w as usize, img.h as usize);
    let mut tmp = vec![0u16; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let xl = x.saturating_sub(1);
            let xr = (x + 1).min(w - 1);
            for c in 0..3 {
                let g = |xx: usize| img.data[(y * w + xx) * 3 + c] as u16;
                tmp[(y * w + x) * 3 + c] = g(xl) + 2 * g(x) + g(xr);
            }
        }
    }
    let mut out = vec![0u8; w * h * 3];
    for y in 0..h {
        let yu = y.saturating_sub(1);
        let yd = (y + 1).min(h - 1);
        for x in 0..w {
            for c in 0..3 {
                let g = |yy: usize| tmp[(yy * w + x) * 3 + c] as u32;
                out[(y * w + x) * 3 + c] = ((g(yu) + 2 * g(y) + g(yd) + 8) / 16) as u8;
            }
        }
    }
    Image { w: img.w, h: img.h, data: out }
}

type Pt = (f64, f64);

fn add(a: Pt, b: Pt) -> Pt {
    (a.0 + b.0, a.1 + b.1)
}

fn mul(a: Pt, s: f64) -> Pt {
    (a.0 * s, a.1 * s)
}

/// Keypoints (COCO order), head centre and head radius of a figure `height` px tall centred at (cx, cy).
fn skeleton(rng: &mut Rng, cx: f64, cy: f64, height: f64, front: bool) -> ([Pt; 17], Pt, f64) {
    let u = height / 8.0;
    let lean = rng.uniform(-0.25, 0.25);
    let neck = (cx, cy - 2.2 * u);
    let pelvis = add(neck, mul((lean.sin(), lean.cos()), 3.0 * u));
    let sw = rng.uniform(0.8, 1.1) * u;
    let hw = rng.uniform(0.5, 0.75) * u;
    let side = if front { 1.0 } else { -1.0 };
    let perp = (lean.cos(), -lean.sin());
    let mut k = [(0.0, 0.0); 17];
    k[5] = add(neck, mul(perp, side * sw));
    k[6] = add(neck, mul(perp, -side * sw));
    k[11] = add(pelvis, mul(perp, side * hw));
    k[12] = add(pelvis, mul(perp, -side * hw));
    let r = rng.uniform(0.42, 0.55) * u;
    let head = add(neck, (lean.sin() * u, -u));
    let yaw = rng.uniform(-0.6, 0.6);
    k[0] = add(head, (side * yaw * 0.5 * r, 0.15 * r));
    k[1] = add(head, (side * (0.38 + yaw * 0.3) * r, -0.2 * r));
    k[2] = add(head, (side * (-0.38 + yaw * 0.3) * r, -0.2 * r));
    k[3] = add(head, (side * 0.95 * r, 0.0));
    k[4] = add(head, (-side * 0.95 * r, 0.0));
    let chain = |root: Pt, a1: f64, a2: f64, l1: f64, l2: f64| {
        let j1 = add(root, mul((a1.sin(), a1.cos()), l1));
        let j2 = add(j1, mul((a2.sin(), a2.cos()), l2));
        (j1, j2)
    };
    for (sh, el, wr, sgn) in [(5, 7, 9, side), (6, 8, 10, -side)] {
        let a1 = sgn * rng.uniform(-0.4, 2.6);
        let a2 = a1 + sgn * rng.uniform(-0.3, 2.0);
        let (j1, j2) = chain(k[sh], a1, a2, 1.45 * u, 1.3 * u);
        k[el] = j1;
        k[wr] = j2;
    }
    for (hp, kn, an, sgn) in [(11, 13, 15, side), (12, 14, 16, -side)] {
        let a1 = sgn * rng.uniform(-0.25, 0.9);
        let a2 = a1 - sgn * rng.uniform(0.0, 1.2);
        let (j1, j2) = chain(k[hp], a1, a2, 1.9 * u, 1.8 * u);
        k[kn] = j1;
        k[an] = j2;
    }
    (k, head, r)
}

fn draw_person(cv: &mut Canvas, pid: i32, rng: &mut Rng, kp: &[Pt; 17], head: Pt, r: f64, height: f64) {
    let skin = rand_col(rng, 60);
    let top = rand_col(rng, 0);
    let leg = rand_col(rng, 0);
    let th = ((height / 8.0 * rng.uniform(0.28, 0.42)) as i64).max(2) as f64;
    let p: Vec<Pt> = kp.iter().map(|q| (q.0.round(), q.1.round())).collect();
    for (a, b) in LIMBS {
        let col = if a >= 11 { leg } else { top };
        cv.line(p[a], p[b], th, Some(col), Some(pid));
    }
    cv.poly(&[p[5], p[6], p[12], p[11]], Some(top), Some(pid));
    let neck = (((p[5].0 + p[6].0) / 2.0).floor(), ((p[5].1 + p[6].1) / 2.0).floor());
    cv.line(neck, (head.0.round(), head.1.round()), (th / 2.0).floor().max(2.0), Some(skin), Some(pid));
    cv.circle(head.0.round(), head.1.round(), r.round(), Some(skin), Some(pid));
    for j in [1, 2] {
        cv.circle(p[j].0, p[j].1, (r * 0.12).floor().max(1.0), Some([20, 20, 20]), None);
    }
}

/// One image: pixels and label rows (cls, cx, cy, w, h, then 17 × (x, y, v), normalised).
fn make_image(rng: &mut Rng, with_people: bool, imgsz: u32) -> (Image, Vec<Vec<f64>>) {
    let (bw, bh) = SIZES[rng.below(SIZES.len() as u64) as usize];
    let scale = imgsz as f64 / 640.0;
    let w = ((bw as f64 * scale).round() as u32).max(32);
    let h = ((bh as f64 * scale).round() as u32).max(32);
    let mut cv = background(rng, w, h);
    let mut labels = Vec::new();
    if !with_people {
        return (cv.img, labels);
    }
    let n = rng.randint(1, 3);
    let (wf, hf) = (w as f64, h as f64);
    let mut people = Vec::new();
    for pid in 1..=n as i32 {
        let height = rng.uniform(0.3, 0.95) * hf;
        let cx = rng.uniform(0.1, 0.9) * wf;
        let cy = rng.uniform(0.35, 0.75) * hf;
        let front = rng.random() < 0.75;
        let (kp, head, r) = skeleton(rng, cx, cy, height, front);
        draw_person(&mut cv, pid, rng, &kp, head, r, height);
        people.push((pid, kp, front));
    }
    for _ in 0..rng.randint(0, 2) {
        if rng.random() < 0.5 {
            let x0 = rng.randint(0, w as i64 - 1);
            let y0 = rng.randint(0, h as i64 - 1);
            let x1 = x0 + rng.randint(20, (w as i64 / 3).max(21) - 1);
            let y1 = y0 + rng.randint(20, (h as i64 / 3).max(21) - 1);
            let col = rand_col(rng, 0);
            cv.rect(x0, y0, x1, y1, Some(col), Some(-1));
        }
    }
    for (pid, kp, front) in people {
        let (mut x0, mut y0, mut x1, mut y1, mut count) = (i64::MAX, i64::MAX, i64::MIN, i64::MIN, 0usize);
        for y in 0..h as i64 {
            for x in 0..w as i64 {
                if cv.id[(y * w as i64 + x) as usize] == pid {
                    x0 = x0.min(x);
                    x1 = x1.max(x + 1);
                    y0 = y0.min(y);
                    y1 = y1.max(y + 1);
                    count += 1;
                }
            }
        }
        if count < 50 || x1 - x0 < 8 || y1 - y0 < 8 {
            continue;
        }
        let mut kpt = [[0.0f64; 3]; 17];
        for (j, &(x, y)) in kp.iter().enumerate() {
            if !(x >= 0.0 && x < wf && y >= 0.0 && y < hf) {
                continue;
            }
            if !front && j <= 2 {
                continue;
            }
            let (xi, yi) = (x as usize, y as usize);
            let vis = if cv.id[yi * w as usize + xi] == pid { 2.0 } else { 1.0 };
            kpt[j] = [x / wf, y / hf, vis];
        }
        if kpt.iter().all(|p| p[2] == 0.0) {
            continue;
        }
        let mut row = vec![0.0, (x0 + x1) as f64 / 2.0 / wf, (y0 + y1) as f64 / 2.0 / hf, (x1 - x0) as f64 / wf, (y1 - y0) as f64 / hf];
        for p in kpt {
            row.extend_from_slice(&p);
        }
        labels.push(row);
    }
    (cv.img, labels)
}

fn label_text(rows: &[Vec<f64>]) -> String {
    let mut s = String::new();
    for r in rows {
        s.push_str(&(r[0] as i64).to_string());
        for v in &r[1..5] {
            s.push_str(&format!(" {v:.6}"));
        }
        for p in r[5..].chunks(3) {
            s.push_str(&format!(" {:.6} {:.6} {}", p[0], p[1], p[2] as i64));
        }
        s.push('\n');
    }
    s
}

struct Written {
    background: bool,
    instances: usize,
    vis: [usize; 3],
}

fn write_split(root: &Path, split: &str, split_id: u64, n: usize, n_bg: usize, o: &SynthOptions) -> Result<Vec<Written>> {
    let idir = root.join("images").join(split);
    let ldir = root.join("labels").join(split);
    for d in [&idir, &ldir] {
        std::fs::create_dir_all(d).map_err(|e| DataError::io(d, e))?;
    }
    let mut order: Vec<usize> = (0..n).collect();
    Rng::for_sample(stream::SYNTH, o.seed, split_id, u64::MAX).shuffle(&mut order);
    let mut is_bg = vec![false; n];
    for &i in order.iter().take(n_bg) {
        is_bg[i] = true;
    }
    (0..n)
        .into_par_iter()
        .map(|i| {
            let mut rng = Rng::for_sample(stream::SYNTH, o.seed, split_id, i as u64);
            let with_people = !is_bg[i];
            let (mut img, mut labels) = make_image(&mut rng, with_people, o.imgsz);
            let mut tries = 0;
            while with_people && labels.is_empty() && tries < 10 {
                let r = make_image(&mut rng, true, o.imgsz);
                img = r.0;
                labels = r.1;
                tries += 1;
            }
            for (j, r) in labels.iter_mut().enumerate() {
                r[0] = ((i + j) % o.classes.max(1)) as f64;
            }
            let name = format!("{split}_{i:06}");
            write_jpeg(&img, &idir.join(format!("{name}.jpg")), o.jpeg_quality)?;
            let lp = ldir.join(format!("{name}.txt"));
            std::fs::write(&lp, label_text(&labels)).map_err(|e| DataError::io(&lp, e))?;
            let mut vis = [0usize; 3];
            for r in &labels {
                for p in r[5..].chunks(3) {
                    vis[(p[2] as usize).min(2)] += 1;
                }
            }
            Ok(Written { background: labels.is_empty(), instances: labels.len(), vis })
        })
        .collect()
}

fn header_line(o: &SynthOptions, bg: usize) -> String {
    let classes = if o.classes > 1 { format!(", {} classes", o.classes) } else { String::new() };
    format!(
        "# ptl synthetic pose dataset (seed {}, imgsz {}): {} train ({} background), {} val{classes}",
        o.seed, o.imgsz, o.train, bg, o.val
    )
}

/// Returns `out/data.yaml` if a dataset generated with the same options is already there (its header line matches),
/// otherwise generates it. Used for the embedded default dataset of `ptl train`.
pub fn ensure(opts: &SynthOptions) -> Result<PathBuf> {
    let yp = opts.out.join("data.yaml");
    if let Ok(text) = ptl_files::read_to_string(&yp) {
        if text.lines().next() == Some(header_line(opts, opts.background).as_str()) {
            return Ok(yp);
        }
    }
    Ok(generate(opts)?.yaml)
}

/// Writes the dataset and `data.yaml` under `opts.out`.
pub fn generate(opts: &SynthOptions) -> Result<SynthStats> {
    if opts.background > opts.train {
        return Err(DataError::Invalid(format!(
            "--background {} exceeds --train {} (background images are part of the training images)",
            opts.background, opts.train
        )));
    }
    if opts.imgsz < 64 || opts.imgsz > MAX_SYNTH_IMGSZ {
        return Err(DataError::Invalid(format!("--imgsz {} is outside 64..={MAX_SYNTH_IMGSZ}", opts.imgsz)));
    }
    for (flag, n) in [("--train", opts.train), ("--val", opts.val)] {
        if n > MAX_SYNTH_IMAGES {
            return Err(DataError::Invalid(format!("{flag} {n} is more than the {MAX_SYNTH_IMAGES} images a synthetic split may have")));
        }
    }
    crate::check_threads("--threads", opts.threads)?;
    if !(1..=crate::config::MAX_CLASSES).contains(&opts.classes) {
        return Err(DataError::Invalid(format!("--classes {} is outside 1..={}", opts.classes, crate::config::MAX_CLASSES)));
    }
    if opts.train == 0 && opts.val == 0 {
        return Err(DataError::Invalid("nothing to generate (--train and --val are 0)".into()));
    }
    std::fs::create_dir_all(&opts.out).map_err(|e| DataError::io(&opts.out, e))?;
    let root = std::fs::canonicalize(&opts.out).map_err(|e| DataError::io(&opts.out, e))?;
    let run = || -> Result<(Vec<Written>, Vec<Written>)> {
        let tr = write_split(&root, "train", 0, opts.train, opts.background, opts)?;
        let va = write_split(&root, "val", 1, opts.val, 0, opts)?;
        Ok((tr, va))
    };
    let (tr, va) = if opts.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(opts.threads)
            .build()
            .map_err(|e| DataError::Invalid(format!("cannot start threads: {e}")))?
            .install(run)?
    } else {
        run()?
    };
    let mut st = SynthStats { train_images: tr.len(), val_images: va.len(), ..Default::default() };
    for w in &tr {
        st.train_background += w.background as usize;
        st.train_instances += w.instances;
    }
    for w in &va {
        st.val_instances += w.instances;
    }
    for w in tr.iter().chain(&va) {
        for v in 0..3 {
            st.visibility[v] += w.vis[v];
        }
    }
    let flip = COCO_FLIP_IDX.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ");
    let root_s = root.to_string_lossy().replace('\'', "''");
    let names: String =
        (0..opts.classes.max(1)).map(|c| if c == 0 { "  0: person\n".to_string() } else { format!("  {c}: person{c}\n") }).collect();
    let yaml = format!(
        "{}\npath: '{root_s}'\ntrain: images/train\nval: images/val\n\
         kpt_shape: [17, 3]\nflip_idx: [{flip}]\nnames:\n{names}",
        header_line(opts, opts.background)
    );
    let yp = root.join("data.yaml");
    ptl_files::write_atomic(&yp, yaml.as_bytes(), 0o644)?;
    st.yaml = yp;
    Ok(st)
}

//! Geometric and photometric transforms of docs/data.md §6–§8, on BGR images with pixel-space instances.

use crate::canvas::{release, MosaicCanvas, SourceRows, TilePlacement};
use crate::hsv::{apply_hsv_bgr_hwc, HsvGains};
use crate::image::{resize_bilinear, Image};
use crate::labels::Labels;
use crate::rng::Rng;

/// Fill value of mosaic canvases, affine borders and letterbox padding.
pub const PAD_VALUE: u8 = 114;

/// Objects of one sample in pixels: boxes as (x1, y1, x2, y2), keypoints `n × K × 3` (x, y, v).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Instances {
    /// Class of each object.
    pub cls: Vec<f32>,
    /// Boxes (x1, y1, x2, y2) in pixels.
    pub boxes: Vec<[f32; 4]>,
    /// Keypoints, `n × K × 3` values (x, y in pixels, visibility).
    pub kpts: Vec<f32>,
    /// Keypoints per object.
    pub k: usize,
}

impl Instances {
    /// Empty set with `k` keypoints per object.
    pub fn empty(k: usize) -> Self {
        Instances { k, ..Default::default() }
    }

    /// De-normalises labels (cx, cy, w, h in `[0, 1]`) of an image of size `w × h` to pixel xyxy.
    pub fn from_labels(l: &Labels, k: usize, w: f32, h: f32) -> Self {
        let boxes = l
            .boxes
            .iter()
            .map(|b| {
                let (cx, cy, bw, bh) = (b[0] * w, b[1] * h, b[2] * w, b[3] * h);
                [cx - bw / 2.0, cy - bh / 2.0, cx + bw / 2.0, cy + bh / 2.0]
            })
            .collect();
        let mut kpts = l.kpts.clone();
        for p in kpts.chunks_exact_mut(3) {
            p[0] *= w;
            p[1] *= h;
        }
        Instances { cls: l.cls.clone(), boxes, kpts, k }
    }

    /// Number of objects.
    pub fn len(&self) -> usize {
        self.cls.len()
    }

    /// Whether there is no object.
    pub fn is_empty(&self) -> bool {
        self.cls.is_empty()
    }

    /// Adds a pixel offset to boxes and keypoints (all keypoints, also v = 0 ones).
    pub fn add_padding(&mut self, dx: f32, dy: f32) {
        for b in &mut self.boxes {
            b[0] += dx;
            b[1] += dy;
            b[2] += dx;
            b[3] += dy;
        }
        for p in self.kpts.chunks_exact_mut(3) {
            p[0] += dx;
            p[1] += dy;
        }
    }

    /// Multiplies coordinates by (sx, sy); keypoints too unless `bbox_only`.
    pub fn scale(&mut self, sx: f32, sy: f32, bbox_only: bool) {
        for b in &mut self.boxes {
            b[0] *= sx;
            b[1] *= sy;
            b[2] *= sx;
            b[3] *= sy;
        }
        if !bbox_only {
            for p in self.kpts.chunks_exact_mut(3) {
                p[0] *= sx;
                p[1] *= sy;
            }
        }
    }

    /// Appends another set.
    pub fn extend(&mut self, o: Instances) {
        self.cls.extend(o.cls);
        self.boxes.extend(o.boxes);
        self.kpts.extend(o.kpts);
    }

    /// `Instances.clip`: box corners clamped to `[0, w] × [0, h]`; keypoints outside get v = 0, then are clamped.
    pub fn clip(&mut self, w: f32, h: f32) {
        for b in &mut self.boxes {
            b[0] = b[0].clamp(0.0, w);
            b[2] = b[2].clamp(0.0, w);
            b[1] = b[1].clamp(0.0, h);
            b[3] = b[3].clamp(0.0, h);
        }
        for p in self.kpts.chunks_exact_mut(3) {
            if p[0] < 0.0 || p[0] > w || p[1] < 0.0 || p[1] > h {
                p[2] = 0.0;
            }
            p[0] = p[0].clamp(0.0, w);
            p[1] = p[1].clamp(0.0, h);
        }
    }

    /// Keeps the objects whose flag is true.
    pub fn retain(&mut self, keep: &[bool]) {
        let k3 = self.k * 3;
        let mut cls = Vec::new();
        let mut boxes = Vec::new();
        let mut kpts = Vec::new();
        for (i, &kp) in keep.iter().enumerate() {
            if kp {
                cls.push(self.cls[i]);
                boxes.push(self.boxes[i]);
                kpts.extend_from_slice(&self.kpts[i * k3..(i + 1) * k3]);
            }
        }
        self.cls = cls;
        self.boxes = boxes;
        self.kpts = kpts;
    }

    /// Removes boxes with (x2 − x1)·(y2 − y1) ≤ 0.
    pub fn remove_zero_area(&mut self) {
        let keep: Vec<bool> = self.boxes.iter().map(|b| (b[2] - b[0]) * (b[3] - b[1]) > 0.0).collect();
        self.retain(&keep);
    }

    /// Horizontal flip in an image of width `w`, then keypoint reorder `new[k] = old[flip_idx[k]]`.
    pub fn fliplr(&mut self, w: f32, flip_idx: Option<&[usize]>) {
        for b in &mut self.boxes {
            let (x1, x2) = (b[0], b[2]);
            b[0] = w - x2;
            b[2] = w - x1;
        }
        for p in self.kpts.chunks_exact_mut(3) {
            p[0] = w - p[0];
        }
        self.permute_kpts(flip_idx);
    }

    /// Vertical flip in an image of height `h` (also applies flip_idx, as the reference does).
    pub fn flipud(&mut self, h: f32, flip_idx: Option<&[usize]>) {
        for b in &mut self.boxes {
            let (y1, y2) = (b[1], b[3]);
            b[1] = h - y2;
            b[3] = h - y1;
        }
        for p in self.kpts.chunks_exact_mut(3) {
            p[1] = h - p[1];
        }
        self.permute_kpts(flip_idx);
    }

    fn permute_kpts(&mut self, flip_idx: Option<&[usize]>) {
        let Some(fi) = flip_idx else { return };
        let k = self.k;
        if fi.len() != k {
            return;
        }
        for obj in self.kpts.chunks_exact_mut(k * 3) {
            let old = obj.to_vec();
            for (j, &src) in fi.iter().enumerate() {
                obj[j * 3..j * 3 + 3].copy_from_slice(&old[src * 3..src * 3 + 3]);
            }
        }
    }
}

/// Augmentation hyper-parameters (docs/data.md §6 defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct AugmentConfig {
    /// Probability of a 4-image mosaic (Ultralytics' `mosaic`, 1.0).
    pub mosaic: f64,
    /// Rotation range in degrees, ± (`degrees`, 0).
    pub degrees: f64,
    /// Translation as a fraction of the image, ± (`translate`, 0.1).
    pub translate: f64,
    /// Scale gain: the scale is drawn in 1 ± this (`scale`, 0.5).
    pub scale: f64,
    /// Shear range in degrees, ± (`shear`, 0).
    pub shear: f64,
    /// Perspective coefficient range, ± (`perspective`, 0).
    pub perspective: f64,
    /// Hue gain (`hsv_h`, 0.015).
    pub hsv_h: f64,
    /// Saturation gain (`hsv_s`, 0.7).
    pub hsv_s: f64,
    /// Value gain (`hsv_v`, 0.4).
    pub hsv_v: f64,
    /// Probability of a vertical flip (`flipud`, 0).
    pub flipud: f64,
    /// Probability of a horizontal flip (`fliplr`, 0.5).
    pub fliplr: f64,
    /// Probability of keeping BGR channel order (`bgr`, 0).
    pub bgr: f64,
}

impl Default for AugmentConfig {
    fn default() -> Self {
        AugmentConfig {
            mosaic: 1.0,
            degrees: 0.0,
            translate: 0.1,
            scale: 0.5,
            shear: 0.0,
            perspective: 0.0,
            hsv_h: 0.015,
            hsv_s: 0.7,
            hsv_v: 0.4,
            flipud: 0.0,
            fliplr: 0.5,
            bgr: 0.0,
        }
    }
}

/// Mosaic centre (y_c, x_c) draw: each `int(U(s/2, 3s/2))`, y first.
pub fn draw_mosaic_centre(rng: &mut Rng, s: u32) -> (i64, i64) {
    let s = s as f64;
    let yc = rng.uniform(s / 2.0, 1.5 * s) as i64;
    let xc = rng.uniform(s / 2.0, 1.5 * s) as i64;
    (yc, xc)
}

thread_local! {
    /// One reusable canvas buffer per thread: avoids mapping and zeroing 4.9 MB of fresh pages per mosaic.
    static CANVAS_POOL: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A buffer of `n` bytes set to `fill`, reusing this thread's pooled allocation when there is one.
pub(crate) fn take_buffer(n: usize, fill: u8) -> Vec<u8> {
    let mut v = CANVAS_POOL.with(|p| std::mem::take(&mut *p.borrow_mut()));
    v.clear();
    v.resize(n, fill);
    v
}

/// Returns an image's buffer (e.g. a mosaic canvas after the warp) to this thread's pool.
pub fn recycle(img: Image) {
    CANVAS_POOL.with(|p| {
        let mut slot = p.borrow_mut();
        if img.data.capacity() > slot.capacity() {
            *slot = img.data;
        }
    });
}

/// 4-image mosaic on a `2s × 2s` canvas (docs/data.md §6.1). Tile 0 top-left, 1 top-right, 2 bottom-left,
/// 3 bottom-right. Labels are normalised per tile. The result is clipped to the canvas and zero-area boxes removed.
pub fn mosaic4(tiles: [(&Image, &Labels); 4], k: usize, s: u32, yc: i64, xc: i64) -> (Image, Instances) {
    let (canvas, inst) = mosaic4_layout(tiles, k, s, yc, xc);
    (canvas.to_image(), inst)
}

/// [`mosaic4`] with the canvas left as its tiles' placements: a warp composes the rows it reads
/// ([`MosaicCanvas`]) instead of reading a stored 2s × 2s canvas.
pub fn mosaic4_layout<'a>(tiles: [(&'a Image, &Labels); 4], k: usize, s: u32, yc: i64, xc: i64) -> (MosaicCanvas<'a>, Instances) {
    let cs = 2 * s as i64;
    let mut placed = [(tiles[0].0, TilePlacement::default()); 4];
    let mut all = Instances::empty(k);
    for (i, (img, labels)) in tiles.iter().enumerate() {
        let (w, h) = (img.w as i64, img.h as i64);
        let (x1a, y1a, x2a, y2a, x1b, y1b, x2b, y2b);
        match i {
            0 => {
                x1a = (xc - w).max(0);
                y1a = (yc - h).max(0);
                x2a = xc;
                y2a = yc;
                x1b = w - (x2a - x1a);
                y1b = h - (y2a - y1a);
                x2b = w;
                y2b = h;
            }
            1 => {
                x1a = xc;
                y1a = (yc - h).max(0);
                x2a = (xc + w).min(cs);
                y2a = yc;
                x1b = 0;
                y1b = h - (y2a - y1a);
                x2b = w.min(x2a - x1a);
                y2b = h;
            }
            2 => {
                x1a = (xc - w).max(0);
                y1a = yc;
                x2a = xc;
                y2a = cs.min(yc + h);
                x1b = w - (x2a - x1a);
                y1b = 0;
                x2b = w;
                y2b = (y2a - y1a).min(h);
            }
            _ => {
                x1a = xc;
                y1a = yc;
                x2a = (xc + w).min(cs);
                y2a = cs.min(yc + h);
                x1b = 0;
                y1b = 0;
                x2b = w.min(x2a - x1a);
                y2b = (y2a - y1a).min(h);
            }
        }
        let cw = (x2a - x1a).min(x2b - x1b).max(0) as usize;
        let ch = (y2a - y1a).min(y2b - y1b).max(0) as usize;
        placed[i] = (*img, TilePlacement { x: x1a as usize, y: y1a as usize, src_x: x1b as usize, src_y: y1b as usize, w: cw, h: ch });
        let mut inst = Instances::from_labels(labels, k, w as f32, h as f32);
        inst.add_padding((x1a - x1b) as f32, (y1a - y1b) as f32);
        all.extend(inst);
    }
    all.clip(cs as f32, cs as f32);
    all.remove_zero_area();
    (MosaicCanvas { size: cs as u32, tiles: placed }, all)
}

/// The 8 random draws of the perspective/affine transform, in draw order.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AffineDraw {
    /// Perspective coefficient along x.
    pub persp_x: f64,
    /// Perspective coefficient along y.
    pub persp_y: f64,
    /// Rotation in degrees.
    pub angle: f64,
    /// Isotropic scale.
    pub scale: f64,
    /// Shear along x in degrees.
    pub shear_x: f64,
    /// Shear along y in degrees.
    pub shear_y: f64,
    /// Translation as a fraction of the output width (0.5 = centred).
    pub tx: f64,
    /// Translation as a fraction of the output height.
    pub ty: f64,
}

impl AffineDraw {
    /// Draws in order P-x, P-y, angle, scale, shear-x, shear-y, translate-x, translate-y. tx/ty are fractions of the
    /// output size.
    pub fn draw(rng: &mut Rng, a: &AugmentConfig) -> Self {
        AffineDraw {
            persp_x: rng.uniform(-a.perspective, a.perspective),
            persp_y: rng.uniform(-a.perspective, a.perspective),
            angle: rng.uniform(-a.degrees, a.degrees),
            scale: rng.uniform(1.0 - a.scale, 1.0 + a.scale),
            shear_x: rng.uniform(-a.shear, a.shear),
            shear_y: rng.uniform(-a.shear, a.shear),
            tx: rng.uniform(0.5 - a.translate, 0.5 + a.translate),
            ty: rng.uniform(0.5 - a.translate, 0.5 + a.translate),
        }
    }
}

type Mat3 = [[f32; 3]; 3];

fn matmul(a: &Mat3, b: &Mat3) -> Mat3 {
    let mut c = [[0f32; 3]; 3];
    for (i, row) in c.iter_mut().enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = a[i][0] * b[0][j] + a[i][1] * b[1][j] + a[i][2] * b[2][j];
        }
    }
    c
}

/// M = T · S · R · P · C (float32) for an input of `in_w × in_h` and an output of `out_w × out_h`.
pub fn affine_matrix(d: &AffineDraw, in_w: u32, in_h: u32, out_w: u32, out_h: u32) -> Mat3 {
    let id = [[1f32, 0., 0.], [0., 1., 0.], [0., 0., 1.]];
    let mut c = id;
    c[0][2] = -(in_w as f32) / 2.0;
    c[1][2] = -(in_h as f32) / 2.0;
    let mut p = id;
    p[2][0] = d.persp_x as f32;
    p[2][1] = d.persp_y as f32;
    let a = d.angle.to_radians();
    let (alpha, beta) = (d.scale * a.cos(), d.scale * a.sin());
    let r = [[alpha as f32, beta as f32, 0.], [-beta as f32, alpha as f32, 0.], [0., 0., 1.]];
    let mut s = id;
    s[0][1] = d.shear_x.to_radians().tan() as f32;
    s[1][0] = d.shear_y.to_radians().tan() as f32;
    let mut t = id;
    t[0][2] = (d.tx * out_w as f64) as f32;
    t[1][2] = (d.ty * out_h as f64) as f32;
    matmul(&t, &matmul(&s, &matmul(&r, &matmul(&p, &c))))
}

fn invert3(m: &Mat3) -> Option<[[f64; 3]; 3]> {
    let a: [[f64; 3]; 3] = [
        [m[0][0] as f64, m[0][1] as f64, m[0][2] as f64],
        [m[1][0] as f64, m[1][1] as f64, m[1][2] as f64],
        [m[2][0] as f64, m[2][1] as f64, m[2][2] as f64],
    ];
    let det = a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
        + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]);
    if det == 0.0 || !det.is_finite() {
        return None;
    }
    let i = 1.0 / det;
    Some([
        [
            (a[1][1] * a[2][2] - a[1][2] * a[2][1]) * i,
            (a[0][2] * a[2][1] - a[0][1] * a[2][2]) * i,
            (a[0][1] * a[1][2] - a[0][2] * a[1][1]) * i,
        ],
        [
            (a[1][2] * a[2][0] - a[1][0] * a[2][2]) * i,
            (a[0][0] * a[2][2] - a[0][2] * a[2][0]) * i,
            (a[0][2] * a[1][0] - a[0][0] * a[1][2]) * i,
        ],
        [
            (a[1][0] * a[2][1] - a[1][1] * a[2][0]) * i,
            (a[0][1] * a[2][0] - a[0][0] * a[2][1]) * i,
            (a[0][0] * a[1][1] - a[0][1] * a[1][0]) * i,
        ],
    ])
}

/// Rounds a value in [0, 2²²) half-to-even to an integer (as OpenCV's `saturate_cast<uchar>(float)`), without a libm
/// call: adding 2²³ leaves no fraction bits, so the FPU's default rounding does it.
#[inline(always)]
fn round_u8(v: f32) -> u8 {
    ((v + 8_388_608.0) - 8_388_608.0) as u8
}

/// [`round_u8`] for a value known to lie in [0, 255] (a lerp of bytes never leaves the range of
/// its ends): the sum with 2²³ holds the rounded integer in its low mantissa bits, read with bit
/// operations only, so a loop of these vectorises (a float-to-int conversion does not).
#[inline(always)]
fn round_u8_in_range(v: f32) -> u8 {
    ((v + 8_388_608.0).to_bits() - 0x4B00_0000) as u8
}

#[inline(always)]
fn tap(src: &Image, x: i32, y: i32, c: usize) -> f32 {
    if x < 0 || y < 0 || x >= src.w as i32 || y >= src.h as i32 {
        PAD_VALUE as f32
    } else {
        src.data[(y as usize * src.w as usize + x as usize) * 3 + c] as f32
    }
}

/// Bilinear sample at float source coordinates with OpenCV ≥ 4.11's 8-bit warp kernel arithmetic:
/// `floor`, fractions in float32, `v0 = p00 + α(p01 − p00)`, `v1 = p10 + α(p11 − p10)`, `v0 + β(v1 − v0)`, rounded
/// half-to-even. Taps outside the source read the border value 114.
#[inline(always)]
fn sample_into(src: &Image, sx: f32, sy: f32, out: &mut [u8]) {
    let (w, h) = (src.w as f32, src.h as f32);
    // also catches NaN
    if !(sx >= -1.0 && sy >= -1.0 && sx < w && sy < h) {
        out[..3].copy_from_slice(&[PAD_VALUE; 3]);
        return;
    }
    let ix = crate::image::floor_i32(sx);
    let iy = crate::image::floor_i32(sy);
    let a = sx - ix as f32;
    let b = sy - iy as f32;
    if ix >= 0 && iy >= 0 && ix + 1 < src.w as i32 && iy + 1 < src.h as i32 {
        let stride = src.stride();
        let o = iy as usize * stride + ix as usize * 3;
        let (Some(r0), Some(r1)) = (src.data.get(o..o + 6), src.data.get(o + stride..o + stride + 6)) else {
            return;
        };
        for c in 0..3 {
            let (p00, p01) = (r0[c] as f32, r0[c + 3] as f32);
            let (p10, p11) = (r1[c] as f32, r1[c + 3] as f32);
            let v0 = p00 + a * (p01 - p00);
            let v1 = p10 + a * (p11 - p10);
            out[c] = round_u8(v0 + b * (v1 - v0));
        }
        return;
    }
    for (c, o) in out.iter_mut().enumerate().take(3) {
        let (p00, p01) = (tap(src, ix, iy, c), tap(src, ix + 1, iy, c));
        let (p10, p11) = (tap(src, ix, iy + 1, c), tap(src, ix + 1, iy + 1, c));
        let v0 = p00 + a * (p01 - p00);
        let v1 = p10 + a * (p11 - p10);
        *o = round_u8(v0 + b * (v1 - v0));
    }
}

/// `cv::invertAffineTransform` (double).
fn invert_affine(m: &Mat3) -> [[f64; 3]; 2] {
    let g = |i: usize, j: usize| m[i][j] as f64;
    let d = g(0, 0) * g(1, 1) - g(0, 1) * g(1, 0);
    let d = if d != 0.0 { 1.0 / d } else { 0.0 };
    let (a11, a22, a12, a21) = (g(1, 1) * d, g(0, 0) * d, -g(0, 1) * d, -g(1, 0) * d);
    let b1 = -a11 * g(0, 2) - a12 * g(1, 2);
    let b2 = -a21 * g(0, 2) - a22 * g(1, 2);
    [[a11, a12, b1], [a21, a22, b2]]
}

/// Scale + translation warp (the default augmentation): source columns depend on x only and rows on y only, so the
/// horizontal lerps of a source row are computed once and shared by every destination row that reads it. Same
/// arithmetic as [`sample_into`] (taps outside the source read 114), so the bytes are identical.
#[inline(always)]
fn warp_separable<S: SourceRows + ?Sized>(src: &S, f: &[[f32; 3]; 2], out: &mut Image) {
    let ow = out.w as usize;
    let (sw, sh) = (src.size().0 as i32, src.size().1 as i32);
    let mut scratch = vec![0u8; sw as usize * 3];
    // per destination column: (x0 tap, x1 tap, alpha); a tap is a byte offset or None (border)
    let cols: Vec<(Option<usize>, Option<usize>, f32)> = (0..ow)
        .map(|x| {
            let sx = f[0][0] * x as f32 + f[0][2];
            if !(sx >= -1.0 && sx < sw as f32) {
                return (None, None, 0.0);
            }
            let ix = crate::image::floor_i32(sx);
            let t = |i: i32| (i >= 0 && i < sw).then(|| i as usize * 3);
            (t(ix), t(ix + 1), sx - ix as f32)
        })
        .collect();
    let border = PAD_VALUE as f32;
    // Columns whose two taps are both inside the source form one run (the scale is positive, so
    // taps grow with x): those are read straight from the row; the few outside it read 114.
    let inside = |t: &(Option<usize>, Option<usize>, f32)| t.0.is_some() && t.1.is_some();
    let first = cols.iter().position(inside).unwrap_or(ow);
    let last = cols.iter().rposition(inside).map_or(first, |x| x + 1).max(first);
    // Inside the run both taps are in the source and the second is the first's right neighbour
    // (the taps are monotonic in x); should a column break that, the whole run takes the edge path.
    let neighbours = cols[first..last].iter().all(|&(t0, t1, _)| t0.is_some() && t1 == t0.map(|o| o + 3));
    let (first, last) = if neighbours { (first, last) } else { (ow, ow) };
    let run: Vec<(usize, f32)> = cols[first..last].iter().map(|&(t0, _, a)| (t0.unwrap_or(0), a)).collect();
    // horizontal lerp of source row `iy` (or of a border row) into `buf`
    let hpass = |iy: i32, buf: &mut [f32], scratch: &mut [u8]| {
        let row = (iy >= 0 && iy < sh).then(|| src.row(iy as usize, scratch));
        let Some(r) = row else {
            // p0 = p1 = 114: the lerp is 114 exactly
            buf.fill(border);
            return;
        };
        let edge = |x: usize, buf: &mut [f32]| {
            let (t0, t1, a) = cols[x];
            for c in 0..3 {
                let p = |t: Option<usize>| t.map_or(border, |o| r[o + c] as f32);
                let (p0, p1) = (p(t0), p(t1));
                buf[x * 3 + c] = p0 + a * (p1 - p0);
            }
        };
        for x in (0..first).chain(last..ow) {
            edge(x, buf);
        }
        // The run's taps are neighbours (ix, ix + 1): one six-byte read per column.
        for (out, &(o0, a)) in buf[first * 3..last * 3].chunks_exact_mut(3).zip(&run) {
            let Some(q) = r.get(o0..o0 + 6) else { continue };
            let Ok(q) = <&[u8; 6]>::try_from(q) else { continue };
            out[0] = q[0] as f32 + a * (q[3] as f32 - q[0] as f32);
            out[1] = q[1] as f32 + a * (q[4] as f32 - q[1] as f32);
            out[2] = q[2] as f32 + a * (q[5] as f32 - q[2] as f32);
        }
    };
    let mut rows: [(i32, Vec<f32>); 2] = [(i32::MIN, vec![0.0; ow * 3]), (i32::MIN, vec![0.0; ow * 3])];
    for (y, orow) in out.data.chunks_exact_mut(ow * 3).enumerate() {
        let sy = f[1][1] * y as f32 + f[1][2];
        if !(sy >= -1.0 && sy < sh as f32) {
            continue; // whole row is border (already 114)
        }
        let iy = crate::image::floor_i32(sy);
        let b = sy - iy as f32;
        for (slot, want) in [(0usize, iy), (1usize, iy + 1)] {
            if rows[slot].0 != want {
                let other = 1 - slot;
                if rows[other].0 == want {
                    let (lo, hi) = rows.split_at_mut(1);
                    if slot == 0 {
                        lo[0].1.copy_from_slice(&hi[0].1);
                    } else {
                        hi[0].1.copy_from_slice(&lo[0].1);
                    }
                } else {
                    hpass(want, &mut rows[slot].1, &mut scratch);
                }
                rows[slot].0 = want;
            }
        }
        let (v0, v1) = (&rows[0].1, &rows[1].1);
        for ((o, &a), &c) in orow.iter_mut().zip(v0).zip(v1) {
            *o = round_u8_in_range(a + b * (c - a));
        }
    }
}

/// Warps `src` with the 3×3 matrix `m` (destination = m · source) into `out_w × out_h`, bilinear, constant border
/// 114, as OpenCV ≥ 4.11 (`warpAffine` / `warpPerspective`, INTER_LINEAR, 8UC3) computes it: the inverse matrix in
/// double, converted to float32; per destination pixel `sx = M₀·x + (M₁·y + M₂)` (and `/ (M₆·x + (M₇·y + M₈))` for
/// perspective) in float32; see `sample_into`. Bit-exact against OpenCV 5.0 in the goldens.
#[inline(always)]
pub fn warp<S: SourceRows + ?Sized>(source: &S, m: &Mat3, out_w: u32, out_h: u32, perspective: bool) -> Image {
    let (ow, oh) = (out_w as usize, out_h as usize);
    let mut out = Image { w: out_w, h: out_h, data: vec![PAD_VALUE; ow * oh * 3] };
    if source.size().0 == 0 || source.size().1 == 0 {
        return out;
    }
    if !perspective {
        let iv = invert_affine(m);
        let f: [[f32; 3]; 2] = [[iv[0][0] as f32, iv[0][1] as f32, iv[0][2] as f32], [iv[1][0] as f32, iv[1][1] as f32, iv[1][2] as f32]];
        if f[0][1] == 0.0 && f[1][0] == 0.0 {
            warp_separable(source, &f, &mut out);
            return out;
        }
        let whole = source.image();
        let src = whole.as_ref();
        for (y, row) in out.data.chunks_exact_mut(ow * 3).enumerate() {
            let yf = y as f32;
            let cx = f[0][1] * yf + f[0][2];
            let cy = f[1][1] * yf + f[1][2];
            for (x, o) in row.chunks_exact_mut(3).enumerate() {
                let xf = x as f32;
                sample_into(src, f[0][0] * xf + cx, f[1][0] * xf + cy, o);
            }
        }
        release(whole);
    } else {
        let Some(iv) = invert3(m) else { return out };
        let f: Vec<[f32; 3]> = iv.iter().map(|r| [r[0] as f32, r[1] as f32, r[2] as f32]).collect();
        let whole = source.image();
        let src = whole.as_ref();
        for (y, row) in out.data.chunks_exact_mut(ow * 3).enumerate() {
            let yf = y as f32;
            let (cx, cy, cw) = (f[0][1] * yf + f[0][2], f[1][1] * yf + f[1][2], f[2][1] * yf + f[2][2]);
            for (x, o) in row.chunks_exact_mut(3).enumerate() {
                let xf = x as f32;
                let wv = f[2][0] * xf + cw;
                sample_into(src, (f[0][0] * xf + cx) / wv, (f[1][0] * xf + cy) / wv, o);
            }
        }
        release(whole);
    }
    out
}

#[inline]
fn apply_pt(m: &Mat3, x: f32, y: f32, perspective: bool) -> (f32, f32) {
    let nx = m[0][0] * x + m[0][1] * y + m[0][2];
    let ny = m[1][0] * x + m[1][1] * y + m[1][2];
    if perspective {
        let nz = m[2][0] * x + m[2][1] * y + m[2][2];
        (nx / nz, ny / nz)
    } else {
        (nx, ny)
    }
}

/// `box_candidates`: keep if w₂ > 2, h₂ > 2, area ratio > 0.1 and aspect < 100.
pub fn box_candidate(old: &[f32; 4], new: &[f32; 4]) -> bool {
    let eps = 1e-16f32;
    let (w1, h1) = (old[2] - old[0], old[3] - old[1]);
    let (w2, h2) = (new[2] - new[0], new[3] - new[1]);
    let ar = (w2 / (h2 + eps)).max(h2 / (w2 + eps));
    w2 > 2.0 && h2 > 2.0 && w2 * h2 / (w1 * h1 + eps) > 0.10 && ar < 100.0
}

/// RandomPerspective (docs/data.md §6.2): warps the image to `out × out`, transforms boxes (4 corners) and keypoints,
/// zeroes the visibility of points that leave the image, clips, and applies the box-candidate filter.
#[inline(always)]
pub fn random_perspective<S: SourceRows + ?Sized>(img: &S, inst: &Instances, d: &AffineDraw, out: u32) -> (Image, Instances) {
    let m = affine_matrix(d, img.size().0, img.size().1, out, out);
    let persp = d.persp_x != 0.0 || d.persp_y != 0.0;
    let warped = warp(img, &m, out, out, persp);
    let of = out as f32;
    let mut new = Instances::empty(inst.k);
    new.cls = inst.cls.clone();
    for b in &inst.boxes {
        let corners = [(b[0], b[1]), (b[2], b[3]), (b[0], b[3]), (b[2], b[1])];
        let mut mn = (f32::INFINITY, f32::INFINITY);
        let mut mx = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for (x, y) in corners {
            let (nx, ny) = apply_pt(&m, x, y, persp);
            mn = (mn.0.min(nx), mn.1.min(ny));
            mx = (mx.0.max(nx), mx.1.max(ny));
        }
        new.boxes.push([mn.0, mn.1, mx.0, mx.1]);
    }
    new.kpts = inst.kpts.clone();
    for p in new.kpts.chunks_exact_mut(3) {
        let (nx, ny) = apply_pt(&m, p[0], p[1], true);
        if nx < 0.0 || ny < 0.0 || nx > of || ny > of {
            p[2] = 0.0;
        }
        p[0] = nx;
        p[1] = ny;
    }
    new.clip(of, of);
    let mut old = inst.clone();
    old.scale(d.scale as f32, d.scale as f32, true);
    let keep: Vec<bool> = old.boxes.iter().zip(&new.boxes).map(|(o, n)| box_candidate(o, n)).collect();
    new.retain(&keep);
    (warped, new)
}

/// Result of a letterbox.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LetterboxInfo {
    /// Scale applied to the incoming image.
    pub r: f32,
    /// Padding on the left in pixels.
    pub left: u32,
    /// Padding on the top in pixels.
    pub top: u32,
}

/// Python's `round` (half to even) on f64.
fn pyround(v: f64) -> f64 {
    v.round_ties_even()
}

/// LetterBox (centre, pad 114): scale by `min(H/h, W/w)` (capped at 1 unless `scaleup`), resize bilinear, pad
/// `top = round(dh/2 − 0.1)`, `bottom = round(dh/2 + 0.1)` and the same for left/right. Instances move with it.
#[inline(always)]
pub fn letterbox(img: &Image, inst: &mut Instances, new_h: u32, new_w: u32, scaleup: bool) -> (Image, LetterboxInfo) {
    letterbox_with(img, inst, new_h, new_w, scaleup, None)
}

/// [`letterbox`] with Ultralytics' `auto=True` (what its predictor uses, `rect=True`): the image
/// scaled as to fit `new_h × new_w`, then padded only up to the next multiple of `stride` on each
/// side instead of to the full size (a 128 × 72 image at 128 becomes 128 × 96, not 128 × 128).
pub fn letterbox_min(img: &Image, inst: &mut Instances, new_h: u32, new_w: u32, scaleup: bool, stride: u32) -> (Image, LetterboxInfo) {
    letterbox_with(img, inst, new_h, new_w, scaleup, Some(stride.max(1)))
}

#[inline(always)]
fn letterbox_with(img: &Image, inst: &mut Instances, new_h: u32, new_w: u32, scaleup: bool, auto: Option<u32>) -> (Image, LetterboxInfo) {
    let (h, w) = (img.h as f64, img.w as f64);
    let mut r = (new_h as f64 / h).min(new_w as f64 / w);
    if !scaleup {
        r = r.min(1.0);
    }
    let uw = (pyround(w * r) as u32).max(1);
    let uh = (pyround(h * r) as u32).max(1);
    let (mut pad_w, mut pad_h) = (new_w as f64 - uw as f64, new_h as f64 - uh as f64);
    if let Some(stride) = auto {
        // numpy's mod: a non-negative remainder.
        (pad_w, pad_h) = (pad_w.rem_euclid(stride as f64), pad_h.rem_euclid(stride as f64));
    }
    let dw = pad_w / 2.0;
    let dh = pad_h / 2.0;
    let resized = if uw != img.w || uh != img.h { resize_bilinear(img, uw, uh) } else { img.clone() };
    let top = pyround(dh - 0.1).max(0.0) as u32;
    let bottom = pyround(dh + 0.1).max(0.0) as u32;
    let left = pyround(dw - 0.1).max(0.0) as u32;
    let right = pyround(dw + 0.1).max(0.0) as u32;
    let ow = uw + left + right;
    let oh = uh + top + bottom;
    let mut out = Image::filled(ow, oh, [PAD_VALUE; 3]);
    let os = out.stride();
    let rs = resized.stride();
    for y in 0..uh as usize {
        let d0 = (y + top as usize) * os + left as usize * 3;
        out.data[d0..d0 + rs].copy_from_slice(&resized.data[y * rs..(y + 1) * rs]);
    }
    inst.scale(r as f32, r as f32, false);
    inst.add_padding(left as f32, top as f32);
    (out, LetterboxInfo { r: r as f32, left, top })
}

/// Mirrors an image left–right in place.
#[inline(always)]
pub fn fliplr_image(img: &mut Image) {
    let stride = img.stride();
    for row in img.data.chunks_exact_mut(stride) {
        // whole pixels, reversed
        row.as_chunks_mut::<3>().0.reverse();
    }
}

/// Mirrors an image top–bottom in place.
#[inline(always)]
pub fn flipud_image(img: &mut Image) {
    let h = img.h as usize;
    let stride = img.stride();
    for y in 0..h / 2 {
        let (a, b) = img.data.split_at_mut((h - 1 - y) * stride);
        a[y * stride..(y + 1) * stride].swap_with_slice(&mut b[..stride]);
    }
}

/// HSV step with the gains already drawn (CPU reference).
#[inline(always)]
pub fn hsv(img: &mut Image, gains: &HsvGains) {
    apply_hsv_bgr_hwc(&mut img.data, gains);
}

#[cfg(test)]
mod tests {

    /// Ultralytics' `auto=True` letterbox: 128 × 72 at 128 pads to 128 × 96 (12 rows above and
    /// below), a 100 × 60 image scaled ×1.28 to 128 × 77 pads to 128 × 96 (top 9, bottom 10).
    #[test]
    fn letterbox_min_pads_to_the_stride_only() {
        let mut inst = Instances::empty(17);
        let (out, info) = letterbox_min(&Image::filled(128, 72, [0; 3]), &mut inst, 128, 128, true, 32);
        assert_eq!((out.w, out.h, info.left, info.top), (128, 96, 0, 12));
        let (out, info) = letterbox_min(&Image::filled(100, 60, [0; 3]), &mut inst, 128, 128, true, 32);
        assert_eq!((out.w, out.h, info.left, info.top), (128, 96, 0, 9));
        let (square, _) = letterbox(&Image::filled(128, 72, [0; 3]), &mut inst, 128, 128, true);
        assert_eq!((square.w, square.h), (128, 128));
    }
    use super::*;

    fn one_obj(k: usize) -> Labels {
        let mut l = Labels::default();
        l.cls.push(0.0);
        l.boxes.push([0.5, 0.5, 0.5, 0.5]);
        for j in 0..k {
            l.kpts.extend_from_slice(&[0.3 + 0.02 * j as f32, 0.4, 2.0]);
        }
        l
    }

    #[test]
    fn the_vectorisable_rounding_equals_the_saturating_one_on_byte_lerps() {
        // Every multiple of 2⁻¹² in [0, 255] (halves included), and the float just below each half.
        for i in 0..=255u32 << 12 {
            let v = i as f32 / 4096.0;
            assert_eq!(round_u8_in_range(v), round_u8(v), "{v}");
            let below = f32::from_bits(v.to_bits().saturating_sub(1));
            assert_eq!(round_u8_in_range(below), round_u8(below), "{below}");
        }
    }

    #[test]
    fn letterbox_spec_examples() {
        let img = Image::filled(640, 480, [1, 2, 3]);
        let mut inst = Instances::empty(17);
        let (out, info) = letterbox(&img, &mut inst, 512, 672, false);
        assert_eq!((out.h, out.w), (512, 672));
        assert_eq!((info.r, info.left, info.top), (1.0, 16, 16));
        let img = Image::filled(640, 360, [1, 2, 3]);
        let (out, info) = letterbox(&img, &mut inst, 672, 672, false);
        assert_eq!((out.h, out.w), (672, 672));
        assert_eq!((info.left, info.top), (16, 156));
        // odd padding: dh = 213 → top round(106.4) = 106, bottom round(106.6) = 107
        let img = Image::filled(640, 427, [1, 2, 3]);
        let (out, info) = letterbox(&img, &mut inst, 640, 640, true);
        assert_eq!((out.h, info.top), (640, 106));
        assert_eq!(out.data[(105 * 640 + 5) * 3], PAD_VALUE);
        assert_eq!(out.data[(106 * 640 + 5) * 3], 1);
        assert_eq!(out.data[(532 * 640 + 5) * 3], 1);
        assert_eq!(out.data[(533 * 640 + 5) * 3], PAD_VALUE);
    }

    #[test]
    fn flip_idx_applied() {
        let k = 17;
        let mut inst = Instances::from_labels(&one_obj(k), k, 100.0, 100.0);
        let fi = crate::config::COCO_FLIP_IDX;
        let before = inst.clone();
        inst.fliplr(100.0, Some(&fi));
        assert_eq!(inst.boxes[0], [25.0, 25.0, 75.0, 75.0]);
        for (j, &src) in fi.iter().enumerate() {
            assert!((inst.kpts[j * 3] - (100.0 - before.kpts[src * 3])).abs() < 1e-4);
            assert_eq!(inst.kpts[j * 3 + 2], before.kpts[src * 3 + 2]);
        }
        // double flip is the identity (flip_idx is an involution)
        inst.fliplr(100.0, Some(&fi));
        for (a, b) in inst.kpts.iter().zip(&before.kpts) {
            assert!((a - b).abs() < 1e-4);
        }
        let mut img = Image::filled(3, 2, [0, 0, 0]);
        img.data[0] = 9;
        fliplr_image(&mut img);
        assert_eq!(img.data[6], 9);
        flipud_image(&mut img);
        assert_eq!(img.data[3 * 3 + 6], 9);
    }

    #[test]
    fn mosaic_layout_and_clip() {
        let k = 17;
        let imgs: Vec<Image> = (0..4).map(|i| Image::filled(100, 80, [i as u8 * 10 + 1; 3])).collect();
        let l = one_obj(k);
        let tiles = [(&imgs[0], &l), (&imgs[1], &l), (&imgs[2], &l), (&imgs[3], &l)];
        let (canvas, inst) = mosaic4(tiles, k, 64, 70, 60);
        assert_eq!((canvas.w, canvas.h), (128, 128));
        let px = |x: usize, y: usize| canvas.data[(y * 128 + x) * 3];
        assert_eq!(px(0, 0), 1); // tile 0 covers [0,60)×[0,70)
        assert_eq!(px(59, 69), 1);
        assert_eq!(px(60, 0), 11); // tile 1 right of xc
        assert_eq!(px(0, 70), 21); // tile 2 below yc
        assert_eq!(px(127, 127), 31);
        // tile 0: pad = (x1a − x1b, y1a − y1b) = (0 − 40, 0 − 10); its box 25..75 → −15..35, clipped to 0..35
        assert_eq!(inst.boxes[0], [0.0, 10.0, 35.0, 50.0]);
        // keypoint x = 30 − 40 < 0 → v = 0 and clamped
        assert_eq!(&inst.kpts[0..3], &[0.0, 22.0, 0.0]);
        assert_eq!(inst.len(), 4);
    }

    #[test]
    fn affine_identity_like_and_box_filter() {
        // scale 1, centred translate: a 640² image maps onto itself.
        let d = AffineDraw { scale: 1.0, tx: 0.5, ty: 0.5, ..Default::default() };
        let mut img = Image::filled(64, 64, [50, 60, 70]);
        img.data[(10 * 64 + 20) * 3] = 200;
        let l = one_obj(17);
        let inst = Instances::from_labels(&l, 17, 64.0, 64.0);
        let (out, new) = random_perspective(&img, &inst, &d, 64);
        assert_eq!(out, img);
        assert_eq!(new.boxes, inst.boxes);
        // translation half-way off the image: kept box clipped, keypoints outside get v=0.
        let d = AffineDraw { scale: 1.0, tx: 1.0, ty: 0.5, ..Default::default() };
        let (out, new) = random_perspective(&img, &inst, &d, 64);
        assert_eq!(out.data[0], 114);
        assert_eq!(new.boxes[0], [48.0, 16.0, 64.0, 48.0]);
        assert!(new.kpts.chunks(3).all(|p| p[2] == 2.0 || p[0] == 64.0));
        // box filter example from the spec
        assert!(box_candidate(&[0.0, 0.0, 80.0, 40.0], &[0.0, 0.0, 30.0, 40.0]));
        assert!(!box_candidate(&[0.0, 0.0, 80.0, 40.0], &[0.0, 0.0, 2.0, 40.0]));
        assert!(!box_candidate(&[0.0, 0.0, 80.0, 40.0], &[0.0, 0.0, 10.0, 10.0]));
    }

    #[test]
    fn rotation_shear_and_perspective_paths() {
        // 180° about the centre with scale 1: destination x samples source W − x.
        let mut img = Image::filled(64, 64, [10, 10, 10]);
        img.data[(20 * 64 + 10) * 3] = 250;
        let d = AffineDraw { angle: 180.0, scale: 1.0, tx: 0.5, ty: 0.5, ..Default::default() };
        let mut l = one_obj(17);
        l.boxes[0] = [0.25, 0.25, 0.25, 0.25];
        let inst = Instances::from_labels(&l, 17, 64.0, 64.0);
        let (out, new) = random_perspective(&img, &inst, &d, 64);
        assert_eq!(out.data[((64 - 20) * 64 + (64 - 10)) * 3], 250);
        let b = new.boxes[0];
        assert!((b[0] - 40.0).abs() < 1e-3 && (b[2] - 56.0).abs() < 1e-3, "{b:?}");
        // keypoint (0.3·64, 0.4·64) → (64 − x, 64 − y)
        assert!((new.kpts[0] - (64.0 - 19.2)).abs() < 1e-3 && (new.kpts[1] - (64.0 - 25.6)).abs() < 1e-3);
        // 90° rotation keeps the box area of a square box
        let d = AffineDraw { angle: 90.0, ..d };
        let (_, new) = random_perspective(&img, &inst, &d, 64);
        let b = new.boxes[0];
        assert!(((b[2] - b[0]) * (b[3] - b[1]) - 256.0).abs() < 1e-2, "{b:?}");
        // shear and perspective run and give finite, clipped results
        let d = AffineDraw { shear_x: 10.0, shear_y: -5.0, persp_x: 0.0005, persp_y: -0.0003, ..d };
        let (out, new) = random_perspective(&img, &inst, &d, 64);
        assert_eq!(out.data.len(), 64 * 64 * 3);
        assert!(new.boxes.iter().flatten().all(|v| v.is_finite() && (0.0..=64.0).contains(v)));
        assert!(new.kpts.chunks(3).all(|p| (0.0..=64.0).contains(&p[0]) && (0.0..=64.0).contains(&p[1])));
    }

    #[test]
    fn separable_warp_equals_per_pixel_sampling() {
        let mut rng = Rng::new(9);
        let mut img = Image::filled(57, 43, [0, 0, 0]);
        img.data.iter_mut().for_each(|v| *v = rng.below(256) as u8);
        for i in 0..30 {
            // A negative scale (Ultralytics' `scale` > 1 can draw one) mirrors the image.
            let scale = if i % 3 == 2 { -rng.uniform(0.3, 2.0) } else { rng.uniform(0.3, 2.0) };
            let d = AffineDraw { scale, tx: rng.uniform(-0.2, 1.2), ty: rng.uniform(-0.2, 1.2), ..Default::default() };
            let m = affine_matrix(&d, 57, 43, 50, 50);
            let got = warp(&img, &m, 50, 50, false);
            let iv = invert_affine(&m);
            let mut want = Image::filled(50, 50, [0, 0, 0]);
            for y in 0..50usize {
                for x in 0..50usize {
                    let (xf, yf) = (x as f32, y as f32);
                    let sx = iv[0][0] as f32 * xf + (iv[0][1] as f32 * yf + iv[0][2] as f32);
                    let sy = iv[1][0] as f32 * xf + (iv[1][1] as f32 * yf + iv[1][2] as f32);
                    sample_into(&img, sx, sy, &mut want.data[(y * 50 + x) * 3..(y * 50 + x) * 3 + 3]);
                }
            }
            assert_eq!(got, want, "{d:?}");
        }
    }

    #[test]
    fn affine_matrix_net_effect() {
        let d = AffineDraw { scale: 0.5, tx: 0.4, ty: 0.6, ..Default::default() };
        let m = affine_matrix(&d, 1280, 1280, 640, 640);
        let (x, y) = apply_pt(&m, 640.0, 640.0, false);
        assert!((x - 256.0).abs() < 1e-3 && (y - 384.0).abs() < 1e-3);
        let (x, _) = apply_pt(&m, 740.0, 640.0, false);
        assert!((x - 306.0).abs() < 1e-3);
    }
}

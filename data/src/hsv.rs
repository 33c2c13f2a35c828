//! HSV colour jitter (docs/data.md §6.3): LUT method with OpenCV's exact 8-bit BGR↔HSV conversions.
//!
//! Design for the device kernel: the random part is only [`HsvGains`] (three doubles drawn on the host per image).
//! Everything else is a pure per-pixel function, [`hsv_pixel_bgr`], of the pixel and the image's [`HsvLut`]
//! (three 256-byte tables): integer arithmetic for BGR→HSV with 12-bit fixed-point tables (`SDIV`, `HDIV`), and
//! float32 with fused multiply-adds for HSV→BGR. A CUDA kernel mirrors it with `__fmaf_rn`, identical bytes.

use crate::rng::Rng;

/// Per-image HSV gains r = (U(−1,1)·hgain, U(−1,1)·sgain, U(−1,1)·vgain).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HsvGains {
    /// Hue gain.
    pub h: f64,
    /// Saturation gain.
    pub s: f64,
    /// Value gain.
    pub v: f64,
}

impl HsvGains {
    /// Draws the three gains (one "call", three values in h, s, v order).
    pub fn draw(rng: &mut Rng, hgain: f64, sgain: f64, vgain: f64) -> Self {
        let a = rng.uniform(-1.0, 1.0);
        let b = rng.uniform(-1.0, 1.0);
        let c = rng.uniform(-1.0, 1.0);
        HsvGains { h: a * hgain, s: b * sgain, v: c * vgain }
    }

    /// True when all gains are zero (the transform is skipped).
    pub fn is_zero(&self) -> bool {
        self.h == 0.0 && self.s == 0.0 && self.v == 0.0
    }
}

/// The three 256-entry tables of one image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HsvLut {
    /// New hue by old hue (OpenCV's 0..180).
    pub hue: [u8; 256],
    /// New saturation by old.
    pub sat: [u8; 256],
    /// New value by old.
    pub val: [u8; 256],
}

impl HsvLut {
    /// Builds the tables in float64 with truncation toward zero (numpy `astype(uint8)`).
    pub fn new(g: &HsvGains) -> Self {
        let mut hue = [0u8; 256];
        let mut sat = [0u8; 256];
        let mut val = [0u8; 256];
        for x in 0..256usize {
            let xf = x as f64;
            let hv = (xf + g.h * 180.0).rem_euclid(180.0);
            hue[x] = hv as u8;
            sat[x] = (xf * (g.s + 1.0)).clamp(0.0, 255.0) as u8;
            val[x] = (xf * (g.v + 1.0)).clamp(0.0, 255.0) as u8;
        }
        sat[0] = 0;
        HsvLut { hue, sat, val }
    }
}

const fn div_tables() -> ([i32; 256], [i32; 256]) {
    // round(255·4096 / i) and round(180·4096 / (6·i)), computed in integers (round half up; no exact halves occur
    // for these numerators except where the integer formula agrees with round-half-even, checked in tests).
    let mut s = [0i32; 256];
    let mut h = [0i32; 256];
    let mut i = 1;
    while i < 256 {
        let n = 255 * 4096;
        s[i] = (2 * n + i as i32) / (2 * i as i32);
        let nh = 180 * 4096;
        let d = 6 * i as i32;
        h[i] = (2 * nh + d) / (2 * d);
        i += 1;
    }
    (s, h)
}

const TABLES: ([i32; 256], [i32; 256]) = div_tables();
/// `round(255·4096 / i)`, index 0 → 0.
pub const SDIV: [i32; 256] = TABLES.0;
/// `round(180·4096 / (6·i))`, index 0 → 0.
pub const HDIV: [i32; 256] = TABLES.1;

/// OpenCV 8-bit BGR → HSV (H in [0,180)), bit-exact integer formula (branch-free, as OpenCV's masks).
#[inline(always)]
pub fn bgr_to_hsv(b: u8, g: u8, r: u8) -> (u8, u8, u8) {
    let (b, g, r) = (b as i32, g as i32, r as i32);
    let v = b.max(g).max(r);
    let diff = v - b.min(g).min(r);
    let s = (diff * SDIV[v as usize] + 2048) >> 12;
    let vr = -((v == r) as i32);
    let vg = -((v == g) as i32);
    let h = (vr & (g - b)) + (!vr & ((vg & (b - r + 2 * diff)) + (!vg & (r - g + 4 * diff))));
    let h = (h * HDIV[diff as usize] + 2048) >> 12;
    let h = h + ((h >> 31) & 180);
    (h as u8, s as u8, v as u8)
}

/// Which of (t0, t1, t2, t3) becomes (B, G, R) for each sector k = 0..5 (index 6 guards H = 180).
const SECTOR: [[usize; 3]; 7] = [[1, 3, 0], [1, 0, 2], [3, 0, 1], [0, 2, 1], [0, 1, 3], [2, 1, 0], [2, 1, 0]];

/// OpenCV 8-bit HSV → BGR as executed by its vectorised path (float32, fused multiply-adds, truncation).
#[inline(always)]
pub fn hsv_to_bgr(h: u8, s: u8, v: u8) -> (u8, u8, u8) {
    let hf = h as f32 * (6.0f32 / 180.0f32);
    let sf = s as f32 * (1.0f32 / 255.0f32);
    let vf = v as f32 * (1.0f32 / 255.0f32);
    // h ≥ 0, so an integer conversion is trunc (and avoids a libm call on CPUs without SSE4.1)
    let ki = hf as i32;
    let f = hf - ki as f32;
    let t = [vf, vf * (1.0 - sf), vf * (-sf).mul_add(f, 1.0), vf * (-sf).mul_add(1.0 - f, 1.0)];
    let idx = SECTOR[(ki as usize).min(6)];
    ((t[idx[0]] * 255.0) as u8, (t[idx[1]] * 255.0) as u8, (t[idx[2]] * 255.0) as u8)
}

/// The whole jitter of one BGR pixel: BGR → HSV → tables → BGR. Pure; the device kernel mirrors it.
#[inline(always)]
pub fn hsv_pixel_bgr(lut: &HsvLut, b: u8, g: u8, r: u8) -> (u8, u8, u8) {
    let (h, s, v) = bgr_to_hsv(b, g, r);
    hsv_to_bgr(lut.hue[h as usize], lut.sat[s as usize], lut.val[v as usize])
}

#[inline(always)]
fn hwc_loop(data: &mut [u8], lut: &HsvLut) {
    // runs of equal pixels (padding, flat regions) reuse the previous result
    let mut last_in = [0u8; 3];
    let mut last_out = {
        let (b, g, r) = hsv_pixel_bgr(lut, 0, 0, 0);
        [b, g, r]
    };
    for px in data.chunks_exact_mut(3) {
        let cur = [px[0], px[1], px[2]];
        if cur != last_in {
            let (b, g, r) = hsv_pixel_bgr(lut, cur[0], cur[1], cur[2]);
            last_in = cur;
            last_out = [b, g, r];
        }
        px.copy_from_slice(&last_out);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn hwc_loop_fma(data: &mut [u8], lut: &HsvLut) {
    hwc_loop(data, lut)
}

/// Applies the jitter in place to interleaved BGR bytes (`h × w × 3`). Zero gains leave the bytes untouched.
pub fn apply_hsv_bgr_hwc(data: &mut [u8], gains: &HsvGains) {
    if gains.is_zero() {
        return;
    }
    let lut = HsvLut::new(gains);
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports FMA (checked above); the function only does safe slice work.
            unsafe { hwc_loop_fma(data, &lut) };
            return;
        }
    }
    hwc_loop(data, &lut)
}

/// Applies the jitter in place to one planar **RGB** image (`3 × h × w`, the collated batch layout).
pub fn apply_hsv_rgb_chw(img: &mut [u8], plane: usize, gains: &HsvGains) {
    if gains.is_zero() || img.len() < 3 * plane {
        return;
    }
    let lut = HsvLut::new(gains);
    let (r, rest) = img.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    for i in 0..plane {
        let (nb, ng, nr) = hsv_pixel_bgr(&lut, b[i], g[i], r[i]);
        b[i] = nb;
        g[i] = ng;
        r[i] = nr;
    }
}

/// Host reference of the fused device kernel: applies each image's gains to a u8 RGB batch `n × 3 × h × w`.
pub fn apply_hsv_batch_rgb_nchw(batch: &mut [u8], h: usize, w: usize, gains: &[HsvGains]) {
    let per = 3 * h * w;
    if per == 0 {
        return;
    }
    for (img, g) in batch.chunks_exact_mut(per).zip(gains) {
        apply_hsv_rgb_chw(img, h * w, g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn div_tables_match_round_half_even() {
        for i in 1..256 {
            let s = (255.0 * 4096.0 / i as f64).round_ties_even() as i32;
            let h = (180.0 * 4096.0 / (6.0 * i as f64)).round_ties_even() as i32;
            assert_eq!(SDIV[i], s, "sdiv {i}");
            assert_eq!(HDIV[i], h, "hdiv {i}");
        }
    }

    #[test]
    fn lut_spec_examples() {
        let l = HsvLut::new(&HsvGains { h: 0.01, s: -0.5, v: 0.2 });
        assert_eq!(l.hue[100], 101);
        assert_eq!(l.hue[179], 0);
        assert_eq!(l.sat[200], 100);
        assert_eq!(l.sat[0], 0);
        assert_eq!(l.val[200], 240);
        assert_eq!(l.val[250], 255);
        let l = HsvLut::new(&HsvGains { h: -0.01, s: 0.0, v: 0.0 });
        assert_eq!(l.hue[0], 178); // (0 − 1.8) mod 180 = 178.2
        assert_eq!(l.hue[2], 0);
    }

    #[test]
    fn known_conversions() {
        assert_eq!(bgr_to_hsv(0, 0, 255), (0, 255, 255));
        assert_eq!(bgr_to_hsv(0, 255, 0), (60, 255, 255));
        assert_eq!(bgr_to_hsv(255, 0, 0), (120, 255, 255));
        assert_eq!(bgr_to_hsv(128, 128, 128), (0, 0, 128));
        assert_eq!(bgr_to_hsv(0, 0, 0), (0, 0, 0));
        assert_eq!(hsv_to_bgr(0, 255, 255), (0, 0, 255));
        assert_eq!(hsv_to_bgr(60, 255, 255), (0, 255, 0));
        assert_eq!(hsv_to_bgr(120, 255, 255), (255, 0, 0));
        assert_eq!(hsv_to_bgr(0, 0, 200), (200, 200, 200));
        // all forward outputs in range
        for b in (0..256).step_by(5) {
            for g in (0..256).step_by(7) {
                for r in 0..256 {
                    let (h, _, _) = bgr_to_hsv(b as u8, g as u8, r as u8);
                    assert!(h < 180);
                }
            }
        }
    }

    /// Straightforward (branching) forms of docs/data.md §6.3, to check the branch-free ones on every input.
    fn ref_forward(b: u8, g: u8, r: u8) -> (u8, u8, u8) {
        let (b, g, r) = (b as i32, g as i32, r as i32);
        let v = b.max(g).max(r);
        let d = v - b.min(g).min(r);
        let s = (d * SDIV[v as usize] + 2048) >> 12;
        let h = if v == r {
            g - b
        } else if v == g {
            b - r + 2 * d
        } else {
            r - g + 4 * d
        };
        let mut h = (h * HDIV[d as usize] + 2048) >> 12;
        if h < 0 {
            h += 180;
        }
        (h as u8, s as u8, v as u8)
    }

    fn ref_backward(h: u8, s: u8, v: u8) -> (u8, u8, u8) {
        let hf = h as f32 * (6.0f32 / 180.0f32);
        let sf = s as f32 * (1.0f32 / 255.0f32);
        let vf = v as f32 * (1.0f32 / 255.0f32);
        let k = hf.trunc();
        let f = hf - k;
        let t0 = vf;
        let t1 = vf * (1.0 - sf);
        let t2 = vf * (-sf).mul_add(f, 1.0);
        let t3 = vf * (-sf).mul_add(1.0 - f, 1.0);
        let (b, g, r) = match k as i32 {
            0 => (t1, t3, t0),
            1 => (t1, t0, t2),
            2 => (t3, t0, t1),
            3 => (t0, t2, t1),
            4 => (t0, t1, t3),
            _ => (t2, t1, t0),
        };
        ((b * 255.0) as u8, (g * 255.0) as u8, (r * 255.0) as u8)
    }

    #[test]
    fn branch_free_conversions_match_spec_forms_exhaustively() {
        for b in 0..=255u8 {
            for g in 0..=255u8 {
                for r in 0..=255u8 {
                    assert_eq!(bgr_to_hsv(b, g, r), ref_forward(b, g, r), "bgr {b} {g} {r}");
                }
            }
        }
        for h in 0..180u8 {
            for s in 0..=255u8 {
                for v in 0..=255u8 {
                    assert_eq!(hsv_to_bgr(h, s, v), ref_backward(h, s, v), "hsv {h} {s} {v}");
                }
            }
        }
    }

    #[test]
    fn hwc_bgr_and_chw_rgb_paths_agree() {
        let (h, w) = (7usize, 33usize);
        let mut rng = Rng::new(5);
        let hwc: Vec<u8> = (0..h * w * 3).map(|_| rng.below(256) as u8).collect();
        let gains = [HsvGains::draw(&mut rng, 0.015, 0.7, 0.4), HsvGains::draw(&mut rng, 0.5, 0.9, 0.9)];
        let mut batch = Vec::new();
        let mut expect = Vec::new();
        for g in &gains {
            let mut a = hwc.clone();
            apply_hsv_bgr_hwc(&mut a, g);
            for c in [2usize, 1, 0] {
                for i in 0..h * w {
                    expect.push(a[i * 3 + c]);
                    batch.push(hwc[i * 3 + c]);
                }
            }
        }
        apply_hsv_batch_rgb_nchw(&mut batch, h, w, &gains);
        assert_eq!(batch, expect);
        // zero gains: untouched
        let mut a = hwc.clone();
        apply_hsv_bgr_hwc(&mut a, &HsvGains::default());
        assert_eq!(a, hwc);
    }
}

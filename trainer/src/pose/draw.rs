//! Minimal raster drawing on BGR images (boxes, skeleton lines, keypoint dots) for predictions.

use ptl_data::image::Image;

/// COCO skeleton (keypoint index pairs, 0-based).
pub const COCO_SKELETON: [(usize, usize); 19] = [
    (15, 13),
    (13, 11),
    (16, 14),
    (14, 12),
    (11, 12),
    (5, 11),
    (6, 12),
    (5, 6),
    (5, 7),
    (6, 8),
    (7, 9),
    (8, 10),
    (1, 2),
    (0, 1),
    (0, 2),
    (1, 3),
    (2, 4),
    (3, 5),
    (4, 6),
];

fn put(img: &mut Image, x: i64, y: i64, bgr: [u8; 3]) {
    if x >= 0 && y >= 0 && (x as u32) < img.w && (y as u32) < img.h {
        let i = (y as usize * img.w as usize + x as usize) * 3;
        img.data[i..i + 3].copy_from_slice(&bgr);
    }
}

/// A filled disc of radius `r`.
pub fn dot(img: &mut Image, cx: f32, cy: f32, r: i64, bgr: [u8; 3]) {
    let (cx, cy) = (cx.round() as i64, cy.round() as i64);
    for dy in -r..=r {
        for dx in -r..=r {
            if dx * dx + dy * dy <= r * r {
                put(img, cx + dx, cy + dy, bgr);
            }
        }
    }
}

/// A line of the given thickness (stamped discs along the segment).
pub fn line(img: &mut Image, x0: f32, y0: f32, x1: f32, y1: f32, thick: i64, bgr: [u8; 3]) {
    let n = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
    for i in 0..=n {
        let t = i as f32 / n as f32;
        dot(img, x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, thick / 2, bgr);
    }
}

/// An axis-aligned rectangle outline (x1, y1, x2, y2).
pub fn rect(img: &mut Image, b: [f32; 4], thick: i64, bgr: [u8; 3]) {
    line(img, b[0], b[1], b[2], b[1], thick, bgr);
    line(img, b[2], b[1], b[2], b[3], thick, bgr);
    line(img, b[2], b[3], b[0], b[3], thick, bgr);
    line(img, b[0], b[3], b[0], b[1], thick, bgr);
}

/// Draws one detection: box, skeleton between confident keypoints, keypoint dots.
pub fn person(img: &mut Image, bbox: [f32; 4], kpts: &[[f32; 3]], kpt_conf: f32) {
    let t = ((img.w.max(img.h) as f32) / 320.0).ceil().max(1.0) as i64;
    rect(img, bbox, t, [255, 56, 56]);
    for &(a, b) in COCO_SKELETON.iter() {
        if let (Some(p), Some(q)) = (kpts.get(a), kpts.get(b)) {
            if p[2] >= kpt_conf && q[2] >= kpt_conf {
                line(img, p[0], p[1], q[0], q[1], t, [51, 153, 255]);
            }
        }
    }
    for p in kpts.iter().filter(|p| p[2] >= kpt_conf) {
        dot(img, p[0], p[1], t + 1, [0, 255, 0]);
    }
}

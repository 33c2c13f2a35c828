//! Predictions drawn on BGR images with `plotters` (anti-aliased boxes, skeleton, keypoints and a
//! score label in the embedded font) instead of a hand-written rasteriser; colours follow
//! Ultralytics' pose palette.

use plotters::prelude::*;
use ptl_data::image::Image;

use super::plots::{ensure_font, plot_error};
use crate::Result;

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

/// Ultralytics' `pose_palette` (RGB).
const PALETTE: [(u8, u8, u8); 17] = [
    (255, 128, 0),
    (255, 153, 51),
    (255, 178, 102),
    (230, 230, 0),
    (255, 153, 255),
    (153, 204, 255),
    (255, 102, 255),
    (255, 51, 255),
    (102, 178, 255),
    (51, 153, 255),
    (255, 153, 153),
    (255, 102, 102),
    (255, 51, 51),
    (153, 255, 153),
    (102, 255, 102),
    (51, 255, 51),
    (0, 255, 0),
];
/// Palette index per skeleton limb and per keypoint (Ultralytics' `limb_color`, `kpt_color`).
const LIMB_COLOR: [usize; 19] = [9, 9, 9, 9, 7, 7, 7, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16];
const KPT_COLOR: [usize; 17] = [16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9];
/// Box colour of class 0 (Ultralytics' first class colour, #042AFF).
const BOX: RGBColor = RGBColor(4, 42, 255);

fn palette(i: usize) -> RGBColor {
    let (r, g, b) = PALETTE[i % PALETTE.len()];
    RGBColor(r, g, b)
}

/// One detection to draw: box (x1, y1, x2, y2), keypoints (x, y, confidence), optional score.
#[derive(Clone, Debug)]
pub struct Person<'a> {
    /// Box (x1, y1, x2, y2) in pixels.
    pub bbox: [f32; 4],
    /// Keypoints (x, y, visibility or score).
    pub kpts: &'a [[f32; 3]],
    /// Detection score, when drawn.
    pub score: Option<f32>,
    /// The class name written before the score (`person` for a one-class model).
    pub name: &'a str,
}

/// Draws every detection on `img`: box with a `<class name> <score>` label, skeleton between keypoints
/// of confidence ≥ `kpt_conf`, keypoint dots.
pub fn people(img: &mut Image, people: &[Person<'_>], kpt_conf: f32) -> Result<()> {
    ensure_font()?;
    let (w, h) = (img.w, img.h);
    let mut rgb = img.to_rgb();
    {
        let area = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        let err = |e: DrawingAreaErrorKind<_>| plot_error("prediction image", e);
        let t = (w.max(h) / 320).max(1);
        let font = (w.max(h) as f64 / 40.0).clamp(10.0, 28.0);
        let at = |x: f32, y: f32| (x.round() as i32, y.round() as i32);
        for p in people {
            let b = p.bbox;
            area.draw(&Rectangle::new([at(b[0], b[1]), at(b[2], b[3])], BOX.stroke_width(t))).map_err(err)?;
            if let Some(s) = p.score {
                let style = ("sans-serif", font).into_font().color(&WHITE);
                let label = format!("{} {s:.2}", p.name);
                let (tw, th) = area.estimate_text_size(&label, &style).map_err(err)?;
                let (x, y) = at(b[0], b[1]);
                let top = if y >= th as i32 + 2 { y - th as i32 - 2 } else { y };
                area.draw(&Rectangle::new([(x, top), (x + tw as i32 + 4, top + th as i32 + 2)], BOX.filled())).map_err(err)?;
                area.draw(&Text::new(label, (x + 2, top + 1), style)).map_err(err)?;
            }
            let shown = |k: usize| p.kpts.get(k).filter(|q| q[2] >= kpt_conf && q[0] > 0.0 && q[1] > 0.0);
            for (l, &(a, c)) in COCO_SKELETON.iter().enumerate() {
                if let (Some(q), Some(r)) = (shown(a), shown(c)) {
                    let style = palette(LIMB_COLOR[l]).stroke_width(t);
                    area.draw(&PathElement::new(vec![at(q[0], q[1]), at(r[0], r[1])], style)).map_err(err)?;
                }
            }
            for k in 0..p.kpts.len() {
                if let Some(q) = shown(k) {
                    let c = palette(KPT_COLOR.get(k).copied().unwrap_or(16));
                    area.draw(&Circle::new(at(q[0], q[1]), t as i32 + 2, c.filled())).map_err(err)?;
                }
            }
        }
        area.present().map_err(err)?;
    }
    *img = Image::from_rgb(w, h, rgb);
    Ok(())
}

/// Draws one detection without a score label (see [`people`]).
pub fn person(img: &mut Image, bbox: [f32; 4], kpts: &[[f32; 3]], kpt_conf: f32) -> Result<()> {
    people(img, &[Person { bbox, kpts, score: None, name: "" }], kpt_conf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_box_skeleton_and_label() {
        let mut img = Image::filled(96, 96, [0, 0, 0]);
        let kpts: Vec<[f32; 3]> = (0..17).map(|k| [30.0 + k as f32 * 2.0, 30.0 + k as f32 * 3.0, if k == 3 { 0.1 } else { 0.9 }]).collect();
        people(&mut img, &[Person { bbox: [10.0, 20.0, 80.0, 90.0], kpts: &kpts, score: Some(0.87), name: "person" }], 0.5).unwrap();
        // The box's left edge (BGR of #042AFF) and the label band above it.
        let px = |x: u32, y: u32| &img.data[((y * img.w + x) * 3) as usize..((y * img.w + x) * 3 + 3) as usize];
        assert_eq!(px(10, 60), &[255, 42, 4]);
        assert!((0..20).any(|y| px(12, y) == [255, 42, 4]), "label band above the box");
        let green = img.data.chunks_exact(3).filter(|p| p[1] > 200 && p[0] < 80 && p[2] < 80).count();
        assert!(green > 10, "head keypoints in palette green ({green} px)");
        let untouched = Image::filled(96, 96, [0, 0, 0]);
        assert_ne!(img, untouched);
    }
}

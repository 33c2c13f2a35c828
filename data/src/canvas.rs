//! Where a warp reads its source: a stored image, or a mosaic canvas whose rows are composed from
//! its four tiles when the warp asks for them. The default affine warp (scale and translation)
//! reads its source one row at a time, so a mosaic's 2s × 2s canvas (4.9 MB at 640 px) need not
//! be filled and copied into memory first: the rows it reads are built in a small buffer, with
//! the same bytes the stored canvas would hold.

use std::borrow::Cow;

use crate::augment::{recycle, take_buffer, PAD_VALUE};
use crate::image::Image;

/// A warp's source image, B, G, R per pixel: read a row at a time, or whole.
pub trait SourceRows {
    /// (width, height) in pixels.
    fn size(&self) -> (u32, u32);

    /// Row `y < height` (`width × 3` bytes), composed into `scratch` (at least that long) where
    /// the source does not store it whole.
    fn row<'a>(&'a self, y: usize, scratch: &'a mut [u8]) -> &'a [u8];

    /// The whole image (the per-pixel warps read it in any order); give it back with
    /// [`release`] so that a built buffer is reused.
    fn image(&self) -> Cow<'_, Image>;
}

/// Returns an image [`SourceRows::image`] built to this thread's buffer pool.
pub fn release(img: Cow<'_, Image>) {
    if let Cow::Owned(img) = img {
        recycle(img);
    }
}

impl SourceRows for Image {
    fn size(&self) -> (u32, u32) {
        (self.w, self.h)
    }

    fn row<'a>(&'a self, y: usize, _scratch: &'a mut [u8]) -> &'a [u8] {
        let stride = self.stride();
        &self.data[y * stride..(y + 1) * stride]
    }

    fn image(&self) -> Cow<'_, Image> {
        Cow::Borrowed(self)
    }
}

/// Where one mosaic tile lies: its `w × h` pixels from (`src_x`, `src_y`) of the tile go to
/// (`x`, `y`) of the canvas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TilePlacement {
    /// Canvas column of the tile's first copied pixel.
    pub x: usize,
    /// Canvas row of the tile's first copied row.
    pub y: usize,
    /// Tile column of its first copied pixel.
    pub src_x: usize,
    /// Tile row of its first copied row.
    pub src_y: usize,
    /// Copied width in pixels.
    pub w: usize,
    /// Copied height in rows.
    pub h: usize,
}

/// A square mosaic canvas of `size × size` pixels: four tiles, in order, on the fill value 114.
#[derive(Clone, Debug)]
pub struct MosaicCanvas<'a> {
    /// Side of the canvas in pixels.
    pub size: u32,
    /// The tiles and where each lies (a later tile covers an earlier one where they meet).
    pub tiles: [(&'a Image, TilePlacement); 4],
}

impl MosaicCanvas<'_> {
    /// The canvas as a stored image (from this thread's buffer pool).
    pub fn to_image(&self) -> Image {
        let cs = self.size as usize;
        let mut canvas = Image { w: self.size, h: self.size, data: take_buffer(cs * cs * 3, PAD_VALUE) };
        for (y, row) in canvas.data.chunks_exact_mut(cs * 3).enumerate() {
            self.compose_row(y, row);
        }
        canvas
    }

    /// Writes canvas row `y` into `out` (`size × 3` bytes): 114, then the tiles that cross it.
    #[inline(always)]
    fn compose_row(&self, y: usize, out: &mut [u8]) {
        out.fill(PAD_VALUE);
        for (img, p) in &self.tiles {
            if (p.y..p.y + p.h).contains(&y) {
                let s0 = (p.src_y + y - p.y) * img.stride() + p.src_x * 3;
                out[p.x * 3..(p.x + p.w) * 3].copy_from_slice(&img.data[s0..s0 + p.w * 3]);
            }
        }
    }
}

impl SourceRows for MosaicCanvas<'_> {
    fn size(&self) -> (u32, u32) {
        (self.size, self.size)
    }

    #[inline(always)]
    fn row<'a>(&'a self, y: usize, scratch: &'a mut [u8]) -> &'a [u8] {
        let out = &mut scratch[..self.size as usize * 3];
        self.compose_row(y, out);
        out
    }

    fn image(&self) -> Cow<'_, Image> {
        Cow::Owned(self.to_image())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn noise(w: u32, h: u32, rng: &mut Rng) -> Image {
        let mut img = Image::filled(w, h, [0, 0, 0]);
        img.data.iter_mut().for_each(|v| *v = rng.below(256) as u8);
        img
    }

    #[test]
    fn composed_rows_equal_the_stored_canvas() {
        let mut rng = Rng::new(5);
        let tiles: Vec<Image> = (0..4).map(|i| noise(20 + i * 3, 17 + i * 2, &mut rng)).collect();
        let place = |x, y, src_x, src_y, w, h| TilePlacement { x, y, src_x, src_y, w, h };
        let canvas = MosaicCanvas {
            size: 48,
            tiles: [
                (&tiles[0], place(0, 3, 2, 1, 18, 16)),
                (&tiles[1], place(18, 0, 0, 2, 23, 17)),
                (&tiles[2], place(5, 19, 1, 0, 13, 21)),
                // overlaps tile 2: the later tile wins in both paths
                (&tiles[3], place(10, 25, 0, 0, 29, 23)),
            ],
        };
        let stored = canvas.to_image();
        let mut scratch = vec![0u8; 48 * 3];
        for y in 0..48 {
            assert_eq!(canvas.row(y, &mut scratch), stored.row(y, &mut []), "row {y}");
        }
        assert_eq!(canvas.image().as_ref(), &stored);
    }

    /// The loader's path (rows composed from the tiles) gives the stored canvas's bytes, for the
    /// separable warp (scale, translation) and the per-pixel ones (rotation, shear, perspective).
    #[test]
    fn warping_the_composed_mosaic_equals_warping_the_stored_one() {
        use crate::augment::{mosaic4_layout, random_perspective, AffineDraw};
        use crate::labels::Labels;
        let mut rng = Rng::new(11);
        let tiles: Vec<Image> = (0..4).map(|i| noise(40 + 7 * i, 52 - 5 * i, &mut rng)).collect();
        let labels = Labels::default();
        for trial in 0..12 {
            let (yc, xc) = crate::augment::draw_mosaic_centre(&mut rng, 48);
            let (canvas, inst) =
                mosaic4_layout([(&tiles[0], &labels), (&tiles[1], &labels), (&tiles[2], &labels), (&tiles[3], &labels)], 17, 48, yc, xc);
            let mut d =
                AffineDraw { scale: rng.uniform(0.5, 1.5), tx: rng.uniform(0.4, 0.6), ty: rng.uniform(0.4, 0.6), ..Default::default() };
            match trial % 3 {
                1 => (d.angle, d.shear_x) = (rng.uniform(-10.0, 10.0), rng.uniform(-5.0, 5.0)),
                2 => d.persp_x = 0.0005,
                _ => {}
            }
            let stored = canvas.to_image();
            assert_eq!(random_perspective(&canvas, &inst, &d, 48), random_perspective(&stored, &inst, &d, 48), "{d:?}");
        }
    }
}

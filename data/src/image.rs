//! 8-bit BGR images: decoding (JPEG/PNG with EXIF orientation), OpenCV-style bilinear resize, JPEG writing.
//!
//! Images are kept as interleaved **BGR** (height × width × 3) through the whole augmentation pipeline, exactly as
//! the reference (OpenCV) does; the final batch formatting reverses the channel axis to RGB (docs/data.md §6.5).

use std::io::Cursor;
use std::path::Path;

use crate::error::{DataError, Result};

/// Interleaved 8-bit BGR image, row-major `h × w × 3`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    /// Width in pixels.
    pub w: u32,
    /// Height in pixels.
    pub h: u32,
    /// `h × w × 3` bytes, B, G, R per pixel.
    pub data: Vec<u8>,
}

impl Image {
    /// Image filled with one BGR colour.
    pub fn filled(w: u32, h: u32, bgr: [u8; 3]) -> Self {
        let n = w as usize * h as usize * 3;
        let data = if bgr[0] == bgr[1] && bgr[1] == bgr[2] {
            vec![bgr[0]; n]
        } else {
            let mut data = vec![0u8; n];
            for px in data.chunks_exact_mut(3) {
                px.copy_from_slice(&bgr);
            }
            data
        };
        Image { w, h, data }
    }

    /// Bytes per row.
    #[inline]
    pub fn stride(&self) -> usize {
        self.w as usize * 3
    }

    /// Converts an RGB buffer to BGR.
    pub fn from_rgb(w: u32, h: u32, mut rgb: Vec<u8>) -> Self {
        for px in rgb.chunks_exact_mut(3) {
            px.swap(0, 2);
        }
        Image { w, h, data: rgb }
    }

    /// RGB copy of the pixels.
    pub fn to_rgb(&self) -> Vec<u8> {
        let mut out = self.data.clone();
        for px in out.chunks_exact_mut(3) {
            px.swap(0, 2);
        }
        out
    }
}

/// What decoding found besides the pixels.
#[derive(Clone, Debug, Default)]
pub struct DecodeInfo {
    /// A JPEG whose data does not end in the FFD9 marker (decoded leniently, like the reference's repair).
    pub truncated_jpeg: bool,
}

/// Minimum image side accepted (docs/data.md §1).
pub const MIN_SIDE: u32 = 10;

/// Largest image accepted, in pixels (width × height from the file's header, checked before any
/// pixel memory is allocated): PIL's decompression-bomb limit, about 179 megapixels (13,377 px
/// square) — 0.5 GB of BGR pixels. A larger image is skipped as oversize, never decoded.
pub const MAX_PIXELS: u64 = 178_956_970;

/// Rejects a header size above [`MAX_PIXELS`].
pub fn check_image_size(w: u32, h: u32, path: &Path) -> Result<()> {
    let pixels = w as u64 * h as u64;
    if pixels > MAX_PIXELS {
        return Err(DataError::ImageTooLarge { path: path.to_path_buf(), w, h, max_pixels: MAX_PIXELS });
    }
    Ok(())
}

/// Decodes JPEG or PNG bytes to BGR, applying the EXIF orientation.
pub fn decode_bytes(bytes: &[u8], path: &Path) -> Result<(Image, DecodeInfo)> {
    use image::ImageDecoder;
    let err = |m: String| DataError::Decode { path: path.to_path_buf(), message: m };
    let mut reader = image::ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| err(e.to_string()))?;
    // Bound what the decoder may allocate (the header can claim any size): the pixels of the
    // largest accepted image plus room for the decoder's own buffers.
    let mut limits = image::Limits::default();
    limits.max_alloc = Some(MAX_PIXELS * 4 + (64 << 20));
    reader.limits(limits);
    let format = reader.format();
    match format {
        Some(image::ImageFormat::Jpeg) | Some(image::ImageFormat::Png) => {}
        Some(f) => return Err(err(format!("unsupported format {f:?}"))),
        None => return Err(err("unknown image format".into())),
    }
    let mut info = DecodeInfo::default();
    if format == Some(image::ImageFormat::Jpeg) && !bytes.ends_with(&[0xFF, 0xD9]) {
        info.truncated_jpeg = true;
    }
    let mut decoder = reader.into_decoder().map_err(|e| err(e.to_string()))?;
    let (hw, hh) = decoder.dimensions();
    check_image_size(hw, hh, path)?;
    let orientation = decoder.orientation().unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut img = image::DynamicImage::from_decoder(decoder).map_err(|e| err(e.to_string()))?;
    img.apply_orientation(orientation);
    let rgb = img.to_rgb8();
    let (w, h) = rgb.dimensions();
    if w < MIN_SIDE || h < MIN_SIDE {
        return Err(err(format!("image size {w}x{h} is below the {MIN_SIDE}px minimum")));
    }
    Ok((Image::from_rgb(w, h, rgb.into_raw()), info))
}

/// The largest image file read (an uncompressed 16-bit TIFF at the pixel limit is below this).
pub const MAX_FILE_BYTES: u64 = 2 << 30;

/// Reads and decodes an image file.
pub fn decode_file(path: &Path) -> Result<(Image, DecodeInfo)> {
    let bytes = ptl_files::read_limited(path, MAX_FILE_BYTES, "image file")?;
    decode_bytes(&bytes, path)
}

/// Writes a BGR image as JPEG with the given quality.
pub fn write_jpeg(img: &Image, path: &Path, quality: u8) -> Result<()> {
    let rgb = img.to_rgb();
    let mut buf = Vec::new();
    let mut enc = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut buf, quality);
    enc.encode(&rgb, img.w, img.h, image::ExtendedColorType::Rgb8)
        .map_err(|e| DataError::Encode { path: path.to_path_buf(), message: e.to_string() })?;
    std::fs::write(path, &buf).map_err(|e| DataError::io(path, e))
}

/// Writes a BGR image as PNG.
pub fn write_png(img: &Image, path: &Path) -> Result<()> {
    let rgb = img.to_rgb();
    image::save_buffer(path, &rgb, img.w, img.h, image::ExtendedColorType::Rgb8)
        .map_err(|e| DataError::Encode { path: path.to_path_buf(), message: e.to_string() })
}

/// Source taps of OpenCV's INTER_LINEAR resize along one axis: (index0, index1, weight0, weight1), weights in 11-bit
/// fixed point rounded from OpenCV's float32 fractions.
fn linear_taps(src: usize, dst: usize) -> Vec<(usize, usize, i32, i32)> {
    let scale = 1.0 / (dst as f64 / src as f64);
    (0..dst)
        .map(|d| {
            let mut f = ((d as f64 + 0.5) * scale - 0.5) as f32;
            let mut i0 = floor_i32(f);
            f -= i0 as f32;
            if i0 < 0 {
                i0 = 0;
                f = 0.0;
            }
            if i0 >= src as i32 - 1 {
                i0 = src as i32 - 1;
                f = 0.0;
            }
            let i0 = i0 as usize;
            let w0 = ((1.0 - f) * 2048.0).round_ties_even() as i32;
            let w1 = (f * 2048.0).round_ties_even() as i32;
            (i0, (i0 + 1).min(src - 1), w0, w1)
        })
        .collect()
}

/// floor() of an f32 in i32 range without a libm call.
#[inline(always)]
pub(crate) fn floor_i32(v: f32) -> i32 {
    let i = v as i32;
    if (i as f32) > v {
        i - 1
    } else {
        i
    }
}

/// Bilinear resize with OpenCV INTER_LINEAR semantics for 8-bit images (half-pixel centres, edge replication, no
/// anti-aliasing): 11-bit fixed-point weights, horizontal pass in integers, vertical pass as OpenCV's vectorised
/// kernel `((b0·(r0 >> 4)) >> 16 + (b1·(r1 >> 4)) >> 16 + 2) >> 2`. Matched OpenCV 5.0 bit-exactly on down-scales
/// in the goldens; up-scales differ by ±1 on a few tenths of a percent of the bytes.
pub fn resize_bilinear(src: &Image, nw: u32, nh: u32) -> Image {
    if nw == src.w && nh == src.h {
        return src.clone();
    }
    if src.w == 0 || src.h == 0 || nw == 0 || nh == 0 {
        return Image::filled(nw, nh, [0, 0, 0]);
    }
    let (sw, sh) = (src.w as usize, src.h as usize);
    let (dw, dh) = (nw as usize, nh as usize);
    let xt = linear_taps(sw, dw);
    let yt = linear_taps(sh, dh);
    let mut out = vec![0u8; dw * dh * 3];
    let hpass = |y: usize, buf: &mut Vec<i32>| {
        let row = &src.data[y * sw * 3..(y + 1) * sw * 3];
        for (x, &(x0, x1, a0, a1)) in xt.iter().enumerate() {
            for c in 0..3 {
                buf[x * 3 + c] = row[x0 * 3 + c] as i32 * a0 + row[x1 * 3 + c] as i32 * a1;
            }
        }
    };
    let mut rows: [(usize, Vec<i32>); 2] = [(usize::MAX, vec![0; dw * 3]), (usize::MAX, vec![0; dw * 3])];
    for (y, &(y0, y1, b0, b1)) in yt.iter().enumerate() {
        for (slot, yy) in [(0usize, y0), (1usize, y1)] {
            if rows[slot].0 != yy {
                let other = 1 - slot;
                if rows[other].0 == yy {
                    let (a, b) = rows.split_at_mut(1);
                    if slot == 0 {
                        a[0].1.copy_from_slice(&b[0].1);
                    } else {
                        b[0].1.copy_from_slice(&a[0].1);
                    }
                } else {
                    hpass(yy, &mut rows[slot].1);
                }
                rows[slot].0 = yy;
            }
        }
        let (r0, r1) = (&rows[0].1, &rows[1].1);
        let orow = &mut out[y * dw * 3..(y + 1) * dw * 3];
        for i in 0..dw * 3 {
            let v = (((b0 * (r0[i] >> 4)) >> 16) + ((b1 * (r1[i] >> 4)) >> 16) + 2) >> 2;
            orow[i] = v.clamp(0, 255) as u8;
        }
    }
    Image { w: nw, h: nh, data: out }
}

/// The load-time resize of docs/data.md §5: long side to `imgsz` (aspect kept), `min(ceil(side·r), imgsz)`.
pub fn load_resize_shape(w0: u32, h0: u32, imgsz: u32) -> (u32, u32) {
    if w0 == 0 || h0 == 0 {
        return (w0, h0);
    }
    let r = imgsz as f64 / w0.max(h0) as f64;
    if r == 1.0 {
        return (w0, h0);
    }
    let w = ((w0 as f64 * r).ceil() as u32).clamp(1, imgsz);
    let h = ((h0 as f64 * r).ceil() as u32).clamp(1, imgsz);
    (w, h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_resize_examples() {
        assert_eq!(load_resize_shape(640, 427, 640), (640, 427));
        assert_eq!(load_resize_shape(500, 480, 640), (640, 615));
        assert_eq!(load_resize_shape(1280, 960, 640), (640, 480));
    }

    #[test]
    fn resize_constant_and_identity() {
        let img = Image::filled(37, 21, [10, 200, 99]);
        let r = resize_bilinear(&img, 64, 40);
        assert!(r.data.chunks(3).all(|p| p == [10, 200, 99]));
        assert_eq!(resize_bilinear(&img, 37, 21), img);
    }

    #[test]
    fn resize_half_pixel_semantics() {
        // 1-row ramp 0,100,200,... downscale by 2: dst x samples src at 2x+0.5 → mean of pixels 2x, 2x+1.
        let w = 8u32;
        let mut data = Vec::new();
        for x in 0..w {
            data.extend_from_slice(&[(x * 20) as u8; 3]);
        }
        let img = Image { w, h: 1, data };
        let r = resize_bilinear(&img, 4, 1);
        let got: Vec<u8> = r.data.chunks(3).map(|p| p[0]).collect();
        assert_eq!(got, vec![10, 50, 90, 130]);
        // upscale ×2: dst 0 → src −0.25 clamped to 0; dst 1 → src 0.25
        let r = resize_bilinear(&img, 16, 1);
        let got: Vec<u8> = r.data.chunks(3).map(|p| p[0]).collect();
        assert_eq!(&got[..4], &[0, 5, 15, 25]);
        assert_eq!(got[15], 140);
    }

    #[test]
    fn png_roundtrip_and_bgr_order() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.png");
        let img = Image::filled(12, 11, [1, 2, 3]);
        write_png(&img, &p).unwrap();
        let (back, info) = decode_file(&p).unwrap();
        assert_eq!(back, img);
        assert!(!info.truncated_jpeg);
    }

    #[test]
    fn tiny_and_garbage_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.png");
        write_png(&Image::filled(5, 20, [0, 0, 0]), &p).unwrap();
        assert!(decode_file(&p).is_err());
        assert!(decode_bytes(b"not an image at all", Path::new("x.jpg")).is_err());
    }
}

//! Pixel operations against OpenCV goldens made by `scripts/make_cv2_goldens.py` (cv2 5.0.0 on the GPU machine):
//! bilinear resize, warpAffine/warpPerspective with Ultralytics-built matrices, and the RandomHSV LUT method.

use std::path::{Path, PathBuf};

use ptl_data::augment::{affine_matrix, warp, AffineDraw};
use ptl_data::image::{decode_file, resize_bilinear, Image};
use ptl_data::{apply_hsv_bgr_hwc, HsvGains};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/cv2_goldens")
}

fn load(name: &str) -> Image {
    decode_file(&dir().join(name)).unwrap().0
}

fn cases() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap()
}

/// (max abs difference, number of differing bytes)
fn diff(a: &Image, b: &Image) -> (u8, usize) {
    assert_eq!((a.w, a.h), (b.w, b.h));
    let mut mx = 0u8;
    let mut n = 0;
    for (x, y) in a.data.iter().zip(&b.data) {
        let d = x.abs_diff(*y);
        mx = mx.max(d);
        n += (d != 0) as usize;
    }
    (mx, n)
}

#[test]
fn resize_matches_opencv_within_one_level() {
    let src = load("input.png");
    for c in cases()["resize"].as_array().unwrap() {
        let (w, h) = (c["w"].as_u64().unwrap() as u32, c["h"].as_u64().unwrap() as u32);
        let want = load(c["file"].as_str().unwrap());
        let got = resize_bilinear(&src, w, h);
        let (mx, n) = diff(&got, &want);
        eprintln!("resize {w}x{h}: max diff {mx}, {n} of {} bytes differ", got.data.len());
        assert!(mx <= 1, "resize {w}x{h}: max diff {mx}");
        // OpenCV's fixed-point arithmetic: exact on down-scales, rare ±1 on up-scales
        assert!(n * 200 <= got.data.len(), "resize {w}x{h}: {n} of {} bytes differ", got.data.len());
    }
}

#[test]
fn warp_matrices_and_pixels_match_opencv() {
    let src = load("input.png");
    for c in cases()["warp"].as_array().unwrap() {
        let p = &c["params"];
        let f = |k: &str| p[k].as_f64().unwrap();
        let persp = p["persp"].as_array().unwrap();
        let d = AffineDraw {
            persp_x: persp[0].as_f64().unwrap(),
            persp_y: persp[1].as_f64().unwrap(),
            angle: f("angle"),
            scale: f("scale"),
            shear_x: f("shear_x"),
            shear_y: f("shear_y"),
            tx: f("tx"),
            ty: f("ty"),
        };
        let m = affine_matrix(&d, src.w, src.h, 96, 96);
        let want_m: Vec<Vec<f32>> =
            c["M"].as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()).collect();
        for i in 0..3 {
            for j in 0..3 {
                let (a, b) = (m[i][j], want_m[i][j]);
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "M[{i}][{j}] {a} vs {b} ({d:?})");
            }
        }
        let is_persp = d.persp_x != 0.0 || d.persp_y != 0.0;
        let mut mf = [[0f32; 3]; 3];
        for i in 0..3 {
            for j in 0..3 {
                mf[i][j] = want_m[i][j];
            }
        }
        let got = warp(&src, &mf, 96, 96, is_persp);
        let want = load(c["file"].as_str().unwrap());
        let (mx, n) = diff(&got, &want);
        eprintln!("{}: max diff {mx}, {n} of {} bytes differ", c["file"], got.data.len());
        assert_eq!((mx, n), (0, 0), "{}: warp must be bit-exact", c["file"]);
    }
}

#[test]
fn hsv_matches_opencv_bit_exactly() {
    let src = load("input.png");
    for c in cases()["hsv"].as_array().unwrap() {
        let r: Vec<f64> = c["r"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let mut got = src.clone();
        apply_hsv_bgr_hwc(&mut got.data, &HsvGains { h: r[0], s: r[1], v: r[2] });
        let want = load(c["file"].as_str().unwrap());
        assert_eq!(diff(&got, &want), (0, 0), "{}", c["file"]);
    }
}

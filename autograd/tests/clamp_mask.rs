//! The gradient of `clamp` in f32 and f64 takes its mask from the clamp's own output (inside
//! exactly when the clamp left the element as it was); these tests hold it to the two-comparison
//! mask it replaced — bounds, values next to them, signed zeros, infinities, NaN, equal bounds and
//! crossed ones (which keep the comparisons) — byte for byte.

use ptl_autograd::{DType, Device, Tensor};

/// The values to clamp for bounds `lo`, `hi`: the bounds, their neighbours, zeros of both signs,
/// infinities, NaN and a spread.
fn values(lo: f64, hi: f64) -> Vec<f64> {
    let mut v = vec![0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 1e-30, -1e-30, 7.25, -7.25];
    for b in [lo, hi] {
        if b.is_finite() {
            let f = b as f32;
            v.extend([b, f64::from(f), f64::from(f.next_up()), f64::from(f.next_down()), b.next_up(), b.next_down()]);
        }
    }
    v.extend((0..40).map(|i| -5.0 + 0.25 * f64::from(i)));
    v
}

/// The gradient the two comparisons give: g where lo ≤ x ≤ hi (in `dt`), else 0.
fn two_comparisons(x: &Tensor, g: &Tensor, lo: f64, hi: f64) -> Vec<u8> {
    let inside = x.ge_scalar(lo).unwrap().mul(&x.le_scalar(hi).unwrap()).unwrap();
    g.mul(&inside.to_dtype(g.dtype()).unwrap()).unwrap().to_bytes().unwrap()
}

/// Checks `clamp`'s gradient against [`two_comparisons`] on `device`.
pub fn clamp_gradient_matches_two_comparisons(device: Device) {
    let bounds = [(0.0, 1.0), (-0.5, 0.1), (0.0, f64::INFINITY), (f64::NEG_INFINITY, 3.0), (2.0, 2.0), (1e-9, 4.0), (1.0, 0.0)];
    for dt in [DType::F32, DType::F64] {
        for (lo, hi) in bounds {
            let v = values(lo, hi);
            let n = v.len();
            let x = Tensor::from_vec(v, n, Device::Cpu).unwrap().to_dtype(dt).unwrap().to_device(device).unwrap();
            let g = Tensor::from_vec((0..n).map(|i| 1.0 + i as f64 * 0.5).collect::<Vec<f64>>(), n, Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
                .to_device(device)
                .unwrap();
            let xr = x.detach().requires_grad_(true).unwrap();
            xr.clamp(lo, hi).unwrap().backward_with(&g).unwrap();
            let got = xr.grad().unwrap().to_bytes().unwrap();
            assert!(got == two_comparisons(&x, &g, lo, hi), "{dt} clamp({lo}, {hi}) on {device:?}");
        }
    }
}

#[test]
fn clamp_gradient_matches_two_comparisons_on_the_cpu() {
    clamp_gradient_matches_two_comparisons(Device::Cpu);
}

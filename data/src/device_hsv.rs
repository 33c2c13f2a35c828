//! The fused device HSV jitter (docs/data.md §6.3): one kernel launch applies every image's gains to an
//! uploaded u8 RGB batch, byte-identical to the CPU reference [`crate::apply_hsv_batch_rgb_nchw`].
//!
//! Only the random part (the per-image [`HsvGains`]) is drawn on the host; it becomes three 256-byte
//! tables per image ([`HsvLut`], built in float64 exactly as on the CPU) that travel with the batch.
//! The per-pixel work mirrors [`crate::hsv::hsv_pixel_bgr`]: integer BGR→HSV with the same fixed-point
//! division tables, and HSV→BGR in float32 with explicitly rounded operations (`__fmul_rn`,
//! `__fsub_rn`, `__fmaf_rn`) so the compiler can neither contract nor reorder them.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use ptl_autograd::internal::cuda::{KernelArg, UserKernel};
use ptl_autograd::{DType, Device, Tensor};

use crate::error::{DataError, Result};
use crate::hsv::{HsvGains, HsvLut, HDIV, SDIV};

/// Bytes per image in the table upload: hue, sat, val tables and an "apply" flag (zero gains leave
/// the image untouched, as on the CPU), padded to a multiple of 16.
const LUT_STRIDE: usize = 784;

fn kernel_source() -> String {
    let table = |t: &[i32; 256]| t.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",");
    // f32 constants passed as exact bit patterns, so no compiler folds them differently from Rust.
    let bits = |v: f32| format!("__int_as_float({:#010x})", v.to_bits());
    format!(
        r#"
typedef unsigned char u8;
typedef unsigned int u32;
__constant__ int SDIV[256] = {{{sdiv}}};
__constant__ int HDIV[256] = {{{hdiv}}};
// (B, G, R) taken from (t0, t1, t2, t3) per sector; row 6 guards H = 180.
__constant__ u8 SECTOR[7][3] = {{{{1,3,0}},{{1,0,2}},{{3,0,1}},{{0,2,1}},{{0,1,3}},{{2,1,0}},{{2,1,0}}}};

__device__ __forceinline__ u8 to_u8(float x) {{
    u32 v = __float2uint_rz(x);   // truncation; negative -> 0 as Rust's saturating cast
    return (u8)(v > 255u ? 255u : v);
}}

extern "C" __global__ void hsv_jitter_rgb_nchw(const u8* x, const u8* luts, u8* y, u32 n, u32 plane) {{
    const unsigned long long total = (unsigned long long)n * plane;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {{
        const u32 img = (u32)(i / plane);
        const u32 p = (u32)(i - (unsigned long long)img * plane);
        const unsigned long long base = (unsigned long long)img * 3 * plane + p;
        const u8* lut = luts + (unsigned long long)img * {stride};
        const u8 r8 = x[base], g8 = x[base + plane], b8 = x[base + 2ull * plane];
        if (!lut[768]) {{ y[base] = r8; y[base + plane] = g8; y[base + 2ull * plane] = b8; continue; }}
        // OpenCV 8-bit BGR -> HSV, branch-free integer form
        const int b = b8, g = g8, r = r8;
        const int v = max(max(b, g), r);
        const int diff = v - min(min(b, g), r);
        const int s = (diff * SDIV[v] + 2048) >> 12;
        const int vr = -(int)(v == r);
        const int vg = -(int)(v == g);
        int h = (vr & (g - b)) + (~vr & ((vg & (b - r + 2 * diff)) + (~vg & (r - g + 4 * diff))));
        h = (h * HDIV[diff] + 2048) >> 12;
        h += (h >> 31) & 180;
        // tables, then OpenCV's vectorised HSV -> BGR in float32
        const float hf = __fmul_rn((float)lut[h], {six_over_180});
        const float sf = __fmul_rn((float)lut[256 + s], {one_over_255});
        const float vf = __fmul_rn((float)lut[512 + v], {one_over_255});
        const int ki = (int)hf;   // hf >= 0: truncation
        const float f = __fsub_rn(hf, (float)ki);
        float t[4];
        t[0] = vf;
        t[1] = __fmul_rn(vf, __fsub_rn(1.0f, sf));
        t[2] = __fmul_rn(vf, __fmaf_rn(-sf, f, 1.0f));
        t[3] = __fmul_rn(vf, __fmaf_rn(-sf, __fsub_rn(1.0f, f), 1.0f));
        const u8* idx = SECTOR[ki < 6 ? ki : 6];
        y[base + 2ull * plane] = to_u8(__fmul_rn(t[idx[0]], 255.0f));
        y[base + plane] = to_u8(__fmul_rn(t[idx[1]], 255.0f));
        y[base] = to_u8(__fmul_rn(t[idx[2]], 255.0f));
    }}
}}
"#,
        sdiv = table(&SDIV),
        hdiv = table(&HDIV),
        stride = LUT_STRIDE,
        six_over_180 = bits(6.0f32 / 180.0f32),
        one_over_255 = bits(1.0f32 / 255.0f32),
    )
}

/// The per-image tables of `gains` in the kernel's layout (`n × 784` bytes).
fn lut_bytes(gains: &[HsvGains]) -> Vec<u8> {
    let mut out = vec![0u8; gains.len() * LUT_STRIDE];
    for (g, dst) in gains.iter().zip(out.chunks_exact_mut(LUT_STRIDE)) {
        if g.is_zero() {
            continue;
        }
        let lut = HsvLut::new(g);
        dst[..256].copy_from_slice(&lut.hue);
        dst[256..512].copy_from_slice(&lut.sat);
        dst[512..768].copy_from_slice(&lut.val);
        dst[768] = 1;
    }
    out
}

/// The compiled kernel of `device`: built once per process and device (the training loop calls
/// this every batch, so neither the source nor the function lookup is redone per step).
fn kernel_for(device: Device) -> Result<UserKernel> {
    static KERNELS: OnceLock<Mutex<HashMap<Device, UserKernel>>> = OnceLock::new();
    let mut cache = KERNELS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(k) = cache.get(&device) {
        return Ok(k.clone());
    }
    let k = UserKernel::compile(device, "ptl_data_hsv", &kernel_source(), "hsv_jitter_rgb_nchw").map_err(device_err)?;
    cache.insert(device, k.clone());
    Ok(k)
}

fn device_err(e: ptl_autograd::Error) -> DataError {
    DataError::Device(e.to_string())
}

/// Applies each image's gains to a u8 RGB batch `images` (`N × 3 × H × W` on a CUDA device) in one
/// kernel launch and returns the jittered batch (a new tensor). Asynchronous: nothing waits for the
/// GPU; the only transfer is the small table upload (`N × 784` bytes).
pub fn apply_hsv_device(images: &Tensor, gains: &[HsvGains]) -> Result<Tensor> {
    let dims = images.dims().to_vec();
    if dims.len() != 4 || dims[1] != 3 || images.dtype() != DType::U8 {
        return Err(DataError::Invalid(format!("apply_hsv_device wants a u8 N×3×H×W RGB batch, got {:?} {:?}", images.dtype(), dims)));
    }
    if dims[0] != gains.len() {
        return Err(DataError::Invalid(format!("apply_hsv_device: {} images but {} gain triples", dims[0], gains.len())));
    }
    let device = images.device();
    if !matches!(device, Device::Cuda(_)) {
        return Err(DataError::Invalid(format!(
            "apply_hsv_device runs on a CUDA device, the batch is on {device} (use apply_hsv_batch_rgb_nchw on the CPU)"
        )));
    }
    let (n, plane) = (dims[0], dims[2] * dims[3]);
    let total = n * plane;
    if total == 0 || gains.iter().all(HsvGains::is_zero) {
        return Ok(images.clone());
    }
    let plane32 = u32::try_from(plane).map_err(|_| DataError::Invalid(format!("apply_hsv_device: image plane {plane} too large")))?;
    let n32 = u32::try_from(n).map_err(|_| DataError::Invalid(format!("apply_hsv_device: batch {n} too large")))?;
    let kernel = kernel_for(device)?;
    let luts = Tensor::from_vec(lut_bytes(gains), vec![n, LUT_STRIDE], device).map_err(device_err)?;
    let out = Tensor::zeros(dims.clone(), DType::U8, device).map_err(device_err)?;
    let block = 256u32;
    let blocks = total.div_ceil(block as usize).clamp(1, 65536) as u32;
    // SAFETY: the arguments match the kernel's parameters; the grid-stride loop stays below n·plane,
    // and `images`/`out` hold n·3·plane bytes, `luts` n·784.
    unsafe {
        kernel
            .launch(
                (blocks, 1, 1),
                (block, 1, 1),
                &[
                    KernelArg::Tensor(images),
                    KernelArg::Tensor(&luts),
                    KernelArg::Tensor(&out),
                    KernelArg::U32(n32),
                    KernelArg::U32(plane32),
                ],
            )
            .map_err(device_err)?;
    }
    Ok(out)
}

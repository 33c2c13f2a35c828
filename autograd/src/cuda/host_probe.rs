//! Where the host time of an eager CUDA op goes: the pieces of a launch timed on their own
//! (stream-ordered allocation, kernel lookup and launch, cuBLAS and cuDNN calls on preallocated
//! buffers), for the micro-benchmark's breakdown table. Benchmark support, not a stable API.

use std::ffi::c_void;
use std::time::Instant;

use cudarc::cublas::{result as br, sys as bs};
use cudarc::cublaslt::{result as lr, sys as ls};

use super::alloc::DevBuf;
use super::conv::{run_into, Dir};
use super::device::cu_err;
use super::device::dev_of;
use super::ops;
use super::storage::CudaStorage;
use crate::backend::{Conv2dParams, MatmulParams};
use crate::{DType, Device, Error, Result};

/// Host µs per call of `f`: the median over 5 batches of `reps` calls (10 warm-ups; no
/// synchronisation inside a batch, one before each so queued work does not pile up).
fn host_us(device: Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..10 {
        f()?;
    }
    let mut batches = Vec::with_capacity(5);
    for _ in 0..5 {
        super::alloc::synchronize(device)?;
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        batches.push(t.elapsed().as_secs_f64() * 1e6 / reps as f64);
    }
    super::alloc::synchronize(device)?;
    batches.sort_by(f64::total_cmp);
    Ok(batches[2])
}

/// `(what, host µs per call)` for each piece, on `device`, each timed over `reps` calls.
pub fn host_cost_breakdown(device: Device, reps: usize) -> Result<Vec<(&'static str, f64)>> {
    let dev = dev_of(device)?;
    let mut rows = Vec::new();
    rows.push(("pool alloc + free (256 B)", host_us(device, reps, || DevBuf::alloc(&dev, 256).map(drop))?));
    rows.push(("kernel lookup (mutex + map)", host_us(device, reps, || dev.func("fill", "f32").map(drop))?));
    let s = CudaStorage::alloc(&dev, DType::F32, 64)?;
    rows.push(("fill kernel launch (preallocated)", host_us(device, reps, || ops::fill(&s, 1.0))?));

    // 16×16 f32 GEMM on preallocated buffers: our wrapper, classic SGEMM, a bare cuBLASLt call.
    let (a, c) = (CudaStorage::alloc(&dev, DType::F32, 256)?, CudaStorage::alloc(&dev, DType::F32, 256)?);
    ops::fill(&a, 0.5)?;
    let mp = MatmulParams { lhs_batch: 1, rhs_batch: 1, m: 16, n: 16, k: 16, lhs_t: false, rhs_t: false };
    let (pa, pc) = (a.buf.ptr, c.buf.ptr);
    rows.push((
        "ptl gemm (cached cuBLASLt plan) 16x16",
        host_us(device, reps, || super::blas::gemm(&dev, DType::F32, &mp, pa, pa, pc, 0.0, false))?,
    ));
    let h = super::blas::handle(&dev)?;
    let op = bs::cublasOperation_t::CUBLAS_OP_N;
    let (al, be) = (1f32, 0f32);
    rows.push((
        "cuBLAS sgemm 16x16",
        host_us(device, reps, || {
            // SAFETY: 16×16 f32 buffers live for the whole probe.
            unsafe { br::sgemm(h, op, op, 16, 16, 16, &al, pa as *const f32, 16, pa as *const f32, 16, &be, pc as *mut f32, 16) }
                .map_err(|e| cu_err("cublasSgemm", e))
        })?,
    ));
    rows.push(("cuBLASLt matmul 16x16 (algo cached)", lt_probe(device, reps, pa, pc)?));

    // 3×3 conv 8→8 channels on 8×8, f32, preallocated output: cached variant pack (same pointers
    // every call) and a pack built per call (16 rotating outputs, more than a plan keeps).
    let p = Conv2dParams {
        channels_last: false,
        weight_channels_last: false,
        grad_channels_last: false,
        input_channels_last: false,
        batch: 1,
        c_in: 8,
        h_in: 8,
        w_in: 8,
        c_out: 8,
        kh: 3,
        kw: 3,
        stride: (1, 1),
        padding: (1, 1),
        groups: 1,
    };
    let x = CudaStorage::alloc(&dev, DType::F32, 512)?;
    let w = CudaStorage::alloc(&dev, DType::F32, 576)?;
    ops::fill(&x, 0.25)?;
    ops::fill(&w, 0.125)?;
    let mut outs: Vec<Option<CudaStorage>> = (0..16).map(|_| CudaStorage::alloc(&dev, DType::F32, 512).map(Some)).collect::<Result<_>>()?;
    let mut call = |k: usize| -> Result<()> {
        let o = outs[k].take().ok_or_else(|| Error::Cuda("probe buffer".into()))?;
        outs[k] = Some(run_into(Dir::Fwd, &x, &w, &p, "conv2d", o)?);
        Ok(())
    };
    rows.push(("cuDNN conv fwd f32 3x3 (same pointers)", host_us(device, reps, || call(0))?));
    let mut k = 0;
    rows.push((
        "cuDNN conv fwd f32 3x3 (16 rotating outputs)",
        host_us(device, reps, || {
            k = (k + 1) % 16;
            call(k)
        })?,
    ));
    let bx = CudaStorage::alloc(&dev, DType::BF16, 512)?;
    let bw = CudaStorage::alloc(&dev, DType::BF16, 576)?;
    ops::fill(&bx, 0.25)?;
    ops::fill(&bw, 0.125)?;
    let mut bo = Some(CudaStorage::alloc(&dev, DType::BF16, 512)?);
    rows.push((
        "cuDNN conv fwd bf16 3x3 (same pointers)",
        host_us(device, reps, || {
            let o = bo.take().ok_or_else(|| Error::Cuda("probe buffer".into()))?;
            bo = Some(run_into(Dir::Fwd, &bx, &bw, &p, "conv2d", o)?);
            Ok(())
        })?,
    ));
    Ok(rows)
}

/// cuBLASLt 16×16 f32 matmul with the descriptors and the heuristic's algorithm built once.
fn lt_probe(device: Device, reps: usize, pa: u64, pc: u64) -> Result<f64> {
    let dev = dev_of(device)?;
    let e = |what: &'static str| move |err: lr::CublasError| cu_err(what, err);
    let lt = lr::create_handle().map_err(e("cublasLtCreate"))?;
    let f32t = ls::cudaDataType::CUDA_R_32F;
    let desc = lr::create_matmul_desc(ls::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t).map_err(e("cublasLtMatmulDescCreate"))?;
    let lay = lr::create_matrix_layout(f32t, 16, 16, 16).map_err(e("cublasLtMatrixLayoutCreate"))?;
    let pref = lr::create_matmul_pref().map_err(e("cublasLtMatmulPreferenceCreate"))?;
    let ws = DevBuf::alloc(&dev, 4 << 20)?;
    let ws_bytes: u64 = 4 << 20;
    let stream = dev.cu_stream as ls::cudaStream_t;
    // SAFETY: descriptors created above and destroyed at the end; buffers outlive the calls.
    let us = unsafe {
        lr::set_matmul_pref_attribute(
            pref,
            ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws_bytes as *const u64 as *const c_void,
            8,
        )
        .map_err(e("cublasLtMatmulPreferenceSetAttribute"))?;
        let heur = lr::get_matmul_algo_heuristic(lt, desc, lay, lay, lay, lay, pref).map_err(e("cublasLtMatmulAlgoGetHeuristic"))?;
        let (al, be) = (1f32, 0f32);
        let r = host_us(device, reps, || {
            lr::matmul(
                lt,
                desc,
                &al as *const f32 as *const c_void,
                &be as *const f32 as *const c_void,
                pa as *const c_void,
                lay,
                pa as *const c_void,
                lay,
                pc as *const c_void,
                lay,
                pc as *mut c_void,
                lay,
                &heur.algo,
                ws.ptr as *mut c_void,
                heur.workspaceSize,
                stream,
            )
            .map_err(e("cublasLtMatmul"))
        });
        let _ = lr::destroy_matmul_pref(pref);
        let _ = lr::destroy_matrix_layout(lay);
        let _ = lr::destroy_matmul_desc(desc);
        super::alloc::synchronize(device)?;
        let _ = lr::destroy_handle(lt);
        r?
    };
    Ok(us)
}

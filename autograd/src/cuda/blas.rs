//! Matmul / bmm through cuBLAS: true FP32 SGEMM for f32 (default math mode, no TF32), DGEMM for
//! f64, and GemmEx with f16/bf16 inputs and outputs accumulating in f32.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as br, sys as bs};

use super::alloc::DevBuf;
use super::device::{cu_err, Dev};
use super::CudaStorage;
use crate::backend::MatmulParams;
use crate::{DType, Error, Result};

/// The cuBLAS handle of one device, bound to its compute stream, with a fixed workspace (so
/// captured GEMMs never allocate).
pub(crate) struct Blas {
    handle: bs::cublasHandle_t,
    _workspace: DevBuf,
}
unsafe impl Send for Blas {}

const WORKSPACE: usize = 32 << 20;

impl Blas {
    fn new(dev: &Arc<Dev>) -> Result<Blas> {
        dev.bind()?;
        let handle = br::create_handle().map_err(|e| cu_err("cublasCreate", e))?;
        let ws = DevBuf::alloc(dev, WORKSPACE)?;
        unsafe {
            br::set_stream(handle, dev.cu_stream as bs::cudaStream_t).map_err(|e| cu_err("cublasSetStream", e))?;
            bs::cublasSetWorkspace_v2(handle, ws.ptr as *mut c_void, WORKSPACE).result().map_err(|e| cu_err("cublasSetWorkspace", e))?;
            bs::cublasSetMathMode(handle, bs::cublasMath_t::CUBLAS_DEFAULT_MATH).result().map_err(|e| cu_err("cublasSetMathMode", e))?;
        }
        Ok(Blas { handle, _workspace: ws })
    }
}

/// The device's cuBLAS handle (created on first use). Callers serialise on the compute stream.
pub(crate) fn handle(dev: &Arc<Dev>) -> Result<bs::cublasHandle_t> {
    dev.bind()?;
    let mut guard = dev.blas.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(Blas::new(dev)?);
    }
    guard.as_ref().map(|b| b.handle).ok_or_else(|| Error::Cuda("cuBLAS handle".into()))
}

pub(crate) fn matmul(a: &CudaStorage, b: &CudaStorage, p: &MatmulParams) -> Result<CudaStorage> {
    if a.dtype != b.dtype {
        return Err(Error::DTypeMismatch { op: "matmul", lhs: a.dtype, rhs: b.dtype });
    }
    if a.len != p.lhs_batch * p.m * p.k || b.len != p.rhs_batch * p.k * p.n {
        return Err(Error::invalid("matmul", format!("storage sizes {} / {} do not match {p:?}", a.len, b.len)));
    }
    let dev = &a.buf.dev;
    let batch = p.batch();
    let out = CudaStorage::alloc(dev, a.dtype, batch * p.m * p.n)?;
    if out.len == 0 {
        return Ok(out);
    }
    if p.k == 0 {
        super::ops::fill(&out, 0.0)?;
        return Ok(out);
    }
    gemm(dev, a.dtype, p, a.buf.ptr, b.buf.ptr, out.buf.ptr, 0.0, false)?;
    Ok(out)
}

/// Row-major batched GEMM on raw pointers: `C = op(A)·op(B) + beta·C` (see [`MatmulParams`]). With
/// `c_f32`, half inputs write an f32 `C` (for accumulation across calls).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(dev: &Arc<Dev>, dtype: DType, p: &MatmulParams, pa: u64, pb: u64, pc: u64, beta: f32, c_f32: bool) -> Result<()> {
    dev.bind()?;
    let batch = p.batch();
    let mut guard = dev.blas.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(Blas::new(dev)?);
    }
    let h = guard.as_ref().map(|b| b.handle).ok_or_else(|| Error::Cuda("cuBLAS handle".into()))?;
    // Row-major C (m×n) = op(A)·op(B) is column-major Cᵀ (n×m) = op(B)ᵀ·op(A)ᵀ.
    let (m, n, k) = (p.m as i32, p.n as i32, p.k as i32);
    let (opb, ldb) = if p.rhs_t { (bs::cublasOperation_t::CUBLAS_OP_T, k) } else { (bs::cublasOperation_t::CUBLAS_OP_N, n) };
    let (opa, lda) = if p.lhs_t { (bs::cublasOperation_t::CUBLAS_OP_T, m) } else { (bs::cublasOperation_t::CUBLAS_OP_N, k) };
    let sa = if p.lhs_batch == 1 { 0 } else { (p.m * p.k) as i64 };
    let sb = if p.rhs_batch == 1 { 0 } else { (p.k * p.n) as i64 };
    let sc = (p.m * p.n) as i64;
    let bc = batch as i32;
    unsafe {
        match dtype {
            DType::F32 => {
                let (al, be) = (1f32, beta);
                br::sgemm_strided_batched(
                    h,
                    opb,
                    opa,
                    n,
                    m,
                    k,
                    &al,
                    pb as *const f32,
                    ldb,
                    sb,
                    pa as *const f32,
                    lda,
                    sa,
                    &be,
                    pc as *mut f32,
                    n,
                    sc,
                    bc,
                )
            }
            DType::F64 => {
                let (al, be) = (1f64, beta as f64);
                br::dgemm_strided_batched(
                    h,
                    opb,
                    opa,
                    n,
                    m,
                    k,
                    &al,
                    pb as *const f64,
                    ldb,
                    sb,
                    pa as *const f64,
                    lda,
                    sa,
                    &be,
                    pc as *mut f64,
                    n,
                    sc,
                    bc,
                )
            }
            DType::F16 | DType::BF16 => {
                let t = if dtype == DType::F16 { bs::cudaDataType::CUDA_R_16F } else { bs::cudaDataType::CUDA_R_16BF };
                let (al, be) = (1f32, beta);
                br::gemm_strided_batched_ex(
                    h,
                    opb,
                    opa,
                    n,
                    m,
                    k,
                    &al as *const f32 as *const c_void,
                    pb as *const c_void,
                    t,
                    ldb,
                    sb,
                    pa as *const c_void,
                    t,
                    lda,
                    sa,
                    &be as *const f32 as *const c_void,
                    pc as *mut c_void,
                    if c_f32 { bs::cudaDataType::CUDA_R_32F } else { t },
                    n,
                    sc,
                    bc,
                    bs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            other => return Err(Error::UnsupportedDType { op: "matmul", dtype: other, expected: "a float dtype" }),
        }
    }
    .map_err(|e| cu_err("cuBLAS gemm", e))
}

//! Matmul / bmm through cuBLAS: true FP32 for f32 (no TF32; a 1×1 convolution run as a GEMM may
//! take TF32 under the device's `tf32_convolutions`, as cuDNN's convolutions do), DGEMM for f64,
//! and f16/bf16 inputs and outputs accumulating in f32.
//!
//! f32/f16/bf16 GEMMs go through cuBLASLt with the descriptors and the heuristic's algorithm built
//! once per (shape, dtype) and reused: a cuBLAS `gemm*` call repeats that selection on every call
//! (measured ~1.2–2 µs of host time per call on the H200, `docs/cuda-ops-h200.md`). The heuristic's
//! first pick for a given shape and workspace is the same in every process, so results stay
//! bit-identical run to run. Without libcublasLt, or when it offers no algorithm, the classic
//! cuBLAS call is used.

use std::ffi::c_void;
use std::sync::Arc;

use std::collections::HashMap;

use cudarc::cublas::{result as br, sys as bs};
use cudarc::cublaslt::{result as lr, sys as ls};

use super::alloc::DevBuf;
use super::counters::Setup;
use super::device::{count_path, cu_err, Dev, LibPath};
use super::storage::CudaStorage;
use crate::backend::MatmulParams;
use crate::{DType, Error, Result};

/// The cuBLAS and cuBLASLt handles of one device, bound to its compute stream, with a fixed
/// workspace (so captured GEMMs never allocate) and the cached cuBLASLt plans.
pub(crate) struct Blas {
    handle: bs::cublasHandle_t,
    lt: Option<ls::cublasLtHandle_t>,
    plans: HashMap<LtKey, Option<LtPlan>>,
    workspace: DevBuf,
    /// The workspace of GEMMs queued on the side stream (made on its first use there): two
    /// streams writing one workspace at once would race.
    side_workspace: Option<DevBuf>,
}
unsafe impl Send for Blas {}

pub(crate) const WORKSPACE: usize = 32 << 20;

/// What a cuBLASLt plan depends on: the GEMM's shape and layout, the dtype, whether `C` is f32,
/// and whether f32 inputs may be rounded to TF32 on tensor cores (convolutions as GEMMs only).
type LtKey = (MatmulParams, DType, bool, bool);

/// Descriptors and algorithm of one GEMM shape (column-major view, see [`gemm`]).
struct LtPlan {
    desc: ls::cublasLtMatmulDesc_t,
    a: ls::cublasLtMatrixLayout_t,
    b: ls::cublasLtMatrixLayout_t,
    c: ls::cublasLtMatrixLayout_t,
    algo: ls::cublasLtMatmulAlgo_t,
    ws: usize,
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        // SAFETY: created in `build_lt_plan` (null when a build stopped before it), destroyed once.
        unsafe {
            for l in [self.a, self.b, self.c] {
                if !l.is_null() {
                    let _ = lr::destroy_matrix_layout(l);
                }
            }
            let _ = lr::destroy_matmul_desc(self.desc);
        }
    }
}

impl Blas {
    fn new(dev: &Arc<Dev>) -> Result<Blas> {
        dev.bind()?;
        let handle = br::create_handle().map_err(|e| cu_err("cublasCreate", e))?;
        // Device state for the rest of the process: never from a capture's arena (whose bytes
        // are reused later), and not part of a warm-up's measured region.
        if dev.capturing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(super::capture_scope::violation(super::capture_scope::CaptureViolation::WorkspaceGrowth {
                library: "cuBLAS",
                requested: WORKSPACE,
            }));
        }
        let ws = super::capture_scope::unmeasured(|| DevBuf::alloc(dev, WORKSPACE))?;
        unsafe {
            br::set_stream(handle, dev.cu_stream as bs::cudaStream_t).map_err(|e| cu_err("cublasSetStream", e))?;
            bs::cublasSetWorkspace_v2(handle, ws.ptr as *mut c_void, WORKSPACE).result().map_err(|e| cu_err("cublasSetWorkspace", e))?;
            bs::cublasSetMathMode(handle, bs::cublasMath_t::CUBLAS_DEFAULT_MATH).result().map_err(|e| cu_err("cublasSetMathMode", e))?;
        }
        // cudarc panics on a missing library: look before using cuBLASLt.
        let lt = if unsafe { ls::is_culib_present() } { lr::create_handle().ok() } else { None };
        Ok(Blas { handle, lt, plans: HashMap::new(), workspace: ws, side_workspace: None })
    }

    /// Bytes of the workspaces made so far.
    pub(crate) fn workspace_bytes(&self) -> u64 {
        (WORKSPACE * (1 + self.side_workspace.is_some() as usize)) as u64
    }

    /// The workspace for the stream the calling thread queues on.
    fn workspace_for(&mut self, dev: &Arc<Dev>) -> Result<u64> {
        if !dev.on_side() {
            return Ok(self.workspace.ptr);
        }
        if let Some(ws) = &self.side_workspace {
            return Ok(ws.ptr);
        }
        if dev.capturing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(super::capture_scope::violation(super::capture_scope::CaptureViolation::WorkspaceGrowth {
                library: "cuBLAS (side stream)",
                requested: WORKSPACE,
            }));
        }
        let ws = super::capture_scope::unmeasured(|| DevBuf::alloc(dev, WORKSPACE))?;
        let ptr = ws.ptr;
        self.side_workspace = Some(ws);
        Ok(ptr)
    }

    /// Points the classic handle at `stream` and `workspace`.
    fn bind_classic(&self, stream: cudarc::driver::sys::CUstream, workspace: u64) -> Result<()> {
        unsafe {
            br::set_stream(self.handle, stream as bs::cudaStream_t).map_err(|e| cu_err("cublasSetStream", e))?;
            bs::cublasSetWorkspace_v2(self.handle, workspace as *mut c_void, WORKSPACE)
                .result()
                .map_err(|e| cu_err("cublasSetWorkspace", e))
        }
    }

    /// The cached plan for `key` (built on first use; `None` when cuBLASLt is unavailable or has
    /// no algorithm for it).
    fn lt_plan(&mut self, key: LtKey) -> Option<&LtPlan> {
        let lt = self.lt?;
        self.plans.entry(key).or_insert_with(|| super::counters::time_setup(Setup::GemmPlan, || build_lt_plan(lt, key)).ok()).as_ref()
    }
}

fn lt_type(dt: DType) -> Option<ls::cudaDataType> {
    match dt {
        DType::F32 => Some(ls::cudaDataType::CUDA_R_32F),
        DType::F16 => Some(ls::cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(ls::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

/// Column-major `Cᵀ (n×m) = op(B)ᵀ·op(A)ᵀ` for the row-major `C = op(A)·op(B)` of `p`, batched
/// with the strides of [`gemm`]; f32 compute, no reduced-precision reduction, and no TF32 unless
/// the key allows it for f32 inputs.
fn build_lt_plan(lt: ls::cublasLtHandle_t, (p, dt, c_f32, tf32): LtKey) -> std::result::Result<LtPlan, lr::CublasError> {
    let t = lt_type(dt).ok_or(lr::CublasError(ls::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED))?;
    let compute = match tf32 && dt == DType::F32 {
        true => ls::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        false => ls::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    let ct = if c_f32 { ls::cudaDataType::CUDA_R_32F } else { t };
    let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
    let op = |t: bool| if t { bs::cublasOperation_t::CUBLAS_OP_T } else { bs::cublasOperation_t::CUBLAS_OP_N };
    // Stored (pre-op) shapes in the column-major view.
    let (a_rows, a_cols) = if p.rhs_t { (k, n) } else { (n, k) };
    let (b_rows, b_cols) = if p.lhs_t { (m, k) } else { (k, m) };
    // Built up in place: on an error, dropping the partial plan releases what exists.
    let mut plan = LtPlan {
        desc: lr::create_matmul_desc(compute, ls::cudaDataType::CUDA_R_32F)?,
        a: std::ptr::null_mut(),
        b: std::ptr::null_mut(),
        c: std::ptr::null_mut(),
        // SAFETY: plain data, overwritten by the heuristic's pick below.
        algo: unsafe { std::mem::zeroed() },
        ws: 0,
    };
    plan.a = lr::create_matrix_layout(t, a_rows, a_cols, a_rows as i64)?;
    plan.b = lr::create_matrix_layout(t, b_rows, b_cols, b_rows as i64)?;
    plan.c = lr::create_matrix_layout(ct, n, m, n as i64)?;
    let batch = p.batch() as i32;
    let strides = [
        (plan.a, if p.rhs_batch == 1 { 0 } else { (p.k * p.n) as i64 }),
        (plan.b, if p.lhs_batch == 1 { 0 } else { (p.m * p.k) as i64 }),
        (plan.c, (p.m * p.n) as i64),
    ];
    // SAFETY: descriptors created above; attribute buffers are the documented C types.
    unsafe {
        for (attr, t) in [
            (ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, op(p.rhs_t) as i32),
            (ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, op(p.lhs_t) as i32),
        ] {
            lr::set_matmul_desc_attribute(plan.desc, attr, &t as *const i32 as *const c_void, 4)?;
        }
        for (l, stride) in strides {
            lr::set_matrix_layout_attribute(
                l,
                ls::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                &batch as *const i32 as *const c_void,
                4,
            )?;
            lr::set_matrix_layout_attribute(
                l,
                ls::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &stride as *const i64 as *const c_void,
                8,
            )?;
        }
        let pref = lr::create_matmul_pref()?;
        let ws = WORKSPACE as u64;
        let heur = lr::set_matmul_pref_attribute(
            pref,
            ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws as *const u64 as *const c_void,
            8,
        )
        .and_then(|()| lr::get_matmul_algo_heuristic(lt, plan.desc, plan.a, plan.b, plan.c, plan.c, pref));
        let _ = lr::destroy_matmul_pref(pref);
        let h = heur?;
        plan.algo = h.algo;
        plan.ws = h.workspaceSize;
    }
    Ok(plan)
}

/// Runs `f` on the device's cuBLAS state (created on first use) under its lock.
fn with_blas<R>(dev: &Arc<Dev>, f: impl FnOnce(&mut Blas) -> Result<R>) -> Result<R> {
    dev.bind()?;
    dev.blas.with(
        || super::counters::time_setup(Setup::Handle, || Blas::new(dev)),
        |blas| {
            if !dev.on_side() {
                return f(blas);
            }
            // A side task's calls: the classic handle follows the side stream for their duration.
            let ws = blas.workspace_for(dev)?;
            blas.bind_classic(dev.side_cu_stream, ws)?;
            let r = f(blas);
            blas.bind_classic(dev.cu_stream, blas.workspace.ptr)?;
            r
        },
    )
}

/// The device's cuBLAS handle (for the host-cost probe's bare calls; callers serialise on the
/// compute stream).
pub(crate) fn handle(dev: &Arc<Dev>) -> Result<bs::cublasHandle_t> {
    with_blas(dev, |b| Ok(b.handle))
}

/// How many GEMMs (matmul, bmm, 1×1 convolutions) the calling thread ran through cuBLASLt and how
/// many through the classic cuBLAS API (`(lt, classic)`), to check which path is in use.
pub fn gemm_paths() -> (u64, u64) {
    let c = super::device::path_counts();
    (c[LibPath::GemmLt as usize], c[LibPath::GemmClassic as usize])
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
    if splits_k(a.dtype, p) {
        gemm_split_k(dev, a.dtype, p, a.buf.ptr, b.buf.ptr, &out)?;
        return Ok(out);
    }
    gemm(dev, a.dtype, p, a.buf.ptr, b.buf.ptr, out.buf.ptr, 0.0, false)?;
    Ok(out)
}

/// Rows of the shared dimension per piece in [`gemm_split_k`].
const SPLIT_K_ROWS: usize = 512;

/// Whether `p` is a weight-gradient-shaped product (`Aᵀ·B`, one batch, a small output, a long
/// shared dimension) whose output rows are too narrow for cuBLAS's 16-byte kernels. For such
/// shapes (a 2-wide Linear's gradient over 20 k rows: the RLE flow's first and last layers)
/// cuBLASLt picks a one-tile `align1` kernel that walks the whole shared dimension alone — about
/// 100 µs per call on the H200, 1.1 ms of a batch-4 step's loss backward.
fn splits_k(dt: DType, p: &MatmulParams) -> bool {
    let es = dt.size_in_bytes();
    let narrow = !(p.m * es).is_multiple_of(16) || !(p.n * es).is_multiple_of(16);
    matches!(dt, DType::F32 | DType::BF16 | DType::F16)
        && p.lhs_batch == 1
        && p.rhs_batch == 1
        && p.lhs_t
        && !p.rhs_t
        && narrow
        && p.m * p.n <= 64 * 64
        && p.k >= 4 * SPLIT_K_ROWS
}

/// `out = Aᵀ·B` for a [`splits_k`] shape: the shared dimension in pieces of [`SPLIT_K_ROWS`]
/// rows, one batched GEMM writing an f32 partial per piece (plus one GEMM for the rest), then
/// one in-order sum of the partials — a fixed summation order, so the bytes are the same run to
/// run and recorded or not.
fn gemm_split_k(dev: &Arc<Dev>, dt: DType, p: &MatmulParams, pa: u64, pb: u64, out: &CudaStorage) -> Result<()> {
    let (whole, rest) = (p.k / SPLIT_K_ROWS, p.k % SPLIT_K_ROWS);
    let pieces = whole + usize::from(rest > 0);
    let partials = CudaStorage::alloc(dev, DType::F32, pieces * p.m * p.n)?;
    let piece = MatmulParams { lhs_batch: whole, rhs_batch: whole, k: SPLIT_K_ROWS, ..*p };
    gemm(dev, dt, &piece, pa, pb, partials.buf.ptr, 0.0, true)?;
    if rest > 0 {
        let es = dt.size_in_bytes() as u64;
        let done = (whole * SPLIT_K_ROWS) as u64;
        let last = MatmulParams { lhs_batch: 1, rhs_batch: 1, k: rest, ..*p };
        let pc = partials.buf.ptr + (whole * p.m * p.n * 4) as u64;
        gemm(dev, dt, &last, pa + done * p.m as u64 * es, pb + done * p.n as u64 * es, pc, 0.0, true)?;
    }
    super::ops::sum_partials(&partials, pieces, out)
}

/// Row-major batched GEMM on raw pointers: `C = op(A)·op(B) + beta·C` (see [`MatmulParams`]). With
/// `c_f32`, half inputs write an f32 `C` (for accumulation across calls).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(dev: &Arc<Dev>, dtype: DType, p: &MatmulParams, pa: u64, pb: u64, pc: u64, beta: f32, c_f32: bool) -> Result<()> {
    gemm_math(dev, dtype, p, pa, pb, pc, beta, c_f32, false)
}

/// [`gemm`] whose f32 inputs may be rounded to TF32 on tensor cores (`tf32`): a convolution run
/// as a GEMM under the device's `tf32_convolutions` option. Other dtypes ignore it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_math(
    dev: &Arc<Dev>,
    dtype: DType,
    p: &MatmulParams,
    pa: u64,
    pb: u64,
    pc: u64,
    beta: f32,
    c_f32: bool,
    tf32: bool,
) -> Result<()> {
    let scale = Scale { alpha: 1.0, beta: f64::from(beta), out: pc };
    with_blas(dev, |blas| gemm_on(blas, dev, dtype, p, pa, pb, pc, scale, c_f32, tf32 && dtype == DType::F32))
}

/// `D = alpha·op(A)·op(B) + beta·C` with `D` at `out` (which may be `C`'s address); the scales
/// go to the GEMM in its scale type (f32, f64 for DGEMM).
#[derive(Clone, Copy)]
struct Scale {
    alpha: f64,
    beta: f64,
    out: u64,
}

/// `beta·c + alpha·op(a)·op(b)` into a new storage (`Tensor::baddbmm`): cuBLASLt's epilogue, f32
/// compute and scale, one rounding to the dtype.
pub(crate) fn matmul_add(
    a: &CudaStorage,
    b: &CudaStorage,
    c: &CudaStorage,
    p: &MatmulParams,
    alpha: f64,
    beta: f64,
) -> Result<CudaStorage> {
    if a.dtype != b.dtype || a.dtype != c.dtype {
        let other = if a.dtype != b.dtype { b.dtype } else { c.dtype };
        return Err(Error::DTypeMismatch { op: "matmul_add", lhs: a.dtype, rhs: other });
    }
    if a.len != p.lhs_batch * p.m * p.k || b.len != p.rhs_batch * p.k * p.n || c.len != p.batch() * p.m * p.n {
        return Err(Error::invalid("matmul_add", format!("storage sizes {} / {} / {} do not match {p:?}", a.len, b.len, c.len)));
    }
    a.same_device("matmul_add", b)?;
    a.same_device("matmul_add", c)?;
    let dev = &a.buf.dev;
    let out = CudaStorage::alloc(dev, a.dtype, c.len)?;
    if out.len == 0 {
        return Ok(out);
    }
    let scale = Scale { alpha, beta, out: out.buf.ptr };
    if p.k == 0 {
        // `Tensor::baddbmm` computes beta·C itself when there is no product.
        return Err(Error::invalid("matmul_add", "an empty inner dimension (k = 0)"));
    }
    with_blas(dev, |blas| gemm_on(blas, dev, a.dtype, p, a.buf.ptr, b.buf.ptr, c.buf.ptr, scale, false, false))?;
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn gemm_on(
    blas: &mut Blas,
    dev: &Arc<Dev>,
    dtype: DType,
    p: &MatmulParams,
    pa: u64,
    pb: u64,
    pc: u64,
    scale: Scale,
    c_f32: bool,
    tf32: bool,
) -> Result<()> {
    let Scale { alpha, beta, out: pd } = scale;
    let batch = p.batch();
    if lt_type(dtype).is_some() {
        let (lt, stream, ws) = (blas.lt, dev.stream() as ls::cudaStream_t, blas.workspace_for(dev)?);
        if let (Some(lt), Some(plan)) = (lt, blas.lt_plan((*p, dtype, c_f32, tf32))) {
            let (al, be) = (alpha as f32, beta as f32);
            // SAFETY: the plan's layouts describe exactly these buffers (sizes checked by callers);
            // the workspace is the handle's own, used in stream order.
            return unsafe {
                lr::matmul(
                    lt,
                    plan.desc,
                    &al as *const f32 as *const c_void,
                    &be as *const f32 as *const c_void,
                    pb as *const c_void,
                    plan.a,
                    pa as *const c_void,
                    plan.b,
                    pc as *const c_void,
                    plan.c,
                    pd as *mut c_void,
                    plan.c,
                    &plan.algo,
                    ws as *mut c_void,
                    plan.ws,
                    stream,
                )
            }
            .map_err(|e| cu_err("cublasLtMatmul", e))
            .map(|()| count_path(LibPath::GemmLt));
        }
    }
    count_path(LibPath::GemmClassic);
    if pd != pc {
        // The classic API writes C in place: start D as a copy of C.
        let bytes = p.batch() * p.m * p.n * if c_f32 { 4 } else { dtype.size_in_bytes() };
        // SAFETY: both buffers hold the product's batch·m·n elements (checked by the callers).
        unsafe { cudarc::driver::result::memcpy_dtod_async(pd, pc, bytes, dev.stream()) }.map_err(|e| cu_err("cuMemcpyDtoDAsync", e))?;
    }
    let pc = pd;
    let h = blas.handle;
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
            DType::F32 if !tf32 => {
                let (al, be) = (alpha as f32, beta as f32);
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
                let (al, be) = (alpha, beta);
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
            // Halves accumulating in f32, and f32 allowed TF32 (a convolution as a GEMM).
            DType::F16 | DType::BF16 | DType::F32 => {
                let t = match dtype {
                    DType::F16 => bs::cudaDataType::CUDA_R_16F,
                    DType::BF16 => bs::cudaDataType::CUDA_R_16BF,
                    _ => bs::cudaDataType::CUDA_R_32F,
                };
                let compute =
                    if tf32 { bs::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32 } else { bs::cublasComputeType_t::CUBLAS_COMPUTE_32F };
                let (al, be) = (alpha as f32, beta as f32);
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
                    compute,
                    bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            other => return Err(Error::UnsupportedDType { op: "matmul", dtype: other, expected: "a float dtype" }),
        }
    }
    .map_err(|e| cu_err("cuBLAS gemm", e))
}

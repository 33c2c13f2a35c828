//! Convolution forward / backward-data / backward-filter through cuDNN, and 1×1 stride-1
//! convolutions through GEMMs. f32/bf16/f16 go through the graph API first (`conv_graph`: faster
//! engines, a few µs of host time per call); this file's legacy-API path (NCHW) serves f64 and any
//! shape the graph API has no deterministic engine for (`PTL_CUDNN_LEGACY=1` forces it).
//!
//! Legacy path: only deterministic algorithms, in cuDNN's heuristic ranking (identical in every
//! process, so a fixed seed gives the same bytes run to run). f32 uses `CUDNN_FMA_MATH` (true FP32,
//! no TF32) unless the device's `tf32_convolutions` option allows TF32 tensor cores (PyTorch's
//! `cudnn.allow_tf32`; then the plans and remembered choices are kept apart from the strict ones),
//! f16/bf16 tensor cores with an f32 compute type, f64 the double path. (A timed choice,
//! `PTL_CUDNN_BENCHMARK`, existed while every convolution went this way; it was dropped when the
//! graph API took over, since it had come to time only f64 and fallback shapes.) All plans share one
//! workspace ([`Workspace`], `conv_workspace`), which only native work grows: a captured step never
//! allocates inside cuDNN.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cudnn::{result as nr, sys as ns};

use super::conv_choice::{Choice, ChoiceCache};
pub(crate) use super::conv_graph::Dir;
use super::conv_graph::{workspace_cap, Built};
use super::conv_workspace::Workspace;
use super::counters::Setup;
use super::device::{count_path, cu_err, Dev, LibPath};
use super::storage::CudaStorage;
use crate::backend::Conv2dParams;
use crate::{DType, Error, Result};

#[derive(Clone, Copy)]
enum Algo {
    F(ns::cudnnConvolutionFwdAlgo_t),
    D(ns::cudnnConvolutionBwdDataAlgo_t),
    W(ns::cudnnConvolutionBwdFilterAlgo_t),
}

/// Descriptors live as long as the process (plans are never dropped), so a plan is a plain copy.
#[derive(Clone, Copy)]
struct Plan {
    x: ns::cudnnTensorDescriptor_t,
    y: ns::cudnnTensorDescriptor_t,
    w: ns::cudnnFilterDescriptor_t,
    conv: ns::cudnnConvolutionDescriptor_t,
    algo: Algo,
    ws_bytes: usize,
}

pub(crate) struct Dnn {
    handle: ns::cudnnHandle_t,
    /// The stream the handle queues on now (the compute stream, or the side stream during a
    /// side task's calls).
    bound: cudarc::driver::sys::CUstream,
    /// The workspaces of calls queued on the compute stream (0) and on the side stream (1): two
    /// streams must not share one.
    workspaces: [Workspace; 2],
    /// Keyed by shape, dtype, direction and whether f32 may run in TF32.
    plans: HashMap<(Conv2dParams, DType, Dir, bool), Plan>,
    /// Graph-API plans (`None`: no usable engine for the shape, legacy path), keyed as `plans`.
    graph_plans: HashMap<(Conv2dParams, DType, Dir, bool), Option<super::conv_graph::GraphPlan>>,
    /// Engine choices remembered across processes.
    choices: ChoiceCache,
}
unsafe impl Send for Dnn {}

const MAX_WS: usize = 512 << 20;

fn ndt(dt: DType) -> Result<ns::cudnnDataType_t> {
    Ok(match dt {
        DType::F32 => ns::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::F64 => ns::cudnnDataType_t::CUDNN_DATA_DOUBLE,
        DType::F16 => ns::cudnnDataType_t::CUDNN_DATA_HALF,
        DType::BF16 => ns::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        other => return Err(Error::UnsupportedDType { op: "conv2d", dtype: other, expected: "a float dtype" }),
    })
}

fn e(what: &'static str) -> impl Fn(nr::CudnnError) -> Error {
    move |err| cu_err(what, err)
}

impl Dnn {
    /// Bytes held by the shared plan workspace.
    pub(crate) fn workspace_bytes(&self) -> u64 {
        self.workspaces.iter().map(Workspace::bytes).sum()
    }

    /// Points the handle at the stream the calling thread queues on.
    fn follow_stream(&mut self, dev: &Dev) -> Result<()> {
        let stream = dev.stream();
        if self.bound != stream {
            unsafe { nr::set_stream(self.handle, stream as ns::cudaStream_t) }.map_err(e("cudnnSetStream"))?;
            self.bound = stream;
        }
        Ok(())
    }

    fn new(dev: &Arc<Dev>) -> Result<Dnn> {
        dev.bind()?;
        let handle = nr::create_handle().map_err(e("cudnnCreate"))?;
        unsafe { nr::set_stream(handle, dev.cu_stream as ns::cudaStream_t) }.map_err(e("cudnnSetStream"))?;
        let (major, minor) = dev.ctx.compute_capability().map_err(|err| cu_err("compute capability", err))?;
        // SAFETY: a plain query.
        let version = unsafe { ns::cudnnGetVersion() };
        let mut context =
            format!("cudnn {version} sm_{major}{minor} heuristics {:?} workspace {}", super::conv_graph::heuristic_mode(), workspace_cap());
        if !super::conv_graph::runtime_compiled_allowed() {
            context.push_str(" no-runtime-compiled");
        }
        Ok(Dnn {
            handle,
            bound: dev.cu_stream,
            workspaces: Default::default(),
            plans: HashMap::new(),
            graph_plans: HashMap::new(),
            choices: ChoiceCache::new(context),
        })
    }

    /// The cached legacy plan for (`p`, `dt`, `dir`, `tf32`), built on first use.
    fn plan(&mut self, p: &Conv2dParams, dt: DType, dir: Dir, tf32: bool) -> Result<Plan> {
        let key = (*p, dt, dir, tf32);
        if let Some(plan) = self.plans.get(&key) {
            return Ok(*plan);
        }
        let plan = super::counters::time_setup(Setup::ConvPlan, || self.make_plan(p, dt, dir, tf32))?;
        self.plans.insert(key, plan);
        Ok(plan)
    }

    fn make_plan(&self, p: &Conv2dParams, dt: DType, dir: Dir, tf32: bool) -> Result<Plan> {
        let t = ndt(dt)?;
        let nchw = ns::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        let i = |v: usize| v as i32;
        let [n, co, oh, ow] = p.out_shape();
        let [_, cg, kh, kw] = p.weight_shape();
        unsafe {
            // Activations in the data's format (cuDNN takes logical NCHW sizes either way).
            let data = if p.channels_last { ns::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC } else { nchw };
            let x = nr::create_tensor_descriptor().map_err(e("cudnnCreateTensorDescriptor"))?;
            nr::set_tensor4d_descriptor(x, data, t, [i(p.batch), i(p.c_in), i(p.h_in), i(p.w_in)])
                .map_err(e("cudnnSetTensor4dDescriptor(x)"))?;
            let y = nr::create_tensor_descriptor().map_err(e("cudnnCreateTensorDescriptor"))?;
            nr::set_tensor4d_descriptor(y, data, t, [i(n), i(co), i(oh), i(ow)]).map_err(e("cudnnSetTensor4dDescriptor(y)"))?;
            let w = nr::create_filter_descriptor().map_err(e("cudnnCreateFilterDescriptor"))?;
            nr::set_filter4d_descriptor(w, t, nchw, [i(co), i(cg), i(kh), i(kw)]).map_err(e("cudnnSetFilter4dDescriptor"))?;
            let conv = nr::create_convolution_descriptor().map_err(e("cudnnCreateConvolutionDescriptor"))?;
            let compute = if dt == DType::F64 { ns::cudnnDataType_t::CUDNN_DATA_DOUBLE } else { ns::cudnnDataType_t::CUDNN_DATA_FLOAT };
            nr::set_convolution2d_descriptor(
                conv,
                i(p.padding.0),
                i(p.padding.1),
                i(p.stride.0),
                i(p.stride.1),
                1,
                1,
                ns::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute,
            )
            .map_err(e("cudnnSetConvolution2dDescriptor"))?;
            nr::set_convolution_group_count(conv, i(p.groups)).map_err(e("cudnnSetConvolutionGroupCount"))?;
            let strict_f32 = dt == DType::F32 && !tf32;
            let want_math = match dt {
                DType::F32 if strict_f32 => ns::cudnnMathType_t::CUDNN_FMA_MATH,
                DType::F64 => ns::cudnnMathType_t::CUDNN_DEFAULT_MATH,
                _ => ns::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            };
            nr::set_convolution_math_type(conv, want_math).map_err(e("cudnnSetConvolutionMathType"))?;
            // Strict FP32 must never run on tensor cores (TF32); halves, and f32 with TF32
            // allowed, may use any math.
            let math_ok = |m: ns::cudnnMathType_t| {
                !strict_f32 || matches!(m, ns::cudnnMathType_t::CUDNN_FMA_MATH | ns::cudnnMathType_t::CUDNN_DEFAULT_MATH)
            };
            // Strict f32 keeps FMA math whatever the heuristic reports (DEFAULT could mean TF32 on Ampere+).
            let final_math = |m: ns::cudnnMathType_t| if strict_f32 { ns::cudnnMathType_t::CUDNN_FMA_MATH } else { m };
            let det = ns::cudnnDeterminism_t::CUDNN_DETERMINISTIC;
            let okst = ns::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
            let h = self.handle;
            let mut cnt = 0i32;
            // cuDNN's heuristic ranking (the same in every process); the first deterministic pick.
            macro_rules! choose {
                ($perf_t:ty, $heur:expr, $wsq:expr, $wrap:path, $what:literal) => {{
                    let mut perf = vec![std::mem::zeroed::<$perf_t>(); 16];
                    $heur(&mut perf, &mut cnt).map_err(e(concat!("cuDNN ", $what, " heuristics")))?;
                    let pick = perf[..cnt.max(0) as usize]
                        .iter()
                        .find(|q| q.status == okst && q.determinism == det && math_ok(q.mathType) && q.memory <= MAX_WS)
                        .copied()
                        .ok_or_else(|| Error::Cuda(format!("cuDNN offers no deterministic {} algorithm for {p:?} {dt}", $what)))?;
                    nr::set_convolution_math_type(conv, final_math(pick.mathType)).map_err(e("cudnnSetConvolutionMathType"))?;
                    let ws = $wsq(pick.algo).map_err(e(concat!("cuDNN ", $what, " workspace size")))?;
                    ($wrap(pick.algo), pick.mathType, ws)
                }};
            }
            let (algo, math, ws_bytes) = match dir {
                Dir::Fwd => choose!(
                    ns::cudnnConvolutionFwdAlgoPerf_t,
                    |perf: &mut Vec<ns::cudnnConvolutionFwdAlgoPerf_t>, cnt: &mut i32| nr::get_convolution_forward_algorithm(
                        h,
                        x,
                        w,
                        conv,
                        y,
                        16,
                        cnt,
                        perf.as_mut_ptr()
                    ),
                    |a| nr::get_convolution_forward_workspace_size(h, x, w, conv, y, a),
                    Algo::F,
                    "forward"
                ),
                Dir::BwdData => choose!(
                    ns::cudnnConvolutionBwdDataAlgoPerf_t,
                    |perf: &mut Vec<ns::cudnnConvolutionBwdDataAlgoPerf_t>, cnt: &mut i32| {
                        nr::get_convolution_backward_data_algorithm(h, w, y, conv, x, 16, cnt, perf.as_mut_ptr())
                    },
                    |a| nr::get_convolution_backward_data_workspace_size(h, w, y, conv, x, a),
                    Algo::D,
                    "backward-data"
                ),
                Dir::BwdFilter => choose!(
                    ns::cudnnConvolutionBwdFilterAlgoPerf_t,
                    |perf: &mut Vec<ns::cudnnConvolutionBwdFilterAlgoPerf_t>, cnt: &mut i32| {
                        nr::get_convolution_backward_filter_algorithm(h, x, y, conv, w, 16, cnt, perf.as_mut_ptr())
                    },
                    |a| nr::get_convolution_backward_filter_workspace_size(h, x, y, conv, w, a),
                    Algo::W,
                    "backward-filter"
                ),
            };
            let _ = math;
            Ok(Plan { x, y, w, conv, algo, ws_bytes })
        }
    }
}

/// How many cuDNN convolutions (any direction and dtype; 1×1 GEMMs not counted) the calling thread
/// ran through the graph API and how many through the legacy API (`(graph, legacy)`), to check
/// which path is in use.
pub fn conv_paths() -> (u64, u64) {
    let c = super::device::path_counts();
    (c[LibPath::ConvGraph as usize], c[LibPath::ConvLegacy as usize])
}

/// How many weight gradients of thin-input convolutions (the first layer's RGB input) the own
/// kernel computed in this process instead of cuDNN, to check which path a shape takes.
pub fn thin_weight_gradients() -> u64 {
    super::ops::thin_weight_gradients()
}

/// How many weight gradients of narrow 1×1 convolutions (unaligned rows, small batches) the own
/// kernel computed in this process instead of cuBLAS, to check which path a shape takes.
pub fn narrow_weight_gradients() -> u64 {
    super::ops::narrow_weight_gradients()
}

/// How many bias gradients the narrow 1×1 weight-gradient kernel computed in its own launch in
/// this process (the shapes `fuses_bias_gradient` takes).
pub fn narrow_bias_gradients() -> u64 {
    super::ops::narrow_bias_gradients()
}

/// Gradient calls that read an N, H, W, C output gradient through the graph API
/// ([`Conv2dParams::grad_channels_last`]).
static CHANNELS_LAST_OUTPUT_GRADIENT_READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many convolution gradients (data and weight, any dtype) read an output gradient converted
/// once to N, H, W, C through cuDNN's graph API in this process, to check which path a shape takes.
pub fn channels_last_output_gradient_reads() -> u64 {
    CHANNELS_LAST_OUTPUT_GRADIENT_READS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `PTL_CUDNN_LEGACY=1`: every convolution uses the legacy API (for comparison).
fn legacy_forced() -> bool {
    static FORCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| std::env::var("PTL_CUDNN_LEGACY").is_ok_and(|v| v == "1"))
}

fn out_len(dir: Dir, p: &Conv2dParams) -> usize {
    match dir {
        Dir::Fwd => p.out_shape().iter().product(),
        Dir::BwdData => p.batch * p.c_in * p.h_in * p.w_in,
        Dir::BwdFilter => p.weight_shape().iter().product(),
    }
}

fn run(dir: Dir, a: &CudaStorage, b: &CudaStorage, p: &Conv2dParams, op: &'static str) -> Result<CudaStorage> {
    if a.dtype != b.dtype {
        return Err(Error::DTypeMismatch { op, lhs: a.dtype, rhs: b.dtype });
    }
    let dt = a.dtype;
    ndt(dt)?;
    let out = CudaStorage::alloc(&a.buf.dev, dt, out_len(dir, p))?;
    run_into(dir, a, b, p, op, out)
}

/// Whether cuDNN's graph API computes the contiguous convolution `p` in `dt` in NHWC, converting
/// its planar operands inside each call: not 1×1 GEMMs, grouped convolutions (cuDNN's planar
/// direct kernels take those without a conversion), the own thin-input weight gradient or f64
/// (legacy API); and only channel counts of whole 16-byte vectors (NHWC engines pad others in
/// their workspace, which the workspace cap may not allow: the pose stems' 85 channels).
fn computes_in_nhwc(p: &Conv2dParams, dt: DType) -> bool {
    let pointwise = p.kh == 1 && p.kw == 1 && p.stride == (1, 1) && p.padding == (0, 0);
    let vector = 16 / dt.size_in_bytes().max(1);
    !p.channels_last
        && p.c_in.is_multiple_of(vector)
        && p.c_out.is_multiple_of(vector)
        && matches!(dt, DType::F32 | DType::BF16 | DType::F16)
        && p.groups == 1
        && !pointwise
        && !super::ops::takes_thin_weight_gradient(p, dt)
        && !legacy_forced()
}

/// Whether both gradients of the contiguous convolution `p` in `dt` read an output gradient
/// stored N, H, W, C ([`Conv2dParams::grad_channels_last`]): the shapes cuDNN computes in NHWC
/// ([`computes_in_nhwc`]) whose output gradient is at most [`GRAD_NHWC_MAX_BYTES`]: the converted
/// copy is one more buffer of the gradient's size while both gradients run, which at batch 64
/// raised the native step's peak by 300 MiB and its kernel time by 1.2 ms (large transposes cost
/// what cuDNN's own conversions cost), while for small gradients it saves a launch each.
/// `PTL_CONV_GRAD_NHWC=0` turns it off (each gradient converts the output gradient inside cuDNN).
pub(crate) fn reads_channels_last_output_gradient(p: &Conv2dParams, dt: DType) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("PTL_CONV_GRAD_NHWC").map_or(true, |v| v.trim() != "0"));
    on && computes_in_nhwc(p, dt) && p.out_shape().iter().product::<usize>() * dt.size_in_bytes() <= GRAD_NHWC_MAX_BYTES
}

/// Whether the forward call and the weight gradient of the contiguous convolution `p` in `dt`
/// read an input stored N, H, W, C ([`Conv2dParams::input_channels_last`]): the shapes cuDNN
/// computes in NHWC ([`computes_in_nhwc`]), converting the input inside both calls, whose input
/// is at most [`GRAD_NHWC_MAX_BYTES`]: the converted copy is what the convolution keeps for its
/// weight gradient, one more buffer of the input's size where the input has other holders.
/// `PTL_CONV_INPUT_NHWC=0` turns it off.
pub(crate) fn reads_channels_last_input(p: &Conv2dParams, dt: DType) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("PTL_CONV_INPUT_NHWC").map_or(true, |v| v.trim() != "0"));
    on && computes_in_nhwc(p, dt) && p.batch * p.c_in * p.h_in * p.w_in * dt.size_in_bytes() <= GRAD_NHWC_MAX_BYTES
}

/// Calls that read an N, H, W, C input beside contiguous outputs ([`Conv2dParams::input_channels_last`]).
static CHANNELS_LAST_INPUT_READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many forward calls and weight gradients (any dtype) read an input converted once to N, H,
/// W, C through cuDNN's graph API in this process, to check which path a shape takes.
pub fn channels_last_input_reads() -> u64 {
    CHANNELS_LAST_INPUT_READS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The largest output gradient a convolution converts to N, H, W, C itself
/// ([`reads_channels_last_output_gradient`]): 16 MiB, every layer of a 640 px batch of 4 in
/// bf16 (the largest, 16 × 320 × 320 × 4, is 12.5 MiB); larger ones are left to cuDNN.
pub(crate) const GRAD_NHWC_MAX_BYTES: usize = 16 << 20;

/// The output gradient `dy` of `p`, stored N, H, W, C, rearranged into N, C, H, W for a path that
/// reads it so (the legacy API, or a shape [`reads_channels_last_output_gradient`] turns down).
fn output_gradient_contiguous(dy: &CudaStorage, p: &Conv2dParams) -> Result<CudaStorage> {
    let dims = p.out_shape();
    let mut out = CudaStorage::alloc(&dy.buf.dev, dy.dtype, dy.len)?;
    let src = crate::memory_format::channels_last_as_logical(&dims);
    super::ops::copy_strided(dy, &src, &mut out, &crate::shape::Layout::contiguous(&dims))?;
    Ok(out)
}

/// The input `x` of `p`, stored N, H, W, C, rearranged into N, C, H, W for a path that reads it
/// so (the legacy API, or a shape [`reads_channels_last_input`] turns down).
fn input_contiguous(x: &CudaStorage, p: &Conv2dParams) -> Result<CudaStorage> {
    let dims = [p.batch, p.c_in, p.h_in, p.w_in];
    let mut out = CudaStorage::alloc(&x.buf.dev, x.dtype, x.len)?;
    let src = crate::memory_format::channels_last_as_logical(&dims);
    super::ops::copy_strided(x, &src, &mut out, &crate::shape::Layout::contiguous(&dims))?;
    Ok(out)
}

/// Computes direction `dir` into `out` (already allocated with the direction's size). Inputs: Fwd
/// (x, w), BwdData (dy, w), BwdFilter (dy, x).
pub(crate) fn run_into(
    dir: Dir,
    a: &CudaStorage,
    b: &CudaStorage,
    p: &Conv2dParams,
    op: &'static str,
    out: CudaStorage,
) -> Result<CudaStorage> {
    let dt = a.dtype;
    let dev = &a.buf.dev;
    if p.input_channels_last && (dir == Dir::BwdData || !reads_channels_last_input(p, dt)) {
        let q = Conv2dParams { input_channels_last: false, ..*p };
        return match dir {
            Dir::Fwd => run_into(dir, &input_contiguous(a, p)?, b, &q, op, out),
            Dir::BwdData => run_into(dir, a, b, &q, op, out),
            Dir::BwdFilter => run_into(dir, a, &input_contiguous(b, p)?, &q, op, out),
        };
    }
    if p.grad_channels_last && (dir == Dir::Fwd || !reads_channels_last_output_gradient(p, dt)) {
        let q = Conv2dParams { grad_channels_last: false, ..*p };
        return match dir {
            Dir::Fwd => run_into(dir, a, b, &q, op, out),
            _ => run_into(dir, &output_gradient_contiguous(a, p)?, b, &q, op, out),
        };
    }
    if out.len == 0 {
        return Ok(out);
    }
    if p.batch == 0 || p.h_out() == 0 || p.w_out() == 0 {
        super::ops::fill(&out, 0.0)?;
        return Ok(out);
    }
    // f32 on tensor cores in TF32 where the device allows it (PyTorch's cudnn.allow_tf32).
    let tf32 = dt == DType::F32 && dev.options().tf32_convolutions;
    if p.kh == 1 && p.kw == 1 && p.stride == (1, 1) && p.padding == (0, 0) && p.groups == 1 {
        return pointwise(dir, a, b, p, out, tf32);
    }
    if super::ops::takes_depthwise(p, dt) {
        return super::ops::depthwise_channels_last(dir, a, b, p, out);
    }
    if matches!(dir, Dir::BwdFilter) && super::ops::takes_thin_weight_gradient(p, dt) {
        if !p.weight_channels_last {
            return super::ops::thin_weight_gradient(a, b, p, out);
        }
        let oihw = super::ops::thin_weight_gradient(a, b, p, CudaStorage::alloc(dev, dt, out.len)?)?;
        return weight_reordered_into(&oihw, p.weight_shape(), true, out);
    }
    dev.dnn.with(
        || super::counters::time_setup(Setup::Handle, || Dnn::new(dev)),
        |dnn: &mut Dnn| {
            dnn.follow_stream(dev)?;
            let h = dnn.handle;
            let slot = usize::from(dev.on_side());
            if dt != DType::F64 && !legacy_forced() {
                // Buffers by their forward-convolution names (x, w, y).
                let (pa, pb, po) = (a.buf.ptr, b.buf.ptr, out.buf.ptr);
                let (x, w, y) = match dir {
                    Dir::Fwd => (pa, pb, po),
                    Dir::BwdData => (po, pb, pa),
                    Dir::BwdFilter => (pb, po, pa),
                };
                let key = (*p, dt, dir, tf32);
                if !dnn.graph_plans.contains_key(&key) {
                    let Dnn { choices, workspaces, .. } = &mut *dnn;
                    let built = super::counters::time_setup(Setup::ConvPlan, || {
                        graph_plan(choices, &mut workspaces[slot], dev, h, p, dt, dir, tf32, [x, w, y])
                    });
                    dnn.graph_plans.insert(key, built);
                }
                let Dnn { graph_plans, workspaces, .. } = &mut *dnn;
                if let Some(gp) = graph_plans.get_mut(&key).and_then(Option::as_mut) {
                    let ws = workspaces[slot].get(dev, gp.workspace_bytes())?;
                    gp.execute(h, x, w, y, ws.ptr)?;
                    count_path(LibPath::ConvGraph);
                    if p.grad_channels_last {
                        CHANNELS_LAST_OUTPUT_GRADIENT_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    if p.input_channels_last {
                        CHANNELS_LAST_INPUT_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    return Ok(out);
                }
            }
            count_path(LibPath::ConvLegacy);
            // The legacy descriptors here are NCHW activations and OIHW filters: an N, H, W, C
            // output gradient and an O, H, W, I weight go in through contiguous copies, and the
            // weight's gradient comes out through one.
            let dy_contiguous = if p.grad_channels_last { Some(output_gradient_contiguous(a, p)?) } else { None };
            let a = dy_contiguous.as_ref().unwrap_or(a);
            // The input lies N, H, W, C only in forward and weight-gradient calls (run_into
            // dropped the flag for the data gradient).
            let x_contiguous = match (p.input_channels_last, dir) {
                (true, Dir::Fwd) => Some(input_contiguous(a, p)?),
                (true, _) => Some(input_contiguous(b, p)?),
                (false, _) => None,
            };
            let (a, b) = match (&x_contiguous, dir) {
                (Some(x), Dir::Fwd) => (x, b),
                (Some(x), _) => (a, x),
                (None, _) => (a, b),
            };
            let q = Conv2dParams { weight_channels_last: false, grad_channels_last: false, input_channels_last: false, ..*p };
            let (oihw_weight, oihw_grad) = match (p.weight_channels_last, dir) {
                (false, _) => (None, None),
                (true, Dir::BwdFilter) => (None, Some(CudaStorage::alloc(dev, dt, out.len)?)),
                (true, _) => (Some(weight_reordered_into(b, p.weight_shape(), false, CudaStorage::alloc(dev, dt, b.len)?)?), None),
            };
            let b = oihw_weight.as_ref().unwrap_or(b);
            let o = oihw_grad.as_ref().unwrap_or(&out);
            let (pa, pb, po) = (a.buf.ptr as *const c_void, b.buf.ptr as *const c_void, o.buf.ptr as *mut c_void);
            let plan = dnn.plan(&q, dt, dir, tf32)?;
            let lease = dnn.workspaces[slot].get(dev, plan.ws_bytes)?;
            let ws = lease.ptr as *mut c_void;
            let (af, bf) = (1f32, 0f32);
            let (ad, bd) = (1f64, 0f64);
            let (alpha, beta) = if dt == DType::F64 {
                (&ad as *const f64 as *const c_void, &bd as *const f64 as *const c_void)
            } else {
                (&af as *const f32 as *const c_void, &bf as *const f32 as *const c_void)
            };
            unsafe {
                match plan.algo {
                    // a = x, b = w
                    Algo::F(algo) => {
                        nr::convolution_forward(h, alpha, plan.x, pa, plan.w, pb, plan.conv, algo, ws, plan.ws_bytes, beta, plan.y, po)
                    }
                    // a = dy, b = w
                    Algo::D(algo) => nr::convolution_backward_data(
                        h,
                        alpha,
                        plan.w,
                        pb,
                        plan.y,
                        pa,
                        plan.conv,
                        algo,
                        ws,
                        plan.ws_bytes,
                        beta,
                        plan.x,
                        po,
                    ),
                    // a = dy, b = x
                    Algo::W(algo) => nr::convolution_backward_filter(
                        h,
                        alpha,
                        plan.x,
                        pb,
                        plan.y,
                        pa,
                        plan.conv,
                        algo,
                        ws,
                        plan.ws_bytes,
                        beta,
                        plan.w,
                        po,
                    ),
                }
            }
            .map_err(|err| cu_err(op, err))?;
            match oihw_grad {
                Some(g) => weight_reordered_into(&g, p.weight_shape(), true, out),
                None => Ok(out),
            }
        },
    )
}

/// `src`, a weight of logical `dims` (O, I, H, W), written into `out` rearranged from OIHW to
/// O, H, W, I order (`to_ohwi`) or back: one strided copy.
fn weight_reordered_into(src: &CudaStorage, dims: [usize; 4], to_ohwi: bool, mut out: CudaStorage) -> Result<CudaStorage> {
    use crate::shape::Layout;
    let [o, i, h, w] = dims;
    let hw = h * w;
    // The source seen in the destination's order: OIHW as (o, hw, i), or OHWI as (o, i, hw).
    let (shape, strides) = match to_ohwi {
        true => (vec![o, hw, i], vec![i * hw, 1, hw]),
        false => (vec![o, i, hw], vec![hw * i, 1, i]),
    };
    let dst = Layout::contiguous(&shape);
    super::ops::copy_strided(src, &Layout { shape, strides, offset: 0 }, &mut out, &dst)?;
    Ok(out)
}

/// The graph-API plan for (`p`, `dt`, `dir`, `tf32`), or `None` when no engine qualifies (legacy
/// path), taking the outcome of an earlier process's engine walk when one is remembered (TF32
/// choices under their own key: the engines differ; timed choices too). With
/// `PTL_CUDNN_TIMED=1` and no remembered choice, the candidates run on the call's own buffers
/// (`[x, w, y]`, the one being written overwritten afterwards) outside a capture.
#[allow(clippy::too_many_arguments)]
fn graph_plan(
    choices: &ChoiceCache,
    workspace: &mut Workspace,
    dev: &Arc<Dev>,
    h: ns::cudnnHandle_t,
    p: &Conv2dParams,
    dt: DType,
    dir: Dir,
    tf32: bool,
    [x, w, y]: [u64; 3],
) -> Option<super::conv_graph::GraphPlan> {
    let timed = super::conv_graph::timed_candidates();
    // The key of a timed choice names how many engines were timed (six: plain " timed", as stored
    // before other counts existed).
    let timed_key = match timed {
        None => String::new(),
        Some(super::conv_graph::TIMED_CANDIDATES) => " timed".to_string(),
        Some(n) => format!(" timed{n}"),
    };
    let key = format!("{p:?} {dt:?} {dir:?}{}{timed_key}", if tf32 { " tf32" } else { "" });
    let hint = match choices.get(&key) {
        Some(Choice::Legacy) => return None,
        Some(Choice::Engine(k)) => Some(k),
        None => None,
    };
    // An engine that compiles its kernel does so in every process (≈ 150 ms each on the H200)
    // unless an earlier process's serialized plan is restored.
    if let Some(k) = hint {
        if let Some(json) = choices.get_plan(&key, k) {
            match super::conv_graph::load(h, &json, super::conv_graph::workspace_limit(workspace_cap(), p, dt)) {
                Ok(plan) => return Some(plan),
                Err(err) => log::warn!("ptl: {err}; building the plan for {key} again"),
            }
        }
    }
    // Each candidate: one run for its variant pack and caches, then three timed.
    let mut time = |gp: &mut super::conv_graph::GraphPlan| -> Result<f64> {
        let ws = workspace.get(dev, gp.workspace_bytes())?;
        gp.execute(h, x, w, y, ws.ptr)?;
        super::graph::time_on_dev(dev, || -> Result<()> {
            for _ in 0..3 {
                gp.execute(h, x, w, y, ws.ptr)?;
            }
            Ok(())
        })
        .and_then(|(ran, ms)| ran.map(|()| ms))
    };
    let timer: Option<super::conv_graph::PlanTimer<'_>> =
        if timed.is_some() && !super::capture_scope::is_capturing() { Some(&mut time) } else { None };
    match super::conv_graph::build(h, p, dt, dir, hint, tf32, timer) {
        Ok(Built::Plan(plan, k)) => {
            if hint != Some(k) {
                choices.put(&key, Choice::Engine(k));
            }
            if let Some(json) = plan.serialized() {
                choices.put_plan(&key, k, &json);
            }
            Some(plan)
        }
        Ok(Built::NoEngine(why)) => {
            let remembered = choices.dir().map(|d| format!(" (remembered in {})", d.display())).unwrap_or_default();
            log::warn!("ptl: {why}; this shape uses the legacy cuDNN API{remembered}");
            choices.put(&key, Choice::Legacy);
            None
        }
        // A failure of cuDNN itself is not a property of the shape: not remembered.
        Err(err) => {
            log::warn!("ptl: {err}; this shape uses the legacy cuDNN API");
            None
        }
    }
}

pub(crate) fn conv2d(x: &CudaStorage, w: &CudaStorage, p: &Conv2dParams) -> Result<CudaStorage> {
    run(Dir::Fwd, x, w, p, "conv2d")
}
pub(crate) fn conv2d_backward_input(dy: &CudaStorage, w: &CudaStorage, p: &Conv2dParams) -> Result<CudaStorage> {
    run(Dir::BwdData, dy, w, p, "conv2d_backward_input")
}
pub(crate) fn conv2d_backward_weight(dy: &CudaStorage, x: &CudaStorage, p: &Conv2dParams) -> Result<CudaStorage> {
    run(Dir::BwdFilter, dy, x, p, "conv2d_backward_weight")
}

/// Batch size from which an unaligned 1×1 weight gradient (rows not a multiple of 16 bytes: the
/// head's 1-, 4-, 34- and 51-channel outputs) takes the batched GEMM of partials; below it the own
/// narrow kernel (`ops/narrow_wgrad.rs`) computes it. cuBLAS's batched kernel for those shapes
/// costs ≈ 60 µs a layer against ≈ 5 µs per item for one GEMM per item (plus its split-K
/// reductions), and at batch 64 the per-item loop was 768 GEMMs, 1,024 split-K reductions and 504
/// accumulations per step (≈ 7 ms of a 77 ms step's kernels on an H100,
/// `results/2026-12-06-17dc218/`); the own kernel runs on CUDA cores, which the batched GEMM's
/// tensor cores outrun from about this many items.
const UNALIGNED_BATCHED_FROM: usize = 16;

/// Whether the weight gradient of `p` in `dt` is the own narrow kernel's: a planar 1×1 stride-1
/// convolution whose rows are not 16 bytes (the batched GEMM's fast kernels need them: for a 51-
/// or 1-channel output cuBLAS picked a 60 µs kernel, against 4–5 µs for one per item) below
/// [`UNALIGNED_BATCHED_FROM`] items; not f64.
fn takes_narrow_weight_gradient(p: &Conv2dParams, dt: DType) -> bool {
    let pointwise = p.kh == 1 && p.kw == 1 && p.stride == (1, 1) && p.padding == (0, 0) && p.groups == 1;
    let rows16 = [p.c_out, p.c_in, p.h_in * p.w_in].iter().all(|v| (v * dt.size_in_bytes()).is_multiple_of(16));
    pointwise
        && !p.channels_last
        && !p.grad_channels_last
        && !p.input_channels_last
        && matches!(dt, DType::F32 | DType::BF16 | DType::F16)
        && !rows16
        && p.batch < UNALIGNED_BATCHED_FROM
}

/// Whether [`conv2d_backward_weight_and_bias`] computes the bias gradient of `p` in `dt` in the
/// weight gradient's launch: where the weight gradient is the own narrow kernel's, which holds
/// the output gradient in shared memory already (the head's last projections, each with a bias:
/// one reduction launch fewer per projection).
pub(crate) fn fuses_bias_gradient(p: &Conv2dParams, dt: DType) -> bool {
    takes_narrow_weight_gradient(p, dt) && p.batch > 0 && p.h_in * p.w_in > 0
}

/// The weight and bias gradients of `p` from `dy` and `x` in one launch, where
/// [`fuses_bias_gradient`] says so.
pub(crate) fn conv2d_backward_weight_and_bias(dy: &CudaStorage, x: &CudaStorage, p: &Conv2dParams) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "conv2d_backward_weight_and_bias";
    if dy.dtype != x.dtype {
        return Err(Error::DTypeMismatch { op: OP, lhs: dy.dtype, rhs: x.dtype });
    }
    if !fuses_bias_gradient(p, dy.dtype) {
        return Err(Error::invalid(OP, format!("{p:?} in {} has no one-launch bias gradient", dy.dtype)));
    }
    let dev = &dy.buf.dev;
    let w = CudaStorage::alloc(dev, dy.dtype, out_len(Dir::BwdFilter, p))?;
    let b = CudaStorage::alloc(dev, dy.dtype, p.c_out)?;
    super::ops::narrow_pointwise_weight_and_bias_gradients(dy, x, p, w, b)
}

/// 1×1 stride-1 convolutions are plain GEMMs: through cuBLAS (faster than cuDNN's picks here).
/// The weight gradient is one batched GEMM writing an f32 partial per batch item, then one kernel
/// adding the partials in item order and storing the result in the gradient's dtype: two launches
/// whatever the batch (a GEMM per item accumulating with β = 1, plus a cast for halves, took
/// `batch` + 1 launches, and cuBLAS split most of those GEMMs in two: 519 kernels, 1.9 ms of a
/// batch-4 bf16 backward on the H200). Shapes without 16-byte rows below
/// [`UNALIGNED_BATCHED_FROM`] items take the own narrow kernel; f64 keeps the GEMM per item.
fn pointwise(dir: Dir, a: &CudaStorage, b: &CudaStorage, p: &Conv2dParams, out: CudaStorage, tf32: bool) -> Result<CudaStorage> {
    use crate::backend::MatmulParams;
    let dev = &a.buf.dev;
    let dt = a.dtype;
    let hw = p.h_in * p.w_in;
    let (ci, co, n) = (p.c_in, p.c_out, p.batch);
    if p.channels_last {
        return pointwise_channels_last(dir, a, b, p, out, tf32);
    }
    match dir {
        Dir::Fwd => {
            let mp = MatmulParams { lhs_batch: 1, rhs_batch: n, m: co, n: hw, k: ci, lhs_t: false, rhs_t: false };
            super::blas::gemm_math(dev, dt, &mp, b.buf.ptr, a.buf.ptr, out.buf.ptr, 0.0, false, tf32)?;
            Ok(out)
        }
        Dir::BwdData => {
            let mp = MatmulParams { lhs_batch: 1, rhs_batch: n, m: ci, n: hw, k: co, lhs_t: true, rhs_t: false };
            super::blas::gemm_math(dev, dt, &mp, b.buf.ptr, a.buf.ptr, out.buf.ptr, 0.0, false, tf32)?;
            Ok(out)
        }
        Dir::BwdFilter => {
            let half = dt.is_half();
            if takes_narrow_weight_gradient(p, dt) {
                return super::ops::narrow_pointwise_weight_gradient(a, b, p, out);
            }
            if dt == DType::F64 {
                // One GEMM per item accumulating with β = 1.
                let es = dt.size_in_bytes() as u64;
                let mp = MatmulParams { lhs_batch: 1, rhs_batch: 1, m: co, n: ci, k: hw, lhs_t: false, rhs_t: true };
                for i in 0..n as u64 {
                    let (pa, pb) = (a.buf.ptr + i * (co * hw) as u64 * es, b.buf.ptr + i * (ci * hw) as u64 * es);
                    super::blas::gemm_math(dev, dt, &mp, pa, pb, out.buf.ptr, if i == 0 { 0.0 } else { 1.0 }, false, tf32)?;
                }
                return Ok(out);
            }
            let mp = MatmulParams { lhs_batch: n, rhs_batch: n, m: co, n: ci, k: hw, lhs_t: false, rhs_t: true };
            if n == 1 && !half {
                super::blas::gemm_math(dev, dt, &mp, a.buf.ptr, b.buf.ptr, out.buf.ptr, 0.0, false, tf32)?;
                return Ok(out);
            }
            let partials = CudaStorage::alloc(dev, DType::F32, n * co * ci)?;
            super::blas::gemm_math(dev, dt, &mp, a.buf.ptr, b.buf.ptr, partials.buf.ptr, 0.0, half, tf32)?;
            super::ops::sum_partials(&partials, n, &out)?;
            Ok(out)
        }
    }
}

/// [`pointwise`] on channels-last data: the activations are (N·H·W) × C row-major matrices, so
/// each direction is one GEMM over the whole batch — the weight gradient too (its contraction runs
/// over N·H·W), with no partial per batch item.
fn pointwise_channels_last(
    dir: Dir,
    a: &CudaStorage,
    b: &CudaStorage,
    p: &Conv2dParams,
    out: CudaStorage,
    tf32: bool,
) -> Result<CudaStorage> {
    use crate::backend::MatmulParams;
    let dev = &a.buf.dev;
    let dt = a.dtype;
    let (ci, co, rows) = (p.c_in, p.c_out, p.batch * p.h_in * p.w_in);
    let one = |m, n, k, lhs_t, rhs_t| MatmulParams { lhs_batch: 1, rhs_batch: 1, m, n, k, lhs_t, rhs_t };
    match dir {
        // y (rows × co) = x (rows × ci) · wᵀ, w stored (co × ci).
        Dir::Fwd => super::blas::gemm_math(dev, dt, &one(rows, co, ci, false, true), a.buf.ptr, b.buf.ptr, out.buf.ptr, 0.0, false, tf32)?,
        // dx (rows × ci) = dy (rows × co) · w (co × ci).
        Dir::BwdData => {
            super::blas::gemm_math(dev, dt, &one(rows, ci, co, false, false), a.buf.ptr, b.buf.ptr, out.buf.ptr, 0.0, false, tf32)?
        }
        // dw (co × ci) = dyᵀ (co × rows) · x (rows × ci); halves accumulate into f32, then one cast.
        Dir::BwdFilter => {
            let mp = one(co, ci, rows, true, false);
            if dt.is_half() {
                let acc = CudaStorage::alloc(dev, DType::F32, co * ci)?;
                super::blas::gemm_math(dev, dt, &mp, a.buf.ptr, b.buf.ptr, acc.buf.ptr, 0.0, true, tf32)?;
                super::ops::sum_partials(&acc, 1, &out)?;
            } else {
                super::blas::gemm_math(dev, dt, &mp, a.buf.ptr, b.buf.ptr, out.buf.ptr, 0.0, false, tf32)?;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(c_in: usize, c_out: usize, k: usize, groups: usize) -> Conv2dParams {
        Conv2dParams {
            channels_last: false,
            weight_channels_last: true,
            grad_channels_last: false,
            input_channels_last: false,
            batch: 4,
            c_in,
            h_in: 40,
            w_in: 40,
            c_out,
            kh: k,
            kw: k,
            stride: (1, 1),
            padding: (k / 2, k / 2),
            groups,
        }
    }

    /// The output gradient is converted once for the 3×3 shapes cuDNN computes in NHWC, and
    /// left alone where a conversion would be one more kernel for nothing (1×1 GEMMs, grouped
    /// convolutions, the thin-input weight gradient, f64, channels-last data) or where NHWC
    /// engines pad the channels (85 of the pose stems).
    #[test]
    fn the_output_gradient_is_converted_once_where_both_gradients_convert_it() {
        assert!(reads_channels_last_output_gradient(&conv(64, 64, 3, 1), DType::BF16));
        assert!(reads_channels_last_output_gradient(&conv(32, 64, 3, 1), DType::F32));
        assert!(!reads_channels_last_output_gradient(&conv(64, 64, 1, 1), DType::BF16), "1×1: a GEMM");
        assert!(!reads_channels_last_output_gradient(&conv(64, 64, 3, 64), DType::BF16), "depthwise");
        assert!(!reads_channels_last_output_gradient(&conv(3, 16, 3, 1), DType::BF16), "thin input");
        assert!(!reads_channels_last_output_gradient(&conv(64, 64, 3, 1), DType::F64), "f64: legacy API");
        assert!(!reads_channels_last_output_gradient(&conv(85, 85, 3, 1), DType::BF16), "channels off the vector");
        assert!(reads_channels_last_output_gradient(&conv(84, 84, 3, 1), DType::F32), "f32 vectors of four channels");
        let cl = Conv2dParams { channels_last: true, ..conv(64, 64, 3, 1) };
        assert!(!reads_channels_last_output_gradient(&cl, DType::BF16), "channels-last data reads it as it lies already");
        // 4 × 64 × 40 × 40 bf16 values are 800 KiB; a batch of 64 at 320 × 320 with 16
        // channels is 200 MiB.
        let large = Conv2dParams { batch: 64, h_in: 320, w_in: 320, ..conv(16, 16, 3, 1) };
        assert!(!reads_channels_last_output_gradient(&large, DType::BF16), "a large gradient is left to cuDNN");
        let at_four = Conv2dParams { batch: 4, h_in: 320, w_in: 320, ..conv(16, 16, 3, 1) };
        assert!(reads_channels_last_output_gradient(&at_four, DType::BF16), "batch 4's largest layer: 12.5 MiB");
    }

    /// The input is converted once for the forward call and the weight gradient at the shapes
    /// whose output gradient is (cuDNN computes them in NHWC), limited by the input's own size:
    /// a stride-2 convolution's input is four times its output.
    #[test]
    fn the_input_is_converted_once_where_both_calls_convert_it() {
        assert!(reads_channels_last_input(&conv(64, 64, 3, 1), DType::BF16));
        assert!(!reads_channels_last_input(&conv(64, 64, 1, 1), DType::BF16), "1×1: a GEMM");
        assert!(!reads_channels_last_input(&conv(64, 64, 3, 64), DType::BF16), "depthwise");
        assert!(!reads_channels_last_input(&conv(3, 16, 3, 1), DType::BF16), "thin input");
        assert!(!reads_channels_last_input(&conv(85, 85, 3, 1), DType::BF16), "channels off the vector");
        let cl = Conv2dParams { channels_last: true, ..conv(64, 64, 3, 1) };
        assert!(!reads_channels_last_input(&cl, DType::BF16), "channels-last data is read as it lies already");
        // Batch 4 at 640 px: the first stride-2 3×3 convolution after the stem reads 16 × 320 ×
        // 320 (12.5 MiB); at batch 64 it is 200 MiB and left to cuDNN.
        let strided = |batch| Conv2dParams { batch, h_in: 320, w_in: 320, stride: (2, 2), ..conv(16, 32, 3, 1) };
        assert!(reads_channels_last_input(&strided(4), DType::BF16));
        assert!(!reads_channels_last_input(&strided(64), DType::BF16), "a large input is left to cuDNN");
        // Input and output sizes are limited apart: this input is 50 MiB, its output 12.5 MiB.
        let at_sixteen = strided(16);
        assert!(!reads_channels_last_input(&at_sixteen, DType::BF16));
        assert!(reads_channels_last_output_gradient(&Conv2dParams { c_out: 16, ..at_sixteen }, DType::BF16));
    }
}

//! Convolutions (forward, backward-data, backward-filter; f32, bf16, f16) through cuDNN's graph
//! (backend) API.
//!
//! Why: for NCHW half-precision 3×3 convolutions the legacy API's algorithms measured 1.5–4× slower
//! on the H200 than what PyTorch reaches through the graph API (`docs/cuda-ops-h200.md`), and in cuDNN 9
//! a legacy call costs ~35 µs of host time against a few µs for executing a built plan. Engines
//! are taken in cuDNN's heuristic order (mode INSTANT: the same ranking in every process, so a
//! fixed seed still gives the same bytes run to run), skipping engines cuDNN marks
//! nondeterministic or as reducing in reduced precision (products must accumulate in f32), and for
//! f32 engines on tensor cores (TF32) unless the device's `tf32_convolutions` allows them: by
//! default f32 stays true FP32. The first engine that builds an
//! execution plan within the workspace limit is kept for the shape. If none does, the caller falls
//! back to the legacy API. `PTL_CUDNN_LEGACY=1` forces the legacy path (for comparison).
//! `PTL_CUDNN_TIMED=1` ([`timed_candidates`]) times the first few usable engines instead and keeps the
//! fastest, remembered so that later processes take it untimed (the same bytes).
//!
//! Executing needs a "variant pack" (the call's device pointers); building one is most of the host
//! cost of a call, so each plan keeps the last few packs keyed by their pointers (the allocator
//! hands the same addresses back step after step). Plans share one workspace (the convolution module's).

use std::ffi::c_void;

use cudarc::cudnn::sys as ns;
use ns::cudnnBackendAttributeName_t as A;
use ns::cudnnBackendAttributeType_t as T;
use ns::cudnnBackendDescriptorType_t as D;

use super::counters::Setup;
use crate::backend::Conv2dParams;
use crate::{DType, Error, Result};

/// One backend descriptor, destroyed on drop.
struct Desc(ns::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: created by cudnnBackendCreateDescriptor and destroyed once.
            unsafe {
                ns::cudnnBackendDestroyDescriptor(self.0);
            }
        }
    }
}

fn check(what: &str, st: ns::cudnnStatus_t) -> Result<()> {
    if st == ns::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("cuDNN graph API: {what}: {st:?}")))
    }
}

/// `check` for attribute setters: the message is only formatted on failure (this runs per call).
fn check_set(name: A, st: ns::cudnnStatus_t) -> Result<()> {
    if st == ns::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("cuDNN graph API: set {name:?}: {st:?}")))
    }
}

impl Desc {
    fn new(ty: D) -> Result<Desc> {
        let mut d: ns::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `d` receives a fresh descriptor.
        check("create descriptor", unsafe { ns::cudnnBackendCreateDescriptor(ty, &mut d) })?;
        Ok(Desc(d))
    }

    /// Sets an attribute from a slice of values of the matching C type.
    fn set<V>(&self, name: A, ty: T, vals: &[V]) -> Result<()> {
        // SAFETY: `vals` holds `len` elements of the C type `ty` names (checked by each caller).
        check_set(name, unsafe { ns::cudnnBackendSetAttribute(self.0, name, ty, vals.len() as i64, vals.as_ptr() as *const c_void) })
    }

    /// Reads attribute `name` into `out` (values of the C type `ty`); returns how many were
    /// written (with an empty `out`: how many there are).
    fn get<V>(&self, name: A, ty: T, out: &mut [V]) -> Result<usize> {
        let mut n = 0i64;
        let ptr = if out.is_empty() { std::ptr::null_mut() } else { out.as_mut_ptr() as *mut c_void };
        // SAFETY: `out` has room for `len` elements of the C type `ty` (checked by each caller).
        let st = unsafe { ns::cudnnBackendGetAttribute(self.0, name, ty, out.len() as i64, &mut n, ptr) };
        if st != ns::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            return Err(Error::Cuda(format!("cuDNN graph API: get {name:?}: {st:?}")));
        }
        Ok(n.max(0) as usize)
    }

    fn set_desc(&self, name: A, d: &Desc) -> Result<()> {
        self.set(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[d.0])
    }

    fn finalize(&self, what: &str) -> Result<()> {
        // SAFETY: a live descriptor.
        check(what, unsafe { ns::cudnnBackendFinalize(self.0) })
    }
}

/// Which convolution a plan computes. Buffers are named after the forward convolution whatever
/// the direction: `x` (input / its gradient), `w` (filter / its gradient), `y` (output / its
/// gradient).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Dir {
    /// y = conv(x, w)
    Fwd,
    /// dx = conv_transpose(dy, w)
    BwdData,
    /// dw = correlation of dy with x
    BwdFilter,
}

/// Variant packs kept per plan (most recently used last).
const PACKS_KEPT: usize = 8;

/// A built plan (descriptors kept alive with it), the workspace it needs, and its recent variant
/// packs (keyed by the three tensor addresses and the workspace address).
pub(crate) struct GraphPlan {
    plan: Desc,
    ws_bytes: usize,
    packs: Vec<([u64; 4], Desc)>,
    _keep: Vec<Desc>,
    /// Whether its engine compiled the kernel when the plan was finalized (such plans can be
    /// serialized, see [`GraphPlan::serialized`]).
    runtime_compiled: bool,
}

const UID_X: i64 = 1;
const UID_W: i64 = 2;
const UID_Y: i64 = 3;
/// Our buffers start at ≥ 256-byte boundaries (pool and arena allocations).
const ALIGN: i64 = 16;

fn data_type(dt: DType) -> Result<ns::cudnnDataType_t> {
    match dt {
        DType::F32 => Ok(ns::cudnnDataType_t::CUDNN_DATA_FLOAT),
        DType::BF16 => Ok(ns::cudnnDataType_t::CUDNN_DATA_BFLOAT16),
        DType::F16 => Ok(ns::cudnnDataType_t::CUDNN_DATA_HALF),
        other => Err(Error::UnsupportedDType { op: "conv2d (cuDNN graph)", dtype: other, expected: "f32, bf16 or f16" }),
    }
}

/// A tensor of logical NCHW `dims`, stored N, C, H, W or (`channels_last`) N, H, W, C.
fn tensor(uid: i64, dims: [usize; 4], dt: ns::cudnnDataType_t, channels_last: bool) -> Result<Desc> {
    let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    let dims = dims.map(|v| v as i64);
    let strides = match channels_last {
        false => [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1],
        true => [dims[1] * dims[2] * dims[3], 1, dims[3] * dims[1], dims[1]],
    };
    d.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE, T::CUDNN_TYPE_DATA_TYPE, &[dt])?;
    d.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, T::CUDNN_TYPE_INT64, &dims)?;
    d.set(A::CUDNN_ATTR_TENSOR_STRIDES, T::CUDNN_TYPE_INT64, &strides)?;
    d.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, T::CUDNN_TYPE_INT64, &[uid])?;
    d.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, T::CUDNN_TYPE_INT64, &[ALIGN])?;
    d.finalize("tensor")?;
    Ok(d)
}

/// Numerical notes that rule an engine out for data of type `dt`: nondeterminism, reductions in
/// reduced precision, down-converted inputs, and for f32 tensor cores (they run TF32) unless
/// `tf32` allows them.
fn excluded(note: ns::cudnnBackendNumericalNote_t, dt: DType, tf32: bool) -> bool {
    use ns::cudnnBackendNumericalNote_t as N;
    matches!(
        note,
        N::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC
            | N::CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION
            | N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS
    ) || (dt == DType::F32 && !tf32 && note == N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE)
}

/// Builds the plan for direction `dir` of `p` in `dt` and says which position of cuDNN's ranking
/// it took, or explains why none is usable. `hint`: the position a previous process ended with
/// for the same shape, cuDNN and GPU (`conv_choice`), tried first; if it no longer builds, the
/// whole ranking is walked as without one.
/// Runs a candidate plan on the call's tensors and returns its milliseconds ([`build`]).
pub(crate) type PlanTimer<'a> = &'a mut dyn FnMut(&mut GraphPlan) -> Result<f64>;

/// Engines [`build`] times with `PTL_CUDNN_TIMED=1` (the first usable ones of cuDNN's ranking).
pub(crate) const TIMED_CANDIDATES: usize = 6;
/// The most engines [`build`] reads from cuDNN's ranking (and times with `PTL_CUDNN_TIMED=all`).
const MAX_CANDIDATES: usize = 64;

/// How many engines are timed when convolution engines are chosen by timing (`PTL_CUDNN_TIMED`:
/// `1` the first [`TIMED_CANDIDATES`] usable engines of cuDNN's ranking, `all` every usable one,
/// `2`–`64` that many), `None` when they are not. Each candidate runs on the call's own tensors
/// and the fastest is kept — and remembered with the plans under its own key, so a later process
/// takes the same engine (the same bytes) without timing. Off by default: the ranking alone picks,
/// the same engine on every machine of one GPU model.
pub(crate) fn timed_candidates() -> Option<usize> {
    static N: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *N.get_or_init(|| parse_timed(std::env::var("PTL_CUDNN_TIMED").ok().as_deref()))
}

/// `PTL_CUDNN_TIMED`'s value as a candidate count ([`timed_candidates`]); anything else is off,
/// with a warning.
fn parse_timed(v: Option<&str>) -> Option<usize> {
    match v.map(str::trim) {
        None | Some("") | Some("0") => None,
        Some("1") => Some(TIMED_CANDIDATES),
        Some("all") => Some(MAX_CANDIDATES),
        Some(other) => match other.parse::<usize>() {
            Ok(n) if (2..=MAX_CANDIDATES).contains(&n) => Some(n),
            _ => {
                log::warn!("ptl: PTL_CUDNN_TIMED={other:?} is not 1, all or a count from 2 to {MAX_CANDIDATES}; engines are not timed");
                None
            }
        },
    }
}

/// A plan for the convolution: cuDNN's first usable deterministic engine in its ranking (the
/// remembered `hint` first), or, given `time`, the fastest of the first [`timed_candidates`]
/// usable ones (`time` runs a candidate plan and returns its milliseconds).
pub(crate) fn build(
    handle: ns::cudnnHandle_t,
    p: &Conv2dParams,
    dt: DType,
    dir: Dir,
    hint: Option<usize>,
    tf32: bool,
    time: Option<PlanTimer<'_>>,
) -> Result<Built> {
    let want = if time.is_some() && hint.is_none() { timed_candidates().unwrap_or(TIMED_CANDIDATES) } else { 1 };
    let t = data_type(dt)?;
    // Activations in the data's format, the weight in its own (OIHW, or O, H, W, I: KRSC).
    // The input may lie N, H, W, C beside a contiguous output (converted once for the forward
    // call and the weight gradient); the data gradient is written in the activations' format.
    let x_channels_last = p.channels_last || (dir != Dir::BwdData && p.input_channels_last);
    let x = tensor(UID_X, [p.batch, p.c_in, p.h_in, p.w_in], t, x_channels_last)?;
    let w = tensor(UID_W, p.weight_shape(), t, p.weight_channels_last)?;
    // The output gradient may lie N, H, W, C beside contiguous activations (converted once for
    // both gradients).
    let y_channels_last = p.channels_last || (dir != Dir::Fwd && p.grad_channels_last);
    let y = tensor(UID_Y, p.out_shape(), t, y_channels_last)?;
    let conv = Desc::new(D::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE, T::CUDNN_TYPE_DATA_TYPE, &[ns::cudnnDataType_t::CUDNN_DATA_FLOAT])?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_CONV_MODE, T::CUDNN_TYPE_CONVOLUTION_MODE, &[ns::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION])?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, T::CUDNN_TYPE_INT64, &[2i64])?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_DILATIONS, T::CUDNN_TYPE_INT64, &[1i64, 1])?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, T::CUDNN_TYPE_INT64, &[p.stride.0 as i64, p.stride.1 as i64])?;
    let pad = [p.padding.0 as i64, p.padding.1 as i64];
    conv.set(A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, T::CUDNN_TYPE_INT64, &pad)?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, T::CUDNN_TYPE_INT64, &pad)?;
    conv.finalize("convolution")?;
    let op = operation(dir, &x, &w, &y, &conv)?;
    let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[op.0])?;
    graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, T::CUDNN_TYPE_HANDLE, &[handle])?;
    graph.finalize("operation graph")?;
    let (heur, cfgs, got) = super::counters::time_setup(Setup::ConvHeuristics, || -> Result<(Desc, Vec<Desc>, usize)> {
        let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heur.set_desc(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &graph)?;
        heur.set(A::CUDNN_ATTR_ENGINEHEUR_MODE, T::CUDNN_TYPE_HEUR_MODE, &[heuristic_mode()])?;
        heur.finalize("engine heuristics")?;
        let results = (A::CUDNN_ATTR_ENGINEHEUR_RESULTS, T::CUDNN_TYPE_BACKEND_DESCRIPTOR);
        let count = heur.get::<ns::cudnnBackendDescriptor_t>(results.0, results.1, &mut [])?;
        let cfgs: Vec<Desc> =
            (0..count.min(MAX_CANDIDATES)).map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)).collect::<Result<_>>()?;
        // cuDNN fills the created engine-config descriptors.
        let mut raw: Vec<ns::cudnnBackendDescriptor_t> = cfgs.iter().map(|c| c.0).collect();
        let got = heur.get(results.0, results.1, &mut raw)?;
        Ok((heur, cfgs, got))
    })?;
    let limit = workspace_limit(workspace_cap(), p, dt);
    let mut why = Vec::new();
    // (plan, workspace bytes, engine, compiled at run time, position in the ranking)
    let mut found: Vec<(Desc, usize, Desc, bool, usize)> = Vec::new();
    if let Some(k) = hint.filter(|&k| k < got) {
        if let Ok((plan, ws_bytes, engine, compiled)) = try_engine(handle, &cfgs[k], dt, tf32, limit) {
            found.push((plan, ws_bytes, engine, compiled, k));
        }
    }
    if found.is_empty() {
        for (k, cfg) in cfgs.iter().take(got).enumerate() {
            match try_engine(handle, cfg, dt, tf32, limit) {
                Ok((plan, ws_bytes, engine, compiled)) => {
                    found.push((plan, ws_bytes, engine, compiled, k));
                    if found.len() == want {
                        break;
                    }
                }
                Err(reason) => why.push(format!("#{k}: {reason}")),
            }
        }
    }
    if found.is_empty() {
        return Ok(Built::NoEngine(format!(
            "cuDNN graph API: no usable deterministic {dir:?} engine among {got} for {p:?} {dt} ({})",
            why.join("; ")
        )));
    }
    let mut plans: Vec<(GraphPlan, usize)> = found
        .into_iter()
        .map(|(plan, ws_bytes, engine, runtime_compiled, k)| {
            (GraphPlan { plan, ws_bytes, packs: Vec::new(), _keep: vec![engine], runtime_compiled }, k)
        })
        .collect();
    // The fastest by `time` (ties and failed timings: the better-ranked), else cuDNN's first.
    let pick = match time.filter(|_| plans.len() > 1) {
        Some(time) => fastest(&plans.iter_mut().map(|(plan, _)| time(plan).ok()).collect::<Vec<_>>()),
        None => 0,
    };
    let (mut chosen, position) = plans.swap_remove(pick);
    drop(plans);
    // Kept in the order the descriptors were made (its engine after the heuristics).
    let engine = std::mem::take(&mut chosen._keep);
    chosen._keep = vec![x, w, y, conv, op, graph, heur];
    chosen._keep.extend(engine);
    chosen._keep.extend(cfgs);
    Ok(Built::Plan(chosen, position))
}

/// The index of the smallest timing (the first of equal ones; failed timings, `None`, never win
/// unless all failed: then 0, cuDNN's first).
fn fastest(ms: &[Option<f64>]) -> usize {
    let mut pick = 0;
    let mut best = f64::INFINITY;
    for (i, t) in ms.iter().enumerate() {
        if let Some(t) = t.filter(|t| *t < best) {
            best = t;
            pick = i;
        }
    }
    pick
}

/// What walking cuDNN's ranking for one shape gave.
pub(crate) enum Built {
    /// A plan and its engine's position in the ranking.
    Plan(GraphPlan, usize),
    /// Every engine was refused (why, engine by engine): the shape needs the legacy API.
    NoEngine(String),
}

/// cuDNN's engine ranking: INSTANT, or `PTL_CUDNN_HEUR=a` / `b` for heuristics modes A and B. All
/// three rank without timing anything, so the pick is the same in every process (a fixed seed still
/// gives the same bytes); they may pick different engines (for comparing them on the bench).
pub(crate) fn heuristic_mode() -> ns::cudnnBackendHeurMode_t {
    static MODE: std::sync::OnceLock<ns::cudnnBackendHeurMode_t> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("PTL_CUDNN_HEUR").as_deref() {
        Ok("a") => ns::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        Ok("b") => ns::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B,
        Ok("instant") | Err(_) => ns::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_INSTANT,
        Ok(other) => {
            log::warn!("ptl: PTL_CUDNN_HEUR={other:?} is not `instant`, `a` or `b`; using `instant`");
            ns::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_INSTANT
        }
    })
}

/// The convolution operation node of direction `dir` (α = 1, β = 0).
fn operation(dir: Dir, x: &Desc, w: &Desc, y: &Desc, conv: &Desc) -> Result<Desc> {
    let (ty, [ax, aw, ay, ac, alpha, beta], what) = match dir {
        Dir::Fwd => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
            ],
            "convolution forward operation",
        ),
        Dir::BwdData => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
            ],
            "convolution backward-data operation",
        ),
        Dir::BwdFilter => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
            ],
            "convolution backward-filter operation",
        ),
    };
    let op = Desc::new(ty)?;
    op.set_desc(ax, x)?;
    op.set_desc(aw, w)?;
    op.set_desc(ay, y)?;
    op.set_desc(ac, conv)?;
    op.set(alpha, T::CUDNN_TYPE_FLOAT, &[1f32])?;
    op.set(beta, T::CUDNN_TYPE_FLOAT, &[0f32])?;
    op.finalize(what)?;
    Ok(op)
}

/// Checks one heuristic result: its engine's numerical notes, then whether a plan builds. Gives
/// the plan, its workspace bytes, the engine and whether the engine compiled its kernel.
fn try_engine(
    handle: ns::cudnnHandle_t,
    cfg: &Desc,
    dt: DType,
    tf32: bool,
    limit: usize,
) -> std::result::Result<(Desc, usize, Desc, bool), String> {
    let engine = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR).map_err(|e| e.to_string())?;
    // cuDNN fills the created engine descriptor.
    cfg.get(A::CUDNN_ATTR_ENGINECFG_ENGINE, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &mut [engine.0])
        .map_err(|e| format!("engine unreadable ({e})"))?;
    let mut notes = [ns::cudnnBackendNumericalNote_t::CUDNN_NUMERICAL_NOTE_TYPE_COUNT; 16];
    let nn = engine
        .get(A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, T::CUDNN_TYPE_NUMERICAL_NOTE, &mut notes)
        .map_err(|e| format!("notes unreadable ({e})"))?;
    if let Some(bad) = notes[..nn.min(16)].iter().find(|n| excluded(**n, dt, tf32)) {
        return Err(format!("{bad:?}"));
    }
    let compiles = compiles_at_run_time(&engine);
    if compiles && !runtime_compiled_allowed() {
        return Err("compiles at run time (PTL_CUDNN_RUNTIME_COMPILED=off)".into());
    }
    let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR).map_err(|e| e.to_string())?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, T::CUDNN_TYPE_HANDLE, &[handle]).map_err(|e| e.to_string())?;
    plan.set_desc(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg).map_err(|e| e.to_string())?;
    let started = std::time::Instant::now();
    let finalized = plan.finalize("execution plan");
    let took = started.elapsed();
    super::counters::add_setup(Setup::ConvFinalize, took);
    if compiles {
        super::counters::add_setup(Setup::ConvRuntimeCompiled, took);
    }
    finalized.map_err(|e| e.to_string())?;
    let ws = workspace_within_limit(&plan, limit)?;
    Ok((plan, ws, engine, compiles))
}

/// The plan's workspace bytes, refused above `limit`.
fn workspace_within_limit(plan: &Desc, limit: usize) -> std::result::Result<usize, String> {
    let mut ws = [0i64];
    plan.get(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, T::CUDNN_TYPE_INT64, &mut ws)
        .map_err(|e| format!("workspace size unreadable ({e})"))?;
    let ws = ws[0];
    if ws > limit as i64 {
        return Err(format!("workspace {ws} bytes"));
    }
    Ok(ws.max(0) as usize)
}

/// A plan restored from [`GraphPlan::serialized`] (same cuDNN, same GPU): no kernel compile.
pub(crate) fn load(handle: ns::cudnnHandle_t, json: &[u8], limit: usize) -> Result<GraphPlan> {
    let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, T::CUDNN_TYPE_CHAR, json)?;
    plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, T::CUDNN_TYPE_HANDLE, &[handle])?;
    super::counters::time_setup(Setup::ConvPlanLoad, || plan.finalize("execution plan (serialized)"))?;
    let ws_bytes = workspace_within_limit(&plan, limit).map_err(|e| Error::Cuda(format!("cuDNN graph API: serialized plan: {e}")))?;
    Ok(GraphPlan { plan, ws_bytes, packs: Vec::new(), _keep: Vec::new(), runtime_compiled: true })
}

/// Whether cuDNN compiles the engine's kernel when a plan is finalized (NVRTC) rather than taking
/// a precompiled one; an unreadable note counts as precompiled.
fn compiles_at_run_time(engine: &Desc) -> bool {
    use ns::cudnnBackendBehaviorNote_t as B;
    let mut notes = [B::CUDNN_BEHAVIOR_NOTE_TYPE_COUNT; 16];
    match engine.get(A::CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, T::CUDNN_TYPE_BEHAVIOR_NOTE, &mut notes) {
        Ok(n) => notes[..n.min(16)].contains(&B::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION),
        Err(_) => false,
    }
}

/// Whether engines that compile at run time may be chosen (`PTL_CUDNN_RUNTIME_COMPILED=off`
/// refuses them: their finalize compiles a kernel in every process).
pub(crate) fn runtime_compiled_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PTL_CUDNN_RUNTIME_COMPILED").map_or(true, |v| v != "off"))
}

impl GraphPlan {
    /// The plan as cuDNN's serialized form (JSON text), for a plan whose engine compiled its kernel
    /// (the only kind cuDNN serializes); `None` otherwise or when cuDNN declines.
    pub(crate) fn serialized(&self) -> Option<Vec<u8>> {
        if !self.runtime_compiled {
            return None;
        }
        let name = A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION;
        let n = self.plan.get::<u8>(name, T::CUDNN_TYPE_CHAR, &mut []).ok()?;
        let mut text = vec![0u8; n];
        let got = self.plan.get(name, T::CUDNN_TYPE_CHAR, &mut text).ok()?;
        text.truncate(got);
        while text.last() == Some(&0) {
            text.pop();
        }
        (!text.is_empty()).then_some(text)
    }

    /// Workspace bytes the plan needs (the convolution module's shared workspace hands them out).
    pub(crate) fn workspace_bytes(&self) -> usize {
        self.ws_bytes
    }

    /// Queues the plan's convolution on the handle's stream with the buffers named as in the
    /// forward convolution (see [`Dir`]): reads two of `x`, `w`, `y` and writes the third.
    /// `ws`: a device workspace of at least [`Self::workspace_bytes`] bytes.
    pub(crate) fn execute(&mut self, handle: ns::cudnnHandle_t, x: u64, w: u64, y: u64, ws: u64) -> Result<()> {
        let key = [x, w, y, ws];
        let pack = match self.packs.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                let hit = self.packs.remove(i);
                self.packs.push(hit);
                &self.packs[self.packs.len() - 1].1
            }
            None => {
                let vp = self.variant_pack(key)?;
                if self.packs.len() == PACKS_KEPT {
                    self.packs.remove(0);
                }
                self.packs.push((key, vp));
                &self.packs[self.packs.len() - 1].1
            }
        };
        // SAFETY: a finalized plan and variant pack whose pointers are live device buffers (the
        // pack was built for exactly these pointers).
        check("execute", unsafe { ns::cudnnBackendExecute(handle, self.plan.0, pack.0) })
    }

    fn variant_pack(&self, [x, w, y, ws]: [u64; 4]) -> Result<Desc> {
        let vp = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        let ptrs: [*mut c_void; 3] = [x as *mut c_void, w as *mut c_void, y as *mut c_void];
        vp.set(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, T::CUDNN_TYPE_INT64, &[UID_X, UID_W, UID_Y])?;
        vp.set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, T::CUDNN_TYPE_VOID_PTR, &ptrs)?;
        let ws = ws as *mut c_void;
        vp.set(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, T::CUDNN_TYPE_VOID_PTR, &[ws])?;
        vp.finalize("variant pack")?;
        Ok(vp)
    }
}

/// How large a workspace a convolution plan may need: 32 MiB for every shape, another fixed cap
/// with `PTL_CUDNN_WORKSPACE_MIB=<MiB>`, or a cap that follows the shape with
/// `PTL_CUDNN_WORKSPACE_MIB=auto` ([`workspace_limit`]). Engines needing more are passed over for
/// the next one in cuDNN's ranking. The workspace is one buffer held for the whole run, sized to
/// the largest need (validation's larger batch included), so it adds to the peak memory one for
/// one.
pub(crate) fn workspace_cap() -> WorkspaceCap {
    static CAP: std::sync::OnceLock<WorkspaceCap> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("PTL_CUDNN_WORKSPACE_MIB") {
        Err(_) => WorkspaceCap::Fixed(MIN_WS),
        Ok(v) if v.trim() == "auto" => WorkspaceCap::PerShape,
        Ok(v) => WorkspaceCap::Fixed(parse_workspace_mib(&v).unwrap_or_else(|e| {
            log::warn!("ptl: {e}; using {} MiB", MIN_WS >> 20);
            MIN_WS
        })),
    })
}

/// The rule that caps a plan's workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WorkspaceCap {
    /// One cap in bytes for every shape (the default, or `PTL_CUDNN_WORKSPACE_MIB=<MiB>`).
    Fixed(usize),
    /// [`workspace_limit`] of each shape (`PTL_CUDNN_WORKSPACE_MIB=auto`).
    PerShape,
}

impl std::fmt::Display for WorkspaceCap {
    /// As the engine-choice cache's context names it (choices made under another rule are not
    /// reused).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkspaceCap::Fixed(b) => write!(f, "{b}, channels-last padding"),
            WorkspaceCap::PerShape => write!(f, "per-shape {MIN_WS}+x+y, channels-last padding"),
        }
    }
}

/// The workspace cap of one convolution in `dt` under `cap`; per shape, the larger of 32 MiB and
/// the bytes of its input and output plus 1 MiB. Why the per-shape rule exists: cuDNN's fast
/// engines on Hopper compute in NHWC and convert NCHW tensors in their workspace — x and y, a few
/// kilobytes over their sizes — so the fixed 32 MiB refuses every engine of the 3×3 convolutions
/// at batch 64 (57 shapes of training and validation went to the legacy API there,
/// `results/2026-12-06-17dc218/`). It is not the default because the one workspace buffer then
/// grows to the largest layer's input and output — at batch 64 about 300 MiB for training and
/// twice that for validation's batch of 128 — and it stays allocated.
pub(crate) fn workspace_limit(cap: WorkspaceCap, p: &crate::backend::Conv2dParams, dt: DType) -> usize {
    let by_rule = match cap {
        WorkspaceCap::Fixed(b) => b,
        WorkspaceCap::PerShape => {
            let x = p.batch * p.c_in * p.h_in * p.w_in;
            let y: usize = p.out_shape().iter().product();
            MIN_WS.max((x + y) * dt.size_in_bytes() + (1 << 20))
        }
    };
    by_rule.max(channel_padding_workspace(p, dt))
}

/// The workspace a channels-last convolution with a channel count off the 16-byte vector needs:
/// cuDNN's NHWC engines pad x and y to whole vectors of channels in their workspace (85 → 88 in
/// bf16 — the pose stems' 17 × 5 channels), and no legacy algorithm computes such a weight
/// gradient deterministically, so without room for the padded copies the shape has no engine at
/// all. Zero for every other convolution. The padded x and y plus 1 MiB: at batch 64 the
/// 85 → 85 3×3 convolution at 80 × 80 asked for 144,318,739 bytes, this gives 145,227,776.
fn channel_padding_workspace(p: &crate::backend::Conv2dParams, dt: DType) -> usize {
    let vector = (16 / dt.size_in_bytes()).max(1);
    if !p.channels_last || (p.c_in.is_multiple_of(vector) && p.c_out.is_multiple_of(vector)) {
        return 0;
    }
    let padded = |c: usize| c.div_ceil(vector) * vector;
    let [n, _, ho, wo] = p.out_shape();
    (n * padded(p.c_in) * p.h_in * p.w_in + n * padded(p.c_out) * ho * wo) * dt.size_in_bytes() + (1 << 20)
}

/// `PTL_CUDNN_WORKSPACE_MIB`'s value in bytes (at most 16 GiB).
fn parse_workspace_mib(v: &str) -> std::result::Result<usize, String> {
    match v.trim().parse::<usize>() {
        Ok(m) if m <= 16 << 10 => Ok(m << 20),
        _ => Err(format!("PTL_CUDNN_WORKSPACE_MIB={v:?} is not a number of MiB up to 16384")),
    }
}

/// The smallest workspace cap: what every shape may use (and the fallback for a bad
/// `PTL_CUDNN_WORKSPACE_MIB`).
const MIN_WS: usize = 32 << 20;

#[cfg(test)]
mod tests {
    #[test]
    fn the_fastest_candidate_wins_ties_go_to_the_better_ranked() {
        use super::fastest;
        assert_eq!(fastest(&[Some(2.0), Some(1.0), Some(1.5)]), 1);
        assert_eq!(fastest(&[Some(1.0), Some(1.0)]), 0, "a tie keeps cuDNN's order");
        assert_eq!(fastest(&[None, Some(3.0), None]), 1, "a failed timing never wins");
        assert_eq!(fastest(&[None, None]), 0, "nothing timed: cuDNN's first");
        assert_eq!(fastest(&[Some(f64::NAN), Some(4.0)]), 1, "NaN is no timing");
    }

    #[test]
    fn timed_counts_read_from_the_environment_value() {
        use super::{parse_timed, MAX_CANDIDATES, TIMED_CANDIDATES};
        assert_eq!(parse_timed(None), None);
        assert_eq!(parse_timed(Some("0")), None);
        assert_eq!(parse_timed(Some("1")), Some(TIMED_CANDIDATES), "1 keeps the six of before");
        assert_eq!(parse_timed(Some("all")), Some(MAX_CANDIDATES));
        assert_eq!(parse_timed(Some(" 12 ")), Some(12));
        assert_eq!(parse_timed(Some("65")), None, "more than the ranking is read");
        assert_eq!(parse_timed(Some("yes")), None);
    }

    #[test]
    fn per_shape_caps_follow_the_tensors() {
        use super::{workspace_limit, WorkspaceCap, MIN_WS};
        let mut p = crate::backend::Conv2dParams {
            channels_last: false,
            weight_channels_last: false,
            grad_channels_last: false,
            input_channels_last: false,
            batch: 64,
            c_in: 16,
            h_in: 320,
            w_in: 320,
            c_out: 32,
            kh: 3,
            kw: 3,
            stride: (2, 2),
            padding: (1, 1),
            groups: 1,
        };
        // x 64·16·320·320 and y 64·32·160·160 bf16 values: the 314,582,032 bytes cuDNN's engines
        // asked for this shape fit under the cap.
        let cap = workspace_limit(WorkspaceCap::PerShape, &p, crate::DType::BF16);
        assert_eq!(cap, (64 * 16 * 320 * 320 + 64 * 32 * 160 * 160) * 2 + (1 << 20));
        assert!(cap >= 314_582_032);
        assert_eq!(workspace_limit(WorkspaceCap::Fixed(7), &p, crate::DType::BF16), 7);
        p.batch = 1;
        assert_eq!(workspace_limit(WorkspaceCap::PerShape, &p, crate::DType::BF16), MIN_WS, "small shapes keep the floor");
    }

    #[test]
    fn channels_last_shapes_off_the_vector_get_room_for_padded_copies() {
        use super::{workspace_limit, WorkspaceCap, MIN_WS};
        let mut p = crate::backend::Conv2dParams {
            channels_last: true,
            weight_channels_last: true,
            grad_channels_last: false,
            input_channels_last: false,
            batch: 64,
            c_in: 85,
            h_in: 80,
            w_in: 80,
            c_out: 85,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            padding: (1, 1),
            groups: 1,
        };
        // cuDNN's engines asked for 144,318,739 bytes for this shape at batch 64 in bf16.
        let cap = workspace_limit(WorkspaceCap::Fixed(MIN_WS), &p, crate::DType::BF16);
        assert_eq!(cap, 2 * 64 * 88 * 80 * 80 * 2 + (1 << 20));
        assert!(cap >= 144_318_739);
        p.c_in = 64; // only the output padded: 72,191,123 bytes asked
        assert!(workspace_limit(WorkspaceCap::Fixed(MIN_WS), &p, crate::DType::BF16) >= 72_191_123);
        p.c_out = 88;
        assert_eq!(workspace_limit(WorkspaceCap::Fixed(MIN_WS), &p, crate::DType::BF16), MIN_WS, "aligned channels: the rule's cap");
        p.c_out = 85;
        p.channels_last = false;
        assert_eq!(workspace_limit(WorkspaceCap::Fixed(MIN_WS), &p, crate::DType::BF16), MIN_WS, "contiguous: the rule's cap");
        p.channels_last = true;
        p.c_out = 84; // a whole number of f32 vectors, not of bf16 ones
        assert_eq!(workspace_limit(WorkspaceCap::Fixed(MIN_WS), &p, crate::DType::F32), MIN_WS);
        assert!(workspace_limit(WorkspaceCap::Fixed(MIN_WS), &p, crate::DType::BF16) > MIN_WS);
    }

    #[test]
    fn workspace_limit_parses_or_names_the_variable() {
        assert_eq!(super::parse_workspace_mib("32"), Ok(32 << 20));
        assert_eq!(super::parse_workspace_mib(" 0 "), Ok(0));
        for bad in ["", "x", "-4", "16385", "1e3"] {
            assert!(super::parse_workspace_mib(bad).unwrap_err().contains("PTL_CUDNN_WORKSPACE_MIB"), "{bad}");
        }
    }
}

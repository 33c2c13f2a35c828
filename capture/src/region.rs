//! A recorded region: its spec, its recordings, the graphed tape node, and the call state machine.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use ptl_autograd::{
    attach_custom_node, autocast_dtype, is_grad_enabled, BackwardOp, DType, Device, GradModeGuard, GraphSafeRng, MemoryFormat, Rng, Tensor,
    TensorKind,
};

use crate::backend::{ArenaSlot, ArenaSpec, Backend, Footprint, Graph, PoolHandle};
use crate::recorder::RecorderInner;
use crate::signature::Signature;
use crate::stats::{FallbackReason, RegionStats, RetireReason};
use crate::{CaptureError, Result};

/// The region's current parameters and buffers (its *surface*), in a stable order. Called on
/// every call: a parameter replaced by a new tensor is seen as a storage change.
pub type SurfaceFn = Arc<dyn Fn() -> Vec<(String, Tensor, TensorKind)> + Send + Sync>;
/// The region itself: tensors in, tensors out.
pub type RegionFn = Arc<dyn Fn(&[Tensor]) -> ptl_autograd::Result<Vec<Tensor>> + Send + Sync>;

/// Host-side state a region mutates (e.g. a host RNG): snapshotted before warmup and restored
/// after warmup and capture.
pub trait HostState: Send + Sync {
    /// The state as plain numbers.
    fn snapshot(&self) -> Vec<u64>;
    /// Puts back a state [`HostState::snapshot`] took.
    fn restore(&self, snap: &[u64]);
}

impl HostState for Mutex<Rng> {
    fn snapshot(&self) -> Vec<u64> {
        let (s, o, u) = self.lock().unwrap_or_else(|e| e.into_inner()).state();
        vec![s, o, u as u64]
    }
    fn restore(&self, snap: &[u64]) {
        if let [s, o, u] = snap {
            *self.lock().unwrap_or_else(|e| e.into_inner()) = Rng::from_state(*s, *o, *u as usize);
        }
    }
}

/// The body of one call, borrowed for the duration of [`RegionHandle::call_with`].
pub type BodyFn<'a> = dyn Fn(&[Tensor]) -> ptl_autograd::Result<Vec<Tensor>> + 'a;

/// What to record: a name, the surface, the callable, and any host state it touches. A region made
/// with [`RegionSpec::per_call`] has neither surface nor callable: each
/// [`RegionHandle::call_with`] brings them, over the live model.
#[derive(Clone)]
pub struct RegionSpec {
    /// The region's name (in counters, errors and summaries).
    pub name: String,
    /// The parameters and buffers the body reads or writes, by name (`None`: given per call).
    pub surface: Option<SurfaceFn>,
    /// The body (`None`: given per call).
    pub func: Option<RegionFn>,
    /// Host-side state the body changes, rolled back after warm-up (docs/capture.md §2.1).
    pub host_state: Vec<Arc<dyn HostState>>,
    /// Graph-safe generators the body draws from (docs/capture.md §9).
    pub graph_rngs: Vec<Arc<GraphSafeRng>>,
}

impl RegionSpec {
    /// A region named `name` that runs `func` over the tensors `surface` lists.
    pub fn new(
        name: impl Into<String>,
        surface: impl Fn() -> Vec<(String, Tensor, TensorKind)> + Send + Sync + 'static,
        func: impl Fn(&[Tensor]) -> ptl_autograd::Result<Vec<Tensor>> + Send + Sync + 'static,
    ) -> RegionSpec {
        RegionSpec {
            name: name.into(),
            surface: Some(Arc::new(surface)),
            func: Some(Arc::new(func)),
            host_state: Vec::new(),
            graph_rngs: Vec::new(),
        }
    }
    /// A region whose surface and body come with every call ([`RegionHandle::call_with`]): no
    /// `'static` copy of the modules it runs.
    pub fn per_call(name: impl Into<String>) -> RegionSpec {
        RegionSpec { name: name.into(), surface: None, func: None, host_state: Vec::new(), graph_rngs: Vec::new() }
    }
    /// Registers host state for warmup/capture rollback.
    pub fn with_host_state(mut self, s: Arc<dyn HostState>) -> RegionSpec {
        self.host_state.push(s);
        self
    }
    /// Registers a graph-safe generator the body draws from (dropout, noise): its offset is rolled
    /// back after warmup and capture, captured draws read the device state, and every replay (or
    /// native run) advances it exactly as an eager call would, so replays draw fresh numbers.
    pub fn with_graph_rng(mut self, rng: Arc<GraphSafeRng>) -> RegionSpec {
        self.graph_rngs.push(rng);
        self
    }
}

thread_local! {
    static IN_REPLAY: Cell<bool> = const { Cell::new(false) };
}

/// Where a region's recordings find the body of the call in progress: lent by the calling
/// thread for exactly the duration of one call (`lend` returns a guard that takes it back), and
/// refused to any other thread. Graph bodies (captured forward, the test double's replays) run
/// inside that call, on that thread, so the borrow is always live when it is used.
#[derive(Default)]
pub(crate) struct BodySlot {
    lent: Mutex<Option<(std::thread::ThreadId, BodyPtr)>>,
}

#[derive(Clone, Copy)]
struct BodyPtr(*const BodyFn<'static>);

// SAFETY: the pointer is only dereferenced by the thread that lent it, while the lend is live.
unsafe impl Send for BodyPtr {}
unsafe impl Sync for BodyPtr {}

pub(crate) struct LendGuard<'s> {
    slot: &'s BodySlot,
    previous: Option<(std::thread::ThreadId, BodyPtr)>,
}

impl Drop for LendGuard<'_> {
    fn drop(&mut self) {
        *lock(&self.slot.lent) = self.previous.take();
    }
}

impl BodySlot {
    /// Lends `body` until the guard is dropped (nested lends restore the outer one).
    pub(crate) fn lend<'a>(&'a self, body: &'a BodyFn<'a>) -> LendGuard<'a> {
        // SAFETY: only the lifetime is erased; `call` dereferences the pointer only on this
        // thread and only while this guard (which borrows `body`) is alive.
        let ptr: *const BodyFn<'static> = unsafe { std::mem::transmute::<*const BodyFn<'a>, *const BodyFn<'static>>(body as *const _) };
        let previous = lock(&self.lent).replace((std::thread::current().id(), BodyPtr(ptr)));
        LendGuard { slot: self, previous }
    }

    /// Runs the lent body on `xs`.
    fn call(&self, region: &str, xs: &[Tensor]) -> Result<Vec<Tensor>> {
        let lent = *lock(&self.lent);
        match lent {
            Some((thread, BodyPtr(ptr))) if thread == std::thread::current().id() => {
                // SAFETY: see `lend`: same thread, inside the lending call.
                Ok(unsafe { (*ptr)(xs) }?)
            }
            Some(_) => Err(CaptureError::Region { region: region.into(), msg: "the region body was used from another thread".into() }),
            None => Err(CaptureError::Region { region: region.into(), msg: "the region body ran outside its call".into() }),
        }
    }
}

/// The shared arenas of a recorder, evicted ([`Backend::set_shared_resident`]) while native work
/// runs beside their graphs, and mapped again by [`ArenasAside::put_back`] (or on drop, should an
/// error end the work first: their graphs must find memory under their addresses).
struct ArenasAside<'a> {
    backend: &'a dyn Backend,
    device: Device,
    evicted: Vec<&'a ArenaSlot>,
}

impl<'a> ArenasAside<'a> {
    fn none(backend: &'a dyn Backend, device: Device) -> ArenasAside<'a> {
        ArenasAside { backend, device, evicted: Vec::new() }
    }

    fn take<const N: usize>(backend: &'a dyn Backend, device: Device, slots: [&'a ArenaSlot; N]) -> Result<ArenasAside<'a>> {
        let mut aside = ArenasAside::none(backend, device);
        for slot in slots {
            if backend.set_shared_resident(slot, false)? {
                aside.evicted.push(slot);
            }
        }
        Ok(aside)
    }

    /// Returns the native work's cached memory to the driver, then maps the arenas again.
    fn put_back(mut self) -> Result<()> {
        self.restore()
    }

    fn restore(&mut self) -> Result<()> {
        if self.evicted.is_empty() {
            return Ok(());
        }
        self.backend.trim(self.device)?;
        while let Some(slot) = self.evicted.pop() {
            self.backend.set_shared_resident(slot, true)?;
        }
        Ok(())
    }
}

impl Drop for ArenasAside<'_> {
    fn drop(&mut self) {
        // An arena left unmapped is caught at its graphs' next launch, which then fails.
        let _ = self.restore();
    }
}

fn launch_replay(g: &dyn Graph) -> Result<()> {
    IN_REPLAY.with(|r| r.set(true));
    let r = g.launch();
    IN_REPLAY.with(|r| r.set(false));
    r
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Per gradient mask: (parameters that receive a gradient, inputs that receive one).
type Presence = (Vec<bool>, Vec<bool>);
/// Where a backward graph leaves the parameters' gradients: empty — in the recording's static
/// buffers, added in by the host afterwards — or, per parameter, (address, accumulate) of its
/// persistent gradient buffer, added into or written inside the graph (docs/capture.md §13.1).
type GradInto = Vec<Option<(u64, bool)>>;
/// Backward graphs by gradient mask and where they leave the parameters' gradients.
type BwdGraphs = BTreeMap<(Vec<bool>, GradInto), Box<dyn Graph>>;
/// Per parameter: its persistent gradient buffer and whether the graph accumulates into it
/// (`false`: the gradient was absent, the graph writes the buffer and the host marks it present).
type GradTargets = Vec<Option<(Tensor, bool)>>;

/// Static buffers and the region body shared by a recording's graphs.
struct Core {
    region: String,
    body: Arc<BodySlot>,
    needs_grad: bool,
    static_in: Vec<Tensor>,
    leaves: Vec<Tensor>,
    static_out: Vec<Tensor>,
    out_grad: Vec<bool>,
    static_gout: Vec<Option<Tensor>>,
    params: Vec<Tensor>,
    static_gparam: Vec<Option<Tensor>>,
    static_gin: Vec<Option<Tensor>>,
    /// Outputs with history from the latest execution of the forward body.
    tape: Mutex<Option<Vec<Tensor>>>,
    /// Per gradient mask: which parameters and which inputs receive a gradient.
    presence: Mutex<HashMap<Vec<bool>, Presence>>,
    stats: Arc<Mutex<RegionStats>>,
}

impl Core {
    fn err(&self, msg: impl Into<String>) -> CaptureError {
        CaptureError::Region { region: self.region.clone(), msg: msg.into() }
    }

    fn note_body_run(&self) {
        if IN_REPLAY.with(|r| r.get()) {
            lock(&self.stats).eager_dispatches_during_replay += 1;
        }
    }

    fn fwd_body(&self) -> Result<()> {
        self.note_body_run();
        let outs = {
            let _g = GradModeGuard::new(self.needs_grad);
            self.body.call(&self.region, &self.leaves)?
        };
        if outs.len() != self.static_out.len() {
            return Err(self.err(format!("returned {} outputs, {} at warmup", outs.len(), self.static_out.len())));
        }
        for (o, s) in outs.iter().zip(&self.static_out) {
            s.copy_(o)?;
        }
        if self.needs_grad {
            *lock(&self.tape) = Some(outs);
        }
        Ok(())
    }

    /// The persistent gradient buffers the present gradients of `present` would land in, when
    /// every such parameter has one of the static buffer's shape and dtype (`None`: the host path).
    fn grad_targets(&self, present: &[bool]) -> Option<GradTargets> {
        let mut out = Vec::with_capacity(self.params.len());
        for ((p, s), on) in self.params.iter().zip(&self.static_gparam).zip(present) {
            match (on, s) {
                (true, Some(s)) => {
                    let (t, acc) = p.grad_target()?;
                    if t.dims() != s.dims() || t.dtype() != s.dtype() || t.device() != s.device() {
                        return None;
                    }
                    out.push(Some((t, acc)));
                }
                _ => out.push(None),
            }
        }
        Some(out)
    }

    /// Drops the activations the last forward kept for its backward.
    fn clear_tape(&self) {
        *lock(&self.tape) = None;
    }

    fn bwd_body(&self, mask: &[bool], into: Option<&GradTargets>) -> Result<()> {
        self.note_body_run();
        let outs = lock(&self.tape).clone().ok_or_else(|| self.err("backward recorded before any forward"))?;
        // The parameters' gradients and kept buffers stay out of the body's backward.
        let stash: Vec<ptl_autograd::GradState> = self.params.iter().map(|p| p.take_grad_state()).collect();
        for l in &self.leaves {
            l.set_grad(None);
        }
        let r = self.bwd_inner(mask, &outs, into);
        for (p, g) in self.params.iter().zip(stash) {
            p.restore_grad_state(g);
        }
        for l in &self.leaves {
            l.set_grad(None);
        }
        r
    }

    fn bwd_inner(&self, mask: &[bool], outs: &[Tensor], into: Option<&GradTargets>) -> Result<()> {
        let mut present = Vec::new();
        let mut grads = Vec::new();
        for ((m, o), g) in mask.iter().zip(outs).zip(&self.static_gout) {
            if let (true, Some(g)) = (*m, g) {
                present.push(o);
                grads.push(g.clone());
            }
        }
        seed_backward(&present, grads)?;
        let collect = |ts: &[Tensor], statics: &[Option<Tensor>], what: &str| -> Result<Vec<bool>> {
            let mut v = Vec::with_capacity(ts.len());
            for (t, s) in ts.iter().zip(statics) {
                match (t.grad(), s) {
                    (Some(g), Some(s)) => {
                        s.copy_(&g)?;
                        v.push(true);
                    }
                    (Some(_), None) => return Err(self.err(format!("{what} received a gradient it did not receive at warmup"))),
                    (None, _) => v.push(false),
                }
            }
            Ok(v)
        };
        let pp = match into {
            Some(targets) => self.grads_into(targets)?,
            None => collect(&self.params, &self.static_gparam, "a parameter")?,
        };
        let ip = collect(&self.leaves, &self.static_gin, "an input")?;
        lock(&self.presence).insert(mask.to_vec(), (pp, ip));
        Ok(())
    }
}

impl Core {
    /// The body's parameter gradients into their persistent buffers: added (one batched add, the
    /// bytes of the engine's accumulation) or written (the first gradient of a window; one
    /// batched copy).
    fn grads_into(&self, targets: &GradTargets) -> Result<Vec<bool>> {
        let mut present = Vec::with_capacity(self.params.len());
        let mut adds: Vec<(Tensor, Tensor)> = Vec::new();
        let mut writes: Vec<(Tensor, Tensor)> = Vec::new();
        for (p, t) in self.params.iter().zip(targets) {
            match (p.grad(), t) {
                (Some(g), Some((dst, true))) => adds.push((dst.clone(), g)),
                (Some(g), Some((dst, false))) => writes.push((dst.clone(), g)),
                (Some(_), None) => {
                    return Err(self.err("a parameter received a gradient it did not receive when this backward was first recorded"))
                }
                (None, _) => {}
            }
            present.push(p.grad().is_some());
        }
        Tensor::add_many_(&adds.iter().map(|(d, g)| (d, g)).collect::<Vec<_>>())?;
        // The first gradients of a window, batched: one copy node per 40 in a recorded graph
        // instead of one per parameter (every step's at batch 64, where a window is one step).
        Tensor::copy_many_(&writes.iter().map(|(d, g)| (d, g)).collect::<Vec<_>>())?;
        Ok(present)
    }
}

/// Back-propagates the given gradients from several outputs at once: a one-output seed node whose
/// backward hands out `grads` (no extra kernels besides the root's fill).
fn seed_backward(outs: &[&Tensor], grads: Vec<Tensor>) -> Result<()> {
    struct Seed(Vec<Tensor>);
    impl BackwardOp for Seed {
        fn name(&self) -> &str {
            "capture-seed"
        }
        fn backward(&self, _g: &[Option<Tensor>]) -> ptl_autograd::Result<Vec<Option<Tensor>>> {
            Ok(self.0.iter().cloned().map(Some).collect())
        }
    }
    let Some(first) = outs.first() else { return Ok(()) };
    let root = Tensor::zeros((), DType::F32, first.device())?;
    let rooted = {
        let _g = GradModeGuard::new(true);
        attach_custom_node(Arc::new(Seed(grads)), outs, std::slice::from_ref(&root))
    };
    if let Some(r) = rooted.first() {
        if r.requires_grad() {
            r.backward_with(&root)?;
        }
    }
    Ok(())
}

/// Recordings take their inputs in the contiguous order: channels-last inputs converted at entry
/// (one strided copy, the rule every op follows: docs/channels-last.md); `None` when all are
/// contiguous already.
fn contiguous_inputs(inputs: &[Tensor]) -> Result<Option<Vec<Tensor>>> {
    if inputs.iter().all(|t| t.memory_format() == MemoryFormat::Contiguous) {
        return Ok(None);
    }
    Ok(Some(inputs.iter().map(|t| t.to_memory_format(MemoryFormat::Contiguous)).collect::<ptl_autograd::Result<_>>()?))
}

/// Marks one forward replay whose backward has not run yet.
struct Token {
    consumed: AtomicBool,
    discarded: AtomicBool,
}

/// One recording: graphs first (dropped first), pool last.
/// How a graph's arena is laid out from a traced capture of its body ([`Backend::trace_capture`]).
#[derive(Clone, Copy, Debug)]
struct Planning {
    /// The unplanned tail, as a fraction of the planned bytes ([`RecorderConfig::traced_headroom`]) ...
    headroom: f64,
    /// ... plus these bytes ([`RecorderConfig::arena_extra_bytes`]).
    extra: usize,
    /// Addresses the traced capture may use (no memory behind them).
    addresses: usize,
}

impl Planning {
    /// The layout of `body`'s next capture, from a traced capture of it; `None` (a warning in
    /// `stats`) when the backend cannot trace or the traced capture failed.
    fn spec_for(
        &self,
        backend: &dyn Backend,
        region: &str,
        device: Device,
        body: &crate::backend::Body,
        stats: &Mutex<RegionStats>,
    ) -> Option<ArenaSpec> {
        match backend.trace_capture(region, device, self.addresses, body.clone()) {
            Ok(Some(trace)) => {
                let plan = ptl_autograd::internal::arena_plan::plan(&trace);
                let tail = ((plan.bytes as f64) * self.headroom.max(0.0)) as usize + self.extra;
                Some(ArenaSpec { plan, tail })
            }
            Ok(None) => None,
            Err(e) => {
                lock(stats).warn(format!("region `{region}`: traced capture failed ({e}); the warm-up's trace lays out the arena"));
                None
            }
        }
    }
}

pub(crate) struct Recording {
    fwd: Box<dyn Graph>,
    bwd: Mutex<BwdGraphs>,
    core: Arc<Core>,
    key: Signature,
    fingerprints: Vec<(String, usize, u64)>,
    /// `requires_grad` of each surface parameter at capture (what the graphs compute gradients for).
    trainable: Vec<bool>,
    pending: Mutex<Option<Weak<Token>>>,
    /// The layout of the backward graphs recorded later (other masks, write/add targets): the
    /// all-outputs backward's plan, whose allocations theirs repeat (what does not fit the plan
    /// goes to its tail), in the recorder's shared backward arena ...
    bwd_arena: ArenaSpec,
    /// ... or, should one not fit there, an arena of its own sized by the warm-up's summed bytes.
    bwd_unplanned: ArenaSpec,
    /// With planned arenas: how a later backward graph's own traced capture becomes its layout.
    bwd_planning: Option<Planning>,
    /// The arena every backward graph of the recorder shares (they run one at a time).
    bwd_arena_slot: Arc<ArenaSlot>,
    device: Device,
    strict_masks: bool,
    backend: Arc<dyn Backend>,
    pool: Option<PoolHandle>,
    /// Generators drawn from by the forward graph, with the graph's whole-run increment for each.
    rngs: Vec<(Arc<GraphSafeRng>, u64)>,
}

impl Drop for Recording {
    fn drop(&mut self) {
        // Teardown safety: no graph or arena memory is released while a replay may be in flight.
        let _ = self.backend.synchronize(self.device);
    }
}

impl Recording {
    fn pending_alive(&self) -> bool {
        lock(&self.pending).as_ref().and_then(Weak::upgrade).map(|t| !t.consumed.load(Ordering::SeqCst)).unwrap_or(false)
    }

    fn discard(&self) {
        if let Some(t) = lock(&self.pending).take().and_then(|w| w.upgrade()) {
            t.discarded.store(true, Ordering::SeqCst);
        }
    }

    /// The first surface entry whose storage changed, if any.
    fn stale(&self, surface: &[(String, Tensor, TensorKind)]) -> Option<String> {
        if surface.len() != self.fingerprints.len() {
            return Some(format!("surface ({} entries, {} at capture)", surface.len(), self.fingerprints.len()));
        }
        for ((n, t, _), (fname, sp, addr)) in surface.iter().zip(&self.fingerprints) {
            if n != fname || t.storage_ptr() != *sp || self.backend.address(t) != *addr {
                return Some(n.clone());
            }
        }
        None
    }

    /// Whether a surface parameter was frozen or unfrozen since the capture.
    fn trainable_changed(&self, surface: &[(String, Tensor, TensorKind)]) -> bool {
        let now = surface.iter().filter(|(_, _, k)| *k == TensorKind::Parameter).map(|(_, t, _)| t.requires_grad());
        !now.eq(self.trainable.iter().copied())
    }

    fn arena_bytes(&self) -> u64 {
        (self.fwd.arena_bytes() + lock(&self.bwd).values().map(|g| g.arena_bytes()).sum::<usize>()) as u64
    }

    fn nodes(&self) -> u64 {
        (self.fwd.node_count() + lock(&self.bwd).values().map(|g| g.node_count()).sum::<usize>()) as u64
    }
}

/// The tape node of one forward replay.
struct GraphedNode {
    rec: Arc<Recording>,
    token: Arc<Token>,
    n_inputs: usize,
}

impl BackwardOp for GraphedNode {
    fn name(&self) -> &str {
        &self.rec.core.region
    }
    fn backward(&self, g: &[Option<Tensor>]) -> ptl_autograd::Result<Vec<Option<Tensor>>> {
        self.run(g).map_err(Into::into)
    }
}

impl GraphedNode {
    fn run(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let rec = &self.rec;
        let core = &rec.core;
        if self.token.discarded.load(Ordering::SeqCst) {
            return Err(core.err("backward of a forward replay that was discarded"));
        }
        if self.token.consumed.swap(true, Ordering::SeqCst) {
            return Err(core.err("backward ran twice for one forward replay"));
        }
        let n_total = self.n_inputs + core.params.len();
        let mask: Vec<bool> = g.iter().zip(&core.out_grad).map(|(g, og)| g.is_some() && *og).collect();
        if !mask.iter().any(|m| *m) {
            return Ok(vec![None; n_total]);
        }
        let mut host_ops = 0u64;
        for (i, m) in mask.iter().enumerate() {
            if !*m {
                continue;
            }
            let (Some(src), Some(dst)) = (&g[i], &core.static_gout[i]) else { continue };
            if src.dims() != dst.dims() || src.dtype() != dst.dtype() {
                return Err(CaptureError::Mismatch {
                    region: core.region.clone(),
                    what: format!("gradient of output {i}"),
                    got: format!("{:?} {}", src.dims(), src.dtype()),
                    expected: format!("{:?} {}", dst.dims(), dst.dtype()),
                });
            }
            dst.copy_(src)?;
            host_ops += 1;
        }
        // With persistent gradients (and this mask seen once), the graph itself leaves the
        // parameters' gradients in their buffers; otherwise in static buffers, added in below.
        let known = lock(&core.presence).get(&mask).cloned();
        let targets = known.as_ref().and_then(|(pp, _)| core.grad_targets(pp));
        let into: GradInto = match &targets {
            Some(ts) => ts.iter().map(|t| t.as_ref().map(|(x, acc)| (rec.backend.address(x), *acc))).collect(),
            None => Vec::new(),
        };
        let key = (mask.clone(), into);
        {
            let mut bwd = lock(&rec.bwd);
            if !bwd.contains_key(&key) {
                if rec.strict_masks && !bwd.keys().any(|(m, _)| *m == mask) {
                    return Err(CaptureError::UnexpectedGradMask { region: core.region.clone(), mask });
                }
                let c = core.clone();
                let m = mask.clone();
                let t = targets.clone();
                let body: crate::backend::Body = Arc::new(move || c.bwd_body(&m, t.as_ref()));
                let spec = match &rec.bwd_planning {
                    Some(p) => p
                        .spec_for(rec.backend.as_ref(), &core.region, rec.device, &body, &core.stats)
                        .unwrap_or_else(|| rec.bwd_arena.clone()),
                    None => rec.bwd_arena.clone(),
                };
                let shared =
                    rec.backend.record_sharing(&core.region, rec.device, &spec, &rec.bwd_arena_slot, rec.pool.as_ref(), body.clone());
                let graph = match shared {
                    Err(CaptureError::AllocOutsidePool { .. }) => {
                        if !spec.plan.offsets.is_empty() {
                            lock(&core.stats).arena_replans += 1;
                        }
                        rec.backend.record(&core.region, rec.device, &rec.bwd_unplanned, rec.pool.as_ref(), body)?
                    }
                    other => other?,
                };
                lock(&core.stats).backward_captures += 1;
                bwd.insert(key.clone(), graph);
            }
            let graph = bwd.get(&key).ok_or_else(|| core.err("backward graph missing"))?;
            launch_replay(graph.as_ref())?;
        }
        let (pp, ip) = lock(&core.presence).get(&mask).cloned().ok_or_else(|| core.err("no gradient presence recorded for this mask"))?;
        let _ng = GradModeGuard::new(false);
        if let Some(ts) = &targets {
            // The graph wrote or added every present gradient: a written buffer becomes present.
            for ((p, t), present) in core.params.iter().zip(ts).zip(&pp) {
                if let (true, Some((_, false))) = (*present, t) {
                    if !p.adopt_kept_grad() {
                        return Err(core.err("a persistent gradient buffer changed under a replayed backward"));
                    }
                }
            }
            return self.finish(&ip, host_ops);
        }
        // Into existing gradients as one batched add (a launch per 40 parameters on CUDA, the
        // bytes of one add each); a parameter without a gradient takes a copy.
        let mut adds: Vec<(Tensor, &Tensor)> = Vec::new();
        for ((p, s), present) in core.params.iter().zip(&core.static_gparam).zip(&pp) {
            let (true, Some(s)) = (*present, s) else { continue };
            match p.grad() {
                Some(existing) => adds.push((existing, s)),
                // Into a kept buffer when the parameter has one (persistent gradients), else a copy.
                None => p.add_to_grad(s)?,
            }
            host_ops += 1;
        }
        Tensor::add_many_(&adds.iter().map(|(e, s)| (e, *s)).collect::<Vec<_>>())?;
        self.finish(&ip, host_ops)
    }

    /// The inputs' gradients (copies of the static buffers) and the counters of one replay.
    fn finish(&self, ip: &[bool], mut host_ops: u64) -> Result<Vec<Option<Tensor>>> {
        let core = &self.rec.core;
        let n_total = self.n_inputs + core.params.len();
        let mut out = Vec::with_capacity(n_total);
        for (s, present) in core.static_gin.iter().zip(ip) {
            match (present, s) {
                (true, Some(s)) => {
                    out.push(Some(s.deep_copy()?));
                    host_ops += 1;
                }
                _ => out.push(None),
            }
        }
        out.resize(n_total, None);
        let mut st = lock(&core.stats);
        st.backward_replays += 1;
        st.graph_launches += 1;
        st.host_ops += host_ops;
        Ok(out)
    }
}

/// Per-region mutable state.
pub(crate) struct RegionState {
    spec: RegionSpec,
    training: bool,
    hooks: bool,
    recordings: Vec<Arc<Recording>>,
    seen: HashMap<Signature, usize>,
    failed: HashSet<Signature>,
}

pub(crate) struct RegionShared {
    state: Mutex<RegionState>,
    stats: Arc<Mutex<RegionStats>>,
    name: String,
    /// The body of the call in progress, shared by the region's recordings.
    body: Arc<BodySlot>,
    /// Serialises calls (the lent body belongs to one call at a time).
    calls: Mutex<()>,
}

impl RegionShared {
    pub(crate) fn new(spec: RegionSpec) -> RegionShared {
        let name = spec.name.clone();
        RegionShared {
            state: Mutex::new(RegionState {
                spec,
                training: true,
                hooks: false,
                recordings: Vec::new(),
                seen: HashMap::new(),
                failed: HashSet::new(),
            }),
            stats: Arc::new(Mutex::new(RegionStats::default())),
            name,
            body: Arc::new(BodySlot::default()),
            calls: Mutex::new(()),
        }
    }
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
    /// Whether none of this region's recordings waits for its backward (a region in the middle
    /// of a call counts as busy).
    pub(crate) fn idle(&self) -> bool {
        match self.state.try_lock() {
            Ok(st) => st.recordings.iter().all(|r| !r.pending_alive()),
            Err(_) => false,
        }
    }
    pub(crate) fn spec(&self) -> RegionSpec {
        lock(&self.state).spec.clone()
    }
    pub(crate) fn release(&self) {
        let mut st = lock(&self.state);
        let n = st.recordings.len() as u64;
        st.recordings.clear();
        st.seen.clear();
        if n > 0 {
            *lock(&self.stats).retired.entry(RetireReason::Released).or_default() += n;
        }
    }
    pub(crate) fn stats(&self) -> RegionStats {
        let st = lock(&self.state);
        let mut s = lock(&self.stats).clone();
        s.live_recordings = st.recordings.len() as u64;
        s.graph_nodes = st.recordings.iter().map(|r| r.nodes()).sum();
        s.pool_bytes = st.recordings.iter().map(|r| r.arena_bytes()).sum();
        s
    }
}

/// A handle on one region of a [`crate::Recorder`]. Cloning gives a new region with the same
/// spec and no recording.
pub struct RegionHandle {
    pub(crate) shared: Arc<RegionShared>,
    pub(crate) recorder: Arc<RecorderInner>,
}

impl Clone for RegionHandle {
    fn clone(&self) -> Self {
        crate::Recorder { inner: self.recorder.clone() }.region(self.shared.spec())
    }
}

impl std::fmt::Debug for RegionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegionHandle({})", self.shared.name())
    }
}

impl RegionHandle {
    /// The region's name.
    pub fn name(&self) -> &str {
        self.shared.name()
    }
    /// Train/eval of the region (part of the signature).
    pub fn set_training(&self, training: bool) {
        lock(&self.shared.state).training = training;
    }
    /// Declares whether hooks are registered on the region's modules: while true every call runs
    /// natively (hooks must run, and must never be baked into a graph).
    pub fn set_hooks(&self, present: bool) {
        lock(&self.shared.state).hooks = present;
    }
    /// Counters (with the live recordings' totals filled in).
    pub fn stats(&self) -> RegionStats {
        self.shared.stats()
    }
    /// Releases every recording (graphs and pools).
    pub fn release(&self) {
        self.shared.release()
    }
    /// Forgets the pending backward of the last forward replay (its backward then errors), so the
    /// next forward may replay.
    pub fn discard_pending(&self) {
        for r in &lock(&self.shared.state).recordings {
            r.discard();
        }
    }
    /// Number of recordings held.
    pub fn live_recordings(&self) -> usize {
        lock(&self.shared.state).recordings.len()
    }

    /// Runs the region: natively, or by capturing and replaying its graphs (see the crate docs).
    /// For a region made with [`RegionSpec::new`].
    pub fn call(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let (surface, func) = {
            let st = lock(&self.shared.state);
            (st.spec.surface.clone(), st.spec.func.clone())
        };
        let (Some(surface), Some(func)) = (surface, func) else {
            return Err(CaptureError::Region {
                region: self.name().to_string(),
                msg: "this region takes its body with every call: use call_with".into(),
            });
        };
        self.call_with(inputs, &surface(), &*func)
    }

    /// Runs the region with this call's `surface` (the parameters and buffers `body` reads) and
    /// `body`, borrowed for the call only — natively, or by capturing and replaying. `inputs` may
    /// be empty (a region that only reads its surface, e.g. an optimizer update).
    pub fn call_with(&self, inputs: &[Tensor], surface: &[(String, Tensor, TensorKind)], body: &BodyFn<'_>) -> Result<Vec<Tensor>> {
        let converted = contiguous_inputs(inputs)?;
        let inputs = converted.as_deref().unwrap_or(inputs);
        let _one_call = lock(&self.shared.calls);
        let _lent = self.shared.body.lend(body);
        self.call_inner(inputs, surface, body)
    }

    /// Records `body` for `inputs`' signature ahead of its first call, without running it: the
    /// capture's warm-up is rolled back and the graphs are not launched, so nothing the body
    /// writes changes. A fit prepares the largest shape a region will see first, so that the
    /// arenas its regions share are laid out for it and a later, smaller shape records into them
    /// without growing them. `Ok(true)` when a recording was made; `Ok(false)` when the region
    /// runs natively anyway (disabled, hooks, no device, inside a capture), already holds the
    /// signature, is full, or the capture failed (noted in the counters, as a call's would be).
    pub fn prepare(&self, inputs: &[Tensor], surface: &[(String, Tensor, TensorKind)], body: &BodyFn<'_>) -> Result<bool> {
        let converted = contiguous_inputs(inputs)?;
        let inputs = converted.as_deref().unwrap_or(inputs);
        let _one_call = lock(&self.shared.calls);
        let _lent = self.shared.body.lend(body);
        let cfg = &self.recorder.config;
        let backend = self.recorder.backend.clone();
        let mut st = lock(&self.shared.state);
        let device = inputs.first().or(surface.first().map(|(_, t, _)| t)).map(Tensor::device);
        let on_cpu = inputs.iter().chain(surface.iter().map(|(_, t, _)| t)).any(|t| t.device() == Device::Cpu);
        if !cfg.enabled || st.hooks || device.is_none() || (backend.name() == "cuda" && on_cpu) || backend.is_capturing() {
            return Ok(false);
        }
        let precision = autocast_dtype();
        let key = Signature::of(inputs, is_grad_enabled(), st.training, precision);
        if st.recordings.iter().any(|r| r.key == key) || st.failed.contains(&key) || st.recordings.len() >= cfg.max_recordings.max(1) {
            return Ok(false);
        }
        match self.capture(&st, &key, inputs, surface, body) {
            Ok(rec) => {
                st.recordings.push(Arc::new(rec));
                Ok(true)
            }
            Err(e) => {
                self.note_failure(&e);
                st.failed.insert(key);
                Ok(false)
            }
        }
    }

    fn call_inner(&self, inputs: &[Tensor], surface: &[(String, Tensor, TensorKind)], body: &BodyFn<'_>) -> Result<Vec<Tensor>> {
        let cfg = &self.recorder.config;
        let backend = self.recorder.backend.clone();
        let mut st = lock(&self.shared.state);
        if !cfg.enabled {
            return self.native_with(inputs, body, FallbackReason::Disabled);
        }
        if st.hooks {
            return self.native_with(inputs, body, FallbackReason::Hooks);
        }
        // The device: the inputs', or for a region without inputs its surface's.
        let device = inputs.first().or(surface.first().map(|(_, t, _)| t)).map(Tensor::device);
        let on_cpu = inputs.iter().chain(surface.iter().map(|(_, t, _)| t)).any(|t| t.device() == Device::Cpu);
        if device.is_none() || (backend.name() == "cuda" && on_cpu) {
            return self.native_with(inputs, body, FallbackReason::Unsupported);
        }
        if backend.is_capturing() {
            // Inside another region's capture: run natively so the work lands in that graph.
            return self.native_with(inputs, body, FallbackReason::InsideCapture);
        }
        let precision = autocast_dtype();
        // Precision check: a precision change retires recordings made under another precision.
        let before = st.recordings.len();
        st.recordings.retain(|r| r.key.precision == precision);
        let gone = (before - st.recordings.len()) as u64;
        if gone > 0 {
            *lock(&self.shared.stats).retired.entry(RetireReason::Precision).or_default() += gone;
        }
        let key = Signature::of(inputs, is_grad_enabled(), st.training, precision);
        if let Some(pos) = st.recordings.iter().position(|r| r.key == key) {
            let rec = st.recordings[pos].clone();
            if rec.trainable_changed(surface) {
                st.recordings.remove(pos);
                st.seen.remove(&key);
                drop(rec);
                *lock(&self.shared.stats).retired.entry(RetireReason::Trainable).or_default() += 1;
                return self.native_with(inputs, body, FallbackReason::Stale);
            }
            if let Some(buffer) = rec.stale(surface) {
                st.recordings.remove(pos);
                st.seen.remove(&key);
                drop(rec);
                let mut s = lock(&self.shared.stats);
                *s.retired.entry(RetireReason::Storage).or_default() += 1;
                s.warn(CaptureError::StaleRecording { region: self.name().to_string(), buffer }.to_string());
                drop(s);
                return self.native_with(inputs, body, FallbackReason::Stale);
            }
            if rec.pending_alive() {
                if cfg.strict_pending {
                    return Err(CaptureError::PendingBackward { region: self.name().to_string() });
                }
                return self.native_with(inputs, body, FallbackReason::PendingBackward);
            }
            drop(st);
            return self.replay(&rec, inputs);
        }
        if st.failed.contains(&key) {
            return self.native_with(inputs, body, FallbackReason::CaptureFailed);
        }
        // Regions that take turns over a shared forward arena: once one has been recorded, a
        // new signature is captured at its first call. The native calls would hold a native
        // step's memory beside the arenas (their results live on until the caller's backward),
        // and the one-time state they exist for was made by the first signature's; the capture's
        // own warm-up, rolled back, runs with the arenas set aside.
        let warmup_calls = match cfg.share_forward_arena && self.recorder.holds_shared_forward() {
            true => 0,
            false => cfg.warmup_calls,
        };
        let seen = st.seen.entry(key.clone()).or_insert(0);
        *seen += 1;
        if *seen <= warmup_calls {
            return self.native_with(inputs, body, FallbackReason::Warmup);
        }
        if st.recordings.len() >= cfg.max_recordings.max(1) {
            return self.native_with(inputs, body, FallbackReason::CacheFull);
        }
        match self.capture(&st, &key, inputs, surface, body) {
            Ok(rec) => {
                let rec = Arc::new(rec);
                st.recordings.push(rec.clone());
                drop(st);
                self.replay(&rec, inputs)
            }
            Err(e) => {
                self.note_failure(&e);
                st.failed.insert(key);
                self.native_with(inputs, body, FallbackReason::CaptureFailed)
            }
        }
    }

    fn note_failure(&self, e: &CaptureError) {
        let mut s = lock(&self.shared.stats);
        *s.capture_failures.entry(e.kind().to_string()).or_default() += 1;
        let w = format!("ptl-capture: region `{}` runs natively: {e}", self.name());
        log::warn!("warning: {w}");
        s.warn(w);
    }

    fn native_with(&self, inputs: &[Tensor], body: &BodyFn<'_>, why: FallbackReason) -> Result<Vec<Tensor>> {
        lock(&self.shared.stats).bump_native(why);
        Ok(body(inputs)?)
    }

    fn replay(&self, rec: &Arc<Recording>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let core = &rec.core;
        let mut host_ops = 0u64;
        for (s, x) in core.static_in.iter().zip(inputs) {
            if s.storage_ptr() != x.storage_ptr() {
                s.copy_(x)?;
                host_ops += 1;
            }
        }
        for (r, whole) in &rec.rngs {
            r.begin_replay(*whole)?;
        }
        let launched = launch_replay(rec.fwd.as_ref());
        for (r, _) in &rec.rngs {
            r.end_replay();
        }
        launched?;
        let mut outs = Vec::with_capacity(core.static_out.len());
        for s in &core.static_out {
            outs.push(s.deep_copy()?);
            host_ops += 1;
        }
        let outs = if core.needs_grad && core.out_grad.iter().any(|g| *g) {
            let token = Arc::new(Token { consumed: AtomicBool::new(false), discarded: AtomicBool::new(false) });
            *lock(&rec.pending) = Some(Arc::downgrade(&token));
            let node = Arc::new(GraphedNode { rec: rec.clone(), token, n_inputs: inputs.len() });
            let mut surface: Vec<&Tensor> = inputs.iter().collect();
            surface.extend(core.params.iter());
            let mut handed = attach_custom_node(node, &surface, &outs);
            // Outputs that carried no gradient at capture hand out without history.
            for (h, g) in handed.iter_mut().zip(&core.out_grad) {
                if !*g && h.requires_grad() {
                    *h = h.detach();
                }
            }
            handed
        } else {
            outs
        };
        let mut s = lock(&self.shared.stats);
        s.replays += 1;
        s.graph_launches += 1;
        s.host_ops += host_ops;
        Ok(outs)
    }

    fn capture(
        &self,
        st: &RegionState,
        key: &Signature,
        inputs: &[Tensor],
        surface: &[(String, Tensor, TensorKind)],
        body: &BodyFn<'_>,
    ) -> Result<Recording> {
        let cfg = &self.recorder.config;
        let backend = self.recorder.backend.clone();
        let spec = &st.spec;
        let region = spec.name.clone();
        let device = inputs.first().or(surface.first().map(|(_, t, _)| t)).map(Tensor::device).ok_or_else(|| CaptureError::Region {
            region: region.clone(),
            msg: "a region needs inputs or a surface to know its device".into(),
        })?;
        let params: Vec<Tensor> =
            surface.iter().filter(|(_, t, k)| *k == TensorKind::Parameter && t.requires_grad()).map(|(_, t, _)| t.clone()).collect();
        let buffers: Vec<Tensor> = surface.iter().filter(|(_, _, k)| *k == TensorKind::Buffer).map(|(_, t, _)| t.clone()).collect();
        let needs_grad = key.grad_enabled && (inputs.iter().any(|t| t.requires_grad()) || !params.is_empty());
        let pool = backend.new_pool(device)?;

        // ---- warmup on the capture stream, observationally free --------------------------------
        // The recorder's shared arenas hold nothing between replays: their memory goes back to
        // the driver while the warm-up runs natively, so a signature captured after another does
        // not hold a native step's working set beside them (docs/memory.md).
        // The turn arena holds nothing between graphs whatever other recorders wait for.
        let idle = st.recordings.iter().all(|r| !r.pending_alive()) && self.recorder.others_idle(&self.shared);
        let turn_slot = self.recorder.turn_slot(device);
        let aside = match idle {
            true => ArenasAside::take(backend.as_ref(), device, [&*self.recorder.fwd_arena, &*self.recorder.bwd_arena, &*turn_slot])?,
            false if self.recorder.config.take_turns => ArenasAside::take(backend.as_ref(), device, [&*turn_slot])?,
            false => ArenasAside::none(backend.as_ref(), device),
        };
        let buf_snap: Vec<Tensor> = buffers.iter().map(|b| b.deep_copy()).collect::<ptl_autograd::Result<_>>()?;
        let host_snap: Vec<Vec<u64>> = spec.host_state.iter().map(|h| h.snapshot()).collect();
        let rng_snap: Vec<(u64, u64)> = spec.graph_rngs.iter().map(|r| r.snapshot()).collect();
        let grad_stash: Vec<ptl_autograd::GradState> = params.iter().map(|p| p.take_grad_state()).collect();
        let warm_leaves: Vec<Tensor> = inputs
            .iter()
            .map(|x| x.detach().requires_grad_(x.requires_grad() && x.dtype().is_float()))
            .collect::<ptl_autograd::Result<_>>()?;
        let mut meta: Vec<(Vec<usize>, DType, bool)> = Vec::new();
        let mut gparam_dt: Vec<Option<DType>> = vec![None; params.len()];
        let mut gin_dt: Vec<Option<DType>> = vec![None; inputs.len()];
        // What the last warm-up iteration allocated (the steady state: caches are warm by then).
        let (mut fwd_fp, mut bwd_fp) = (Footprint::default(), Footprint::default());
        // Every storage the warmup writes that existed before it (parameters an optimizer body
        // updates, its moments, EMA shadows, BatchNorm statistics) is copied before its first
        // write and copied back below: the write-set of docs/capture.md rule 2.1, found by watching.
        let journaled = ptl_autograd::internal::write_journal::journal_writes(|| {
            // Marked as a warm-up: work that must run as often on every rank of a group (its
            // collectives) is left out here, so a rank that records alone stays in step.
            let _warm = ptl_autograd::internal::warmup::WarmupGuard::new();
            (|| -> Result<()> {
                for _ in 0..cfg.warmup_iters.max(1) {
                    let mut outs: Vec<Tensor> = Vec::new();
                    fwd_fp = backend.measure(&mut || {
                        let _g = GradModeGuard::new(needs_grad);
                        outs = body(&warm_leaves)?;
                        Ok(())
                    })?;
                    meta = outs.iter().map(|o| (o.dims().to_vec(), o.dtype(), needs_grad && o.requires_grad())).collect();
                    if meta.iter().any(|m| m.2) {
                        bwd_fp = backend.measure(&mut || {
                            let present: Vec<&Tensor> = outs.iter().zip(&meta).filter(|(_, m)| m.2).map(|(o, _)| o).collect();
                            let seeds: Vec<Tensor> = present.iter().map(|o| o.ones_like()).collect::<ptl_autograd::Result<_>>()?;
                            seed_backward(&present, seeds)
                        })?;
                        for (p, dt) in params.iter().zip(gparam_dt.iter_mut()) {
                            if let Some(g) = p.grad() {
                                *dt = Some(g.dtype());
                            }
                            p.set_grad(None);
                        }
                        for (l, dt) in warm_leaves.iter().zip(gin_dt.iter_mut()) {
                            if let Some(g) = l.grad() {
                                *dt = Some(g.dtype());
                            }
                            l.set_grad(None);
                        }
                    }
                }
                Ok(())
            })()
        });
        let (warm, journal) = match journaled {
            Ok((w, j)) => (w, Some(j)),
            Err(e) => (Err(e.into()), None),
        };
        // Rollback, whatever happened: the journaled write-set and buffers bitwise, host state,
        // parameter gradients.
        let rollback = || -> Result<()> {
            let _g = GradModeGuard::new(false);
            if let Some(j) = journal {
                j.restore()?;
            }
            for (b, s) in buffers.iter().zip(&buf_snap) {
                b.copy_(s)?;
            }
            for (h, s) in spec.host_state.iter().zip(&host_snap) {
                h.restore(s);
            }
            for (r, s) in spec.graph_rngs.iter().zip(&rng_snap) {
                r.restore(*s);
            }
            Ok(())
        };
        let rb = rollback();
        for (p, g) in params.iter().zip(grad_stash) {
            p.restore_grad_state(g);
        }
        let back = aside.put_back();
        warm?;
        rb?;
        back?;
        backend.synchronize(device)?;

        // ---- static buffers in the recording's pool ---------------------------------------------
        let mut static_in = Vec::new();
        let mut static_out = Vec::new();
        let mut static_gout = Vec::new();
        let mut static_gparam = Vec::new();
        let mut static_gin = Vec::new();
        backend.in_pool(pool.as_ref(), &mut || {
            static_in = inputs
                .iter()
                .enumerate()
                .map(|(i, x)| match cfg.share_forward_arena {
                    true => self.recorder.shared_input(i, x, || x.zeros_like()),
                    false => x.zeros_like(),
                })
                .collect::<ptl_autograd::Result<_>>()?;
            static_out = meta.iter().map(|(d, dt, _)| Tensor::zeros(d.clone(), *dt, device)).collect::<ptl_autograd::Result<_>>()?;
            static_gout = meta
                .iter()
                .map(|(d, dt, g)| if *g { Tensor::zeros(d.clone(), *dt, device).map(Some) } else { Ok(None) })
                .collect::<ptl_autograd::Result<_>>()?;
            static_gparam = params
                .iter()
                .zip(&gparam_dt)
                .map(|(p, dt)| dt.map(|dt| Tensor::zeros(p.dims().to_vec(), dt, device)).transpose())
                .collect::<ptl_autograd::Result<_>>()?;
            static_gin = inputs
                .iter()
                .zip(&gin_dt)
                .map(|(x, dt)| dt.map(|dt| Tensor::zeros(x.dims().to_vec(), dt, device)).transpose())
                .collect::<ptl_autograd::Result<_>>()?;
            Ok(())
        })?;
        // Run the copies the bodies issue once natively (kernel loading stays out of the capture),
        // and fill the static inputs with the real ones.
        {
            let _g = GradModeGuard::new(false);
            for (s, x) in static_in.iter().zip(inputs) {
                s.copy_(x)?;
            }
            for s in static_out
                .iter()
                .chain(static_gout.iter().flatten())
                .chain(static_gparam.iter().flatten())
                .chain(static_gin.iter().flatten())
            {
                s.copy_(&s.zeros_like()?)?;
            }
        }
        let leaves: Vec<Tensor> = static_in
            .iter()
            .zip(inputs)
            .map(|(s, x)| s.detach().requires_grad_(needs_grad && x.requires_grad() && x.dtype().is_float()))
            .collect::<ptl_autograd::Result<_>>()?;
        let core = Arc::new(Core {
            region: region.clone(),
            body: self.shared.body.clone(),
            needs_grad,
            static_in,
            leaves,
            static_out,
            out_grad: meta.iter().map(|m| m.2).collect(),
            static_gout,
            params,
            static_gparam,
            static_gin,
            tape: Mutex::new(None),
            presence: Mutex::new(HashMap::new()),
            stats: self.shared.stats.clone(),
        });

        // ---- capture: forward, then the all-outputs backward --------------------------------------
        let slack = |n: usize| ((n as f64) * cfg.arena_slack.max(1.0)) as usize + cfg.arena_extra_bytes;
        let arena_of = |fp: &Footprint| match fp.trace.as_ref().filter(|_| cfg.plan_arenas) {
            Some(trace) => {
                let plan = ptl_autograd::internal::arena_plan::plan(trace);
                let tail = ((plan.bytes as f64) * cfg.plan_headroom.max(0.0)) as usize + cfg.arena_extra_bytes;
                ArenaSpec { plan, tail }
            }
            None => ArenaSpec { plan: Default::default(), tail: slack(fp.bytes) },
        };
        let c = core.clone();
        let rngs = spec.graph_rngs.clone();
        let wholes = Arc::new(Mutex::new(vec![0u64; rngs.len()]));
        let w = wholes.clone();
        let be = backend.clone();
        let fwd_body = move || -> Result<()> {
            if !be.is_capturing() {
                // A backend that replays by running the body (the test double): draws happen now.
                return c.fwd_body();
            }
            // Draws during the capture become relative to each generator's device state.
            for r in &rngs {
                r.begin_capture()?;
            }
            let res = c.fwd_body();
            *lock(&w) = rngs.iter().map(|r| r.end_capture()).collect();
            res
        };
        let bwd_arena_slot = turn_slot.clone();
        let restore_host = || {
            for (h, s) in spec.host_state.iter().zip(&host_snap) {
                h.restore(s);
            }
            for (r, s) in spec.graph_rngs.iter().zip(&rng_snap) {
                r.restore(*s);
            }
        };
        let planning = |fp: &Footprint| {
            cfg.plan_arenas.then(|| Planning {
                headroom: cfg.traced_headroom,
                extra: cfg.arena_extra_bytes,
                addresses: 2 * slack(fp.bytes),
            })
        };
        // With planned arenas, each graph is first captured once on addresses alone and laid out
        // from that capture's own trace (which the real capture repeats); the warm-up's trace is
        // the fallback.
        let spec_of = |fp: &Footprint, body: &crate::backend::Body| -> ArenaSpec {
            let Some(p) = planning(fp) else { return arena_of(fp) };
            // The traced capture's host effects are undone: the real one starts where it did.
            let hosts: Vec<Vec<u64>> = spec.host_state.iter().map(|h| h.snapshot()).collect();
            let rngs: Vec<(u64, u64)> = spec.graph_rngs.iter().map(|r| r.snapshot()).collect();
            let traced = p.spec_for(backend.as_ref(), &region, device, body, &self.shared.stats);
            for (h, s) in spec.host_state.iter().zip(&hosts) {
                h.restore(s);
            }
            for (r, s) in spec.graph_rngs.iter().zip(&rngs) {
                r.restore(*s);
            }
            traced.unwrap_or_else(|| arena_of(fp))
        };
        let captured = (|| -> Result<(Box<dyn Graph>, BwdGraphs, ArenaSpec)> {
            // A capture that allocates past its planned arena's tail is made again in an arena
            // sized by the warm-up's summed bytes, as without a plan.
            let unplanned = |fp: &Footprint| ArenaSpec { plan: Default::default(), tail: slack(fp.bytes) };
            let fwd_body: crate::backend::Body = Arc::new(fwd_body);
            let fwd_spec = spec_of(&fwd_fp, &fwd_body);
            // The traced capture's activations are on addresses without memory of their own.
            if cfg.plan_arenas {
                core.clear_tape();
            }
            // A forward graph that saves nothing for a backward keeps nothing in its arena past its
            // end (its outputs are static buffers): it takes turns with the backward graphs.
            let saves_for_backward = needs_grad && core.out_grad.iter().any(|g| *g);
            let fwd_slot = match (cfg.take_turns && !saves_for_backward, cfg.share_forward_arena) {
                (true, _) => Some(&*bwd_arena_slot),
                (false, true) => Some(&*self.recorder.fwd_arena),
                (false, false) => None,
            };
            let fwd = match fwd_slot {
                Some(slot) => backend.record_sharing(&region, device, &fwd_spec, slot, pool.as_ref(), fwd_body.clone()),
                None => backend.record(&region, device, &fwd_spec, pool.as_ref(), fwd_body.clone()),
            };
            // A planned capture that overflowed a shared arena is tried once more in an arena of
            // its own with the plan's whole tail, then unplanned.
            let fwd = match fwd {
                Err(CaptureError::AllocOutsidePool { .. }) if !fwd_spec.plan.offsets.is_empty() => {
                    restore_host();
                    lock(&self.shared.stats).arena_replans += 1;
                    let own = fwd_slot.is_some().then(|| backend.record(&region, device, &fwd_spec, pool.as_ref(), fwd_body.clone()));
                    match own {
                        None | Some(Err(CaptureError::AllocOutsidePool { .. })) => {
                            restore_host();
                            backend.record(&region, device, &unplanned(&fwd_fp), pool.as_ref(), fwd_body)?
                        }
                        Some(other) => other?,
                    }
                }
                other => other?,
            };
            let mut bwd = BTreeMap::new();
            let mut bwd_spec = arena_of(&bwd_fp);
            if needs_grad && core.out_grad.iter().any(|g| *g) {
                let mask = core.out_grad.clone();
                let c = core.clone();
                let m = mask.clone();
                let body: crate::backend::Body = Arc::new(move || c.bwd_body(&m, None));
                bwd_spec = spec_of(&bwd_fp, &body);
                let graph = match backend.record_sharing(&region, device, &bwd_spec, &bwd_arena_slot, pool.as_ref(), body.clone()) {
                    Err(CaptureError::AllocOutsidePool { .. }) if !bwd_spec.plan.offsets.is_empty() => {
                        lock(&self.shared.stats).arena_replans += 1;
                        match backend.record(&region, device, &bwd_spec, pool.as_ref(), body.clone()) {
                            Err(CaptureError::AllocOutsidePool { .. }) => {
                                backend.record(&region, device, &unplanned(&bwd_fp), pool.as_ref(), body)?
                            }
                            other => other?,
                        }
                    }
                    other => other?,
                };
                bwd.insert((mask, Vec::new()), graph);
            }
            Ok((fwd, bwd, bwd_spec))
        })();
        // Host effects of running the body during capture are undone too.
        restore_host();
        let rngs: Vec<(Arc<GraphSafeRng>, u64)> = spec.graph_rngs.iter().cloned().zip(lock(&wholes).iter().copied()).collect();
        let (fwd, bwd, bwd_spec) = captured?;
        // The warm-up's allocations went back to the default pool: return them to the driver, so
        // that they do not stay reserved beside the recording's own arenas.
        backend.trim(device)?;
        {
            let mut s = lock(&self.shared.stats);
            s.captures += 1;
            s.backward_captures += bwd.len() as u64;
            for (planned, tail) in std::iter::once(fwd.placement()).chain(bwd.values().map(|g| g.placement())) {
                s.arena_planned += planned as u64;
                s.arena_tail += tail as u64;
            }
        }
        let fingerprints = surface.iter().map(|(n, t, _)| (n.clone(), t.storage_ptr(), backend.address(t))).collect();
        let trainable = surface.iter().filter(|(_, _, k)| *k == TensorKind::Parameter).map(|(_, t, _)| t.requires_grad()).collect();
        Ok(Recording {
            fwd,
            bwd: Mutex::new(bwd),
            core,
            key: key.clone(),
            fingerprints,
            trainable,
            pending: Mutex::new(None),
            // Backward graphs recorded later (another mask, other targets) have no warm-up of
            // their own: the all-outputs backward's plan, and a tail as large as an unplanned
            // arena would be, for what they allocate otherwise.
            bwd_arena: bwd_spec.clone(),
            bwd_unplanned: ArenaSpec { plan: Default::default(), tail: slack(bwd_fp.bytes) },
            bwd_planning: planning(&bwd_fp),
            bwd_arena_slot,
            device,
            strict_masks: cfg.strict_masks,
            backend,
            pool,
            rngs,
        })
    }
}

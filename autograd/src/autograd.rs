//! The tape: nodes that remember how to push gradients to their inputs, and the engine that walks
//! them in reverse topological order.
//!
//! Absent gradients are first-class: a node's backward receives `Option<Tensor>` per output, is not
//! called at all when every entry is `None`, and a leaf reached by no gradient keeps `grad() == None`.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Error, Result, Tensor};

/// The backward half of an op (or of any custom multi-output node).
///
/// `grad_outputs` has one entry per output (`None` when that output received no gradient); the
/// result has one entry per input (`None` for "no gradient for this input"). The engine runs this
/// with gradient recording disabled and never calls it when all `grad_outputs` are `None`.
pub trait BackwardOp: Send + Sync {
    /// The op's name (in errors and graph dumps).
    fn name(&self) -> &str;
    /// Input gradients from the output gradients (`None`: absent).
    fn backward(&self, grad_outputs: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>>;
    /// Whether the engine may queue this backward beside the data-gradient chain when a gradient
    /// it receives is still being written there (a weight gradient's cast back to f32, say):
    /// true only for backwards that read nothing but their inputs and saved tensors and write
    /// only fresh outputs. Otherwise the engine joins the two first.
    fn runs_aside(&self) -> bool {
        false
    }
    /// Whether this backward takes each output's gradient as the contributions it received,
    /// unsummed ([`BackwardOp::backward_parts`]), where no output received more than two and one
    /// received two: it adds them inside its own kernels as the engine would have, saving the
    /// addition's launch.
    fn adds_two_contributions(&self) -> bool {
        false
    }
    /// [`BackwardOp::backward`] of a single-output node whose gradient is `a + b` (the engine's
    /// order: `a` from the later-created consumer). By default the sum, then `backward`.
    fn backward_two(&self, a: &Tensor, b: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let g = add_grads(a.clone(), b.clone())?;
        self.backward(&[Some(g)])
    }
    /// [`BackwardOp::backward`] from each output's contributions, unsummed, in the engine's adding
    /// order (none, one or two each). By default a single output's two go to
    /// [`BackwardOp::backward_two`]; otherwise each output's are added, then `backward`.
    fn backward_parts(&self, parts: Vec<Vec<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        if let [only] = parts.as_slice() {
            if let [a, b] = only.as_slice() {
                return self.backward_two(a, b);
            }
        }
        let grads = parts.into_iter().map(summed).collect::<Result<Vec<_>>>()?;
        self.backward(&grads)
    }
}

/// Closure adapter so simple ops can write `backward` next to `forward`.
pub(crate) struct FnBackward<F> {
    pub name: &'static str,
    pub f: F,
}

impl<F> BackwardOp for FnBackward<F>
where
    F: Fn(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send + Sync,
{
    fn name(&self) -> &str {
        self.name
    }
    fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        (self.f)(g)
    }
    fn runs_aside(&self) -> bool {
        true
    }
}

/// One recorded operation.
pub struct Node {
    id: u64,
    op: Box<dyn BackwardOp>,
    /// Inputs that require gradients (`None` where an input does not).
    inputs: Vec<Option<Tensor>>,
    num_outputs: usize,
    /// The [`crate::stage`] tag the node was created under; its backward runs under
    /// `stage | BACKWARD_OF`.
    stage: u8,
    /// Recorded inside a side task ([`crate::streams::beside`]): its backward runs beside the
    /// chain too.
    aside: bool,
}

impl Node {
    /// The op's name.
    pub fn name(&self) -> &str {
        self.op.name()
    }
}

/// Which output of which node produced a tensor.
#[derive(Clone)]
pub(crate) struct GradFn {
    pub node: Arc<Node>,
    pub index: usize,
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops currently record history on this thread.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous grad mode when dropped.
pub struct GradModeGuard(bool);

impl GradModeGuard {
    /// Sets the grad mode for this thread until the guard is dropped.
    pub fn new(enabled: bool) -> Self {
        let prev = GRAD_ENABLED.with(|g| g.replace(enabled));
        GradModeGuard(prev)
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.0));
    }
}

/// Runs `f` without recording history (like `torch.no_grad()`).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = GradModeGuard::new(false);
    f()
}

fn next_node_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Gives fresh, history-less `outputs` a node that records `op` when grad mode is on and some
/// input requires a gradient (otherwise the outputs are returned unchanged). Backward closures
/// capture *detached* handles, so a node never owns the tensors that own it (no Arc cycles).
pub(crate) fn record(inputs: &[&Tensor], outputs: Vec<Tensor>, op: impl BackwardOp + 'static) -> Vec<Tensor> {
    if !tracking(inputs) {
        return outputs;
    }
    let node = new_node(inputs, Box::new(op), outputs.len());
    outputs.iter().enumerate().map(|(i, t)| with_history(t, &node, i)).collect()
}

/// Single-output convenience for [`record`].
/// (No intermediate vectors: this runs for every recorded op, on the eager launch path.)
pub(crate) fn record1(inputs: &[&Tensor], output: Tensor, op: impl BackwardOp + 'static) -> Tensor {
    if !tracking(inputs) {
        return output;
    }
    with_history(&output, &new_node(inputs, Box::new(op), 1), 0)
}

/// Whether an op over `inputs` is recorded: grad mode is on and some input needs a gradient.
fn tracking(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

/// The node for `op` over `inputs` (keeping the inputs that need gradients).
fn new_node(inputs: &[&Tensor], op: Box<dyn BackwardOp>, num_outputs: usize) -> Arc<Node> {
    Arc::new(Node {
        id: next_node_id(),
        op,
        inputs: inputs.iter().map(|t| if t.requires_grad() { Some((*t).clone()) } else { None }).collect(),
        num_outputs,
        stage: crate::stage::current(),
        aside: crate::streams::in_side_task(),
    })
}

/// A new handle on `t`'s storage that is output `index` of `node`.
fn with_history(t: &Tensor, node: &Arc<Node>, index: usize) -> Tensor {
    Tensor::build_in(t.0.storage.clone(), t.shape().clone(), t.memory_format(), false, Some(GradFn { node: node.clone(), index }))
}

/// Connects already computed `outputs` to `inputs` through a custom backward (e.g. a replayed
/// CUDA graph). Returns new handles on the outputs' storage that carry the history. When grad mode
/// is off or no input requires a gradient, the handles are returned without history.
pub fn attach_custom_node(op: Arc<dyn BackwardOp>, inputs: &[&Tensor], outputs: &[Tensor]) -> Vec<Tensor> {
    struct Shared(Arc<dyn BackwardOp>);
    impl BackwardOp for Shared {
        fn name(&self) -> &str {
            self.0.name()
        }
        fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
            self.0.backward(g)
        }
        fn adds_two_contributions(&self) -> bool {
            self.0.adds_two_contributions()
        }
        fn backward_two(&self, a: &Tensor, b: &Tensor) -> Result<Vec<Option<Tensor>>> {
            self.0.backward_two(a, b)
        }
        fn backward_parts(&self, parts: Vec<Vec<Tensor>>) -> Result<Vec<Option<Tensor>>> {
            self.0.backward_parts(parts)
        }
    }
    if !tracking(inputs) {
        return outputs.iter().map(|t| t.detach()).collect();
    }
    let node = new_node(inputs, Box::new(Shared(op)), outputs.len());
    outputs.iter().enumerate().map(|(i, t)| with_history(t, &node, i)).collect()
}

/// Nodes reachable from `root`, parents after children (reverse gives a valid processing order).
fn topo_order(root: &Arc<Node>) -> Vec<Arc<Node>> {
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    // Iterative DFS: (node, next input index to visit).
    let mut stack: Vec<(Arc<Node>, usize)> = vec![(root.clone(), 0)];
    seen.insert(root.id);
    while let Some((node, i)) = stack.pop() {
        if i < node.inputs.len() {
            stack.push((node.clone(), i + 1));
            if let Some(t) = &node.inputs[i] {
                if let Some(gf) = t.grad_fn() {
                    if seen.insert(gf.node.id) {
                        stack.push((gf.node.clone(), 0));
                    }
                }
            }
        } else {
            order.push(node);
        }
    }
    order
}

/// Two gradient contributions added as the engine adds them (`a + b`, one elementwise op).
pub(crate) fn add_grads(a: Tensor, b: Tensor) -> Result<Tensor> {
    no_grad(|| a.add(&b))
}

/// One output's gradient contributions in the order they are added: latest-created consumer
/// first.
fn in_sum_order(mut c: Vec<(u64, Tensor)>) -> Vec<Tensor> {
    c.sort_by_key(|(id, _)| std::cmp::Reverse(*id));
    c.into_iter().map(|(_, g)| g).collect()
}

/// The sum of one output's gradient contributions, latest-created consumer first (`None` when
/// nothing arrived: an absent gradient stays absent).
fn sum_contributions(c: Vec<(u64, Tensor)>) -> Result<Option<Tensor>> {
    summed(in_sum_order(c))
}

/// `parts` added in order (`None` for none).
pub(crate) fn summed(parts: Vec<Tensor>) -> Result<Option<Tensor>> {
    let mut it = parts.into_iter();
    let Some(first) = it.next() else { return Ok(None) };
    it.try_fold(first, add_grads).map(Some)
}

impl Tensor {
    /// Back-propagates from a scalar (seed 1).
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(Error::Backward {
                msg: format!("backward() needs a one-element tensor, got shape {:?}; pass an explicit gradient", self.dims()),
            });
        }
        let seed = self.ones_like()?;
        self.backward_with(&seed)
    }

    /// Back-propagates `grad` (same shape as `self`) into every leaf that requires a gradient.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        self.backward_inner(grad, None)
    }

    /// [`Tensor::backward_with`], calling `ready` with each leaf as soon as its gradient is final
    /// for this backward — after the last node that may add to it has run, its contributions
    /// added into `.grad` then (the same bytes as [`Tensor::backward_with`], which adds every
    /// leaf's at the end) — so work on finished gradients (a data-parallel all-reduce) can start
    /// while the backward goes on. A leaf that receives no gradient is not reported; each leaf
    /// is reported once, in the order the engine passes the last node that reads it.
    pub fn backward_with_ready(&self, grad: &Tensor, ready: &mut GradReady<'_>) -> Result<()> {
        self.backward_inner(grad, Some(ready))
    }

    fn backward_inner(&self, grad: &Tensor, mut ready: Option<&mut GradReady<'_>>) -> Result<()> {
        if grad.dims() != self.dims() {
            return Err(Error::GradShape {
                node: "backward seed".into(),
                input: 0,
                got: grad.dims().to_vec(),
                expected: self.dims().to_vec(),
            });
        }
        if !self.requires_grad() {
            return Err(Error::Backward { msg: "tensor does not require grad and has no grad_fn".into() });
        }
        let _mode = GradModeGuard::new(false);
        let Some(root) = self.grad_fn().cloned() else {
            self.accumulate_grad(grad)?;
            return match ready {
                Some(r) => r(self),
                None => Ok(()),
            };
        };
        let order = topo_order(&root.node);
        // With `ready`: the leaves whose last reader is the node at each step of the walk.
        let due = match ready {
            Some(_) => last_readers(&order),
            None => Vec::new(),
        };
        let mut leaf_grads: Vec<(Tensor, Tensor)> = Vec::new();
        // Gradient contributions per node output, with the id of the node that sent each: they
        // are summed in a canonical order (latest-created consumer first) when the node runs, so
        // a tensor read by several consumers gets the same bytes whatever the shape of the
        // consumers' graphs — e.g. whether a consumer ran natively or as one replayed node.
        let mut pending: Pending = HashMap::new();
        let mut seed = vec![Vec::new(); root.node.num_outputs];
        seed[root.index].push((u64::MAX, grad.clone()));
        pending.insert(root.node.id, seed);

        // Weight gradients may be computed beside the chain of data gradients (`streams`): a node
        // that receives one still being written there runs there too (or after a join), and
        // everything is joined before the leaves' gradients are touched — or when this stops early.
        let _join = crate::streams::JoinOnDrop;
        for (step, node) in order.iter().rev().enumerate() {
            self.backward_node(node, &mut pending, &mut leaf_grads)?;
            if let (Some(r), Some(leaves)) = (ready.as_mut(), due.get(step)) {
                finish_leaves(leaves, &mut leaf_grads, &mut **r)?;
            }
        }
        crate::streams::join()?;
        accumulate_leaf_grads(leaf_grads)
    }

    /// One node of the backward walk: sums its contributions, runs its backward, and hands each
    /// input's gradient to the node that made the input (`pending`) or, for a leaf, to `leaf_grads`.
    fn backward_node(&self, node: &Arc<Node>, pending: &mut Pending, leaf_grads: &mut Vec<(Tensor, Tensor)>) -> Result<()> {
        {
            let Some(contributions) = pending.remove(&node.id) else { return Ok(()) };
            let _stage = crate::stage::StageGuard::new(node.stage | crate::stage::BACKWARD_OF);
            let _label = crate::stage::LabelGuard::new(node.name());
            let written_aside = crate::streams::written_aside(contributions.iter().flatten().map(|(_, g)| g));
            let device = contributions.iter().flatten().map(|(_, g)| g.device()).next();
            let aside = match (node.aside, written_aside) {
                (true, _) => device,
                (false, Some(d)) if node.op.runs_aside() => Some(d),
                (false, Some(_)) => {
                    crate::streams::join()?;
                    None
                }
                (false, None) => None,
            };
            let run = || -> Result<Option<Vec<Option<Tensor>>>> {
                // A node that adds two contributions itself gets them unsummed.
                let two_at_most = contributions.iter().all(|c| c.len() <= 2);
                if node.op.adds_two_contributions() && two_at_most && contributions.iter().any(|c| c.len() == 2) {
                    let parts = contributions.into_iter().map(in_sum_order).collect();
                    return node.op.backward_parts(parts).map(Some);
                }
                let grads = contributions.into_iter().map(sum_contributions).collect::<Result<Vec<Option<Tensor>>>>()?;
                if grads.iter().all(Option::is_none) {
                    return Ok(None);
                }
                node.op.backward(&grads).map(Some)
            };
            let input_grads = match aside {
                Some(device) => crate::streams::beside(device, run)?,
                None => run()?,
            };
            let Some(input_grads) = input_grads else { return Ok(()) };
            if input_grads.len() != node.inputs.len() {
                return Err(Error::Backward {
                    msg: format!("{} returned {} gradients for {} inputs", node.name(), input_grads.len(), node.inputs.len()),
                });
            }
            for (i, (input, g)) in node.inputs.iter().zip(input_grads).enumerate() {
                let (Some(input), Some(g)) = (input, g) else { continue };
                if g.dims() != input.dims() {
                    return Err(Error::GradShape {
                        node: node.name().to_string(),
                        input: i,
                        got: g.dims().to_vec(),
                        expected: input.dims().to_vec(),
                    });
                }
                match input.grad_fn() {
                    Some(gf) => {
                        let slot = pending.entry(gf.node.id).or_insert_with(|| vec![Vec::new(); gf.node.num_outputs]);
                        slot[gf.index].push((node.id, g));
                    }
                    None => leaf_grads.push((input.clone(), g)),
                }
            }
        }
        Ok(())
    }
}

/// What [`Tensor::backward_with_ready`] calls with each leaf whose gradient is final.
pub type GradReady<'a> = dyn FnMut(&Tensor) -> Result<()> + 'a;

/// Gradient contributions waiting for their node: per node id, per output, (sender id, gradient).
type Pending = HashMap<u64, Vec<Vec<(u64, Tensor)>>>;

/// For each step of the backward walk (`order` reversed), the leaves whose last reader is that
/// step's node — after it, no node adds to them — each listed once, in input order.
fn last_readers(order: &[Arc<Node>]) -> Vec<Vec<Tensor>> {
    let mut last: HashMap<usize, usize> = HashMap::new();
    let mut leaves: Vec<(usize, Tensor)> = Vec::new();
    for (step, node) in order.iter().rev().enumerate() {
        for t in node.inputs.iter().flatten().filter(|t| t.grad_fn().is_none()) {
            let key = Arc::as_ptr(&t.0) as usize;
            if last.insert(key, step).is_none() {
                leaves.push((key, t.clone()));
            }
        }
    }
    let mut due: Vec<Vec<Tensor>> = vec![Vec::new(); order.len()];
    for (key, t) in leaves {
        if let Some(&step) = last.get(&key) {
            due[step].push(t);
        }
    }
    due
}

/// Adds the contributions of `leaves` (their last reader has run) into their gradients — each
/// leaf's in arrival order, as [`accumulate_leaf_grads`] does at the end — and reports each leaf
/// that received one.
fn finish_leaves(leaves: &[Tensor], leaf_grads: &mut Vec<(Tensor, Tensor)>, ready: &mut GradReady<'_>) -> Result<()> {
    let keys: HashSet<usize> = leaves.iter().map(|t| Arc::as_ptr(&t.0) as usize).collect();
    let (now, later): (Vec<_>, Vec<_>) =
        std::mem::take(leaf_grads).into_iter().partition(|(l, _)| keys.contains(&(Arc::as_ptr(&l.0) as usize)));
    *leaf_grads = later;
    if now.is_empty() {
        return Ok(());
    }
    let got: HashSet<usize> = now.iter().map(|(l, _)| Arc::as_ptr(&l.0) as usize).collect();
    // Side-stream work may still write these gradients.
    crate::streams::join()?;
    accumulate_leaf_grads(now)?;
    for leaf in leaves.iter().filter(|t| got.contains(&(Arc::as_ptr(&t.0) as usize))) {
        ready(leaf)?;
    }
    Ok(())
}

/// Adds the gradients that reached leaves during one backward into their `.grad`, each leaf's
/// contributions in arrival order (as if each were added when it arrived): round k holds every
/// leaf's k-th contribution; a leaf without a gradient takes its first one as is, and the adds into
/// existing gradients of a round run as one batch ([`Tensor::add_many_`]: on CUDA a launch per 40
/// tensors instead of one per parameter).
fn accumulate_leaf_grads(items: Vec<(Tensor, Tensor)>) -> Result<()> {
    let mut rounds: Vec<Vec<(Tensor, Tensor)>> = Vec::new();
    let mut seen: HashMap<usize, usize> = HashMap::new();
    for (leaf, g) in items {
        let k = seen.entry(Arc::as_ptr(&leaf.0) as usize).or_insert(0);
        if rounds.len() <= *k {
            rounds.push(Vec::new());
        }
        rounds[*k].push((leaf, g));
        *k += 1;
    }
    for round in rounds {
        let mut adds: Vec<(Tensor, Tensor)> = Vec::new();
        for (leaf, g) in round {
            let existing = leaf.0.grad.lock().unwrap_or_else(|e| e.into_inner()).clone();
            match existing {
                Some(e) => adds.push((e, g)),
                None => leaf.accumulate_grad(&g)?,
            }
        }
        let refs: Vec<(&Tensor, &Tensor)> = adds.iter().map(|(e, g)| (e, g)).collect();
        Tensor::add_many_(&refs)?;
    }
    Ok(())
}

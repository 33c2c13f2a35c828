//! Shape ops: reshape (shares storage), permute, narrow, cat/split, expand, (un)squeeze,
//! nearest upsampling. Views other than reshape are materialised by a strided copy.

use std::sync::Arc;

use crate::autograd::{record, record1, FnBackward};
use crate::shape::{broadcast_strides, contiguous_strides, normalize_dim, Layout, Shape};
use crate::storage::Storage;
use crate::{DType, Device, Error, MemoryFormat, Result, Tensor};

/// Copies the strided view `src` of `x` into a new contiguous tensor.
fn gather_view(x: &Tensor, src: &Layout) -> Result<Tensor> {
    let mut out = Storage::uninit(x.device(), x.dtype(), src.numel())?;
    x.read_storage()?.copy_strided(src, &mut out, &Layout::contiguous(&src.shape))?;
    Tensor::from_storage(out, src.shape.clone())
}

/// A zero tensor of `shape` with `g` written into the region `dst` (the inverse of a view).
fn scatter_view(g: &Tensor, shape: &[usize], dst: &Layout) -> Result<Tensor> {
    let mut out = Storage::zeros(g.device(), g.dtype(), shape.iter().product())?;
    g.read_storage()?.copy_strided(&Layout::contiguous(g.dims()), &mut out, dst)?;
    Tensor::from_storage(out, shape.to_vec())
}

fn narrow_layout(dims: &[usize], d: usize, start: usize, len: usize) -> Layout {
    let st = contiguous_strides(dims);
    let mut shape = dims.to_vec();
    shape[d] = len;
    Layout { shape, strides: st.clone(), offset: start * st[d] }
}

/// `Some(N·H·W)` when `t` is a channels-last 4-D tensor and `d` is its channel dimension: along C
/// its storage is N·H·W rows of channels, so cat and split along C are row copies.
fn channels_last_rows(t: &Tensor, d: usize) -> Option<usize> {
    let dims = t.dims();
    (t.memory_format() == MemoryFormat::ChannelsLast && d == 1 && dims.len() == 4).then(|| dims[0] * dims[2] * dims[3])
}

/// `x` cut along `d` into pieces of `sizes` (no autograd; channels-last pieces of a channels-last
/// `x` cut along C where the backend copies rows in one pass, else contiguous ones): one device pass where the
/// backend has it (CUDA, up to 8 pieces), else a strided copy per piece.
fn split_pieces(x: &Tensor, d: usize, sizes: &[usize]) -> Result<Vec<Tensor>> {
    if let Some(rows) = channels_last_rows(x, d) {
        // Channels-last along C: each row of N·H·W positions hands each piece its channels.
        let es = x.dtype().size_in_bytes();
        let dims = x.dims();
        let outs = sizes.iter().map(|&l| Storage::uninit(x.device(), x.dtype(), rows * l)).collect::<Result<Vec<_>>>()?;
        let dsts: Vec<(Option<u64>, usize)> = outs.iter().zip(sizes).map(|(o, &l)| (o.device_address(), l * es)).collect();
        if x.raw_storage().split_rows(rows, &dsts)? {
            return outs
                .into_iter()
                .zip(sizes)
                .map(|(o, &l)| Tensor::from_storage_in(o, vec![dims[0], l, dims[2], dims[3]].into(), MemoryFormat::ChannelsLast))
                .collect();
        }
    }
    let dims = x.dims();
    let rows: usize = dims[..d].iter().product();
    let inner: usize = dims[d + 1..].iter().product();
    let row_bytes = inner * x.dtype().size_in_bytes();
    let mut outs = sizes.iter().map(|&l| Storage::uninit(x.device(), x.dtype(), rows * l * inner)).collect::<Result<Vec<_>>>()?;
    let dsts: Vec<(Option<u64>, usize)> = outs.iter().zip(sizes).map(|(o, &l)| (o.device_address(), l * row_bytes)).collect();
    let fused = x.read_storage()?.split_rows(rows, &dsts)?;
    let mut start = 0;
    let mut pieces = Vec::with_capacity(sizes.len());
    for (out, &l) in outs.iter_mut().zip(sizes) {
        let lay = narrow_layout(dims, d, start, l);
        if !fused {
            x.read_storage()?.copy_strided(&lay, out, &Layout::contiguous(&lay.shape))?;
        }
        start += l;
        pieces.push(lay.shape);
    }
    outs.into_iter().zip(pieces).map(|(o, shape)| Tensor::from_storage(o, shape)).collect()
}

impl Tensor {
    /// Same data, new shape (no copy; storage is shared).
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(Error::ReshapeNumel {
                op: "reshape",
                from: self.dims().to_vec(),
                from_numel: self.numel(),
                to: shape.0.clone(),
                to_numel: shape.numel(),
            });
        }
        if shape == *self.shape() {
            return Ok(self.clone());
        }
        // A view reads the storage in the logical order: a channels-last tensor is made
        // contiguous first (its gradient flows back through the conversion).
        if self.memory_format() != MemoryFormat::Contiguous {
            return self.to_memory_format(MemoryFormat::Contiguous)?.reshape(shape);
        }
        let y = Tensor::build(Arc::clone(&self.0.storage), shape, false, None);
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let in_shape = self.shape().clone();
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "reshape",
                f: move |g: &[Option<Tensor>]| Ok(vec![g[0].as_ref().map(|g| g.reshape(in_shape.clone())).transpose()?]),
            },
        ))
    }

    /// Reshape where one entry may be −1 (inferred).
    pub fn reshape_infer(&self, dims: &[isize]) -> Result<Tensor> {
        let known: usize = dims.iter().filter(|&&d| d >= 0).map(|&d| d as usize).product();
        let n_infer = dims.iter().filter(|&&d| d < 0).count();
        if n_infer > 1 || (n_infer == 1 && (known == 0 || !self.numel().is_multiple_of(known))) {
            return Err(Error::invalid("reshape", format!("cannot reshape {:?} into {dims:?}", self.dims())));
        }
        let shape: Vec<usize> = dims.iter().map(|&d| if d < 0 { self.numel() / known.max(1) } else { d as usize }).collect();
        self.reshape(shape)
    }

    /// The elements as one dimension.
    pub fn flatten_all(&self) -> Result<Tensor> {
        self.reshape(vec![self.numel()])
    }

    /// Flattens dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        let (s, e) = (normalize_dim("flatten", start, self.rank())?, normalize_dim("flatten", end, self.rank())?);
        if s > e {
            return Err(Error::invalid("flatten", format!("start {start} after end {end}")));
        }
        let d = self.dims();
        let mut shape = d[..s].to_vec();
        shape.push(d[s..=e].iter().product());
        shape.extend_from_slice(&d[e + 1..]);
        self.reshape(shape)
    }

    /// A new dimension of size 1 at `dim`.
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("unsqueeze", dim, self.rank() + 1)?;
        let mut s = self.dims().to_vec();
        s.insert(d, 1);
        self.reshape(s)
    }

    /// Dimension `dim` (of size 1) removed.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("squeeze", dim, self.rank())?;
        if self.dims()[d] != 1 {
            return Ok(self.clone());
        }
        let mut s = self.dims().to_vec();
        s.remove(d);
        self.reshape(s)
    }

    /// Reorders dimensions (a copy).
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let r = self.rank();
        let mut seen = vec![false; r];
        if perm.len() != r || perm.iter().any(|&p| p >= r || std::mem::replace(&mut seen[p], true)) {
            return Err(Error::invalid("permute", format!("{perm:?} is not a permutation of {r} dims (shape {:?})", self.dims())));
        }
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self.clone());
        }
        // A permutation that moves only dims of size 1 keeps the storage order: a view, no copy
        // (e.g. (B, 1, A) → (B, A, 1), a one-class head's scores).
        let moved: Vec<usize> = perm.iter().copied().filter(|&p| self.dims()[p] != 1).collect();
        if self.memory_format() == MemoryFormat::Contiguous && moved.windows(2).all(|w| w[0] < w[1]) {
            return self.reshape(perm.iter().map(|&p| self.dims()[p]).collect::<Vec<usize>>());
        }
        let st = contiguous_strides(self.dims());
        let src =
            Layout { shape: perm.iter().map(|&p| self.dims()[p]).collect(), strides: perm.iter().map(|&p| st[p]).collect(), offset: 0 };
        let y = gather_view(self, &src)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let mut inv = vec![0; r];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(record1(
            &[self],
            y,
            FnBackward { name: "permute", f: move |g: &[Option<Tensor>]| Ok(vec![g[0].as_ref().map(|g| g.permute(&inv)).transpose()?]) },
        ))
    }

    /// Swaps two dimensions (a copy).
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor> {
        let (a, b) = (normalize_dim("transpose", a, self.rank())?, normalize_dim("transpose", b, self.rank())?);
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Elements `start..start+len` along `dim` (a copy).
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = normalize_dim("narrow", dim, self.rank())?;
        if start + len > self.dims()[d] {
            return Err(Error::invalid(
                "narrow",
                format!("range {start}..{} exceeds size {} of dim {d} in {:?}", start + len, self.dims()[d], self.dims()),
            ));
        }
        if start == 0 && len == self.dims()[d] {
            return Ok(self.clone());
        }
        let lay = narrow_layout(self.dims(), d, start, len);
        let y = gather_view(self, &lay)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let in_dims = self.dims().to_vec();
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "narrow",
                f: move |g: &[Option<Tensor>]| Ok(vec![g[0].as_ref().map(|g| scatter_view(g, &in_dims, &lay)).transpose()?]),
            },
        ))
    }

    /// Concatenates along `dim`.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::invalid("cat", "no tensors given"))?;
        let d = normalize_dim("cat", dim, first.rank())?;
        let channels_last = tensors.iter().all(|t| channels_last_rows(t, d).is_some());
        // The one-pass kernel copies storage as it lies: channels-last inputs joined along C are
        // rows of channels joined side by side (below); any other mix enters in the contiguous
        // order (the entry rule, docs/channels-last.md).
        if !channels_last && tensors.iter().any(|t| t.memory_format() != MemoryFormat::Contiguous) {
            let owned = tensors.iter().map(|t| t.to_memory_format(MemoryFormat::Contiguous)).collect::<Result<Vec<_>>>()?;
            return Tensor::cat(&owned.iter().collect::<Vec<_>>(), dim);
        }
        let mut total = 0;
        for t in tensors {
            let ok = t.rank() == first.rank() && t.dims().iter().zip(first.dims()).enumerate().all(|(i, (a, b))| i == d || a == b);
            if !ok {
                return Err(Error::ShapeMismatch { op: "cat", lhs: first.dims().to_vec(), rhs: t.dims().to_vec() });
            }
            super::same_dtype("cat", first, t)?;
            total += t.dims()[d];
        }
        let mut shape = first.dims().to_vec();
        shape[d] = total;
        let mut out = Storage::uninit(first.device(), first.dtype(), shape.iter().product())?;
        // One pass for all inputs where the backend has it (CUDA), else a strided copy per input.
        // Channels-last along C: rows of N·H·W positions, each input's channels side by side.
        let (rows, row_bytes) = match channels_last {
            true => (shape[0] * shape[2] * shape[3], first.dtype().size_in_bytes()),
            false => (shape[..d].iter().product(), shape[d + 1..].iter().product::<usize>() * first.dtype().size_in_bytes()),
        };
        let srcs: Vec<(Option<u64>, usize)> = tensors.iter().map(|t| (t.device_address(), t.dims()[d] * row_bytes)).collect();
        let fused = out.cat_rows(rows, &srcs)?;
        if channels_last && !fused {
            // A backend without the one-pass copy: the contiguous way.
            let owned = tensors.iter().map(|t| t.to_memory_format(MemoryFormat::Contiguous)).collect::<Result<Vec<_>>>()?;
            return Tensor::cat(&owned.iter().collect::<Vec<_>>(), dim);
        }
        let mut regions = Vec::with_capacity(tensors.len());
        let mut start = 0;
        for t in tensors {
            if !fused {
                let lay = narrow_layout(&shape, d, start, t.dims()[d]);
                t.read_storage()?.copy_strided(&Layout::contiguous(t.dims()), &mut out, &lay)?;
            }
            regions.push((start, t.dims()[d]));
            start += t.dims()[d];
        }
        let format = if channels_last { MemoryFormat::ChannelsLast } else { MemoryFormat::Contiguous };
        let y = Tensor::from_storage_in(out, shape.into(), format)?;
        if !tensors.iter().any(|t| t.requires_grad()) || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let needs: Vec<bool> = tensors.iter().map(|t| t.requires_grad()).collect();
        Ok(record(
            tensors,
            vec![y],
            FnBackward {
                name: "cat",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None; needs.len()]) };
                    // Every input's slice of the gradient in one pass (unneeded ones dropped).
                    let sizes: Vec<usize> = regions.iter().map(|&(_, l)| l).collect();
                    let pieces = split_pieces(g, d, &sizes)?;
                    Ok(pieces.into_iter().zip(&needs).map(|(p, &need)| need.then_some(p)).collect())
                },
            },
        )
        .remove(0))
    }

    /// Splits along `dim` into pieces of the given sizes (copies, made in one device pass on
    /// CUDA). One autograd node: its gradient is the pieces' gradients concatenated (zeros for a
    /// piece that received none; absent when none did).
    pub fn split(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = normalize_dim("split", dim, self.rank())?;
        if sizes.iter().sum::<usize>() != self.dims()[d] {
            return Err(Error::invalid(
                "split",
                format!("sizes {sizes:?} do not add up to {} (dim {d} of {:?})", self.dims()[d], self.dims()),
            ));
        }
        if sizes.len() == 1 {
            return Ok(vec![self.clone()]);
        }
        let pieces = split_pieces(self, d, sizes)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(pieces);
        }
        let shapes: Vec<Vec<usize>> = pieces.iter().map(|p| p.dims().to_vec()).collect();
        let (dtype, device) = (self.dtype(), self.device());
        Ok(record(&[self], pieces, SplitBackward { shapes, dtype, device, d }))
    }

    /// Splits into `n` nearly equal chunks along `dim` (like `torch.chunk`).
    pub fn chunk(&self, n: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = normalize_dim("chunk", dim, self.rank())?;
        let size = self.dims()[d];
        let step = size.div_ceil(n.max(1));
        let mut sizes = Vec::new();
        let mut left = size;
        while left > 0 {
            sizes.push(step.min(left));
            left -= step.min(left);
        }
        self.split(&sizes, d as isize)
    }

    /// Broadcasts to `shape` (a materialised copy); the gradient is summed back.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let target = crate::shape::broadcast_shapes("expand", self.dims(), shape)?;
        if target != shape {
            return Err(Error::BroadcastIncompatible { op: "expand", lhs: self.dims().to_vec(), rhs: shape.to_vec() });
        }
        if self.dims() == shape {
            return Ok(self.clone());
        }
        let src = Layout { shape: shape.to_vec(), strides: broadcast_strides(self.dims(), shape), offset: 0 };
        let y = gather_view(self, &src)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        let in_dims = self.dims().to_vec();
        Ok(record1(
            &[self],
            y,
            FnBackward { name: "expand", f: move |g: &[Option<Tensor>]| Ok(vec![g[0].as_ref().map(|g| g.sum_to(&in_dims)).transpose()?]) },
        ))
    }

    /// Nearest-neighbour upsampling of an NCHW tensor by an integer factor (a channels-last one
    /// stays channels-last).
    pub fn upsample_nearest(&self, factor: usize) -> Result<Tensor> {
        let d = self.dims();
        if d.len() != 4 || factor == 0 {
            return Err(Error::invalid("upsample_nearest", format!("expected NCHW and a factor ≥ 1, got {d:?} and {factor}")));
        }
        let (n, c, h, w) = (d[0], d[1], d[2], d[3]);
        if !self.dtype().is_float() {
            // Integer tensors: a broadcast copy (no gradient to carry).
            return self.reshape(vec![n, c, h, 1, w, 1])?.expand(&[n, c, h, factor, w, factor])?.reshape(vec![
                n,
                c,
                h * factor,
                w * factor,
            ]);
        }
        // Float tensors: a dedicated kernel each way (one pass over memory, no reduction kernel);
        // a channels-last tensor is upsampled as it lies and the result is channels-last.
        let shape = [n, c, h, w];
        let format = self.memory_format();
        let cl = format == MemoryFormat::ChannelsLast;
        let s = self.raw_storage().upsample_nearest2d(shape, factor, cl)?;
        let y = Tensor::from_storage_in(s, vec![n, c, h * factor, w * factor].into(), format)?;
        if !self.requires_grad() || !crate::is_grad_enabled() {
            return Ok(y);
        }
        Ok(record1(
            &[self],
            y,
            FnBackward {
                name: "upsample_nearest",
                f: move |g: &[Option<Tensor>]| {
                    let Some(g) = &g[0] else { return Ok(vec![None]) };
                    // The output gradient in the output's format (converted if it arrived otherwise).
                    let g = g.to_memory_format(format)?;
                    let s = g.raw_storage().upsample_nearest2d_backward(shape, factor, cl)?;
                    Ok(vec![Some(Tensor::from_storage_in(s, shape.to_vec().into(), format)?)])
                },
            },
        ))
    }
}

/// The backward of [`Tensor::split`]: the pieces' gradients concatenated (zeros for a piece that
/// received none; absent when none did). A piece whose gradient arrived as two contributions
/// (a C2f/C3k2 chunk read by the concatenation and by the next block) has them added inside the
/// concatenation's one pass where the backend has it, instead of an addition launch first.
struct SplitBackward {
    shapes: Vec<Vec<usize>>,
    dtype: DType,
    device: Device,
    d: usize,
}

impl SplitBackward {
    /// One piece's gradient in the input's dtype, or zeros.
    fn filled(&self, g: Option<Tensor>, shape: &[usize]) -> Result<Tensor> {
        match g {
            Some(g) if g.dtype() == self.dtype => Ok(g),
            Some(g) => g.to_dtype(self.dtype),
            None => Tensor::zeros(shape.to_vec(), self.dtype, self.device),
        }
    }

    /// The concatenation of `parts` (each piece's contributions, at most two, in adding order)
    /// in one pass that adds where the backend has it; `None` where it does not (another dtype
    /// or layout among the contributions, a backend without the kernel).
    fn cat_adding(&self, parts: &[Vec<Tensor>]) -> Result<Option<Tensor>> {
        let d = self.d;
        let ready = |t: &Tensor, shape: &[usize]| {
            t.dtype() == self.dtype && t.dims() == shape && t.memory_format() == MemoryFormat::Contiguous && t.device_address().is_some()
        };
        if parts.iter().zip(&self.shapes).any(|(p, s)| p.iter().any(|t| !ready(t, s))) {
            return Ok(None);
        }
        let zeros: Vec<Option<Tensor>> = parts
            .iter()
            .zip(&self.shapes)
            .map(|(p, s)| p.is_empty().then(|| Tensor::zeros(s.clone(), self.dtype, self.device)).transpose())
            .collect::<Result<_>>()?;
        let mut shape = self.shapes[0].clone();
        shape[d] = self.shapes.iter().map(|s| s[d]).sum();
        let row_values: usize = shape[d + 1..].iter().product();
        let addr = |t: &Tensor| t.device_address().unwrap_or(0);
        let srcs: Vec<(u64, Option<u64>, usize)> = parts
            .iter()
            .zip(&zeros)
            .zip(&self.shapes)
            .map(|((p, z), s)| match (p.as_slice(), z) {
                ([a, b], _) => (addr(a), Some(addr(b)), s[d] * row_values),
                ([a], _) => (addr(a), None, s[d] * row_values),
                (_, z) => (z.as_ref().map_or(0, addr), None, s[d] * row_values),
            })
            .collect();
        let mut out = Storage::uninit(self.device, self.dtype, shape.iter().product())?;
        if !out.cat_rows_adding(shape[..d].iter().product(), &srcs)? {
            return Ok(None);
        }
        Ok(Some(Tensor::from_storage_in(out, shape.into(), MemoryFormat::Contiguous)?))
    }
}

impl crate::autograd::BackwardOp for SplitBackward {
    fn name(&self) -> &str {
        "split"
    }
    fn backward(&self, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        if g.iter().all(Option::is_none) {
            return Ok(vec![None]);
        }
        let filled = g.iter().zip(&self.shapes).map(|(g, s)| self.filled(g.clone(), s)).collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = filled.iter().collect();
        Ok(vec![Some(Tensor::cat(&refs, self.d as isize)?)])
    }
    fn adds_two_contributions(&self) -> bool {
        true
    }
    fn backward_parts(&self, parts: Vec<Vec<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        if let Some(g) = self.cat_adding(&parts)? {
            return Ok(vec![Some(g)]);
        }
        let grads = parts.into_iter().map(crate::autograd::summed).collect::<Result<Vec<_>>>()?;
        self.backward(&grads)
    }
}

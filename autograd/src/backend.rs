//! The backend boundary: the primitive, non-differentiable kernels every device implements.
//!
//! Tensors are always contiguous, so most primitives take plain shapes; broadcasting and views
//! reach the kernels as [`Layout`]s (strides, with 0 for broadcast dimensions). Autograd never
//! lives here: each differentiable op in `ops/` is built from these primitives in forward *and*
//! backward, so a backend that implements this trait gets gradients for free.
//!
//! Beside it, optional sub-traits for work that is not a primitive of the math but must run on
//! the device that holds the data: counter-based random draws ([`RandomStorage`]), padded-batch
//! packing ([`PackStorage`]), optimizer updates over many tensors ([`MultiTensorStorage`]) and
//! deferred host reads ([`DeferredReadStorage`]). The CPU backend implements each as the
//! reference of the others; `storage.rs` alone picks the backend.

use crate::shape::Layout;
use crate::{DType, Device, Result};

/// Element-wise unary functions (parameters carried inline).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// −x.
    Neg,
    /// eˣ.
    Exp,
    /// ln x.
    Log,
    /// √x.
    Sqrt,
    /// |x|.
    Abs,
    /// 1 / (1 + e⁻ˣ).
    Sigmoid,
    /// x·sigmoid(x).
    Silu,
    /// tanh x.
    Tanh,
    /// `log(1 + e^x)`, with PyTorch's threshold 20 (returns `x` above it).
    Softplus,
    /// atan x.
    Atan,
    /// 1 / x.
    Recip,
    /// −1, 0 or 1.
    Sign,
    /// x².
    Square,
    /// max(x, 0).
    Relu,
    /// ⌊x⌋.
    Floor,
    /// ⌈x⌉.
    Ceil,
    /// `x^p` for a scalar exponent.
    Powf(f64),
    /// `min(max(x, lo), hi)`.
    Clamp(f64, f64),
    /// `x * mul + add`.
    Affine(f64, f64),
    /// Derivative of SiLU: `s(x)·(1 + x·(1 − s(x)))`.
    SiluGrad,
}

/// Element-wise binary functions with broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    /// a + b.
    Add,
    /// a − b.
    Sub,
    /// a·b.
    Mul,
    /// a / b.
    Div,
    /// max(a, b).
    Maximum,
    /// min(a, b).
    Minimum,
    /// aᵇ.
    Pow,
    /// atan2(a, b).
    Atan2,
    /// Binary cross-entropy on logits `a` with targets `b`, no reduction, in the stable form
    /// `max(a, 0) − a·b + log(1 + e^(−|a|))` (one fused pass).
    BceWithLogits,
}

/// Element-wise comparisons; the result dtype is `Bool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    /// a = b.
    Eq,
    /// a ≠ b.
    Ne,
    /// a < b.
    Lt,
    /// a ≤ b.
    Le,
    /// a > b.
    Gt,
    /// a ≥ b.
    Ge,
}

/// Reductions along one dimension (kept as size 1 in the output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Index of the first maximum, as I64.
    ArgMax,
    /// Index of the first minimum, as I64.
    ArgMin,
}

/// 2-D convolution geometry (logical NCHW input, OIHW weight, dilation 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    /// Input, output and their gradients stored N, H, W, C: asked only of a backend whose
    /// [`BackendStorage::computes_channels_last_convolutions`] says so.
    pub channels_last: bool,
    /// The weight and its gradient stored O, H, W, I (cuDNN's KRSC, the order its fast engines
    /// read, so no filter conversion runs inside cuDNN), whatever the activations' format; asked
    /// only of a backend that computes channels-last convolutions.
    pub weight_channels_last: bool,
    /// The output gradient stored N, H, W, C while the input, the output and the input's gradient
    /// are contiguous (`channels_last` false): converted once and read as it lies by both
    /// gradients, instead of each converting it inside the library; asked only where
    /// [`BackendStorage::reads_channels_last_output_gradient`] says so. Forward calls ignore it.
    pub grad_channels_last: bool,
    /// The input stored N, H, W, C while the output and the input's gradient are contiguous
    /// (`channels_last` false): converted once in the forward call, which reads it so, and kept
    /// in that order for the weight gradient, which would otherwise convert it again inside the
    /// library; asked only where [`BackendStorage::reads_channels_last_input`] says so. Data
    /// gradient calls ignore it.
    pub input_channels_last: bool,
    /// Images.
    pub batch: usize,
    /// Input channels.
    pub c_in: usize,
    /// Input height.
    pub h_in: usize,
    /// Input width.
    pub w_in: usize,
    /// Output channels.
    pub c_out: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Stride (vertical, horizontal).
    pub stride: (usize, usize),
    /// Zero padding (vertical, horizontal), on both sides.
    pub padding: (usize, usize),
    /// Groups (c_in for a depthwise convolution).
    pub groups: usize,
}

impl Conv2dParams {
    /// Output height.
    pub fn h_out(&self) -> usize {
        (self.h_in + 2 * self.padding.0 - self.kh) / self.stride.0 + 1
    }
    /// Output width.
    pub fn w_out(&self) -> usize {
        (self.w_in + 2 * self.padding.1 - self.kw) / self.stride.1 + 1
    }
    /// The output's logical shape (N, C, H, W).
    pub fn out_shape(&self) -> [usize; 4] {
        [self.batch, self.c_out, self.h_out(), self.w_out()]
    }
    /// The weight's shape (c_out, c_in / groups, kh, kw).
    pub fn weight_shape(&self) -> [usize; 4] {
        [self.c_out, self.c_in / self.groups, self.kh, self.kw]
    }
}

/// 2-D max-pool geometry (logical NCHW, padding with −∞).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pool2dParams {
    /// Input, output, indices and gradients stored N, H, W, C (indices still count positions
    /// within a channel's H×W plane).
    pub channels_last: bool,
    /// Images.
    pub batch: usize,
    /// Channels.
    pub channels: usize,
    /// Input height.
    pub h_in: usize,
    /// Input width.
    pub w_in: usize,
    /// Square window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Padding with −∞ on every side.
    pub padding: usize,
}

impl Pool2dParams {
    /// Output height.
    pub fn h_out(&self) -> usize {
        (self.h_in + 2 * self.padding - self.kernel) / self.stride + 1
    }
    /// Output width.
    pub fn w_out(&self) -> usize {
        (self.w_in + 2 * self.padding - self.kernel) / self.stride + 1
    }
}

/// Batched matrix multiply geometry: `C[b] (m×n) = op(A[b]) (m×k) · op(B[b]) (k×n)`.
/// `A` is stored `m×k` (or `k×m` when `lhs_t`), `B` `k×n` (or `n×k` when `rhs_t`).
/// A batch count of 1 on one side broadcasts it over the other's batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulParams {
    /// Matrices in the left operand (1: shared by every product).
    pub lhs_batch: usize,
    /// Matrices in the right operand (1: shared).
    pub rhs_batch: usize,
    /// Rows of the product.
    pub m: usize,
    /// Columns of the product.
    pub n: usize,
    /// The shared (summed) dimension.
    pub k: usize,
    /// The left matrices are stored transposed.
    pub lhs_t: bool,
    /// The right matrices are stored transposed.
    pub rhs_t: bool,
}

impl MatmulParams {
    /// Products computed (the larger batch).
    pub fn batch(&self) -> usize {
        self.lhs_batch.max(self.rhs_batch)
    }
}

/// The contract each device's storage fulfils. All slices are contiguous unless a [`Layout`] says
/// otherwise; every kernel must write every output element (tests poison outputs to check).
pub trait BackendStorage: Sized {
    /// The element type.
    fn dtype(&self) -> DType;
    /// The device holding the elements.
    fn device(&self) -> Device;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether there is no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `op` applied to every element.
    fn unary(&self, op: UnaryOp) -> Result<Self>;
    /// `out[i] = op(lhs[lhs_layout(i)], rhs[rhs_layout(i)])`, both layouts of shape `out_shape`.
    fn binary(&self, lhs: &Layout, rhs: &Self, rhs_l: &Layout, op: BinaryOp) -> Result<Self>;
    /// `op` between `self` (read through `lhs`) and `rhs` (through `rhs_l`), as bool elements.
    fn cmp(&self, lhs: &Layout, rhs: &Self, rhs_l: &Layout, op: CmpOp) -> Result<Self>;
    /// `out[i] = cond[i] != 0 ? a[i] : b[i]` with all three broadcast to one shape.
    fn where_cond(&self, cond_l: &Layout, a: &Self, a_l: &Layout, b: &Self, b_l: &Layout) -> Result<Self>;
    /// Reduce `dim` of a contiguous tensor of `shape`; the output keeps `dim` with size 1.
    fn reduce(&self, shape: &[usize], dim: usize, op: ReduceOp) -> Result<Self>;
    /// The elements converted to `dtype` (round to nearest even).
    fn to_dtype(&self, dtype: DType) -> Result<Self>;
    /// Copies the strided view `src_l` of `self` into the strided view `dst_l` of `dst` (same shape).
    fn copy_strided(&self, src_l: &Layout, dst: &mut Self, dst_l: &Layout) -> Result<()>;
    /// `dst[i] += src[i]` in place (same dtype and length). Used for gradient accumulation.
    fn add_assign(&mut self, src: &Self) -> Result<()>;

    /// Select `idx` (I64) along `dim`.
    fn index_select(&self, shape: &[usize], dim: usize, idx: &Self) -> Result<Self>;
    /// `self` (shape `shape`) with `src` rows added at `idx` along `dim`, deterministically.
    fn index_add(&self, shape: &[usize], dim: usize, idx: &Self, src: &Self) -> Result<Self>;
    /// `out[..i_dim..] = self[..idx[..]..]` with `idx` of shape `idx_shape`.
    fn gather(&self, shape: &[usize], dim: usize, idx: &Self, idx_shape: &[usize]) -> Result<Self>;
    /// `self` with `src` (shape `idx_shape`) added at positions `idx` along `dim`, deterministically.
    fn scatter_add(&self, shape: &[usize], dim: usize, idx: &Self, idx_shape: &[usize], src: &Self) -> Result<Self>;

    /// The batched product `op(self)·op(rhs)` described by `p`.
    fn matmul(&self, rhs: &Self, p: &MatmulParams) -> Result<Self>;
    /// `beta·c + alpha·op(self)·op(rhs)` with `c` of the product's shape (PyTorch `baddbmm`):
    /// products accumulated as [`BackendStorage::matmul`] does, one rounding to the dtype.
    fn matmul_add(&self, rhs: &Self, c: &Self, p: &MatmulParams, alpha: f64, beta: f64) -> Result<Self>;
    /// The convolution of `self` (input) with `weight` described by `p`.
    fn conv2d(&self, weight: &Self, p: &Conv2dParams) -> Result<Self>;
    /// Whether the convolutions take [`Conv2dParams::channels_last`] data (cuDNN computes in
    /// NHWC; a backend without it gets channels-last inputs converted at the op's entry).
    fn computes_channels_last_convolutions(&self) -> bool {
        false
    }
    /// Whether both gradients of the contiguous convolution `p` are cheaper from an output
    /// gradient stored N, H, W, C ([`Conv2dParams::grad_channels_last`]): true where the library
    /// computes in NHWC and would otherwise convert the same output gradient once per gradient.
    fn reads_channels_last_output_gradient(&self, p: &Conv2dParams) -> bool {
        let _ = p;
        false
    }
    /// Whether the forward call and the weight gradient of the contiguous convolution `p` are
    /// cheaper from an input stored N, H, W, C ([`Conv2dParams::input_channels_last`]): true where
    /// the library computes in NHWC and would otherwise convert the same input once in each.
    fn reads_channels_last_input(&self, p: &Conv2dParams) -> bool {
        let _ = p;
        false
    }
    /// Gradient of the conv input given the output gradient (`self`).
    fn conv2d_backward_input(&self, weight: &Self, p: &Conv2dParams) -> Result<Self>;
    /// Gradient of the conv weight given the output gradient (`self`) and the input.
    fn conv2d_backward_weight(&self, input: &Self, p: &Conv2dParams) -> Result<Self>;
    /// Whether [`BackendStorage::conv2d_backward_weight_and_bias`] computes the bias gradient of
    /// `p` in the weight gradient's launch (instead of a reduction of the output gradient of its
    /// own).
    fn fuses_bias_gradient(&self, p: &Conv2dParams) -> bool {
        let _ = p;
        false
    }
    /// Gradients of the conv weight and of a bias added to every output channel, given the output
    /// gradient (`self`) and the input; asked only where
    /// [`BackendStorage::fuses_bias_gradient`] says so.
    fn conv2d_backward_weight_and_bias(&self, input: &Self, p: &Conv2dParams) -> Result<(Self, Self)> {
        let _ = input;
        Err(crate::Error::invalid("conv2d_backward_weight_and_bias", format!("this backend has no one-launch bias gradient ({p:?})")))
    }
    /// Returns (values, argmax indices within each input plane as I64).
    fn max_pool2d(&self, p: &Pool2dParams) -> Result<(Self, Self)>;
    /// Gradient of the pool input from the output gradient (`self`) and the argmax indices.
    fn max_pool2d_backward(&self, indices: &Self, p: &Pool2dParams) -> Result<Self>;
    /// Nearest upsampling of a tensor of logical shape `shape` = [n, c, h, w] by an integer factor,
    /// stored N, C, H, W or (`channels_last`) N, H, W, C; the output is stored the same way.
    fn upsample_nearest2d(&self, shape: [usize; 4], factor: usize, channels_last: bool) -> Result<Self>;
    /// Its gradient: each input position receives the sum of its factor×factor block of the
    /// output gradient (`self`, logical shape [n, c, h·f, w·f]), summed in row-major order.
    fn upsample_nearest2d_backward(&self, shape: [usize; 4], factor: usize, channels_last: bool) -> Result<Self>;
    /// Positions (I64) of the first `size` non-zero elements in ascending order, padded with
    /// `fill`: a fixed-shape `nonzero` (PyTorch `nonzero_static`) that needs no host read.
    fn nonzero_static(&self, size: usize, fill: i64) -> Result<Self>;
    /// Top-k along `dim`, sorted (largest first when `largest`), ties by lower index. No gradient.
    fn topk(&self, shape: &[usize], dim: usize, k: usize, largest: bool) -> Result<(Self, Self)>;

    /// Training-mode batch-norm statistics of an NCHW tensor (`shape` = [n, c, h, w], stored
    /// N, H, W, C when `channels_last`), accumulated deterministically in f64. `weight`, `bias`, `running_mean`, `running_var` have
    /// the statistics dtype (f64 for f64 input, else f32); the running statistics are updated in
    /// place (`r ← (1 − momentum)·r + momentum·batch`, unbiased variance). Returns
    /// `([scale; C] ++ [shift; C], [invstd; C] ++ [−mean·invstd; C])` in the statistics dtype, with
    /// `scale = weight·invstd`, `shift = bias − mean·scale`. `batches`, when given (one i64), is
    /// incremented by one in the same pass (`num_batches_tracked`).
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_train_stats(
        &self,
        shape: &[usize],
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        batches: Option<&mut Self>,
        eps: f64,
        momentum: f64,
        channels_last: bool,
    ) -> Result<(Self, Self)>;
    /// [`Self::batch_norm_train_stats`] followed by [`Self::channel_affine`] with its `aff` and,
    /// with a `residual` (same shape and dtype, planar), the addition `residual + y`: returns
    /// `(y, aff, nrm)`. A backend may do them in fewer passes; the bytes must be those of the
    /// separate calls. `y` is stored as `self` is (`channels_last`).
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_train_apply(
        &self,
        shape: &[usize],
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        batches: Option<&mut Self>,
        eps: f64,
        momentum: f64,
        silu: bool,
        residual: Option<&Self>,
        channels_last: bool,
    ) -> Result<(Self, Self, Self)> {
        let (aff, nrm) =
            self.batch_norm_train_stats(shape, weight, bias, running_mean, running_var, batches, eps, momentum, channels_last)?;
        let y = self.channel_affine(shape, &aff, silu, channels_last)?;
        let y = match residual {
            Some(r) => {
                let l = crate::shape::Layout::contiguous(shape);
                r.binary(&l, &y, &l, BinaryOp::Add)?
            }
            None => y,
        };
        Ok((y, aff, nrm))
    }
    /// `y = act(x·p[c] + p[C + c])` over an NCHW tensor (stored N, H, W, C when `channels_last`,
    /// and `y` the same way) with `p` = `[scale; C] ++ [shift; C]` (statistics dtype); `act` is
    /// SiLU when `silu`, else identity. Output in the input dtype.
    fn channel_affine(&self, shape: &[usize], params: &Self, silu: bool, channels_last: bool) -> Result<Self>;
    /// Backward of `y = act(x·aff[c] + aff[C + c])` for batch-norm (`self` = x, NCHW), with
    /// `nrm` = `[invstd; C] ++ [−mean·invstd; C]` and the weight `w` (statistics dtype): with
    /// `gz = g·act'(z)` and `x̂ = x·nrm[c] + nrm[C + c]`, returns `(dx, Σ gz·x̂, Σ gz)` — the input
    /// gradient in the input dtype and the weight and bias gradients per channel (statistics
    /// dtype). `training` adds the batch-statistics terms: `dx = w·invstd·(gz − (Σgz + x̂·Σgz·x̂)/N)`,
    /// else `dx = w·invstd·gz`. Sums accumulate in f64 in a fixed order. `x`, `g` and `dx` are
    /// stored N, H, W, C when `channels_last`. With `g2` the output gradient is `g + g2` (two
    /// contributions to it, of `g`'s dtype and storage order) as the elementwise addition stores
    /// it: a backend may add them inside its kernels instead of a launch of its own.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_act_backward(
        &self,
        g: &Self,
        g2: Option<&Self>,
        shape: &[usize],
        aff: &Self,
        nrm: &Self,
        w: &Self,
        silu: bool,
        training: bool,
        channels_last: bool,
    ) -> Result<(Self, Self, Self)>;
    /// Eval-mode batch-norm parameters from `self` = weight and the running statistics (all of one
    /// float dtype, length C): the same `(aff, nrm)` pair as [`Self::batch_norm_train_stats`].
    fn batch_norm_eval_params(&self, bias: &Self, running_mean: &Self, running_var: &Self, eps: f64) -> Result<(Self, Self)>;
    /// Softmax (or log-softmax when `log`) of a contiguous float tensor along `dim`, stabilised by
    /// the maximum; sums accumulate in f64 (CPU) / a fixed-order f32-or-wider tree (CUDA).
    fn softmax(&self, shape: &[usize], dim: usize, log: bool) -> Result<Self>;
}

/// The dtype batch-norm statistics are kept in for inputs of `dt`.
pub fn stats_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Where a keep mask's Philox counters start.
pub enum PhiloxStart<'a, S> {
    /// The host's `(seed, offset)`, baked into the launch.
    Value {
        /// The seed.
        seed: u64,
        /// The Philox offset of the first block.
        offset: u64,
    },
    /// A generator state buffer (`[seed, base offset]`, two i64) plus `intra` blocks: what a
    /// recorded graph reads again at each replay.
    State {
        /// The generator state buffer.
        state: &'a S,
        /// Blocks into the graph's own offset.
        intra: u64,
    },
}

/// Counter-based random draws on a backend's own memory (the graph-safe generator of
/// `graph_rng`): every backend gives the same bytes for the same counters, the CPU's being the
/// reference.
pub trait RandomStorage: BackendStorage {
    /// A u8 mask of `n` elements on `device`: element i is word i % 4 of the Philox-4x32 block for
    /// counter `offset + i / 4` under key `seed`, 1 when `(word >> 8)·2⁻²⁴ < keep`.
    fn keep_mask(device: Device, n: usize, keep: f32, start: PhiloxStart<'_, Self>) -> Result<Self>;
    /// Writes `(seed, offset)` into this generator state buffer (two i64).
    fn set_rng_state(&mut self, seed: u64, offset: u64) -> Result<()>;
}

/// One matrix of a padded batch: its shape as stored (`rows × cols`, row-major) and whether its
/// slot holds the transpose (then it fills `cols × rows` of the slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PackedMatrix {
    /// Rows of the packed matrix.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Stored transposed.
    pub transposed: bool,
}

impl PackedMatrix {
    /// The corner of the slot it fills.
    pub fn extent(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// Matrices of different shapes packed into one zero-padded batch and back (MuSGD's
/// Newton–Schulz runs many shapes through one batched GEMM): kernels a backend may offer for some
/// dtypes (`None`: the caller composes the same result from primitives). The CPU's are the
/// reference: the bytes of the composed ops.
pub trait PackStorage: BackendStorage {
    /// A `[items.len(), rows, cols]` batch of `dtype` whose slot i holds f32 matrix i in its
    /// top-left corner (transposed when flagged), cast as `to_dtype` casts, and zeros elsewhere.
    fn pack_padded(items: &[(&Self, PackedMatrix)], rows: usize, cols: usize, dtype: DType) -> Result<Option<Self>>;
    /// Slot i of this `[n, rows, cols]` batch as an f32 matrix of its own: the corner (transposed
    /// back), times its scale as `mul_scalar` rounds (a scale of 1 multiplies nothing).
    fn unpack_padded(&self, items: &[(PackedMatrix, f64)], rows: usize, cols: usize) -> Result<Option<Vec<Self>>>;
}

/// A copy of a few f32 values on its way to the host ([`DeferredReadStorage::read_later`]).
pub trait HostRead: std::fmt::Debug + Send {
    /// Whether the copy has finished (a non-blocking query).
    fn poll(&mut self) -> Result<bool>;
    /// Waits for the copy.
    fn wait(&mut self) -> Result<()>;
    /// The values (once finished).
    fn values(&self) -> Vec<f32>;
}

/// Reads without a synchronisation: a backend queues the copy of an f32 storage to the host and
/// returns at once (the CPU's is ready at once).
pub trait DeferredReadStorage: BackendStorage {
    /// Queues the copy of this f32 storage's values.
    fn read_later(&self) -> Result<Box<dyn HostRead>>;
}

/// One operand of a multi-tensor row: read, or read and written in place.
pub enum Operand<'a, S> {
    /// Read only.
    Read(&'a S),
    /// Written in place.
    Write(&'a mut S),
}

impl<S> Operand<'_, S> {
    /// The operand, for reading.
    pub fn get(&self) -> &S {
        match self {
            Operand::Read(s) => s,
            Operand::Write(s) => s,
        }
    }
}

/// Scalars of a `*_dev` optimizer update in the backend's own memory: `values[at..]` of an f64
/// storage, and an optional f32 flag that, when non-zero, makes the update leave everything as it
/// is (the grad scaler's found-inf: a skipped step decided without a host read).
pub struct ScalarsAt<'a, S> {
    /// The device buffer of scalars.
    pub values: &'a S,
    /// Index of the first scalar this op reads.
    pub at: usize,
    /// A device flag: when set, the update leaves everything unchanged (a skipped loss-scaled step).
    pub skip: Option<&'a S>,
}

/// What a multi-tensor launch does to each row ([`MultiTensorStorage`]). Every operand is a whole
/// f32 storage of one length per row, except the f64 step counts and the found-inf flag.
pub enum MultiTensorOp<'a, S> {
    /// Rows `[param (w), grad, momentum buffer (w) when with_buf]`: `Tensor::sgd_step_composed`.
    Sgd {
        /// Decay, momentum, learning rate and Nesterov.
        h: crate::ops::optim::SgdStep,
        /// Whether rows carry a momentum buffer.
        with_buf: bool,
    },
    /// The same with `[weight_decay, momentum, neg_lr]` read from `scalars` (the decay applied
    /// when `weight_decay`).
    SgdDev {
        /// Where the step's scalars are read.
        scalars: ScalarsAt<'a, S>,
        /// Whether the decay applies.
        weight_decay: bool,
        /// Nesterov's form.
        nesterov: bool,
        /// Whether rows carry a momentum buffer.
        with_buf: bool,
    },
    /// Rows `[momentum (w), grad, blend (w)]`: `Tensor::momentum_blend_composed` into the blend.
    Blend {
        /// Momentum β.
        beta: f64,
        /// Nesterov's form.
        nesterov: bool,
    },
    /// The same with β read from `scalars`; when skipped the momentum stays and the blend is
    /// still written.
    BlendDev {
        /// Where the step's scalars are read.
        scalars: ScalarsAt<'a, S>,
        /// Nesterov's form.
        nesterov: bool,
    },
    /// Rows `[dst (w), src]`: `dst ← lerp(dst, src, w)`.
    Lerp {
        /// Interpolation weight.
        w: f64,
    },
    /// The same with `w` read from `scalars`.
    LerpDev {
        /// Where the step's scalars are read.
        scalars: ScalarsAt<'a, S>,
    },
    /// Rows `[param (w), grad, exp_avg (w), exp_avg_sq (w), step count (w, f64)]`:
    /// `ops::optim::adamw_composed` with the `ADAMW_SCALARS` read from `scalars` at the count plus
    /// one, which is then stored.
    AdamWDev {
        /// Where the step's scalars are read.
        scalars: ScalarsAt<'a, S>,
        /// Whether the decay applies.
        weight_decay: bool,
    },
    /// Rows `[grad (w)]`, the last row `[found (w)]` alone: every gradient times the f32
    /// `inv_scale`, `found` set to 1 when one held a non-finite value before, else 0.
    Unscale {
        /// The f32 1/scale.
        inv_scale: &'a S,
    },
    /// Rows `[grad (w)]`: global L2-norm clipping to `max_norm`; the output is the total norm (an
    /// f32 value).
    ClipNorm {
        /// The norm the gradients are scaled down to.
        max_norm: f32,
    },
}

/// Optimizer updates over many tensors at once (PyTorch's fused / `_foreach` kernels): a backend
/// may offer them (`None`: no kernel for this op here, and the caller composes the same result
/// from primitives). Where a backend offers one it gives the bytes of the composed ops
/// (`ops::optim`), which are the reference — except `ClipNorm`, whose total norm is summed in
/// another order (deterministic, its last bits differ from the composed reduction's).
pub trait MultiTensorStorage: BackendStorage {
    /// Applies `op` to every row (operands in the order the op names), returning its outputs.
    fn multi_tensor(op: MultiTensorOp<'_, Self>, rows: Vec<Vec<Operand<'_, Self>>>) -> Result<Option<Vec<Self>>>;
}

//! Autocast: a thread-local "compute dtype" for the matrix-heavy ops (conv2d, matmul, linear),
//! like `torch.autocast`. Inside `autocast(BF16, …)` those ops cast f32 operands to bf16 (the
//! cast is differentiable, so gradients reach the f32 master weights in f32); element-wise ops
//! promote mixed float operands to the wider type, so normalisation and losses run in f32.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

use crate::{DType, MemoryFormat, Result, Tensor};

thread_local! {
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
    /// Weight copies made up front by [`autocast_with_weights`]: dtype, the copy of each f32
    /// tensor by handle identity, and the recording state they were made in.
    static WEIGHT_COPIES: RefCell<Option<WeightCopies>> = const { RefCell::new(None) };
}

/// [`autocast_with_weights`]' copies: their dtype, each f32 tensor's copy by handle identity, and
/// [`recording_state`] when they were made.
type WeightCopies = (DType, HashMap<usize, Tensor>, (bool, bool));

/// (capturing a CUDA graph, measuring a region's warm-up) on this thread: a weight copy is handed
/// out only in the state it was made in — copies made before a recording began are not part of
/// it (their bytes would be stale on replay), copies made inside the recording are.
fn recording_state() -> (bool, bool) {
    #[cfg(feature = "cuda")]
    {
        (crate::cuda::capture_support::is_capturing(), crate::cuda::capture_support::is_measuring())
    }
    #[cfg(not(feature = "cuda"))]
    {
        (false, false)
    }
}

/// The active autocast dtype on this thread, if any.
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(|a| a.get())
}

/// Runs `f` with `dtype` (F16 or BF16; `None` disables) as the compute dtype of conv/matmul.
pub fn autocast<R>(dtype: Option<DType>, f: impl FnOnce() -> R) -> R {
    let _restore = AutocastGuard::new(dtype);
    f()
}

/// Sets the autocast dtype of this thread until dropped (then the previous one comes back).
pub struct AutocastGuard(Option<DType>);

impl AutocastGuard {
    /// Turns autocast to `dtype` (`None`: off) until the guard drops.
    pub fn new(dtype: Option<DType>) -> AutocastGuard {
        AutocastGuard(AUTOCAST.with(|a| a.replace(dtype)))
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.0));
    }
}

/// [`autocast`] with the f32 tensors of `weights` cast to `dtype` once, before `f`, in one batched
/// cast ([`Tensor::to_dtype_many`]: one launch per 40 tensors and one autograd node, whose backward
/// casts their gradients back in one go too); inside `f` the autocast ops take these copies
/// instead of casting the weight at their first use. The same bytes as [`autocast`] — a copy is the
/// cast the op would make. Later uses of a weight, and tensors not listed, are still cast at use.
/// Copies are handed out only in the recording state they were made in: a region recorded inside
/// `f` makes its own casts, while a region whose body calls this makes the batched cast inside
/// its graph (one kernel instead of one per weight, and one for their gradients).
pub fn autocast_with_weights<R>(dtype: Option<DType>, weights: &[Tensor], f: impl FnOnce() -> R) -> Result<R> {
    let Some(dt) = dtype.filter(|d| *d != DType::F32) else { return Ok(autocast(dtype, f)) };
    let f32s: Vec<Tensor> = weights.iter().filter(|w| w.dtype() == DType::F32).cloned().collect();
    let formats: Vec<MemoryFormat> = f32s.iter().map(copy_format).collect();
    let copies = Tensor::to_dtype_many_in(&f32s, dt, &formats)?;
    let map: HashMap<usize, Tensor> = f32s.iter().zip(copies).map(|(w, c)| (Arc::as_ptr(&w.0) as usize, c)).collect();
    let previous = WEIGHT_COPIES.with(|w| w.replace(Some((dt, map, recording_state()))));
    struct Restore(Option<WeightCopies>);
    impl Drop for Restore {
        fn drop(&mut self) {
            WEIGHT_COPIES.with(|w| *w.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(previous);
    Ok(autocast(Some(dt), f))
}

/// The memory format of `w`'s up-front copy: O, H, W, I (channels-last) for a convolution weight
/// with a spatial kernel and several input channels on a backend that computes channels-last
/// convolutions — the order cuDNN's fast engines read, so no filter conversion runs inside cuDNN
/// in the forward or the data gradient, and the weight gradient comes back in it (cast back to
/// OIHW by the batched cast's backward) when [`krsc_copies`] says so; otherwise every copy keeps
/// `w`'s format.
fn copy_format(w: &Tensor) -> MemoryFormat {
    let d = w.dims();
    let spatial_weight = d.len() == 4 && d[1] > 1 && d[2] * d[3] > 1;
    if spatial_weight && krsc_copies() && w.with_storage(|s| s.computes_channels_last_convolutions()) {
        MemoryFormat::ChannelsLast
    } else {
        w.memory_format()
    }
}

/// Whether autocast's up-front copies of convolution weights are made channels-last when
/// `PTL_WEIGHT_KRSC` is not set.
const KRSC_COPIES_BY_DEFAULT: bool = true;

/// Whether autocast's up-front copies of convolution weights with a spatial kernel are made
/// K, R, S, C (channels-last) on a backend that computes channels-last convolutions:
/// `PTL_WEIGHT_KRSC=1` on, `0` off, else the default; read once per process.
pub fn krsc_copies() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var("PTL_WEIGHT_KRSC").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => KRSC_COPIES_BY_DEFAULT,
    })
}

/// The up-front copy of `t` in `dt`, if [`autocast_with_weights`] made one and it may be used now.
fn weight_copy(t: &Tensor, dt: DType) -> Option<Tensor> {
    // Taken on first use: a second use casts again, so that each use's gradient is cast back to
    // f32 on its own and summed there, as with a cast per use (summing them in the half type
    // first would round).
    WEIGHT_COPIES.with(|w| match &mut *w.borrow_mut() {
        Some((d, map, made_in)) if *d == dt && *made_in == recording_state() => map.remove(&(Arc::as_ptr(&t.0) as usize)),
        _ => None,
    })
}

/// `t.to_dtype(dtype)`, taking the up-front copy of [`autocast_with_weights`] when there is one —
/// for modules that cast a parameter to their input's dtype themselves. Either way the cast is
/// in the format the up-front copy has (K, R, S, C for a convolution weight under
/// `PTL_WEIGHT_KRSC=1` on CUDA, else the weight's own), so a convolution reads the weight in
/// the same order (and picks the same engine, the same bytes) whether the copy was made up front,
/// inside a recorded region or at a second use.
pub fn cast_weight(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == DType::F32 {
        if let Some(c) = weight_copy(t, dtype) {
            return Ok(c);
        }
    }
    cast_in_copy_format(t, dtype)
}

/// `t` cast to `dtype` in its up-front copy's format: a channels-last copy through the batched
/// cast (one launch, which transposes on the way), anything else through [`Tensor::to_dtype`].
fn cast_in_copy_format(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let format = copy_format(t);
    if t.dtype() == dtype || format == t.memory_format() || !dtype.is_float() || !t.dtype().is_float() {
        return t.to_dtype(dtype);
    }
    Ok(Tensor::to_dtype_many_in(std::slice::from_ref(t), dtype, &[format])?.remove(0))
}

/// A convolution's weight operand under autocast: [`cast_for_compute`], with the cast at use in
/// the up-front copy's format (see [`cast_weight`]).
pub(crate) fn cast_conv_weight_for_compute(w: &Tensor) -> Result<Tensor> {
    match autocast_dtype() {
        Some(dt) if w.dtype() == DType::F32 && dt != DType::F32 => match weight_copy(w, dt) {
            Some(c) => Ok(c),
            None => cast_in_copy_format(w, dt),
        },
        _ => Ok(w.clone()),
    }
}

/// Casts an f32 operand to the autocast dtype when autocast is active.
pub(crate) fn cast_for_compute(t: &Tensor) -> Result<Tensor> {
    match autocast_dtype() {
        Some(dt) if t.dtype() == DType::F32 && dt != DType::F32 => match weight_copy(t, dt) {
            Some(c) => Ok(c),
            None => t.to_dtype(dt),
        },
        _ => Ok(t.clone()),
    }
}

fn rank(d: DType) -> u8 {
    match d {
        DType::BF16 | DType::F16 => 1,
        DType::F32 => 2,
        DType::F64 => 3,
        _ => 0,
    }
}

/// Promotes two float operands of different dtypes to the wider one (bf16/f16 → f32 → f64).
/// Non-float or equal dtypes are returned unchanged (the op then reports any mismatch).
pub(crate) fn promote(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let (da, db) = (a.dtype(), b.dtype());
    if da == db || !da.is_float() || !db.is_float() {
        return Ok((a.clone(), b.clone()));
    }
    let target = if rank(da) > rank(db) || (rank(da) == rank(db) && da == DType::F32) { da } else { db };
    let target = if rank(da) == rank(db) { DType::F32 } else { target };
    Ok((a.to_dtype(target)?, b.to_dtype(target)?))
}

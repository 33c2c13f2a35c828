//! Autocast: a thread-local "compute dtype" for the matrix-heavy ops (conv2d, matmul, linear),
//! like `torch.autocast`. Inside `autocast(BF16, …)` those ops cast f32 operands to bf16 (the
//! cast is differentiable, so gradients reach the f32 master weights in f32); element-wise ops
//! promote mixed float operands to the wider type, so normalisation and losses run in f32.

use std::cell::Cell;

use crate::{DType, Result, Tensor};

thread_local! {
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
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
    pub fn new(dtype: Option<DType>) -> AutocastGuard {
        AutocastGuard(AUTOCAST.with(|a| a.replace(dtype)))
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.0));
    }
}

/// Casts an f32 operand to the autocast dtype when autocast is active.
pub(crate) fn cast_for_compute(t: &Tensor) -> Result<Tensor> {
    match autocast_dtype() {
        Some(dt) if t.dtype() == DType::F32 && dt != DType::F32 => t.to_dtype(dt),
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

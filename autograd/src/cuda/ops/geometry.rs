//! What every launcher shares: the strided geometry a kernel walks (up to 8 dimensions, 32-bit
//! sizes checked) and a storage's device address.

use super::super::storage::CudaStorage;
use crate::shape::Layout;
use crate::{Error, Result};

pub(super) const MAXD: usize = 8;

/// Kernel geometry for up to three strided operands over one logical shape (see prelude.cuh).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct Strided {
    pub(super) rank: u32,
    pub(super) shape: [u32; MAXD],
    pub(super) st: [[u32; MAXD]; 3],
    pub(super) off: [u32; 3],
}

pub(super) fn u32c(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(op, format!("size {v} exceeds the CUDA backend's 32-bit indexing")))
}

/// Builds a coalesced geometry: size-1 dims dropped, adjacent dims merged where every operand is
/// contiguous across them.
pub(crate) fn strided(op: &'static str, shape: &[usize], ops: &[(&[usize], usize)]) -> Result<Strided> {
    let mut dims: Vec<(usize, [usize; 3])> = Vec::with_capacity(shape.len());
    for (d, &s) in shape.iter().enumerate() {
        if s == 1 {
            continue;
        }
        let mut st = [0usize; 3];
        for (k, (strides, _)) in ops.iter().enumerate() {
            st[k] = strides[d];
        }
        if let Some(last) = dims.last_mut() {
            if (0..ops.len()).all(|k| last.1[k] == st[k] * s) {
                last.0 *= s;
                last.1 = st;
                continue;
            }
        }
        dims.push((s, st));
    }
    if dims.len() > MAXD {
        return Err(Error::invalid(op, format!("rank {} after coalescing exceeds {MAXD} on CUDA", dims.len())));
    }
    let mut g = Strided { rank: dims.len() as u32, ..Default::default() };
    for (d, (s, st)) in dims.iter().enumerate() {
        g.shape[d] = u32c(op, *s)?;
        for (k, &v) in st.iter().enumerate().take(ops.len()) {
            g.st[k][d] = u32c(op, v)?;
        }
    }
    for (k, (_, off)) in ops.iter().enumerate() {
        g.off[k] = u32c(op, *off)?;
    }
    Ok(g)
}

macro_rules! args {
    ($($a:ident),* $(,)?) => {
        [$( &$a as *const _ as *mut c_void ),*]
    };
}

pub(super) fn ptr(s: &CudaStorage) -> u64 {
    s.buf.ptr
}

pub(super) fn plain(l: &Layout) -> bool {
    l.offset == 0 && l.is_contiguous()
}

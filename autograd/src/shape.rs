//! Shapes, contiguous strides, dimension normalisation and broadcasting rules.

use crate::{Error, Result};

/// A tensor shape (row-major, contiguous storage is always assumed for tensors).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl Shape {
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Row-major strides of a contiguous tensor of this shape.
    pub fn contiguous_strides(&self) -> Vec<usize> {
        contiguous_strides(&self.0)
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape(d.to_vec())
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(d)
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape(d.to_vec())
    }
}
impl From<&Vec<usize>> for Shape {
    fn from(d: &Vec<usize>) -> Self {
        Shape(d.clone())
    }
}
impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(vec![])
    }
}
impl From<usize> for Shape {
    fn from(d: usize) -> Self {
        Shape(vec![d])
    }
}

/// Row-major strides for `dims`.
pub fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// Resolves a possibly negative dimension index against `rank`.
pub fn normalize_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r {
        return Err(Error::DimOutOfRange { op, dim, rank });
    }
    Ok(d as usize)
}

/// NumPy broadcasting of two shapes.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = if da == db {
            da
        } else if da == 1 {
            db
        } else if db == 1 {
            da
        } else {
            return Err(Error::BroadcastIncompatible { op, lhs: a.to_vec(), rhs: b.to_vec() });
        };
    }
    Ok(out)
}

/// Strides that read a contiguous tensor of shape `src` as if it had shape `dst` (broadcast
/// dimensions get stride 0). `src` must be broadcast-compatible with `dst`.
pub fn broadcast_strides(src: &[usize], dst: &[usize]) -> Vec<usize> {
    let cs = contiguous_strides(src);
    let off = dst.len() - src.len();
    (0..dst.len()).map(|i| if i < off || src[i - off] == 1 && dst[i] != 1 { 0 } else { cs[i - off] }).collect()
}

/// A strided view description used by copy kernels: `element(idx) = data[offset + Σ idx_i·strides_i]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The logical shape.
    pub shape: Vec<usize>,
    /// Elements between neighbours along each dimension.
    pub strides: Vec<usize>,
    /// Index of the first element.
    pub offset: usize,
}

impl Layout {
    /// Row-major strides for `shape`.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 }
    }
    /// Elements addressed.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Whether the strides are row-major.
    pub fn is_contiguous(&self) -> bool {
        self.strides == contiguous_strides(&self.shape)
    }
    /// Storage offsets of every element in row-major order.
    pub fn offsets(&self) -> StridedOffsets<'_> {
        StridedOffsets::new(self)
    }
}

/// Iterator over storage offsets of a [`Layout`] in row-major element order.
pub struct StridedOffsets<'a> {
    layout: &'a Layout,
    index: Vec<usize>,
    next: Option<usize>,
}

impl<'a> StridedOffsets<'a> {
    fn new(layout: &'a Layout) -> Self {
        let next = if layout.numel() == 0 { None } else { Some(layout.offset) };
        StridedOffsets { layout, index: vec![0; layout.shape.len()], next }
    }
}

impl Iterator for StridedOffsets<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        let cur = self.next?;
        let mut off = cur;
        let mut d = self.index.len();
        loop {
            if d == 0 {
                self.next = None;
                break;
            }
            d -= 1;
            self.index[d] += 1;
            off += self.layout.strides[d];
            if self.index[d] < self.layout.shape[d] {
                self.next = Some(off);
                break;
            }
            off -= self.layout.strides[d] * self.index[d];
            self.index[d] = 0;
        }
        Some(cur)
    }
}

macro_rules! shape_from_tuple {
    ($($n:ident),+) => {
        impl From<($(shape_from_tuple!(@ty $n),)+)> for Shape {
            #[allow(non_snake_case)]
            fn from(($($n,)+): ($(shape_from_tuple!(@ty $n),)+)) -> Self {
                Shape(vec![$($n),+])
            }
        }
    };
    (@ty $n:ident) => { usize };
}
shape_from_tuple!(A);
shape_from_tuple!(A, B);
shape_from_tuple!(A, B, C);
shape_from_tuple!(A, B, C, D);
shape_from_tuple!(A, B, C, D, E);
shape_from_tuple!(A, B, C, D, E, F);

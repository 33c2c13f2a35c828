//! Quintic Newton–Schulz orthogonalisation (docs/training.md §3.5), written with tensor ops so it runs on
//! the parameter's device. In [`NsPrecision::Bf16`] values are rounded to bfloat16 exactly where the
//! reference rounds: the input, the norm, the normalised X, the Gram matrix A = X·Xᵀ, and the two
//! fused `baddbmm` results B = b·A + c·A·A and X = a·X + B·X (products accumulated in f32, one
//! rounding each). This reproduces the goldens' `ns_out_bf16` bit for bit on most matrices; the
//! rest differ only through f32 summation order.

use ptl_autograd::{DType, PackedMatrix, Tensor, Unpacked};

use super::groups::NsPrecision;
use crate::error::{Result, TrainerError};

/// (a, b, c) of the quintic iteration.
pub const NS_COEFFS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);
/// Number of iterations.
pub const NS_STEPS: usize = 5;
/// Added to the Frobenius norm before normalising.
pub const NS_EPS: f64 = 1e-7;

fn work_dtype(p: NsPrecision) -> DType {
    match p {
        NsPrecision::Bf16 => DType::BF16,
        NsPrecision::F32 => DType::F32,
        NsPrecision::F64 => DType::F64,
    }
}

/// Orthogonalises a 2-D matrix; the result has `g`'s dtype and shape.
pub fn newton_schulz5(g: &Tensor, precision: NsPrecision) -> Result<Tensor> {
    newton_schulz5_many(std::slice::from_ref(g), precision)?
        .pop()
        .ok_or_else(|| TrainerError::InvalidArgument { what: "newton_schulz5", reason: "no result for the matrix".into() })
}

/// [`newton_schulz5`] of many 2-D matrices (any shapes, one dtype and device) at once, batched as
/// [`Padding::for_device`] plans it. Results in the input order.
pub fn newton_schulz5_many(gs: &[Tensor], precision: NsPrecision) -> Result<Vec<Tensor>> {
    let Some(first) = gs.first() else { return Ok(Vec::new()) };
    let jobs: Vec<NsJob> = gs.iter().map(|g| NsJob { matrix: g.clone(), dims: g.dims().to_vec(), scale: 1.0 }).collect();
    orthogonalize(&jobs, precision, Padding::for_device(first.device()))
}

/// One matrix to orthogonalise, the shape its result is given back and the factor it is scaled by.
struct NsJob {
    matrix: Tensor,
    dims: Vec<usize>,
    scale: f64,
}

/// How matrices of different shapes share batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Padding {
    /// One batch per exact (wide-oriented) shape: no padding, no wasted arithmetic (the CPU,
    /// where a batch costs no launch).
    ExactShapes,
    /// Zero-padded batches of a few size classes, chosen by [`plan_batches`]'s cost model: on a
    /// GPU every batch costs ≈ 25 launches per step, far more than the padding's arithmetic.
    SizeClasses,
}

impl Padding {
    /// The padding rule for `device`.
    pub fn for_device(device: ptl_autograd::Device) -> Padding {
        match device {
            ptl_autograd::Device::Cpu => Padding::ExactShapes,
            _ => Padding::SizeClasses,
        }
    }
}

/// One padded batch: its slot shape (wide: rows ≤ cols) and the matrices in it (input indices).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NsBatch {
    /// Rows of every matrix in the batch.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Indices of the matrices.
    pub members: Vec<usize>,
}

/// Estimated fixed cost of one padded batch on the GPU (its ≈ 25 launches), in seconds, and the
/// bf16 tensor-core rate its padded GEMMs run at (FLOP/s): the two terms [`plan_batches`] trades.
const BATCH_COST_S: f64 = 80e-6;
const GEMM_FLOPS: f64 = 100e12;

/// Groups matrices (stored shapes `(rows, cols)`) into batches. Each is taken wide
/// (min × max of its dims). With [`Padding::SizeClasses`] the short side rounds up to a power of
/// two (at least 16), the long side to a multiple of 8 (tensor-core alignment), the matrices are
/// ordered by (short class, long side) and cut into consecutive runs minimising
/// Σ `BATCH_COST_S` + FLOP / `GEMM_FLOPS` (five iterations of 4·r²·c + 2·r³ each) — a shortest
/// path over cut points, deterministic in the shapes.
pub fn plan_batches(shapes: &[(usize, usize)], padding: Padding) -> Vec<NsBatch> {
    let wide = |&(r, c): &(usize, usize)| (r.min(c), r.max(c));
    if padding == Padding::ExactShapes {
        let mut out: Vec<NsBatch> = Vec::new();
        for (i, s) in shapes.iter().enumerate() {
            let (r, c) = wide(s);
            match out.iter_mut().find(|b| (b.rows, b.cols) == (r, c)) {
                Some(b) => b.members.push(i),
                None => out.push(NsBatch { rows: r, cols: c, members: vec![i] }),
            }
        }
        return out;
    }
    let class = |i: usize| {
        let (r, c) = wide(&shapes[i]);
        (r.next_power_of_two().max(16), c.div_ceil(8) * 8)
    };
    let mut order: Vec<usize> = (0..shapes.len()).collect();
    order.sort_by_key(|&i| (class(i), i));
    let n = order.len();
    let flops = |r: usize, c: usize| 5.0 * (4.0 * (r * r * c) as f64 + 2.0 * (r * r * r) as f64);
    // best[j]: the cheapest cover of order[..j]; cut[j]: where its last batch starts.
    let mut best = vec![0.0f64; n + 1];
    let mut cut = vec![0usize; n + 1];
    for j in 1..=n {
        best[j] = f64::INFINITY;
        let (mut r, mut c) = (0, 0);
        for i in (0..j).rev() {
            let (ri, ci) = class(order[i]);
            (r, c) = (r.max(ri), c.max(ci));
            let cost = best[i] + BATCH_COST_S + (j - i) as f64 * flops(r, c) / GEMM_FLOPS;
            if cost < best[j] {
                (best[j], cut[j]) = (cost, i);
            }
        }
    }
    let mut out = Vec::new();
    let mut j = n;
    while j > 0 {
        let i = cut[j];
        let members: Vec<usize> = order[i..j].to_vec();
        let (rows, cols) = members.iter().fold((0, 0), |(r, c), &m| (r.max(class(m).0), c.max(class(m).1)));
        out.push(NsBatch { rows, cols, members });
        j = i;
    }
    out.reverse();
    out
}

/// Orthogonalises every job's matrix through padded batches: per batch, pack (wide, cast to the
/// working dtype), normalise each slot by its own Frobenius norm, iterate, unpack (cast back,
/// scaled, in the job's dims). Zero padding changes no product, so a slot's result is its
/// matrix's; only the summation order of a larger GEMM may differ.
fn orthogonalize(jobs: &[NsJob], precision: NsPrecision, padding: Padding) -> Result<Vec<Tensor>> {
    let dtype = jobs[0].matrix.dtype();
    let mut shapes = Vec::with_capacity(jobs.len());
    for j in jobs {
        if j.matrix.rank() != 2 || j.matrix.dtype() != dtype {
            return Err(TrainerError::InvalidArgument {
                what: "newton_schulz5",
                reason: format!("expected 2-D matrices of one dtype ({dtype}), got {:?} {}", j.matrix.dims(), j.matrix.dtype()),
            });
        }
        shapes.push((j.matrix.dims()[0], j.matrix.dims()[1]));
    }
    let wd = work_dtype(precision);
    let mut out: Vec<Option<Tensor>> = vec![None; jobs.len()];
    ptl_autograd::no_grad(|| -> Result<()> {
        for batch in plan_batches(&shapes, padding) {
            let mats: Vec<(&Tensor, PackedMatrix)> = batch
                .members
                .iter()
                .map(|&i| (&jobs[i].matrix, PackedMatrix { rows: shapes[i].0, cols: shapes[i].1, transposed: shapes[i].0 > shapes[i].1 }))
                .collect();
            let x = Tensor::pack_padded(&mats, batch.rows, batch.cols, wd)?;
            let x = iterate(normalized(x)?)?;
            let items: Vec<Unpacked> = batch
                .members
                .iter()
                .zip(&mats)
                .map(|(&i, (_, m))| Unpacked { matrix: *m, dims: jobs[i].dims.clone(), scale: jobs[i].scale })
                .collect();
            for (&i, o) in batch.members.iter().zip(x.unpack_padded(&items, dtype)?) {
                out[i] = Some(o);
            }
        }
        Ok(())
    })?;
    out.into_iter()
        .map(|o| o.ok_or_else(|| TrainerError::InvalidArgument { what: "newton_schulz5", reason: "a matrix got no result".into() }))
        .collect()
}

/// Each slot of a packed batch (working dtype) divided by its Frobenius norm + eps: the norm
/// accumulated in (at least) f32 and rounded to the working dtype, as the reference divides.
fn normalized(x: Tensor) -> Result<Tensor> {
    let wd = x.dtype();
    let d = x.dims().to_vec();
    let norm = x.reshape(vec![d[0], d[1] * d[2]])?.to_dtype(acc_dtype(wd))?.square()?.sum_dim(1, true)?.sqrt()?.to_dtype(wd)?;
    let denom = norm.reshape(vec![d[0], 1, 1])?.add_scalar(NS_EPS)?;
    Ok(if wd == DType::BF16 {
        // PyTorch divides a reduced-precision tensor by a scalar as x · (1/s) in f32.
        x.to_dtype(DType::F32)?.mul(&denom.to_dtype(DType::F32)?.recip()?)?.to_dtype(wd)?
    } else {
        x.div(&denom)?
    })
}

fn acc_dtype(wd: DType) -> DType {
    if wd == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The quintic iteration on a batch of wide matrices in the working dtype: A = X·Xᵀ,
/// B = b·A + c·A·A and X = a·X + B·X, each one GEMM accumulating in f32 (f64 for f64) with one
/// rounding to the working dtype — the reference's fused `baddbmm` form.
fn iterate(mut x: Tensor) -> Result<Tensor> {
    let (a, b, c) = NS_COEFFS;
    for _ in 0..NS_STEPS {
        let gram = x.matmul_t(&x, false, true)?;
        let bm = gram.baddbmm(&gram, &gram, b, c)?;
        x = x.baddbmm(&bm, &x, a, 1.0)?;
    }
    Ok(x)
}

/// Runs the Newton–Schulz of one optimizer group's blends for a step: `body(matrices)` natively,
/// or a replay of it (a plugin's recorded graph). It must return what `body` returns.
pub trait NsRunner {
    /// Runs `body` on `matrices`: natively, or by replaying its recording.
    fn run_ns(&self, matrices: &[Tensor], body: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>>;
}

/// Runs Newton–Schulz where the optimizer calls it (no plugin).
pub struct NativeNs;

impl NsRunner for NativeNs {
    fn run_ns(&self, matrices: &[Tensor], body: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>> {
        body(matrices)
    }
}

/// [`orthogonalized_update`] of many blends (one optimizer group's), batched across shapes as
/// [`plan_batches`] plans for their device; the scale and the reshape back are part of the
/// unpacking. One call of `runner` for all of them (the step's Newton–Schulz site). Results in
/// the input order.
pub fn orthogonalized_updates(us: &[Tensor], precision: NsPrecision, runner: &dyn NsRunner) -> Result<Vec<Tensor>> {
    let Some(first) = us.first() else { return Ok(Vec::new()) };
    let mats = us.iter().map(as_matrix).collect::<Result<Vec<Tensor>>>()?;
    let padding = Padding::for_device(first.device());
    let body = |ms: &[Tensor]| -> Result<Vec<Tensor>> {
        if ms.len() != us.len() {
            return Err(TrainerError::InvalidArgument {
                what: "Newton–Schulz body",
                reason: format!("got {} matrices for {} blends", ms.len(), us.len()),
            });
        }
        let jobs: Vec<NsJob> =
            ms.iter().zip(us).map(|(m, u)| NsJob { matrix: m.clone(), dims: u.dims().to_vec(), scale: muon_scale(u.dims()) }).collect();
        orthogonalize(&jobs, precision, padding)
    };
    let orthogonal = runner.run_ns(&mats, &body)?;
    if orthogonal.len() != us.len() {
        return Err(TrainerError::InvalidArgument {
            what: "Newton–Schulz runner",
            reason: format!("returned {} matrices for {}", orthogonal.len(), us.len()),
        });
    }
    Ok(orthogonal)
}

/// A 2-D or 4-D blend as the matrix Newton–Schulz works on: (out, rest).
fn as_matrix(u: &Tensor) -> Result<Tensor> {
    let dims = u.dims().to_vec();
    match dims.len() {
        2 => Ok(u.clone()),
        4 => Ok(u.reshape(vec![dims[0], dims[1] * dims[2] * dims[3]])?),
        _ => {
            Err(TrainerError::InvalidArgument { what: "muon update", reason: format!("expected a 2-D or 4-D tensor, got shape {dims:?}") })
        }
    }
}

/// `√max(1, n₋₂ / n₋₁)` of the gradient's last two dimensions.
pub fn muon_scale(dims: &[usize]) -> f64 {
    if dims.len() < 2 {
        return 1.0;
    }
    let (r, c) = (dims[dims.len() - 2] as f64, dims[dims.len() - 1] as f64);
    (r / c).max(1.0).sqrt()
}

/// The Muon direction of a Nesterov blend `u` (2-D or 4-D): reshape 4-D to (out, rest),
/// orthogonalise, scale by [`muon_scale`] of the original shape, reshape back.
pub fn orthogonalized_update(u: &Tensor, precision: NsPrecision) -> Result<Tensor> {
    let job = NsJob { matrix: as_matrix(u)?, dims: u.dims().to_vec(), scale: muon_scale(u.dims()) };
    orthogonalize(std::slice::from_ref(&job), precision, Padding::for_device(u.device()))?
        .pop()
        .ok_or_else(|| TrainerError::InvalidArgument { what: "muon update", reason: "no result for the blend".into() })
}

#[cfg(test)]
mod batched_tests {
    use super::*;
    use ptl_autograd::{Device, Rng};

    /// The batched form gives each matrix the bytes of the one-matrix form on the CPU, wide and tall
    /// matrices, every precision; `orthogonalized_updates` keeps the input order across shapes.
    #[test]
    fn batched_newton_schulz_matches_one_by_one() {
        let mut rng = Rng::new(17);
        for precision in [NsPrecision::Bf16, NsPrecision::F32, NsPrecision::F64] {
            for dims in [[6usize, 10], [12, 5]] {
                let gs: Vec<Tensor> =
                    (0..3).map(|_| Tensor::rand(dims.to_vec(), -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap()).collect();
                let many = newton_schulz5_many(&gs, precision).unwrap();
                for (g, m) in gs.iter().zip(&many) {
                    let one = newton_schulz5(g, precision).unwrap();
                    assert_eq!(m.dims(), one.dims());
                    assert_eq!(m.to_bytes().unwrap(), one.to_bytes().unwrap(), "{precision:?} {dims:?}");
                }
            }
        }
        let us: Vec<Tensor> = [vec![4, 2, 3, 3], vec![5, 7], vec![4, 2, 3, 3], vec![8, 3, 1, 1]]
            .into_iter()
            .map(|d| Tensor::rand(d, -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap())
            .collect();
        let batched = orthogonalized_updates(&us, NsPrecision::Bf16, &NativeNs).unwrap();
        for (u, b) in us.iter().zip(&batched) {
            assert_eq!(b.to_bytes().unwrap(), orthogonalized_update(u, NsPrecision::Bf16).unwrap().to_bytes().unwrap(), "{:?}", u.dims());
        }
        let half = us[1].to_dtype(DType::BF16).unwrap();
        assert!(newton_schulz5_many(&[us[1].clone(), half], NsPrecision::F32).is_err(), "mixed dtypes");
    }

    /// Zero padding changes no product: orthogonalising through the GPU's padded size classes on
    /// the CPU gives every matrix its exact-shape batch's result (wide, tall, tiny and square
    /// matrices, scaled and reshaped back) up to summation order — the CPU GEMM sums a one-row
    /// product in another order than a 16-row one — in every precision.
    #[test]
    fn padded_size_classes_give_the_exact_shapes_bytes() {
        let mut rng = Rng::new(29);
        let dims = [vec![4, 2, 3, 3], vec![5, 7], vec![4, 2, 3, 3], vec![8, 3, 1, 1], vec![1, 16], vec![20, 20], vec![3, 40]];
        let us: Vec<Tensor> = dims.iter().map(|d| Tensor::rand(d.clone(), -1.0, 1.0, DType::F32, Device::Cpu, &mut rng).unwrap()).collect();
        let jobs: Vec<NsJob> =
            us.iter().map(|u| NsJob { matrix: as_matrix(u).unwrap(), dims: u.dims().to_vec(), scale: muon_scale(u.dims()) }).collect();
        let shapes: Vec<(usize, usize)> = jobs.iter().map(|j| (j.matrix.dims()[0], j.matrix.dims()[1])).collect();
        assert!(
            plan_batches(&shapes, Padding::SizeClasses).len() < plan_batches(&shapes, Padding::ExactShapes).len(),
            "padding merges shapes"
        );
        for precision in [NsPrecision::Bf16, NsPrecision::F32, NsPrecision::F64] {
            let exact = orthogonalize(&jobs, precision, Padding::ExactShapes).unwrap();
            let padded = orthogonalize(&jobs, precision, Padding::SizeClasses).unwrap();
            let tol = match precision {
                NsPrecision::F64 => 1e-12,
                NsPrecision::F32 => 1e-5,
                NsPrecision::Bf16 => 2e-2,
            };
            for ((e, p), d) in exact.iter().zip(&padded).zip(&dims) {
                assert_eq!(p.dims(), d.as_slice());
                let (e, p) = (e.to_vec::<f32>().unwrap(), p.to_vec::<f32>().unwrap());
                let worst = e.iter().zip(&p).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
                assert!(worst <= tol, "{precision:?} {d:?}: differs by {worst}");
            }
        }
    }

    /// Every matrix lands in exactly one batch whose slot holds it wide; exact shapes never pad;
    /// size classes round the short side to a power of two ≥ 16 and the long side to 8, and put
    /// many small shapes into one batch.
    #[test]
    fn batch_plans_cover_every_matrix_once() {
        let shapes: Vec<(usize, usize)> =
            (0..60).map(|i| [(16, 144), (144, 16), (32, 288), (64, 576), (1, 64), (85, 765), (256, 1152), (9, 64)][i % 8]).collect();
        for padding in [Padding::ExactShapes, Padding::SizeClasses] {
            let plan = plan_batches(&shapes, padding);
            let mut seen: Vec<usize> = plan.iter().flat_map(|b| b.members.clone()).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..shapes.len()).collect::<Vec<_>>(), "{padding:?}");
            for b in &plan {
                assert!(b.rows <= b.cols);
                for &i in &b.members {
                    let (r, c) = (shapes[i].0.min(shapes[i].1), shapes[i].0.max(shapes[i].1));
                    assert!(r <= b.rows && c <= b.cols, "{padding:?} {:?} in {}×{}", shapes[i], b.rows, b.cols);
                    if padding == Padding::ExactShapes {
                        assert_eq!((r, c), (b.rows, b.cols));
                    }
                }
                if padding == Padding::SizeClasses {
                    assert!(b.rows.is_power_of_two() && b.rows >= 16 && b.cols % 8 == 0, "{}×{}", b.rows, b.cols);
                }
            }
            let n = plan.len();
            match padding {
                Padding::ExactShapes => assert_eq!(n, 7, "16×144 and 144×16 share a wide shape"),
                Padding::SizeClasses => assert!(n <= 4, "{n} batches"),
            }
        }
    }
}

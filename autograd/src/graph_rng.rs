//! A graph-safe Philox generator (docs/capture.md §9) and the random ops that draw from it.
//!
//! Eager random ops receive `(seed, offset)` by value and advance the host offset by their
//! increment, rounded up to a multiple of 4. While a region is being recorded, ops instead read
//! `[seed, base offset]` from a small device state and add an intra-graph offset, so the graph
//! behaves like one big random op: before each replay the recorder writes the current host
//! `(seed, offset)` into the device state (outside the graph) and advances the host offset by the
//! whole-graph increment. Replays therefore draw fresh numbers — exactly the ones the same number
//! of eager steps would have drawn.

use std::sync::Mutex;

use crate::backend::PhiloxStart;
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// What the generator is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Eager,
    /// Recording: draws are relative to the device state's base offset.
    Capturing {
        intra: u64,
    },
    /// A replay of a graph consuming `whole` blocks from `base`; when the body itself runs (the CPU
    /// test double replays natively), its draws continue from `base`.
    Replaying {
        base: u64,
        intra: u64,
        whole: u64,
    },
}

struct Inner {
    seed: u64,
    offset: u64,
    mode: Mode,
}

/// One random op's view of the stream.
pub(crate) enum Draw {
    /// Eager: the numbers at `(seed, offset)`.
    Value { seed: u64, offset: u64 },
    /// Recording on CUDA: read `[seed, base]` from `state`, add `intra`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device { state: Tensor, intra: u64 },
}

/// A Philox stream owned by one device whose draws survive CUDA-graph recording (see the module
/// docs). Register it with every recorded region whose body draws from it.
pub struct GraphSafeRng {
    device: Device,
    inner: Mutex<Inner>,
    /// CUDA: `[seed, base offset]` as two u64 (allocated up front, never inside a capture).
    state: Option<Tensor>,
}

impl std::fmt::Debug for GraphSafeRng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self.lock();
        write!(f, "GraphSafeRng({}, seed {}, offset {}, {:?})", self.device, i.seed, i.offset, i.mode)
    }
}

/// Increment of an op that consumes `blocks` Philox blocks: rounded up to a multiple of 4.
fn increment(blocks: u64) -> u64 {
    blocks.div_ceil(4) * 4
}

impl GraphSafeRng {
    /// A generator on `device` starting at offset 0.
    pub fn new(seed: u64, device: Device) -> Result<GraphSafeRng> {
        let state = if device.is_cuda() { Some(Tensor::zeros([2], DType::I64, device)?) } else { None };
        Ok(GraphSafeRng { device, inner: Mutex::new(Inner { seed, offset: 0, mode: Mode::Eager }), state })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The device of its seed and offset scalars.
    pub fn device(&self) -> Device {
        self.device
    }
    /// The seed.
    pub fn seed(&self) -> u64 {
        self.lock().seed
    }
    /// Host offset: Philox blocks consumed so far (always a multiple of 4).
    pub fn offset(&self) -> u64 {
        self.lock().offset
    }

    /// Sets seed and offset (a checkpoint restore). Not allowed while a recording uses the generator.
    pub fn set_state(&self, seed: u64, offset: u64) -> Result<()> {
        let mut i = self.lock();
        if i.mode != Mode::Eager {
            return Err(Error::invalid("GraphSafeRng::set_state", "the generator is being recorded or replayed"));
        }
        i.seed = seed;
        i.offset = offset;
        Ok(())
    }

    /// Reserves `blocks` Philox blocks for one op.
    pub(crate) fn draw(&self, op: &'static str, blocks: u64) -> Result<Draw> {
        #[cfg(not(feature = "cuda"))]
        let _ = op;
        let inc = increment(blocks);
        let mut i = self.lock();
        let seed = i.seed;
        match &mut i.mode {
            Mode::Eager => {
                #[cfg(feature = "cuda")]
                if self.device.is_cuda() && crate::cuda::capture_support::is_capturing() {
                    return Err(Error::invalid(
                        op,
                        "a graph-safe RNG drew inside a CUDA capture without being registered with the recording \
                         (register it with the region, e.g. RegionSpec::with_graph_rng)",
                    ));
                }
                let offset = i.offset;
                i.offset += inc;
                Ok(Draw::Value { seed, offset })
            }
            Mode::Capturing { intra } => {
                let at = *intra;
                *intra += inc;
                match &self.state {
                    Some(state) => Ok(Draw::Device { state: state.clone(), intra: at }),
                    None => {
                        let offset = i.offset + at;
                        Ok(Draw::Value { seed, offset })
                    }
                }
            }
            Mode::Replaying { base, intra, .. } => {
                let offset = *base + *intra;
                *intra += inc;
                Ok(Draw::Value { seed, offset })
            }
        }
    }

    /// Recording starts: draws become relative to the device state.
    pub fn begin_capture(&self) -> Result<()> {
        let mut i = self.lock();
        if i.mode != Mode::Eager {
            return Err(Error::invalid("GraphSafeRng::begin_capture", format!("the generator is already in {:?}", i.mode)));
        }
        i.mode = Mode::Capturing { intra: 0 };
        Ok(())
    }

    /// Recording ends: returns the whole-graph increment (a multiple of 4).
    pub fn end_capture(&self) -> u64 {
        let mut i = self.lock();
        let whole = match i.mode {
            Mode::Capturing { intra } => intra,
            _ => 0,
        };
        i.mode = Mode::Eager;
        whole
    }

    /// Before a replay of a graph that consumes `whole` blocks: writes the host `(seed, offset)`
    /// into the device state (queued on the stream, outside any graph). [`GraphSafeRng::end_replay`]
    /// then advances the host offset.
    pub fn begin_replay(&self, whole: u64) -> Result<()> {
        if self.lock().mode != Mode::Eager {
            return Err(Error::invalid("GraphSafeRng::begin_replay", "the generator is already being recorded or replayed"));
        }
        let mut i = self.lock();
        if let Some(state) = &self.state {
            state.write_storage().set_rng_state(i.seed, i.offset)?;
        }
        let base = i.offset;
        i.mode = Mode::Replaying { base, intra: 0, whole };
        Ok(())
    }

    /// After the replay launch: the host offset moves past the graph's draws (the whole-graph
    /// increment, or what a natively run body drew, whichever is larger).
    pub fn end_replay(&self) {
        let mut i = self.lock();
        if let Mode::Replaying { base, intra, whole } = i.mode {
            i.offset = base + whole.max(intra);
        }
        i.mode = Mode::Eager;
    }

    /// Whether a recording of this generator is in progress.
    pub fn is_capturing(&self) -> bool {
        matches!(self.lock().mode, Mode::Capturing { .. })
    }

    /// `(seed, offset)` for rollback around warmup and capture.
    pub fn snapshot(&self) -> (u64, u64) {
        let i = self.lock();
        (i.seed, i.offset)
    }
    /// Restores a [`GraphSafeRng::snapshot`] (mode back to eager).
    pub fn restore(&self, snap: (u64, u64)) {
        let mut i = self.lock();
        i.seed = snap.0;
        i.offset = snap.1;
        i.mode = Mode::Eager;
    }
}

impl Tensor {
    /// A u8 mask of `shape` whose elements are 1 with probability `keep`, drawn from `rng` on its
    /// device (identical bytes on CPU and CUDA for the same generator state).
    pub fn keep_mask(shape: impl Into<Shape>, keep: f64, rng: &GraphSafeRng) -> Result<Tensor> {
        let shape = shape.into();
        if !(0.0..=1.0).contains(&keep) {
            return Err(Error::invalid("keep_mask", format!("keep probability {keep} is outside [0, 1]")));
        }
        let n = shape.numel();
        let draw = rng.draw("keep_mask", n.div_ceil(4) as u64)?;
        let mask = match draw {
            Draw::Value { seed, offset } => Storage::keep_mask(rng.device(), n, keep as f32, PhiloxStart::Value { seed, offset })?,
            Draw::Device { state, intra } => {
                let state = state.raw_storage();
                Storage::keep_mask(rng.device(), n, keep as f32, PhiloxStart::State { state: &state, intra })?
            }
        };
        Tensor::from_storage(mask, shape)
    }

    /// Inverted dropout (training mode): zeroes each element with probability `p` and scales the
    /// rest by `1/(1−p)`. The mask is a constant of the graph, so the gradient is `dy·mask/(1−p)`.
    pub fn dropout(&self, p: f64, rng: &GraphSafeRng) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid("dropout", format!("p = {p} must be in [0, 1)")));
        }
        if rng.device() != self.device() {
            return Err(Error::invalid("dropout", format!("the generator lives on {}, the tensor on {}", rng.device(), self.device())));
        }
        if p == 0.0 {
            return Ok(self.clone());
        }
        let mask = Tensor::keep_mask(self.shape().clone(), 1.0 - p, rng)?.to_dtype(self.dtype())?;
        self.mul(&mask)?.affine(1.0 / (1.0 - p), 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn increments_are_multiples_of_four() {
        assert_eq!(increment(1), 4);
        assert_eq!(increment(4), 4);
        assert_eq!(increment(5), 8);
        let r = GraphSafeRng::new(7, Device::Cpu).unwrap();
        Tensor::keep_mask([10], 0.5, &r).unwrap(); // 3 blocks -> 4
        assert_eq!(r.offset(), 4);
        Tensor::keep_mask([100], 0.5, &r).unwrap(); // 25 blocks -> 28
        assert_eq!(r.offset(), 32);
    }

    #[test]
    fn masks_follow_the_stream_and_the_keep_rate() {
        let r = GraphSafeRng::new(11, Device::Cpu).unwrap();
        let a = Tensor::keep_mask([4096], 0.7, &r).unwrap().to_vec::<u8>().unwrap();
        let b = Tensor::keep_mask([4096], 0.7, &r).unwrap().to_vec::<u8>().unwrap();
        assert_ne!(a, b, "consecutive draws differ");
        let kept = a.iter().filter(|&&v| v == 1).count() as f64 / 4096.0;
        assert!((kept - 0.7).abs() < 0.03, "keep rate {kept}");
        // same state, same mask
        let r2 = GraphSafeRng::new(11, Device::Cpu).unwrap();
        assert_eq!(Tensor::keep_mask([4096], 0.7, &r2).unwrap().to_vec::<u8>().unwrap(), a);
        r2.set_state(11, 0).unwrap();
        assert_eq!(Tensor::keep_mask([4096], 0.7, &r2).unwrap().to_vec::<u8>().unwrap(), a);
    }

    #[test]
    fn capture_and_replay_modes_reproduce_the_eager_stream() {
        // eager reference: three ops of different sizes, twice
        let eager = GraphSafeRng::new(5, Device::Cpu).unwrap();
        let mut want = Vec::new();
        for _ in 0..2 {
            for n in [3usize, 17, 64] {
                want.push(Tensor::keep_mask([n], 0.5, &eager).unwrap().to_vec::<u8>().unwrap());
            }
        }
        // recorded: capture measures the whole increment without moving the host offset…
        let g = GraphSafeRng::new(5, Device::Cpu).unwrap();
        g.begin_capture().unwrap();
        for n in [3usize, 17, 64] {
            Tensor::keep_mask([n], 0.5, &g).unwrap();
        }
        let whole = g.end_capture();
        assert_eq!(whole, 4 + 8 + 16);
        assert_eq!(g.offset(), 0);
        assert!(g.set_state(5, 0).is_ok());
        // …and each replay draws the next slice of the stream
        let mut got = Vec::new();
        for _ in 0..2 {
            g.begin_replay(whole).unwrap();
            assert!(g.set_state(5, 0).is_err(), "no state changes during a replay");
            for n in [3usize, 17, 64] {
                got.push(Tensor::keep_mask([n], 0.5, &g).unwrap().to_vec::<u8>().unwrap());
            }
            g.end_replay();
        }
        assert_eq!(got, want);
        assert_eq!(g.offset(), eager.offset());
    }

    #[test]
    fn dropout_scales_kept_values_and_its_gradient_is_the_scaled_mask() {
        let r = GraphSafeRng::new(3, Device::Cpu).unwrap();
        let x = Tensor::from_vec((0..64).map(|i| i as f32 + 1.0).collect::<Vec<_>>(), [8, 8], Device::Cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let y = x.dropout(0.25, &r).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        let (xv, yv) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
        let g = x.grad().unwrap().to_vec::<f32>().unwrap();
        let scale = 1.0f32 / 0.75;
        let mut dropped = 0;
        for i in 0..64 {
            if yv[i] == 0.0 {
                dropped += 1;
                assert_eq!(g[i], 0.0);
            } else {
                assert_eq!(yv[i], xv[i] * scale);
                assert_eq!(g[i], scale);
            }
        }
        assert!(dropped > 0 && dropped < 64);
        assert!(x.dropout(1.0, &r).is_err());
        assert_eq!(x.dropout(0.0, &r).unwrap().to_vec::<f32>().unwrap(), xv);
    }
}

//! Philox4x32-10: a counter-based generator (the one cuRAND and PyTorch's CUDA RNG use), so the
//! same (seed, offset) gives the same numbers on any device and any thread split.

use crate::{DType, Device, Result, Tensor};

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// One Philox4x32-10 block for `counter` under `key`.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [((p1 >> 32) as u32) ^ c[1] ^ k[0], p1 as u32, ((p0 >> 32) as u32) ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// A seeded stream: `seed` is the key, `offset` counts consumed 4-word blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    seed: u64,
    offset: u64,
    buf: [u32; 4],
    used: usize,
}

impl Rng {
    /// A generator for `seed`, at offset 0.
    pub fn new(seed: u64) -> Self {
        Rng { seed, offset: 0, buf: [0; 4], used: 4 }
    }
    /// A stream for a sub-task (e.g. one sample of an epoch): independent of call order.
    pub fn derive(seed: u64, stream: &[u64]) -> Self {
        let mut h = seed ^ 0x9E37_79B9_7F4A_7C15;
        for &s in stream {
            let b = philox4x32([s as u32, (s >> 32) as u32, h as u32, (h >> 32) as u32], [0xA5A5_A5A5, 0x5A5A_5A5A]);
            h = ((b[0] as u64) << 32 | b[1] as u64) ^ h.rotate_left(17);
        }
        Rng::new(h)
    }
    /// Its seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
    /// (seed, blocks consumed, words used in the current block): enough to restore the stream.
    pub fn state(&self) -> (u64, u64, usize) {
        (self.seed, self.offset, self.used)
    }
    /// A generator at a state `state()` returned.
    pub fn from_state(seed: u64, offset: u64, used: usize) -> Self {
        let mut r = Rng { seed, offset: offset.saturating_sub(1), buf: [0; 4], used: 4 };
        if offset > 0 {
            r.refill();
            r.used = used.min(4);
        } else {
            r.offset = 0;
        }
        r
    }
    fn refill(&mut self) {
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        self.buf = philox4x32([self.offset as u32, (self.offset >> 32) as u32, 0, 0], key);
        self.offset += 1;
        self.used = 0;
    }
    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        if self.used == 4 {
            self.refill();
        }
        let v = self.buf[self.used];
        self.used += 1;
        v
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        (self.next_u32() as u64) << 32 | self.next_u32() as u64
    }
    /// Uniform in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// A uniform draw in [lo, hi).
    pub fn uniform_range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// Integer in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

impl Tensor {
    /// Uniform values in `[lo, hi)`.
    pub fn rand(shape: impl Into<crate::Shape>, lo: f64, hi: f64, dtype: DType, device: Device, rng: &mut Rng) -> Result<Tensor> {
        let shape = shape.into();
        let v: Vec<f64> = (0..shape.numel()).map(|_| rng.uniform_range(lo, hi)).collect();
        Tensor::from_f64(&v, shape, dtype, device)
    }
    /// Normal values with the given mean and standard deviation.
    pub fn randn(shape: impl Into<crate::Shape>, mean: f64, std: f64, dtype: DType, device: Device, rng: &mut Rng) -> Result<Tensor> {
        let shape = shape.into();
        let v: Vec<f64> = (0..shape.numel()).map(|_| mean + std * rng.normal()).collect();
        Tensor::from_f64(&v, shape, dtype, device)
    }
}

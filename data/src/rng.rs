//! Deterministic random numbers.
//!
//! Every training sample gets its own generator derived from `(seed, epoch, index)` so that the bytes of a batch do
//! not depend on the number of worker threads or on the order in which workers pick jobs. The draws inside one
//! sample follow the order of docs/data.md §6.0 (the reference uses Python's `random`/NumPy streams; the *order and
//! distribution* of draws is reproduced, the bit streams are not).

/// SplitMix64 step: used to expand seeds.
#[inline]
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Mixes several words into one 64-bit seed.
pub fn mix_seed(words: &[u64]) -> u64 {
    let mut s = 0x5851_F42D_4C95_7F2D_u64;
    let mut out = 0u64;
    for &w in words {
        s ^= w.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        out = splitmix64(&mut s) ^ out.rotate_left(17);
    }
    out
}

/// xoshiro256** generator.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

/// Stream tags keep unrelated uses of the same (seed, epoch, index) apart.
pub mod stream {
    /// A training sample's augmentation draws.
    pub const SAMPLE: u64 = 1;
    /// An epoch's shuffle.
    pub const SHUFFLE: u64 = 2;
    /// The synthetic dataset generator.
    pub const SYNTH: u64 = 3;
    /// Validation samples' draws.
    pub const VAL: u64 = 4;
}

impl Rng {
    /// Generator seeded from one 64-bit value.
    pub fn new(seed: u64) -> Self {
        let mut st = seed;
        let mut s = [0u64; 4];
        for w in &mut s {
            *w = splitmix64(&mut st);
        }
        if s == [0; 4] {
            s[0] = 1;
        }
        Rng { s }
    }

    /// Generator for `(seed, epoch, index)` within a stream.
    pub fn for_sample(stream: u64, seed: u64, epoch: u64, index: u64) -> Self {
        Rng::new(mix_seed(&[stream, seed, epoch, index]))
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits (Python `random.random()`).
    #[inline]
    pub fn random(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// U(a, b) = a + (b − a)·random() (Python `random.uniform`).
    #[inline]
    pub fn uniform(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * self.random()
    }

    /// Integer uniform in [lo, hi] inclusive (Python `random.randint`). Requires lo ≤ hi.
    pub fn randint(&mut self, lo: i64, hi: i64) -> i64 {
        let span = (hi - lo) as u64 + 1;
        lo + self.below(span) as i64
    }

    /// Unbiased integer in [0, n); n = 0 gives 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let v = self.next_u64();
            if v < zone {
                return v % n;
            }
        }
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.random();
        let u2 = self.random();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let mut a = Rng::for_sample(stream::SAMPLE, 1, 2, 3);
        let mut b = Rng::for_sample(stream::SAMPLE, 1, 2, 3);
        let mut c = Rng::for_sample(stream::SAMPLE, 1, 2, 4);
        let va: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let vb: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        let vc: Vec<u64> = (0..8).map(|_| c.next_u64()).collect();
        assert_eq!(va, vb);
        assert_ne!(va, vc);
        for _ in 0..1000 {
            let r = a.random();
            assert!((0.0..1.0).contains(&r));
            let k = a.randint(3, 5);
            assert!((3..=5).contains(&k));
        }
    }
}

//! Where each buffer of a recorded graph lives inside its arena.
//!
//! A recorder runs a region natively first (its warm-up) and records the allocations and frees the
//! region made, in order: an [`AllocTrace`]. Every buffer then has a lifetime — from its
//! allocation to its free, or to the end of the region for what outlives it (outputs, activations
//! the backward will read) — and two buffers whose lifetimes do not meet may share bytes, as they
//! would in a caching allocator. [`plan`] gives each buffer an offset so that buffers live at the
//! same time never overlap, and the arena needs about the peak of live bytes instead of the sum of
//! every allocation.
//!
//! The placement is greedy by size (the largest buffer first, each at the lowest offset free over
//! its whole lifetime), the method TensorFlow Lite's and several other inference runtimes' arena
//! planners use; it is not always optimal, and its result is checked against the lower bound, the
//! peak of live bytes ([`AllocTrace::peak_live`]).

/// One event of a region's allocation trace, in the order the host issued them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceEvent {
    /// A new buffer of this many bytes (already rounded to the arena's alignment); buffers are
    /// numbered by their allocation order.
    Alloc(usize),
    /// Buffer number `id` was freed.
    Free(usize),
}

/// The allocations and frees of one run of a region.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocTrace {
    events: Vec<TraceEvent>,
    /// Allocations among `events` (the next buffer's number), kept as they are appended.
    allocs: usize,
}

/// A buffer's bytes and the half-open range of event positions it is live in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Lifetime {
    bytes: usize,
    start: usize,
    end: usize,
}

impl AllocTrace {
    /// Appends an allocation; returns the buffer's number.
    pub fn alloc(&mut self, bytes: usize) -> usize {
        let id = self.allocs;
        self.events.push(TraceEvent::Alloc(bytes));
        self.allocs += 1;
        id
    }

    /// The allocations and frees, in order.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// Appends the free of buffer `id`.
    pub fn free(&mut self, id: usize) {
        self.events.push(TraceEvent::Free(id));
    }

    /// Buffers allocated.
    pub fn buffers(&self) -> usize {
        self.allocs
    }

    /// The sum of every allocation (what a bump arena needs).
    pub fn total_bytes(&self) -> usize {
        self.events.iter().map(|e| if let TraceEvent::Alloc(b) = e { *b } else { 0 }).sum()
    }

    /// The most bytes live at once: no placement can use less.
    pub fn peak_live(&self) -> usize {
        let sizes = self.sizes();
        let (mut live, mut peak) = (0usize, 0usize);
        let mut alive = vec![false; sizes.len()];
        let mut next = 0;
        for e in &self.events {
            match *e {
                TraceEvent::Alloc(b) => {
                    alive[next] = true;
                    next += 1;
                    live += b;
                    peak = peak.max(live);
                }
                TraceEvent::Free(id) => {
                    if alive.get(id).copied().unwrap_or(false) {
                        alive[id] = false;
                        live -= sizes[id];
                    }
                }
            }
        }
        peak
    }

    fn sizes(&self) -> Vec<usize> {
        self.events.iter().filter_map(|e| if let TraceEvent::Alloc(b) = e { Some(*b) } else { None }).collect()
    }

    /// Each buffer's lifetime; a buffer never freed lives to the end. A free of a buffer that does
    /// not exist (yet) or was freed before is ignored.
    fn lifetimes(&self) -> Vec<Lifetime> {
        let mut out: Vec<Lifetime> = Vec::new();
        for (pos, e) in self.events.iter().enumerate() {
            match *e {
                TraceEvent::Alloc(bytes) => out.push(Lifetime { bytes, start: pos, end: usize::MAX }),
                TraceEvent::Free(id) => {
                    if let Some(l) = out.get_mut(id).filter(|l| l.end == usize::MAX) {
                        l.end = pos;
                    }
                }
            }
        }
        out
    }
}

/// Offsets of a trace's buffers inside one arena.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaPlan {
    /// Offset of buffer `i` (in allocation order).
    pub offsets: Vec<usize>,
    /// Bytes of buffer `i`.
    pub sizes: Vec<usize>,
    /// Bytes the arena needs for the planned buffers (the largest offset + size).
    pub bytes: usize,
}

/// Places every buffer of `trace` (see the module documentation). Offsets are multiples of
/// `align` when the sizes are.
pub fn plan(trace: &AllocTrace) -> ArenaPlan {
    let lives = trace.lifetimes();
    let mut order: Vec<usize> = (0..lives.len()).collect();
    // Largest first; among equals the earlier, so the plan is a function of the trace alone.
    order.sort_by(|&a, &b| lives[b].bytes.cmp(&lives[a].bytes).then(a.cmp(&b)));
    let mut offsets = vec![0usize; lives.len()];
    // Buffers placed so far, by offset.
    let mut placed: Vec<usize> = Vec::with_capacity(lives.len());
    let mut bytes = 0usize;
    for &i in &order {
        let me = lives[i];
        let mut candidate = 0usize;
        // Placed buffers whose lifetimes meet this one's, by offset: take the first gap that fits.
        for &j in placed.iter().filter(|&&j| overlaps_in_time(&lives[j], &me)) {
            if offsets[j] >= candidate + me.bytes {
                break;
            }
            candidate = candidate.max(offsets[j] + lives[j].bytes);
        }
        offsets[i] = candidate;
        bytes = bytes.max(candidate + me.bytes);
        let at = placed.partition_point(|&j| (offsets[j], j) < (candidate, i));
        placed.insert(at, i);
    }
    ArenaPlan { offsets, sizes: lives.iter().map(|l| l.bytes).collect(), bytes }
}

/// How far ahead of its position in the plan an allocation looks for a planned buffer of its size.
pub const PLAN_LOOKAHEAD: usize = 32;

/// Hands out the offsets of an arena of `capacity` bytes during one capture: the k-th request
/// takes the planned offset of the next planned buffer of its size (looking at most
/// [`PLAN_LOOKAHEAD`] entries ahead, so that one allocation more or less than the warm-up made
/// does not throw the rest off) if no live piece is there now; otherwise — or without a plan — it
/// goes to the tail after the planned part. The live check is what makes reuse safe: a piece is
/// live until it is released (its buffer dropped on the host, so every kernel that reads it was
/// issued before), whatever the plan assumed.
#[derive(Clone, Debug, Default)]
pub struct Placer {
    plan: ArenaPlan,
    capacity: usize,
    next: usize,
    bump: usize,
    live: std::collections::BTreeMap<usize, usize>,
    /// Requests that took their planned offset, and those that went to the tail.
    pub planned_hits: usize,
    /// Allocations that went to the unplanned tail.
    pub tail_allocs: usize,
    /// The most bytes in use at once so far (the planned part counts once one of its pieces is).
    pub high: usize,
}

impl Placer {
    /// A placer for one capture into an arena of `capacity` bytes laid out by `plan`.
    pub fn new(plan: ArenaPlan, capacity: usize) -> Placer {
        Placer { bump: plan.bytes.min(capacity), plan, capacity, ..Placer::default() }
    }

    /// The offset for `bytes` (already aligned), or `None` when the tail is full.
    pub fn place(&mut self, bytes: usize) -> Option<usize> {
        let end = (self.next + PLAN_LOOKAHEAD).min(self.plan.sizes.len());
        let planned = (self.next..end).find(|&k| self.plan.sizes[k] == bytes && self.is_free(self.plan.offsets[k], bytes));
        if let Some(k) = planned {
            let off = self.plan.offsets[k];
            self.next = k + 1;
            self.live.insert(off, bytes);
            self.planned_hits += 1;
            self.high = self.high.max(self.bump.min(self.plan.bytes));
            return Some(off);
        }
        let off = self.bump;
        if off + bytes > self.capacity {
            return None;
        }
        self.bump = off + bytes;
        self.live.insert(off, bytes);
        self.tail_allocs += 1;
        self.high = self.high.max(off + bytes);
        Some(off)
    }

    /// The piece at `offset` was dropped.
    pub fn release(&mut self, offset: usize) {
        self.live.remove(&offset);
    }

    /// Bytes free in the tail.
    pub fn tail_free(&self) -> usize {
        self.capacity.saturating_sub(self.bump)
    }

    /// Whether `[off, off + bytes)` meets no live piece.
    fn is_free(&self, off: usize, bytes: usize) -> bool {
        // The live piece starting at or before `off + bytes` with the largest start, and every one
        // after `off`: pieces never overlap each other, so checking the neighbours suffices.
        let before = self.live.range(..=off).next_back().is_some_and(|(&o, &l)| o + l > off);
        let inside = self.live.range(off..off + bytes).next().is_some();
        !before && !inside
    }
}

fn overlaps_in_time(a: &Lifetime, b: &Lifetime) -> bool {
    a.start < b.end && b.start < a.end
}

impl ArenaPlan {
    /// Whether two buffers live at the same time ever share a byte (false for a valid plan).
    pub fn has_overlap(&self, trace: &AllocTrace) -> bool {
        let lives = trace.lifetimes();
        (0..lives.len()).any(|i| {
            (i + 1..lives.len()).any(|j| {
                overlaps_in_time(&lives[i], &lives[j])
                    && self.offsets[i] < self.offsets[j] + self.sizes[j]
                    && self.offsets[j] < self.offsets[i] + self.sizes[i]
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A region-like trace: layers that allocate an output, keep every other one (saved for a
    /// backward), and free temporaries, from a fixed pseudo-random sequence.
    fn layered(seed: u64, layers: usize) -> AllocTrace {
        let mut s = seed;
        let mut next = move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as usize
        };
        let mut t = AllocTrace::default();
        let mut prev: Option<usize> = None;
        for l in 0..layers {
            let out = t.alloc((1 + next() % 64) * 256);
            let tmp = t.alloc((1 + next() % 128) * 256);
            t.free(tmp);
            if let Some(p) = prev.filter(|_| l % 2 == 1) {
                t.free(p);
            }
            prev = Some(out);
        }
        t
    }

    #[test]
    fn disjoint_lifetimes_share_bytes_and_live_ones_do_not() {
        let mut t = AllocTrace::default();
        let a = t.alloc(1024);
        t.free(a);
        let b = t.alloc(512);
        let c = t.alloc(256);
        t.free(b);
        let p = plan(&t);
        assert_eq!(p.offsets[a], 0);
        assert_eq!(p.offsets[b], 0, "b reuses a's bytes");
        assert_eq!(p.offsets[c], 512, "c is live with b");
        assert_eq!(p.bytes, 1024);
        assert_eq!((t.peak_live(), t.total_bytes()), (1024, 1792));
        assert!(!p.has_overlap(&t));
    }

    #[test]
    fn buffers_that_outlive_the_region_keep_their_bytes() {
        let mut t = AllocTrace::default();
        let saved = t.alloc(256);
        let tmp = t.alloc(1024);
        t.free(tmp);
        let out = t.alloc(768);
        let p = plan(&t);
        assert!(!p.has_overlap(&t));
        assert!(p.offsets[out] + 768 <= p.offsets[saved] || p.offsets[saved] + 256 <= p.offsets[out]);
        assert_eq!(p.bytes, 1280);
    }

    /// On traces shaped like a forward pass the plan stays within 10 % of the peak of live bytes
    /// (the lower bound) and far below the bump arena's sum; it never overlaps live buffers, and
    /// it is a function of the trace.
    #[test]
    fn plans_are_overlap_free_and_near_the_live_peak() {
        for seed in 0..40 {
            let t = layered(seed, 60);
            let p = plan(&t);
            assert!(!p.has_overlap(&t), "seed {seed}");
            let (peak, total) = (t.peak_live(), t.total_bytes());
            assert!(p.bytes >= peak);
            assert!(p.bytes as f64 <= 1.10 * peak as f64, "seed {seed}: plan {} vs live peak {peak}", p.bytes);
            assert!(p.bytes * 2 < total, "seed {seed}: plan {} vs sum {total}", p.bytes);
            assert_eq!(plan(&t), p);
        }
    }

    /// A capture that repeats its warm-up takes every planned offset; one allocation more or less
    /// costs one piece of tail, not the rest of the plan; a planned place still live goes to the
    /// tail; a full tail says so.
    #[test]
    fn the_placer_follows_the_plan_and_never_overlaps_live_pieces() {
        let mut t = AllocTrace::default();
        let a = t.alloc(512);
        t.free(a);
        let b = t.alloc(512);
        let c = t.alloc(256);
        assert_eq!(c, 2);
        t.free(b);
        let p = plan(&t);
        assert_eq!((p.offsets[a], p.offsets[b], p.bytes), (0, 0, 768));
        // The same sequence: a, free a, b (a's bytes), c.
        let mut s = Placer::new(p.clone(), 768 + 1024);
        assert_eq!(s.place(512), Some(0));
        s.release(0);
        assert_eq!(s.place(512), Some(0));
        assert_eq!(s.place(256), Some(512));
        assert_eq!((s.planned_hits, s.tail_allocs), (3, 0));
        // a is not dropped before b: b's planned bytes are live, so b goes to the tail.
        let mut s = Placer::new(p.clone(), 768 + 1024);
        assert_eq!(s.place(512), Some(0));
        assert_eq!(s.place(512), Some(768));
        assert_eq!(s.place(256), Some(512));
        assert_eq!((s.planned_hits, s.tail_allocs), (2, 1));
        // An extra 1 KiB request first: the tail; the rest still follows the plan.
        let mut s = Placer::new(p.clone(), 768 + 1024);
        assert_eq!(s.place(1024), Some(768));
        assert_eq!(s.place(512), Some(0));
        assert_eq!(s.tail_free(), 0);
        s.release(0);
        assert_eq!(s.place(512), Some(0));
        assert_eq!(s.place(256), Some(512));
        assert_eq!(s.place(256), None, "the tail is full");
    }

    /// Over layered traces replayed with their own frees, no two live pieces ever overlap and
    /// every request takes its planned place.
    #[test]
    fn replaying_a_trace_through_the_placer_matches_the_plan() {
        for seed in 0..20 {
            let t = layered(seed, 40);
            let p = plan(&t);
            let mut s = Placer::new(p.clone(), p.bytes);
            let mut at: Vec<usize> = Vec::new();
            let mut live: Vec<(usize, usize)> = Vec::new();
            for e in &t.events {
                match *e {
                    TraceEvent::Alloc(n) => {
                        let off = s.place(n).expect("fits");
                        assert!(live.iter().all(|&(o, l)| o + l <= off || off + n <= o), "seed {seed}: overlap");
                        live.push((off, n));
                        at.push(off);
                    }
                    TraceEvent::Free(id) => {
                        s.release(at[id]);
                        live.retain(|&(o, _)| o != at[id]);
                    }
                }
            }
            assert_eq!(at, p.offsets, "seed {seed}");
            assert_eq!(s.tail_allocs, 0);
        }
    }

    #[test]
    fn stray_frees_are_ignored() {
        let mut t = AllocTrace::default();
        let a = t.alloc(256);
        t.free(7);
        t.free(a);
        t.free(a);
        let b = t.alloc(256);
        let p = plan(&t);
        assert_eq!((p.offsets[a], p.offsets[b], p.bytes), (0, 0, 256));
        assert_eq!(t.peak_live(), 256);
    }
}

// The dense pose assigner (docs/loss.md §2) in four kernels: the composed tensor ops of
// `assign_dense::assign_composed`, step for step with the same f32 operations (each product and
// sum explicitly rounded, so the compiler cannot contract them into FMAs the composed kernels do
// not use), over targets padded to M slots per image.
//
//   1. candidates        blocks per (image, slot) and slice of anchors: candidates, overlaps, metric
//   1b. slot_topk        one block per (image, slot): the top-k of the metric
//   2. resolve_claims    one thread per (image, anchor): an anchor claimed by several GTs goes to
//                        the one of highest overlap
//   3. second_topk       one block per (image, slot): the second top-k filter, the slot's largest
//                        metric and overlap among its positives
//   4. targets           one thread per (image, anchor): foreground, GT index, labels, boxes,
//                        soft class scores
//
// Top-k order is value descending, then anchor index ascending (the composed top-k's order).

typedef unsigned int u32;
typedef long long i64;

#define MUL(a, b) __fmul_rn((a), (b))
#define ADD(a, b) __fadd_rn((a), (b))
#define SUB(a, b) __fsub_rn((a), (b))

#define MAX_K 64        // keypoints and top-k picks held in shared memory
#define BLOCK 512       // threads of the per-slot kernels
#define WARPS (BLOCK / 32)

// The tensor ops' semantics: clamp_min keeps NaN; maximum/minimum propagate it.
__device__ __forceinline__ float clamp_min(float x, float lo) { return x != x ? x : (x > lo ? x : lo); }
__device__ __forceinline__ float vmax(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
__device__ __forceinline__ float vmin(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }

// Does (v, i) come before (w, j) in top-k order?
__device__ __forceinline__ bool before(float v, u32 i, float w, u32 j) { return v > w || (v == w && i < j); }

// The block's first element in top-k order among each thread's (v, i) (i = 0xffffffff: none).
__device__ void block_first(float& v, u32& i, float* sv, u32* si) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_down_sync(0xffffffffu, v, o);
        u32 j = __shfl_down_sync(0xffffffffu, i, o);
        if (j != 0xffffffffu && (i == 0xffffffffu || before(w, j, v, i))) { v = w; i = j; }
    }
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 w = 1; w < WARPS; ++w)
            if (si[w] != 0xffffffffu && (i == 0xffffffffu || before(sv[w], si[w], v, i))) { v = sv[w]; i = si[w]; }
        sv[0] = v; si[0] = i;
    }
    __syncthreads();
    v = sv[0]; i = si[0];
}

// Picks the first `k` of `row[0..n)` (multiplied by `weight[..]` when given) in top-k order into
// `picked[0..k)`.
__device__ void block_topk(const float* row, const float* weight, u32 n, u32 k, u32* picked, float* sv, u32* si) {
    float pv = 0.0f; u32 pi = 0xffffffffu;
    for (u32 r = 0; r < k; ++r) {
        float bv = 0.0f; u32 bi = 0xffffffffu;
        for (u32 a = threadIdx.x; a < n; a += BLOCK) {
            const float v = weight ? MUL(row[a], weight[a]) : row[a];
            const bool after = pi == 0xffffffffu || before(pv, pi, v, a);
            if (after && (bi == 0xffffffffu || before(v, a, bv, bi))) { bv = v; bi = a; }
        }
        block_first(bv, bi, sv, si);
        if (threadIdx.x == 0) picked[r] = bi;
        pv = bv; pi = bi;
    }
    __syncthreads();
}

__device__ __forceinline__ bool is_picked(const u32* picked, u32 k, u32 a) {
    for (u32 r = 0; r < k; ++r)
        if (picked[r] == a) return true;
    return false;
}

// CIoU of b1 (the GT) and b2 (the prediction), clamped at 0: `boxes::ciou`'s operations.
__device__ float ciou_clamped(const float* b1, const float* b2, float eps, float one_plus_eps, float four_over_pi2) {
    const float w1 = SUB(b1[2], b1[0]), h1 = ADD(SUB(b1[3], b1[1]), eps);
    const float w2 = SUB(b2[2], b2[0]), h2 = ADD(SUB(b2[3], b2[1]), eps);
    const float iw = clamp_min(SUB(vmin(b1[2], b2[2]), vmax(b1[0], b2[0])), 0.0f);
    const float ih = clamp_min(SUB(vmin(b1[3], b2[3]), vmax(b1[1], b2[1])), 0.0f);
    const float inter = MUL(iw, ih);
    const float uni = ADD(SUB(ADD(MUL(w1, h1), MUL(w2, h2)), inter), eps);
    const float iou = inter / uni;
    const float cw = SUB(vmax(b1[2], b2[2]), vmin(b1[0], b2[0]));
    const float ch = SUB(vmax(b1[3], b2[3]), vmin(b1[1], b2[1]));
    const float cc = ADD(ADD(MUL(cw, cw), MUL(ch, ch)), eps);
    const float dx = SUB(SUB(ADD(b2[0], b2[2]), b1[0]), b1[2]);
    const float dy = SUB(SUB(ADD(b2[1], b2[3]), b1[1]), b1[3]);
    const float rho2 = ADD(MUL(dx, dx), MUL(dy, dy)) / 4.0f;
    const float da = SUB(atanf(w2 / h2), atanf(w1 / h1));
    const float v = MUL(MUL(da, da), four_over_pi2);
    const float alpha = v / ADD(SUB(v, iou), one_plus_eps);
    return clamp_min(SUB(iou, ADD(rho2 / cc, MUL(v, alpha))), 0.0f);
}

struct Gate {
    float eps, size_floor, lo, hi, min_stride, max_stride;
};

// In the GT's box enlarged to the size floor (and a valid slot)?
__device__ __forceinline__ bool in_box(const float* g, float ax, float ay, const Gate& p) {
    const float cx = MUL(ADD(g[0], g[2]), 0.5f), cy = MUL(ADD(g[1], g[3]), 0.5f);
    const float hw = MUL(clamp_min(SUB(g[2], g[0]), p.size_floor), 0.5f);
    const float hh = MUL(clamp_min(SUB(g[3], g[1]), p.size_floor), 0.5f);
    return SUB(ax, SUB(cx, hw)) > p.eps && SUB(ay, SUB(cy, hh)) > p.eps && SUB(ADD(cx, hw), ax) > p.eps && SUB(ADD(cy, hh), ay) > p.eps;
}

// The level gate for a GT of side `side` at an anchor of stride `st`.
__device__ __forceinline__ bool level_ok(float side, float st, const Gate& p) {
    return (side >= MUL(st, p.lo) || st == p.min_stride) && (side <= MUL(st, p.hi) || st == p.max_stride);
}

// Grid (B·M, slices): block (bm, slice) fills anchors [slice·span, (slice + 1)·span) of the
// slot's rows; every block of a slot decides the level gate over all anchors (cheap compares), so
// the slices need no communication. `slot_topk` then picks the slot's top-k.
extern "C" __global__ void candidates(
    const float* gt_boxes, const float* gt_mask, const float* gt_labels, const float* gt_kpts,
    const float* scores, const float* boxes, const float* kpts,
    const float* anchors_px, const float* strides, const float* sigma_sq,
    float* overlaps, float* metric, float* pos,
    u32 M, u32 A, u32 K, u32 nc, u32 span,
    float eps, float size_floor, float lo, float hi, float min_stride, float max_stride, float area_factor,
    float ciou_eps, float ciou_one_plus_eps, float four_over_pi2) {
    __shared__ float gk[MAX_K * 3], denom[MAX_K];
    const u32 bm = blockIdx.x, b = bm / M;
    const u32 a0 = blockIdx.y * span, a1 = min(A, a0 + span);
    const float* g = gt_boxes + 4ull * bm;
    float* ov_row = overlaps + (unsigned long long)bm * A;
    float* me_row = metric + (unsigned long long)bm * A;
    float* pos_row = pos + (unsigned long long)bm * A;
    if (gt_mask[bm] == 0.0f) {  // a padding slot: no candidates
        for (u32 a = a0 + threadIdx.x; a < a1; a += BLOCK) { ov_row[a] = 0.0f; me_row[a] = 0.0f; pos_row[a] = 0.0f; }
        return;
    }
    const Gate p = {eps, size_floor, lo, hi, min_stride, max_stride};
    const float w = SUB(g[2], g[0]), h = SUB(g[3], g[1]);
    const float side = sqrtf(MUL(w, h));
    const float area = MUL(MUL(w, h), area_factor);
    float nvis = 0.0f;
    for (u32 k = 0; k < K; ++k) nvis = ADD(nvis, gt_kpts[(bm * K + k) * 3 + 2] > 0.0f ? 1.0f : 0.0f);
    if (threadIdx.x < K) {
        const u32 k = threadIdx.x;
        for (u32 c = 0; c < 3; ++c) gk[3 * k + c] = gt_kpts[(bm * K + k) * 3 + c];
        denom[k] = MUL(MUL(sigma_sq[k], ADD(area, eps)), 2.0f);
    }
    // Pass 1: does any anchor pass the level gate? (Else every in-box anchor is a candidate.)
    int gated_here = 0;
    for (u32 a = threadIdx.x; a < A; a += BLOCK)
        gated_here |= in_box(g, anchors_px[2 * a], anchors_px[2 * a + 1], p) && level_ok(side, strides[a], p);
    const bool use_gate = __syncthreads_or(gated_here) != 0;  // also orders the shared writes above
    const long long label = (long long)gt_labels[bm];
    // Pass 2: candidates, overlaps (OKS over visible keypoints, else the clamped CIoU), metric.
    for (u32 a = a0 + threadIdx.x; a < a1; a += BLOCK) {
        const bool inside = in_box(g, anchors_px[2 * a], anchors_px[2 * a + 1], p);
        const float cand = (inside && (!use_gate || level_ok(side, strides[a], p))) ? 1.0f : 0.0f;
        const unsigned long long ba = (unsigned long long)b * A + a;
        float ov;
        if (nvis > 0.0f) {
            const float* pk = kpts + ba * K * 2;
            float acc = 0.0f;
            for (u32 k = 0; k < K; ++k) {
                const float dx = SUB(pk[2 * k], gk[3 * k]), dy = SUB(pk[2 * k + 1], gk[3 * k + 1]);
                const float t = MUL(expf(-(ADD(MUL(dx, dx), MUL(dy, dy)) / denom[k])), gk[3 * k + 2] > 0.0f ? 1.0f : 0.0f);
                acc = k == 0 ? t : ADD(acc, t);
            }
            ov = acc / clamp_min(nvis, 1.0f);
        } else {
            ov = ciou_clamped(g, boxes + ba * 4, ciou_eps, ciou_one_plus_eps, four_over_pi2);
        }
        ov = MUL(ov, cand);
        const float score = (label >= 0 && label < (long long)nc) ? scores[ba * nc + label] : 0.0f;
        const float me = MUL(MUL(sqrtf(score), (float)pow((double)ov, 6.0)), cand);
        ov_row[a] = ov;
        me_row[a] = me;
        pos_row[a] = cand;
    }
}

// One block per (image, slot): the top-k of the metric over all anchors, kept where a candidate.
extern "C" __global__ void slot_topk(const float* gt_mask, const float* metric, float* pos, u32 A, u32 topk) {
    __shared__ float sv[WARPS];
    __shared__ u32 si[WARPS];
    __shared__ u32 picked[MAX_K];
    const u32 bm = blockIdx.x;
    if (gt_mask[bm] == 0.0f) return;  // a padding slot: nothing to pick
    const float* me_row = metric + (unsigned long long)bm * A;
    float* pos_row = pos + (unsigned long long)bm * A;
    const u32 k = topk < A ? topk : A;
    block_topk(me_row, 0, A, k, picked, sv, si);
    for (u32 a = threadIdx.x; a < A; a += BLOCK)
        if (pos_row[a] != 0.0f && !is_picked(picked, k, a)) pos_row[a] = 0.0f;
}

extern "C" __global__ void resolve_claims(const float* overlaps, float* pos, u32 B, u32 M, u32 A) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (unsigned long long)B * A;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long b = i / A, a = i % A;
        float claims = 0.0f, best_ov = 0.0f;
        u32 best = 0;
        for (u32 m = 0; m < M; ++m) {
            const unsigned long long j = (b * M + m) * A + a;
            claims = ADD(claims, pos[j]);
            const float o = overlaps[j];
            if (m == 0 || o > best_ov) { best_ov = o; best = m; }
        }
        if (claims > 1.0f)
            for (u32 m = 0; m < M; ++m) pos[(b * M + m) * A + a] = m == best ? 1.0f : 0.0f;
    }
}

extern "C" __global__ void second_topk(const float* overlaps, const float* metric, float* pos, float* pos_align, float* pos_overlap,
                                       u32 A, u32 topk2, u32 filter) {
    __shared__ float sv[WARPS];
    __shared__ u32 si[WARPS];
    __shared__ u32 picked[MAX_K];
    const u32 bm = blockIdx.x;
    const float* ov_row = overlaps + (unsigned long long)bm * A;
    const float* me_row = metric + (unsigned long long)bm * A;
    float* pos_row = pos + (unsigned long long)bm * A;
    if (filter) {
        const u32 k = topk2 < A ? topk2 : A;
        block_topk(me_row, pos_row, A, k, picked, sv, si);
        for (u32 a = threadIdx.x; a < A; a += BLOCK)
            if (pos_row[a] != 0.0f && !is_picked(picked, k, a)) pos_row[a] = 0.0f;
        __syncthreads();
    }
    // The slot's largest metric and overlap among its positives (0 without any).
    float al = -__int_as_float(0x7f800000), ol = al;
    for (u32 a = threadIdx.x; a < A; a += BLOCK) {
        al = vmax(al, MUL(me_row[a], pos_row[a]));
        ol = vmax(ol, MUL(ov_row[a], pos_row[a]));
    }
    for (int o = 16; o > 0; o >>= 1) {
        al = vmax(al, __shfl_down_sync(0xffffffffu, al, o));
        ol = vmax(ol, __shfl_down_sync(0xffffffffu, ol, o));
    }
    __shared__ float sa[WARPS], so[WARPS];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sa[warp] = al; so[warp] = ol; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 w = 1; w < WARPS; ++w) { al = vmax(al, sa[w]); ol = vmax(ol, so[w]); }
        pos_align[bm] = al;
        pos_overlap[bm] = ol;
    }
}

extern "C" __global__ void targets(const float* metric, const float* pos, const float* pos_align, const float* pos_overlap,
                                   const float* gt_labels, const float* gt_boxes,
                                   float* fg_mask, i64* gt_idx, i64* target_labels, float* target_boxes, float* target_scores,
                                   u32 B, u32 M, u32 A, u32 nc, float eps) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (unsigned long long)B * A;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long b = i / A, a = i % A;
        float fg = 0.0f, norm = 0.0f;
        u32 idx = 0;
        for (u32 m = 0; m < M; ++m) {
            const unsigned long long bm = b * M + m, j = bm * A + a;
            const float pm = pos[j];
            if (pm > fg) { fg = pm; idx = m; }
            const float n = MUL(MUL(metric[j], pos_overlap[bm]) / ADD(pos_align[bm], eps), pm);
            norm = m == 0 ? n : vmax(norm, n);
        }
        const bool is_fg = fg != 0.0f;
        const i64 label = is_fg ? (i64)gt_labels[b * M + idx] : 0;
        fg_mask[i] = fg;
        gt_idx[i] = idx;
        target_labels[i] = label;
        const float* gb = gt_boxes + (b * M + idx) * 4;
        for (u32 c = 0; c < 4; ++c) target_boxes[i * 4 + c] = is_fg ? gb[c] : 0.0f;
        const float s = MUL(norm, fg);
        for (u32 c = 0; c < nc; ++c) target_scores[i * nc + c] = (i64)c == label ? s : 0.0f;
    }
}

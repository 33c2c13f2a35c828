// The keypoint terms of the dense loss (`dense::dense_branch_parts`: OKS keypoint loss, keypoint
// visibility BCE and the RLE rows that go into the flow) in one forward and one backward kernel, a
// thread per (row, keypoint), instead of ≈ 60 composed ops forward and ≈ 80 backward per branch.
// The forward follows the composed ops in their order; the backward is their chain rule written
// out with the composed ops' conventions (clamp passes the gradient where lo ≤ x ≤ hi; `where`
// sends it to the chosen side only). Rows: F foreground rows (padding rows have valid = 0, which
// zeroes every term and every gradient), K keypoints.
//
// Inputs per row r: kp (F, K, 3) predicted keypoints (x, y offsets in grid units, visibility
// logit), sg (F, K, 2) sigma logits, anc (F, 2) anchor point, st (F, 1) stride, tb (F, 4) target
// box (grid units, xyxy), valid (F, 1), gk (F, K, 3) target keypoints (pixels, visibility);
// per keypoint: tss (K) the OKS factors (2σ)².

typedef unsigned int u32;

struct Row {
    float px, py, gx, gy, m, denom, factor, q, ex, vlog;
    float sx, sy, rx, ry, errx, erry, keep;
};

__device__ __forceinline__ float clampf(float x, float lo, float hi) {
    if (x != x) return x;
    float y = x > lo ? x : lo;
    return y < hi ? y : hi;
}

__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ Row row_forward(const float* kp, const float* sg, const float* anc, const float* st, const float* tb,
                           const float* valid, const float* gk, const float* tss, u32 r, u32 k, u32 nk, float nkpt,
                           float sigma_floor) {
    Row o;
    const float s = st[r], v = valid[r];
    const float* p = kp + 3ull * ((unsigned long long)r * nk + k);
    const float* g = gk + 3ull * ((unsigned long long)r * nk + k);
    o.px = p[0] + anc[2ull * r];
    o.py = p[1] + anc[2ull * r + 1];
    o.vlog = p[2];
    o.gx = g[0] / s;
    o.gy = g[1] / s;
    o.m = (g[2] != 0.0f ? 1.0f : 0.0f) * v;
    const float* b = tb + 4ull * r;
    const float area = __fmul_rn(b[2] - b[0], b[3] - b[1]);
    o.denom = __fmul_rn(__fmul_rn(tss[k], area + 1e-9f), 2.0f);
    // Visible keypoints of the row: a sum of 0/1 values, exact in any order.
    float nv = 0.0f;
    for (u32 j = 0; j < nk; ++j) nv += (gk[3ull * ((unsigned long long)r * nk + j) + 2] != 0.0f ? 1.0f : 0.0f) * v;
    o.factor = nkpt / (nv + 1e-9f);
    const float dx = o.px - o.gx, dy = o.py - o.gy;
    const float d = __fadd_rn(__fmul_rn(dx, dx), __fmul_rn(dy, dy));
    o.q = d / o.denom;
    o.ex = expf(-o.q);
    // RLE: σ = max(sigmoid(sg), floor), the error scaled by σ, kept where visible and finite.
    const float* t = sg + 2ull * ((unsigned long long)r * nk + k);
    o.rx = sigm(t[0]);
    o.ry = sigm(t[1]);
    o.sx = clampf(o.rx, sigma_floor, __int_as_float(0x7f800000));
    o.sy = clampf(o.ry, sigma_floor, __int_as_float(0x7f800000));
    o.errx = dx / (o.sx + 1e-9f);
    o.erry = dy / (o.sy + 1e-9f);
    const float finite = (fabsf(o.errx) <= 3.402823466e38f ? 1.0f : 0.0f) * (fabsf(o.erry) <= 3.402823466e38f ? 1.0f : 0.0f);
    o.keep = o.m * finite;
    return o;
}

// kpt (F, K) = factor · (1 − exp(−d / denom)) · m · valid; kobj (F, K) = BCE(vlog, m) · valid;
// e (F, K, 2) = clamp(keep ? error : 0, −100, 100); s (F, K, 2) = keep ? σ : 1; keep (F, K).
extern "C" __global__ void kpt_fwd(const float* kp, const float* sg, const float* anc, const float* st, const float* tb,
                                   const float* valid, const float* gk, const float* tss, float* kpt, float* kobj, float* e,
                                   float* s, float* keep, u32 f, u32 nk, float nkpt, float sigma_floor) {
    const unsigned long long n = (unsigned long long)f * nk;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        const u32 r = (u32)(i / nk), k = (u32)(i % nk);
        const Row o = row_forward(kp, sg, anc, st, tb, valid, gk, tss, r, k, nk, nkpt, sigma_floor);
        const float v = valid[r];
        const float lk = __fmul_rn(-o.ex + 1.0f, o.m);
        kpt[i] = __fmul_rn(__fmul_rn(o.factor, lk), v);
        const float x = o.vlog;
        const float bce = __fadd_rn((x > 0.0f ? x : 0.0f) - __fmul_rn(x, o.m), log1pf(expf(-fabsf(x))));
        kobj[i] = __fmul_rn(bce, v);
        const bool kept = o.keep != 0.0f;
        e[2 * i] = clampf(kept ? o.errx : 0.0f, -100.0f, 100.0f);
        e[2 * i + 1] = clampf(kept ? o.erry : 0.0f, -100.0f, 100.0f);
        s[2 * i] = kept ? o.sx : 1.0f;
        s[2 * i + 1] = kept ? o.sy : 1.0f;
        keep[i] = o.keep;
    }
}

// d_kp (F, K, 3) and d_sg (F, K, 2) from the gradients of kpt, kobj, e and s (each (F, K) or
// (F, K, 2); a null pointer is an absent gradient, i.e. zero).
extern "C" __global__ void kpt_bwd(const float* kp, const float* sg, const float* anc, const float* st, const float* tb,
                                   const float* valid, const float* gk, const float* tss, const float* g_kpt,
                                   const float* g_kobj, const float* g_e, const float* g_s, float* d_kp, float* d_sg, u32 f,
                                   u32 nk, float nkpt, float sigma_floor) {
    const unsigned long long n = (unsigned long long)f * nk;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        const u32 r = (u32)(i / nk), k = (u32)(i % nk);
        const Row o = row_forward(kp, sg, anc, st, tb, valid, gk, tss, r, k, nk, nkpt, sigma_floor);
        const float v = valid[r];
        // OKS term: ∂/∂d of factor·(1 − e^{−d/denom})·m·v, then ∂d/∂px = 2·(px − gx).
        const float gk_ = g_kpt ? g_kpt[i] : 0.0f;
        const float dd = gk_ * o.factor * v * o.m * o.ex / o.denom;
        float dpx = dd * 2.0f * (o.px - o.gx);
        float dpy = dd * 2.0f * (o.py - o.gy);
        // Visibility BCE: (sigmoid(x) − m)·v.
        const float go = g_kobj ? g_kobj[i] : 0.0f;
        const float dvlog = go * v * (sigm(o.vlog) - o.m);
        // RLE rows: e = clamp(keep ? err : 0), err = (p − g) / (σ + 1e-9); s = keep ? σ : 1.
        float dsx = 0.0f, dsy = 0.0f;
        if (o.keep != 0.0f) {
            const float gex = g_e ? g_e[2 * i] : 0.0f, gey = g_e ? g_e[2 * i + 1] : 0.0f;
            const float gsx = g_s ? g_s[2 * i] : 0.0f, gsy = g_s ? g_s[2 * i + 1] : 0.0f;
            const float derrx = (o.errx >= -100.0f && o.errx <= 100.0f) ? gex : 0.0f;
            const float derry = (o.erry >= -100.0f && o.erry <= 100.0f) ? gey : 0.0f;
            const float bx = o.sx + 1e-9f, by = o.sy + 1e-9f;
            dpx += derrx / bx;
            dpy += derry / by;
            // ∂(a / b)/∂b = −(a / b) / b; then σ = clamp(sigmoid) passes where sigmoid ≥ floor.
            dsx = gsx - derrx * o.errx / bx;
            dsy = gsy - derry * o.erry / by;
        }
        const float cx = o.rx >= sigma_floor ? 1.0f : 0.0f, cy = o.ry >= sigma_floor ? 1.0f : 0.0f;
        float* dk = d_kp + 3 * i;
        dk[0] = dpx;
        dk[1] = dpy;
        dk[2] = dvlog;
        d_sg[2 * i] = dsx * cx * (o.rx * (1.0f - o.rx));
        d_sg[2 * i + 1] = dsy * cy * (o.ry * (1.0f - o.ry));
    }
}

// The RLE term's rows after the flow (`dense::rle_terms`), a thread per (row, keypoint) pair and
// both coordinates: l = ((log σ − log φ) + (log 2σ + |e|))·w_k·keep / n_keep, with σ (F, K, 2),
// log φ (F·K), e (F·K, 2), w (K), keep (F, K) and n_keep a device scalar (1 element).
extern "C" __global__ void rle_fwd(const float* s, const float* lp, const float* e, const float* w, const float* keep, const float* n_keep,
                                   float* out, u32 f, u32 nk) {
    const unsigned long long n = (unsigned long long)f * nk;
    const float nkeep = n_keep[0];
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        const float wk = w[i % nk], kp = keep[i], l = lp[i];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float sv = s[2 * i + c];
            const float a = logf(sv) - l;
            const float b = __fadd_rn(logf(__fmul_rn(sv, 2.0f)), fabsf(e[2 * i + c]));
            out[2 * i + c] = __fmul_rn(__fmul_rn(__fadd_rn(a, b), wk), kp) / nkeep;
        }
    }
}

// d_s (F, K, 2), d_lp (F·K) and d_e (F·K, 2) from the gradient g (F, K, 2) of rle_fwd's output.
extern "C" __global__ void rle_bwd(const float* s, const float* e, const float* w, const float* keep, const float* n_keep, const float* g,
                                   float* d_s, float* d_lp, float* d_e, u32 f, u32 nk) {
    const unsigned long long n = (unsigned long long)f * nk;
    const float nkeep = n_keep[0];
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        const float wk = w[i % nk], kp = keep[i];
        float dl = 0.0f;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float gm = (g[2 * i + c] / nkeep) * kp * wk;
            const float sv = s[2 * i + c], ev = e[2 * i + c];
            // d log σ = 1/σ; d log 2σ = 2 · 1/(2σ).
            d_s[2 * i + c] = gm / sv + (gm / __fmul_rn(sv, 2.0f)) * 2.0f;
            d_e[2 * i + c] = gm * (ev > 0.0f ? 1.0f : (ev < 0.0f ? -1.0f : ev * 0.0f));
            dl -= gm;
        }
        d_lp[i] = dl;
    }
}

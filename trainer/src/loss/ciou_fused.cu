// The box loss's CIoU (docs/loss.md §3.2, `boxes::ciou`) in one forward and one backward kernel, a thread
// per box pair, instead of ≈ 55 composed ops forward and ≈ 100 backward per branch. The forward
// follows the composed ops' operations in their order; the backward is their chain rule written out,
// with the composed ops' conventions: a tie of minimum/maximum sends half the gradient each way,
// clamp_min(·, 0) passes the gradient where its input is ≥ 0, and the aspect-ratio weight α is a
// constant (computed without gradient, as in the reference).

typedef unsigned int u32;

struct Ciou {
    float x1, y1, x2, y2, X1, Y1, X2, Y2;
    float w1, h1, w2, h2, mx, my, iw, ih, inter, uni, iou, cw, ch, cc, dx, dy, rho2, u1, u2, da, v, alpha, out;
};

__device__ __forceinline__ float clamp_min0(float x) { return x != x ? x : (x > 0.0f ? x : 0.0f); }
__device__ __forceinline__ float vmin(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }
__device__ __forceinline__ float vmax(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
// The share of a minimum's (maximum's) gradient that reaches its first argument.
__device__ __forceinline__ float share_lt(float a, float b) { return a < b ? 1.0f : (a == b ? 0.5f : 0.0f); }
__device__ __forceinline__ float share_gt(float a, float b) { return a > b ? 1.0f : (a == b ? 0.5f : 0.0f); }

__device__ Ciou ciou_forward(const float* p, const float* t, float eps, float four_over_pi2) {
    Ciou c;
    c.x1 = p[0]; c.y1 = p[1]; c.x2 = p[2]; c.y2 = p[3];
    c.X1 = t[0]; c.Y1 = t[1]; c.X2 = t[2]; c.Y2 = t[3];
    c.w1 = c.x2 - c.x1;
    c.h1 = (c.y2 - c.y1) + eps;
    c.w2 = c.X2 - c.X1;
    c.h2 = (c.Y2 - c.Y1) + eps;
    c.mx = vmin(c.x2, c.X2) - vmax(c.x1, c.X1);
    c.my = vmin(c.y2, c.Y2) - vmax(c.y1, c.Y1);
    c.iw = clamp_min0(c.mx);
    c.ih = clamp_min0(c.my);
    c.inter = __fmul_rn(c.iw, c.ih);
    c.uni = ((__fmul_rn(c.w1, c.h1) + __fmul_rn(c.w2, c.h2)) - c.inter) + eps;
    c.iou = c.inter / c.uni;
    c.cw = vmax(c.x2, c.X2) - vmin(c.x1, c.X1);
    c.ch = vmax(c.y2, c.Y2) - vmin(c.y1, c.Y1);
    c.cc = (__fmul_rn(c.cw, c.cw) + __fmul_rn(c.ch, c.ch)) + eps;
    c.dx = ((c.X1 + c.X2) - c.x1) - c.x2;
    c.dy = ((c.Y1 + c.Y2) - c.y1) - c.y2;
    c.rho2 = (__fmul_rn(c.dx, c.dx) + __fmul_rn(c.dy, c.dy)) / 4.0f;
    c.u1 = c.w1 / c.h1;
    c.u2 = c.w2 / c.h2;
    c.da = atanf(c.u2) - atanf(c.u1);
    c.v = __fmul_rn(__fmul_rn(c.da, c.da), four_over_pi2);
    c.alpha = c.v / ((c.v - c.iou) + (1.0f + eps));
    c.out = c.iou - (c.rho2 / c.cc + __fmul_rn(c.v, c.alpha));
    return c;
}

// out (N) = CIoU(pred[i], target[i]) for N (pred, target) pairs of xyxy boxes (N×4 each).
extern "C" __global__ void ciou_fwd(const float* pred, const float* target, float* out, u32 n, float eps, float four_over_pi2) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        out[i] = ciou_forward(pred + 4ull * i, target + 4ull * i, eps, four_over_pi2).out;
    }
}

// ∂CIoU/∂pred (d[0..4]) times the output gradient `go`, from the forward's values `c` (the target
// is constant).
__device__ __forceinline__ void ciou_backward(const Ciou& c, float go, float four_over_pi2, float (&d)[4]) {
    // out = iou − (rho2 / cc + v·α)
    const float g_iou = go, g_r = -go, g_v = -go * c.alpha;
    // rho2 / cc
    const float g_rho2 = g_r / c.cc;
    const float g_cc = -g_r * c.rho2 / (c.cc * c.cc);
    const float g_cw = g_cc * 2.0f * c.cw, g_ch = g_cc * 2.0f * c.ch;
    const float g_dx = (g_rho2 / 4.0f) * 2.0f * c.dx, g_dy = (g_rho2 / 4.0f) * 2.0f * c.dy;
    // v = k·(atan u2 − atan u1)²; u1 = w1 / h1
    const float g_da = g_v * four_over_pi2 * 2.0f * c.da;
    const float g_u1 = -g_da / (1.0f + c.u1 * c.u1);
    float g_w1 = g_u1 / c.h1;
    float g_h1 = -g_u1 * c.u1 / c.h1;
    // iou = inter / uni; uni = w1·h1 + w2·h2 − inter + eps
    float g_inter = g_iou / c.uni;
    const float g_uni = -g_iou * c.iou / c.uni;
    g_w1 += g_uni * c.h1;
    g_h1 += g_uni * c.w1;
    g_inter -= g_uni;
    // inter = iw·ih, iw = clamp_min(mx, 0), mx = min(x2, X2) − max(x1, X1)
    const float g_mx = c.mx >= 0.0f ? g_inter * c.ih : 0.0f;
    const float g_my = c.my >= 0.0f ? g_inter * c.iw : 0.0f;
    float gx1 = 0.0f, gy1 = 0.0f, gx2 = 0.0f, gy2 = 0.0f;
    gx2 += g_mx * share_lt(c.x2, c.X2);
    gx1 -= g_mx * share_gt(c.x1, c.X1);
    gy2 += g_my * share_lt(c.y2, c.Y2);
    gy1 -= g_my * share_gt(c.y1, c.Y1);
    // cw = max(x2, X2) − min(x1, X1)
    gx2 += g_cw * share_gt(c.x2, c.X2);
    gx1 -= g_cw * share_lt(c.x1, c.X1);
    gy2 += g_ch * share_gt(c.y2, c.Y2);
    gy1 -= g_ch * share_lt(c.y1, c.Y1);
    // dx = X1 + X2 − x1 − x2
    gx1 -= g_dx;
    gx2 -= g_dx;
    gy1 -= g_dy;
    gy2 -= g_dy;
    // w1 = x2 − x1, h1 = y2 − y1 + eps
    gx2 += g_w1;
    gx1 -= g_w1;
    gy2 += g_h1;
    gy1 -= g_h1;
    d[0] = gx1;
    d[1] = gy1;
    d[2] = gx2;
    d[3] = gy2;
}

// d_pred (N×4) = g[i] · ∂CIoU/∂pred[i] (the target is constant).
extern "C" __global__ void ciou_bwd(const float* pred, const float* target, const float* g, float* d_pred, u32 n, float eps,
                                   float four_over_pi2) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const Ciou c = ciou_forward(pred + 4ull * i, target + 4ull * i, eps, four_over_pi2);
        float d[4];
        ciou_backward(c, g[i], four_over_pi2, d);
        float* o = d_pred + 4ull * i;
        o[0] = d[0];
        o[1] = d[1];
        o[2] = d[2];
        o[3] = d[3];
    }
}

// The dense loss's box rows (`dense::dense_branch_parts`), a thread per foreground row i: the
// predicted box from the row's distances ltrb (grid units) around its anchor point, the CIoU term
// (1 − CIoU)·w against the target box (both replaced by the unit box on padding rows, valid = 0),
// and the side L1 term mean₄ |pred − target|·w on image-normalised distances (stride / whwh).
struct BoxRow {
    float P[4], T[4], pl1[4], tl1[4];
};

__device__ __forceinline__ BoxRow box_row(const float* ltrb, const float* anc, const float* st, const float* tb, const float* valid,
                                          const float* whwh, u32 i) {
    BoxRow b;
    const float* l = ltrb + 4ull * i;
    const float* t = tb + 4ull * i;
    const float a0 = anc[2ull * i], a1 = anc[2ull * i + 1], s = st[i];
    const bool real = valid[i] != 0.0f;
    const float pred[4] = {a0 - l[0], a1 - l[1], a0 + l[2], a1 + l[3]};
    const float unit[4] = {0.0f, 0.0f, 1.0f, 1.0f};
    const float side[4] = {a0 - t[0], a1 - t[1], t[2] - a0, t[3] - a1};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        b.P[j] = real ? pred[j] : unit[j];
        b.T[j] = real ? t[j] : unit[j];
        b.pl1[j] = __fmul_rn(l[j], s) / whwh[j];
        b.tl1[j] = __fmul_rn(side[j], s) / whwh[j];
    }
    return b;
}

// box (N) = (1 − CIoU)·w, l1 (N) = (Σ₄ |pl1 − tl1|)·¼·w.
extern "C" __global__ void box_rows_fwd(const float* ltrb, const float* anc, const float* st, const float* tb, const float* valid,
                                        const float* w, const float* whwh, float* box, float* l1, u32 n, float eps, float four_over_pi2) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const BoxRow b = box_row(ltrb, anc, st, tb, valid, whwh, i);
        const Ciou c = ciou_forward(b.P, b.T, eps, four_over_pi2);
        box[i] = __fmul_rn(-c.out + 1.0f, w[i]);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) s = __fadd_rn(s, fabsf(b.pl1[j] - b.tl1[j]));
        l1[i] = __fmul_rn(__fmul_rn(s, 0.25f), w[i]);
    }
}

// d_ltrb (N×4) from the gradients of box and l1 (N each; a null pointer is an absent gradient).
extern "C" __global__ void box_rows_bwd(const float* ltrb, const float* anc, const float* st, const float* tb, const float* valid,
                                        const float* w, const float* whwh, const float* g_box, const float* g_l1, float* d_ltrb, u32 n,
                                        float eps, float four_over_pi2) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const BoxRow b = box_row(ltrb, anc, st, tb, valid, whwh, i);
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float gb = g_box ? g_box[i] : 0.0f, gl = g_l1 ? g_l1[i] : 0.0f;
        if (valid[i] != 0.0f) {
            // box = (1 − CIoU)·w; pred = (a0 − l0, a1 − l1, a0 + l2, a1 + l3).
            const Ciou c = ciou_forward(b.P, b.T, eps, four_over_pi2);
            float dp[4];
            ciou_backward(c, -gb * w[i], four_over_pi2, dp);
            d[0] = -dp[0];
            d[1] = -dp[1];
            d[2] = dp[2];
            d[3] = dp[3];
        }
        const float s = st[i], gm = gl * w[i] * 0.25f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float e = b.pl1[j] - b.tl1[j];
            const float sg = e > 0.0f ? 1.0f : (e < 0.0f ? -1.0f : e * 0.0f);
            d[j] += gm * sg * (s / whwh[j]);
        }
        float* o = d_ltrb + 4ull * i;
        o[0] = d[0];
        o[1] = d[1];
        o[2] = d[2];
        o[3] = d[3];
    }
}

// The RLE loss's RealNVP flow (docs/model.md §5.4) in four kernels instead of ≈ 600 composed tensor ops
// per step. `flow_fused.rs` explains the interface; the arithmetic follows the composed
// `RealNvp::log_prob` operation by operation, including, under autocast, the rounding of every
// tensor the composed ops would store in the compute dtype (`rnd`).
//
//   1. flow_forward        tiles of ROWS rows: log p(e) and the per-layer inputs the backward needs
//   2. flow_backward_rows  tiles of ROWS rows: ∂/∂e, and each net's output gradient and input per row
//   3. flow_weight_grads   one block per (net, chunk of tiles): the chunk's weight-gradient sums
//   4. flow_reduce         one thread per parameter: the chunks' sums in chunk order
//
// A block of the row kernels (1, 2) has GROUPS groups of HIDDEN threads, thread i of a group owning
// hidden unit i of the net at hand, and works on a tile of ROWS rows, each group on RPG of them (a
// row per independent FMA chain: the products over hidden units read each row's activations as
// broadcast float4s from shared memory). The groups share the staged weights; a block of one group
// took a serial chain four times as long, and with only the few tiles of real rows busy that chain
// was the kernel's time. `flow_weight_grads` has one group per block. A row's arithmetic does not
// depend on the group that computes it. Every sum runs in a fixed order (no
// atomics), so a result does not depend on scheduling. The RLE's padding rows cost almost nothing:
// a forward tile of rows that are all exactly (+0, +0) computes one row, and rows whose incoming
// gradient is exactly zero contribute exactly zero to every gradient, so the backward skips tiles
// made only of them.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned int u32;

#define HIDDEN 64
#define LAYERS 6
#define NETS 12              // s.0 … s.5, then t.0 … t.5
#define ROWS 16              // rows per tile
#define GROUPS 4             // groups of HIDDEN threads in a block of the row kernels
#define RPG (ROWS / GROUPS)  // rows per group
#define STAGE_BATCH 16       // W2 values a thread loads before storing them to shared memory
#define WSTRIDE 65           // padded row stride of W2 in shared memory (conflict-free both ways)
// One net's parameters, packed: W0 (64×2), b0 (64), W2 (64×64), b2 (64), W4 (2×64), b4 (2).
#define OFF_W0 0
#define OFF_B0 128
#define OFF_W2 192
#define OFF_B2 4288
#define OFF_W4 4352
#define OFF_B4 4480
#define NET_PARAMS 4482

// The 72 parameter tensors, net n's at [6n, 6n + 6) in the order above.
struct Weights { const float* p[6 * NETS]; };
struct Grads { float* p[6 * NETS]; };

// Rounding to the compute dtype of the composed ops (0: f32, 1: bf16, 2: f16).
__device__ __forceinline__ float rnd(float x, int mode) {
    if (mode == 1) return __bfloat162float(__float2bfloat16_rn(x));
    if (mode == 2) return __half2float(__float2half_rn(x));
    return x;
}
__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x * sigm(x); }
__device__ __forceinline__ float silu_grad(float x) { const float s = sigm(x); return s * (1.0f + x * (1.0f - s)); }

// Layer j keeps coordinate `kept(j)` (mask row j = [0,1] for even j) and updates the other.
__device__ __forceinline__ u32 kept(u32 j) { return (j % 2 == 0) ? 1u : 0u; }

// One net's weights in shared memory, rounded to the compute dtype as autocast would cast them.
struct __align__(16) NetShared {
    float w2[HIDDEN * WSTRIDE];  // W2[i][k] at i·WSTRIDE + k
    float w0[HIDDEN];            // W0[i][c] (the kept coordinate's column)
    float b0[HIDDEN];
    float b2[HIDDEN];
    float w4[HIDDEN];            // W4[o][i] (the updated coordinate's row)
    float b4;
};

// Every thread of the block takes part (STAGE_BATCH loads in flight before their stores).
__device__ void stage_net(NetShared& s, const Weights& w, u32 net, u32 c, int mode) {
    const u32 o = 1 - c, i = threadIdx.x, nt = blockDim.x;
    const float* W0 = w.p[6 * net];
    const float* W2 = w.p[6 * net + 2];
    for (u32 q0 = i; q0 < HIDDEN * HIDDEN; q0 += STAGE_BATCH * nt) {
        float v[STAGE_BATCH];
#pragma unroll
        for (u32 u = 0; u < STAGE_BATCH; ++u) {
            const u32 q = q0 + u * nt;
            v[u] = q < HIDDEN * HIDDEN ? W2[q] : 0.0f;
        }
#pragma unroll
        for (u32 u = 0; u < STAGE_BATCH; ++u) {
            const u32 q = q0 + u * nt;
            if (q < HIDDEN * HIDDEN) s.w2[(q / HIDDEN) * WSTRIDE + q % HIDDEN] = rnd(v[u], mode);
        }
    }
    if (i < HIDDEN) {
        s.w0[i] = rnd(W0[2 * i + c], mode);
        s.b0[i] = rnd(w.p[6 * net + 1][i], mode);
        s.b2[i] = rnd(w.p[6 * net + 3][i], mode);
        s.w4[i] = rnd(w.p[6 * net + 4][o * HIDDEN + i], mode);
    }
    if (i == 0) s.b4 = rnd(w.p[6 * net + 5][o], mode);
}

// The hidden unit a thread owns, and the first tile row of its group.
__device__ __forceinline__ u32 unit() { return threadIdx.x % HIDDEN; }
__device__ __forceinline__ u32 group_row0() { return (threadIdx.x / HIDDEN) * RPG; }
// Whether tile row t is computed when each group computes its first R rows.
template <int R>
__device__ __forceinline__ bool computed(u32 t) { return t < ROWS && t % RPG < (u32)R; }

// Per-row sums over a group's HIDDEN threads of v[r] (its rows group_row0() + r, r < R): each
// warp's butterfly, then warp 0's sum plus warp 1's, into sum[row]. Call with every thread; ends
// synchronised.
template <int R>
__device__ __forceinline__ void group_sum_rows(const float* v, float (*ws)[2], float* sum) {
    const u32 lane = threadIdx.x & 31u, warp = unit() >> 5, row0 = group_row0();
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float x = v[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        if (lane == 0) ws[row0 + r][warp] = x;
    }
    __syncthreads();
    if (computed<R>(threadIdx.x)) sum[threadIdx.x] = ws[threadIdx.x][0] + ws[threadIdx.x][1];
    __syncthreads();
}

// acc[r] = Σ_k w[k·step] · a[r][k] over k ascending, for R rows of a (HIDDEN wide, 16-byte
// aligned, read as broadcast float4s): R independent FMA chains.
template <int R>
__device__ __forceinline__ void dot_rows(const float* w, u32 step, const float (*a)[HIDDEN], float* acc) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (u32 k = 0; k < HIDDEN; k += 4) {
        const float w0 = w[k * step], w1 = w[(k + 1) * step], w2 = w[(k + 2) * step], w3 = w[(k + 3) * step];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float4 h = *reinterpret_cast<const float4*>(&a[r][k]);
            acc[r] = fmaf(w0, h.x, acc[r]);
            acc[r] = fmaf(w1, h.y, acc[r]);
            acc[r] = fmaf(w2, h.z, acc[r]);
            acc[r] = fmaf(w3, h.w, acc[r]);
        }
    }
}

struct __align__(16) TileShared {
    float h1s[ROWS][HIDDEN];     // h1 of every unit (forward), ∂/∂p2 of every unit (backward)
    NetShared net[2];            // the layer's scale and translation nets
    float ws[ROWS][2];
    float sum[ROWS];
    float x[ROWS];
    float sv[ROWS], tv[ROWS];
};

// A net's forward on the tile's inputs x[row] (the kept coordinate) of the group's rows
// group_row0() + r, r < R: keeps each row's pre-activations p1[r], p2[r] of this thread's unit;
// returns the outputs in out[row] (tanh'd for a scale net). `mm(x, W)` rounds its f32 sum; the
// bias add, SiLU and tanh round too.
template <int R>
__device__ __forceinline__ void net_forward(const NetShared& s, bool scale, TileShared& sh, float* p1, float* p2, float* out, int mode) {
    const u32 i = unit(), row0 = group_row0(), t = threadIdx.x;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        p1[r] = rnd(rnd(rnd(sh.x[row0 + r], mode) * s.w0[i], mode) + s.b0[i], mode);
        sh.h1s[row0 + r][i] = rnd(silu(p1[r]), mode);
    }
    __syncthreads();
    float acc[R], v[R];
    dot_rows<R>(s.w2 + i * WSTRIDE, 1, sh.h1s + row0, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        p2[r] = rnd(rnd(acc[r], mode) + s.b2[i], mode);
        v[r] = rnd(silu(p2[r]), mode) * s.w4[i];
    }
    group_sum_rows<R>(v, sh.ws, sh.sum);
    if (computed<R>(t)) {
        const float y = rnd(rnd(sh.sum[t], mode) + s.b4, mode);
        out[t] = scale ? rnd(tanhf(y), mode) : y;
    }
    __syncthreads();
}

// A net's backward for each row's output gradient dy[row] (after the tanh): returns each row's
// gradient of the kept input coordinate in dx[row]; p1, p2 from `net_forward` (the group's rows).
template <int R>
__device__ __forceinline__ void net_backward(const NetShared& s, const float* dy, const float* p1, const float* p2, TileShared& sh,
                                             float* dx, int mode) {
    const u32 k = unit(), row0 = group_row0(), t = threadIdx.x;
#pragma unroll
    for (int r = 0; r < R; ++r) sh.h1s[row0 + r][k] = rnd(rnd(dy[row0 + r] * s.w4[k], mode) * rnd(silu_grad(p2[r]), mode), mode);
    __syncthreads();
    float acc[R], v[R];
    dot_rows<R>(s.w2 + k, WSTRIDE, sh.h1s + row0, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float dp1 = rnd(rnd(acc[r], mode) * rnd(silu_grad(p1[r]), mode), mode);
        v[r] = dp1 * s.w0[k];
    }
    group_sum_rows<R>(v, sh.ws, sh.sum);
    if (computed<R>(t)) dx[t] = rnd(sh.sum[t], mode);
    __syncthreads();
}

// Layer j's two nets on the tile's rows of z (each group's first R): stages their weights, takes
// the kept coordinate as input and leaves the scale net's outputs in sh.sv, the translation net's
// in sh.tv (pre-activations of the group's rows in p1s/p2s and p1t/p2t for a backward).
template <int R>
__device__ __forceinline__ void layer_nets(const Weights& w, TileShared& sh, const float (*z)[2], u32 j, float* p1s, float* p2s,
                                           float* p1t, float* p2t, int mode) {
    const u32 c = kept(j);
    __syncthreads();
    stage_net(sh.net[0], w, j, c, mode);
    stage_net(sh.net[1], w, LAYERS + j, c, mode);
    if (threadIdx.x < ROWS) sh.x[threadIdx.x] = z[threadIdx.x][c];
    __syncthreads();
    net_forward<R>(sh.net[0], true, sh, p1s, p2s, sh.sv, mode);
    net_forward<R>(sh.net[1], false, sh, p1t, p2t, sh.tv, mode);
}

// The layers of the forward on the tile's rows of z (its state in shared memory; each group's
// first R rows); the updated coordinate's input to layer j lands in zin[row][j].
template <int R>
__device__ __forceinline__ void forward_layers(const Weights& w, TileShared& sh, float (*z)[2], float* logdet, float (*zin)[LAYERS], int mode) {
    const u32 i = threadIdx.x;
    const bool row = computed<R>(i);
    float p1[R], p2[R];
    for (int jj = LAYERS - 1; jj >= 0; --jj) {
        const u32 j = (u32)jj, o = 1 - kept(j);
        layer_nets<R>(w, sh, z, j, p1, p2, p1, p2, mode);
        if (row) {
            const float zo = z[i][o];
            zin[i][j] = zo;
            z[i][o] = (zo - sh.tv[i]) * expf(-sh.sv[i]);
            logdet[i] = (jj == LAYERS - 1) ? -sh.sv[i] : logdet[i] - sh.sv[i];
        }
    }
    __syncthreads();
}

// log p(e) for N rows of e (N×2): lp (N), and saved (N×8): the updated coordinate's input to each
// layer j at [j], the latent z at [6], [7]. A tile whose rows are all exactly (+0, +0) — the RLE's
// padding rows — computes one row and copies it (every row's result is that row's).
extern "C" __global__ void flow_forward(const float* e, Weights w, float* lp, float* saved, u32 n, int mode, float neg_ln2pi) {
    __shared__ TileShared sh;
    __shared__ float z[ROWS][2], logdet[ROWS], zin[ROWS][LAYERS];
    __shared__ int nonzero;
    const u32 row0 = blockIdx.x * ROWS, i = threadIdx.x;
    if (i == 0) nonzero = 0;
    __syncthreads();
    if (i < ROWS) {
        const u32 row = row0 + i;
        z[i][0] = row < n ? e[2 * row] : 0.0f;
        z[i][1] = row < n ? e[2 * row + 1] : 0.0f;
        logdet[i] = 0.0f;
        if (__float_as_uint(z[i][0]) != 0u || __float_as_uint(z[i][1]) != 0u) nonzero = 1;
    }
    __syncthreads();
    const bool all_zero = nonzero == 0;
    if (all_zero) forward_layers<1>(w, sh, z, logdet, zin, mode);
    else forward_layers<RPG>(w, sh, z, logdet, zin, mode);
    if (i < ROWS) {
        const u32 row = row0 + i, src = all_zero ? 0 : i;
        if (row < n) {
            for (u32 j = 0; j < LAYERS; ++j) saved[8ull * row + j] = zin[src][j];
            const float z0 = z[src][0], z1 = z[src][1];
            saved[8ull * row + 6] = z0;
            saved[8ull * row + 7] = z1;
            lp[row] = ((z0 * z0 + z1 * z1) * -0.5f + neg_ln2pi) + logdet[src];
        }
    }
}

// ∂L/∂e (N×2) for ∂L/∂lp = g (N), and per (row, layer): [x, dy_s, dy_t] in nets (N×6×3): the kept
// coordinate's input and each net's output gradient (after its tanh), for `flow_weight_grads`.
extern "C" __global__ void flow_backward_rows(const float* g, const float* saved, Weights w, float* de, float* nets, u32 n,
                                              int mode) {
    __shared__ TileShared sh;
    __shared__ float z[ROWS][2], dz[ROWS][2], gr[ROWS], dys[ROWS], dyt[ROWS], dxs[ROWS], dxt[ROWS];
    __shared__ int any;
    const u32 row0 = blockIdx.x * ROWS, i = threadIdx.x;
    if (i == 0) any = 0;
    __syncthreads();
    if (i < ROWS) {
        const u32 row = row0 + i;
        gr[i] = row < n ? g[row] : 0.0f;
        if (gr[i] != 0.0f) any = 1;
    }
    __syncthreads();
    if (!any) {  // every row's gradient is zero: so is everything downstream
        if (i < ROWS && row0 + i < n) {
            const u32 row = row0 + i;
            de[2 * row] = 0.0f;
            de[2 * row + 1] = 0.0f;
            for (u32 q = 0; q < 3 * LAYERS; ++q) nets[18ull * row + q] = 0.0f;
        }
        return;
    }
    if (i < ROWS) {
        const u32 row = row0 + i;
        const float z0 = row < n ? saved[8ull * row + 6] : 0.0f, z1 = row < n ? saved[8ull * row + 7] : 0.0f;
        z[i][0] = z0;
        z[i][1] = z1;
        // lp = −½(z0² + z1²) − ln 2π + logdet: square's backward of the affine's −½ g.
        const float gh = gr[i] * -0.5f;
        dz[i][0] = gh * (2.0f * z0);
        dz[i][1] = gh * (2.0f * z1);
    }
    float p1s[RPG], p2s[RPG], p1t[RPG], p2t[RPG];
    for (u32 j = 0; j < LAYERS; ++j) {
        const u32 c = kept(j), o = 1 - c;
        layer_nets<RPG>(w, sh, z, j, p1s, p2s, p1t, p2t, mode);
        if (i < ROWS) {
            const u32 row = row0 + i;
            const float zin = row < n ? saved[8ull * row + j] : 0.0f;
            const float s = sh.sv[i], t = sh.tv[i], ex = expf(-s), d = zin - t;
            // zout = (zin − t)·exp(−s) for the updated coordinate; logdet −= s.
            const float ga = dz[i][o] * ex;
            const float ds = -((dz[i][o] * d) * ex) + -gr[i];
            dys[i] = rnd(rnd(ds, mode) * rnd(1.0f - rnd(s * s, mode), mode), mode);  // through the tanh
            dyt[i] = rnd(-ga, mode);
            dz[i][o] = ga;
            z[i][o] = zin;
            if (row < n) {
                nets[18ull * row + 3 * j] = sh.x[i];
                nets[18ull * row + 3 * j + 1] = dys[i];
                nets[18ull * row + 3 * j + 2] = dyt[i];
            }
        }
        __syncthreads();
        net_backward<RPG>(sh.net[0], dys, p1s, p2s, sh, dxs, mode);
        net_backward<RPG>(sh.net[1], dyt, p1t, p2t, sh, dxt, mode);
        if (i < ROWS) dz[i][c] = (dz[i][c] + dxs[i]) + dxt[i];
    }
    __syncthreads();
    if (i < ROWS && row0 + i < n) {
        const u32 row = row0 + i;
        de[2 * row] = dz[i][0];
        de[2 * row + 1] = dz[i][1];
    }
}

// One block per (net = blockIdx.y, chunk = blockIdx.x): the sums over the chunk's tiles (tiles
// chunk, chunk + chunks, …) of the net's weight gradients, written to partial[chunk][net] in the
// packed layout (entries no row reaches — the masked column of W0, the kept row of W4 — are 0).
extern "C" __global__ void flow_weight_grads(const float* nets, Weights w, float* partial, u32 n, int mode) {
    __shared__ NetShared s;
    __shared__ __align__(16) float h1s[ROWS][HIDDEN];
    __shared__ __align__(16) float dp2s[ROWS][HIDDEN];
    __shared__ float x[ROWS], dy[ROWS];
    __shared__ int any;
    const u32 net = blockIdx.y, chunk = blockIdx.x, chunks = gridDim.x, i = threadIdx.x;
    const u32 j = net % LAYERS, c = kept(j), o = 1 - c;
    const bool scale = net < LAYERS;
    stage_net(s, w, net, c, mode);
    float gw2[HIDDEN];
#pragma unroll
    for (u32 k = 0; k < HIDDEN; ++k) gw2[k] = 0.0f;
    float gb2 = 0.0f, gw0 = 0.0f, gb0 = 0.0f, gw4 = 0.0f, gb4 = 0.0f;
    const u32 tiles = (n + ROWS - 1) / ROWS;
    for (u32 tile = chunk; tile < tiles; tile += chunks) {
        __syncthreads();
        if (i == 0) any = 0;
        __syncthreads();
        if (i < ROWS) {
            const u32 row = tile * ROWS + i;
            x[i] = row < n ? nets[18ull * row + 3 * j] : 0.0f;
            dy[i] = row < n ? nets[18ull * row + 3 * j + (scale ? 1 : 2)] : 0.0f;
            if (dy[i] != 0.0f) any = 1;
        }
        __syncthreads();
        if (!any) continue;
        float p1[ROWS], acc[ROWS], dp2[ROWS];
#pragma unroll
        for (u32 r = 0; r < ROWS; ++r) {
            p1[r] = rnd(rnd(rnd(x[r], mode) * s.w0[i], mode) + s.b0[i], mode);
            h1s[r][i] = rnd(silu(p1[r]), mode);
        }
        __syncthreads();
        dot_rows<ROWS>(s.w2 + i * WSTRIDE, 1, h1s, acc);
#pragma unroll
        for (u32 r = 0; r < ROWS; ++r) {
            const float p2 = rnd(rnd(acc[r], mode) + s.b2[i], mode);
            const float h2 = rnd(silu(p2), mode);
            dp2[r] = rnd(rnd(dy[r] * s.w4[i], mode) * rnd(silu_grad(p2), mode), mode);
            dp2s[r][i] = dp2[r];
            gb2 += dp2[r];
            gw4 = fmaf(dy[r], h2, gw4);
        }
        // dW2[i][k] += Σ_r ∂p2[r][i] · h1[r][k], rows ascending.
#pragma unroll
        for (u32 r = 0; r < ROWS; ++r)
#pragma unroll
            for (u32 k = 0; k < HIDDEN; k += 4) {
                const float4 h = *reinterpret_cast<const float4*>(&h1s[r][k]);
                gw2[k] = fmaf(dp2[r], h.x, gw2[k]);
                gw2[k + 1] = fmaf(dp2[r], h.y, gw2[k + 1]);
                gw2[k + 2] = fmaf(dp2[r], h.z, gw2[k + 2]);
                gw2[k + 3] = fmaf(dp2[r], h.w, gw2[k + 3]);
            }
        __syncthreads();
        dot_rows<ROWS>(s.w2 + i, WSTRIDE, dp2s, acc);
#pragma unroll
        for (u32 r = 0; r < ROWS; ++r) {
            const float dp1 = rnd(rnd(acc[r], mode) * rnd(silu_grad(p1[r]), mode), mode);
            gw0 = fmaf(dp1, rnd(x[r], mode), gw0);
            gb0 += dp1;
            if (i == 0) gb4 += dy[r];
        }
    }
    float* out = partial + ((unsigned long long)chunk * NETS + net) * NET_PARAMS;
    for (u32 k = 0; k < HIDDEN; ++k) out[OFF_W2 + i * HIDDEN + k] = gw2[k];
    out[OFF_W0 + 2 * i + c] = gw0;
    out[OFF_W0 + 2 * i + o] = 0.0f;
    out[OFF_B0 + i] = gb0;
    out[OFF_B2 + i] = gb2;
    out[OFF_W4 + o * HIDDEN + i] = gw4;
    out[OFF_W4 + c * HIDDEN + i] = 0.0f;
    if (i == 0) {
        out[OFF_B4 + o] = gb4;
        out[OFF_B4 + c] = 0.0f;
    }
}

// Each parameter's gradient: the chunks' partial sums added in chunk order, rounded as the composed
// ops' compute-dtype GEMM or sum would round it, into the parameter's own gradient tensor.
extern "C" __global__ void flow_reduce(const float* partial, Grads grads, u32 chunks, int mode) {
    const u32 p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= NETS * NET_PARAMS) return;
    float acc = 0.0f;
    for (u32 ch = 0; ch < chunks; ++ch) acc += partial[(unsigned long long)ch * NETS * NET_PARAMS + p];
    const u32 net = p / NET_PARAMS, q = p % NET_PARAMS;
    u32 which, off;
    if (q < OFF_B0) { which = 0; off = q - OFF_W0; }
    else if (q < OFF_W2) { which = 1; off = q - OFF_B0; }
    else if (q < OFF_B2) { which = 2; off = q - OFF_W2; }
    else if (q < OFF_W4) { which = 3; off = q - OFF_B2; }
    else if (q < OFF_B4) { which = 4; off = q - OFF_W4; }
    else { which = 5; off = q - OFF_B4; }
    grads.p[6 * net + which][off] = rnd(acc, mode);
}

// Weight gradient of a planar (N, C, H, W) convolution with few input channels — the model's first
// layer, RGB in. Launched by thin_conv.rs; compiled as one NVRTC unit behind prelude.cuh. cuDNN's
// heuristic gives this shape at batch 64 a direct engine (wgrad_alg1) taking ≈ 9 ms of an
// H100 step: the reduction runs over N·Ho·Wo values for only Co·Ci·KH·KW outputs, which these
// kernels spread over blocks of output rows instead.

struct ThinGeo {
    u32 n, ci, h, w, co, ho, wo, kh, kw, sh, sw, ph, pw;
    u32 tw;     // output columns per tile
    u32 xw;     // shared row stride of the input rows (≥ (tw − 1)·sw + kw, ≡ kw mod 32: the taps of a
                // column fall in distinct banks)
    u32 groups; // thread groups of a block, each taking every groups-th column of a tile
};

// Output channels one block computes (its grid row), and floats of shared memory per block.
#define THIN_CO 16
#define THIN_SMEM 12000

// Partial weight gradients, grid (P, ⌈Co / THIN_CO⌉), block (taps · groups) with taps = Ci·KH·KW:
// thread (g, tap) keeps THIN_CO sums — one per output channel of the block — of dy·x over block
// p's share of the N·Ho output rows, taking columns g, g + groups, … of each tile (one input value
// and THIN_CO broadcast dy values per column). At the end the groups' sums are added in group
// order into part[p·O + co·taps + tap] (O = Co·taps). Every sum runs in a fixed order; the launcher
// adds the P partials in order (sum_partials).
template <typename T>
__device__ void thin_weight_grad_part_k(const T* dy, const T* x, float* part, ThinGeo g, u32 rows, u32 P) {
    __shared__ float sm[THIN_SMEM];
    const u32 taps = g.ci * g.kh * g.kw, co0 = blockIdx.y * THIN_CO, cos = min(THIN_CO, g.co - co0);
    float* sdy = sm;                    // [THIN_CO][tw]
    float* sx = sm + THIN_CO * g.tw;    // [ci][kh][xw]
    const u32 tap = threadIdx.x % taps, grp = threadIdx.x / taps;
    const bool active = grp < g.groups;
    const u32 b = tap % g.kw, a = (tap / g.kw) % g.kh, c = tap / (g.kw * g.kh);
    const u32 chunk = (rows + P - 1) / P, start = min(blockIdx.x * chunk, rows), end = min(start + chunk, rows);
    float acc[THIN_CO];
#pragma unroll
    for (u32 k = 0; k < THIN_CO; ++k) acc[k] = 0.f;
    for (u32 r = start; r < end; ++r) {
        const u32 oy = r % g.ho, ni = r / g.ho;
        for (u32 x0 = 0; x0 < g.wo; x0 += g.tw) {
            const u32 tw = min(g.tw, g.wo - x0);
            __syncthreads();  // every thread has read the previous tile
            for (u32 i = threadIdx.x; i < THIN_CO * tw; i += blockDim.x) {
                const u32 k = i / tw, j = i % tw;
                sdy[k * g.tw + j] = k < cos ? to_acc(dy[(((size_t)ni * g.co + co0 + k) * g.ho + oy) * g.wo + x0 + j]) : 0.f;
            }
            const u32 xs = (tw - 1) * g.sw + g.kw;
            const int ix0 = (int)(x0 * g.sw) - (int)g.pw;
            for (u32 i = threadIdx.x; i < g.ci * g.kh * xs; i += blockDim.x) {
                const u32 j = i % xs, t = i / xs, aa = t % g.kh, cc = t / g.kh;
                const int iy = (int)(oy * g.sh + aa) - (int)g.ph, ix = ix0 + (int)j;
                const bool in = iy >= 0 && iy < (int)g.h && ix >= 0 && ix < (int)g.w;
                sx[t * g.xw + j] = in ? to_acc(x[(((size_t)ni * g.ci + cc) * g.h + iy) * g.w + ix]) : 0.f;
            }
            __syncthreads();
            if (active) {
                const float* s = sx + (c * g.kh + a) * g.xw + b;
                for (u32 j = grp; j < tw; j += g.groups) {
                    const float v = s[j * g.sw];
#pragma unroll
                    for (u32 k = 0; k < THIN_CO; ++k) acc[k] += sdy[k * g.tw + j] * v;
                }
            }
        }
    }
    // The groups' sums, added in group order (the tiles are no longer read).
    __syncthreads();
    float* sums = sm;  // [groups][THIN_CO][taps]
    if (active) {
#pragma unroll
        for (u32 k = 0; k < THIN_CO; ++k) sums[(grp * THIN_CO + k) * taps + tap] = acc[k];
    }
    __syncthreads();
    for (u32 o = threadIdx.x; o < cos * taps; o += blockDim.x) {
        float s = sums[o];
        for (u32 q = 1; q < g.groups; ++q) s += sums[q * THIN_CO * taps + o];
        part[(size_t)blockIdx.x * g.co * taps + (size_t)co0 * taps + o] = s;
    }
}
#define INST_THIN(name, T)                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024) thin_weight_grad_part_##name(const T* dy, const T* x, float* part, ThinGeo g,  \
                                                                                   u32 rows, u32 P) {                                \
        thin_weight_grad_part_k<T>(dy, x, part, g, rows, P);                                                                           \
    }
INST_THIN(f32, float)
INST_THIN(f16, __half)
INST_THIN(bf16, __nv_bfloat16)

// Weight gradient of a planar (N, C, H, W) convolution with few input channels — the model's first
// layer, RGB in. Launched by thin_conv.rs; compiled as one NVRTC unit behind prelude.cuh. cuDNN's
// heuristic gives this shape at batch 64 a direct engine (wgrad_alg1) taking ≈ 9 ms of an
// H100 step: the reduction runs over N·Ho·Wo values for only Co·Ci·KH·KW outputs, which these
// kernels spread over blocks of output rows instead.

struct ThinGeo {
    u32 n, ci, h, w, co, ho, wo, kh, kw, sh, sw, ph, pw;
    u32 tw;  // output columns per tile (the shared tile holds tw of every output channel)
};

// Floats of shared memory per block: a tile of dy (co × tw) and the input rows it reads
// (ci × kh × ((tw - 1)·sw + kw)); the launcher picks tw to fit.
#define THIN_SMEM 12000

// Partial weight gradients, grid (P), block (Co·Ci·KH·KW rounded up to a warp): thread o owns
// output o = ((co·Ci + c)·KH + a)·KW + b and adds dy·x over block p's share of the N·Ho output
// rows, tile by tile, in row then column order (f32), into part[p·O + o]. The launcher sums the P
// partials in order (sum_partials).
template <typename T>
__device__ void thin_weight_grad_part_k(const T* dy, const T* x, float* part, ThinGeo g, u32 rows, u32 P) {
    __shared__ float sm[THIN_SMEM];
    const u32 K = g.kh * g.kw, O = g.co * g.ci * K, xw = (g.tw - 1) * g.sw + g.kw;
    float* sdy = sm;            // [co][tw]
    float* sx = sm + g.co * g.tw;  // [ci][kh][xw]
    const u32 o = threadIdx.x;
    u32 oc = 0, c = 0, a = 0, b = 0;
    if (o < O) {
        b = o % g.kw;
        a = (o / g.kw) % g.kh;
        c = (o / K) % g.ci;
        oc = o / (K * g.ci);
    }
    const u32 chunk = (rows + P - 1) / P, start = min(blockIdx.x * chunk, rows), end = min(start + chunk, rows);
    float acc = 0.f;
    for (u32 r = start; r < end; ++r) {
        const u32 oy = r % g.ho, ni = r / g.ho;
        for (u32 x0 = 0; x0 < g.wo; x0 += g.tw) {
            const u32 tw = min(g.tw, g.wo - x0);
            __syncthreads();  // the previous tile is read by every thread
            for (u32 i = threadIdx.x; i < g.co * g.tw; i += blockDim.x) {
                const u32 k = i / g.tw, j = i % g.tw;
                sdy[i] = j < tw ? to_acc(dy[(((size_t)ni * g.co + k) * g.ho + oy) * g.wo + x0 + j]) : 0.f;
            }
            const int ix0 = (int)(x0 * g.sw) - (int)g.pw;
            for (u32 i = threadIdx.x; i < g.ci * g.kh * xw; i += blockDim.x) {
                const u32 j = i % xw, t = i / xw, aa = t % g.kh, cc = t / g.kh;
                const int iy = (int)(oy * g.sh + aa) - (int)g.ph, ix = ix0 + (int)j;
                const bool in = iy >= 0 && iy < (int)g.h && ix >= 0 && ix < (int)g.w;
                sx[i] = in ? to_acc(x[(((size_t)ni * g.ci + cc) * g.h + iy) * g.w + ix]) : 0.f;
            }
            __syncthreads();
            if (o < O) {
                const float* d = sdy + oc * g.tw;
                const float* s = sx + (c * g.kh + a) * xw + b;
                for (u32 j = 0; j < tw; ++j) acc += d[j] * s[j * g.sw];
            }
        }
    }
    if (o < O) part[(size_t)blockIdx.x * O + o] = acc;
}
#define INST_THIN(name, T)                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024) thin_weight_grad_part_##name(const T* dy, const T* x, float* part, ThinGeo g,        \
                                                                             u32 rows, u32 P) {                                      \
        thin_weight_grad_part_k<T>(dy, x, part, g, rows, P);                                                                                 \
    }
INST_THIN(f32, float)
INST_THIN(f16, __half)
INST_THIN(bf16, __nv_bfloat16)

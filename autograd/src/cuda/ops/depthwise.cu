// Depthwise convolution (one filter per channel, channel multiplier 1) on channels-last storage:
// x (N, H, W, C), y (N, Ho, Wo, C), weight (C, 1, KH, KW). Launched by depthwise.rs; compiled as
// one NVRTC unit behind prelude.cuh. cuDNN runs these shapes in NHWC with direct kernels several
// times slower than its planar ones, and pads the channels first. Consecutive threads take
// consecutive channels, so every load of an activation row is contiguous; every sum runs in a
// fixed order in the accumulator type (f32 for halves), so the bytes are fixed for a shape.

struct DwGeo {
    u32 n, h, w, c, ho, wo, kh, kw, sh, sw, ph, pw;
};

// Channel, column, row and image of element i of an (N, H, W, C) tensor of width w and height h.
__device__ __forceinline__ void dw_position(u32 i, u32 c, u32 w, u32 h, u32& ch, u32& col, u32& row, u32& img) {
    const u32 r = i / c, t = r / w;
    ch = i % c;
    col = r % w;
    row = t % h;
    img = t / h;
}
// y = Σ over the window of x·w, one output value per thread (taps in row-major order).
template <typename T>
__device__ void dw_fwd_k(const T* x, const T* wt, T* y, DwGeo g, u32 total) {
    typedef typename Acc<T>::type A;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        u32 ch, ox, oy, ni;
        dw_position(i, g.c, g.wo, g.ho, ch, ox, oy, ni);
        A acc = (A)0;
        for (u32 a = 0; a < g.kh; ++a) {
            const int iy = (int)(oy * g.sh + a) - (int)g.ph;
            if (iy < 0 || iy >= (int)g.h) continue;
            for (u32 b = 0; b < g.kw; ++b) {
                const int ix = (int)(ox * g.sw + b) - (int)g.pw;
                if (ix < 0 || ix >= (int)g.w) continue;
                acc += to_acc(x[(((size_t)ni * g.h + iy) * g.w + ix) * g.c + ch]) * to_acc(wt[((size_t)ch * g.kh + a) * g.kw + b]);
            }
        }
        y[i] = store<T, A>(acc);
    }
}
// dx = Σ over the outputs whose window covers the input of dy·w, one input value per thread
// (taps in row-major order).
template <typename T>
__device__ void dw_dgrad_k(const T* dy, const T* wt, T* dx, DwGeo g, u32 total) {
    typedef typename Acc<T>::type A;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        u32 ch, ix, iy, ni;
        dw_position(i, g.c, g.w, g.h, ch, ix, iy, ni);
        A acc = (A)0;
        for (u32 a = 0; a < g.kh; ++a) {
            const int ty = (int)(iy + g.ph) - (int)a;
            if (ty < 0 || ty % (int)g.sh != 0) continue;
            const u32 oy = (u32)ty / g.sh;
            if (oy >= g.ho) continue;
            for (u32 b = 0; b < g.kw; ++b) {
                const int tx = (int)(ix + g.pw) - (int)b;
                if (tx < 0 || tx % (int)g.sw != 0) continue;
                const u32 ox = (u32)tx / g.sw;
                if (ox >= g.wo) continue;
                acc += to_acc(dy[(((size_t)ni * g.ho + oy) * g.wo + ox) * g.c + ch]) * to_acc(wt[((size_t)ch * g.kh + a) * g.kw + b]);
            }
        }
        dx[i] = store<T, A>(acc);
    }
}
// Partial weight gradients, grid (P, tiles of 32 channels, KH·KW taps), block (32, 8): block p sums
// dy·x of its tap over its share of the N·Ho·Wo output rows, lane y taking rows start + y,
// start + y + 8, …; the 8 lanes add in order into part[p·C·K + ch·K + tap] (f32). The launcher
// then sums the P partials in order (sum_partials) into the weight gradient.
template <typename T>
__device__ void dw_wgrad_part_k(const T* dy, const T* x, float* part, DwGeo g, u32 rows, u32 P) {
    __shared__ float lanes[8][32];
    const u32 ch = blockIdx.y * 32 + threadIdx.x, tap = blockIdx.z, a = tap / g.kw, b = tap % g.kw, p = blockIdx.x, K = g.kh * g.kw;
    const u32 chunk = (rows + P - 1) / P, start = min(p * chunk, rows), end = min(start + chunk, rows);
    float acc = 0.f;
    if (ch < g.c) {
        for (u32 r = start + threadIdx.y; r < end; r += 8) {
            const u32 ox = r % g.wo, t = r / g.wo, oy = t % g.ho, ni = t / g.ho;
            const int iy = (int)(oy * g.sh + a) - (int)g.ph, ix = (int)(ox * g.sw + b) - (int)g.pw;
            if (iy < 0 || iy >= (int)g.h || ix < 0 || ix >= (int)g.w) continue;
            acc += (float)to_acc(dy[(size_t)r * g.c + ch]) * (float)to_acc(x[(((size_t)ni * g.h + iy) * g.w + ix) * g.c + ch]);
        }
    }
    lanes[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && ch < g.c) {
        float s = lanes[0][threadIdx.x];
        for (int k = 1; k < 8; ++k) s += lanes[k][threadIdx.x];
        part[((size_t)p * g.c + ch) * K + tap] = s;
    }
}
#define INST_DW(name, T)                                                                                                               \
    extern "C" __global__ void dw_fwd_##name(const T* x, const T* w, T* y, DwGeo g, u32 total) { dw_fwd_k<T>(x, w, y, g, total); }   \
    extern "C" __global__ void dw_dgrad_##name(const T* dy, const T* w, T* dx, DwGeo g, u32 total) {                                  \
        dw_dgrad_k<T>(dy, w, dx, g, total);                                                                                            \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) dw_wgrad_part_##name(const T* dy, const T* x, float* part, DwGeo g, u32 rows,   \
                                                                          u32 P) {                                                     \
        dw_wgrad_part_k<T>(dy, x, part, g, rows, P);                                                                                   \
    }
INST_DW(f32, float)
INST_DW(f16, __half)
INST_DW(bf16, __nv_bfloat16)

// Max pooling and nearest upsampling (NCHW, or NHWC for channels-last data), forward and backward.
// Launched by pool.rs; compiled as one NVRTC unit behind prelude.cuh (see mod.rs).

// ---- max pooling ------------------------------------------------------------------------------------
struct PoolGeo { u32 planes, h, w, oh, ow, k, s, p, c, cl; };
// Element (y, x) of plane pl (= image · c + channel) in an H×W map: N, C, H, W storage, or
// N, H, W, C when g.cl (threads still walk planes; indices count positions within a plane).
__device__ __forceinline__ size_t pool_at(const PoolGeo& g, u32 pl, u32 y, u32 x, u32 H, u32 W) {
    if (!g.cl) return ((size_t)pl * H + y) * W + x;
    const u32 img = pl / g.c, ch = pl % g.c;
    return (((size_t)img * H + y) * W + x) * g.c + ch;
}
template <typename T>
__device__ void maxpool_fwd_k(const T* x, T* y, i64* yi, PoolGeo g) {
    u32 total = g.planes * g.oh * g.ow;
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += blockDim.x * gridDim.x) {
        u32 ox = t % g.ow, oy = (t / g.ow) % g.oh, pl = t / (g.ow * g.oh);
        float best = -F_INF;
        T bv = from_f<T>(-F_INF);
        int bi = -1;
        for (u32 ky = 0; ky < g.k; ++ky) {
            int iy = (int)(oy * g.s + ky) - (int)g.p;
            if (iy < 0 || iy >= (int)g.h) continue;
            for (u32 kx = 0; kx < g.k; ++kx) {
                int ix = (int)(ox * g.s + kx) - (int)g.p;
                if (ix < 0 || ix >= (int)g.w) continue;
                int kk = iy * (int)g.w + ix;
                T raw = x[pool_at(g, pl, (u32)iy, (u32)ix, g.h, g.w)];
                float v = (float)to_acc(raw);
                if (bi < 0 || v > best || (is_nan(v) && !is_nan(best))) { best = v; bv = raw; bi = kk; }
            }
        }
        const size_t at = pool_at(g, pl, oy, ox, g.oh, g.ow);
        y[at] = bv;
        yi[at] = bi < 0 ? 0 : bi;
    }
}
template <>
__device__ void maxpool_fwd_k<double>(const double* x, double* y, i64* yi, PoolGeo g) {
    u32 total = g.planes * g.oh * g.ow;
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += blockDim.x * gridDim.x) {
        u32 ox = t % g.ow, oy = (t / g.ow) % g.oh, pl = t / (g.ow * g.oh);
        double best = -D_INF;
        int bi = -1;
        for (u32 ky = 0; ky < g.k; ++ky) {
            int iy = (int)(oy * g.s + ky) - (int)g.p;
            if (iy < 0 || iy >= (int)g.h) continue;
            for (u32 kx = 0; kx < g.k; ++kx) {
                int ix = (int)(ox * g.s + kx) - (int)g.p;
                if (ix < 0 || ix >= (int)g.w) continue;
                int kk = iy * (int)g.w + ix;
                double v = x[pool_at(g, pl, (u32)iy, (u32)ix, g.h, g.w)];
                if (bi < 0 || v > best || (is_nan(v) && !is_nan(best))) { best = v; bi = kk; }
            }
        }
        const size_t at = pool_at(g, pl, oy, ox, g.oh, g.ow);
        y[at] = best;
        yi[at] = bi < 0 ? 0 : bi;
    }
}
// dx[pl, k] = sum over outputs (ascending) whose argmax is k.
template <typename T>
__device__ void maxpool_bwd_k(const T* dy, const i64* idx, T* dx, PoolGeo g) {
    typedef typename Acc<T>::type A;
    u32 total = g.planes * g.h * g.w;
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += blockDim.x * gridDim.x) {
        u32 ix = t % g.w, iy = (t / g.w) % g.h, pl = t / (g.w * g.h);
        i64 me = (i64)iy * g.w + ix;
        int oy0 = ((int)iy + (int)g.p - (int)g.k + (int)g.s) / (int)g.s;  // ceil((iy+p-k+1)/s)
        if ((int)iy + (int)g.p - (int)g.k + 1 <= 0) oy0 = 0;
        int ox0 = ((int)ix + (int)g.p - (int)g.k + (int)g.s) / (int)g.s;
        if ((int)ix + (int)g.p - (int)g.k + 1 <= 0) ox0 = 0;
        int oy1 = ((int)iy + (int)g.p) / (int)g.s;
        int ox1 = ((int)ix + (int)g.p) / (int)g.s;
        if (oy1 >= (int)g.oh) oy1 = (int)g.oh - 1;
        if (ox1 >= (int)g.ow) ox1 = (int)g.ow - 1;
        T acc = from_d<T>(0.0);
        for (int oy = oy0; oy <= oy1; ++oy)
            for (int ox = ox0; ox <= ox1; ++ox) {
                const size_t q = pool_at(g, pl, (u32)oy, (u32)ox, g.oh, g.ow);
                if (idx[q] == me) acc = store<T, A>(to_acc(acc) + to_acc(dy[q]));
            }
        dx[pool_at(g, pl, iy, ix, g.h, g.w)] = acc;
    }
}


// ---- nearest upsampling by an integer factor (NCHW) ---------------------------------------------
// Forward: one thread per input element writes its f×f block. Backward: one thread per input
// element sums its f×f block of output gradients in a fixed order (row-major), no atomics.
template <typename T>
__device__ void upsample_fwd_k(const T* x, T* y, u32 n, u32 h, u32 w, u32 f) {
    const u32 W = w * f;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const u32 c = i % w, t = i / w, r = t % h, pl = t / h;
        const T v = x[i];
        T* o = y + ((size_t)pl * h * f + (size_t)r * f) * W + (size_t)c * f;
        for (u32 a = 0; a < f; ++a)
            for (u32 b = 0; b < f; ++b) o[(size_t)a * W + b] = v;
    }
}
template <typename T>
__device__ void upsample_bwd_k(const T* dy, T* dx, u32 n, u32 h, u32 w, u32 f) {
    typedef typename Acc<T>::type A;
    const u32 W = w * f;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const u32 c = i % w, t = i / w, r = t % h, pl = t / h;
        const T* g = dy + ((size_t)pl * h * f + (size_t)r * f) * W + (size_t)c * f;
        A s = (A)0;
        for (u32 a = 0; a < f; ++a)
            for (u32 b = 0; b < f; ++b) s += to_acc(g[(size_t)a * W + b]);
        dx[i] = store<T, A>(s);
    }
}
// N, H, W, C storage: thread i takes input element i (channel i % c of position i / c) and
// writes (forward) or sums in row-major order (backward) the same channel of its f×f block.
template <typename T>
__device__ void upsample_fwd_nhwc_k(const T* x, T* y, u32 n, u32 c, u32 h, u32 w, u32 f) {
    const u32 W = w * f;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const u32 ch = i % c, p = i / c, col = p % w, t = p / w, r = t % h, img = t / h;
        const T v = x[i];
        T* o = y + (((size_t)img * h * f + (size_t)r * f) * W + (size_t)col * f) * c + ch;
        for (u32 a = 0; a < f; ++a)
            for (u32 b = 0; b < f; ++b) o[((size_t)a * W + b) * c] = v;
    }
}
template <typename T>
__device__ void upsample_bwd_nhwc_k(const T* dy, T* dx, u32 n, u32 c, u32 h, u32 w, u32 f) {
    typedef typename Acc<T>::type A;
    const u32 W = w * f;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const u32 ch = i % c, p = i / c, col = p % w, t = p / w, r = t % h, img = t / h;
        const T* g = dy + (((size_t)img * h * f + (size_t)r * f) * W + (size_t)col * f) * c + ch;
        A s = (A)0;
        for (u32 a = 0; a < f; ++a)
            for (u32 b = 0; b < f; ++b) s += to_acc(g[((size_t)a * W + b) * c]);
        dx[i] = store<T, A>(s);
    }
}
#define INST_UPSAMPLE_NHWC(name, T) \
    extern "C" __global__ void upsample_fwd_nhwc_##name(const T* x, T* y, u32 n, u32 c, u32 h, u32 w, u32 f) { upsample_fwd_nhwc_k<T>(x, y, n, c, h, w, f); } \
    extern "C" __global__ void upsample_bwd_nhwc_##name(const T* dy, T* dx, u32 n, u32 c, u32 h, u32 w, u32 f) { upsample_bwd_nhwc_k<T>(dy, dx, n, c, h, w, f); }
FLOAT_TYPES(INST_UPSAMPLE_NHWC)
#define INST_UPSAMPLE(name, T) \
    extern "C" __global__ void upsample_fwd_##name(const T* x, T* y, u32 n, u32 h, u32 w, u32 f) { upsample_fwd_k<T>(x, y, n, h, w, f); } \
    extern "C" __global__ void upsample_bwd_##name(const T* dy, T* dx, u32 n, u32 h, u32 w, u32 f) { upsample_bwd_k<T>(dy, dx, n, h, w, f); }
FLOAT_TYPES(INST_UPSAMPLE)


// ---- instantiations -------------------------------------------------------------------------------
#define INST_FLOAT_POOL(name, T)                                                                                    \
    extern "C" __global__ void maxpool_fwd_##name(const T* x, T* y, i64* yi, PoolGeo g) { maxpool_fwd_k<T>(x, y, yi, g); } \
    extern "C" __global__ void maxpool_bwd_##name(const T* dy, const i64* idx, T* dx, PoolGeo g) { maxpool_bwd_k<T>(dy, idx, dx, g); }
FLOAT_TYPES(INST_FLOAT_POOL)

// Max pooling and nearest upsampling (NCHW), forward and backward.
// Launched by pool.rs; compiled as one NVRTC unit behind prelude.cuh (see mod.rs).

// ---- max pooling ------------------------------------------------------------------------------------
struct PoolGeo { u32 planes, h, w, oh, ow, k, s, p; };
template <typename T>
__device__ void maxpool_fwd_k(const T* x, T* y, i64* yi, PoolGeo g) {
    u32 total = g.planes * g.oh * g.ow;
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += blockDim.x * gridDim.x) {
        u32 ox = t % g.ow, oy = (t / g.ow) % g.oh, pl = t / (g.ow * g.oh);
        const T* xp = x + (size_t)pl * g.h * g.w;
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
                T raw = xp[kk];
                float v = (float)to_acc(raw);
                if (bi < 0 || v > best || (is_nan(v) && !is_nan(best))) { best = v; bv = raw; bi = kk; }
            }
        }
        y[t] = bv;
        yi[t] = bi < 0 ? 0 : bi;
    }
}
template <>
__device__ void maxpool_fwd_k<double>(const double* x, double* y, i64* yi, PoolGeo g) {
    u32 total = g.planes * g.oh * g.ow;
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += blockDim.x * gridDim.x) {
        u32 ox = t % g.ow, oy = (t / g.ow) % g.oh, pl = t / (g.ow * g.oh);
        const double* xp = x + (size_t)pl * g.h * g.w;
        double best = -D_INF;
        int bi = -1;
        for (u32 ky = 0; ky < g.k; ++ky) {
            int iy = (int)(oy * g.s + ky) - (int)g.p;
            if (iy < 0 || iy >= (int)g.h) continue;
            for (u32 kx = 0; kx < g.k; ++kx) {
                int ix = (int)(ox * g.s + kx) - (int)g.p;
                if (ix < 0 || ix >= (int)g.w) continue;
                int kk = iy * (int)g.w + ix;
                double v = xp[kk];
                if (bi < 0 || v > best || (is_nan(v) && !is_nan(best))) { best = v; bi = kk; }
            }
        }
        y[t] = best;
        yi[t] = bi < 0 ? 0 : bi;
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
        size_t base = (size_t)pl * g.oh * g.ow;
        for (int oy = oy0; oy <= oy1; ++oy)
            for (int ox = ox0; ox <= ox1; ++ox) {
                size_t q = base + (size_t)oy * g.ow + ox;
                if (idx[q] == me) acc = store<T, A>(to_acc(acc) + to_acc(dy[q]));
            }
        dx[t] = acc;
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

// Softmax over rows (one block or one warp per row) and over a middle axis.
// Launched by softmax.rs; compiled as one NVRTC unit behind prelude.cuh (see mod.rs).

// ---- softmax ---------------------------------------------------------------------------------------------
// Rows (inner == 1): one block per row; max and sum by fixed-order trees (sum in f64 for f32/f64).
template <typename T>
__device__ void softmax_rows_k(const T* x, T* y, u32 d, int lg) {
    typedef typename Acc<T>::type A;
    typedef typename SumAcc<T>::type S;
    __shared__ A sm[256];
    __shared__ S ss[256];
    const T* row = x + (size_t)blockIdx.x * d;
    T* out = y + (size_t)blockIdx.x * d;
    u32 t = threadIdx.x;
    A m = -(A)F_INF;
    for (u32 j = t; j < d; j += 256) { A v = to_acc(row[j]); if (v > m || is_nan(v)) m = v; }
    sm[t] = m;
    __syncthreads();
    for (u32 k = 128; k > 0; k >>= 1) {
        if (t < k) { A o = sm[t + k]; if (o > sm[t] || is_nan(o)) sm[t] = o; }
        __syncthreads();
    }
    m = sm[0];
    S s = 0;
    for (u32 j = t; j < d; j += 256) s += (S)m_exp(to_acc(row[j]) - m);
    ss[t] = s;
    __syncthreads();
    for (u32 k = 128; k > 0; k >>= 1) {
        if (t < k) ss[t] += ss[t + k];
        __syncthreads();
    }
    A st = (A)ss[0];
    A ls = m_log(st);
    for (u32 j = t; j < d; j += 256) {
        A xm = to_acc(row[j]) - m;
        out[j] = store<T, A>(lg ? xm - ls : m_exp(xm) / st);
    }
}
// Columns (inner > 1): one thread per (outer, inner) position, sequential over d.
template <typename T>
__device__ void softmax_cols_k(const T* x, T* y, u32 n, u32 d, u32 inner, int lg) {
    typedef typename Acc<T>::type A;
    typedef typename SumAcc<T>::type S;
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += blockDim.x * gridDim.x) {
        u32 o = k / inner, i = k % inner;
        const T* b = x + (size_t)o * d * inner + i;
        T* ob = y + (size_t)o * d * inner + i;
        A m = -(A)F_INF;
        for (u32 j = 0; j < d; ++j) { A v = to_acc(b[(size_t)j * inner]); if (v > m || is_nan(v)) m = v; }
        S s = 0;
        for (u32 j = 0; j < d; ++j) s += (S)m_exp(to_acc(b[(size_t)j * inner]) - m);
        A st = (A)s;
        A ls = m_log(st);
        for (u32 j = 0; j < d; ++j) {
            A xm = to_acc(b[(size_t)j * inner]) - m;
            ob[(size_t)j * inner] = store<T, A>(lg ? xm - ls : m_exp(xm) / st);
        }
    }
}
#define INST_SOFTMAX(name, T) \
    extern "C" __global__ void softmax_rows_##name(const T* x, T* y, u32 d, int lg) { softmax_rows_k<T>(x, y, d, lg); } \
    extern "C" __global__ void softmax_cols_##name(const T* x, T* y, u32 n, u32 d, u32 inner, int lg) { softmax_cols_k<T>(x, y, n, d, inner, lg); }
FLOAT_TYPES(INST_SOFTMAX)

// ---- softmax over short rows (d ≤ 1024) -------------------------------------------------------------
// One warp per row, the row held in registers (E values per lane, E = the power of two ≥ d/32, so
// short rows do not pay for 32 slots): one read, one write, one exp per element. Max and sum by an
// xor-shuffle butterfly: floating-point addition is commutative, so every lane ends with the same
// bits, and the order is fixed (deterministic). Sum in f64 for f32/f64, as the block kernel.
template <typename T, int E>
__device__ void softmax_warp_k(const T* x, T* y, u32 rows, u32 d, int lg) {
    typedef typename Acc<T>::type A;
    typedef typename SumAcc<T>::type S;
    const u32 lane = threadIdx.x & 31u;
    const u32 wpb = blockDim.x >> 5;
    for (u32 r = blockIdx.x * wpb + (threadIdx.x >> 5); r < rows; r += gridDim.x * wpb) {
        const T* row = x + (size_t)r * d;
        T* out = y + (size_t)r * d;
        A v[E];
        A m = -(A)F_INF;
#pragma unroll
        for (int k = 0; k < E; ++k) {
            const u32 j = lane + 32u * k;
            v[k] = j < d ? to_acc(row[j]) : -(A)F_INF;
        }
#pragma unroll
        for (int k = 0; k < E; ++k) {
            if (lane + 32u * k < d && (v[k] > m || is_nan(v[k]))) m = v[k];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const A q = __shfl_xor_sync(0xffffffffu, m, o);
            if (q > m || is_nan(q)) m = q;
        }
        S s = 0;
#pragma unroll
        for (int k = 0; k < E; ++k) {
            // x - max stays in v for the log form; the exponential replaces it otherwise.
            const A xm = v[k] - m;
            const A e = lane + 32u * k < d ? m_exp(xm) : (A)0;
            s += (S)e;
            v[k] = lg ? xm : e;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const A st = (A)s;
        const A ls = m_log(st);
#pragma unroll
        for (int k = 0; k < E; ++k) {
            const u32 j = lane + 32u * k;
            if (j < d) out[j] = store<T, A>(lg ? v[k] - ls : v[k] / st);
        }
    }
}
#define INST_SOFTMAX_WARP_E(name, T, E) \
    extern "C" __global__ void softmax_warp##E##_##name(const T* x, T* y, u32 rows, u32 d, int lg) { softmax_warp_k<T, E>(x, y, rows, d, lg); }
#define INST_SOFTMAX_WARP(name, T) \
    INST_SOFTMAX_WARP_E(name, T, 4) INST_SOFTMAX_WARP_E(name, T, 8) INST_SOFTMAX_WARP_E(name, T, 16) INST_SOFTMAX_WARP_E(name, T, 32)
FLOAT_TYPES(INST_SOFTMAX_WARP)

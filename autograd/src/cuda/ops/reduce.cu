// Reductions: sums and extrema over rows, columns and middle axes (fixed-order trees), and the batch
// sum of per-image weight-gradient partials.
// Launched by reduce.rs; compiled as one NVRTC unit behind prelude.cuh (see mod.rs).

// Sum of `n` f32 partials of `len` values each, in order ((p0 + p1) + p2) + …, stored in the
// output type with one rounding: the batch sum of a 1×1 convolution's weight gradient (one
// batched GEMM writes a partial per image; this adds them).
template <typename D>
__device__ void sum_partials_k(const float* p, D* y, u32 n, u32 len) {
    for (u32 j = blockIdx.x * blockDim.x + threadIdx.x; j < len; j += blockDim.x * gridDim.x) {
        float acc = p[j];
        for (u32 i = 1; i < n; ++i) acc += p[(size_t)i * len + j];
        y[j] = store<D, float>(acc);
    }
}
extern "C" __global__ void sum_partials_f32(const float* p, float* y, u32 n, u32 len) { sum_partials_k<float>(p, y, n, len); }
extern "C" __global__ void sum_partials_bf16(const float* p, __nv_bfloat16* y, u32 n, u32 len) { sum_partials_k<__nv_bfloat16>(p, y, n, len); }
extern "C" __global__ void sum_partials_f16(const float* p, __half* y, u32 n, u32 len) { sum_partials_k<__half>(p, y, n, len); }

// ---- reductions (fixed-order trees, no atomics) -----------------------------------------------------
// op: 0 sum 1 max 2 min 3 argmax 4 argmin.
template <typename V> struct Cand { V v; i64 i; };

template <typename V> __device__ __forceinline__ Cand<V> pick(Cand<V> a, Cand<V> b, bool mx) {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    bool an = is_nan(a.v), bn = is_nan(b.v);
    if (an && bn) return a.i < b.i ? a : b;
    if (an) return a;
    if (bn) return b;
    if (mx ? (a.v > b.v) : (a.v < b.v)) return a;
    if (mx ? (b.v > a.v) : (b.v < a.v)) return b;
    return a.i < b.i ? a : b;
}

#define RBLOCK 256
// inner == 1: one block per output row, strided per thread, then a fixed shared-memory tree.
template <typename T>
__device__ void reduce_rows_k(const T* x, void* yv, u32 d, int op) {
    typedef typename SumAcc<T>::type S;
    typedef typename Acc<T>::type A;
    __shared__ S ss[RBLOCK];
    __shared__ A sv[RBLOCK];
    __shared__ i64 si[RBLOCK];
    const T* row = x + (size_t)blockIdx.x * d;
    u32 t = threadIdx.x;
    if (op == 0) {
        S acc = 0;
        for (u32 j = t; j < d; j += RBLOCK) acc += (S)to_acc(row[j]);
        ss[t] = acc;
        __syncthreads();
        for (u32 s = RBLOCK / 2; s > 0; s >>= 1) {
            if (t < s) ss[t] += ss[t + s];
            __syncthreads();
        }
        if (t == 0) ((T*)yv)[blockIdx.x] = store<T, A>((A)ss[0]);
        return;
    }
    bool mx = (op == 1 || op == 3);
    Cand<A> c; c.v = 0; c.i = -1;
    for (u32 j = t; j < d; j += RBLOCK) {
        Cand<A> n; n.v = to_acc(row[j]); n.i = j;
        c = pick(c, n, mx);
    }
    sv[t] = c.v; si[t] = c.i;
    __syncthreads();
    for (u32 s = RBLOCK / 2; s > 0; s >>= 1) {
        if (t < s) {
            Cand<A> a, b; a.v = sv[t]; a.i = si[t]; b.v = sv[t + s]; b.i = si[t + s];
            Cand<A> r = pick(a, b, mx);
            sv[t] = r.v; si[t] = r.i;
        }
        __syncthreads();
    }
    if (t == 0) {
        if (op >= 3) ((i64*)yv)[blockIdx.x] = si[0] < 0 ? 0 : si[0];
        else ((T*)yv)[blockIdx.x] = row[si[0] < 0 ? 0 : si[0]];
    }
}

// inner > 1: block (32, 8) covers 32 columns; the 8 row-groups combine in order.
template <typename T>
__device__ void reduce_cols_k(const T* x, void* yv, u32 d, u32 inner, int op) {
    typedef typename SumAcc<T>::type S;
    typedef typename Acc<T>::type A;
    __shared__ S ss[8][33];
    __shared__ A sv[8][33];
    __shared__ i64 si[8][33];
    u32 tx = threadIdx.x, ty = threadIdx.y;
    u32 col = blockIdx.x * 32 + tx;
    u32 o = blockIdx.y;
    bool ok = col < inner;
    const T* base = x + (size_t)o * d * inner + col;
    if (op == 0) {
        S acc = 0;
        if (ok) for (u32 j = ty; j < d; j += 8) acc += (S)to_acc(base[(size_t)j * inner]);
        ss[ty][tx] = acc;
        __syncthreads();
        if (ty == 0 && ok) {
            S r = ss[0][tx];
            for (int k = 1; k < 8; ++k) r += ss[k][tx];
            ((T*)yv)[(size_t)o * inner + col] = store<T, A>((A)r);
        }
        return;
    }
    bool mx = (op == 1 || op == 3);
    Cand<A> c; c.v = 0; c.i = -1;
    if (ok) for (u32 j = ty; j < d; j += 8) {
        Cand<A> n; n.v = to_acc(base[(size_t)j * inner]); n.i = j;
        c = pick(c, n, mx);
    }
    sv[ty][tx] = c.v; si[ty][tx] = c.i;
    __syncthreads();
    if (ty == 0 && ok) {
        Cand<A> r; r.v = sv[0][tx]; r.i = si[0][tx];
        for (int k = 1; k < 8; ++k) { Cand<A> b; b.v = sv[k][tx]; b.i = si[k][tx]; r = pick(r, b, mx); }
        i64 bi = r.i < 0 ? 0 : r.i;
        if (op >= 3) ((i64*)yv)[(size_t)o * inner + col] = bi;
        else ((T*)yv)[(size_t)o * inner + col] = base[(size_t)bi * inner];
    }
}

// Sum over the outer and inner dims of [outer, mid, inner], one block (256) per mid index: each
// thread sums its stride of the outer·inner values in order, then a fixed tree over the block.
// One launch for a bias gradient (N, H, W summed) where three one-dim reductions took three.
#define SUM_MID_LOADS 8
template <typename T>
__device__ void sum_mid_k(const T* x, T* y, u32 outer, u32 mid, u32 inner) {
    typedef typename SumAcc<T>::type S;
    typedef typename Acc<T>::type A;
    __shared__ S sh[256];
    const u32 m = blockIdx.x, t = threadIdx.x, total = outer * inner;
    // The thread's elements j = t, t + 256, … as (o, i) = (j / inner, j % inner), stepped without
    // a division; SUM_MID_LOADS of them loaded before they are added, in j order (the sum is the
    // one-at-a-time loop's, bit for bit; only more loads are in flight).
    const u32 dq = 256u / inner, dr = 256u % inner;
    u32 o = t / inner, i = t - o * inner;
    S acc = 0;
    u32 j = t;
    for (; j + (SUM_MID_LOADS - 1) * 256u < total; j += SUM_MID_LOADS * 256u) {
        A v[SUM_MID_LOADS];
#pragma unroll
        for (int k = 0; k < SUM_MID_LOADS; ++k) {
            v[k] = to_acc(x[((size_t)o * mid + m) * inner + i]);
            o += dq;
            i += dr;
            if (i >= inner) {
                i -= inner;
                ++o;
            }
        }
#pragma unroll
        for (int k = 0; k < SUM_MID_LOADS; ++k) acc += (S)v[k];
    }
    for (; j < total; j += 256u) {
        acc += (S)to_acc(x[((size_t)o * mid + m) * inner + i]);
        o += dq;
        i += dr;
        if (i >= inner) {
            i -= inner;
            ++o;
        }
    }
    sh[t] = acc;
    __syncthreads();
    for (u32 w = 128; w > 0; w >>= 1) {
        if (t < w) sh[t] += sh[t + w];
        __syncthreads();
    }
    if (t == 0) y[m] = store<T, A>((A)sh[0]);
}


// ---- instantiations -------------------------------------------------------------------------------
#define INST_SUM_MID(name, T) \
    extern "C" __global__ void __launch_bounds__(256) sum_mid_##name(const T* x, T* y, u32 outer, u32 mid, u32 inner) { sum_mid_k<T>(x, y, outer, mid, inner); }
INST_SUM_MID(f32, float)
INST_SUM_MID(f64, double)
INST_SUM_MID(f16, __half)
INST_SUM_MID(bf16, __nv_bfloat16)

#define INST_ALL_RED(name, T)                                                                                        \
    extern "C" __global__ void reduce_rows_##name(const T* x, void* y, u32 d, int op) { reduce_rows_k<T>(x, y, d, op); } \
    extern "C" __global__ void reduce_cols_##name(const T* x, void* y, u32 d, u32 inner, int op) { reduce_cols_k<T>(x, y, d, inner, op); }
ALL_TYPES(INST_ALL_RED)

// ptl-autograd CUDA kernels, compiled once per process with NVRTC (see cuda/device.rs).
//
// Rules every kernel follows:
// - every output element is written by exactly one thread (no pre-zeroed outputs assumed);
// - no atomics: reductions combine in a fixed order, so results are bit-identical run to run;
// - f16/bf16 are loaded into f32, computed in f32 and rounded once on store.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned char u8;
typedef unsigned int u32;

#define MAXD 8
#define F_INF __int_as_float(0x7f800000)
#define D_INF __longlong_as_double(0x7ff0000000000000LL)

// Up to three strided operands over one logical shape (offsets and strides in elements).
struct Strided {
    u32 rank;
    u32 shape[MAXD];
    u32 st[3][MAXD];
    u32 off[3];
};

__device__ __forceinline__ void strided_offsets(const Strided& g, u32 i, u32* o, int nops) {
    u32 a = g.off[0], b = g.off[1], c = g.off[2];
    for (int d = (int)g.rank - 1; d >= 0; --d) {
        u32 s = g.shape[d];
        u32 q = i / s;
        u32 r = i - q * s;
        i = q;
        a += r * g.st[0][d];
        if (nops > 1) b += r * g.st[1][d];
        if (nops > 2) c += r * g.st[2][d];
    }
    o[0] = a; o[1] = b; o[2] = c;
}

// ---- scalar conversions -------------------------------------------------------------------------
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ i64 to_acc(i64 x) { return x; }
__device__ __forceinline__ i64 to_acc(u8 x) { return (i64)x; }

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };
template <> struct Acc<i64> { typedef i64 type; };
template <> struct Acc<u8> { typedef i64 type; };

// Sums of f32 accumulate in f64 like the CPU backend; halves accumulate in f32.
template <typename T> struct SumAcc { typedef float type; };
template <> struct SumAcc<float> { typedef double type; };
template <> struct SumAcc<double> { typedef double type; };
template <> struct SumAcc<i64> { typedef i64 type; };
template <> struct SumAcc<u8> { typedef i64 type; };

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_f<double>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T> __device__ __forceinline__ T from_d(double x);
template <> __device__ __forceinline__ float from_d<float>(double x) { return (float)x; }
template <> __device__ __forceinline__ double from_d<double>(double x) { return x; }
template <> __device__ __forceinline__ __half from_d<__half>(double x) { return __double2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_d<__nv_bfloat16>(double x) { return __double2bfloat16(x); }
template <> __device__ __forceinline__ i64 from_d<i64>(double x) {
    if (x != x) return 0;
    if (x >= 9.2233720368547758e18) return 0x7fffffffffffffffLL;
    if (x <= -9.2233720368547758e18) return (i64)0x8000000000000000ULL;
    return (i64)x;
}
template <> __device__ __forceinline__ u8 from_d<u8>(double x) {
    if (!(x > 0.0)) return 0;
    if (x >= 255.0) return 255;
    return (u8)x;
}

__device__ __forceinline__ double to_d(float x) { return x; }
__device__ __forceinline__ double to_d(double x) { return x; }
__device__ __forceinline__ double to_d(__half x) { return (double)__half2float(x); }
__device__ __forceinline__ double to_d(__nv_bfloat16 x) { return (double)__bfloat162float(x); }
__device__ __forceinline__ double to_d(i64 x) { return (double)x; }
__device__ __forceinline__ double to_d(u8 x) { return (double)x; }

// Accumulator back to storage type.
template <typename T, typename A> __device__ __forceinline__ T store(A x);
template <> __device__ __forceinline__ float store<float, float>(float x) { return x; }
template <> __device__ __forceinline__ float store<float, double>(double x) { return (float)x; }
template <> __device__ __forceinline__ double store<double, double>(double x) { return x; }
template <> __device__ __forceinline__ __half store<__half, float>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 store<__nv_bfloat16, float>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ i64 store<i64, i64>(i64 x) { return x; }
template <> __device__ __forceinline__ u8 store<u8, i64>(i64 x) { return (u8)x; }

// ---- math overloads ------------------------------------------------------------------------------
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double m_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_atan(float x) { return atanf(x); }
__device__ __forceinline__ double m_atan(double x) { return atan(x); }
__device__ __forceinline__ float m_floor(float x) { return floorf(x); }
__device__ __forceinline__ double m_floor(double x) { return floor(x); }
__device__ __forceinline__ float m_ceil(float x) { return ceilf(x); }
__device__ __forceinline__ double m_ceil(double x) { return ceil(x); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float m_atan2(float x, float y) { return atan2f(x, y); }
__device__ __forceinline__ double m_atan2(double x, double y) { return atan2(x, y); }
template <typename A> __device__ __forceinline__ bool is_nan(A x) { return x != x; }

template <typename A> __device__ __forceinline__ A sigm(A x) { return (A)1 / ((A)1 + m_exp(-x)); }

// Unary op codes (match cuda/ops.rs).
template <typename A> __device__ __forceinline__ A unary_apply(int op, A x, A p0, A p1) {
    switch (op) {
    case 0: return -x;
    case 1: return m_exp(x);
    case 2: return m_log(x);
    case 3: return m_sqrt(x);
    case 4: return m_abs(x);
    case 5: return sigm(x);
    case 6: return x * sigm(x);
    case 7: return m_tanh(x);
    case 8: return x > (A)20 ? x : m_log1p(m_exp(x));
    case 9: return m_atan(x);
    case 10: return (A)1 / x;
    case 11: return x > (A)0 ? (A)1 : (x < (A)0 ? (A)-1 : x * (A)0);
    case 12: return x * x;
    case 13: return x > (A)0 ? x : (A)0;
    case 14: return m_floor(x);
    case 15: return m_ceil(x);
    case 16: return m_pow(x, p0);
    case 17: { if (is_nan(x)) return x; A y = x > p0 ? x : p0; return y < p1 ? y : p1; }
    case 18: return x * p0 + p1;
    case 19: { A s = sigm(x); return s * ((A)1 + x * ((A)1 - s)); }
    }
    return x;
}

template <typename T>
__device__ void unary_k(const T* x, T* y, u32 n, int op, double p0, double p1) {
    typedef typename Acc<T>::type A;
    A a0 = (A)p0, a1 = (A)p1;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        y[i] = store<T, A>(unary_apply<A>(op, to_acc(x[i]), a0, a1));
}

// Integer unary: 0 neg, 1 abs, 2 affine (integral mul/add), 3 clamp (through f64 like the CPU).
__device__ void unary_i64_k(const i64* x, i64* y, u32 n, int op, double p0, double p1) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        i64 v = x[i];
        i64 r;
        switch (op) {
        case 0: r = -v; break;
        case 1: r = v < 0 ? -v : v; break;
        case 2: r = v * (i64)p0 + (i64)p1; break;
        default: { double d = (double)v; d = d < p0 ? p0 : d; d = d > p1 ? p1 : d; r = from_d<i64>(d); }
        }
        y[i] = r;
    }
}

// Binary op codes: 0 add 1 sub 2 mul 3 div 4 max 5 min 6 pow 7 atan2.
template <typename A> __device__ __forceinline__ A binary_apply(int op, A a, A b) {
    switch (op) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return a / b;
    case 4: return (is_nan(a) || is_nan(b)) ? a + b : (a > b ? a : b);
    case 5: return (is_nan(a) || is_nan(b)) ? a + b : (a < b ? a : b);
    case 6: return m_pow(a, b);
    case 7: return m_atan2(a, b);
    case 8: return (a > (A)0 ? a : (A)0) - a * b + m_log1p(m_exp(-m_abs(a)));
    }
    return a;
}
__device__ __forceinline__ i64 floordiv(i64 a, i64 b) {
    // Euclidean division like Rust's div_euclid.
    if (b == 0) return 0;
    i64 q = a / b;
    i64 r = a - q * b;
    if (r < 0) q = b > 0 ? q - 1 : q + 1;
    return q;
}
template <> __device__ __forceinline__ i64 binary_apply<i64>(int op, i64 a, i64 b) {
    switch (op) {
    case 0: return (i64)((unsigned long long)a + (unsigned long long)b);
    case 1: return (i64)((unsigned long long)a - (unsigned long long)b);
    case 2: return (i64)((unsigned long long)a * (unsigned long long)b);
    case 3: return floordiv(a, b);
    case 4: return a > b ? a : b;
    case 5: return a < b ? a : b;
    }
    return 0;
}

template <typename T>
__device__ void binary_c_k(const T* a, const T* b, T* y, u32 n, int op) {
    typedef typename Acc<T>::type A;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        y[i] = store<T, A>(binary_apply<A>(op, to_acc(a[i]), to_acc(b[i])));
}
template <typename T>
__device__ void binary_s_k(const T* a, const T* b, T* y, u32 n, int op, Strided g) {
    typedef typename Acc<T>::type A;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        u32 o[3];
        strided_offsets(g, i, o, 2);
        y[i] = store<T, A>(binary_apply<A>(op, to_acc(a[o[0]]), to_acc(b[o[1]])));
    }
}
// u8 / bool arithmetic (wrapping; bool results clamp to 1).
__device__ __forceinline__ u8 binary_u8(int op, u8 a, u8 b, int is_bool) {
    u8 r;
    switch (op) {
    case 0: r = (u8)(a + b); break;
    case 1: r = (u8)(a - b); break;
    case 2: r = (u8)(a * b); break;
    case 4: r = a > b ? a : b; break;
    default: r = a < b ? a : b; break;
    }
    return is_bool ? (r > 1 ? 1 : r) : r;
}
extern "C" __global__ void binary_s_u8(const u8* a, const u8* b, u8* y, u32 n, int op, Strided g, int is_bool) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        u32 o[3];
        strided_offsets(g, i, o, 2);
        y[i] = binary_u8(op, a[o[0]], b[o[1]], is_bool);
    }
}

// Comparisons: 0 eq 1 ne 2 lt 3 le 4 gt 5 ge; output bool bytes.
template <typename A> __device__ __forceinline__ u8 cmp_apply(int op, A a, A b) {
    switch (op) {
    case 0: return a == b;
    case 1: return a != b;
    case 2: return a < b;
    case 3: return a <= b;
    case 4: return a > b;
    }
    return a >= b;
}
template <typename T>
__device__ void cmp_s_k(const T* a, const T* b, u8* y, u32 n, int op, Strided g) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        u32 o[3];
        strided_offsets(g, i, o, 2);
        y[i] = cmp_apply(op, to_acc(a[o[0]]), to_acc(b[o[1]]));
    }
}

template <typename T>
__device__ void where_s_k(const u8* c, const T* a, const T* b, T* y, u32 n, Strided g) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        u32 o[3];
        strided_offsets(g, i, o, 3);
        y[i] = c[o[0]] ? a[o[1]] : b[o[2]];
    }
}

// Strided copy: src view (operand 0) into dst view (operand 1).
template <typename T>
__device__ void copy_s_k(const T* x, T* y, u32 n, Strided g) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        u32 o[3];
        strided_offsets(g, i, o, 2);
        y[o[1]] = x[o[0]];
    }
}

template <typename T>
__device__ void fill_k(T* y, u32 n, double v) {
    T t = from_d<T>(v);
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = t;
}

// ---- casts (through f64, rounding once) ------------------------------------------------------------
template <typename S, typename D>
__device__ void cast_k(const S* x, D* y, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = from_d<D>(to_d(x[i]));
}
template <typename S>
__device__ void cast_bool_k(const S* x, u8* y, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = to_d(x[i]) != 0.0;
}
// f32 <-> half directly (one rounding, no detour).
extern "C" __global__ void cast_f32_bf16(const float* x, __nv_bfloat16* y, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = __float2bfloat16_rn(x[i]);
}
extern "C" __global__ void cast_f32_f16(const float* x, __half* y, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = __float2half_rn(x[i]);
}
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
// i64 to float types: exact i64->f64 like the CPU backend.
template <typename D>
__device__ void cast_from_i64_k(const i64* x, D* y, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = from_d<D>((double)x[i]);
}

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
template <typename T>
__device__ void sum_mid_k(const T* x, T* y, u32 outer, u32 mid, u32 inner) {
    typedef typename SumAcc<T>::type S;
    typedef typename Acc<T>::type A;
    __shared__ S sh[256];
    const u32 m = blockIdx.x, t = threadIdx.x, total = outer * inner;
    S acc = 0;
    for (u32 j = t; j < total; j += 256) {
        const u32 o = j / inner, i = j - o * inner;
        acc += (S)to_acc(x[((size_t)o * mid + m) * inner + i]);
    }
    sh[t] = acc;
    __syncthreads();
    for (u32 w = 128; w > 0; w >>= 1) {
        if (t < w) sh[t] += sh[t + w];
        __syncthreads();
    }
    if (t == 0) y[m] = store<T, A>((A)sh[0]);
}

// ---- index kernels ----------------------------------------------------------------------------------
// Out-of-range indices read/write nothing and yield zero (bounds are not checked on the host:
// that would need a synchronising read).
template <typename T>
__device__ void index_select_k(const T* x, const i64* idx, T* y, u32 outer, u32 d, u32 n, u32 inner) {
    u32 total = outer * n * inner;
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += blockDim.x * gridDim.x) {
        u32 i = k % inner, r = (k / inner) % n, o = k / (inner * n);
        i64 j = idx[r];
        y[k] = (j >= 0 && j < d) ? x[((size_t)o * d + j) * inner + i] : from_d<T>(0.0);
    }
}
// out[o, j, i] = x[o, j, i] + sum over r (ascending) with idx[r] == j of src[o, r, i].
template <typename T>
__device__ void index_add_k(const T* x, const i64* idx, const T* src, T* y, u32 outer, u32 d, u32 n, u32 inner) {
    typedef typename Acc<T>::type A;
    u32 total = outer * d * inner;
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += blockDim.x * gridDim.x) {
        u32 i = k % inner, j = (k / inner) % d, o = k / (inner * d);
        T acc = x[k];
        for (u32 r = 0; r < n; ++r)
            if (idx[r] == (i64)j) acc = store<T, A>(to_acc(acc) + to_acc(src[((size_t)o * n + r) * inner + i]));
        y[k] = acc;
    }
}
// index_add by buckets (the same sums as index_add_k, in the same order, without its scan of
// every index for every output element — O(outputs × indices), 47 ms of a batch-64 step):
// ia_count counts the indices per target (integer atomics: counts are exact), ia_scan turns the
// counts into bucket offsets, ia_fill drops each source row into its target's bucket, ia_sort
// orders every bucket by row, and ia_sum adds each bucket's rows in ascending order, as
// index_add_k does. Out-of-range indices land in no bucket (they add nothing, as there).
extern "C" __global__ void ia_count(const i64* idx, u32 n, u32 d, u32* counts) {
    for (u32 r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += blockDim.x * gridDim.x) {
        const i64 j = idx[r];
        if (j >= 0 && j < (i64)d) atomicAdd(&counts[(u32)j], 1u);
    }
}
// One block of 1024: exclusive prefix sums of `counts` into offsets[0..d], offsets[d] = total.
extern "C" __global__ void __launch_bounds__(1024) ia_scan(const u32* counts, u32* offsets, u32 d) {
    __shared__ u32 part[1024];
    const u32 t = threadIdx.x, per = (d + 1023) / 1024;
    const u32 lo = min(t * per, d), hi = min(lo + per, d);
    u32 sum = 0;
    for (u32 j = lo; j < hi; ++j) sum += counts[j];
    part[t] = sum;
    __syncthreads();
    for (u32 o = 1; o < 1024; o <<= 1) {
        const u32 v = t >= o ? part[t - o] : 0u;
        __syncthreads();
        part[t] += v;
        __syncthreads();
    }
    u32 run = t ? part[t - 1] : 0u;
    for (u32 j = lo; j < hi; ++j) {
        offsets[j] = run;
        run += counts[j];
    }
    if (t == 1023) offsets[d] = part[1023];
}
// The scan of many counts in three passes over blocks of 1024 (coalesced reads; ia_scan alone, one
// block walking 33 k counts in strided runs, took 46 µs of a batch-4 loss backward): each block's
// sum (ia_block_sums), ia_scan over those sums, then each block's own exclusive scan plus its
// block's prefix (ia_scan_apply). Integer sums: exact, in any order.
extern "C" __global__ void __launch_bounds__(1024) ia_block_sums(const u32* counts, u32 d, u32* sums) {
    __shared__ u32 warp_sum[32];
    const u32 j = blockIdx.x * 1024u + threadIdx.x, lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
    u32 v = j < d ? counts[j] : 0u;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) warp_sum[wid] = v;
    __syncthreads();
    if (wid == 0) {
        u32 w = warp_sum[lane];
        for (int o = 16; o > 0; o >>= 1) w += __shfl_down_sync(0xffffffffu, w, o);
        if (lane == 0) sums[blockIdx.x] = w;
    }
}
// offsets[j] = block_offsets[block] + the counts before j in its block; offsets[d] = the total
// (block_offsets[blocks], from ia_scan over the block sums).
extern "C" __global__ void __launch_bounds__(1024) ia_scan_apply(const u32* counts, const u32* block_offsets, u32* offsets, u32 d, u32 blocks) {
    __shared__ u32 warp_excl[32];
    const u32 j = blockIdx.x * 1024u + threadIdx.x, lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
    const u32 v = j < d ? counts[j] : 0u;
    u32 x = v;  // inclusive scan within the warp
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= (u32)o) x += y;
    }
    if (lane == 31) warp_excl[wid] = x;
    __syncthreads();
    if (wid == 0) {
        const u32 t = warp_excl[lane];
        u32 sum = t;
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(0xffffffffu, sum, o);
            if (lane >= (u32)o) sum += y;
        }
        warp_excl[lane] = sum - t;
    }
    __syncthreads();
    if (j < d) offsets[j] = block_offsets[blockIdx.x] + warp_excl[wid] + x - v;
    if (j == 0) offsets[d] = block_offsets[blocks];
}
extern "C" __global__ void ia_fill(const i64* idx, u32 n, u32 d, const u32* offsets, u32* cursor, u32* rows) {
    for (u32 r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += blockDim.x * gridDim.x) {
        const i64 j = idx[r];
        if (j >= 0 && j < (i64)d) rows[offsets[(u32)j] + atomicAdd(&cursor[(u32)j], 1u)] = r;
    }
}
// Insertion sort of each bucket (buckets are short: a target is hit by few rows).
extern "C" __global__ void ia_sort(const u32* offsets, u32 d, u32* rows) {
    for (u32 j = blockIdx.x * blockDim.x + threadIdx.x; j < d; j += blockDim.x * gridDim.x) {
        const u32 lo = offsets[j], hi = offsets[j + 1];
        for (u32 a = lo + 1; a < hi; ++a) {
            const u32 v = rows[a];
            u32 b = a;
            while (b > lo && rows[b - 1] > v) {
                rows[b] = rows[b - 1];
                --b;
            }
            rows[b] = v;
        }
    }
}
template <typename T>
__device__ void ia_sum_k(const T* x, const T* src, const u32* offsets, const u32* rows, T* y, u32 outer, u32 d, u32 n, u32 inner) {
    typedef typename Acc<T>::type A;
    u32 total = outer * d * inner;
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += blockDim.x * gridDim.x) {
        u32 i = k % inner, j = (k / inner) % d, o = k / (inner * d);
        T acc = x[k];
        for (u32 t = offsets[j]; t < offsets[j + 1]; ++t) acc = store<T, A>(to_acc(acc) + to_acc(src[((size_t)o * n + rows[t]) * inner + i]));
        y[k] = acc;
    }
}
// Shapes of x and idx padded to MAXD; dim is the gather dimension.
struct GatherGeo {
    u32 rank;
    u32 dim;
    u32 xshape[MAXD];
    u32 ishape[MAXD];
};
template <typename T>
__device__ void gather_k(const T* x, const i64* idx, T* y, u32 n, GatherGeo g) {
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += blockDim.x * gridDim.x) {
        u32 rem = k, off = 0, stride = 1, dstride = 0;
        for (int d = (int)g.rank - 1; d >= 0; --d) {
            u32 c = rem % g.ishape[d];
            rem /= g.ishape[d];
            if ((u32)d != g.dim) off += c * stride; else dstride = stride;
            stride *= g.xshape[d];
        }
        i64 j = idx[k];
        y[k] = (j >= 0 && j < g.xshape[g.dim]) ? x[off + (u32)j * dstride] : from_d<T>(0.0);
    }
}
// out[c] = x[c] + sum over p (ascending along dim) with idx[p] == c[dim] of src[p], where p shares
// c's other coordinates.
template <typename T>
__device__ void scatter_add_k(const T* x, const i64* idx, const T* src, T* y, u32 n, GatherGeo g) {
    typedef typename Acc<T>::type A;
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += blockDim.x * gridDim.x) {
        u32 rem = k, ioff = 0, istride = 1, idstride = 0, j = 0;
        bool inside = true;
        for (int d = (int)g.rank - 1; d >= 0; --d) {
            u32 c = rem % g.xshape[d];
            rem /= g.xshape[d];
            if ((u32)d == g.dim) { j = c; idstride = istride; }
            else { if (c >= g.ishape[d]) inside = false; ioff += c * istride; }
            istride *= g.ishape[d];
        }
        T acc = x[k];
        if (inside)
            for (u32 p = 0; p < g.ishape[g.dim]; ++p) {
                u32 q = ioff + p * idstride;
                if (idx[q] == (i64)j) acc = store<T, A>(to_acc(acc) + to_acc(src[q]));
            }
        y[k] = acc;
    }
}

// ---- top-k: rank of each element in (value desc/asc, index asc) order; one block per row ---------------
template <typename T>
__device__ void topk_k(const T* x, T* yv, i64* yi, u32 d, u32 inner, u32 k, int largest) {
    typedef typename Acc<T>::type A;
    u32 row = blockIdx.x;
    u32 o = row / inner, i = row % inner;
    const T* base = x + (size_t)o * d * inner + i;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) {
        A v = to_acc(base[(size_t)j * inner]);
        u32 rank = 0;
        for (u32 q = 0; q < d; ++q) {
            A w = to_acc(base[(size_t)q * inner]);
            bool before = largest ? (w > v) : (w < v);
            if (before || (w == v && q < j)) ++rank;
        }
        if (rank < k) {
            size_t at = ((size_t)o * k + rank) * inner + i;
            yv[at] = base[(size_t)j * inner];
            yi[at] = j;
        }
    }
}

// Top-k for small k: k rounds per row (one block), each finding the first element in (value desc —
// asc when !largest —, index asc) order that comes after the previous pick; NaN counts as beyond
// every number (first when largest). The same output as topk_k on rows without NaN, in k·d/256
// comparisons per thread instead of d²/256 (topk_k's rank of every element).
template <typename A>
__device__ __forceinline__ bool topk_before(A av, u32 ai, A bv, u32 bi, int largest) {
    const bool an = is_nan(av), bn = is_nan(bv);
    if (an || bn) return an && bn ? ai < bi : (largest ? an : bn);
    if (av != bv) return largest ? av > bv : av < bv;
    return ai < bi;
}
template <typename T>
__device__ void topk_select_k(const T* x, T* yv, i64* yi, u32 d, u32 inner, u32 k, int largest) {
    typedef typename Acc<T>::type A;
    __shared__ A sv[256];
    __shared__ u32 si[256];
    __shared__ A pv;
    __shared__ u32 pi;
    const u32 row = blockIdx.x, o = row / inner, i = row % inner;
    const T* base = x + (size_t)o * d * inner + i;
    const u32 NONE = 0xffffffffu;
    for (u32 r = 0; r < k; ++r) {
        A bv = (A)0;
        u32 bi = NONE;
        for (u32 j = threadIdx.x; j < d; j += blockDim.x) {
            const A v = to_acc(base[(size_t)j * inner]);
            if (r > 0 && !topk_before(pv, pi, v, j, largest)) continue;  // not after the previous pick
            if (bi == NONE || topk_before(v, j, bv, bi, largest)) { bv = v; bi = j; }
        }
        sv[threadIdx.x] = bv;
        si[threadIdx.x] = bi;
        __syncthreads();
        for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) {
                const u32 oi = si[threadIdx.x + s];
                if (oi != NONE && (si[threadIdx.x] == NONE || topk_before(sv[threadIdx.x + s], oi, sv[threadIdx.x], si[threadIdx.x], largest))) {
                    sv[threadIdx.x] = sv[threadIdx.x + s];
                    si[threadIdx.x] = oi;
                }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            const u32 j = si[0];
            const size_t at = ((size_t)o * k + r) * inner + i;
            yv[at] = base[(size_t)j * inner];
            yi[at] = j;
            pv = sv[0];
            pi = j;
        }
        __syncthreads();
    }
}

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

// ---- fused batch norm -----------------------------------------------------------------------------
// NCHW: a channel's N·HW elements are N runs of HW. Every kernel here takes a vector width V: with
// HW % V == 0 and 16-byte aligned buffers the host picks V = 16 / sizeof(T) (one 16-byte load per
// V elements, which keeps enough bytes in flight to run near bandwidth; a run never splits a
// vector), else V = 1. Elementwise math runs in the accumulator type (f32, f64 for f64 tensors);
// the per-channel sums accumulate in f64 and combine in a fixed order (no float atomics).

// V consecutive elements from p + i (i a multiple of V), in the accumulator type.
template <typename T, int V>
__device__ __forceinline__ void ld_vec(const T* p, size_t i, typename Acc<T>::type (&o)[V]) {
    if (V == 1) {
        o[0] = to_acc(p[i]);
    } else {
        uint4 u = __ldg(reinterpret_cast<const uint4*>(p + i));
        const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
        for (int k = 0; k < V; ++k) o[k] = to_acc(e[k]);
    }
}
// Stores V values (rounded once) to p + i.
template <typename T, int V>
__device__ __forceinline__ void st_vec(T* p, size_t i, const typename Acc<T>::type (&v)[V]) {
    typedef typename Acc<T>::type A;
    if (V == 1) {
        p[i] = store<T, A>(v[0]);
    } else {
        uint4 u;
        T* e = reinterpret_cast<T*>(&u);
#pragma unroll
        for (int k = 0; k < V; ++k) e[k] = store<T, A>(v[k]);
        *reinterpret_cast<uint4*>(p + i) = u;
    }
}
// Element index of vector v of channel ch (hv = HW / V vectors per run).
__device__ __forceinline__ size_t bn_vec_index(u32 v, u32 hv, u32 ch, u32 c, u32 hw, int V) {
    u32 ni = v / hv, j = v - ni * hv;
    return ((size_t)ni * c + ch) * hw + (size_t)j * V;
}
// Block p's share [start, end) of a channel's nv vectors split P ways.
__device__ __forceinline__ void bn_chunk(u32 nv, u32 P, u32 p, u32& start, u32& end) {
    u32 chunk = (nv + P - 1) / P;
    start = min(p * chunk, nv);
    end = min(start + chunk, nv);
}
// Fixed-order sum of (a, b) over a 256-thread block: warp shuffles, then the 8 warp sums in order.
// The result is valid in thread 0; every thread must call it.
__device__ __forceinline__ void bn_block_sum2(double& a, double& b) {
    __shared__ double sa[8], sb[8];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, o);
        b += __shfl_down_sync(0xffffffffu, b, o);
    }
    const u32 w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) { sa[w] = a; sb[w] = b; }
    __syncthreads();
    if (threadIdx.x == 0) {
        a = sa[0];
        b = sb[0];
        for (int k = 1; k < 8; ++k) { a += sa[k]; b += sb[k]; }
    }
    __syncthreads();  // sa/sb may be reused by the next call
}
// The channel's totals in thread 0 of one block, or false in every thread of the other blocks.
// P = 1: the block's own sums. Else each block writes its partial pair and takes a ticket; the
// last block to finish (which one does not change the result) sums the P partials in a fixed
// order in its first warp (lane-strided, then the fixed shuffle tree) and resets the ticket for
// the next launch.
__device__ __forceinline__ bool bn_last_block_totals(double& a, double& b, double* part, u32 ch, u32 p, u32 P, unsigned int* tickets) {
    __shared__ bool last;
    bn_block_sum2(a, b);
    if (P == 1) return true;
    if (threadIdx.x == 0) {
        part[((size_t)ch * P + p) * 2] = a;
        part[((size_t)ch * P + p) * 2 + 1] = b;
        __threadfence();
        last = atomicAdd(&tickets[ch], 1u) == P - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 32) return false;
    __threadfence();
    a = 0.0;
    b = 0.0;
    for (u32 k = threadIdx.x; k < P; k += 32) {  // L1-bypassing: written by other blocks
        a += __ldcg(&part[((size_t)ch * P + k) * 2]);
        b += __ldcg(&part[((size_t)ch * P + k) * 2 + 1]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, o);
        b += __shfl_down_sync(0xffffffffu, b, o);
    }
    if (threadIdx.x == 0) tickets[ch] = 0u;
    return true;
}

// The channel's parameters from its shifted sums (s = Σ(x − K), q = Σ(x − K)²): writes aff, nrm,
// the running statistics and (channel 0) the batch counter; returns aff's pair in (sc, sh).
template <typename S>
__device__ __forceinline__ void bn_stats_finish(double s, double q, double K, u32 ch, u32 c, double count, const S* w, const S* b,
                                                S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt, S& sc, S& sh) {
    const double ms = s / count;
    double var = q / count - ms * ms;
    if (var < 0.0) var = 0.0;
    const double mean = K + ms;
    const double invstd = 1.0 / sqrt(var + eps);
    const double scale = (double)w[ch] * invstd;
    sc = (S)scale;
    sh = (S)((double)b[ch] - mean * scale);
    aff[ch] = sc;
    aff[c + ch] = sh;
    nrm[ch] = (S)invstd;
    nrm[c + ch] = (S)(-mean * invstd);
    const double unb = count > 1.0 ? var * count / (count - 1.0) : var;
    rm[ch] = (S)((1.0 - mom) * (double)rm[ch] + mom * mean);
    rv[ch] = (S)((1.0 - mom) * (double)rv[ch] + mom * unb);
    if (nbt != nullptr && ch == 0) *nbt += 1;
}

// This thread's shifted sums s += Σ(x − K), q += Σ(x − K)² over vectors [start, end) of channel ch
// (thread t takes vectors start + t, start + t + 256, …).
template <typename T, int V>
__device__ __forceinline__ void bn_shifted_sums(const T* x, u32 ch, u32 c, u32 hw, typename Acc<T>::type K, u32 start, u32 end,
                                                double& s, double& q) {
    typedef typename Acc<T>::type A;
    const u32 hv = hw / V;
    for (u32 v = start + threadIdx.x; v < end; v += 256) {
        A e[V];
        ld_vec<T, V>(x, bn_vec_index(v, hv, ch, c, hw, V), e);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const double d = (double)(e[k] - K);
            s += d;
            q += d * d;
        }
    }
}
// y = act(x·sc + sh) for V values (act = SiLU when silu != 0).
template <typename A, int V>
__device__ __forceinline__ void bn_apply_vec(A* e, A sc, A sh, int silu) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
        A z = e[k] * sc + sh;
        e[k] = silu ? z / ((A)1 + m_exp(-z)) : z;
    }
}

// Training statistics, grid (P, C), block 256: shifted sums of x − K and (x − K)² (K = the
// channel's first element, which keeps E[x²] − E[x]² well conditioned); the channel's last block
// writes the affine parameters aff = [w·invstd; b − mean·w·invstd], the normalisation parameters
// nrm = [invstd; −mean·invstd] and the running statistics, and (channel 0) counts the batch in
// `nbt` when given. `tickets`: a device-lifetime array of zeros, one per channel.
template <typename T, typename S, int V>
__device__ void bn_stats_k(const T* x, double* part, u32 n, u32 c, u32 hw, u32 P, unsigned int* tickets, double count, const S* w,
                           const S* b, S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt) {
    typedef typename Acc<T>::type A;
    const u32 ch = blockIdx.y, p = blockIdx.x, hv = hw / V;
    u32 start, end;
    bn_chunk(n * hv, P, p, start, end);
    const A K = to_acc(x[(size_t)ch * hw]);
    double s = 0.0, q = 0.0;
    bn_shifted_sums<T, V>(x, ch, c, hw, K, start, end, s, q);
    if (!bn_last_block_totals(s, q, part, ch, p, P, tickets) || threadIdx.x != 0) return;
    S sc, sh;
    bn_stats_finish<S>(s, q, (double)K, ch, c, count, w, b, rm, rv, eps, mom, aff, nrm, nbt, sc, sh);
}
// y = act(x·p[c] + p[C + c]) over NCHW (act = SiLU when silu != 0), V elements per thread step;
// nvec = len / V, hv = HW / V.
template <typename T, typename S, int V>
__device__ void chaffine_k(const T* x, const S* p, T* y, u32 nvec, u32 hv, u32 c, int silu) {
    typedef typename Acc<T>::type A;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += blockDim.x * gridDim.x) {
        const u32 ch = (v / hv) % c;
        const A sc = (A)p[ch], sh = (A)p[c + ch];
        A e[V];
        ld_vec<T, V>(x, (size_t)v * V, e);
        bn_apply_vec<A, V>(e, sc, sh, silu);
        st_vec<T, V>(y, (size_t)v * V, e);
    }
}

// One block per channel (P = 1), grid (1, C): bn_stats_k's sums and parameters, then chaffine_k's
// y = act(x·sc + sh) over the same channel in the same launch — the same arithmetic, so the same
// bytes as the two launches, one launch fewer for each small layer.
template <typename T, typename S, int V>
__device__ void bn_fwd1_k(const T* x, T* y, u32 n, u32 c, u32 hw, double count, const S* w, const S* b, S* rm, S* rv, double eps,
                          double mom, S* aff, S* nrm, i64* nbt, int silu) {
    typedef typename Acc<T>::type A;
    __shared__ S ssc, ssh;
    const u32 ch = blockIdx.y, hv = hw / V, nv = n * hv;
    const A K = to_acc(x[(size_t)ch * hw]);
    double s = 0.0, q = 0.0;
    bn_shifted_sums<T, V>(x, ch, c, hw, K, 0, nv, s, q);
    bn_block_sum2(s, q);
    if (threadIdx.x == 0) {
        S sc, sh;
        bn_stats_finish<S>(s, q, (double)K, ch, c, count, w, b, rm, rv, eps, mom, aff, nrm, nbt, sc, sh);
        ssc = sc;
        ssh = sh;
    }
    __syncthreads();
    const A sc = (A)ssc, sh = (A)ssh;
    for (u32 v = threadIdx.x; v < nv; v += 256) {
        const size_t i = bn_vec_index(v, hv, ch, c, hw, V);
        A e[V];
        ld_vec<T, V>(x, i, e);
        bn_apply_vec<A, V>(e, sc, sh, silu);
        st_vec<T, V>(y, i, e);
    }
}

// ---- batch-norm (+SiLU) backward --------------------------------------------------------------------
// gz = g·act'(z) with z = x·aff[ch] + aff[C+ch]; x̂ = x·nrm[ch] + nrm[C+ch].
template <typename A>
__device__ __forceinline__ void bnb_terms(A x, A g, A a0, A a1, A n0, A n1, int silu, A& gz, A& xh) {
    const A z = x * a0 + a1;
    if (silu) {
        const A s = (A)1 / ((A)1 + m_exp(-z));
        gz = g * (s * ((A)1 + z * ((A)1 - s)));
    } else {
        gz = g;
    }
    xh = x * n0 + n1;
}
// This thread's sums sa += Σgz, sq += Σgz·x̂ over vectors [start, end) of channel ch.
template <typename T, int V>
__device__ __forceinline__ void bnb_sums(const T* x, const T* g, u32 ch, u32 c, u32 hw, typename Acc<T>::type a0, typename Acc<T>::type a1,
                                         typename Acc<T>::type n0, typename Acc<T>::type n1, int silu, u32 start, u32 end, double& sa,
                                         double& sq) {
    typedef typename Acc<T>::type A;
    const u32 hv = hw / V;
    for (u32 v = start + threadIdx.x; v < end; v += 256) {
        const size_t i = bn_vec_index(v, hv, ch, c, hw, V);
        A xe[V], ge[V];
        ld_vec<T, V>(x, i, xe);
        ld_vec<T, V>(g, i, ge);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            A gz, xh;
            bnb_terms<A>(xe[k], ge[k], a0, a1, n0, n1, silu, gz, xh);
            sa += (double)gz;
            sq += (double)gz * (double)xh;
        }
    }
}
// The channel's totals to gw = Σgz·x̂, gb = Σgz and dx's coefficients
// coef = [k; −k·Σgz/N; −k·Σgz·x̂/N] with k = w·invstd (eval: no batch terms), also returned in k3.
template <typename S>
__device__ __forceinline__ void bnb_finish(double sa, double sq, u32 ch, u32 c, double count, const S* w, const S* nrm, int training, S* gw,
                                           S* gb, S* coef, S* k3) {
    gb[ch] = (S)sa;
    gw[ch] = (S)sq;
    const double k = (double)w[ch] * (double)nrm[ch];
    k3[0] = (S)k;
    k3[1] = (S)(training ? -k * sa / count : 0.0);
    k3[2] = (S)(training ? -k * sq / count : 0.0);
    coef[ch] = k3[0];
    coef[c + ch] = k3[1];
    coef[2 * c + ch] = k3[2];
}
// dx = k0·gz + k1 + k2·x̂ for V values (x in xe, g in ge; dx written over xe).
template <typename A, int V>
__device__ __forceinline__ void bnb_dx_vec(A* xe, const A* ge, A a0, A a1, A n0, A n1, A k0, A k1, A k2, int silu) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
        A gz, xh;
        bnb_terms<A>(xe[k], ge[k], a0, a1, n0, n1, silu, gz, xh);
        xe[k] = k0 * gz + k1 + k2 * xh;
    }
}
// Reduction, grid (P, C), block 256: per-channel sums Σgz and Σgz·x̂; the channel's last block
// writes gw = Σgz·x̂, gb = Σgz and dx's coefficients coef = [k; −k·Σgz/N; −k·Σgz·x̂/N] with
// k = w·invstd (eval: no batch terms).
template <typename T, typename S, int V>
__device__ void bnb_reduce_k(const T* x, const T* g, const S* aff, const S* nrm, double* part, u32 n, u32 c, u32 hw, u32 P, int silu,
                             unsigned int* tickets, double count, const S* w, int training, S* gw, S* gb, S* coef) {
    typedef typename Acc<T>::type A;
    const u32 ch = blockIdx.y, p = blockIdx.x, hv = hw / V;
    const A a0 = (A)aff[ch], a1 = (A)aff[c + ch], n0 = (A)nrm[ch], n1 = (A)nrm[c + ch];
    u32 start, end;
    bn_chunk(n * hv, P, p, start, end);
    double sa = 0.0, sq = 0.0;
    bnb_sums<T, V>(x, g, ch, c, hw, a0, a1, n0, n1, silu, start, end, sa, sq);
    if (!bn_last_block_totals(sa, sq, part, ch, p, P, tickets) || threadIdx.x != 0) return;
    S k3[3];
    bnb_finish<S>(sa, sq, ch, c, count, w, nrm, training, gw, gb, coef, k3);
}
// dx = coef[0]·gz + coef[1] + coef[2]·x̂, V elements per thread step.
template <typename T, typename S, int V>
__device__ void bnb_dx_k(const T* x, const T* g, const S* aff, const S* nrm, const S* coef, T* dx, u32 nvec, u32 hv, u32 c, int silu) {
    typedef typename Acc<T>::type A;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += blockDim.x * gridDim.x) {
        const u32 ch = (v / hv) % c;
        const A a0 = (A)aff[ch], a1 = (A)aff[c + ch], n0 = (A)nrm[ch], n1 = (A)nrm[c + ch];
        const A k0 = (A)coef[ch], k1 = (A)coef[c + ch], k2 = (A)coef[2 * c + ch];
        A xe[V], ge[V];
        ld_vec<T, V>(x, (size_t)v * V, xe);
        ld_vec<T, V>(g, (size_t)v * V, ge);
        bnb_dx_vec<A, V>(xe, ge, a0, a1, n0, n1, k0, k1, k2, silu);
        st_vec<T, V>(dx, (size_t)v * V, xe);
    }
}
// One block per channel (P = 1), grid (1, C): bnb_reduce_k's sums and coefficients, then bnb_dx_k's
// dx over the same channel in the same launch (same arithmetic, same bytes, one launch fewer).
template <typename T, typename S, int V>
__device__ void bnb_fused1_k(const T* x, const T* g, const S* aff, const S* nrm, u32 n, u32 c, u32 hw, int silu, double count,
                             const S* w, int training, S* gw, S* gb, S* coef, T* dx) {
    typedef typename Acc<T>::type A;
    __shared__ S sk[3];
    const u32 ch = blockIdx.y, hv = hw / V, nv = n * hv;
    const A a0 = (A)aff[ch], a1 = (A)aff[c + ch], n0 = (A)nrm[ch], n1 = (A)nrm[c + ch];
    double sa = 0.0, sq = 0.0;
    bnb_sums<T, V>(x, g, ch, c, hw, a0, a1, n0, n1, silu, 0, nv, sa, sq);
    bn_block_sum2(sa, sq);
    if (threadIdx.x == 0) bnb_finish<S>(sa, sq, ch, c, count, w, nrm, training, gw, gb, coef, sk);
    __syncthreads();
    const A k0 = (A)sk[0], k1 = (A)sk[1], k2 = (A)sk[2];
    for (u32 v = threadIdx.x; v < nv; v += 256) {
        const size_t i = bn_vec_index(v, hv, ch, c, hw, V);
        A xe[V], ge[V];
        ld_vec<T, V>(x, i, xe);
        ld_vec<T, V>(g, i, ge);
        bnb_dx_vec<A, V>(xe, ge, a0, a1, n0, n1, k0, k1, k2, silu);
        st_vec<T, V>(dx, i, xe);
    }
}
#define INST_BN_V(name, T, S, V, sfx)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bn_stats##sfx##_##name(const T* x, double* part, u32 n, u32 c, u32 hw, u32 P,    \
        unsigned int* tickets, double count, const S* w, const S* b, S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt) { \
        bn_stats_k<T, S, V>(x, part, n, c, hw, P, tickets, count, w, b, rm, rv, eps, mom, aff, nrm, nbt);                              \
    }                                                                                                                                  \
    extern "C" __global__ void chaffine##sfx##_##name(const T* x, const S* p, T* y, u32 nvec, u32 hv, u32 c, int silu) {              \
        chaffine_k<T, S, V>(x, p, y, nvec, hv, c, silu);                                                                               \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bnb_reduce##sfx##_##name(const T* x, const T* g, const S* aff, const S* nrm,    \
        double* part, u32 n, u32 c, u32 hw, u32 P, int silu, unsigned int* tickets, double count, const S* w, int training, S* gw,     \
        S* gb, S* coef) {                                                                                                              \
        bnb_reduce_k<T, S, V>(x, g, aff, nrm, part, n, c, hw, P, silu, tickets, count, w, training, gw, gb, coef);                    \
    }                                                                                                                                  \
    extern "C" __global__ void bnb_dx##sfx##_##name(const T* x, const T* g, const S* aff, const S* nrm, const S* coef, T* dx,         \
        u32 nvec, u32 hv, u32 c, int silu) {                                                                                           \
        bnb_dx_k<T, S, V>(x, g, aff, nrm, coef, dx, nvec, hv, c, silu);                                                                \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bn_fwd1##sfx##_##name(const T* x, T* y, u32 n, u32 c, u32 hw, double count,     \
        const S* w, const S* b, S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt, int silu) {                            \
        bn_fwd1_k<T, S, V>(x, y, n, c, hw, count, w, b, rm, rv, eps, mom, aff, nrm, nbt, silu);                                        \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bnb_fused1##sfx##_##name(const T* x, const T* g, const S* aff, const S* nrm,    \
        u32 n, u32 c, u32 hw, int silu, double count, const S* w, int training, S* gw, S* gb, S* coef, T* dx) {                        \
        bnb_fused1_k<T, S, V>(x, g, aff, nrm, n, c, hw, silu, count, w, training, gw, gb, coef, dx);                                   \
    }
#define INST_BN(name, T, S)            \
    INST_BN_V(name, T, S, 1, )         \
    INST_BN_V(name, T, S, 16 / sizeof(T), _v)
INST_BN(f32, float, float)
INST_BN(f64, double, double)
INST_BN(f16, __half, float)
INST_BN(bf16, __nv_bfloat16, float)

// ---- contiguous binary ops, 16 bytes at a time ------------------------------------------------------
// binary_c for n % V == 0 and 16-byte aligned operands (V = 16 / sizeof(T)): the same math per
// element, vector loads and stores, for large half-precision tensors (2-byte scalar loads). In the
// batch-4 training step most binary ops are launch-bound: their summed time did not move (H200:
// 1.28 ms before, 0.90 + 0.40 ms after). nvec = n / V.
template <typename T>
__device__ void binary_cv_k(const T* a, const T* b, T* y, u32 nvec, int op) {
    typedef typename Acc<T>::type A;
    constexpr int V = 16 / sizeof(T);
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += blockDim.x * gridDim.x) {
        A ea[V], eb[V];
        ld_vec<T, V>(a, (size_t)v * V, ea);
        ld_vec<T, V>(b, (size_t)v * V, eb);
#pragma unroll
        for (int k = 0; k < V; ++k) ea[k] = binary_apply<A>(op, ea[k], eb[k]);
        st_vec<T, V>(y, (size_t)v * V, ea);
    }
}
#define INST_BCV(name, T) \
    extern "C" __global__ void binary_cv_##name(const T* a, const T* b, T* y, u32 nvec, int op) { binary_cv_k<T>(a, b, y, nvec, op); }
INST_BCV(f32, float)
INST_BCV(f64, double)
INST_BCV(f16, __half)
INST_BCV(bf16, __nv_bfloat16)

// ---- multi-tensor accumulate and cast ----------------------------------------------------------------
// dst_k[i] += src_k[i] (ptr[0], ptr[1]) for up to MT_ADD same-dtype tensors in one launch — gradient accumulation
// into many parameters without a launch each. The table travels in the kernel parameters (graph
// capture keeps it); block b works on chunk b − first_block[k] of the tensor k whose block range
// holds b. The sum is the one binary add computes (same bytes).
#define MT_ADD 40
#define MT_CHUNK 2048
// Up to three operand arrays per tensor (which one means what is each kernel's own).
struct MtTable {
    unsigned long long ptr[3][MT_ADD];
    u32 len[MT_ADD];
    u32 first_block[MT_ADD + 1];
    u32 count;
};
// This block's tensor k and its element range [base, end).
template <typename Tab>
__device__ __forceinline__ u32 mt_locate(const Tab& t, u32& base, u32& end) {
    const u32 b = blockIdx.x;
    u32 k = 0;
    while (k + 1 < t.count && b >= t.first_block[k + 1]) ++k;
    base = (b - t.first_block[k]) * MT_CHUNK;
    end = min(base + MT_CHUNK, t.len[k]);
    return k;
}
template <typename T>
__device__ void mt_add_k(const MtTable& t) {
    typedef typename Acc<T>::type A;
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    T* d = reinterpret_cast<T*>(t.ptr[0][k]);
    const T* s = reinterpret_cast<const T*>(t.ptr[1][k]);
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) d[i] = store<T, A>(to_acc(d[i]) + to_acc(s[i]));
}
#define INST_MT(name, T) \
    extern "C" __global__ void mt_add_##name(const MtTable t) { mt_add_k<T>(t); }
INST_MT(f32, float)
INST_MT(f64, double)
INST_MT(f16, __half)
INST_MT(bf16, __nv_bfloat16)
// dst_k = cast(src_k) for up to MT_ADD tensors, rounding exactly as the one-tensor casts do (f32 to
// a half type directly, the other way exactly): autocast's weight copies of a step in one launch.
template <typename S, typename D> __device__ __forceinline__ D mt_conv(S x) { return from_d<D>(to_d(x)); }
template <> __device__ __forceinline__ __nv_bfloat16 mt_conv<float, __nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half mt_conv<float, __half>(float x) { return __float2half_rn(x); }
template <typename S, typename D>
__device__ void mt_cast_k(const MtTable& t) {
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    D* d = reinterpret_cast<D*>(t.ptr[0][k]);
    const S* s = reinterpret_cast<const S*>(t.ptr[1][k]);
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) d[i] = mt_conv<S, D>(s[i]);
}
extern "C" __global__ void mt_cast_f32_bf16(const MtTable t) { mt_cast_k<float, __nv_bfloat16>(t); }
extern "C" __global__ void mt_cast_f32_f16(const MtTable t) { mt_cast_k<float, __half>(t); }
extern "C" __global__ void mt_cast_bf16_f32(const MtTable t) { mt_cast_k<__nv_bfloat16, float>(t); }
extern "C" __global__ void mt_cast_f16_f32(const MtTable t) { mt_cast_k<__half, float>(t); }

// ---- multi-tensor SGD step -------------------------------------------------------------------------
// For up to MT_ADD f32 parameters at once, in place, the op sequence of the composed SGD update
// with each op's own rounding (the composed `mul_scalar` is the unary affine x·s + 0, which the
// compiler contracts to one fma — written here as that fma):
//   g' = g + fma(p, wd, 0)            (when has_wd)
//   b  = fma(b, μ, 0) + g'            (when has_buf; the buffer is written back)
//   u  = nesterov ? g' + fma(b, μ, 0) : b     (u = g' without a buffer)
//   p  = p + fma(u, −lr·factor, 0)
__device__ __forceinline__ void mt_sgd_rows(const MtTable& t, float fwd, float fmu, float fnlr, float zero, int has_wd, int has_buf,
                                            int nesterov) {
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    float* P = reinterpret_cast<float*>(t.ptr[0][k]);
    const float* G = reinterpret_cast<const float*>(t.ptr[1][k]);
    float* B = reinterpret_cast<float*>(t.ptr[2][k]);
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) {
        const float p = P[i];
        const float gw = has_wd ? __fadd_rn(G[i], __fmaf_rn(p, fwd, zero)) : G[i];
        float u = gw;
        if (has_buf) {
            const float b = __fadd_rn(__fmaf_rn(B[i], fmu, zero), gw);
            B[i] = b;
            u = nesterov ? __fadd_rn(gw, __fmaf_rn(b, fmu, zero)) : b;
        }
        P[i] = __fadd_rn(p, __fmaf_rn(u, fnlr, zero));
    }
}
extern "C" __global__ void mt_sgd_f32(const MtTable t, double wd, double mu, double nlr, float zero, int has_wd, int has_buf, int nesterov) {
    mt_sgd_rows(t, (float)wd, (float)mu, (float)nlr, zero, has_wd, has_buf, nesterov);
}
// The same step with [wd, μ, −lr·factor] read from device memory (written by the host before the
// step), so a recorded graph takes each step's values; nothing is written when the flag `skip`
// (the grad scaler's found-inf; null: none) is non-zero.
__device__ __forceinline__ bool skip_set(const float* skip) { return skip != nullptr && *skip != 0.0f; }
extern "C" __global__ void mt_sgd_dev_f32(const MtTable t, const double* hp, const float* skip, float zero, int has_wd, int has_buf,
                                          int nesterov) {
    if (skip_set(skip)) return;
    mt_sgd_rows(t, (float)hp[0], (float)hp[1], (float)hp[2], zero, has_wd, has_buf, nesterov);
}

// The factor lerp multiplies by and its branch, as the host's `lerp_factor`: w rounded to f32;
// |w| < 0.5 → (w, start + …), else (1 − w in f32, end − …).
__device__ __forceinline__ void lerp_factor_of(double w, float& f, int& small) {
    const float w32 = (float)w;
    small = fabsf(w32) < 0.5f;
    f = small ? w32 : __fsub_rn(1.0f, w32);
}

// ---- multi-tensor momentum blend (Muon) -------------------------------------------------------------
// For up to MT_ADD f32 tensors, with the composed ops' roundings (lerp(s, e, w) = s + fma(e − s, w, 0)
// when |w| < 0.5, else e − fma(e − s, 1 − w, 0); f1/f2 are the factors, small1/small2 the branches):
//   m ← lerp(m, g, 1 − β);   u = nesterov ? lerp(g, m, β) : m   (u written to a fresh buffer)
__device__ __forceinline__ void mt_blend_rows(const MtTable& t, float f1, int small1, float f2, int small2, int nesterov, float zero,
                                              bool write_m) {
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    float* M = reinterpret_cast<float*>(t.ptr[0][k]);
    const float* G = reinterpret_cast<const float*>(t.ptr[1][k]);
    float* U = reinterpret_cast<float*>(t.ptr[2][k]);
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) {
        const float m = M[i], g = G[i];
        const float d1 = __fsub_rn(g, m);
        const float m1 = small1 ? __fadd_rn(m, __fmaf_rn(d1, f1, zero)) : __fsub_rn(g, __fmaf_rn(d1, f1, zero));
        if (write_m) M[i] = m1;
        float u = m1;
        if (nesterov) {
            const float d2 = __fsub_rn(m1, g);
            u = small2 ? __fadd_rn(g, __fmaf_rn(d2, f2, zero)) : __fsub_rn(m1, __fmaf_rn(d2, f2, zero));
        }
        U[i] = u;
    }
}
extern "C" __global__ void mt_blend_f32(const MtTable t, float f1, int small1, float f2, int small2, int nesterov, float zero) {
    mt_blend_rows(t, f1, small1, f2, small2, nesterov, zero, true);
}
// β read from device memory; the factors of 1 − β (in f64) and β derived as on the host. Under a
// set `skip` flag the momenta keep their values (the blend is still written: a fresh buffer).
extern "C" __global__ void mt_blend_dev_f32(const MtTable t, const double* hp, const float* skip, int nesterov, float zero) {
    float f1, f2;
    int small1, small2;
    lerp_factor_of(1.0 - hp[0], f1, small1);
    lerp_factor_of(hp[0], f2, small2);
    mt_blend_rows(t, f1, small1, f2, small2, nesterov, zero, !skip_set(skip));
}

// ---- multi-tensor lerp in place (EMA) -----------------------------------------------------------------
// dst ← lerp(dst, src, w) for up to MT_ADD f32 tensors, with the composed ops' roundings (see
// mt_blend_f32): dst + fma(src − dst, f, 0) when small, else src − fma(src − dst, f, 0).
__device__ __forceinline__ void mt_lerp_rows(const MtTable& t, float f, int small, float zero) {
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    float* D = reinterpret_cast<float*>(t.ptr[0][k]);
    const float* S = reinterpret_cast<const float*>(t.ptr[1][k]);
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) {
        const float d = D[i], s = S[i];
        const float diff = __fsub_rn(s, d);
        D[i] = small ? __fadd_rn(d, __fmaf_rn(diff, f, zero)) : __fsub_rn(s, __fmaf_rn(diff, f, zero));
    }
}
extern "C" __global__ void mt_lerp_f32(const MtTable t, float f, int small, float zero) { mt_lerp_rows(t, f, small, zero); }
// The weight read from device memory (an EMA update whose decay changes every step).
extern "C" __global__ void mt_lerp_dev_f32(const MtTable t, const double* hp, float zero) {
    float f;
    int small;
    lerp_factor_of(hp[0], f, small);
    mt_lerp_rows(t, f, small, zero);
}

// ---- gradient clipping (Tensor::clip_norm_many_) -------------------------------------------------------
// Block b: the sum of squares of its chunk of tensor k — each thread strided over the chunk, then a
// shared-memory tree in a fixed order — into partials[b].
extern "C" __global__ void mt_sumsq_f32(const MtTable t, float* partials) {
    __shared__ float sh[256];
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    const float* X = reinterpret_cast<const float*>(t.ptr[0][k]);
    float acc = 0.0f;
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) acc = __fadd_rn(acc, __fmul_rn(X[i], X[i]));
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = __fadd_rn(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}
// Block k (one thread): tensor k's norm, √(its chunks' partials summed in order).
extern "C" __global__ void mt_norms_f32(const MtTable t, const float* partials, float* norms) {
    const u32 k = blockIdx.x;
    if (k >= t.count || threadIdx.x != 0) return;
    float s = 0.0f;
    for (u32 b = t.first_block[k]; b < t.first_block[k + 1]; ++b) s = __fadd_rn(s, partials[b]);
    norms[k] = sqrtf(s);
}
// One thread: total = √(Σ norm² in tensor order), coef = min(1, max_norm / (total + eps)) with the
// composed ops' roundings (add, reciprocal, scale, clamp; NaN stays NaN).
extern "C" __global__ void clip_coef_f32(const float* norms, u32 n, float max_norm, float eps, float* total, float* coef) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    float s = 0.0f;
    for (u32 j = 0; j < n; ++j) s = __fadd_rn(s, __fmul_rn(norms[j], norms[j]));
    const float tot = sqrtf(s);
    const float c = __fmul_rn(__fdiv_rn(1.0f, __fadd_rn(tot, eps)), max_norm);
    total[0] = tot;
    coef[0] = c != c ? c : (c < 1.0f ? c : 1.0f);
}
// Every element of the table's tensors times coef[0].
extern "C" __global__ void mt_scale_by_f32(const MtTable t, const float* coef) {
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    float* X = reinterpret_cast<float*>(t.ptr[0][k]);
    const float c = coef[0];
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) X[i] = __fmul_rn(X[i], c);
}

// ---- padded matrix batches (Tensor::pack_padded / unpack_padded) ----------------------------------------
// Matrix k of a table (up to PACK_MAX) goes to / comes from a slot of slot_rows × slot_cols: stored
// rows[k] × cols[k] row-major, the slot holding its transpose when transposed[k]. Grid: x = chunks of
// MT_CHUNK elements, y = the table's matrices.
#define PACK_MAX 40
struct PackTable {
    unsigned long long src[PACK_MAX];
    unsigned long long dst[PACK_MAX];
    u32 rows[PACK_MAX];
    u32 cols[PACK_MAX];
    u32 transposed[PACK_MAX];
    float scale[PACK_MAX];
    u32 count;
    u32 slot_rows;
    u32 slot_cols;
};
// Every element of slot k: the matrix's value (cast as the one-tensor casts round) in its corner,
// zero elsewhere.
template <typename S, typename D>
__device__ void pack_pad_k(const PackTable& t) {
    const u32 k = blockIdx.y;
    if (k >= t.count) return;
    const u32 r = t.rows[k], c = t.cols[k], tr = t.transposed[k];
    const u32 er = tr ? c : r, ec = tr ? r : c;
    const u32 n = t.slot_rows * t.slot_cols;
    const S* src = reinterpret_cast<const S*>(t.src[k]);
    D* dst = reinterpret_cast<D*>(t.dst[k]);
    const u32 base = blockIdx.x * MT_CHUNK, end = min(base + MT_CHUNK, n);
    for (u32 idx = base + threadIdx.x; idx < end; idx += blockDim.x) {
        const u32 i = idx / t.slot_cols, j = idx % t.slot_cols;
        const S v = (i < er && j < ec) ? (tr ? src[j * c + i] : src[i * c + j]) : (S)0;
        dst[idx] = mt_conv<S, D>(v);
    }
}
extern "C" __global__ void pack_pad_f32_bf16(const PackTable t) { pack_pad_k<float, __nv_bfloat16>(t); }
extern "C" __global__ void pack_pad_f32_f32(const PackTable t) { pack_pad_k<float, float>(t); }
extern "C" __global__ void pack_pad_f32_f64(const PackTable t) { pack_pad_k<float, double>(t); }
// Matrix k back from its slot (transposed back), as f32, times scale[k] the way mul_scalar rounds
// (x·s + 0 contracted to one fma; a scale of 1 multiplies nothing).
template <typename S>
__device__ void unpack_pad_k(const PackTable& t, float zero) {
    const u32 k = blockIdx.y;
    if (k >= t.count) return;
    const u32 r = t.rows[k], c = t.cols[k], tr = t.transposed[k];
    const S* src = reinterpret_cast<const S*>(t.src[k]);
    float* dst = reinterpret_cast<float*>(t.dst[k]);
    const float sc = t.scale[k];
    const u32 base = blockIdx.x * MT_CHUNK, end = min(base + MT_CHUNK, r * c);
    for (u32 idx = base + threadIdx.x; idx < end; idx += blockDim.x) {
        const u32 a = idx / c, b = idx % c;
        const float v = mt_conv<S, float>(tr ? src[b * t.slot_cols + a] : src[a * t.slot_cols + b]);
        dst[idx] = sc == 1.0f ? v : __fmaf_rn(v, sc, zero);
    }
}
extern "C" __global__ void unpack_pad_bf16_f32(const PackTable t, float zero) { unpack_pad_k<__nv_bfloat16>(t, zero); }
extern "C" __global__ void unpack_pad_f32_f32(const PackTable t, float zero) { unpack_pad_k<float>(t, zero); }
extern "C" __global__ void unpack_pad_f64_f32(const PackTable t, float zero) { unpack_pad_k<double>(t, zero); }

// ---- GradScaler unscale (Tensor::unscale_many_) -----------------------------------------------------------
// For up to MT_ADD f32 gradients in place: g ← g · inv[0] (one rounding, as the composed mul), and
// found[0] ← 1 when the block's chunk held a value whose magnitude is not ≤ FLT_MAX (inf or NaN),
// checked before scaling as the composed check is. The flag is zeroed before the first table; every
// writer stores the same 1.0, so it does not depend on which block writes first.
extern "C" __global__ void mt_unscale_f32(const MtTable t, const float* inv, float* found) {
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    float* G = reinterpret_cast<float*>(t.ptr[0][k]);
    const float s = inv[0];
    int bad = 0;
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) {
        const float g = G[i];
        bad |= !(fabsf(g) <= 3.402823466e+38f);
        G[i] = __fmul_rn(g, s);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) found[0] = 1.0f;
}

// ---- AdamW with device scalars (one parameter per launch) ------------------------------------------------
// hp = [1 − lr·wd, 1 − β1, β2, 1 − β2, eps, lr, β1] (f64, computed on the host as the composed update
// computes them); the step t = count + 1 (count read here, incremented by mt_count_dev afterwards).
// The composed ops' roundings, in their order (unary affine x·a + b = fma(x, a, b); binary ops
// rounded each):
//   p ← fma(p, 1 − lr·wd, 0)                                   (when has_wd)
//   m ← lerp(m, g, 1 − β1)
//   v ← fma(v, β2, 0) + fma(g, 1 − β2, 0)·g
//   d = fma(fma(sqrt(v), 1/√(1 − β2ᵗ), 0), 1, eps)
//   p ← p + fma(m / d, −lr/(1 − β1ᵗ), 0)
extern "C" __global__ void adamw_dev_f32(float* P, const float* G, float* M, float* V, const double* count, const double* hp,
                                         const float* skip, u32 n, int has_wd, float zero) {
    if (skip_set(skip)) return;
    const double t = count[0] + 1.0;
    const float fkeep = (float)hp[0];
    float f1;
    int small1;
    lerp_factor_of(hp[1], f1, small1);
    const float fb2 = (float)hp[2], f1b2 = (float)hp[3], feps = (float)hp[4];
    const double bc1 = 1.0 - pow(hp[6], t), bc2 = 1.0 - pow(hp[2], t);
    const float fisb = (float)(1.0 / sqrt(bc2));
    const float fnss = (float)(-(hp[5] / bc1));
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const float g = G[i];
        float p = P[i];
        if (has_wd) p = __fmaf_rn(p, fkeep, zero);
        const float m = M[i];
        const float d1 = __fsub_rn(g, m);
        const float m1 = small1 ? __fadd_rn(m, __fmaf_rn(d1, f1, zero)) : __fsub_rn(g, __fmaf_rn(d1, f1, zero));
        M[i] = m1;
        const float v1 = __fadd_rn(__fmaf_rn(V[i], fb2, zero), __fmul_rn(__fmaf_rn(g, f1b2, zero), g));
        V[i] = v1;
        const float den = __fmaf_rn(__fmaf_rn(sqrtf(v1), fisb, zero), 1.0f, feps);
        P[i] = __fadd_rn(p, __fmaf_rn(__fdiv_rn(m1, den), fnss, zero));
    }
}
// count += 1 for up to MT_ADD f64 step counts (one element each), unless skipped.
extern "C" __global__ void mt_count_dev(const MtTable t, const float* skip) {
    if (skip_set(skip)) return;
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    double* C = reinterpret_cast<double*>(t.ptr[0][k]);
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) C[i] = C[i] + 1.0;
}

// ---- instantiations ---------------------------------------------------------------------------------------
#define FLOAT_TYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)
#define ALL_TYPES(X) FLOAT_TYPES(X) X(i64, i64) X(u8, u8)

#define INST_FLOAT(name, T)                                                                                         \
    extern "C" __global__ void unary_##name(const T* x, T* y, u32 n, int op, double p0, double p1) { unary_k<T>(x, y, n, op, p0, p1); } \
    extern "C" __global__ void binary_c_##name(const T* a, const T* b, T* y, u32 n, int op) { binary_c_k<T>(a, b, y, n, op); } \
    extern "C" __global__ void binary_s_##name(const T* a, const T* b, T* y, u32 n, int op, Strided g) { binary_s_k<T>(a, b, y, n, op, g); } \
    extern "C" __global__ void index_add_##name(const T* x, const i64* idx, const T* src, T* y, u32 outer, u32 d, u32 n, u32 inner) { index_add_k<T>(x, idx, src, y, outer, d, n, inner); } \
    extern "C" __global__ void ia_sum_##name(const T* x, const T* src, const u32* off, const u32* rows, T* y, u32 outer, u32 d, u32 n, u32 inner) { ia_sum_k<T>(x, src, off, rows, y, outer, d, n, inner); } \
    extern "C" __global__ void scatter_add_##name(const T* x, const i64* idx, const T* src, T* y, u32 n, GatherGeo g) { scatter_add_k<T>(x, idx, src, y, n, g); } \
    extern "C" __global__ void maxpool_fwd_##name(const T* x, T* y, i64* yi, PoolGeo g) { maxpool_fwd_k<T>(x, y, yi, g); } \
    extern "C" __global__ void maxpool_bwd_##name(const T* dy, const i64* idx, T* dx, PoolGeo g) { maxpool_bwd_k<T>(dy, idx, dx, g); } \
    extern "C" __global__ void cast_i64_##name(const i64* x, T* y, u32 n) { cast_from_i64_k<T>(x, y, n); }
FLOAT_TYPES(INST_FLOAT)

extern "C" __global__ void unary_i64(const i64* x, i64* y, u32 n, int op, double p0, double p1) { unary_i64_k(x, y, n, op, p0, p1); }
extern "C" __global__ void binary_c_i64(const i64* a, const i64* b, i64* y, u32 n, int op) { binary_c_k<i64>(a, b, y, n, op); }
extern "C" __global__ void binary_s_i64(const i64* a, const i64* b, i64* y, u32 n, int op, Strided g) { binary_s_k<i64>(a, b, y, n, op, g); }
extern "C" __global__ void index_add_i64(const i64* x, const i64* idx, const i64* src, i64* y, u32 outer, u32 d, u32 n, u32 inner) { index_add_k<i64>(x, idx, src, y, outer, d, n, inner); }
extern "C" __global__ void ia_sum_i64(const i64* x, const i64* src, const u32* off, const u32* rows, i64* y, u32 outer, u32 d, u32 n, u32 inner) { ia_sum_k<i64>(x, src, off, rows, y, outer, d, n, inner); }
extern "C" __global__ void scatter_add_i64(const i64* x, const i64* idx, const i64* src, i64* y, u32 n, GatherGeo g) { scatter_add_k<i64>(x, idx, src, y, n, g); }

#define INST_SUM_MID(name, T) \
    extern "C" __global__ void __launch_bounds__(256) sum_mid_##name(const T* x, T* y, u32 outer, u32 mid, u32 inner) { sum_mid_k<T>(x, y, outer, mid, inner); }
INST_SUM_MID(f32, float)
INST_SUM_MID(f64, double)
INST_SUM_MID(f16, __half)
INST_SUM_MID(bf16, __nv_bfloat16)

// Positions of the non-zero elements (ascending), the first `size` of them, padded with `fill`:
// one block of 1024 threads scans the input in chunks (a warp scan, then a scan of the warp
// totals), so the order never depends on scheduling and no count travels to the host.
template <typename T>
__device__ void nonzero_static_k(const T* x, i64* y, u32 n, u32 size, i64 fill) {
    __shared__ u32 warp_sums[32];
    const u32 t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
    u32 base = 0;
    for (u32 start = 0; start < n && base < size; start += blockDim.x) {
        const u32 i = start + t;
        const u32 flag = (i < n && to_d(x[i]) != 0.0) ? 1u : 0u;
        u32 v = flag;
        for (int o = 1; o < 32; o <<= 1) { u32 w = __shfl_up_sync(0xffffffffu, v, o); if (lane >= (u32)o) v += w; }
        if (lane == 31) warp_sums[warp] = v;
        __syncthreads();
        if (warp == 0) {
            u32 s = lane < nw ? warp_sums[lane] : 0u;
            for (int o = 1; o < 32; o <<= 1) { u32 w = __shfl_up_sync(0xffffffffu, s, o); if (lane >= (u32)o) s += w; }
            warp_sums[lane] = s;
        }
        __syncthreads();
        const u32 at = base + (warp > 0 ? warp_sums[warp - 1] : 0u) + v - flag;
        if (flag && at < size) y[at] = (i64)i;
        base += warp_sums[nw - 1];
        __syncthreads();
    }
    for (u32 j = base + t; j < size; j += blockDim.x) y[j] = fill;
}

#define INST_ALL(name, T)                                                                                            \
    extern "C" __global__ void cmp_s_##name(const T* a, const T* b, u8* y, u32 n, int op, Strided g) { cmp_s_k<T>(a, b, y, n, op, g); } \
    extern "C" __global__ void where_s_##name(const u8* c, const T* a, const T* b, T* y, u32 n, Strided g) { where_s_k<T>(c, a, b, y, n, g); } \
    extern "C" __global__ void copy_s_##name(const T* x, T* y, u32 n, Strided g) { copy_s_k<T>(x, y, n, g); } \
    extern "C" __global__ void fill_##name(T* y, u32 n, double v) { fill_k<T>(y, n, v); } \
    extern "C" __global__ void reduce_rows_##name(const T* x, void* y, u32 d, int op) { reduce_rows_k<T>(x, y, d, op); } \
    extern "C" __global__ void reduce_cols_##name(const T* x, void* y, u32 d, u32 inner, int op) { reduce_cols_k<T>(x, y, d, inner, op); } \
    extern "C" __global__ void index_select_##name(const T* x, const i64* idx, T* y, u32 outer, u32 d, u32 n, u32 inner) { index_select_k<T>(x, idx, y, outer, d, n, inner); } \
    extern "C" __global__ void gather_##name(const T* x, const i64* idx, T* y, u32 n, GatherGeo g) { gather_k<T>(x, idx, y, n, g); } \
    extern "C" __global__ void topk_##name(const T* x, T* yv, i64* yi, u32 d, u32 inner, u32 k, int largest) { topk_k<T>(x, yv, yi, d, inner, k, largest); } \
    extern "C" __global__ void topk_select_##name(const T* x, T* yv, i64* yi, u32 d, u32 inner, u32 k, int largest) { topk_select_k<T>(x, yv, yi, d, inner, k, largest); } \
    extern "C" __global__ void cast_bool_##name(const T* x, u8* y, u32 n) { cast_bool_k<T>(x, y, n); } \
    extern "C" __global__ void __launch_bounds__(1024) nonzero_static_##name(const T* x, i64* y, u32 n, u32 size, i64 fill) { nonzero_static_k<T>(x, y, n, size, fill); }
ALL_TYPES(INST_ALL)

// Generic casts between every pair (through f64).
#define CAST_TO(sname, S)                                                                                          \
    extern "C" __global__ void cast_##sname##_f32(const S* x, float* y, u32 n) { cast_k<S, float>(x, y, n); }      \
    extern "C" __global__ void cast_##sname##_f64(const S* x, double* y, u32 n) { cast_k<S, double>(x, y, n); }    \
    extern "C" __global__ void cast_##sname##_f16x(const S* x, __half* y, u32 n) { cast_k<S, __half>(x, y, n); }   \
    extern "C" __global__ void cast_##sname##_bf16x(const S* x, __nv_bfloat16* y, u32 n) { cast_k<S, __nv_bfloat16>(x, y, n); } \
    extern "C" __global__ void cast_##sname##_i64x(const S* x, i64* y, u32 n) { cast_k<S, i64>(x, y, n); }         \
    extern "C" __global__ void cast_##sname##_u8(const S* x, u8* y, u32 n) { cast_k<S, u8>(x, y, n); }
FLOAT_TYPES(CAST_TO)
CAST_TO(u8, u8)
extern "C" __global__ void cast_i64_u8(const i64* x, u8* y, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = from_d<u8>((double)x[i]);
}

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

// Eval-mode batch-norm parameters (one thread per channel).
template <typename S>
__device__ void bn_eval_k(const S* w, const S* b, const S* rm, const S* rv, double eps, S* aff, S* nrm, u32 c) {
    for (u32 ch = blockIdx.x * blockDim.x + threadIdx.x; ch < c; ch += blockDim.x * gridDim.x) {
        double invstd = 1.0 / sqrt((double)rv[ch] + eps);
        double scale = (double)w[ch] * invstd;
        aff[ch] = (S)scale;
        aff[c + ch] = (S)((double)b[ch] - (double)rm[ch] * scale);
        nrm[ch] = (S)invstd;
        nrm[c + ch] = (S)(-(double)rm[ch] * invstd);
    }
}
extern "C" __global__ void bn_eval_f32(const float* w, const float* b, const float* rm, const float* rv, double eps, float* aff, float* nrm, u32 c) { bn_eval_k<float>(w, b, rm, rv, eps, aff, nrm, c); }
extern "C" __global__ void bn_eval_f64(const double* w, const double* b, const double* rm, const double* rv, double eps, double* aff, double* nrm, u32 c) { bn_eval_k<double>(w, b, rm, rv, eps, aff, nrm, c); }

// ---- graph-safe Philox RNG (capture.md §9) ----------------------------------------------------------
// Philox4x32-10, the same rounds as rng.rs `philox4x32`.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
    for (int r = 0; r < 10; ++r) {
        const unsigned long long p0 = (unsigned long long)0xD2511F53u * c.x;
        const unsigned long long p1 = (unsigned long long)0xCD9E8D57u * c.z;
        c = make_uint4((u32)(p1 >> 32) ^ c.y ^ k.x, (u32)p1, (u32)(p0 >> 32) ^ c.w ^ k.y, (u32)p0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

// Keep mask: element i draws word i%4 of the block for counter (offset + i/4) under key seed;
// u = (word >> 8)·2^-24 and the element is kept when u < keep. Eager launches pass (seed, offset)
// by value (state == 0); captured launches read them from the generator's device state
// ([seed, base offset]) plus the launch's intra-graph offset, so each replay draws fresh numbers.
extern "C" __global__ void philox_keep_mask(u8* y, u32 n, float keep, unsigned long long seed_v, unsigned long long off_v,
                                            const unsigned long long* state, unsigned long long intra) {
    const unsigned long long seed = state ? state[0] : seed_v;
    const unsigned long long off = state ? state[1] + intra : off_v;
    const uint2 key = make_uint2((u32)seed, (u32)(seed >> 32));
    const u32 blocks = (u32)(((unsigned long long)n + 3) / 4);
    for (u32 b = blockIdx.x * blockDim.x + threadIdx.x; b < blocks; b += gridDim.x * blockDim.x) {
        const unsigned long long c = off + b;
        const uint4 r = philox4x32_10(make_uint4((u32)c, (u32)(c >> 32), 0u, 0u), key);
        const u32 w[4] = {r.x, r.y, r.z, r.w};
        for (int j = 0; j < 4; ++j) {
            const unsigned long long i = (unsigned long long)b * 4 + j;
            if (i < n) y[i] = (u8)((float)(w[j] >> 8) * 5.9604644775390625e-08f < keep);
        }
    }
}

// Writes a generator's host (seed, offset) into its device state before a replay.
extern "C" __global__ void rng_state_set(unsigned long long* s, unsigned long long seed, unsigned long long off) {
    s[0] = seed;
    s[1] = off;
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
#define INST_UPSAMPLE(name, T) \
    extern "C" __global__ void upsample_fwd_##name(const T* x, T* y, u32 n, u32 h, u32 w, u32 f) { upsample_fwd_k<T>(x, y, n, h, w, f); } \
    extern "C" __global__ void upsample_bwd_##name(const T* dy, T* dx, u32 n, u32 h, u32 w, u32 f) { upsample_bwd_k<T>(dy, dx, n, h, w, f); }
FLOAT_TYPES(INST_UPSAMPLE)

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

// ---- row copies (concatenation, narrowing) ------------------------------------------------------------
// `rows` rows of `cols` vectors of type V; pitches in vectors. One division per vector.
template <typename V>
__device__ void copy2d_k(const V* s, V* d, u32 rows, u32 cols, unsigned long long sp, unsigned long long dp) {
    const u32 total = rows * cols;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        const u32 r = i / cols, c = i - r * cols;
        d[(size_t)r * dp + c] = s[(size_t)r * sp + c];
    }
}
extern "C" __global__ void copy2d_v16(const uint4* s, uint4* d, u32 rows, u32 cols, unsigned long long sp, unsigned long long dp) { copy2d_k<uint4>(s, d, rows, cols, sp, dp); }
extern "C" __global__ void copy2d_v8(const uint2* s, uint2* d, u32 rows, u32 cols, unsigned long long sp, unsigned long long dp) { copy2d_k<uint2>(s, d, rows, cols, sp, dp); }
extern "C" __global__ void copy2d_v4(const unsigned int* s, unsigned int* d, u32 rows, u32 cols, unsigned long long sp, unsigned long long dp) { copy2d_k<unsigned int>(s, d, rows, cols, sp, dp); }
extern "C" __global__ void copy2d_v2(const unsigned short* s, unsigned short* d, u32 rows, u32 cols, unsigned long long sp, unsigned long long dp) { copy2d_k<unsigned short>(s, d, rows, cols, sp, dp); }
extern "C" __global__ void copy2d_v1(const u8* s, u8* d, u32 rows, u32 cols, unsigned long long sp, unsigned long long dp) { copy2d_k<u8>(s, d, rows, cols, sp, dp); }

// Concatenation of up to 8 contiguous inputs in one launch (blockIdx.y = input): input k holds
// `rows` rows of cols[k] vectors and lands at vector offset off[k] of each output row (pitch dp).
struct CatArgs {
    unsigned long long src[8];
    u32 cols[8];
    u32 off[8];
};
// Piece k = blockIdx.y of a cat/split: its address, columns and offset, selected with constant
// indices only (indexing the parameter struct with blockIdx.y would make every thread copy it to
// local memory first).
__device__ __forceinline__ void cat_piece(const CatArgs& a, unsigned long long& addr, u32& cols, u32& off) {
    const u32 k = blockIdx.y;
    addr = a.src[0];
    cols = a.cols[0];
    off = a.off[0];
#pragma unroll
    for (u32 j = 1; j < 8; ++j) {
        if (k == j) {
            addr = a.src[j];
            cols = a.cols[j];
            off = a.off[j];
        }
    }
}
template <typename V>
__device__ void cat_rows_k(CatArgs a, V* d, u32 rows, u32 dp) {
    unsigned long long src;
    u32 cols, off;
    cat_piece(a, src, cols, off);
    const V* s = (const V*)src;
    const u32 total = rows * cols;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        const u32 r = i / cols, c = i - r * cols;
        d[(size_t)r * dp + off + c] = s[i];
    }
}
extern "C" __global__ void cat_rows_v16(CatArgs a, uint4* d, u32 rows, u32 dp) { cat_rows_k<uint4>(a, d, rows, dp); }
extern "C" __global__ void cat_rows_v8(CatArgs a, uint2* d, u32 rows, u32 dp) { cat_rows_k<uint2>(a, d, rows, dp); }
extern "C" __global__ void cat_rows_v4(CatArgs a, unsigned int* d, u32 rows, u32 dp) { cat_rows_k<unsigned int>(a, d, rows, dp); }
extern "C" __global__ void cat_rows_v2(CatArgs a, unsigned short* d, u32 rows, u32 dp) { cat_rows_k<unsigned short>(a, d, rows, dp); }
extern "C" __global__ void cat_rows_v1(CatArgs a, u8* d, u32 rows, u32 dp) { cat_rows_k<u8>(a, d, rows, dp); }

// The inverse of cat_rows: output k (address a.src[k], a.cols[k] vectors per row) takes its
// columns at offset a.off[k] of every row of s (pitch sp vectors). One launch for a split's
// pieces (forward) and a concatenation's gradient pieces (backward).
template <typename V>
__device__ void split_rows_k(CatArgs a, const V* s, u32 rows, u32 sp) {
    unsigned long long dst;
    u32 cols, off;
    cat_piece(a, dst, cols, off);
    V* d = (V*)dst;
    const u32 total = rows * cols;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        const u32 r = i / cols, c = i - r * cols;
        d[i] = s[(size_t)r * sp + off + c];
    }
}
extern "C" __global__ void split_rows_v16(CatArgs a, const uint4* s, u32 rows, u32 sp) { split_rows_k<uint4>(a, s, rows, sp); }
extern "C" __global__ void split_rows_v8(CatArgs a, const uint2* s, u32 rows, u32 sp) { split_rows_k<uint2>(a, s, rows, sp); }
extern "C" __global__ void split_rows_v4(CatArgs a, const unsigned int* s, u32 rows, u32 sp) { split_rows_k<unsigned int>(a, s, rows, sp); }
extern "C" __global__ void split_rows_v2(CatArgs a, const unsigned short* s, u32 rows, u32 sp) { split_rows_k<unsigned short>(a, s, rows, sp); }
extern "C" __global__ void split_rows_v1(CatArgs a, const u8* s, u32 rows, u32 sp) { split_rows_k<u8>(a, s, rows, sp); }

// Keeps one thread busy for `cycles` SM clock cycles (benchmarks: lets the host queue a timed
// loop while the GPU is busy, so event timing measures GPU time, not launch throughput).
extern "C" __global__ void spin_cycles(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

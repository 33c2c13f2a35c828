// What every ptl-autograd kernel unit starts with: types, conversions, math overloads, shared
// geometry. Each unit (elementwise.cu, reduce.cu, …) is compiled with this in front, once per
// process with NVRTC and cached per unit (see mod.rs).
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

// Programmatic dependent launch (compute capability 9.0 and later). Every kernel's body opens with
// this call, inserted when its unit is compiled (kernel_units.rs: `with_entry_waits`): it waits
// until the kernel before it in the stream has ended and its writes are visible — a no-op for a
// launch without the attribute — and only then lets the next kernel's blocks be scheduled, so
// those are resident and waiting when this one ends instead of being launched after it. Nothing is
// read or written before the wait, so the bytes are those of plain stream order.
__device__ __forceinline__ void ptl_kernel_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// Type lists the units instantiate their kernels over.
#define FLOAT_TYPES(X) X(f32, float) X(f64, double) X(f16, __half) X(bf16, __nv_bfloat16)
#define ALL_TYPES(X) FLOAT_TYPES(X) X(i64, i64) X(u8, u8)

// 16-byte vector loads and stores in the accumulator type (contiguous binary ops, batch norm).
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

// ---- shared by the multi-tensor and pack kernels ---------------------------------------------------
// Elements one block handles in a chunked multi-tensor launch (cuda/ops/multi_tensor.rs sizes grids by it).
#define MT_CHUNK 2048
// One conversion, rounding exactly as the one-tensor casts do (f32 to a half type directly).
template <typename S, typename D> __device__ __forceinline__ D mt_conv(S x) { return from_d<D>(to_d(x)); }
template <> __device__ __forceinline__ __nv_bfloat16 mt_conv<float, __nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half mt_conv<float, __half>(float x) { return __float2half_rn(x); }

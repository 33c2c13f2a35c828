// Multi-tensor kernels: accumulate, cast, SGD, Muon momentum blend, EMA lerp, gradient clipping,
// GradScaler unscale and AdamW with device scalars (the optimizer step in few launches).
// Launched by multi_tensor.rs; compiled as one NVRTC unit behind prelude.cuh (see mod.rs).

// ---- multi-tensor accumulate and cast ----------------------------------------------------------------
// dst_k[i] += src_k[i] (ptr[0], ptr[1]) for up to MT_ADD same-dtype tensors in one launch — gradient accumulation
// into many parameters without a launch each. The table travels in the kernel parameters (graph
// capture keeps it); block b works on chunk b − first_block[k] of the tensor k whose block range
// holds b. The sum is the one binary add computes (same bytes).
#define MT_ADD 40
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
// dst_k = src_k, word by word (4-byte words: every tensor's bytes are a multiple of 4 here): the
// gradients a recorded backward writes into their persistent buffers, in one launch per 40.
__device__ void mt_copy_k(const MtTable& t) {
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    unsigned int* d = reinterpret_cast<unsigned int*>(t.ptr[0][k]);
    const unsigned int* s = reinterpret_cast<const unsigned int*>(t.ptr[1][k]);
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) d[i] = s[i];
}
extern "C" __global__ void mt_copy_words(const MtTable t) { mt_copy_k(t); }
#define INST_MT(name, T) \
    extern "C" __global__ void mt_add_##name(const MtTable t) { mt_add_k<T>(t); }
INST_MT(f32, float)
INST_MT(f64, double)
INST_MT(f16, __half)
INST_MT(bf16, __nv_bfloat16)
// dst_k = cast(src_k) for up to MT_ADD tensors, rounding exactly as the one-tensor casts do (f32 to
// a half type directly, the other way exactly): autocast's weight copies of a step in one launch.
// A nonzero ptr[2][k] = A | B << 32 also transposes the last two dimensions: src_k stored
// (K, A, B) lands in dst_k as (K, B, A) — a 4-D weight between OIHW and O, H, W, I order.
template <typename S, typename D>
__device__ void mt_cast_k(const MtTable& t) {
    u32 base, end;
    const u32 k = mt_locate(t, base, end);
    D* d = reinterpret_cast<D*>(t.ptr[0][k]);
    const S* s = reinterpret_cast<const S*>(t.ptr[1][k]);
    const unsigned long long tr = t.ptr[2][k];
    if (tr == 0) {
        for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) d[i] = mt_conv<S, D>(s[i]);
        return;
    }
    const u32 A = (u32)(tr & 0xffffffffull), B = (u32)(tr >> 32), AB = A * B;
    for (u32 i = base + threadIdx.x; i < end; i += blockDim.x) {
        const u32 kk = i / AB, r = i - kk * AB, b = r / A, a = r - b * A;
        d[i] = mt_conv<S, D>(s[kk * AB + a * B + b]);
    }
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

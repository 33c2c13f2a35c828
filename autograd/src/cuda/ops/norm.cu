// Batch norm: fused statistics + apply (+SiLU), its backward, the channel affine, eval-mode parameters.
// Launched by norm.rs; compiled as one NVRTC unit behind prelude.cuh (see mod.rs).

// ---- fused batch norm -----------------------------------------------------------------------------
// NCHW: a channel's N·HW elements are N runs of HW. Every kernel here takes a vector width V: with
// HW % V == 0 and 16-byte aligned buffers the host picks V = 16 / sizeof(T) (one 16-byte load per
// V elements, which keeps enough bytes in flight to run near bandwidth; a run never splits a
// vector), else V = 1. Elementwise math runs in the accumulator type (f32, f64 for f64 tensors);
// the per-channel sums accumulate in f64 and combine in a fixed order (no float atomics).

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
// `write` = false: only (sc, sh), for the blocks of a cluster other than the one that writes.
template <typename S>
__device__ __forceinline__ void bn_stats_finish(double s, double q, double K, u32 ch, u32 c, double count, const S* w, const S* b,
                                                S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt, S& sc, S& sh,
                                                bool write = true) {
    const double ms = s / count;
    double var = q / count - ms * ms;
    if (var < 0.0) var = 0.0;
    const double mean = K + ms;
    const double invstd = 1.0 / sqrt(var + eps);
    const double scale = (double)w[ch] * invstd;
    sc = (S)scale;
    sh = (S)((double)b[ch] - mean * scale);
    if (!write) return;
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

// With a residual r (a block's shortcut, `r + y`): y's V values stored in T and read back, then r's
// added as the addition kernel (binary_cv, op 0) adds them — the bytes of adding after the
// normalisation, without the launch. r == nullptr: nothing.
template <typename T, int V>
__device__ __forceinline__ void bn_add_residual(const T* r, size_t i, typename Acc<T>::type (&e)[V]) {
    typedef typename Acc<T>::type A;
    if (r == nullptr) return;
    A er[V];
    ld_vec<T, V>(r, i, er);
#pragma unroll
    for (int k = 0; k < V; ++k) e[k] = er[k] + to_acc(store<T, A>(e[k]));
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
__device__ void chaffine_k(const T* x, const S* p, const T* r, T* y, u32 nvec, u32 hv, u32 c, int silu) {
    typedef typename Acc<T>::type A;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += blockDim.x * gridDim.x) {
        const u32 ch = (v / hv) % c;
        const A sc = (A)p[ch], sh = (A)p[c + ch];
        A e[V];
        ld_vec<T, V>(x, (size_t)v * V, e);
        bn_apply_vec<A, V>(e, sc, sh, silu);
        bn_add_residual<T, V>(r, (size_t)v * V, e);
        st_vec<T, V>(y, (size_t)v * V, e);
    }
}

// One block per channel (P = 1), grid (1, C): bn_stats_k's sums and parameters, then chaffine_k's
// y = act(x·sc + sh) over the same channel in the same launch — the same arithmetic, so the same
// bytes as the two launches, one launch fewer for each small layer.
template <typename T, typename S, int V>
__device__ void bn_fwd1_k(const T* x, const T* r, T* y, u32 n, u32 c, u32 hw, double count, const S* w, const S* b, S* rm, S* rv,
                          double eps, double mom, S* aff, S* nrm, i64* nbt, int silu) {
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
        bn_add_residual<T, V>(r, i, e);
        st_vec<T, V>(y, i, e);
    }
}

// ---- batch-norm (+SiLU) backward --------------------------------------------------------------------
// gz = g·act'(z) with z = x·aff[ch] + aff[C+ch]; x̂ = x·nrm[ch] + nrm[C+ch].
// The output gradient's V values at i: g's, or — when the engine passed its two contributions —
// g + g2 stored in T and read back, the bytes the addition kernel (binary_cv / binary_c) would
// have written, so the result is the same as adding first.
template <typename T, int V>
__device__ __forceinline__ void bn_ld_grad(const T* g, const T* g2, size_t i, typename Acc<T>::type (&ge)[V]) {
    typedef typename Acc<T>::type A;
    ld_vec<T, V>(g, i, ge);
    if (g2 == nullptr) return;
    A e2[V];
    ld_vec<T, V>(g2, i, e2);
#pragma unroll
    for (int k = 0; k < V; ++k) ge[k] = to_acc(store<T, A>(ge[k] + e2[k]));
}
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
__device__ __forceinline__ void bnb_sums(const T* x, const T* g, const T* g2, u32 ch, u32 c, u32 hw, typename Acc<T>::type a0, typename Acc<T>::type a1,
                                         typename Acc<T>::type n0, typename Acc<T>::type n1, int silu, u32 start, u32 end, double& sa,
                                         double& sq) {
    typedef typename Acc<T>::type A;
    const u32 hv = hw / V;
    for (u32 v = start + threadIdx.x; v < end; v += 256) {
        const size_t i = bn_vec_index(v, hv, ch, c, hw, V);
        A xe[V], ge[V];
        ld_vec<T, V>(x, i, xe);
        bn_ld_grad<T, V>(g, g2, i, ge);
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
// `write` = false: only k3, for the blocks of a cluster other than the one that writes.
template <typename S>
__device__ __forceinline__ void bnb_finish(double sa, double sq, u32 ch, u32 c, double count, const S* w, const S* nrm, int training, S* gw,
                                           S* gb, S* coef, S* k3, bool write = true) {
    const double k = (double)w[ch] * (double)nrm[ch];
    k3[0] = (S)k;
    k3[1] = (S)(training ? -k * sa / count : 0.0);
    k3[2] = (S)(training ? -k * sq / count : 0.0);
    if (!write) return;
    gb[ch] = (S)sa;
    gw[ch] = (S)sq;
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
__device__ void bnb_reduce_k(const T* x, const T* g, const T* g2, const S* aff, const S* nrm, double* part, u32 n, u32 c, u32 hw, u32 P, int silu,
                             unsigned int* tickets, double count, const S* w, int training, S* gw, S* gb, S* coef) {
    typedef typename Acc<T>::type A;
    const u32 ch = blockIdx.y, p = blockIdx.x, hv = hw / V;
    const A a0 = (A)aff[ch], a1 = (A)aff[c + ch], n0 = (A)nrm[ch], n1 = (A)nrm[c + ch];
    u32 start, end;
    bn_chunk(n * hv, P, p, start, end);
    double sa = 0.0, sq = 0.0;
    bnb_sums<T, V>(x, g, g2, ch, c, hw, a0, a1, n0, n1, silu, start, end, sa, sq);
    if (!bn_last_block_totals(sa, sq, part, ch, p, P, tickets) || threadIdx.x != 0) return;
    S k3[3];
    bnb_finish<S>(sa, sq, ch, c, count, w, nrm, training, gw, gb, coef, k3);
}
// dx = coef[0]·gz + coef[1] + coef[2]·x̂, V elements per thread step.
template <typename T, typename S, int V>
__device__ void bnb_dx_k(const T* x, const T* g, const T* g2, const S* aff, const S* nrm, const S* coef, T* dx, u32 nvec, u32 hv, u32 c, int silu) {
    typedef typename Acc<T>::type A;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += blockDim.x * gridDim.x) {
        const u32 ch = (v / hv) % c;
        const A a0 = (A)aff[ch], a1 = (A)aff[c + ch], n0 = (A)nrm[ch], n1 = (A)nrm[c + ch];
        const A k0 = (A)coef[ch], k1 = (A)coef[c + ch], k2 = (A)coef[2 * c + ch];
        A xe[V], ge[V];
        ld_vec<T, V>(x, (size_t)v * V, xe);
        bn_ld_grad<T, V>(g, g2, (size_t)v * V, ge);
        bnb_dx_vec<A, V>(xe, ge, a0, a1, n0, n1, k0, k1, k2, silu);
        st_vec<T, V>(dx, (size_t)v * V, xe);
    }
}
// One block per channel (P = 1), grid (1, C): bnb_reduce_k's sums and coefficients, then bnb_dx_k's
// dx over the same channel in the same launch (same arithmetic, same bytes, one launch fewer).
template <typename T, typename S, int V>
__device__ void bnb_fused1_k(const T* x, const T* g, const T* g2, const S* aff, const S* nrm, u32 n, u32 c, u32 hw, int silu, double count,
                             const S* w, int training, S* gw, S* gb, S* coef, T* dx) {
    typedef typename Acc<T>::type A;
    __shared__ S sk[3];
    const u32 ch = blockIdx.y, hv = hw / V, nv = n * hv;
    const A a0 = (A)aff[ch], a1 = (A)aff[c + ch], n0 = (A)nrm[ch], n1 = (A)nrm[c + ch];
    double sa = 0.0, sq = 0.0;
    bnb_sums<T, V>(x, g, g2, ch, c, hw, a0, a1, n0, n1, silu, 0, nv, sa, sq);
    bn_block_sum2(sa, sq);
    if (threadIdx.x == 0) bnb_finish<S>(sa, sq, ch, c, count, w, nrm, training, gw, gb, coef, sk);
    __syncthreads();
    const A k0 = (A)sk[0], k1 = (A)sk[1], k2 = (A)sk[2];
    for (u32 v = threadIdx.x; v < nv; v += 256) {
        const size_t i = bn_vec_index(v, hv, ch, c, hw, V);
        A xe[V], ge[V];
        ld_vec<T, V>(x, i, xe);
        bn_ld_grad<T, V>(g, g2, i, ge);
        bnb_dx_vec<A, V>(xe, ge, a0, a1, n0, n1, k0, k1, k2, silu);
        st_vec<T, V>(dx, i, xe);
    }
}
// ---- one launch per direction for layers of 2–8 blocks per channel: a thread-block cluster each ------
// Grid (P, C) with clusters of (P, 1, 1): channel ch's P blocks form one cluster (block p has
// cluster rank p). Each block reduces its share of the channel as the two-launch kernels do and
// leaves its partial pair in its shared memory; after a cluster barrier every block combines the P
// pairs exactly as bn_last_block_totals does (lane k of the first warp adds pair k to zero, then
// the shuffle tree), so every block holds the totals of the two-launch path; block 0 writes the
// channel's parameters and each block applies them to its share in the same launch. The second
// barrier keeps each block's shared memory alive until every block has read it. sm_90 and later.
__device__ __forceinline__ void bn_cluster_barrier() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// `local[i]` of the cluster block of rank `rank` (the same shared variable in that block).
__device__ __forceinline__ double bn_cluster_load(const double* local, u32 i, u32 rank) {
    double v = 0.0;
#if __CUDA_ARCH__ >= 900
    const u32 a = (u32)__cvta_generic_to_shared(local + i);
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(r) : "memory");
#endif
    return v;
}
// The channel's totals (a, b) in every thread of every block of the cluster (P blocks).
__device__ __forceinline__ void bn_cluster_totals(double& a, double& b, u32 P) {
    __shared__ double pair[2], tot[2];
    bn_block_sum2(a, b);
    if (threadIdx.x == 0) {
        pair[0] = a;
        pair[1] = b;
    }
    bn_cluster_barrier();
    if (threadIdx.x < 32) {
        a = 0.0;
        b = 0.0;
        for (u32 k = threadIdx.x; k < P; k += 32) {
            a += bn_cluster_load(pair, 0, k);
            b += bn_cluster_load(pair, 1, k);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            a += __shfl_down_sync(0xffffffffu, a, o);
            b += __shfl_down_sync(0xffffffffu, b, o);
        }
        if (threadIdx.x == 0) {
            tot[0] = a;
            tot[1] = b;
        }
    }
    bn_cluster_barrier();
    a = tot[0];
    b = tot[1];
}
// bn_stats_k + chaffine_k in one launch for a channel of P blocks (one cluster).
template <typename T, typename S, int V>
__device__ void bn_fwdc_k(const T* x, const T* r, T* y, u32 n, u32 c, u32 hw, u32 P, double count, const S* w, const S* b, S* rm,
                          S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt, int silu) {
    typedef typename Acc<T>::type A;
    __shared__ S ssc, ssh;
    const u32 ch = blockIdx.y, p = blockIdx.x, hv = hw / V;
    u32 start, end;
    bn_chunk(n * hv, P, p, start, end);
    const A K = to_acc(x[(size_t)ch * hw]);
    double s = 0.0, q = 0.0;
    bn_shifted_sums<T, V>(x, ch, c, hw, K, start, end, s, q);
    bn_cluster_totals(s, q, P);
    if (threadIdx.x == 0) {
        S sc, sh;
        bn_stats_finish<S>(s, q, (double)K, ch, c, count, w, b, rm, rv, eps, mom, aff, nrm, nbt, sc, sh, p == 0);
        ssc = sc;
        ssh = sh;
    }
    __syncthreads();
    const A sc = (A)ssc, sh = (A)ssh;
    for (u32 v = start + threadIdx.x; v < end; v += 256) {
        const size_t i = bn_vec_index(v, hv, ch, c, hw, V);
        A e[V];
        ld_vec<T, V>(x, i, e);
        bn_apply_vec<A, V>(e, sc, sh, silu);
        bn_add_residual<T, V>(r, i, e);
        st_vec<T, V>(y, i, e);
    }
}
// bnb_reduce_k + bnb_dx_k in one launch for a channel of P blocks (one cluster).
template <typename T, typename S, int V>
__device__ void bnb_fusedc_k(const T* x, const T* g, const T* g2, const S* aff, const S* nrm, u32 n, u32 c, u32 hw, u32 P, int silu, double count,
                             const S* w, int training, S* gw, S* gb, S* coef, T* dx) {
    typedef typename Acc<T>::type A;
    __shared__ S sk[3];
    const u32 ch = blockIdx.y, p = blockIdx.x, hv = hw / V;
    const A a0 = (A)aff[ch], a1 = (A)aff[c + ch], n0 = (A)nrm[ch], n1 = (A)nrm[c + ch];
    u32 start, end;
    bn_chunk(n * hv, P, p, start, end);
    double sa = 0.0, sq = 0.0;
    bnb_sums<T, V>(x, g, g2, ch, c, hw, a0, a1, n0, n1, silu, start, end, sa, sq);
    bn_cluster_totals(sa, sq, P);
    if (threadIdx.x == 0) bnb_finish<S>(sa, sq, ch, c, count, w, nrm, training, gw, gb, coef, sk, p == 0);
    __syncthreads();
    const A k0 = (A)sk[0], k1 = (A)sk[1], k2 = (A)sk[2];
    for (u32 v = start + threadIdx.x; v < end; v += 256) {
        const size_t i = bn_vec_index(v, hv, ch, c, hw, V);
        A xe[V], ge[V];
        ld_vec<T, V>(x, i, xe);
        bn_ld_grad<T, V>(g, g2, i, ge);
        bnb_dx_vec<A, V>(xe, ge, a0, a1, n0, n1, k0, k1, k2, silu);
        st_vec<T, V>(dx, i, xe);
    }
}
#define INST_BN_V(name, T, S, V, sfx)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bn_stats##sfx##_##name(const T* x, double* part, u32 n, u32 c, u32 hw, u32 P,    \
        unsigned int* tickets, double count, const S* w, const S* b, S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt) { \
        bn_stats_k<T, S, V>(x, part, n, c, hw, P, tickets, count, w, b, rm, rv, eps, mom, aff, nrm, nbt);                              \
    }                                                                                                                                  \
    extern "C" __global__ void chaffine##sfx##_##name(const T* x, const S* p, const T* r, T* y, u32 nvec, u32 hv, u32 c, int silu) {  \
        chaffine_k<T, S, V>(x, p, r, y, nvec, hv, c, silu);                                                                            \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bnb_reduce##sfx##_##name(const T* x, const T* g, const T* g2, const S* aff, const S* nrm,    \
        double* part, u32 n, u32 c, u32 hw, u32 P, int silu, unsigned int* tickets, double count, const S* w, int training, S* gw,     \
        S* gb, S* coef) {                                                                                                              \
        bnb_reduce_k<T, S, V>(x, g, g2, aff, nrm, part, n, c, hw, P, silu, tickets, count, w, training, gw, gb, coef);                    \
    }                                                                                                                                  \
    extern "C" __global__ void bnb_dx##sfx##_##name(const T* x, const T* g, const T* g2, const S* aff, const S* nrm, const S* coef, T* dx,         \
        u32 nvec, u32 hv, u32 c, int silu) {                                                                                           \
        bnb_dx_k<T, S, V>(x, g, g2, aff, nrm, coef, dx, nvec, hv, c, silu);                                                                \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bn_fwd1##sfx##_##name(const T* x, const T* r, T* y, u32 n, u32 c, u32 hw,       \
        double count, const S* w, const S* b, S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt, int silu) {              \
        bn_fwd1_k<T, S, V>(x, r, y, n, c, hw, count, w, b, rm, rv, eps, mom, aff, nrm, nbt, silu);                                     \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bnb_fused1##sfx##_##name(const T* x, const T* g, const T* g2, const S* aff, const S* nrm,    \
        u32 n, u32 c, u32 hw, int silu, double count, const S* w, int training, S* gw, S* gb, S* coef, T* dx) {                        \
        bnb_fused1_k<T, S, V>(x, g, g2, aff, nrm, n, c, hw, silu, count, w, training, gw, gb, coef, dx);                                   \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bn_fwdc##sfx##_##name(const T* x, const T* r, T* y, u32 n, u32 c, u32 hw,       \
        u32 P, double count, const S* w, const S* b, S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt, int silu) {       \
        bn_fwdc_k<T, S, V>(x, r, y, n, c, hw, P, count, w, b, rm, rv, eps, mom, aff, nrm, nbt, silu);                                  \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bnb_fusedc##sfx##_##name(const T* x, const T* g, const T* g2, const S* aff, const S* nrm,    \
        u32 n, u32 c, u32 hw, u32 P, int silu, double count, const S* w, int training, S* gw, S* gb, S* coef, T* dx) {                 \
        bnb_fusedc_k<T, S, V>(x, g, g2, aff, nrm, n, c, hw, P, silu, count, w, training, gw, gb, coef, dx);                                \
    }
#define INST_BN(name, T, S)            \
    INST_BN_V(name, T, S, 1, )         \
    INST_BN_V(name, T, S, 16 / sizeof(T), _v)
INST_BN(f32, float, float)
INST_BN(f64, double, double)
INST_BN(f16, __half, float)
INST_BN(bf16, __nv_bfloat16, float)

// ---- batch norm (+SiLU) on channels-last storage ----------------------------------------------------
// N, H, W, C storage: element (row r, channel ch) at r·C + ch over rows = N·H·W. A thread owns V
// consecutive channels: one 16-byte load per row when C % V == 0 and the buffers are 16-byte
// aligned (the host's choice), else V = 1. A block of 256 threads is (CW, L): CW = blockDim.x
// channel vectors side by side (a tile of CW·V channels, so a warp reads whole rows of the tile:
// contiguous bytes) and L = blockDim.y = 256 / CW row lanes (a power of two); lane y takes rows
// start + y, start + y + L, … of its block's share. A thread's sums run in f64; the lanes combine
// by a fixed binary tree in shared memory, then the P blocks of a tile as bn_last_block_totals
// does, so a shape's bytes are fixed (they are not the N, C, H, W kernels' bytes: the summation
// order differs).

// Fixed-order sum of each of the V pairs (a, b) over the L row lanes: a shuffle tree over the
// lanes of one warp (lanes t and t + o hold the same channels when o is a multiple of CW), then
// the 8 warps' sums in order. Valid where threadIdx.y == 0 (the first warp's first CW threads).
// Every thread must call it.
template <int V>
__device__ __forceinline__ void bncl_lane_sum(double (&a)[V], double (&b)[V]) {
    __shared__ double sh[2 * V][8][32];
    const u32 cw = blockDim.x, t = threadIdx.y * cw + threadIdx.x, lane = t & 31, warp = t >> 5;
    for (u32 o = 16; o >= cw; o >>= 1) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            a[k] += __shfl_down_sync(0xffffffffu, a[k], o);
            b[k] += __shfl_down_sync(0xffffffffu, b[k], o);
        }
    }
    if (lane < cw) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            sh[k][warp][lane] = a[k];
            sh[V + k][warp][lane] = b[k];
        }
    }
    __syncthreads();
    if (threadIdx.y == 0) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            a[k] = sh[k][0][lane];
            b[k] = sh[V + k][0][lane];
            for (u32 w = 1; w < (blockDim.x * blockDim.y) >> 5; ++w) {
                a[k] += sh[k][w][lane];
                b[k] += sh[V + k][w][lane];
            }
        }
    }
    __syncthreads();  // sh may be reused by the next call
}
// Whether this block holds the tile's totals (then in its row-lane-0 threads): P = 1, the block's
// own sums; else each block writes its channels' partial pairs (part[(p·C + ch)·2 + {0, 1}]) and
// takes the tile's ticket, and the last block sums the P partials of each channel lane-strided,
// then over the lanes as above, and resets the ticket. The same answer in every thread of a block.
template <int V>
__device__ __forceinline__ bool bncl_tile_totals(double (&a)[V], double (&b)[V], double* part, u32 c, u32 ch0, bool valid, u32 tile,
                                                 u32 p, u32 P, unsigned int* tickets) {
    __shared__ bool last;
    bncl_lane_sum<V>(a, b);
    if (P == 1) return true;
    if (threadIdx.y == 0 && valid) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            part[((size_t)p * c + ch0 + k) * 2] = a[k];
            part[((size_t)p * c + ch0 + k) * 2 + 1] = b[k];
        }
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) last = atomicAdd(&tickets[tile], 1u) == P - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
#pragma unroll
    for (int k = 0; k < V; ++k) a[k] = b[k] = 0.0;
    if (valid) {
        for (u32 j = threadIdx.y; j < P; j += blockDim.y) {  // L1-bypassing: written by other blocks
#pragma unroll
            for (int k = 0; k < V; ++k) {
                a[k] += __ldcg(&part[((size_t)j * c + ch0 + k) * 2]);
                b[k] += __ldcg(&part[((size_t)j * c + ch0 + k) * 2 + 1]);
            }
        }
    }
    bncl_lane_sum<V>(a, b);
    if (threadIdx.x == 0 && threadIdx.y == 0) tickets[tile] = 0u;
    return true;
}
// Hands the totals of the row-lane-0 threads out one channel per thread: thread (x, y < V) gets
// the pair of channel ch0(x) + y, so the per-channel finishing math (divisions, square roots in
// f64) runs V-wide instead of V times over. Every thread of the block must call it.
template <int V>
__device__ __forceinline__ void bncl_spread(const double (&a)[V], const double (&b)[V], double& ta, double& tb) {
    __shared__ double sp[2][V][32];
    if (threadIdx.y == 0) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            sp[0][k][threadIdx.x] = a[k];
            sp[1][k][threadIdx.x] = b[k];
        }
    }
    __syncthreads();
    if (threadIdx.y < V) {
        ta = sp[0][threadIdx.y][threadIdx.x];
        tb = sp[1][threadIdx.y][threadIdx.x];
    }
}
// This thread's first channel.
__device__ __forceinline__ u32 bncl_first_channel(int V) { return (blockIdx.y * blockDim.x + threadIdx.x) * (u32)V; }
// Rows a thread loads before it sums them (loads in flight; the sums still run in row order).
#define BNCL_UNROLL 4
// This thread's shifted sums of its V channels over rows [start + threadIdx.y, end) in steps of L,
// in row order (K = each channel's value in row 0); zeros for a thread past the last channel.
template <typename T, int V>
__device__ __forceinline__ void bncl_shifted_sums(const T* x, u32 ch0, u32 c, bool valid, u32 start, u32 end, double (&s)[V],
                                                  double (&q)[V]) {
    typedef typename Acc<T>::type A;
#pragma unroll
    for (int k = 0; k < V; ++k) s[k] = q[k] = 0.0;
    if (!valid) return;
    A K[V];
    ld_vec<T, V>(x, ch0, K);
    const u32 L = blockDim.y;
    u32 r = start + threadIdx.y;
    for (; r + (BNCL_UNROLL - 1) * L < end; r += BNCL_UNROLL * L) {
        A e[BNCL_UNROLL][V];
#pragma unroll
        for (int u = 0; u < BNCL_UNROLL; ++u) ld_vec<T, V>(x, (size_t)(r + u * L) * c + ch0, e[u]);
#pragma unroll
        for (int u = 0; u < BNCL_UNROLL; ++u) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const double d = (double)(e[u][k] - K[k]);
                s[k] += d;
                q[k] += d * d;
            }
        }
    }
    for (; r < end; r += L) {
        A e[V];
        ld_vec<T, V>(x, (size_t)r * c + ch0, e);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const double d = (double)(e[k] - K[k]);
            s[k] += d;
            q[k] += d * d;
        }
    }
}
// Training statistics, grid (P, tiles), block (CW, 256 / CW): bn_stats_k's sums and parameters
// (K = each channel's value in row 0).
template <typename T, typename S, int V>
__device__ void bncl_stats_k(const T* x, double* part, u32 rows, u32 c, u32 P, unsigned int* tickets, double count, const S* w, const S* b,
                             S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt) {
    const u32 tile = blockIdx.y, p = blockIdx.x, ch0 = bncl_first_channel(V);
    const bool valid = ch0 < c;
    u32 start, end;
    bn_chunk(rows, P, p, start, end);
    double s[V], q[V];
    bncl_shifted_sums<T, V>(x, ch0, c, valid, start, end, s, q);
    if (!bncl_tile_totals<V>(s, q, part, c, ch0, valid, tile, p, P, tickets)) return;
    double ts = 0.0, tq = 0.0;
    bncl_spread<V>(s, q, ts, tq);
    if (!valid || threadIdx.y >= V) return;
    const u32 ch = ch0 + threadIdx.y;
    S sc, sh;
    bn_stats_finish<S>(ts, tq, (double)to_acc(x[ch]), ch, c, count, w, b, rm, rv, eps, mom, aff, nrm, nbt, sc, sh);
}
// y = act(x·p[ch] + p[C + ch]) over channels-last storage, V elements per step (C % V == 0 when
// V > 1, so a vector never crosses a row); nvec = len / V.
template <typename T, typename S, int V>
__device__ void chaffine_cl_k(const T* x, const S* p, T* y, u32 nvec, u32 c, int silu) {
    typedef typename Acc<T>::type A;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += blockDim.x * gridDim.x) {
        const u32 ch0 = (u32)(((size_t)v * V) % c);
        A e[V];
        ld_vec<T, V>(x, (size_t)v * V, e);
#pragma unroll
        for (int k = 0; k < V; ++k) bn_apply_vec<A, 1>(&e[k], (A)p[ch0 + k], (A)p[c + ch0 + k], silu);
        st_vec<T, V>(y, (size_t)v * V, e);
    }
}
// One block per tile (P = 1), grid (1, tiles): bncl_stats_k's sums and parameters, then
// chaffine_cl_k's arithmetic over the tile in the same launch (the two launches' bytes).
template <typename T, typename S, int V>
__device__ void bncl_fwd1_k(const T* x, T* y, u32 rows, u32 c, double count, const S* w, const S* b, S* rm, S* rv, double eps, double mom,
                            S* aff, S* nrm, i64* nbt, int silu) {
    typedef typename Acc<T>::type A;
    __shared__ S ssc[256], ssh[256];
    const u32 ch0 = bncl_first_channel(V);
    const bool valid = ch0 < c;
    double s[V], q[V];
    bncl_shifted_sums<T, V>(x, ch0, c, valid, 0, rows, s, q);
    bncl_lane_sum<V>(s, q);
    double ts = 0.0, tq = 0.0;
    bncl_spread<V>(s, q, ts, tq);
    if (valid && threadIdx.y < V) {
        const u32 ch = ch0 + threadIdx.y;
        bn_stats_finish<S>(ts, tq, (double)to_acc(x[ch]), ch, c, count, w, b, rm, rv, eps, mom, aff, nrm, nbt,
                           ssc[threadIdx.x * V + threadIdx.y], ssh[threadIdx.x * V + threadIdx.y]);
    }
    __syncthreads();
    if (!valid) return;
    A sc[V], sh[V];
#pragma unroll
    for (int k = 0; k < V; ++k) sc[k] = (A)ssc[threadIdx.x * V + k], sh[k] = (A)ssh[threadIdx.x * V + k];
    for (u32 r = threadIdx.y; r < rows; r += blockDim.y) {
        const size_t i = (size_t)r * c + ch0;
        A e[V];
        ld_vec<T, V>(x, i, e);
#pragma unroll
        for (int k = 0; k < V; ++k) bn_apply_vec<A, 1>(&e[k], sc[k], sh[k], silu);
        st_vec<T, V>(y, i, e);
    }
}
// The forward's per-channel parameters of this thread's V channels: (aff[ch], aff[C + ch],
// nrm[ch], nrm[C + ch]) for each.
template <typename A, typename S, int V>
__device__ __forceinline__ void bncl_params(const S* aff, const S* nrm, u32 ch0, u32 c, A (&t)[V][4]) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
        t[k][0] = (A)aff[ch0 + k];
        t[k][1] = (A)aff[c + ch0 + k];
        t[k][2] = (A)nrm[ch0 + k];
        t[k][3] = (A)nrm[c + ch0 + k];
    }
}
// This thread's backward sums (Σgz, Σgz·x̂) of its V channels over rows [start + threadIdx.y, end),
// in row order (two rows loaded before they are summed), and the forward's parameters `t` it used
// (bncl_params); zeros for a thread past the last channel.
template <typename T, typename S, int V>
__device__ __forceinline__ void bnbcl_sums(const T* x, const T* g, const S* aff, const S* nrm, u32 ch0, u32 c, bool valid, int silu,
                                           u32 start, u32 end, typename Acc<T>::type (&t)[V][4], double (&sa)[V], double (&sq)[V]) {
    typedef typename Acc<T>::type A;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        sa[k] = sq[k] = 0.0;
        t[k][0] = t[k][1] = t[k][2] = t[k][3] = (A)0;
    }
    if (!valid) return;
    bncl_params<A, S, V>(aff, nrm, ch0, c, t);
    const u32 L = blockDim.y;
    u32 r = start + threadIdx.y;
    for (; r + L < end; r += 2 * L) {
        A xe[2][V], ge[2][V];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            ld_vec<T, V>(x, (size_t)(r + u * L) * c + ch0, xe[u]);
            ld_vec<T, V>(g, (size_t)(r + u * L) * c + ch0, ge[u]);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                A gz, xh;
                bnb_terms<A>(xe[u][k], ge[u][k], t[k][0], t[k][1], t[k][2], t[k][3], silu, gz, xh);
                sa[k] += (double)gz;
                sq[k] += (double)gz * (double)xh;
            }
        }
    }
    for (; r < end; r += L) {
        const size_t i = (size_t)r * c + ch0;
        A xe[V], ge[V];
        ld_vec<T, V>(x, i, xe);
        ld_vec<T, V>(g, i, ge);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            A gz, xh;
            bnb_terms<A>(xe[k], ge[k], t[k][0], t[k][1], t[k][2], t[k][3], silu, gz, xh);
            sa[k] += (double)gz;
            sq[k] += (double)gz * (double)xh;
        }
    }
}
// Backward reduction, grid (P, tiles), block (CW, 256 / CW): bnb_reduce_k's sums and coefficients.
template <typename T, typename S, int V>
__device__ void bnbcl_reduce_k(const T* x, const T* g, const S* aff, const S* nrm, double* part, u32 rows, u32 c, u32 P, int silu,
                               unsigned int* tickets, double count, const S* w, int training, S* gw, S* gb, S* coef) {
    typedef typename Acc<T>::type A;
    const u32 tile = blockIdx.y, p = blockIdx.x, ch0 = bncl_first_channel(V);
    const bool valid = ch0 < c;
    u32 start, end;
    bn_chunk(rows, P, p, start, end);
    A t[V][4];
    double sa[V], sq[V];
    bnbcl_sums<T, S, V>(x, g, aff, nrm, ch0, c, valid, silu, start, end, t, sa, sq);
    if (!bncl_tile_totals<V>(sa, sq, part, c, ch0, valid, tile, p, P, tickets)) return;
    double ta = 0.0, tq = 0.0;
    bncl_spread<V>(sa, sq, ta, tq);
    if (!valid || threadIdx.y >= V) return;
    S k3[3];
    bnb_finish<S>(ta, tq, ch0 + threadIdx.y, c, count, w, nrm, training, gw, gb, coef, k3);
}
// dx = coef[0]·gz + coef[1] + coef[2]·x̂ over channels-last storage, V elements per step (C % V
// == 0 when V > 1).
template <typename T, typename S, int V>
__device__ void bnbcl_dx_k(const T* x, const T* g, const S* aff, const S* nrm, const S* coef, T* dx, u32 nvec, u32 c, int silu) {
    typedef typename Acc<T>::type A;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += blockDim.x * gridDim.x) {
        const u32 ch0 = (u32)(((size_t)v * V) % c);
        A xe[V], ge[V];
        ld_vec<T, V>(x, (size_t)v * V, xe);
        ld_vec<T, V>(g, (size_t)v * V, ge);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const u32 ch = ch0 + k;
            bnb_dx_vec<A, 1>(&xe[k], &ge[k], (A)aff[ch], (A)aff[c + ch], (A)nrm[ch], (A)nrm[c + ch], (A)coef[ch], (A)coef[c + ch],
                             (A)coef[2 * c + ch], silu);
        }
        st_vec<T, V>(dx, (size_t)v * V, xe);
    }
}
// One block per tile (P = 1), grid (1, tiles): bnbcl_reduce_k's sums and coefficients, then
// bnbcl_dx_k's dx over the tile in the same launch.
template <typename T, typename S, int V>
__device__ void bnbcl_fused1_k(const T* x, const T* g, const S* aff, const S* nrm, u32 rows, u32 c, int silu, double count, const S* w,
                               int training, S* gw, S* gb, S* coef, T* dx) {
    typedef typename Acc<T>::type A;
    __shared__ S sk[3][256];
    const u32 ch0 = bncl_first_channel(V);
    const bool valid = ch0 < c;
    A t[V][4];
    double sa[V], sq[V];
    bnbcl_sums<T, S, V>(x, g, aff, nrm, ch0, c, valid, silu, 0, rows, t, sa, sq);
    bncl_lane_sum<V>(sa, sq);
    double ta = 0.0, tq = 0.0;
    bncl_spread<V>(sa, sq, ta, tq);
    if (valid && threadIdx.y < V) {
        S k3[3];
        bnb_finish<S>(ta, tq, ch0 + threadIdx.y, c, count, w, nrm, training, gw, gb, coef, k3);
        sk[0][threadIdx.x * V + threadIdx.y] = k3[0];
        sk[1][threadIdx.x * V + threadIdx.y] = k3[1];
        sk[2][threadIdx.x * V + threadIdx.y] = k3[2];
    }
    __syncthreads();
    if (!valid) return;
    A k0[V], k1[V], k2[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        k0[k] = (A)sk[0][threadIdx.x * V + k];
        k1[k] = (A)sk[1][threadIdx.x * V + k];
        k2[k] = (A)sk[2][threadIdx.x * V + k];
    }
    for (u32 r = threadIdx.y; r < rows; r += blockDim.y) {
        const size_t i = (size_t)r * c + ch0;
        A xe[V], ge[V];
        ld_vec<T, V>(x, i, xe);
        ld_vec<T, V>(g, i, ge);
#pragma unroll
        for (int k = 0; k < V; ++k) bnb_dx_vec<A, 1>(&xe[k], &ge[k], t[k][0], t[k][1], t[k][2], t[k][3], k0[k], k1[k], k2[k], silu);
        st_vec<T, V>(dx, i, xe);
    }
}
// Each kernel at vector width V (suffix "" for 1, "_v" for 16 / sizeof(T)).
#define INST_BNCL_V(name, T, S, V, sfx)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) bncl_stats##sfx##_##name(const T* x, double* part, u32 rows, u32 c, u32 P,       \
        unsigned int* tickets, double count, const S* w, const S* b, S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt) {   \
        bncl_stats_k<T, S, V>(x, part, rows, c, P, tickets, count, w, b, rm, rv, eps, mom, aff, nrm, nbt);                               \
    }                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) bncl_fwd1##sfx##_##name(const T* x, T* y, u32 rows, u32 c, double count,         \
        const S* w, const S* b, S* rm, S* rv, double eps, double mom, S* aff, S* nrm, i64* nbt, int silu) {                             \
        bncl_fwd1_k<T, S, V>(x, y, rows, c, count, w, b, rm, rv, eps, mom, aff, nrm, nbt, silu);                                         \
    }                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) bnbcl_reduce##sfx##_##name(const T* x, const T* g, const S* aff, const S* nrm,   \
        double* part, u32 rows, u32 c, u32 P, int silu, unsigned int* tickets, double count, const S* w, int training, S* gw, S* gb,     \
        S* coef) {                                                                                                                       \
        bnbcl_reduce_k<T, S, V>(x, g, aff, nrm, part, rows, c, P, silu, tickets, count, w, training, gw, gb, coef);                     \
    }                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) bnbcl_fused1##sfx##_##name(const T* x, const T* g, const S* aff, const S* nrm,   \
        u32 rows, u32 c, int silu, double count, const S* w, int training, S* gw, S* gb, S* coef, T* dx) {                              \
        bnbcl_fused1_k<T, S, V>(x, g, aff, nrm, rows, c, silu, count, w, training, gw, gb, coef, dx);                                   \
    }                                                                                                                                    \
    extern "C" __global__ void chaffine_cl##sfx##_##name(const T* x, const S* p, T* y, u32 nvec, u32 c, int silu) {                     \
        chaffine_cl_k<T, S, V>(x, p, y, nvec, c, silu);                                                                                  \
    }                                                                                                                                    \
    extern "C" __global__ void bnbcl_dx##sfx##_##name(const T* x, const T* g, const S* aff, const S* nrm, const S* coef, T* dx,         \
        u32 nvec, u32 c, int silu) {                                                                                                     \
        bnbcl_dx_k<T, S, V>(x, g, aff, nrm, coef, dx, nvec, c, silu);                                                                    \
    }
#define INST_BNCL(name, T, S)                                                                                                            \
    INST_BNCL_V(name, T, S, 1, )                                                                                                         \
    INST_BNCL_V(name, T, S, 16 / sizeof(T), _v)
INST_BNCL(f32, float, float)
INST_BNCL(f64, double, double)
INST_BNCL(f16, __half, float)
INST_BNCL(bf16, __nv_bfloat16, float)

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

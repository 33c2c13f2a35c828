// Weight gradient of a planar 1×1 stride-1 convolution with narrow rows — the head's last
// projections (16 → 4, 64 → 1, 85 → 51 and 85 → 34 channels), whose rows are not 16-byte aligned —
// at small batches. Launched by narrow_wgrad.rs; compiled as one NVRTC unit behind prelude.cuh.
//
//   dW[o][c] = Σ_n Σ_p dy[n][o][p] · x[n][c][p]
//
// is a GEMM whose contraction runs over the (item, position) pairs; with planar storage that
// contraction has no single stride, so cuBLAS needs a GEMM per item (plus its split-K reductions)
// or a batched GEMM of per-item partials, whose kernels for these shapes are slow. Here a block
// takes a band of consecutive (item, position) pairs and a 64 × 32 tile of the weight, and writes
// the band's f32 sums; the last block of a tile to finish (a ticket per tile) adds the tile's
// bands in order, as sum_partials does, so the bytes are fixed for a shape — in one launch.

#define NW_TO 64   // outputs per block tile
#define NW_TC 32   // inputs per block tile
#define NW_KC 32   // contraction positions per shared chunk

// Grid (bands, output tiles, input tiles), 256 threads. Thread (ty, tx) = (t / 16, t % 16) owns
// outputs o0 + 4·ty + i (i < 4) and inputs c0 + 2·tx + j (j < 2); it adds its products over the
// band's positions in ascending order (one FMA chain per weight) into part[(band·co + o)·ci + c].
// Loads: lane = position in the chunk (coalesced along p), warp w = rows w, w + 8, …; the next
// chunk's values are loaded into registers while the current one is multiplied.
//
// With `bpart` (the bias gradient asked for too), the blocks of the first input tile also add the
// output gradient over their band, per output, in ascending position order (thread t < NW_TO owns
// output o0 + t), into bpart[band·co + o]: the bias gradient Σ_n Σ_p dy[n][o][p] from the values
// already in shared memory, instead of another pass over dy.
template <typename T>
__device__ void narrow_wgrad_part_k(const T* dy, const T* x, float* part, float* bpart, u32 co, u32 ci, u32 P, u32 K,
                                    u32 per) {
    __shared__ float sdy[NW_KC][NW_TO + 1];
    __shared__ float sx[NW_KC][NW_TC + 1];
    const u32 band = blockIdx.x, o0 = blockIdx.y * NW_TO, c0 = blockIdx.z * NW_TC;
    const u32 t = threadIdx.x, tx = t % 16, ty = t / 16, lane = t & 31u, warp = t >> 5;
    const u32 k0 = min(band * per, K), k1 = min(k0 + per, K);
    float rd[NW_TO / 8], rx[NW_TC / 8];
    auto load = [&](u32 kb) {
        const u32 k = kb + lane;
        const bool in = k < k1;
        const u32 n = in ? k / P : 0, p = in ? k - n * P : 0;
#pragma unroll
        for (u32 r = 0; r < NW_TO / 8; ++r) {
            const u32 o = o0 + warp + 8 * r;
            rd[r] = (in && o < co) ? to_acc(dy[((size_t)n * co + o) * P + p]) : 0.f;
        }
#pragma unroll
        for (u32 r = 0; r < NW_TC / 8; ++r) {
            const u32 c = c0 + warp + 8 * r;
            rx[r] = (in && c < ci) ? to_acc(x[((size_t)n * ci + c) * P + p]) : 0.f;
        }
    };
    float acc[4][2] = {{0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}};
    const bool bias = bpart != nullptr && blockIdx.z == 0 && t < NW_TO;
    float bacc = 0.f;
    if (k0 < k1) load(k0);
    for (u32 kb = k0; kb < k1; kb += NW_KC) {
        __syncthreads();  // every thread is done with the previous chunk
#pragma unroll
        for (u32 r = 0; r < NW_TO / 8; ++r) sdy[lane][warp + 8 * r] = rd[r];
#pragma unroll
        for (u32 r = 0; r < NW_TC / 8; ++r) sx[lane][warp + 8 * r] = rx[r];
        __syncthreads();
        if (kb + NW_KC < k1) load(kb + NW_KC);
        if (bias) {
#pragma unroll 8
            for (u32 j = 0; j < NW_KC; ++j) bacc += sdy[j][t];
        }
#pragma unroll 8
        for (u32 j = 0; j < NW_KC; ++j) {
            float a[4], b[2];
#pragma unroll
            for (u32 i = 0; i < 4; ++i) a[i] = sdy[j][4 * ty + i];
            b[0] = sx[j][2 * tx];
            b[1] = sx[j][2 * tx + 1];
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                acc[i][0] = fmaf(a[i], b[0], acc[i][0]);
                acc[i][1] = fmaf(a[i], b[1], acc[i][1]);
            }
        }
    }
#pragma unroll
    for (u32 i = 0; i < 4; ++i) {
        const u32 o = o0 + 4 * ty + i;
#pragma unroll
        for (u32 j = 0; j < 2; ++j) {
            const u32 c = c0 + 2 * tx + j;
            if (o < co && c < ci) part[((size_t)band * co + o) * ci + c] = acc[i][j];
        }
    }
    if (bias && o0 + t < co) bpart[(size_t)band * co + o0 + t] = bacc;
}
// After its band's partial, a block takes its tile's ticket (`tickets`: device-lifetime zeros of
// the launching stream); the last of the `nb` bands adds the tile's partials in band order — the
// order and f32 arithmetic of sum_partials — stores them in T, and resets the ticket.
// With `bpart`, the last block of a first-input-tile tile adds the bias partials of its outputs
// in band order too and stores them in `bout`.
template <typename T>
__device__ void narrow_wgrad_k(const T* dy, const T* x, float* part, T* out, float* bpart, T* bout, u32 co, u32 ci, u32 P,
                               u32 K, u32 per, u32 nb, unsigned int* tickets) {
    narrow_wgrad_part_k<T>(dy, x, part, bpart, co, ci, P, K, per);
    __shared__ bool last;
    const u32 tile = blockIdx.y * gridDim.z + blockIdx.z;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&tickets[tile], 1u) == nb - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const u32 o0 = blockIdx.y * NW_TO, c0 = blockIdx.z * NW_TC;
    const size_t len = (size_t)co * ci;
    for (u32 e = threadIdx.x; e < NW_TO * NW_TC; e += blockDim.x) {
        const u32 o = o0 + e / NW_TC, c = c0 + e % NW_TC;
        if (o >= co || c >= ci) continue;
        const size_t j = (size_t)o * ci + c;
        float acc = __ldcg(&part[j]);
        for (u32 b = 1; b < nb; ++b) acc += __ldcg(&part[(size_t)b * len + j]);
        out[j] = store<T, float>(acc);
    }
    if (bpart != nullptr && blockIdx.z == 0 && threadIdx.x < NW_TO && o0 + threadIdx.x < co) {
        const u32 o = o0 + threadIdx.x;
        float acc = __ldcg(&bpart[o]);
        for (u32 b = 1; b < nb; ++b) acc += __ldcg(&bpart[(size_t)b * co + o]);
        bout[o] = store<T, float>(acc);
    }
    if (threadIdx.x == 0) tickets[tile] = 0u;
}
#define INST_NARROW(name, T)                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                                                          \
        narrow_wgrad_##name(const T* dy, const T* x, float* part, T* out, float* bpart, T* bout, u32 co, u32 ci, u32 P, u32 K, \
                            u32 per, u32 nb, unsigned int* tickets) {                                                          \
        narrow_wgrad_k<T>(dy, x, part, out, bpart, bout, co, ci, P, K, per, nb, tickets);                                     \
    }
INST_NARROW(f32, float)
INST_NARROW(f16, __half)
INST_NARROW(bf16, __nv_bfloat16)

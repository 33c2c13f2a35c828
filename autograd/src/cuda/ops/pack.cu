// Padded matrix batches (Tensor::pack_padded / unpack_padded) for the Newton–Schulz iteration.
// Launched by pack.rs; compiled as one NVRTC unit behind prelude.cuh (see mod.rs).

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

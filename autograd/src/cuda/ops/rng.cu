// Graph-safe Philox RNG: dropout keep masks whose seed and offset live on the device.
// Launched by rng.rs; compiled as one NVRTC unit behind prelude.cuh (see mod.rs).

// ---- graph-safe Philox RNG (graph_rng.rs: the key and counter live on the device) ----------------------------------------------------------
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

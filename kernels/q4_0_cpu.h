// Shared between q4_0_cpu.cpp (the matmul kernels), forward_cpu.cpp (the fused step) and
// sample_cpu.cpp (the host sampler).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// The vector code of forward_cpu.cpp and sample_cpu.cpp is built as AVX-512 / AVX2 / baseline
// clones, picked by the CPU at load.
#define TQ_STR_(x) #x
#define TQ_STR(x) TQ_STR_(x)
#if defined(TQ_ONE_CLONE)  // one clone alone (-DTQ_ONE_CLONE=arch=x86-64-v3), to compare the clones' bits
#define TQ_CLONES __attribute__((target(TQ_STR(TQ_ONE_CLONE))))
#elif defined(TQ_NO_CLONES)  // baseline x86-64 only
#define TQ_CLONES
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TQ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TQ_CLONES
#endif

namespace tq {

constexpr int QK = 32;          // weights per Q4_0 block
constexpr int BLOCK_BYTES = 18; // fp16 scale + 16 nibble bytes
constexpr int TILE_ROWS = 4;    // weight rows per tile (unit of the thread split)
constexpr int GROUP = 16;       // rows per group of the packed (q16) layout
constexpr int GROUP_BLOCK_BYTES = GROUP * BLOCK_BYTES;  // a group's block: 16 scales, 16 x 16 bytes

// Rows [r0, r1) of thread `tid` of `nt`: contiguous runs of whole 4-row tiles.
inline void thread_rows(int64_t N, int tid, int nt, int64_t* r0, int64_t* r1) {
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t t0 = tiles * tid / nt, t1 = tiles * (tid + 1) / nt;
    *r0 = t0 * TILE_ROWS;
    *r1 = t1 * TILE_ROWS < N ? t1 * TILE_ROWS : N;
}

// Groups [g0, g1) of thread `tid` of `nt` (contiguous runs; packed matmuls split by group).
inline void thread_groups(int64_t G, int tid, int nt, int64_t* g0, int64_t* g1) {
    *g0 = G * tid / nt;
    *g1 = G * (tid + 1) / nt;
}

// The instruction-set path to use: `isa` (0 scalar, 1 AVX2, 2 AVX-512) capped at the best the CPU
// has; -1 means the best.
int resolve_isa(int isa);

// Output rows [r0, r1) of out[M, N] = x[M, K] @ W.T with f32 activations, on the calling thread
// (r0 and r1 on 4-row tile boundaries, or r1 == N). `isa` must be resolved.
void matmul_f32_rows(const float* x, const uint8_t* q, float* out, int64_t M, int64_t N, int64_t K,
                     int64_t r0, int64_t r1, int isa);

// q16 (see q4_0_cpu.cpp): activation rows [m0, m1) of x[M, K] quantized into xp[M, K/32, 16],
// dx[M, K/32], xs[M, K/32]; then output rows of groups [g0, g1) of out[M, N] from packed weights.
void quantize_rows_q16(const float* x, int32_t* xp, float* dx, int32_t* xs, int64_t m0, int64_t m1, int64_t K);
void matmul_q16_groups(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* p, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t g0, int64_t g1, int isa);
void pack_q4_0(const uint8_t* q, int64_t N, int64_t K, uint8_t* out);
void unpack_q4_0(const uint8_t* p, int64_t N, int64_t K, uint8_t* out);
void embedding_rows_packed(const int64_t* ids, int64_t n_ids, const uint8_t* p, int64_t K, float* out);

// out[n_ids, K] = dequantized rows `ids` of q (bitwise the reference).
void embedding_rows(const int64_t* ids, int64_t n_ids, const uint8_t* q, int64_t K, float* out);

// exp(x) in fixed operations (Cephes expf coefficients; ~2 ulp): the same bits in every clone.
// exp_body is the part after the clamp to [-87, 88]; exp_lanes runs it over N lanes in passes
// the vectoriser takes (with the default -ftrapping-math GCC will not if-convert a clamp that
// feeds more arithmetic, so a loop calling exp_fixed stays scalar: the clamps get passes of
// their own). Both give the same bits for every input.
__attribute__((always_inline)) inline float exp_body(float x) {
    const float magic = 12582912.0f;  // 1.5 * 2^23: (v + magic) - magic rounds v to an integer
    const float n = (x * 1.44269504088896341f + magic) - magic;
    float r = std::fma(n, -0.693359375f, x);
    r = std::fma(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    const float y = std::fma(p, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

inline float exp_fixed(float x) { return exp_body(x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x)); }

// v[i] = exp_fixed(v[i]) for i < N.
template <int N>
__attribute__((always_inline)) inline void exp_lanes(float* __restrict v) {
#pragma omp simd
    for (int i = 0; i < N; ++i) v[i] = v[i] < -87.0f ? -87.0f : v[i];
#pragma omp simd
    for (int i = 0; i < N; ++i) v[i] = v[i] > 88.0f ? 88.0f : v[i];
#pragma omp simd
    for (int i = 0; i < N; ++i) v[i] = exp_body(v[i]);
}

}  // namespace tq

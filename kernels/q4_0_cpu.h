// Shared between q4_0_cpu.cpp (the matmul kernels) and forward_cpu.cpp (the fused step).
#pragma once

#include <cstdint>

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

}  // namespace tq

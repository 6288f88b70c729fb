// Shared between q4_0_cpu.cpp (the matmul kernels) and forward_cpu.cpp (the fused step).
#pragma once

#include <cstdint>

namespace tq {

constexpr int QK = 32;          // weights per Q4_0 block
constexpr int BLOCK_BYTES = 18; // fp16 scale + 16 nibble bytes
constexpr int TILE_ROWS = 4;    // weight rows per tile (unit of the thread split)

// Rows [r0, r1) of thread `tid` of `nt`: contiguous runs of whole 4-row tiles.
inline void thread_rows(int64_t N, int tid, int nt, int64_t* r0, int64_t* r1) {
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t t0 = tiles * tid / nt, t1 = tiles * (tid + 1) / nt;
    *r0 = t0 * TILE_ROWS;
    *r1 = t1 * TILE_ROWS < N ? t1 * TILE_ROWS : N;
}

// The instruction-set path to use: `isa` (0 scalar, 1 AVX2, 2 AVX-512) capped at the best the CPU
// has; -1 means the best.
int resolve_isa(int isa);

// Output rows [r0, r1) of out[M, N] = x[M, K] @ W.T with f32 activations, on the calling thread
// (r0 and r1 on 4-row tile boundaries, or r1 == N). `isa` must be resolved.
void matmul_f32_rows(const float* x, const uint8_t* q, float* out, int64_t M, int64_t N, int64_t K,
                     int64_t r0, int64_t r1, int isa);

// out[n_ids, K] = dequantized rows `ids` of q (bitwise the reference).
void embedding_rows(const int64_t* ids, int64_t n_ids, const uint8_t* q, int64_t K, float* out);

}  // namespace tq

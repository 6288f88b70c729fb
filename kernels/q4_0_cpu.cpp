// Fast CPU Q4_0 kernels, loaded by kernels/cpu.py through ctypes.
//
// matmul: out[M, N] = x[M, K] (f32) @ W[N, K].T with W in llama.cpp's block_q4_0 layout
// (per 32 weights: fp16 scale d, then 16 bytes; byte j = weight j (low nibble) and
// weight j+16 (high nibble); value (nibble - 8) * d).
//
// Two activation modes: "q8" (below) and "f32" (tq_matmul_f32: weights dequantized to f32 per
// block and FMA'd against the f32 activations, no activation rounding; order at rows_f32_scalar).
//
// q8, per call: (1) each activation row is quantized to Q8_0 (32 int8 + an fp32 scale per
// block, round-to-nearest-even, like llama.cpp's AVX2 quantize_row_q8_0); (2) every
// output element is a sum over blocks of int8 dot products scaled by d_w * d_x.
//
// Arithmetic order of one output element (the same in every path, for every M, tile
// and thread count, so results are bitwise reproducible and batched == single row):
//   lane[i] (i = 0..7) = sum_{j=4i..4i+3} (qw_j - 8) * qx_j          (exact int32)
//   acc[i]  = fma(float(lane[i]), d_w * d_x, acc[i])  for blocks in order, acc = 0
//   result  = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7))
// The scalar path emulates the AVX2 lanes exactly, so both paths agree bit for bit.
//
// Threading: one OpenMP region per call (quantize the rows, barrier, then the output
// rows split into contiguous ranges of 4-row tiles); libgomp is the one torch loaded.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define TQ_X86 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__GNUC__)
#define TQ_ARM 1
#include <arm_neon.h>
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

#include "q4_0_cpu.h"

namespace {

using tq::QK;
using tq::BLOCK_BYTES;
using tq::TILE_ROWS;
using tq::thread_rows;
constexpr int64_t MIN_BYTES_PER_THREAD = 32 * 1024;  // weight bytes x M worth a thread

enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2, ISA_NEON = 3, ISA_AMX = 4 };  // NEON: with dot product;
// AMX: the AVX-512 VNNI paths plus q16 batches on the tile unit

// ---------------------------------------------------------------- portable scalar path

inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ffu;
    uint32_t f;
    if (exp == 0) {
        if (mant == 0) {
            f = sign;
        } else {  // subnormal: normalize
            uint32_t e = 113;
            while (!(mant & 0x400u)) { mant <<= 1; --e; }
            f = sign | (e << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        f = sign | 0x7f800000u | (mant << 13);
    } else {
        f = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float r;
    std::memcpy(&r, &f, 4);
    return r;
}

inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

void quantize_row_scalar(const float* x, int8_t* q, float* d, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        for (int j = 0; j < QK; ++j) q[b * QK + j] = (int8_t)std::nearbyint(xb[j] * id);
        d[b] = db;
    }
}

inline float hsum8_scalar(const float* a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

float dot_row_scalar(const uint8_t* w, const int8_t* a, const float* ad, int64_t nb) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * BLOCK_BYTES;
        const float s = fp16_to_fp32(load_u16(blk)) * ad[b];
        const int8_t* y = a + b * QK;
        int8_t wv[QK];
        for (int j = 0; j < 16; ++j) {
            wv[j] = (int8_t)((blk[2 + j] & 0x0f) - 8);
            wv[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
        }
        for (int i = 0; i < 8; ++i) {
            int32_t lane = 0;
            for (int j = 4 * i; j < 4 * i + 4; ++j) lane += (int32_t)wv[j] * (int32_t)y[j];
            acc[i] = std::fma((float)lane, s, acc[i]);
        }
    }
    return hsum8_scalar(acc);
}

void rows_scalar(const uint8_t* q, int64_t row_bytes, const int8_t* qa, const float* da,
                 float* out, int64_t M, int64_t N, int64_t K, int64_t r0, int64_t r1) {
    const int64_t nb = K / QK;
    for (int64_t n = r0; n < r1; ++n)
        for (int64_t m = 0; m < M; ++m)
            out[m * N + n] = dot_row_scalar(q + n * row_bytes, qa + m * K, da + m * nb, nb);
}

// f32-activation path. Arithmetic order of one output element (every path, M, tile, thread count):
//   w_j = (nibble_j - 8) * d_w                                        (exact in f32)
//   lane[l] (l = 0..15), per block in order, acc = 0:
//       lane[l] = fma(w_l, x_l, lane[l]);  lane[l] = fma(w_{l+16}, x_{l+16}, lane[l])
//   a[i] = lane[i] + lane[i+8] (i = 0..7); result = hsum8 order above
float dot_row_f32_scalar(const uint8_t* w, const float* x, int64_t nb) {
    float acc[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * BLOCK_BYTES;
        const float d = fp16_to_fp32(load_u16(blk));
        const float* xb = x + b * QK;
        for (int l = 0; l < 16; ++l) {
            const float lo = (float)((blk[2 + l] & 0x0f) - 8) * d;
            const float hi = (float)((blk[2 + l] >> 4) - 8) * d;
            acc[l] = std::fma(lo, xb[l], acc[l]);
            acc[l] = std::fma(hi, xb[l + 16], acc[l]);
        }
    }
    float a8[8];
    for (int i = 0; i < 8; ++i) a8[i] = acc[i] + acc[i + 8];
    return hsum8_scalar(a8);
}

void rows_f32_scalar(const uint8_t* q, int64_t row_bytes, const float* x,
                     float* out, int64_t M, int64_t N, int64_t K, int64_t r0, int64_t r1) {
    const int64_t nb = K / QK;
    for (int64_t n = r0; n < r1; ++n)
        for (int64_t m = 0; m < M; ++m)
            out[m * N + n] = dot_row_f32_scalar(q + n * row_bytes, x + m * K, nb);
}

// The drivers of a q8-activation tile ``tile_<ISA><R, C>``: weight rows 4 at a time (then one by
// one), activation rows C4 at a time for 4-row tiles and 4 at a time for single rows. Expanded in
// each ISA's target region (the tiles inline only into code of their own target).
#define TQ_Q8_ROWS(ISA, C4)                                                                             \
    template <int R>                                                                                    \
    void rows_tile_##ISA(const uint8_t* w, int64_t row_bytes, const int8_t* qa, const float* da,       \
                         float* out, int64_t M, int64_t N, int64_t K) {                                 \
        const int64_t nb = K / QK;                                                                      \
        constexpr int C = R == 4 ? C4 : 4;                                                              \
        int64_t m = 0;                                                                                  \
        for (; m + C <= M; m += C)                                                                      \
            tile_##ISA<R, C>(w, row_bytes, qa + m * K, da + m * nb, K, nb, out + m * N, N);            \
        for (; m < M; ++m)                                                                              \
            tile_##ISA<R, 1>(w, row_bytes, qa + m * K, da + m * nb, K, nb, out + m * N, N);            \
    }                                                                                                   \
    void rows_##ISA(const uint8_t* q, int64_t row_bytes, const int8_t* qa, const float* da,            \
                    float* out, int64_t M, int64_t N, int64_t K, int64_t r0, int64_t r1) {              \
        int64_t n = r0;                                                                                 \
        for (; n + 4 <= r1; n += 4)                                                                     \
            rows_tile_##ISA<4>(q + n * row_bytes, row_bytes, qa, da, out + n, M, N, K);                \
        for (; n < r1; ++n)                                                                             \
            rows_tile_##ISA<1>(q + n * row_bytes, row_bytes, qa, da, out + n, M, N, K);                \
    }

// ---------------------------------------------------------------- AVX2 + FMA + F16C path
#ifdef TQ_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

void quantize_row_avx2(const float* x, int8_t* q, float* d, int64_t nb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float db = amax / 127.0f;
        const float idf = db != 0.0f ? 1.0f / db : 0.0f;
        const __m256 id = _mm256_set1_ps(idf);
        // cvtps rounds with MXCSR (nearest even), as nearbyint in the scalar path
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        i0 = _mm256_packs_epi32(i0, i1);
        i2 = _mm256_packs_epi32(i2, i3);
        i0 = _mm256_packs_epi16(i0, i2);
        i0 = _mm256_permutevar8x32_epi32(i0, perm);
        _mm256_storeu_si256((__m256i*)(q + b * QK), i0);
        d[b] = db;
    }
}

inline float hsum8_avx2(__m256 v) {
    // ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)), the order hsum8_scalar uses
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// R weight rows x C activation rows; acc[r][c] follows the per-element order above.
template <int R, int C>
inline __attribute__((always_inline)) void tile_avx2(
        const uint8_t* w, int64_t row_bytes, const int8_t* a, const float* ad,
        int64_t K, int64_t nb, float* out, int64_t N) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    const __m256i eight = _mm256_set1_epi8(8);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
        __m256i y[C], y8[C];
        __m256 dx[C];
        for (int c = 0; c < C; ++c) {
            y[c] = _mm256_loadu_si256((const __m256i*)(a + c * K + b * QK));
            y8[c] = _mm256_maddubs_epi16(eight, y[c]);  // 8 * (y_2k + y_2k+1), int16
            dx[c] = _mm256_broadcast_ss(ad + c * nb + b);
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * row_bytes + b * BLOCK_BYTES;
            const __m256 dw = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
            const __m128i t = _mm_loadu_si128((const __m128i*)(blk + 2));
            const __m256i qv = _mm256_and_si256(
                _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1), lo4);
            for (int c = 0; c < C; ++c) {
                // (q - 8) . y  ==  q . y - 8 y, all in int16 without saturation
                __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(qv, y[c]), y8[c]);
                __m256i s = _mm256_madd_epi16(p, ones);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx[c]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[c * N + r] = hsum8_avx2(acc[r][c]);
}

TQ_Q8_ROWS(avx2, 2)

// f32 activations, 8-wide: the 16 lanes as two halves (lanes 0-7: weights 0-7 and 16-23;
// lanes 8-15: weights 8-15 and 24-31), each a full pass over the blocks (lanes are independent,
// so the per-lane order is the scalar one); the second pass reads the tile's rows from L1.
// PACKED: the R rows were dequantized once into wf[R][K] (dequant_rows_avx2, the same exact
// values), so a GEMM dequantizes each weight once per chunk of activation rows, not once per C rows.
template <int R, int C, bool PACKED>
inline __attribute__((always_inline)) void tile_f32_avx2(
        const uint8_t* w, int64_t row_bytes, const float* wf, const float* x, int64_t K, int64_t nb,
        float* out, int64_t N) {
    const __m256i lo4 = _mm256_set1_epi32(0x0f);
    const __m256 m8 = _mm256_set1_ps(-8.0f);
    __m256 half[2][R][C];
    for (int h = 0; h < 2; ++h) {
        __m256 acc[R][C];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m256 xl[C], xh[C];
            for (int c = 0; c < C; ++c) {
                xl[c] = _mm256_loadu_ps(x + c * K + b * QK + 8 * h);
                xh[c] = _mm256_loadu_ps(x + c * K + b * QK + 16 + 8 * h);
            }
            for (int r = 0; r < R; ++r) {
                __m256 wl, wh;
                if constexpr (PACKED) {
                    wl = _mm256_loadu_ps(wf + r * K + b * QK + 8 * h);
                    wh = _mm256_loadu_ps(wf + r * K + b * QK + 16 + 8 * h);
                } else {
                    const uint8_t* blk = w + r * row_bytes + b * BLOCK_BYTES;
                    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
                    const __m256 nd8 = _mm256_mul_ps(d, m8);  // exact
                    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * h)));
                    // n * d - 8 d == (n - 8) * d exactly (one rounding of an exact value)
                    wl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, lo4)), d, nd8);
                    wh = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, nd8);
                }
                for (int c = 0; c < C; ++c) {
                    acc[r][c] = _mm256_fmadd_ps(wl, xl[c], acc[r][c]);
                    acc[r][c] = _mm256_fmadd_ps(wh, xh[c], acc[r][c]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) half[h][r][c] = acc[r][c];
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[c * N + r] = hsum8_avx2(_mm256_add_ps(half[0][r][c], half[1][r][c]));
}

// wf[r][k] = weight k of row r as f32, for R rows of nb blocks (values as tile_f32_avx2 computes them).
template <int R>
void dequant_rows_avx2(const uint8_t* w, int64_t row_bytes, int64_t nb, float* wf, int64_t K) {
    const __m256i lo4 = _mm256_set1_epi32(0x0f);
    const __m256 m8 = _mm256_set1_ps(-8.0f);
    for (int r = 0; r < R; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = w + r * row_bytes + b * BLOCK_BYTES;
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
            const __m256 nd8 = _mm256_mul_ps(d, m8);
            float* o = wf + r * K + b * QK;
            for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * h)));
                _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, lo4)), d, nd8));
                _mm256_storeu_ps(o + 16 + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, nd8));
            }
        }
}

// GEMM: activation rows in chunks that stay in L2; per chunk and 4-row tile, the rows are
// dequantized once into an L1 buffer and every C = 2 activation rows run over it.
constexpr int64_t PACK_MIN_M = 4;            // below this, dequantize in registers (GEMV)
constexpr int64_t X_CHUNK_FLOATS = 48 * 1024; // ~192 KB of activations per chunk

template <int R>
void rows_tile_f32_avx2(const uint8_t* w, int64_t row_bytes, const float* wf, const float* x,
                        float* out, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    constexpr int C = R == 4 ? 2 : 4;
    int64_t m = 0;
    if (wf) {
        for (; m + C <= M; m += C) tile_f32_avx2<R, C, true>(w, row_bytes, wf, x + m * K, K, nb, out + m * N, N);
        for (; m < M; ++m) tile_f32_avx2<R, 1, true>(w, row_bytes, wf, x + m * K, K, nb, out + m * N, N);
        return;
    }
    for (; m + C <= M; m += C) tile_f32_avx2<R, C, false>(w, row_bytes, wf, x + m * K, K, nb, out + m * N, N);
    for (; m < M; ++m) tile_f32_avx2<R, 1, false>(w, row_bytes, wf, x + m * K, K, nb, out + m * N, N);
}

void rows_f32_avx2(const uint8_t* q, int64_t row_bytes, const float* x,
                   float* out, int64_t M, int64_t N, int64_t K, int64_t r0, int64_t r1) {
    if (M < PACK_MIN_M) {
        int64_t n = r0;
        for (; n + 4 <= r1; n += 4) rows_tile_f32_avx2<4>(q + n * row_bytes, row_bytes, nullptr, x, out + n, M, N, K);
        for (; n < r1; ++n) rows_tile_f32_avx2<1>(q + n * row_bytes, row_bytes, nullptr, x, out + n, M, N, K);
        return;
    }
    thread_local std::vector<float> buf;
    if ((int64_t)buf.size() < 4 * K) buf.resize(4 * K);
    float* wf = buf.data();
    const int64_t nb = K / QK;
    const int64_t chunk = X_CHUNK_FLOATS / K > PACK_MIN_M ? X_CHUNK_FLOATS / K : PACK_MIN_M;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        const float* xc = x + m0 * K;
        float* oc = out + m0 * N;
        int64_t n = r0;
        for (; n + 4 <= r1; n += 4) {
            dequant_rows_avx2<4>(q + n * row_bytes, row_bytes, nb, wf, K);
            rows_tile_f32_avx2<4>(q + n * row_bytes, row_bytes, wf, xc, oc + n, mc, N, K);
        }
        for (; n < r1; ++n) {
            dequant_rows_avx2<1>(q + n * row_bytes, row_bytes, nb, wf, K);
            rows_tile_f32_avx2<1>(q + n * row_bytes, row_bytes, wf, xc, oc + n, mc, N, K);
        }
    }
}

#pragma GCC pop_options

// ---------------------------------------------------------------- AVX-512 VNNI path (256-bit, VL)
// vpdpbusd computes the same exact int32 lanes as maddubs + madd, so this path gives the
// same bits as the AVX2 one; it saves two ops per block and has 32 vector registers.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")

template <int R, int C>
inline __attribute__((always_inline)) void tile_vnni(
        const uint8_t* w, int64_t row_bytes, const int8_t* a, const float* ad,
        int64_t K, int64_t nb, float* out, int64_t N) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    const __m256i eight = _mm256_set1_epi8(8);
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i y[C], nc[C];
        __m256 dx[C];
        for (int c = 0; c < C; ++c) {
            y[c] = _mm256_loadu_si256((const __m256i*)(a + c * K + b * QK));
            nc[c] = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, eight, y[c]));  // -8 * sum4(y)
            dx[c] = _mm256_broadcast_ss(ad + c * nb + b);
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * row_bytes + b * BLOCK_BYTES;
            const __m256 dw = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
            const __m128i t = _mm_loadu_si128((const __m128i*)(blk + 2));
            const __m256i qv = _mm256_and_si256(
                _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1), lo4);
            for (int c = 0; c < C; ++c) {
                __m256i s = _mm256_dpbusd_epi32(nc[c], qv, y[c]);  // (q - 8) . y per 4 bytes
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx[c]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[c * N + r] = hsum8_avx2(acc[r][c]);
}

TQ_Q8_ROWS(vnni, 4)

// f32 activations, 16-wide (512-bit): lane l holds weights l and l+16 of every block.
template <int R, int C>
inline __attribute__((always_inline)) void tile_f32_512(
        const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t nb, float* out, int64_t N) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    // table[i] = (i - 8) * d (exact); vpermps picks entry (index & 15), so the low nibble
    // needs no mask and the dequantized weight costs one permute
    const __m512 iota_m8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t b = 0; b < nb; ++b) {
        __m512 xl[C], xh[C];
        for (int c = 0; c < C; ++c) {
            xl[c] = _mm512_loadu_ps(x + c * K + b * QK);
            xh[c] = _mm512_loadu_ps(x + c * K + b * QK + 16);
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * row_bytes + b * BLOCK_BYTES;
            const __m512 table = _mm512_mul_ps(iota_m8, _mm512_set1_ps(_cvtsh_ss(load_u16(blk))));
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)));
            const __m512 wl = _mm512_permutexvar_ps(v, table);
            const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            for (int c = 0; c < C; ++c) {
                acc[r][c] = _mm512_fmadd_ps(wl, xl[c], acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(wh, xh[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            const __m512 a = acc[r][c];
            const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(a),
                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
            out[c * N + r] = hsum8_avx2(s);
        }
}

template <int R>
void rows_tile_f32_512(const uint8_t* w, int64_t row_bytes, const float* x,
                       float* out, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    constexpr int C = 4;
    int64_t m = 0;
    for (; m + C <= M; m += C) tile_f32_512<R, C>(w, row_bytes, x + m * K, K, nb, out + m * N, N);
    for (; m < M; ++m) tile_f32_512<R, 1>(w, row_bytes, x + m * K, K, nb, out + m * N, N);
}

void rows_f32_512(const uint8_t* q, int64_t row_bytes, const float* x,
                  float* out, int64_t M, int64_t N, int64_t K, int64_t r0, int64_t r1) {
    int64_t n = r0;
    for (; n + 4 <= r1; n += 4) rows_tile_f32_512<4>(q + n * row_bytes, row_bytes, x, out + n, M, N, K);
    for (; n < r1; ++n) rows_tile_f32_512<1>(q + n * row_bytes, row_bytes, x, out + n, M, N, K);
}

#pragma GCC pop_options
#endif  // TQ_X86

// ---------------------------------------------------------------- q16: packed weights x int16 activations
// The default CPU matmul. Weights are repacked once at load (tq_pack_q4_0; the same Q4_0 values
// and bytes, another order): groups of GROUP = 16 rows; per group and block, 288 bytes = the 16
// rows' fp16 scales, then for step s = 0..3 the 16 rows' bytes 4s..4s+3 (4 bytes per row). One
// 64-byte load of a step, masked, holds per row (a dword lane) the four weights k = 4s..4s+3 as
// bytes 0..15; shifted right by 4 and masked, the weights k = 4s+16..4s+19: lanes are rows, 128
// weights per load and three ops, no horizontal sums.
// Activations are quantized per row and block of 32: dx = amax / Q16_MAX, xq = round-half-even(
// x * (1 / dx)), |xq| <= Q16_MAX = 32639 = 127 * 257, so xq = 256 * xh + xl with both halves
// signed bytes (xh = (xq + 128) >> 8); per block and step 4 dwords — the xh and the xl bytes of
// k = 4s..4s+3, then of k = 4s+16..4s+19 — and xs = the sum of xq. One output element (every
// path, M, tile, thread count):
//   dp  = 256 * sum_k n_k * xh_k + sum_k n_k * xl_k - 8 * xs = sum_k (n_k - 8) * xq_k
//                                                              (exact int32; |dp| < 2^23)
//   acc = fma(float(dp), d_w[b] * dx[b], acc)                   for blocks in order, acc = 0
// float(dp) is exact, so the paths differ in nothing: AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw,
// its int16 pairs added up to 8 at a time, then vpmaddwd: no int16 saturation or wrap, |pair| <=
// 2 * 15 * 128; q16_tile_avx2) and scalar give the same bits.

constexpr int GROUP = tq::GROUP;
constexpr int GBYTES = tq::GROUP_BLOCK_BYTES;
constexpr int32_t Q16_MAX = 32639;
constexpr int64_t Q16_ROW_BLOCK_BYTES = 16 * 4 + 4 + 4;  // one activation block: quads, scale, sum

// Activation rows per pass over the weights: ~128 KB of quantized activations (stays in L2).
inline int64_t q16_chunk_rows(int64_t nb) {
    const int64_t rows = (128 * 1024) / (nb * Q16_ROW_BLOCK_BYTES);
    return rows < 4 ? 4 : rows / 4 * 4;
}

#if defined(TQ_X86) && defined(__GNUC__) && !defined(__clang__)
#define TQ_Q16_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TQ_Q16_CLONES
#endif

// One activation row to q16 (layout above). Only exact IEEE operations (max, divide, multiply,
// round-half-even), so every clone gives the same bits.
TQ_Q16_CLONES void quantize_row_q16_generic(const float* x, int32_t* xp, float* dx, int32_t* xs, int64_t nb) {
    // three passes, so the per-block scalar steps (max, the two divisions) vectorise across blocks
    float amax[64], inv[64];                 // a row of up to 64 blocks per pass (2048 values)
    for (int64_t b0 = 0; b0 < nb; b0 += 64) {
        const int64_t n = nb - b0 < 64 ? nb - b0 : 64;
        for (int64_t b = 0; b < n; ++b) {
            const float* v = x + (b0 + b) * QK;
            float m = 0.0f;
            for (int j = 0; j < QK; ++j) {
                const float a = std::fabs(v[j]);
                m = a > m ? a : m;
            }
            amax[b] = m;
        }
        for (int64_t b = 0; b < n; ++b) {
            const float d = amax[b] / (float)Q16_MAX;
            dx[b0 + b] = d;
            inv[b] = d != 0.0f ? 1.0f / d : 0.0f;
        }
        for (int64_t b = 0; b < n; ++b) {
            const float* v = x + (b0 + b) * QK;
            const float id = inv[b];
            int32_t q[QK];
            for (int j = 0; j < QK; ++j) {
                float r = std::nearbyint(v[j] * id);
                r = r > (float)Q16_MAX ? (float)Q16_MAX : (r < -(float)Q16_MAX ? -(float)Q16_MAX : r);
                q[j] = (int32_t)r;
            }
            int32_t sum = 0;
            int8_t hb[QK], lb[QK];  // xq = 256 * hb + lb
            for (int j = 0; j < QK; ++j) {
                const int32_t h = (q[j] + 128) >> 8;
                sum += q[j];
                hb[j] = (int8_t)h;
                lb[j] = (int8_t)(q[j] - 256 * h);
            }
            int32_t* o = xp + (b0 + b) * 16;
            for (int st = 0; st < 4; ++st) {  // byte c of dword i of step s: weight 4s + c (+ 16 for i >= 2)
                std::memcpy(o + 4 * st + 0, hb + 4 * st, 4);
                std::memcpy(o + 4 * st + 1, lb + 4 * st, 4);
                std::memcpy(o + 4 * st + 2, hb + 16 + 4 * st, 4);
                std::memcpy(o + 4 * st + 3, lb + 16 + 4 * st, 4);
            }
            xs[b0 + b] = sum;
        }
    }
}

#ifdef TQ_X86
// The same quantization in AVX-512 intrinsics (the generic loops above do not vectorise the byte
// split and the quad interleave): the same exact operations, so the same bits.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_row_q16_512(const float* x, int32_t* xp,
                                                                               float* dx, int32_t* xs, int64_t nb) {
    const __m512 qmax = _mm512_set1_ps((float)Q16_MAX), qmin = _mm512_set1_ps(-(float)Q16_MAX);
    const __m512i c128 = _mm512_set1_epi32(128);
    // output dword 4s + i: i = 0 hb[s], 1 lb[s], 2 hb[4 + s], 3 lb[4 + s] (hb, lb: 8 dwords of bytes)
    const __m512i order = _mm512_setr_epi32(0, 8, 4, 12, 1, 9, 5, 13, 2, 10, 6, 14, 3, 11, 7, 15);
    float inv[64];  // per pass of up to 64 blocks: the maxima first, then both divisions 16 blocks at a time
    for (int64_t b0 = 0; b0 < nb; b0 += 64) {
        const int64_t n = nb - b0 < 64 ? nb - b0 : 64;
        for (int64_t b = 0; b < n; ++b) {
            const float* v = x + (b0 + b) * QK;
            inv[b] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v)), _mm512_abs_ps(_mm512_loadu_ps(v + 16))));
        }
        for (int64_t b = 0; b < n; b += 16) {
            const __mmask16 k = n - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - b)) - 1);
            const __m512 d = _mm512_div_ps(_mm512_maskz_loadu_ps(k, inv + b), qmax);
            _mm512_mask_storeu_ps(dx + b0 + b, k, d);
            const __mmask16 nz = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_OQ);
            _mm512_mask_storeu_ps(inv + b, k, _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0f), d));
        }
        for (int64_t bb = 0; bb < n; ++bb) {
            const int64_t b = b0 + bb;
            const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
            const float id = inv[bb];
            const __m512 s = _mm512_set1_ps(id);
            // round half to even (the default rounding mode), then clamp: exact on integral values
            const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, s), rnd);
            const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, s), rnd);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r0, qmin), qmax));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r1, qmin), qmax));
            const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(q0, c128), 8), h1 = _mm512_srai_epi32(_mm512_add_epi32(q1, c128), 8);
            const __m512i l0 = _mm512_sub_epi32(q0, _mm512_slli_epi32(h0, 8)), l1 = _mm512_sub_epi32(q1, _mm512_slli_epi32(h1, 8));
            const __m256i hb = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(h0)), _mm512_cvtepi32_epi8(h1), 1);
            const __m256i lb = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(l0)), _mm512_cvtepi32_epi8(l1), 1);
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(hb), lb, 1);   // dwords: hb 0..7, lb 8..15
            _mm512_storeu_si512((void*)(xp + b * 16), _mm512_permutexvar_epi32(order, both));
            xs[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
    }
}
#endif

void quantize_row_q16(const float* x, int32_t* xp, float* dx, int32_t* xs, int64_t nb) {
#ifdef TQ_X86
    static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vl");
    if (avx512) return quantize_row_q16_512(x, xp, dx, xs, nb);
#endif
    quantize_row_q16_generic(x, xp, dx, xs, nb);
}

// A q16 tile: 16 rows (one group) x C activation rows.
using Q16Tile = void (*)(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* w, float* out,
                         int64_t N, int64_t nb, int64_t rows);

// Groups [g0, g1) one at a time, activation rows `wide` at a time through `tile_wide` (the rest one
// at a time), in chunks of activations that stay in L2 (the AVX2 and NEON paths).
void q16_rows_grouped(Q16Tile tile_wide, int64_t wide, Q16Tile tile_one, const int32_t* xp, const float* dx,
                      const int32_t* xs, const uint8_t* p, float* out, int64_t M, int64_t N, int64_t nb,
                      int64_t g0, int64_t g1) {
    const int64_t mc = q16_chunk_rows(nb);
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m1 = std::min(M, m0 + mc);
        for (int64_t g = g0; g < g1; ++g) {
            const uint8_t* w = p + g * nb * GBYTES;
            const int64_t rows = std::min<int64_t>(GROUP, N - g * GROUP);
            float* o = out + g * GROUP;
            int64_t m = m0;
            for (; m + wide <= m1; m += wide)
                tile_wide(xp + m * nb * 16, dx + m * nb, xs + m * nb, w, o + m * N, N, nb, rows);
            for (; m < m1; ++m) tile_one(xp + m * nb * 16, dx + m * nb, xs + m * nb, w, o + m * N, N, nb, rows);
        }
    }
}

void q16_rows_scalar(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* p,
                     float* out, int64_t M, int64_t N, int64_t nb, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
        for (int r = 0; r < GROUP && g * GROUP + r < N; ++r)
            for (int64_t m = 0; m < M; ++m) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; ++b) {
                    const uint8_t* blk = p + (g * nb + b) * GBYTES;
                    const int32_t* x = xp + (m * nb + b) * 16;
                    int32_t dp = -8 * xs[m * nb + b];
                    for (int st = 0; st < 4; ++st)
                        for (int c = 0; c < 4; ++c) {
                            const int32_t byte = blk[32 + st * 64 + 4 * r + c];
                            const int32_t* xq = x + 4 * st;     // xh, xl of the low quad, then the high
                            const int32_t lo = 256 * (int8_t)(xq[0] >> (8 * c)) + (int8_t)(xq[1] >> (8 * c));
                            const int32_t hi = 256 * (int8_t)(xq[2] >> (8 * c)) + (int8_t)(xq[3] >> (8 * c));
                            dp += (byte & 15) * lo + (byte >> 4) * hi;
                        }
                    const float sc = fp16_to_fp32(load_u16(blk + 2 * r)) * dx[m * nb + b];
                    acc = std::fma((float)dp, sc, acc);
                }
                out[m * N + g * GROUP + r] = acc;
            }
}

#ifdef TQ_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// 16 rows x C activations of one group (rows as two 8-lane halves). The products of a step go to
// two chains, the high and the low activation bytes' (dp = 256 * high + low - 8 * xs); each chain's
// two vpmaddubsw of a step (the low and the high nibbles; int16 pairs, |pair| <= 2 * 15 * 128 =
// 3,840) are added in int16 lanes. The wide tile (C > 1) goes on adding its block's 4 steps in
// int16 — 8 pairs to a lane, <= 30,720 < 2^15: no lane wraps — and widens each chain once, at the
// block's end (vpmaddwd); a single row widens at each step (per block it was slower: 0.93-0.95x on
// the FFN matmuls at one row, 2 vCPUs of an AVX2 AMD EPYC). Either way the same exact int32 as a
// vpmaddwd per product, so the same bits, with a quarter (C > 1) or half of the vpmaddwd: the
// bundled model's matmuls 1.1-1.2x at one row, 1.1-1.3x at 8 and 32 (docs/kernels.md).
// A single row's tile asks for the weights this many blocks ahead (4.6 KB): one row streams the
// model's weights from memory, and the hardware prefetcher alone left it waiting — engine decode
// of one sequence 1.19-1.23x with it on 2 vCPUs of an AVX2 AMD EPYC (family 25; docs/kernels.md).
constexpr int64_t PREFETCH_BLOCKS = 16;

template <int C>
void q16_tile_avx2(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* w, float* out,
                   int64_t N, int64_t nb, int64_t rows) {
    constexpr bool WIDE = C > 1;   // int16 sums over the block (else int32 sums over its steps)
    const __m256i mask = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
    __m256 acc[2][C];
    for (int h = 0; h < 2; ++h)
        for (int c = 0; c < C; ++c) acc[h][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * GBYTES;
        if (!WIDE)   // a single row streams the weights: ask for the block PREFETCH_BLOCKS ahead
            for (int l = 0; l < GBYTES; l += 64) _mm_prefetch((const char*)(blk + PREFETCH_BLOCKS * GBYTES + l), _MM_HINT_T0);
        __m256i sh[2][C], sl[2][C];   // the high and the low activation bytes' chains
        for (int h = 0; h < 2; ++h)
            for (int c = 0; c < C; ++c) sh[h][c] = sl[h][c] = _mm256_setzero_si256();
        for (int s = 0; s < 4; ++s) {
            __m256i wl[2], wh[2];
            for (int h = 0; h < 2; ++h) {
                const __m256i u = _mm256_loadu_si256((const __m256i*)(blk + 32 + s * 64 + 32 * h));
                wl[h] = _mm256_and_si256(u, mask);
                wh[h] = _mm256_and_si256(_mm256_srli_epi16(u, 4), mask);
            }
            for (int c = 0; c < C; ++c) {
                const int32_t* x = xp + (c * nb + b) * 16 + 4 * s;
                const __m256i x0 = _mm256_set1_epi32(x[0]), x1 = _mm256_set1_epi32(x[1]);
                const __m256i x2 = _mm256_set1_epi32(x[2]), x3 = _mm256_set1_epi32(x[3]);
                for (int h = 0; h < 2; ++h) {
                    const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(wl[h], x0), _mm256_maddubs_epi16(wh[h], x2));
                    const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(wl[h], x1), _mm256_maddubs_epi16(wh[h], x3));
                    if (WIDE) {
                        sh[h][c] = _mm256_add_epi16(sh[h][c], ph);
                        sl[h][c] = _mm256_add_epi16(sl[h][c], pl);
                    } else {
                        sh[h][c] = _mm256_add_epi32(sh[h][c], _mm256_madd_epi16(ph, ones));
                        sl[h][c] = _mm256_add_epi32(sl[h][c], _mm256_madd_epi16(pl, ones));
                    }
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * h)));
            for (int c = 0; c < C; ++c) {
                const __m256i ih = WIDE ? _mm256_madd_epi16(sh[h][c], ones) : sh[h][c];
                const __m256i il = WIDE ? _mm256_madd_epi16(sl[h][c], ones) : sl[h][c];
                const __m256i t = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(ih, 8), il),
                                                   _mm256_set1_epi32(8 * xs[c * nb + b]));
                acc[h][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(dx[c * nb + b])),
                                            acc[h][c]);
            }
        }
    }
    for (int c = 0; c < C; ++c) {
        alignas(32) float tmp[GROUP];
        _mm256_store_ps(tmp, acc[0][c]);
        _mm256_store_ps(tmp + 8, acc[1][c]);
        std::memcpy(out + c * N, tmp, rows * sizeof(float));
    }
}

void q16_rows_avx2(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* p,
                   float* out, int64_t M, int64_t N, int64_t nb, int64_t g0, int64_t g1) {
    q16_rows_grouped(q16_tile_avx2<4>, 4, q16_tile_avx2<1>, xp, dx, xs, p, out, M, N, nb, g0, g1);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")

// GR groups (16 rows each) x C activations; per group and activation two int32 chains (the
// high and low activation bytes), combined exactly per block.
template <int GR, int C>
inline __attribute__((always_inline)) void q16_tile_512(const int32_t* xp, const float* dx, const int32_t* xs,
                                                        const uint8_t* w, int64_t gstride, float* out, int64_t N,
                                                        int64_t nb, int64_t rows_last) {
    const __m512i mask = _mm512_set1_epi32(0x0F0F0F0F);
    __m512 acc[GR][C];
    for (int g = 0; g < GR; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i ih[GR][C], il[GR][C];
        for (int g = 0; g < GR; ++g)
            for (int c = 0; c < C; ++c) ih[g][c] = il[g][c] = _mm512_setzero_si512();
        for (int s = 0; s < 4; ++s) {
            __m512i wl[GR], wh[GR];
            for (int g = 0; g < GR; ++g) {
                const __m512i u = _mm512_loadu_si512((const void*)(w + g * gstride + b * GBYTES + 32 + s * 64));
                wl[g] = _mm512_and_si512(u, mask);
                wh[g] = _mm512_and_si512(_mm512_srli_epi16(u, 4), mask);
            }
            for (int c = 0; c < C; ++c) {
                const int32_t* x = xp + (c * nb + b) * 16 + 4 * s;
                const __m512i x0 = _mm512_set1_epi32(x[0]), x1 = _mm512_set1_epi32(x[1]);
                const __m512i x2 = _mm512_set1_epi32(x[2]), x3 = _mm512_set1_epi32(x[3]);
                for (int g = 0; g < GR; ++g) {
                    ih[g][c] = _mm512_dpbusd_epi32(ih[g][c], wl[g], x0);
                    il[g][c] = _mm512_dpbusd_epi32(il[g][c], wl[g], x1);
                    ih[g][c] = _mm512_dpbusd_epi32(ih[g][c], wh[g], x2);
                    il[g][c] = _mm512_dpbusd_epi32(il[g][c], wh[g], x3);
                }
            }
        }
        for (int g = 0; g < GR; ++g) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + g * gstride + b * GBYTES)));
            for (int c = 0; c < C; ++c) {
                const __m512i t = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(ih[g][c], 8), il[g][c]),
                                                   _mm512_set1_epi32(8 * xs[c * nb + b]));
                acc[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(dx[c * nb + b])),
                                            acc[g][c]);
            }
        }
    }
    for (int g = 0; g < GR; ++g) {
        const __mmask16 k = g == GR - 1 && rows_last < GROUP ? (__mmask16)((1u << rows_last) - 1) : (__mmask16)0xffff;
        for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + c * N + g * GROUP, k, acc[g][c]);
    }
}

template <int GR>
inline void q16_groups_512(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* w, int64_t gstride,
                           float* out, int64_t M, int64_t N, int64_t nb, int64_t rows_last) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
        q16_tile_512<GR, 4>(xp + m * nb * 16, dx + m * nb, xs + m * nb, w, gstride, out + m * N, N, nb, rows_last);
    switch (M - m) {
        case 3: q16_tile_512<GR, 3>(xp + m * nb * 16, dx + m * nb, xs + m * nb, w, gstride, out + m * N, N, nb, rows_last); break;
        case 2: q16_tile_512<GR, 2>(xp + m * nb * 16, dx + m * nb, xs + m * nb, w, gstride, out + m * N, N, nb, rows_last); break;
        case 1: q16_tile_512<GR, 1>(xp + m * nb * 16, dx + m * nb, xs + m * nb, w, gstride, out + m * N, N, nb, rows_last); break;
        default: break;
    }
}

void q16_rows_512(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* p,
                  float* out, int64_t M, int64_t N, int64_t nb, int64_t g0, int64_t g1) {
    const int64_t gstride = nb * GBYTES;
    const int64_t G = (N + GROUP - 1) / GROUP;
    auto last_rows = [&](int64_t g_end) { return g_end == G ? N - (G - 1) * GROUP : (int64_t)GROUP; };
    // decode (M == 1): 4 groups per pass; batches: 2 groups x 4 activations, the activations in
    // chunks that stay in L2 while the groups' weights (L1) pass over them
    const int GR = M == 1 ? 4 : 2;
    const int64_t mc = q16_chunk_rows(nb);
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t mm = std::min(mc, M - m0);
        const int32_t *xpc = xp + m0 * nb * 16, *xsc = xs + m0 * nb;
        const float* dxc = dx + m0 * nb;
        float* oc = out + m0 * N;
        int64_t g = g0;
        for (; g + GR <= g1; g += GR) {
            if (GR == 4)
                q16_groups_512<4>(xpc, dxc, xsc, p + g * gstride, gstride, oc + g * GROUP, mm, N, nb, last_rows(g + 4));
            else
                q16_groups_512<2>(xpc, dxc, xsc, p + g * gstride, gstride, oc + g * GROUP, mm, N, nb, last_rows(g + 2));
        }
        for (; g < g1; ++g)
            q16_groups_512<1>(xpc, dxc, xsc, p + g * gstride, gstride, oc + g * GROUP, mm, N, nb, last_rows(g + 1));
    }
}
#pragma GCC pop_options

// ---------------------------------------------------------------- q16 on AMX (Sapphire Rapids and later)
// The same integers as q16_tile_512 from Intel's tile unit: per 16-row group, block and chunk of
// 16 activation rows, two TDPBSSD (s8 activations x s8 weights n - 8) give h = sum_k xh_k (n_k - 8)
// and l = sum_k xl_k (n_k - 8) for all 16 x 16 (activation, weight row) pairs at once, exactly in
// int32. The tiles are stored and each activation row finishes its block with dp = 256 h + l (the
// AVX-512 path's 256 sum n xh + sum n xl - 8 xs, the same integer) and acc = fma(float(dp),
// d_w * dx, acc), so the bits are the same.
//   A tiles (xh, xl): 16 activation rows x 32 bytes, k in the B tile's order (packed per call from
//                     the q16 layout: the xh / xl dwords of steps 0..3, low then high nibbles)
//   B tile:           8 rows x 64 bytes, row r = the group's weights n - 8 of step r & 3 (low
//                     nibbles for r < 4, high after): per dword lane one weight row's four k —
//                     the VNNI layout
//   C tiles:          16 x 16 int32, row = activation, lane = weight row (the acc lanes)
// For fewer than AMX_MIN_M activation rows the tile unit idles: the AVX-512 path runs them (and
// any call of fewer than AMX_MIN_GROUPS groups, below).
// Each call packs all its activation rows for the tiles: a thread with fewer than AMX_MIN_GROUPS
// groups (many threads, a narrow matrix) spends more on that than the tiles save (measured on a
// 16-core host: 0.81-0.87x of the AVX-512 path at 2-3 groups per thread).
constexpr int64_t AMX_MIN_M = 8;
constexpr int64_t AMX_MIN_GROUPS = 8;
constexpr int AMX_ROWS = 16;  // activation rows per A tile

struct alignas(64) AmxConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// The kernel may use AMX only after the OS granted this process the tile state (Linux >= 5.16).
bool amx_permitted() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")

void q16_rows_amx(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* p,
                  float* out, int64_t M, int64_t N, int64_t nb, int64_t g0, int64_t g1) {
    if (M < AMX_MIN_M || g1 - g0 < AMX_MIN_GROUPS) return q16_rows_512(xp, dx, xs, p, out, M, N, nb, g0, g1);
    const int64_t gstride = nb * GBYTES;
    const int64_t G = (N + GROUP - 1) / GROUP;
    const int64_t chunks = (M + AMX_ROWS - 1) / AMX_ROWS;
    // per chunk and block: A_h (16 x 32 bytes), A_l, 16 dx; padding rows are zero
    thread_local std::vector<uint8_t> apack_buf, bpack_buf;
    thread_local std::vector<float> dpad_buf;
    const int64_t padded = chunks * AMX_ROWS;
    if ((int64_t)apack_buf.size() < chunks * nb * 1024) apack_buf.resize(chunks * nb * 1024);
    if ((int64_t)dpad_buf.size() < chunks * nb * AMX_ROWS) dpad_buf.resize(chunks * nb * AMX_ROWS);
    if ((int64_t)bpack_buf.size() < 2 * nb * 512) bpack_buf.resize(2 * nb * 512);  // this group, the next
    uint8_t* const apack = apack_buf.data();  // (thread_local names cost a TLS lookup per use)
    uint8_t* const bpack = bpack_buf.data();
    float* const dpad = dpad_buf.data();
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
    for (int64_t m = 0; m < padded; ++m) {
        const int64_t c = m / AMX_ROWS, r = m % AMX_ROWS;
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* a = apack + (c * nb + b) * 1024 + r * 32;
            if (m >= M) {  // padding rows: zero products, never stored
                std::memset(a, 0, 32), std::memset(a + 512, 0, 32);
                dpad[(c * nb + b) * AMX_ROWS + r] = 0.f;
                continue;
            }
            const __m512i v = _mm512_permutexvar_epi32(idx, _mm512_loadu_si512((const void*)(xp + (m * nb + b) * 16)));
            _mm256_storeu_si256((__m256i*)a, _mm512_castsi512_si256(v));
            _mm256_storeu_si256((__m256i*)(a + 512), _mm512_extracti64x4_epi64(v, 1));
            dpad[(c * nb + b) * AMX_ROWS + r] = dx[m * nb + b];
        }
    }
    AmxConfig cfg;
    for (int t = 0; t < 2; ++t) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;          // C_h, C_l
    for (int t = 2; t < 4; ++t) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 32;          // A_h, A_l
    for (int t = 5; t < 7; ++t) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;          // C of the odd block
    cfg.rows[4] = cfg.rows[7] = 8, cfg.colsb[4] = cfg.colsb[7] = 64;                // B, even and odd
    _tile_loadconfig(&cfg);
    alignas(64) int32_t cbuf[4][2][AMX_ROWS * 16];
    const __m512i mask = _mm512_set1_epi32(0x0F0F0F0F), eight = _mm512_set1_epi8(8);
    // block b of group g as the B tile (n - 8 per byte) into buffer (g - g0) & 1
    auto unpack = [&](int64_t g, int64_t b) {
        const uint8_t* w = p + g * gstride + b * GBYTES + 32;
        uint8_t* dst = bpack + ((g - g0) & 1) * nb * 512 + b * 512;
        for (int s = 0; s < 4; ++s) {
            const __m512i u = _mm512_loadu_si512((const void*)(w + s * 64));
            _mm512_storeu_si512((void*)(dst + s * 64), _mm512_sub_epi8(_mm512_and_si512(u, mask), eight));
            _mm512_storeu_si512((void*)(dst + (4 + s) * 64),
                                _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(u, 4), mask), eight));
        }
    };
    for (int64_t b = 0; b < nb; ++b) unpack(g0, b);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* w = p + g * gstride;
        const uint8_t* bp = bpack + ((g - g0) & 1) * nb * 512;
        const int64_t rows = g == G - 1 ? N - g * GROUP : GROUP;
        const __mmask16 k = rows < GROUP ? (__mmask16)((1u << rows) - 1) : (__mmask16)0xffff;
        for (int64_t c = 0; c < chunks; ++c) {
            __m512 acc[AMX_ROWS];
            for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
            auto finish = [&](int64_t b, const int32_t* ch, const int32_t* cl) {
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + b * GBYTES)));
                const float* dxs = dpad + (c * nb + b) * AMX_ROWS;
                for (int r = 0; r < AMX_ROWS; ++r) {
                    const __m512i t = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void*)(ch + r * 16)), 8),
                                                       _mm512_load_si512((const void*)(cl + r * 16)));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(dxs[r])), acc[r]);
                }
            };
            // software pipeline: the tile products of block b + 2 are issued before block b is
            // finished (even blocks on tiles 0, 1, 4, odd on 5, 6, 7; four buffers in a ring)
            // (two written-out branches: GCC's tile intrinsics are macros that paste the tile
            // number into the instruction, so it cannot be a variable or template parameter)
            auto issue = [&](int64_t b) {
                const uint8_t* a = apack + (c * nb + b) * 1024;
                int32_t* cb = cbuf[b & 3][0];
                _tile_loadd(2, a, 32);
                _tile_loadd(3, a + 512, 32);
                if (b & 1) {
                    _tile_loadd(7, bp + b * 512, 64);
                    _tile_zero(5);
                    _tile_zero(6);
                    _tile_dpbssd(5, 2, 7);
                    _tile_dpbssd(6, 3, 7);
                    _tile_stored(5, cb, 64);
                    _tile_stored(6, cb + AMX_ROWS * 16, 64);
                } else {
                    _tile_loadd(4, bp + b * 512, 64);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_dpbssd(0, 2, 4);
                    _tile_dpbssd(1, 3, 4);
                    _tile_stored(0, cb, 64);
                    _tile_stored(1, cb + AMX_ROWS * 16, 64);
                }
            };
            issue(0);
            if (nb > 1) issue(1);
            // while the first chunk computes: the next group's weights unpacked block by block
            // (their loads overlap the tile work) and the group after it prefetched (weights
            // stream from memory every step)
            const bool ahead = c == 0 && g + 1 < g1;
            const char* far = (const char*)(w + 2 * gstride);
            const int64_t lines = c == 0 && g + 2 < g1 ? (gstride + 63) / 64 : 0;
            const int64_t per = (lines + nb - 1) / nb;
            for (int64_t b = 0; b < nb; ++b) {
                if (b + 2 < nb) issue(b + 2);
                if (ahead) unpack(g + 1, b);
                for (int64_t l = b * per; l < std::min(lines, (b + 1) * per); ++l)
                    _mm_prefetch(far + l * 64, _MM_HINT_T0);
                finish(b, cbuf[b & 3][0], cbuf[b & 3][1]);
            }
            const int64_t valid = std::min<int64_t>(AMX_ROWS, M - c * AMX_ROWS);
            for (int64_t r = 0; r < valid; ++r)
                _mm512_mask_storeu_ps(out + (c * AMX_ROWS + r) * N + g * GROUP, k, acc[r]);
        }
    }
    _tile_release();
}
#pragma GCC pop_options
#endif  // TQ_X86

#ifdef TQ_ARM
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod+fp16")

// 16 rows (four 4-lane quarters) x C activations of one group; `vdotq_s32` (s8 x s8, four products
// per lane) computes the same exact sums as vpdpbusd: the nibbles 0..15 fit a signed byte.
template <int C>
void q16_tile_neon(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* w, float* out,
                   int64_t N, int64_t nb, int64_t rows) {
    const uint8x16_t mask = vdupq_n_u8(0x0F);
    float32x4_t acc[4][C];
    for (int q = 0; q < 4; ++q)
        for (int c = 0; c < C; ++c) acc[q][c] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * GBYTES;
        int32x4_t ih[4][C], il[4][C];
        for (int q = 0; q < 4; ++q)
            for (int c = 0; c < C; ++c) ih[q][c] = il[q][c] = vdupq_n_s32(0);
        for (int s = 0; s < 4; ++s) {
            int8x16_t lo[4], hi[4];
            for (int q = 0; q < 4; ++q) {
                const uint8x16_t u = vld1q_u8(blk + 32 + s * 64 + 16 * q);   // rows 4q..4q+3
                lo[q] = vreinterpretq_s8_u8(vandq_u8(u, mask));
                hi[q] = vreinterpretq_s8_u8(vshrq_n_u8(u, 4));
            }
            for (int c = 0; c < C; ++c) {
                const int32_t* x = xp + (c * nb + b) * 16 + 4 * s;
                const int8x16_t x0 = vreinterpretq_s8_s32(vdupq_n_s32(x[0])), x1 = vreinterpretq_s8_s32(vdupq_n_s32(x[1]));
                const int8x16_t x2 = vreinterpretq_s8_s32(vdupq_n_s32(x[2])), x3 = vreinterpretq_s8_s32(vdupq_n_s32(x[3]));
                for (int q = 0; q < 4; ++q) {
                    ih[q][c] = vdotq_s32(ih[q][c], lo[q], x0);
                    il[q][c] = vdotq_s32(il[q][c], lo[q], x1);
                    ih[q][c] = vdotq_s32(ih[q][c], hi[q], x2);
                    il[q][c] = vdotq_s32(il[q][c], hi[q], x3);
                }
            }
        }
        for (int q = 0; q < 4; ++q) {
            const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)(blk + 8 * q))));
            for (int c = 0; c < C; ++c) {
                const int32x4_t t = vsubq_s32(vaddq_s32(vshlq_n_s32(ih[q][c], 8), il[q][c]), vdupq_n_s32(8 * xs[c * nb + b]));
                acc[q][c] = vfmaq_f32(acc[q][c], vcvtq_f32_s32(t), vmulq_f32(d, vdupq_n_f32(dx[c * nb + b])));
            }
        }
    }
    for (int c = 0; c < C; ++c) {
        float tmp[GROUP];
        for (int q = 0; q < 4; ++q) vst1q_f32(tmp + 4 * q, acc[q][c]);
        std::memcpy(out + c * N, tmp, rows * sizeof(float));
    }
}

void q16_rows_neon(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* p,
                   float* out, int64_t M, int64_t N, int64_t nb, int64_t g0, int64_t g1) {
    q16_rows_grouped(q16_tile_neon<2>, 2, q16_tile_neon<1>, xp, dx, xs, p, out, M, N, nb, g0, g1);
}
#pragma GCC pop_options
#endif  // TQ_ARM

// ---------------------------------------------------------------- dispatch

int detect_isa() {
#ifdef TQ_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_permitted()
                   ? ISA_AMX : ISA_AVX512VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
#ifdef TQ_ARM
    if (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) return ISA_NEON;
#endif
    return ISA_SCALAR;
}

const int g_best_isa = detect_isa();

using QuantFn = void (*)(const float*, int8_t*, float*, int64_t);
using RowsFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, float*,
                        int64_t, int64_t, int64_t, int64_t, int64_t);

QuantFn quant_fn(int isa) {
#ifdef TQ_X86
    if (isa >= ISA_AVX2) return quantize_row_avx2;
#endif
    (void)isa;
    return quantize_row_scalar;
}

RowsFn rows_fn(int isa) {
#ifdef TQ_X86
    if (isa == ISA_AVX512VNNI || isa == ISA_AMX) return rows_vnni;
    if (isa == ISA_AVX2) return rows_avx2;
#endif
    (void)isa;
    return rows_scalar;
}

using RowsF32Fn = void (*)(const uint8_t*, int64_t, const float*, float*,
                           int64_t, int64_t, int64_t, int64_t, int64_t);

RowsF32Fn rows_f32_fn(int isa) {
#ifdef TQ_X86
    if (isa == ISA_AVX512VNNI || isa == ISA_AMX) return rows_f32_512;
    if (isa == ISA_AVX2) return rows_f32_avx2;
#endif
    (void)isa;
    return rows_f32_scalar;
}

using RowsQ16Fn = void (*)(const int32_t*, const float*, const int32_t*, const uint8_t*, float*,
                           int64_t, int64_t, int64_t, int64_t, int64_t);

RowsQ16Fn rows_q16_fn(int isa) {
#ifdef TQ_X86
    if (isa == ISA_AMX) return q16_rows_amx;
    if (isa == ISA_AVX512VNNI) return q16_rows_512;
    if (isa == ISA_AVX2) return q16_rows_avx2;
#endif
#ifdef TQ_ARM
    if (isa == ISA_NEON) return q16_rows_neon;
#endif
    (void)isa;
    return q16_rows_scalar;
}

// threads: at most one per tile, and one per ~32 KB of weight bytes x activation rows, so
// tiny matmuls do not pay a thread wake-up (the split never changes the results)
inline int thread_count(int nthreads, int64_t M, int64_t N, int64_t row_bytes) {
    int nt = nthreads < 1 ? 1 : nthreads;
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t work = N * row_bytes * M / MIN_BYTES_PER_THREAD;
    if (nt > tiles) nt = (int)tiles;
    if (nt > work) nt = work < 1 ? 1 : (int)work;
    return nt;
}

}  // namespace

namespace tq {

int resolve_isa(int isa) {
#ifdef TQ_ARM
    return isa < 0 || isa >= ISA_NEON ? g_best_isa : ISA_SCALAR;  // the x86 paths do not exist here
#else
    if (isa < 0 || isa > g_best_isa || isa == ISA_NEON) return g_best_isa;
    return isa;
#endif
}

void matmul_f32_rows(const float* x, const uint8_t* q, float* out, int64_t M, int64_t N, int64_t K,
                     int64_t r0, int64_t r1, int isa) {
    rows_f32_fn(isa)(q, K / QK * BLOCK_BYTES, x, out, M, N, K, r0, r1);
}

void quantize_rows_q16(const float* x, int32_t* xp, float* dx, int32_t* xs, int64_t m0, int64_t m1, int64_t K) {
    const int64_t nb = K / QK;
    for (int64_t m = m0; m < m1; ++m) quantize_row_q16(x + m * K, xp + m * nb * 16, dx + m * nb, xs + m * nb, nb);
}

void matmul_q16_groups(const int32_t* xp, const float* dx, const int32_t* xs, const uint8_t* p, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t g0, int64_t g1, int isa) {
    rows_q16_fn(isa)(xp, dx, xs, p, out, M, N, K / QK, g0, g1);
}

// Offset, in a packed group-block, of original byte j (0..15) of row r: step j / 4, row r, byte j % 4.
inline int64_t packed_byte(int j, int r) { return 32 + (j / 4) * 64 + 4 * r + (j & 3); }

void pack_q4_0(const uint8_t* q, int64_t N, int64_t K, uint8_t* out) {
    const int64_t nb = K / QK, G = (N + GROUP - 1) / GROUP;
    for (int64_t g = 0; g < G; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* d = out + (g * nb + b) * GBYTES;
            for (int r = 0; r < GROUP; ++r) {
                const int64_t n = g * GROUP + r;
                if (n < N) {
                    const uint8_t* src = q + (n * nb + b) * BLOCK_BYTES;
                    d[2 * r] = src[0];
                    d[2 * r + 1] = src[1];
                    for (int j = 0; j < 16; ++j) d[packed_byte(j, r)] = src[2 + j];
                } else {  // padding rows: scale 0, weights (8 - 8) * 0 = 0
                    d[2 * r] = d[2 * r + 1] = 0;
                    for (int j = 0; j < 16; ++j) d[packed_byte(j, r)] = 0x88;
                }
            }
        }
}

void unpack_q4_0(const uint8_t* p, int64_t N, int64_t K, uint8_t* out) {
    const int64_t nb = K / QK;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* src = p + ((n / GROUP) * nb + b) * GBYTES;
            const int r = (int)(n % GROUP);
            uint8_t* d = out + (n * nb + b) * BLOCK_BYTES;
            d[0] = src[2 * r];
            d[1] = src[2 * r + 1];
            for (int j = 0; j < 16; ++j) d[2 + j] = src[packed_byte(j, r)];
        }
}

void embedding_rows_packed(const int64_t* ids, int64_t n_ids, const uint8_t* p, int64_t K, float* out) {
    const int64_t nb = K / QK;
    for (int64_t i = 0; i < n_ids; ++i) {
        const int64_t n = ids[i];
        const int r = (int)(n % GROUP);
        float* o = out + i * K;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = p + ((n / GROUP) * nb + b) * GBYTES;
            const float d = fp16_to_fp32(load_u16(blk + 2 * r));
            for (int j = 0; j < 16; ++j) {
                const int byte = blk[packed_byte(j, r)];
                o[b * QK + j] = (float)((byte & 0x0f) - 8) * d;
                o[b * QK + j + 16] = (float)((byte >> 4) - 8) * d;
            }
        }
    }
}

void embedding_rows(const int64_t* ids, int64_t n_ids, const uint8_t* q, int64_t K, float* out) {
    const int64_t nb = K / QK;
    const int64_t row_bytes = nb * BLOCK_BYTES;
    for (int64_t i = 0; i < n_ids; ++i) {
        const uint8_t* row = q + ids[i] * row_bytes;
        float* o = out + i * K;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + b * BLOCK_BYTES;
            const float d = fp16_to_fp32(load_u16(blk));
            for (int j = 0; j < 16; ++j) {
                o[b * QK + j] = (float)((blk[2 + j] & 0x0f) - 8) * d;
                o[b * QK + j + 16] = (float)((blk[2 + j] >> 4) - 8) * d;
            }
        }
    }
}

}  // namespace tq

extern "C" {

int tq_abi_version() { return 4; }

// The best path this CPU runs: 4 AMX (+ AVX-512 VNNI), 2 AVX-512 VNNI, 1 AVX2/FMA/F16C, 3 NEON with dot
// product, 0 scalar.
int tq_best_isa() { return g_best_isa; }

// The path a request for `isa` runs (-1: the best).
int tq_resolve_isa(int isa) { return tq::resolve_isa(isa); }

int tq_max_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

// Q8_0 activation quantization, exposed so tests can compare it with torch exactly.
void tq_quantize_q8_0(const float* x, int8_t* q, float* d, int64_t M, int64_t K, int isa) {
    const QuantFn qf = quant_fn(tq::resolve_isa(isa));
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; ++m) qf(x + m * K, q + m * K, d + m * nb, nb);
}

// out[M, N] = x[M, K] @ dequant(q[N, K/32*18]).T ; all pointers contiguous, validated by the caller.
void tq_matmul(const float* x, const uint8_t* q, float* out, int64_t M, int64_t N, int64_t K,
               int nthreads, int isa) {
    isa = tq::resolve_isa(isa);
    const QuantFn qf = quant_fn(isa);
    const RowsFn rf = rows_fn(isa);
    const int64_t nb = K / QK;
    const int64_t row_bytes = nb * BLOCK_BYTES;

    // scratch for the quantized activations, reused by each calling thread
    thread_local std::vector<int8_t> qa_buf;
    thread_local std::vector<float> da_buf;
    if ((int64_t)qa_buf.size() < M * K) qa_buf.resize(M * K);
    if ((int64_t)da_buf.size() < M * nb) da_buf.resize(M * nb);
    int8_t* qa = qa_buf.data();
    float* da = da_buf.data();

    const int nt = thread_count(nthreads, M, N, row_bytes);
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            const int tid = omp_get_thread_num(), T = omp_get_num_threads();
            for (int64_t m = M * tid / T; m < M * (tid + 1) / T; ++m)
                qf(x + m * K, qa + m * K, da + m * nb, nb);
#pragma omp barrier
            int64_t r0, r1;
            thread_rows(N, tid, T, &r0, &r1);
            if (r0 < r1) rf(q, row_bytes, qa, da, out, M, N, K, r0, r1);
        }
        return;
    }
#endif
    for (int64_t m = 0; m < M; ++m) qf(x + m * K, qa + m * K, da + m * nb, nb);
    rf(q, row_bytes, qa, da, out, M, N, K, 0, N);
}

// Same product with f32 activations (no Q8_0 rounding): see the f32 order above.
void tq_matmul_f32(const float* x, const uint8_t* q, float* out, int64_t M, int64_t N, int64_t K,
                   int nthreads, int isa) {
    const RowsF32Fn rf = rows_f32_fn(tq::resolve_isa(isa));
    const int64_t row_bytes = K / QK * BLOCK_BYTES;
    const int nt = thread_count(nthreads, M, N, row_bytes);
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            int64_t r0, r1;
            thread_rows(N, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
            if (r0 < r1) rf(q, row_bytes, x, out, M, N, K, r0, r1);
        }
        return;
    }
#endif
    rf(q, row_bytes, x, out, M, N, K, 0, N);
}

// q16: out[M, N] = x[M, K] @ W.T with W packed (tq_pack_q4_0) and x quantized to int16 per block.
void tq_matmul_q16(const float* x, const uint8_t* p, float* out, int64_t M, int64_t N, int64_t K,
                   int nthreads, int isa) {
    isa = tq::resolve_isa(isa);
    const int64_t nb = K / QK, G = (N + GROUP - 1) / GROUP;
    thread_local std::vector<int32_t> xp_buf, xs_buf;
    thread_local std::vector<float> dx_buf;
    if ((int64_t)xp_buf.size() < M * nb * 16) xp_buf.resize(M * nb * 16);
    if ((int64_t)xs_buf.size() < M * nb) xs_buf.resize(M * nb);
    if ((int64_t)dx_buf.size() < M * nb) dx_buf.resize(M * nb);
    int32_t *xp = xp_buf.data(), *xs = xs_buf.data();
    float* dx = dx_buf.data();
    const int nt = thread_count(nthreads, M, N, nb * BLOCK_BYTES);
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            const int tid = omp_get_thread_num(), T = omp_get_num_threads();
            tq::quantize_rows_q16(x, xp, dx, xs, M * tid / T, M * (tid + 1) / T, K);
#pragma omp barrier
            int64_t g0, g1;
            tq::thread_groups(G, tid, T, &g0, &g1);
            if (g0 < g1) tq::matmul_q16_groups(xp, dx, xs, p, out, M, N, K, g0, g1, isa);
        }
        return;
    }
#endif
    tq::quantize_rows_q16(x, xp, dx, xs, 0, M, K);
    tq::matmul_q16_groups(xp, dx, xs, p, out, M, N, K, 0, G, isa);
}

// The q16 activation quantization, exposed so tests can compare it with torch exactly.
void tq_quantize_q16(const float* x, int32_t* xp, float* dx, int32_t* xs, int64_t M, int64_t K) {
    tq::quantize_rows_q16(x, xp, dx, xs, 0, M, K);
}

// Q4_0 rows q[N, K/32*18] -> packed groups out[ceil(N/16) * K/32 * 288], and back.
void tq_pack_q4_0(const uint8_t* q, int64_t N, int64_t K, uint8_t* out) { tq::pack_q4_0(q, N, K, out); }
void tq_unpack_q4_0(const uint8_t* p, int64_t N, int64_t K, uint8_t* out) { tq::unpack_q4_0(p, N, K, out); }

// out[n_ids, K] = dequantized rows ids of a packed table (bitwise tq_embedding of the unpacked one).
void tq_embedding_packed(const int64_t* ids, int64_t n_ids, const uint8_t* p, int64_t K, float* out) {
    tq::embedding_rows_packed(ids, n_ids, p, K, out);
}

// out[n_ids, K] = dequantized rows ids of q[N, K/32*18] (ids validated by the caller).
void tq_embedding(const int64_t* ids, int64_t n_ids, const uint8_t* q, int64_t K, float* out) {
    tq::embedding_rows(ids, n_ids, q, K, out);
}

}  // extern "C"

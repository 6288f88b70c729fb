// The fused CPU forward step: the whole layer loop of shared/engine/model.py in one call.
//
// Same model as Transformer.forward (Llama / Qwen2 / Qwen3: RMSNorm, fused q|k|v with optional
// bias and q/k norms, rotate-half rope, GQA attention over the paged fp16 KV, SwiGLU), the same
// Q4_0 f32-activation matmul rows (q4_0_cpu.cpp), and the same KV layout
// kv[num_blocks, n_layers, 2, block_size, n_kv_heads, head_dim] (fp16), read in place through
// each chunk's block table: no gather, no copy, no per-sequence Python loop.
//
// Threads: ONE OpenMP team for the whole step; stages are separated by barriers and every
// stage splits its work into items whose arithmetic does not depend on which thread runs them
// (matmul: 4-row weight tiles; norms / activations: rows; rope + KV write: (token, head);
// attention: (query-row tile of a chunk, kv head) — or all kv heads of a one-token tile —,
// dealt round-robin because causal tiles differ in length; a decode step with few tiles splits
// each into 256-key segments, merged in order after a barrier). So the result is bitwise the same for any thread count, and a
// sequence's numbers do not depend on its batch neighbours. Attention goes further: a row's
// arithmetic does not depend on its tile either (keys are taken in segments at absolute
// positions, whichever item computes them), so a token gets the same bits whether its sequence
// is prefilled in one pass, in chunks, or decoded a token at a time.
//
// Vector code: the element-wise loops below are written over fixed 16-lane accumulators with
// explicit fma and no reassociation; `target_clones` builds them for AVX-512, AVX2+FMA and
// baseline x86-64, and the vectoriser may not reorder them (-ffp-contract=off, no fast-math),
// so every clone gives the same bits. Where the vectoriser would not (fp16 -> f32 loads), the
// code picks an intrinsics path at run time; those steps are exact, so the path changes no bit.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "q4_0_cpu.h"

namespace {

constexpr int LANES = 16;

struct Layer {  // mirrors kernels/cpu_forward.py _Layer; optional tensors are null
    const float* attn_norm;
    const uint8_t* qkv;
    const float* qkv_bias;
    const float* q_norm;
    const float* k_norm;
    const uint8_t* o;
    const float* ffn_norm;
    const uint8_t* gate_up;
    const uint8_t* down;
};

struct Model {  // mirrors _Model
    int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, ffn, vocab, max_ctx;
    int64_t packed;        // 1: the matrices are packed (q16 activations), 0: row-major (f32)
    int64_t embed_packed;  // 1: embed is packed too (tied with the packed output)
    float eps, scale;
    const Layer* layers;
    const uint8_t* embed;
    const uint8_t* output;
    const float* output_norm;
    const float* cos;  // [max_ctx, head_dim / 2]
    const float* sin;
};

struct Batch {  // mirrors _Batch
    int64_t n_tokens;
    const int64_t* token_ids;   // [n_tokens]
    int64_t n_chunks;
    const int64_t* chunks;      // [n_chunks, 4]: start, num_tokens, token_offset, table_offset
    const int64_t* tables;      // block ids, the chunks' tables end to end
    int64_t n_sample;
    const int64_t* sample_rows; // [n_sample]
    uint16_t* kv;               // fp16 bits
    int64_t block_size;
    float* logits;              // [n_sample, vocab]
};

#if defined(__aarch64__) || defined(__arm__)
using half_t = __fp16;    // ARM's IEEE half (GCC's C++ has no _Float16 there)
#else
using half_t = _Float16;
#endif

inline float h2f(uint16_t h) {
    half_t v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

inline uint16_t f2h(float f) {  // round to nearest even, as torch's .to(float16)
    const half_t v = (half_t)f;
    uint16_t h;
    std::memcpy(&h, &v, 2);
    return h;
}

using tq::exp_body;  // (q4_0_cpu.h: the same exp the host sampler uses)
using tq::exp_fixed;
using tq::exp_lanes;

// Sum of 16 lanes in a fixed tree.
inline float hsum16(const float* a) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// out = x * rsqrt(mean(x^2) + eps) * w over n values (n a multiple of 16), as model.py's _norm.
TQ_CLONES void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
    float acc[LANES] = {};
    for (int64_t i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = std::fma(x[i + l], x[i + l], acc[l]);
    const float r = 1.0f / std::sqrt(hsum16(acc) / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// Rotate-half rope on one head in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
TQ_CLONES void rope(float* x, const float* c, const float* s, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

// silu(g) * u, element by element (a row of gate|up is split over threads in whole blocks).
TQ_CLONES void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
    int64_t i0 = 0;
    for (; i0 + LANES <= n; i0 += LANES) {
        float e[LANES];
#pragma omp simd
        for (int i = 0; i < LANES; ++i) e[i] = -gate[i0 + i];
        exp_lanes<LANES>(e);
#pragma omp simd
        for (int i = 0; i < LANES; ++i) out[i0 + i] = gate[i0 + i] / (1.0f + e[i]) * up[i0 + i];
    }
    for (int64_t i = i0; i < n; ++i) out[i] = gate[i] / (1.0f + exp_fixed(-gate[i])) * up[i];
}

TQ_CLONES void to_half(const float* x, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = f2h(x[i]);
}

// ---- attention ----------------------------------------------------------------------------
// One work item: the query rows of up to `tile` tokens of one chunk times the `group` query
// heads sharing one kv head (row r = token i * group + head), against that sequence's keys
// 0..pos, read in place from the paged cache in key blocks of KB at absolute positions
// [KB*b, KB*b + KB). Per block: K and V rows converted to f32 once for all rows of the item,
// scores as a small GEMM (lanes = query rows), an online-softmax update (lanes = rows), then
// V accumulated (lanes = head dims). Every row's arithmetic is the same whatever tile, chunk
// length or thread it lands in: scores are a sequential fma chain over the head dims, keys
// past a row's position are skipped (a block with none of its keys leaves the row untouched:
// max unchanged, alpha = exp(0) = 1 exactly), and block edges are absolute positions. A
// one-token tile (decode) runs the same arithmetic with lanes = keys (attend_keys, below).

constexpr int KB = 16;        // keys per attention block
constexpr int KG = 8;         // keys per score pass (independent fma chains)
constexpr int MAX_ROWS = 64;  // query rows per work item (tokens per item = MAX_ROWS / group)


constexpr int64_t SEG = 256;  // keys per attention segment (a multiple of KB): see Step::attention

// kf[k][0..hd) / vf[k][0..hd) = f32 of key / value j0 + k of one kv head for k < n (n <= KB;
// rows up to the next multiple of KG zeroed), read through the block table; `src` points at the
// head in slot 0 of block 0 of this layer, V at src + v_off. fp16 -> f32 is exact, so which
// loader runs (F16C where the CPU has it, chosen once) changes no bit; the conversion is inlined
// in the key loop (a call per key row cost more than the conversion).
template <class Cvt>
inline __attribute__((always_inline)) void load_kv_block(Cvt cvt, const uint16_t* src, int64_t v_off,
                                                         const int64_t* table, int64_t j0, int64_t n, int64_t bs,
                                                         int64_t block_stride, int64_t slot_stride, int64_t hd,
                                                         float* kf, float* vf) {
    int64_t bi = j0 / bs, slot = j0 % bs;
    for (int64_t k = 0; k < n; ++k) {
        const uint16_t* row = src + table[bi] * block_stride + slot * slot_stride;
        cvt(row, kf + k * hd, hd);
        cvt(row + v_off, vf + k * hd, hd);
        if (++slot == bs) slot = 0, ++bi;
    }
    const int64_t pad = ((n + KG - 1) / KG * KG - n) * hd * sizeof(float);
    std::memset(kf + n * hd, 0, pad);
    std::memset(vf + n * hd, 0, pad);
}

void load_kv_plain(const uint16_t* src, int64_t v_off, const int64_t* table, int64_t j0, int64_t n, int64_t bs,
                   int64_t block_stride, int64_t slot_stride, int64_t hd, float* kf, float* vf) {
    load_kv_block([](const uint16_t* in, float* out, int64_t m) { for (int64_t i = 0; i < m; ++i) out[i] = h2f(in[i]); },
                  src, v_off, table, j0, n, bs, block_stride, slot_stride, hd, kf, vf);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx,f16c"))) void load_kv_f16c(const uint16_t* src, int64_t v_off, const int64_t* table,
                                                       int64_t j0, int64_t n, int64_t bs, int64_t block_stride,
                                                       int64_t slot_stride, int64_t hd, float* kf, float* vf) {
    int64_t bi = j0 / bs, slot = j0 % bs;
    for (int64_t k = 0; k < n; ++k) {  // hd is a multiple of 16 (checked by the caller)
        const uint16_t* row = src + table[bi] * block_stride + slot * slot_stride;
        for (int64_t i = 0; i < hd; i += 8) {
            _mm256_storeu_ps(kf + k * hd + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + i))));
            _mm256_storeu_ps(vf + k * hd + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + v_off + i))));
        }
        if (++slot == bs) slot = 0, ++bi;
    }
    const int64_t pad = ((n + KG - 1) / KG * KG - n) * hd * sizeof(float);
    std::memset(kf + n * hd, 0, pad);
    std::memset(vf + n * hd, 0, pad);
}
#endif

using LoadKvFn = void (*)(const uint16_t*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, float*, float*);

// ---- decode items: lanes over keys ----
// A tile of one token (a decode step, or a one-token chunk) has only the `group` rows of that
// token (3 on the bundled model), all seeing the same keys: lanes = rows would leave most lanes
// empty. Its keys go KP at a time (two blocks) with lanes = keys instead, each lane its own
// sequential fma chain over the head dims (the same chain, so the same score bits, as
// block_scores), then per block of KB keys the same online-softmax and V updates. Each key is
// converted fp16 -> f32 once for all rows, straight into the transposed layout the lanes need.

constexpr int KP = 2 * KB;       // keys per score pass of a one-token tile
constexpr int64_t MAX_HD = 512;  // head widths the F16C transposing loader takes (else the plain one)
alignas(64) const uint16_t ZERO_ROW[MAX_HD] = {};

// kt[d * KP + k] = f32 of key j0 + k and vf[k * hd + d] of its value for k < n <= KP (kt lanes
// past n zeroed up to the next multiple of KB), read through the block table as load_kv_block.
void load_kt_plain(const uint16_t* src, int64_t v_off, const int64_t* table, int64_t j0, int64_t n, int64_t bs,
                   int64_t block_stride, int64_t slot_stride, int64_t hd, float* kt, float* vf) {
    int64_t bi = j0 / bs, slot = j0 % bs;
    const int64_t nk = (n + KB - 1) / KB * KB;
    for (int64_t k = 0; k < nk; ++k) {
        if (k >= n) {
            for (int64_t d = 0; d < hd; ++d) kt[d * KP + k] = 0.0f;
            continue;
        }
        const uint16_t* row = src + table[bi] * block_stride + slot * slot_stride;
        for (int64_t d = 0; d < hd; ++d) kt[d * KP + k] = h2f(row[d]), vf[k * hd + d] = h2f(row[v_off + d]);
        if (++slot == bs) slot = 0, ++bi;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
// rows[k] = the K row of key j0 + k through the block table for k < n (its V row at + v_off),
// ZERO_ROW for k in [n, KP).
inline void key_rows(const uint16_t* src, const int64_t* table, int64_t j0, int64_t n, int64_t bs,
                     int64_t block_stride, int64_t slot_stride, const uint16_t** rows) {
    for (int64_t k = 0, bi = j0 / bs, slot = j0 % bs; k < KP; ++k) {
        if (k >= n) {
            rows[k] = ZERO_ROW;
            continue;
        }
        rows[k] = src + table[bi] * block_stride + slot * slot_stride;
        if (++slot == bs) slot = 0, ++bi;
    }
}

// load_kt_plain with F16C: per 16 keys x 8 dims, an 8 x 8 transpose of 16-bit words in each
// 128-bit half of 8 registers (half 0: keys 0-7, half 1: keys 8-15), then one conversion per
// half. Keys past n read a zero row.
__attribute__((target("avx2,f16c"))) void load_kt_f16c(const uint16_t* src, int64_t v_off, const int64_t* table,
                                                       int64_t j0, int64_t n, int64_t bs, int64_t block_stride,
                                                       int64_t slot_stride, int64_t hd, float* kt, float* vf) {
    const uint16_t* rows[KP];
    key_rows(src, table, j0, n, bs, block_stride, slot_stride, rows);
    for (int64_t k = 0; k < n; ++k)
        for (int64_t i = 0; i < hd; i += 8)
            _mm256_storeu_ps(vf + k * hd + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rows[k] + v_off + i))));
    auto ld = [](const uint16_t* p) { return _mm_loadu_si128((const __m128i*)p); };
    for (int64_t k0 = 0; k0 < n; k0 += KB)
        for (int64_t d0 = 0; d0 < hd; d0 += 8) {
            const uint16_t* const* r = rows + k0;
            __m256i a[8], t[8];
            for (int i = 0; i < 8; ++i)
                a[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(r[i] + d0)), ld(r[i + 8] + d0), 1);
            for (int i = 0; i < 4; ++i) {  // pairs of keys: (k, k+1) per dim
                t[2 * i] = _mm256_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
                t[2 * i + 1] = _mm256_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
            }
            for (int i = 0; i < 2; ++i) {  // quads of keys: dims (0,1) (2,3) (4,5) (6,7)
                a[4 * i] = _mm256_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
                a[4 * i + 1] = _mm256_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
                a[4 * i + 2] = _mm256_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
                a[4 * i + 3] = _mm256_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
            }
            for (int i = 0; i < 4; ++i) {  // eight keys: dims 2i, 2i+1
                t[2 * i] = _mm256_unpacklo_epi64(a[i], a[i + 4]);
                t[2 * i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 4]);
            }
            for (int j = 0; j < 8; ++j) {
                float* out = kt + (d0 + j) * KP + k0;
                _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm256_castsi256_si128(t[j])));
                _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(t[j], 1)));
            }
        }
}

// load_kt_f16c with 512-bit registers: the four 128-bit quarters of a register hold keys k,
// k+8, k+16, k+24, so one transpose serves all KP keys.
__attribute__((target("avx512f,avx512bw,avx2,f16c"))) void load_kt_512(const uint16_t* src, int64_t v_off,
                                                              const int64_t* table, int64_t j0, int64_t n,
                                                              int64_t bs, int64_t block_stride, int64_t slot_stride,
                                                              int64_t hd, float* kt, float* vf) {
    const uint16_t* rows[KP];
    key_rows(src, table, j0, n, bs, block_stride, slot_stride, rows);
    for (int64_t k = 0; k < n; ++k)
        for (int64_t i = 0; i < hd; i += 16)
            _mm512_storeu_ps(vf + k * hd + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rows[k] + v_off + i))));
    auto ld = [](const uint16_t* p) { return _mm_loadu_si128((const __m128i*)p); };
    for (int64_t d0 = 0; d0 < hd; d0 += 8) {
        __m512i a[8], t[8];
        for (int i = 0; i < 8; ++i) {
            const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(rows[i] + d0)), ld(rows[i + 8] + d0), 1);
            const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(rows[i + 16] + d0)), ld(rows[i + 24] + d0), 1);
            a[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        for (int i = 0; i < 4; ++i) {
            t[2 * i] = _mm512_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
        }
        for (int i = 0; i < 2; ++i) {
            a[4 * i] = _mm512_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
            a[4 * i + 1] = _mm512_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
            a[4 * i + 2] = _mm512_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
            a[4 * i + 3] = _mm512_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
        }
        for (int i = 0; i < 4; ++i) {
            t[2 * i] = _mm512_unpacklo_epi64(a[i], a[i + 4]);
            t[2 * i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 4]);
        }
        for (int j = 0; j < 8; ++j) {
            float* out = kt + (d0 + j) * KP;
            _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_castsi512_si256(t[j])));
            _mm512_storeu_ps(out + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(t[j], 1)));
        }
    }
}
#endif

// The K/V loaders of `isa` (a resolved TANDEM_CPU_ISA: 0 takes the plain ones). Every loader's
// conversion is exact, so which one runs changes no bit.
struct KvLoaders {
    LoadKvFn rows, transposed;
};

KvLoaders kv_loaders(int isa, int64_t hd) {
#if defined(__x86_64__) && defined(__GNUC__)
    const bool t_ok = hd <= MAX_HD && hd % 16 == 0;
    if (isa > 1 && t_ok && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c"))
        return {load_kv_f16c, load_kt_512};
    if (isa > 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return {load_kv_f16c, t_ok ? load_kt_f16c : load_kt_plain};
#endif
    (void)isa, (void)hd;
    return {load_kv_plain, load_kt_plain};
}

// Scores of keys k < n for the RL rows at r0 (lanes = rows); see block_scores.
template <int RL>
__attribute__((always_inline)) inline void block_scores_rows(const float* __restrict qt, const float* __restrict kf,
                                                             int64_t hd, int64_t nqp, int64_t n, float scale,
                                                             float* __restrict s) {
    for (int k0 = 0; k0 < n; k0 += KG) {
        float acc[KG][RL] = {};
        for (int64_t d = 0; d < hd; ++d) {
            const float* q = qt + d * nqp;
            for (int k = 0; k < KG; ++k) {
                const float kv = kf[(k0 + k) * hd + d];
#pragma omp simd
                for (int l = 0; l < RL; ++l) acc[k][l] = std::fma(kv, q[l], acc[k][l]);
            }
        }
        for (int k = 0; k < KG; ++k)
#pragma omp simd
            for (int l = 0; l < RL; ++l) s[(k0 + k) * nqp + l] = acc[k][l] * scale;
    }
}

// s[k * nqp + r] = scale * (q_r . k_k) for keys k < n (rounded up to KG), the dot a sequential
// fma chain over d = 0..hd-1; qt is the item's queries transposed, qt[d * nqp + r]; nqp a
// multiple of 8 (rows in 16-lane passes, then an 8-lane one: a decode item's 1 x group rows).
TQ_CLONES void block_scores(const float* qt, const float* kf, int64_t hd, int64_t nqp, int64_t n, float scale,
                            float* s) {
    int64_t r0 = 0;
    for (; r0 + LANES <= nqp; r0 += LANES) block_scores_rows<LANES>(qt + r0, kf, hd, nqp, n, scale, s + r0);
    if (r0 < nqp) block_scores_rows<LANES / 2>(qt + r0, kf, hd, nqp, n, scale, s + r0);
}

// The softmax update for the RL rows at r0; see block_softmax.
template <int RL>
__attribute__((always_inline)) inline void block_softmax_rows(float* __restrict s, const int32_t* __restrict last,
                                                              int32_t j0, int64_t n, int64_t nqp, float* __restrict m,
                                                              float* __restrict l, float* __restrict alpha) {
    float mx[RL], sum[RL];
    for (int i = 0; i < RL; ++i) mx[i] = m[i];
    for (int64_t k = 0; k < n; ++k)
#pragma omp simd
        for (int i = 0; i < RL; ++i) {
            const float v = s[k * nqp + i];
            mx[i] = j0 + k <= last[i] && v > mx[i] ? v : mx[i];
        }
    for (int i = 0; i < RL; ++i) {
        alpha[i] = exp_fixed(m[i] - mx[i]);
        sum[i] = l[i] * alpha[i];
        m[i] = mx[i];
    }
    for (int64_t k = 0; k < n; ++k) {
        float* v = s + k * nqp;
        float e[RL];
#pragma omp simd
        for (int i = 0; i < RL; ++i) e[i] = v[i] - mx[i];
        exp_lanes<RL>(e);
#pragma omp simd
        for (int i = 0; i < RL; ++i) {
            v[i] = j0 + k <= last[i] ? e[i] : 0.0f;
            sum[i] += v[i];
        }
    }
    for (int i = 0; i < RL; ++i) l[i] = sum[i];
}

// Online softmax over keys j0 + k, k < n, per row (lanes = rows): keys past last[r] are masked;
// m (running max) and l (running sum) updated, alpha = exp(m_old - m_new) for rescaling the
// output, s overwritten with the weights exp(s - m_new) (0 where masked; +0 keeps a sum exact).
TQ_CLONES void block_softmax(float* s, const int32_t* last, int32_t j0, int64_t n, int64_t nqp, float* m, float* l,
                             float* alpha) {
    int64_t r0 = 0;
    for (; r0 + LANES <= nqp; r0 += LANES)
        block_softmax_rows<LANES>(s + r0, last + r0, j0, n, nqp, m + r0, l + r0, alpha + r0);
    if (r0 < nqp) block_softmax_rows<LANES / 2>(s + r0, last + r0, j0, n, nqp, m + r0, l + r0, alpha + r0);
}

// o[r] = o[r] * alpha[r] + sum_{k < nk} p[k][r] v_k (keys in order) for NR rows (o stride hd),
// lanes = head dims, W of them per pass (NR * W / 16 independent fma chains).
// p[k * ks + r * rs] is row r's weight of key k (the rows' lanes: ks = nqp, rs = 1; the keys'
// lanes of a decode item: ks = 1, rs = its row stride).
template <int NR, int W>
__attribute__((always_inline)) inline void block_values_rows(float* __restrict o, const float* __restrict p, const float* __restrict alpha,
                              const float* __restrict vf, int64_t ks, int64_t rs, int64_t nk, int64_t hd) {
    for (int64_t d0 = 0; d0 < hd; d0 += W) {
        float acc[NR][W];
        for (int r = 0; r < NR; ++r)
#pragma omp simd
            for (int i = 0; i < W; ++i) acc[r][i] = o[r * hd + d0 + i] * alpha[r];
        for (int64_t k = 0; k < nk; ++k)
            for (int r = 0; r < NR; ++r) {
                const float pk = p[k * ks + r * rs];
#pragma omp simd
                for (int i = 0; i < W; ++i) acc[r][i] = std::fma(pk, vf[k * hd + d0 + i], acc[r][i]);
            }
        for (int r = 0; r < NR; ++r)
#pragma omp simd
            for (int i = 0; i < W; ++i) o[r * hd + d0 + i] = acc[r][i];
    }
}

template <int NR>
__attribute__((always_inline)) inline void block_values_rows(float* o, const float* p, const float* alpha, const float* vf, int64_t ks,
                              int64_t rs, int64_t nk, int64_t hd) {
    if (hd % (2 * LANES) == 0)
        block_values_rows<NR, 2 * LANES>(o, p, alpha, vf, ks, rs, nk, hd);
    else
        block_values_rows<NR, LANES>(o, p, alpha, vf, ks, rs, nk, hd);
}

// The V step of one block for rows 0..nq-1: runs of rows with the same number of unmasked keys
// (a token's heads; every row off the diagonal) in groups of up to 4 rows; rows with none skip.
TQ_CLONES void block_values(float* o, const float* p, const float* alpha, const float* vf,
                            const int32_t* last, int32_t j0, int64_t nq, int64_t nqp, int64_t hd) {
    auto keys = [&](int64_t r) -> int64_t {
        const int64_t n = (int64_t)last[r] - j0 + 1;
        return n < 0 ? 0 : (n > KB ? KB : n);
    };
    for (int64_t r = 0; r < nq;) {
        const int64_t nk = keys(r);
        int64_t e = r + 1;
        while (e < nq && e - r < 4 && keys(e) == nk) ++e;
        if (nk) {
            float* orow = o + r * hd;
            const float *pr = p + r, *ar = alpha + r;
            switch (e - r) {
                case 4: block_values_rows<4>(orow, pr, ar, vf, nqp, 1, nk, hd); break;
                case 3: block_values_rows<3>(orow, pr, ar, vf, nqp, 1, nk, hd); break;
                case 2: block_values_rows<2>(orow, pr, ar, vf, nqp, 1, nk, hd); break;
                default: block_values_rows<1>(orow, pr, ar, vf, nqp, 1, nk, hd); break;
            }
        }
        r = e;
    }
}

// s[r * KP + k] = scale * (q_r . k_k) for the nq rows of one token (row r at q + r * hd) and
// keys k < W (W = KB or KP; kt[d * KP + k]), lanes = keys: each a sequential fma chain over
// d = 0..hd-1, the chain block_scores computes for the same (row, key).
template <int NR, int W>
__attribute__((always_inline)) inline void keys_scores_rows(const float* __restrict q, const float* __restrict kt,
                                                            int64_t hd, float scale, float* __restrict s) {
    float acc[NR][W] = {};
    for (int64_t d = 0; d < hd; ++d)
        for (int r = 0; r < NR; ++r) {
            const float qd = q[r * hd + d];
#pragma omp simd
            for (int k = 0; k < W; ++k) acc[r][k] = std::fma(kt[d * KP + k], qd, acc[r][k]);
        }
    for (int r = 0; r < NR; ++r)
#pragma omp simd
        for (int k = 0; k < W; ++k) s[r * KP + k] = acc[r][k] * scale;
}

template <int W>
__attribute__((always_inline)) inline void keys_scores_w(const float* q, const float* kt, int64_t hd, int64_t nq,
                                                         float scale, float* s) {
    for (int64_t r = 0; r < nq; r += 3) {  // 3 rows x 32 keys: 12 AVX2 accumulators
        switch (std::min<int64_t>(3, nq - r)) {
            case 3: keys_scores_rows<3, W>(q + r * hd, kt, hd, scale, s + r * KP); break;
            case 2: keys_scores_rows<2, W>(q + r * hd, kt, hd, scale, s + r * KP); break;
            default: keys_scores_rows<1, W>(q + r * hd, kt, hd, scale, s + r * KP); break;
        }
    }
}

TQ_CLONES void keys_scores(const float* q, const float* kt, int64_t hd, int64_t nq, int64_t n, float scale,
                           float* s) {
    if (n > KB)
        keys_scores_w<KP>(q, kt, hd, nq, scale, s);
    else
        keys_scores_w<KB>(q, kt, hd, nq, scale, s);
}

// block_softmax for the nq rows of one token over the keys k < n <= KB of one block (row r's
// scores at s + r * KP, lanes = keys; every key visible to every row: a one-token tile's keys
// end at its position). The block's max is the same whichever order finds it (a signed zero
// aside, which no exp below tells apart); the sum is a sequential add in key order, as there.
TQ_CLONES void keys_softmax(float* s, int64_t nq, int64_t n, float* m, float* l, float* alpha) {
    for (int64_t r = 0; r < nq; ++r) {
        float* sr = s + r * KP;
        float v[KB];
#pragma omp simd
        for (int k = 0; k < KB; ++k) v[k] = k < n ? sr[k] : -INFINITY;
        for (int w = KB / 2; w; w /= 2)
#pragma omp simd
            for (int k = 0; k < w; ++k) v[k] = v[k + w] > v[k] ? v[k + w] : v[k];
        const float mx = v[0] > m[r] ? v[0] : m[r];
        float e[KB];
#pragma omp simd
        for (int k = 0; k < KB; ++k) e[k] = sr[k] - mx;
        exp_lanes<KB>(e);
#pragma omp simd
        for (int k = 0; k < KB; ++k) sr[k] = k < n ? e[k] : 0.0f;
        alpha[r] = exp_fixed(m[r] - mx);
        l[r] *= alpha[r];
        m[r] = mx;
    }
    for (int64_t k = 0; k < n; ++k)  // the rows' sums side by side (each in key order)
        for (int64_t r = 0; r < nq; ++r) l[r] += s[r * KP + k];
}

// block_values for the nq rows of one token (weights p[r * KP + k], keys k < n).
TQ_CLONES void keys_values(float* o, const float* p, const float* alpha, const float* vf, int64_t nq, int64_t n,
                           int64_t hd) {
    for (int64_t r = 0; r < nq; r += 4) {
        float* orow = o + r * hd;
        const float *pr = p + r * KP, *ar = alpha + r;
        switch (std::min<int64_t>(4, nq - r)) {
            case 4: block_values_rows<4>(orow, pr, ar, vf, 1, KP, n, hd); break;
            case 3: block_values_rows<3>(orow, pr, ar, vf, 1, KP, n, hd); break;
            case 2: block_values_rows<2>(orow, pr, ar, vf, 1, KP, n, hd); break;
            default: block_values_rows<1>(orow, pr, ar, vf, 1, KP, n, hd); break;
        }
    }
}

// Merge a segment's softmax state (m2, l2, o2) into the running one (m, l, o) for rows 0..nq-1
// (o rows of hd): both rescaled to the larger max. A row with no key in the segment (m2 = -inf)
// is left as it is.
TQ_CLONES void merge_segment(int64_t nq, int64_t hd, float* m, float* l, float* o, const float* m2,
                             const float* l2, const float* o2) {
    for (int64_t r = 0; r < nq; ++r) {
        if (m2[r] == -INFINITY) continue;
        const float mn = m[r] > m2[r] ? m[r] : m2[r];
        const float a = exp_fixed(m[r] - mn), c = exp_fixed(m2[r] - mn);
        l[r] = std::fma(l2[r], c, l[r] * a);
        m[r] = mn;
        for (int64_t d = 0; d < hd; ++d) o[r * hd + d] = std::fma(o2[r * hd + d], c, o[r * hd + d] * a);
    }
}

// Per-call scratch, grown as needed and kept (one forward runs at a time per calling thread).
struct Scratch {
    std::vector<float> x, h, qkv, attn, tmp, gu, act;
    std::vector<int64_t> pos, chunk_of, tiles, att_items, split_items, part_off;
    std::vector<float> parts;
    std::vector<int32_t> xp, xs;   // q16 activations of the next matmul's input rows
    std::vector<float> dx;
    std::vector<std::vector<float>> per_thread;  // each OpenMP thread's attention buffers
};

template <class T>
T* grow(std::vector<T>& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
    return v.data();
}

inline void split(int64_t n, int tid, int nt, int64_t* a, int64_t* b) {
    *a = n * tid / nt;
    *b = n * (tid + 1) / nt;
}

struct Step {
    const Model& m;
    const Batch& b;
    int isa;
    int64_t T, D, hd, nh, nkv, F, qkv_n;
    float *x, *h, *qkv, *attn, *tmp, *gu, *act;
    std::vector<float>* scratch;  // one per thread
    const int64_t *pos, *chunk_of;
    int64_t layer_stride, block_stride, slot_stride, v_off;
    const int64_t* tiles;  // attention tiles: [n_tiles, 2] (chunk, first token)
    int64_t n_tiles, tile;
    // attention items: [n_att, 3] (tile, kv heads g0..g1): see heads_together
    const int64_t* att_items;
    int64_t n_att;
    // attention_split (null / 0 when the step does not split): [n_split, 4] (tile, kv heads
    // g0..g1, segment) items, the offset of each tile's segment states in `parts`
    const int64_t *split_items, *part_off;
    int64_t n_split;
    float* parts;
    // q16 (m.packed): the next matmul's input rows quantized by the stage that wrote them,
    // at that matmul's row stride of K / 32 blocks ([rows, K/32, 16] pairs, [rows, K/32] scales, sums)
    int32_t *xp, *xs;
    float* dx;
    KvLoaders ld;

    // q16-quantize `nb` blocks of row t of a matmul input of width K, from block b0 of the row.
    void quantize(const float* v, int64_t t, int64_t K, int64_t b0, int64_t nb) const {
        if (!m.packed) return;
        const int64_t at = t * (K / tq::QK) + b0;
        tq::quantize_rows_q16(v, xp + at * 16, dx + at, xs + at, 0, 1, nb * tq::QK);
    }

    // out[M, N] = in @ W.T, this thread's tiles; with `residual`, residual[:, tiles] += out.
    // Packed weights read the rows' q16 form (`quantize`) instead of `in`.
    void matmul(const float* in, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                float* residual, int tid, int nt) const {
        int64_t r0, r1;
        if (m.packed) {
            int64_t g0, g1;
            tq::thread_groups((N + tq::GROUP - 1) / tq::GROUP, tid, nt, &g0, &g1);
            r0 = std::min(N, g0 * tq::GROUP);
            r1 = std::min(N, g1 * tq::GROUP);
            if (r0 >= r1) return;
            tq::matmul_q16_groups(xp, dx, xs, w, out, M, N, K, g0, g1, isa);
        } else {
            tq::thread_rows(N, tid, nt, &r0, &r1);
            if (r0 >= r1) return;
            tq::matmul_f32_rows(in, w, out, M, N, K, r0, r1, isa);
        }
        if (residual)
            for (int64_t i = 0; i < M; ++i)
                for (int64_t n = r0; n < r1; ++n) residual[i * N + n] += out[i * N + n];
    }

    void norm_rows(const float* w, int tid, int nt) const {
        int64_t a, e;
        split(T, tid, nt, &a, &e);
        for (int64_t t = a; t < e; ++t) {
            rms_norm(x + t * D, w, h + t * D, D, m.eps);
            quantize(h + t * D, t, D, 0, D / tq::QK);
        }
    }

    // bias, q/k norms, rope; k and v written to the cache. Items: (token, head of q|k|v).
    void qkv_post(const Layer& L, int64_t li, int tid, int nt) const {
        const int64_t heads = nh + 2 * nkv, half = hd / 2;
        int64_t a, e;
        split(T * heads, tid, nt, &a, &e);
        float* normed = grow(scratch[tid], hd);
        for (int64_t it = a; it < e; ++it) {
            const int64_t t = it / heads, hh = it % heads;
            float* v = qkv + t * qkv_n + hh * hd;
            if (L.qkv_bias)
                for (int64_t d = 0; d < hd; ++d) v[d] += L.qkv_bias[hh * hd + d];
            const float* nw = hh < nh ? L.q_norm : (hh < nh + nkv ? L.k_norm : nullptr);
            if (nw) {
                rms_norm(v, nw, normed, hd, m.eps);
                std::memcpy(v, normed, hd * sizeof(float));
            }
            if (hh < nh + nkv) rope(v, m.cos + pos[t] * half, m.sin + pos[t] * half, half);
            if (hh >= nh && b.kv) store_kv(li, t, hh);  // no cache (a ring coordinator): q|k|v only
        }
    }

    // Write head hh (a k or v head of q|k|v) of token t into the cache slot of its position.
    void store_kv(int64_t li, int64_t t, int64_t hh) const {
        const int64_t* ch = b.chunks + chunk_of[t] * 4;
        const int64_t p = pos[t];
        const int64_t blk = b.tables[ch[3] + p / b.block_size];
        const bool is_v = hh >= nh + nkv;
        const int64_t kvh = is_v ? hh - nh - nkv : hh - nh;
        uint16_t* dst = b.kv + blk * block_stride + li * layer_stride + (is_v ? v_off : 0) +
                        (p % b.block_size) * slot_stride + kvh * hd;
        to_half(qkv + t * qkv_n + hh * hd, dst, hd);
    }

    // The rows of attention tile `ti` for kv head g: its chunk, first token, rows (tokens x the
    // group's heads; padded to a multiple of 8 for the score / softmax lanes) and key count.
    struct TileRows { int64_t c, t0, ntok, nq, nqp, end; };
    TileRows tile_rows(int64_t ti) const {
        const int64_t c = tiles[2 * ti], t0 = tiles[2 * ti + 1], group = nh / nkv;
        const int64_t* ch = b.chunks + c * 4;
        const int64_t ntok = std::min(tile, ch[2] + ch[1] - t0), nq = ntok * group;
        return {c, t0, ntok, nq, (nq + 7) / 8 * 8, pos[t0 + ntok - 1] + 1};
    }

    // qt = the rows' queries transposed (qt[d * nqp + r]), last[r] = the row's position.
    void load_rows(const TileRows& v, int64_t g, float* qt, int32_t* last) const {
        const int64_t group = nh / nkv;
        for (int64_t r = 0; r < v.nqp; ++r) {  // rows past nq repeat row 0 (finite, never stored)
            const int64_t rr = r < v.nq ? r : 0, t = v.t0 + rr / group, hh = g * group + rr % group;
            const float* q = qkv + t * qkv_n + hh * hd;
            for (int64_t d = 0; d < hd; ++d) qt[d * v.nqp + r] = q[d];
            last[r] = (int32_t)pos[t];
        }
    }

    // A fresh online softmax of the rows over segment `sg` of the tile's keys ([SEG*sg, ...)),
    // block by block: mx / sum / o (rows x hd) of the segment alone. A row whose position is
    // before the segment has no key in it: its mx stays -inf (merge_segment skips it).
    // kf and vf hold KP * hd floats, s KP * nqp. A one-token tile takes its keys' lanes
    // (attend_keys); others the rows' lanes, from qt.
    void attend_segment(const TileRows& v, int64_t g, int64_t li, int64_t sg, const float* qt, const int32_t* last,
                        float* kf, float* vf, float* s, float* mx, float* sum, float* alpha, float* o) const {
        for (int64_t r = 0; r < v.nqp; ++r) mx[r] = -INFINITY, sum[r] = 0.0f;
        std::memset(o, 0, v.nq * hd * sizeof(float));
        const uint16_t* kbase = b.kv + li * layer_stride + g * hd;
        const int64_t* table = b.tables + b.chunks[v.c * 4 + 3];
        const int64_t stop = std::min(v.end, (sg + 1) * SEG);
        const int64_t step = v.ntok == 1 ? KP : KB;
        for (int64_t j0 = sg * SEG; j0 < stop; j0 += step) {
            const int64_t n = std::min<int64_t>(step, stop - j0);
            // the next keys' K/V rows: strided reads through the block table that the
            // hardware prefetcher does not see coming (decode attention waited on them)
            const int64_t pf = j0 + step, pf_end = std::min<int64_t>(stop, pf + step);
            for (int64_t j = pf, bi = pf / b.block_size, slot = pf % b.block_size; j < pf_end; ++j) {
                const uint16_t* row = kbase + table[bi] * block_stride + slot * slot_stride;
                for (int64_t i = 0; i < hd; i += 32) {  // 64-byte lines
                    __builtin_prefetch(row + i);
                    __builtin_prefetch(row + v_off + i);
                }
                if (++slot == b.block_size) slot = 0, ++bi;
            }
            if (v.ntok == 1) {
                attend_keys(v, g, kbase, table, j0, n, kf, vf, s, mx, sum, alpha, o);
                continue;
            }
            ld.rows(kbase, v_off, table, j0, n, b.block_size, block_stride, slot_stride, hd, kf, vf);
            block_scores(qt, kf, hd, v.nqp, n, m.scale, s);
            block_softmax(s, last, (int32_t)j0, n, v.nqp, mx, sum, alpha);
            block_values(o, s, alpha, vf, last, (int32_t)j0, v.nq, v.nqp, hd);
        }
    }

    // Keys j0..j0+n-1 (n <= KP, blocks of KB at absolute positions) of a one-token tile, lanes =
    // keys: scores of both blocks in one pass, then each block's softmax and V update in order.
    void attend_keys(const TileRows& v, int64_t g, const uint16_t* kbase, const int64_t* table, int64_t j0,
                     int64_t n, float* kt, float* vf, float* s, float* mx, float* sum, float* alpha, float* o) const {
        const float* q = qkv + v.t0 * qkv_n + g * (nh / nkv) * hd;  // the token's rows of kv head g
        ld.transposed(kbase, v_off, table, j0, n, b.block_size, block_stride, slot_stride, hd, kt, vf);
        keys_scores(q, kt, hd, v.nq, n, m.scale, s);
        for (int64_t k0 = 0; k0 < n; k0 += KB) {
            const int64_t nb = std::min<int64_t>(KB, n - k0);
            keys_softmax(s + k0, v.nq, nb, mx, sum, alpha);
            keys_values(o, s + k0, alpha, vf + k0 * hd, v.nq, nb, hd);
        }
    }

    // Normalise the rows' output and write it (and its q16 form) into attn.
    void finish_rows(const TileRows& v, int64_t g, const float* sum, const float* o) const {
        const int64_t group = nh / nkv;
        for (int64_t r = 0; r < v.nq; ++r) {
            const int64_t t = v.t0 + r / group, hh = g * group + r % group;
            const float inv = 1.0f / sum[r];
            float* out = attn + t * nh * hd + hh * hd;
            for (int64_t d = 0; d < hd; ++d) out[d] = o[r * hd + d] * inv;
            quantize(out, t, nh * hd, hh * hd / tq::QK, hd / tq::QK);  // head = whole blocks (checked)
        }
    }

    // Items: (query tile of a chunk, kv heads g0..g1), from `att_items`, dealt round-robin
    // (causal tiles differ in length). A tile's keys are taken in segments of SEG at absolute
    // positions, each a fresh online softmax merged in order (merge_segment), so a row's bits
    // depend on its position only — not on whether the segments of its tile were one item (here)
    // or items of their own spread over the threads (attention_split, when a step has too few
    // tiles to keep the threads busy: decode at a long context).
    void attention(int64_t li, int tid, int nt) const {
        const int64_t group = nh / nkv, nq_max = tile * group, np_max = (nq_max + 7) / 8 * 8;
        float* buf = grow(scratch[tid], hd * np_max + 2 * KP * hd + KP * np_max + 2 * nq_max * hd + 6 * np_max);
        float *qt = buf, *kf = qt + hd * np_max, *vf = kf + KP * hd, *s = vf + KP * hd, *o = s + KP * np_max;
        float *o2 = o + nq_max * hd, *mx = o2 + nq_max * hd, *sum = mx + np_max, *alpha = sum + np_max;
        float *mx2 = alpha + np_max, *sum2 = mx2 + np_max;
        int32_t* last = (int32_t*)(sum2 + np_max);  // one float's room per row
        for (int64_t it = tid; it < n_att; it += nt) {
            const TileRows v = tile_rows(att_items[3 * it]);
            for (int64_t g = att_items[3 * it + 1]; g < att_items[3 * it + 2]; ++g) {
                load_rows(v, g, qt, last);
                attend_segment(v, g, li, 0, qt, last, kf, vf, s, mx, sum, alpha, o);
                for (int64_t sg = 1; sg * SEG < v.end; ++sg) {
                    attend_segment(v, g, li, sg, qt, last, kf, vf, s, mx2, sum2, alpha, o2);
                    merge_segment(v.nq, hd, mx, sum, o, mx2, sum2, o2);
                }
                finish_rows(v, g, sum, o);
            }
        }
    }

    // attention() with each (tile, kv heads, segment) an item of its own: the segments' states
    // go to `parts` (at part_off[tile] + (g * segments + sg) * rows * (hd + 2)), then, after a
    // barrier, each (tile, kv head) merges its segments in order.
    void attention_split(int64_t li, int tid, int nt) const {
        const int64_t group = nh / nkv, nq_max = tile * group, np_max = (nq_max + 7) / 8 * 8;
        float* buf = grow(scratch[tid], hd * np_max + 2 * KP * hd + KP * np_max + 2 * np_max);
        float *qt = buf, *kf = qt + hd * np_max, *vf = kf + KP * hd, *s = vf + KP * hd, *alpha = s + KP * np_max;
        int32_t* last = (int32_t*)(alpha + np_max);
        for (int64_t it = tid; it < n_split; it += nt) {
            const int64_t* item = split_items + 4 * it;
            const TileRows v = tile_rows(item[0]);
            const int64_t nseg = (v.end + SEG - 1) / SEG, rows = v.nqp, sg = item[3];
            for (int64_t g = item[1]; g < item[2]; ++g) {
                float* part = parts + part_off[item[0]] + (g * nseg + sg) * rows * (hd + 2);
                load_rows(v, g, qt, last);
                attend_segment(v, g, li, sg, qt, last, kf, vf, s, part, part + rows, alpha, part + 2 * rows);
            }
        }
#pragma omp barrier
        for (int64_t it = tid; it < n_tiles * nkv; it += nt) {
            const TileRows v = tile_rows(it / nkv);
            const int64_t g = it % nkv, nseg = (v.end + SEG - 1) / SEG;
            merge_parts(v, g, parts + part_off[it / nkv] + g * nseg * v.nqp * (hd + 2), nseg);
        }
    }

    // Merge the states of `nseg` segments of (tile v, kv head g), stored one after another from
    // `first` (each: mx[nqp], sum[nqp], o[nqp * hd]), in segment order into the first, and
    // finish the rows: the one order every attention path uses, so the bits never depend on
    // which thread, item or ring member computed a segment.
    void merge_parts(const TileRows& v, int64_t g, float* first, int64_t nseg) const {
        fold_parts(v, first, nseg);
        finish_rows(v, g, first + v.nqp, first + 2 * v.nqp);
    }

    // The fold of merge_parts without the finish: states 1..nseg-1 merged into the first, in order.
    void fold_parts(const TileRows& v, float* first, int64_t nseg) const {
        const int64_t rows = v.nqp;
        for (int64_t sg = 1; sg < nseg; ++sg) {
            const float* p = first + sg * rows * (hd + 2);
            merge_segment(v.nq, hd, first, first + rows, first + 2 * rows, p, p + rows, p + 2 * rows);
        }
    }

    // ---- ring decode (tq_ring_stage; docs/strategies.md) ----------------------------------
    // The step is one tile (one chunk of at most `tile` tokens: a decode token) whose keys are
    // split by SEG-aligned token ranges over ring members. A member computes the states of its
    // segments (attend_range); the coordinator merges all of them in segment order
    // (merge_ring) with merge_parts, the same order attention() / attention_split() use.

    // Write the batch's k and v rows (q|k|v in `qkv`) into this member's cache: the tail member.
    void store_rows(int64_t li, int tid, int nt) const {
        int64_t a, e;
        split(T * 2 * nkv, tid, nt, &a, &e);
        for (int64_t it = a; it < e; ++it) store_kv(li, it / (2 * nkv), nh + it % (2 * nkv));
    }

    // States of segments [lo, hi) of tile 0 for kv heads [glo, ghi), to
    // out[g - glo][sg - lo][nqp * (hd + 2)] (mx[nqp], sum[nqp], o[nqp * hd]: attention_split's
    // layout). A segment past the tile's last key gets mx = -inf (merge_segment skips it), like
    // a row before a segment. A head group at a time: a ring member passes each group's state on
    // while it attends the next.
    void attend_range(int64_t li, float* out, int64_t lo, int64_t hi, int64_t glo, int64_t ghi, int tid,
                      int nt) const {
        const TileRows v = tile_rows(0);
        const int64_t nseg = hi - lo, stride = v.nqp * (hd + 2);
        float* buf = grow(scratch[tid], hd * v.nqp + 2 * KP * hd + KP * v.nqp + 2 * v.nqp);
        float *qt = buf, *kf = qt + hd * v.nqp, *vf = kf + KP * hd, *s = vf + KP * hd, *alpha = s + KP * v.nqp;
        int32_t* last = (int32_t*)(alpha + v.nqp);
        for (int64_t it = tid; it < (ghi - glo) * nseg; it += nt) {
            const int64_t g = glo + it / nseg, sg = lo + it % nseg;
            float* part = out + it * stride;
            std::memset(part, 0, stride * sizeof(float));
            if (sg * SEG >= v.end) {
                for (int64_t r = 0; r < v.nqp; ++r) part[r] = -INFINITY;
                continue;
            }
            load_rows(v, g, qt, last);
            attend_segment(v, g, li, sg, qt, last, kf, vf, s, part, part + v.nqp, alpha, part + 2 * v.nqp);
        }
    }

    // Fold parts[g - glo][0..nseg) per kv head g in [glo, ghi) into parts[g - glo][0], in order
    // (a ring member folding its segments into the running state its predecessor passed on: the
    // same left fold).
    void fold_ring(float* all, int64_t nseg, int64_t glo, int64_t ghi, int tid, int nt) const {
        const TileRows v = tile_rows(0);
        for (int64_t g = glo + tid; g < ghi; g += nt) fold_parts(v, all + (g - glo) * nseg * v.nqp * (hd + 2), nseg);
    }

    // Merge parts[g][0..nseg) (every segment of the tile's keys, in order) per kv head and
    // finish the rows into `attn` (normalised, quantized for the o-proj). Merges in place.
    void merge_ring(float* all, int64_t nseg, int tid, int nt) const {
        const TileRows v = tile_rows(0);
        for (int64_t g = tid; g < nkv; g += nt) merge_parts(v, g, all + g * nseg * v.nqp * (hd + 2), nseg);
    }

    void run(int tid, int nt) const {
        for (int64_t li = 0; li < m.n_layers; ++li) {
            layer_qkv(li, tid, nt);
#pragma omp barrier
            if (n_split)
                attention_split(li, tid, nt);
            else
                attention(li, tid, nt);
#pragma omp barrier
            layer_ffn(li, tid, nt);
        }
        head(tid, nt);
    }

    // A layer up to its attention: norm, q|k|v, bias / norms / rope (and the KV write).
    void layer_qkv(int64_t li, int tid, int nt) const {
        const Layer& L = m.layers[li];
        norm_rows(L.attn_norm, tid, nt);
#pragma omp barrier
        matmul(h, L.qkv, qkv, T, qkv_n, D, nullptr, tid, nt);
#pragma omp barrier
        qkv_post(L, li, tid, nt);
    }

    // A layer after its attention (in `attn`, quantized): o-proj + residual, norm, SwiGLU + residual.
    void layer_ffn(int64_t li, int tid, int nt) const {
        const Layer& L = m.layers[li];
        matmul(attn, L.o, tmp, T, D, nh * hd, x, tid, nt);
#pragma omp barrier
        norm_rows(L.ffn_norm, tid, nt);
#pragma omp barrier
        matmul(h, L.gate_up, gu, T, 2 * F, D, nullptr, tid, nt);
#pragma omp barrier
        // SiLU * up in whole 32-value blocks dealt over the threads (a decode step's one row
        // would otherwise be one thread's work), each block quantized for down as it is done
        const int64_t nbf = F / tq::QK;
        int64_t a, e;
        split(T * nbf, tid, nt, &a, &e);
        while (a < e) {
            const int64_t t = a / nbf, b0 = a % nbf, n = std::min(nbf - b0, e - a);
            const float* g = gu + t * 2 * F + b0 * tq::QK;
            silu_mul(g, g + F, act + t * F + b0 * tq::QK, n * tq::QK);
            quantize(act + t * F + b0 * tq::QK, t, F, b0, n);
            a += n;
        }
#pragma omp barrier
        matmul(act, L.down, tmp, T, D, F, x, tid, nt);
#pragma omp barrier
    }

    // The sample rows' final norm and the lm head.
    void head(int tid, int nt) const {
        int64_t a, e;
        split(b.n_sample, tid, nt, &a, &e);
        for (int64_t s = a; s < e; ++s) {
            rms_norm(x + b.sample_rows[s] * D, m.output_norm, h + s * D, D, m.eps);
            quantize(h + s * D, s, D, 0, D / tq::QK);
        }
#pragma omp barrier
        matmul(h, m.output, b.logits, b.n_sample, m.vocab, D, nullptr, tid, nt);
    }
};

// Whether one attention item takes all kv heads of tile v (out of `n` such units of work for
// nt threads): a one-token tile's K/V rows of a block lie side by side for all its heads, so
// one item reads them as one stream (every line it fetches is used) — when there are enough
// units (2 a thread) to keep the threads busy; else an item per kv head.
bool heads_together(const Step::TileRows& v, int64_t n, int nt) { return v.ntok == 1 && n >= 2 * nt; }

// The attention items of a step: (tile, g0, g1).
void plan_items(Step& st, Scratch& s, int nt) {
    int64_t* items = grow(s.att_items, 3 * st.n_tiles * st.nkv);
    int64_t i = 0;
    for (int64_t ti = 0; ti < st.n_tiles; ++ti) {
        if (heads_together(st.tile_rows(ti), st.n_tiles, nt)) {
            items[3 * i] = ti, items[3 * i + 1] = 0, items[3 * i + 2] = st.nkv, ++i;
            continue;
        }
        for (int64_t g = 0; g < st.nkv; ++g, ++i) items[3 * i] = ti, items[3 * i + 1] = g, items[3 * i + 2] = g + 1;
    }
    st.att_items = items;
    st.n_att = i;
}

// A step whose tiles are too few to keep the threads busy (fewer than 4 items a thread: decode)
// and whose keys span several segments spreads each tile's segments over the threads.
void plan_split(Step& st, Scratch& s, int nt) {
    if (nt < 2 || st.n_tiles * st.nkv >= 4 * nt) return;
    int64_t n_items = 0, n_parts = 0;
    int64_t* off = grow(s.part_off, st.n_tiles);
    for (int64_t ti = 0; ti < st.n_tiles; ++ti) {
        const auto v = st.tile_rows(ti);
        const int64_t nseg = (v.end + SEG - 1) / SEG;
        off[ti] = n_parts;
        n_items += nseg * st.nkv;
        n_parts += nseg * st.nkv * v.nqp * (st.hd + 2);
    }
    if (n_items == st.n_tiles * st.nkv) return;  // one segment each: nothing to spread
    int64_t* items = grow(s.split_items, 4 * n_items);
    int64_t i = 0;
    for (int64_t ti = 0; ti < st.n_tiles; ++ti) {
        const auto v = st.tile_rows(ti);
        const int64_t nseg = (v.end + SEG - 1) / SEG;
        const bool together = heads_together(v, nseg, nt);
        for (int64_t sg = 0; sg < nseg; ++sg)
            for (int64_t g = 0; g < st.nkv; g += together ? st.nkv : 1, ++i) {
                int64_t* item = items + 4 * i;
                item[0] = ti, item[1] = g, item[2] = together ? st.nkv : g + 1, item[3] = sg;
            }
    }
    st.split_items = items;
    st.part_off = off;
    st.n_split = i;
    st.parts = grow(s.parts, n_parts);
}

// The Step of one call over batch `b`: positions, attention tiles and buffers from `s`; the
// residual stream `x` and q|k|v rows from the caller where given (ring stages keep them
// between calls), else from `s`.
Step make_step(const Model* m, const Batch* b, Scratch& s, int nt, int isa, float* x, float* qkv) {
    const int64_t T = b->n_tokens, D = m->hidden, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv_heads;
    const int64_t F = m->ffn, qkv_n = (nh + 2 * nkv) * hd;
    int64_t* pos = grow(s.pos, T);
    int64_t* chunk_of = grow(s.chunk_of, T);
    for (int64_t c = 0; c < b->n_chunks; ++c) {
        const int64_t* ch = b->chunks + c * 4;
        for (int64_t i = 0; i < ch[1]; ++i) {
            pos[ch[2] + i] = ch[0] + i;
            chunk_of[ch[2] + i] = c;
        }
    }
    // attention tiles: up to MAX_ROWS query rows (tokens x the heads of one kv head) each
    const int64_t tile = std::max<int64_t>(1, MAX_ROWS / (nh / nkv));
    int64_t n_tiles = 0;
    for (int64_t c = 0; c < b->n_chunks; ++c) n_tiles += (b->chunks[c * 4 + 1] + tile - 1) / tile;
    int64_t* tiles = grow(s.tiles, 2 * n_tiles);
    for (int64_t c = 0, i = 0; c < b->n_chunks; ++c)
        for (int64_t t = 0; t < b->chunks[c * 4 + 1]; t += tile, ++i) {
            tiles[2 * i] = c;
            tiles[2 * i + 1] = b->chunks[c * 4 + 2] + t;
        }
    const int64_t S = b->n_sample > T ? b->n_sample : T;
    const int64_t max_nb = std::max(std::max(D, nh * hd), F) / tq::QK;
    int32_t* xp = m->packed ? grow(s.xp, S * max_nb * 16) : nullptr;
    int32_t* xs = m->packed ? grow(s.xs, S * max_nb) : nullptr;
    float* dx = m->packed ? grow(s.dx, S * max_nb) : nullptr;
    if ((int)s.per_thread.size() < nt) s.per_thread.resize(nt);
    const int64_t slot_stride = nkv * hd;
    const int64_t layer_stride = 2 * b->block_size * slot_stride;
    return Step{*m, *b, tq::resolve_isa(isa), T, D, hd, nh, nkv, F, qkv_n, x ? x : grow(s.x, T * D),
                grow(s.h, S * D), qkv ? qkv : grow(s.qkv, T * qkv_n), grow(s.attn, T * nh * hd), grow(s.tmp, T * D),
                grow(s.gu, T * 2 * F), grow(s.act, T * F), s.per_thread.data(), pos, chunk_of,
                layer_stride, m->n_layers * layer_stride, slot_stride, b->block_size * slot_stride,
                tiles, n_tiles, tile, nullptr, 0, nullptr, nullptr, 0, nullptr, xp, xs, dx,
                kv_loaders(tq::resolve_isa(isa), hd)};
}

void embed(const Model* m, const Batch* b, float* x) {
    if (m->embed_packed)
        tq::embedding_rows_packed(b->token_ids, b->n_tokens, m->embed, m->hidden, x);
    else
        tq::embedding_rows(b->token_ids, b->n_tokens, m->embed, m->hidden, x);
}

// Run body(tid, nt) on one OpenMP team of nt threads (or inline for one).
template <class Body>
void on_team(int nt, Body body) {
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        body(omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    body(0, 1);
}

Scratch& thread_scratch() {
    thread_local Scratch s;
    return s;
}

}  // namespace

extern "C" {

// One forward step over a flat batch (see Batch); everything validated by the caller
// (kernels/cpu_forward.py). Writes the batch's K/V into b->kv and logits of b->sample_rows.
void tq_forward(const Model* m, const Batch* b, int nthreads, int isa) {
    Scratch& s = thread_scratch();
    const int nt = nthreads < 1 ? 1 : nthreads;
    Step st = make_step(m, b, s, nt, isa, nullptr, nullptr);
    embed(m, b, st.x);
    plan_items(st, s, nt);
    plan_split(st, s, nt);
    on_team(nt, [&](int tid, int n) { st.run(tid, n); });
}

// One stage of a ring decode step (kernels/cpu_ring.py drives them; docs/strategies.md). The
// batch is one chunk of at most MAX_ROWS / group tokens (one attention tile: a decode token);
// `x` [T, hidden] is the residual stream and `qkv` [T, (nh + 2 nkv) hd] the layer's q|k|v rows,
// both kept by the caller between stages. Stages:
//   0 embed      x = embedding of the batch's tokens                      (coordinator)
//   1 qkv        layer's norm, q|k|v, bias / norms / rope into qkv; b->kv null (coordinator)
//   2 store      k and v rows of qkv into b->kv through b->tables          (the tail member)
//   3 attend     states of segments [seg_lo, seg_hi) of kv heads [head_lo, head_hi) into parts
//                [head_hi - head_lo][seg_hi - seg_lo][nqp * (hd + 2)], nqp = T * group rounded
//                up to 8                                                   (member)
//   4 merge_ffn  parts [nkv][seg_hi][...] (all segments, seg_lo = 0) merged in order, then
//                o-proj, FFN and the residual adds into x                   (coordinator)
//   5 head       logits of b->sample_rows into b->logits                    (coordinator)
//   6 fold       parts [head_hi - head_lo][seg_hi][...] folded in order into parts[:, 0] (a
//                member passing the running state along the ring; merge_ffn then takes it,
//                all kv heads, as one part)
// Everything else validated by the caller. Returns 0, or -1 for a batch that is not one tile
// (or a head range outside [0, nkv) for stages 3 and 6).
int tq_ring_stage(const Model* m, const Batch* b, int stage, int64_t layer, float* x, float* qkv, float* parts,
                  int64_t seg_lo, int64_t seg_hi, int64_t head_lo, int64_t head_hi, int nthreads, int isa) {
    const int64_t tile = std::max<int64_t>(1, MAX_ROWS / (m->n_heads / m->n_kv_heads));
    if (b->n_chunks != 1 || b->chunks[2] != 0 || b->chunks[1] != b->n_tokens || b->n_tokens < 1 ||
        b->n_tokens > tile || stage < 0 || stage > 6)
        return -1;
    if ((stage == 3 || stage == 6) && !(0 <= head_lo && head_lo < head_hi && head_hi <= m->n_kv_heads))
        return -1;
    Scratch& s = thread_scratch();
    const int nt = nthreads < 1 ? 1 : nthreads;
    Step st = make_step(m, b, s, nt, isa, x, qkv);
    if (stage == 0) {
        embed(m, b, x);
        return 0;
    }
    on_team(nt, [&](int tid, int n) {
        switch (stage) {
            case 1: st.layer_qkv(layer, tid, n); break;
            case 2: st.store_rows(layer, tid, n); break;
            case 6: st.fold_ring(parts, seg_hi, head_lo, head_hi, tid, n); break;
            case 3: st.attend_range(layer, parts, seg_lo, seg_hi, head_lo, head_hi, tid, n); break;
            case 4:
                st.merge_ring(parts, seg_hi, tid, n);
#pragma omp barrier
                st.layer_ffn(layer, tid, n);
                break;
            default: st.head(tid, n); break;
        }
    });
    return 0;
}

}  // extern "C"

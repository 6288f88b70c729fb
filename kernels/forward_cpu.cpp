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
// attention: (token, query head), dealt round-robin because causal rows differ in length).
// So the result is bitwise the same for any thread count, and a sequence's numbers do not
// depend on its batch neighbours.
//
// Vector code: the element-wise loops below are written over fixed 16-lane accumulators with
// explicit fma and no reassociation; `target_clones` builds them for AVX-512, AVX2+FMA and
// baseline x86-64, and the vectoriser may not reorder them (-ffp-contract=off, no fast-math),
// so every clone gives the same bits.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "q4_0_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TQ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TQ_CLONES
#endif

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

inline float h2f(uint16_t h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

inline uint16_t f2h(float f) {  // round to nearest even, as torch's .to(float16)
    const _Float16 v = (_Float16)f;
    uint16_t h;
    std::memcpy(&h, &v, 2);
    return h;
}

// exp(x) in fixed operations (Cephes expf coefficients; ~2 ulp): the same bits in every clone.
inline float exp_fixed(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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

// silu(g) * u for one row of gate|up.
TQ_CLONES void silu_mul(const float* gu, float* out, int64_t ffn) {
    for (int64_t i = 0; i < ffn; ++i) {
        const float g = gu[i];
        out[i] = g / (1.0f + exp_fixed(-g)) * gu[ffn + i];
    }
}

TQ_CLONES void to_half(const float* x, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = f2h(x[i]);
}

// One query head over keys/values 0..L-1 of its sequence, read in place from the paged cache.
// k(j) = kv + table[j / bs] * block_stride + (j % bs) * slot_stride (v at + v_off).
TQ_CLONES void attend(const float* q, const uint16_t* kv, const int64_t* table, int64_t L, int64_t bs,
                      int64_t block_stride, int64_t slot_stride, int64_t v_off, int64_t hd,
                      float scale, float* scores, float* out) {
    float m = -INFINITY;
    for (int64_t j = 0; j < L; ++j) {
        const uint16_t* k = kv + table[j / bs] * block_stride + (j % bs) * slot_stride;
        float acc[LANES] = {};
        for (int64_t d = 0; d < hd; d += LANES)
            for (int l = 0; l < LANES; ++l) acc[l] = std::fma(q[d + l], h2f(k[d + l]), acc[l]);
        const float s = hsum16(acc) * scale;
        scores[j] = s;
        m = s > m ? s : m;
    }
    float sum[LANES] = {};
    int64_t j = 0;
    for (; j + LANES <= L; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            scores[j + l] = exp_fixed(scores[j + l] - m);
            sum[l] += scores[j + l];
        }
    for (; j < L; ++j) {
        scores[j] = exp_fixed(scores[j] - m);
        sum[j % LANES] += scores[j];
    }
    const float inv = 1.0f / hsum16(sum);
    for (int64_t d = 0; d < hd; ++d) out[d] = 0.0f;
    for (j = 0; j < L; ++j) {
        const uint16_t* v = kv + table[j / bs] * block_stride + (j % bs) * slot_stride + v_off;
        const float p = scores[j];
        for (int64_t d = 0; d < hd; ++d) out[d] = std::fma(p, h2f(v[d]), out[d]);
    }
    for (int64_t d = 0; d < hd; ++d) out[d] *= inv;
}

// Per-call scratch, grown as needed and kept (one forward runs at a time per calling thread).
struct Scratch {
    std::vector<float> x, h, qkv, attn, tmp, gu, act, scores;
    std::vector<int64_t> pos, chunk_of;
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
    std::vector<float>* scores;  // one per thread
    const int64_t *pos, *chunk_of;
    int64_t layer_stride, block_stride, slot_stride, v_off;

    // out[M, N] = in @ W.T, this thread's tiles; with `residual`, residual[:, tiles] += out.
    void matmul(const float* in, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                float* residual, int tid, int nt) const {
        int64_t r0, r1;
        tq::thread_rows(N, tid, nt, &r0, &r1);
        if (r0 >= r1) return;
        tq::matmul_f32_rows(in, w, out, M, N, K, r0, r1, isa);
        if (residual)
            for (int64_t i = 0; i < M; ++i)
                for (int64_t n = r0; n < r1; ++n) residual[i * N + n] += out[i * N + n];
    }

    void norm_rows(const float* w, int tid, int nt) const {
        int64_t a, e;
        split(T, tid, nt, &a, &e);
        for (int64_t t = a; t < e; ++t) rms_norm(x + t * D, w, h + t * D, D, m.eps);
    }

    // bias, q/k norms, rope; k and v written to the cache. Items: (token, head of q|k|v).
    void qkv_post(const Layer& L, int64_t li, int tid, int nt) const {
        const int64_t heads = nh + 2 * nkv, half = hd / 2;
        int64_t a, e;
        split(T * heads, tid, nt, &a, &e);
        std::vector<float>& tmp_head = scores[tid];
        float* normed = grow(tmp_head, hd);
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
            if (hh < nh) continue;
            const int64_t* ch = b.chunks + chunk_of[t] * 4;
            const int64_t p = pos[t];
            const int64_t blk = b.tables[ch[3] + p / b.block_size];
            const bool is_v = hh >= nh + nkv;
            const int64_t kvh = is_v ? hh - nh - nkv : hh - nh;
            uint16_t* dst = b.kv + blk * block_stride + li * layer_stride + (is_v ? v_off : 0) +
                            (p % b.block_size) * slot_stride + kvh * hd;
            to_half(v, dst, hd);
        }
    }

    void attention(int64_t li, int tid, int nt) const {
        const int64_t group = nh / nkv;
        float* sc = grow(scores[tid], m.max_ctx);
        for (int64_t it = tid; it < T * nh; it += nt) {  // round-robin: causal rows differ in length
            const int64_t t = it / nh, hh = it % nh;
            const int64_t* ch = b.chunks + chunk_of[t] * 4;
            const uint16_t* base = b.kv + li * layer_stride + (hh / group) * hd;
            attend(qkv + t * qkv_n + hh * hd, base, b.tables + ch[3], pos[t] + 1, b.block_size,
                   block_stride, slot_stride, v_off, hd, m.scale, sc, attn + t * nh * hd + hh * hd);
        }
    }

    void run(int tid, int nt) const {
        for (int64_t li = 0; li < m.n_layers; ++li) {
            const Layer& L = m.layers[li];
            norm_rows(L.attn_norm, tid, nt);
#pragma omp barrier
            matmul(h, L.qkv, qkv, T, qkv_n, D, nullptr, tid, nt);
#pragma omp barrier
            qkv_post(L, li, tid, nt);
#pragma omp barrier
            attention(li, tid, nt);
#pragma omp barrier
            matmul(attn, L.o, tmp, T, D, nh * hd, x, tid, nt);
#pragma omp barrier
            norm_rows(L.ffn_norm, tid, nt);
#pragma omp barrier
            matmul(h, L.gate_up, gu, T, 2 * F, D, nullptr, tid, nt);
#pragma omp barrier
            int64_t a, e;
            split(T, tid, nt, &a, &e);
            for (int64_t t = a; t < e; ++t) silu_mul(gu + t * 2 * F, act + t * F, F);
#pragma omp barrier
            matmul(act, L.down, tmp, T, D, F, x, tid, nt);
#pragma omp barrier
        }
        int64_t a, e;
        split(b.n_sample, tid, nt, &a, &e);
        for (int64_t s = a; s < e; ++s) rms_norm(x + b.sample_rows[s] * D, m.output_norm, h + s * D, D, m.eps);
#pragma omp barrier
        matmul(h, m.output, b.logits, b.n_sample, m.vocab, D, nullptr, tid, nt);
    }
};

}  // namespace

extern "C" {

// One forward step over a flat batch (see Batch); everything validated by the caller
// (kernels/cpu_forward.py). Writes the batch's K/V into b->kv and logits of b->sample_rows.
void tq_forward(const Model* m, const Batch* b, int nthreads, int isa) {
    thread_local Scratch s;
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
    const int64_t S = b->n_sample > T ? b->n_sample : T;
    float* x = grow(s.x, T * D);
    tq::embedding_rows(b->token_ids, T, m->embed, D, x);
    const int nt = nthreads < 1 ? 1 : nthreads;
    static thread_local std::vector<std::vector<float>> per_thread;
    if ((int)per_thread.size() < nt) per_thread.resize(nt);
    const int64_t slot_stride = nkv * hd;
    const int64_t layer_stride = 2 * b->block_size * slot_stride;
    Step st{*m, *b, tq::resolve_isa(isa), T, D, hd, nh, nkv, F, qkv_n, x,
            grow(s.h, S * D), grow(s.qkv, T * qkv_n), grow(s.attn, T * nh * hd), grow(s.tmp, T * D),
            grow(s.gu, T * 2 * F), grow(s.act, T * F), per_thread.data(), pos, chunk_of,
            layer_stride, m->n_layers * layer_stride, slot_stride, b->block_size * slot_stride};
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        st.run(omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    st.run(0, 1);
}

}  // extern "C"

// The host's token draw for sampled rows (shared/engine/sampler.py `draw_rows`): temperature,
// top-k, top-p, min-p and the seeded inverse-CDF draw, every row of a step in one call, rows
// spread over the kernel threads. Per row (V logits, parameters T, k, p, min_p, seed, index):
//
//   1. x = logits / T (a +inf or overflow clamped to FLT_MAX); a NaN fails the row (-2);
//   2. top-k (0 < k < V): keep x >= the k-th largest x (ties stay);
//   3. e = exp(x - max x) over what is kept (exp in fixed operations, tq::exp_body: the same bits
//      on every ISA; e = 0 where x - max < -87 or x = -inf), Z = their float64 sum;
//   4. top-p (p < 1): in descending order of x (ties by token index), a token is dropped when the
//      float64 sum of e before it reaches p * Z; the best always stays. Only the tokens within a
//      span of the best are sorted (8, 1.5x wider while their sum is short of p * Z, past 64
//      every token): any token past them has at least their sum before it;
//   5. min-p: drop e < min_p (the best token's e is exp(0) = 1 exactly, so this is
//      p < min_p * max p over the kept set);
//   6. the draw: the first kept token, in token order, whose float64 running sum of e exceeds
//      u * (their sum), u numpy's Generator(Philox(key=seed, counter=index)).random() — the
//      same u as sampler.uniform and the GPU's philox_uniform.
//
// The result depends on the row and its parameters only: not on the batch, the thread count
// or the CPU's ISA.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "q4_0_cpu.h"

namespace {

// numpy's Generator(Philox(key=seed, counter=index)).random(): Philox-4x64-10 of the counter
// (index + 1, 0, 0, 0) under the key (seed, 0), its first word's top 53 bits over 2^53.
double philox_uniform(uint64_t seed, uint64_t index) {
    uint64_t k0 = seed, k1 = 0, c0 = index + 1, c1 = 0, c2 = 0, c3 = 0;
    for (int r = 0; r < 10; ++r) {
        if (r) k0 += 0x9E3779B97F4A7C15ULL, k1 += 0xBB67AE8584CAA73BULL;
        const unsigned __int128 p0 = (unsigned __int128)0xD2E7470EE14C6C93ULL * c0;
        const unsigned __int128 p1 = (unsigned __int128)0xCA5A826395121157ULL * c2;
        const uint64_t n0 = (uint64_t)(p1 >> 64) ^ c1 ^ k0, n2 = (uint64_t)(p0 >> 64) ^ c3 ^ k1;
        c1 = (uint64_t)p1, c3 = (uint64_t)p0, c0 = n0, c2 = n2;
    }
    return (double)(c0 >> 11) * (1.0 / 9007199254740992.0);
}

// Sum of e[0..n) in float64: 16 lanes (i mod 16), then a fixed tree.
TQ_CLONES double sum64(const float* e, int64_t n) {
    double acc[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
#pragma omp simd
        for (int l = 0; l < 16; ++l) acc[l] += (double)e[i + l];
    for (int l = 0; i < n; ++i, ++l) acc[l] += (double)e[i];
    for (int w = 8; w; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

struct Scratch {
    std::vector<float> x, e;
    std::vector<int32_t> cand;
    std::vector<uint64_t> keys;
};

// Steps 1-6 for one row; weights (nullable) gets e on the kept set, 0 elsewhere (for tests).
TQ_CLONES int32_t draw_row(const float* row, int64_t V, float T, int32_t top_k, float top_p, float min_p, double u,
                 Scratch& s, float* weights) {
    s.x.resize(V), s.e.resize(V);
    float* x = s.x.data();
    float* e = s.e.data();
    int64_t nan = 0;
    float m = -INFINITY;
#pragma omp simd reduction(+ : nan) reduction(max : m)
    for (int64_t i = 0; i < V; ++i) {
        const float v = row[i] / T;
        x[i] = v > FLT_MAX ? FLT_MAX : v;
        nan += v != v;
        m = x[i] > m ? x[i] : m;
    }
    if (nan) return -2;
    if (m == -INFINITY) return -1;
    if (top_k > 0 && top_k < V) {
        std::copy(x, x + V, e);
        std::nth_element(e, e + (top_k - 1), e + V, [](float a, float b) { return a > b; });
        const float kth = e[top_k - 1];
#pragma omp simd
        for (int64_t i = 0; i < V; ++i) x[i] = x[i] < kth ? -INFINITY : x[i];
    }
    // in passes the vectoriser takes (tq::exp_lanes' reason): the difference clamped, its exp,
    // then 0 where the difference was under -87 (-inf included)
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) e[i] = x[i] - m < -87.0f ? -87.0f : x[i] - m;
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) e[i] = tq::exp_body(e[i]);
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) e[i] = x[i] - m < -87.0f ? 0.0f : e[i];
    // the kept tokens: every one with e > 0 (`all`), else `cand`
    std::vector<int32_t>& cand = s.cand;
    cand.clear();
    bool all = true;
    if (top_p < 1.0f) {
        const double cut = (double)top_p * sum64(e, V);
        std::vector<uint64_t>& keys = s.keys;  // x descending, then index ascending: (~order(x), i)
        for (float span = 8.0f;; span = span < 64.0f ? 1.5f * span : INFINITY) {
            keys.clear();
            for (int64_t i0 = 0; i0 < V; i0 += 16) {
                const int64_t n = std::min<int64_t>(16, V - i0);
                int any = 0;
#pragma omp simd reduction(| : any)
                for (int64_t l = 0; l < n; ++l) any |= x[i0 + l] - m >= -span;
                if (!any) continue;
                for (int64_t i = i0; i < i0 + n; ++i)
                    if (e[i] > 0.0f && x[i] - m >= -span) {
                        uint32_t b;
                        std::memcpy(&b, x + i, 4);
                        b = b & 0x80000000u ? ~b : b | 0x80000000u;  // float order as unsigned order
                        keys.push_back((uint64_t)~b << 32 | (uint64_t)i);
                    }
            }
            std::sort(keys.begin(), keys.end());
            double sum = 0.0;
            size_t keep = keys.size();
            for (size_t j = 0; j < keys.size(); ++j) {
                if (j && sum >= cut) {
                    keep = j;
                    break;
                }
                sum += (double)e[(uint32_t)keys[j]];
            }
            if (keep < keys.size() || sum >= cut || span == INFINITY) {
                for (size_t j = 0; j < keep; ++j) cand.push_back((int32_t)(uint32_t)keys[j]);
                break;
            }
        }
        std::sort(cand.begin(), cand.end());
        all = false;
    }
    if (min_p > 0.0f) {
        if (all) {
            for (int64_t i = 0; i < V; ++i)
                if ((double)e[i] >= (double)min_p) cand.push_back((int32_t)i);
        } else {
            cand.erase(std::remove_if(cand.begin(), cand.end(), [&](int32_t i) { return (double)e[i] < (double)min_p; }),
                       cand.end());
        }
        all = false;
    }
    if (weights) {
        std::fill(weights, weights + V, 0.0f);
        if (all)
            std::copy(e, e + V, weights);
        for (int32_t i : cand) weights[i] = e[i];
    }
    // the draw: the running sum in token order, up to the first token past u * total
    if (all) {
        const double target = u * sum64(e, V);
        double run = 0.0;
        for (int64_t i = 0; i < V; ++i)
            if ((run += (double)e[i]) > target) return (int32_t)i;
        for (int64_t i = V - 1;; --i)  // u * total rounded up to the total: the last drawable token
            if (e[i] > 0.0f) return (int32_t)i;
    }
    double total = 0.0;
    for (int32_t i : cand) total += (double)e[i];
    const double target = u * total;
    double run = 0.0;
    for (int32_t i : cand)
        if ((run += (double)e[i]) > target) return i;
    return cand.back();
}

}  // namespace

extern "C" {

// out[r] = the token drawn for row r (rows[r]: V float32 logits), -1 where no token can be
// drawn, -2 where a logit is NaN. weights (nullable): S x V, each row's kept e (0 elsewhere).
void tq_sample_rows(const float* const* rows, int64_t S, int64_t V, const float* temp, const int32_t* top_k,
                    const float* top_p, const float* min_p, const uint64_t* seed, const int64_t* index,
                    int32_t* out, float* weights, int nthreads) {
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (S > 1)
    {
        static thread_local Scratch s;  // (fresh buffers of 2 x V floats a call cost page faults)
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < S; ++r)
            out[r] = draw_row(rows[r], V, temp[r], top_k[r], top_p[r], min_p[r],
                              philox_uniform(seed[r], (uint64_t)index[r]), s, weights ? weights + r * V : nullptr);
    }
}

double tq_philox_uniform(uint64_t seed, int64_t index) { return philox_uniform(seed, (uint64_t)index); }

}  // extern "C"

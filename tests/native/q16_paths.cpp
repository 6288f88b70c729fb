// Cross-ISA check of the q16 kernels, built as a standalone program (tests/unit/test_kernels_cross.py
// builds it for another architecture and runs it under qemu-user): every instruction-set path this
// CPU runs must give the scalar path's bits, for several M, N (not multiples of the 16-row group)
// and K. Prints one line per path and exits non-zero on the first difference.
#include "../../kernels/q4_0_cpu.cpp"

#include <cstdio>
#include <cstdlib>
#include <random>

int main() {
    std::mt19937 rng(7);
    std::normal_distribution<float> gauss(0.0f, 1.0f);
    const int best = tq::resolve_isa(-1);
    int checked = 0;
    for (int64_t K : {64, 576}) {
        for (int64_t N : {16, 50, 100}) {
            const int64_t nb = K / 32, G = (N + 15) / 16;
            std::vector<uint8_t> q(N * nb * 18), packed(G * 16 * nb * 18);
            for (int64_t i = 0; i < N * nb; ++i) {
                const uint16_t d = (uint16_t)(0x2000 + rng() % 0x0C00);   // fp16 scales ~0.008 .. 0.04
                std::memcpy(&q[i * 18], &d, 2);
                for (int j = 2; j < 18; ++j) q[i * 18 + j] = (uint8_t)rng();
            }
            tq_pack_q4_0(q.data(), N, K, packed.data());
            for (int64_t M : {1, 2, 3, 5, 17}) {
                std::vector<float> x(M * K), ref(M * N), got(M * N);
                for (auto& v : x) v = gauss(rng);
                tq_matmul_q16(x.data(), packed.data(), ref.data(), M, N, K, 1, 0);   // scalar
                for (int threads : {1, 2}) {
                    tq_matmul_q16(x.data(), packed.data(), got.data(), M, N, K, threads, best);
                    if (std::memcmp(ref.data(), got.data(), ref.size() * sizeof(float)) != 0) {
                        std::printf("MISMATCH isa %d M %ld N %ld K %ld threads %d\n", best, (long)M, (long)N,
                                    (long)K, threads);
                        return 1;
                    }
                    ++checked;
                }
            }
        }
    }
    std::printf("isa %d: %d cases bitwise equal to the scalar path\n", best, checked);
    return best == 0 ? 2 : 0;  // 2: only the scalar path ran (nothing was compared)
}

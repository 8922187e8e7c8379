// The CPU select's page sums, vectorised (sparse_attn_page_scores) against the scalar canonical order
// (sparse_attn_page_score), bit for bit. Compiled by tests/test_build_real.py against the patched tree's
// ggml/src/ggml-cpu/sparse-attn.cpp (included whole: the functions are static) and linked with its CPU backend.
// Prints the path the build took and "<n> compared, <m> differ"; exits 1 on any difference.
#include "sparse-attn.cpp"

#include "ggml-cpu.h"

#include <cstdio>
#include <initializer_list>
#include <random>
#include <vector>

template <typename T_S>
static long count_differences(const std::vector<float> & q, const std::vector<float> & qp, const std::vector<T_S> & ks,
                              int64_t D, int64_t gqa, long & n) {
    std::vector<float> kb(D);
    std::vector<float> ps(gqa);
    sparse_attn_page_scores<T_S>(qp.data(), ks.data(), kb.data(), D, gqa, ps.data());
    long bad = 0;
    for (int64_t g = 0; g < gqa; ++g) {
        const float r = sparse_attn_page_score<T_S>(q.data() + g*D, ks.data(), D);
        n++;
        if (memcmp(&r, &ps[g], sizeof(float)) != 0 && !(std::isnan(r) && std::isnan(ps[g]))) {
            if (bad++ < 3) {
                printf("D=%lld g=%lld scalar %a vectorised %a\n", (long long) D, (long long) g, r, ps[g]);
            }
        }
    }
    return bad;
}

int main() {
    ggml_cpu_init(); // the f16 -> f32 table of the scalar conversion

    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    long n   = 0;
    long bad = 0;
    for (int64_t D : {16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 576}) {
        for (int64_t gqa : {1, 2, 4, 5, 8}) {
            for (int it = 0; it < 2000; ++it) {
                // magnitudes over 2^-20 .. 2^19, some keys 1000x larger (cancellation), some infinities
                const float scale = std::ldexp(1.0f, (int) (rng() % 40) - 20);
                std::vector<float> q(gqa*D), qp(gqa*D), k(D);
                std::vector<ggml_fp16_t> kh(D);
                for (float & x : q) {
                    x = normal(rng);
                }
                for (int64_t d = 0; d < D; ++d) {
                    k[d]  = normal(rng)*scale*(rng() % 7 == 0 ? 1000.0f : 1.0f);
                    kh[d] = GGML_CPU_FP32_TO_FP16(k[d]);
                }
                if (it % 50 == 0) {
                    k[rng() % D]  = INFINITY;
                    kh[rng() % D] = GGML_CPU_FP32_TO_FP16(-INFINITY);
                }
                for (int64_t g = 0; g < gqa; ++g) {
                    sparse_attn_prepare_q(q.data() + g*D, D, qp.data() + g*D);
                }
                bad += count_differences<float>(q, qp, k, D, gqa, n);
                bad += count_differences<ggml_fp16_t>(q, qp, kh, D, gqa, n);
            }
        }
    }
#if defined(SPARSE_ATTN_SELECT_AVX2)
    printf("path: avx2\n");
#else
    printf("path: scalar\n");
#endif
    printf("%ld compared, %ld differ\n", n, bad);
    return bad == 0 ? 0 : 1;
}

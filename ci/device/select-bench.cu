// Microbenchmark of the CUDA SPARSE_ATTN_SELECT kernels against the memory floor of the select.
//
// Built on the device against the patched tree (ci/device/h200.sh stage `selbench`):
//   nvcc -std=c++17 -O3 -arch=sm_90 -use_fast_math -extended-lambda -I$SRC/ggml/include -I$SRC/ggml/src
//        -I$SRC/ggml/src/ggml-cuda ci/device/select-bench.cu -L$BIN -lggml-cuda -lggml-base -lggml -o select-bench
//   select-bench [N_KV[:PAGE[:SCORE[:N_BATCH]]] ...]     (default: 32768:4 131072:16 524288:16, SCORE maxmean or max)
// It includes the tree's sparse-attn.cu and times, per case (8 KV heads x GQA 4, head dim 128, f16 key sums, 128-token
// blocks, top-k 32 + 1 sink + 2 recent blocks: the llama defaults; the page size as the automatic one, 4 cells up to
// 32K, 16 beyond):
//   - the fused kernel (sparse_attn_score_select_kernel, its counter memset included): the whole op, and its score
//     phase alone (counters that never reach the last count, so no CUDA block does the top-k);
//   - where the tree has them (SPARSE_ATTN_SELECT_FLOOR: ci/device/candidates/select-floor.patch), the floor kernels:
//     the whole op (score kernel + top-k kernel), the score kernel alone and the top-k kernel alone;
// L2 flushed before every timed launch ("cold", as inside the model, where weights and K/V pass through L2 between two
// selects) and not ("warm", as test-backend-ops perf). The memory floor is the bytes of page key sums the select must
// read once (pages x KV heads x D x 2 bytes; the mask and the keys are under 2% of it) over the bandwidth: the nominal
// one of the card (H100 3.35 TB/s, H200 4.8 TB/s) and a device-to-device copy measured here. Every kernel's share of
// the floor is floor / time. The floor kernels' block lists must equal the fused kernel's (checked on three inputs:
// random sums, sums with exact ties and empty pages, and equal sums everywhere), else the run fails.
#include "sparse-attn.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define BENCH_CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

struct bench_case {
    int  n_kv       = 131072;
    int  page_size  = 16;
    bool maxmean    = true;
    int  n_batch    = 1;
    int  D          = 128;
    int  gqa        = 4;
    int  n_head_kv  = 8;
    int  block_size = 128;
    int  top_k      = 32;
    int  n_sink     = 1;
    int  n_recent   = 2;
};

static bool parse_case(const char * arg, bench_case & c) {
    std::string s(arg);
    std::vector<std::string> f;
    size_t p = 0;
    while (true) {
        const size_t q = s.find(':', p);
        f.push_back(s.substr(p, q == std::string::npos ? std::string::npos : q - p));
        if (q == std::string::npos) {
            break;
        }
        p = q + 1;
    }
    c.n_kv      = atoi(f[0].c_str());
    c.page_size = f.size() > 1 ? atoi(f[1].c_str()) : (c.n_kv <= 32768 ? 4 : 16);
    c.maxmean   = f.size() > 2 ? f[2] != "max" : true;
    c.n_batch   = f.size() > 3 ? atoi(f[3].c_str()) : 1;
    return c.n_kv > 0 && c.page_size > 0 && c.block_size % c.page_size == 0 && c.n_batch >= 1 && c.n_batch <= 8;
}

static float bench_median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0f : v[v.size()/2];
}

// the key sums of a check or timing: 0 random: sums of 16 keys of unit variance (sd 4), some pages "hot" (a realistic
// spread); 1 tied: as 0, but every 5th page repeats the page before it (exact ties of the scores) and 3% of the pages
// are empty (NaN); 2 flat: every page the same (all scores equal: the top-k's every digit level, then the lowest ids)
static void fill_sums(std::vector<half> & hk, const bench_case & c, const int n_pages, const int mode, std::mt19937 & rng) {
    std::normal_distribution<float> nd01(0.0f, 1.0f);
    const size_t row = size_t(c.D)*c.n_head_kv; // one page, all KV heads
    const bool ties = mode == 1;
    for (int pg = 0; pg < n_pages; ++pg) {
        half * r = hk.data() + size_t(pg)*row;
        if ((ties && pg % 5 == 4) || (mode == 2 && pg > 0)) {
            memcpy(r, r - row, row*sizeof(half));
            continue;
        }
        const bool empty = ties && (pg*2654435761u) % 100 < 3;
        const float bias = (pg*2654435761u) % 97 == 0 ? 2.0f : 0.0f;
        for (size_t i = 0; i < row; ++i) {
            r[i] = empty ? __float2half(NAN) : __float2half(4.0f*nd01(rng) + bias);
        }
    }
}

int main(int argc, char ** argv) {
    std::vector<bench_case> cases;
    for (int i = 1; i < argc; ++i) {
        bench_case c;
        if (!parse_case(argv[i], c)) {
            fprintf(stderr, "select-bench: bad case '%s' (N_KV[:PAGE[:maxmean|max[:N_BATCH]]])\n", argv[i]);
            return 2;
        }
        cases.push_back(c);
    }
    if (cases.empty()) {
        for (const char * a : { "32768:4", "131072:16", "524288:16" }) {
            bench_case c;
            parse_case(a, c);
            cases.push_back(c);
        }
    }

    cudaDeviceProp prop;
    BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
    const int nsm = prop.multiProcessorCount;
    const bool is_h200 = strstr(prop.name, "H200") != nullptr;
    const bool is_h100 = strstr(prop.name, "H100") != nullptr;
    const double bw_nominal = is_h200 ? 4.8e12 : is_h100 ? 3.35e12 : 0.0;

    cudaStream_t stream;
    BENCH_CHECK(cudaStreamCreate(&stream));
    cudaEvent_t e0, e1;
    BENCH_CHECK(cudaEventCreate(&e0));
    BENCH_CHECK(cudaEventCreate(&e1));

    // L2 flush buffer, and the copy bandwidth (bytes read + written) of a 1 GiB device-to-device copy
    const size_t n_flush = size_t(512) << 20;
    char * flush = nullptr;
    BENCH_CHECK(cudaMalloc(&flush, n_flush));
    double bw_copy = 0.0;
    {
        const size_t n = size_t(1) << 30;
        char * a = nullptr;
        char * b = nullptr;
        BENCH_CHECK(cudaMalloc(&a, n));
        BENCH_CHECK(cudaMalloc(&b, n));
        BENCH_CHECK(cudaMemsetAsync(a, 1, n, stream));
        std::vector<float> ts;
        for (int r = 0; r < 12; ++r) {
            BENCH_CHECK(cudaEventRecord(e0, stream));
            BENCH_CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, stream));
            BENCH_CHECK(cudaEventRecord(e1, stream));
            BENCH_CHECK(cudaEventSynchronize(e1));
            float ms;
            BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 2) {
                ts.push_back(ms);
            }
        }
        bw_copy = 2.0*n/(bench_median(ts)*1e-3);
        cudaFree(a);
        cudaFree(b);
    }
    printf("device %s, %d SMs, L2 %d MB; copy bandwidth %.2f TB/s (read + write), nominal %s\n", prop.name, nsm,
        prop.l2CacheSize >> 20, bw_copy/1e12, bw_nominal > 0 ? (is_h200 ? "4.8 TB/s" : "3.35 TB/s") : "unknown");
#ifndef SPARSE_ATTN_SELECT_FLOOR
    printf("the tree has no floor kernels (SPARSE_ATTN_SELECT_FLOOR): the fused kernel only\n");
#endif

    bool all_ok = true;
    std::vector<std::string> summary;
    for (const bench_case & c : cases) {
        const int n_head   = c.gqa*c.n_head_kv;
        const int n_pages  = (c.n_kv + c.page_size - 1)/c.page_size;
        const int n_blocks = (c.n_kv + c.block_size - 1)/c.block_size;
        const int n_rows   = c.n_head_kv*c.n_batch;

        float * q = nullptr; half * ksum = nullptr; half * mask = nullptr; uint32_t * keys = nullptr; int32_t * dst = nullptr;
        BENCH_CHECK(cudaMalloc(&q, sizeof(float)*c.D*n_head*c.n_batch));
        BENCH_CHECK(cudaMalloc(&ksum, sizeof(half)*size_t(c.D)*c.n_head_kv*n_pages));
        BENCH_CHECK(cudaMalloc(&mask, sizeof(half)*size_t(c.n_kv)*c.n_batch));
        BENCH_CHECK(cudaMalloc(&keys, sizeof(uint32_t)*(size_t(n_blocks)*n_rows + n_rows)));
        BENCH_CHECK(cudaMalloc(&dst, sizeof(int32_t)*size_t(n_blocks + 1)*n_rows*2));
        unsigned int * counters = keys + size_t(n_blocks)*n_rows;
        int32_t * dst_fused = dst;
        int32_t * dst_floor = dst + size_t(n_blocks + 1)*n_rows;

        std::mt19937 rng(1234 + c.n_kv);
        std::normal_distribution<float> nd01(0.0f, 1.0f);
        std::vector<float> hq(size_t(c.D)*n_head*c.n_batch);
        for (float & x : hq) {
            x = nd01(rng);
        }
        std::vector<half> hk(size_t(c.D)*c.n_head_kv*n_pages);
        std::vector<half> hm(size_t(c.n_kv)*c.n_batch, __float2half(0.0f));
        BENCH_CHECK(cudaMemcpy(q, hq.data(), hq.size()*sizeof(float), cudaMemcpyHostToDevice));
        BENCH_CHECK(cudaMemcpy(mask, hm.data(), hm.size()*sizeof(half), cudaMemcpyHostToDevice));

        // q as flash attention sees it: [D, n_batch, n_head], each query's heads contiguous per query row
        const int64_t nbq1 = sizeof(float)*c.D*n_head, nbq2 = sizeof(float)*c.D, nbq3 = nbq1*c.n_batch;
        const int64_t s_m1 = c.n_kv, s_m3 = int64_t(c.n_kv)*c.n_batch;
        const int64_t s_d1 = n_blocks + 1, s_d2 = s_d1*c.n_head_kv, s_d3 = s_d2*c.n_batch;
        // grid of the op (ggml_cuda_op_sparse_attn_select)
        const int64_t n_w  = int64_t(2)*nsm*SPARSE_ATTN_SELECT_NWARPS;
        const int bpw      = (int) std::min<int64_t>(SPARSE_ATTN_SELECT_BPW_MAX,
            std::max<int64_t>(1, (int64_t(n_blocks)*n_rows + n_w - 1)/n_w));
        const int n_chunks = (n_blocks + SPARSE_ATTN_SELECT_NWARPS*bpw - 1)/(SPARSE_ATTN_SELECT_NWARPS*bpw);
        const bool keys_in_smem = size_t(n_blocks)*sizeof(uint32_t) <= 32*1024;
        const double bytes_sums = double(n_pages)*c.n_head_kv*c.D*sizeof(half);
        const double floor_nominal = bw_nominal > 0 ? bytes_sums/bw_nominal*1e6 : 0.0;
        const double floor_copy    = bytes_sums/(bw_copy/2.0)*1e6; // a read-only stream at the copy's rate
        printf("\nn_kv %d, %d-cell pages, %s, %d quer%s: %d blocks x %d KV heads, bpw %d, grid %d x %d x %d, "
            "%.1f MB of key sums; floor %.2f us nominal, %.2f us at the measured copy rate\n",
            c.n_kv, c.page_size, c.maxmean ? "maxmean" : "max", c.n_batch, c.n_batch == 1 ? "y" : "ies", n_blocks,
            c.n_head_kv, bpw, c.n_batch, n_chunks, c.n_head_kv, bytes_sums/1e6, floor_nominal, floor_copy);

        const auto launch_fused = [&](const bool score_only) {
            // score_only: counters that never reach the last count, so no CUDA block does the top-k
            BENCH_CHECK(cudaMemsetAsync(counters, score_only ? 0x40 : 0, n_rows*sizeof(unsigned int), stream));
            sparse_attn_score_select_cuda<4>(c.gqa, (const char *) q, (const half *) ksum, mask, keys, counters,
                dst_fused, c.D, c.n_batch, c.n_head_kv, c.n_kv, c.block_size, c.page_size, n_blocks, n_pages, 1, bpw,
                n_chunks, nbq1, nbq2, nbq3, s_m1, s_m3, c.top_k, c.n_sink, c.n_recent, keys_in_smem, s_d1, s_d2, s_d3,
                c.maxmean, stream);
            BENCH_CHECK(cudaGetLastError());
        };
#ifdef SPARSE_ATTN_SELECT_FLOOR
        // 0: both kernels, 1: the score kernel alone, 2: the top-k kernel alone (over the keys already there)
        const auto launch_floor = [&](const int part) {
            const int dev = ggml_cuda_get_device();
            if (part == 2) {
                const size_t smpbo = ggml_cuda_info().devices[dev].smpbo;
                CUDA_SET_SHARED_MEMORY_LIMIT(sparse_attn_select_floor_kernel, smpbo - SPARSE_ATTN_FLOOR_STATIC_TOPK);
                sparse_attn_select_floor_kernel<<<dim3(c.n_head_kv, c.n_batch, 1), SPARSE_ATTN_SELECT_NTHREADS,
                    size_t(n_blocks)*8, stream>>>(keys, dst_floor, n_blocks, c.top_k, c.n_sink, c.n_recent, s_d1, s_d2, s_d3);
            } else if (part == 1) {
                const size_t smpbo = ggml_cuda_info().devices[dev].smpbo;
                const size_t nbytes = sparse_attn_floor_stage_bytes<4, 4, half>(c.D);
                if (c.maxmean) {
                    CUDA_SET_SHARED_MEMORY_LIMIT((sparse_attn_score_floor_kernel<4, 4, true, half>), smpbo);
                    sparse_attn_score_floor_kernel<4, 4, true, half><<<dim3(c.n_batch, n_chunks, c.n_head_kv),
                        SPARSE_ATTN_SELECT_NTHREADS, nbytes, stream>>>((const char *) q, ksum, mask, keys, c.D, c.n_head_kv,
                        c.n_kv, c.block_size, c.page_size, n_blocks, n_pages, bpw, nbq1, nbq2, nbq3, s_m1, s_m3);
                } else {
                    CUDA_SET_SHARED_MEMORY_LIMIT((sparse_attn_score_floor_kernel<4, 4, false, half>), smpbo);
                    sparse_attn_score_floor_kernel<4, 4, false, half><<<dim3(c.n_batch, n_chunks, c.n_head_kv),
                        SPARSE_ATTN_SELECT_NTHREADS, nbytes, stream>>>((const char *) q, ksum, mask, keys, c.D, c.n_head_kv,
                        c.n_kv, c.block_size, c.page_size, n_blocks, n_pages, bpw, nbq1, nbq2, nbq3, s_m1, s_m3);
                }
            } else {
                const bool ok = sparse_attn_select_floor_cuda<4>(c.gqa, dev, (const char *) q, (const half *) ksum, mask,
                    keys, dst_floor, c.D, c.n_batch, c.n_head_kv, c.n_kv, c.block_size, c.page_size, n_blocks, n_pages,
                    1, bpw, n_chunks, nbq1, nbq2, nbq3, s_m1, s_m3, c.top_k, c.n_sink, c.n_recent, s_d1, s_d2, s_d3,
                    c.maxmean, stream);
                if (!ok) {
                    fprintf(stderr, "select-bench: the floor kernels do not fit this device's shared memory\n");
                    exit(1);
                }
            }
            BENCH_CHECK(cudaGetLastError());
        };
#endif // SPARSE_ATTN_SELECT_FLOOR

        const int reps = 40;
        const auto time_it = [&](const std::function<void()> & f, const bool cold) {
            std::vector<float> ts;
            for (int r = 0; r < reps + 3; ++r) {
                if (cold) {
                    BENCH_CHECK(cudaMemsetAsync(flush, r & 0xFF, n_flush, stream));
                }
                BENCH_CHECK(cudaEventRecord(e0, stream));
                f();
                BENCH_CHECK(cudaEventRecord(e1, stream));
                BENCH_CHECK(cudaEventSynchronize(e1));
                float ms;
                BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
                if (r >= 3) {
                    ts.push_back(ms*1000.0f);
                }
            }
            return bench_median(ts);
        };

        // block lists: both kernels on random, tied and flat sums; dst poisoned before each
        bool same = true;
        int n_sel0 = 0;
        const char * mode_name[3] = { "random", "tied", "flat" };
        (void) mode_name;
        for (const int mode : { 0, 1, 2 }) {
            fill_sums(hk, c, n_pages, mode, rng);
            BENCH_CHECK(cudaMemcpy(ksum, hk.data(), hk.size()*sizeof(half), cudaMemcpyHostToDevice));
            std::vector<int32_t> h_fused(size_t(n_blocks + 1)*n_rows), h_floor(h_fused.size());
            BENCH_CHECK(cudaMemset(dst, 0x7F, sizeof(int32_t)*h_fused.size()*2));
            launch_fused(false);
            BENCH_CHECK(cudaStreamSynchronize(stream));
            BENCH_CHECK(cudaMemcpy(h_fused.data(), dst_fused, h_fused.size()*sizeof(int32_t), cudaMemcpyDeviceToHost));
            for (size_t r = 0; r < size_t(n_rows); ++r) {
                const int32_t * l = &h_fused[r*(n_blocks + 1)];
                bool ok = l[0] > 0 && l[0] <= n_blocks;
                for (int i = 1; ok && i <= n_blocks; ++i) {
                    ok = i <= l[0] ? (l[i] >= 0 && l[i] < n_blocks && (i == 1 || l[i] > l[i - 1])) : l[i] == -1;
                }
                if (!ok) {
                    printf("  fused kernel: row %zu is not a valid list\n", r);
                    same = false;
                }
            }
            if (mode == 0) {
                n_sel0 = h_fused[0];
            }
#ifdef SPARSE_ATTN_SELECT_FLOOR
            launch_floor(0);
            BENCH_CHECK(cudaStreamSynchronize(stream));
            BENCH_CHECK(cudaMemcpy(h_floor.data(), dst_floor, h_floor.size()*sizeof(int32_t), cudaMemcpyDeviceToHost));
            if (h_floor != h_fused) {
                size_t r = 0;
                while (r < size_t(n_rows) && std::equal(h_floor.begin() + r*(n_blocks + 1), h_floor.begin() + (r + 1)*(n_blocks + 1),
                        h_fused.begin() + r*(n_blocks + 1))) {
                    ++r;
                }
                printf("  block lists DIFFER (%s sums): first row %zu (count %d vs %d)\n", mode_name[mode], r,
                    h_floor[r*(n_blocks + 1)], h_fused[r*(n_blocks + 1)]);
                same = false;
            }
#endif // SPARSE_ATTN_SELECT_FLOOR
        }
        all_ok = all_ok && same;
        // time on the random sums
        fill_sums(hk, c, n_pages, 0, rng);
        BENCH_CHECK(cudaMemcpy(ksum, hk.data(), hk.size()*sizeof(half), cudaMemcpyHostToDevice));
        printf("  selected per row: %d of %d blocks; block lists %s\n", n_sel0, n_blocks,
#ifdef SPARSE_ATTN_SELECT_FLOOR
            same ? "identical (floor = fused, random, tied and flat sums)" : "DIFFER"
#else
            same ? "valid" : "INVALID"
#endif // SPARSE_ATTN_SELECT_FLOOR
        );

        const auto share = [&](const float us) { return floor_nominal > 0 ? 100.0*floor_nominal/us : 100.0*floor_copy/us; };
        printf("  %-30s %9s %9s %13s\n", "kernel", "cold us", "warm us", "floor share");
        const float fc = time_it([&]() { launch_fused(false); }, true);
        const float fw = time_it([&]() { launch_fused(false); }, false);
        const float fs = time_it([&]() { launch_fused(true); }, true);
        printf("  %-30s %9.2f %9.2f %12.0f%%\n", "fused (memset + kernel)", fc, fw, share(fc));
        printf("  %-30s %9.2f %9s %12.0f%%\n", "fused, score phase only", fs, "", share(fs));
        char line[256];
        snprintf(line, sizeof(line), "%8d %5d %8s %3d  floor %6.2f us  fused %7.2f us (%3.0f%%)", c.n_kv, c.page_size,
            c.maxmean ? "maxmean" : "max", c.n_batch, floor_nominal > 0 ? floor_nominal : floor_copy, fc, share(fc));
        std::string sum_line(line);
#ifdef SPARSE_ATTN_SELECT_FLOOR
        const float lc = time_it([&]() { launch_floor(0); }, true);
        const float lw = time_it([&]() { launch_floor(0); }, false);
        const float ls = time_it([&]() { launch_floor(1); }, true);
        const float lt = time_it([&]() { launch_floor(2); }, false);
        printf("  %-30s %9.2f %9.2f %12.0f%%\n", "floor (score + top-k kernels)", lc, lw, share(lc));
        printf("  %-30s %9.2f %9s %12.0f%%\n", "floor, score kernel only", ls, "", share(ls));
        printf("  %-30s %9s %9.2f\n", "floor, top-k kernel only", "", lt);
        snprintf(line, sizeof(line), "  floor kernels %7.2f us (%3.0f%%)  %.2fx  %s", lc, share(lc), fc/lc,
            same ? "same lists" : "LISTS DIFFER");
        sum_line += line;
#endif // SPARSE_ATTN_SELECT_FLOOR
        summary.push_back(sum_line);

        cudaFree(q); cudaFree(ksum); cudaFree(mask); cudaFree(keys); cudaFree(dst);
    }
    cudaFree(flush);

    printf("\nsummary (cold L2, median of %d; floor = key-sum bytes / %s):\n", 40,
        bw_nominal > 0 ? "nominal bandwidth" : "measured copy rate");
    printf("    n_kv  page    score   B  floor             fused kernel\n");
    for (const std::string & s : summary) {
        printf("%s\n", s.c_str());
    }
    printf("\n%s\n", all_ok ? "ALL LISTS SAME" : "SOME LISTS DIFFER");
    return all_ok ? 0 : 1;
}

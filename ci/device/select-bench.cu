// Microbenchmark of the CUDA SPARSE_ATTN_SELECT kernels (the select's fixed cost per layer).
//
// Built on the device against the patched tree (ci/device/h200.sh stage `selbench`):
//   nvcc -std=c++17 -O3 -arch=sm_90 -use_fast_math -extended-lambda -I$SRC/ggml/include -I$SRC/ggml/src
//        -I$SRC/ggml/src/ggml-cuda ci/device/select-bench.cu -L$BIN -lggml-cuda -lggml-base -o select-bench
//   select-bench [n_kv ...]
// It includes the tree's sparse-attn.cu, times its fused score + top-k launch (the op as the model runs it), and
// times variants of the kernel defined here next to it: each variant's block lists must equal the tree's kernel's, or
// the run fails. The variant kernels record per CUDA block clock64()/globaltimer stamps, so that the score phase and
// the last CUDA block's top-k are timed apart. L2 is flushed before every timed launch ("cold", like inside the model:
// the weights and K/V pass through L2 between two selects) or not ("warm", like test-backend-ops perf).
#include "sparse-attn.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#define BENCH_CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

static __device__ __forceinline__ unsigned long long bench_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---------------------------------------------------------------------------------------------------------------------
// variant kernel: the fused score + top-k with
//   pipe:   the key sums of the warp's next chunk loaded while the current chunk is scored, the first chunk's loads
//           issued before the mask and q are read
//   tk_reg: the top-k with the keys in registers (no copy to shared memory), two barriers per radix pass
// stamps (instr): per CUDA block [globaltimer at entry, globaltimer after its keys, clock64 cycles of the score phase,
// globaltimer at the end]; per row of the last block, clock64 at the top-k's steps.
// ---------------------------------------------------------------------------------------------------------------------

template <int nd, int gqa, typename T_s>
struct bench_chunk {
    using shape = sparse_attn_chunk_shape<gqa>;
    using T2    = typename sparse_attn_ksum<T_s>::T2;
    static constexpr int npc = shape::npc;
    static constexpr int np  = nd/2;
    T2 kv[npc][np];

    __device__ __forceinline__ void load(const T_s * __restrict__ ks0, const int64_t page_stride, const int D,
                                         const uint32_t used, const int lane) {
#pragma unroll
        for (int pi = 0; pi < npc; ++pi) {
#pragma unroll
            for (int i = 0; i < np; ++i) {
                const int d = i*64 + 2*lane;
                kv[pi][i] = ((used >> pi) & 1) && d < D ? *(const T2 *) (ks0 + pi*page_stride + d) : sparse_attn_ksum<T_s>::zero2();
            }
        }
    }

    // as sparse_attn_score_chunk after its loads
    __device__ __forceinline__ uint32_t score(const int D, const float (&qr)[gqa][nd], const uint32_t used, const int lane) const {
        constexpr int ns = shape::ns;
        constexpr int nv = shape::nv;
        uint32_t empty = 0;
#pragma unroll
        for (int pi = 0; pi < npc; ++pi) {
            empty |= uint32_t(sparse_attn_isnan(sparse_attn_ksum<T_s>::to_float2(kv[pi][0]).x)) << pi;
        }
        empty = __shfl_sync(0xFFFFFFFF, empty, 0, 32);

        float p[nv];
#pragma unroll
        for (int k = 0; k < nv; ++k) {
            p[k] = 0.0f;
            if (k < ns) {
#pragma unroll
                for (int i = 0; i < np; ++i) {
                    if (i*64 + 2*lane < D) {
                        const float2 kf = sparse_attn_ksum<T_s>::to_float2(kv[k / gqa][i]);
                        p[k] = sparse_attn_fma(qr[k % gqa][2*i + 0], kf.x, p[k]);
                        p[k] = sparse_attn_fma(qr[k % gqa][2*i + 1], kf.y, p[k]);
                    }
                }
            }
        }
        const float sum = sparse_attn_warp_sum_transposed<nv, 16>(p, lane);

        const int k  = lane >> shape::shift;
        const int pi = k / gqa;
        if (k < ns && ((used >> pi) & 1) && !((empty >> pi) & 1)) {
            const float score = (__float_as_uint(sum) & 0x7F800000u) == 0x7F800000u ? INFINITY : sum;
            return sparse_attn_score_key(score);
        }
        return 0;
    }
};

// top-k of one row with the keys in registers: thread t owns ids [t*ipt, t*ipt + ipt), ipt <= kpt
template <int kpt>
static __device__ __forceinline__ void bench_select_row_regs(
        const uint32_t * keys_g, int32_t * out, const int n, const int64_t top_k, const int64_t n_sink,
        const int64_t n_recent, long long * tstamp) {
    constexpr int nthreads = SPARSE_ATTN_SELECT_NTHREADS;
    const int tid  = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;

    __shared__ int                buf_i[SPARSE_ATTN_SELECT_NWARPS];
    __shared__ unsigned long long buf_u64[SPARSE_ATTN_SELECT_NWARPS];
    __shared__ int                hist[2][256];
    __shared__ int                digit_s[2];
    __shared__ int                k_rem_s[2];

    for (int i = tid; i < 2*256; i += nthreads) {
        hist[i/256][i%256] = 0;
    }

    const int ipt = (n + nthreads - 1)/nthreads;
    const int i0  = min(n, tid*ipt);
    const int i1  = min(n, i0 + ipt);

    uint32_t kr[kpt];
#pragma unroll
    for (int e = 0; e < kpt; ++e) {
        kr[e] = i0 + e < i1 ? keys_g[i0 + e] : SPARSE_ATTN_KEY_INVISIBLE;
    }
    if (tstamp && tid == 0) { tstamp[1] = clock64(); }

    int n_vis_t = 0;
#pragma unroll
    for (int e = 0; e < kpt; ++e) {
        n_vis_t += kr[e] != SPARSE_ATTN_KEY_INVISIBLE;
    }
    int n_vis;
    int rank = sparse_attn_block_exclusive_scan<int>(n_vis_t, &n_vis, buf_i); // also orders the hist clearing
#pragma unroll
    for (int e = 0; e < kpt; ++e) {
        if (kr[e] != SPARSE_ATTN_KEY_INVISIBLE) {
            if (rank < n_sink || rank >= n_vis - n_recent) {
                kr[e] = SPARSE_ATTN_KEY_FORCED;
            }
            ++rank;
        }
    }
    if (tstamp && tid == 0) { tstamp[2] = clock64(); }

    const int n_sel = (int) min(int64_t(n_vis), top_k + min(int64_t(n_vis), n_sink + n_recent));

    uint32_t T    = SPARSE_ATTN_KEY_INVISIBLE;
    int      n_eq = 0;
    if (n_sel > 0 && n_sel < n_vis) {
        uint32_t prefix      = 0;
        uint32_t prefix_mask = 0;
        int      k_rem       = n_sel;
        int      pass        = 0;
        for (int shift = 24; shift >= 0; shift -= 8, ++pass) {
            int * h = hist[pass & 1];
#pragma unroll
            for (int e = 0; e < kpt; ++e) {
                const int digit = (kr[e] & prefix_mask) == prefix ? int((kr[e] >> shift) & 0xFF) : -1;
                const unsigned int same = __match_any_sync(0xFFFFFFFF, digit);
                if (digit >= 0 && lane == __ffs(same) - 1) {
                    atomicAdd(&h[digit], __popc(same));
                }
            }
            __syncthreads();
            if (warp == 0) {
                int cnt[8];
                int sum = 0;
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    cnt[e] = h[255 - (8*lane + e)];
                    h[255 - (8*lane + e)] = 0; // cleared for the pass after the next
                    sum += cnt[e];
                }
                int incl = sum;
#pragma unroll
                for (int off = 1; off < 32; off <<= 1) {
                    const int y = __shfl_up_sync(0xFFFFFFFF, incl, off, 32);
                    if (lane >= off) {
                        incl += y;
                    }
                }
                int above = incl - sum;
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    if (above < k_rem && k_rem <= above + cnt[e]) {
                        digit_s[pass & 1] = 255 - (8*lane + e);
                        k_rem_s[pass & 1] = k_rem - above;
                    }
                    above += cnt[e];
                }
            }
            __syncthreads();
            prefix      |= uint32_t(digit_s[pass & 1]) << shift;
            prefix_mask |= 0xFFu << shift;
            k_rem        = k_rem_s[pass & 1];
        }
        T    = prefix;
        n_eq = k_rem;
    } else if (n_sel == 0) {
        T = SPARSE_ATTN_KEY_FORCED;
    }
    if (tstamp && tid == 0) { tstamp[3] = clock64(); }

    unsigned long long cnt_t = 0;
#pragma unroll
    for (int e = 0; e < kpt; ++e) {
        if (i0 + e < i1) {
            cnt_t += kr[e] > T ? (1ull << 32) : (kr[e] == T ? 1ull : 0ull);
        }
    }
    unsigned long long cnt_total;
    const unsigned long long before = sparse_attn_block_exclusive_scan<unsigned long long>(cnt_t, &cnt_total, buf_u64);
    int n_gt_before = int(before >> 32);
    int n_eq_before = int(before & 0xFFFFFFFFull);
#pragma unroll
    for (int e = 0; e < kpt; ++e) {
        const int i = i0 + e;
        if (i < i1) {
            if (kr[e] > T) {
                out[1 + n_gt_before + min(n_eq_before, n_eq)] = i;
                ++n_gt_before;
            } else if (kr[e] == T) {
                if (n_eq_before < n_eq) {
                    out[1 + n_gt_before + n_eq_before] = i;
                }
                ++n_eq_before;
            }
        }
    }
    if (tid == 0) {
        out[0] = n_sel;
    }
    for (int i = n_sel + tid; i < n; i += nthreads) {
        out[1 + i] = -1;
    }
    if (tstamp && tid == 0) { tstamp[4] = clock64(); }
}

template <int nd, int gqa, typename T_s, bool pipe, int tk_kpt>
__launch_bounds__(SPARSE_ATTN_SELECT_NTHREADS, 1)
static __global__ void bench_score_select_kernel(
        const char * q_ptr, const T_s * ksum_ptr, const half * mask_ptr, uint32_t * keys_ptr,
        unsigned int * counters_ptr, int32_t * dst_ptr,
        const int D, const int n_head_kv, const int n_kv, const int block_size, const int page_size,
        const int n_blocks, const int pps, const int bpw,
        const int64_t nbq1, const int64_t nbq2, const int64_t nbq3, const int64_t s_m1, const int64_t s_m3,
        const int64_t top_k, const int64_t n_sink, const int64_t n_recent, const bool keys_in_smem,
        const int64_t s_d1, const int64_t s_d2, const int64_t s_d3,
        unsigned long long * stamps, long long * tail_stamps) {
    constexpr int nwarps = SPARSE_ATTN_SELECT_NWARPS;
    using chunk = bench_chunk<nd, gqa, T_s>;
    constexpr int npc = chunk::npc;

    ggml_cuda_pdl_sync();
    ggml_cuda_pdl_lc();
    const unsigned long long g0 = stamps ? bench_globaltimer() : 0;
    const long long c0 = clock64();

    const char  * GGML_CUDA_RESTRICT q    = q_ptr;
    const T_s   * GGML_CUDA_RESTRICT ksum = ksum_ptr;
    const half  * GGML_CUDA_RESTRICT mask = mask_ptr;

    const int tid     = threadIdx.x;
    const int lane    = tid % 32;
    const int warp    = tid / 32;
    const int j       = blockIdx.x;
    const int n_batch = gridDim.x;
    const int h       = blockIdx.z % n_head_kv;
    const int s       = blockIdx.z / n_head_kv;
    const int64_t row = (int64_t(s)*n_batch + j)*n_head_kv + h;

    uint32_t * keys = keys_ptr + row*n_blocks;

    const int bw0 = min(n_blocks, (int(blockIdx.y)*nwarps + warp)*bpw);
    const int bw1 = min(n_blocks, bw0 + bpw);

    const int ppb     = block_size/page_size;
    const int cpb     = (ppb + npc - 1)/npc; // chunks per block
    const int n_pages = (n_kv + page_size - 1)/page_size;
    const int n_ci    = (bw1 - bw0)*cpb;     // chunks of this warp

    const int64_t page_stride = int64_t(n_head_kv)*D;
    const T_s   * ks_sh = ksum + (int64_t(s)*pps*n_head_kv + h)*D;

    // chunk ci of the warp: its first page and the bit mask of its pages
    const auto chunk_pages = [&](const int ci, int & p0) -> uint32_t {
        const int b = bw0 + ci/cpb;
        p0 = b*ppb + (ci % cpb)*npc;
        const int np = min(npc, min(n_pages, (b + 1)*ppb) - p0);
        return np > 0 ? (1u << np) - 1 : 0u;
    };

    chunk next;
    if constexpr (pipe) {
        if (n_ci > 0) {
            int p0;
            const uint32_t used = chunk_pages(0, p0);
            next.load(ks_sh + int64_t(p0)*page_stride, page_stride, D, used, lane); // before the mask: speculative
        }
    }

    uint32_t vis = 0;
    {
        const half * mask_j = mask + s*s_m3 + j*s_m1;
        const int cb0 = bw0*block_size;
        const int cb1 = min(bw1*block_size, n_kv);
#pragma unroll 8
        for (int c = cb0 + lane; c < cb1; c += 32) {
            if (__half2float(mask_j[c]) > -INFINITY) {
                vis |= 1u << ((c - cb0)/block_size);
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            vis |= __shfl_xor_sync(0xFFFFFFFF, vis, off, 32);
        }
    }

    float qr[gqa][nd];
#pragma unroll
    for (int g = 0; g < gqa; ++g) {
        const float * qg = (const float *) (q + s*nbq3 + (int64_t(h)*gqa + g)*nbq2 + j*nbq1);
#pragma unroll
        for (int i = 0; i < nd; ++i) {
            const int d = (i/2)*64 + 2*lane + i%2;
            qr[g][i] = d < D ? qg[d] : 0.0f;
        }
    }

    uint32_t key_max = 0;
    for (int ci = 0; ci < n_ci; ++ci) {
        const int bi = ci/cpb;
        int p0;
        const uint32_t used = chunk_pages(ci, p0);
        chunk cur;
        if constexpr (pipe) {
            cur = next;
            if (ci + 1 < n_ci) {
                int p0n;
                const uint32_t used_n = chunk_pages(ci + 1, p0n);
                const bool     vis_n  = (vis >> ((ci + 1)/cpb)) & 1;
                next.load(ks_sh + int64_t(p0n)*page_stride, page_stride, D, vis_n ? used_n : 0u, lane);
            }
        } else {
            cur.load(ks_sh + int64_t(p0)*page_stride, page_stride, D, ((vis >> bi) & 1) ? used : 0u, lane);
        }
        if ((vis >> bi) & 1) {
            key_max = max(key_max, cur.score(D, qr, used, lane));
        }
        if (ci % cpb == cpb - 1) {
            const uint32_t key = sparse_attn_visible_block_key(key_max);
            if (lane == 0) {
                keys[bw0 + bi] = (vis >> bi) & 1 ? key : SPARSE_ATTN_KEY_INVISIBLE;
            }
            key_max = 0;
        }
    }

    __shared__ bool last_s;
    __threadfence();
    __syncthreads();
    const long long c1 = clock64();
    if (tid == 0) {
        const unsigned int n_done = atomicAdd(counters_ptr + row, 1u);
        last_s = n_done == gridDim.y - 1;
        __threadfence();
    }
    __syncthreads();
    const int64_t cta = (int64_t(blockIdx.z)*gridDim.y + blockIdx.y)*gridDim.x + blockIdx.x;
    if (stamps && tid == 0) {
        stamps[4*cta + 0] = g0;
        stamps[4*cta + 1] = bench_globaltimer();
        stamps[4*cta + 2] = (unsigned long long) (c1 - c0);
        stamps[4*cta + 3] = 0;
    }
    if (!last_s) {
        return;
    }
    long long * ts = tail_stamps ? tail_stamps + 8*row : nullptr;
    if (ts && tid == 0) { ts[0] = clock64(); }

    int32_t * out = dst_ptr + s*s_d3 + j*s_d2 + h*s_d1;
    if (tk_kpt > 0 && (n_blocks + SPARSE_ATTN_SELECT_NTHREADS - 1)/SPARSE_ATTN_SELECT_NTHREADS <= tk_kpt) {
        bench_select_row_regs<(tk_kpt > 0 ? tk_kpt : 1)>(keys, out, n_blocks, top_k, n_sink, n_recent, ts);
    } else {
        extern __shared__ uint32_t keys_s[];
        sparse_attn_select_row(keys, keys_s, out, n_blocks, top_k, n_sink, n_recent, keys_in_smem);
        if (ts && tid == 0) { ts[4] = clock64(); }
    }
    if (stamps && tid == 0) {
        stamps[4*cta + 3] = bench_globaltimer();
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------------------------------

struct bench_shape {
    int D = 128, gqa = 4, n_head_kv = 8, n_kv = 131072, block_size = 128, page_size = 16;
    int top_k = 32, n_sink = 1, n_recent = 2; // blocks
};

struct bench_bufs {
    float * q = nullptr; half * ksum = nullptr; half * mask = nullptr; uint32_t * keys = nullptr; int32_t * dst = nullptr;
    unsigned long long * stamps = nullptr; long long * tail = nullptr; char * flush = nullptr;
    size_t n_flush = size_t(512) << 20;
};

static float bench_median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0f : v[v.size()/2];
}

int main(int argc, char ** argv) {
    std::vector<int> depths;
    for (int i = 1; i < argc; ++i) {
        depths.push_back(atoi(argv[i]));
    }
    if (depths.empty()) {
        depths = {32768, 131072, 524288};
    }

    cudaDeviceProp prop;
    BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
    const int nsm = prop.multiProcessorCount;
    printf("device %s, %d SMs\n", prop.name, nsm);

    cudaStream_t stream;
    BENCH_CHECK(cudaStreamCreate(&stream));
    cudaEvent_t e0, e1;
    BENCH_CHECK(cudaEventCreate(&e0));
    BENCH_CHECK(cudaEventCreate(&e1));

    bool all_ok = true;
    for (const int n_kv : depths) {
        bench_shape sh;
        sh.n_kv = n_kv;
        const int n_head   = sh.gqa*sh.n_head_kv;
        const int n_pages  = (n_kv + sh.page_size - 1)/sh.page_size;
        const int n_blocks = (n_kv + sh.block_size - 1)/sh.block_size;
        const int n_rows   = sh.n_head_kv;

        bench_bufs b;
        BENCH_CHECK(cudaMalloc(&b.q, sizeof(float)*sh.D*n_head));
        BENCH_CHECK(cudaMalloc(&b.ksum, sizeof(half)*size_t(sh.D)*sh.n_head_kv*n_pages));
        BENCH_CHECK(cudaMalloc(&b.mask, sizeof(half)*n_kv));
        BENCH_CHECK(cudaMalloc(&b.keys, sizeof(uint32_t)*(size_t(n_blocks)*n_rows + n_rows)));
        BENCH_CHECK(cudaMalloc(&b.dst, sizeof(int32_t)*size_t(n_blocks + 1)*n_rows*2));
        BENCH_CHECK(cudaMalloc(&b.flush, b.n_flush));

        // random q and key sums (sums of 16 keys of unit variance: sd 4; some blocks "hot" for a realistic spread)
        std::mt19937 rng(1234);
        std::normal_distribution<float> nd01(0.0f, 1.0f);
        std::vector<float> hq(size_t(sh.D)*n_head);
        for (float & x : hq) { x = nd01(rng); }
        std::vector<half> hk(size_t(sh.D)*sh.n_head_kv*n_pages);
        for (size_t i = 0; i < hk.size(); ++i) {
            const size_t pg = i/(size_t(sh.D)*sh.n_head_kv);
            const float bias = (pg*2654435761u) % 97 == 0 ? 2.0f : 0.0f;
            hk[i] = __float2half(4.0f*nd01(rng) + bias);
        }
        std::vector<half> hm(n_kv, __float2half(0.0f));
        BENCH_CHECK(cudaMemcpy(b.q, hq.data(), hq.size()*sizeof(float), cudaMemcpyHostToDevice));
        BENCH_CHECK(cudaMemcpy(b.ksum, hk.data(), hk.size()*sizeof(half), cudaMemcpyHostToDevice));
        BENCH_CHECK(cudaMemcpy(b.mask, hm.data(), hm.size()*sizeof(half), cudaMemcpyHostToDevice));

        const int64_t nbq1 = sizeof(float)*sh.D, nbq2 = nbq1, nbq3 = nbq2*n_head;
        const int64_t s_m1 = n_kv, s_m3 = n_kv;
        const int64_t s_d1 = n_blocks + 1, s_d2 = s_d1*sh.n_head_kv, s_d3 = s_d2;
        const int64_t n_w  = int64_t(2)*nsm*SPARSE_ATTN_SELECT_NWARPS;
        const int bpw      = (int) std::min<int64_t>(SPARSE_ATTN_SELECT_BPW_MAX, std::max<int64_t>(1, (int64_t(n_blocks)*n_rows + n_w - 1)/n_w));
        const int n_chunks = (n_blocks + SPARSE_ATTN_SELECT_NWARPS*bpw - 1)/(SPARSE_ATTN_SELECT_NWARPS*bpw);
        const bool keys_in_smem = size_t(n_blocks)*sizeof(uint32_t) <= 32*1024;
        const size_t nshared    = keys_in_smem ? size_t(n_blocks)*sizeof(uint32_t) : 0;
        unsigned int * counters = b.keys + size_t(n_blocks)*n_rows;
        const dim3 grid(1, n_chunks, sh.n_head_kv);
        const dim3 block(SPARSE_ATTN_SELECT_NTHREADS, 1, 1);
        const int n_cta = n_chunks*sh.n_head_kv;
        BENCH_CHECK(cudaMalloc(&b.stamps, sizeof(unsigned long long)*4*n_cta));
        BENCH_CHECK(cudaMalloc(&b.tail, sizeof(long long)*8*n_rows));
        printf("\nn_kv %d: %d blocks, %d pages per KV head, bpw %d, grid %d x %d, %.1f MB of key sums\n",
            n_kv, n_blocks, n_pages, bpw, n_chunks, sh.n_head_kv, hk.size()*2/1e6);

        int32_t * dst_ref = b.dst;
        int32_t * dst_var = b.dst + size_t(n_blocks + 1)*n_rows;

        const auto launch_ref = [&]() {
            BENCH_CHECK(cudaMemsetAsync(counters, 0, n_rows*sizeof(unsigned int), stream));
            sparse_attn_score_select_cuda<4>(sh.gqa, (const char *) b.q, (const half *) b.ksum, b.mask, b.keys, counters,
                dst_ref, sh.D, 1, sh.n_head_kv, n_kv, sh.block_size, sh.page_size, n_blocks, n_pages, 1, bpw, n_chunks,
                nbq1, nbq2, nbq3, s_m1, s_m3, sh.top_k, sh.n_sink, sh.n_recent, keys_in_smem, s_d1, s_d2, s_d3, stream);
        };

        using kernel_t = decltype(&bench_score_select_kernel<4, 4, half, false, 0>);
        struct variant { const char * name; kernel_t k; int kpt; };
        std::vector<variant> variants = {
            {"copy (instrumented)",     bench_score_select_kernel<4, 4, half, false, 0>,  0},
            {"pipe",                    bench_score_select_kernel<4, 4, half, true,  0>,  0},
            {"pipe + regs top-k",       bench_score_select_kernel<4, 4, half, true,  4>,  4},
            {"pipe + regs top-k (16)",  bench_score_select_kernel<4, 4, half, true,  16>, 16},
        };
        const auto launch_var = [&](const variant & v, bool instr, bool score_only) {
            // score_only: counters that never reach the last count, so no CUDA block does the top-k
            BENCH_CHECK(cudaMemsetAsync(counters, score_only ? 0x40 : 0, n_rows*sizeof(unsigned int), stream));
            v.k<<<grid, block, nshared, stream>>>((const char *) b.q, (const half *) b.ksum, b.mask,
                b.keys, counters, dst_var, sh.D, sh.n_head_kv, n_kv, sh.block_size, sh.page_size, n_blocks, n_pages, bpw,
                nbq1, nbq2, nbq3, s_m1, s_m3, sh.top_k, sh.n_sink, sh.n_recent, keys_in_smem, s_d1, s_d2, s_d3,
                instr ? b.stamps : nullptr, instr ? b.tail : nullptr);
            BENCH_CHECK(cudaGetLastError());
        };

        const int reps = 40;
        const auto time_it = [&](const std::function<void()> & f, bool cold) {
            std::vector<float> ts;
            for (int r = 0; r < reps + 3; ++r) {
                if (cold) {
                    BENCH_CHECK(cudaMemsetAsync(b.flush, r & 0xFF, b.n_flush, stream));
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

        // an empty launch pair (memset + kernel of the same grid) as the floor of the event timing
        const auto launch_empty = [&]() {
            BENCH_CHECK(cudaMemsetAsync(counters, 0, n_rows*sizeof(unsigned int), stream));
            sparse_attn_select_kernel<<<1, 32, 0, stream>>>(nullptr, dst_var, 0, 0, 0, 0, true, false, 0, 0, 0);
        };

        launch_ref();
        BENCH_CHECK(cudaStreamSynchronize(stream));
        std::vector<int32_t> h_ref(size_t(n_blocks + 1)*n_rows), h_var(h_ref.size());
        BENCH_CHECK(cudaMemcpy(h_ref.data(), dst_ref, h_ref.size()*sizeof(int32_t), cudaMemcpyDeviceToHost));
        printf("  selected per row: %d (of %d)\n", h_ref[0], n_blocks);

        printf("  %-26s %9s %9s %9s %9s\n", "kernel", "cold us", "warm us", "score-only", "");
        printf("  %-26s %9.2f %9.2f\n", "floor (memset + empty)", time_it(launch_empty, true), time_it(launch_empty, false));
        printf("  %-26s %9.2f %9.2f\n", "tree's fused kernel", time_it(launch_ref, true), time_it(launch_ref, false));
        for (const variant & v : variants) {
            BENCH_CHECK(cudaMemset(dst_var, 0xFF, h_var.size()*sizeof(int32_t)));
            launch_var(v, false, false);
            BENCH_CHECK(cudaStreamSynchronize(stream));
            BENCH_CHECK(cudaMemcpy(h_var.data(), dst_var, h_var.size()*sizeof(int32_t), cudaMemcpyDeviceToHost));
            const bool ok = h_var == h_ref;
            all_ok = all_ok && ok;
            const float tc = time_it([&]() { launch_var(v, false, false); }, true);
            const float tw = time_it([&]() { launch_var(v, false, false); }, false);
            const float ts = time_it([&]() { launch_var(v, false, true); }, true);
            printf("  %-26s %9.2f %9.2f %9.2f  %s\n", v.name, tc, tw, ts, ok ? "same lists" : "LISTS DIFFER");

            // stamps of one cold launch
            BENCH_CHECK(cudaMemsetAsync(b.flush, 1, b.n_flush, stream));
            BENCH_CHECK(cudaMemsetAsync(b.tail, 0, sizeof(long long)*8*n_rows, stream));
            launch_var(v, true, false);
            BENCH_CHECK(cudaStreamSynchronize(stream));
            std::vector<unsigned long long> st(size_t(4)*n_cta);
            std::vector<long long> tt(size_t(8)*n_rows);
            BENCH_CHECK(cudaMemcpy(st.data(), b.stamps, st.size()*sizeof(st[0]), cudaMemcpyDeviceToHost));
            BENCH_CHECK(cudaMemcpy(tt.data(), b.tail, tt.size()*sizeof(tt[0]), cudaMemcpyDeviceToHost));
            unsigned long long g_start = ~0ull, g_score_last = 0, g_end = 0;
            std::vector<double> cyc;
            for (int c = 0; c < n_cta; ++c) {
                g_start      = std::min(g_start, st[4*c + 0]);
                g_score_last = std::max(g_score_last, st[4*c + 1]);
                g_end        = std::max(g_end, st[4*c + 3]);
                cyc.push_back(double(st[4*c + 2]));
            }
            std::sort(cyc.begin(), cyc.end());
            printf("      stamps: first entry -> last keys %.2f us, -> last end %.2f us; score phase per CUDA block "
                   "median %.0f max %.0f cycles\n", (g_score_last - g_start)/1e3, (g_end - g_start)/1e3,
                   cyc[cyc.size()/2], cyc.back());
            double d[4] = {0, 0, 0, 0};
            for (int r = 0; r < n_rows; ++r) {
                const long long * t = &tt[8*r];
                if (v.kpt > 0) {
                    d[0] += double(t[1] - t[0]); d[1] += double(t[2] - t[1]); d[2] += double(t[3] - t[2]);
                    d[3] += double(t[4] - t[3]);
                } else {
                    d[0] += double(t[4] - t[0]);
                }
            }
            if (v.kpt > 0) {
                printf("      top-k cycles per row: load %.0f, rank %.0f, radix %.0f, write %.0f\n",
                    d[0]/n_rows, d[1]/n_rows, d[2]/n_rows, d[3]/n_rows);
            } else {
                printf("      top-k cycles per row: %.0f\n", d[0]/n_rows);
            }
        }

        cudaFree(b.q); cudaFree(b.ksum); cudaFree(b.mask); cudaFree(b.keys); cudaFree(b.dst); cudaFree(b.flush);
        cudaFree(b.stamps); cudaFree(b.tail);
    }
    printf("\n%s\n", all_ok ? "ALL LISTS SAME" : "SOME LISTS DIFFER");
    return all_ok ? 0 : 1;
}

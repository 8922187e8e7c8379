// opencoti-harness: deterministic prefill + single-token decode, dumping every decode step's logits.
//
// Used by `opencoti-patch verify-identical` (pristine vs patched builds must give the same bytes with
// the feature off) and reusable for evals. Harness options:
//
//   --prompt-tokens N      random prompt of N tokens from --seed (default 2048; BOS first if the vocab adds it)
//   -f/--file F            use the text of F as the prompt instead (common's flag; tokenized with specials)
//   --decode N             N single-token decode steps after the prefill (default 64), greedy (argmax)
//   --generate N           like --decode N, and print the generated text to stdout
//   --teacher-forced F     feed these token ids (whitespace separated, or int32 LE if F ends in .bin)
//                          at the decode steps instead of the argmax
//   --dump-logits F        write float32 logits, (1 + N) rows x n_vocab: row 0 = last prompt token,
//                          row i = after decode step i
//   --json F               write a JSON summary (tokens, node counts, state size, timings)
//   --count-nodes          count the graph nodes computed per llama_decode (eval callback; no effect
//                          on the results)
//   --warmup N             the first N decode steps are not timed (decode_tps in --json: the others; also
//                          the median host time per timed step inside llama_decode, which returns once the
//                          work is queued on an asynchronous backend, and inside the logits read that waits
//                          for it: ms_step_decode_call / ms_step_logits_wait)
//   --synthetic-depth D    decode at a depth of D cells without a D-token prefill (a speed benchmark at
//                          512K-1M, where a real prefill takes many minutes): the prompt (--prompt-tokens,
//                          a few thousand) is prefilled for real, its sequence state is tiled to D cells at
//                          positions 0..D-1 (the prompt's K/V rows repeated) and loaded back through
//                          llama_state_seq_set_data, then decoding starts at position D. The attention reads
//                          the same bytes per token as after a real prefill of D tokens; the logits are
//                          meaningless. One KV cache only (not iSWA / hybrid models): anything else in the
//                          state is refused.
//   --backend-dir D        where to load the ggml backends from (default: the build it was linked to)
//
// Every other argument goes to llama.cpp's common argument parser when the harness is built with
// libllama-common (OPENCOTI_WITH_COMMON: -m, -c, -ctk, -ctv, -fa, -t, -s/--seed, -ngl, and whatever flags
// the tree adds, e.g. --sparse-attn on a patched build). Without it (a build of only ggml + libllama, the
// cheap one verify-identical uses) a small parser takes: -m -c -b -ub -t -ctk -ctv -fa -ngl -s/--seed
// -f/--file -v.

#ifdef OPENCOTI_WITH_COMMON
#include "arg.h"
#include "common.h"
#endif
#include "ggml-backend.h"
#include "llama.h"
#include "opencoti-harness.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef OPENCOTI_BACKEND_DIR
#define OPENCOTI_BACKEND_DIR ""
#endif

namespace {

struct harness_args {
    int n_prompt = 2048;
    int n_decode = 64;
    bool generate = false;
    bool count_nodes = false;
    int n_warmup = 0;
    int64_t synthetic_depth = 0;
    std::string dump_logits;
    std::string teacher_forced;
    std::string json_out;
    std::string backend_dir = OPENCOTI_BACKEND_DIR;
};

struct node_counter {
    int64_t n = 0;
};

bool count_nodes_cb(struct ggml_tensor * /*t*/, bool ask, void * user_data) {
    if (ask) {
        static_cast<node_counter *>(user_data)->n++;
    }
    return false;  // never observe: the split is computed in one piece, exactly as without a callback
}

ggml_log_level g_last_level = GGML_LOG_LEVEL_INFO;
bool g_verbose = false;

void log_cb(ggml_log_level level, const char * text, void * /*user_data*/) {
    if (level == GGML_LOG_LEVEL_CONT) {
        level = g_last_level;
    }
    g_last_level = level;
    if (level == GGML_LOG_LEVEL_DEBUG && !g_verbose) {
        return;
    }
    fputs(text, stderr);
}

uint64_t splitmix64(uint64_t & state) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

std::vector<llama_token> random_prompt(const llama_vocab * vocab, int n, uint64_t seed) {
    std::vector<llama_token> out;
    if (n <= 0) {
        return out;
    }
    if (llama_vocab_get_add_bos(vocab)) {
        out.push_back(llama_vocab_bos(vocab));
    }
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    const int skip = LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_UNKNOWN | LLAMA_TOKEN_ATTR_UNUSED;
    uint64_t state = seed;
    while ((int) out.size() < n) {
        const llama_token t = (llama_token) (splitmix64(state) % (uint64_t) n_vocab);
        if (llama_vocab_get_attr(vocab, t) & skip) {
            continue;
        }
        out.push_back(t);
    }
    return out;
}

bool read_tokens(const std::string & path, std::vector<llama_token> & out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    if (path.size() >= 4 && path.compare(path.size() - 4, 4, ".bin") == 0) {
        int32_t v;
        while (f.read(reinterpret_cast<char *>(&v), sizeof(v))) {
            out.push_back(v);
        }
    } else {
        long long v;
        while (f >> v) {
            out.push_back((llama_token) v);
        }
    }
    return true;
}

std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text) {
    int32_t n = -llama_tokenize(vocab, text.data(), (int32_t) text.size(), nullptr, 0, true, true);
    std::vector<llama_token> out((size_t) std::max(n, 0));
    n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), true, true);
    out.resize((size_t) std::max(n, 0));
    return out;
}

std::string token_to_piece(const llama_vocab * vocab, llama_token tok) {
    char buf[256];
    const int32_t n = llama_token_to_piece(vocab, tok, buf, sizeof(buf), 0, true);
    return n > 0 ? std::string(buf, (size_t) n) : std::string();
}

// the median of xs (the upper one of an even count); 0 when empty
double median(std::vector<double> xs) {
    if (xs.empty()) {
        return 0.0;
    }
    std::nth_element(xs.begin(), xs.begin() + xs.size()/2, xs.end());
    return xs[xs.size()/2];
}

bool need_value(int i, int argc, const char * name) {
    if (i + 1 >= argc) {
        fprintf(stderr, "error: %s needs a value\n", name);
        return false;
    }
    return true;
}

// What both parsers produce.
struct run_config {
    std::string model;
    std::string prompt;  // text prompt (-f), empty = random tokens
    uint32_t seed = LLAMA_DEFAULT_SEED;
    llama_model_params mparams = llama_model_default_params();
    llama_context_params cparams = llama_context_default_params();
    bool n_ctx_given = false;
};

#ifndef OPENCOTI_WITH_COMMON
bool parse_type(const std::string & name, ggml_type & out) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name((ggml_type) t);
        if (tn != nullptr && name == tn) {
            out = (ggml_type) t;
            return true;
        }
    }
    return false;
}

bool read_text(const std::string & path, std::string & out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    std::stringstream ss;
    ss << f.rdbuf();
    out = ss.str();
    if (!out.empty() && out.back() == '\n') {
        out.pop_back();
    }
    return true;
}

bool parse_minimal(const std::vector<char *> & args, run_config & rc) {
    rc.cparams.n_ctx = 0;
    for (size_t i = 1; i + 1 < args.size(); ++i) {  // args ends with nullptr
        const std::string a = args[i];
        const bool has_value = i + 2 < args.size();
        auto value = [&]() -> std::string { return args[++i]; };
        if (!has_value && a != "-v" && a != "--verbose") {
            fprintf(stderr, "error: %s needs a value (or is unknown)\n", a.c_str());
            return false;
        }
        if (a == "-m" || a == "--model") {
            rc.model = value();
        } else if (a == "-c" || a == "--ctx-size") {
            rc.cparams.n_ctx = (uint32_t) std::stoul(value());
            rc.n_ctx_given = rc.cparams.n_ctx != 0;
        } else if (a == "-b" || a == "--batch-size") {
            rc.cparams.n_batch = (uint32_t) std::stoul(value());
        } else if (a == "-ub" || a == "--ubatch-size") {
            rc.cparams.n_ubatch = (uint32_t) std::stoul(value());
        } else if (a == "-t" || a == "--threads") {
            rc.cparams.n_threads = rc.cparams.n_threads_batch = std::stoi(value());
        } else if (a == "-ngl" || a == "--n-gpu-layers" || a == "--gpu-layers") {
            rc.mparams.n_gpu_layers = std::stoi(value());
        } else if (a == "-s" || a == "--seed") {
            rc.seed = (uint32_t) std::stoul(value());
        } else if (a == "-f" || a == "--file") {
            const std::string path = value();
            if (!read_text(path, rc.prompt)) {
                fprintf(stderr, "error: cannot read %s\n", path.c_str());
                return false;
            }
        } else if (a == "-ctk" || a == "--cache-type-k" || a == "-ctv" || a == "--cache-type-v") {
            const std::string v = value();
            ggml_type t;
            if (!parse_type(v, t)) {
                fprintf(stderr, "error: unknown cache type %s\n", v.c_str());
                return false;
            }
            (a == "-ctk" || a == "--cache-type-k" ? rc.cparams.type_k : rc.cparams.type_v) = t;
        } else if (a == "-fa" || a == "--flash-attn") {
            const std::string v = value();
            rc.cparams.flash_attn_type = v == "on" || v == "1" ? LLAMA_FLASH_ATTN_TYPE_ENABLED :
                                         v == "off" || v == "0" ? LLAMA_FLASH_ATTN_TYPE_DISABLED :
                                                                  LLAMA_FLASH_ATTN_TYPE_AUTO;
        } else if (a == "-v" || a == "--verbose") {
            g_verbose = true;
        } else {
            fprintf(stderr, "error: unknown argument %s (this harness was built without libllama-common)\n",
                    a.c_str());
            return false;
        }
    }
    if (rc.model.empty()) {
        fprintf(stderr, "error: -m MODEL is required\n");
        return false;
    }
    return true;
}
#endif

// A sequence state (llama_state_seq_get_data of one sequence, one KV cache, one stream) of C cells tiled to
// n cells: positions 0..n-1, cell i holding the K/V rows (and the cell extension, if any) of cell i % C.
// The layout (llama-context.cpp state_seq_get_data + llama-kv-cache.cpp state_write): magic u32, seq_id
// i32, n_stream u32, cell_count u32, per cell {pos i32, n_seq_id u32 (= 1), [ext], seq_id i32}, v_trans
// u32, n_layer u32, per layer {k_type i32, k_row u64, C rows}, then per layer V: {v_type i32, v_row u64,
// C rows} or, transposed, {v_type i32, v_el u32, n_embd u32, n_embd x C elements}. The cell extension
// (M-RoPE, token ids) is present when that gives an exact parse. Returns an empty vector (and says why)
// when the state does not parse as that layout.
struct state_reader {
    const uint8_t * p;
    size_t n;
    size_t off = 0;
    bool ok = true;
    template <typename T> T get() {
        T v{};
        if (off + sizeof(T) > n) {
            ok = false;
            return v;
        }
        memcpy(&v, p + off, sizeof(T));
        off += sizeof(T);
        return v;
    }
    const uint8_t * take(size_t k) {
        if (off + k > n) {
            ok = false;
            return nullptr;
        }
        const uint8_t * r = p + off;
        off += k;
        return r;
    }
};

struct state_layout {
    size_t meta_cell = 0;        // bytes per cell of meta
    size_t meta_off = 0;         // offset of the first cell's meta
    uint32_t cells = 0;
    uint32_t v_trans = 0;
    std::vector<size_t> k_off, k_row;               // per layer: offset of the rows, bytes per row
    std::vector<size_t> v_off, v_row, v_el, v_embd;  // per layer (v_row: not transposed)
    size_t head_k = 4 + 8, head_v = 4 + 8;          // bytes of a layer's header
    size_t layers_head = 8;  // v_trans, n_layer (+ n_rot_k, n_rot_v where the cache writes its rotation)
};

// rot: the layout of newer upstreams, which write n_rot_k and n_rot_v after n_layer
bool parse_state(const std::vector<uint8_t> & st, size_t ext_size, bool rot, state_layout & L) {
    state_reader r{ st.data(), st.size() };
    r.get<uint32_t>();  // magic
    r.get<int32_t>();   // seq_id
    if (r.get<uint32_t>() != 1) {
        return false;   // n_stream
    }
    L.cells = r.get<uint32_t>();
    L.meta_off = r.off;
    L.meta_cell = 4 + 4 + ext_size + 4;
    for (uint32_t i = 0; i < L.cells && r.ok; ++i) {
        r.get<int32_t>();
        if (r.get<uint32_t>() != 1) {
            return false;
        }
        r.take(ext_size);
        r.get<int32_t>();
    }
    L.v_trans = r.get<uint32_t>();
    const uint32_t n_layer = r.get<uint32_t>();
    if (!r.ok || L.v_trans > 1 || n_layer == 0 || n_layer > 4096) {
        return false;
    }
    if (rot) {
        r.get<uint32_t>();  // n_rot_k
        r.get<uint32_t>();  // n_rot_v
        L.layers_head = 16;
    }
    for (uint32_t il = 0; il < n_layer && r.ok; ++il) {
        r.get<int32_t>();
        const uint64_t row = r.get<uint64_t>();
        L.k_row.push_back(row);
        L.k_off.push_back(r.off);
        r.take(row * L.cells);
    }
    for (uint32_t il = 0; il < n_layer && r.ok; ++il) {
        r.get<int32_t>();
        if (!L.v_trans) {
            const uint64_t row = r.get<uint64_t>();
            L.v_row.push_back(row);
            L.v_off.push_back(r.off);
            r.take(row * L.cells);
        } else {
            const uint32_t el = r.get<uint32_t>();
            const uint32_t embd = r.get<uint32_t>();
            L.v_el.push_back(el);
            L.v_embd.push_back(embd);
            L.v_off.push_back(r.off);
            r.take((size_t) el * embd * L.cells);
        }
    }
    L.head_v = L.v_trans ? 4 + 4 + 4 : 4 + 8;
    return r.ok && r.off == st.size();
}

struct tiled_state {
    std::unique_ptr<uint8_t[]> data;
    size_t size = 0;
};

tiled_state tile_state(const std::vector<uint8_t> & st, uint32_t n) {
    state_layout L;
    bool parsed = false;
    for (const size_t ext : { (size_t) 0, (size_t) 12 }) {
        for (const bool rot : { false, true }) {
            L = state_layout{};
            if (parse_state(st, ext, rot, L)) {
                parsed = true;
                break;
            }
        }
        if (parsed) {
            break;
        }
    }
    if (!parsed || L.cells == 0) {
        fprintf(stderr, "error: --synthetic-depth: the sequence state does not parse as one KV cache with one "
                        "stream (an iSWA or hybrid model, or another state layout)\n");
        return {};
    }
    const size_t C = L.cells;
    const size_t n_layer = L.k_row.size();

    // where each part goes: the meta, then per layer K (header + n rows), then per layer V
    struct part {
        size_t src_head;  // offset of the layer's header in st
        size_t head;      // its size
        size_t src_rows;  // offset of its C cells
        size_t cell;      // bytes per cell of one run (a row, or one element of a transposed V row)
        size_t runs;      // runs of C cells (1, or n_embd for a transposed V)
        size_t dst;       // offset of the header in the output
    };
    std::vector<part> parts;
    size_t size = L.meta_off + (size_t) n * L.meta_cell + L.layers_head;
    for (size_t il = 0; il < n_layer; ++il) {
        parts.push_back({ L.k_off[il] - L.head_k, L.head_k, L.k_off[il], L.k_row[il], 1, size });
        size += L.head_k + L.k_row[il] * n;
    }
    for (size_t il = 0; il < n_layer; ++il) {
        const size_t cell = L.v_trans ? L.v_el[il] : L.v_row[il];
        const size_t runs = L.v_trans ? L.v_embd[il] : 1;
        parts.push_back({ L.v_off[il] - L.head_v, L.head_v, L.v_off[il], cell, runs, size });
        size += L.head_v + cell * runs * n;
    }

    tiled_state out;
    out.data.reset(new (std::nothrow) uint8_t[size]);  // not zeroed: every byte is written below
    if (!out.data) {
        fprintf(stderr, "error: --synthetic-depth: cannot allocate %.1f GiB for the state\n", size / 1073741824.0);
        return {};
    }
    out.size = size;
    uint8_t * o = out.data.get();
    const uint8_t * src = st.data();

    memcpy(o, src, L.meta_off - 4);  // magic, seq_id, n_stream
    memcpy(o + L.meta_off - 4, &n, 4);
    for (uint32_t i = 0; i < n; ++i) {  // positions 0..n-1, the rest of the meta of cell i % C
        uint8_t * w = o + L.meta_off + (size_t) i * L.meta_cell;
        memcpy(w, src + L.meta_off + (i % C) * L.meta_cell, L.meta_cell);
        const int32_t pos = (int32_t) i;
        memcpy(w, &pos, 4);
    }
    memcpy(o + L.meta_off + (size_t) n * L.meta_cell, src + L.meta_off + C * L.meta_cell, L.layers_head);

    // the layers in parallel (tens of GiB at 512K-1M cells)
    auto fill = [&](size_t first, size_t step) {
        for (size_t k = first; k < parts.size(); k += step) {
            const part & pt = parts[k];
            memcpy(o + pt.dst, src + pt.src_head, pt.head);
            uint8_t * w = o + pt.dst + pt.head;
            for (size_t r = 0; r < pt.runs; ++r) {
                const uint8_t * rows = src + pt.src_rows + r * C * pt.cell;
                for (size_t done = 0; done < n; ) {
                    const size_t k_cells = std::min<size_t>(C, n - done);
                    memcpy(w, rows, k_cells * pt.cell);
                    w += k_cells * pt.cell;
                    done += k_cells;
                }
            }
        }
    };
    const size_t n_threads = std::max<size_t>(1, std::min<size_t>(16, std::thread::hardware_concurrency()));
    std::vector<std::thread> workers;
    for (size_t t = 0; t < n_threads; ++t) {
        workers.emplace_back(fill, t, n_threads);
    }
    for (auto & t : workers) {
        t.join();
    }
    return out;
}

void print_usage(int /*argc*/, char ** argv) {
    fprintf(stderr,
            "usage: %s -m MODEL [-c N] [-ctk T -ctv T] [-fa on|off] [--prompt-tokens N | -f FILE] [-s SEED]\n"
            "          [--decode N | --generate N] [--teacher-forced FILE] [--dump-logits FILE] [--json FILE]\n"
            "          [--count-nodes] [--warmup N] [--synthetic-depth D] [--backend-dir DIR]\n"
            "          [any llama.cpp common flag]\n",
            argv[0]);
}

std::string json_escape(const std::string & s) {
    std::string out;
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if ((unsigned char) c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
        } else {
            out += c;
        }
    }
    return out;
}

}  // namespace

int main(int argc, char ** argv) {
    harness_args h;
    std::vector<char *> rest = { argv[0] };
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--prompt-tokens" || a == "--decode" || a == "--generate" || a == "--warmup" ||
            a == "--synthetic-depth") {
            if (!need_value(i, argc, argv[i])) {
                return 2;
            }
            const long long v = std::atoll(argv[++i]);
            if (v < 0 || v > INT32_MAX) {
                fprintf(stderr, "error: %s %lld is out of range\n", a.c_str(), v);
                return 2;
            }
            if (a == "--prompt-tokens") {
                h.n_prompt = (int) v;
            } else if (a == "--warmup") {
                h.n_warmup = (int) v;
            } else if (a == "--synthetic-depth") {
                h.synthetic_depth = v;
            } else {
                h.n_decode = (int) v;
                h.generate = (a == "--generate");
            }
        } else if (a == "--dump-logits" || a == "--teacher-forced" || a == "--json" || a == "--backend-dir") {
            if (!need_value(i, argc, argv[i])) {
                return 2;
            }
            std::string & dst = a == "--dump-logits"    ? h.dump_logits :
                                a == "--teacher-forced" ? h.teacher_forced :
                                a == "--json"           ? h.json_out :
                                                          h.backend_dir;
            dst = argv[++i];
        } else if (a == "--count-nodes") {
            h.count_nodes = true;
        } else {
            if (a == "-v" || a == "--verbose" || a == "--log-verbose") {
                g_verbose = true;
            }
            rest.push_back(argv[i]);
        }
    }
    rest.push_back(nullptr);

    llama_log_set(log_cb, nullptr);
    // GGML_BACKEND_DL builds: the backends live next to the build's libraries, not next to this binary
    // (common's parser then looks next to the executable and in the cwd, where there are none).
    if (!h.backend_dir.empty()) {
        ggml_backend_load_all_from_path(h.backend_dir.c_str());
    }

    run_config rc;
#ifdef OPENCOTI_WITH_COMMON
    common_params params;
    if (!common_params_parse((int) rest.size() - 1, rest.data(), params, LLAMA_EXAMPLE_COMMON, print_usage)) {
        return 2;
    }
    rc.model = params.model.path;
    rc.prompt = params.prompt;
    rc.seed = params.sampling.seed;
    rc.n_ctx_given = params.n_ctx != 0;
    rc.mparams = common_model_params_to_llama(params);
    rc.cparams = common_context_params_to_llama(params);
    llama_backend_init();
    llama_numa_init(params.numa);
#else
    if (!parse_minimal(rest, rc)) {
        print_usage(argc, argv);
        return 2;
    }
    llama_backend_init();
#endif
    const uint64_t seed = rc.seed == LLAMA_DEFAULT_SEED ? 42 : rc.seed;
    const bool text_prompt = !rc.prompt.empty();
    if (h.synthetic_depth > 0 && (text_prompt || h.synthetic_depth < h.n_prompt || !h.teacher_forced.empty())) {
        fprintf(stderr, "error: --synthetic-depth needs a random prompt (--prompt-tokens, not -f or "
                        "--teacher-forced) of at most that many tokens\n");
        return 2;
    }
    if (h.n_warmup >= h.n_decode && h.n_warmup > 0) {
        fprintf(stderr, "error: --warmup %d leaves no timed decode step of --decode %d\n", h.n_warmup, h.n_decode);
        return 2;
    }
    if (!rc.n_ctx_given) {
        const int64_t n_before = h.synthetic_depth > 0 ? h.synthetic_depth :
                                 text_prompt ? (int64_t) rc.prompt.size() + 8 : h.n_prompt;
        const int64_t need = n_before + h.n_decode + 1;
        rc.cparams.n_ctx = (uint32_t) ((need + 255) / 256 * 256);
    }

    node_counter counter;
    if (h.count_nodes) {
        rc.cparams.cb_eval = count_nodes_cb;
        rc.cparams.cb_eval_user_data = &counter;
    }

    llama_model * model = llama_model_load_from_file(rc.model.c_str(), rc.mparams);
    if (model == nullptr) {
        fprintf(stderr, "error: failed to load %s\n", rc.model.c_str());
        return 1;
    }
    llama_context * ctx = llama_init_from_model(model, rc.cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "error: failed to create the context\n");
        llama_model_free(model);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);

    std::vector<llama_token> prompt =
        text_prompt ? tokenize(vocab, rc.prompt) : random_prompt(vocab, h.n_prompt, seed);
    if (prompt.empty()) {
        fprintf(stderr, "error: empty prompt\n");
        return 1;
    }
    std::vector<llama_token> teacher;
    if (!h.teacher_forced.empty()) {
        if (!read_tokens(h.teacher_forced, teacher)) {
            fprintf(stderr, "error: cannot read %s\n", h.teacher_forced.c_str());
            return 1;
        }
        if ((int) teacher.size() < h.n_decode) {
            fprintf(stderr, "error: %s has %zu tokens, --decode needs %d\n", h.teacher_forced.c_str(),
                    teacher.size(), h.n_decode);
            return 1;
        }
    }
    const int64_t n_ctx = llama_n_ctx(ctx);
    if (std::max<int64_t>((int64_t) prompt.size(), h.synthetic_depth) + h.n_decode > n_ctx) {
        fprintf(stderr, "error: prompt (%zu) + decode (%d) exceeds the context (%" PRId64 ")\n", prompt.size(),
                h.n_decode, n_ctx);
        return 1;
    }

    FILE * dump = nullptr;
    if (!h.dump_logits.empty()) {
        dump = fopen(h.dump_logits.c_str(), "wb");
        if (dump == nullptr) {
            fprintf(stderr, "error: cannot write %s\n", h.dump_logits.c_str());
            return 1;
        }
    }
    auto write_row = [&](const float * row) {
        if (dump != nullptr) {
            fwrite(row, sizeof(float), (size_t) n_vocab, dump);
        }
    };

    // prefill, in n_batch chunks, logits for the last prompt token only
    const int n_batch = (int) llama_n_batch(ctx);
    llama_batch batch = llama_batch_init(std::max(n_batch, 1), 0, 1);
    const auto t0 = std::chrono::steady_clock::now();
    counter.n = 0;
    for (size_t i = 0; i < prompt.size(); i += (size_t) n_batch) {
        batch.n_tokens = 0;
        const size_t end = std::min(prompt.size(), i + (size_t) n_batch);
        for (size_t j = i; j < end; ++j) {
            opencoti_batch_add(batch, prompt[j], (llama_pos) j, j + 1 == prompt.size());
        }
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "error: llama_decode failed in the prefill at token %zu\n", i);
            return 1;
        }
    }
    const int64_t nodes_prefill = counter.n;
    auto t1 = std::chrono::steady_clock::now();
    const size_t state_size = llama_state_get_size(ctx);

    llama_pos pos = (llama_pos) prompt.size();
    double ms_state_load = 0.0;
    llama_pos pos_max_loaded = -1;  // --synthetic-depth: the sequence's last position after the load
    if (h.synthetic_depth > 0) {
        std::vector<uint8_t> st(llama_state_seq_get_size(ctx, 0));
        if (st.empty() || llama_state_seq_get_data(ctx, st.data(), st.size(), 0) != st.size()) {
            fprintf(stderr, "error: --synthetic-depth: cannot read the sequence state\n");
            return 1;
        }
        tiled_state tiled = tile_state(st, (uint32_t) h.synthetic_depth);
        if (!tiled.data) {
            return 1;
        }
        st.clear();
        st.shrink_to_fit();
        const auto ts = std::chrono::steady_clock::now();
        llama_memory_clear(llama_get_memory(ctx), true);
        if (llama_state_seq_set_data(ctx, tiled.data.get(), tiled.size, 0) != tiled.size) {
            fprintf(stderr, "error: --synthetic-depth: llama_state_seq_set_data refused the tiled state "
                            "(%.1f GiB)\n", tiled.size / 1073741824.0);
            return 1;
        }
        ms_state_load = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - ts).count();
        pos_max_loaded = llama_memory_seq_pos_max(llama_get_memory(ctx), 0);
        fprintf(stderr, "opencoti-harness: synthetic depth %" PRId64 " cells (%zu-token prompt tiled, %.1f GiB "
                        "of state, loaded in %.0f ms)\n", h.synthetic_depth, prompt.size(),
                tiled.size / 1073741824.0, ms_state_load);
        pos = (llama_pos) h.synthetic_depth;
        t1 = std::chrono::steady_clock::now();
    }

    std::vector<float> last(llama_get_logits_ith(ctx, -1), llama_get_logits_ith(ctx, -1) + n_vocab);
    write_row(last.data());

    std::vector<llama_token> fed;
    std::vector<int64_t> nodes_decode;
    std::string text;
    auto t_timed = t1;  // the end of the warmup steps
    std::vector<double> ms_call;  // per timed step: host time inside llama_decode
    std::vector<double> ms_wait;  // per timed step: host time inside llama_get_logits_ith (waits for the backend)
    for (int i = 0; i < h.n_decode; ++i) {
        if (i == h.n_warmup) {
            t_timed = std::chrono::steady_clock::now();
        }
        const llama_token tok = teacher.empty() ? opencoti_argmax(last.data(), n_vocab) : teacher[(size_t) i];
        fed.push_back(tok);
        if (h.generate) {
            const std::string piece = token_to_piece(vocab, tok);
            text += piece;
            fputs(piece.c_str(), stdout);
            fflush(stdout);
        }
        batch.n_tokens = 0;
        opencoti_batch_add(batch, tok, pos++, true);
        counter.n = 0;
        const auto t_call = std::chrono::steady_clock::now();
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "error: llama_decode failed at decode step %d\n", i);
            return 1;
        }
        const auto t_queued = std::chrono::steady_clock::now();
        nodes_decode.push_back(counter.n);
        const float * row = llama_get_logits_ith(ctx, -1);
        if (i >= h.n_warmup) {
            ms_call.push_back(std::chrono::duration<double, std::milli>(t_queued - t_call).count());
            ms_wait.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_queued).count());
        }
        last.assign(row, row + n_vocab);
        write_row(last.data());
    }
    const auto t2 = std::chrono::steady_clock::now();
    if (h.generate) {
        fputs("\n", stdout);
    }
    if (dump != nullptr) {
        fclose(dump);
    }
    const int32_t n_reused = llama_perf_context(ctx).n_reused;
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);

    const double ms_prefill = std::chrono::duration<double, std::milli>(t1 - t0).count();
    const double ms_decode = std::chrono::duration<double, std::milli>(t2 - t1).count();
    const double ms_timed = std::chrono::duration<double, std::milli>(t2 - t_timed).count();
    const int n_timed = h.n_decode - std::min(h.n_warmup, h.n_decode);
    const double decode_tps = n_timed > 0 && ms_timed > 0.0 ? 1e3 * n_timed / ms_timed : 0.0;
    int64_t nodes_min = 0;
    int64_t nodes_max = 0;
    if (!nodes_decode.empty()) {
        nodes_min = *std::min_element(nodes_decode.begin(), nodes_decode.end());
        nodes_max = *std::max_element(nodes_decode.begin(), nodes_decode.end());
    }
    fprintf(stderr,
            "opencoti-harness: prompt %zu tokens, %d decode steps, %d logits rows x %d, state %zu bytes, "
            "prefill %.1f ms, decode %.1f ms\n",
            prompt.size(), h.n_decode, h.n_decode + 1, n_vocab, state_size, ms_prefill, ms_decode);
    if (h.count_nodes) {
        fprintf(stderr, "opencoti-harness: nodes computed: prefill %" PRId64 ", decode min %" PRId64
                        " max %" PRId64 "\n", nodes_prefill, nodes_min, nodes_max);
    }

    if (!h.json_out.empty()) {
        std::ostringstream js;
        js << "{\n  \"n_vocab\": " << n_vocab << ",\n  \"n_ctx\": " << n_ctx << ",\n  \"n_prompt\": " << prompt.size()
           << ",\n  \"n_decode\": " << h.n_decode << ",\n  \"rows\": " << h.n_decode + 1
           << ",\n  \"seed\": " << seed << ",\n  \"teacher_forced\": " << (teacher.empty() ? "false" : "true")
           << ",\n  \"state_size\": " << state_size << ",\n  \"ms_prefill\": " << ms_prefill
           << ",\n  \"ms_decode\": " << ms_decode << ",\n  \"warmup\": " << h.n_warmup
           << ",\n  \"decode_tps\": " << decode_tps << ",\n  \"synthetic_depth\": " << h.synthetic_depth
           << ",\n  \"ms_state_load\": " << ms_state_load << ",\n  \"pos_max_loaded\": " << pos_max_loaded
           << ",\n  \"graphs_reused\": " << n_reused
           << ",\n  \"ms_step_decode_call\": " << median(ms_call) << ",\n  \"ms_step_logits_wait\": " << median(ms_wait)
           << ",\n  \"decode_tokens\": [";
        for (size_t i = 0; i < fed.size(); ++i) {
            js << (i ? ", " : "") << fed[i];
        }
        js << "],\n  \"nodes\": ";
        if (h.count_nodes) {
            js << "{\"prefill\": " << nodes_prefill << ", \"decode_min\": " << nodes_min
               << ", \"decode_max\": " << nodes_max << "}";
        } else {
            js << "null";
        }
        js << ",\n  \"text\": \"" << json_escape(text) << "\"\n}\n";
        std::ofstream out(h.json_out);
        out << js.str();
        if (!out) {
            fprintf(stderr, "error: cannot write %s\n", h.json_out.c_str());
            return 1;
        }
    }
    return 0;
}

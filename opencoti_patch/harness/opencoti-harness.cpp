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

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
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

void batch_add(llama_batch & batch, llama_token tok, llama_pos pos, bool logits) {
    const int i = batch.n_tokens++;
    batch.token[i] = tok;
    batch.pos[i] = pos;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = logits;
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

llama_token argmax(const float * logits, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; ++i) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
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

void print_usage(int /*argc*/, char ** argv) {
    fprintf(stderr,
            "usage: %s -m MODEL [-c N] [-ctk T -ctv T] [-fa on|off] [--prompt-tokens N | -f FILE] [-s SEED]\n"
            "          [--decode N | --generate N] [--teacher-forced FILE] [--dump-logits FILE] [--json FILE]\n"
            "          [--count-nodes] [--backend-dir DIR] [any llama.cpp common flag]\n",
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
        if (a == "--prompt-tokens" || a == "--decode" || a == "--generate") {
            if (!need_value(i, argc, argv[i])) {
                return 2;
            }
            const int v = std::atoi(argv[++i]);
            if (a == "--prompt-tokens") {
                h.n_prompt = v;
            } else {
                h.n_decode = v;
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
    if (!rc.n_ctx_given) {
        const int64_t need = (text_prompt ? (int64_t) rc.prompt.size() + 8 : h.n_prompt) + h.n_decode + 1;
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
    if ((int64_t) prompt.size() + h.n_decode > n_ctx) {
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
            batch_add(batch, prompt[j], (llama_pos) j, j + 1 == prompt.size());
        }
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "error: llama_decode failed in the prefill at token %zu\n", i);
            return 1;
        }
    }
    const int64_t nodes_prefill = counter.n;
    const auto t1 = std::chrono::steady_clock::now();
    const size_t state_size = llama_state_get_size(ctx);

    std::vector<float> last(llama_get_logits_ith(ctx, -1), llama_get_logits_ith(ctx, -1) + n_vocab);
    write_row(last.data());

    std::vector<llama_token> fed;
    std::vector<int64_t> nodes_decode;
    std::string text;
    llama_pos pos = (llama_pos) prompt.size();
    for (int i = 0; i < h.n_decode; ++i) {
        const llama_token tok = teacher.empty() ? argmax(last.data(), n_vocab) : teacher[(size_t) i];
        fed.push_back(tok);
        if (h.generate) {
            const std::string piece = token_to_piece(vocab, tok);
            text += piece;
            fputs(piece.c_str(), stdout);
            fflush(stdout);
        }
        batch.n_tokens = 0;
        batch_add(batch, tok, pos++, true);
        counter.n = 0;
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "error: llama_decode failed at decode step %d\n", i);
            return 1;
        }
        nodes_decode.push_back(counter.n);
        const float * row = llama_get_logits_ith(ctx, -1);
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
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);

    const double ms_prefill = std::chrono::duration<double, std::milli>(t1 - t0).count();
    const double ms_decode = std::chrono::duration<double, std::milli>(t2 - t1).count();
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
           << ",\n  \"ms_decode\": " << ms_decode << ",\n  \"graphs_reused\": " << llama_perf_context(ctx).n_reused
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

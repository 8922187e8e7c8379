// opencoti-harness-batch (used by `opencoti-patch lab eval` and `lab selector`): many requests in one process, one model load.
// A separate executable of the harness project (needs libllama-common: its argument parser takes every flag
// the tree knows, e.g. --sparse-attn on a patched build).
//
//   opencoti-harness-batch --batch IN.jsonl [--batch-out OUT.jsonl] [--backend-dir D] -m MODEL -c N -fa on -t 2 ...
//
// IN: one JSON object per line:
//   "id"         string, copied to the output
//   "text"       the text, tokenized with the vocab's specials (BOS) and without parsing special tokens
//   "n_prefill"  tokens prefilled in n_batch chunks (prompt processing, never a decode ubatch); default: all
//                tokens but the last
//   "n_forced"   then this many single-token decode steps over the text's next tokens (teacher forcing);
//                default: the rest of the text
//   "n_generate" then this many greedy (argmax) tokens; the first comes from the last forced step's logits,
//                each further one costs a single-token decode step
//   "dump"       optional path: float32 logits, one row of n_vocab per single-token decode step, in order
//   "tokenize_only" optional bool: only report n_tokens
//   "return_targets" optional bool: also report "targets", the text's token after each forced step
//   "reuse_prefix" optional int A > 0: keep the cached prefill of the previous request up to the longest common
//                prefix of the two token lists, rounded down to a multiple of A (use a multiple of the sparse
//                block size so no block is left half-written), drop the rest (llama_memory_seq_rm) and prefill
//                only the new tail. A sliding-window model needs --swa-full (else the window before the kept
//                prefix is gone; the harness checks the cache and falls back to a full prefill).
// OUT: one JSON object per request, flushed as soon as it is done: id, n_tokens, n_prefill, n_forced,
//   generated (token ids), text (the generated text), decode_steps, select_nodes / fill_nodes (graph nodes of
//   the sparse ops computed during the decode steps / the prefill, counted with an eval callback that never
//   asks for data, so the graph is computed exactly as without it), ms_prefill, ms_decode.
// The memory is cleared between requests (unless reuse_prefix keeps a common prefix).
// Reported "reused": the number of prefill tokens taken from the cache.
//
// --variants FILE (a tree with the sparse attention patches): one JSON object per line, each a decode variant with
//   "name" and the sparse settings to override ("sparse_attn" bool, "topk", "block_size", "recent", "sink",
//   "dense_layers", "min_ctx", "score": "max", "mass" or "maxmean", "page_size"). Each variant gets its own context
//   (the command line's settings + its overrides). A
//   request is prefilled once, in the main context (the command line's settings: run it dense), then its sequence
//   state is copied into each variant's context (llama_state_seq_set_data: a sparse context rebuilds its key bounds
//   exactly from the copied keys) and the decode steps run there, one output line per variant with "variant": name.
//   Prompt processing is dense in every variant, so the variants differ only in how they decode, as with
//   --sparse-attn on: N variants cost one prefill instead of N.

#include "arg.h"
#include "common.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "opencoti-harness.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#ifndef OPENCOTI_BACKEND_DIR
#define OPENCOTI_BACKEND_DIR ""
#endif

namespace {

struct batch_counter {
    bool    decode = false;
    int64_t select_decode = 0;
    int64_t select_prefill = 0;
    int64_t fill = 0;
};

bool batch_count_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    if (ask) {
        auto * c = static_cast<batch_counter *>(user_data);
        const char * name = ggml_op_name(t->op);
        if (std::strcmp(name, "SPARSE_ATTN_SELECT") == 0) {
            (c->decode ? c->select_decode : c->select_prefill)++;
        } else if (std::strcmp(name, "SPARSE_ATTN_FILL") == 0) {
            c->fill++;
        }
    }
    return false;  // never observe a tensor: each split is computed in one piece, as without a callback
}

bool g_batch_verbose = false;
std::string g_variants_path;

struct batch_variant {
    std::string     name;
    llama_context * ctx = nullptr;
};

// the next non-empty line of ``in``, parsed into ``out``: false at the end, or after an error message about the bad
// ``what`` (then ``bad`` is set)
bool batch_next_json(std::istream & in, nlohmann::json & out, const std::string & what, bool & bad) {
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty()) {
            continue;
        }
        try {
            out = nlohmann::json::parse(line);
            return true;
        } catch (const std::exception & e) {
            fprintf(stderr, "error: bad %s: %s\n", what.c_str(), e.what());
            bad = true;
            return false;
        }
    }
    return false;
}

// the contexts of --variants (see the file comment); false after an error message
bool batch_load_variants(const std::string & path, llama_model * model, const common_params & params,
                         std::vector<batch_variant> & out) {
    std::ifstream f(path);
    if (!f) {
        fprintf(stderr, "error: cannot read %s\n", path.c_str());
        return false;
    }
    nlohmann::json v;
    bool bad = false;
    while (batch_next_json(f, v, "variant line in " + path, bad)) {
        llama_context_params cp = common_context_params_to_llama(params);
#ifdef OPENCOTI_HAVE_SPARSE_ATTN
        cp.sparse_attn              = v.value("sparse_attn", cp.sparse_attn);
        cp.sparse_attn_topk         = v.value("topk", cp.sparse_attn_topk);
        cp.sparse_attn_block_size   = v.value("block_size", cp.sparse_attn_block_size);
        cp.sparse_attn_recent       = v.value("recent", cp.sparse_attn_recent);
        cp.sparse_attn_sink         = v.value("sink", cp.sparse_attn_sink);
        cp.sparse_attn_dense_layers = v.value("dense_layers", cp.sparse_attn_dense_layers);
        cp.sparse_attn_min_ctx      = v.value("min_ctx", cp.sparse_attn_min_ctx);
        if (v.contains("score")) {
#ifdef OPENCOTI_HAVE_SPARSE_ATTN_SCORE
            const std::string score = v.value("score", std::string("max"));
            if (score != "max" && score != "mass" && score != "maxmean") {
                fprintf(stderr, "error: %s: unknown score '%s' (max, mass or maxmean)\n", path.c_str(), score.c_str());
                return false;
            }
            cp.sparse_attn_score = score == "mass"    ? LLAMA_SPARSE_ATTN_SCORE_MASS :
                                   score == "maxmean" ? LLAMA_SPARSE_ATTN_SCORE_MAXMEAN : LLAMA_SPARSE_ATTN_SCORE_MAX;
#else
            fprintf(stderr, "error: %s: \"score\" needs a tree with --sparse-attn-score\n", path.c_str());
            return false;
#endif
        }
        if (v.contains("page_size")) {
#ifdef OPENCOTI_HAVE_SPARSE_ATTN_PAGE_SIZE
            cp.sparse_attn_page_size = v.value("page_size", cp.sparse_attn_page_size);
#else
            fprintf(stderr, "error: %s: \"page_size\" needs a tree with --sparse-attn-page-size\n", path.c_str());
            return false;
#endif
        }
#else
        if (v.contains("sparse_attn") || v.contains("topk")) {
            fprintf(stderr, "error: %s: sparse settings need a llama.cpp tree with the sparse attention patches\n", path.c_str());
            return false;
        }
#endif
        batch_variant bv;
        bv.name = v.value("name", std::string("variant") + std::to_string(out.size()));
        bv.ctx  = llama_init_from_model(model, cp);
        if (bv.ctx == nullptr) {
            fprintf(stderr, "error: variant %s: cannot create the context\n", bv.name.c_str());
            return false;
        }
        out.push_back(bv);
    }
    if (bad) {
        return false;
    }
    if (out.empty()) {
        fprintf(stderr, "error: %s holds no variant\n", path.c_str());
        return false;
    }
    return true;
}

void batch_log_cb(ggml_log_level level, const char * text, void * /*user_data*/) {
    static ggml_log_level last = GGML_LOG_LEVEL_INFO;
    if (level == GGML_LOG_LEVEL_CONT) {
        level = last;
    }
    last = level;
    // quiet by default: warnings, errors, the sparse-attention setup lines and where the weights are (the
    // "offloaded N/M layers to GPU" and "<buffer> model buffer size" lines: the caller checks an asked offload)
    if ((level == GGML_LOG_LEVEL_DEBUG || level == GGML_LOG_LEVEL_INFO) && !g_batch_verbose &&
        std::strstr(text, "llama_sparse_attn") == nullptr && std::strstr(text, "offloaded") == nullptr &&
        std::strstr(text, "model buffer size") == nullptr) {
        return;
    }
    fputs(text, stderr);
}

void batch_usage(int /*argc*/, char ** argv) {
    fprintf(stderr, "usage: %s --batch IN.jsonl [--batch-out OUT.jsonl] [--backend-dir D] [-v] [llama.cpp common flags]\n",
            argv[0]);
}

int batch_run(common_params & params, const std::string & in_path, const std::string & out_path);

// how many leading prefill tokens of `tokens` can stay in the cache (the rest of the cache is removed); clears
// the cache and returns 0 when nothing can be kept
int64_t batch_keep_prefix(llama_memory_t mem, const std::vector<llama_token> & cached,
                          const std::vector<llama_token> & tokens, int64_t n_prefill, int64_t align) {
    int64_t keep = 0;
    if (align > 0) {
        const int64_t n = std::min<int64_t>((int64_t) cached.size(), n_prefill);
        while (keep < n && cached[(size_t) keep] == tokens[(size_t) keep]) {
            ++keep;
        }
        keep = keep / align * align;
    }
    if (keep > 0 && llama_memory_seq_rm(mem, 0, (llama_pos) keep, -1) && llama_memory_seq_pos_min(mem, 0) == 0 &&
        llama_memory_seq_pos_max(mem, 0) == (llama_pos) keep - 1) {
        return keep;
    }
    llama_memory_clear(mem, true);
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    std::string in_path;
    std::string out_path;
    std::string backend_dir = OPENCOTI_BACKEND_DIR;
    std::vector<char *> rest = { argv[0] };
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--batch" || a == "--batch-out" || a == "--backend-dir" || a == "--variants") {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: %s needs a value\n", argv[i]);
                return 2;
            }
            (a == "--batch" ? in_path : a == "--batch-out" ? out_path : a == "--variants" ? g_variants_path : backend_dir) = argv[++i];
            continue;
        }
        if (a == "-v" || a == "--verbose" || a == "--log-verbose") {
            g_batch_verbose = true;
        }
        rest.push_back(argv[i]);
    }
    rest.push_back(nullptr);
    if (in_path.empty()) {
        batch_usage(argc, argv);
        return 2;
    }
    llama_log_set(batch_log_cb, nullptr);
    if (!backend_dir.empty()) {
        ggml_backend_load_all_from_path(backend_dir.c_str());
    }
    common_params params;
    if (!common_params_parse((int) rest.size() - 1, rest.data(), params, LLAMA_EXAMPLE_COMMON, batch_usage)) {
        return 2;
    }
    return batch_run(params, in_path, out_path);
}

namespace {

struct batch_steps {
    const std::vector<llama_token> & tokens;
    int64_t n_prefill, n_forced, n_generate, n_steps;
    int32_t n_vocab;
};

// the single-token decode steps of a request after its prefill (teacher-forced, then greedy), into res
int batch_decode(llama_context * ctx, llama_batch & batch, const batch_steps & st, batch_counter & counter, FILE * dump,
                 const std::string & id, nlohmann::json & res) {
    const int64_t sel0 = counter.select_decode;
    counter.decode = true;
    std::vector<llama_token> generated;
    std::string gen_text;
    llama_pos pos = (llama_pos) st.n_prefill;
    const auto t1 = std::chrono::steady_clock::now();
    for (int64_t s = 0; s < st.n_steps; ++s) {
        const llama_token tok = s < st.n_forced ? st.tokens[(size_t) pos] : generated.back();
        batch.n_tokens = 0;
        opencoti_batch_add(batch, tok, pos++, true);
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "error: request %s: llama_decode failed at decode step %lld\n", id.c_str(), (long long) s);
            return 1;
        }
        const float * row = llama_get_logits_ith(ctx, -1);
        if (dump != nullptr) {
            fwrite(row, sizeof(float), (size_t) st.n_vocab, dump);
        }
        if (s + 1 >= st.n_forced && (int64_t) generated.size() < st.n_generate) {
            generated.push_back(opencoti_argmax(row, st.n_vocab));
            gen_text += common_token_to_piece(ctx, generated.back());
        }
    }
    const auto t2 = std::chrono::steady_clock::now();
    counter.decode = false;
    res["generated"] = generated;
    res["text"] = gen_text;
    res["select_nodes"] = counter.select_decode - sel0;
    res["ms_decode"] = std::chrono::duration<double, std::milli>(t2 - t1).count();
    return 0;
}

int batch_run(common_params & params, const std::string & in_path, const std::string & out_path) {
    std::ifstream in(in_path);
    if (!in) {
        fprintf(stderr, "error: cannot read %s\n", in_path.c_str());
        return 1;
    }
    FILE * out = out_path.empty() || out_path == "-" ? stdout : fopen(out_path.c_str(), "w");
    if (out == nullptr) {
        fprintf(stderr, "error: cannot write %s\n", out_path.c_str());
        return 1;
    }

    batch_counter counter;
    params.cb_eval = batch_count_cb;
    params.cb_eval_user_data = &counter;
    params.warmup = false;

    llama_backend_init();
    llama_numa_init(params.numa);
    auto init = common_init_from_params(params);
    llama_model * model = init ? init->model() : nullptr;
    llama_context * ctx = init ? init->context() : nullptr;
    if (model == nullptr || ctx == nullptr) {
        fprintf(stderr, "error: failed to load the model or create the context\n");
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    const int64_t n_ctx = llama_n_ctx(ctx);
    const int n_batch = std::max(1, (int) llama_n_batch(ctx));
    llama_batch batch = llama_batch_init(n_batch, 0, 1);

    std::vector<batch_variant> variants;
    if (!g_variants_path.empty() && !batch_load_variants(g_variants_path, model, params, variants)) {
        return 1;
    }

    std::vector<llama_token> cached;  // the prefill tokens of the previous request (positions 0..)
    llama_memory_t mem = llama_get_memory(ctx);

    int rc = 0;
    nlohmann::json req;
    bool bad = false;
    while (rc == 0 && batch_next_json(in, req, "request line", bad)) {
        const std::string id = req.value("id", std::string());
        const std::string text = req.value("text", std::string());
        const std::vector<llama_token> tokens = common_tokenize(ctx, text, true, false);
        const int64_t n_tok = (int64_t) tokens.size();
        nlohmann::json res = { { "id", id }, { "n_tokens", n_tok } };
        if (req.value("tokenize_only", false)) {
            fprintf(out, "%s\n", res.dump().c_str());
            fflush(out);
            continue;
        }
        const int64_t n_prefill = req.value("n_prefill", n_tok - 1);
        const int64_t n_forced = req.value("n_forced", n_tok - n_prefill);
        const int64_t n_generate = req.value("n_generate", (int64_t) 0);
        const int64_t n_steps = n_forced + std::max<int64_t>(0, n_generate - 1);
        if (n_prefill < 1 || n_forced < 0 || n_generate < 0 || n_prefill + n_forced > n_tok ||
            (n_forced == 0 && n_generate > 0) || n_prefill + n_steps > n_ctx) {
            fprintf(stderr, "error: request %s: bad sizes (tokens %lld, prefill %lld, forced %lld, generate %lld, "
                            "n_ctx %lld)\n", id.c_str(), (long long) n_tok, (long long) n_prefill,
                    (long long) n_forced, (long long) n_generate, (long long) n_ctx);
            rc = 1;
            break;
        }
        FILE * dump = nullptr;
        const std::string dump_path = req.value("dump", std::string());
        if (!dump_path.empty() && (dump = fopen(dump_path.c_str(), "wb")) == nullptr) {
            fprintf(stderr, "error: cannot write %s\n", dump_path.c_str());
            rc = 1;
            break;
        }

        const int64_t align = req.value("reuse_prefix", (int64_t) 0);
        const int64_t keep = batch_keep_prefix(mem, cached, tokens, n_prefill, align);
        cached.assign(tokens.begin(), tokens.begin() + n_prefill);
        counter = batch_counter();
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = keep; i < n_prefill && rc == 0; i += n_batch) {
            batch.n_tokens = 0;
            const int64_t end = std::min(n_prefill, i + n_batch);
            for (int64_t j = i; j < end; ++j) {
                opencoti_batch_add(batch, tokens[(size_t) j], (llama_pos) j, j + 1 == n_prefill);
            }
            if (llama_decode(ctx, batch) != 0) {
                fprintf(stderr, "error: request %s: llama_decode failed in the prefill at %lld\n", id.c_str(),
                        (long long) i);
                rc = 1;
            }
        }
        const auto t1 = std::chrono::steady_clock::now();
        if (rc != 0) {
            if (dump != nullptr) {
                fclose(dump);
            }
            break;
        }
        res["n_prefill"] = n_prefill;
        res["reused"] = keep;
        res["n_forced"] = n_forced;
        res["decode_steps"] = n_steps;
        res["select_nodes_prefill"] = counter.select_prefill;
        res["fill_nodes"] = counter.fill;
        if (req.value("return_targets", false)) {
            // the text's next token after each forced step (what the step's logits predict), where the text has one
            std::vector<llama_token> targets;
            for (int64_t j = n_prefill + 1; j <= n_prefill + n_forced && j < n_tok; ++j) {
                targets.push_back(tokens[(size_t) j]);
            }
            res["targets"] = targets;
        }
        res["n_vocab"] = n_vocab;
        res["n_ctx"] = n_ctx;
        res["ms_prefill"] = std::chrono::duration<double, std::milli>(t1 - t0).count();

        const batch_steps steps = { tokens, n_prefill, n_forced, n_generate, n_steps, n_vocab };
        if (variants.empty()) {
            rc = batch_decode(ctx, batch, steps, counter, dump, id, res);
            if (dump != nullptr && fclose(dump) != 0) {
                fprintf(stderr, "error: cannot write %s\n", dump_path.c_str());
                rc = 1;
            }
            if (rc == 0) {
                fprintf(out, "%s\n", res.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
                fflush(out);
            }
            continue;
        }
        if (dump != nullptr) {
            fclose(dump); // per-variant dumps: "dump" + "." + variant name
        }
        // the prefilled sequence, copied into each variant's context
        std::vector<uint8_t> state(llama_state_seq_get_size(ctx, 0));
        if (llama_state_seq_get_data(ctx, state.data(), state.size(), 0) != state.size()) {
            fprintf(stderr, "error: request %s: cannot read the sequence state\n", id.c_str());
            rc = 1;
            break;
        }
        for (const batch_variant & v : variants) {
            llama_memory_clear(llama_get_memory(v.ctx), true);
            if (llama_state_seq_set_data(v.ctx, state.data(), state.size(), 0) != state.size()) {
                fprintf(stderr, "error: request %s: variant %s: cannot load the sequence state\n", id.c_str(), v.name.c_str());
                rc = 1;
                break;
            }
            FILE * vdump = nullptr;
            if (!dump_path.empty() && (vdump = fopen((dump_path + "." + v.name).c_str(), "wb")) == nullptr) {
                fprintf(stderr, "error: cannot write %s.%s\n", dump_path.c_str(), v.name.c_str());
                rc = 1;
                break;
            }
            nlohmann::json vres = res;
            vres["variant"] = v.name;
            rc = batch_decode(v.ctx, batch, steps, counter, vdump, id, vres);
            if (vdump != nullptr && fclose(vdump) != 0) {
                rc = 1;
            }
            if (rc != 0) {
                break;
            }
            fprintf(out, "%s\n", vres.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
            fflush(out);
        }
    }
    if (bad) {
        rc = 1;
    }
    for (const batch_variant & v : variants) {
        llama_free(v.ctx);
    }
    llama_batch_free(batch);
    if (out != stdout) {
        fclose(out);
    }
    return rc;
}

}  // namespace

// opencoti-qk-dump: one dense prefill of a text, saving the post-RoPE queries and keys of chosen layers.
//
// What `opencoti-patch lab selector recall` scores block selectors on: with the keys of every position and the
// queries of the last positions, the attention of each of those queries over its causal context is known
// exactly, so the share of the attention mass that a selector keeps can be computed offline for any
// scorer, budget and block size, from one prefill (teacher forcing: query t attends to keys 0..t, as the
// decode step at position t does).
//
//   opencoti-qk-dump -m MODEL -f TEXT --layers 5,11,17 [--q-last N] [--max-tokens N] [-t THREADS] [-ngl N] -o DIR
//
// -ngl: layers offloaded to a GPU (default 0: CPU only, whatever the build has); the captured tensors are
// copied back to the host either way.
//
// Writes DIR/k-<layer>.npy  float32 [n_tokens, n_head_kv, head_dim]
//        DIR/q-<layer>.npy  float32 [q_last,   n_head,    head_dim]  (queries of the last q_last positions)
//        DIR/tokens.npy     int32   [n_tokens]
// The tensors are the graph's "Qcur-<il>" / "Kcur-<il>" (after the norms and RoPE, before any attention
// scale), read through the eval callback, which does not change the computation.

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct capture {
    std::map<std::string, int> want;   // tensor name -> layer
    std::map<std::string, std::vector<float>> data;
    std::map<std::string, std::pair<int64_t, int64_t>> shape; // name -> (ne0, ne1) per token
    std::vector<uint8_t> buf;
    // per llama_decode: several graph nodes share a name (the projection, then the RoPE output); the last one
    // computed is the post-RoPE tensor that attention reads
    std::map<std::string, std::vector<float>> last;
};

bool capture_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * cap = static_cast<capture *>(user_data);
    if (cap->want.find(t->name) == cap->want.end()) {
        return false;
    }
    if (ask) {
        return true;
    }
    GGML_ASSERT(t->type == GGML_TYPE_F32 && ggml_is_contiguous(t));
    const size_t nbytes = ggml_nbytes(t);
    cap->buf.resize(nbytes);
    ggml_backend_tensor_get(t, cap->buf.data(), 0, nbytes);
    const float * f = reinterpret_cast<const float *>(cap->buf.data());
    cap->last[t->name].assign(f, f + ggml_nelements(t));
    cap->shape[t->name] = { t->ne[0], t->ne[1] };
    return true;
}

bool write_npy(const std::string & path, const char * descr, const void * data, size_t elem_size,
               const std::vector<int64_t> & shape) {
    std::string dims;
    size_t n = 1;
    for (int64_t d : shape) {
        dims += std::to_string(d) + ",";
        n *= (size_t) d;
    }
    std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
    while ((10 + header.size() + 1) % 64 != 0) {
        header += ' ';
    }
    header += '\n';
    std::ofstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    const uint16_t hlen = (uint16_t) header.size();
    f.write("\x93NUMPY\x01\x00", 8);
    f.write(reinterpret_cast<const char *>(&hlen), 2);
    f.write(header.data(), (std::streamsize) header.size());
    f.write(reinterpret_cast<const char *>(data), (std::streamsize) (n * elem_size));
    return (bool) f;
}

void usage(const char * argv0) {
    fprintf(stderr, "usage: %s -m MODEL -f TEXT --layers L1,L2,... -o DIR [--q-last N] [--max-tokens N] [-t N] [-ngl N]\n", argv0);
}

} // namespace

int main(int argc, char ** argv) {
    std::string model_path, text_path, out_dir, layers_arg;
    int q_last = 256, max_tokens = 0, n_threads = 2, n_gpu_layers = 0;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: %s needs a value\n", a.c_str());
                exit(2);
            }
            return argv[++i];
        };
        if (a == "-m") { model_path = val(); }
        else if (a == "-f") { text_path = val(); }
        else if (a == "-o") { out_dir = val(); }
        else if (a == "--layers") { layers_arg = val(); }
        else if (a == "--q-last") { q_last = std::atoi(val().c_str()); }
        else if (a == "--max-tokens") { max_tokens = std::atoi(val().c_str()); }
        else if (a == "-t") { n_threads = std::atoi(val().c_str()); }
        else if (a == "-ngl") { n_gpu_layers = std::atoi(val().c_str()); }
        else { usage(argv[0]); return 2; }
    }
    if (model_path.empty() || text_path.empty() || out_dir.empty() || layers_arg.empty() || q_last <= 0) {
        usage(argv[0]);
        return 2;
    }

    capture cap;
    std::vector<int> layers;
    {
        std::stringstream ss(layers_arg);
        std::string item;
        while (std::getline(ss, item, ',')) {
            const int il = std::atoi(item.c_str());
            layers.push_back(il);
            cap.want["Qcur-" + std::to_string(il)] = il;
            cap.want["Kcur-" + std::to_string(il)] = il;
        }
    }

    std::ifstream tf(text_path, std::ios::binary);
    if (!tf) {
        fprintf(stderr, "error: cannot read %s\n", text_path.c_str());
        return 1;
    }
    std::stringstream text_ss;
    text_ss << tf.rdbuf();
    const std::string text = text_ss.str();

    llama_log_set([](ggml_log_level level, const char * msg, void *) {
        if (level >= GGML_LOG_LEVEL_WARN || std::strstr(msg, "offloaded") != nullptr) {
            fputs(msg, stderr);
        }
    }, nullptr);
    ggml_backend_load_all();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = n_gpu_layers;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", model_path.c_str());
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    int32_t n = -llama_tokenize(vocab, text.data(), (int32_t) text.size(), nullptr, 0, true, false);
    std::vector<llama_token> tokens((size_t) n);
    n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), tokens.data(), n, true, false);
    tokens.resize((size_t) std::max(n, 0));
    if (max_tokens > 0 && (int) tokens.size() > max_tokens) {
        tokens.resize((size_t) max_tokens);
    }
    const int n_tok = (int) tokens.size();
    if (n_tok <= q_last) {
        fprintf(stderr, "error: %d tokens, need more than --q-last %d\n", n_tok, q_last);
        return 1;
    }

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) (n_tok + 16);
    cparams.n_batch = 2048;
    cparams.n_ubatch = 2048;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cparams.cb_eval = capture_cb;
    cparams.cb_eval_user_data = &cap;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "error: cannot create the context\n");
        return 1;
    }

    for (int i0 = 0; i0 < n_tok; i0 += (int) cparams.n_batch) {
        const int nb = std::min((int) cparams.n_batch, n_tok - i0);
        llama_batch batch = llama_batch_get_one(tokens.data() + i0, nb);
        cap.last.clear();
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "error: llama_decode failed at token %d\n", i0);
            return 1;
        }
        for (auto & [name, v] : cap.last) {
            auto & all = cap.data[name];
            all.insert(all.end(), v.begin(), v.end());
        }
        fprintf(stderr, "\rprefill %d/%d", i0 + nb, n_tok);
    }
    fprintf(stderr, "\n");

    for (int il : layers) {
        const std::string qn = "Qcur-" + std::to_string(il), kn = "Kcur-" + std::to_string(il);
        if (cap.data.find(qn) == cap.data.end() || cap.data.find(kn) == cap.data.end()) {
            fprintf(stderr, "error: layer %d: no %s/%s tensors seen in the graph\n", il, qn.c_str(), kn.c_str());
            return 1;
        }
        const auto [dq, hq] = cap.shape[qn];
        const auto [dk, hk] = cap.shape[kn];
        const auto & q = cap.data[qn];
        const auto & k = cap.data[kn];
        if ((int64_t) k.size() != (int64_t) n_tok * dk * hk || (int64_t) q.size() != (int64_t) n_tok * dq * hq) {
            fprintf(stderr, "error: layer %d: captured %zu K and %zu Q values for %d tokens of [%lld, %lld] / [%lld, %lld]\n",
                    il, k.size(), q.size(), n_tok, (long long) dk, (long long) hk, (long long) dq, (long long) hq);
            return 1;
        }
        const size_t q_off = (size_t) (n_tok - q_last) * dq * hq;
        if (!write_npy(out_dir + "/k-" + std::to_string(il) + ".npy", "<f4", k.data(), 4, { n_tok, hk, dk }) ||
            !write_npy(out_dir + "/q-" + std::to_string(il) + ".npy", "<f4", q.data() + q_off, 4, { q_last, hq, dq })) {
            fprintf(stderr, "error: cannot write to %s\n", out_dir.c_str());
            return 1;
        }
    }
    if (!write_npy(out_dir + "/tokens.npy", "<i4", tokens.data(), 4, { n_tok })) {
        fprintf(stderr, "error: cannot write to %s\n", out_dir.c_str());
        return 1;
    }
    fprintf(stderr, "wrote %zu layers, %d tokens, %d queries to %s\n", layers.size(), n_tok, q_last, out_dir.c_str());

    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

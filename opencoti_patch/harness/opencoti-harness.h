// What the harness programs share (opencoti-harness here, the lab's opencoti-harness-batch in lab/harness/):
// a one-sequence batch and the greedy pick. Header only; llama.cmake puts this folder on every program's
// include path.
#pragma once

#include "llama.h"

#include <cstdint>

// append one token of sequence 0 to ``batch`` (logits for it when ``logits``)
inline void opencoti_batch_add(llama_batch & batch, llama_token tok, llama_pos pos, bool logits) {
    const int i = batch.n_tokens++;
    batch.token[i] = tok;
    batch.pos[i] = pos;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = logits;
}

// the greedy token: the first index of the largest of ``n`` logits
inline llama_token opencoti_argmax(const float * logits, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; ++i) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
}

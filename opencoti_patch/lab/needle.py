"""Quality of the block selection on real prose: passkey retrieval and decode fidelity, sparse vs dense.

Both run through the lab's one passkey and one fidelity run (:mod:`.passkey`, :mod:`.fidelity`), with a
shared prefill (``opencoti-harness-batch --variants``): each request is prefilled once (dense, as
``--sparse-attn on`` does for prompts), then its sequence state is copied into one context per attention
variant (dense, sparse at each budget, the equal-size window), and each decodes. So all variants see the same
prompt, the same prefill and the same samples, and N variants cost one prefill.

- **passkey**: a 5-digit key in a needle sentence (several wordings) inside real prose paragraphs
  (:mod:`opencoti_patch.lab.prose`),
  at a uniform depth restricted to the blocks that sparse attention may drop
  (past the sink block, before the recent blocks), then a question (several frames); greedy answer.
- **fidelity**: teacher-forced decode steps over real prose after a long prefill; KL(dense || variant) and
  top-1 agreement per step (:func:`opencoti_patch.lab.logits.compare_logits`).

Budgets are stated as **attended tokens** (sink + recent + top-k blocks): ``share`` of the context, or a fixed
number of tokens.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import OpencotiError
from .batch import Group, Harness
from .fidelity import run_fidelity
from .passkey import run_passkey
from .prose import take_text
from .variants import BLOCK, DENSE, RECENT, SINK, variants_for

PER_DOC = 25  # passkey samples per filler text (make_samples)

HEADER = "Read the following text carefully. A pass key is hidden somewhere in it; remember it.\n\n"
NEEDLES = (
    "The pass key is {key}. Remember it. {key} is the pass key.",
    "Important: the secret pass key is {key}. Keep this number in mind, you will be asked for it.",
    "Note for the reader: the pass key that you will need later is {key}.",
)
QUESTIONS = (
    "\n\nQuestion: What is the pass key?\nAnswer: The pass key is",
    "\n\nQuestion: Which number was given as the pass key in the text above?\nAnswer: The pass key is",
)


@dataclasses.dataclass(frozen=True)
class Sample:
    sid: str
    n_ctx: int
    doc: int  # index of the first prose paragraph of the filler
    depth: float  # where the needle sits, as a fraction of the filler
    key: str
    needle: int
    question: int

    def prompt(self, paragraphs: list[str], filler_chars: int) -> str:
        text = take_text(paragraphs, self.doc, filler_chars)
        cut = int(self.depth * len(text))
        at = text.rfind("\n\n", 0, cut)  # the needle is a paragraph of its own
        at = 0 if at < 0 else at + 2
        needle = NEEDLES[self.needle].format(key=self.key)
        return HEADER + text[:at] + needle + "\n\n" + text[at:] + QUESTIONS[self.question]


def make_samples(seed: int, n_ctx: int, count: int, n_paragraphs: int,
                 per_doc: int = PER_DOC) -> list[Sample]:
    """``count`` samples: groups of ``per_doc`` share one filler (prefix reuse), depths spread uniformly over
    the droppable part of the context, keys, wordings and frames drawn from ``seed``."""
    if per_doc < 1:
        raise OpencotiError(f"need at least one sample per filler text, got {per_doc}")
    rng = random.Random(seed * 1_000_003 + n_ctx)
    lo = (SINK + 2 * BLOCK) / n_ctx  # past the sink block (and the header)
    hi = 1.0 - (RECENT + 3 * BLOCK) / n_ctx  # before the recent blocks (and the question)
    if hi <= lo:
        raise OpencotiError(f"context {n_ctx} too small for a needle outside the sink and recent blocks")
    out = []
    docs = [rng.randrange(n_paragraphs) for _ in range(-(-count // per_doc))]
    for i in range(count):
        depth = lo + (hi - lo) * ((i % per_doc) + rng.random()) / per_doc
        out.append(Sample(f"c{n_ctx}-{i:03d}", n_ctx, docs[i // per_doc], depth,
                          f"{rng.randrange(10_000, 100_000)}", rng.randrange(len(NEEDLES)),
                          rng.randrange(len(QUESTIONS))))
    return out


class _Progress:
    """Calls ``report`` once per finished sample (all its variants)."""

    def __init__(self, report: Callable[[str], None] | None, label: str, n_samples: int,
                 n_variants: int) -> None:
        self.report, self.label = report, label
        self.n_samples, self.n_variants, self.lines = n_samples, n_variants, 0

    def __call__(self, _: dict[str, Any]) -> None:
        self.lines += 1
        if self.report is not None and self.lines % self.n_variants == 0:
            self.report(f"{self.label}: {self.lines // self.n_variants}/{self.n_samples} samples")


def chars_per_token(harness: Harness, paragraphs: list[str]) -> float:
    """Characters per token of the model's tokenizer on the corpus (its first 40K characters)."""
    text = take_text(paragraphs, 0, 40_000)
    with tempfile.TemporaryDirectory(prefix="opencoti-fit-") as tmp:
        log = (harness.log_dir or Path(tmp)) / "fit.log"
        res = harness.run_variants([{"id": "fit", "text": text, "tokenize_only": True}], 16384, [DENSE], log)
    return len(text) / int(res[0]["n_tokens"])


# KV cells beyond the nominal context: a prompt aimed at n_ctx tokens from a chars-per-token estimate can
# come out a little longer (seen on the H200: 8189 prompt tokens + 8 generated at 8192), and the answer needs
# its cells too
CTX_HEADROOM = 256


def harness_ctx(n_ctx: int, n_generate: int) -> int:
    """The harness's -c for a nominal context of ``n_ctx`` tokens (budgets stay shares of ``n_ctx``)."""
    if n_generate >= CTX_HEADROOM:
        raise OpencotiError(f"{n_generate} generated tokens do not fit the {CTX_HEADROOM}-cell headroom")
    return n_ctx + CTX_HEADROOM


def prose_passkey(harness: Harness, paragraphs: list[str], *, contexts: dict[int, int],
                  shares: Sequence[float], fixed_tokens: Sequence[int], seed: int, n_generate: int = 8,
                  progress: Callable[[str], None] | None = None, per_doc: int = PER_DOC,
                  blocks: Sequence[int] = (BLOCK,), scores: Sequence[str] = ("max",)) -> dict[str, Any]:
    """Passkey prompts in real prose per context (``contexts``: context -> prompts), every variant of
    :func:`~opencoti_patch.lab.variants.variants_for` on the same prompts, one dense prefill each
    (:func:`~.passkey.run_passkey`): correct answers, answers lost and gained against dense, the change per
    100 prompts and its interval."""
    t0 = time.monotonic()
    cpt = chars_per_token(harness, paragraphs)
    by_ctx: dict[str, Any] = {}
    for n_ctx, count in contexts.items():
        variants = variants_for(n_ctx, shares, fixed_tokens, blocks=blocks, scores=scores)
        samples = make_samples(seed, n_ctx, count, len(paragraphs), per_doc)
        filler_chars = int((n_ctx - 160 - n_generate) * cpt * 0.96)
        # deepest needle first within a filler: a prompt shares its text up to its needle with the one before
        ordered = sorted(samples, key=lambda s: (s.doc, -s.depth))
        reqs = tuple({"id": s.sid, "text": s.prompt(paragraphs, filler_chars), "n_generate": n_generate,
                      "reuse_prefix": BLOCK} for s in ordered)
        tick = _Progress(progress, f"passkey {n_ctx}", len(reqs), len(variants))
        t_ctx = time.monotonic()
        group = Group(harness_ctx(n_ctx, n_generate), tuple(variants), reqs, f"passkey-{n_ctx}")
        (answers,), decoded = run_passkey(harness, [group], n_generate=n_generate, shared_prefill=True,
                                          on_result=tick)
        by_cfg = decoded.results[0]
        keys = {s.sid: s for s in samples}
        per: dict[str, dict[str, Any]] = {
            v.name: {"correct": sum(a == keys[sid].key for sid, a in answers[v.name].items()),
                     "answers": answers[v.name],
                     "ms_decode": sum(float(r["ms_decode"]) for r in by_cfg[v.name].values())}
            for v in variants}
        dense = per["dense"]["answers"]
        dense_right = {sid for sid, a in dense.items() if a == keys[sid].key}
        for v in variants:
            p = per[v.name]
            p["agree_dense"] = sum(p["answers"][sid] == dense[sid] for sid in dense)
            # paired on the same prompts: lost where dense is right and the variant not, gained the reverse
            right = {sid for sid, a in p["answers"].items() if a == keys[sid].key}
            p["lost"], p["gained"] = len(dense_right - right), len(right - dense_right)
            p["attended_tokens"] = v.attended_tokens(n_ctx)
            p["topk"] = v.topk if v.sparse else None
            p["wrong"] = [{"sid": sid, "key": keys[sid].key, "answer": a, "depth": round(keys[sid].depth, 3),
                           "dense": dense[sid]}
                          for sid, a in sorted(p["answers"].items()) if a != keys[sid].key]
            del p["answers"]
        dense_runs = list(by_cfg["dense"].values())
        n_tokens = [int(r["n_tokens"]) for by_id in by_cfg.values() for r in by_id.values()]
        by_ctx[str(n_ctx)] = {"samples": count, "variants": per,
                              "prompt_tokens": [min(n_tokens), max(n_tokens)],
                              "ms_prefill": sum(r["ms_prefill"] for r in dense_runs),
                              "prefill_tokens": sum(int(r["n_prefill"]) - int(r["reused"])
                                                    for r in dense_runs),
                              "seconds": time.monotonic() - t_ctx}
    out = {"kind": "passkey", "seed": seed, "shares": list(shares), "fixed_tokens": list(fixed_tokens),
           "per_doc": per_doc,
           "needles": list(NEEDLES), "questions": list(QUESTIONS), "header": HEADER, "chars_per_token": cpt,
           "contexts": by_ctx, "seconds": time.monotonic() - t0}
    annotate_paired(out)
    return out


def paired_change(lost: int, gained: int, n: int) -> tuple[float, float]:
    """A variant's change in correct passkey answers against dense, per 100 prompts, and the half-width of
    its 95% interval: each prompt contributes +1 (gained), -1 (lost) or 0, and the interval is the normal
    approximation of the mean of those paired differences. With 100 prompts of which 10 disagree the
    half-width is about 6 per 100: a few answers either way is not a finding."""
    if n <= 0:
        raise OpencotiError("paired change of an empty sample")
    mean = (gained - lost) / n
    var = (gained + lost) / n - mean * mean
    return 100.0 * mean, 100.0 * 1.96 * (max(var, 0.0) / n) ** 0.5


def annotate_paired(passkey: dict[str, Any]) -> None:
    """Add ``change_per_100`` and ``change_ci95`` (:func:`paired_change`) to every variant of a passkey
    result that counts lost and gained answers (results written before those counts are left as they are),
    and to every sparse variant with another score or block size than `max` over 128-token blocks
    (``sparse-25%-maxmean``) ``vs_default``: the same against that reference variant of the budget
    (``sparse-25%``, the default until 2026-12-06) on the same prompts, from the prompts each answers
    wrong."""
    def fields(lost: int, gained: int, n: int) -> dict[str, float]:
        change, ci95 = paired_change(lost, gained, n)
        return {"change_per_100": round(change, 4), "change_ci95": round(ci95, 4)}

    for c in passkey.get("contexts", {}).values():
        n, variants = c["samples"], c["variants"]
        for name, v in variants.items():
            if "lost" not in v:
                continue
            v |= fields(v["lost"], v["gained"], n)
            base = "-".join(name.split("-")[:2])  # sparse-<budget>[-b<size>][-<score>]: the default's name
            if name.startswith("sparse-") and base != name and "wrong" in v and \
                    "wrong" in variants.get(base, {}):
                wrong, wrong_base = ({w["sid"] for w in x["wrong"]} for x in (v, variants[base]))
                better, worse = len(wrong_base - wrong), len(wrong - wrong_base)
                v["vs_default"] = {"name": base, "better": better, "worse": worse, **fields(worse, better, n)}


def reorder_variants(passkey: dict[str, Any], blocks: Sequence[int], scores: Sequence[str]) -> None:
    """Put each context's variants of a passkey result read back from JSON (written with sorted keys) in the
    order of the run, :func:`variants_for`'s; names it does not make stay after those, in the order read."""
    for ctx, c in passkey.get("contexts", {}).items():
        made = [v.name for v in variants_for(int(ctx), passkey.get("shares", []),
                                             passkey.get("fixed_tokens", []), blocks=blocks, scores=scores)]
        have = c["variants"]
        c["variants"] = {n: have[n] for n in made if n in have} | \
            {n: v for n, v in have.items() if n not in made}


def prose_fidelity(harness: Harness, paragraphs: list[str], *, contexts: Sequence[int],
                   shares: Sequence[float], fixed_tokens: Sequence[int], steps: int, seed: int,
                   samples: int = 1, blocks: Sequence[int] = (BLOCK,),
                   scores: Sequence[str] = ("max",)) -> dict[str, Any]:
    """Teacher-forced decode over ``samples`` prose texts per context, every variant from one dense prefill
    (:func:`~.fidelity.run_fidelity`): KL(dense || variant), top-1 agreement and NLL per variant."""
    t0 = time.monotonic()
    cpt = chars_per_token(harness, paragraphs)
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for n_ctx in contexts:
        variants = variants_for(n_ctx, shares, fixed_tokens, blocks=blocks, scores=scores)
        texts = [(f"f{n_ctx}-{i}", take_text(paragraphs, rng.randrange(len(paragraphs)),
                                             int(n_ctx * cpt * 1.1))) for i in range(samples)]
        found, _ = run_fidelity(harness, n_ctx, variants, texts, steps=steps, margin=16, shared_prefill=True)
        for row in found:
            v = row.pop("cfg")
            rows.append({"n_ctx": n_ctx, "sample": row.pop("text"), "variant": v.name,
                         "attended_tokens": v.attended_tokens(n_ctx), **row})
    return {"kind": "fidelity", "steps": steps, "shares": list(shares), "fixed_tokens": list(fixed_tokens),
            "rows": rows, "seconds": time.monotonic() - t0}

"""Quality of the block selection on real prose: passkey retrieval and decode fidelity, sparse vs dense.

Both run ``opencoti-harness-batch --variants``: each request is prefilled once (dense, as ``--sparse-attn on``
does for prompts), then its sequence state is copied into one context per attention variant (dense, sparse at
each budget, the equal-size window), and each decodes. So all variants see the same prompt, the same prefill
and the same samples, and N variants cost one prefill.

- **passkey**: a 5-digit key in a needle sentence (several wordings) inside real prose paragraphs
  (:mod:`opencoti_patch.lab.prose`),
  at a uniform depth restricted to the blocks that sparse attention may drop
  (past the sink block, before the recent blocks), then a question (several frames); greedy answer.
- **fidelity**: teacher-forced decode steps over real prose after a long prefill; KL(dense || variant) and
  top-1 agreement per step (:func:`opencoti_patch.lab.evaluate.compare_logits`).

Budgets are stated as **attended tokens** (sink + recent + top-k blocks): ``share`` of the context, or a fixed
number of tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import OpencotiError
from .evaluate import AttnConfig, compare_logits, parse_answer, window_config
from .prose import take_text

BLOCK = 128
SINK = 128
RECENT = 256
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
class Variant:
    """A decode variant: dense, or sparse with a budget of attended tokens."""

    name: str
    cfg: AttnConfig

    def json(self) -> dict[str, Any]:
        c = self.cfg
        if not c.sparse:
            return {"name": self.name, "sparse_attn": False}
        return {"name": self.name, "sparse_attn": True, "topk": c.topk, "block_size": c.block_size,
                "recent": c.recent, "sink": c.sink, "dense_layers": c.dense_layers, "min_ctx": 1,
                **c.score_settings()}

    def attended(self, n_ctx: int) -> int:
        return self.cfg.attended_blocks(n_ctx) * self.cfg.block_size


def sparse_variant(n_ctx: int, attended_tokens: int, name: str, block: int = BLOCK,
                   score: str = "max") -> Variant:
    """Sparse attention attending ``attended_tokens`` of ``n_ctx`` (whole blocks of ``block`` tokens): sink +
    recent + top-k (the sink and recent token counts are the same for every block size), blocks ranked by
    ``score``."""
    base = AttnConfig(name, sparse=True, topk=1, block_size=block, sink=SINK, recent=RECENT, min_ctx=1,
                      fraction=attended_tokens / n_ctx, score=score)
    top_k = round(attended_tokens / block) - base.sink_blocks - base.recent_blocks
    if top_k < 1:
        raise OpencotiError(f"{attended_tokens} attended tokens of {n_ctx} leave no top-k block")
    return Variant(name, dataclasses.replace(base, topk=top_k))


def variants_for(n_ctx: int, shares: Sequence[float], fixed_tokens: Sequence[int],
                 window: bool = True, blocks: Sequence[int] = (BLOCK,),
                 scores: Sequence[str] = ("max",)) -> list[Variant]:
    """dense, sparse at each share of the context and at each smaller fixed budget, the window of the first
    share. ``blocks`` x ``scores``: the selection block sizes and block scores, each pair its own sparse
    variants, named ``sparse-<budget>`` plus ``-b<size>`` for a block size after the first or other than
    128, and ``-<score>`` for a score after the first or other than ``max`` (the defaults keep the plain
    names); the window is that of the first."""
    out = [Variant("dense", AttnConfig("dense"))]
    window_name = ""
    for bi, block in enumerate(blocks):
        probe = sparse_variant(n_ctx, n_ctx, "", block).cfg
        min_tokens = (probe.sink_blocks + probe.recent_blocks + 1) * block
        for si, score in enumerate(scores):
            sfx = ("" if bi == 0 and block == BLOCK else f"-b{block}") + \
                ("" if si == 0 and score == "max" else f"-{score}")
            first = len(out)
            # a share below sink + recent + 1 block has no top-k at this context: not run
            for share in shares:
                if round(share * n_ctx) >= min_tokens:
                    name = f"sparse-{share * 100:g}%{sfx}"
                    out.append(sparse_variant(n_ctx, round(share * n_ctx), name, block, score))
                    window_name = window_name or f"window-{share * 100:g}%"
            for tokens in fixed_tokens:  # a fixed budget below the shares' and not one of them
                if tokens < n_ctx * min(shares, default=1.0) and \
                        all(v.attended(n_ctx) != tokens for v in out[first:]):
                    out.append(sparse_variant(n_ctx, tokens, f"sparse-{tokens}t{sfx}", block, score))
                    window_name = window_name or f"window-{tokens}t"
    if window and len(out) > 1:
        out.append(Variant(window_name, window_config(out[1].cfg, n_ctx)))
    return out


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


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where the harness runs: ``ngl`` layers on the GPU (0: CPU only, the default) and further llama.cpp
    flags passed through to ``opencoti-harness-batch`` as they are."""

    ngl: int = 0
    extra: tuple[str, ...] = ()


def batch_command(exe: Path, model: Path, n_ctx: int, variants_file: Path, requests_file: Path, *,
                  threads: int, offload: Offload = Offload()) -> list[str]:
    """The harness command line of :func:`run_variants` (the passed-through flags last, so they override)."""
    return [str(exe), "--batch", str(requests_file), "--variants", str(variants_file), "-m", str(model),
            "-c", str(n_ctx), "-fa", "on", "-t", str(threads), "-ngl", str(offload.ngl), "--swa-full",
            *offload.extra]


_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def check_offload(log_text: str, ngl: int, log: Path) -> str | None:
    """``N/M`` from llama's "offloaded N/M layers to GPU" line; with ``ngl`` > 0 every asked layer must be on
    the GPU (a CPU build prints no such line, a GPU build with too little memory fewer layers), else an
    error."""
    found = _OFFLOADED.findall(log_text)
    got = f"{found[-1][0]}/{found[-1][1]}" if found else None
    if ngl > 0 and (not found or int(found[-1][0]) < min(ngl, int(found[-1][1]))):
        raise OpencotiError(f"asked for -ngl {ngl}, but the harness offloaded {got or 'no'} layers to a GPU "
                            f"(a build without a GPU backend? log {log})")
    return got


def run_variants(exe: Path, model: Path, n_ctx: int, variants: Sequence[Variant],
                 requests: Sequence[dict[str, Any]], *, threads: int, log: Path,
                 on_line: Callable[[dict[str, Any]], None] | None = None,
                 offload: Offload = Offload()) -> list[dict[str, Any]]:
    """One harness process: every request prefilled once (dense), decoded by every variant."""
    with tempfile.TemporaryDirectory(prefix="opencoti-needle-") as tmp:
        vfile, rfile = Path(tmp) / "variants.jsonl", Path(tmp) / "requests.jsonl"
        vfile.write_text("".join(json.dumps(v.json()) + "\n" for v in variants))
        rfile.write_text("".join(json.dumps(r) + "\n" for r in requests))
        cmd = batch_command(exe, model, n_ctx, vfile, rfile, threads=threads, offload=offload)
        out: list[dict[str, Any]] = []
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as err, \
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip():
                    out.append(json.loads(line))
                    if on_line is not None:
                        on_line(out[-1])
            rc = proc.wait()
    expected = sum(1 if r.get("tokenize_only") else len(variants) for r in requests)
    if rc != 0 or len(out) != expected:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
        raise OpencotiError(f"harness exited {rc} after {len(out)}/{expected} results (log {log})\n{tail}")
    check_offload(log.read_text(errors="replace"), offload.ngl, log)
    for r in out:
        if "variant" not in r:  # tokenize_only
            continue
        sparse = next(v for v in variants if v.name == r["variant"]).cfg.sparse
        if sparse != (int(r.get("select_nodes", 0)) > 0):
            raise OpencotiError(f"variant {r['variant']}: {r.get('select_nodes')} select nodes in the decode "
                                f"of {r['id']}: the sparse path {'did not run' if sparse else 'ran'}")
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


def chars_per_token(exe: Path, model: Path, paragraphs: list[str], log: Path) -> float:
    text = take_text(paragraphs, 0, 40_000)
    res = run_variants(exe, model, 16384, [Variant("dense", AttnConfig("dense"))],
                       [{"id": "fit", "text": text, "tokenize_only": True}], threads=1, log=log)
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


def run_passkey(exe: Path, model: Path, paragraphs: list[str], *, contexts: dict[int, int],
                shares: Sequence[float], fixed_tokens: Sequence[int], seed: int, threads: int, log_dir: Path,
                n_generate: int = 8, progress: Callable[[str], None] | None = None, per_doc: int = PER_DOC,
                offload: Offload = Offload(), blocks: Sequence[int] = (BLOCK,),
                scores: Sequence[str] = ("max",)) -> dict[str, Any]:
    t0 = time.monotonic()
    cpt = chars_per_token(exe, model, paragraphs, log_dir / "fit.log")
    by_ctx: dict[str, Any] = {}
    for n_ctx, count in contexts.items():
        variants = variants_for(n_ctx, shares, fixed_tokens, blocks=blocks, scores=scores)
        samples = make_samples(seed, n_ctx, count, len(paragraphs), per_doc)
        filler_chars = int((n_ctx - 160 - n_generate) * cpt * 0.96)
        # deepest needle first within a filler: a prompt shares its text up to its needle with the one before
        ordered = sorted(samples, key=lambda s: (s.doc, -s.depth))
        reqs = [{"id": s.sid, "text": s.prompt(paragraphs, filler_chars), "n_generate": n_generate,
                 "reuse_prefix": BLOCK} for s in ordered]
        tick = _Progress(progress, f"passkey {n_ctx}", len(reqs), len(variants))
        t_ctx = time.monotonic()
        n_ctx_kv = harness_ctx(n_ctx, n_generate)
        res = run_variants(exe, model, n_ctx_kv, variants, reqs, threads=threads,
                           log=log_dir / f"passkey-{n_ctx}.log", on_line=tick, offload=offload)
        keys = {s.sid: s for s in samples}
        per: dict[str, dict[str, Any]] = {v.name: {"correct": 0, "answers": {}, "ms_decode": 0.0}
                                          for v in variants}
        for r in res:
            s = keys[r["id"]]
            per[r["variant"]]["ms_decode"] += float(r["ms_decode"])
            if r["n_tokens"] + n_generate > n_ctx_kv:
                raise OpencotiError(f"{s.sid}: {r['n_tokens']} prompt tokens do not fit {n_ctx_kv}")
            ans = parse_answer(r["text"])
            per[r["variant"]]["answers"][s.sid] = ans
            per[r["variant"]]["correct"] += ans == s.key
        dense = per["dense"]["answers"]
        dense_right = {sid for sid, a in dense.items() if a == keys[sid].key}
        for v in variants:
            p = per[v.name]
            p["agree_dense"] = sum(p["answers"][sid] == dense[sid] for sid in dense)
            # paired on the same prompts: lost where dense is right and the variant not, gained the reverse
            right = {sid for sid, a in p["answers"].items() if a == keys[sid].key}
            p["lost"], p["gained"] = len(dense_right - right), len(right - dense_right)
            p["attended_tokens"] = v.attended(n_ctx)
            p["topk"] = v.cfg.topk if v.cfg.sparse else None
            p["wrong"] = [{"sid": sid, "key": keys[sid].key, "answer": a, "depth": round(keys[sid].depth, 3),
                           "dense": dense[sid]}
                          for sid, a in sorted(p["answers"].items()) if a != keys[sid].key]
            del p["answers"]
        n_tokens = [int(r["n_tokens"]) for r in res]
        by_ctx[str(n_ctx)] = {"samples": count, "variants": per,
                              "prompt_tokens": [min(n_tokens), max(n_tokens)],
                              "ms_prefill": sum(r["ms_prefill"] for r in res if r["variant"] == "dense"),
                              "prefill_tokens": sum(int(r["n_prefill"]) - int(r["reused"]) for r in res
                                                    if r["variant"] == "dense"),
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


def run_fidelity(exe: Path, model: Path, paragraphs: list[str], *, contexts: Sequence[int],
                 shares: Sequence[float], fixed_tokens: Sequence[int], steps: int, seed: int, threads: int,
                 log_dir: Path, samples: int = 1, offload: Offload = Offload(),
                 blocks: Sequence[int] = (BLOCK,), scores: Sequence[str] = ("max",)) -> dict[str, Any]:
    t0 = time.monotonic()
    cpt = chars_per_token(exe, model, paragraphs, log_dir / "fit.log")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="opencoti-fidelity-") as tmp:
        for n_ctx in contexts:
            variants = variants_for(n_ctx, shares, fixed_tokens, blocks=blocks, scores=scores)
            n_prefill = n_ctx - steps - 16
            reqs = [{"id": f"f{n_ctx}-{i}", "text": take_text(paragraphs, rng.randrange(len(paragraphs)),
                                                              int(n_ctx * cpt * 1.1)),
                     "n_prefill": n_prefill, "n_forced": steps, "dump": str(Path(tmp) / f"f{n_ctx}-{i}.f32"),
                     "return_targets": True} for i in range(samples)]
            res = run_variants(exe, model, n_ctx, variants, reqs, threads=threads,
                               log=log_dir / f"fidelity-{n_ctx}.log", offload=offload)
            for req in reqs:
                dense = next(r for r in res if r["id"] == req["id"] and r["variant"] == "dense")
                for v in variants[1:]:
                    m = compare_logits(Path(req["dump"] + ".dense"), Path(req["dump"] + "." + v.name),
                                       int(dense["n_vocab"]), dense.get("targets"))
                    rows.append({"n_ctx": n_ctx, "sample": req["id"], "variant": v.name,
                                 "attended_tokens": v.attended(n_ctx), **m})
    return {"kind": "fidelity", "steps": steps, "shares": list(shares), "fixed_tokens": list(fixed_tokens),
            "rows": rows, "seconds": time.monotonic() - t0}

"""The load test's requests: seeded prompts (each a different slice of the corpus, fitted to a length in
tokens, carrying a marker and, in the middle of its context, a key), and the seeded order they are sent in:
endpoints, streaming, cancellations, repeats; the isolated reference."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import OpencotiError
from ..prose import load_corpus

DEFAULT_CORPUS = "<tree>/docs"  # the vendored tree's docs (opencoti_patch.config.Settings)


MARKER_RE = re.compile(r"LT[0-9a-f]{2}-\d{4}-[0-9a-f]{6}")


KEY_RE = re.compile(r"KY[0-9a-f]{2}-\d{4}-[0-9a-f]{6}")  # the per-request key placed inside the context


@dataclass
class LoadConfig:
    requests: int = 200
    concurrency: int = 6
    min_tokens: int = 1024
    max_tokens: int = 4096
    shared_prefix_tokens: int = 0  # a common prefix (cached by the server) in front of some slices
    shared_prefix_frac: float = 0.5  # the share of prompts with that prefix (the rest start cold)
    n_predict: int = 16
    seed: int = 0
    stream_frac: float = 0.5
    cancel_frac: float = 0.2  # of the streamed requests
    cancel_chunks: tuple[int, int] = (1, 4)
    v1_frac: float = 0.3  # share sent to /v1/completions (the rest to /completion)
    repeat_frac: float = 0.1
    time_limit_s: float = 900.0  # per server run: no request starts after it
    request_timeout_s: float = 600.0
    rss_interval_s: float = 0.5
    warmup_frac: float = 0.1
    rss_growth_mib: float = 64.0
    gpu_growth_mib: float = 64.0
    min_key_echo: float = 0.9  # share of finished answers that must hold their own context's key
    isolated: int = 4  # prompts re-sent one at a time, uncached, after the load (batch-invariant reference)
    strict_load_determinism: bool = False  # llama-server is not batch-invariant: see module doc

    def validate(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.n_predict < 1:
            raise OpencotiError("requests, concurrency and n_predict must be >= 1")
        if not 0 < self.min_tokens <= self.max_tokens:
            raise OpencotiError(f"need 0 < min-tokens <= max-tokens, "
                                f"got {self.min_tokens}..{self.max_tokens}")
        if self.shared_prefix_tokens and self.shared_prefix_tokens + 64 > self.min_tokens:
            raise OpencotiError("shared-prefix-tokens must leave >= 64 tokens of min-tokens for the slice")
        for name in ("stream_frac", "cancel_frac", "v1_frac", "repeat_frac", "warmup_frac",
                     "shared_prefix_frac", "min_key_echo"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise OpencotiError(f"{name} must be in [0, 1]")
        if self.repeat_frac > 0.5:
            raise OpencotiError("repeat-frac must be <= 0.5")


@dataclass
class Spec:
    """One prompt (repeats share the prompt of their original)."""

    key: int  # index of the unique prompt
    rid: str  # its marker
    prompt: str
    n_tokens: int  # with BOS, as the server counts tokens_evaluated
    fact: str = ""  # the key placed in the middle of its context, which the answer must repeat


@dataclass
class Job:
    pos: int  # position in the schedule
    spec: Spec
    endpoint: str  # "completion" | "v1"
    stream: bool
    cancel_after: int | None = None  # close a stream after this many data chunks
    repeat_of: int | None = None  # schedule position of the original


def corpus_text(sources: Sequence[str | Path], min_chars: int = 20000) -> str:
    """The prose of ``sources`` (:func:`~opencoti_patch.lab.prose.load_corpus`: files, folders, glob
    patterns) as one text, at least ``min_chars`` long, without marker- or key-like strings (they would read
    as another request's)."""
    corpus = "\n\n".join(load_corpus(sources))
    if len(corpus) < min_chars:
        names = ", ".join(map(str, sources))
        raise OpencotiError(f"the prose of {names} is {len(corpus)} characters, need >= {min_chars}")
    return KEY_RE.sub("KY--", MARKER_RE.sub("LT--", corpus))


def marker(seed: int, key: int, rng: random.Random) -> str:
    return f"LT{seed % 256:02x}-{key:04d}-{rng.getrandbits(24):06x}"


def context_key(seed: int, key: int, rng: random.Random) -> str:
    return f"KY{seed % 256:02x}-{key:04d}-{rng.getrandbits(24):06x}"


def _frame(rid: str, fact: str, body: str) -> tuple[str, str]:
    """(head with the body, tail): the key sentence is a paragraph in the middle of the body, and the
    last lines ask for it, ending in the same words, so a model copies the key from its own context
    (key_echo; Gemma 3 270M: 32 of 32 answers on 128-384-token prompts of docs/usage.md)."""
    cut = body.rfind("\n", 0, len(body) // 2) + 1 or len(body) // 2
    middle = f"\n\nThe key of document {rid} is {fact}.\n\n"
    return (f"\n\n=== document {rid} ===\n{body[:cut]}{middle}{body[cut:]}",
            f"\n=== end of document {rid} ===\nQuestion: What is the key of document {rid}?\n"
            f"Answer: The key of document {rid} is")


def _fit(make: Callable[[int], str], target: int, tokenize: Callable[[str], int], chars0: int,
         lo: int, hi: int) -> tuple[str, int]:
    """Find a char count whose prompt tokenizes to ~target tokens, within [lo, hi]."""
    chars = max(1, chars0)
    best: tuple[str, int] | None = None
    for _ in range(6):
        text = make(chars)
        n = tokenize(text)
        if lo <= n <= hi and (best is None or abs(n - target) < abs(best[1] - target)):
            best = (text, n)
        if abs(n - target) <= max(4, target // 200):
            break
        chars = max(1, int(chars * target / max(n, 1)))
    if best is None:  # shrink/grow until inside the bounds
        for _ in range(40):
            text = make(chars)
            n = tokenize(text)
            if lo <= n <= hi:
                return text, n
            chars = max(1, int(chars * (0.97 if n > hi else 1.03)))
        raise OpencotiError(f"could not fit a prompt of {target} tokens within [{lo}, {hi}]")
    return best


def build_specs(corpus: str, cfg: LoadConfig, n_unique: int,
                tokenize: Callable[[str], int]) -> list[Spec]:
    """Seeded prompts: token lengths uniform in [min, max], each a different corpus slice + marker."""
    rng = random.Random(cfg.seed)
    ratio = 3.5  # chars per token, refined by the tokenizer
    big = corpus
    while len(big) < 8 * cfg.max_tokens + 1000:
        big += "\n\n" + corpus
    prefix = ""
    if cfg.shared_prefix_tokens:
        p = cfg.shared_prefix_tokens
        prefix, _ = _fit(lambda c: big[:c], p, tokenize, int(p * ratio), p - max(8, p // 50), p)
    specs: list[Spec] = []
    offsets = rng.sample(range(0, len(big) - 6 * cfg.max_tokens), n_unique)
    for key in range(n_unique):
        target = rng.randint(cfg.min_tokens, cfg.max_tokens)
        rid = marker(cfg.seed, key, rng)
        fact = context_key(cfg.seed, key, rng)
        off = offsets[key]
        # only some prompts share the cached prefix: the others start cold, in the same batches (the first
        # two prompts one of each, so that both kinds exist for any 0 < frac < 1)
        first = {0: 0.0, 1: 1.0}.get(key, rng.random()) if 0 < cfg.shared_prefix_frac < 1 else rng.random()
        pre = prefix if first < cfg.shared_prefix_frac else ""
        n_pre = cfg.shared_prefix_tokens if pre else 0

        def make(chars: int, off: int = off, rid: str = rid, fact: str = fact, pre: str = pre) -> str:
            head, tail = _frame(rid, fact, big[off:off + chars])
            return pre + head + tail

        text, n = _fit(make, target, tokenize, int((target - n_pre) * ratio), cfg.min_tokens, cfg.max_tokens)
        ratio = max(1.0, len(text) / n)
        specs.append(Spec(key=key, rid=rid, prompt=text, n_tokens=n, fact=fact))
    return specs


def schedule(specs: Sequence[Spec], cfg: LoadConfig) -> list[Job]:
    """Seeded request order: endpoints, streaming, cancellations and repeats."""
    rng = random.Random(cfg.seed + 1)
    jobs: list[Job] = []
    for spec in specs:
        stream = rng.random() < cfg.stream_frac
        cancel = rng.randint(*cfg.cancel_chunks) if stream and rng.random() < cfg.cancel_frac else None
        endpoint = "v1" if rng.random() < cfg.v1_frac else "completion"
        jobs.append(Job(pos=len(jobs), spec=spec, endpoint=endpoint, stream=stream, cancel_after=cancel))
    n_rep = cfg.requests - len(specs)
    gap = max(1, min(2 * cfg.concurrency + 1, len(jobs) // 3))  # a different batch for the repeat
    candidates = [j for j in jobs if j.cancel_after is None and j.pos + gap < len(jobs)]
    if n_rep > len(candidates):
        raise OpencotiError(f"not enough prompts to repeat {n_rep} of them")
    order: list[Job] = list(jobs)
    for i, orig in enumerate(sorted(rng.sample(candidates, n_rep), key=lambda j: j.pos)):
        at = order.index(orig)
        where = rng.randint(min(at + gap, len(order)), len(order))
        stream = (not orig.stream) if i % 2 == 0 else orig.stream  # half also check stream == non-stream
        order.insert(where, Job(pos=-1, spec=orig.spec, endpoint=orig.endpoint, stream=stream,
                                repeat_of=orig.pos))
    # renumber positions; repeat_of refers to the original's final position
    old_to_new: dict[int, int] = {}
    for i, job in enumerate(order):
        if job.repeat_of is None:
            old_to_new[job.pos] = i
    for i, job in enumerate(order):
        job.pos = i
        if job.repeat_of is not None:
            job.repeat_of = old_to_new[job.repeat_of]
    return order


def plan(corpus: str, cfg: LoadConfig, tokenize: Callable[[str], int]) -> list[Job]:
    cfg.validate()
    n_unique = cfg.requests - int(round(cfg.requests * cfg.repeat_frac))
    return schedule(build_specs(corpus, cfg, n_unique, tokenize), cfg)


def isolated_jobs(jobs: Sequence[Job], n: int) -> list[Job]:
    """`n` prompts spread over the length range (same for every variant), the first one twice."""
    specs = sorted({j.spec.key: j.spec for j in jobs}.values(), key=lambda s: (s.n_tokens, s.key))
    if n <= 0 or not specs:
        return []
    picks = [specs[round(i * (len(specs) - 1) / max(1, n - 1))] for i in range(min(n, len(specs)))]
    picks = list({s.key: s for s in picks}.values()) + [picks[0]]
    last = len(picks) - 1
    return [Job(pos=i, spec=s, endpoint="completion", stream=False, repeat_of=0 if i == last else None)
            for i, s in enumerate(picks)]

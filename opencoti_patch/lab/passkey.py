"""Passkey retrieval, the one way the lab runs it: prompts that each hide a key, decoded greedily under every
attention config of their context (:func:`~opencoti_patch.lab.batch.decode`), each answer the first digits the
model generates. The eval gates (:mod:`.evaluate`: a repeated filler, the gate) and the selector tools
(:mod:`.needle`: real prose, answers lost and gained against dense) make the prompts and judge the answers."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..errors import OpencotiError
from .batch import Decoded, Group, Harness, OnResult, decode

_NUMBER = re.compile(r"\d+")


def parse_answer(text: str) -> str | None:
    """The first run of digits of the generated text (" 12345. Remember" -> "12345"), or None."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def parse_samples_spec(text: str) -> dict[int, int]:
    """``"2048:50,4096:32,8192:20"`` -> {2048: 50, 4096: 32, 8192: 20}: contexts and prompts per context."""
    out: dict[int, int] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        ctx, sep, count = part.partition(":")
        try:
            if not sep:
                raise ValueError(part)
            out[int(ctx)] = int(count)
        except ValueError as exc:
            raise OpencotiError(f"bad samples spec {part!r} (want CTX:COUNT,...)") from exc
    if not out:
        raise OpencotiError("no passkey contexts")
    return out


Answers = dict[str, dict[str, str | None]]  # config name -> prompt id -> the answer (None: no digits)


def run_passkey(harness: Harness, groups: Sequence[Group], *, n_generate: int, shared_prefill: bool,
                jobs: int = 1, show_progress: bool = False,
                on_result: OnResult | None = None) -> tuple[list[Answers], Decoded]:
    """Each group's prompts (requests generating ``n_generate`` tokens) under each of its configs: per group
    the answers, and what was decoded. A prompt whose tokens and answer do not fit its context is an
    error."""
    decoded = decode(harness, groups, shared_prefill=shared_prefill, jobs=jobs, show_progress=show_progress,
                     on_result=on_result)
    answers: list[Answers] = []
    for g, by_cfg in zip(groups, decoded.results, strict=True):
        for by_id in by_cfg.values():
            for rid, r in by_id.items():
                if r["n_tokens"] + n_generate > g.n_ctx:
                    raise OpencotiError(f"sample {rid}: {r['n_tokens']} prompt tokens do not fit {g.n_ctx}")
        answers.append({name: {rid: parse_answer(r["text"]) for rid, r in by_id.items()}
                        for name, by_id in by_cfg.items()})
    return answers, decoded

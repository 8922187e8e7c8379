"""The attention settings a lab run compares, one :class:`AttnConfig` each (named: ``dense``, ``sparse-25%``,
``window-25%``, ...): the block score and its page size, sparse budgets as a share of the context or as
attended tokens, the select-all config, the sliding-window baseline of a budget, and the variants of a
selector run (every block size with every score). The harness is told a config on its command line
(:meth:`AttnConfig.args`) or as one line of its ``--variants`` file (:meth:`AttnConfig.variant_json`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import OpencotiError

BLOCK = 128
SINK = 128
RECENT = 256

# the block scores of --sparse-attn-score; a plain name is that score over 16-cell pages, a name
# "<score>-p<N>" over pages of N cells (--sparse-attn-page-size N), "<score>-pauto" over the tree's automatic
# page size (--sparse-attn-page-size 0: 4 cells up to 32K per sequence, 16 beyond); "oracle" is "mass-p1": the
# MASS score over the keys themselves, each block ranked by its exact share of the attention (summed over the
# query heads of the KV head), the best any ranking of these blocks can do for the attention mass.
SCORES = ("max", "mass", "maxmean")

# the page size of a plain score name: 16 cells, the tree's default until its page size became automatic
# (2026-12-06), so that a report's rows keep their meaning whatever the tree's default is
REFERENCE_PAGE = 16


def parse_score(name: str) -> tuple[str, int]:
    """``max`` -> ("max", 16): the score and its page size; ``max-p4`` -> ("max", 4); ``max-pauto`` ->
    ("max", 0), the automatic page size; ``oracle`` -> ("mass", 1)."""
    if name == "oracle":
        return "mass", 1
    score, sep, page = name.partition("-p")
    if score in SCORES:
        if not sep:
            return score, REFERENCE_PAGE
        if page == "auto":
            return score, 0
        if page.isdigit() and int(page) >= 1:
            return score, int(page)
    raise OpencotiError(f"unknown block score {name!r}: {', '.join(SCORES)}, <score>-p<N> (pages of N "
                        "cells), <score>-pauto (the automatic page size) or oracle")


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """One attention setting of the harness: dense, or sparse with its parameters."""

    name: str
    sparse: bool = False
    topk: int = 0
    block_size: int = 128
    sink: int = 128
    recent: int = 256
    dense_layers: int = 2
    min_ctx: int = 1
    fraction: float | None = None  # the budget as a fraction of the context, when made from one
    window: bool = False  # a sliding-window baseline (top-k 0: sink + a long recent window), not the selector
    score: str = "max"  # the block score (parse_score): max | mass | maxmean | <score>-p<N|auto> | oracle

    def score_settings(self) -> dict[str, Any]:
        """The harness variant keys of the score: always the score and the page size (a tree's defaults may
        change: a run says what it measured)."""
        score, page = parse_score(self.score)
        return {"score": score, "page_size": page}

    def args(self) -> list[str]:
        if not self.sparse:
            return []
        score, page = parse_score(self.score)
        return ["--sparse-attn", "on", "--sparse-attn-topk", str(self.topk),
                "--sparse-attn-block-size", str(self.block_size), "--sparse-attn-recent", str(self.recent),
                "--sparse-attn-sink", str(self.sink), "--sparse-attn-dense-layers", str(self.dense_layers),
                "--sparse-attn-min-ctx", str(self.min_ctx), "--sparse-attn-score", score,
                "--sparse-attn-page-size", str(page)]

    def variant_json(self) -> dict[str, Any]:
        """The line of the harness's ``--variants`` file: the name and the sparse settings it overrides."""
        if not self.sparse:
            return {"name": self.name, "sparse_attn": False}
        return {"name": self.name, "sparse_attn": True, "topk": self.topk, "block_size": self.block_size,
                "recent": self.recent, "sink": self.sink, "dense_layers": self.dense_layers,
                "min_ctx": self.min_ctx, **self.score_settings()}

    @property
    def sink_blocks(self) -> int:  # mirrors llama_sparse_attn_params::n_sink_blocks
        return -(-self.sink // self.block_size) if self.sink > 0 else 0

    @property
    def recent_blocks(self) -> int:  # mirrors n_recent_blocks: the last tokens may end anywhere in a block
        return (self.recent - 1 + self.block_size - 1) // self.block_size + 1 if self.recent > 0 else 0

    def attended_blocks(self, n_kv: int) -> int:
        n_blocks = -(-n_kv // self.block_size)
        if not self.sparse:
            return n_blocks
        return min(n_blocks, self.topk + self.sink_blocks + self.recent_blocks)

    def attended_tokens(self, n_kv: int) -> int:
        return self.attended_blocks(n_kv) * self.block_size

    def describe(self, n_kv: int) -> dict[str, Any]:
        n_blocks = -(-n_kv // self.block_size)
        att = self.attended_blocks(n_kv)
        return {"name": self.name, "sparse": self.sparse, "window": self.window, "topk": self.topk,
                "block_size": self.block_size,
                "sink": self.sink, "recent": self.recent,
                "sink_blocks": self.sink_blocks if self.sparse else 0,
                "recent_blocks": self.recent_blocks if self.sparse else 0, "dense_layers": self.dense_layers,
                "min_ctx": self.min_ctx, "fraction": self.fraction, "n_kv": n_kv, "n_blocks": n_blocks,
                "attended_blocks": att, "attended_tokens": att * self.block_size,
                "attended_fraction": att / n_blocks, "score": self.score, "args": " ".join(self.args())}


DENSE = AttnConfig("dense")


def budget_config(n_ctx: int, fraction: float, *, block_size: int = 128, sink: int = 128, recent: int = 256,
                  dense_layers: int = 2, min_ctx: int = 1, accounting: str = "exclusive") -> AttnConfig:
    """The sparse config for a budget of ``fraction`` of ``n_ctx`` tokens (module doc: accounting)."""
    base = AttnConfig("", sparse=True, topk=1, block_size=block_size, sink=sink, recent=recent,
                      dense_layers=dense_layers, min_ctx=min_ctx)
    blocks = round(fraction * n_ctx / block_size)
    if accounting == "inclusive":
        blocks -= base.sink_blocks + base.recent_blocks
    elif accounting != "exclusive":
        raise OpencotiError(f"unknown budget accounting {accounting!r} (exclusive|inclusive)")
    if blocks < 1:
        raise OpencotiError(f"a budget of {fraction:.0%} of {n_ctx} leaves no top-k block "
                            f"({accounting} accounting)")
    return dataclasses.replace(base, name=f"sparse-{fraction * 100:g}%", topk=blocks, fraction=fraction)


def select_all_config(n_ctx: int, *, block_size: int = 128, sink: int = 128, recent: int = 256,
                      dense_layers: int = 2) -> AttnConfig:
    """top-k covering every block, min-ctx 1: the select op runs and keeps everything (must equal dense)."""
    return AttnConfig("select-all", sparse=True, topk=-(-n_ctx // block_size), block_size=block_size,
                      sink=sink, recent=recent, dense_layers=dense_layers, min_ctx=1, fraction=1.0)


def window_config(budget: AttnConfig, n_kv: int) -> AttnConfig:
    """A sliding-window baseline attending as many blocks as ``budget``: sink + recent, top-k 0 (no block
    chosen by score).

    Score-based selection should beat it at the same cost; if not, the selection adds nothing.
    """
    n_recent_blocks = budget.attended_blocks(n_kv) - budget.sink_blocks
    if n_recent_blocks < 2:
        raise OpencotiError(f"budget {budget.name} too small for a window baseline")
    # recent_blocks(R) = (R - 1 + B - 1) // B + 1 = k for R = B * (k - 1)
    return dataclasses.replace(budget, name=f"window-{budget.name.removeprefix('sparse-')}", topk=0,
                               recent=budget.block_size * (n_recent_blocks - 1), window=True)


def sparse_variant(n_ctx: int, attended_tokens: int, name: str, block: int = BLOCK,
                   score: str = "max") -> AttnConfig:
    """Sparse attention attending ``attended_tokens`` of ``n_ctx`` (whole blocks of ``block`` tokens): sink +
    recent + top-k (the sink and recent token counts are the same for every block size), blocks ranked by
    ``score``."""
    base = AttnConfig(name, sparse=True, topk=1, block_size=block, sink=SINK, recent=RECENT, min_ctx=1,
                      fraction=attended_tokens / n_ctx, score=score)
    top_k = round(attended_tokens / block) - base.sink_blocks - base.recent_blocks
    if top_k < 1:
        raise OpencotiError(f"{attended_tokens} attended tokens of {n_ctx} leave no top-k block")
    return dataclasses.replace(base, topk=top_k)


def variants_for(n_ctx: int, shares: Sequence[float], fixed_tokens: Sequence[int],
                 window: bool = True, blocks: Sequence[int] = (BLOCK,),
                 scores: Sequence[str] = ("max",)) -> list[AttnConfig]:
    """dense, sparse at each share of the context and at each smaller fixed budget, the window of the first
    share. ``blocks`` x ``scores``: the selection block sizes and block scores, each pair its own sparse
    variants, named ``sparse-<budget>`` plus ``-b<size>`` for a block size after the first or other than
    128, and ``-<score>`` for a score after the first or other than ``max`` (the defaults keep the plain
    names); the window is that of the first."""
    out = [DENSE]
    window_name = ""
    for bi, block in enumerate(blocks):
        probe = sparse_variant(n_ctx, n_ctx, "", block)
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
                        all(v.attended_tokens(n_ctx) != tokens for v in out[first:]):
                    out.append(sparse_variant(n_ctx, tokens, f"sparse-{tokens}t{sfx}", block, score))
                    window_name = window_name or f"window-{tokens}t"
    if window and len(out) > 1:
        out.append(dataclasses.replace(window_config(out[1], n_ctx), name=window_name))
    return out

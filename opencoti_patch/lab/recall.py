"""Selection recall: the share of the true (dense) attention mass that a block selector keeps.

From one dense prefill's post-RoPE queries and keys (``opencoti-qk-dump``), the attention of each of the
last N positions over its causal context is known exactly. For every query position t (a teacher-forced
decode step), every sparse layer and every KV head:

- ``mass[b]``: the softmax weight that falls in block b, averaged over the query heads of the KV head
  (what sparse attention loses by dropping b, summed over its query heads);
- a selector keeps the first ``sink`` and last ``recent`` visible blocks plus the ``top_k`` other blocks
  with the highest score; its **recall** is the kept share of the mass;
- the **oracle** keeps the same number of blocks, ranked by the true mass (the best any selector can do);
- the **window** keeps the same number of blocks as sink + the most recent ones (no selection at all).

Scorers (each from keys alone, as the KV cache holds them, f16-rounded):
- ``minmax``: Quest's upper bound ``sum_d max(q_d*kmin_d, q_d*kmax_d)`` per sub-block of ``sub`` keys
  (``sub`` = block size: one bound per block), block score = max over its sub-blocks, max over the
  query heads of the KV head;
- ``mean``: ``q . mean(k)`` per sub-block, same reductions (an estimate, not a bound);
- ``sum``: ``q . sum(k)`` per sub-block, the side-cache of the patches (the same ranking as ``mean`` for
  full pages); ``sum16-f16`` keeps each sum in f16, rounded after every addition in key order, as the
  side-cache does;
- ``mid``: ``q . (kmin + kmax)/2`` per sub-block: the centre of Quest's box, from the same min/max side-cache;
- ``midlse``: the box centre as the page's key, aggregated like ``mlse`` (log-sum-exp over pages and heads);
- ``meanstd``: ``q . mean(k) + c * sqrt(sum_d q_d^2 var_d(k))`` per sub-block (a statistical bound);
- ``lse``: an estimate of the block's attention mass itself: per sub-block and query head, the log of
  ``sub * exp(s*q.mean(k) + s^2/2 * sum_d q_d^2 var_d(k))`` (keys as independent normals per channel,
  s = the softmax scale), then log-sum-exp over the sub-blocks and the query heads;
- ``mlse``: the same without the variance term;
- ``mmax``: ``mlse`` with the block's best sub-block instead of the log-sum-exp over its sub-blocks.

Query-head reductions (scorer suffix): ``max`` (default, the op's), ``sum`` (the summed query), ``lex``
(max, the sum breaking exact ties), ``maxmean`` (max + mean over the query heads: a soft tie-breaker), ``rr``
(each query head ranks the blocks by its own score and the heads take turns: a block's place is its best place
in any head's ranking, ties by the max; the top-k is the union of every head's first k/G or so), ``norm``
(``lse``/``mlse``/``midlse`` only: each head's estimated block weights divided by their sum over the visible
blocks, an estimate of that head's softmax, before the sum over the heads), ``maxnorm`` (the same, divided by
the head's largest page weight over the visible blocks instead of the sum), ``normguard`` (``norm``, and each
head's heaviest visible block first).

Budget splits (:class:`Split`): at a fixed number of attended blocks, the recent window is a fixed number of
tokens or a share of the attended tokens, and the top-k fills the rest. With several splits,
:func:`layer_recall` names rows ``<selector>@<split>`` and measures every row against one reference
**oracle**: sink + the query's own block + the truest-mass other blocks (no split can keep more).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OpencotiError


@dataclasses.dataclass(frozen=True)
class Scorer:
    kind: str  # minmax | mean | meanstd | lse | mlse
    sub: int  # keys per scored sub-block (divides the block size)
    c: float = 0.0  # meanstd only
    head_reduce: str = "max"  # max | sum | lex | maxmean (over the query heads of a KV head)
    f16_sums: bool = False  # sum only: the sums kept in f16, rounded after every addition
    parts: tuple[Scorer, ...] = ()  # union only: the rankings that take turns

    @property
    def name(self) -> str:
        if self.kind == "union":
            return "+".join(p.name for p in self.parts)
        extra = f"-c{self.c:g}" if self.kind == "meanstd" else ""
        red = "" if self.head_reduce == "max" else f"-{self.head_reduce}"
        return f"{self.kind}{self.sub}{extra}{red}{'-f16' if self.f16_sums else ''}"

    def bytes_per_token(self, head_dim: int, bytes_per_value: int = 4) -> float:
        """Side-cache bytes per token of context and KV head."""
        if self.kind == "union":
            return max(p.bytes_per_token(head_dim, bytes_per_value) for p in self.parts)
        if self.f16_sums:
            bytes_per_value = 2
        vectors = 2 if self.kind in ("minmax", "mid", "midlse", "meanstd", "lse") else 1
        return vectors * head_dim * bytes_per_value / self.sub


HEAD_REDUCE = ("max", "sum", "lex", "maxmean", "rr", "norm", "maxnorm", "normguard", "normmax", "normmaxsum")


def parse_scorer(text: str) -> Scorer:
    """``minmax16``, ``mean32``, ``meanstd128-c2``, ``minmax16-sum``, ``sum16-f16``; ``A+B``: the union of A's
    and B's rankings, taking turns."""
    if "+" in text:
        subs = tuple(parse_scorer(t) for t in text.split("+"))
        return Scorer("union", subs[0].sub, parts=subs)
    parts = text.split("-")
    head = parts[0]
    kind = head.rstrip("0123456789")
    kinds = ("minmax", "mid", "midlse", "mean", "sum", "meanstd", "lse", "mlse", "mmax")
    if kind not in kinds or kind == head:
        raise OpencotiError(f"unknown scorer {text!r} (e.g. minmax16, mean32, sum16-f16, meanstd128-c2)")
    sub = int(head[len(kind):])
    c, red, f16_sums = 0.0, "max", False
    for p in parts[1:]:
        if p.startswith("c"):
            c = float(p[1:])
        elif p in HEAD_REDUCE:
            red = p
        elif p == "f16" and kind == "sum":
            f16_sums = True
        else:
            raise OpencotiError(f"unknown scorer option {p!r} in {text!r}")
    return Scorer(kind, sub, c, red, f16_sums)


def page_sums(ks: np.ndarray, f16_sums: bool) -> np.ndarray:
    """Sums of the keys of each sub-block, ks [nsub, sub, D] (NaN: no key) -> [nsub, D], in key order; with
    ``f16_sums`` rounded to f16 after every addition (the side-cache of the patches)."""
    if not f16_sums:
        return np.nansum(ks, axis=1)
    acc = np.full((ks.shape[0], ks.shape[2]), np.nan, np.float32)
    for i in range(ks.shape[1]):
        v = ks[:, i, :]
        acc = np.where(np.isnan(v), acc, f16(np.where(np.isnan(acc), v, acc + v)))
    return acc


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def block_mass(q: np.ndarray, k: np.ndarray, positions: np.ndarray, scale: float, block: int) -> np.ndarray:
    """Attention mass per block: q [N, G, D] (the G query heads of one KV head), k [T, D] -> [N, nb].

    Query n sits at position ``positions[n]`` and sees keys 0..positions[n]. Mass is averaged over G.
    """
    n_tok = k.shape[0]
    nb = -(-n_tok // block)
    logits = np.einsum("ngd,td->ngt", q, k, optimize=True) * scale
    causal = np.arange(n_tok)[None, :] > positions[:, None]  # [N, T]
    logits = np.where(causal[:, None, :], -np.inf, logits)
    logits -= logits.max(axis=2, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=2, keepdims=True)
    pad = nb * block - n_tok
    if pad:
        p = np.concatenate([p, np.zeros(p.shape[:2] + (pad,), p.dtype)], axis=2)
    return p.reshape(p.shape[0], p.shape[1], nb, block).sum(axis=3).mean(axis=1)


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def block_scores(q: np.ndarray, k: np.ndarray, scorer: Scorer, block: int, scale: float,
                 positions: np.ndarray | None = None) -> np.ndarray:
    """Scores per block: q [N, G, D], k [T, D] (f16-rounded as cached) -> [N, nb]. ``positions``: those of the
    queries (default: the last N), for the ``norm`` reduction."""
    if scorer.kind == "union":
        return _union_ranks([block_scores(q, k, p, block, scale, positions) for p in scorer.parts])
    if block % scorer.sub:
        raise OpencotiError(f"scorer sub-block {scorer.sub} does not divide block size {block}")
    n_tok, d = k.shape
    nsub = -(-n_tok // scorer.sub)
    pad = nsub * scorer.sub - n_tok
    kp = np.concatenate([k, np.full((pad, d), np.nan, k.dtype)]) if pad else k
    ks = kp.reshape(nsub, scorer.sub, d)
    if scorer.kind == "minmax":
        kmin, kmax = np.nanmin(ks, axis=1), np.nanmax(ks, axis=1)
        s = (np.einsum("ngd,sd->ngs", np.maximum(q, 0), kmax)
             + np.einsum("ngd,sd->ngs", np.minimum(q, 0), kmin))
    elif scorer.kind == "sum":
        s = np.einsum("ngd,sd->ngs", q, page_sums(ks, scorer.f16_sums))
    elif scorer.kind in ("mid", "midlse"):
        s = np.einsum("ngd,sd->ngs", q, 0.5 * (np.nanmin(ks, axis=1) + np.nanmax(ks, axis=1)))
        if scorer.kind == "midlse":
            s = scale * s + np.log(scorer.sub)
    else:
        mu = np.nanmean(ks, axis=1)
        s = np.einsum("ngd,sd->ngs", q, mu)
        if scorer.kind == "meanstd":
            var = np.nanvar(ks, axis=1)
            s = s + scorer.c * np.sqrt(np.einsum("ngd,sd->ngs", q * q, var))
        elif scorer.kind in ("lse", "mlse", "mmax"):
            s = scale * s + np.log(scorer.sub)
            if scorer.kind == "lse":
                s = s + 0.5 * scale * scale * np.einsum("ngd,sd->ngs", q * q, np.nanvar(ks, axis=1))
    per_block = block // scorer.sub
    nb = -(-n_tok // block)
    padsub = nb * per_block - nsub
    if padsub:
        s = np.concatenate([s, np.full(s.shape[:2] + (padsub,), -np.inf, s.dtype)], axis=2)
    s = s.reshape(s.shape[0], s.shape[1], nb, per_block)
    if scorer.kind in ("lse", "mlse", "midlse", "mmax"):  # estimated mass: over sub-blocks, query heads
        blk = s.max(axis=3) if scorer.kind == "mmax" else _logsumexp(s, 3)
        if scorer.head_reduce in ("norm", "maxnorm", "normguard", "normmax", "normmaxsum"):
            # norm: each head's estimated weights over its visible blocks normalised to 1 (the softmax of that
            # head), so that the block's estimated share of the head-averaged mass is ranked, not its raw
            # weight;
            # maxnorm: divided by the head's largest page weight instead (no sum over the blocks)
            if positions is None:
                positions = np.arange(n_tok - q.shape[0], n_tok)
            vis = (np.arange(nb)[None, :] <= (np.asarray(positions) // block)[:, None])[:, None, :]
            if scorer.head_reduce != "maxnorm":
                blk = blk - _logsumexp(np.where(vis, blk, -np.inf), 2)[:, :, None]
            else:
                blk = blk - np.max(np.where(vis, s.max(axis=3), -np.inf), axis=2)[:, :, None]
            if scorer.head_reduce == "normmax":  # the largest estimated share of any one head
                return blk.max(axis=1)
            if scorer.head_reduce == "normmaxsum":  # largest share + summed share
                return np.logaddexp(blk.max(axis=1), _logsumexp(blk, 1))
            if scorer.head_reduce == "normguard":
                # norm, and every head's own heaviest visible block ranks first (a head that attends to one
                # place keeps it)
                out = _logsumexp(blk, 1)
                best = np.argmax(np.where(vis, blk, -np.inf), axis=2)  # [N, G]
                np.put_along_axis(out, best, np.inf, axis=1)
                return out
        return _logsumexp(blk, 1)
    s = s.max(axis=3)  # over the sub-blocks
    return reduce_heads(s, scorer.head_reduce)


def _places(s: np.ndarray) -> np.ndarray:
    """[N, nb] scores -> the place of each block in its row's ranking (0 = best; ties: lower id first)."""
    order = np.argsort(-s, axis=-1, kind="stable")
    place = np.empty(s.shape, dtype=np.int64)
    np.put_along_axis(place, order, np.broadcast_to(np.arange(s.shape[-1]), s.shape), axis=-1)
    return place


def _union_ranks(scores: list[np.ndarray]) -> np.ndarray:
    """Rankings that take turns: a block's rank is its best place in any of them, ties by the first."""
    best = np.min(np.stack([_places(s) for s in scores]), axis=0).astype(np.float64)
    return -best - _places(scores[0]) / (scores[0].shape[-1] + 1.0)


def reduce_heads(s: np.ndarray, how: str) -> np.ndarray:
    """[N, G, nb] block scores per query head -> [N, nb] ranks (higher = kept first)."""
    smax, ssum = s.max(axis=1), s.sum(axis=1)
    if how == "max":
        return smax
    if how == "sum":
        return ssum
    if how == "maxmean":
        return smax + ssum / s.shape[1]
    if how == "rr":
        # place of each block in each head's own ranking (0 = that head's best; ties: lower block id first)
        best = _places(s).min(axis=1).astype(np.float64)
        # rank: a better (smaller) best place first; within one place, the higher max score first
        tie = np.argsort(np.argsort(smax, axis=1, kind="stable"), axis=1, kind="stable") / (s.shape[2] + 1.0)
        return -best + tie
    # lex: order by the max, exact ties by the sum, then lower block id first; the rank is the position
    ids = np.broadcast_to(np.arange(s.shape[2]), smax.shape)
    order = np.lexsort((-ids, ssum, smax), axis=1)
    rank = np.empty(smax.shape)
    pos = np.broadcast_to(np.arange(s.shape[2], dtype=np.float64), smax.shape)
    np.put_along_axis(rank, order, pos, axis=1)
    return rank


@dataclasses.dataclass(frozen=True)
class Budget:
    sink_blocks: int
    recent_blocks: int
    top_k: int

    @property
    def blocks(self) -> int:
        return self.sink_blocks + self.recent_blocks + self.top_k


@dataclasses.dataclass(frozen=True)
class Split:
    """The recent window of a budget: ``tokens``, or (``of_budget`` > 0) that share of the attended tokens."""

    tokens: int = 0
    of_budget: float = 0.0

    @property
    def name(self) -> str:
        return f"r{self.of_budget * 100:g}%" if self.of_budget else f"r{self.tokens}"

    def recent(self, attended_tokens: int) -> int:
        return round(self.of_budget * attended_tokens) if self.of_budget else self.tokens


def parse_split(text: str) -> Split:
    """``512`` (recent tokens) or ``25%`` (of the attended tokens)."""
    t = text.strip()
    try:
        split = Split(0, float(t[:-1]) / 100) if t.endswith("%") else Split(int(t))
    except ValueError:
        split = Split(-1)
    if split.tokens < 0 or not 0 <= split.of_budget < 1 or (t.endswith("%") and not split.of_budget):
        raise OpencotiError(f"bad recent window {text!r} (tokens, e.g. 512, or a share of the budget: 25%)")
    return split


def budget_for(n_ctx: int, share: float, block: int, sink: int = 128, recent: int | Split = 256) -> Budget:
    """The budget whose attended tokens (sink + recent + top-k blocks) are ``share`` of ``n_ctx``."""
    if isinstance(recent, Split):
        recent = recent.recent(round(share * n_ctx / block) * block)
    sink_b = -(-sink // block) if sink > 0 else 0
    recent_b = (recent - 1 + block - 1) // block + 1 if recent > 0 else 0  # llama_sparse_attn_params
    top_k = round(share * n_ctx / block) - sink_b - recent_b
    if top_k < 1:
        raise OpencotiError(f"{share:.1%} of {n_ctx} tokens leaves no top-k block at block size {block}")
    return Budget(sink_b, recent_b, top_k)


def kept_mass(mass: np.ndarray, rank: np.ndarray, positions: np.ndarray, block: int,
              budget: Budget) -> np.ndarray:
    """Mass kept per query: sink + recent visible blocks + the top-k others by ``rank`` (higher first)."""
    out = np.empty(mass.shape[0])
    for n, t in enumerate(positions):
        nv = int(t) // block + 1
        m = mass[n, :nv]
        fixed = np.zeros(nv, bool)
        fixed[:budget.sink_blocks] = True
        fixed[max(0, nv - budget.recent_blocks):] = True
        cand = np.flatnonzero(~fixed)
        if len(cand) > budget.top_k:
            r = rank[n, cand]
            # ties: lower block id first (the op's order); argsort is stable on -r
            cand = cand[np.argsort(-r, kind="stable")[:budget.top_k]]
        out[n] = m[fixed].sum() + m[cand].sum()
    return out


def window_mass(mass: np.ndarray, positions: np.ndarray, block: int, budget: Budget) -> np.ndarray:
    """Mass kept by a window of the same size: the top-k blocks are the most recent ones."""
    recency = np.broadcast_to(np.arange(mass.shape[1], dtype=np.float64), mass.shape)
    return kept_mass(mass, recency, positions, block, budget)


def summarize(x: np.ndarray) -> dict[str, float]:
    return {"mean": float(np.mean(x)), "p10": float(np.percentile(x, 10)), "min": float(np.min(x))}


def layer_recall(q: np.ndarray, k: np.ndarray, *, scale: float, block: int, shares: Sequence[float],
                 scorers: Sequence[Scorer], sink: int = 128, recent: int | Split = 256,
                 splits: Sequence[Split] = ()) -> dict[str, Any]:
    """Recall of every scorer, the oracle and the window, per budget share, for one layer's dump.

    q: [N, H, D] queries of the last N positions; k: [T, Hkv, D] keys of every position. ``splits``: compare
    these recent windows at each share (rows ``<name>@<split>``, a split that leaves no top-k block is left
    out, all against the reference oracle, see the module doc); none: the one window ``recent``, plain names.
    """
    n_q, n_head, _ = q.shape
    n_tok, n_head_kv, _ = k.shape
    if n_head % n_head_kv:
        raise OpencotiError(f"{n_head} query heads do not group over {n_head_kv} KV heads")
    gqa = n_head // n_head_kv
    positions = np.arange(n_tok - n_q, n_tok)
    kc = f16(k)
    # per share: the budget of each split (suffix "" = the single-window mode) and the oracle's budget
    plans: dict[str, tuple[Budget, dict[str, Budget]]] = {}
    for share in shares:
        if not splits:
            bud = budget_for(n_tok, share, block, sink, recent)
            plans[f"{share:g}"] = (bud, {"": bud})
            continue
        per = {}
        for sp in splits:
            try:
                per["@" + sp.name] = budget_for(n_tok, share, block, sink, sp)
            except OpencotiError:
                continue
        if per:
            plans[f"{share:g}"] = (budget_for(n_tok, share, block, sink, 1), per)
    acc: dict[str, dict[str, list[np.ndarray]]] = {}
    for h in range(n_head_kv):
        qg = q[:, h * gqa:(h + 1) * gqa, :]
        mass = block_mass(qg, kc[:, h, :], positions, scale, block)
        ranks = {s.name: block_scores(qg, kc[:, h, :], s, block, scale) for s in scorers}
        for share, (ref, per) in plans.items():
            row = acc.setdefault(share, {})
            row.setdefault("oracle", []).append(kept_mass(mass, mass, positions, block, ref))
            row.setdefault("window", []).append(window_mass(mass, positions, block, ref))
            for sfx, bud in per.items():
                if sfx:
                    row.setdefault("oracle" + sfx, []).append(kept_mass(mass, mass, positions, block, bud))
                row.setdefault("fixed" + sfx, []).append(
                    kept_mass(mass, mass, positions, block, dataclasses.replace(bud, top_k=0)))
                for name, r in ranks.items():
                    row.setdefault(name + sfx, []).append(kept_mass(mass, r, positions, block, bud))
    out: dict[str, Any] = {}
    for share, row in acc.items():
        ref, per = plans[share]
        pooled = {name: np.concatenate(v) for name, v in row.items()}
        oracle = pooled["oracle"]
        sel = {name: v for name, v in pooled.items() if not name.startswith("fixed")}
        res: dict[str, Any] = {"budget": dataclasses.asdict(ref), "attended_tokens": ref.blocks * block,
                               "values": {name: summarize(v) for name, v in sel.items()},
                               "of_oracle": {name: summarize(v / oracle) for name, v in sel.items()},
                               "selected": {}}
        if splits:
            res["budgets"] = {sfx[1:]: dataclasses.asdict(b) for sfx, b in per.items()}
        for sfx in per:
            fixed, top = pooled["fixed" + sfx], pooled["oracle" + sfx] if sfx else oracle
            if not sfx:
                res["fixed"] = summarize(fixed)
            # "selected": of the mass outside the always-kept sink/recent blocks that the oracle's top-k (same
            # split) holds, the share this selector's top-k holds (the number that separates selectors)
            for name, v in sel.items():
                if name.endswith(sfx) and ("@" in name) == bool(sfx):
                    res["selected"][name] = summarize((v - fixed) / np.maximum(top - fixed, 1e-12))
        out[share] = res
    return out


def load_dump(dump_dir: Path, layer: int) -> tuple[np.ndarray, np.ndarray]:
    qp, kp = dump_dir / f"q-{layer}.npy", dump_dir / f"k-{layer}.npy"
    if not qp.is_file() or not kp.is_file():
        raise OpencotiError(f"no Q/K dump for layer {layer} in {dump_dir} (run opencoti-qk-dump)")
    return np.load(qp), np.load(kp)


def aggregate(per_layer: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Pool :func:`layer_recall` results of several texts and layers (equal query counts): per share and
    selector, the mean kept mass and its mean per-layer p10, the mean and the mean per-layer p10 of its share
    of the oracle's mass, and the mean share of the oracle top-k's mass (outside sink/recent) that its top-k
    holds."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for res in per_layer.values():
        for share, v in res.items():
            for name in v["values"]:
                acc = out.setdefault(share, {}).setdefault(name, {"mass": [], "mass_p10": [],
                                                                  "of_oracle": [], "of_oracle_p10": [],
                                                                  "selected": []})
                acc["mass"].append(v["values"][name]["mean"])
                acc["mass_p10"].append(v["values"][name]["p10"])
                acc["of_oracle"].append(v["of_oracle"][name]["mean"])
                acc["of_oracle_p10"].append(v["of_oracle"][name]["p10"])
                if name in v["selected"]:
                    acc["selected"].append(v["selected"][name]["mean"])
    return {share: {name: {k: float(np.mean(x)) for k, x in acc.items() if x} for name, acc in row.items()}
            for share, row in out.items()}


def needle_kept(q: np.ndarray, k: np.ndarray, positions: np.ndarray, needle_blocks: set[int], *,
                scale: float, block: int, budget: Budget, scorers: Sequence[Scorer]) -> dict[str, list[bool]]:
    """Per query (at ``positions``) of one KV head's group: does each scorer (and the oracle by true mass, and
    the window) keep a block holding the needle? q [N, G, D] and k [T, D] of one KV head."""
    kc = f16(k)
    ranks = {s.name: block_scores(q, kc, s, block, scale, positions) for s in scorers}
    ranks["oracle"] = block_mass(q, kc, positions, scale, block)
    out: dict[str, list[bool]] = {name: [] for name in [*ranks, "window"]}
    for n, t in enumerate(positions):
        nv = int(t) // block + 1
        fixed = set(range(budget.sink_blocks)) | set(range(max(0, nv - budget.recent_blocks), nv))
        cand = [b for b in range(nv) if b not in fixed]
        for name, r in ranks.items():
            top = sorted(cand, key=lambda b, r=r, n=n: (-r[n, b], b))[:budget.top_k]
            out[name].append(bool(needle_blocks & (fixed | set(top))))
        n_last = budget.blocks - budget.sink_blocks
        window = set(range(budget.sink_blocks)) | set(range(max(0, nv - n_last), nv))
        out["window"].append(bool(needle_blocks & window))
    return out

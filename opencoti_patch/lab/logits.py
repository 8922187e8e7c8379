"""Decode logits compared: the float32 dumps of the harness (one row of n_vocab per decode step), read in
chunks; KL(P || Q) over the full vocabulary, top-1 agreement, the NLL of the real next token, identity."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OpencotiError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, P and Q given as logits over the full vocabulary (nats, float64)."""
    lp = log_softmax(p_logits)
    lq = log_softmax(q_logits)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def top1(logits: np.ndarray) -> np.ndarray:
    return np.asarray(logits).argmax(axis=-1)


def iter_logit_rows(path: Path, n_vocab: int, chunk: int = 16) -> Iterator[np.ndarray]:
    data = np.memmap(path, dtype=np.float32, mode="r")
    if data.size % n_vocab:
        raise OpencotiError(f"{path}: {data.size} floats is not a whole number of {n_vocab}-wide rows")
    rows = data.reshape(-1, n_vocab)
    for i in range(0, rows.shape[0], chunk):
        yield np.array(rows[i:i + chunk])


def compare_logits(ref: Path, other: Path, n_vocab: int,
                   targets: Sequence[int] | None = None) -> dict[str, Any]:
    """Per-step KL(ref || other), top-1 agreement, next-token NLL of both against ``targets``."""
    kls: list[np.ndarray] = []
    agree: list[np.ndarray] = []
    nll_ref: list[np.ndarray] = []
    nll_other: list[np.ndarray] = []
    off = 0
    for a, b in zip(iter_logit_rows(ref, n_vocab), iter_logit_rows(other, n_vocab), strict=True):
        kls.append(kl_divergence(a, b))
        agree.append(top1(a) == top1(b))
        if targets is not None:
            t = np.asarray(targets[off:off + a.shape[0]])
            nll_ref.append(-log_softmax(a)[np.arange(len(t)), t])
            nll_other.append(-log_softmax(b)[np.arange(len(t)), t])
        off += a.shape[0]
    kl = np.concatenate(kls)
    ag = np.concatenate(agree)
    out: dict[str, Any] = {
        "steps": int(kl.size), "kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
        "kl_p95": float(np.quantile(kl, 0.95)), "kl_max": float(kl.max()),
        "top1_agreement": float(ag.mean()), "top1_disagreements": int((~ag).sum()),
        "identical": files_identical(ref, other),
    }
    if targets is not None:
        nr, no = np.concatenate(nll_ref), np.concatenate(nll_other)
        out |= {"nll_ref": float(nr.mean()), "nll": float(no.mean()),
                "ppl_ref": float(np.exp(nr.mean())), "ppl": float(np.exp(no.mean()))}
    return out


def files_identical(a: Path, b: Path, chunk: int = 1 << 22) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True

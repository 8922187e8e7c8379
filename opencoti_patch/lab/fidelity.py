"""Decode fidelity, the one way the lab measures it: a text prefilled, then teacher-forced single-token decode
steps with the logits of every step dumped, under every attention config of the context; per config after
dense, KL(dense || config) over the full vocabulary, top-1 agreement and the NLL of the text's next token
(:func:`~opencoti_patch.lab.logits.compare_logits`). The eval gates (:mod:`.evaluate`) and the selector tools
(:mod:`.needle`) choose the texts and the configs and report the rows."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import OpencotiError
from .batch import Decoded, Group, Harness, decode, slug
from .logits import compare_logits
from .variants import AttnConfig

MIN_PREFILL = 256  # tokens of context before the first decode step


def run_fidelity(harness: Harness, n_ctx: int, configs: Sequence[AttnConfig],
                 texts: Sequence[tuple[str, str]], *, steps: int, margin: int, shared_prefill: bool,
                 jobs: int = 1, show_progress: bool = False,
                 work_dir: Path | None = None) -> tuple[list[dict[str, Any]], Decoded]:
    """Each of ``texts`` (id, text) prefilled to ``n_ctx - steps - margin`` tokens and decoded ``steps``
    teacher-forced steps under each of ``configs`` (dense first): a row per text and config after dense
    (its ``text`` id, its ``cfg``, ``n_prefill``, the comparison with dense, ``select_nodes_per_step``), and
    what was decoded. The dumps live in a temporary folder (under ``work_dir``) for the call."""
    n_prefill = n_ctx - steps - margin
    if n_prefill < MIN_PREFILL:
        raise OpencotiError(f"context {n_ctx} too small for {steps} decode steps")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="opencoti-fidelity-", dir=work_dir) as tmp:
        reqs = tuple({"id": tid, "text": text, "n_prefill": n_prefill, "n_forced": steps,
                      "dump": str(Path(tmp) / f"{slug(tid)}.f32"), "return_targets": True}
                     for tid, text in texts)
        group = Group(n_ctx, tuple(configs), reqs, f"fidelity {n_ctx}")
        decoded = decode(harness, [group], shared_prefill=shared_prefill, jobs=jobs,
                         show_progress=show_progress)
        by_cfg = decoded.results[0]
        for req in reqs:
            dense = by_cfg[configs[0].name][req["id"]]
            if dense["n_tokens"] < n_prefill + steps + 1:
                raise OpencotiError(f"the fidelity text {req['id']} has {dense['n_tokens']} tokens, "
                                    f"need {n_prefill + steps + 1}")
            for cfg in configs[1:]:
                ref, other = (Path(f"{req['dump']}.{c.name}") for c in (configs[0], cfg))
                m = compare_logits(ref, other, int(dense["n_vocab"]), dense.get("targets"))
                rows.append({"text": req["id"], "cfg": cfg, "n_prefill": n_prefill, **m,
                             "select_nodes_per_step": by_cfg[cfg.name][req["id"]]["select_nodes"] / steps})
    return rows, decoded

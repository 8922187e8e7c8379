"""Quality gates of the sparse-attention stack on a real model, on CPU: passkey retrieval and decode fidelity.

Both gates drive ``opencoti-harness-batch`` (``harness/``, built against a llama.cpp build): one process per
(context size, attention config) runs every request of that group, so the model is loaded once per group.

- **passkey**: seeded prompts (filler text, a 5-digit pass key at a depth of 0-100%, a plain Q/A frame at
  the end). The prompt minus its last token is prefilled (prompt processing: dense in every config); the last
  prompt token and the answer tokens are single-token decode steps, so with ``--sparse-attn on`` every answer
  token comes from a step that ran the block selection. Dense and sparse see the same samples; accuracy,
  and how often sparse gives the same answer as dense.
- **fidelity**: a long real text; prefill P tokens, then N teacher-forced single-token decode steps with the
  logits of every step dumped. KL(dense || sparse) over the full vocabulary and top-1 agreement per step, per
  budget. The select-all config (top-k covers every block, min-ctx 1 so the select op still runs) must give
  logits bitwise identical to dense: anything else is a hard failure (plumbing check).

The harness counts the SPARSE_ATTN_SELECT nodes computed in the decode steps: a sparse run where they are zero
(the path silently fell back to dense) is an error, as is a dense run where they are not.

Budgets: ``top_k = round(fraction * n_ctx / block_size)`` blocks chosen by score ("exclusive" accounting,
the default); the sink and recent blocks are always attended on top of them and reported separately
(attended = top_k + sink blocks + recent blocks). "inclusive" accounting subtracts them from the budget.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Settings, write_report
from ..errors import CheckFailed, OpencotiError
from ..stack.gitrun import run_git
from .batch import Harness, Task, run_tasks, slug
from .logits import compare_logits
from .variants import DENSE, budget_config, select_all_config, window_config

# ----------------------------------------------------------------------------------------------------
# passkey
# ----------------------------------------------------------------------------------------------------

PASSKEY_HEADER = ("There is an important info hidden inside a lot of irrelevant text. "
                  "Find it and memorize it. I will quiz you about the important information there.\n\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. "
PASSKEY_QUESTION = "\nQuestion: What is the pass key?\nAnswer: The pass key is"


@dataclasses.dataclass(frozen=True)
class PasskeySample:
    sid: str
    n_ctx: int
    depth: float  # fraction of the filler before the needle
    key: str
    n_filler: int
    needle_tok: int = -1  # estimated first token of the needle (-1: unknown)

    @property
    def n_before(self) -> int:
        return round(self.depth * self.n_filler)

    def prompt(self) -> str:
        return passkey_prompt(self.n_filler, self.n_before, self.key)


def passkey_prompt(n_filler: int, n_before: int, key: str) -> str:
    if not 0 <= n_before <= n_filler:
        raise ValueError(f"needle position {n_before} outside 0..{n_filler}")
    return (PASSKEY_HEADER + PASSKEY_FILLER * n_before + PASSKEY_NEEDLE.format(key=key)
            + PASSKEY_FILLER * (n_filler - n_before) + PASSKEY_QUESTION)


@dataclasses.dataclass(frozen=True)
class TokenFit:
    """Prompt tokens = base + per_filler * n_filler (measured with the model's tokenizer); the needle starts
    near token header + per_filler * n_before (``header``: the tokens of PASSKEY_HEADER, BOS included)."""

    base: int
    per_filler: float
    header: int | None = None

    def n_filler(self, target_tokens: int) -> int:
        n = int((target_tokens - self.base) // self.per_filler)
        if n < 1:
            raise OpencotiError(f"a {target_tokens}-token prompt leaves no room for filler")
        return n


def passkey_samples(seed: int, per_ctx: dict[int, int], fit: TokenFit,
                    margin: int = 64) -> list[PasskeySample]:
    """``per_ctx[n_ctx]`` samples per context, depths evenly spaced over 0..100%, keys drawn from ``seed``.

    The prompt fills ``n_ctx - margin`` tokens (the margin holds the answer and tokenizer slack).
    """
    out = []
    for n_ctx, count in per_ctx.items():
        if count < 1:
            raise OpencotiError(f"need at least one sample for context {n_ctx}")
        rng = random.Random(seed * 1_000_003 + n_ctx)
        n_filler = fit.n_filler(n_ctx - margin)
        for i in range(count):
            depth = i / (count - 1) if count > 1 else 0.5
            key = f"{rng.randrange(10_000, 100_000)}"
            n_before = round(depth * n_filler)
            needle = -1 if fit.header is None else round(fit.header + n_before * fit.per_filler)
            out.append(PasskeySample(f"c{n_ctx}-{i:03d}", n_ctx, depth, key, n_filler, needle))
    return out


def parse_samples_spec(text: str) -> dict[int, int]:
    """``"2048:50,4096:32,8192:20"`` -> {2048: 50, 4096: 32, 8192: 20}."""
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


_NUMBER = re.compile(r"\d+")


def parse_answer(text: str) -> str | None:
    """The first run of digits of the generated text (" 12345. Remember" -> "12345"), or None."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def calibrate_tokens(harness: Harness, n_probe: int = 64) -> TokenFit:
    reqs = [{"id": f"fit{n}", "text": passkey_prompt(n, n // 2, "12345"), "tokenize_only": True}
            for n in (0, n_probe)]
    reqs.append({"id": "fit-header", "text": PASSKEY_HEADER, "tokenize_only": True})
    res = harness.run(reqs, 512, DENSE, "tokenizer fit").results
    t0, t1, th = (int(r["n_tokens"]) for r in res)
    return TokenFit(base=t0, per_filler=(t1 - t0) / n_probe, header=th)


def depth_bucket(depth: float, n_buckets: int = 5) -> int:
    return min(int(depth * n_buckets), n_buckets - 1)


NEEDLE_SPAN = 16  # tokens of the needle sentence, rounded up
NEEDLE_SLACK = 16  # tokenizer slack of the estimated needle position


def needle_in_kept_blocks(needle_tok: int, n_tokens: int, cfg: dict[str, Any]) -> bool:
    """Whether the needle may lie in a block every sparse step keeps (sink or recent) at the first answer
    step (n_kv = n_tokens): such a sample cannot test the selection. ``cfg``: AttnConfig.describe()."""
    b = int(cfg["block_size"])
    start, end = needle_tok - NEEDLE_SLACK, needle_tok + NEEDLE_SPAN + NEEDLE_SLACK
    sink_end = int(cfg["sink_blocks"]) * b
    recent_start = ((n_tokens - 1) // b - int(cfg["recent_blocks"]) + 1) * b
    return start < sink_end or end > recent_start


def passkey_gate(samples: Sequence[PasskeySample], answers: dict[str, dict[str, str | None]],
                 configs: dict[str, dict[str, Any]], n_tokens: dict[str, int], gate_fraction: float = 0.5,
                 gate_slack: int = 1, min_dense_accuracy: float = 0.9) -> dict[str, Any]:
    """The passkey gate, per sparse config at ``gate_fraction``: counted only on samples whose needle lies
    outside the always-kept sink/recent blocks (the others are reported apart), dense must be good there
    (>= ``min_dense_accuracy``), the sparse config within ``gate_slack`` of dense, and strictly ahead of the
    sliding-window baseline of the same attended size. Named by the share of the context attended."""
    def correct(name: str, group: Sequence[PasskeySample]) -> int:
        return sum(answers.get(name, {}).get(s.sid) == s.key for s in group)

    def at_gate(name: str, window: bool) -> bool:
        c = configs.get(name, {})
        return (bool(c.get("sparse")) and c.get("fraction") == gate_fraction
                and bool(c.get("window")) == window)

    windows = [n for n in answers if at_gate(n, True)]
    checks = []
    for name in (n for n in answers if at_gate(n, False)):
        by_ctx = configs[name].get("by_ctx", {})
        known = [s for s in samples if s.needle_tok >= 0 and s.sid in n_tokens and s.n_ctx in by_ctx]
        gated = [s for s in known
                 if not needle_in_kept_blocks(s.needle_tok, n_tokens[s.sid], by_ctx[s.n_ctx])]
        kept = [s for s in known if s not in gated]
        shares = [by_ctx[c]["attended_fraction"] for c in sorted({s.n_ctx for s in samples}) if c in by_ctx]
        dense_ok = correct("dense", gated)
        c: dict[str, Any] = {
            "config": name, "n": len(gated), "n_kept": len(kept), "n_unknown": len(samples) - len(known),
            "attended_min": min(shares, default=0.0), "attended_max": max(shares, default=0.0),
            "correct": correct(name, gated), "dense_correct": dense_ok,
            "dense_accuracy": dense_ok / len(gated) if gated else 0.0,
            "kept_correct": correct(name, kept), "kept_dense_correct": correct("dense", kept),
            "window": windows[0] if windows else None,
            "window_correct": correct(windows[0], gated) if windows else None}
        reasons = []
        if not gated:
            reasons.append("no sample with the needle outside the sink and recent blocks")
        elif c["dense_accuracy"] < min_dense_accuracy:
            reasons.append(f"dense itself only {dense_ok}/{len(gated)} (< {min_dense_accuracy:.0%})")
        if c["correct"] < dense_ok - gate_slack:
            reasons.append(f"{c['correct']} correct, dense {dense_ok} (slack {gate_slack})")
        if c["window"] is None:
            reasons.append("no window baseline at this budget")
        elif c["correct"] <= c["window_correct"]:
            reasons.append(f"does not beat the window baseline ({c['correct']} vs {c['window_correct']})")
        c["reasons"] = reasons
        c["passed"] = not reasons
        checks.append(c)
    return {"fraction": gate_fraction, "slack": gate_slack, "min_dense_accuracy": min_dense_accuracy,
            "dense_correct": checks[0]["dense_correct"] if checks else 0, "checks": checks,
            "passed": bool(checks) and all(c["passed"] for c in checks)}


def passkey_summary(samples: Sequence[PasskeySample], answers: dict[str, dict[str, str | None]],
                    configs: dict[str, dict[str, Any]], n_tokens: dict[str, int] | None = None,
                    gate_fraction: float = 0.5, gate_slack: int = 1, n_buckets: int = 5) -> dict[str, Any]:
    """Accuracy per context/config, agreement with dense, accuracy per depth bucket, and the gate.

    ``answers[config_name][sample_id]`` = parsed answer; ``configs[config_name]`` = describe() per context
    (key ``by_ctx``) plus ``sparse``/``fraction``/``window``; ``n_tokens[sample_id]`` = prompt tokens.
    """
    contexts = sorted({s.n_ctx for s in samples})
    names = list(answers)
    rows = []
    totals: dict[str, dict[str, int]] = {n: {"n": 0, "correct": 0, "same": 0} for n in names}
    for n_ctx in contexts:
        group = [s for s in samples if s.n_ctx == n_ctx]
        for name in names:
            correct = sum(answers[name].get(s.sid) == s.key for s in group)
            same = sum(answers[name].get(s.sid) == answers["dense"].get(s.sid) for s in group)
            t = totals[name]
            t["n"] += len(group)
            t["correct"] += correct
            t["same"] += same
            rows.append({"n_ctx": n_ctx, "config": name, "n": len(group), "correct": correct,
                         "accuracy": correct / len(group), "same_as_dense": same,
                         "agreement": same / len(group), **_cfg_cols(configs, name, n_ctx)})
    buckets = []
    for b in range(n_buckets):
        group = [s for s in samples if depth_bucket(s.depth, n_buckets) == b]
        if not group:
            continue
        row: dict[str, Any] = {"lo": b / n_buckets, "hi": (b + 1) / n_buckets, "n": len(group)}
        for name in names:
            row[name] = sum(answers[name].get(s.sid) == s.key for s in group)
        buckets.append(row)
    overall = [{"config": n, **t, "accuracy": t["correct"] / t["n"] if t["n"] else 0.0,
                "agreement": t["same"] / t["n"] if t["n"] else 0.0} for n, t in totals.items()]
    gate = passkey_gate(samples, answers, configs, n_tokens or {}, gate_fraction, gate_slack)
    disagreements = [{"sid": s.sid, "n_ctx": s.n_ctx, "depth": s.depth, "key": s.key,
                      **{n: answers[n].get(s.sid) for n in names}}
                     for s in samples
                     if any(answers[n].get(s.sid) != answers["dense"].get(s.sid) for n in names)]
    return {"contexts": contexts, "configs": names, "rows": rows, "overall": overall,
            "depth_buckets": buckets, "gate": gate, "disagreements": disagreements}


def _cfg_cols(configs: dict[str, dict[str, Any]], name: str, n_ctx: int) -> dict[str, Any]:
    d = configs.get(name, {}).get("by_ctx", {}).get(n_ctx, {})
    return {"topk": d.get("topk", 0), "attended_tokens": d.get("attended_tokens", n_ctx),
            "attended_fraction": d.get("attended_fraction", 1.0)}


# Prefix reuse between consecutive passkey prompts: a multiple of the sparse block size (no half-written block
# after llama_memory_seq_rm) and of the KV padding. Measured: logits bitwise equal to a fresh prefill.
REUSE_ALIGN = 256


def passkey_requests(group: Sequence[PasskeySample], n_generate: int,
                     reuse: bool) -> tuple[dict[str, Any], ...]:
    """Deepest needle first: each prompt shares its text up to its own needle with the one before it."""
    ordered = sorted(group, key=lambda s: (-s.depth, s.sid))
    return tuple({"id": s.sid, "text": s.prompt(), "n_generate": n_generate,
                  **({"reuse_prefix": REUSE_ALIGN} if reuse else {})} for s in ordered)


def run_passkey(harness: Harness, *, seed: int, per_ctx: dict[int, int], fractions: Sequence[float],
                accounting: str, n_generate: int = 8, jobs: int = 2, reuse: bool = True,
                gate_fraction: float = 0.5, show_progress: bool = True) -> dict[str, Any]:
    t_start = time.monotonic()
    fit = calibrate_tokens(harness)
    samples = passkey_samples(seed, per_ctx, fit)
    contexts = list(per_ctx)
    tasks = []
    for n_ctx in contexts:
        reqs = passkey_requests([s for s in samples if s.n_ctx == n_ctx], n_generate, reuse)
        budgets = [budget_config(n_ctx, f, accounting=accounting) for f in fractions]
        for cfg in [DENSE, *budgets, *(window_config(b, n_ctx) for b in budgets)]:
            tasks.append(Task(n_ctx, cfg, reqs, f"passkey {n_ctx} {cfg.name}"))
    runs = run_tasks(harness, tasks, jobs, f"passkey ({len(tasks)} runs)", show_progress)
    answers: dict[str, dict[str, str | None]] = {"dense": {}}
    raw: dict[str, dict[str, dict[str, Any]]] = {"dense": {}}
    configs: dict[str, dict[str, Any]] = {"dense": {"sparse": False, "fraction": None, "by_ctx": {}}}
    for run in runs:
        cfg, n_ctx = run.cfg, run.n_ctx
        entry = configs.setdefault(cfg.name, {"sparse": cfg.sparse, "fraction": cfg.fraction,
                                              "window": cfg.window, "by_ctx": {}})
        entry["by_ctx"][n_ctx] = cfg.describe(n_ctx)
        for r in run.results:
            if r["n_tokens"] + n_generate > n_ctx:
                raise OpencotiError(f"sample {r['id']}: {r['n_tokens']} prompt tokens do not fit {n_ctx}")
            answers.setdefault(cfg.name, {})[r["id"]] = parse_answer(r["text"])
            raw.setdefault(cfg.name, {})[r["id"]] = {k: r.get(k) for k in ("n_tokens", "text", "select_nodes",
                                                                             "decode_steps", "reused")}
    n_tokens = {sid: int(r["n_tokens"]) for sid, r in raw["dense"].items()}
    summary = passkey_summary(samples, answers, configs, n_tokens, gate_fraction=gate_fraction)
    for d in summary["disagreements"]:  # what each config actually generated there
        d["texts"] = {name: raw[name][d["sid"]]["text"] for name in raw if d["sid"] in raw[name]}
    prompt_tokens = {n: sorted(raw["dense"][s.sid]["n_tokens"] for s in samples if s.n_ctx == n)
                     for n in contexts}
    return {
        "seed": seed, "per_ctx": per_ctx, "n_samples": len(samples), "fractions": list(fractions),
        "accounting": accounting, "n_generate": n_generate, "token_fit": dataclasses.asdict(fit),
        "reuse_prefix": REUSE_ALIGN if reuse else 0, "jobs": jobs,
        "prompt_tokens": {n: {"min": v[0], "max": v[-1]} for n, v in prompt_tokens.items()},
        "frame": {"header": PASSKEY_HEADER, "filler": PASSKEY_FILLER, "needle": PASSKEY_NEEDLE,
                  "question": PASSKEY_QUESTION},
        "configs": configs, "summary": summary, "timings": [r.timing() for r in runs],
        "select_nodes_per_step": _select_per_step(raw), "seconds": time.monotonic() - t_start,
        "samples": [{**dataclasses.asdict(s), **{f"answer_{n}": answers[n].get(s.sid) for n in answers},
                     "n_tokens": raw["dense"][s.sid]["n_tokens"]} for s in samples],
    }


def _select_per_step(raw: dict[str, dict[str, dict[str, Any]]]) -> dict[str, list[float]]:
    out = {}
    for name, by_id in raw.items():
        vals = sorted({r["select_nodes"] / r["decode_steps"] for r in by_id.values() if r["decode_steps"]})
        out[name] = vals
    return out


def fidelity_text(docs_dir: Path, max_chars: int) -> tuple[str, list[str]]:
    """The ``*.md`` files of ``docs_dir`` in name order, joined by blank lines, cut at ``max_chars``."""
    files = sorted(p for p in docs_dir.glob("*.md") if p.is_file())
    if not files:
        raise OpencotiError(f"no *.md files in {docs_dir}")
    parts: list[str] = []
    used: list[str] = []
    size = 0
    for p in files:
        if size >= max_chars:
            break
        text = p.read_text(errors="replace")
        parts.append(text)
        used.append(p.name)
        size += len(text) + 2
    return "\n\n".join(parts)[:max_chars], used


def run_fidelity(harness: Harness, *, docs_dir: Path, contexts: Sequence[int], steps: int,
                 fractions: Sequence[float], accounting: str, jobs: int = 2, work_dir: Path | None = None,
                 window_baseline: bool = True, gate_fraction: float = 0.5,
                 show_progress: bool = True) -> dict[str, Any]:
    t_start = time.monotonic()
    runs: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="opencoti-fidelity-", dir=work_dir) as tmp:
        for n_ctx in contexts:
            n_prefill = n_ctx - steps - 64
            if n_prefill < 256:
                raise OpencotiError(f"context {n_ctx} too small for {steps} decode steps")
            text, used = fidelity_text(docs_dir, max_chars=(n_ctx + 64) * 8)
            budgets = [budget_config(n_ctx, f, accounting=accounting) for f in fractions]
            windows = [window_config(b, n_ctx) for b in budgets] if window_baseline else []
            cfgs = [DENSE, *budgets, *windows, select_all_config(n_ctx)]
            dumps = {c.name: Path(tmp) / f"{n_ctx}-{slug(c.name.replace('%', 'pct'))}.f32" for c in cfgs}
            tasks = [Task(n_ctx, c, ({"id": f"fidelity-{n_ctx}", "text": text, "n_prefill": n_prefill,
                                      "n_forced": steps, "dump": str(dumps[c.name]),
                                      "return_targets": True},), f"fidelity {n_ctx} {c.name}") for c in cfgs]
            done = run_tasks(harness, tasks, jobs, f"fidelity {n_ctx} ({len(tasks)} runs)", show_progress)
            timings += [r.timing() for r in done]
            results = {r.cfg.name: r.results[0] for r in done}
            dense = results["dense"]
            if dense["n_tokens"] < n_prefill + steps + 1:
                raise OpencotiError(f"the fidelity text has {dense['n_tokens']} tokens, "
                                    f"need {n_prefill + steps + 1}")
            n_vocab = int(dense["n_vocab"])
            for cfg in cfgs[1:]:
                m = compare_logits(dumps["dense"], dumps[cfg.name], n_vocab, dense.get("targets"))
                runs.append({"n_ctx": n_ctx, "n_prefill": n_prefill, "config": cfg.name, **m,
                             "select_nodes_per_step": results[cfg.name]["select_nodes"] / steps,
                             "cfg": cfg.describe(n_ctx), "docs": used})
            for d in dumps.values():
                d.unlink(missing_ok=True)
    bad = [r for r in runs if r["config"] == "select-all" and not r["identical"]]
    return {"steps": steps, "fractions": list(fractions), "accounting": accounting, "docs_dir": str(docs_dir),
            "runs": runs, "timings": timings, "seconds": time.monotonic() - t_start, "jobs": jobs,
            "select_all_identical": not bad and any(r["config"] == "select-all" for r in runs),
            "gate": fidelity_gate(runs, gate_fraction)}


def fidelity_gate(runs: Sequence[dict[str, Any]], gate_fraction: float = 0.5) -> dict[str, Any]:
    """Per context: the sparse config at ``gate_fraction`` must beat the sliding-window baseline of the same
    attended size, on KL(dense || .) (strictly lower mean) and on the text's NLL (not higher); with no window
    run the gate fails (a selector that recency alone matches adds nothing)."""
    def at_gate(r: dict[str, Any], window: bool) -> bool:
        cfg = r.get("cfg", {})
        is_window = cfg.get("window", str(r.get("config", "")).startswith("window-"))  # runs recorded before
        return bool(cfg.get("sparse")) and cfg.get("fraction") == gate_fraction and bool(is_window) == window

    checks = []
    for r in (r for r in runs if at_gate(r, False)):
        w = next((x for x in runs if x["n_ctx"] == r["n_ctx"] and at_gate(x, True)), None)
        reasons = []
        if w is None:
            reasons.append("no window baseline at this budget")
        else:
            if not r["kl_mean"] < w["kl_mean"]:
                reasons.append(f"KL mean {r['kl_mean']:.3g} not below the window's {w['kl_mean']:.3g}")
            if "nll" in r and "nll" in w and r["nll"] > w["nll"]:
                reasons.append(f"NLL {r['nll']:.4f} above the window's {w['nll']:.4f}")
        checks.append({"n_ctx": r["n_ctx"], "config": r["config"], "window": w["config"] if w else None,
                       "attended_fraction": r["cfg"]["attended_fraction"], "kl_mean": r["kl_mean"],
                       "window_kl_mean": w["kl_mean"] if w else None, "nll": r.get("nll"),
                       "window_nll": w.get("nll") if w else None, "reasons": reasons, "passed": not reasons})
    return {"fraction": gate_fraction, "checks": checks,
            "passed": bool(checks) and all(c["passed"] for c in checks)}


def check_gates(update: dict[str, Any]) -> None:
    """Raise on any failed gate of an eval run (select-all identity first: the plumbing must be exact)."""
    if "fidelity" in update:
        check_select_all(update["fidelity"])
        g = update["fidelity"]["gate"]
        if not g["passed"]:
            why = [f"{c['n_ctx']} {c['config']}: {'; '.join(c['reasons'])}" for c in g["checks"]]
            raise CheckFailed(f"fidelity gate failed: {', '.join(why) or 'no sparse run at the gate budget'}")
    if "passkey" in update:
        g = update["passkey"]["summary"]["gate"]
        if not g["passed"]:
            why = [f"{c['config']}: {'; '.join(c['reasons'])}" for c in g["checks"]]
            raise CheckFailed(f"passkey gate failed: {', '.join(why) or 'no sparse run at the gate budget'}")


def check_select_all(fid: dict[str, Any]) -> None:
    for r in fid["runs"]:
        if r["config"] == "select-all" and not r["identical"]:
            raise CheckFailed(f"fidelity {r['n_ctx']}: select-all logits differ from dense (KL mean "
                              f"{r['kl_mean']:.3g}, top-1 agreement {r['top1_agreement']:.2%}): the sparse "
                              "plumbing is not exact")


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------


def merge_results(path: Path, update: dict[str, Any]) -> dict[str, Any]:
    """Load ``path`` (JSON) if present, overwrite the keys of ``update``, write it back (sorted keys)."""
    data: dict[str, Any] = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            data = {}
    data.update(update)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_report(path, json.dumps(_jsonable(data), indent=1, sort_keys=True) + "\n")
    return json.loads(path.read_text())


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def save_gate_results(out_dir: Path, name: str, update: dict[str, Any],
                      meta: dict[str, Any] | None) -> tuple[Path, Path]:
    """Merge the gates of ``update`` (and ``meta``) into ``<out-dir>/<name>.json``, render its .md.

    Gates run separately merge: the commands of the gates run before are kept in ``meta``.
    ``meta`` None: only re-render (after a template change). Returns (md, json) paths.
    """
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    if meta is not None:
        old = merge_results(json_path, {}) if json_path.is_file() else {}
        if "meta" in old:  # keep the commands of the gates run before
            meta["cli"] = sorted(set(old["meta"].get("cli", [])) | set(meta.get("cli", [])))
            before = old["meta"].get("harness_commands", [])
            meta["harness_commands"] = list(dict.fromkeys(before + meta.get("harness_commands", [])))
        update = {**update, "meta": meta}
    data = merge_results(json_path, update)
    fid = data.get("fidelity")
    if fid and "gate" not in fid:  # recorded before the gate existed: apply it to the recorded runs
        fid["gate"] = fidelity_gate(fid["runs"])
    write_report(md_path, render_report(default_template_dirs(), data))
    return md_path, json_path


def render_report(template_dirs: Iterable[Path], data: dict[str, Any]) -> str:
    from ..report import render  # noqa: PLC0415 (click-free callers of the math need not import jinja2)

    return render(list(template_dirs), "quality.md.j2", **data_for_template(data))


def data_for_template(data: dict[str, Any]) -> dict[str, Any]:
    return {"meta": data.get("meta", {}), "passkey": data.get("passkey"), "fidelity": data.get("fidelity")}


def default_template_dirs() -> list[Path]:
    """The project's template override, then the shipped templates (``Settings.templates_dirs``)."""
    return Settings.resolve().templates_dirs


def build_meta(build_dir: Path) -> dict[str, Any]:
    """A few CMake cache facts of the llama.cpp build the harness ran on (speed depends on them)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return {}
    keys = ("CMAKE_BUILD_TYPE", "GGML_NATIVE", "GGML_CUDA", "BUILD_SHARED_LIBS")
    found = {}
    for line in cache.read_text(errors="replace").splitlines():
        name, _, value = line.partition("=")
        name = name.split(":")[0]
        if name in keys:
            found[name] = value
    note = ", ".join(f"{k}={found[k]}" for k in keys if k in found)
    return {"build_dir": str(build_dir), "build_cache": found,
            "build_note": f"llama.cpp build `{build_dir}` ({note})."}


def environment_meta(model: Path, harness: Harness, tree: Path | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"model": model.name, "model_path": str(model), "threads": harness.threads,
                            "harness": str(harness.exe), "cpu_count": os.cpu_count(),
                            "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if tree is not None and (tree / ".git").exists():
        def git(*args: str) -> str:
            return run_git(tree, *args).text.strip()
        meta["tree"] = str(tree)
        meta["tree_head"] = git("rev-parse", "--short", "HEAD")
        meta["tree_dirty_files"] = len([ln for ln in git("status", "--porcelain").splitlines() if ln])
    return meta

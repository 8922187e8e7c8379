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
  logits bitwise identical to dense: anything else is a hard failure (plumbing check), and a fidelity run
  without it proves nothing.

Each gate is judged by the shared verdict (:mod:`..verdict`): a gate check FAILs on a sparse config behind
dense or not ahead of the window baseline, or on a NaN metric; it proves nothing (INCOMPLETE) on fewer than
``min_samples`` gated samples (passkey: needles outside the always-kept blocks; fidelity: decode steps;
:data:`MIN_GATE_SAMPLES` by default) or where dense itself fails the passkey floor; no gate at all is
INCOMPLETE.

The harness counts the SPARSE_ATTN_SELECT nodes computed in the decode steps: a sparse run where they are zero
(the path silently fell back to dense) is an error, as is a dense run where they are not.

Budgets: ``top_k = round(fraction * n_ctx / block_size)`` blocks chosen by score ("exclusive" accounting,
the default); the sink and recent blocks are always attended on top of them and reported separately
(attended = top_k + sink blocks + recent blocks). "inclusive" accounting subtracts them from the budget.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckFailed, OpencotiError
from ..verdict import Check, Verdict, verdict_of
from .batch import Group, Harness
from .fidelity import run_fidelity
from .passkey import run_passkey
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


def calibrate_tokens(harness: Harness, n_probe: int = 64) -> TokenFit:
    reqs = [{"id": f"fit{n}", "text": passkey_prompt(n, n // 2, "12345"), "tokenize_only": True}
            for n in (0, n_probe)]
    reqs.append({"id": "fit-header", "text": PASSKEY_HEADER, "tokenize_only": True})
    res = harness.run(reqs, 512, DENSE, "tokenizer fit").results
    t0, t1, th = (int(r["n_tokens"]) for r in res)
    return TokenFit(base=t0, per_filler=(t1 - t0) / n_probe, header=th)


def depth_bucket(depth: float, n_buckets: int = 5) -> int:
    return min(int(depth * n_buckets), n_buckets - 1)


MIN_GATE_SAMPLES = 20  # gated passkey samples / fidelity decode steps a gate needs to prove anything

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


def _status(reasons: Sequence[str], unproven: Sequence[str]) -> str:
    """A gate check's status: FAIL on a failure reason, else "not checked" when it proved nothing."""
    return "FAIL" if reasons else ("not checked" if unproven else "pass")


def passkey_gate(samples: Sequence[PasskeySample], answers: dict[str, dict[str, str | None]],
                 configs: dict[str, dict[str, Any]], n_tokens: dict[str, int], gate_fraction: float = 0.5,
                 gate_slack: int = 1, min_dense_accuracy: float = 0.9,
                 min_samples: int = MIN_GATE_SAMPLES) -> dict[str, Any]:
    """The passkey gate, per sparse config at ``gate_fraction``: counted only on samples whose needle lies
    outside the always-kept sink/recent blocks (the others are reported apart), the sparse config within
    ``gate_slack`` of dense and strictly ahead of the sliding-window baseline of the same attended size
    (else FAIL). It proves nothing ("not checked") on fewer than ``min_samples`` such samples or where dense
    itself finds fewer than ``min_dense_accuracy`` of them. Named by the share of the context attended."""
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
        reasons: list[str] = []
        unproven: list[str] = []  # the gate proved nothing: no samples to count, or dense itself is bad
        if not gated:
            unproven.append("no sample with the needle outside the sink and recent blocks")
        elif c["dense_accuracy"] < min_dense_accuracy:
            unproven.append(f"dense itself only {dense_ok}/{len(gated)} (< {min_dense_accuracy:.0%})")
        if c["correct"] < dense_ok - gate_slack:
            reasons.append(f"{c['correct']} correct, dense {dense_ok} (slack {gate_slack})")
        if c["window"] is None:
            reasons.append("no window baseline at this budget")
        elif c["correct"] <= c["window_correct"]:
            reasons.append(f"does not beat the window baseline ({c['correct']} vs {c['window_correct']})")
        if not unproven and not reasons and len(gated) < min_samples:
            unproven.append(f"only {len(gated)} gated samples (needle outside the sink and recent blocks), "
                            f"at least {min_samples} needed")
        # with nothing to count or a dense control that fails itself, the comparisons mean nothing
        c["reasons"] = unproven + reasons
        c["status"] = "not checked" if unproven else _status(reasons, ())
        c["passed"] = c["status"] == "pass"
        checks.append(c)
    gate = {"fraction": gate_fraction, "slack": gate_slack, "min_dense_accuracy": min_dense_accuracy,
            "min_samples": min_samples, "dense_correct": checks[0]["dense_correct"] if checks else 0,
            "checks": checks}
    return gate | {"verdict": gate_verdict("passkey", gate).verdict,
                   "passed": bool(checks) and all(c["passed"] for c in checks)}


def passkey_summary(samples: Sequence[PasskeySample], answers: dict[str, dict[str, str | None]],
                    configs: dict[str, dict[str, Any]], n_tokens: dict[str, int] | None = None,
                    gate_fraction: float = 0.5, gate_slack: int = 1, n_buckets: int = 5,
                    min_samples: int = MIN_GATE_SAMPLES) -> dict[str, Any]:
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
    gate = passkey_gate(samples, answers, configs, n_tokens or {}, gate_fraction, gate_slack,
                        min_samples=min_samples)
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


def gate_passkey(harness: Harness, *, seed: int, per_ctx: dict[int, int], fractions: Sequence[float],
                 accounting: str, n_generate: int = 8, jobs: int = 2, reuse: bool = True,
                 gate_fraction: float = 0.5, show_progress: bool = True,
                 min_samples: int = MIN_GATE_SAMPLES) -> dict[str, Any]:
    """The passkey gate's run: seeded filler prompts per context decoded dense, at each budget and the window
    of each budget, one process each (:func:`~.passkey.run_passkey`), and the gate over the answers."""
    t_start = time.monotonic()
    fit = calibrate_tokens(harness)
    samples = passkey_samples(seed, per_ctx, fit)
    contexts = list(per_ctx)
    groups = []
    for n_ctx in contexts:
        reqs = passkey_requests([s for s in samples if s.n_ctx == n_ctx], n_generate, reuse)
        budgets = [budget_config(n_ctx, f, accounting=accounting) for f in fractions]
        groups.append(Group(n_ctx, (DENSE, *budgets, *(window_config(b, n_ctx) for b in budgets)), reqs,
                            f"passkey {n_ctx}"))
    per_group, decoded = run_passkey(harness, groups, n_generate=n_generate, shared_prefill=False, jobs=jobs,
                                     show_progress=show_progress)
    answers: dict[str, dict[str, str | None]] = {"dense": {}}
    raw: dict[str, dict[str, dict[str, Any]]] = {"dense": {}}
    configs: dict[str, dict[str, Any]] = {"dense": {"sparse": False, "fraction": None, "by_ctx": {}}}
    for g, group_answers, by_cfg in zip(groups, per_group, decoded.results, strict=True):
        for cfg in g.configs:
            entry = configs.setdefault(cfg.name, {"sparse": cfg.sparse, "fraction": cfg.fraction,
                                                  "window": cfg.window, "by_ctx": {}})
            entry["by_ctx"][g.n_ctx] = cfg.describe(g.n_ctx)
            answers.setdefault(cfg.name, {}).update(group_answers[cfg.name])
            raw.setdefault(cfg.name, {}).update(
                {rid: {k: r.get(k) for k in ("n_tokens", "text", "select_nodes", "decode_steps", "reused")}
                 for rid, r in by_cfg[cfg.name].items()})
    n_tokens = {sid: int(r["n_tokens"]) for sid, r in raw["dense"].items()}
    summary = passkey_summary(samples, answers, configs, n_tokens, gate_fraction=gate_fraction,
                              min_samples=min_samples)
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
        "configs": configs, "summary": summary, "timings": [r.timing() for r in decoded.runs],
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


def gate_fidelity(harness: Harness, *, docs_dir: Path, contexts: Sequence[int], steps: int,
                  fractions: Sequence[float], accounting: str, jobs: int = 2, work_dir: Path | None = None,
                  window_baseline: bool = True, gate_fraction: float = 0.5,
                  show_progress: bool = True, min_samples: int = MIN_GATE_SAMPLES) -> dict[str, Any]:
    """The fidelity gate's run: per context the docs text (:func:`fidelity_text`) decoded dense, at each
    budget, the window of each budget and select-all, one process each (:func:`~.fidelity.run_fidelity`),
    and the gate over the rows."""
    t_start = time.monotonic()
    runs: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    for n_ctx in contexts:
        text, used = fidelity_text(docs_dir, max_chars=(n_ctx + 64) * 8)
        budgets = [budget_config(n_ctx, f, accounting=accounting) for f in fractions]
        windows = [window_config(b, n_ctx) for b in budgets] if window_baseline else []
        cfgs = [DENSE, *budgets, *windows, select_all_config(n_ctx)]
        rows, decoded = run_fidelity(harness, n_ctx, cfgs, [(f"fidelity-{n_ctx}", text)], steps=steps,
                                     margin=64, shared_prefill=False, jobs=jobs, show_progress=show_progress,
                                     work_dir=work_dir)
        timings += [r.timing() for r in decoded.runs]
        for row in rows:
            cfg = row.pop("cfg")
            del row["text"]
            runs.append({"n_ctx": n_ctx, "config": cfg.name, **row, "cfg": cfg.describe(n_ctx), "docs": used})
    bad = [r for r in runs if r["config"] == "select-all" and not r["identical"]]
    return {"steps": steps, "fractions": list(fractions), "accounting": accounting, "docs_dir": str(docs_dir),
            "min_samples": min_samples,
            "runs": runs, "timings": timings, "seconds": time.monotonic() - t_start, "jobs": jobs,
            "select_all_identical": not bad and any(r["config"] == "select-all" for r in runs),
            "gate": fidelity_gate(runs, gate_fraction, min_samples)}


def _not_finite(r: dict[str, Any], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if k in r and not math.isfinite(float(r[k]))]


def fidelity_gate(runs: Sequence[dict[str, Any]], gate_fraction: float = 0.5,
                  min_samples: int = MIN_GATE_SAMPLES) -> dict[str, Any]:
    """Per context: the sparse config at ``gate_fraction`` must beat the sliding-window baseline of the same
    attended size, on KL(dense || .) (strictly lower mean) and on the text's NLL (not higher); a NaN or
    infinite KL or NLL, or no window run, fails it (a selector that recency alone matches adds nothing). It
    proves nothing ("not checked") over fewer than ``min_samples`` decode steps or without an NLL."""
    def at_gate(r: dict[str, Any], window: bool) -> bool:
        cfg = r.get("cfg", {})
        is_window = cfg.get("window", str(r.get("config", "")).startswith("window-"))  # runs recorded before
        return bool(cfg.get("sparse")) and cfg.get("fraction") == gate_fraction and bool(is_window) == window

    checks = []
    for r in (r for r in runs if at_gate(r, False)):
        w = next((x for x in runs if x["n_ctx"] == r["n_ctx"] and at_gate(x, True)), None)
        reasons: list[str] = []
        unproven: list[str] = []
        steps = r.get("steps")
        if steps is not None and steps < min_samples:
            unproven.append(f"only {steps} decode steps, at least {min_samples} needed")
        bad = _not_finite(r, ("kl_mean", "nll", "nll_ref")) + [f"window {k}" for k in
                                                              _not_finite(w or {}, ("kl_mean", "nll"))]
        if bad:
            reasons.append(f"not finite: {', '.join(bad)}")
        if w is None:
            reasons.append("no window baseline at this budget")
        elif not bad:
            if not r["kl_mean"] < w["kl_mean"]:
                reasons.append(f"KL mean {r['kl_mean']:.3g} not below the window's {w['kl_mean']:.3g}")
            if "nll" not in r or "nll" not in w:
                unproven.append("no NLL of the text (no targets)")
            elif r["nll"] > w["nll"]:
                reasons.append(f"NLL {r['nll']:.4f} above the window's {w['nll']:.4f}")
        status = _status(reasons, unproven)
        checks.append({"n_ctx": r["n_ctx"], "config": r["config"], "window": w["config"] if w else None,
                       "attended_fraction": r["cfg"]["attended_fraction"], "kl_mean": r["kl_mean"],
                       "window_kl_mean": w["kl_mean"] if w else None, "nll": r.get("nll"),
                       "window_nll": w.get("nll") if w else None, "steps": steps,
                       "reasons": reasons + unproven, "status": status, "passed": status == "pass"})
    gate = {"fraction": gate_fraction, "min_samples": min_samples, "checks": checks}
    return gate | {"verdict": gate_verdict("fidelity", gate).verdict,
                   "passed": bool(checks) and all(c["passed"] for c in checks)}


def _gate_check(stage: str, c: dict[str, Any]) -> Check:
    """One config's gate result as a :class:`..verdict.Check` (records without a status: pass/FAIL)."""
    name = f"{stage} {c.get('n_ctx', '')} {c['config']}".replace("  ", " ")
    status = c.get("status", "pass" if c["passed"] else "FAIL")
    passed = None if status == "not checked" else status == "pass"
    return Check(name, stage, passed, "; ".join(c["reasons"]) or "pass", list(c["reasons"]))


def gate_verdict(stage: str, gate: dict[str, Any]) -> Verdict:
    """The verdict of one gate: no sparse config at the gate budget is INCOMPLETE."""
    checks = [_gate_check(stage, c) for c in gate["checks"]]
    return verdict_of(checks, [stage])


def select_all_check(fid: dict[str, Any]) -> Check:
    """select-all (every block selected, the select op running) must give logits bitwise equal to dense,
    and dense's must be finite; a fidelity result without a select-all run proves nothing of the plumbing."""
    runs = [r for r in fid.get("runs", []) if r["config"] == "select-all"]
    name = "select-all = dense"
    if not runs:
        return Check(name, "select-all", None, "no select-all run: the sparse plumbing was not checked")
    ev = [f"{r['n_ctx']}: {'identical' if r['identical'] else 'differs'} (KL mean {r['kl_mean']:.3g}, "
          f"top-1 agreement {r['top1_agreement']:.2%})" for r in runs]
    bad = [r for r in runs if not r["identical"]]
    if bad:
        r = bad[0]
        return Check(name, "select-all", False, f"fidelity {r['n_ctx']}: select-all logits differ from dense "
                     f"(KL mean {r['kl_mean']:.3g}, top-1 agreement {r['top1_agreement']:.2%}): the sparse "
                     "plumbing is not exact", ev)
    nan = [r for r in runs if _not_finite(r, ("kl_mean", "nll_ref"))]
    if nan:
        return Check(name, "select-all", False, f"fidelity {nan[0]['n_ctx']}: dense logits not finite "
                     "(identical NaN proves nothing)", ev)
    return Check(name, "select-all", True, f"bitwise identical at {', '.join(str(r['n_ctx']) for r in runs)}",
                 ev)


def gate_checks(update: dict[str, Any]) -> tuple[list[Check], list[str]]:
    """Every check of an eval run and the stages it requires (select-all first: the plumbing must be
    exact). A gate with no sparse config at its budget gets a "not checked" entry."""
    checks: list[Check] = []
    stages: list[str] = []
    if "fidelity" in update:
        checks.append(select_all_check(update["fidelity"]))
        stages += ["select-all", "fidelity"]
    for stage, gate in (("fidelity", (update.get("fidelity") or {}).get("gate")),
                        ("passkey", ((update.get("passkey") or {}).get("summary") or {}).get("gate"))):
        if stage not in update:
            continue
        if stage == "passkey":
            stages.append(stage)
        if gate is None:
            checks.append(Check(f"{stage} gate", stage, None, "no gate result in this run"))
            continue
        gate_cs = [_gate_check(stage, c) for c in gate["checks"]]
        checks += gate_cs or [Check(f"{stage} gate", stage, None, "no sparse run at the gate budget")]
    return checks, stages


def check_gates(update: dict[str, Any]) -> Verdict:
    """The verdict of an eval run's gates; raise unless it is PASS (no gate at all: INCOMPLETE)."""
    checks, stages = gate_checks(update)
    v = verdict_of(checks, stages)
    if not v.passed:
        why = [f"{c.name}: {c.summary}" for c in checks if c.passed is not True] or ["no gate ran"]
        raise CheckFailed(f"quality gates {v.verdict}: {'; '.join(why)}")
    return v


def check_select_all(fid: dict[str, Any]) -> None:
    """Raise unless the fidelity result has select-all runs, all bitwise equal to dense."""
    c = select_all_check(fid)
    if c.passed is not True:
        raise CheckFailed(c.summary)

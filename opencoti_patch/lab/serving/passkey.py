"""Passkey accuracy through llama-server: the same real-prose requests served one at a time and N at a time.

With unified slots (``-kvu``) llama-server decodes the sequences of its busy slots in one ubatch of one KV
stream; a block selection shared by those sequences (one list per KV head and stream) loses
answers only when requests overlap. So each variant (its server arguments) starts one server, which answers
the same passkey set twice: **sequential** (one request in flight) and **concurrent** (``concurrency``
requests in flight, sent in groups that start together so that their decodes share ubatches). Greedy, a fixed
number of generated tokens.

The samples are :mod:`opencoti_patch.lab.needle`'s: a 5-digit key in a needle sentence inside real prose
paragraphs, at a depth past the sink block and before the recent blocks, then a question. The prompts are
fitted to the context with the server's own tokenizer (``/tokenize``).

Reported per variant and mode: correct answers, agreement with the same variant's sequential answers and with
the first variant's (dense) answers in the same mode. The verdict compares the modes against the first
variant, the control: batching changes the numerics of dense attention too (on the H200, dense answered 62 of
100 one at a time and 60 of 100 four at a time), so a variant passes when serving concurrently costs it at
most ``tolerance`` answers more than it costs the control. A lone variant is judged on its own (concurrent
at least sequential minus ``tolerance``).

Every answer is judged against its own request's key (an answer holding another request's key is a mixed-up
response: FAIL, whatever the counts say). Any failed or missing request fails the run; a mode with no
request proves nothing, and so does a control that answers fewer than ``min_control`` of the keys in a mode
(a control at 0/20 forgives any loss): both are INCOMPLETE (:mod:`..verdict`)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...config import Settings, write_report
from ...errors import OpencotiError
from ...report import render
from ...verdict import Check, verdict_of
from ..needle import Sample, make_samples
from ..passkey import parse_answer
from ..prose import take_text
from ..variants import BLOCK, sparse_variant
from .http import Transport
from .server import ServerConfig, ServerProcess, Variant, server_tokenizer

MODES = ("sequential", "concurrent")
MIN_CONTROL = 0.25  # share of the keys the control must find in each mode for the comparison to mean anything
REQUIRED_STAGES = ("requests", "attribution", "control", "concurrency")


def default_variants(n_ctx: int, share: float) -> list[Variant]:
    """dense, and sparse attending ``share`` of ``n_ctx`` (sink + recent + top-k blocks), selecting from the
    first decode on (min-ctx 1: the automatic threshold would keep a 4K context dense)."""
    c = sparse_variant(n_ctx, round(share * n_ctx), "sparse")
    sparse = ("--sparse-attn", "on", "--sparse-attn-topk", str(c.topk),
              "--sparse-attn-block-size", str(c.block_size), "--sparse-attn-sink", str(c.sink),
              "--sparse-attn-recent", str(c.recent), "--sparse-attn-min-ctx", "1")
    return [Variant("dense", ("--sparse-attn", "off")),
            Variant(f"sparse-{share * 100:g}%", sparse)]


@dataclasses.dataclass
class Prompt:
    sample: Sample
    text: str
    n_tokens: int


def build_prompts(paragraphs: list[str], tokenize: Callable[[str], int], *, n_ctx: int, count: int, seed: int,
                  n_predict: int, per_doc: int = 25) -> list[Prompt]:
    """``count`` passkey prompts that fit ``n_ctx`` with ``n_predict`` generated tokens (fitted with the
    server's tokenizer). Groups of ``per_doc`` share one filler; within a group the deepest needle comes
    first, so that a prompt shares its text up to its own needle with every prompt before it (a slot's cached
    prompt is reused up to there)."""
    probe = take_text(paragraphs, 0, min(40_000, sum(map(len, paragraphs)) // 2))
    cpt = len(probe) / tokenize(probe)
    samples = sorted(make_samples(seed, n_ctx, count, len(paragraphs), per_doc=per_doc),
                     key=lambda s: (s.doc, -s.depth))
    limit = n_ctx - n_predict - 8
    scale = 0.96
    while True:
        filler_chars = int((n_ctx - 160 - n_predict) * cpt * scale)
        texts = [s.prompt(paragraphs, filler_chars) for s in samples]
        out = [Prompt(s, t, tokenize(t)) for s, t in zip(samples, texts, strict=True)]
        if max(p.n_tokens for p in out) <= limit:
            return out
        scale *= 0.97


def _complete(transport: Transport, base_url: str, prompt: Prompt, n_predict: int, timeout: float,
              cache_prompt: bool) -> dict[str, Any]:
    body = {"prompt": prompt.text, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": cache_prompt,
            "seed": 0, "stream": False}
    t0 = time.monotonic()
    status, data = transport.post(base_url + "/completion", body, timeout)
    if status != 200:
        return {"sid": prompt.sample.sid, "error": f"HTTP {status}: {data[:200]!r}"}
    res = json.loads(data)
    text = str(res.get("content", ""))
    ans = parse_answer(text)
    return {"sid": prompt.sample.sid, "answer": ans, "correct": ans == prompt.sample.key, "text": text,
            "prompt_tokens": int(res.get("tokens_evaluated", 0)), "seconds": round(time.monotonic() - t0, 2)}


def serve_mode(transport: Transport, base_url: str, prompts: Sequence[Prompt], *, concurrency: int,
               n_predict: int, cache_prompt: bool = True, timeout: float = 1800.0,
               progress: Callable[[str], None] | None = None, label: str = "") -> list[dict[str, Any]]:
    """Every prompt once: groups of ``concurrency`` requests sent together (1: one at a time)."""
    out: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for g in range(0, len(prompts), concurrency):
            group = prompts[g:g + concurrency]
            out += list(pool.map(
                lambda p: _complete(transport, base_url, p, n_predict, timeout, cache_prompt), group))
            if progress is not None:
                progress(f"{label}: {len(out)}/{len(prompts)}")
    return out


def _judge(rows: Sequence[dict[str, Any]], keys: dict[str, str]) -> dict[str, Any]:
    """One mode of one variant, every answer against its own request's key (never a ``correct`` field)."""
    every_key = set(keys.values())
    answered = [r for r in rows if "error" not in r and r.get("answer") is not None]
    right = [r["sid"] for r in answered if r["answer"] == keys.get(r["sid"])]
    foreign = [r["sid"] for r in answered if r["answer"] != keys.get(r["sid"]) and r["answer"] in every_key]
    sids = [r["sid"] for r in rows]
    return {"correct": len(right), "requests": len(rows), "errors": sum("error" in r for r in rows),
            "foreign": sorted(foreign), "unknown": sorted(set(sids) - set(keys)),
            "missing": sorted(set(keys) - set(sids)), "wrong": sorted(set(sids) - set(right)),
            "repeated": sorted({s for s in sids if sids.count(s) > 1})}


def _mode_checks(v: str, m: str, j: dict[str, Any], n: int) -> list[Check]:
    name = f"{v} {m}"
    if not j["requests"]:
        return [Check(f"{name}: requests", "requests", None, f"{name}: no request served: not checked")]
    bad = [f"{j['errors']} request(s) failed" if j["errors"] else "",
           f"{len(j['missing'])} never answered" if j["missing"] else "",
           f"{len(j['repeated'])} answered twice" if j["repeated"] else "",
           f"{len(j['unknown'])} of no prompt" if j["unknown"] else ""]
    bad = [b for b in bad if b]
    req = Check(f"{name}: requests", "requests", not bad,
                f"{name}: {', '.join(bad) if bad else f'{n} prompts answered once each'}")
    att = Check(f"{name}: answers of their own request", "attribution", not j["foreign"],
                f"{name}: " + (f"{len(j['foreign'])} answer(s) hold another request's key: "
                               f"{', '.join(j['foreign'][:5])}" if j["foreign"] else
                               "no answer holds another request's key"),
                [f"{sid}: another request's key" for sid in j["foreign"]])
    return [req, att]


def summarize(results: dict[str, dict[str, list[dict[str, Any]]]], prompts: Sequence[Prompt],
              tolerance: int, min_control: float = MIN_CONTROL) -> dict[str, Any]:
    """Per variant and mode: correct (each answer against its own request's key), errors, answers holding
    another request's key, agreement with the variant's sequential answers and with the first variant's
    answers in that mode. Checks (:mod:`..verdict`): every prompt answered once without an error in every
    mode (an empty mode: not checked), no answer with another request's key, the control (the first of
    several variants; a lone variant is its own) finds at least ``min_control`` of the keys in each mode
    (else not checked: it proved nothing), and each other variant's loss from serving concurrently
    (sequential - concurrent correct) is at most the control's loss (or 0) plus ``tolerance``; a lone
    variant: its loss at most ``tolerance``."""
    names = list(results)
    ref = names[0]
    keys = {p.sample.sid: p.sample.key for p in prompts}
    n = len(prompts)
    answers = {v: {m: {r["sid"]: r.get("answer") for r in results[v].get(m, [])} for m in MODES}
               for v in names}
    table: dict[str, Any] = {}
    checks: list[Check] = []
    for v in names:
        table[v] = {}
        for m in MODES:
            j = _judge(results[v].get(m, []), keys)
            own, seq, dense = answers[v][m], answers[v]["sequential"], answers[ref][m]
            table[v][m] = {**j, "agree_sequential": sum(own[s] == seq.get(s) for s in own),
                           "agree_dense": sum(own[s] == dense.get(s) for s in own)}
            checks += _mode_checks(v, m, j, n)
    control = ref if len(names) > 1 else None  # a lone variant is judged on its own
    floor = min_control * n
    for m in MODES:
        got = table[ref][m]
        ok = bool(got["requests"]) and got["correct"] >= floor
        checks.append(Check(f"{ref} {m}: control answers", "control", True if ok else None,
                            f"{got['correct']}/{n} keys found (floor {min_control:.0%})" if ok else
                            f"not checked: {ref} finds {got['correct']}/{n} keys in the {m} pass, below "
                            f"the floor of {min_control:.0%}: the comparison proves nothing"))

    def loss(v: str) -> int:
        return table[v]["sequential"]["correct"] - table[v]["concurrent"]["correct"]

    for v in names:
        if v == control:
            continue  # the control: its loss is what batching costs without the feature
        name = f"{v}: concurrent vs sequential"
        if not all(table[x][m]["requests"] for x in (v, ref) for m in MODES):
            checks.append(Check(name, "concurrency", None, "not checked: a mode has no request"))
            continue
        allowed = tolerance + (max(0, loss(control)) if control else 0)
        n_seq, conc = table[v]["sequential"]["correct"], table[v]["concurrent"]["correct"]
        ctl = (f" ({control}: {table[control]['sequential']['correct']} and "
               f"{table[control]['concurrent']['correct']})" if control else "")
        checks.append(Check(name, "concurrency", loss(v) <= allowed,
                            f"{v}: {conc}/{n} correct served concurrently, {n_seq}/{n} one at a time{ctl}"))
    verdict = verdict_of(checks, REQUIRED_STAGES)
    n_tok = [p.n_tokens for p in prompts] or [0]
    return {"table": table, "failed": [c.summary for c in checks if c.passed is not True],
            "checks": [c.as_dict() for c in checks], "control": control, "min_control": min_control,
            "prompt_tokens": [min(n_tok), max(n_tok)],
            "depths": [round(p.sample.depth, 3) for p in prompts], "verdict": verdict.verdict}


def run(server: ServerConfig, variants: Sequence[Variant], paragraphs: list[str], transport: Transport,
        *, n_ctx: int, count: int, seed: int, n_predict: int, concurrency: int, tolerance: int, log_dir: Path,
        cache_prompt: bool = True, progress: Callable[[str], None] = print,
        min_control: float = MIN_CONTROL) -> dict[str, Any]:
    """Each variant: one server, the passkey set served one at a time, then ``concurrency`` at a time."""
    t0 = time.monotonic()
    prompts: list[Prompt] | None = None
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    commands: dict[str, list[str]] = {}
    log_dir.mkdir(parents=True, exist_ok=True)
    for v in variants:
        cfg = dataclasses.replace(server, args=list(server.args) + list(v.args),
                                  log_path=log_dir / f"server-{v.name}.log")
        proc = ServerProcess(cfg, transport)
        proc.start()
        try:
            commands[v.name] = proc.cmd
            if prompts is None:
                prompts = build_prompts(paragraphs, server_tokenizer(transport, proc.base_url), n_ctx=n_ctx,
                                        count=count, seed=seed, n_predict=n_predict)
            results[v.name] = {}
            for mode, conc in zip(MODES, (1, concurrency), strict=True):
                results[v.name][mode] = serve_mode(transport, proc.base_url, prompts, concurrency=conc,
                                                   n_predict=n_predict, cache_prompt=cache_prompt,
                                                   progress=progress,
                                                   label=f"{v.name} {mode}")
            alive = proc.healthy()
        finally:
            code = proc.stop()
        if not alive:
            raise OpencotiError(f"llama-server ({v.name}) died during the run (exit {code}): "
                                f"{proc.log_tail()[-600:]}")
    assert prompts is not None
    summary = summarize(results, prompts, tolerance, min_control)
    return {"kind": "served-passkey", "n_ctx": n_ctx, "samples": count, "seed": seed, "n_predict": n_predict,
            "concurrency": concurrency, "block": BLOCK, "tolerance": tolerance, "cache_prompt": cache_prompt,
            "variants": {v.name: list(v.args) for v in variants}, "server_commands": commands,
            "keys": {p.sample.sid: p.sample.key for p in prompts}, "results": results, **summary,
            "seconds": round(time.monotonic() - t0, 1)}


def llama_server(bin_dir: Path, model: Path, *, server_args: Sequence[str], ngl: int, parallel: int,
                 n_ctx: int, threads: int) -> ServerConfig:
    """The llama-server of a build (its bin/): ``parallel`` slots of ``n_ctx`` cells, ``ngl`` layers
    offloaded."""
    server = ServerConfig(binary=bin_dir / "llama-server", model=model,
                          args=[*server_args, *(["-ngl", str(ngl)] if ngl else [])], parallel=parallel,
                          ctx=parallel * n_ctx, threads=threads)
    if not server.binary.is_file():
        raise OpencotiError(f"{server.binary} not found: build the llama-server target of that build")
    return server


def save(out_dir: Path, name: str, data: dict[str, Any]) -> Path:
    """``<out_dir>/<name>.json`` and its Markdown report; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    write_report(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    md = render(Settings.resolve().templates_dirs, "serving-passkey.md.j2", **data)
    write_report(path.with_suffix(".md"), md)
    return path


def public(res: dict[str, Any], server: ServerConfig) -> dict[str, Any]:
    """The result for a report: the server commands with the binary and the model as placeholders."""
    subst = {str(server.binary): "llama-server", str(server.model): "<model.gguf>"}
    cmds = {v: " ".join(subst.get(a, a) for a in cmd) for v, cmd in res["server_commands"].items()}
    return {**res, "server_commands": cmds}

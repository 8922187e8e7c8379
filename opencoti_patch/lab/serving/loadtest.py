"""Bounded serving load test of llama-server (dense vs sparse attention).

Starts llama-server (loopback, a free port, ``--parallel 4 -fa on`` + per-variant args such as
``--sparse-attn on --sparse-attn-topk 8``), waits for ``/health``, then sends a fixed, seeded
schedule of long-prompt requests from a thread pool: a mix of ``/completion`` and
``/v1/completions``, streamed (SSE) and not, some streams closed after a few chunks (cancelled), a
subset of prompts sent twice at different positions. Every prompt is a different slice of a real
text corpus carrying a unique marker, and in the middle of that slice a unique key ("The key of document
<marker> is <key>."), so each output can be attributed to its request and to its own context.

Checks (each a :class:`~opencoti_patch.verdict.Check`: pass, FAIL or "not checked"; the verdict through
``verdict_of``):
- ``no_5xx`` / ``no_transport_errors``: every request answered, none with a 5xx.
- ``valid_json``: every non-streamed body and every SSE ``data:`` chunk parses as JSON.
- ``attribution``: ``tokens_evaluated`` / ``usage.prompt_tokens`` equal the prompt's own token count,
  the echoed ``prompt`` holds the request's own marker and no other, no output holds a foreign marker
  (a request's text fed back as another's input shows up here).
- ``key_echo``: every prompt ends by asking for the key placed in the middle of its own context ("The
  key of document <marker> is"), so a real model copies it into the answer: at least ``--min-key-echo``
  of the finished answers must hold their own key. An answer can only do so by reading its own context:
  one that repeats its own marker (which the question holds) but continues another request's context
  fails here, and one that holds another request's key fails ``attribution``. Without it the foreign
  checks could never fire (answers that hold no key prove nothing about slots mixing); ``--min-key-echo
  0`` (a random-weight model) makes it "not checked".
- ``isolated_deterministic``: after the load, ``--isolated`` prompts are re-sent one at a time with the
  prompt cache off (the first one twice); at temperature 0 they must repeat exactly. Under load a
  repeated prompt (sent twice at different positions, streamed or not) is compared too, but only
  reported (``--strict-load-determinism`` makes it a check): llama-server is not batch-invariant
  (with ``--parallel`` > 1 a prompt's ubatches are cut differently depending on which other slots are
  busy, and CPU FA / matmul round differently for other ubatch shapes), dense included.
- ``rss_flat``: the server's RSS (``/proc/<pid>/status``), sampled throughout the load (a timer, and
  once when the warm-up requests are done: the baseline), peaks at most a threshold above the baseline
  (the peak, not the last sample). Fewer than :data:`MIN_MEMORY_SAMPLES` samples from the baseline to the
  end (e.g. only a start and an end sample) prove nothing: "not checked".
- ``gpu_mem_flat``: the same for the server's GPU memory (``nvidia-smi --query-compute-apps``); "not
  checked" where nvidia-smi lists no memory for the server (no GPU, no nvidia-smi).
  Neither can be measured without the server's pid (``--url`` without ``--server-pid``): "not checked".
  A check not checked makes the verdict INCOMPLETE (exit 4) unless ``--accept-not-checked CHECK`` names it
  (bare: any).
- ``server_alive``: the server still answers ``/health`` after the run and did not exit.
- ``--expect-equal A:B``: two variants give identical text on the isolated reference (e.g. sparse
  select-all vs dense); their agreement under load is reported beside it.

The parts, one module each: :mod:`.schedule` (the seeded prompts and their order), :mod:`.client` (one
request and its checks), :mod:`.load` (the load, memory sampled), :mod:`.judge` (the checks and the verdict),
:mod:`.server` (llama-server), :mod:`.http` (``requests`` where installed, else ``http.client``). This module
runs them per variant and writes the report: ``opencoti-patch lab loadtest``.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...config import write_report
from ...errors import OpencotiError
from ...verdict import Check, Verdict
from .http import Transport, default_transport
from .judge import evaluate_pairs, overall_verdict, summarize
from .load import run_isolated, run_load
from .schedule import Job, LoadConfig, corpus_text, plan
from .server import ServerConfig, ServerProcess, Variant, server_tokenizer

DENSE = Variant("dense", ("--sparse-attn", "off"))  # the variant of a run that names none


def run_variants(variants: Sequence[Variant], cfg: LoadConfig, corpus: str, transport: Transport, *,
                 server: ServerConfig | None, url: str | None, log_dir: Path | None,
                 progress: Callable[[str], None] = print, server_pid: int | None = None) -> dict[str, Any]:
    jobs: list[Job] | None = None
    runs: dict[str, dict[str, Any]] = {}
    summaries: list[dict[str, Any]] = []
    for v in variants:
        proc: ServerProcess | None = None
        info: dict[str, Any] = {"url": url}
        if url is None:
            assert server is not None
            scfg = ServerConfig(**{**asdict(server), "args": list(server.args) + list(v.args),
                                   "log_path": (log_dir / f"{v.name}.server.log") if log_dir else None})
            proc = ServerProcess(scfg, transport)
            progress(f"[{v.name}] starting: {shlex.join(scfg.command(0))}")
            t0 = time.monotonic()
            proc.start()
            base = proc.base_url
            info = {"cmd": shlex.join(proc.cmd), "startup_s": round(time.monotonic() - t0, 1),
                    "log": str(scfg.log_path) if scfg.log_path else None}
        else:
            base = url.rstrip("/")
        try:
            if jobs is None:
                progress(f"[{v.name}] building {cfg.requests} requests")
                jobs = plan(corpus, cfg, server_tokenizer(transport, base))
            progress(f"[{v.name}] sending {len(jobs)} requests, concurrency {cfg.concurrency}")
            run = run_load(transport, base, jobs, cfg,
                           pid=proc.proc.pid if proc and proc.proc else server_pid, progress=progress)
            if cfg.isolated:
                progress(f"[{v.name}] isolated reference: {cfg.isolated} prompts one at a time, uncached")
                run["isolated"] = run_isolated(transport, base, jobs, cfg)
            info["alive_after"] = proc.healthy() if proc else True
        finally:
            if proc is not None:
                info["exit_code"] = proc.stop()
                if not info.get("alive_after", False):
                    info["log_tail"] = proc.log_tail(2000)
        runs[v.name] = run
        s = summarize(v.name, run, cfg, info)
        summaries.append(s)
        progress(f"[{v.name}] {s['verdict']} "
                 + "; ".join(f"{c['stage']}: {c['summary']}" for c in s["checks"] if c["passed"] is not True))
    assert jobs is not None
    return {"jobs": jobs, "runs": runs, "summaries": summaries}


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summaries"]
    cols = [x["name"] for x in s]
    rows: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("requests (started / completed)", lambda x: f"{x['requests']} ({x['started']} / {x['completed']})"),
        ("streamed / cancelled / v1 / repeats",
         lambda x: f"{x['streamed']} / {x['cancelled']} / {x['v1']} / {x['repeats']}"),
        ("requests with errors", lambda x: x["with_errors"]),
        ("HTTP 5xx", lambda x: x["http_5xx"]),
        ("error kinds", lambda x: ", ".join(f"{k} {n}" for k, n in x["error_kinds"].items()) or "-"),
        ("echoed prompt == sent prompt", lambda x: x["echo_exact"]),
        ("repeat pairs (mismatches)",
         lambda x: f"{x['determinism']['pairs']} ({x['determinism']['mismatches']})"),
        ("latency p50 / p99 (s)", lambda x: f"{x['latency_p50_s']} / {x['latency_p99_s']}"),
        ("TTFT p50, streams (s)", lambda x: x["ttft_p50_s"]),
        ("prompt tok/s (server timings)", lambda x: x["prompt_tps_per_request"]),
        ("decode tok/s per request (server timings)", lambda x: x["decode_tps_per_request"]),
        ("generated tok/s aggregate (wall)", lambda x: x["generated_tps_aggregate"]),
        ("prompt tokens evaluated / cached", lambda x: f"{x['prompt_tokens']} / {x['cached_tokens']}"),
        ("wall (s)", lambda x: x["wall_s"]),
        ("RSS start / warm / peak / end (MiB)",
         lambda x: "-" if not x["rss"] else
         " / ".join(str(x["rss"].get(k, "-")) for k in ("start_mib", "warm_mib", "peak_mib", "end_mib"))),
        ("RSS peak above warm-up (MiB)",
         lambda x: "-" if not x["rss"] else x["rss"].get("peak_after_warmup_mib", "-")),
        ("GPU memory warm / peak (MiB)",
         lambda x: "-" if not x.get("gpu") else f"{x['gpu'].get('warm_mib', '-')} / {x['gpu']['peak_mib']}"),
        ("answers holding the key of their own context", lambda x: x.get("key_echo", "-")),
        ("failed checks",
         lambda x: ", ".join(c["stage"] for c in x["checks"] if c["passed"] is False) or "none"),
        ("not checked", lambda x: "; ".join(x.get("not_checked", [])) or "none"),
    ]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    lines += [f"| {label} | " + " | ".join(str(f(x)) for x in s) + " |" for label, f in rows]
    lines.append("")
    for x in s:
        det = x["isolated"]["determinism"]
        lines.append(f"- {x['name']}: isolated reference {x['isolated']['requests']} requests, "
                     f"repeat identical {det['pairs'] - det['mismatches']}/{det['pairs']}")
    for c in result.get("comparisons", []):
        kind = "required identical" if c["required"] else "informative"
        i, ld = c["isolated"], c["load"]
        lines.append(f"- {c['a']} vs {c['b']} ({kind}): isolated {i['identical']}/{i['compared']} identical, "
                     f"under load {ld['identical']}/{ld['compared']} identical"
                     + ("" if c["passed"] else " **FAIL**"))
    return "\n".join(lines) + "\n"


def _jsonable(result: dict[str, Any], with_outcomes: bool) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in result.items() if k not in ("jobs", "runs")}
    out["schedule"] = [{"pos": j.pos, "rid": j.spec.rid, "n_tokens": j.spec.n_tokens, "endpoint": j.endpoint,
                        "stream": j.stream, "cancel_after": j.cancel_after, "repeat_of": j.repeat_of}
                       for j in result["jobs"]]
    if with_outcomes:
        out["outcomes"] = {name: [asdict(o) for o in run["outcomes"]] for name, run in result["runs"].items()}
        out["isolated_outcomes"] = {name: [asdict(o) for o in run.get("isolated", [])]
                                    for name, run in result["runs"].items()}
    return out


@dataclass(frozen=True)
class Target:
    """What the load goes to: llama-server started per variant (``server``), or a running one (``url``; its
    memory only with ``server_pid``)."""

    server: ServerConfig | None = None
    url: str | None = None
    server_pid: int | None = None


def run_loadtest(cfg: LoadConfig, variants: Sequence[Variant], target: Target, corpus: Sequence[str | Path],
                 *,
                 expect_equal: Sequence[tuple[str, str]] = (), compare: Sequence[tuple[str, str]] = (),
                 transport: str = "auto", log_dir: Path | None = None,
                 progress: Callable[[str], None] = print) -> tuple[dict[str, Any], Verdict, list[Check]]:
    """The load test of every variant (default: :data:`DENSE`) on ``target`` with prompts cut from
    ``corpus``: the result, its verdict and the checks."""
    cfg.validate()
    variants = list(variants) or [DENSE]
    if len({v.name for v in variants}) != len(variants):
        raise OpencotiError("variant names must be unique")
    if target.url and len(variants) != 1:
        raise OpencotiError("--url runs a single variant")
    if not target.url and target.server is None:
        raise OpencotiError("--server and --model are required (or --url)")
    text = corpus_text(corpus)
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    client = default_transport(transport)
    progress(f"transport: {client.name}")
    result = run_variants(variants, cfg, text, client, server=target.server, url=target.url, log_dir=log_dir,
                          progress=progress, server_pid=target.server_pid)
    result["comparisons"] = evaluate_pairs(result["runs"], expect_equal, compare, cfg.strict_load_determinism)
    server = target.server
    server_json = None if server is None else {**asdict(server), "binary": str(server.binary),
                                               "model": str(server.model)}
    result["config"] = {**asdict(cfg), "transport": client.name, "variants": [asdict(v) for v in variants],
                        "server": server_json}
    verdict, checks = overall_verdict(result)
    result["verdict"], result["passed"] = verdict.verdict, verdict.passed
    return result, verdict, checks


def write_reports(result: dict[str, Any], json_out: Path | None, markdown: Path | None) -> str:
    """The Markdown summary (also into ``markdown``) and the full result as JSON (into ``json_out``)."""
    md = render_markdown(result)
    if markdown:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        write_report(markdown, md)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_report(json_out, json.dumps(_jsonable(result, True), indent=1, default=str) + "\n")
    return md

"""The lab's programs (``lab/harness/``, C++) and the one driver of ``opencoti-harness-batch``.

The programs, built against a llama.cpp build by the toolkit's harness builder: ``opencoti-harness-batch``
(many requests per process, JSON lines in and out) and ``opencoti-qk-dump`` (the Q/K of a dense prefill).

:class:`Harness` runs ``opencoti-harness-batch`` in either of its two ways, with one process loop and the
same checks (every request answered, no stray output, the sparse path run exactly where asked, the layers on
the GPU that were asked for):

- :meth:`Harness.run`: one attention config on the command line, one process per config (the eval gates run
  several at once, :func:`run_tasks`, and keep finished runs in a cache to resume);
- :meth:`Harness.run_variants`: ``--variants``, one process whose requests are each prefilled once (dense) and
  decoded by every variant (the selector tools: N variants cost one prefill).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..builds.harness import build_harness
from ..errors import CheckFailed, OpencotiError
from ..progress import progress as _progress
from ..report import info
from .variants import AttnConfig

LAB_HARNESS = Path(__file__).resolve().parent / "harness"
BATCH_EXE = "opencoti-harness-batch"
DUMP_EXE = "opencoti-qk-dump"


def build_lab_harness(llama_src: Path, llama_bin: Path, build_dir: Path,
                      targets: Sequence[str] = (BATCH_EXE,)) -> Path:
    """Build ``targets`` of the lab's programs against the build in ``llama_bin``; returns ``build_dir``."""
    return build_harness(llama_src, llama_bin, build_dir, targets=targets, source=LAB_HARNESS)


def build_harness_for(llama_src: Path, build_dir: Path) -> Path:
    """``opencoti-harness-batch`` built against the llama.cpp build ``build_dir`` (its bin/), into
    ``<build_dir>/opencoti-harness``; returns the executable."""
    if not (build_dir / "bin").is_dir():
        raise OpencotiError(f"no llama.cpp build at {build_dir} (build it, or pass --harness)")
    info(f"building {BATCH_EXE} against {build_dir}/bin")
    return build_lab_harness(llama_src, build_dir / "bin", build_dir / "opencoti-harness") / BATCH_EXE


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where the harness runs: ``ngl`` layers on the GPU (0: CPU only, the default) and further llama.cpp
    flags passed through to ``opencoti-harness-batch`` as they are (last, so they override)."""

    ngl: int = 0
    extra: tuple[str, ...] = ()


OnResult = Callable[[dict[str, Any]], None]


@dataclasses.dataclass
class Harness:
    """Runs batches of requests through ``opencoti-harness-batch`` (JSON lines in, JSON lines out)."""

    exe: Path
    model: Path
    threads: int = 1
    extra: tuple[str, ...] = ()  # flags for every run (e.g. --swa-full), before the offload's
    offload: Offload = Offload()
    log_dir: Path | None = None
    cache_dir: Path | None = None  # finished runs are kept here and not run again (a long gate can resume)
    commands: list[str] = dataclasses.field(default_factory=list)

    def command(self, n_ctx: int, requests_file: Path | str, cfg: AttnConfig | None = None,
                variants_file: Path | str | None = None) -> list[str]:
        """The command line: ``cfg`` on it (:meth:`run`), or a ``--variants`` file (:meth:`run_variants`)."""
        variants = ["--variants", str(variants_file)] if variants_file is not None else []
        return [str(self.exe), "--batch", str(requests_file), *variants, "-m", str(self.model),
                "-c", str(n_ctx), "-fa", "on", "-t", str(self.threads), "-ngl", str(self.offload.ngl),
                *self.extra, *self.offload.extra, *(cfg.args() if cfg is not None else [])]

    def run(self, requests: Sequence[dict[str, Any]], n_ctx: int, cfg: AttnConfig, label: str,
            on_result: OnResult | None = None) -> RunResult:
        """One harness process over ``requests`` with ``cfg``; checks that the sparse path ran exactly when
        asked. Taken from the cache when it holds this run."""
        t0 = time.monotonic()
        self.commands.append(" ".join(self.command(n_ctx, "REQUESTS.jsonl", cfg)))
        cached = self._cache_path(n_ctx, cfg, requests)
        if cached is not None and cached.is_file():
            data = json.loads(cached.read_text())
            for r in data["results"]:
                if on_result is not None:
                    on_result(r)
            return RunResult(label, n_ctx, cfg, data["results"], data["seconds"], data["llama_log"],
                             cached=True)
        with tempfile.TemporaryDirectory(prefix="opencoti-eval-") as tmp:
            batch = Path(tmp) / "requests.jsonl"
            batch.write_text("".join(json.dumps(r) + "\n" for r in requests))
            log = (self.log_dir or Path(tmp)) / f"{slug(label)}.stderr.log"
            results, log_text = self._process(self.command(n_ctx, batch, cfg), log, label, len(requests),
                                              on_result)
        for r in results:
            check_sparse_ran(r, cfg.sparse, label)
        run = RunResult(label, n_ctx, cfg, results, time.monotonic() - t0,
                        [ln for ln in log_text.splitlines() if ln.startswith("llama_sparse_attn")][:4])
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp_path = cached.with_suffix(".tmp")
            tmp_path.write_text(json.dumps({"label": label, "results": results, "seconds": run.seconds,
                                            "llama_log": run.llama_log}))
            tmp_path.replace(cached)
        return run

    def run_variants(self, requests: Sequence[dict[str, Any]], n_ctx: int, variants: Sequence[AttnConfig],
                     log: Path, on_result: OnResult | None = None) -> list[dict[str, Any]]:
        """One harness process: every request prefilled once (dense), decoded by every variant (one result
        each, with ``variant``; a ``tokenize_only`` request gives one result); the stderr goes to ``log``."""
        with tempfile.TemporaryDirectory(prefix="opencoti-needle-") as tmp:
            vfile, rfile = Path(tmp) / "variants.jsonl", Path(tmp) / "requests.jsonl"
            vfile.write_text("".join(json.dumps(v.variant_json()) + "\n" for v in variants))
            rfile.write_text("".join(json.dumps(r) + "\n" for r in requests))
            shown = self.command(n_ctx, "REQUESTS.jsonl", variants_file="VARIANTS.jsonl")
            self.commands.append(" ".join(shown))
            expected = sum(1 if r.get("tokenize_only") else len(variants) for r in requests)
            out, _ = self._process(self.command(n_ctx, rfile, variants_file=vfile), log, log.stem, expected,
                                   on_result)
        sparse = {v.name: v.sparse for v in variants}
        for r in out:
            if "variant" in r:  # not tokenize_only
                check_sparse_ran(r, sparse[r["variant"]], f"variant {r['variant']}")
        return out

    def _process(self, cmd: list[str], log: Path, label: str, expected: int,
                 on_result: OnResult | None) -> tuple[list[dict[str, Any]], str]:
        """Run ``cmd`` (stderr to ``log``), reading one JSON result a line; every one of ``expected`` results
        must come, nothing else on stdout, exit 0, and the layers asked for on the GPU. Returns the results
        and the log's text."""
        log.parent.mkdir(parents=True, exist_ok=True)
        results: list[dict[str, Any]] = []
        stray: list[str] = []  # not JSON: e.g. a crash handler's backtrace on stdout
        with log.open("w") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                                    env=clean_env()) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.strip():
                    continue
                try:
                    results.append(json.loads(line))
                except ValueError:
                    stray.append(line.rstrip())
                    continue
                if on_result is not None:
                    on_result(results[-1])
            rc = proc.wait()
        text = log.read_text(errors="replace")
        if rc != 0 or stray or len(results) != expected:
            tail = "\n".join(text.splitlines()[-15:] + stray[-10:])
            raise OpencotiError(f"{label}: harness exited {rc} after {len(results)}/{expected} results "
                                f"(log {log})\n  {' '.join(cmd)}\n{tail}")
        check_offload(text, self.offload.ngl, log)
        return results, text

    def _cache_path(self, n_ctx: int, cfg: AttnConfig, requests: Sequence[dict[str, Any]]) -> Path | None:
        """Keyed by harness binary, model, command line and requests; never for requests that dump files."""
        if self.cache_dir is None or any("dump" in r for r in requests):
            return None
        h = hashlib.sha256()
        for part in (str(self.exe), str(self.exe.stat().st_mtime_ns), str(self.model),
                     json.dumps(self.command(n_ctx, "-", cfg)), json.dumps(list(requests), sort_keys=True)):
            h.update(part.encode() + b"\0")
        return self.cache_dir / f"{h.hexdigest()[:32]}.json"


@dataclasses.dataclass
class RunResult:
    label: str
    n_ctx: int
    cfg: AttnConfig
    results: list[dict[str, Any]]
    seconds: float
    llama_log: list[str]
    cached: bool = False  # taken from Harness.cache_dir (seconds = when it ran)

    def timing(self) -> dict[str, Any]:
        return {"n_ctx": self.n_ctx, "config": self.cfg.name, "seconds": self.seconds, "cached": self.cached,
                "requests": len(self.results),
                "ms_prefill": sum(float(r.get("ms_prefill", 0.0)) for r in self.results),
                "ms_decode": sum(float(r.get("ms_decode", 0.0)) for r in self.results),
                "prefill_tokens": sum(int(r.get("n_prefill", 0)) - int(r.get("reused", 0))
                                      for r in self.results),
                "llama_log": self.llama_log}


@dataclasses.dataclass(frozen=True)
class Task:
    """One harness process: ``requests`` at context ``n_ctx`` with attention ``cfg``."""

    n_ctx: int
    cfg: AttnConfig
    requests: tuple[dict[str, Any], ...]
    label: str

    @property
    def cost(self) -> int:
        return self.n_ctx * len(self.requests)


def run_tasks(harness: Harness, tasks: Sequence[Task], jobs: int, title: str,
              show_progress: bool = True) -> list[RunResult]:
    """Run ``tasks`` on ``jobs`` concurrent processes (largest first), one progress bar over all requests.

    Results come back in the order of ``tasks``. The first failure cancels what has not started.
    """
    total = sum(len(t.requests) for t in tasks)
    lock = threading.Lock()
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i].cost)
    out: dict[int, RunResult] = {}
    with _progress(total, title, show_progress) as bar:
        def one(i: int) -> RunResult:
            def tick(_: dict[str, Any]) -> None:
                with lock:
                    bar.update(1)
            t = tasks[i]
            return harness.run(t.requests, t.n_ctx, t.cfg, t.label, tick)

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {pool.submit(one, i): i for i in order}
            try:
                for fut in concurrent.futures.as_completed(futures):
                    out[futures[fut]] = fut.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    return [out[i] for i in range(len(tasks))]


@dataclasses.dataclass(frozen=True)
class Group:
    """What one context decodes: ``requests`` at the harness context ``n_ctx`` under each of ``configs``
    (dense first); ``label`` names its runs and logs."""

    n_ctx: int
    configs: tuple[AttnConfig, ...]
    requests: tuple[dict[str, Any], ...]
    label: str


@dataclasses.dataclass
class Decoded:
    """Per group: config name -> request id -> result; the per-config runs (their timings; none when the
    configs shared a prefill)."""

    results: list[dict[str, dict[str, dict[str, Any]]]]
    runs: list[RunResult]


def decode(harness: Harness, groups: Sequence[Group], *, shared_prefill: bool, jobs: int = 1,
           show_progress: bool = False, on_result: OnResult | None = None) -> Decoded:
    """Every group's requests under each of its configs, the one way the lab decodes: with ``shared_prefill``
    one process per group, each request prefilled once and decoded by every config
    (:meth:`Harness.run_variants`, its log ``<label>.log``); else one process per group and config, ``jobs``
    at once, the largest first (:func:`run_tasks`). Either way a request's ``dump`` is written as
    ``<dump>.<config name>``."""
    if shared_prefill:
        results = []
        with tempfile.TemporaryDirectory(prefix="opencoti-decode-") as tmp:
            for g in groups:
                log = (harness.log_dir or Path(tmp)) / f"{slug(g.label)}.log"
                out = harness.run_variants(g.requests, g.n_ctx, g.configs, log, on_result)
                by_cfg: dict[str, dict[str, dict[str, Any]]] = {c.name: {} for c in g.configs}
                for r in out:
                    by_cfg[r["variant"]][r["id"]] = r
                results.append(by_cfg)
        return Decoded(results, [])
    tasks = [Task(g.n_ctx, cfg, tuple({**r, "dump": f"{r['dump']}.{cfg.name}"} if "dump" in r else r
                                      for r in g.requests), f"{g.label} {cfg.name}")
             for g in groups for cfg in g.configs]
    title = f"{groups[0].label.split()[0] if groups else ''} ({len(tasks)} runs)"
    runs = run_tasks(harness, tasks, jobs, title, show_progress)
    results = [{} for _ in groups]
    i = 0
    for gi, g in enumerate(groups):
        for cfg in g.configs:
            results[gi][cfg.name] = {r["id"]: r for r in runs[i].results}
            i += 1
    return Decoded(results, runs)


def clean_env() -> dict[str, str]:
    """The environment without llama.cpp's ``LLAMA_ARG_*`` mirrors: only the command line sets a run up."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}


def check_sparse_ran(result: dict[str, Any], sparse: bool, label: str) -> None:
    """The sparse path ran in the decode steps of a sparse run, and only there (a sparse run whose select
    nodes are zero fell back to dense silently), never in the prefill."""
    if result.get("decode_steps", 0) == 0:
        return
    sel = int(result.get("select_nodes", 0))
    if sparse and sel == 0:
        raise CheckFailed(f"{label}: request {result.get('id')}: no SPARSE_ATTN_SELECT node ran in "
                          f"{result.get('decode_steps')} decode steps: the sparse path is not active")
    if not sparse and sel != 0:
        raise CheckFailed(f"{label}: request {result.get('id')}: a dense run computed {sel} select nodes")
    if int(result.get("select_nodes_prefill", 0)) != 0:
        raise CheckFailed(f"{label}: request {result.get('id')}: the select op ran during the prefill")


_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def check_offload(log_text: str, ngl: int, log: Path) -> str | None:
    """``N/M`` from llama's "offloaded N/M layers to GPU" line; with ``ngl`` > 0 every asked layer must be on
    the GPU (a CPU build prints no such line, a GPU build with too little memory fewer layers), else an
    error."""
    found = _OFFLOADED.findall(log_text)
    got = f"{found[-1][0]}/{found[-1][1]}" if found else None
    if ngl > 0 and (not found or int(found[-1][0]) < min(ngl, int(found[-1][1]))):
        raise OpencotiError(f"asked for -ngl {ngl}, but the harness offloaded {got or 'no'} layers to a GPU "
                            f"(a build without a GPU backend? log {log})")
    return got


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")

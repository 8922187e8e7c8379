"""The selector tools on real prose (``opencoti-patch lab selector``): their workspace, the two tables
computed offline from Q/K dumps, and the one report every tool merges its part into.

- :class:`Workspace`: the build's programs (built on first use), the model, the prose corpus, a scratch folder
  holding the Q/K dumps of dense prefills (each reused while its text, model and arguments stay the same), and
  what a report says about the run (:meth:`Workspace.meta`).
- :func:`recall_table`: the share of the dense attention mass each scorer's selection keeps, against the
  oracle and the window (:mod:`opencoti_patch.lab.recall`).
- :func:`needle_table`: whether each scorer keeps the block holding a passkey's needle at the queries that
  answer it.
- :func:`save_part`, :func:`write_markdown`, :func:`rerender`: ``<out-dir>/<name>.json`` and its Markdown,
  every tool's part in one report (the passkey and fidelity parts come from :mod:`opencoti_patch.lab.needle`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from ..config import Settings, write_report
from ..errors import OpencotiError
from ..report import info, render
from ..stack.upstream import sha256_file
from . import needle, prose, recall
from .batch import BATCH_EXE, DUMP_EXE, Harness, Offload, build_lab_harness
from .model import find_model
from .runinfo import machine_line
from .variants import BLOCK, RECENT, SINK

DEFAULT_PROSE = Path("/usr/share/doc/python3/html")  # Debian's python3-doc
REPORT_PARTS = ("recall", "needles", "passkey", "fidelity")


@dataclass
class Workspace:
    """Where a selector tool runs: ``bin`` (the build's bin/), ``llama_src`` (its source, the headers of the
    lab's programs), ``model``, the prose ``paragraphs`` of ``prose_dirs``, the scratch folder ``work`` and
    where the harness runs (``offload``)."""

    llama_src: Path
    bin: Path
    model: Path
    prose_dirs: list[Path]
    work: Path
    offload: Offload
    paragraphs: list[str]

    @classmethod
    def open(cls, build_dir: Path, llama_src: Path | None = None, model: Path | None = None,
             prose_dirs: Sequence[Path] = (), work_dir: Path | None = None,
             offload: Offload | None = None) -> Workspace:
        """The workspace of a build (defaults: the project's tree, the [model] extra's model, Debian's Python
        documentation, ``<work>/selector``); reads the prose corpus."""
        settings = Settings.resolve()
        dirs = list(prose_dirs) or [DEFAULT_PROSE]
        work = (work_dir or settings.work_dir / "selector").resolve()
        work.mkdir(parents=True, exist_ok=True)
        info(f"prose: reading {', '.join(map(str, dirs))}")
        paragraphs = prose.load_corpus(dirs)
        info(f"prose: {len(paragraphs)} paragraphs, {sum(map(len, paragraphs)) // 1000} k characters")
        return cls(llama_src=(llama_src or settings.tree).resolve(), bin=(build_dir / "bin").resolve(),
                   model=find_model(model), prose_dirs=dirs, work=work, offload=offload or Offload(),
                   paragraphs=paragraphs)

    def exe(self, target: str) -> Path:
        """The lab's program ``target``, built against this build (once: the harness build is reused)."""
        return build_lab_harness(self.llama_src, self.bin, self.work / "harness", targets=(target,)) / target

    def harness(self, threads: int) -> Harness:
        """``opencoti-harness-batch`` of this build on the model, with ``threads`` and the offload (and
        ``--swa-full``: Gemma 3 is iSWA, and a full-size SWA cache lets a prompt keep the common prefix of the
        one before)."""
        return Harness(self.exe(BATCH_EXE), self.model, threads=threads, extra=("--swa-full",),
                       offload=self.offload, log_dir=self.work / "logs")

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
            raise OpencotiError(f"{exe.name} failed: {proc.stderr.strip().splitlines()[-1:]}")
        key_file.write_text(json.dumps(key))
        return dump

    def meta(self, splits: Sequence[recall.Split] = ()) -> dict[str, Any]:
        """What the report says about the run: model, prose, machine, offload, the selection's geometry."""
        recent: int | str = RECENT
        if splits and (len(splits) > 1 or splits[0].of_budget or splits[0].tokens != RECENT):
            recent = " / ".join(s.name.removeprefix("r") for s in splits)
        return {"model": self.model.name, "prose": ", ".join(p.name for p in self.prose_dirs),
                "prose_sha256": {p.name: sha256_file(p) for p in self.prose_dirs if p.is_file()},
                "machine": machine_line(self.offload.ngl), "ngl": self.offload.ngl,
                "harness_args": list(self.offload.extra), "block": BLOCK, "sink": SINK,
                "recent": recent}


def feasible_shares(shares: Sequence[float], n_ctx: int, splits: Sequence[recall.Split],
                    block: int = BLOCK) -> list[float]:
    """The shares that leave at least one top-k block at this context with some split (the others are only
    sink + recent)."""
    out = []
    for share in shares:
        for split in splits:
            try:
                recall.budget_for(n_ctx, share, block, SINK, split)
            except OpencotiError:
                continue
            out.append(share)
            break
    if not out:
        raise OpencotiError(f"no share in {list(shares)} leaves a top-k block at context {n_ctx}")
    return out


def recall_table(ws: Workspace, *, texts: dict[int, int], layers: Sequence[int], shares: Sequence[float],
                 scorers: Sequence[recall.Scorer], splits: Sequence[recall.Split], block: int, q_last: int,
                 scale: float | None, seed: int, threads: int) -> dict[str, Any]:
    """Per context (``texts``: context -> texts): the attention mass each scorer keeps, over every layer of
    every text (one dense prefill each); ``splits`` after the first are rows ``<scorer>@r<window>``."""
    if block <= 0 or SINK % block:
        raise OpencotiError(f"the selection unit must divide the {SINK}-token sink, got {block}")
    multi = list(splits) if len(splits) > 1 else []
    layer_arg = ",".join(map(str, layers))
    rng = random.Random(seed)
    table: dict[str, Any] = {}
    n_texts: dict[str, int] = {}
    for n_ctx, count in texts.items():
        per_layer: dict[str, Any] = {}
        for i in range(count):
            text = prose.take_text(ws.paragraphs, rng.randrange(len(ws.paragraphs)), int(n_ctx * 5.5))
            dump = ws.qk_dump(ws.work / f"qk-{n_ctx}-{seed}-{i}", text,
                              ["--layers", layer_arg, "--q-last", str(q_last), "--max-tokens", str(n_ctx),
                               "-t", str(threads), "-ngl", str(ws.offload.ngl)],
                              f"recall {n_ctx}: dense prefill of text {i + 1}/{count}")
            for layer in layers:
                q, k = recall.load_dump(dump, layer)
                if k.shape[0] != n_ctx:
                    raise OpencotiError(f"{dump}: the text gave {k.shape[0]} tokens, {n_ctx} needed")
                sc = scale if scale is not None else 1.0 / math.sqrt(k.shape[2])
                per_layer[f"{i}/{layer}"] = recall.layer_recall(
                    q, k, scale=sc, block=block, shares=feasible_shares(shares, n_ctx, splits, block),
                    scorers=list(scorers), sink=SINK, recent=splits[0], splits=multi)
        table[str(n_ctx)] = recall.aggregate(per_layer)
        n_texts[str(n_ctx)] = count
        info(f"recall {n_ctx}: done")
    return {"layers": list(layers), "q_last": q_last, "table": table, "texts": n_texts,
            "scorers": [s.name for s in scorers], "splits": [s.name for s in multi]}


NEEDLE_QUERIES = 7  # the answer frame and the key's digits: the queries that answer a passkey


def digit_tokens(model: Path) -> dict[str, int]:
    """The model's single-digit tokens (text -> id), from its GGUF vocabulary (needs the gguf package)."""
    try:
        from gguf import GGUFReader  # noqa: PLC0415
    except ImportError as exc:
        raise OpencotiError("the needle table needs the gguf package (pip install gguf)") from exc
    field = GGUFReader(str(model)).fields["tokenizer.ggml.tokens"]
    vocab = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
    return {t: i for i, t in enumerate(vocab) if len(t) == 1 and t.isdigit()}


def needle_table(ws: Workspace, *, samples: dict[int, int], layers: Sequence[int], shares: Sequence[float],
                 scorers: Sequence[recall.Scorer], splits: Sequence[recall.Split], seed: int,
                 threads: int) -> dict[str, Any]:
    """Per context (and share, when several): the share of the answering queries at which each scorer keeps a
    block holding the key's digits, per layer and over all, from one dense prefill of each passkey prompt
    (the answer teacher-forced)."""
    digit = digit_tokens(ws.model)
    layer_arg = ",".join(map(str, layers))
    table: dict[str, Any] = {}
    for n_ctx, count in samples.items():
        hits: dict[float, dict[str, dict[str, list[float]]]] = {share: {} for share in shares}
        for smp in needle.make_samples(seed, n_ctx, count, len(ws.paragraphs), per_doc=1):
            prompt = smp.prompt(ws.paragraphs, int((n_ctx - 168) * 3.8))  # ~4 characters a token
            dump = ws.qk_dump(ws.work / f"needle-{smp.sid}-{seed}", prompt + " " + smp.key + ".",
                              ["--layers", layer_arg, "--q-last", "12", "-t", str(threads),
                               "-ngl", str(ws.offload.ngl)], f"needles {n_ctx}: dense prefill of {smp.sid}")
            _needle_hits(dump, smp, [digit[c] for c in smp.key], layers, shares, scorers, splits, hits)
        for share in shares:  # one table per context (and per share, when several)
            if hits[share]:
                table[str(n_ctx) if len(shares) == 1 else f"{n_ctx}:{share:g}"] = {
                    sname: {"all": float(np.mean([v for x in per.values() for v in x])),
                            **{f"layer {lay}": float(np.mean(x)) for lay, x in per.items()}}
                    for sname, per in hits[share].items()}
        info(f"needles {n_ctx}: done")
    return {"layers": list(layers), "samples": {str(c): n for c, n in samples.items()},
            "share": shares[0], "shares": list(shares), "table": table,
            "splits": [s.name for s in splits if len(splits) > 1]}


def _needle_hits(dump: Path, smp: needle.Sample, key: list[int], layers: Sequence[int],
                 shares: Sequence[float], scorers: Sequence[recall.Scorer], splits: Sequence[recall.Split],
                 hits: dict[float, dict[str, dict[str, list[float]]]]) -> None:
    """Add one prompt's kept-needle shares to ``hits[share][row][layer]``."""
    tokens = [int(t) for t in np.load(dump / "tokens.npy")]
    at = next((i for i in range(len(tokens) - 20) if tokens[i:i + len(key)] == key), None)
    if at is None:
        raise OpencotiError(f"{smp.sid}: the key's digits are not in the prompt's tokens")
    blocks = {at // BLOCK, (at + len(key) - 1) // BLOCK}
    positions = np.arange(len(tokens) - NEEDLE_QUERIES, len(tokens))
    budgets: list[tuple[float, str, recall.Budget]] = []
    for share in shares:
        for split in splits:  # a split that leaves no top-k block is left out
            try:
                bud = recall.budget_for(len(tokens), share, BLOCK, SINK, split)
            except OpencotiError:
                continue
            budgets.append((share, f"@{split.name}" if len(splits) > 1 else "", bud))
    for layer in layers:
        q, k = recall.load_dump(dump, layer)
        sc = 1.0 / math.sqrt(k.shape[2])
        gqa = q.shape[1] // k.shape[1]
        for h in range(k.shape[1]):
            windowed: set[float] = set()  # the window is the same for every split of a share
            for share, sfx, bud in budgets:
                res = recall.needle_kept(q[-NEEDLE_QUERIES:, h * gqa:(h + 1) * gqa], k[:, h], positions,
                                         blocks, scale=sc, block=BLOCK, budget=bud,
                                         scorers=list(scorers))
                for sname, v in res.items():
                    if sname == "window" and share in windowed:
                        continue
                    row = sname if sname == "window" else sname + sfx
                    hits[share].setdefault(row, {}).setdefault(str(layer), []).append(float(sum(v)) / len(v))
                windowed.add(share)


def save_part(out_dir: Path, name: str, part: str, data: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Merge ``data`` as ``part`` (and ``meta``) into ``<out_dir>/<name>.json``, write its Markdown; returns
    the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged |= meta
    merged[part] = data
    write_report(path, json.dumps(merged, indent=1, sort_keys=True) + "\n")
    write_markdown(path.with_suffix(".md"), merged)
    return path


def write_markdown(path: Path, data: dict[str, Any]) -> None:
    """The report of one JSON result (every part it holds: recall, needles, passkey, fidelity)."""
    context: dict[str, Any] = {part: None for part in REPORT_PARTS} | data
    write_report(path, render(Settings.resolve().templates_dirs, "quality-selector.md.j2", **context))


def rerender(path: Path) -> Path:
    """Write the Markdown of the JSON result ``path`` again, with the current template (passkey results gain
    their change per 100 prompts against dense and its interval); returns the Markdown's path. The JSON is
    not changed. A file that is not such a result is an error that says why."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OpencotiError(f"{path}: not a readable JSON result ({e})") from None
    if not isinstance(data, dict) or not any(k in data for k in REPORT_PARTS):
        raise OpencotiError(f"{path}: no recall, needles, passkey or fidelity result in it")
    try:
        if data.get("passkey"):
            needle.reorder_variants(data["passkey"], data.get("blocks") or [BLOCK],
                                    data.get("scores") or ["max"])
            needle.annotate_paired(data["passkey"])
        write_markdown(path.with_suffix(".md"), data)
    except (KeyError, TypeError, ValueError, AttributeError, jinja2.UndefinedError) as e:
        why = f"{type(e).__name__}: {e}"
        raise OpencotiError(f"{path}: not a result this version can report ({why})") from None
    return path.with_suffix(".md")

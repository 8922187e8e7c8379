"""The eval gates' report: ``<out-dir>/<name>.json`` (gates run separately merge into it) and its Markdown
(template ``quality.md.j2``), and what it says about the run (the model, the harness and its commands, the
build, the command line)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Settings, write_report
from ..stack.gitrun import run_git
from .batch import Harness
from .evaluate import MIN_GATE_SAMPLES, fidelity_gate
from .runinfo import command_line


def merge_results(path: Path, update: dict[str, Any]) -> dict[str, Any]:
    """Load ``path`` (JSON) if present, overwrite the keys of ``update``, write it back (sorted keys)."""
    data: dict[str, Any] = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            data = {}
    data.update(update)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_report(path, json.dumps(_jsonable(data), indent=1, sort_keys=True) + "\n")
    return json.loads(path.read_text())


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def save_gate_results(out_dir: Path, name: str, update: dict[str, Any],
                      meta: dict[str, Any] | None) -> tuple[Path, Path]:
    """Merge the gates of ``update`` (and ``meta``) into ``<out-dir>/<name>.json``, render its .md.

    Gates run separately merge: the commands of the gates run before are kept in ``meta``.
    ``meta`` None: only re-render (after a template change). Returns (md, json) paths.
    """
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    if meta is not None:
        old = merge_results(json_path, {}) if json_path.is_file() else {}
        if "meta" in old:  # keep the commands of the gates run before
            meta["cli"] = sorted(set(old["meta"].get("cli", [])) | set(meta.get("cli", [])))
            before = old["meta"].get("harness_commands", [])
            meta["harness_commands"] = list(dict.fromkeys(before + meta.get("harness_commands", [])))
        update = {**update, "meta": meta}
    data = merge_results(json_path, update)
    fid = data.get("fidelity")
    if fid and "gate" not in fid:  # recorded before the gate existed: apply it to the recorded runs
        fid["gate"] = fidelity_gate(fid["runs"], min_samples=int(fid.get("min_samples", MIN_GATE_SAMPLES)))
    write_report(md_path, render_report(default_template_dirs(), data))
    return md_path, json_path


def render_report(template_dirs: Iterable[Path], data: dict[str, Any]) -> str:
    from ..report import render  # noqa: PLC0415 (click-free callers of the math need not import jinja2)

    return render(list(template_dirs), "quality.md.j2", **data_for_template(data))


def data_for_template(data: dict[str, Any]) -> dict[str, Any]:
    return {"meta": data.get("meta", {}), "passkey": data.get("passkey"), "fidelity": data.get("fidelity")}


def default_template_dirs() -> list[Path]:
    """The project's template override, then the shipped templates (``Settings.templates_dirs``)."""
    return Settings.resolve().templates_dirs


def build_meta(build_dir: Path) -> dict[str, Any]:
    """A few CMake cache facts of the llama.cpp build the harness ran on (speed depends on them)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return {}
    keys = ("CMAKE_BUILD_TYPE", "GGML_NATIVE", "GGML_CUDA", "BUILD_SHARED_LIBS")
    found = {}
    for line in cache.read_text(errors="replace").splitlines():
        name, _, value = line.partition("=")
        name = name.split(":")[0]
        if name in keys:
            found[name] = value
    note = ", ".join(f"{k}={found[k]}" for k in keys if k in found)
    return {"build_dir": str(build_dir), "build_cache": found,
            "build_note": f"llama.cpp build `{build_dir}` ({note})."}


def environment_meta(model: Path, harness: Harness, tree: Path | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"model": model.name, "model_path": str(model), "threads": harness.threads,
                            "harness": str(harness.exe), "cpu_count": os.cpu_count(),
                            "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if tree is not None and (tree / ".git").exists():
        def git(*args: str) -> str:
            return run_git(tree, *args).text.strip()
        meta["tree"] = str(tree)
        meta["tree_head"] = git("rev-parse", "--short", "HEAD")
        meta["tree_dirty_files"] = len([ln for ln in git("status", "--porcelain").splitlines() if ln])
    return meta


def run_meta(harness: Harness, llama_src: Path | None, build_dir: Path, jobs: int, seconds: float,
             argv: list[str] | None = None) -> dict[str, Any]:
    """What the report says about this run: the environment, the command line, the harness commands, the
    build."""
    meta = environment_meta(harness.model, harness, llama_src)
    meta["cli"] = [command_line(argv)]
    meta["harness_commands"] = harness.commands
    meta["jobs"] = jobs
    meta |= build_meta(build_dir)
    meta["seconds"] = seconds
    return meta

"""The stamp of a build and its manifest: the series fingerprint and the commit string the binaries
carry, the artifacts (sha256 of each DSO and tool), the manifest (JSON + Markdown), installing the DSOs
with every copy checked, and ``rebuild`` (export, build, stamp, install).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..config import write_report
from ..errors import CheckFailed, OpencotiError
from ..report import render
from ..stack.gitrun import run_git
from ..stack.series import read_series
from ..stack.upstream import sha256_file
from .builder import BuildOptions, BuildResult, configure_and_build, export_tree, find_tool, tool_version

MANIFEST_JSON = "opencoti-build-manifest.json"
MANIFEST_MD = "opencoti-build-manifest.md"


# --------------------------------------------------------------------------- series fingerprint

def series_fingerprint(patches_dir: Path | None) -> str:
    """sha256 over the series file and each patch's bytes, in series order.

    Framing: ``series\\0<len>\\0<bytes>`` then per patch ``<name>\\0<len>\\0<bytes>``, so moving
    bytes between files changes the hash. No series (or no patches dir) hashes the empty series.
    """
    h = hashlib.sha256()
    series_bytes = b""
    names: list[str] = []
    if patches_dir is not None and (Path(patches_dir) / "series").is_file():
        series_bytes = (Path(patches_dir) / "series").read_bytes()
        names = read_series(Path(patches_dir))
    h.update(b"series\0%d\0" % len(series_bytes) + series_bytes)
    for name in names:
        path = Path(patches_dir or ".") / name
        if not path.is_file():
            raise OpencotiError(f"series names {name}, which is not in {patches_dir}")
        data = path.read_bytes()
        h.update(name.encode() + b"\0%d\0" % len(data) + data)
    return h.hexdigest()


def build_stamp(pin: str, fingerprint: str, identity: dict[str, Any] | None = None) -> str:
    """What ``llama-cli --version`` shows as the commit: ``<pin>+<first 12 of the fingerprint>``, and
    ``<pin>@<release or commit>+...`` when the pin's name is not already its release or commit (a
    release pin has no commit: its release tag says which upstream it is; the manifest adds the
    archive's sha256)."""
    ident = identity or {}
    commit, release = ident.get("commit") or "", ident.get("release") or ""
    token = release or commit[:9]
    if not token or pin == release or (commit and commit.startswith(pin)):
        return f"{pin}+{fingerprint[:12]}"
    return f"{pin}@{token}+{fingerprint[:12]}"



# --------------------------------------------------------------------------- artifacts

@dataclass(frozen=True)
class Artifact:
    name: str  # file name in bin/ (the real file, e.g. libllama.so.0.0.11312)
    kind: str  # "dso" or "tool"
    sha256: str
    size: int
    links: tuple[str, ...] = ()  # symlinks in bin/ pointing at it (libllama.so, libllama.so.0)


def collect_artifacts(bin_dir: Path, tools: Iterable[str] = ()) -> list[Artifact]:
    """Shared objects (real files, with their symlinks) and the named executables of ``bin_dir``."""
    bin_dir = Path(bin_dir)
    links: dict[str, list[str]] = {}
    for p in sorted(bin_dir.glob("lib*.so*")):
        if p.is_symlink():
            links.setdefault(p.resolve().name, []).append(p.name)
    out = []
    for p in sorted(bin_dir.glob("lib*.so*")):
        if p.is_file() and not p.is_symlink():
            out.append(Artifact(p.name, "dso", sha256_file(p), p.stat().st_size,
                                tuple(links.get(p.name, []))))
    for name in sorted(set(tools)):
        p = bin_dir / name
        if p.is_file() and os.access(p, os.X_OK):
            out.append(Artifact(name, "tool", sha256_file(p), p.stat().st_size))
    return out


def artifact_key(name: str) -> str:
    """Version-free name for comparing builds: libllama.so.0.0.11312 -> libllama.so."""
    m = re.match(r"^(lib.+?\.so)(\.\d+)*$", name)
    return m.group(1) if m else name


# --------------------------------------------------------------------------- manifest

def toolchain_versions(build: Path, cuda: bool) -> dict[str, str | None]:
    cache = (Path(build) / "CMakeCache.txt")
    entries: dict[str, str] = {}
    if cache.is_file():
        for line in cache.read_text(errors="replace").splitlines():
            m = re.match(r"^(CMAKE_C_COMPILER|CMAKE_CXX_COMPILER|CMAKE_CUDA_COMPILER):[A-Z]+=(.*)$", line)
            if m:
                entries[m.group(1)] = m.group(2)
    cc = entries.get("CMAKE_C_COMPILER") or "cc"
    cxx = entries.get("CMAKE_CXX_COMPILER") or "c++"
    nvcc = entries.get("CMAKE_CUDA_COMPILER") or shutil.which("nvcc")
    return {
        "cmake": tool_version([find_tool("cmake")]),
        "ninja": tool_version([find_tool("ninja")]),
        "cc": tool_version([cc]),
        "cxx": tool_version([cxx]),
        "nvcc": tool_version([nvcc]) if (cuda and nvcc) else None,
        "ccache": tool_version(["ccache"]) if shutil.which("ccache") else None,
    }


def portable_args(args: Sequence[str], src: Path, build: Path) -> list[str]:
    """CMake args with the machine's paths replaced by <src>/<build>/<python> (stable manifests)."""
    out = []
    for a in args:
        a = a.replace(str(build), "<build>").replace(str(src), "<src>").replace(sys.executable, "<python>")
        out.append(a)
    return out


def make_manifest(result: BuildResult, *, pin: str, fingerprint: str, series: list[str],
                  source: dict[str, Any], tools: Iterable[str],
                  identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """The build manifest; ``identity``: what the pin is (``Tree.identity``: its llama.cpp commit, or
    its release and archive sha256, and that in words)."""
    arts = collect_artifacts(result.bin, tools)
    return {
        "schema": 1,
        "generator": f"opencoti-patch {__version__}",
        "upstream_pin": pin,
        "upstream": identity or {"pin": pin, "identity": "unknown"},
        "series_fingerprint": fingerprint,
        "series": series,
        "build_commit": result.options.build_commit,
        "build_number": result.options.build_number,
        "source": source,
        "cpu_variant": result.options.cpu_variant,
        "cuda": result.options.cuda,
        "cuda_arch": result.options.cuda_arch if result.options.cuda else None,
        "targets": result.targets,
        "skipped_optional_targets": result.missing_optional,
        "cmake_options": portable_args(result.cmake_args, result.src, result.build),
        "toolchain": toolchain_versions(result.build, result.options.cuda),
        "artifacts": [asdict(a) | {"links": list(a.links)} for a in arts],
    }


def write_manifest(manifest: dict[str, Any], out_dir: Path,
                   template_dirs: Sequence[Path]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / MANIFEST_JSON
    write_report(js, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    md = out_dir / MANIFEST_MD
    write_report(md, render(template_dirs, "build-manifest.md.j2", m=manifest))
    return js, md


def install(manifest: dict[str, Any], bin_dir: Path, dest: Path) -> list[str]:
    """Copy the manifest's DSOs (+ their soname links) to ``dest`` and check every copy's sha256."""
    dest.mkdir(parents=True, exist_ok=True)
    problems = []
    copied = []
    for art in manifest["artifacts"]:
        if art["kind"] != "dso":
            continue
        target = dest / art["name"]
        if target.exists() or target.is_symlink():
            target.unlink()
        shutil.copy2(Path(bin_dir) / art["name"], target)
        copied.append(art["name"])
        for link in art["links"]:
            lp = dest / link
            if lp.exists() or lp.is_symlink():
                lp.unlink()
            lp.symlink_to(art["name"])
    for art in manifest["artifacts"]:
        if art["kind"] != "dso":
            continue
        got = sha256_file(dest / art["name"])
        if got != art["sha256"]:
            problems.append(f"{dest / art['name']}: sha256 {got} != manifest {art['sha256']}")
        for link in art["links"]:
            if (dest / link).resolve() != (dest / art["name"]).resolve():
                problems.append(f"{dest / link} does not point at {art['name']}")
    (dest / MANIFEST_JSON).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if problems:
        raise CheckFailed("install verification failed:\n" + "\n".join(problems))
    return copied


def git_source_info(tree: Path, rev: str | None) -> dict[str, Any]:
    info: dict[str, Any] = {"tree": str(tree), "rev": rev or "working-tree"}
    if (Path(tree) / ".git").exists():
        info["commit"] = run_git(tree, "rev-parse", rev or "HEAD").text.strip() or None
        if rev is None:
            info["dirty"] = bool(run_git(tree, "status", "--porcelain").text.strip())
    return info


# --------------------------------------------------------------------------- rebuild command

def rebuild(tree: Path, work: Path, opts: BuildOptions, *, label: str, rev: str | None,
            pin: str, patches_dir: Path | None, template_dirs: Sequence[Path],
            install_dirs: Sequence[Path] = (), fresh: bool = False, progress: bool = True,
            stale: Sequence[str] = (), identity: dict[str, Any] | None = None,
            ) -> tuple[dict[str, Any], Path]:
    """Export, build and stamp; ``stale``: why the tree is not exactly pristine + the series
    fingerprinted in the stamp (recorded in the manifest; empty: it is); ``identity``: the pin's."""
    work = Path(work).resolve()
    fingerprint = series_fingerprint(patches_dir)
    opts = replace(opts, build_commit=build_stamp(pin, fingerprint, identity))
    exported = export_tree(tree, work / label / "src", rev)
    result = configure_and_build(exported.dest, work / label / "build", opts, label=label, work_root=work,
                                 fresh=fresh, progress=progress)
    result.export = exported
    tools = [t for t in result.targets if t.startswith(("llama-", "test-")) and t != "llama-common"]
    manifest = make_manifest(result, pin=pin, fingerprint=fingerprint,
                             series=read_series(Path(patches_dir)) if patches_dir else [],
                             source=git_source_info(Path(tree), rev), tools=tools, identity=identity)
    manifest["tree_matches_series"] = not stale
    manifest["stale"] = list(stale)
    out_dir = result.build
    write_manifest(manifest, out_dir, template_dirs)
    for d in install_dirs:
        install(manifest, result.bin, Path(d))
    return manifest, out_dir

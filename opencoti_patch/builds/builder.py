"""Build llama.cpp as runtime-loadable DSOs + tools, reproducibly (``stamp.py`` stamps the build,
writes its manifest and installs it).

How the bytes are kept independent of where and when the build runs (see docs/usage.md):

- The tree is *exported* (tracked + untracked-not-ignored files of the working tree, or ``git
  archive REV``) into ``<work>/<label>/src``: no ``.git``, so nothing of the tree's git state can
  leak in. On top of that, CMake's git lookups (``GIT_EXE`` in ggml, ``GIT_EXECUTABLE`` in
  build-info/git-vars) point at a stub that answers the stamp: the build is identical whether the
  export sits inside some other git repository or not, and libggml-base's ``ggml_commit()`` carries
  the stamp too. The export is synced (only changed files are rewritten), so a reused build dir
  rebuilds incrementally.
- ``-ffile-prefix-map`` maps the source dir to ``.`` and the build dir to ``build`` (C, C++ and,
  through ``-Xcompiler``, CUDA), ``CMAKE_BUILD_RPATH_USE_ORIGIN`` makes RUNPATHs ``$ORIGIN``, the CPU
  variant is explicit (``GGML_NATIVE=OFF`` + every x86 feature flag ON/OFF, so ``SOURCE_DATE_EPOCH``
  cannot silently change it), ``LLAMA_BUILD_NUMBER/COMMIT`` are fixed, and nvcc gets a
  ``--frandom-seed`` per file and the relative path as cudafe++'s ``--orig_src_path_name`` through
  a compiler launcher (see NVCC_LAUNCHER). The default CUDA arch is ``90-real`` (SASS only): the
  PTX that ``90`` embeds was seen to differ by a few bytes between two parallel builds (nvcc 13.0,
  H200 machine), the cubins never; with ``90-real`` two fresh builds in different folders gave a
  byte-identical libggml-cuda.so.
- ccache is used when present, without ``CCACHE_BASEDIR`` (see build_env): a ccache build and a
  plain one give the same bytes. ``-ffile-prefix-map=../src=.`` also maps paths relative to the
  build dir (``../src/...`` in the ``<label>/src`` + ``<label>/build`` layout).
"""

from __future__ import annotations

import io
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..errors import OpencotiError
from ..stack.gitrun import run_git

# --------------------------------------------------------------------------- constants

# Targets of `rebuild` by default (libggml-base / libggml come with them).
LIB_TARGETS = ("ggml-base", "ggml", "ggml-cpu", "llama", "llama-common")
TOOL_TARGETS = ("llama-cli", "llama-server", "llama-bench", "llama-perplexity", "test-backend-ops")
# Built when the tree defines them (the sparse-attn stack adds them; test-sparse-attn only without
# GGML_BACKEND_DL, test-sparse-attn-kv also with it: `-g` compares the GPU with the CPU).
OPTIONAL_TARGETS = ("test-sparse-attn", "test-sparse-attn-kv")
CUDA_TARGET = "ggml-cuda"

X86_FEATURES = ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI",
                "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16")
# The names of ggml's GGML_CPU_ALL_VARIANTS builds (ggml/src/CMakeLists.txt) -> features ON.
CPU_VARIANTS: dict[str, tuple[str, ...]] = {
    "x64": (),
    "sse42": ("SSE42",),
    "sandybridge": ("SSE42", "AVX"),
    "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"),
    "haswell": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
    "skylakex": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"),
    "icelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI"),
}
# Not x86-specific: "default" = GGML_NATIVE=OFF and ggml's defaults (the right choice off x86),
# "native" = -march=native (not portable, not reproducible across machines), "all" = every variant.
CPU_VARIANT_CHOICES = (*CPU_VARIANTS, "default", "native", "all")
DEFAULT_CPU_VARIANT = "haswell" if platform.machine().lower() in ("x86_64", "amd64") else "default"

EXPORT_EXCLUDE_DIRS = ("docs", "media", ".github", ".devops")  # nothing in them is compiled

_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]\s*(.*)$")
_ERROR_LINE = re.compile(r"(\berror\b[:\s]|^FAILED: |\bError \d|CMake Error|undefined reference)")


# --------------------------------------------------------------------------- tool lookup

def find_tool(name: str) -> str:
    """The cmake/ninja binary of the PyPI package (our pinned versions), else the one on PATH."""
    try:
        if name == "cmake":
            import cmake  # noqa: PLC0415

            candidate = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        elif name == "ninja":
            import ninja  # noqa: PLC0415

            candidate = Path(ninja.BIN_DIR) / "ninja"
        else:
            candidate = None
        if candidate is not None and candidate.is_file():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    found = shutil.which(name)
    if not found:
        raise OpencotiError(f"{name} not found (pip install {name}, or put it on PATH)")
    return found


def tool_version(cmd: Sequence[str]) -> str | None:
    """First line of ``cmd --version`` (None when the tool is missing)."""
    try:
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    if cmd and Path(cmd[0]).name.startswith("nvcc"):
        lines = [ln for ln in text.splitlines() if ln.startswith(("Cuda compilation", "Build"))]
        return "; ".join(lines) or None
    return text.splitlines()[0] if text else None


def have_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


# --------------------------------------------------------------------------- tree export

def _excluded(rel: str) -> bool:
    top = rel.split("/", 1)[0]
    if top in EXPORT_EXCLUDE_DIRS or top == ".git":
        return True
    return rel.startswith("models/") and rel.endswith(".gguf")


def _sync_file(dest: Path, data: bytes, mode: int) -> bool:
    """Write ``data`` unless ``dest`` already holds it (keeps mtimes -> ninja stays incremental)."""
    if dest.is_file() and not dest.is_symlink():
        if dest.stat().st_size == len(data) and dest.read_bytes() == data:
            if (dest.stat().st_mode & 0o111) != (mode & 0o111):
                dest.chmod(mode)
            return False
    elif dest.exists() or dest.is_symlink():
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        else:
            dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    dest.chmod(mode)
    return True


def _sync_link(dest: Path, target: str) -> bool:
    if dest.is_symlink() and os.readlink(dest) == target:
        return False
    if dest.is_dir() and not dest.is_symlink():
        shutil.rmtree(dest)
    elif dest.exists() or dest.is_symlink():
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.symlink_to(target)
    return True


@dataclass
class ExportResult:
    dest: Path
    files: int
    written: int
    removed: int
    source: str  # "working-tree", "git:<rev>" or "dir"


def _tree_entries(tree: Path, rev: str | None) -> Iterator[tuple[str, bytes | None, int, str | None]]:
    """(relative path, bytes or None for a symlink, mode, link target) of what gets exported."""
    if rev is not None:
        data = run_git(tree, "archive", "--format=tar", rev, check=True)
        assert isinstance(data.out, bytes)
        with tarfile.open(fileobj=io.BytesIO(data.out)) as tar:
            for m in tar:
                if m.isfile():
                    f = tar.extractfile(m)
                    yield m.name, f.read() if f else b"", 0o755 if m.mode & 0o111 else 0o644, None
                elif m.issym():
                    yield m.name, None, 0o777, m.linkname
        return
    if (tree / ".git").exists():
        out = run_git(tree, "ls-files", "-z", "-c", "-o", "--exclude-standard", check=True)
        rels = sorted({r for r in out.text.split("\0") if r})
    else:
        rels = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*")
                      if p.is_file() or p.is_symlink())
    for rel in rels:
        path = tree / rel
        if path.is_symlink():
            yield rel, None, 0o777, os.readlink(path)
        elif path.is_file():  # ls-files -c lists deleted files too
            yield rel, path.read_bytes(), 0o755 if os.access(path, os.X_OK) else 0o644, None


def export_tree(tree: Path, dest: Path, rev: str | None = None) -> ExportResult:
    """Sync ``dest`` to the tree's files (no .git, no docs/models blobs); only changes are written."""
    tree = Path(tree).resolve()
    dest = Path(dest)
    if not tree.is_dir():
        raise OpencotiError(f"source tree {tree} does not exist")
    dest.mkdir(parents=True, exist_ok=True)
    keep: set[str] = set()
    written = 0
    for rel, data, mode, link in _tree_entries(tree, rev):
        if _excluded(rel):
            continue
        keep.add(rel)
        target = dest / rel
        written += _sync_link(target, link) if data is None else _sync_file(target, data, mode)
    removed = 0
    for path in sorted(dest.rglob("*"), reverse=True):
        rel = path.relative_to(dest).as_posix()
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif rel not in keep:
            path.unlink()
            removed += 1
    # CMake wants these folders even when their content is not built
    (dest / "examples").mkdir(exist_ok=True)
    source = f"git:{rev}" if rev else ("working-tree" if (tree / ".git").exists() else "dir")
    return ExportResult(dest=dest, files=len(keep), written=written, removed=removed, source=source)


def changed_files(a: Path, b: Path) -> list[str]:
    """Relative paths whose content differs between two exported trees (added/removed included)."""
    def listing(root: Path) -> dict[str, Path]:
        return {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file() or p.is_symlink()}

    la, lb = listing(Path(a)), listing(Path(b))
    out = []
    for rel in sorted(set(la) | set(lb)):
        pa, pb = la.get(rel), lb.get(rel)
        if pa is None or pb is None:
            out.append(rel)
        elif pa.is_symlink() or pb.is_symlink():
            if not (pa.is_symlink() and pb.is_symlink() and os.readlink(pa) == os.readlink(pb)):
                out.append(rel)
        elif pa.stat().st_size != pb.stat().st_size or pa.read_bytes() != pb.read_bytes():
            out.append(rel)
    return out


# --------------------------------------------------------------------------- cmake configuration

@dataclass(frozen=True)
class BuildOptions:
    targets: tuple[str, ...] = (*LIB_TARGETS, *TOOL_TARGETS, *OPTIONAL_TARGETS)
    optional_targets: tuple[str, ...] = OPTIONAL_TARGETS
    cuda: bool = False
    cuda_arch: str = "90-real"
    cpu_variant: str = DEFAULT_CPU_VARIANT
    ccache: bool = True  # wanted; off where ccache is not installed (the one place that decides)
    build_commit: str = "unknown"
    build_number: int = 0
    jobs: int | None = None
    extra_cmake: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.ccache and not have_ccache():
            object.__setattr__(self, "ccache", False)


def cpu_variant_args(variant: str) -> list[str]:
    if variant == "native":
        return ["-DGGML_NATIVE=ON", "-DGGML_CPU_ALL_VARIANTS=OFF"]
    if variant == "all":
        return ["-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=ON"]
    args = ["-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF"]
    if variant == "default":
        return args
    if variant not in CPU_VARIANTS:
        raise OpencotiError(f"unknown CPU variant {variant!r} (one of {', '.join(CPU_VARIANT_CHOICES)})")
    on = set(CPU_VARIANTS[variant])
    return args + [f"-DGGML_{f}={'ON' if f in on else 'OFF'}" for f in X86_FEATURES]


def prefix_map_flags(src: Path, build: Path) -> str:
    """``__FILE__`` etc. as ``./<relative path>`` whatever the folders (``../src=.``: paths relative
    to the build dir in our ``<label>/src`` + ``<label>/build`` layout)."""
    return f"-ffile-prefix-map={src}=. -ffile-prefix-map={build}=build -ffile-prefix-map=../src=."


def have_ccache() -> bool:
    return shutil.which("ccache") is not None


def cmake_args(src: Path, build: Path, opts: BuildOptions, helper_dir: Path) -> list[str]:
    """Every -D of the configure step (pure: unit-tested)."""
    fake_git = helper_dir / "git"
    pmap = prefix_map_flags(src, build)
    args = [
        "-G", "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DGGML_BACKEND_DL=ON",
        *cpu_variant_args(opts.cpu_variant),
        "-DGGML_CCACHE=OFF",  # we decide about ccache ourselves
        f"-DLLAMA_BUILD_NUMBER={opts.build_number}",
        f"-DLLAMA_BUILD_COMMIT={opts.build_commit}",
        f"-DGIT_EXE={fake_git}",
        f"-DGIT_EXECUTABLE={fake_git}",
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download at build time
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TESTS=ON",
        f"-DCMAKE_C_FLAGS={pmap}",
        f"-DCMAKE_CXX_FLAGS={pmap}",
    ]
    if opts.ccache:
        args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    if opts.cuda:
        args += [
            "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={opts.cuda_arch}",
            "-DCMAKE_CUDA_FLAGS=" + " ".join(f"-Xcompiler={f}" for f in prefix_map_flags(src, build).split()),
            f"-DCMAKE_CUDA_COMPILER_LAUNCHER={sys.executable};{helper_dir / 'nvcc-launcher.py'}",
        ]
    else:
        args.append("-DGGML_CUDA=OFF")
    args += list(opts.extra_cmake)
    return args


FAKE_GIT = """#!/bin/sh
# Stands in for git during llama.cpp's configure: answers the build stamp, never the tree's git state.
case "$1" in
  rev-parse|describe) echo "{stamp}" ;;
  rev-list) echo "{number}" ;;
esac
exit 0
"""

NVCC_LAUNCHER = '''"""nvcc launcher (written by opencoti-patch): makes nvcc's output independent of the
build and source folders.

- --frandom-seed=<hash of the file's path relative to the source> + --objdir-as-tempdir: no random
  or pid-derived names (tmpxft_*, module ids);
- -Xcudafe --orig_src_path_name/--orig_src_file_name=<relative path>: cudafe++ otherwise hashes the
  *absolute* (realpath) source path into the names of internal-linkage entities
  (_INTERNAL_<hash>_...), so the same file at another path gives other bytes.
"""
import hashlib, os, sys

SRC = {src!r}
CCACHE = {ccache!r}
args = sys.argv[1:]
cu = next((a for a in args if a.endswith(".cu")), None)
if cu is not None:
    full = os.path.realpath(cu)
    src = os.path.realpath(SRC)
    rel = os.path.relpath(full, src) if full.startswith(src + os.sep) else os.path.basename(cu)
    seed = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)
    extra = ["--frandom-seed=%d" % seed, "--objdir-as-tempdir",
             "-Xcudafe", "--orig_src_path_name=" + rel, "-Xcudafe", "--orig_src_file_name=" + rel]
    args = args[:1] + extra + args[1:]
if CCACHE:
    args = [CCACHE] + args
os.execvp(args[0], args)
'''


def write_helpers(helper_dir: Path, src: Path, opts: BuildOptions) -> None:
    helper_dir.mkdir(parents=True, exist_ok=True)
    git = helper_dir / "git"
    git.write_text(FAKE_GIT.format(stamp=opts.build_commit, number=opts.build_number))
    git.chmod(0o755)
    ccache = shutil.which("ccache") if opts.ccache else None
    (helper_dir / "nvcc-launcher.py").write_text(NVCC_LAUNCHER.format(src=str(src), ccache=ccache))


def build_env(work_root: Path, opts: BuildOptions) -> dict[str, str]:
    env = dict(os.environ)
    # no git discovery above the export (defence in depth next to the fake git)
    env["GIT_CEILING_DIRECTORIES"] = str(work_root)
    # No CCACHE_BASEDIR: with one, ccache rewrites (and normalizes) the paths it hands the compiler,
    # so __FILE__ of e.g. vendor/nlohmann/json.hpp (reached through -I.../vendor/nlohmann/..) comes
    # out different from a build without ccache (seen: libllama-common.so differed). Cache hits then
    # need the same absolute paths, i.e. the same label folder - which CI keeps between runs.
    env.pop("CCACHE_BASEDIR", None)
    if not opts.ccache:
        env["CCACHE_DISABLE"] = "1"
    return env


# --------------------------------------------------------------------------- running ninja

def parse_progress(line: str) -> tuple[int, int, str] | None:
    """``[12/135] Building CXX object …`` -> (12, 135, 'Building CXX object …')."""
    m = _PROGRESS.match(line.strip())
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def first_error(lines: Sequence[str], context: int = 6) -> str | None:
    """The first compiler/CMake error of a build log with a few lines after it."""
    for i, line in enumerate(lines):
        if _ERROR_LINE.search(line) and not parse_progress(line):
            return "\n".join(ln.rstrip() for ln in lines[i:i + context])
    return None


class Progress:
    """``[#####.....] 41/135 Building CXX object …`` on a terminal, a line per 10% otherwise."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self.last_decile = -1

    def update(self, done: int, total: int, what: str) -> None:
        frac = done / total if total else 1.0
        if self.tty:
            bar = "#" * int(frac * self.width)
            short = what if len(what) < 60 else "…" + what[-59:]
            self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {done}/{total} {short}\x1b[K")
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self.last_decile:
                self.last_decile = decile
                self.stream.write(f"{self.label}: {done}/{total} ({frac:.0%})\n")
                self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def run_logged(cmd: Sequence[str], log: Path, env: dict[str, str], cwd: Path | None = None,
               on_line: Callable[[str], None] | None = None) -> int:
    """Run ``cmd`` appending its output to ``log``; feed each line to ``on_line``."""
    with log.open("a", encoding="utf-8") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            fh.flush()  # the log can be followed while the build runs
            if on_line:
                on_line(line)
        return proc.wait()


def ninja_targets(ninja: str, build: Path) -> set[str]:
    out = subprocess.run([ninja, "-C", str(build), "-t", "targets", "all"], capture_output=True, text=True)
    return {line.split(":", 1)[0] for line in out.stdout.splitlines() if ":" in line}


def _fail_from_log(what: str, log: Path) -> OpencotiError:
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    err = first_error(lines) or "\n".join(lines[-15:])
    return OpencotiError(f"{what} failed (full log: {log})\n{err}")


@dataclass
class BuildResult:
    label: str
    src: Path
    build: Path
    log: Path
    options: BuildOptions
    targets: list[str]
    cmake_args: list[str]
    seconds: float
    export: ExportResult | None = None
    missing_optional: list[str] = field(default_factory=list)

    @property
    def bin(self) -> Path:
        return self.build / "bin"


def configure_and_build(src: Path, build: Path, opts: BuildOptions, label: str = "build",
                        work_root: Path | None = None, fresh: bool = False,
                        progress: bool = True) -> BuildResult:
    """Configure (if needed) and build ``opts.targets`` of the exported ``src`` into ``build``."""
    src, build = Path(src).resolve(), Path(build).resolve()
    work_root = (work_root or build.parent.parent).resolve()
    if fresh and build.exists():
        shutil.rmtree(build)
    build.mkdir(parents=True, exist_ok=True)
    helper_dir = build / ".opencoti"
    write_helpers(helper_dir, src, opts)
    log = build / "opencoti-build.log"
    log.write_text("")
    env = build_env(work_root, opts)
    cmake, ninja = find_tool("cmake"), find_tool("ninja")
    args = cmake_args(src, build, opts, helper_dir)
    t0 = time.monotonic()
    cfg = [cmake, "-S", str(src), "-B", str(build), f"-DCMAKE_MAKE_PROGRAM={ninja}", *args]
    if run_logged(cfg, log, env) != 0:
        raise _fail_from_log(f"configure of {label}", log)
    known = ninja_targets(ninja, build)
    wanted = [t for t in opts.targets if t not in opts.optional_targets]
    missing = [t for t in wanted if t not in known]
    if missing:
        raise OpencotiError(f"{label}: unknown build target(s) {', '.join(missing)} (see {log})")
    skipped = [t for t in opts.optional_targets if t in opts.targets and t not in known]
    targets = [t for t in opts.targets if t in known]
    if opts.cuda and CUDA_TARGET not in targets:
        targets.append(CUDA_TARGET)
    bar = Progress(label) if progress else None

    def on_line(line: str) -> None:
        p = parse_progress(line)
        if p and bar:
            bar.update(*p)

    jobs = ["-j", str(opts.jobs)] if opts.jobs else []
    rc = run_logged([ninja, "-C", str(build), *jobs, *targets], log, env, on_line=on_line)
    if bar:
        bar.close()
    if rc != 0:
        raise _fail_from_log(f"build of {label}", log)
    return BuildResult(label=label, src=src, build=build, log=log, options=opts, targets=targets,
                       cmake_args=args, seconds=time.monotonic() - t0, missing_optional=skipped)

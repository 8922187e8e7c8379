"""The one builder of the harness programs: the logits harness (``harness/``, verify-identical's)
and any other harness folder whose CMakeLists includes its ``llama.cmake`` (the lab's programs).

Built with Ninja against one llama.cpp build (its ``bin/`` and source headers), reproducibly: the
source path is mapped away (``-ffile-prefix-map``), git discovery stops at the build folder, and
ccache is used only where it is installed and wanted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config import SHIPPED_HARNESS
from ..errors import OpencotiError
from .builder import BuildOptions, build_env, find_tool, run_logged

SINGLE_EXE = "opencoti-harness"  # one prompt, logits dump (verify-identical)


def harness_args(llama_src: Path, llama_bin: Path, build_dir: Path, opts: BuildOptions,
                 source: Path = SHIPPED_HARNESS) -> list[str]:
    """The CMake configure arguments of the harness folder ``source`` (pure: unit-tested)."""
    cmake, ninja = find_tool("cmake"), find_tool("ninja")
    args = [cmake, "-S", str(source), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}", "-DCMAKE_BUILD_TYPE=Release", f"-DLLAMA_SRC={llama_src}",
            f"-DLLAMA_BIN={llama_bin}", f"-DCMAKE_CXX_FLAGS=-ffile-prefix-map={llama_src}=."]
    if opts.ccache:  # only where ccache is installed (BuildOptions)
        args.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    return args


def build_harness(llama_src: Path, llama_bin: Path, build_dir: Path, opts: BuildOptions | None = None,
                  targets: Sequence[str] = (), label: str = "", source: Path = SHIPPED_HARNESS) -> Path:
    """Configure + build the harness folder ``source`` against a llama.cpp build; returns ``build_dir``
    (the executables inside, e.g. ``SINGLE_EXE``). ``targets``: only these (default: all)."""
    if not (source / "CMakeLists.txt").is_file():
        raise OpencotiError(f"harness sources not found at {source}")
    opts = opts or BuildOptions()
    env = build_env(build_dir.parent, opts)
    log = build_dir / "opencoti-harness-build.log"
    build_dir.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    ninja = [find_tool("ninja"), "-C", str(build_dir), *targets]
    if run_logged(harness_args(llama_src, llama_bin, build_dir, opts, source), log, env) != 0 \
            or run_logged(ninja, log, env) != 0:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise OpencotiError(f"harness build against {label or llama_bin} failed (log: {log})\n"
                            + "\n".join(tail))
    for exe in targets or (SINGLE_EXE,):
        if not (build_dir / exe).is_file():
            raise OpencotiError(f"harness build produced no {build_dir / exe} (log: {log})")
    return build_dir

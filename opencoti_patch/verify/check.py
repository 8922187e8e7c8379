"""``opencoti-patch check``: the series applied one patch at a time onto pristine upstream; after each
patch an incremental CPU build (one build folder for the whole run, ccache when installed) and the
checks that patch declares in its header (``Test:`` lines), so a broken patch is caught at that patch.

A check is ``markers`` (the marker audit of the series up to this patch, on the folder as it is) or
a build target and its arguments (``test-sparse-attn``, ``test-backend-ops -o SPARSE_ATTN_FILL``):
the target is built with the others and run from ``<build>/bin``; a non-zero exit fails it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..builds.builder import BuildOptions, configure_and_build, export_tree
from ..errors import OpencotiError
from ..markers.audit import audit
from ..stack.apply import apply_to_folder
from ..stack.series import Patch

MARKERS = "markers"
OUTPUT_TAIL = 2000
# The checks run tests that link the CPU backend directly (test-sparse-attn, test-backend-ops' CPU
# cases): llama.cpp defines those targets only without dynamically loaded backends, as the optests
# stage of ci/rebuild.sh builds them. A --cmake-arg of the caller comes after it and wins.
CHECK_CMAKE = ("-DGGML_BACKEND_DL=OFF",)


@dataclass
class TestResult:
    check: str
    ok: bool
    rc: int | None = None
    seconds: float = 0.0
    output_tail: str = ""


@dataclass
class StepResult:
    patch: str
    applied: bool = False
    built: bool = False
    targets: list[str] = field(default_factory=list)
    build_seconds: float = 0.0
    tests: list[TestResult] = field(default_factory=list)
    error: str = ""
    where: list[str] = field(default_factory=list)  # a build error in the series' terms (``locate``)

    @property
    def ok(self) -> bool:
        return self.applied and self.built and all(t.ok for t in self.tests) and not self.error


@dataclass
class CheckReport:
    pin: str
    src: str
    build: str
    steps: list[StepResult] = field(default_factory=list)
    failed_at: str | None = None
    verify: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.failed_at is None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for step, obj in zip(data["steps"], self.steps, strict=True):
            step["ok"] = obj.ok
        data["ok"] = self.ok
        return data


# a compiler diagnostic ``path:line[:col]: [fatal ]error: ...`` and a linker's undefined symbol
COMPILE_ERROR = re.compile(r"^(?P<file>[^\s:][^:\n]*?):(?P<line>\d+)(?::\d+)?:[ \t]*(?:fatal[ \t]+)?error\b",
                           re.M)
UNDEFINED = re.compile(r"undefined reference to [`'\"](?P<name>[^'`\"(]+)")


def _relative(path: str, src: Path) -> str:
    """A diagnostic's path relative to the checked source (absolute, or ``../src/...`` from the build)."""
    for prefix in (f"{src}/", f"{src.resolve()}/", "../src/"):
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def locate(error: str, src: Path, series: Sequence[Patch]) -> list[str]:
    """Where a build error is in the series' terms: for the compiler's errors, the marked region (and
    its patch) holding the line, the patch that creates the file, or upstream code outside them (one
    entry per place, at its first error line); for an undefined symbol of the linker, the patches whose
    added lines name it."""
    places: dict[str, tuple[str, int, int]] = {}  # what -> (file, first line, errors there)
    regions = None
    created = {f.new_path: p.name for p in series for f in p.files if f.new_file and f.new_path}
    for m in COMPILE_ERROR.finditer(error):
        rel, line = _relative(m.group("file"), src), int(m.group("line"))
        if rel in created:
            what = f"in a file {created[rel]} creates"
        else:
            regions = regions if regions is not None else audit(series, src).regions
            inside = [r for r in regions if r.path == rel and r.begin <= line <= r.end]
            if inside:
                r = inside[0]
                what = f"in the marked region {rel}:{r.begin}-{r.end} ({', '.join(r.patches) or r.feature})"
            elif any(f.path == rel for p in series for f in p.files):
                what = "upstream code outside the marked regions of the series in that file"
            else:
                what = "upstream code no patch of the series touches"
        first = places.setdefault(f"{rel}\0{what}", (rel, line, 0))
        places[f"{rel}\0{what}"] = (first[0], first[1], first[2] + 1)
    out = [f"{rel}:{line}: {key.split(chr(0), 1)[1]}" + (f" ({n} errors)" if n > 1 else "")
           for key, (rel, line, n) in places.items()]
    for name in dict.fromkeys(m.group("name").strip() for m in UNDEFINED.finditer(error)):
        word = re.compile(rf"\b{re.escape(name)}\b")
        users = [f"{p.name} ({f.path})" for p in series for f in p.files
                 if any(tag == "+" and word.search(text) for h in f.hunks for _, tag, text in h.new_side())]
        out.append(f"undefined {name}: " + (f"named by {', '.join(users)}" if users
                                            else "no patch of the series names it"))
    return out


def test_targets(patch: Patch) -> list[str]:
    """The build targets the patch's checks run (``markers`` needs none)."""
    out: list[str] = []
    for check in patch.header.tests:
        words = shlex.split(check)
        if words and words[0] != MARKERS and words[0] not in out:
            out.append(words[0])
    return out


def run_test(check: str, src: Path, bin_dir: Path, series: Sequence[Patch], timeout: float) -> TestResult:
    """One ``Test:`` check after ``series`` (the patches applied so far)."""
    t0 = time.monotonic()
    words = shlex.split(check)
    if not words:
        return TestResult(check, False, output_tail="empty Test: line")
    if words[0] == MARKERS:
        report = audit(series, src)
        text = "\n".join(str(i) for i in report.errors)
        return TestResult(check, not report.errors, None, time.monotonic() - t0,
                          text[-OUTPUT_TAIL:] or f"{len(report.regions)} marked region(s), no error")
    exe = bin_dir / words[0]
    if not exe.is_file():
        return TestResult(check, False, output_tail=f"{exe} was not built")
    try:
        proc = subprocess.run([str(exe), *words[1:]], cwd=bin_dir, capture_output=True, text=True,
                              errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return TestResult(check, False, None, time.monotonic() - t0, f"timed out after {timeout:.0f} s")
    out = (proc.stdout + proc.stderr)[-OUTPUT_TAIL:]
    return TestResult(check, proc.returncode == 0, proc.returncode, time.monotonic() - t0, out)


def check_series(tree: Path, pristine_rev: str, patches: Sequence[Patch], root: Path, opts: BuildOptions,
                 *, pin: str, timeout: float = 1800, progress: Callable[[str], None] | None = None,
                 build_progress: bool = False) -> CheckReport:
    """Export ``pristine_rev`` of ``tree`` to ``<root>/src``, then per patch: apply it exactly, build
    ``opts.targets`` + its checks' targets in ``<root>/build`` (incremental), run its checks. Stops at
    the first patch that fails to apply, build or pass a check (``failed_at``)."""
    say = progress or (lambda _msg: None)
    src, build = root / "src", root / "build"
    export_tree(tree, src, pristine_rev)  # only files that differ are rewritten: the build stays warm
    report = CheckReport(pin=pin, src=str(src), build=str(build))
    for n, patch in enumerate(patches, 1):
        step = StepResult(patch.name)
        report.steps.append(step)
        head = f"[{n}/{len(patches)}] {patch.name}"
        try:
            apply_to_folder(src, patch.path)
            step.applied = True
        except OpencotiError as exc:
            step.error = f"does not apply: {exc.message}"
            say(f"{head}: FAILED {step.error}")
            report.failed_at = patch.name
            return report
        wanted = [*opts.targets, *(t for t in test_targets(patch) if t not in opts.targets)]
        say(f"{head}: applied; building {' '.join(wanted)}")
        try:
            result = configure_and_build(src, build, replace(opts, targets=tuple(wanted)), label=patch.name,
                                         work_root=root, progress=build_progress)
            step.built, step.targets, step.build_seconds = True, result.targets, round(result.seconds, 1)
        except OpencotiError as exc:
            step.error = f"build failed: {exc.message}"
            log = build / "opencoti-build.log"
            step.where = locate(log.read_text(errors="replace") if log.is_file() else exc.message, src,
                                patches[:n])
            say(f"{head}: FAILED {step.error.splitlines()[0]}")
            for where in step.where:
                say(f"{head}: at {where}")
            report.failed_at = patch.name
            return report
        for check in patch.header.tests:
            res = run_test(check, src, build / "bin", patches[:n], timeout)
            step.tests.append(res)
            say(f"{head}: test {check}: {'ok' if res.ok else 'FAILED'} ({res.seconds:.1f} s)")
            if not res.ok:
                report.failed_at = patch.name
                return report
        if not patch.header.tests:
            say(f"{head}: built; no Test: line")
    return report

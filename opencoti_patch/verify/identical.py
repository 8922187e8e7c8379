"""verify-identical: prove the patch series is default-off, by building pristine and patched trees.

Checks (each pass, FAIL or "not checked" with evidence, rendered as markdown + JSON):

0. sources - the patched tree differs from pristine exactly where every patch says: each file a patch
   adds exists, each file it changes differs, each file it deletes is gone (else the run would compare
   pristine with itself, or with half a series). The patches are the ``--patch-file`` diffs, else the
   series (``<patches-dir>/series``); with neither, nothing says what the patched tree must hold: FAIL.
1. reproducibility - the pristine tree built a second time, in a fresh build dir at another path
   and with ccache disabled (a ccache hit would only replay the first build's objects, proving
   nothing about the compiler), gives the same bytes for every DSO/tool.
2. binaries - every DSO/tool of the pristine and patched builds compared byte for byte; a file that
   differs must be fed by a changed source (directory rules in :func:`affected_artifacts`), and is
   listed with the patches that touch those sources. An unexpected difference fails. When a changed
   file feeds every artifact (a ggml header does), no difference can be unexpected: "not checked".
   Object files: every object that reads no changed file (ninja's depfile record) and is compiled with
   the same command must be byte-identical; "not checked" when there is no such object.
3. behaviour - per KV cache type, ``harness/opencoti-harness`` built against each build runs a
   deterministic random prompt (prefill) and single-token decode steps on a small random-weight
   llama GGUF with flash attention on; the float32 logits of every decode step must be bitwise
   identical (sha256 of the dump), and so must the graph (node/split counts of the pp and tg
   reservation graphs from the log, and the nodes actually computed per decode step), the KV and
   compute buffer sizes and the serialized state size. Both runs must have written a dump of
   1 + decode rows of n_vocab floats from the requested prompt, every row finite and not constant
   (all-NaN or all-zero logits are equal on both sides and prove nothing), else FAIL.

Verdict (:mod:`..verdict`): FAIL when a check failed; INCOMPLETE when a check proved nothing ("not
checked", e.g. ``--skip-repro``) or a stage of :data:`REQUIRED_STAGES` has no passed check; PASS only
when every check ran and passed, every stage included.
"""

from __future__ import annotations

import array
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..builds.builder import (
    LIB_TARGETS,
    BuildOptions,
    BuildResult,
    changed_files,
    configure_and_build,
    export_tree,
    find_tool,
)
from ..builds.builder import _excluded as excluded_from_export
from ..builds.harness import SINGLE_EXE, build_harness
from ..builds.stamp import artifact_key, collect_artifacts
from ..config import write_report
from ..errors import CheckFailed, OpencotiError
from ..report import info, render
from ..stack.apply import apply_to_folder
from ..stack.series import FilePatch, diff_paths, load_series, parse_diff, split_patch
from ..stack.upstream import sha256_file
from ..verdict import FAIL, Check, Verdict, evidence_problem
from ..verdict import verdict_of as shared_verdict_of

VERIFY_STAMP = "opencoti-verify"  # the same build info in both builds, so it cannot be a difference

# --------------------------------------------------------------------------- sources -> artifacts

# tools/<dir> -> artifact stems built from it (a stem matches "<stem>", "lib<stem>.so", "lib<stem>-*.so")
TOOL_DIR_STEMS: dict[str, tuple[str, ...]] = {
    "cli": ("llama-cli",),
    "server": ("llama-server", "server-context", "llama-cli"),
    "mtmd": ("mtmd", "llama-server", "server-context", "llama-cli", "llama-mtmd-cli"),
    "ui": ("llama-ui", "llama-server", "server-context", "llama-cli"),
    "llama-bench": ("llama-bench",),
    "perplexity": ("llama-perplexity",),
    "main": ("llama-cli",),
}


def _stem_match(key: str, stem: str) -> bool:
    return key == stem or key == f"lib{stem}.so" or key.startswith(f"lib{stem}-")


def affected_artifacts(path: str, available: Iterable[str]) -> set[str]:
    """Artifact keys (see :func:`build.artifact_key`) whose bytes a change of ``path`` may change.

    ggml/src/ggml-cpu -> libggml-cpu*, ggml/src/ggml-<backend> -> libggml-<backend>, ggml/include and
    any ggml header or CMake file -> everything, ggml/src/*.c(pp) -> libggml-base (the registry,
    ggml-backend-reg.cpp, -> libggml), src/ -> libllama, include/ -> libllama + common + tools,
    common/ and vendor/ -> libllama-common + tools, tools/X -> X, tests/test-X.cpp -> test-X,
    top-level CMake -> everything, anything else (docs, scripts, gguf-py, ...) -> nothing.
    """
    avail = set(available)
    ggml_libs = {k for k in avail if k.startswith("libggml")}
    tool_side = {k for k in avail if k not in ggml_libs and k not in ("libllama.so", "libllama-common.so")}
    parts = path.split("/")
    top = parts[0]
    name = parts[-1]
    if path == "CMakeLists.txt" or top == "cmake":
        return avail
    if top == "ggml":
        if len(parts) >= 2 and parts[1] in ("include", "cmake"):
            return avail
        if name == "CMakeLists.txt" and len(parts) <= 3:
            return avail
        if len(parts) >= 4 and parts[1] == "src" and parts[2].startswith("ggml-"):
            return {k for k in avail if k == f"lib{parts[2]}.so" or k.startswith(f"lib{parts[2]}-")}
        if len(parts) == 3 and parts[1] == "src":
            if name.endswith((".h", ".hpp", ".inc")):
                return avail
            if name.startswith("ggml-backend-reg") or name.startswith("ggml-backend-dl"):
                return {"libggml.so"} & avail
            if name.endswith((".c", ".cpp")):
                return {"libggml-base.so"} & avail
        return set()
    if top == "src":
        return {"libllama.so"} & avail
    if top == "include":
        return avail - ggml_libs
    if top in ("common", "vendor"):
        return ({"libllama-common.so"} & avail) | tool_side
    if top == "tools" and len(parts) >= 3:
        stems = TOOL_DIR_STEMS.get(parts[1], (f"llama-{parts[1]}",))
        return {k for k in tool_side if any(_stem_match(k, s) for s in stems)}
    if top == "tests":
        if name.startswith("test-") and name.endswith((".cpp", ".c")) and len(parts) == 2:
            return {name.rsplit(".", 1)[0]} & avail
        return {k for k in avail if k.startswith("test-")}
    if top == "app":
        return {"llama"} & avail
    return set()


def patch_files(patch_text: str) -> list[str]:
    """Paths a unified/git diff touches (both sides of renames), read with the series' patch model."""
    return diff_paths(patch_text.encode("utf-8", "surrogateescape"))


def file_patches(patch: Path) -> list[FilePatch]:
    """The files of one patch (header + diff, or a bare diff) with what it does to each."""
    return parse_diff(split_patch(patch.read_bytes())[1], patch.name)


def attribute(diffs: Iterable[str], patches: dict[str, list[str]],
              available: Iterable[str]) -> dict[str, list[str]]:
    """For each differing artifact key, the patches whose files feed it."""
    avail = set(available)
    per_patch = {p: set().union(*(affected_artifacts(f, avail) for f in files)) if files else set()
                 for p, files in patches.items()}
    return {k: sorted(p for p, arts in per_patch.items() if k in arts) for k in sorted(diffs)}


# --------------------------------------------------------------------------- log facts

_FACT_PATTERNS: dict[str, re.Pattern[str]] = {
    # "sched_reserve: graph: nodes = 130, splits = 1, ..." (the function name varies between pins)
    "graph": re.compile(r"^\S+: graph(?: \(pp bs=\d+, tg bs=\d+\))?: (nodes = .*)$"),
    "kv_size": re.compile(r"^\S+: size = (.*cells.*)$"),
    "kv_buffer": re.compile(r"^\S+:\s+(\S+) KV buffer size = \s*(.*)$"),
    "compute_buffer": re.compile(r"^\S+:\s+(\S+) compute buffer size = \s*(.*)$"),
    "output_buffer": re.compile(r"^\S+:\s+(\S+)\s+output buffer size = \s*(.*)$"),
    "model_buffer": re.compile(r"^\S+:\s+(\S+) model buffer size = \s*(.*)$"),
    "nodes_computed": re.compile(r"^opencoti-harness: nodes computed: (.*)$"),
}
# Older pins (llama-cpp-python 0.3.35 / 0.3.33 / 0.3.32) print the graph on two lines instead:
# "sched_reserve: graph nodes  = 727" then "sched_reserve: graph splits = 1", each with a tail
# " (with bs=512), 700 (with bs=1)" when the pp and tg graphs differ; read as one fact in the form of
# the one-line print without its input counts: "nodes = 727, splits = 1" or "nodes = 727 / 700, ...".
_OLD_GRAPH_NODES = re.compile(r"^\S+: graph nodes\s+= (\d+)(?: \(with bs=\d+\), (\d+) \(with bs=1\))?$")
_OLD_GRAPH_SPLITS = re.compile(r"^\S+: graph splits\s+= (\d+)(?: \(with bs=\d+\), (\d+) \(with bs=1\))?$")


def _pp_tg(m: re.Match[str]) -> str:
    return m.group(1) if m.group(2) is None else f"{m.group(1)} / {m.group(2)}"


def parse_log_facts(text: str) -> dict[str, list[str]]:
    """Graph and buffer facts llama prints at context creation (+ the harness's node counts)."""
    facts: dict[str, list[str]] = {k: [] for k in _FACT_PATTERNS}
    for line in text.splitlines():
        line = line.rstrip()
        if m := _OLD_GRAPH_NODES.search(line):
            facts["graph"].append(f"nodes = {_pp_tg(m)}")
        elif (m := _OLD_GRAPH_SPLITS.search(line)) and facts["graph"] and "splits" not in facts["graph"][-1]:
            facts["graph"][-1] += f", splits = {_pp_tg(m)}"
        for key, pat in _FACT_PATTERNS.items():
            m = pat.search(line)
            if m:
                facts[key].append(" ".join(g.strip() for g in m.groups()))
    return facts


def first_difference(a: Path, b: Path, n_vocab: int) -> str:
    """Where two float32 logit dumps first differ, and the largest absolute difference."""
    fa, fb = array.array("f"), array.array("f")
    fa.frombytes(Path(a).read_bytes())
    fb.frombytes(Path(b).read_bytes())
    if len(fa) != len(fb):
        return f"sizes differ: {len(fa)} vs {len(fb)} floats"
    first = next((i for i, (x, y) in enumerate(zip(fa, fb, strict=True)) if x != y), None)
    if first is None:
        return "identical values"
    max_abs = max(abs(x - y) for x, y in zip(fa, fb, strict=True))
    return (f"first difference at row {first // n_vocab} (0 = prefill), token {first % n_vocab}: "
            f"{fa[first]!r} vs {fb[first]!r}; max |diff| {max_abs:.3g}")


# --------------------------------------------------------------------------- checks + report

@dataclass
class VerifyConfig:
    work: Path
    pristine: tuple[Path, str | None]  # (tree, rev or None = files as they are)
    patched: tuple[Path, str | None]
    patch_files: tuple[Path, ...] = ()  # applied on top of the patched export
    series_dir: Path | None = None  # for attributing differences to patches
    options: BuildOptions = field(default_factory=lambda: BuildOptions(targets=LIB_TARGETS))
    repro: bool = True
    kv_types: tuple[str, ...] = ("f16", "q8_0")
    prompt_tokens: int = 2048
    decode: int = 64
    seed: int = 42
    threads: int = 2
    model: Path | None = None
    patched_args: tuple[str, ...] = ()
    progress: bool = True


def _label_paths(work: Path, label: str) -> tuple[Path, Path]:
    return work / label / "src", work / label / "build"


def prepare_source(cfg: VerifyConfig, label: str, tree: Path, rev: str | None,
                   patches: Sequence[Path] = ()) -> Path:
    src, _ = _label_paths(cfg.work, label)
    exported = export_tree(tree, src, rev)
    info(f"[{label}] exported {exported.files} files from {exported.source} of {tree} "
         f"({exported.written} written, {exported.removed} removed)")
    for p in patches:
        try:  # the applier of the stack: exact (no fuzz, no offset), a failing hunk named
            apply_to_folder(src, Path(p))
        except OpencotiError as exc:
            raise OpencotiError(f"[{label}] {exc.message}") from exc
    return src


def build_label(cfg: VerifyConfig, label: str, opts: BuildOptions, fresh: bool = False) -> BuildResult:
    src, build = _label_paths(cfg.work, label)
    info(f"[{label}] building {' '.join(opts.targets)}{' (fresh, no ccache)' if fresh else ''}")
    res = configure_and_build(src, build, opts, label=label, work_root=cfg.work, fresh=fresh,
                              progress=cfg.progress)
    info(f"[{label}] built in {res.seconds:.0f} s")
    return res


def ensure_model(cfg: VerifyConfig, gguf_tree: Path) -> Path:
    """The small random-weight llama GGUF (synth_gguf 'tiny': 4 layers, 1024 embd, 8 heads, 2 KV
    heads, head dim 128, ff 2048, vocab 4096, f16), written once per seed."""
    if cfg.model is not None:
        return cfg.model
    from .synth_gguf import SHAPES, write_llama_gguf  # noqa: PLC0415 (needs numpy; only here)

    path = cfg.work / "models" / f"tiny-f16-seed{cfg.seed}.gguf"
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        write_llama_gguf(tmp, SHAPES["tiny"], "f16", cfg.seed, tree=gguf_tree)
        tmp.replace(path)
    return path


@dataclass
class HarnessRun:
    label: str
    kv: str
    rc: int
    log: Path
    dump: Path
    sha256: str | None
    summary: dict[str, Any] | None
    facts: dict[str, list[str]]


def run_harness(cfg: VerifyConfig, exe: Path, label: str, kv: str, model: Path,
                extra: Sequence[str] = ()) -> HarnessRun:
    out = cfg.work / label / "runs"
    out.mkdir(parents=True, exist_ok=True)
    dump, js, log = out / f"logits-{kv}.f32", out / f"run-{kv}.json", out / f"run-{kv}.log"
    for p in (dump, js):
        p.unlink(missing_ok=True)
    cmd = [str(exe), "-m", str(model), "-ctk", kv, "-ctv", kv, "-fa", "on", "-t", str(cfg.threads),
           "--prompt-tokens", str(cfg.prompt_tokens), "--decode", str(cfg.decode), "--seed", str(cfg.seed),
           "--dump-logits", str(dump), "--json", str(js), "--count-nodes"]
    if cfg.options.cuda:
        cmd += ["-ngl", "99"]
    cmd += list(extra)
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    text = log.read_text(errors="replace")
    summary = json.loads(js.read_text()) if (rc == 0 and js.is_file()) else None
    return HarnessRun(label, kv, rc, log, dump, sha256_file(dump) if rc == 0 and dump.is_file() else None,
                      summary, parse_log_facts(text))


def compare_builds(a: BuildResult, b: BuildResult) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(key -> sha in a, key -> sha in b, keys that differ or exist on one side only)."""
    tools = [t for t in set(a.targets) | set(b.targets) if not t.startswith(("ggml", "llama-common"))
             and t != "llama"]
    ha = {artifact_key(x.name): x.sha256 for x in collect_artifacts(a.bin, tools)}
    hb = {artifact_key(x.name): x.sha256 for x in collect_artifacts(b.bin, tools)}
    diff = sorted(k for k in set(ha) | set(hb) if ha.get(k) != hb.get(k))
    return ha, hb, diff


@dataclass(frozen=True)
class ObjectInfo:
    """One compiled object of a build: its bytes, what it was compiled from, and how."""

    sha256: str
    source: str  # the translation unit, relative to the source tree ("" when outside it)
    deps: frozenset[str]  # every file the compiler read (ninja's depfile record), relative to the tree
    command: str  # the compile command with the tree and build paths replaced, ccache dropped


def _tree_relative(path: str, src: Path, build: Path) -> str | None:
    p = Path(path) if Path(path).is_absolute() else build / path
    try:
        return p.resolve().relative_to(src.resolve()).as_posix()
    except ValueError:
        return None


def parse_ninja_deps(text: str, src: Path, build: Path) -> dict[str, frozenset[str]]:
    """``ninja -t deps`` output -> object (relative to the build) -> its dependencies inside the tree."""
    out: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            current = None
        elif not line[0].isspace() and ": #deps" in line:
            current = out.setdefault(line.split(": #deps", 1)[0], set())
        elif current is not None:
            rel = _tree_relative(line.strip(), src, build)
            if rel is not None:
                current.add(rel)
    return {k: frozenset(v) for k, v in out.items()}


def _normalize_command(command: str, src: Path, build: Path) -> str:
    words = command.split()
    if words and Path(words[0]).name == "ccache":
        words = words[1:]
    text = " ".join(words)
    for path, tag in ((str(src.resolve()), "<src>"), (str(build.resolve()), "<build>")):
        text = text.replace(path, tag)
    return text


def object_infos(res: BuildResult) -> dict[str, ObjectInfo]:
    """Every ``*.o`` of a ninja build with its depfile record and compile command."""
    ninja = find_tool("ninja")

    def tool(name: str) -> str:
        out = subprocess.run([ninja, "-C", str(res.build), "-t", name], capture_output=True, text=True)
        if out.returncode != 0:
            raise OpencotiError(f"ninja -t {name} in {res.build} failed: {out.stderr.strip()}")
        return out.stdout

    deps = parse_ninja_deps(tool("deps"), res.src, res.build)
    commands = {e["output"]: e for e in json.loads(tool("compdb")) if e.get("output", "").endswith(".o")}
    out: dict[str, ObjectInfo] = {}
    for rel, entry in commands.items():
        obj = res.build / rel
        if not obj.is_file():
            continue  # not a target of this build
        source = _tree_relative(entry.get("file", ""), res.src, res.build) or ""
        out[rel] = ObjectInfo(sha256_file(obj), source, deps.get(rel, frozenset({source}) - {""}),
                              _normalize_command(entry.get("command", ""), res.src, res.build))
    return out


@dataclass
class ObjectComparison:
    independent: list[str] = field(default_factory=list)  # no changed input, same command: identical
    unexpected: list[str] = field(default_factory=list)  # no changed input, same command: differs
    header_same: list[str] = field(default_factory=list)  # reads a changed header, still identical
    header_differs: dict[str, list[str]] = field(default_factory=dict)  # -> the changed headers it reads
    source_changed: list[str] = field(default_factory=list)  # own source or command changed, or one side


def compare_objects(a: dict[str, ObjectInfo], b: dict[str, ObjectInfo],
                    changed: Iterable[str]) -> ObjectComparison:
    """Sort the objects of two builds by what may explain a difference (pure: testable on its own)."""
    changed_set = set(changed)
    cmp = ObjectComparison()
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            cmp.source_changed.append(key)
            continue
        if x.source in changed_set or x.command != y.command:
            cmp.source_changed.append(key)
            continue
        fed_by = sorted((x.deps | y.deps) & changed_set)
        same = x.sha256 == y.sha256
        if not fed_by:
            (cmp.independent if same else cmp.unexpected).append(key)
        elif same:
            cmp.header_same.append(key)
        else:
            cmp.header_differs[key] = fed_by
    return cmp


def check_objects(cmp: ObjectComparison) -> Check:
    """Object files: those that read no changed file, compiled the same way, must be byte-identical.

    Passes only when there is at least one such object (else nothing was compared: "not checked")."""
    n_header = len(cmp.header_same) + len(cmp.header_differs)
    ev = [f"objects reading no changed file: {len(cmp.independent) + len(cmp.unexpected)} "
          f"({len(cmp.unexpected)} differ)",
          f"objects whose own source or compile command changed (or on one side only): "
          f"{len(cmp.source_changed)}",
          f"objects reading a changed header: {n_header} ({len(cmp.header_same)} still identical, "
          f"{len(cmp.header_differs)} differ; not a check: a header change may change their code)"]
    ev += [f"UNEXPECTED: {k} differs and reads no changed file" for k in cmp.unexpected]
    ev += [f"differs via header: {k} <- {', '.join(h)}" for k, h in sorted(cmp.header_differs.items())]
    name = "objects of untouched translation units"
    if cmp.unexpected:
        return Check(name, "binaries", False, f"{len(cmp.unexpected)} object(s) differ though they read "
                     f"no changed file: {', '.join(cmp.unexpected[:5])}", ev)
    if not cmp.independent:
        return Check(name, "binaries", None, "not checked: every object reads a changed file or was compiled "
                     f"differently ({len(cmp.header_same)} of {n_header} header-fed objects identical)", ev)
    return Check(name, "binaries", True, f"{len(cmp.independent)} objects that read no changed file are "
                 f"byte-identical ({len(cmp.header_same)} of {n_header} header-fed objects too)", ev)


def expected_state(patches: dict[str, Sequence[FilePatch]]) -> dict[str, bool]:
    """path -> whether it exists in the patched tree, after every patch in order (a file one patch adds
    and a later one deletes is gone; the old side of a rename is gone)."""
    state: dict[str, bool] = {}
    for files in patches.values():
        for fp in files:
            if fp.old_path is not None and fp.old_path != fp.new_path:
                state[fp.old_path] = False
            if fp.new_path is not None:
                state[fp.new_path] = True
    return state


def check_patched_differs(changed: Sequence[str], patches: dict[str, Sequence[FilePatch]],
                          patched: Path, no_patches: str | None = None) -> Check:
    """The patched tree must differ from pristine exactly where every patch says: each file a patch adds
    exists, each file it changes differs, each file it deletes is gone. Comparing pristine with itself,
    or with a tree that holds a part of a patch, proves nothing. ``no_patches``: why there are none."""
    name = "patched differs from pristine"
    ev = [f"changed sources: {len(changed)}"]
    if no_patches is not None or not patches:
        return Check(name, "sources", False, f"no patch to verify: {no_patches or 'the series is empty'} "
                     "(nothing says what the patched tree must hold)", ev)
    if not changed:
        return Check(name, "sources", False, "patched tree is identical to pristine: nothing to compare", ev)
    changed_set = set(changed)
    exists = expected_state(patches)
    bad: dict[str, list[str]] = {}
    for patch, files in patches.items():
        paths = list(dict.fromkeys(p for fp in files for p in (fp.old_path, fp.new_path) if p))
        problems = []
        for rel in paths:
            if excluded_from_export(rel):
                continue  # not exported (docs/, models): not built, not compared
            present = (patched / rel).is_file() or (patched / rel).is_symlink()
            if exists[rel] and not present:
                problems.append(f"{rel} missing")
            elif not exists[rel] and present:
                problems.append(f"{rel} still there (deleted by the series)")
            elif rel not in changed_set:
                problems.append(f"{rel} unchanged")
        ev.append(f"{patch}: {len(paths) - len(problems)} of {len(paths)} files as the patch says"
                  + (f"; {', '.join(problems)}" if problems else ""))
        if problems:
            bad[patch] = problems
    touched = set(exists)
    extra = [f for f in changed if f not in touched]
    if extra:
        ev.append(f"changed files no patch touches: {len(extra)} ({', '.join(extra[:5])}"
                  f"{', ...' if len(extra) > 5 else ''})")
    if bad:
        first = next(iter(bad.items()))
        return Check(name, "sources", False, f"not applied as the patch says: {', '.join(bad)} "
                     f"({first[0]}: {', '.join(first[1][:3])})", ev)
    return Check(name, "sources", True, f"{len(changed)} files differ; every file of every patch "
                 f"({len(patches)} patches, {len(touched)} files) as the patch says", ev)


def check_repro(first: BuildResult, second: BuildResult) -> Check:
    ha, hb, diff = compare_builds(first, second)
    ev = [f"{first.build} (ccache {'on' if first.options.ccache else 'off'}) vs {second.build} "
          f"(fresh, ccache off)"]
    ev += [f"{k}: {ha.get(k, '-')[:16]} {'==' if k not in diff else '!='} {hb.get(k, '-')[:16]}"
           for k in sorted(set(ha) | set(hb))]
    ok = not diff and bool(ha)
    summary = (f"{len(ha)} artifacts byte-identical across two builds" if ok
               else f"not reproducible: {', '.join(diff) or 'no artifacts'}")
    return Check("same tree built twice", "reproducibility", ok, summary, ev)


def check_binaries(pristine: BuildResult, patched: BuildResult, changed: Sequence[str],
                   patches: dict[str, list[str]]) -> Check:
    ha, hb, diff = compare_builds(pristine, patched)
    avail = set(ha) | set(hb)
    expected = set().union(*(affected_artifacts(f, avail) for f in changed)) if changed else set()
    unexpected = [k for k in diff if k not in expected]
    who = attribute(diff, patches, avail)
    ev = [f"changed sources: {len(changed)}"]
    ev += [f"identical: {k}" for k in sorted(avail) if k not in diff]
    for k in diff:
        tag = "UNEXPECTED" if k in unexpected else "expected"
        ev.append(f"differs ({tag}): {k} <- {', '.join(who.get(k) or ['(no patch maps to it)'])}")
    name = "pristine vs patched binaries"
    if not avail:
        return Check(name, "binaries", False, "no artifacts found in either build", ev)
    if unexpected:
        return Check(name, "binaries", False, f"unexpected difference in {', '.join(unexpected)}", ev)
    everywhere = [f for f in changed if affected_artifacts(f, avail) >= avail]
    if everywhere:
        # every library may differ, so no difference can be unexpected: the comparison proves nothing
        return Check(name, "binaries", None,
                     f"not checked: {', '.join(everywhere[:3])} feed(s) every artifact, so every difference "
                     f"is 'expected' ({len(avail) - len(diff)} identical, {len(diff)} differ)", ev)
    return Check(name, "binaries", True,
                 f"{len(avail) - len(diff)} identical, {len(diff)} differ, all fed by changed sources", ev)


def run_shape_problems(run: HarnessRun, prompt_tokens: int, decode: int) -> list[str]:
    """What is missing or the wrong size in one harness run: a logits dump and summary must exist, hold
    1 (last prompt token) + ``decode`` rows of n_vocab floats, and come from the requested prompt."""
    if run.sha256 is None or not run.dump.is_file():
        return [f"{run.label}: no logits dump written"]
    if run.summary is None:
        return [f"{run.label}: no JSON summary written"]
    s = run.summary
    n_vocab = s.get("n_vocab") or 0
    rows = 1 + decode
    problems = []
    if n_vocab <= 0:
        problems.append(f"{run.label}: n_vocab {n_vocab!r}")
    size = run.dump.stat().st_size
    if size != rows * n_vocab * 4:
        problems.append(f"{run.label}: logits dump has {size} bytes, want {rows} rows x {n_vocab} x 4")
    for key, want in (("rows", rows), ("n_decode", decode), ("n_prompt", prompt_tokens)):
        if s.get(key) != want:
            problems.append(f"{run.label}: {key} {s.get(key)!r}, want {want}")
    if len(s.get("decode_tokens") or []) != decode:
        problems.append(f"{run.label}: {len(s.get('decode_tokens') or [])} decode tokens, want {decode}")
    return problems


def logits_problem(run: HarnessRun, n_vocab: int) -> str | None:
    """Why a run's logits dump cannot serve as evidence (None when it can): a row with a NaN or an
    infinity, or a constant row (all-zero logits on both sides are equal, and prove nothing)."""
    data = array.array("f")
    data.frombytes(run.dump.read_bytes())
    for row in range(len(data) // n_vocab):
        problem = evidence_problem(data[row * n_vocab:(row + 1) * n_vocab], what="logits")
        if problem is not None:
            return f"{run.label}: row {row} (0 = prefill): {problem}"
    return None


def check_behaviour(kv: str, a: HarnessRun, b: HarnessRun, n_vocab: int | None, *,
                    prompt_tokens: int, decode: int) -> Check:
    name = f"feature off, KV {kv}, -fa on"
    if a.rc != 0 or b.rc != 0:
        bad = [r for r in (a, b) if r.rc != 0]
        ev = [f"{r.label}: harness exit {r.rc}, log {r.log}" for r in bad]
        for r in bad:
            ev += r.log.read_text(errors="replace").splitlines()[-8:]
        return Check(name, "behaviour", False, "harness failed", ev)
    shape = run_shape_problems(a, prompt_tokens, decode) + run_shape_problems(b, prompt_tokens, decode)
    if shape:
        return Check(name, "behaviour", False, f"nothing comparable: {shape[0]}", shape)
    garbage = [p for r in (a, b) if (p := logits_problem(r, int((r.summary or {})["n_vocab"])))]
    if garbage:
        return Check(name, "behaviour", False, f"nothing comparable: {garbage[0]}", garbage)
    ev: list[str] = []
    problems: list[str] = []

    def same(what: str, x: Any, y: Any) -> None:
        if x == y:
            ev.append(f"{what}: {x} (both)")
        else:
            ev.append(f"{what}: pristine {x} != patched {y}")
            problems.append(what)

    same("logits sha256", a.sha256, b.sha256)
    if a.sha256 != b.sha256 and n_vocab:
        ev.append(first_difference(a.dump, b.dump, n_vocab))
    sa, sb = a.summary or {}, b.summary or {}
    same("rows x n_vocab", f"{sa.get('rows')} x {sa.get('n_vocab')}",
         f"{sb.get('rows')} x {sb.get('n_vocab')}")
    same("decode tokens sha256", _tokens_sha(sa), _tokens_sha(sb))
    same("nodes computed (prefill, decode min/max)", sa.get("nodes"), sb.get("nodes"))
    same("state size (bytes)", sa.get("state_size"), sb.get("state_size"))
    for key in ("graph", "kv_size", "kv_buffer", "compute_buffer", "output_buffer", "model_buffer"):
        same(key.replace("_", " "), "; ".join(a.facts[key]) or "-", "; ".join(b.facts[key]) or "-")
    if not a.facts["graph"]:
        problems.append("no graph line in the log")
        ev.append("llama printed no 'graph: nodes = ...' line")
    ok = not problems
    summary = (f"bitwise-identical logits ({sa.get('rows')} rows), same graph and buffers" if ok
               else f"differs: {', '.join(problems)}")
    return Check(name, "behaviour", ok, summary, ev)


def _tokens_sha(summary: dict[str, Any]) -> str | None:
    toks = summary.get("decode_tokens")
    if toks is None:
        return None
    return hashlib.sha256(" ".join(map(str, toks)).encode()).hexdigest()[:16]


# PASS needs a passed check of each of these stages; a stage skipped on purpose (--skip-repro) says "not
# checked": INCOMPLETE, accepted only by name (--accept-not-checked); a stage with no check at all never is
REQUIRED_STAGES = ("build", "sources", "reproducibility", "binaries", "behaviour")


def verdict_of(checks: Sequence[Check]) -> Verdict:
    """The verdict of verify-identical: :func:`..verdict.verdict_of` with :data:`REQUIRED_STAGES`."""
    return shared_verdict_of(checks, REQUIRED_STAGES)


def render_report(checks: Sequence[Check], meta: dict[str, Any], out_dir: Path,
                  template_dirs: Sequence[Path]) -> tuple[Path, Path, dict[str, Any]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    v = verdict_of(checks)
    data = {"verdict": v.verdict, "missing_stages": list(v.missing_stages),
            "not_checked": list(v.not_checked), "meta": meta, "checks": [c.as_dict() for c in checks]}
    js = out_dir / "verify-identical.json"
    write_report(js, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    md = out_dir / "verify-identical.md"
    write_report(md, render(template_dirs, "verify-identical.md.j2", r=data))
    return js, md, data


def verify_identical(cfg: VerifyConfig, template_dirs: Sequence[Path], report_dir: Path) -> dict[str, Any]:
    """Run every stage; returns the report data (verdict PASS/FAIL). Never raises on a failed check."""
    cfg.work.mkdir(parents=True, exist_ok=True)
    opts = replace(cfg.options, build_commit=VERIFY_STAMP, build_number=0)
    cfg = replace(cfg, options=opts)
    checks: list[Check] = []
    meta: dict[str, Any] = {
        "generator": f"opencoti-patch {__version__}",
        "pristine": f"{cfg.pristine[1] or 'files'} of {cfg.pristine[0]}",
        "patched": f"{cfg.patched[1] or 'files'} of {cfg.patched[0]}"
                   + (f" + {', '.join(p.name for p in cfg.patch_files)}" if cfg.patch_files else ""),
        "targets": list(opts.targets), "cpu_variant": opts.cpu_variant, "cuda": opts.cuda,
        "kv_types": list(cfg.kv_types), "prompt_tokens": cfg.prompt_tokens, "decode": cfg.decode,
        "seed": cfg.seed, "threads": cfg.threads, "work": str(cfg.work),
        "patched_args": list(cfg.patched_args), "command": " ".join(sys.argv),
    }

    def fail_build(label: str, exc: Exception) -> None:
        checks.append(Check(f"build {label}", "build", False, str(exc).splitlines()[0],
                            str(exc).splitlines()[1:]))

    # sources
    try:
        prepare_source(cfg, "pristine", *cfg.pristine)
        prepare_source(cfg, "patched", *cfg.patched, patches=cfg.patch_files)
    except OpencotiError as exc:
        fail_build("sources", exc)
        return render_report(checks, meta, report_dir, template_dirs)[2]
    psrc, _ = _label_paths(cfg.work, "pristine")
    qsrc, _ = _label_paths(cfg.work, "patched")
    changed = changed_files(psrc, qsrc)
    meta["changed_sources"] = changed
    try:
        required, no_patches = required_patches(cfg), None
    except OpencotiError as exc:
        required, no_patches = {}, exc.message
    patches = {name: list(dict.fromkeys(p for fp in files for p in (fp.old_path, fp.new_path) if p))
               for name, files in required.items()}
    meta["patches"] = patches
    checks.append(check_patched_differs(changed, required, qsrc, no_patches))
    if not checks[-1].passed:
        return render_report(checks, meta, report_dir, template_dirs)[2]

    builds: dict[str, BuildResult] = {}
    for label in ("pristine", "patched"):
        try:
            builds[label] = build_label(cfg, label, opts)
            checks.append(Check(f"build {label}", "build", True, f"{len(builds[label].targets)} targets in "
                                f"{builds[label].seconds:.0f} s", [str(builds[label].build)]))
        except OpencotiError as exc:
            fail_build(label, exc)

    # 1. reproducibility
    if cfg.repro and "pristine" in builds:
        try:
            export_tree(psrc, _label_paths(cfg.work, "pristine-repro")[0])
            again = build_label(cfg, "pristine-repro", replace(opts, ccache=False), fresh=True)
            checks.append(check_repro(builds["pristine"], again))
        except OpencotiError as exc:
            fail_build("pristine-repro", exc)
    elif not cfg.repro:
        checks.append(Check("same tree built twice", "reproducibility", None, "not checked (--skip-repro)"))

    # 2. binaries: whole libraries, and object files of the translation units no change reaches
    if len(builds) == 2:
        checks.append(check_binaries(builds["pristine"], builds["patched"], changed, patches))
        try:
            checks.append(check_objects(compare_objects(object_infos(builds["pristine"]),
                                                        object_infos(builds["patched"]), changed)))
        except OpencotiError as exc:
            checks.append(Check("objects of untouched translation units", "binaries", False,
                                str(exc).splitlines()[0]))

    # 3. behaviour
    if len(builds) == 2 and (not cfg.kv_types or cfg.decode < 1 or cfg.prompt_tokens < 1):
        checks.append(Check("behaviour runs", "behaviour", False,
                            f"nothing to compare: KV types {list(cfg.kv_types)}, {cfg.prompt_tokens}-token "
                            f"prompt, {cfg.decode} decode steps"))
    elif len(builds) == 2:
        try:
            exes = {label: build_harness(res.src, res.bin, res.build.parent / "harness", opts,
                                         label=res.label) / SINGLE_EXE for label, res in builds.items()}
            model = ensure_model(cfg, psrc)
            meta["model"] = {"path": str(model), "sha256": sha256_file(model)}
            for kv in cfg.kv_types:
                info(f"[behaviour] KV {kv}: running the harness on both builds")
                a = run_harness(cfg, exes["pristine"], "pristine", kv, model)
                b = run_harness(cfg, exes["patched"], "patched", kv, model, cfg.patched_args)
                n_vocab = (a.summary or {}).get("n_vocab")
                checks.append(check_behaviour(kv, a, b, n_vocab, prompt_tokens=cfg.prompt_tokens,
                                              decode=cfg.decode))
        except OpencotiError as exc:
            checks.append(Check("harness", "behaviour", False, str(exc).splitlines()[0],
                                str(exc).splitlines()[1:]))
    return render_report(checks, meta, report_dir, template_dirs)[2]


def required_patches(cfg: VerifyConfig) -> dict[str, list[FilePatch]]:
    """patch name -> its files: the --patch-file diffs when given (the patched tree is pristine + them),
    else every patch of the series. Raises when there is neither: a run without them cannot tell a
    README edit from the series."""
    if cfg.patch_files:
        return {Path(p).name: file_patches(Path(p)) for p in cfg.patch_files}
    if cfg.series_dir is None or not (cfg.series_dir / "series").is_file():
        where = "no patches folder" if cfg.series_dir is None else f"no {cfg.series_dir / 'series'}"
        raise OpencotiError(f"{where} and no --patch-file")
    return {p.name: list(p.files) for p in load_series(cfg.series_dir)}


def raise_on_failure(data: dict[str, Any], accept_not_checked: Iterable[str] = ()) -> None:
    """Raise unless the verdict is PASS, or INCOMPLETE with only ``accept_not_checked`` stages not checked."""
    v = verdict_of([Check.from_dict(c) for c in data["checks"]])
    if v.accepts(accept_not_checked):
        return
    if v.verdict == FAIL:
        raise CheckFailed(f"verify-identical FAILED: {', '.join(v.reasons())}")
    raise CheckFailed(f"verify-identical INCOMPLETE: {', '.join(v.reasons())} "
                      "(accept a stage that cannot be checked here with --accept-not-checked STAGE)")

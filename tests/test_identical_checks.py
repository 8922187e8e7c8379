"""verify-identical must be able to fail: each test feeds one broken case and expects FAIL or an
explicit "not checked", never PASS."""

from __future__ import annotations

import array
import json
import math
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from opencoti_patch.builds import builder as b
from opencoti_patch.errors import CheckFailed, OpencotiError
from opencoti_patch.stack.series import FilePatch
from opencoti_patch.stack.upstream import sha256_file
from opencoti_patch.verify import identical as ident

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = [ROOT / "opencoti_patch" / "templates"]
N_VOCAB = 4
PROMPT = 8
DECODE = 2
LOG = "llama_context: graph: nodes = 130, splits = 1\n"
META = {"pristine": "upstream of /t", "patched": "files of /t", "targets": ["llama"],
        "cpu_variant": "haswell", "cuda": False, "kv_types": ["f16"], "prompt_tokens": PROMPT,
        "decode": DECODE, "seed": 42, "threads": 2, "patched_args": [],
        "command": "opencoti-patch verify-identical"}


def _harness_run(tmp: Path, label: str, *, rows: int = 1 + DECODE, dump: bool = True,
                 summary: bool = True, n_prompt: int = PROMPT, tokens: int = DECODE,
                 value: float | None = None) -> ident.HarnessRun:
    """One harness run; its logits are varied and finite, or every one ``value`` (NaN, 0.0)."""
    log = tmp / f"{label}.log"
    log.write_text(LOG)
    path = tmp / f"{label}.f32"
    path.unlink(missing_ok=True)
    if dump:
        logits = [0.25 * (i % 7) - 0.5 if value is None else value for i in range(rows * N_VOCAB)]
        path.write_bytes(array.array("f", logits).tobytes())
    data = {"rows": 1 + DECODE, "n_vocab": N_VOCAB, "n_decode": DECODE, "n_prompt": n_prompt,
            "decode_tokens": [1] * tokens, "state_size": 10, "nodes": None} if summary else None
    return ident.HarnessRun(label, "f16", 0, log, path, sha256_file(path) if dump else None, data,
                            ident.parse_log_facts(LOG))


def _behaviour(a: ident.HarnessRun, q: ident.HarnessRun) -> ident.Check:
    return ident.check_behaviour("f16", a, q, N_VOCAB, prompt_tokens=PROMPT, decode=DECODE)


def test_behaviour_passes_on_equal_complete_dumps(tmp_path: Path) -> None:
    c = _behaviour(_harness_run(tmp_path, "p"), _harness_run(tmp_path, "q"))
    assert c.passed is True, c.evidence


@pytest.mark.parametrize(("broken", "why"), [
    ({"dump": False}, "no logits dump"),  # None == None must not pass
    ({"summary": False}, "no JSON summary"),
    ({"rows": DECODE}, "logits dump has"),  # a row missing: not prefill + decode rows
    ({"n_prompt": PROMPT // 2}, "n_prompt"),
    ({"tokens": DECODE - 1}, "decode tokens"),
])
def test_behaviour_fails_when_nothing_comparable(tmp_path: Path, broken: dict[str, object], why: str) -> None:
    # both runs broken the same way: equal hashes (or both None) must still not pass
    c = _behaviour(_harness_run(tmp_path, "p", **broken), _harness_run(tmp_path, "q", **broken))
    assert c.passed is False and why in c.summary, (c.summary, c.evidence)


@pytest.mark.parametrize(("value", "why"), [(math.nan, "NaN"), (0.0, "all 4 logits equal 0.0"),
                                            (math.inf, "infinite")])
def test_behaviour_fails_on_logits_that_prove_nothing(tmp_path: Path, value: float, why: str) -> None:
    # both sides all-NaN (or all-zero): equal dumps, equal hashes, and still no evidence
    a, q = _harness_run(tmp_path, "p", value=value), _harness_run(tmp_path, "q", value=value)
    assert a.sha256 == q.sha256
    c = _behaviour(a, q)
    assert c.passed is False and why in c.summary, (c.summary, c.evidence)
    # one side only is enough
    c = _behaviour(_harness_run(tmp_path, "p2"), _harness_run(tmp_path, "q2", value=value))
    assert c.passed is False and "q2: row 0" in c.summary


def test_verdict_needs_sources_and_behaviour(tmp_path: Path) -> None:
    builds = [ident.Check("build pristine", "build", True, "ok"),
              ident.Check("build patched", "build", True, "ok")]
    v = ident.verdict_of(builds)
    assert v.verdict == "INCOMPLETE"
    assert v.missing_stages == ("sources", "reproducibility", "binaries", "behaviour")
    _, _, data = ident.render_report(builds, META, tmp_path, TEMPLATES)
    assert data["verdict"] == "INCOMPLETE"
    assert "No passed check of: sources, reproducibility" in (tmp_path / "verify-identical.md").read_text()
    with pytest.raises(CheckFailed, match="no passed behaviour check"):
        ident.raise_on_failure(data)
    with pytest.raises(CheckFailed, match="no passed behaviour check"):  # a missing stage is never accepted
        ident.raise_on_failure(data, accept_not_checked=["sources", "behaviour"])


def test_every_stage_is_required(tmp_path: Path) -> None:
    # build + sources + behaviour alone used to PASS: reproducibility and binaries were never asked for
    three = [ident.Check("build pristine", "build", True, "ok"),
             ident.Check("differs", "sources", True, "ok"), ident.Check("f16", "behaviour", True, "ok")]
    v = ident.verdict_of(three)
    assert v.verdict == "INCOMPLETE" and v.missing_stages == ("reproducibility", "binaries")
    _, _, data = ident.render_report(three, META, tmp_path, TEMPLATES)
    with pytest.raises(CheckFailed, match="no passed reproducibility check"):
        ident.raise_on_failure(data, accept_not_checked=["reproducibility", "binaries"])  # never ran
    five = [*three, ident.Check("same tree built twice", "reproducibility", True, "ok"),
            ident.Check("objects", "binaries", True, "ok")]
    assert ident.verdict_of(five).verdict == "PASS"


def test_not_checked_is_incomplete_not_pass(tmp_path: Path) -> None:
    checks = [ident.Check("build pristine", "build", True, "ok"),
              ident.Check("differs", "sources", True, "ok"), ident.Check("f16", "behaviour", True, "ok"),
              ident.Check("objects", "binaries", True, "ok"),
              ident.Check("same tree built twice", "reproducibility", None, "not checked (--skip-repro)")]
    _, _, data = ident.render_report(checks, META, tmp_path, TEMPLATES)
    assert data["verdict"] == "INCOMPLETE"
    assert data["not_checked"] == ["reproducibility: same tree built twice"]
    assert "**Not checked**" in (tmp_path / "verify-identical.md").read_text()
    with pytest.raises(CheckFailed, match="INCOMPLETE"):
        ident.raise_on_failure(data)
    with pytest.raises(CheckFailed):
        ident.raise_on_failure(data, accept_not_checked=["binaries"])
    ident.raise_on_failure(data, accept_not_checked=["reproducibility"])  # explicit acceptance only


def _fp(old: str | None, new: str | None) -> FilePatch:
    return FilePatch(old, new)


def _tree(root: Path, files: list[str]) -> Path:
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")
    return root


def test_patched_equal_to_pristine_fails(tmp_path: Path) -> None:
    series = {"0001-a.patch": [_fp("ggml/include/ggml.h", "ggml/include/ggml.h")],
              "0002-b.patch": [_fp("src/llama.cpp", "src/llama.cpp")]}
    tree = _tree(tmp_path, ["ggml/include/ggml.h", "src/llama.cpp"])
    assert ident.check_patched_differs([], series, tree).passed is False
    half = ident.check_patched_differs(["ggml/include/ggml.h"], series, tree)
    assert half.passed is False and "0002-b.patch" in half.summary
    assert ident.check_patched_differs(["ggml/include/ggml.h", "src/llama.cpp"], series, tree).passed is True


def test_every_file_of_every_patch_must_be_as_the_patch_says(tmp_path: Path) -> None:
    # a four-file patch: one changed file used to count as "every patch is present"
    four = {"0001-four.patch": [_fp("src/a.cpp", "src/a.cpp"), _fp("src/b.cpp", "src/b.cpp"),
                                _fp(None, "src/new.cpp"), _fp("src/old.cpp", None)]}
    tree = _tree(tmp_path / "t", ["src/a.cpp", "src/b.cpp", "src/new.cpp"])
    changed = ["src/a.cpp", "src/b.cpp", "src/new.cpp", "src/old.cpp"]
    assert ident.check_patched_differs(changed, four, tree).passed is True
    one = ident.check_patched_differs(["src/a.cpp"], four, tree)
    assert one.passed is False and "src/b.cpp unchanged" in one.summary, one.summary
    assert "1 of 4 files as the patch says" in one.evidence[1]
    missing = ident.check_patched_differs(changed, four, _tree(tmp_path / "m", ["src/a.cpp", "src/b.cpp"]))
    assert missing.passed is False and "src/new.cpp missing" in missing.summary
    kept = ident.check_patched_differs(changed, four, _tree(tmp_path / "k", [*changed]))
    assert kept.passed is False and "src/old.cpp still there" in kept.summary
    # a file a later patch deletes again is expected gone; docs/ is never exported, so never compared
    later = {**four, "0002-drop.patch": [_fp("src/new.cpp", None), _fp("docs/x.md", "docs/x.md")]}
    tree2 = _tree(tmp_path / "l", ["src/a.cpp", "src/b.cpp"])
    assert ident.check_patched_differs(changed, later, tree2).passed is True


def test_no_series_fails_the_sources_check(tmp_path: Path) -> None:
    cfg = ident.VerifyConfig(work=tmp_path, pristine=(tmp_path, None), patched=(tmp_path, None))
    with pytest.raises(OpencotiError, match="no patches folder and no --patch-file"):
        ident.required_patches(cfg)
    with pytest.raises(OpencotiError, match="series and no --patch-file"):
        ident.required_patches(replace(cfg, series_dir=tmp_path / "patches"))
    c = ident.check_patched_differs(["README.md"], {}, tmp_path, "no patches folder and no --patch-file")
    assert c.passed is False and "no patch to verify" in c.summary


def _fake_build(tmp: Path, label: str, libs: dict[str, bytes]) -> b.BuildResult:
    build = tmp / label / "build"
    (build / "bin").mkdir(parents=True)
    for name, data in libs.items():
        (build / "bin" / name).write_bytes(data)
    opts = b.BuildOptions(targets=("llama",))
    return b.BuildResult(label, tmp / label / "src", build, build / "log", opts, ["llama"], [], 1.0)


LIBS = {"libggml-base.so": b"base", "libggml-cpu.so": b"cpu", "libllama.so": b"llama"}


def test_binaries_not_checked_when_a_header_feeds_everything(tmp_path: Path) -> None:
    a = _fake_build(tmp_path, "a", LIBS)
    q = _fake_build(tmp_path, "q", {k: v + b"!" for k, v in LIBS.items()})
    c = ident.check_binaries(a, q, ["ggml/include/ggml.h"], {"0001.patch": ["ggml/include/ggml.h"]})
    assert c.passed is None and c.summary.startswith("not checked")
    narrow = ident.check_binaries(a, q, ["src/llama.cpp"], {"0001.patch": ["src/llama.cpp"]})
    assert narrow.passed is False and "libggml-cpu.so" in narrow.summary


def test_repro_fails_on_different_bytes(tmp_path: Path) -> None:
    a = _fake_build(tmp_path, "a", LIBS)
    c = ident.check_repro(a, _fake_build(tmp_path, "b", {**LIBS, "libllama.so": b"other"}))
    assert c.passed is False and "libllama.so" in c.summary
    assert ident.check_repro(a, _fake_build(tmp_path, "c", {})).passed is False


def _obj(sha: str, source: str, *headers: str, command: str = "cc -O3 -c <src>/x") -> ident.ObjectInfo:
    return ident.ObjectInfo(sha, source, frozenset({source, *headers}), command)


def test_objects_compare() -> None:
    a = {"u.o": _obj("1", "ggml/src/u.c"), "h.o": _obj("2", "src/h.cpp", "ggml/include/ggml.h"),
         "s.o": _obj("3", "src/s.cpp"), "c.o": _obj("4", "src/c.cpp"), "h2.o": _obj("5", "src/h2.cpp", "x.h")}
    good = {**a, "h.o": _obj("2x", "src/h.cpp", "ggml/include/ggml.h"), "s.o": _obj("3x", "src/s.cpp"),
            "c.o": _obj("4x", "src/c.cpp", command="cc -O3 -DNEW -c <src>/x")}
    changed = ["ggml/include/ggml.h", "src/s.cpp", "x.h"]
    cmp = ident.compare_objects(a, good, changed)
    assert cmp.independent == ["u.o"] and cmp.unexpected == []
    assert cmp.header_differs == {"h.o": ["ggml/include/ggml.h"]} and cmp.header_same == ["h2.o"]
    assert sorted(cmp.source_changed) == ["c.o", "s.o"]
    assert ident.check_objects(cmp).passed is True
    # an object that reads no changed file and is compiled the same way, yet differs: FAIL
    bad = ident.compare_objects(a, {**good, "u.o": _obj("1x", "ggml/src/u.c")}, changed)
    assert bad.unexpected == ["u.o"] and ident.check_objects(bad).passed is False
    # every object reads a changed file: nothing proven
    only_fed = ident.compare_objects({k: a[k] for k in ("h.o", "s.o")}, {k: good[k] for k in ("h.o", "s.o")},
                                     changed)
    assert ident.check_objects(only_fed).passed is None


def test_parse_ninja_deps(tmp_path: Path) -> None:
    src, build = tmp_path / "src", tmp_path / "build"
    text = (f"ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o: #deps 3, deps mtime 1 (VALID)\n"
            f"    {src}/ggml/src/ggml.c\n    /usr/include/stdio.h\n    {src}/ggml/include/ggml.h\n\n"
            f"src/CMakeFiles/llama.dir/llama.cpp.o: #deps 1, deps mtime 1 (VALID)\n    {src}/src/llama.cpp\n")
    deps = ident.parse_ninja_deps(text, src, build)
    assert deps["ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o"] == {"ggml/src/ggml.c", "ggml/include/ggml.h"}
    assert deps["src/CMakeFiles/llama.dir/llama.cpp.o"] == {"src/llama.cpp"}


# ------------------------------------------------------------ the pipeline, builds and harness faked


@pytest.fixture()
def fake_pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ident.VerifyConfig:
    """verify_identical with exports, builds and harness runs replaced by files: the wiring of the checks."""
    tree = tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "llama.cpp").write_text("int x;\n")

    def prepare(cfg: ident.VerifyConfig, label: str, src_tree: Path, rev: str | None,
                patches: tuple[Path, ...] = ()) -> Path:
        src, _ = ident._label_paths(cfg.work, label)
        b.export_tree(src_tree, src, rev)
        for p in patches:  # the fake "patch": append its text to src/llama.cpp
            with (src / "src" / "llama.cpp").open("a") as fh:
                fh.write(Path(p).read_text())
        return src

    def build(cfg: ident.VerifyConfig, label: str, opts: b.BuildOptions,
              fresh: bool = False) -> b.BuildResult:
        res = _fake_build(cfg.work / "builds", label, LIBS)
        return replace(res, src=ident._label_paths(cfg.work, label)[0])

    def harness(cfg: ident.VerifyConfig, exe: Path, label: str, kv: str, model: Path,
                extra: tuple[str, ...] = ()) -> ident.HarnessRun:
        out = cfg.work / label
        out.mkdir(parents=True, exist_ok=True)
        return _harness_run(out, f"{label}-{kv}")

    monkeypatch.setattr(ident, "prepare_source", prepare)
    monkeypatch.setattr(ident, "build_label", build)
    monkeypatch.setattr(ident, "build_harness", lambda *args, **kwargs: tmp_path / "harness")
    monkeypatch.setattr(ident, "run_harness", harness)
    monkeypatch.setattr(ident, "object_infos", lambda res: {"u.o": _obj("1", "ggml/src/u.c")})
    patch = tmp_path / "0001-x.patch"
    patch.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1 +1,2 @@\n int x;\n+// comment\n")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    return ident.VerifyConfig(work=tmp_path / "work", pristine=(tree, None), patched=(tree, None),
                              patch_files=(patch,), kv_types=("f16",), prompt_tokens=PROMPT, decode=DECODE,
                              model=tmp_path / "m.gguf", progress=False)


def _verify(cfg: ident.VerifyConfig, tmp: Path) -> dict[str, object]:
    data = ident.verify_identical(cfg, TEMPLATES, tmp / "report")
    assert json.loads((tmp / "report" / "verify-identical.json").read_text())["verdict"] == data["verdict"]
    return data


def _series(tmp: Path, diff: Path) -> Path:
    """A patches folder whose series is the one patch ``diff`` (with a header)."""
    series = tmp / "patches"
    series.mkdir()
    (series / "0001-x.patch").write_text("From: t <t@t>\nSubject: [PATCH] x\n\n---\n" + diff.read_text())
    (series / "series").write_text("0001-x.patch\n")
    return series


def test_pipeline_complete_run_passes(fake_pipeline: ident.VerifyConfig, tmp_path: Path) -> None:
    data = _verify(replace(fake_pipeline, repro=True), tmp_path)
    assert data["verdict"] == "PASS", [(c["name"], c["status"], c["summary"]) for c in data["checks"]]
    assert {c["stage"] for c in data["checks"]} == set(ident.REQUIRED_STAGES)


def test_pipeline_readme_edit_without_a_series_fails(fake_pipeline: ident.VerifyConfig,
                                                     tmp_path: Path) -> None:
    # the patched tree differs from pristine by a README edit only, and no series says what it should hold
    patched = tmp_path / "patched-tree"
    shutil.copytree(fake_pipeline.pristine[0], patched)
    (patched / "README.md").write_text("edited\n")
    for series_dir in (None, tmp_path / "no-patches"):
        data = _verify(replace(fake_pipeline, patched=(patched, None), patch_files=(), series_dir=series_dir,
                               repro=True), tmp_path)
        assert data["verdict"] == "FAIL" and data["checks"][0]["stage"] == "sources"
        assert "no patch to verify" in data["checks"][0]["summary"], data["checks"][0]
    # with the series (one patch, not in the tree): FAIL too, naming the patch
    series = _series(tmp_path, fake_pipeline.patch_files[0])
    data = _verify(replace(fake_pipeline, patched=(patched, None), patch_files=(), series_dir=series,
                           repro=True), tmp_path)
    assert data["verdict"] == "FAIL" and "0001-x.patch" in data["checks"][0]["summary"]


def test_pipeline_series_not_applied_fails(fake_pipeline: ident.VerifyConfig, tmp_path: Path) -> None:
    series = _series(tmp_path, fake_pipeline.patch_files[0])
    # the series says 0001-x.patch, but pristine is compared with itself
    data = _verify(replace(fake_pipeline, patch_files=(), series_dir=series), tmp_path)
    assert data["verdict"] == "FAIL"
    assert "identical to pristine" in data["checks"][0]["summary"]


def test_pipeline_no_kv_types_fails(fake_pipeline: ident.VerifyConfig, tmp_path: Path) -> None:
    data = _verify(replace(fake_pipeline, kv_types=(), repro=True), tmp_path)  # the --kv-types "" case
    assert data["verdict"] == "FAIL" and data["missing_stages"] == ["behaviour"]


def test_pipeline_skip_repro_is_incomplete(fake_pipeline: ident.VerifyConfig, tmp_path: Path) -> None:
    data = _verify(replace(fake_pipeline, repro=False), tmp_path)
    assert data["verdict"] == "INCOMPLETE"
    assert data["not_checked"] == ["reproducibility: same tree built twice"]
    with pytest.raises(CheckFailed, match="INCOMPLETE"):
        ident.raise_on_failure(data)
    ident.raise_on_failure(data, accept_not_checked=["reproducibility"])  # named: accepted


# ------------------------------------------------------------ object files of a real (tiny) ninja build


def _tiny_build(tmp: Path, label: str, header: str, helper: str) -> b.BuildResult:
    src, build = tmp / label / "src", tmp / label / "build"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.16)\nproject(tiny C)\n"
                                        "add_library(tiny SHARED uses.c alone.c)\n")
    (src / "h.h").write_text(header)
    (src / "uses.c").write_text('#include "h.h"\nint uses(void) { return H_VALUE; }\n')
    (src / "alone.c").write_text(helper)
    cmake, ninja = b.find_tool("cmake"), b.find_tool("ninja")
    for cmd in ([cmake, "-S", str(src), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                 "-DCMAKE_BUILD_TYPE=Release"], [ninja, "-C", str(build)]):
        subprocess.run(cmd, check=True, capture_output=True)
    opts = b.BuildOptions(targets=("tiny",))
    return b.BuildResult(label, src, build, build / "log", opts, ["tiny"], [], 1.0)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_object_infos_on_a_real_ninja_build(tmp_path: Path) -> None:
    alone = "int alone(int x) { return x * 3; }\n"
    a = _tiny_build(tmp_path, "a", "#define H_VALUE 1\n", alone)
    q = _tiny_build(tmp_path, "q", "#define H_VALUE 2\n", alone)
    ia, iq = ident.object_infos(a), ident.object_infos(q)
    uses = next(k for k in ia if k.endswith("uses.c.o"))
    assert ia[uses].source == "uses.c" and "h.h" in ia[uses].deps
    assert ia[uses].command == iq[uses].command and "<src>" in ia[uses].command  # paths normalized
    cmp = ident.compare_objects(ia, iq, ["h.h"])
    assert [k.endswith("alone.c.o") for k in cmp.independent] == [True] and list(cmp.header_differs) == [uses]
    assert ident.check_objects(cmp).passed is True
    # an object that reads no changed file but differs (a different compiler output): FAIL
    bad = _tiny_build(tmp_path, "bad", "#define H_VALUE 2\n", "int alone(int x) { return x * 5; }\n")
    cmp = ident.compare_objects(ia, ident.object_infos(bad), ["h.h"])
    assert len(cmp.unexpected) == 1 and ident.check_objects(cmp).passed is False

"""verify-identical must be able to fail: each test feeds one broken case and expects FAIL or an
explicit "not checked", never PASS."""

from __future__ import annotations

import array
import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from opencoti_patch.build import builder as b
from opencoti_patch.build import identical as ident
from opencoti_patch.errors import CheckFailed

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
                 summary: bool = True, n_prompt: int = PROMPT, tokens: int = DECODE) -> ident.HarnessRun:
    log = tmp / f"{label}.log"
    log.write_text(LOG)
    path = tmp / f"{label}.f32"
    path.unlink(missing_ok=True)
    if dump:
        path.write_bytes(array.array("f", [0.25] * (rows * N_VOCAB)).tobytes())
    data = {"rows": 1 + DECODE, "n_vocab": N_VOCAB, "n_decode": DECODE, "n_prompt": n_prompt,
            "decode_tokens": [1] * tokens, "state_size": 10, "nodes": None} if summary else None
    return ident.HarnessRun(label, "f16", 0, log, path, b.sha256_file(path) if dump else None, data,
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


def test_verdict_needs_sources_and_behaviour(tmp_path: Path) -> None:
    builds = [ident.Check("build pristine", "build", True, "ok"),
              ident.Check("build patched", "build", True, "ok")]
    v = ident.verdict_of(builds)
    assert v.verdict == "INCOMPLETE" and v.missing_stages == ("sources", "behaviour")
    _, _, data = ident.render_report(builds, META, tmp_path, TEMPLATES)
    assert data["verdict"] == "INCOMPLETE"
    assert "No passed check of: sources, behaviour" in (tmp_path / "verify-identical.md").read_text()
    with pytest.raises(CheckFailed, match="no passed behaviour check"):
        ident.raise_on_failure(data)
    with pytest.raises(CheckFailed, match="no passed behaviour check"):  # a missing stage is never accepted
        ident.raise_on_failure(data, accept_not_checked=["sources", "behaviour"])


def test_not_checked_is_incomplete_not_pass(tmp_path: Path) -> None:
    checks = [ident.Check("build pristine", "build", True, "ok"),
              ident.Check("differs", "sources", True, "ok"), ident.Check("f16", "behaviour", True, "ok"),
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


def test_patched_equal_to_pristine_fails() -> None:
    assert ident.check_patched_differs([], {}).passed is False
    series = {"0001-a.patch": ["ggml/include/ggml.h"], "0002-b.patch": ["src/llama.cpp"]}
    half = ident.check_patched_differs(["ggml/include/ggml.h"], series)
    assert half.passed is False and "0002-b.patch" in half.summary
    assert ident.check_patched_differs(["ggml/include/ggml.h", "src/llama.cpp"], series).passed is True


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


def test_pipeline_complete_run_passes(fake_pipeline: ident.VerifyConfig, tmp_path: Path) -> None:
    data = _verify(replace(fake_pipeline, repro=True), tmp_path)
    assert data["verdict"] == "PASS", [(c["name"], c["status"], c["summary"]) for c in data["checks"]]


def test_pipeline_series_not_applied_fails(fake_pipeline: ident.VerifyConfig, tmp_path: Path) -> None:
    data = _verify(replace(fake_pipeline, patch_files=()), tmp_path)  # pristine compared with itself
    assert data["verdict"] == "FAIL"
    assert "identical to pristine" in data["checks"][0]["summary"]


def test_pipeline_no_kv_types_fails(fake_pipeline: ident.VerifyConfig, tmp_path: Path) -> None:
    data = _verify(replace(fake_pipeline, kv_types=(), repro=True), tmp_path)  # the --kv-types "" case
    assert data["verdict"] == "FAIL" and data["missing_stages"] == ["behaviour"]


def test_pipeline_skip_repro_is_incomplete(fake_pipeline: ident.VerifyConfig, tmp_path: Path) -> None:
    data = _verify(replace(fake_pipeline, repro=False), tmp_path)
    assert data["verdict"] == "INCOMPLETE"
    assert data["not_checked"] == ["reproducibility: same tree built twice"]


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

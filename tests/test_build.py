"""Fast tests of the build side: fingerprint, export, CMake args, ninja/log parsing, target mapping,
manifest + install, report and workflow rendering. (Real builds: tests/test_build_real.py.)"""

from __future__ import annotations

import array
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_house import fake_ccache

from opencoti_patch.builds import builder as b
from opencoti_patch.builds import stamp as stamp_mod
from opencoti_patch.builds.workflow import render_workflow, write_workflow
from opencoti_patch.errors import CheckFailed, OpencotiError
from opencoti_patch.verify import identical as ident

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = [ROOT / "opencoti_patch" / "templates"]


# ------------------------------------------------------------------ fingerprint


def _series(tmp: Path, patches: dict[str, str], order: list[str] | None = None) -> Path:
    d = tmp / "patches"
    d.mkdir(exist_ok=True)
    for name, text in patches.items():
        (d / name).write_text(text)
    (d / "series").write_text("# comment\n" + "".join(n + "\n" for n in (order or list(patches))))
    return d


def test_fingerprint_changes_with_patch_content_and_order(tmp_path: Path) -> None:
    d = _series(tmp_path, {"0001-a.patch": "A\n", "0002-b.patch": "B\n"})
    fp1 = stamp_mod.series_fingerprint(d)
    assert fp1 == stamp_mod.series_fingerprint(d) and len(fp1) == 64
    (d / "0002-b.patch").write_text("B changed\n")
    fp2 = stamp_mod.series_fingerprint(d)
    assert fp2 != fp1
    (d / "series").write_text("# comment\n0002-b.patch\n0001-a.patch\n")
    assert stamp_mod.series_fingerprint(d) not in (fp1, fp2)
    # a file that is not in the series does not count
    (d / "0003-unused.patch").write_text("X\n")
    assert stamp_mod.series_fingerprint(d) == stamp_mod.series_fingerprint(d)


def test_fingerprint_framing_and_empty(tmp_path: Path) -> None:
    assert stamp_mod.series_fingerprint(None) == stamp_mod.series_fingerprint(tmp_path / "nothing")
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    d1 = _series(tmp_path / "x", {"0001-a.patch": "AB", "0002-b.patch": ""})
    d2 = _series(tmp_path / "y", {"0001-a.patch": "A", "0002-b.patch": "B"})
    assert stamp_mod.series_fingerprint(d1) != stamp_mod.series_fingerprint(d2)  # bytes moved between patches


def test_fingerprint_missing_patch(tmp_path: Path) -> None:
    d = _series(tmp_path, {"0001-a.patch": "A\n"}, order=["0001-a.patch", "0002-gone.patch"])
    with pytest.raises(OpencotiError, match="0002-gone.patch"):
        stamp_mod.series_fingerprint(d)


def test_build_stamp() -> None:
    assert stamp_mod.build_stamp("0c1e57098", "ab" * 32) == "0c1e57098+abababababab"


# ------------------------------------------------------------------ export


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    t = tmp_path / "tree"
    (t / "src").mkdir(parents=True)
    (t / "docs").mkdir()
    (t / "models").mkdir()
    (t / "src" / "a.c").write_text("int a;\n")
    (t / "docs" / "x.md").write_text("doc\n")
    (t / "models" / "v.gguf").write_bytes(b"GGUF")
    (t / "models" / "keep.py").write_text("print()\n")
    (t / "run.sh").write_text("#!/bin/sh\n")
    (t / "run.sh").chmod(0o755)
    (t / ".gitignore").write_text("ignored.txt\n")
    _git(t, "init", "-q")
    _git(t, "add", "-A")
    _git(t, "commit", "-qm", "base")
    _git(t, "tag", "upstream")
    return t


def test_export_working_tree_sync(repo: Path, tmp_path: Path) -> None:
    (repo / "src" / "a.c").write_text("int a = 1;\n")  # uncommitted edit
    (repo / "src" / "new.c").write_text("int n;\n")    # untracked, not ignored
    (repo / "ignored.txt").write_text("no\n")
    dest = tmp_path / "out" / "src"
    res = b.export_tree(repo, dest)
    assert res.source == "working-tree"
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == [".gitignore", "models/keep.py", "run.sh", "src/a.c", "src/new.c"]
    assert (dest / "src" / "a.c").read_text() == "int a = 1;\n"
    assert os.access(dest / "run.sh", os.X_OK) and (dest / "examples").is_dir()
    # sync: unchanged files keep their mtime, removed files go
    old = (dest / ".gitignore").stat().st_mtime_ns
    time.sleep(0.01)
    (repo / "src" / "new.c").unlink()
    res2 = b.export_tree(repo, dest)
    assert res2.written == 0 and res2.removed == 1
    assert (dest / ".gitignore").stat().st_mtime_ns == old


def test_export_rev_and_changed_files(repo: Path, tmp_path: Path) -> None:
    (repo / "src" / "a.c").write_text("int a = 2;\n")
    pristine = b.export_tree(repo, tmp_path / "p" / "src", rev="upstream").dest
    patched = b.export_tree(repo, tmp_path / "q" / "src").dest
    assert (pristine / "src" / "a.c").read_text() == "int a;\n"
    assert b.changed_files(pristine, patched) == ["src/a.c"]
    with pytest.raises(OpencotiError, match="git archive"):
        b.export_tree(repo, tmp_path / "r", rev="no-such-rev")


# ------------------------------------------------------------------ cmake args + helpers


def test_cmake_args_reproducible_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_ccache(tmp_path / "fakebin")  # ccache counts only where it is installed
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    src, build = tmp_path / "s", tmp_path / "b"
    opts = b.BuildOptions(build_commit="pin+fp", cpu_variant="haswell", ccache=True)
    args = b.cmake_args(src, build, opts, build / ".opencoti")
    joined = "\n".join(args)
    for want in ("-DGGML_BACKEND_DL=ON", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
                 "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_AVX2=ON", "-DGGML_AVX512=OFF",
                 "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON", "-DLLAMA_BUILD_COMMIT=pin+fp", "-DLLAMA_BUILD_NUMBER=0",
                 f"-DGIT_EXE={build / '.opencoti' / 'git'}", "-DGGML_CCACHE=OFF", "-DGGML_CUDA=OFF",
                 f"-DCMAKE_C_FLAGS=-ffile-prefix-map={src}=. -ffile-prefix-map={build}=build "
                 "-ffile-prefix-map=../src=.",
                 "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DLLAMA_USE_PREBUILT_UI=OFF"):
        assert want in joined, want
    nocc = b.cmake_args(src, build, b.BuildOptions(ccache=False, cuda=True, cuda_arch="90"), build / "h")
    assert not any("COMPILER_LAUNCHER=ccache" in a for a in nocc)
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in nocc and "-DGGML_CUDA=ON" in nocc
    assert any(a.startswith("-DCMAKE_CUDA_FLAGS=-Xcompiler=-ffile-prefix-map=") for a in nocc)
    assert any(a.startswith("-DCMAKE_CUDA_COMPILER_LAUNCHER=") and "nvcc-launcher.py" in a for a in nocc)
    assert b.cpu_variant_args("all") == ["-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=ON"]
    with pytest.raises(OpencotiError):
        b.cpu_variant_args("pentium")


def test_fake_git_and_nvcc_launcher(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "ggml" / "src").mkdir(parents=True)
    helper = tmp_path / "h"
    b.write_helpers(helper, src, b.BuildOptions(build_commit="pin+abc", build_number=7, ccache=False))
    git = str(helper / "git")
    def out(*args: str) -> str:
        return subprocess.run([git, *args], capture_output=True, text=True).stdout

    assert out("rev-parse", "--short", "HEAD") == "pin+abc\n"
    assert out("rev-list", "--count", "HEAD") == "7\n"
    assert subprocess.run([git, "diff-index", "--quiet", "HEAD"]).returncode == 0  # never "dirty"
    # the launcher adds a per-file seed derived from the path relative to the source
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text("#!/bin/sh\necho \"$@\"\n")
    fake_nvcc.chmod(fake_nvcc.stat().st_mode | stat.S_IEXEC)
    cu = src / "ggml" / "src" / "x.cu"

    def run() -> str:
        cmd = [sys.executable, str(helper / "nvcc-launcher.py"), str(fake_nvcc), "-c", str(cu), "-o", "x.o"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

    out = run()
    assert "--frandom-seed=" in out and "--objdir-as-tempdir" in out and out == run()


# ------------------------------------------------------------------ ninja + logs


def test_parse_progress_and_first_error() -> None:
    what = "Building CXX object src/x.o"
    assert b.parse_progress(f"[12/135] {what}") == (12, 135, what)
    assert b.parse_progress("ninja: build stopped") is None
    log = ["[1/3] Building C object a.o", "FAILED: a.o", "/s/a.c:3:1: error: expected ';'", "x", "y"]
    err = b.first_error(log)
    assert err is not None and err.startswith("FAILED: a.o") and "expected ';'" in err
    assert b.first_error(["[1/1] ok"]) is None


def test_progress_non_tty(capsys: pytest.CaptureFixture[str]) -> None:
    p = b.Progress("lbl", stream=sys.stderr)
    for i in range(1, 21):
        p.update(i, 20, "x")
    p.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "lbl: 1/20 (5%)" and err[-1] == "lbl: 20/20 (100%)" and len(err) <= 11


def test_artifact_key() -> None:
    assert stamp_mod.artifact_key("libllama.so.0.5.0") == "libllama.so"
    assert stamp_mod.artifact_key("libggml-cpu.so") == "libggml-cpu.so"
    assert stamp_mod.artifact_key("llama-cli") == "llama-cli"


# ------------------------------------------------------------------ target mapping

AVAIL = {"libggml-base.so", "libggml.so", "libggml-cpu.so", "libggml-cuda.so", "libllama.so",
         "libllama-common.so", "llama-cli", "libllama-cli-impl.so", "llama-server", "libllama-server-impl.so",
         "libserver-context.so", "libmtmd.so", "llama-bench", "libllama-bench-impl.so", "test-backend-ops",
         "test-sparse-attn"}


@pytest.mark.parametrize(("path", "expected"), [
    ("ggml/src/ggml-cpu/ops.cpp", {"libggml-cpu.so"}),
    ("ggml/src/ggml-cpu/sparse-attn.h", {"libggml-cpu.so"}),
    ("ggml/src/ggml-cuda/fattn.cu", {"libggml-cuda.so"}),
    ("ggml/src/ggml.c", {"libggml-base.so"}),
    ("ggml/src/ggml-backend-reg.cpp", {"libggml.so"}),
    ("ggml/include/ggml.h", AVAIL),
    ("ggml/src/ggml-impl.h", AVAIL),
    ("src/llama-graph.cpp", {"libllama.so"}),
    ("src/llama-sparse-attn.h", {"libllama.so"}),
    ("include/llama.h", AVAIL - {"libggml-base.so", "libggml.so", "libggml-cpu.so", "libggml-cuda.so"}),
    ("common/arg.cpp", AVAIL - {"libggml-base.so", "libggml.so", "libggml-cpu.so", "libggml-cuda.so",
                                "libllama.so"}),
    ("tools/llama-bench/llama-bench.cpp", {"llama-bench", "libllama-bench-impl.so"}),
    ("tools/server/server.cpp", {"llama-server", "libllama-server-impl.so", "libserver-context.so",
                                 "llama-cli", "libllama-cli-impl.so"}),
    ("tests/test-sparse-attn.cpp", {"test-sparse-attn"}),
    ("tests/CMakeLists.txt", {"test-backend-ops", "test-sparse-attn"}),
    ("CMakeLists.txt", AVAIL),
    ("docs/build.md", set()),
    ("gguf-py/gguf/constants.py", set()),
])
def test_affected_artifacts(path: str, expected: set[str]) -> None:
    assert ident.affected_artifacts(path, AVAIL) == expected


def test_patch_files_and_attribution() -> None:
    ops = "ggml/src/ggml-cpu/ops.cpp"
    diff = (f"diff --git a/{ops} b/{ops}\n--- a/{ops}\n+++ b/{ops}\n@@ -1 +1 @@\n-a\n+b\n"
            "diff --git a/src/new.cpp b/src/new.cpp\nnew file mode 100644\n"
            "--- /dev/null\n+++ b/src/new.cpp\n")
    files = ident.patch_files(diff)
    assert files == ["ggml/src/ggml-cpu/ops.cpp", "src/new.cpp"]
    who = ident.attribute(["libggml-cpu.so", "libllama.so", "llama-cli"],
                          {"0001-cpu.patch": files, "0002-docs.patch": ["docs/x.md"]}, AVAIL)
    assert who == {"libggml-cpu.so": ["0001-cpu.patch"], "libllama.so": ["0001-cpu.patch"], "llama-cli": []}


# ------------------------------------------------------------------ log facts + logits

LOG = """\
load_tensors:   CPU_Mapped model buffer size =    84.04 MiB
llama_kv_cache:        CPU KV buffer size =    16.00 MiB
llama_kv_cache: size =   16.00 MiB (  2304 cells,   4 layers,  1/1 seqs), K (f16):    8.00 MiB, V (f16): 8 MiB
sched_reserve:        CPU compute buffer size =   108.01 MiB
llama_context:  CPU  output buffer size =     0.02 MiB
sched_reserve: graph (pp bs=512, tg bs=1): nodes = 134 / 130, splits = 1, input objects = 4, input tensors = 5
opencoti-harness: nodes computed: prefill 536, decode min 130 max 130
"""


def test_parse_log_facts() -> None:
    f = ident.parse_log_facts(LOG)
    assert f["graph"] == ["nodes = 134 / 130, splits = 1, input objects = 4, input tensors = 5"]
    assert f["kv_buffer"] == ["CPU 16.00 MiB"]
    assert f["kv_size"][0].startswith("16.00 MiB (  2304 cells")
    assert f["compute_buffer"] == ["CPU 108.01 MiB"]
    assert f["output_buffer"] == ["CPU 0.02 MiB"]
    assert f["nodes_computed"] == ["prefill 536, decode min 130 max 130"]
    assert f["model_buffer"] == ["CPU_Mapped 84.04 MiB"]
    plain = ident.parse_log_facts("llama_context: graph: nodes = 130, splits = 1, input objects = 4\n")
    assert plain["graph"] == ["nodes = 130, splits = 1, input objects = 4"]
    # the two-line print of older pins (4df29be4f): one fact, in the one-line form
    old = ident.parse_log_facts("sched_reserve: graph nodes  = 727\nsched_reserve: graph splits = 1\n")
    assert old["graph"] == ["nodes = 727, splits = 1"]
    both = ident.parse_log_facts("sched_reserve: graph nodes  = 727 (with bs=512), 700 (with bs=1)\n"
                                 "sched_reserve: graph splits = 3 (with bs=512), 2 (with bs=1)\n")
    assert both["graph"] == ["nodes = 727 / 700, splits = 3 / 2"]


def test_first_difference(tmp_path: Path) -> None:
    x = array.array("f", [0.0] * 8)
    y = array.array("f", [0.0] * 8)
    y[5] = 0.5
    (tmp_path / "a").write_bytes(x.tobytes())
    (tmp_path / "b").write_bytes(y.tobytes())
    msg = ident.first_difference(tmp_path / "a", tmp_path / "b", n_vocab=4)
    assert "row 1" in msg and "token 1" in msg and "0.5" in msg
    assert ident.first_difference(tmp_path / "a", tmp_path / "a", 4) == "identical values"


def _run(label: str, kv: str, tmp: Path, sha: str, nodes: int = 130,
         graph: str = "nodes = 134") -> ident.HarnessRun:
    log = tmp / f"{label}.log"
    log.write_text(LOG.replace("nodes = 134", graph))
    dump = tmp / f"{label}.f32"
    dump.write_bytes(array.array("f", [0.5, -0.25, 1.0, 0.0]).tobytes())  # 2 rows of 2: finite, not constant
    summary = {"rows": 2, "n_vocab": 2, "n_decode": 1, "n_prompt": 4, "decode_tokens": [1], "state_size": 10,
               "nodes": {"prefill": 1, "decode_min": nodes, "decode_max": nodes}}
    return ident.HarnessRun(label, kv, 0, log, dump, sha, summary, ident.parse_log_facts(log.read_text()))


def test_check_behaviour(tmp_path: Path) -> None:
    shape = {"prompt_tokens": 4, "decode": 1}
    ok = ident.check_behaviour("f16", _run("p", "f16", tmp_path, "aa"), _run("q", "f16", tmp_path, "aa"), 2,
                               **shape)
    assert ok.passed, ok.evidence
    bad = ident.check_behaviour("f16", _run("p", "f16", tmp_path, "aa"),
                                _run("q", "f16", tmp_path, "bb", nodes=131, graph="nodes = 140"), 2, **shape)
    assert not bad.passed
    assert "logits sha256" in bad.summary and "nodes computed" in bad.summary and "graph" in bad.summary


# ------------------------------------------------------------------ manifest, install, reports


def _fake_build(tmp: Path) -> b.BuildResult:
    build = tmp / "w" / "cpu" / "build"
    bin_dir = build / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "libllama.so.0.5.0").write_bytes(b"llama")
    os.symlink("libllama.so.0.5.0", bin_dir / "libllama.so.0")
    os.symlink("libllama.so.0", bin_dir / "libllama.so")
    (bin_dir / "libggml-cpu.so").write_bytes(b"cpu")
    (bin_dir / "llama-cli").write_bytes(b"cli")
    (bin_dir / "llama-cli").chmod(0o755)
    opts = b.BuildOptions(build_commit="pin+0123456789ab", targets=("llama", "llama-cli"))
    src = tmp / "w" / "cpu" / "src"
    return b.BuildResult("cpu", src, build, build / "log", opts, ["llama", "llama-cli"],
                         b.cmake_args(src, build, opts, build / ".opencoti"), 1.0)


def test_manifest_and_install(tmp_path: Path) -> None:
    res = _fake_build(tmp_path)
    d = _series(tmp_path, {"0001-a.patch": "A\n"})
    fp = stamp_mod.series_fingerprint(d)
    m = stamp_mod.make_manifest(res, pin="0c1e57098", fingerprint=fp, series=["0001-a.patch"],
                        source={"tree": "/t", "rev": "working-tree"}, tools=["llama-cli"])
    assert m["upstream_pin"] == "0c1e57098" and m["series_fingerprint"] == fp
    arts = {a["name"]: a for a in m["artifacts"]}
    assert set(arts) == {"libllama.so.0.5.0", "libggml-cpu.so", "llama-cli"}
    assert sorted(arts["libllama.so.0.5.0"]["links"]) == ["libllama.so", "libllama.so.0"]
    assert arts["llama-cli"]["kind"] == "tool" and arts["libggml-cpu.so"]["kind"] == "dso"
    assert all(str(tmp_path) not in o for o in m["cmake_options"])  # portable
    assert set(m["toolchain"]) == {"cmake", "ninja", "cc", "cxx", "nvcc", "ccache"}
    js, md = stamp_mod.write_manifest(m, res.build, TEMPLATES)
    assert json.loads(js.read_text()) == m
    text = md.read_text()
    assert fp in text and "0001-a.patch" in text
    assert "`libllama.so.0.5.0` (libllama.so, libllama.so.0)" in text

    dests = [tmp_path / "i1", tmp_path / "i2"]
    for dest in dests:
        assert sorted(stamp_mod.install(m, res.bin, dest)) == ["libggml-cpu.so", "libllama.so.0.5.0"]
        assert (dest / "libllama.so").resolve().name == "libllama.so.0.5.0"
        assert not (dest / "llama-cli").exists() and (dest / stamp_mod.MANIFEST_JSON).is_file()
    m["artifacts"][0]["sha256"] = "0" * 64
    with pytest.raises(CheckFailed, match="sha256"):
        stamp_mod.install(m, res.bin, tmp_path / "i3")


def test_report_rendering(tmp_path: Path) -> None:
    checks = [ident.Check("same tree built twice", "reproducibility", True, "ok", ["a == a"]),
              ident.Check("feature off, KV f16", "behaviour", False, "differs: logits sha256", ["x != y"]),
              ident.Check("skipped one", "reproducibility", None, "not checked")]
    meta = {"pristine": "upstream of /t", "patched": "files of /t", "targets": ["llama"],
            "cpu_variant": "haswell", "cuda": False, "kv_types": ["f16"], "prompt_tokens": 2048,
            "decode": 64, "seed": 42, "threads": 2, "patched_args": [],
            "command": "opencoti-patch verify-identical", "patches": {"x.patch": ["src/a"]}}
    js, md, data = ident.render_report(checks, meta, tmp_path, TEMPLATES)
    assert data["verdict"] == "FAIL"
    text = md.read_text()
    assert text.startswith("# verify-identical: FAIL") and "**FAIL**" in text and "**not checked**" in text
    assert json.loads(js.read_text())["checks"][1]["status"] == "FAIL"
    with pytest.raises(CheckFailed, match="feature off"):
        ident.raise_on_failure(data)
    required = [ident.Check(n, st, True, "ok") for n, st in
                (("build pristine", "build"), ("patched differs", "sources"), ("objects", "binaries"),
                 ("feature off", "behaviour"))]
    _, _, good = ident.render_report(checks[:1] + required, meta, tmp_path, TEMPLATES)
    assert good["verdict"] == "PASS"
    ident.raise_on_failure(good)


def test_workflow_renders_and_is_current(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    text = render_workflow(TEMPLATES)
    wf = yaml.safe_load(text)
    assert set(wf["jobs"]) == {"cpu", "cuda"}
    steps = [s.get("run", "") for s in wf["jobs"]["cpu"]["steps"]]
    for stage in ("fetch", "backup", "apply", "markers", "verify", "rebuild", "optests", "publish"):
        assert f"ci/rebuild.sh {stage}" in steps
    assert wf["jobs"]["cpu"]["timeout-minutes"] == 90
    assert "self-hosted" in wf["jobs"]["cuda"]["runs-on"]
    assert "${{ github.workspace }}" in text
    # the committed file is what the template renders
    assert (ROOT / ".github" / "workflows" / "rebuild.yml").read_text() == text
    out = tmp_path / "wf.yml"
    assert write_workflow(out, TEMPLATES) is True and write_workflow(out, TEMPLATES) is False
    out.write_text("stale")
    with pytest.raises(CheckFailed):
        write_workflow(out, TEMPLATES, check=True)


def test_rebuild_script_stages() -> None:
    script = ROOT / "ci" / "rebuild.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    for cmd in ("fetch", "backup", "apply", "markers", "verify-identical", "rebuild"):
        assert f'"$OC" {cmd}' in text
    res = subprocess.run([str(script), "nonsense"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown stage" in res.stderr

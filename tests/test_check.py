"""`opencoti-patch check` on the tiny synthetic upstream: the series applied one patch at a time onto
pristine, an incremental build of a tiny CMake project after each, the checks of each patch's `Test:`
lines; a deliberately broken middle patch is caught at that patch (exit 4), and the `Test:` lines go
through the header template (snapshot --test / --patch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from stackutil import Project
from test_house import path_without_ccache

from opencoti_patch.stack.series import parse_patch

CMAKE = """# UPSTREAM_SYNC(tiny): file
cmake_minimum_required(VERSION 3.14)
project(tiny C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
# like llama.cpp's tests that link the CPU backend: defined only without dynamically loaded backends
if (NOT GGML_BACKEND_DL)
    add_executable(tiny-test t.c)
endif()
"""


def series_with_a_broken_middle(p: Project) -> None:
    p.prepared()
    (p.tree / "CMakeLists.txt").write_text(CMAKE)
    (p.tree / "t.c").write_text("// UPSTREAM_SYNC(tiny): file\nint main(void) { return 0; }\n")
    p.run("snapshot", "--new", "tiny", "--feature", "tiny", "--test", "markers", "--test", "tiny-test")
    p.edit("t.c", "return 0;", "return 1; /* broken */")
    p.run("snapshot", "--new", "broken", "--feature", "tiny", "--test", "tiny-test")
    p.edit("README.md", "# tiny upstream", "# tiny upstream, patched")
    p.run("snapshot", "--new", "third")


def test_test_lines_go_through_the_header_template(project: Project) -> None:
    project.prepared()
    project.edit("src/a.c", "int line_10 = 10;", "int line_10 = 1000;")
    project.run("snapshot", "--new", "first", "--test", "markers", "--test", "test-x -o OP")
    patch = parse_patch(project.patches / "0001-first.patch")
    assert patch.header.tests == ("markers", "test-x -o OP")
    text = (project.patches / "0001-first.patch").read_text()
    assert "Feature: none (always on)\nTest: markers\nTest: test-x -o OP\nPatch-Filename:" in text
    project.edit("src/a.c", "int line_20 = 20;", "int line_20 = 2000;")
    project.run("snapshot", "--new", "second")
    # a header edit of a patch below the top, through the snapshot path (the round trip is proven)
    project.run("snapshot", "--patch", "0001-first.patch", "--test", "markers")
    assert parse_patch(project.patches / "0001-first.patch").header.tests == ("markers",)
    project.run("snapshot", "--check")
    project.run("apply")  # the rewritten header is what the applied commit carries: nothing to do
    assert "already applied" in project.run("apply").stdout


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler")
def test_check_catches_the_broken_middle_patch(project: Project, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", path_without_ccache(tmp_path))  # ccache is never required
    series_with_a_broken_middle(project)
    root = tmp_path / "check"
    result = project.run("check", "--targets", "tiny-test", "--check-root", str(root), "--json",
                         "--no-progress", code=4)
    data = json.loads(result.stdout[result.stdout.index("{"):])
    assert data["failed_at"] == "0002-broken.patch" and not data["ok"]
    steps = data["steps"]
    assert [s["patch"] for s in steps] == ["0001-tiny.patch", "0002-broken.patch"]  # stopped there
    assert steps[0]["ok"] and [t["check"] for t in steps[0]["tests"]] == ["markers", "tiny-test"]
    assert [(t["check"], t["ok"], t["rc"]) for t in steps[1]["tests"]] == [("tiny-test", False, 1)]
    assert "[2/3] 0002-broken.patch: test tiny-test: FAILED" in result.stderr
    # fix the middle patch's file: the whole series passes, in the same (incremental) build folder
    text = (project.patches / "0002-broken.patch").read_text().replace(
        "+int main(void) { return 1; /* broken */ }", "+int main(void) { return 0; /* fixed */ }")
    (project.patches / "0002-broken.patch").write_text(text)
    result = project.run("check", "--targets", "tiny-test", "--check-root", str(root), "--no-progress")
    assert "ok      0002-broken.patch  (tiny-test: ok)" in result.stdout
    assert "ok      0003-third.patch  (no Test: line)" in result.stdout


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler")
def test_check_of_a_broken_copy_in_another_patches_dir(project: Project, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """`check --patches-dir DIR` checks a copy of the series (a scratch folder) against the same pristine
    tree: the copy's broken middle patch is caught at that patch, the project's own series still passes."""
    monkeypatch.setenv("PATH", path_without_ccache(tmp_path))
    series_with_a_broken_middle(project)
    scratch = tmp_path / "scratch-patches"
    shutil.copytree(project.patches, scratch)
    own = project.patches / "0002-broken.patch"
    own.write_text(own.read_text().replace("+int main(void) { return 1; /* broken */ }",
                                           "+int main(void) { return 0; /* fixed */ }"))
    root = tmp_path / "check"
    result = project.run("check", "--patches-dir", str(scratch), "--targets", "tiny-test", "--check-root",
                         str(root), "--json", "--no-progress", code=4)
    data = json.loads(result.stdout[result.stdout.index("{"):])
    assert data["failed_at"] == "0002-broken.patch"
    assert [(s["patch"], s["ok"]) for s in data["steps"]] == [("0001-tiny.patch", True),
                                                               ("0002-broken.patch", False)]
    assert "0003-third.patch" not in result.stderr  # the patch after it is neither run nor blamed
    result = project.run("check", "--targets", "tiny-test", "--check-root", str(root), "--no-progress")
    assert "ok      0002-broken.patch  (tiny-test: ok)" in result.stdout
    assert "ok      0003-third.patch  (no Test: line)" in result.stdout


STUB = """#!/bin/sh
echo "$*" >> "$LOG"
case "$1" in
  pin) [ "$2" = list ] && echo '{"pins": [{"name": "old"}]}' ;;
  bump) echo '{"steps": ["rebase old -> 0.3.35"], "outcomes": [{"patch": "0001-a.patch",
          "status": "'$REBASE_STATUS'",
          "resolved": [{"file": "a.c", "lines": "3-5", "rules": ["marker-region"]}],
          "left": [{"file": "b.c", "lines": "7-9", "why": "unmarked"}]}], "pending": false}'
          [ "$REBASE_STATUS" = conflicted ] && exit 3 ;;
  check) echo '{"ok": true}' ;;
  rebuild) case " $* " in *" selfcheck "*)
          bin=$OPENCOTI_WORK/build/selfcheck/build/bin; mkdir -p "$bin"
          printf '#!/bin/sh\necho ok\n' > "$bin/test-sparse-attn"
          printf '#!/bin/sh\nfor i in $(seq 32); do echo "llama hd=64 x OK"; done\n' \
              > "$bin/test-sparse-attn-kv"
          chmod +x "$bin"/test-* ;; esac ;;
esac
exit 0
"""


@pytest.mark.parametrize("status", ["auto-resolved", "conflicted"])
def test_rebuild_to_pin_path(tmp_path: Path, status: str) -> None:
    """ci/rebuild.sh --to PIN: pin add -> bump (prepare, rebase, snapshot) -> check -> optests -> verify ->
    rebuild; a conflict stops it (exit 3) with the report and the conflicted files in the artifact folder."""
    import subprocess

    stub = tmp_path / "oc"
    stub.write_text(STUB)
    stub.chmod(0o755)
    tree = tmp_path / "tree"
    tree.mkdir()
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    build = tmp_path / "work" / "verify-cpu" / "patched" / "build"  # what the (stub) rebuild made
    build.mkdir(parents=True)
    for name in ("opencoti-build-manifest.json", "opencoti-build-manifest.md"):
        (build / name).write_text("{}")
    env = {"PATH": "/usr/bin:/bin", "OPENCOTI": str(stub), "OPENCOTI_WORK": str(tmp_path / "work"),
           "OPENCOTI_TREE": str(tree), "LOG": str(tmp_path / "log"), "REBASE_STATUS": status,
           "HOME": str(tmp_path)}
    script = Path(__file__).resolve().parents[1] / "ci" / "rebuild.sh"
    res = subprocess.run([str(script), "--to", "0.3.35"], env=env, capture_output=True, text=True,
                         cwd=tmp_path)
    calls = [ln.split()[0] + (" " + ln.split()[1] if ln.startswith("pin") else "")
             for ln in (tmp_path / "log").read_text().splitlines()]
    out = tmp_path / "work" / "artifacts" / "bump-0.3.35"
    assert "auto-resolved a.c:3-5 (marker-region)" in (out / "rebase.txt").read_text()
    if status == "conflicted":
        assert res.returncode == 3, res.stderr
        assert calls == ["pin list", "pin add", "bump"]
        assert "bump onto 0.3.35 stopped (exit 3" in res.stderr
        assert "run ci/rebuild.sh --to 0.3.35 again" in res.stderr
    else:
        assert res.returncode == 0, res.stderr
        assert calls == ["pin list", "pin add", "bump", "check", "rebuild", "verify-identical", "rebuild"]
        assert json.loads((out / "check.json").read_text()) == {"ok": True}
        assert "- rebase old -> 0.3.35" in (out / "rebase.txt").read_text()


LINKED = """# UPSTREAM_SYNC(tiny): file
cmake_minimum_required(VERSION 3.14)
project(tiny C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(tiny-test t.c src/a.c)
"""


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler")
def test_a_build_error_names_the_patch_and_the_region(project: Project, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """A compile error inside a marked region of an upstream file names that region and its patch; an
    undefined symbol at link time names the patches whose added lines use it."""
    monkeypatch.setenv("PATH", path_without_ccache(tmp_path))
    project.prepared()
    (project.tree / "CMakeLists.txt").write_text(LINKED)
    (project.tree / "t.c").write_text("// UPSTREAM_SYNC(tiny): file\nint main(void) { return 0; }\n")
    project.run("snapshot", "--new", "tiny", "--feature", "tiny")
    project.edit("src/a.c", "int line_20 = 20;\n", "int line_20 = 20;\n// UPSTREAM_SYNC(tiny): begin\n"
                 "int broken = ;\n// UPSTREAM_SYNC(tiny): end\n")
    project.run("snapshot", "--new", "broken", "--feature", "tiny")
    root = tmp_path / "check"
    result = project.run("check", "--targets", "tiny-test", "--check-root", str(root), "--json",
                         "--no-progress", code=4)
    data = json.loads(result.stdout[result.stdout.index("{"):])
    assert data["failed_at"] == "0002-broken.patch"
    where = "src/a.c:22: in the marked region src/a.c:21-23 (0002-broken.patch)"
    assert data["steps"][1]["where"] == [where]
    assert f"at {where}" in result.output
    patch = project.patches / "0002-broken.patch"
    fixed = "+int broken(void); int use(void) { return broken(); }"
    patch.write_text(patch.read_text().replace("+int broken = ;", fixed))
    result = project.run("check", "--targets", "tiny-test", "--check-root", str(root), "--no-progress",
                         code=4)
    assert "at undefined broken: named by 0002-broken.patch (src/a.c)" in result.output

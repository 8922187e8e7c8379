"""What a newcomer meets first: the README's test command without ccache, a non-editable install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from dataclasses import replace
from pathlib import Path

import pytest

from opencoti_patch.builds import builder as b
from opencoti_patch.builds import stamp as stamp_mod
from opencoti_patch.config import SHIPPED_TEMPLATES

ROOT = Path(__file__).resolve().parents[1]


def path_without_ccache(tmp: Path) -> str:
    """A PATH like the current one where no ccache can be found (a farm of links to the rest)."""
    farm = tmp / "bin-farm"
    farm.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or "ccache" in d or not Path(d).is_dir():
            continue
        for exe in Path(d).iterdir():
            link = farm / exe.name
            if exe.name == "ccache" or link.exists() or exe.resolve().name == "ccache":
                continue
            link.symlink_to(exe)
    return str(farm)


def fake_ccache(folder: Path) -> Path:
    """A ``ccache`` that runs its command, in ``folder`` (to put on PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / "ccache"
    fake.write_text("#!/bin/sh\nexec \"$@\"\n")
    fake.chmod(0o755)
    return fake


def test_default_build_options_follow_ccache_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    opts = b.BuildOptions()
    assert opts.ccache is False
    assert not any("LAUNCHER" in a for a in b.cmake_args(tmp_path, tmp_path / "b", opts, tmp_path / "h"))
    fake_ccache(tmp_path)
    assert b.BuildOptions().ccache is True


def test_tiny_build_with_default_options_needs_no_ccache(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Configure + build a one-file CMake project with the launcher args of the default options."""
    if not shutil.which("cc"):
        pytest.skip("no C compiler")
    monkeypatch.setenv("PATH", path_without_ccache(tmp_path))
    src, build = tmp_path / "src", tmp_path / "build"
    src.mkdir()
    (src / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\nproject(t C)\n"
                                        "add_executable(t t.c)\n")
    (src / "t.c").write_text("int main(void) { return 0; }\n")
    opts = b.BuildOptions()
    launcher = [a for a in b.cmake_args(src, build, opts, build / "h") if "LAUNCHER" in a]
    cmake, ninja = b.find_tool("cmake"), b.find_tool("ninja")
    cfg = subprocess.run([cmake, "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}", "-S", str(src),
                          "-B", str(build), *launcher], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    out = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True)
    assert out.returncode == 0 and "ccache: not found" not in out.stdout + out.stderr, out.stdout


def test_ccache_wanted_but_not_installed_is_off_everywhere(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-ccache not given (ccache wanted) on a machine without it: no launcher anywhere."""
    from opencoti_patch.builds.harness import harness_args

    monkeypatch.setenv("PATH", path_without_ccache(tmp_path))
    opts = b.BuildOptions(ccache=True)
    assert opts.ccache is False and replace(opts, ccache=True).ccache is False
    args = b.cmake_args(tmp_path, tmp_path / "b", opts, tmp_path / "h")
    assert not any("LAUNCHER=ccache" in a for a in args)
    assert not any("LAUNCHER" in a for a in harness_args(tmp_path, tmp_path / "bin", tmp_path / "hb", opts))
    b.write_helpers(tmp_path / "h", tmp_path, replace(opts, cuda=True))
    assert "CCACHE = None" in (tmp_path / "h" / "nvcc-launcher.py").read_text()
    assert b.build_env(tmp_path, opts)["CCACHE_DISABLE"] == "1"


TINY_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(tiny C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_library(ggml-base SHARED g.c)
set_target_properties(ggml-base PROPERTIES VERSION 0.0.1 SOVERSION 0)
add_executable(llama-tiny t.c)
target_link_libraries(llama-tiny ggml-base)
"""


def test_rebuild_without_ccache_builds_a_tiny_project(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder's whole path (export, configure with its own arguments and helpers, ninja, stamp,
    manifest, install) with the default options on a machine without ccache, on a two-file project."""
    if not shutil.which("cc"):
        pytest.skip("no C compiler")
    monkeypatch.setenv("PATH", path_without_ccache(tmp_path))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "CMakeLists.txt").write_text(TINY_CMAKE)
    (tree / "g.c").write_text("int g(void) { return 0; }\n")
    (tree / "t.c").write_text("int g(void);\nint main(void) { return g(); }\n")
    opts = b.BuildOptions(targets=("ggml-base", "llama-tiny"), optional_targets=())
    manifest, out_dir = stamp_mod.rebuild(tree, tmp_path / "work", opts, label="cpu", rev=None, pin="tiny",
                                          patches_dir=None, template_dirs=[SHIPPED_TEMPLATES],
                                          install_dirs=[tmp_path / "installed"], progress=False)
    log = (out_dir / "opencoti-build.log").read_text().replace(str(tmp_path), "<tmp>")
    assert "ccache" not in log.replace("GGML_CCACHE", ""), log
    assert not any("LAUNCHER" in a for a in manifest["cmake_options"])
    assert manifest["toolchain"]["ccache"] is None and manifest["build_commit"].startswith("tiny+")
    assert {a["name"] for a in manifest["artifacts"]} == {"libggml-base.so.0.0.1", "llama-tiny"}
    assert subprocess.run([str(out_dir / "bin" / "llama-tiny")]).returncode == 0
    assert (tmp_path / "installed" / "libggml-base.so.0").is_symlink()


@pytest.mark.skipif(os.environ.get("OPENCOTI_NESTED") == "1", reason="already inside ci/test.sh")
def test_readme_test_command_without_ccache(tmp_path: Path) -> None:
    """`./ci/test.sh` (the README's command) with no ccache on PATH, on the tests of the build path
    (options, configure arguments, harness, a tiny project built through `rebuild`)."""
    venv_dir = Path(sys.prefix)
    env = dict(os.environ, PATH=path_without_ccache(tmp_path), OPENCOTI_VENV=str(venv_dir),
               OPENCOTI_NESTED="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # itself deselected: inside the nested run it would skip, and under OPENCOTI_REQUIRE_ALL=1 no test may
    res = subprocess.run([str(ROOT / "ci" / "test.sh"), "--fast", "tests/test_house.py", "-k",
                          "ccache and not readme_test_command", "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "4 passed" in out and "skipped" not in out and "ccache: not found" not in out


@pytest.mark.skipif(os.environ.get("OPENCOTI_NESTED") == "1", reason="already inside ci/test.sh")
def test_non_editable_install_runs_from_another_folder(tmp_path: Path) -> None:
    """`pip install .` (not -e) into a fresh venv; status, ci-workflow and markers from elsewhere."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies come from this venv (a plain path line: its editable hook is not run)
    deps = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)]
    (Path(site) / "deps-of-the-test.pth").write_text("\n".join(deps) + "\n")
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)], capture_output=True,
                         text=True, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert pip.returncode == 0, pip.stderr
    where = subprocess.run([str(py), "-c", "import opencoti_patch; print(opencoti_patch.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert str(env_dir) in where.stdout, where.stdout + where.stderr  # not the source checkout
    project = tmp_path / "project"
    shutil.copytree(ROOT / "patches", project / "patches")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    exe = str(env_dir / "bin" / "opencoti-patch")
    env = dict(os.environ, OPENCOTI_ROOT=str(project))
    env.pop("OPENCOTI_TREE", None)
    status = subprocess.run([exe, "status"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert status.returncode == 0 and "template" not in status.stderr, status.stdout + status.stderr
    wf = subprocess.run([exe, "ci-workflow", "--out", str(tmp_path / "wf.yml")], cwd=elsewhere, env=env,
                        capture_output=True, text=True)
    assert wf.returncode == 0, wf.stderr
    assert (tmp_path / "wf.yml").read_text() == (ROOT / ".github" / "workflows" / "rebuild.yml").read_text()
    mk = subprocess.run([exe, "markers"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert mk.returncode == 0 and "marked regions, 0 errors" in mk.stdout, mk.stdout + mk.stderr
    harness = subprocess.run([str(py), "-c", "from opencoti_patch.config import SHIPPED_HARNESS as h; "
                              "from opencoti_patch.lab.batch import LAB_HARNESS as lab; "
                              "print(all(p.is_file() for p in (h / 'CMakeLists.txt', h / 'llama.cmake', "
                              "lab / 'CMakeLists.txt', lab / 'opencoti-qk-dump.cpp')))"], cwd=elsewhere,
                             capture_output=True, text=True)
    assert harness.stdout.strip() == "True", harness.stderr

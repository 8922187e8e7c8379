"""One test per bug found by trying the tools, on the tiny synthetic upstream."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from stackutil import PIN_A, PIN_B, Project
from test_patchstack import _hunk, _write_patch, two_patches

from opencoti_patch.errors import OpencotiError

INDEX = "diff --git a/src/a.c b/src/a.c\nindex 1234567..89abcde 100644\n"


def test_backup_takes_the_pin_fetch_put_there(project: Project) -> None:
    project.run("fetch", "--pin", PIN_B)
    result = project.run("backup", "--pin", PIN_A, code=1)
    assert f"fetched as pin {PIN_B}, not {PIN_A}" in result.output
    project.run("backup")
    status = json.loads(project.run("status", "--json").output)
    assert status["pin"] == PIN_B and f"upstream/{PIN_B}" in status["backup"]


def test_from_dir_is_checked(project: Project, tmp_path: Path) -> None:
    project.prepared()  # project.tree is now a managed (patched-able) tree
    result = project.run("fetch", "--from", str(project.tree), "--tree", str(tmp_path / "t1"), code=1)
    assert "managed by opencoti-patch" in result.output
    result = project.run("fetch", "--from", str(tmp_path), "--tree", str(tmp_path / "t2"), code=1)
    assert "holds) the tree folder" in result.output
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "x.c").write_text("int x;\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    result = project.run("fetch", "--from", str(checkout), "--tree", str(tmp_path / "t3"), code=1)
    assert f"not pin {PIN_A}" in result.output
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.c").write_text("int x;\n")
    result = project.run("fetch", "--from", str(plain), "--tree", str(tmp_path / "t4"))
    assert "cannot be checked" in result.output and (tmp_path / "t4" / "x.c").is_file()


def _killed_mid_apply(project: Project) -> Path:
    two_patches(project)
    project.run("unapply", "1")
    (project.tree / ".git" / "opencoti" / "txn").write_text("x\n")
    project.edit("src/b.h", "int b(void);", "int b(void); // half")
    lock = project.tree / ".git" / "index.lock"
    lock.write_text("")
    return lock


def test_restore_after_kill_9(project: Project) -> None:
    lock = _killed_mid_apply(project)
    out = project.run("restore").output
    assert f"removed {lock}" in out and not lock.exists()
    assert "refusing" not in out and "interrupted.patch" in out  # saved, not taken for user work


def test_apply_after_kill_9(project: Project) -> None:
    lock = _killed_mid_apply(project)
    project.run("apply")
    assert not lock.exists()
    project.run("snapshot", "--check")


def test_a_foreign_index_lock_is_named(project: Project) -> None:
    two_patches(project)
    lock = project.tree / ".git" / "index.lock"
    lock.write_text("")
    for args in (["unapply", "1"], ["apply"], ["restore"]):
        result = project.run(*args, code=1)
        assert str(lock) in result.output and "delete" in result.output, args
    assert lock.exists()  # not ours to remove: no opencoti-patch run was interrupted


def test_markers_checks_the_default_tree_and_exits_4(project: Project) -> None:
    two_patches(project)
    result = project.run("markers", code=4)  # the patches carry unmarked changes
    assert f"(tree {project.tree})" in result.output and "unmarked" in result.output


def test_context_mismatch_shows_the_whole_lines(project: Project) -> None:
    project.prepared()
    long_tail = " // " + "x" * 90
    project.edit("src/a.c", "int line_21 = 21;", "int line_21 = 21;" + long_tail + "A")
    project.run("snapshot", "--new", "long", "--subject", "a long line")
    _write_patch(project, "0002-long.patch",
                 _hunk(20).replace(" int line_21 = 21;", " int line_21 = 21;" + long_tail + "B"))
    out = project.run("apply", code=3).output
    assert f"expected 'int line_21 = 21;{long_tail}B', found 'int line_21 = 21;{long_tail}A'" in out
    assert "differ from column 112" in out


def test_recovery_commands_keep_the_path_options(project: Project, tmp_path: Path) -> None:
    work = tmp_path / "elsewhere"
    project.run("prepare", "--work-dir", str(work))
    _write_patch(project, "0001-fuzz.patch", _hunk(20).replace(" int line_21 = 21;", " int line_21 = 99;"))
    out = project.run("apply", "--work-dir", str(work), code=3).output
    assert f"opencoti-patch restore --work-dir {work}" in out
    assert f"opencoti-patch apply --3way --work-dir {work}" in out


def test_three_way_failure_gives_the_reason_not_git_noise(project: Project) -> None:
    project.prepared()
    body = _hunk(20).replace(" int line_21 = 21;", " int line_21 = 99;")
    _write_patch(project, "0001-foreign.patch", body.replace("diff --git a/src/a.c b/src/a.c\n", INDEX, 1))
    out = project.run("apply", "--3way", code=3).output
    assert "not made against this upstream" in out
    for noise in ("Falling back", "patch failed:", "Checking patch"):
        assert noise not in out


# -- the pin and the stamp: the Tree's pin, a tree that matches patches/ ------------------------------


def test_rebuild_stamps_the_trees_pin_after_a_rebase(project: Project) -> None:
    from opencoti_patch.cli.builds import _pin_and_staleness
    from opencoti_patch.config import Settings

    two_patches(project)
    project.run("rebase", "--to", PIN_B, code=3)
    project.run("rebase", "--skip")  # both upstream/<pin> tags exist now
    tags = subprocess.run(["git", "-C", str(project.tree), "tag"], capture_output=True, text=True).stdout
    assert f"upstream/{PIN_A}" in tags and f"upstream/{PIN_B}" in tags
    pin, stale = _pin_and_staleness(Settings.resolve(), None, None)
    assert pin == PIN_B  # not upstream.toml's default (A)
    assert stale  # 0002 was skipped: the tree does not carry the series until `snapshot`
    project.run("snapshot")
    assert _pin_and_staleness(Settings.resolve(), None, None) == (PIN_B, [])


def test_rebuild_refuses_a_stale_tree_before_building(project: Project) -> None:
    two_patches(project)
    project.edit("src/b.h", "int c(void);", "int c(void); // not captured")
    result = project.run("rebuild", "--no-cuda", code=4)
    assert "stale against" in result.output and "uncaptured edit" in result.output
    result = project.run("rebuild", "--no-cuda", "--pin", PIN_B, code=1)
    assert f"backed up as pin {PIN_A}" in result.output


def test_snapshot_proves_the_round_trip_before_replacing_patches(project: Project,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from opencoti_patch.stack import capture

    two_patches(project)
    before = {p.name: p.read_bytes() for p in project.patches.iterdir()}
    project.edit("src/b.h", "int c(void);", "int c(void);\nint d(void);")
    seen: list[Path] = []

    def failing(tree: object, names: list[str], patches_dir: Path, expected: str) -> capture.RoundTrip:
        seen.append(patches_dir)
        assert {p.name: p.read_bytes() for p in project.patches.iterdir()} == before  # not yet replaced
        return capture.RoundTrip(False, expected, "0" * 40, ["src/b.h"])

    with monkeypatch.context() as m:
        m.setattr(capture, "prove_round_trip", failing)
        result = project.run("snapshot", "--top", code=4)
    assert "was left as it was" in result.output and seen and seen[0] != project.patches
    assert {p.name: p.read_bytes() for p in project.patches.iterdir()} == before
    assert sorted(p.name for p in project.root.iterdir() if p.name.startswith(".patches")) == []
    project.run("snapshot", "--top")
    assert b"int d(void);" in (project.patches / "0002-second.patch").read_bytes()
    project.run("snapshot", "--check")


def test_markers_fix_rebuild_and_verify_identical_take_the_lock(project: Project) -> None:
    from opencoti_patch.config import Settings
    from opencoti_patch.stack.tree import tree_lock

    two_patches(project)
    with tree_lock(Settings.resolve()):
        for args in (["markers", "--fix", "--tree", str(project.tree)], ["rebuild", "--no-cuda"],
                     ["verify-identical", "--no-cuda", "--skip-repro"]):
            result = project.run(*args, code=5)
            assert "another opencoti-patch run" in result.output, args


def test_verify_identical_applies_patch_files_with_the_stacks_applier(tmp_path: Path) -> None:
    """--patch-file diffs go through git apply (exact), even from a work folder inside a git repo."""
    from opencoti_patch.verify import identical as ident

    outer = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(outer)], check=True)  # an enclosing repository
    tree = tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "a.c").write_text("int a;\nint b;\n")
    diff = tmp_path / "x.patch"
    diff.write_text("diff --git a/src/a.c b/src/a.c\n--- a/src/a.c\n+++ b/src/a.c\n@@ -1,2 +1,2 @@\n"
                    " int a;\n-int b;\n+int c;\n")
    cfg = ident.VerifyConfig(work=outer / "verify", pristine=(tree, None), patched=(tree, None))
    src = ident.prepare_source(cfg, "patched", tree, None, (diff,))
    assert (src / "src" / "a.c").read_text() == "int a;\nint c;\n"
    stale = tmp_path / "stale.patch"
    stale.write_text(diff.read_text().replace(" int a;", " int z;"))
    with pytest.raises(OpencotiError, match="does not apply"):
        ident.prepare_source(cfg, "again", tree, None, (stale,))


def test_one_harness_builder_configures_reproducibly(tmp_path: Path) -> None:
    from opencoti_patch.builds import builder as b
    from opencoti_patch.builds import harness

    opts = b.BuildOptions(ccache=False)
    args = harness.harness_args(tmp_path / "src", tmp_path / "bin", tmp_path / "h", opts)
    assert "-G" in args and "Ninja" in args
    assert f"-DCMAKE_CXX_FLAGS=-ffile-prefix-map={tmp_path / 'src'}=." in args
    assert not any("LAUNCHER" in a for a in args)
    assert (harness.SHIPPED_HARNESS / "opencoti-harness.cpp").is_file()
    from opencoti_patch.lab.batch import LAB_HARNESS

    lab = harness.harness_args(tmp_path / "src", tmp_path / "bin", tmp_path / "h", opts, LAB_HARNESS)
    assert lab[lab.index("-S") + 1] == str(LAB_HARNESS)
    assert (LAB_HARNESS / "opencoti-harness-batch.cpp").is_file()


def test_eval_path_defaults_come_from_settings(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from opencoti_patch.cli import cli

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    work, tree = tmp_path / "w", tmp_path / "t"
    (tree / "docs").mkdir(parents=True)
    res = CliRunner().invoke(cli, ["eval", "fidelity", "--model", str(model), "--work-dir", str(work),
                                   "--tree", str(tree)])
    assert res.exit_code == 1 and f"no llama.cpp build at {work / 'build' / 'cpu' / 'build'}" in res.output
    (tree / "docs").rmdir()
    res = CliRunner().invoke(cli, ["eval", "fidelity", "--model", str(model), "--tree", str(tree)])
    assert res.exit_code == 1 and f"no docs folder {tree / 'docs'}" in res.output


def test_eval_gate_results_merge_below_the_cli(tmp_path: Path) -> None:
    """The merging of gates run separately lives in lab/evaluate (the CLI only calls it)."""
    import json as _json

    from opencoti_patch.lab import gate_report

    gate_report.save_gate_results(tmp_path, "q", {"other": 1}, {"cli": ["a"], "harness_commands": ["x"]})
    md, js = gate_report.save_gate_results(tmp_path, "q", {}, {"cli": ["b"], "harness_commands": ["y"]})
    meta = _json.loads(js.read_text())["meta"]
    assert meta["cli"] == ["a", "b"] and meta["harness_commands"] == ["x", "y"]
    assert md.is_file() and _json.loads(js.read_text())["other"] == 1


def test_the_lexers_scanner_core() -> None:
    from opencoti_patch.markers.lexers import skip_open

    assert skip_open('a\\"b" x', 0, '"') == (5, True)  # an escaped quote does not close
    assert skip_open('a\\"b', 0, '"', escapes=False) == (3, True)  # raw: the backslash is text
    assert skip_open("x ]==] y", 0, "]==]") == (6, True)
    assert skip_open("no end", 0, "*/") == (6, False)


# -- review of those bugs: Tree owns the fetch record, the rev's staleness, one applier -------------------


def test_the_tree_owns_the_fetch_record(project: Project) -> None:
    from opencoti_patch.config import Settings
    from opencoti_patch.stack.tree import Tree
    from opencoti_patch.stack.upstream import load_upstream

    settings = Settings.resolve()
    tree = Tree(settings)
    project.run("fetch", "--pin", PIN_B)
    assert tree.fetch_record == project.tree.parent / f".{project.tree.name}.fetched.json"
    assert json.loads(tree.fetch_record.read_text())["pin"] == PIN_B
    assert tree.fetched_pin(load_upstream(settings.upstream_file)).name == PIN_B
    with pytest.raises(OpencotiError, match=f"fetched as pin {PIN_B}"):
        tree.fetched_pin(load_upstream(settings.upstream_file), PIN_A)


def test_rebase_leaves_no_fetch_record_of_its_scratch_import(project: Project) -> None:
    two_patches(project)
    project.run("rebase", "--to", PIN_B, code=3)
    project.run("rebase", "--abort")
    hidden = sorted(p.name for p in project.tree.parent.iterdir() if p.name.startswith("."))
    assert hidden == [f".{project.tree.name}.fetched.json", f".{project.tree.name}.lock"], hidden


def test_rebuild_rev_is_checked_against_the_series_too(project: Project) -> None:
    """`rebuild --rev REV` builds that commit: it must carry exactly the series of patches/."""
    from opencoti_patch.cli.builds import _pin_and_staleness
    from opencoti_patch.config import Settings

    two_patches(project)
    project.edit("src/b.h", "int c(void);", "int c(void); // not captured")  # not in the commit built
    assert _pin_and_staleness(Settings.resolve(), None, "HEAD") == (PIN_A, [])
    assert _pin_and_staleness(Settings.resolve(), None, "HEAD~1")[1] == ["0002-second.patch: not applied"]
    stale = _pin_and_staleness(Settings.resolve(), None, f"upstream/{PIN_A}")[1]
    assert stale == ["0001-first.patch: not applied", "0002-second.patch: not applied"]
    result = project.run("rebuild", "--no-cuda", "--rev", "HEAD~1", code=4)
    assert "stale against" in result.output and "0002-second.patch: not applied" in result.output
    patch = project.patches / "0002-second.patch"
    patch.write_bytes(patch.read_bytes().replace(b"second: edit a and b", b"second: edited since"))
    assert _pin_and_staleness(Settings.resolve(), None, "HEAD")[1] == [
        "0002-second.patch: file changed since applied"]
    result = project.run("rebuild", "--no-cuda", "--rev", "nosuchrev", code=1)
    assert "--rev nosuchrev: no such commit" in result.output


def test_a_failing_git_source_names_gits_reason(project: Project, tmp_path: Path) -> None:
    """upstream's git runs through the one isolated runner (stack/gitrun): its error is git's last line
    (it was printed as a Python list: "failed: ['fatal: ...']")."""
    toml = project.patches / "upstream.toml"
    toml.write_text(toml.read_text() + f'\n[pins.ggg]\ncommit = "abc1234"\n\n[[pins.ggg.sources]]\n'
                    f'kind = "git"\nurl = "{tmp_path / "no-such-repo"}"\ncommit = "abc1234"\n')
    out = project.run("fetch", "--pin", "ggg", code=1).output
    assert "git clone --quiet --no-checkout failed" in out and "fatal:" in out and "['" not in out, out
    assert not project.tree.exists()


def test_markers_takes_the_default_tree_only_when_it_carries_the_series(project: Project) -> None:
    """The same test as `rebuild`'s: a patch file changed since it was applied means the tree does not
    carry it (markers used the tree anyway and reported its hunks as not matching)."""
    two_patches(project)
    patch = project.patches / "0002-second.patch"
    patch.write_bytes(patch.read_bytes().replace(b"+int line_38 = 3838; // opencoti", b"+int line_38 = 39;"))
    out = project.run("markers").output  # unmarked changes a hunk alone cannot judge: warnings
    assert "no tree carrying the whole series" in out and "does not match the tree" not in out, out
    assert "patches only" in out

"""UPSTREAM_SYNC marker audit and --fix, on synthetic patches and trees."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from opencoti_patch.cli import cli
from opencoti_patch.markers.audit import AuditReport, audit
from opencoti_patch.markers.fix import fix_lines, fix_tree
from opencoti_patch.markers.lexers import unsafe_insert_points
from opencoti_patch.markers.syntax import scan_markers
from opencoti_patch.stack.series import load_series

F = "sparse-attn"
B = f"// UPSTREAM_SYNC({F}): begin"
E = f"// UPSTREAM_SYNC({F}): end"

UPSTREAM_C = [f"int f{i}(void) {{ return {i}; }}" for i in range(1, 21)]   # 20 upstream lines


def _diff(path: str, old: list[str] | None, new: list[str] | None) -> str:
    a = "/dev/null" if old is None else f"a/{path}"
    b = "/dev/null" if new is None else f"b/{path}"
    body = list(difflib.unified_diff(old or [], new or [], a, b, lineterm=""))
    head = [f"diff --git a/{path} b/{path}"]
    if old is None:
        head.append("new file mode 100644")
    if new is None:
        head.append("deleted file mode 100644")
    return "\n".join(head + body) + "\n"


def _patch_text(subject: str, feature: str | None, diffs: str) -> str:
    head = ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            "From: Test <test@example.com>\n"
            f"Subject: [PATCH] {subject}\n\nA test patch.\n\n")
    if feature is not None:
        head += f"Feature: {feature} (--{feature}, default off)\n"
    return head + "---\n" + diffs + "-- \n2.39.2\n"


class Series:
    """A patches/ dir + a tree (the upstream files with the whole series applied)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.patches = root / "patches"
        self.tree = root / "tree"
        self.patches.mkdir(parents=True)
        self.tree.mkdir(parents=True)
        self.names: list[str] = []

    def add(self, slug: str, files: dict[str, tuple[list[str] | None, list[str] | None]],
            feature: str | None = F) -> str:
        name = f"{len(self.names) + 1:04d}-{slug}.patch"
        diffs = "".join(_diff(p, old, new) for p, (old, new) in files.items())
        (self.patches / name).write_text(_patch_text(slug, feature, diffs))
        self.names.append(name)
        (self.patches / "series").write_text("".join(n + "\n" for n in self.names))
        for p, (_, new) in files.items():
            target = self.tree / p
            if new is None:
                target.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text("\n".join(new) + "\n")
        return name

    def audit(self, tree: bool = True) -> AuditReport:
        return audit(load_series(self.patches), self.tree if tree else None)

    def read(self, path: str) -> list[str]:
        return (self.tree / path).read_text().split("\n")[:-1]


@pytest.fixture
def series(tmp_path: Path) -> Series:
    return Series(tmp_path)


def kinds(report: AuditReport) -> list[str]:
    return [i.kind for i in report.issues]


def edit(lines: list[str], at: int, insert: list[str], remove: int = 0) -> list[str]:
    """Replace `remove` lines from 1-based line `at` with `insert`."""
    return lines[:at - 1] + insert + lines[at - 1 + remove:]


# ------------------------------------------------------------------ audit


@pytest.mark.parametrize("tree", [True, False])
def test_marked_change_passes_and_is_listed(series: Series, tree: bool) -> None:
    new = edit(UPSTREAM_C, 10, [B, "int sparse(void);", E])
    name = series.add("api", {"src/a.c": (UPSTREAM_C, new)})
    report = series.audit(tree)
    assert report.ok and report.issues == []
    [region] = report.regions
    assert (region.path, region.begin, region.end, region.feature) == ("src/a.c", 10, 12, F)
    assert region.patches == (name,)


def test_unmarked_change_fails(series: Series) -> None:
    new = edit(UPSTREAM_C, 5, ["int f5(void) { return 55; }"], remove=1)
    name = series.add("api", {"src/a.c": (UPSTREAM_C, new)})
    report = series.audit()
    assert not report.ok
    assert [str(i) for i in report.errors] == [f"src/a.c:5: unmarked change (patch {name})"]
    # from the hunk alone a region might enclose the whole hunk: a warning, not a pass
    hunks_only = series.audit(tree=False)
    assert [(i.kind, i.line, i.severity) for i in hunks_only.issues] == [("unverified", 5, "warning")]


def test_hunk_only_mode_sees_an_end_above(series: Series) -> None:
    new = edit(UPSTREAM_C, 5, [B, "int a;", E, "int b;"])
    name = series.add("api", {"src/a.c": (UPSTREAM_C, new)})
    report = series.audit(tree=False)
    assert [str(i) for i in report.errors] == [f"src/a.c:8: unmarked change (patch {name})"]


def test_change_just_outside_a_region(series: Series) -> None:
    new = edit(UPSTREAM_C, 10, [B, "int sparse(void);", E, "int outside(void);"])
    series.add("api", {"src/a.c": (UPSTREAM_C, new)})
    report = series.audit()
    assert [(i.kind, i.line) for i in report.issues] == [("unmarked", 13)]
    # just before the begin, too
    new2 = edit(UPSTREAM_C, 10, ["int before(void);", B, "int sparse(void);", E])
    s2 = Series(series.root / "b")
    s2.add("api", {"src/a.c": (UPSTREAM_C, new2)})
    assert [(i.kind, i.line) for i in s2.audit().issues] == [("unmarked", 10)]


@pytest.mark.parametrize("tree", [True, False])
def test_new_file_marker(series: Series, tree: bool) -> None:
    series.add("files", {
        "src/ok.cpp": (None, [f"// UPSTREAM_SYNC({F}): file", "int x;"]),
        "src/pragma.h": (None, ["#pragma once", "", f"// UPSTREAM_SYNC({F}): file", "int y;"]),
        "src/missing.cpp": (None, ["int z;"]),
        "src/late.cpp": (None, ["a", "b", "c", "d", "e", f"// UPSTREAM_SYNC({F}): file"]),
        "src/other.cpp": (None, ["// UPSTREAM_SYNC(other): file", "int w;"]),
    })
    report = series.audit(tree)
    got = sorted((i.path, i.kind) for i in report.issues)
    assert got == [("src/late.cpp", "missing-file-marker"), ("src/missing.cpp", "missing-file-marker"),
                   ("src/other.cpp", "feature-mismatch")]


def test_fork_file_changed_by_later_patch_needs_no_region(series: Series) -> None:
    first = [f"// UPSTREAM_SYNC({F}): file", "int x;"]
    series.add("new", {"src/n.cpp": (None, first)})
    series.add("more", {"src/n.cpp": (first, first + ["int more;"])})
    assert series.audit().ok


def test_begin_without_end_and_nested(series: Series) -> None:
    new = edit(UPSTREAM_C, 3, [B, "int a;"])
    new = edit(new, 12, [B, "int b;", E])
    series.add("api", {"src/a.c": (UPSTREAM_C, new)})
    report = series.audit()
    assert "nested-marker" in kinds(report)
    assert not report.ok
    s2 = Series(series.root / "b")
    s2.add("api", {"src/a.c": (UPSTREAM_C, edit(UPSTREAM_C, 3, [B, "int a;"]))})
    assert kinds(s2.audit()) == ["unmatched-begin"]
    s3 = Series(series.root / "c")
    s3.add("api", {"src/a.c": (UPSTREAM_C, edit(UPSTREAM_C, 3, ["int a;", E]))})
    assert "unmatched-end" in kinds(s3.audit())


def test_feature_mismatch(series: Series) -> None:
    other_b, other_e = B.replace(F, "other"), E.replace(F, "other")
    new = edit(UPSTREAM_C, 4, [other_b, "int a;", other_e])
    name = series.add("api", {"src/a.c": (UPSTREAM_C, new)})
    report = series.audit()
    [issue] = report.issues
    assert issue.kind == "feature-mismatch" and issue.patch == name and issue.line == 5
    # begin and end naming different features
    s2 = Series(series.root / "b")
    s2.add("api", {"src/a.c": (UPSTREAM_C, edit(UPSTREAM_C, 4, [B, "int a;", other_e]))})
    assert "feature-mismatch" in kinds(s2.audit())


def test_missing_feature_header(series: Series) -> None:
    new = edit(UPSTREAM_C, 4, [B, "int a;", E])
    series.add("api", {"src/a.c": (UPSTREAM_C, new)}, feature=None)
    # series.py gives a patch without Feature: the feature "none (always on)" -> name "none"
    assert kinds(series.audit()) == ["feature-mismatch"]


def test_deletions(series: Series) -> None:
    base = edit(UPSTREAM_C, 10, [B, "int sparse(void);", E])
    series.add("region", {"src/a.c": (UPSTREAM_C, base)})
    # deleting a line inside the region (earlier patch's markers in context): marked
    inside = [ln for ln in base if ln != "int sparse(void);"]
    series.add("del-in", {"src/a.c": (base, inside)})
    assert series.audit().ok
    # deleting an upstream line far from any region: unmarked
    outside = [ln for ln in inside if ln != UPSTREAM_C[2]]
    name = series.add("del-out", {"src/a.c": (inside, outside)})
    report = series.audit()
    assert [(i.kind, i.line, i.message, i.patch) for i in report.issues] == [
        ("unmarked", 3, "unmarked deletion", name)]


def test_deletion_just_after_a_region_end(series: Series) -> None:
    base = edit(UPSTREAM_C, 10, [B, "int sparse(void);", E])
    series.add("region", {"src/a.c": (UPSTREAM_C, base)})
    after = [ln for ln in base if ln != UPSTREAM_C[9]]         # the line right after the end
    series.add("del", {"src/a.c": (base, after)})
    assert [i.kind for i in series.audit().issues] == ["unmarked"]


def test_replacement_marked_with_markers_in_same_hunk(series: Series) -> None:
    # like ggml-rpc.h: "-old" followed by "+begin", "+new", "+end"
    new = edit(UPSTREAM_C, 6, [B, "int f6(void) { return 66; }", E], remove=1)
    series.add("rpc", {"src/a.c": (UPSTREAM_C, new)})
    assert series.audit().ok and series.audit(tree=False).ok
    # pure deletion marked by an empty pair
    new2 = edit(UPSTREAM_C, 6, [B, E], remove=1)
    s2 = Series(series.root / "b")
    s2.add("del", {"src/a.c": (UPSTREAM_C, new2)})
    assert s2.audit().ok and s2.audit(tree=False).ok


def test_hunk_only_mode_cannot_verify_far_markers(series: Series) -> None:
    body = [f"    int v{i};" for i in range(12)]
    new = edit(UPSTREAM_C, 5, [B] + body + [E])
    first = new[:]
    series.add("region", {"src/a.c": (UPSTREAM_C, first)})
    second = edit(first, 12, ["    int extra;"])              # deep inside the long region
    series.add("extra", {"src/a.c": (first, second)})
    hunks_only = series.audit(tree=False)
    assert hunks_only.ok                                      # a warning is not an error
    assert [i.kind for i in hunks_only.warnings] == ["unverified"]
    assert "pass --tree" in hunks_only.warnings[0].message
    exact = series.audit(tree=True)
    assert exact.ok and exact.issues == []
    assert exact.regions[0].patches == ("0001-region.patch", "0002-extra.patch")


def test_later_patch_overlapping_earlier_hunk(series: Series) -> None:
    one = edit(UPSTREAM_C, 10, [B, "int a;", E])
    series.add("one", {"src/a.c": (UPSTREAM_C, one)})
    two = edit(one, 13, ["int unmarked;"])                     # right after patch one's region
    name = series.add("two", {"src/a.c": (one, two)})
    report = series.audit()
    assert [(i.line, i.patch) for i in report.issues] == [(13, name)]


def test_upstream_file_deleted_renamed_binary(series: Series) -> None:
    diffs = _diff("src/gone.c", ["x"], None)
    diffs += ("diff --git a/src/old.c b/src/new.c\nsimilarity index 100%\n"
              "rename from src/old.c\nrename to src/new.c\n")
    diffs += ("diff --git a/img.png b/img.png\nindex 1111111..2222222 100644\n"
              "Binary files a/img.png and b/img.png differ\n")
    (series.patches / "0001-x.patch").write_text(_patch_text("x", F, diffs))
    (series.patches / "series").write_text("0001-x.patch\n")
    (series.tree / "src").mkdir()
    (series.tree / "src/new.c").write_text("int a;\n")
    assert sorted(kinds(series.audit())) == ["binary-upstream", "deleted-upstream", "renamed-upstream"]


def test_no_newline_at_end_of_file(series: Series) -> None:
    diff = ("diff --git a/src/a.c b/src/a.c\n--- a/src/a.c\n+++ b/src/a.c\n@@ -1,2 +1,4 @@\n"
            " int a;\n-int b;\n\\ No newline at end of file\n"
            f"+{B}\n+int b2;\n+{E}\n\\ No newline at end of file\n")
    (series.patches / "0001-x.patch").write_text(_patch_text("x", F, diff))
    (series.patches / "series").write_text("0001-x.patch\n")
    (series.tree / "src").mkdir()
    (series.tree / "src/a.c").write_text(f"int a;\n{B}\nint b2;\n{E}")
    assert series.audit().ok and series.audit(tree=False).ok


def test_scan_markers_other_comment_syntaxes() -> None:
    scan = scan_markers(["# UPSTREAM_SYNC(x): begin", "a", "  # UPSTREAM_SYNC(x): end",
                         "/* UPSTREAM_SYNC(y): begin */", "b", "/* UPSTREAM_SYNC(y): end */",
                         "foo(); // UPSTREAM_SYNC(z): begin"])
    assert scan.regions == [(1, 3, "x"), (4, 6, "y")]
    assert [k for _, k, _ in scan.errors] == ["malformed-marker"]


# ------------------------------------------------------------------ fix


def test_fix_cpp_wraps_with_indentation_and_is_idempotent(series: Series) -> None:
    up = ["void f() {", "    int a = 1;", "    if (a) {", "        g(a);", "    }", "}"]
    new = edit(up, 4, ["        h(a);", "        k(a);"])
    series.add("cpp", {"src/f.cpp": (up, new)})
    patches = load_series(series.patches)
    result = fix_tree(series.tree, patches)
    assert result.ok and not result.refused
    assert series.read("src/f.cpp") == up[:3] + [
        "        // UPSTREAM_SYNC(sparse-attn): begin", "        h(a);", "        k(a);",
        "        // UPSTREAM_SYNC(sparse-attn): end"] + up[3:]
    assert [c.action for c in result.changes] == ["inserted", "inserted"]
    again = fix_tree(series.tree, patches)
    assert again.changes == [] and again.ok
    assert series.read("src/f.cpp")[3] == "        // UPSTREAM_SYNC(sparse-attn): begin"


def test_fix_extends_and_merges_adjacent_regions() -> None:
    lines = ["a", B, "b", E, "c", "d", B, "e", E, "f"]
    out, changes, refused = fix_lines("x.c", lines, {5: F, 6: F})   # c, d between the regions
    assert refused == []
    assert out == ["a", B, "b", "c", "d", "e", E, "f"]
    assert [c.action for c in changes] == ["removed", "removed"]
    # a run right after a region moves its end marker down
    out2, _, _ = fix_lines("x.c", ["a", B, "b", E, "c", "z"], {5: F})
    assert out2 == ["a", B, "b", "c", E, "z"]
    # and right before one moves its begin up
    out3, _, _ = fix_lines("x.c", ["z", "c", B, "b", E], {2: F})
    assert out3 == ["z", B, "c", "b", E]
    # twice changes nothing
    assert fix_lines("x.c", out3, {2: F}) == (out3, [], [])


def test_fix_cmake_and_python(series: Series) -> None:
    cm = ["cmake_minimum_required(VERSION 3.14)", "project(x)", "add_library(x a.c)"]
    py = ["import os", "", "def f():", "    return 1"]
    series.add("cm", {
        "CMakeLists.txt": (cm, edit(cm, 3, ["add_library(y y.c)"])),
        "tools/t.py": (py, edit(py, 4, ["    x = 2"])),
    })
    result = fix_tree(series.tree, load_series(series.patches))
    assert result.ok, result.refused
    assert series.read("CMakeLists.txt")[2:5] == [
        f"# UPSTREAM_SYNC({F}): begin", "add_library(y y.c)", f"# UPSTREAM_SYNC({F}): end"]
    assert series.read("tools/t.py")[3:6] == [
        f"    # UPSTREAM_SYNC({F}): begin", "    x = 2", f"    # UPSTREAM_SYNC({F}): end"]
    assert fix_tree(series.tree, load_series(series.patches)).changes == []


def test_fix_deletion_inserts_empty_pair(series: Series) -> None:
    new = [ln for ln in UPSTREAM_C if ln != UPSTREAM_C[4]]
    series.add("del", {"src/a.c": (UPSTREAM_C, new)})
    patches = load_series(series.patches)
    result = fix_tree(series.tree, patches)
    assert result.ok, result
    assert series.read("src/a.c")[3:7] == [UPSTREAM_C[3], B, E, UPSTREAM_C[5]]
    assert fix_tree(series.tree, patches).changes == []


def test_fix_new_file_marker(series: Series) -> None:
    series.add("new", {"scripts/run.sh": (None, ["#!/bin/sh", "echo hi"]),
                       "src/n.cuh": (None, ["#pragma once", "int x;"])})
    result = fix_tree(series.tree, load_series(series.patches))
    assert result.ok
    assert series.read("scripts/run.sh")[:2] == ["#!/bin/sh", f"# UPSTREAM_SYNC({F}): file"]
    assert series.read("src/n.cuh")[0] == f"// UPSTREAM_SYNC({F}): file"


@pytest.mark.parametrize(("lines", "line", "why"), [
    (['const char * s = R"(', "text", "more", ')";'], 3, "raw string"),
    (['const char * s = "abc\\', "def", 'ghi";'], 2, "string literal"),
    (["#define M(x) \\", "    do_a(x); \\", "    do_b(x)"], 2, "macro"),
    (["/* a comment", "   still", "   end */"], 2, "C comment"),
    (["int a = b + \\", "    c;"], 2, "line continuation"),
])
def test_fix_refuses_where_a_comment_cannot_go(lines: list[str], line: int, why: str) -> None:
    out, changes, refused = fix_lines("x.cpp", lines, {line: F})
    assert out == lines and changes == []
    [issue] = refused
    assert issue.line == line and why in issue.message
    assert str(issue).startswith(f"x.cpp:{line}: cannot place a marker here")


def test_fix_refuses_unknown_file_type() -> None:
    out, changes, refused = fix_lines("README.md", ["a", "b"], {2: F})
    assert out == ["a", "b"] and "unknown file type" in refused[0].message


def test_unsafe_points_other_languages() -> None:
    assert unsafe_insert_points("a.py", ['x = """', "doc", '"""', "y = 1"]) == {
        2: "inside a string literal (triple-quoted)", 3: "inside a string literal (triple-quoted)"}
    assert unsafe_insert_points("CMakeLists.txt", ["set(X [[", "a", "]])", "#[[ c", "]]"]) == {
        2: "inside a bracket argument", 3: "inside a bracket argument", 5: "inside a bracket comment"}
    assert 2 in unsafe_insert_points("a.sh", ["cat <<EOF", "x", "EOF", "echo"])
    assert 4 not in unsafe_insert_points("a.sh", ["cat <<EOF", "x", "EOF", "echo"])
    assert set(unsafe_insert_points("a.yml", ["run: |", "  a", "  b", "next: 1"])) == {2, 3}
    assert unsafe_insert_points("a.cpp", ["int x = 1'000;", "char c = 'a';", "int y;"]) == {}


# ------------------------------------------------------------------ CLI


def test_cli_exit_codes_and_json(series: Series) -> None:
    runner = CliRunner()
    good = edit(UPSTREAM_C, 10, [B, "int sparse(void);", E])
    series.add("ok", {"src/a.c": (UPSTREAM_C, good)})
    args = ["markers", "--patches-dir", str(series.patches), "--tree", str(series.tree)]
    res = runner.invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "src/a.c" in res.output and "1 marked regions, 0 errors" in res.output
    res = runner.invoke(cli, args + ["--json"])
    data = json.loads(res.output)
    assert data["ok"] is True and data["mode"] == "tree"
    assert data["regions"] == [{"path": "src/a.c", "begin": 10, "end": 12, "feature": F,
                                "patches": ["0001-ok.patch"]}]

    bad = edit(good, 2, ["int unmarked;"])
    series.add("bad", {"src/a.c": (good, bad)})
    res = runner.invoke(cli, args)
    assert res.exit_code == 4  # a failed check, as docs/usage.md says
    assert "src/a.c:2: unmarked change (patch 0002-bad.patch)" in res.output
    data = json.loads(runner.invoke(cli, args + ["--json"]).stdout)
    assert data["ok"] is False and data["issues"][0]["kind"] == "unmarked"

    res = runner.invoke(cli, ["markers", "--patches-dir", str(series.patches), "--fix"])
    assert res.exit_code == 2 and "--fix needs --tree" in res.output
    res = runner.invoke(cli, args + ["--fix"])
    assert res.exit_code == 0, res.output
    assert "src/a.c:2: inserted // UPSTREAM_SYNC(sparse-attn): begin" in res.output
    res = runner.invoke(cli, args + ["--fix"])
    assert res.exit_code == 0 and "inserted" not in res.output

    res = runner.invoke(cli, ["markers", "--patches-dir", str(series.root / "nowhere")])
    assert res.exit_code == 1 and "no patches folder" in res.output


def test_cli_diff_option(series: Series, tmp_path: Path) -> None:
    new = edit(UPSTREAM_C, 10, ["int unmarked;"])
    diff = tmp_path / "wip.diff"
    diff.write_text(_diff("src/a.c", UPSTREAM_C, new))
    (tmp_path / "t" / "src").mkdir(parents=True)
    (tmp_path / "t" / "src" / "a.c").write_text("\n".join(new) + "\n")
    res = CliRunner().invoke(cli, ["markers", "--diff", str(diff), "--feature", F,
                                   "--tree", str(tmp_path / "t")])
    assert res.exit_code == 4 and "src/a.c:10: unmarked change (patch wip.diff)" in res.output
    res = CliRunner().invoke(cli, ["markers", "--diff", str(diff), "--feature", F])
    assert res.exit_code == 0 and "warning: src/a.c:10: cannot verify" in res.output


def test_fix_deletion_after_region_end_and_change_on_last_line(series: Series) -> None:
    base = edit(UPSTREAM_C, 10, [B, "int sparse(void);", E])
    series.add("region", {"src/a.c": (UPSTREAM_C, base)})
    after = [ln for ln in base if ln != UPSTREAM_C[9]]          # right after the end marker
    after = after + ["int last;"]                                # and a new last line
    series.add("del", {"src/a.c": (base, after)})
    patches = load_series(series.patches)
    assert sorted(i.message for i in audit(patches, series.tree).issues) == [
        "unmarked change", "unmarked deletion"]
    result = fix_tree(series.tree, patches)
    assert result.ok, (result.refused, result.report.issues)
    text = series.read("src/a.c")
    assert text[-3:] == [B, "int last;", E]
    assert text[9:14] == [B, "int sparse(void);", E, B, E]
    assert fix_tree(series.tree, patches).changes == []


def test_deletion_at_file_start(series: Series) -> None:
    series.add("del", {"src/a.c": (UPSTREAM_C, UPSTREAM_C[1:])})
    report = series.audit()
    assert [(i.kind, i.line) for i in report.issues] == [("unmarked", 1)]
    assert fix_tree(series.tree, load_series(series.patches)).ok
    assert series.read("src/a.c")[:3] == [B, E, UPSTREAM_C[1]]

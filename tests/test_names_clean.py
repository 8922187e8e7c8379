"""The names check on what git merged cleanly (``names-clean-merge``, markers/resolve.py
``check_added_regions``, run by ``rebase`` after each step): a marked region the patch adds that names
an identifier the old upstream file has, the new one lacks and the new tree has nowhere stops the
rebase as a conflict (listed, ``--continue`` / ``--skip`` / ``--abort``); a name the new tree still has
passes. On tiny synthetic upstreams: A has ``use_kv_cur`` in src/a.c, B (lines added on top, so the
patches no longer apply exactly and git merges them) has not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stackutil import PIN_A, PIN_B, Project, make_sdist, upstream_toml

from opencoti_patch.markers.resolve import check_added_regions
from opencoti_patch.stack.apply import TreeNames

BEGIN, END = "// UPSTREAM_SYNC(sparse-attn): begin", "// UPSTREAM_SYNC(sparse-attn): end"
GONE = "static int use_kv_cur(void) { return 0; } // old upstream\n"
REGION = f"{BEGIN}\nint ours = use_kv_cur() ? 0 : fill();\n{END}\n"
FIXED = f"{BEGIN}\nint ours = fill();\n{END}\n"


def upstreams(p: Project, tmp_path: Path, b_header: str = "", a_header: str = "") -> Project:
    """A's src/a.c gets a line naming ``use_kv_cur`` (after line 30); B's has no such line; with
    ``b_header`` B's src/b.h gets that line (the name is elsewhere in the new tree), with ``a_header``
    A's src/b.h does (an API of the old upstream)."""
    a = tmp_path / "src-a" / "src" / "a.c"
    a.write_text(a.read_text().replace("int line_30 = 30;\n", "int line_30 = 30;\n" + GONE))
    if a_header:
        h = tmp_path / "src-a" / "src" / "b.h"
        h.write_text(h.read_text() + a_header)
    if b_header:
        b = tmp_path / "src-b" / "src" / "b.h"
        b.write_text(b.read_text() + b_header)
    sha_a = make_sdist(tmp_path / "src-a", p.sdist_a)
    sha_b = make_sdist(tmp_path / "src-b", p.sdist_b, top="pkg-2.0")
    pins = {PIN_A: (p.sdist_a, sha_a), PIN_B: (p.sdist_b, sha_b)}
    (p.patches / "upstream.toml").write_text(upstream_toml(pins, PIN_A))
    p.sha_a, p.sha_b = sha_a, sha_b
    return p.prepared()


def region_patch(p: Project) -> None:
    p.edit("src/a.c", "int line_10 = 10;\n", "int line_10 = 10;\n" + REGION)
    p.run("snapshot", "--new", "region", "--feature", "sparse-attn")


def rebase_json(p: Project, *args: str, code: int) -> dict:
    out = p.run("rebase", *args, "--json", code=code).stdout
    return json.loads(out[out.index("{"):])


@pytest.fixture
def named(project: Project, tmp_path: Path) -> Project:
    return upstreams(project, tmp_path)


# -- the check on its own ------------------------------------------------------------------------


OLD = "int kept;\nint use_kv_cur;\n"
NEW = "int kept;\n"


def flagged(text: str, added: list[int], known: set[str] | None = None, old_headers: set[str] | None = None,
            old: str | None = OLD, new: str | None = NEW) -> list[dict]:
    return check_added_regions("f.c", text, added, old, new, lambda names: set(names) & (known or set()),
                               lambda names: set(names) & (old_headers or set()))


def test_a_region_naming_what_upstream_removed_is_flagged_with_its_span_and_names() -> None:
    text = f"int kept;\n{BEGIN}\nif (!use_kv_cur) {{\n    fill();\n}}\n{END}\nint after;"
    (hit,) = flagged(text, [2, 3, 4, 5, 6])
    assert (hit["file"], hit["lines"], hit["names"], hit["rule"]) == ("f.c", "2-6", ["use_kv_cur"],
                                                                      "names-clean-merge")
    assert "'use_kv_cur'" in hit["why"] and "a port" in hit["why"]


def test_what_the_check_does_not_flag() -> None:
    text = f"int kept;\n{BEGIN}\nif (!use_kv_cur) fill();\n{END}\nint use_kv_cur_too = use_kv_cur;"
    assert not flagged(text, [2, 3, 4], known={"use_kv_cur"})  # the new tree still has it somewhere
    assert not flagged(text, [5])                               # added, but outside any marked region
    assert not flagged(text, [1])                               # a region the step did not add to
    assert not flagged(text, [2, 3, 4], old=None)               # no old upstream file: nothing was lost
    quoted = f"{BEGIN}\n// was use_kv_cur\nlog(\"use_kv_cur\");\n{END}"
    assert not flagged(quoted, [1, 2, 3, 4])                    # comments and strings do not count


def test_a_fork_only_file_is_checked_against_the_old_upstream_headers() -> None:
    text = "// UPSTREAM_SYNC(sparse-attn): file\nint f() { return ggml_prec_set_acc(fa, 1); }\n"
    hits = flagged(text, [1, 2], known={"int", "return"}, old_headers={"int", "return", "ggml_prec_set_acc"},
                   old=None, new=None)
    assert [(h["lines"], h["names"]) for h in hits] == [("1-2", ["ggml_prec_set_acc"])]
    # our own new names (neither tree has them) and what the new tree has are not flagged
    assert not flagged(text, [1, 2], known={"int", "return", "ggml_prec_set_acc"},
                       old_headers={"ggml_prec_set_acc"}, old=None, new=None)


# -- through rebase ------------------------------------------------------------------------------


def test_clean_merge_naming_a_removed_identifier_stops_the_rebase_and_lists_it(named: Project) -> None:
    region_patch(named)
    data = rebase_json(named, "--to", PIN_B, code=3)
    (outcome,) = data["outcomes"]
    assert data["pending"] and outcome["status"] == "conflicted" and outcome["files"] == ["src/a.c"]
    assert "merged" in outcome["detail"] and "names-clean-merge" in outcome["detail"]
    (hit,) = outcome["left"]
    assert (hit["file"], hit["names"], hit["rule"]) == ("src/a.c", ["use_kv_cur"], "names-clean-merge")
    lines = (named.tree / "src" / "a.c").read_text().split("\n")
    first, last = map(int, hit["lines"].split("-"))
    assert lines[first - 1:last] == REGION.strip("\n").split("\n")  # git's merge, staged in the tree
    status = named.run("status").stdout
    assert "0001-region.patch conflicted in src/a.c (names-clean-merge" in status
    # status lists each region the names check stopped at, as the rebase did
    assert (f"          left src/a.c:{first}-{last} (names-clean-merge): our region names 'use_kv_cur'"
            in status) and "port each region listed" in status
    assert json.loads(named.run("status", "--json").stdout)["rebase"]["left"] == outcome["left"]
    named.run("rebase", "--abort")
    out = named.run("rebase", "--to", PIN_B, code=3).stdout
    assert f"left          src/a.c:{first}-{last} (names-clean-merge): our region names 'use_kv_cur'" in out
    assert "check each region" in out and "rebase --continue" in out
    # --skip drops the patch like any conflicted one
    out = named.run("rebase", "--skip").stdout
    assert "skipped    0001-region.patch" in out


def test_a_removed_identifier_the_new_tree_still_has_passes(project: Project, tmp_path: Path) -> None:
    p = upstreams(project, tmp_path, b_header="int use_kv_cur(void);\n")
    region_patch(p)
    data = rebase_json(p, "--to", PIN_B, code=0)
    (outcome,) = data["outcomes"]
    assert not data["pending"] and outcome["status"] == "merged" and not outcome["left"]


def test_continue_after_fixing_the_flagged_region(named: Project) -> None:
    region_patch(named)
    named.run("rebase", "--to", PIN_B, code=3)
    named.edit("src/a.c", REGION, FIXED)
    data = rebase_json(named, "--continue", code=0)
    (outcome,) = data["outcomes"]
    assert not data["pending"] and outcome["status"] == "resolved"
    assert [h["names"] for h in outcome["left"]] == [["use_kv_cur"]]  # the record of what was flagged
    named.run("snapshot")
    assert "+int ours = fill();" in (named.patches / "0001-region.patch").read_text()


def test_continue_takes_the_region_as_it_stands_when_judged_right(named: Project) -> None:
    region_patch(named)
    named.run("rebase", "--to", PIN_B, code=3)
    assert not rebase_json(named, "--continue", code=0)["pending"]
    assert "use_kv_cur() ? 0 : fill()" in (named.tree / "src" / "a.c").read_text()


@pytest.mark.parametrize("one_by_one", [8, 0])  # git grep per name, or every word of the tree at once
def test_fork_only_file_applied_exactly_is_checked_against_old_headers(
        project: Project, tmp_path: Path, one_by_one: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new file names ``use_kv_cur``, declared in A's src/b.h (an old upstream API), nowhere in B: the
    patch applies exactly and still stops. ``static`` and ``return`` are gone from B too, but A had
    them only in a .c (what a new file cannot include): they do not count."""
    monkeypatch.setattr(TreeNames, "ONE_BY_ONE", one_by_one)
    p = upstreams(project, tmp_path, a_header="int use_kv_cur(void);\n")
    (p.tree / "src" / "sparse.c").write_text("// UPSTREAM_SYNC(sparse-attn): file\nint sparse(void);\n"
                                             "static int on(void) { return !use_kv_cur(); }\n")
    p.run("snapshot", "--new", "fork", "--feature", "sparse-attn")
    data = rebase_json(p, "--to", PIN_B, code=3)
    (hit,) = data["outcomes"][0]["left"]
    assert "clean" in data["outcomes"][0]["detail"]
    assert (hit["file"], hit["lines"], hit["names"]) == ("src/sparse.c", "1-3", ["use_kv_cur"])


def test_conflict_resolved_by_hand_is_checked_on_continue(named: Project) -> None:
    """The real case: 0003 conflicted elsewhere and git merged the region beside the conflict; the
    check runs on ``--continue`` (after the person's resolution), stops once, then goes on."""
    named.edit("src/a.c", "int line_10 = 10;\n", "int line_10 = 10;\n" + REGION)
    named.edit("src/a.c", "int line_38 = 38;", "int line_38 = 380; // ours, unmarked")
    named.run("snapshot", "--new", "both")
    data = rebase_json(named, "--to", PIN_B, code=3)
    assert [x.get("rule") for x in data["outcomes"][0]["left"]] == [None]  # the ordinary conflict
    named.resolve_conflict("src/a.c", "int line_38 = 380; // ours, unmarked")
    data = rebase_json(named, "--continue", code=3)
    (hit,) = data["outcomes"][0]["left"]
    assert (hit["file"], hit["names"]) == ("src/a.c", ["use_kv_cur"])
    named.edit("src/a.c", REGION, FIXED)
    data = rebase_json(named, "--continue", code=0)
    assert not data["pending"] and data["outcomes"][0]["status"] == "resolved"


def test_the_why_names_every_name() -> None:
    from opencoti_patch.markers.resolve import names_why

    why = names_why(["a1", "b2", "c3", "d4", "e5"])
    assert "'a1', 'b2', 'c3', 'd4', 'e5'" in why and "more" not in why

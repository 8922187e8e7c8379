"""Marker-aware conflict resolution (markers/resolve.py) on synthetic diff3 conflict texts: each rule
fed the case it must resolve (and where its result must land) and the cases that must stay conflicts;
then through `rebase` on the tiny synthetic upstreams (the report lists every resolved block)."""

from __future__ import annotations

import json

from stackutil import PIN_B, Project

from opencoti_patch.markers.resolve import parse_blocks, recount, resolve_text

BEGIN, END = "// UPSTREAM_SYNC(sparse-attn): begin", "// UPSTREAM_SYNC(sparse-attn): end"


def conflict(ours: list[str], base: list[str], theirs: list[str], before: list[str] | None = None,
             after: list[str] | None = None) -> str:
    return "\n".join([*(before or ["int before;"]), "<<<<<<< ours", *ours, "||||||| base", *base,
                      "=======", *theirs, ">>>>>>> theirs", *(after or ["int after;"]), ""])


def resolved_lines(text: str) -> list[str]:
    result = resolve_text("f.c", text)
    assert not result.left, result.left
    assert "<<<<<<<" not in result.text
    return result.text.split("\n")


def test_region_goes_where_upstream_removed_its_neighbour() -> None:
    """The real 0.3.35 case: upstream dropped the include our region followed."""
    text = conflict([], ['#include "tiled/tiled.h"'],
                    ['#include "tiled/tiled.h"', BEGIN, '#include "sparse-attn.h"', END],
                    before=['#include "common.h"'], after=[""])
    result = resolve_text("ggml-cpu.c", text)
    assert result.text.split("\n") == ['#include "common.h"', BEGIN, '#include "sparse-attn.h"', END, "", ""]
    assert [(r.lines, r.rules) for r in result.resolved] == [("2-4", ["marker-region"])]


def test_region_at_the_end_of_a_list_stays_after_upstream_additions() -> None:
    """The op enum: upstream appended an op where we appended ours; ours must come last (values of
    upstream ops unchanged), not right after the old last op."""
    text = conflict(["    GGML_OP_LIGHTNING_INDEXER,", "    GGML_OP_NEW_UPSTREAM,"],
                    ["    GGML_OP_LIGHTNING_INDEXER,"],
                    ["    GGML_OP_LIGHTNING_INDEXER,", BEGIN, "    GGML_OP_SPARSE_ATTN_FILL,", END],
                    after=["    GGML_OP_COUNT,"])
    lines = resolved_lines(text)
    assert lines[1:6] == ["    GGML_OP_LIGHTNING_INDEXER,", "    GGML_OP_NEW_UPSTREAM,", BEGIN,
                          "    GGML_OP_SPARSE_ATTN_FILL,", END]


def test_region_anchored_before_the_line_that_followed_it() -> None:
    """A region in the middle of the block: before the base line after it, not at the end."""
    text = conflict(['    "LIGHTNING_INDEXER",', '    "NEW",', "};", "", "int x = 1;"],
                    ['    "LIGHTNING_INDEXER",', "};", "", "int x = 0;"],
                    ['    "LIGHTNING_INDEXER",', BEGIN, '    "SPARSE_ATTN_FILL",', END, "};", "",
                     "int x = 0;"])
    lines = resolved_lines(text)
    assert lines[1:8] == ['    "LIGHTNING_INDEXER",', '    "NEW",', BEGIN, '    "SPARSE_ATTN_FILL",', END,
                          "};", ""]
    assert lines[8] == "int x = 1;"  # upstream's own change kept


def test_count_recomputed_from_upstreams_new_number() -> None:
    """Our region replaced `== 101` by `== 103`; upstream moved it to 102: the result is 104 (both
    numbers of the line), not 103 and not 102."""
    text = conflict(['    "NEW",', "};", "", 'static_assert(GGML_OP_COUNT == 102, "GGML_OP_COUNT != 102");'],
                    ["};", "", 'static_assert(GGML_OP_COUNT == 101, "GGML_OP_COUNT != 101");'],
                    [BEGIN, '    "SPARSE_ATTN_FILL",', '    "SPARSE_ATTN_SELECT",', END, "};", "", BEGIN,
                     'static_assert(GGML_OP_COUNT == 103, "GGML_OP_COUNT != 103");', END],
                    before=['    "LIGHTNING_INDEXER",'])
    result = resolve_text("ggml.c", text)
    assert not result.left
    lines = result.text.split("\n")
    assert lines[:8] == ['    "LIGHTNING_INDEXER",', '    "NEW",', BEGIN, '    "SPARSE_ATTN_FILL",',
                         '    "SPARSE_ATTN_SELECT",', END, "};", ""]
    assert lines[8:11] == [BEGIN, 'static_assert(GGML_OP_COUNT == 104, "GGML_OP_COUNT != 104");', END]
    assert result.resolved[0].rules == ["marker-region", "count"]


def test_rpc_header_count_and_version() -> None:
    def rpc(n: int) -> str:
        return (f'static_assert(GGML_OP_COUNT == {n}, '
                '"GGML_OP_COUNT has changed - update RPC_PROTO_PATCH_VERSION");')

    ours = ["#define RPC_PROTO_PATCH_VERSION    0", "", "#ifdef  __cplusplus", rpc(105)]
    base = ["#define RPC_PROTO_PATCH_VERSION    0", "", "#ifdef  __cplusplus", rpc(101)]
    theirs = [BEGIN, "#define RPC_PROTO_PATCH_VERSION    1", "", "#ifdef  __cplusplus", rpc(103)]
    lines = resolved_lines(conflict(ours, base, theirs, after=["#endif", END]))
    assert lines[1:6] == [BEGIN, "#define RPC_PROTO_PATCH_VERSION    1", "", "#ifdef  __cplusplus", rpc(107)]


def test_recount_is_per_number() -> None:
    assert recount("static_assert(X_COUNT == 12, \"!= 12\");", "static_assert(X_COUNT == 10, \"!= 10\");",
                   "static_assert(X_COUNT == 11, \"!= 11\");") == "static_assert(X_COUNT == 13, \"!= 13\");"


def test_unmarked_change_stays_a_conflict() -> None:
    text = conflict(["int a = 2;"], ["int a = 1;"], ["int a = 3;"])
    result = resolve_text("f.c", text)
    assert not result.resolved and len(result.left) == 1
    assert result.text == text and "outside any UPSTREAM_SYNC region" in result.left[0].why


def test_region_replacing_lines_upstream_changed_stays_a_conflict() -> None:
    text = conflict(["call(a, b, c);"], ["call(a, b);"], [BEGIN, "call(a, b, sparse);", END])
    result = resolve_text("f.c", text)
    assert result.text == text and "upstream changed 'call(a, b);'" in result.left[0].why


def test_region_whose_anchors_both_changed_stays_a_conflict() -> None:
    text = conflict(["int x2;", "int y2;"], ["int x;", "int y;"],
                    ["int x;", BEGIN, "int ours;", END, "int y;"])
    result = resolve_text("f.c", text)
    assert result.text == text and "no anchor" in result.left[0].why


def test_unmarked_count_change_outside_known_patterns_stays() -> None:
    text = conflict(["int n = 12;"], ["int n = 10;"], ["int n = 11;"])
    assert resolve_text("f.c", text).left


def test_left_and_resolved_blocks_in_one_file() -> None:
    ok = conflict([], ["int gone;"], ["int gone;", BEGIN, "int ours;", END])
    bad = conflict(["int a = 2;"], ["int a = 1;"], ["int a = 3;"], before=["int mid;"])
    result = resolve_text("f.c", ok + bad)
    assert len(result.resolved) == 1 and len(result.left) == 1
    lines = result.text.split("\n")
    first, last = map(int, result.left[0].lines.split("-"))
    assert lines[first - 1] == "<<<<<<< ours" and lines[last - 1] == ">>>>>>> theirs"
    assert len(parse_blocks(lines)) == 1


def test_region_open_before_the_block() -> None:
    """A region begun in the common text above the block: the changed lines are inside it."""
    text = conflict(["int up = 2;", "int y;"], ["int y;"], ["int ours;", END, "int y;"], before=[BEGIN])
    lines = resolved_lines(text)
    assert lines[:5] == [BEGIN, "int up = 2;", "int ours;", END, "int y;"]


# -- through rebase ------------------------------------------------------------------------------


def test_rebase_auto_resolves_a_marked_region_and_reports_it(project: Project) -> None:
    """Upstream B changed line 38; our marked region right after it conflicts; the rule resolves it
    and the report (text and --json) names file, lines and rule; no conflict remains."""
    project.prepared()
    project.edit("src/a.c", "int line_38 = 38;\n",
                 f"int line_38 = 38;\n{BEGIN}\nint ours = 1;\n{END}\n")
    project.run("snapshot", "--new", "marked", "--feature", "sparse-attn")
    out = project.run("rebase", "--to", PIN_B, "--json").stdout
    data = json.loads(out[out.index("{"):])
    outcome = data["outcomes"][0]
    assert outcome["status"] == "auto-resolved" and not data["pending"]
    assert [(r["file"], r["rules"]) for r in outcome["resolved"]] == [("src/a.c", ["marker-region"])]
    text = (project.tree / "src" / "a.c").read_text()
    assert "int line_38 = 3800; // changed upstream\n" + BEGIN + "\nint ours = 1;\n" + END in text
    assert "<<<<<<<" not in text
    project.run("rebase", "--abort")
    out = project.run("rebase", "--to", PIN_B).stdout
    assert "auto-resolved 0001-marked.patch" in out and "auto-resolved src/a.c:" in out


def test_rebase_no_resolve_leaves_the_conflict(project: Project) -> None:
    project.prepared()
    project.edit("src/a.c", "int line_38 = 38;\n", f"int line_38 = 38;\n{BEGIN}\nint ours = 1;\n{END}\n")
    project.run("snapshot", "--new", "marked", "--feature", "sparse-attn")
    out = project.run("rebase", "--to", PIN_B, "--no-resolve", code=3).stdout
    assert "conflicted 0001-marked.patch" in out


def test_rebase_unmarked_conflict_is_left_for_a_person(project: Project) -> None:
    project.prepared()
    project.edit("src/a.c", "int line_38 = 38;", "int line_38 = 380; // ours, unmarked")
    project.run("snapshot", "--new", "unmarked")
    out = project.run("rebase", "--to", PIN_B, code=3).stdout
    assert "conflicted 0001-unmarked.patch" in out and "left          src/a.c:" in out
    assert "<<<<<<< ours" in (project.tree / "src" / "a.c").read_text()


def test_orphan_region_goes_where_the_deleted_upstream_code_was() -> None:
    """An older upstream lacks the case our region followed: the region takes its place."""
    text = conflict(["    case GGML_OP_A:", "        break;", "    default:"],
                    ["    case GGML_OP_A:", "        break;", "    case GGML_OP_NEWER: {", "        f();",
                     "    } break;", "    default:"],
                    ["    case GGML_OP_A:", "        break;", "    case GGML_OP_NEWER: {", "        f();",
                     "    } break;", BEGIN, "    case GGML_OP_OURS:", "        break;", END, "    default:"])
    result = resolve_text("f.c", text)
    assert not result.left, result.left
    # the nearest anchor rule places it before `default:` (its base neighbour after) already
    assert result.text.split("\n")[1:8] == ["    case GGML_OP_A:", "        break;", BEGIN,
                                            "    case GGML_OP_OURS:", "        break;", END, "    default:"]


def test_orphan_region_when_both_neighbours_are_gone() -> None:
    text = conflict(["int kept2;"],
                    ["int kept;", "void newer(void) {", "}", "void newer2(void) {", "}", "int kept2;"],
                    ["int kept;", "void newer(void) {", "}", BEGIN, "void ours(void);", END,
                     "void newer2(void) {", "}", "int kept2;"])
    result = resolve_text("f.c", text)
    assert not result.left and result.resolved[0].rules == ["marker-region-orphan"]
    assert result.text.split("\n")[1:5] == [BEGIN, "void ours(void);", END, "int kept2;"]


def test_orphan_region_inside_deleted_enclosing_code_stays() -> None:
    """The CMake case: our source sat inside a `set(...)` upstream does not have: a conflict."""
    text = conflict([], ["set(SOURCES", "    a.cpp", "    z.cpp", ")"],
                    ["set(SOURCES", "    a.cpp", "    # UPSTREAM_SYNC(sparse-attn): begin", "    ours.cpp",
                     "    # UPSTREAM_SYNC(sparse-attn): end", "    z.cpp", ")"])
    result = resolve_text("CMakeLists.txt", text)
    assert result.text == text and len(result.left) == 1 and not result.resolved


def test_call_site_our_region_extends_merges_upstreams_edit_of_the_line() -> None:
    """The real 0.3.35 case: upstream's call lost an argument our patch kept; ours appends one."""
    base = "    ggml_tensor * cur = build_attn_mha(q, k, v, kq_b, kq_mask, sinks, v_mla, 0, kq_scale, il);"
    ours = "    ggml_tensor * cur = build_attn_mha(q, k, v, kq_b, kq_mask, sinks, v_mla, kq_scale, il);"
    theirs = ("    ggml_tensor * cur = build_attn_mha(q, k, v, kq_b, kq_mask, sinks, v_mla, 0, kq_scale, il, "
              "sparse_kb);")
    result = resolve_text("llama-graph.cpp", conflict([ours], [base], [BEGIN, theirs, END]))
    assert not result.left, result.left
    merged = ("    ggml_tensor * cur = build_attn_mha(q, k, v, kq_b, kq_mask, sinks, v_mla, kq_scale, il, "
              "sparse_kb);")
    assert result.text.split("\n")[1:4] == [BEGIN, merged, END]
    assert result.resolved[0].rules == ["marker-region-line-merge"]


def test_line_merge_picks_the_edited_line_among_upstream_changes() -> None:
    text = conflict(["int a2;", "call(x2, y, z);", "int c2;"], ["int a;", "call(x, y, z);", "int c;"],
                    ["int a;", BEGIN, "call(x, y, z, w);", END, "int c;"])
    assert resolved_lines(text)[1:6] == ["int a2;", BEGIN, "call(x2, y, z, w);", END, "int c2;"]


def test_line_merge_adjacent_edits_stay_a_conflict() -> None:
    """Upstream dropped the argument our patch appended after: too close to merge blindly."""
    text = conflict(["call(x, y);"], ["call(x, y, z);"], [BEGIN, "call(x, y, z, w);", END])
    result = resolve_text("f.c", text)
    assert result.text == text and "both edit" in result.left[0].why


def test_line_merge_edits_of_the_same_tokens_stay_a_conflict() -> None:
    """Upstream renamed the argument our patch changed: no merge guesses which one wins."""
    text = conflict(["call(a, bb);"], ["call(a, b);"], [BEGIN, "call(a, b2);", END])
    result = resolve_text("f.c", text)
    assert result.text == text and "both edit" in result.left[0].why


def test_line_merge_of_a_region_replacing_several_lines_stays_a_conflict() -> None:
    text = conflict(["f(1);", "g(1);"], ["f();", "g();"], [BEGIN, "f(s);", "g(s);", END])
    result = resolve_text("f.c", text)
    assert result.text == text and result.left


def test_region_naming_what_the_new_upstream_file_lost_stays_a_conflict() -> None:
    """The real 0.3.35 case (llama-context.cpp): our region sits at the right anchor, but its code
    resets ``gf_res_prev_active``, a member the old upstream file has and the new one has not. With the
    two upstream files handed over it is left (a port); a region naming only what both have is not."""
    region = [BEGIN, "    if (mctx && prepare(this)) {", "        gf_res_prev_active = nullptr;", "    }",
              END]
    text = conflict(["    auto * res = gf_res_prev.get();"], ["    auto * res = get_gf_res_prev();"],
                    [*region, "    auto * res = get_gf_res_prev();"])
    old_up = ("llm_graph_result * gf_res_prev_active = nullptr; // old upstream\n"
              "auto * res = get_gf_res_prev();\n")
    new_up = "auto * res = gf_res_prev.get();\nif (mctx && ok) { return; }\n"
    assert resolve_text("llama-context.cpp", text).resolved  # placed by marker-region without the files
    result = resolve_text("llama-context.cpp", text, old_up, new_up)
    assert result.text == text and not result.resolved
    assert "'gf_res_prev_active'" in result.left[0].why and "a port" in result.left[0].why
    # names only in comments or strings of the region, or our own new names, do not count
    region = [BEGIN, "    // was gf_res_prev_active", '    log("gf_res_prev_active");', "    int fresh = 1;",
              END]
    text = conflict(["    auto * res = gf_res_prev.get();"], ["    auto * res = get_gf_res_prev();"],
                    [*region, "    auto * res = get_gf_res_prev();"])
    assert resolve_text("llama-context.cpp", text, old_up + "log(x);\n", new_up + "log(y);\n").resolved


def test_a_name_the_new_file_lost_but_the_new_tree_has_still_counts_as_there() -> None:
    """The 0.3.33 false alarm: fattn.cu there no longer spells ``int32_t``; the tree does (a header)."""
    region = [BEGIN, "    const int32_t n = lost_member;", END]
    text = conflict(["    int b2;"], ["    int b;"], [*region, "    int b;"])
    old_up, new_up = "int32_t x; int lost_member;\nint b;\n", "int b2;\n"
    result = resolve_text("f.c", text, old_up, new_up, known=lambda name: name == "int32_t")
    assert "'lost_member'" in result.left[0].why and "int32_t" not in result.left[0].why
    assert resolve_text("f.c", text, old_up, new_up, known=lambda name: True).resolved


MOVED = """# CMake
<<<<<<< ours
||||||| base
set(CORE_SOURCES
    a.cpp
    b.cpp
)
=======
set(CORE_SOURCES
    a.cpp
    # UPSTREAM_SYNC(sparse-attn): begin
    ours.cpp
    # UPSTREAM_SYNC(sparse-attn): end
    b.cpp
)
>>>>>>> theirs
add_library(core
            a.cpp
            b.cpp
)
"""


def test_region_in_a_list_upstream_moved_goes_where_the_list_now_is() -> None:
    """The real 0.3.35/0.3.33/0.3.32 case: upstream has no set(LLAMA_CORE_SOURCES ...); its sources are
    listed in add_library(llama ...): our source line goes between the same neighbours there."""
    result = resolve_text("CMakeLists.txt", MOVED)
    assert not result.left, result.left
    pad = " " * 12
    assert result.text.split("\n") == ["# CMake", "add_library(core", pad + "a.cpp",
                                       pad + "# UPSTREAM_SYNC(sparse-attn): begin", pad + "ours.cpp",
                                       pad + "# UPSTREAM_SYNC(sparse-attn): end", pad + "b.cpp", ")", ""]
    assert [(r.lines, r.rules) for r in result.resolved] == [("4-6", ["marker-region-moved"])]


def test_moved_neighbours_found_twice_or_apart_stay_a_conflict() -> None:
    twice = MOVED + "add_library(other\n    a.cpp\n    b.cpp\n)\n"
    assert resolve_text("CMakeLists.txt", twice).left
    pad = " " * 12
    apart = MOVED.replace(f"{pad}a.cpp\n{pad}b.cpp", f"{pad}a.cpp\n{pad}x.cpp\n{pad}b.cpp")
    result = resolve_text("CMakeLists.txt", apart)
    assert result.text == apart and result.left

"""The stack's in-memory applier (stack/hunks.py): what `apply` checks and the marker audit undoes."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from opencoti_patch.errors import PatchFailed
from opencoti_patch.stack import hunks as h
from opencoti_patch.stack.apply import apply_to_folder
from opencoti_patch.stack.series import FilePatch, diff_patch, parse_diff

OLD = [f"line {i}" for i in range(1, 31)]
NEW = OLD[:4] + ["added a", "added b"] + OLD[4:14] + OLD[15:25] + ["changed 26"] + OLD[26:]


def file_diff(old: list[str], new: list[str], n: int = 3) -> FilePatch:
    text = "diff --git a/f.c b/f.c\n" + "\n".join(
        difflib.unified_diff(old, new, "a/f.c", "b/f.c", lineterm="", n=n)) + "\n"
    (fp,) = parse_diff(text.encode(), "t.patch")
    return fp


@pytest.mark.parametrize("context", [3, 0])
def test_forward_and_reverse_round_trip_with_origins(context: int) -> None:
    fp = file_diff(OLD, NEW, context)
    at = h.locate(OLD, fp.hunks)
    assert None not in at
    new = h.apply_at(OLD, fp.hunks, at)
    assert new.lines == NEW
    assert new.origins[:4] == [0, 1, 2, 3] and new.origins[4:6] == [None, None]  # brought in
    assert new.origins[NEW.index("line 16")] == 15 and new.origins[NEW.index("changed 26")] is None
    back = h.apply_at(NEW, fp.hunks, h.locate(NEW, fp.hunks, reverse=True), reverse=True,
                      origins=new.origins)
    assert back.lines == OLD
    assert back.origins == [i if OLD[i] not in ("line 15", "line 26") else None for i in range(30)]


def test_located_mode_skips_markers_and_follows_drift() -> None:
    fp = file_diff(OLD, NEW)
    marker = "// UPSTREAM_SYNC(x): begin"
    # the file the hunks are found in has 3 more lines on top and a marker inside the first hunk
    shifted = ["top 1", "top 2", "top 3", *NEW[:4], marker, *NEW[4:]]
    assert h.locate(shifted, fp.hunks, reverse=True) == [None, None, None]  # not at the stated lines
    content = [t for t in shifted if t != marker]
    at = h.locate(content, fp.hunks, reverse=True, exact=False, skip=lambda t: t == marker)
    assert [x.new_start for x in fp.hunks] == [2, 14, 24]
    assert at == [1 + 3, 13 + 3, 23 + 3]  # each 3 lines later than stated
    assert h.apply_at(content, fp.hunks, at, reverse=True).lines == ["top 1", "top 2", "top 3", *OLD]


def test_find_nearest_prefers_the_occurrence_nearest_the_hint() -> None:
    lines = ["a", "x", "b", "x", "c", "x"]
    assert h.find_nearest(lines, ["x"], 4) == 3  # 3 and 5 are as near: the earlier
    assert h.find_nearest(lines, ["x"], 0, lo=2) == 3
    assert h.find_nearest(lines, ["x", "y"], 0) is None
    assert h.find_nearest(lines, [], 9) == len(lines)


def _exact(old: list[str], data: bytes) -> h.HunkFailure | None:
    patch = diff_patch(("diff --git a/f.c b/f.c\n" + "\n".join(difflib.unified_diff(
        old, NEW, "a/f.c", "b/f.c", lineterm="")) + "\n").encode(), "t.patch")
    return h.check_exact(patch, lambda path: data if path == "f.c" else None)


def test_check_exact_names_the_hunk_and_why() -> None:
    text = "\n".join(OLD) + "\n"
    assert _exact(OLD, text.encode()) is None
    moved = _exact(OLD, ("extra\n" + text).encode())
    assert moved is not None and (moved.file, moved.hunk, moved.line) == ("f.c", 1, 2)
    assert "context found 1 line(s) later (line 3)" in moved.reason
    changed = _exact(OLD, text.replace("line 3\n", "line 3 \xff\n").encode("latin-1"))
    assert changed is not None and "expected 'line 3', found 'line 3 \ufffd' (they differ from column 7)" \
        in changed.reason
    short = _exact(OLD, "\n".join(OLD[:20]).encode())
    assert short is not None and short.hunk == 3 and "found the end of the file" in short.reason


def test_patch_files_apply_exactly_to_a_folder(tmp_path: Path) -> None:
    """verify-identical's --patch-file: git apply would take a hunk 1 line off; the stack's applier
    refuses it and names the hunk."""
    folder = tmp_path / "export"
    folder.mkdir()
    diff = tmp_path / "x.patch"
    diff.write_text("diff --git a/f.c b/f.c\n" + "\n".join(difflib.unified_diff(
        OLD, NEW, "a/f.c", "b/f.c", lineterm="")) + "\n")
    (folder / "f.c").write_text("\n".join(["extra", *OLD]) + "\n")
    with pytest.raises(PatchFailed, match=r"f.c hunk #1 \(line 2\): context found 1 line\(s\) later"):
        apply_to_folder(folder, diff)
    assert (folder / "f.c").read_text() == "\n".join(["extra", *OLD]) + "\n"  # untouched
    (folder / "f.c").write_text("\n".join(OLD) + "\n")
    apply_to_folder(folder, diff)
    assert (folder / "f.c").read_text() == "\n".join(NEW) + "\n"


def test_hunks_at_one_point_and_overlaps() -> None:
    """Two insertions at the same point (empty from sides) go in order; overlapping hunks are refused."""
    ins = file_diff(OLD, OLD[:5] + ["x"] + OLD[5:], 0).hunks[0]
    ins2 = file_diff(OLD, OLD[:5] + ["y"] + OLD[5:], 0).hunks[0]
    assert h.apply_at(OLD, [ins, ins2], [5, 5]).lines == OLD[:5] + ["x", "y"] + OLD[5:]
    change = file_diff(OLD, OLD[:4] + ["z"] + OLD[5:]).hunks[0]
    with pytest.raises(ValueError, match="overlaps"):
        h.apply_at(OLD, [change, change], [1, 2])

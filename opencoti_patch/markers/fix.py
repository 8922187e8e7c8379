"""`markers --fix`: wrap unmarked changes in begin/end markers (or add the file marker), in place."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..stack.series import Patch
from .audit import AuditReport, Issue, audit, line_runs
from .lexers import unsafe_insert_points
from .syntax import (
    FILE_MARKER_LINES,
    Marker,
    Scan,
    comment_prefix,
    marker_text,
    parse_marker,
    read_lines,
    read_text,
    scan_markers,
)


@dataclass(frozen=True)
class FixChange:
    path: str
    line: int           # line number in the file after the fix
    action: str         # inserted | moved | removed
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.action} {self.text.strip()}"


@dataclass
class FixResult:
    changes: list[FixChange] = field(default_factory=list)
    refused: list[Issue] = field(default_factory=list)
    report: AuditReport = field(default_factory=AuditReport)

    @property
    def ok(self) -> bool:
        return not self.refused and self.report.ok

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "changes": [asdict(c) for c in self.changes],
            "refused": [asdict(i) | {"text": str(i)} for i in self.refused],
            "audit": self.report.to_dict(),
        }


def _indent_of(lines: Sequence[str], first: int, last: int) -> str:
    """Indentation of the first non-blank line of lines[first..last] (1-based), else next."""
    for t in list(range(first, last + 1)) + list(range(last + 1, len(lines) + 1)):
        if 1 <= t <= len(lines) and lines[t - 1].strip():
            text = lines[t - 1]
            return text[:len(text) - len(text.lstrip(" \t"))]
    return ""


def fix_lines(path: str, lines: Sequence[str], changed: Mapping[int, str],
              deleted: Sequence[tuple[str, Sequence[int]]] = ()
              ) -> tuple[list[str], list[FixChange], list[Issue]]:
    """Wrap unmarked changes of an upstream file in begin/end markers.

    `changed`: line number (1-based) -> feature of every changed line that must be inside a
    region of that feature; `deleted`: (feature, candidate points) for deletions, a point t
    meaning "after line t". Lines already in a region of their feature are left alone; a run
    of lines next to a region of the same feature extends that region (the marker moves), so
    adjacent regions merge and a second run changes nothing. Returns (new lines, what changed,
    refusals); where a comment cannot go (string, raw string, block comment, macro
    continuation) or the file type is unknown, the run is refused and left as it is.
    """
    out = list(lines)
    refused: list[Issue] = []
    if comment_prefix(path) is None:
        first = min(list(changed) + [g + 1 for _, gs in deleted for g in gs[:1]], default=1)
        return out, [], [Issue(path, first, "fix-refused",
                               "unknown file type: no comment syntax for a marker")]
    scan = scan_markers(out)
    if scan.errors:
        t, _, msg = scan.errors[0]
        return out, [], [Issue(path, t, "fix-refused", f"fix the markers by hand first: {msg}")]
    changes: list[FixChange] = []
    out, ch1, ref1, point = _fix_runs(path, out, changed, scan)
    changes += ch1
    refused += ref1
    if deleted:
        out, ch2, ref2 = _fix_gaps(path, len(lines), out, point, deleted)
        changes += ch2
        refused += ref2
    return out, changes, refused


def _apply_ops(lines: list[str], inserts: dict[int, list[str]], deletes: set[int]
               ) -> tuple[list[str], list[tuple[int, str]], dict[int, int]]:
    """Insert texts before line p (p = n+1 appends), delete lines; new numbers of each."""
    out: list[str] = []
    inserted: list[tuple[int, str]] = []
    new_no: dict[int, int] = {}
    for p in range(1, len(lines) + 2):
        for text in inserts.get(p, []):
            out.append(text)
            inserted.append((len(out), text))
        if p <= len(lines):
            new_no[p] = len(out) + 1
            if p not in deletes:
                out.append(lines[p - 1])
    return out, inserted, new_no


def _fix_runs(path: str, lines: list[str], changed: Mapping[int, str], scan: Scan
              ) -> tuple[list[str], list[FixChange], list[Issue], Callable[[int], int]]:
    """Returns also where the point after an original line lies in the new text."""
    unsafe = unsafe_insert_points(path, lines)
    markers = {m.line: m for m in scan.markers}
    refused: list[Issue] = []
    targets: dict[int, str] = {}
    for t, feature in changed.items():
        if not 1 <= t <= len(lines) or t in markers:
            continue
        state = scan.open_after[t]
        if state == feature:
            continue
        if state is not None:
            refused.append(Issue(path, t, "fix-refused",
                                 f"inside a region of {state!r}: regions do not nest"))
            continue
        targets[t] = feature
    inserts: dict[int, list[str]] = {}
    deletes: set[int] = set()
    moved: set[str] = set()
    for s, e in line_runs(sorted(targets)):
        # split the run where the feature changes
        start = s
        for t in range(s, e + 1):
            if t == e or targets[t + 1] != targets[t]:
                _plan_run(path, lines, start, t, targets[t], markers, unsafe, inserts, deletes,
                          moved, refused)
                start = t + 1
    if not inserts and not deletes:
        return lines, [], refused, lambda g: g
    out, inserted, new_no = _apply_ops(lines, inserts, deletes)
    changes = [FixChange(path, n, "moved" if text in moved else "inserted", text)
               for n, text in inserted]
    changes += [FixChange(path, new_no[d], "removed", lines[d - 1]) for d in sorted(deletes)
                if lines[d - 1] not in moved]

    def point(g: int) -> int:
        if g <= 0:
            return 0
        if g > len(lines):
            return len(out)
        return new_no[g] - (1 if g in deletes else 0)

    return out, changes, refused, point


def _plan_run(path: str, lines: list[str], s: int, e: int, feature: str,
              markers: Mapping[int, Marker], unsafe: Mapping[int, str],
              inserts: dict[int, list[str]], deletes: set[int], moved: set[str],
              refused: list[Issue]) -> None:
    before = markers.get(s - 1)
    after = markers.get(e + 1)
    extend_end = before is not None and before.kind == "end" and before.feature == feature
    extend_begin = after is not None and after.kind == "begin" and after.feature == feature
    indent = _indent_of(lines, s, e)
    begin = marker_text(path, feature, "begin", indent)
    end = marker_text(path, feature, "end", indent)
    assert begin is not None and end is not None
    need = [] if extend_end else [s]
    need += [] if extend_begin else [e + 1]
    for p in need:
        if p in unsafe:
            refused.append(Issue(path, p if p <= len(lines) else len(lines), "fix-refused",
                                 f"cannot place a marker here: {unsafe[p]}", feature=feature))
            return
    if extend_end and extend_begin:          # the run joins two regions: merge them
        deletes.update((s - 1, e + 1))
    elif extend_end:                         # move the end marker down past the run
        deletes.add(s - 1)
        inserts.setdefault(e + 1, []).append(lines[s - 2])
        moved.add(lines[s - 2])
    elif extend_begin:                       # move the begin marker up before the run
        deletes.add(e + 1)
        inserts.setdefault(s, []).append(begin)
        moved.add(begin)
    else:
        inserts.setdefault(s, []).append(begin)
        inserts.setdefault(e + 1, []).insert(0, end)


def _fix_gaps(path: str, n_orig: int, lines: list[str], point: Callable[[int], int],
              deleted: Sequence[tuple[str, Sequence[int]]]
              ) -> tuple[list[str], list[FixChange], list[Issue]]:
    """Mark deletion points no region encloses with an empty begin/end pair."""
    scan = scan_markers(lines)
    unsafe = unsafe_insert_points(path, lines)
    inserts: dict[int, list[str]] = {}
    refused: list[Issue] = []
    for feature, points in deleted:
        spans: list[int] = []
        for g in points:
            # markers the runs inserted right after line g are at the same point
            lo = point(g)
            hi = point(g + 1) - 1 if g < n_orig else len(lines)
            spans.extend(range(lo, max(lo, hi) + 1))
        if any(0 <= q <= len(lines) and scan.open_after[q] == feature for q in spans):
            continue
        if any(q + 1 in inserts for q in spans):
            continue                      # an empty pair already placed at this point
        where = next((q for q in spans if q + 1 not in unsafe), None)
        if where is None:
            q = spans[0] + 1 if spans else 1
            refused.append(Issue(path, min(q, len(lines)), "fix-refused",
                                 f"cannot place a marker here: {unsafe.get(q, 'no place')}",
                                 feature=feature))
            continue
        indent = _indent_of(lines, where + 1, where + 1) if where < len(lines) else _indent_of(
            lines, max(where, 1), max(where, 1))
        pair = [marker_text(path, feature, k, indent) or "" for k in ("begin", "end")]
        inserts[where + 1] = pair
    if not inserts:
        return lines, [], refused
    out, inserted, _ = _apply_ops(lines, inserts, set())
    return out, [FixChange(path, n, "inserted", text) for n, text in inserted], refused


def fix_new_file(path: str, lines: Sequence[str], feature: str
                 ) -> tuple[list[str], list[FixChange], list[Issue]]:
    """Give a fork-only file its `file` marker (line 1; after a shebang/coding line)."""
    out = list(lines)
    if any((m := parse_marker(t)) is not None and m.kind == "file" and m.feature == feature
           for t in out[:FILE_MARKER_LINES]):
        return out, [], []
    text = marker_text(path, feature, "file")
    if text is None:
        return out, [], [Issue(path, 1, "fix-refused", "unknown file type: no comment syntax")]
    at = 0
    while at < min(2, len(out)) and (out[at].startswith("#!") or re.match(
            r"^[ \t\f]*#.*coding[:=]", out[at])):
        at += 1
    out.insert(at, text)
    return out, [FixChange(path, at + 1, "inserted", text)], []


def fix_tree(tree: Path | str, patches: Sequence[Patch], files: Iterable[str] | None = None,
             dry_run: bool = False) -> FixResult:
    """Audit the series against `tree` and wrap what is unmarked there, in place.

    `files` limits the fix (and the returned audit) to those paths. Returns what changed,
    what was refused (file:line + why) and the audit of the fixed tree.
    """
    tree = Path(tree)
    wanted = set(files) if files is not None else None
    report = audit(patches, tree, wanted)
    per_file: dict[str, list[Issue]] = {}
    for issue in report.issues:
        if issue.kind in ("unmarked", "missing-file-marker") and issue.feature is not None:
            per_file.setdefault(issue.path, []).append(issue)
    result = FixResult()
    written: dict[str, list[str]] = {}
    for path, issues in sorted(per_file.items()):
        lines = read_lines(tree / path)
        if lines is None:
            continue
        if any(i.kind == "missing-file-marker" for i in issues):
            feature = next(i.feature for i in issues if i.feature)
            new, changes, refused = fix_new_file(path, lines, feature)
        else:
            changed: dict[int, str] = {}
            deleted: list[tuple[str, Sequence[int]]] = []
            for i in issues:
                assert i.feature is not None
                if i.gap_after:
                    deleted.append((i.feature, i.gap_after))
                else:
                    for t in range(i.line, (i.end_line or i.line) + 1):
                        changed[t] = i.feature
            new, changes, refused = fix_lines(path, lines, changed, deleted)
        result.changes += changes
        result.refused += refused
        if new != lines:
            written[path] = new
    if not dry_run:
        for path, new in written.items():
            target = tree / path
            final_newline = read_text(target).endswith("\n") or not new
            text = "\n".join(new) + ("\n" if final_newline else "")
            target.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    result.report = audit(patches, tree, wanted) if written and not dry_run else report
    return result

"""UPSTREAM_SYNC marker audit: every change to an upstream file sits in a marked region.

Rules (see docs/usage.md, `markers`):
- A changed or added line of a patch inside an *upstream* file (one no patch of the series
  created) lies between `UPSTREAM_SYNC(<feature>): begin` and `UPSTREAM_SYNC(<feature>): end`
  comment lines, `<feature>` being the `Feature:` of the patch header. Pairs match, do not nest.
- A deletion counts as marked when its point in the post-patch file is enclosed by a region.
- A file created by the series (`--- /dev/null`) has `UPSTREAM_SYNC(<feature>): file` on one of
  its first 5 lines (so a shebang, `#pragma once` or a licence line may come first).
- Deleting, renaming, changing the mode of, or binary-patching an upstream file cannot be marked
  and is reported.

With `tree` (a directory where the whole series is applied) the check is exact: the post-patch
files are read from the tree, the hunks of each patch are located in them (through the later
patches of the series, taken off in memory by the stack's applier, ``stack/hunks.py``) and region
membership is decided on the whole file. Marker lines are ignored while locating hunks, so a tree
that has extra markers (after `fix_tree`, before a snapshot) still matches its patches. Without a
tree, only the hunk is known: a change whose enclosing markers are not inside the hunk is reported
"cannot verify".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..stack.hunks import apply_at, locate
from ..stack.series import FilePatch, Hunk, Patch
from .syntax import FILE_MARKER_LINES, Marker, is_marker, parse_marker, read_lines, scan_markers

# Severity of each issue kind: errors fail the audit, warnings are printed only.
WARNING_KINDS = frozenset({"unverified", "binary-file"})


@dataclass(frozen=True)
class Region:
    """A marked region: `begin`/`end` are the line numbers of the two marker lines."""

    path: str
    begin: int
    end: int
    feature: str
    patches: tuple[str, ...] = ()


@dataclass(frozen=True)
class Issue:
    path: str
    line: int
    kind: str
    message: str
    patch: str | None = None
    end_line: int | None = None          # last line of a run of unmarked lines
    feature: str | None = None           # the feature the change should be marked with
    gap_after: tuple[int, ...] = ()      # deletions: lines after which the deletion point may be

    @property
    def severity(self) -> str:
        return "warning" if self.kind in WARNING_KINDS else "error"

    def __str__(self) -> str:
        text = f"{self.path}:{self.line}: {self.message}"
        if self.patch:
            text += f" (patch {self.patch})"
        return text


@dataclass
class AuditReport:
    regions: list[Region] = field(default_factory=list)
    issues: list[Issue] = field(default_factory=list)
    tree: str | None = None
    patches: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.severity == "error"]

    @property
    def warnings(self) -> list[Issue]:
        return [i for i in self.issues if i.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "mode": "tree" if self.tree else "patches",
            "tree": self.tree,
            "patches": self.patches,
            "regions": [asdict(r) | {"patches": list(r.patches)} for r in self.regions],
            "issues": [asdict(i) | {"severity": i.severity, "gap_after": list(i.gap_after),
                                    "text": str(i)} for i in self.issues],
        }


@dataclass
class _Chain:
    """The successive diffs of one file across the series (renames followed)."""

    path: str
    fork: bool
    creator: Patch | None = None
    steps: list[tuple[Patch, FilePatch]] = field(default_factory=list)


@dataclass
class _Change:
    patch: Patch
    line: int                         # first line (lines) / line after the point (deletions)
    gaps: tuple[int, ...] = ()        # deletions only
    state: str | None = None          # known: feature open there; see _UNKNOWN


_UNKNOWN = "\0unknown"


def _build_chains(patches: Sequence[Patch], issues: list[Issue]) -> list[_Chain]:
    live: dict[str, _Chain] = {}
    for patch in patches:
        if patch.feature_name is None:
            issues.append(Issue(patch.name, 0, "no-feature",
                                "patch header has no `Feature: <name>` line", patch.name))
        for fd in patch.files:
            if fd.new_file:
                chain = _Chain(fd.path, fork=True, creator=patch)
                live[fd.path] = chain
            elif fd.deleted_file:
                gone = live.pop(fd.path) if fd.path in live else None
                if gone is None or not gone.fork:
                    issues.append(Issue(fd.path, 0, "deleted-upstream",
                                        "deletes an upstream file (cannot be marked)", patch.name))
                continue
            elif fd.rename:
                old = fd.old_path or ""
                chain = live.pop(old) if old in live else _Chain(fd.path, fork=False)
                if not chain.fork:
                    issues.append(Issue(fd.path, 0, "renamed-upstream",
                                        f"renames upstream file {fd.old_path} (cannot be marked)",
                                        patch.name))
                chain.path = fd.path
                live[fd.path] = chain
            else:
                chain = live.setdefault(fd.path, _Chain(fd.path, fork=False))
            if not chain.fork:
                if fd.binary:
                    issues.append(Issue(fd.path, 0, "binary-upstream",
                                        "binary change to an upstream file (cannot be marked)",
                                        patch.name))
            elif fd.binary and chain.creator is patch:
                issues.append(Issue(fd.path, 0, "binary-file",
                                    "binary file: cannot carry an UPSTREAM_SYNC file marker",
                                    patch.name))
            chain.steps.append((patch, fd))
    return list(live.values())


def audit(patches: Sequence[Patch], tree: Path | str | None = None,
          files: Iterable[str] | None = None) -> AuditReport:
    """Audit the markers of a series (in order). `files` limits the files looked at."""
    views = list(patches)
    issues: list[Issue] = []
    regions: list[Region] = []
    wanted = set(files) if files is not None else None
    tree_path = Path(tree) if tree is not None else None
    for chain in _build_chains(views, issues):
        if wanted is not None and chain.path not in wanted:
            continue
        if chain.fork:
            issues.extend(_audit_fork_file(chain, tree_path))
        elif tree_path is not None:
            r, i = _audit_upstream_tree(chain, tree_path)
            regions.extend(r)
            issues.extend(i)
        else:
            r, i = _audit_upstream_hunks(chain)
            regions.extend(r)
            issues.extend(i)
    if wanted is not None:
        issues = [i for i in issues if i.path in wanted or i.line == 0 and i.kind == "no-feature"]
    regions.sort(key=lambda r: (r.path, r.begin))
    order = {p.name: n for n, p in enumerate(patches)}
    issues.sort(key=lambda i: (i.path, i.line, order.get(i.patch or "", -1), i.kind))
    return AuditReport(regions=regions, issues=_dedupe(issues),
                       tree=str(tree_path) if tree_path is not None else None,
                       patches=[p.name for p in patches])


def _dedupe(issues: list[Issue]) -> list[Issue]:
    seen: set[tuple[str, int, str, str | None]] = set()
    out = []
    for i in issues:
        key = (i.path, i.line, i.kind, i.patch)
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


def _audit_fork_file(chain: _Chain, tree: Path | None) -> list[Issue]:
    creator = chain.creator
    assert creator is not None
    fd = next(fd for p, fd in chain.steps if p is creator)
    if fd.binary:
        return []
    if tree is not None:
        lines = read_lines(tree / chain.path)
        if lines is None:
            return [Issue(chain.path, 0, "missing-file",
                          "not in the tree (is the series applied?)", creator.name)]
    else:
        lines = [text for h in fd.hunks for _, tag, text in h.new_side()][:FILE_MARKER_LINES]
    head = [parse_marker(t) for t in lines[:FILE_MARKER_LINES]]
    found = [m for m in head if m is not None and m.kind == "file"]
    feature = creator.feature_name
    if not found:
        want = feature or "<feature>"
        return [Issue(chain.path, 1, "missing-file-marker",
                      f"new file lacks `UPSTREAM_SYNC({want}): file` in its first "
                      f"{FILE_MARKER_LINES} lines", creator.name, feature=feature)]
    if feature is not None and all(m.feature != feature for m in found):
        return [Issue(chain.path, 1, "feature-mismatch",
                      f"file marker names {found[0].feature!r}, the patch is {feature!r}",
                      creator.name, feature=feature)]
    return []


@dataclass
class _NS:
    """A new-side line of a hunk: tag, text, its content index in the stage (None: marker)."""

    tag: str
    text: str
    cidx: int | None


def _hunk_new_side(h: Hunk, pos: int) -> list[_NS]:
    out: list[_NS] = []
    j = pos
    for tag, text in h.text_lines:
        if tag == "-":
            continue
        if is_marker(text):
            out.append(_NS(tag, text, None))
        else:
            out.append(_NS(tag, text, j))
            j += 1
    return out


def _deletion_blocks(h: Hunk) -> list[tuple[int, int]]:
    """New-side (start, end) of each run of -/+ lines that deletes content and adds none.

    A run that also adds content lines needs no separate check: its deletion point is next
    to those lines, which must be in a region themselves.
    """
    blocks: list[tuple[int, int]] = []
    ns = 0
    i = 0
    while i < len(h.text_lines):
        if h.text_lines[i][0] == " ":
            ns += 1
            i += 1
            continue
        start = ns
        deleted = added = False
        while i < len(h.text_lines) and h.text_lines[i][0] != " ":
            tag, text = h.text_lines[i]
            if tag == "+":
                ns += 1
                added = added or not is_marker(text)
            elif not is_marker(text):
                deleted = True
            i += 1
        if deleted and not added:
            blocks.append((start, ns))
    return blocks


def _audit_upstream_tree(chain: _Chain, tree: Path) -> tuple[list[Region], list[Issue]]:
    path = chain.path
    if any(fd.binary for _, fd in chain.steps):
        return [], []                     # reported by _build_chains: binary cannot be marked
    lines = read_lines(tree / path)
    if lines is None:
        return [], [Issue(path, 0, "missing-file", "not in the tree (is the series applied?)",
                          chain.steps[-1][0].name)]
    issues: list[Issue] = []
    scan = scan_markers(lines)
    tree_line = [t for t, text in enumerate(lines, 1) if not is_marker(text)]  # content -> line
    n_content = len(tree_line)

    def line_of(final: int) -> int:
        return 0 if final < 0 else len(lines) + 1 if final >= n_content else tree_line[final]

    cur = [lines[t - 1] for t in tree_line]
    cur_final: list[int | None] = list(range(n_content))
    changes: list[_Change] = []
    for patch, fd in reversed(chain.steps):
        located = locate(cur, fd.hunks, reverse=True, exact=False, skip=is_marker)
        for h, pos in zip(fd.hunks, located, strict=True):
            if pos is None:
                issues.append(Issue(path, h.new_start, "mismatch",
                                    f"hunk @@ -{h.old_start} +{h.new_start} @@ does not match the "
                                    "tree: cannot verify it (is the series applied?)", patch.name))
                continue
            changes.extend(_tree_changes(patch, h, pos, cur_final, lines, line_of))
        # take this patch off (the stack's in-memory applier) so that earlier patches find their own text
        undone = apply_at(cur, fd.hunks, located, reverse=True, skip=is_marker, origins=cur_final)
        cur, cur_final = undone.lines, undone.origins

    order = {p.name: k for k, (p, _) in enumerate(chain.steps)}
    changes.sort(key=lambda c: order[c.patch.name])
    for t, kind, msg in scan.errors:
        issues.append(Issue(path, t, kind, msg))
    issues.extend(_judge(path, changes, scan.open_after, len(lines)))
    regions = [Region(path, b, e, f, _region_patches(b, e, changes))
               for b, e, f in scan.regions]
    return regions, issues


def _tree_changes(patch: Patch, h: Hunk, pos: int, cur_final: list[int | None],
                  lines: list[str], line_of: Callable[[int], int]) -> list[_Change]:
    """The changes of a hunk located at content index `pos` of its stage, in tree lines."""
    ns = _hunk_new_side(h, pos)
    out: list[_Change] = []
    for e in ns:
        final = cur_final[e.cidx] if e.tag == "+" and e.cidx is not None else None
        if final is not None:
            out.append(_Change(patch, line_of(final)))
    for bs, be in _deletion_blocks(h):
        lo_ns = next((k for k in range(bs - 1, -1, -1) if ns[k].cidx is not None), None)
        hi_ns = next((k for k in range(be, len(ns)) if ns[k].cidx is not None), None)
        lo_c = ns[lo_ns].cidx if lo_ns is not None else pos - 1
        hi_c = ns[hi_ns].cidx if hi_ns is not None else pos + sum(1 for e in ns if e.cidx is not None)
        assert lo_c is not None and hi_c is not None
        # nearest content lines that are still there in the final file
        lo_f = next((f for f in reversed(cur_final[:lo_c + 1]) if f is not None), -1)
        hi_f = next((f for f in cur_final[hi_c:] if f is not None), None)
        lo_t = line_of(lo_f)
        hi_t = line_of(hi_f) if hi_f is not None else len(lines) + 1
        stretch = lines[lo_t:hi_t - 1]
        if lo_ns is not None and hi_ns is not None and stretch == [e.text for e in ns[lo_ns + 1:hi_ns]]:
            gaps = tuple(lo_t + k - lo_ns for k in range(bs - 1, be))   # exact: as the hunk says
        else:
            gaps = tuple(range(lo_t, hi_t))       # the tree differs here: any point in the stretch
        out.append(_Change(patch, min(gaps[0] + 1, max(len(lines), 1)), gaps))
    return out


def _judge(path: str, changes: list[_Change], open_after: Sequence[str | None] | None,
           n_lines: int) -> list[Issue]:
    """Issues for changes: region membership from `open_after`, or each change's own state."""
    issues: list[Issue] = []
    runs: dict[tuple[str, str, str | None], list[int]] = {}
    for ch in changes:
        want = ch.patch.feature_name
        if ch.gaps:
            states = [(open_after[g] if open_after is not None else ch.state) for g in ch.gaps]
            if want is not None and want in states or want is None and any(
                    s is not None and s != _UNKNOWN for s in states):
                continue
            if _UNKNOWN in states:
                issues.append(Issue(path, ch.line, "unverified",
                                    "cannot verify deletion (its region markers are outside the "
                                    "hunk), pass --tree", ch.patch.name, feature=want))
                continue
            other = next((s for s in states if s is not None), None)
            if other is not None:
                issues.append(Issue(path, ch.line, "feature-mismatch",
                                    f"deletion inside a region of {other!r}, the patch is {want!r}",
                                    ch.patch.name, feature=want, gap_after=ch.gaps))
            else:
                issues.append(Issue(path, ch.line, "unmarked", "unmarked deletion", ch.patch.name,
                                    feature=want, gap_after=ch.gaps))
            continue
        state = open_after[ch.line] if open_after is not None else ch.state
        if state is not None and (want is None or state == want):
            continue
        if state == _UNKNOWN:
            kind = "unverified"
        elif state is None:
            kind = "unmarked"
        else:
            kind = f"feature-mismatch:{state}"
        runs.setdefault((ch.patch.name, kind, want), []).append(ch.line)
    for (patch_name, kind, want), nums in runs.items():
        for start, end in line_runs(sorted(set(nums))):
            if kind == "unmarked":
                issues.append(Issue(path, start, "unmarked", "unmarked change", patch_name,
                                    end_line=end, feature=want))
            elif kind == "unverified":
                issues.append(Issue(path, start, "unverified",
                                    "cannot verify (its region markers are outside the hunk), "
                                    "pass --tree", patch_name, end_line=end, feature=want))
            else:
                other = kind.split(":", 1)[1]
                issues.append(Issue(path, start, "feature-mismatch",
                                    f"change inside a region of {other!r}, the patch is {want!r}",
                                    patch_name, end_line=end, feature=want))
    return issues


def line_runs(nums: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for n in nums:
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out


def _region_patches(begin: int, end: int, changes: list[_Change]) -> tuple[str, ...]:
    names: list[str] = []
    for ch in changes:
        inside = (any(begin <= g < end for g in ch.gaps) if ch.gaps else begin < ch.line < end)
        if inside and ch.patch.name not in names:
            names.append(ch.patch.name)
    return tuple(names)


def _hunk_state(ns: list[_NS], markers: list[Marker | None], g: int) -> str | None:
    """Feature open after new-side index g (-1: before the hunk), from the hunk's markers."""
    for k in range(g, -1, -1):
        mk = markers[k]
        if mk is not None and mk.kind in ("begin", "end"):
            return mk.feature if mk.kind == "begin" else None
    for k in range(g + 1, len(ns)):
        mk = markers[k]
        if mk is not None and mk.kind in ("begin", "end"):
            return mk.feature if mk.kind == "end" else None
    return _UNKNOWN


def _audit_upstream_hunks(chain: _Chain) -> tuple[list[Region], list[Issue]]:
    path = chain.path
    regions: list[Region] = []
    issues: list[Issue] = []
    for patch, fd in chain.steps:
        changes: list[_Change] = []
        for h in fd.hunks:
            ns = _hunk_new_side(h, 0)
            numbers = [n for n, _, _ in h.new_side()]
            markers = [parse_marker(e.text) for e in ns]
            scan = scan_markers([e.text for e in ns])
            for t, kind, msg in scan.errors:
                if kind != "unmatched-begin" and not (kind == "unmatched-end" and _no_marker_before(
                        markers, t - 1)):
                    issues.append(Issue(path, numbers[t - 1], kind, msg, patch.name))
            hunk_changes: list[_Change] = []
            for k, e in enumerate(ns):
                if e.tag == "+" and e.cidx is not None:
                    hunk_changes.append(_Change(patch, numbers[k], state=_hunk_state(ns, markers, k)))
            for bs, be in _deletion_blocks(h):
                states = {_hunk_state(ns, markers, g) for g in range(bs - 1, be)}
                line = numbers[be] if be < len(numbers) else h.new_start + len(ns)
                for state in sorted(states, key=str):
                    hunk_changes.append(_Change(patch, line, gaps=(line - 1,), state=state))
            # several states for one deletion: it is marked if any of them is
            changes.extend(_merge_gap_states(hunk_changes, patch.feature_name))
            for first, last, f in scan.regions:
                regions.append(Region(path, numbers[first - 1], numbers[last - 1], f, (patch.name,)))
        issues.extend(_judge(path, changes, None, 0))
    return regions, issues


def _no_marker_before(markers: list[Marker | None], k: int) -> bool:
    return all(m is None or m.kind == "file" for m in markers[:k])


def _merge_gap_states(changes: list[_Change], feature: str | None) -> list[_Change]:
    out: list[_Change] = []
    by_line: dict[int, list[_Change]] = {}
    for ch in changes:
        if ch.gaps:
            by_line.setdefault(ch.line, []).append(ch)
        else:
            out.append(ch)
    for group in by_line.values():
        states = [c.state for c in group]
        if feature in states or feature is None and any(s not in (None, _UNKNOWN) for s in states):
            continue
        best = next((c for c in group if c.state == _UNKNOWN), None) or group[0]
        out.append(best)
    return out


def format_report(report: AuditReport) -> str:
    rows = [(r.path, str(r.begin), str(r.end), r.feature, ", ".join(r.patches) or "-")
            for r in report.regions]
    head = ("file", "begin", "end", "feature", "patch")
    out: list[str] = []
    if rows:
        widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
        out.append("  ".join(h.ljust(w) if k in (0, 3, 4) else h.rjust(w)
                             for k, (h, w) in enumerate(zip(head, widths, strict=True))).rstrip())
        for row in rows:
            out.append("  ".join(c.ljust(w) if k in (0, 3, 4) else c.rjust(w)
                                 for k, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip())
    for issue in report.issues:
        out.append(("warning: " if issue.severity == "warning" else "") + str(issue))
    mode = f"tree {report.tree}" if report.tree else "patches only (pass --tree for an exact check)"
    out.append(f"{len(report.regions)} marked regions, {len(report.errors)} errors, "
               f"{len(report.warnings)} warnings ({mode})")
    return "\n".join(out)

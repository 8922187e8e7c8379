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
patches of the series, by reverse-applying them in memory) and region membership is decided on
the whole file. Marker lines are ignored while locating hunks, so a tree that has extra markers
(after `fix_tree`, before a snapshot) still matches its patches. Without a tree, only the hunk
is known: a change whose enclosing markers are not inside the hunk is reported "cannot verify".
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..stack.series import Patch, PatchHeader, parse_diff

FILE_MARKER_LINES = 5
"""The `file` marker of a new file must be on one of its first this many lines."""

MARKER_RE = re.compile(
    r"^\s*(?://+|#+|/\*+|<!--|--|;+)\s*UPSTREAM_SYNC\((?P<feature>[^()\s]*)\)\s*:\s*"
    r"(?P<kind>begin|end|file)\b"
)
_FEATURE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")

_SLASH_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".inl", ".cu", ".cuh",
                   ".m", ".mm", ".metal", ".comp", ".glsl", ".cl", ".wgsl")
_HASH_SUFFIXES = (".cmake", ".py", ".pyi", ".sh", ".bash", ".yml", ".yaml")

# Severity of each issue kind: errors fail the audit, warnings are printed only.
WARNING_KINDS = frozenset({"unverified", "binary-file"})


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Marker:
    line: int           # 1-based
    kind: str           # begin | end | file
    feature: str
    valid_name: bool = True


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


# --------------------------------------------------------------------------- markers


def parse_marker(text: str) -> Marker | None:
    """The marker on a line (line number 0), or None for an ordinary line."""
    m = MARKER_RE.match(text)
    if not m:
        return None
    feature = m.group("feature")
    return Marker(0, m.group("kind"), feature, bool(_FEATURE_NAME_RE.match(feature)))


def is_marker(text: str) -> bool:
    return MARKER_RE.match(text) is not None


def comment_prefix(path: str) -> str | None:
    """The line-comment syntax for a file type (None: unknown type)."""
    name = Path(path).name
    if name == "CMakeLists.txt" or name.endswith(_HASH_SUFFIXES):
        return "#"
    if name.endswith(_SLASH_SUFFIXES):
        return "//"
    return None


def marker_text(path: str, feature: str, kind: str, indent: str = "") -> str | None:
    prefix = comment_prefix(path)
    if prefix is None:
        return None
    return f"{indent}{prefix} UPSTREAM_SYNC({feature}): {kind}"


@dataclass
class _Scan:
    """Markers of a whole file: regions, the open feature after each line, errors."""

    regions: list[tuple[int, int, str]]
    open_after: list[str | None]          # [t] = feature open after line t (t = 0..n)
    errors: list[tuple[int, str, str]]    # (line, kind, message)
    markers: list[Marker]


def scan_markers(lines: Sequence[str], upstream: bool = True) -> _Scan:
    """Find the regions of a file and everything wrong with its markers."""
    regions: list[tuple[int, int, str]] = []
    errors: list[tuple[int, str, str]] = []
    markers: list[Marker] = []
    open_after: list[str | None] = [None]
    cur: Marker | None = None
    for t, text in enumerate(lines, 1):
        mk = parse_marker(text)
        if mk is None:
            if "UPSTREAM_SYNC" in text and re.search(r"UPSTREAM_SYNC\s*\(", text):
                errors.append((t, "malformed-marker",
                               "malformed UPSTREAM_SYNC marker (want a comment line "
                               "`UPSTREAM_SYNC(<feature>): begin|end|file`)"))
            open_after.append(cur.feature if cur else None)
            continue
        mk = Marker(t, mk.kind, mk.feature, mk.valid_name)
        markers.append(mk)
        if not mk.valid_name:
            errors.append((t, "malformed-marker", f"bad feature name {mk.feature!r} in marker"))
        if mk.kind == "file":
            if upstream:
                errors.append((t, "misplaced-marker", "`file` marker in an upstream file"))
        elif mk.kind == "begin":
            if cur is not None:
                errors.append((t, "nested-marker",
                               f"begin inside the region opened on line {cur.line} "
                               "(nested regions are refused; missing end?)"))
            else:
                cur = mk
        else:
            if cur is None:
                errors.append((t, "unmatched-end", "end without begin"))
            else:
                if cur.feature != mk.feature:
                    errors.append((t, "feature-mismatch",
                                   f"end of {mk.feature!r} closes the begin of {cur.feature!r} "
                                   f"(line {cur.line})"))
                regions.append((cur.line, t, cur.feature))
                cur = None
        open_after.append(cur.feature if cur else None)
    if cur is not None:
        errors.append((cur.line, "unmatched-begin", "begin without end"))
    return _Scan(regions, open_after, errors, markers)


# --------------------------------------------------------------------------- inputs
# Patches come from series.py (its parser); this module looks at them through a small text view.


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="surrogateescape")


def read_lines(path: Path) -> list[str] | None:
    """The lines of a text file split on "\\n" only (None when it is not a file)."""
    if not path.is_file():
        return None
    lines = _read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def patch_feature(patch: Patch) -> str | None:
    """The feature name of a patch: the first word of its `Feature:` header field."""
    words = patch.header.feature.split()
    return words[0] if words else None


def diff_patch(diff: bytes | str, name: str = "diff", feature: str | None = None) -> Patch:
    """A bare diff (e.g. `git diff upstream`) as a one-patch series with the given feature."""
    data = diff.encode("utf-8", errors="surrogateescape") if isinstance(diff, str) else diff
    return Patch(name, Path(name), PatchHeader(subject=name, feature=feature or ""),
                 tuple(parse_diff(data, name)), hashlib.sha256(data).hexdigest())


@dataclass
class _Hunk:
    old_start: int
    new_start: int
    lines: list[tuple[str, str]]          # (' ' | '-' | '+', text)

    def new_side(self) -> list[tuple[int, str, str]]:
        out: list[tuple[int, str, str]] = []
        n = self.new_start
        for tag, text in self.lines:
            if tag != "-":
                out.append((n, tag, text))
                n += 1
        return out


@dataclass
class _File:
    old_path: str | None
    new_path: str | None
    binary: bool
    hunks: list[_Hunk]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""

    @property
    def new_file(self) -> bool:
        return self.old_path is None

    @property
    def deleted_file(self) -> bool:
        return self.new_path is None

    @property
    def rename(self) -> bool:
        return self.old_path is not None and self.new_path is not None and self.old_path != self.new_path


@dataclass
class _Patch:
    name: str
    feature: str | None
    files: list[_File]


def _view(patch: Patch) -> _Patch:
    files = []
    for fp in patch.files:
        hunks = [_Hunk(h.old_start, h.new_start,
                       [(ln[:1].decode() or " ", ln[1:].decode("utf-8", errors="surrogateescape"))
                        for ln in h.lines]) for h in fp.hunks]
        files.append(_File(fp.old_path, fp.new_path, fp.binary, hunks))
    return _Patch(patch.name, patch_feature(patch), files)


# --------------------------------------------------------------------------- audit


@dataclass
class _Chain:
    """The successive diffs of one file across the series (renames followed)."""

    path: str
    fork: bool
    creator: _Patch | None = None
    steps: list[tuple[_Patch, _File]] = field(default_factory=list)


@dataclass
class _Change:
    patch: _Patch
    line: int                         # first line (lines) / line after the point (deletions)
    gaps: tuple[int, ...] = ()        # deletions only
    state: str | None = None          # known: feature open there; see _UNKNOWN


_UNKNOWN = "\0unknown"


def _build_chains(patches: Sequence[_Patch], issues: list[Issue]) -> list[_Chain]:
    live: dict[str, _Chain] = {}
    for patch in patches:
        if patch.feature is None:
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
    views = [_view(p) for p in patches]
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
    feature = creator.feature
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


# ---- exact audit against a tree


def _locate(hay: list[str], needle: list[str], hint: int, lo: int) -> int | None:
    """Index of `needle` in `hay` at or after `lo`, the occurrence nearest `hint`."""
    n = len(needle)
    top = len(hay) - n
    if n == 0:
        return min(max(hint, lo), len(hay))
    if top < lo:
        return None
    hint = min(max(hint, lo), top)
    first = needle[0]
    for d in range(0, max(hint - lo, top - hint) + 1):
        for p in ((hint,) if d == 0 else (hint - d, hint + d)):
            if lo <= p <= top and hay[p] == first and hay[p:p + n] == needle:
                return p
    return None


@dataclass
class _NS:
    """A new-side line of a hunk: tag, text, its content index in the stage (None: marker)."""

    tag: str
    text: str
    cidx: int | None


def _hunk_new_side(h: _Hunk, pos: int) -> list[_NS]:
    out: list[_NS] = []
    j = pos
    for tag, text in h.lines:
        if tag == "-":
            continue
        if is_marker(text):
            out.append(_NS(tag, text, None))
        else:
            out.append(_NS(tag, text, j))
            j += 1
    return out


def _deletion_blocks(h: _Hunk) -> list[tuple[int, int]]:
    """New-side (start, end) of each run of -/+ lines that deletes content and adds none.

    A run that also adds content lines needs no separate check: its deletion point is next
    to those lines, which must be in a region themselves.
    """
    blocks: list[tuple[int, int]] = []
    ns = 0
    i = 0
    while i < len(h.lines):
        if h.lines[i][0] == " ":
            ns += 1
            i += 1
            continue
        start = ns
        deleted = added = False
        while i < len(h.lines) and h.lines[i][0] != " ":
            tag, text = h.lines[i]
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
        located: list[int | None] = []
        drift = 0
        lo = 0
        for h in fd.hunks:
            needle = [t for tag, t in h.lines if tag != "-" and not is_marker(t)]
            pos = _locate(cur, needle, h.new_start - 1 + drift, lo)
            located.append(pos)
            if pos is None:
                issues.append(Issue(path, h.new_start, "mismatch",
                                    f"hunk @@ -{h.old_start} +{h.new_start} @@ does not match the "
                                    "tree: cannot verify it (is the series applied?)", patch.name))
                continue
            drift = pos - (h.new_start - 1)
            lo = pos + len(needle)
            changes.extend(_tree_changes(patch, h, pos, cur_final, lines, line_of))
        # reverse-apply this patch so that earlier patches find their own post-patch text
        for h, pos in reversed(list(zip(fd.hunks, located, strict=True))):
            if pos is None:
                continue
            old_text: list[str] = []
            old_map: list[int | None] = []
            j = pos
            for tag, text in h.lines:
                if is_marker(text):
                    continue
                if tag == " ":
                    old_text.append(text)
                    old_map.append(cur_final[j])
                    j += 1
                elif tag == "+":
                    j += 1
                else:
                    old_text.append(text)
                    old_map.append(None)
            cur[pos:j] = old_text
            cur_final[pos:j] = old_map

    order = {p.name: k for k, (p, _) in enumerate(chain.steps)}
    changes.sort(key=lambda c: order[c.patch.name])
    for t, kind, msg in scan.errors:
        issues.append(Issue(path, t, kind, msg))
    issues.extend(_judge(path, changes, scan.open_after, len(lines)))
    regions = [Region(path, b, e, f, _region_patches(b, e, changes))
               for b, e, f in scan.regions]
    return regions, issues


def _tree_changes(patch: _Patch, h: _Hunk, pos: int, cur_final: list[int | None],
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
        want = ch.patch.feature
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
        for start, end in _runs(sorted(set(nums))):
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


def _runs(nums: list[int]) -> list[tuple[int, int]]:
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


# ---- best-effort audit from the hunks alone


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
            changes.extend(_merge_gap_states(hunk_changes, patch.feature))
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


# --------------------------------------------------------------------------- fix


def unsafe_insert_points(path: str, lines: Sequence[str]) -> dict[int, str]:
    """Where a comment line cannot be inserted: {p: why}, p = insert before line p (1-based)."""
    name = Path(path).name
    if name.endswith(_SLASH_SUFFIXES):
        return _c_unsafe(lines)
    if name.endswith((".py", ".pyi")):
        return _py_unsafe(lines)
    if name == "CMakeLists.txt" or name.endswith(".cmake"):
        return _cmake_unsafe(lines)
    if name.endswith((".sh", ".bash")):
        return _sh_unsafe(lines)
    if name.endswith((".yml", ".yaml")):
        return _yaml_unsafe(lines)
    return {}


_RAW_PREFIX_RE = re.compile(r"(?<![A-Za-z0-9_])(?:u8|u|U|L)?R$")


def _c_unsafe(lines: Sequence[str]) -> dict[int, str]:
    unsafe: dict[int, str] = {}
    comment = False
    raw: str | None = None             # closing sequence of an open raw string
    quote: str | None = None           # open "..." or '...' continued by a backslash
    directive = False
    for t, line in enumerate(lines, 1):
        body = line.rstrip("\r")
        if not comment and raw is None and quote is None and not directive:
            directive = body.lstrip().startswith("#")
        j, n = 0, len(body)
        while j < n:
            if comment:
                k = body.find("*/", j)
                if k < 0:
                    j = n
                else:
                    comment, j = False, k + 2
                continue
            if raw is not None:
                k = body.find(raw, j)
                if k < 0:
                    j = n
                else:
                    j, raw = k + len(raw), None
                continue
            c = body[j]
            if quote is not None:
                if c == "\\":
                    j += 2
                    continue
                if c == quote:
                    quote = None
                j += 1
                continue
            if body.startswith("//", j):
                break
            if body.startswith("/*", j):
                comment, j = True, j + 2
                continue
            if c == '"':
                if _RAW_PREFIX_RE.search(body[:j]):
                    k = body.find("(", j + 1)
                    if k >= 0:
                        raw = ")" + body[j + 1:k] + '"'
                        j = k + 1
                        continue
                quote, j = '"', j + 1
                continue
            if c == "'":
                word = re.search(r"[A-Za-z0-9_]+$", body[:j])
                if word and word.group(0)[0].isdigit():    # digit separator: 1'000
                    j += 1
                    continue
                quote, j = "'", j + 1
                continue
            j += 1
        continued = body.endswith("\\")
        if comment:
            unsafe[t + 1] = "inside a multi-line C comment"
        elif raw is not None:
            unsafe[t + 1] = "inside a raw string literal"
        elif continued and quote is not None:
            unsafe[t + 1] = "inside a string literal"
        elif continued and directive:
            unsafe[t + 1] = "inside a multi-line macro (line continuation)"
        elif continued:
            unsafe[t + 1] = "on a line continuation"
        if not continued:
            quote = None
            directive = False
    return unsafe


def _py_unsafe(lines: Sequence[str]) -> dict[int, str]:
    unsafe: dict[int, str] = {}
    triple: str | None = None
    for t, line in enumerate(lines, 1):
        body = line.rstrip("\r")
        j, n = 0, len(body)
        quote: str | None = None
        in_comment = False
        while j < n:
            c = body[j]
            if triple is not None:
                if c == "\\":
                    j += 2
                    continue
                if body.startswith(triple, j):
                    j, triple = j + 3, None
                else:
                    j += 1
                continue
            if quote is not None:
                if c == "\\":
                    j += 2
                    continue
                if c == quote:
                    quote = None
                j += 1
                continue
            if c == "#":
                in_comment = True
                break
            if c in "\"'":
                if body.startswith(c * 3, j):
                    triple, j = c * 3, j + 3
                else:
                    quote, j = c, j + 1
                continue
            j += 1
        if triple is not None:
            unsafe[t + 1] = "inside a string literal (triple-quoted)"
        elif body.endswith("\\") and quote is not None:
            unsafe[t + 1] = "inside a string literal"
        elif body.endswith("\\") and not in_comment:
            unsafe[t + 1] = "on a line continuation"
    return unsafe


def _cmake_unsafe(lines: Sequence[str]) -> dict[int, str]:
    unsafe: dict[int, str] = {}
    state: str | None = None          # None, '"', or the closing bracket "]==]"
    is_comment = False
    for t, line in enumerate(lines, 1):
        body = line.rstrip("\r")
        j, n = 0, len(body)
        while j < n:
            c = body[j]
            if state == '"':
                if c == "\\":
                    j += 2
                    continue
                if c == '"':
                    state = None
                j += 1
                continue
            if state is not None:
                k = body.find(state, j)
                if k < 0:
                    j = n
                else:
                    j, state = k + len(state), None
                continue
            m = re.match(r"\[(=*)\[", body[j + 1:]) if c == "#" else None
            if c == "#" and m:
                state, is_comment, j = "]" + m.group(1) + "]", True, j + 1 + m.end()
                continue
            if c == "#":
                break
            if c == '"':
                state, j = '"', j + 1
                continue
            m = re.match(r"\[(=*)\[", body[j:]) if c == "[" else None
            if m:
                state, is_comment, j = "]" + m.group(1) + "]", False, j + m.end()
                continue
            j += 1
        if state == '"':
            unsafe[t + 1] = "inside a string literal (quoted argument)"
        elif state is not None:
            unsafe[t + 1] = "inside a bracket comment" if is_comment else "inside a bracket argument"
    return unsafe


def _sh_unsafe(lines: Sequence[str]) -> dict[int, str]:
    unsafe: dict[int, str] = {}
    quote: str | None = None
    heredocs: list[tuple[str, bool]] = []
    in_heredoc: tuple[str, bool] | None = None
    for t, line in enumerate(lines, 1):
        body = line.rstrip("\r")
        if in_heredoc is not None:
            delim, strip_tabs = in_heredoc
            if (body.lstrip("\t") if strip_tabs else body) == delim:
                in_heredoc = heredocs.pop(0) if heredocs else None
            if in_heredoc is not None:
                unsafe[t + 1] = "inside a here-document"
            continue
        j, n = 0, len(body)
        while j < n:
            c = body[j]
            if quote is not None:
                if c == "\\" and quote == '"':
                    j += 2
                    continue
                if c == quote:
                    quote = None
                j += 1
                continue
            if c == "\\":
                j += 2
                continue
            if c == "#" and (j == 0 or body[j - 1] in " \t;|&("):
                break
            if c in "\"'":
                quote, j = c, j + 1
                continue
            m = re.match(r"<<(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2", body[j:]) if c == "<" else None
            if m:
                heredocs.append((m.group(3), m.group(1) == "-"))
                j += m.end()
                continue
            j += 1
        if quote is not None:
            unsafe[t + 1] = "inside a string literal"
        elif heredocs:
            in_heredoc = heredocs.pop(0)
            unsafe[t + 1] = "inside a here-document"
        elif body.endswith("\\"):
            unsafe[t + 1] = "on a line continuation"
    return unsafe


def _yaml_unsafe(lines: Sequence[str]) -> dict[int, str]:
    unsafe: dict[int, str] = {}
    block_indent: int | None = None
    for t, line in enumerate(lines, 1):
        body = line.rstrip("\r")
        indent = len(body) - len(body.lstrip(" "))
        if block_indent is not None:
            if not body.strip() or indent > block_indent:
                unsafe[t] = "inside a YAML block scalar"
                continue
            block_indent = None
        if re.search(r"(?:^|:\s|^\s*-\s)\s*[|>][0-9+-]*\s*(?:#.*)?$", body):
            block_indent = indent
    return unsafe


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


def _fix_runs(path: str, lines: list[str], changed: Mapping[int, str], scan: _Scan
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
    for s, e in _runs(sorted(targets)):
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
            final_newline = _read_text(target).endswith("\n") or not new
            text = "\n".join(new) + ("\n" if final_newline else "")
            target.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    result.report = audit(patches, tree, wanted) if written and not dry_run else report
    return result


# --------------------------------------------------------------------------- output


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

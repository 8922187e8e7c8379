"""Marker-aware conflict resolution for ``rebase`` (and ``apply --3way``): the conflict blocks of a
3-way merge (diff3 style: ours = the new upstream, base = the old upstream, theirs = the old upstream
with our patch) that can be resolved mechanically, each by a named rule; everything else stays a
conflict for a person.

A block is resolved only when every change our patch made in it (base -> theirs) is

- inside an ``UPSTREAM_SYNC(<feature>): begin`` / ``end`` region (the marker lines included), or
- a known count line (``rule_count``: ``GGML_OP_COUNT == N`` static asserts, the RPC protocol
  version) whose number our patch moved by a fixed amount;

and each change finds its place in upstream's new text (ours):

- ``marker-region``: an inserted region goes before the base line that followed it (found in ours),
  else at the end of the block when it ended the block, else after the base line before it, else at
  the block's start when it started it; so a region at the end of a list (the op enum, the op name
  and symbol tables) stays at the end when upstream appended to the list;
- ``marker-region-replace``: a region that replaced base lines replaces them in ours when upstream
  left them as they were;
- ``marker-region-line-merge``: a region that replaced one base line upstream edited too (a call site
  our patch extends by an argument) gets upstream's new line with our token edits merged in, when the
  two edits are apart (not the same nor adjacent tokens);
- ``marker-region-moved``: a region inserted between two upstream lines that upstream moved out of the
  block (a source list upstream dropped here and lists elsewhere: ``set(LLAMA_CORE_SOURCES ...)`` ->
  ``add_library(llama ...)``) goes between the same two lines where they now stand adjacent, exactly once
  in the file outside any conflict block, re-indented like them; the block takes upstream's text;
- ``count``: a region (or a bare line) that replaced a count line replaces upstream's new count line,
  its numbers recomputed: upstream's number plus what our patch added (``static_assert(GGML_OP_COUNT
  == 101)`` -> ``103`` on a base where upstream has ``102`` becomes ``104``).

Anything else (a change outside any region, base lines upstream changed too, an anchor not found or
found twice in the wrong order) leaves the block as it was, conflict markers and all.

Placed right is not yet correct: a region whose code names something the old upstream file has and
the new one has not (``use_kv_cur`` in ``build_attn``, ``gf_res_prev_active`` in ``llama-context.cpp``:
the region was written against code upstream does not have there) is left too (``gone_names``), when
the caller hands over the two upstream versions of the file (``rebase`` does): that is a port. A name
the new file lost but the new tree still has (``int32_t``, a ggml API function) does not count, when
the caller also says which names the new tree knows (``rebase``: ``git grep`` of its HEAD).

The same test for what no rule sees (``names-clean-merge``, ``check_added_regions``): after a patch
applied exactly, merged cleanly or had its blocks resolved, ``rebase`` hands over each file the patch
touched with the lines it added; a marked region holding added lines whose code names what the old
upstream file has, the new one has not and the new tree has nowhere is flagged (the ``use_kv_cur``
line of the iSWA ``build_attn``: git's own clean 3-way merge of a hunk). A fork-only file (``file``
marker) has no upstream file: there the old upstream *headers* (what it can include) stand for it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..stack.hunks import find_nearest
from .syntax import FILE_MARKER_LINES, comment_prefix, parse_marker, scan_markers

OURS, BASE, SEP, THEIRS = "<<<<<<< ", "||||||| ", "=======", ">>>>>>> "

# count lines: (rule name, pattern a line must match); their numbers are recomputed
COUNT_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("op-count-assert", re.compile(r"\bstatic_assert\s*\(\s*\w+_COUNT\s*==\s*\d+")),
    ("rpc-proto-version", re.compile(r"^\s*#\s*define\s+RPC_PROTO_\w+_VERSION\s+\d+\s*$")),
)
NUMBER_RE = re.compile(r"\d+")
NAME_RE = re.compile(r"[A-Za-z_]\w*")
STRING_RE = re.compile(r'"(?:\\.|[^"\\])*"')
NAMES_CLEAN_RULE = "names-clean-merge"  # a marked region git merged cleanly names what is gone


@dataclass
class Block:
    """One conflict block of a diff3-style merge, and where it stands in the merged text."""

    ours: list[str]
    base: list[str]
    theirs: list[str]
    start: int           # index of its ``<<<<<<<`` line in the merged lines
    end: int             # index after its ``>>>>>>>`` line
    open_before: bool = False  # a marked region is open (on the theirs side) where the block starts


@dataclass
class Resolved:
    file: str
    lines: str           # "A-B" in the resolved file (1-based; "A-A" for one line, "A" for none)
    rules: list[str]
    detail: str = ""


@dataclass
class Left:
    file: str
    lines: str           # where the conflict block stands in the file written (1-based)
    why: str


@dataclass
class FileResolution:
    text: str
    resolved: list[Resolved] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"resolved": [asdict(r) for r in self.resolved], "left": [asdict(x) for x in self.left]}


class Unresolvable(Exception):
    """A rule cannot resolve the block (the reason goes to the report)."""


# -- parsing -----------------------------------------------------------------------------------


def parse_blocks(lines: Sequence[str]) -> list[Block]:
    """The diff3-style conflict blocks of ``lines`` (a block without a base section has none)."""
    blocks: list[Block] = []
    i = 0
    open_region = False
    while i < len(lines):
        if not lines[i].startswith(OURS):
            open_region = _region_state(open_region, lines[i])
            i += 1
            continue
        start = i
        parts: dict[str, list[str]] = {"ours": [], "base": [], "theirs": []}
        part = "ours"
        i += 1
        while i < len(lines) and not lines[i].startswith(THEIRS):
            if lines[i].startswith(BASE) and part == "ours":
                part = "base"
            elif lines[i] == SEP and part in ("ours", "base"):
                part = "theirs"
            else:
                parts[part].append(lines[i])
            i += 1
        if i >= len(lines):
            break  # unterminated: not a conflict block
        blocks.append(Block(parts["ours"], parts["base"], parts["theirs"], start, i + 1, open_region))
        for ln in parts["theirs"]:
            open_region = _region_state(open_region, ln)
        i += 1
    return blocks


def _region_state(open_region: bool, line: str) -> bool:
    mk = parse_marker(line)
    if mk is None or mk.kind == "file":
        return open_region
    return mk.kind == "begin"


def marked_mask(lines: Sequence[str], open_before: bool = False) -> list[bool]:
    """Per line: inside a marked region (its begin and end lines included)."""
    mask: list[bool] = []
    inside = open_before
    for ln in lines:
        mk = parse_marker(ln)
        if mk is not None and mk.kind == "begin":
            inside = True
            mask.append(True)
        elif mk is not None and mk.kind == "end":
            mask.append(True)
            inside = False
        else:
            mask.append(inside)
    return mask


# -- names -------------------------------------------------------------------------------------


def code_names(path: str, lines: Sequence[str]) -> set[str]:
    """The identifiers in the code of ``lines`` (string literals and line comments left out)."""
    prefix = comment_prefix(path)
    names: set[str] = set()
    for ln in lines:
        code = STRING_RE.sub('""', ln)
        if prefix:
            code = code.split(prefix, 1)[0]
        names.update(NAME_RE.findall(code))
    return names


def gone_names(path: str, old_upstream: str, new_upstream: str) -> set[str]:
    """Identifiers the old upstream file has and the new one has not."""
    return code_names(path, old_upstream.split("\n")) - code_names(path, new_upstream.split("\n"))


def named_gone(path: str, lines: Sequence[str], gone: set[str],
               known: Callable[[str], bool] | None = None) -> list[str]:
    """The names of ``gone`` the code of ``lines`` names (marker lines left out), sorted; with
    ``known``, only those the new tree does not have anywhere either."""
    content = [ln for ln in lines if parse_marker(ln) is None]
    return [h for h in sorted(code_names(path, content) & gone) if known is None or not known(h)]


def names_why(hits: Sequence[str], where: str = "upstream's new file does not have") -> str:
    return f"our region names {', '.join(repr(h) for h in hits)}, which {where} (a port)"


def check_names(path: str, lines: Sequence[str], gone: set[str],
                known: Callable[[str], bool] | None = None) -> None:
    """Unresolvable when the code of a region placed in upstream's new text names what it lost (and,
    with ``known``, what the new tree does not have anywhere)."""
    hits = named_gone(path, lines, gone, known)
    if hits:
        raise Unresolvable(names_why(hits))


def added_regions(lines: Sequence[str], added: Sequence[int]
                  ) -> tuple[list[tuple[int, int, list[int]]], bool]:
    """The marked regions of a file that hold lines of ``added`` (1-based): (first line, last line,
    the added lines in it) each; and whether the file is fork-only (a ``file`` marker in its first
    lines: the whole file is one region)."""
    scan = scan_markers(lines, upstream=False)
    fork = any(m.kind == "file" and m.line <= FILE_MARKER_LINES for m in scan.markers)
    last = len(lines) - 1 if lines and lines[-1] == "" else len(lines)
    spans = [(1, last)] if fork else [(b, e) for b, e, _ in scan.regions]
    out = []
    for b, e in spans:
        mine = [k for k in added if b <= k <= e]
        if mine:
            out.append((b, e, mine))
    return out, fork


def check_added_regions(path: str, text: str, added: Sequence[int], old_upstream: str | None,
                        new_upstream: str | None, known: Callable[[Iterable[str]], set[str]],
                        old_known: Callable[[Iterable[str]], set[str]]) -> list[dict[str, Any]]:
    """``names-clean-merge``: the marked regions of ``text`` (a file as a patch left it, however it got
    there) whose added lines name what the old upstream file has, the new one has not and the new
    tree (``known``: which of some names it has) has nowhere: the names rule's test, on what git
    merged with no conflict. In a fork-only file, what the old upstream headers (``old_known``) have
    stand for the old file. Each flagged region is a dict: ``file``, ``lines`` (its span, 1-based), ``names``,
    ``rule``, ``why`` (``stack.rebase.NamesCheck``)."""
    lines = text.split("\n")
    regions, fork = added_regions(lines, added)
    if not regions or not fork and (old_upstream is None or new_upstream is None):
        return []
    gone = set() if fork else gone_names(path, old_upstream or "", new_upstream or "")
    flagged: list[dict[str, Any]] = []
    for first, last, mine in regions:
        content = [lines[k - 1] for k in mine if k <= len(lines)]
        # the names of its code the old side has (a fork-only file: all, then the old headers are asked)
        candidates = named_gone(path, content, code_names(path, content) if fork else gone)
        new_has = known(candidates)
        hits = [h for h in candidates if h not in new_has]
        if fork:
            old_has = old_known(hits)
            hits = [h for h in hits if h in old_has]
            why = names_why(hits, "the old upstream headers have and the new tree has nowhere")
        else:
            why = names_why(hits, "the old upstream file has, and neither the new upstream file nor the new "
                                  "tree has")
        if hits:
            flagged.append({"file": path, "lines": f"{first}-{last}", "names": hits, "rule": NAMES_CLEAN_RULE,
                            "why": f"{why}; in what the step merged, which no conflict rule judges"})
    return flagged


# -- rules -------------------------------------------------------------------------------------


def count_rule(line: str) -> str | None:
    """The count rule a line falls under, or None."""
    return next((name for name, pat in COUNT_PATTERNS if pat.search(line)), None)


def masked(line: str) -> str:
    return NUMBER_RE.sub("#", line)


def recount(theirs: str, base: str, ours: str) -> str:
    """``theirs`` (a count line our patch wrote in place of ``base``) with each number moved by what
    upstream moved it: theirs + (ours - base), number by number."""
    b, o = [int(x) for x in NUMBER_RE.findall(base)], [int(x) for x in NUMBER_RE.findall(ours)]
    if masked(base) != masked(ours) or len(b) != len(o):
        raise Unresolvable(f"count line {ours.strip()!r} does not have the shape of {base.strip()!r}")
    if masked(theirs) != masked(base):
        raise Unresolvable(f"count line {theirs.strip()!r} does not have the shape of {base.strip()!r}")
    numbers = iter(int(t) + (ov - bv) for t, bv, ov in zip(NUMBER_RE.findall(theirs), b, o, strict=True))
    return NUMBER_RE.sub(lambda _: str(next(numbers)), theirs)


@dataclass
class Change:
    """One change our patch made in a block: base[i1:i2] became theirs[j1:j2]."""

    i1: int
    i2: int
    new: list[str]


def our_changes(block: Block) -> list[Change]:
    """Our patch's changes in the block; Unresolvable when one is not marked and not a count line."""
    mask = marked_mask(block.theirs, block.open_before)
    changes: list[Change] = []
    sm = difflib.SequenceMatcher(None, block.base, block.theirs, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        new = block.theirs[j1:j2]
        unmarked = [ln for ln, m in zip(new, mask[j1:j2], strict=True) if not m]
        counts_only = (i2 - i1 == j2 - j1 and all(count_rule(ln) for ln in unmarked)
                       and all(count_rule(ln) for ln in block.base[i1:i2]))
        if unmarked and not counts_only:
            raise Unresolvable(f"our change {unmarked[0].strip()!r} is outside any UPSTREAM_SYNC region")
        if i2 > i1 and not new:
            raise Unresolvable(f"our patch deletes upstream line {block.base[i1].strip()!r} "
                               "with no marked region in its place")
        changes.append(Change(i1, i2, new))
    return changes


Placer = Callable[[Block, Change, int, int], tuple[int, int, list[str], str]]


def rule_marker_region(block: Block, ch: Change, lo: int, drift: int) -> tuple[int, int, list[str], str]:
    """An inserted region: before the base line that followed it, at the end of the block when it
    ended it, after the base line before it, at the start when it started it."""
    base, ours = block.base, block.ours
    if ch.i1 < len(base):
        at = _find_one(ours, base[ch.i1], ch.i1 + drift, lo)
        if at is not None:
            return at, at, ch.new, f"before {base[ch.i1].strip()!r}"
    else:
        return len(ours), len(ours), ch.new, "at the end of the block"
    if ch.i1 > 0:
        at = _find_one(ours, base[ch.i1 - 1], ch.i1 - 1 + drift, lo)
        if at is not None:
            return at + 1, at + 1, ch.new, f"after {base[ch.i1 - 1].strip()!r}"
    else:
        return lo, lo, ch.new, "at the start of the block"
    raise Unresolvable(f"no anchor for a marked region: upstream changed both {base[ch.i1 - 1].strip()!r} "
                       f"and {base[ch.i1].strip()!r}")


def rule_orphan_region(block: Block, ch: Change, lo: int, drift: int) -> tuple[int, int, list[str], str]:
    """An inserted region whose neighbours upstream deleted (upstream code it sat among is gone): it
    goes where that code was, only when it stood at nesting depth 0 of the deleted code (balanced
    brackets before and after it), so the deletion did not take away what encloses the region (a
    source list inside a deleted ``set(...)`` stays a conflict)."""
    sm = difflib.SequenceMatcher(None, block.base, block.ours, autojunk=False)
    for tag, a1, a2, b1, _b2 in sm.get_opcodes():
        if tag == "delete" and a1 <= ch.i1 <= a2 and b1 >= lo:
            before, after = _depths(block.base[a1:ch.i1]), _depths(block.base[ch.i1:a2])
            if before == (0, 0) and after == (0, 0):
                return b1, b1, ch.new, f"where upstream's {a2 - a1} deleted line(s) were"
            raise Unresolvable("a marked region inside upstream code that upstream deleted")
    raise Unresolvable("no anchor for a marked region: upstream changed the lines around it")


BRACKETS = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}


def _depths(lines: Sequence[str]) -> tuple[int, int]:
    """(depth at the end, lowest depth on the way) of the brackets in ``lines`` (0, 0: balanced and
    never closing what was opened before them)."""
    depth = low = 0
    for ln in lines:
        code = ln.split("//", 1)[0]
        for c in code:
            depth += BRACKETS.get(c, 0)
            low = min(low, depth)
    return depth, low


def rule_region_replace(block: Block, ch: Change, lo: int, drift: int) -> tuple[int, int, list[str], str]:
    """A region that replaced base lines upstream left as they were."""
    old = block.base[ch.i1:ch.i2]
    at = find_nearest(block.ours, old, ch.i1 + drift, lo)
    if at is None:
        raise Unresolvable(f"upstream changed {old[0].strip()!r}, which our patch replaces")
    return at, at + len(old), ch.new, f"replaces {len(old)} unchanged upstream line(s)"


TOKEN_RE = re.compile(r"\w+|\s+|.")


def merge_line(base: str, ours: str, theirs: str) -> str:
    """The 3-way merge of one line, token by token (identifiers, numbers, runs of blanks, single
    characters): upstream's edits (base -> ours) and our patch's (base -> theirs) both applied;
    Unresolvable when they touch the same or adjacent tokens (an insertion at the same point
    included), so only edits that are clearly apart are merged."""
    a, b, c = (TOKEN_RE.findall(x) for x in (base, ours, theirs))

    def edits(new: list[str]) -> list[tuple[int, int, list[str]]]:
        sm = difflib.SequenceMatcher(None, a, new, autojunk=False)
        return [(i1, i2, new[j1:j2]) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"]

    up, our = edits(b), edits(c)
    for i1, i2, _ in up:
        for k1, k2, _ in our:
            if max(i1, k1) <= min(i2, k2):
                both = "".join(a[min(i1, k1):max(i2, k2)]).strip()
                raise Unresolvable(f"upstream and our patch both edit {both!r} in {base.strip()!r}")
    out: list[str] = []
    at = 0
    for i1, i2, new in sorted(up + our, key=lambda e: e[0]):
        out += a[at:i1] + new
        at = i2
    return "".join(out + a[at:])


def rule_line_merge(block: Block, ch: Change, lo: int, drift: int) -> tuple[int, int, list[str], str]:
    """A region that replaced one upstream line (a call site our patch extends) that upstream edited
    too: upstream's new line with our token edits merged into it (``merge_line``), in the region."""
    old = block.base[ch.i1:ch.i2]
    content = [k for k, ln in enumerate(ch.new) if parse_marker(ln) is None]
    if len(old) != 1 or len(content) != 1:
        raise Unresolvable(f"upstream changed {old[0].strip() if old else ''!r}, which our patch replaces")
    sm = difflib.SequenceMatcher(None, block.base, block.ours, autojunk=False)
    for tag, a1, a2, b1, b2 in sm.get_opcodes():
        if tag != "replace" or not a1 <= ch.i1 < a2 or b1 < lo:
            continue
        if a2 - a1 == b2 - b1:
            at = b1 + ch.i1 - a1  # as many lines on both sides: the line at the same offset
        else:
            ratios = [difflib.SequenceMatcher(None, old[0], ln, autojunk=False).ratio()
                      for ln in block.ours[b1:b2]]
            best = max(ratios)
            if best < 0.6 or ratios.count(best) != 1:
                break
            at = b1 + ratios.index(best)
        new = list(ch.new)
        new[content[0]] = merge_line(old[0], block.ours[at], ch.new[content[0]])
        return at, at + 1, new, (f"our edit of {old[0].strip()!r} merged into upstream's "
                                 f"{block.ours[at].strip()!r}")
    raise Unresolvable(f"upstream changed {old[0].strip()!r}, which our patch replaces, beyond recognition")


def rule_count(block: Block, ch: Change, lo: int, drift: int) -> tuple[int, int, list[str], str]:
    """Count lines our patch rewrote that upstream rewrote too: upstream's numbers plus ours."""
    old = block.base[ch.i1:ch.i2]
    if not old or not all(count_rule(ln) for ln in old):
        raise Unresolvable(f"upstream changed {old[0].strip() if old else ''!r}, which our patch replaces")
    key = [masked(ln) for ln in old]
    ours_keys = [masked(ln) for ln in block.ours]
    at = find_nearest(ours_keys, key, ch.i1 + drift, lo)
    if at is None:
        raise Unresolvable(f"upstream has no count line like {old[0].strip()!r} any more")
    new = list(ch.new)
    shown = []
    for k, b_line in enumerate(old):
        o_line = block.ours[at + k]
        hits = [j for j, t in enumerate(new) if masked(t) == masked(b_line) and count_rule(t)]
        if len(hits) != 1:
            raise Unresolvable(f"cannot tell which of our lines counts {b_line.strip()!r}")
        new[hits[0]] = recount(new[hits[0]], b_line, o_line)
        shown.append(f"{(count_rule(b_line))}: {NUMBER_RE.findall(new[hits[0]])[0]}")
    return at, at + len(old), new, "; ".join(shown)


def _find_one(lines: Sequence[str], line: str, hint: int, lo: int) -> int | None:
    return find_nearest(lines, [line], hint, lo)


def _splice(ours: list[str], edits: Sequence[tuple[int, int, list[str]]]) -> list[str]:
    """``ours`` with each (a, b, new) edit (in order, not overlapping) putting ``new`` for ours[a:b]."""
    out: list[str] = []
    at = 0
    for a, b, new in edits:
        out += ours[at:a] + new
        at = b
    return out + ours[at:]


def _place(placers: Sequence[tuple[str, Placer]], block: Block, ch: Change, lo: int,
           drift: int) -> tuple[str, tuple[int, int, list[str], str]]:
    """The first rule that places the change: (its name, where and what); else every rule's reason."""
    why: list[str] = []
    for name, placer in placers:
        try:
            return name, placer(block, ch, lo, drift)
        except Unresolvable as exc:
            if str(exc) not in why:
                why.append(str(exc))
    raise Unresolvable("; ".join(why))


def resolve_block(block: Block, path: str = "", gone: set[str] | None = None,
                  known: Callable[[str], bool] | None = None) -> tuple[list[str], list[str], str]:
    """(resolved lines, rule names, detail) of a block; Unresolvable when no rule applies, or when a
    placed region names one of ``gone`` (identifiers upstream's new file lost)."""
    changes = our_changes(block)
    if not changes:
        return list(block.ours), ["upstream-only"], "our patch changes nothing here"
    out = list(block.ours)
    edits: list[tuple[int, int, list[str]]] = []
    rules: list[str] = []
    details: list[str] = []
    lo = drift = 0
    for ch in changes:
        if ch.i1 == ch.i2:
            placers: tuple[tuple[str, Placer], ...] = (("marker-region", rule_marker_region),
                                                       ("marker-region-orphan", rule_orphan_region))
        else:
            placers = (("marker-region-replace", rule_region_replace), ("count", rule_count),
                       ("marker-region-line-merge", rule_line_merge))
        name, (a, b, new, detail) = _place(placers, block, ch, lo, drift)
        if gone:
            check_names(path, new, gone, known)
        if a < lo:
            raise Unresolvable("our changes land out of order in upstream's new text")
        edits.append((a, b, new))
        if name not in rules:
            rules.append(name)
        details.append(detail)
        lo, drift = b, b - ch.i2
    return _splice(out, edits), rules, "; ".join(details)


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def relocate_block(block: Block, lines: Sequence[str], outside: Sequence[bool]) -> tuple[int, list[str], str]:
    """``marker-region-moved``: (index of the line the region goes after, the region re-indented,
    detail) for a block whose one change is a region inserted between two upstream lines that stand
    adjacent exactly once in the file outside the conflict blocks; Unresolvable otherwise."""
    changes = our_changes(block)
    if len(changes) != 1 or changes[0].i1 != changes[0].i2 or not 0 < changes[0].i1 < len(block.base):
        raise Unresolvable("not one region between two upstream lines")
    ch = changes[0]
    prev, nxt = block.base[ch.i1 - 1], block.base[ch.i1]
    if not prev.strip() or not nxt.strip():
        raise Unresolvable("a neighbour of the region is a blank line")
    hits = [k for k in range(len(lines) - 1) if outside[k] and outside[k + 1]
            and lines[k].strip() == prev.strip() and lines[k + 1].strip() == nxt.strip()]
    if len(hits) != 1:
        raise Unresolvable(f"{prev.strip()!r} then {nxt.strip()!r} stand together {len(hits)} time(s) "
                           "outside the conflict blocks")
    k = hits[0]
    old, new = _indent(prev), _indent(lines[k])
    region = [new + ln[len(old):] if ln.startswith(old) else ln for ln in ch.new]
    return k, region, f"between {prev.strip()!r} and {nxt.strip()!r}, where upstream moved them"


def resolve_text(path: str, text: str, old_upstream: str | None = None, new_upstream: str | None = None,
                 known: Callable[[str], bool] | None = None) -> FileResolution:
    """Resolve what the rules can of a diff3-style merged file; the rest stays as it was. With both
    upstream versions of the file, a region that names what the new one lost is left (``check_names``)."""
    both = old_upstream is not None and new_upstream is not None
    gone = gone_names(path, old_upstream or "", new_upstream or "") if both else set()
    lines = text.split("\n")
    blocks = parse_blocks(lines)
    in_blocks = {k for block in blocks for k in range(block.start, block.end)}
    outside = [k not in in_blocks for k in range(len(lines))]
    # first pass: each block resolved in place, or by moving its region out (marker-region-moved)
    done: list[tuple[list[str], list[str], str] | Unresolvable] = []
    moved: dict[int, tuple[list[str], str]] = {}  # line index -> (region after it, detail)
    for block in blocks:
        try:
            done.append(resolve_block(block, path, gone, known))
        except Unresolvable as exc:
            try:
                k, region, detail = relocate_block(block, lines, outside)
                if k in moved:
                    raise Unresolvable("two regions move to the same place")
                if gone:
                    check_names(path, region, gone, known)
            except Unresolvable:
                done.append(exc)
            else:
                moved[k] = (region, detail)
                done.append((list(block.ours), ["marker-region-moved"], detail))
    out: list[str] = []
    result = FileResolution("")

    def copy(a: int, b: int) -> None:
        for k in range(a, b):
            out.append(lines[k])
            if k in moved:
                region, detail = moved[k]
                out.extend(region)
                result.resolved.append(Resolved(path, f"{len(out) - len(region) + 1}-{len(out)}",
                                                ["marker-region-moved"], detail))

    at = 0
    for block, outcome in zip(blocks, done, strict=True):
        copy(at, block.start)
        first = len(out) + 1
        if isinstance(outcome, Unresolvable):
            out += lines[block.start:block.end]
            result.left.append(Left(path, f"{first}-{len(out)}", str(outcome)))
        else:
            new, rules, detail = outcome
            out += new
            if rules != ["marker-region-moved"]:  # a moved region is listed where it went
                span = f"{first}-{len(out)}" if new else f"{first}"
                result.resolved.append(Resolved(path, span, rules, detail))
        at = block.end
    copy(at, len(lines))
    result.resolved.sort(key=lambda r: int(r.lines.split("-")[0]))
    result.text = "\n".join(out)
    return result


def resolve_conflicts(path: str, text: str, old_upstream: str | None = None, new_upstream: str | None = None,
                      known: Callable[[str], bool] | None = None
                      ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """The resolver ``rebase`` and ``apply --3way`` take (``stack.apply.Resolver``)."""
    result = resolve_text(path, text, old_upstream, new_upstream, known)
    data = result.as_dict()
    return result.text, data["resolved"], data["left"]

"""The in-memory applier: the hunks of one file's diff located in its lines and applied, forward or
in reverse, each line's origin carried along.

The one applier of the package (git only writes what it proved):

- ``check_exact`` (used by ``apply.py`` before ``git apply`` writes anything, for the series and for
  ``verify-identical --patch-file``): every hunk's old side must stand at exactly its stated line (no
  fuzz, no offset); the first that does not is named with its file, number, line and why.
- ``locate`` + ``apply_at`` in reverse (the marker audit, ``markers/audit.py``): the later patches of
  the series are taken off the tree's files so that each patch finds its own lines; marker lines are
  skipped and hunks are found near their stated line (the tree may carry markers the patches do not).

Lines are text: bytes decoded as UTF-8 with ``surrogateescape`` (lossless, so comparing the text
compares the bytes), split on ``\\n`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from .series import Hunk, Patch

T = TypeVar("T")
Side = Literal["old", "new"]
Skip = Callable[[str], bool] | None


def side_lines(hunk: Hunk, side: Side, skip: Skip = None) -> list[str]:
    """One side of a hunk: context and ``-`` lines (old) or context and ``+`` lines (new); lines that
    ``skip`` accepts are left out."""
    other = "+" if side == "old" else "-"
    return [text for tag, text in hunk.text_lines if tag != other and not (skip and skip(text))]


def stated_start(hunk: Hunk, side: Side) -> int:
    """0-based index of the side's first line, from the ``@@`` header (an empty side is *after* the
    line the header names)."""
    start, length = (hunk.old_start, hunk.old_len) if side == "old" else (hunk.new_start, hunk.new_len)
    return start - 1 if length else start


def find_nearest(lines: Sequence[str], needle: Sequence[str], hint: int, lo: int = 0) -> int | None:
    """Index of ``needle`` in ``lines`` at or after ``lo``, the occurrence nearest ``hint`` (of two as
    near, the earlier); an empty needle stands at ``hint`` (kept within ``lo`` and the end)."""
    n = len(needle)
    top = len(lines) - n
    if n == 0:
        return min(max(hint, lo), len(lines))
    if top < lo:
        return None
    hint = min(max(hint, lo), top)
    first = needle[0]
    for d in range(0, max(hint - lo, top - hint) + 1):
        for p in ((hint,) if d == 0 else (hint - d, hint + d)):
            if lo <= p <= top and lines[p] == first and list(lines[p:p + n]) == list(needle):
                return p
    return None


def locate(lines: Sequence[str], hunks: Sequence[Hunk], *, reverse: bool = False, exact: bool = True,
           skip: Skip = None) -> list[int | None]:
    """Where each hunk's *from* side (old; new with ``reverse``) stands in ``lines`` (None: not there).

    ``exact``: at its stated line only. Otherwise the occurrence nearest its stated line shifted by
    how far the previous hunk was found from its own, after the previous hunk.
    """
    side: Side = "new" if reverse else "old"
    out: list[int | None] = []
    drift = lo = 0
    for hunk in hunks:
        needle = side_lines(hunk, side, skip)
        start = stated_start(hunk, side)
        if exact:
            here = start <= len(lines) and list(lines[start:start + len(needle)]) == needle
            pos = start if here else None
        else:
            pos = find_nearest(lines, needle, start + drift, lo)
        out.append(pos)
        if pos is not None:
            drift, lo = pos - start, pos + len(needle)
    return out


@dataclass
class Applied(Generic[T]):
    lines: list[str]
    origins: list[T | None]  # per line: the origin it had before, None for a line a hunk brought in


def apply_at(lines: Sequence[str], hunks: Sequence[Hunk], positions: Sequence[int | None], *,
             reverse: bool = False, skip: Skip = None,
             origins: Sequence[T | None] | None = None) -> Applied[T]:
    """``lines`` with every hunk of a known position (``locate``) replaced by its other side: the new
    side, or the old one with ``reverse``. Hunks of position None are left out.

    ``origins`` (default: each line's index) go along with the lines a hunk keeps (its context) and
    the lines no hunk touches; the lines a hunk brings in get None.
    """
    src: list[T | None] = list(origins) if origins is not None else list(range(len(lines)))  # type: ignore[arg-type]
    dropped = "+" if reverse else "-"   # only on the from side: taken out
    out: list[str] = []
    out_origins: list[T | None] = []
    at = 0
    placed = [(p, h) for p, h in zip(positions, hunks, strict=True) if p is not None]
    for pos, hunk in sorted(placed, key=lambda ph: ph[0]):
        if pos < at:
            raise ValueError(f"hunk #{hunk.number} overlaps the hunk before it")
        out += lines[at:pos]
        out_origins += src[at:pos]
        j = pos
        for tag, text in hunk.text_lines:
            if skip and skip(text):
                continue
            if tag == " ":
                out.append(lines[j])
                out_origins.append(src[j])
                j += 1
            elif tag == dropped:
                j += 1
            else:
                out.append(text)
                out_origins.append(None)
        at = j
    out += lines[at:]
    out_origins += src[at:]
    return Applied(out, out_origins)


# -- exact applicability (no fuzz, no offset) --------------------------------------------------


@dataclass(frozen=True)
class HunkFailure:
    file: str
    hunk: int | None
    line: int | None
    reason: str


def text_of(data: bytes) -> list[str]:
    """A file's content as the applier's lines."""
    return data.decode("utf-8", "surrogateescape").split("\n")


def _shown(text: str) -> str:
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _first_difference(expected: str, got: str) -> str:
    pairs = enumerate(zip(expected, got, strict=False))
    col = next((k for k, (a, b) in pairs if a != b), min(len(expected), len(got)))
    return f" (they differ from column {col + 1})"


def _why(content: list[str], hunk: Hunk) -> str:
    """Why the old side of ``hunk`` is not at its stated line of ``content``."""
    pre = side_lines(hunk, "old")
    start = stated_start(hunk, "old")
    found = find_nearest(content, pre, start) if pre else None
    if found is not None:
        offset = found - start
        return (f"context found {abs(offset)} line(s) {'later' if offset > 0 else 'earlier'} "
                f"(line {found + 1}); refused: patches must apply exactly (no fuzz, no offset)")
    mismatch = next((k for k, ln in enumerate(pre)
                     if start + k >= len(content) or content[start + k] != ln), 0)
    expected = _shown(pre[mismatch]) if pre else ""
    at = start + mismatch
    got = _shown(content[at]) if at < len(content) else None
    found_text = (f"found {got!r}{_first_difference(expected, got)}" if got is not None
                  else "found the end of the file")
    return f"context does not match at line {at + 1}: expected {expected!r}, {found_text}"


def check_exact(patch: Patch, read: Callable[[str], bytes | None]) -> HunkFailure | None:
    """The first hunk of ``patch`` whose old side is not at exactly its stated line, or None.

    ``read(path)`` gives the current content of a file (None when absent).
    """
    for fp in patch.files:
        if fp.binary:
            continue
        if fp.old_path is None:
            if read(fp.new_path or "") is not None:
                return HunkFailure(fp.path, None, None, "the patch creates it but it already exists")
            continue
        data = read(fp.old_path)
        if data is None:
            return HunkFailure(fp.old_path, None, None, "the file does not exist")
        content = text_of(data)
        for hunk, pos in zip(fp.hunks, locate(content, fp.hunks), strict=True):
            if pos is None:
                return HunkFailure(fp.old_path, hunk.number, hunk.old_start, _why(content, hunk))
    return None

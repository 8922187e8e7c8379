"""UPSTREAM_SYNC marker syntax: what a marker line is, per file type, and the regions of a file."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

FILE_MARKER_LINES = 5


"""The `file` marker of a new file must be on one of its first this many lines."""


MARKER_RE = re.compile(
    r"^\s*(?://+|#+|/\*+|<!--|--|;+)\s*UPSTREAM_SYNC\((?P<feature>[^()\s]*)\)\s*:\s*"
    r"(?P<kind>begin|end|file)\b"
)


_FEATURE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


SLASH_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".inl", ".cu", ".cuh",
                   ".m", ".mm", ".metal", ".comp", ".glsl", ".cl", ".wgsl")


HASH_SUFFIXES = (".cmake", ".py", ".pyi", ".sh", ".bash", ".yml", ".yaml")


@dataclass(frozen=True)
class Marker:
    line: int           # 1-based
    kind: str           # begin | end | file
    feature: str
    valid_name: bool = True


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
    if name == "CMakeLists.txt" or name.endswith(HASH_SUFFIXES):
        return "#"
    if name.endswith(SLASH_SUFFIXES):
        return "//"
    return None


def marker_text(path: str, feature: str, kind: str, indent: str = "") -> str | None:
    prefix = comment_prefix(path)
    if prefix is None:
        return None
    return f"{indent}{prefix} UPSTREAM_SYNC({feature}): {kind}"


@dataclass
class Scan:
    """Markers of a whole file: regions, the open feature after each line, errors."""

    regions: list[tuple[int, int, str]]
    open_after: list[str | None]          # [t] = feature open after line t (t = 0..n)
    errors: list[tuple[int, str, str]]    # (line, kind, message)
    markers: list[Marker]


def scan_markers(lines: Sequence[str], upstream: bool = True) -> Scan:
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
    return Scan(regions, open_after, errors, markers)


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="surrogateescape")


def read_lines(path: Path) -> list[str] | None:
    """The lines of a text file split on "\\n" only (None when it is not a file)."""
    if not path.is_file():
        return None
    lines = read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines

"""Where a marker line may not go: per-language lexers (C/C++/CUDA, Python, CMake, shell, YAML)
finding the lines inside strings, raw strings, comments and line continuations.

Each lexer only knows how its spans open; ``skip_open`` (the one scanner core) walks every span to
its closer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from .syntax import SLASH_SUFFIXES


def unsafe_insert_points(path: str, lines: Sequence[str]) -> dict[int, str]:
    """Where a comment line cannot be inserted: {p: why}, p = insert before line p (1-based)."""
    name = Path(path).name
    if name.endswith(SLASH_SUFFIXES):
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


def skip_open(body: str, j: int, closer: str, escapes: bool = True) -> tuple[int, bool]:
    """The scanner core of every lexer: from ``j`` inside a span (string, comment, raw string,
    bracket argument) that ``closer`` ends, return (index after the closer, True), or
    (end of line, False) when the line ends first. ``escapes``: a backslash skips the next char."""
    n = len(body)
    while j < n:
        if escapes and body[j] == "\\":
            j += 2
        elif body.startswith(closer, j):
            return j + len(closer), True
        else:
            j += 1
    return n, False


def resume(body: str, j: int, closer: str, escapes: bool = True) -> tuple[int, str | None]:
    """Go on through an open span from ``j`` (:func:`skip_open`): (index after ``closer``, None), or (end of
    line, ``closer``) while the span stays open on the next line."""
    j, closed = skip_open(body, j, closer, escapes)
    return j, None if closed else closer


def numbered(lines: Sequence[str]) -> Iterator[tuple[int, str]]:
    """(line number from 1, the line without a carriage return): what every lexer walks."""
    for t, line in enumerate(lines, 1):
        yield t, line.rstrip("\r")


def _c_unsafe(lines: Sequence[str]) -> dict[int, str]:
    unsafe: dict[int, str] = {}
    comment = False
    raw: str | None = None             # closing sequence of an open raw string
    quote: str | None = None           # open "..." or '...' continued by a backslash
    directive = False
    for t, body in numbered(lines):
        if not comment and raw is None and quote is None and not directive:
            directive = body.lstrip().startswith("#")
        j, n = 0, len(body)
        while j < n:
            if comment:
                j, closed = skip_open(body, j, "*/", escapes=False)
                comment = not closed
                continue
            if raw is not None:
                j, raw = resume(body, j, raw, escapes=False)
                continue
            if quote is not None:
                j, quote = resume(body, j, quote)
                continue
            c = body[j]
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
    for t, body in numbered(lines):
        j, n = 0, len(body)
        quote: str | None = None
        in_comment = False
        while j < n:
            if triple is not None:
                j, triple = resume(body, j, triple)
                continue
            if quote is not None:
                j, quote = resume(body, j, quote)
                continue
            c = body[j]
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
    for t, body in numbered(lines):
        j, n = 0, len(body)
        while j < n:
            if state is not None:  # a quoted argument ('"', escapes) or a bracket one ("]==]")
                j, closed = skip_open(body, j, state, escapes=state == '"')
                state = None if closed else state
                continue
            c = body[j]
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
    for t, body in numbered(lines):
        if in_heredoc is not None:
            delim, strip_tabs = in_heredoc
            if (body.lstrip("\t") if strip_tabs else body) == delim:
                in_heredoc = heredocs.pop(0) if heredocs else None
            if in_heredoc is not None:
                unsafe[t + 1] = "inside a here-document"
            continue
        j, n = 0, len(body)
        while j < n:
            if quote is not None:
                j, closed = skip_open(body, j, quote, escapes=quote == '"')
                quote = None if closed else quote
                continue
            c = body[j]
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
    for t, body in numbered(lines):
        indent = len(body) - len(body.lstrip(" "))
        if block_indent is not None:
            if not body.strip() or indent > block_indent:
                unsafe[t] = "inside a YAML block scalar"
                continue
            block_indent = None
        if re.search(r"(?:^|:\s|^\s*-\s)\s*[|>][0-9+-]*\s*(?:#.*)?$", body):
            block_indent = indent
    return unsafe

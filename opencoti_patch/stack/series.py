"""The patch series: ``patches/series`` (order) and the ``NNNN-name.patch`` files (header + diff).

Patch file format (git format-patch style, deterministic)::

    From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
    From: Name <email>
    Subject: [PATCH] subject line

    Free-form description.

    Upstream-Status: Pending | Submitted [url] | Inappropriate [why] | Backport [url]
    Feature: sparse-attn (--sparse-attn, default off)
    Test: markers
    Test: test-backend-ops -o SPARSE_ATTN_FILL
    Patch-Filename: 0001-name.patch
    ---
    diff --git a/path b/path
    index <full blob id>..<full blob id> <mode>
    ...

The diff is parsed here (files, hunks, paths) so that a patch writing outside the tree is refused
before git sees it; ``hunks.py`` (the in-memory applier) then proves every hunk applies *exactly*
(no fuzz, no offset) or names its file, number and line.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..config import require_patches_dir
from ..errors import OpencotiError
from ..report import render
from ..safe_extract import link_escapes

NAME_RE = re.compile(r"^(\d{4})-([A-Za-z0-9][A-Za-z0-9._+-]*)\.patch$")
HUNK_RE = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
FIELD_RE = re.compile(r"^(Upstream-Status|Feature|Test|Patch-Filename):[ \t]*(.*)$")
INDEX_RE = re.compile(r"^index [0-9a-f]+\.\.[0-9a-f]+(?: ([0-7]{6}))?$")
LINK_MODE = "120000"
DEFAULT_UPSTREAM_STATUS = "Inappropriate [opencoti fork]"
DEFAULT_FEATURE = "none (always on)"


class CorruptPatch(OpencotiError):
    pass


@dataclass(frozen=True)
class Hunk:
    number: int  # 1-based, within its file
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[bytes, ...]  # with their ' ', '-', '+' prefix; no line terminators

    @cached_property
    def text_lines(self) -> tuple[tuple[str, str], ...]:
        """(' ' | '-' | '+', text) per line, the text decoded (undecodable bytes kept as escapes)."""
        return tuple((ln[:1].decode() or " ", ln[1:].decode("utf-8", errors="surrogateescape"))
                     for ln in self.lines)

    def new_side(self) -> list[tuple[int, str, str]]:
        """(line number in the new file, tag, text) of the context and added lines."""
        out: list[tuple[int, str, str]] = []
        n = self.new_start
        for tag, text in self.text_lines:
            if tag != "-":
                out.append((n, tag, text))
                n += 1
        return out


@dataclass
class FilePatch:
    old_path: str | None  # None: file created
    new_path: str | None  # None: file deleted
    binary: bool = False
    hunks: list[Hunk] = field(default_factory=list)
    old_mode: str | None = None  # git modes as the diff states them (None: not stated)
    new_mode: str | None = None

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


@dataclass(frozen=True)
class PatchHeader:
    subject: str
    author: str = ""
    description: str = ""
    upstream_status: str = DEFAULT_UPSTREAM_STATUS
    feature: str = DEFAULT_FEATURE
    filename: str = ""
    # the checks `opencoti-patch check` runs after this patch: `markers`, or a build target and its
    # arguments (`test-sparse-attn`, `test-backend-ops -o SPARSE_ATTN_FILL`); one `Test:` line each
    tests: tuple[str, ...] = ()


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    header: PatchHeader
    files: tuple[FilePatch, ...]
    sha256: str

    @property
    def paths(self) -> set[str]:
        return {p for f in self.files for p in (f.old_path, f.new_path) if p}

    @property
    def feature_name(self) -> str | None:
        """The feature of the patch: the first word of its ``Feature:`` field (None: none given)."""
        words = self.header.feature.split()
        return words[0] if words else None


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise OpencotiError(
            f"bad patch name {name!r}: expected NNNN-name.patch (e.g. 0001-sparse-attn.patch)"
        )


def number_of(name: str) -> int:
    m = NAME_RE.match(name)
    return int(m.group(1)) if m else 0


def slugify(text: str, limit: int = 52) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return slug[:limit].rstrip("-") or "patch"


def next_name(existing: Iterable[str], slug: str) -> str:
    number = max((number_of(n) for n in existing), default=0) + 1
    name = f"{number:04d}-{slugify(slug)}.patch"
    check_name(name)
    return name


# -- series file -------------------------------------------------------------------------------


def read_series(patches_dir: Path) -> list[str]:
    """The patch names of ``patches_dir/series`` in order ([] when there is no series file yet); a
    missing ``patches_dir`` is an error (the wrong folder: a project's patches folder exists)."""
    require_patches_dir(patches_dir)
    path = patches_dir / "series"
    if not path.exists():
        return []
    names: list[str] = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            check_name(line)
        except OpencotiError as exc:
            raise OpencotiError(f"{path}:{lineno}: {exc.message}") from exc
        if line in names:
            raise OpencotiError(f"{path}:{lineno}: {line} listed twice")
        names.append(line)
    return names


def series_digest(patches_dir: Path) -> str:
    """sha256 of ``series`` followed by the patches it lists, in its order: what `bench pack` stamps a
    carried tree with, and what ``ci/device/h200.sh`` recomputes (``cat series <patches...> | sha256sum``)
    to refuse a tree packed from another state of the series."""
    h = hashlib.sha256((patches_dir / "series").read_bytes())
    for name in read_series(patches_dir):
        h.update((patches_dir / name).read_bytes())
    return h.hexdigest()


SERIES_HEADER = (
    "# Patches applied in this order on top of the pinned upstream (see upstream.toml).",
    "# Managed by `opencoti-patch snapshot`; one NNNN-name.patch per line.",
)


def write_series(patches_dir: Path, names: list[str], comments: tuple[str, ...] = ()) -> None:
    """Write ``series``: the header, the comment lines it already had (kept, after the header) plus
    ``comments``, then ``names``."""
    patches_dir.mkdir(parents=True, exist_ok=True)
    path = patches_dir / "series"
    old = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    kept = [ln.strip() for ln in old if ln.lstrip().startswith("#") and ln.strip() not in SERIES_HEADER]
    kept += [c for c in comments if c not in kept]
    lines = [*SERIES_HEADER, *kept, *names]
    path.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")


def load_series(patches_dir: Path) -> list[Patch]:
    patches = []
    for name in read_series(patches_dir):
        path = patches_dir / name
        if not path.is_file():
            raise OpencotiError(f"{name} is listed in {patches_dir / 'series'} but {path} is missing")
        patches.append(parse_patch(path))
    return patches


# -- patch files -------------------------------------------------------------------------------


def _unquote(path: str) -> str:
    if len(path) >= 2 and path[0] == path[-1] == '"':
        body = path[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
        return body.encode("latin-1").decode("utf-8", "replace")
    return path


def _safe_path(raw: str, patch: str, prefixed: bool = True) -> str | None:
    """A path of the diff relative to the tree (None: /dev/null); ``prefixed``: it carries git's
    ``a/`` or ``b/`` (the ``rename from``/``to`` lines do not)."""
    raw = _unquote(raw.strip().split("\t", 1)[0])
    if raw == "/dev/null":
        return None
    if prefixed and raw[:2] in ("a/", "b/"):
        raw = raw[2:]
    parts = raw.split("/")
    if raw.startswith("/") or ".." in parts or not raw or parts[0] == ".git":
        raise CorruptPatch(f"{patch}: refusing path {raw!r}: it points outside the tree")
    return "/".join(p for p in parts if p not in ("", "."))


def _split_git_header(line: str, patch: str) -> tuple[str, str]:
    rest = line[len("diff --git "):]
    if rest.startswith('"'):
        end = rest.index('"', 1)
        a, b = rest[: end + 1], rest[end + 2:]
    else:
        # a/X b/X with the same X: split in the middle
        half = (len(rest) - 1) // 2
        a, b = (rest[:half], rest[half + 1:]) if rest[half] == " " else rest.split(" ", 1)
    return _safe_path(a, patch) or "", _safe_path(b, patch) or ""


def parse_header(text: str, name: str) -> PatchHeader:
    lines = text.splitlines()
    author = ""
    subject = ""
    i = 0
    while i < len(lines) and lines[i].strip():
        line = lines[i]
        if line.startswith("From: "):
            author = line[6:].strip()
        elif line.startswith("Subject: "):
            subject = line[9:].strip()
            while i + 1 < len(lines) and lines[i + 1][:1] in (" ", "\t"):
                i += 1
                subject += " " + lines[i].strip()
        i += 1
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
    if not subject:
        raise CorruptPatch(f"{name}: no 'Subject:' line in the header")
    fields: dict[str, str] = {}
    tests: list[str] = []
    body: list[str] = []
    for line in lines[i:]:
        if line == "---":
            break
        m = FIELD_RE.match(line)
        if m and m.group(1) == "Test":
            tests.append(m.group(2).strip())
        elif m:
            fields[m.group(1)] = m.group(2).strip()
        else:
            body.append(line)
    return PatchHeader(
        subject=subject,
        author=author,
        description="\n".join(body).strip(),
        upstream_status=fields.get("Upstream-Status", DEFAULT_UPSTREAM_STATUS),
        feature=fields.get("Feature", DEFAULT_FEATURE),
        filename=fields.get("Patch-Filename", ""),
        tests=tuple(t for t in tests if t),
    )


def split_patch(data: bytes) -> tuple[bytes, bytes]:
    """(header, diff): the diff starts at the first ``diff --git`` (or ``--- `` + ``+++ ``) line."""
    lines = data.split(b"\n")
    offset = 0
    for i, line in enumerate(lines):
        if line.startswith(b"diff --git ") or (
            line.startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ ")
        ):
            return data[:offset], data[offset:]
        offset += len(line) + 1
    return data, b""


def parse_diff(diff: bytes, name: str) -> list[FilePatch]:
    files: list[FilePatch] = []
    lines = diff.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    current: FilePatch | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        text = line.decode("utf-8", "surrogateescape")
        if text.startswith("diff --git "):
            a, b = _split_git_header(text, name)
            current = FilePatch(old_path=a, new_path=b)
            files.append(current)
        elif current is not None and text.startswith("new file mode"):
            current.old_path = None
            current.new_mode = text.rsplit(" ", 1)[-1]
        elif current is not None and text.startswith("deleted file mode"):
            current.new_path = None
            current.old_mode = text.rsplit(" ", 1)[-1]
        elif current is not None and text.startswith("old mode "):
            current.old_mode = text.rsplit(" ", 1)[-1]
        elif current is not None and text.startswith("new mode "):
            current.new_mode = text.rsplit(" ", 1)[-1]
        elif current is not None and (m := INDEX_RE.match(text)) and m.group(1):
            current.old_mode = current.old_mode or m.group(1)
            current.new_mode = current.new_mode or m.group(1)
        elif current is not None and text.startswith(("rename from ", "copy from ")):
            current.old_path = _safe_path(text.split(" from ", 1)[1], name, prefixed=False)
        elif current is not None and text.startswith(("rename to ", "copy to ")):
            current.new_path = _safe_path(text.split(" to ", 1)[1], name, prefixed=False)
        elif text.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ "):
            old = _safe_path(text[4:], name)
            new = _safe_path(lines[i + 1].decode("utf-8", "surrogateescape")[4:], name)
            if current is None or current.hunks:
                current = FilePatch(old_path=old, new_path=new)
                files.append(current)
            else:
                current.old_path, current.new_path = old, new
            i += 1
        elif current is not None and text.startswith(("GIT binary patch", "Binary files ")):
            current.binary = True
        elif line.startswith(b"@@"):
            if current is None:
                raise CorruptPatch(f"{name}: hunk at diff line {i + 1} before any file header")
            i = _parse_hunk(lines, i, current, name)
            continue
        elif text == "-- ":  # format-patch signature: the rest is a version string
            break
        i += 1
    if not files:
        raise CorruptPatch(f"{name}: no diff in the patch")
    for fp in files:
        _check_link(fp, name)
    return files


def _check_link(fp: FilePatch, name: str) -> None:
    """Refuse a symbolic link the diff makes that would point outside the tree (absolute, ``..`` past
    the top) or into ``.git``, as archives' links are refused (``safe_extract``); a diff turning a file
    into a link (git writes a delete and a create instead) or a link whose target it does not show is
    refused too. A renamed link keeps a target the diff does not show: ``apply.py`` checks it."""
    if fp.new_mode != LINK_MODE or fp.new_path is None:
        return
    if fp.old_path is not None and fp.old_mode not in (None, LINK_MODE):
        raise CorruptPatch(f"{name}: refusing {fp.new_path}: the patch turns a file into a symbolic link")
    if fp.binary:
        raise CorruptPatch(f"{name}: refusing {fp.new_path}: a symbolic link whose target is a binary patch")
    if not fp.hunks:
        return  # a mode line or a rename only: the target is the tree's (apply.py checks renames)
    target = "\n".join(text for h in fp.hunks for _, tag, text in h.new_side())
    problem = link_problem(fp.new_path, target)
    if problem:
        raise CorruptPatch(f"{name}: refusing {fp.new_path} -> {target!r}: a symbolic link that {problem}")


def link_problem(path: str, target: str) -> str | None:
    """What is wrong with a symbolic link at ``path`` in the tree pointing at ``target`` (None: it
    stays inside the tree, out of ``.git``)."""
    if link_escapes(path, target):
        return "leaves the tree"
    top = posixpath.normpath(posixpath.join(posixpath.dirname(path), target)).split("/", 1)[0]
    return "points into .git" if top == ".git" else None


def _parse_hunk(lines: list[bytes], i: int, fp: FilePatch, name: str) -> int:
    m = HUNK_RE.match(lines[i])
    number = len(fp.hunks) + 1
    if not m:
        raise CorruptPatch(f"{name}: {fp.path}: malformed hunk header #{number}: {lines[i][:60]!r}")
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_len = int(m.group(2)) if m.group(2) is not None else 1
    new_len = int(m.group(4)) if m.group(4) is not None else 1
    body: list[bytes] = []
    old_left, new_left = old_len, new_len
    j = i + 1
    while (old_left > 0 or new_left > 0) and j < len(lines):
        line = lines[j]
        tag = line[:1]
        if line == b"":
            line, tag = b" ", b" "  # git accepts an empty line as empty context
        if tag == b" ":
            old_left -= 1
            new_left -= 1
        elif tag == b"-":
            old_left -= 1
        elif tag == b"+":
            new_left -= 1
        elif tag == b"\\":
            j += 1
            continue
        else:
            break
        body.append(line)
        j += 1
    if old_left != 0 or new_left != 0:
        raise CorruptPatch(
            f"{name}: corrupt patch: {fp.path} hunk #{number} (@@ -{old_start},{old_len} "
            f"+{new_start},{new_len} @@) ends early or has too many lines"
        )
    while j < len(lines) and lines[j].startswith(b"\\"):
        j += 1
    fp.hunks.append(Hunk(number, old_start, old_len, new_start, new_len, tuple(body)))
    return j


def diff_paths(data: bytes, name: str = "diff") -> list[str]:
    """The paths a patch (header + diff) touches, in order: old and new side of each file."""
    out: list[str] = []
    for fp in parse_diff(split_patch(data)[1], name):
        for path in (fp.old_path, fp.new_path):
            if path and path not in out:
                out.append(path)
    return out


def parse_patch(path: Path) -> Patch:
    data = path.read_bytes()
    header_bytes, diff = split_patch(data)
    header = parse_header(header_bytes.decode("utf-8", "replace"), path.name)
    files = parse_diff(diff, path.name)
    return Patch(path.name, path, header, tuple(files), hashlib.sha256(data).hexdigest())


def diff_patch(diff: bytes | str, name: str = "diff", feature: str | None = None,
               path: Path | None = None) -> Patch:
    """A bare diff (``git diff upstream``, a ``--patch-file``) as a one-file-set Patch with the given
    feature (no header needed)."""
    data = diff.encode("utf-8", errors="surrogateescape") if isinstance(diff, str) else diff
    return Patch(name, path or Path(name), PatchHeader(subject=name, feature=feature or ""),
                 tuple(parse_diff(data, name)), hashlib.sha256(data).hexdigest())


def render_patch(template_dirs: Iterable[Path], header: PatchHeader, diff: bytes) -> bytes:
    text = render(
        list(template_dirs),
        "patch-header.j2",
        author=header.author,
        subject=header.subject,
        description=header.description,
        upstream_status=header.upstream_status,
        feature=header.feature,
        filename=header.filename,
        tests=header.tests,
    )
    return text.encode("utf-8") + diff

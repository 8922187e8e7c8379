"""Extract a tar archive (or one folder of it) refusing anything that could escape the destination.

Refused, before a byte is written: absolute member names, ``..`` components, device/fifo members,
symlinks or hardlinks whose target leaves the extracted folder, members written through a symlink.
Everything is extracted into a hidden sibling folder and renamed into place only when complete,
so a refused or broken archive leaves nothing behind.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import posixpath
import re
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import OpencotiError


class UnsafeArchive(OpencotiError):
    """The archive holds a member that could write outside the destination."""

    hostile = True


class BrokenArchive(OpencotiError):
    """The archive cannot be read to its end: not a tar archive, truncated, or its compressed data
    corrupt (``damaged``: the last two, a broken copy of an archive)."""

    def __init__(self, message: str, damaged: bool = False) -> None:
        super().__init__(message)
        self.damaged = damaged


# what reading a tar archive (gzip, bzip2, xz or plain) raises when the file is cut short, damaged or
# not an archive (bz2 raises a bare OSError, "Invalid data stream")
ARCHIVE_READ_ERRORS: tuple[type[BaseException], ...] = (
    tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError)
_MAGIC = ((b"\x1f\x8b", "gz"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"PK\x03\x04", "zip"))
_TRUNCATED = ("ended before", "end of data", "truncated", "unexpected end", "empty header")


def _compression(archive: Path) -> str:
    try:
        with open(archive, "rb") as fh:
            head = fh.read(6)
    except OSError:
        return "tar"
    return next((kind for magic, kind in _MAGIC if head.startswith(magic)), "tar")


def _decompress_error(archive: Path, kind: str) -> BaseException | None:
    """What decompressing the whole of a gz, bz2 or xz file raises (None: it decompresses)."""
    opener = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}.get(kind)
    if opener is None:
        return None
    try:
        with opener(archive, "rb") as fh:
            while fh.read(1 << 20):
                pass
    except ARCHIVE_READ_ERRORS as exc:
        return exc
    return None


def broken_archive(archive: Path, exc: BaseException | str) -> BrokenArchive:
    """One line naming ``archive`` and what is wrong with it (``exc``: one of ``ARCHIVE_READ_ERRORS``,
    or what a check found)."""
    kind = _compression(archive)
    reason = str(exc)
    unopened = "could not be opened" in reason  # tarfile tried every method: keep the one this file is
    if unopened:
        methods = dict(ln[len("- method "):].split(": ", 1) for ln in reason.splitlines()
                       if ln.startswith("- method ") and ": " in ln)
        reason = methods.get(kind, methods.get("tar", reason))
        probe = _decompress_error(archive, kind)  # tarfile says "not a bzip2 file" for a cut one too
        if probe is not None:
            exc, reason = probe, str(probe)
    reason = " ".join(reason.split()) or type(exc).__name__
    reason = re.sub(r"^\w+Error\('(.*)'\)$", r"\1", reason)  # ReadError('...') as tarfile lists it
    if kind == "zip":
        return BrokenArchive(f"{archive}: a zip archive; only tar archives (gzip, bzip2, xz or plain) are "
                             "read; nothing extracted")
    if isinstance(exc, OSError) and exc.errno is not None:
        what = "cannot be read"
    elif kind == "tar" and unopened:
        what = "not a tar archive (gzip, bzip2, xz or plain tar)"
    elif isinstance(exc, EOFError) or any(t in reason for t in _TRUNCATED):
        what = f"truncated ({'' if kind == 'tar' else kind + ' '}data ends before the archive does)"
    else:
        what = f"corrupt ({'tar' if kind == 'tar' else kind + '-compressed tar'} data)"
    return BrokenArchive(f"{archive}: {what}: {reason}; nothing extracted",
                         damaged=what.startswith(("truncated", "corrupt")))


@dataclass(frozen=True)
class _Member:
    info: tarfile.TarInfo
    rel: str  # path relative to the extraction root


def _normalize(name: str, archive: Path) -> str:
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchive(f"{archive.name}: refusing absolute path {name!r}; nothing extracted")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"{archive.name}: refusing path with '..' {name!r}; nothing extracted")
    return "/".join(parts)


def link_escapes(rel: str, target: str) -> bool:
    """Whether a symbolic link at ``rel`` (relative to a root) pointing at ``target`` leaves the root."""
    if target.startswith("/"):
        return True
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    return joined == ".." or joined.startswith("../")


def _select(
    members: Iterable[tarfile.TarInfo], archive: Path, subdir: str | None, exclude: Iterable[str]
) -> tuple[list[_Member], str]:
    infos = list(members)
    names = [_normalize(m.name, archive) for m in infos]
    # Validate every member of the archive, not only the selected ones.
    for info, name in zip(infos, names, strict=True):
        if info.ischr() or info.isblk() or info.isfifo() or not (info.isfile() or info.isdir()
                                                                  or info.issym() or info.islnk()):
            raise UnsafeArchive(
                f"{archive.name}: refusing device/special member {info.name!r}; nothing extracted"
            )
        if info.issym() and link_escapes(name, info.linkname):
            raise UnsafeArchive(
                f"{archive.name}: symlink {info.name!r} -> {info.linkname!r} points outside the "
                "archive; nothing extracted"
            )
        if info.islnk():
            _normalize(info.linkname, archive)
    # Strip a single top-level folder (sdists and GitHub tarballs have one).
    tops = {n.split("/", 1)[0] for n in names if n}
    strip = ""
    if len(tops) == 1:
        only = tops.pop()
        if any(n.startswith(only + "/") for n in names):
            strip = only + "/"
    prefix = strip + (subdir.strip("/") + "/" if subdir else "")
    excluded = tuple(e.strip("/") for e in exclude)
    selected: list[_Member] = []
    for info, name in zip(infos, names, strict=True):
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix):]
        if not rel or any(rel == e or rel.startswith(e + "/") for e in excluded):
            continue
        selected.append(_Member(info, rel))
    if not selected:
        where = f"folder {subdir!r}" if subdir else "members"
        raise OpencotiError(f"{archive.name}: no {where} in the archive; nothing extracted")
    links = {m.rel for m in selected if m.info.issym()}
    for m in selected:
        if m.info.issym() and link_escapes(m.rel, m.info.linkname):
            raise UnsafeArchive(
                f"{archive.name}: symlink {m.info.name!r} -> {m.info.linkname!r} points outside "
                f"{subdir or 'the tree'}; nothing extracted"
            )
        parts = m.rel.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in links:
                raise UnsafeArchive(
                    f"{archive.name}: member {m.info.name!r} is written through a symlink; "
                    "nothing extracted"
                )
    return selected, prefix


def _inside(root: Path, path: Path) -> bool:
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root + os.sep)


@contextmanager
def staged(dest: Path) -> Iterator[Path]:
    """A hidden sibling folder of ``dest`` (which must not exist) to fill: renamed to ``dest`` when the
    block ends, removed on any error (Ctrl-C included), so ``dest`` only ever appears complete."""
    if dest.exists():
        raise OpencotiError(f"{dest} already exists; remove it first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        yield staging
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def extract_tar(
    archive: Path, dest: Path, subdir: str | None = None, exclude: Iterable[str] = ()
) -> Path:
    """Extract ``archive`` (or its ``subdir`` under the single top-level folder) to ``dest``.

    ``dest`` must not exist. ``exclude`` names paths (relative to the extracted root) to skip.
    """
    if dest.exists():
        raise OpencotiError(f"{dest} already exists; remove it first")
    try:
        tar = tarfile.open(archive, "r:*")
    except ARCHIVE_READ_ERRORS as exc:
        raise broken_archive(archive, exc) from exc
    try:
        return _extract(tar, archive, dest, subdir, exclude)
    except ARCHIVE_READ_ERRORS as exc:  # reading it (the staging folder is gone: nothing extracted)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise  # writing the files (a full disk): not the archive's fault
        raise broken_archive(archive, exc) from exc


def _extract(tar: tarfile.TarFile, archive: Path, dest: Path, subdir: str | None, exclude: Iterable[str]
             ) -> Path:
    with tar, staged(dest) as staging:
        members = tar.getmembers()
        require_complete(tar, archive)
        selected, prefix = _select(members, archive, subdir, exclude)
        symlinks: list[_Member] = []
        for m in selected:
            target = staging / m.rel
            if m.info.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if m.info.issym():
                symlinks.append(m)
            elif m.info.islnk():
                linked = _normalize(m.info.linkname, archive)
                source = staging / linked[len(prefix):] if linked.startswith(prefix) else None
                _hardlink_copy(archive, m, source, target)
            else:
                src = tar.extractfile(m.info)
                if src is None:
                    raise OpencotiError(f"{archive.name}: cannot read member {m.info.name!r}")
                with src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                target.chmod(0o755 if m.info.mode & 0o111 else 0o644)
        for m in symlinks:
            link = staging / m.rel
            os.symlink(m.info.linkname, link)
            if not _inside(staging, link):
                raise UnsafeArchive(
                    f"{archive.name}: symlink {m.info.name!r} resolves outside the tree; "
                    "nothing extracted"
                )
        for d in sorted((p for p in staging.rglob("*") if p.is_dir() and not p.is_symlink()),
                        reverse=True):
            d.chmod(0o755)
        staging.chmod(0o755)
    return dest


def require_complete(tar: tarfile.TarFile, archive: Path) -> None:
    """A tar archive ends with zero blocks after its last member; one cut at a member boundary has
    none, and tarfile reads it as complete (fewer files, no error). The rest (padding) is read to the
    end too, so that a compressed stream's own end and checksum are checked (tarfile stops early)."""
    assert tar.fileobj is not None
    tar.fileobj.seek(tar.offset)
    if tar.fileobj.read(tarfile.BLOCKSIZE) != tarfile.NUL * tarfile.BLOCKSIZE:
        raise broken_archive(archive, f"no end-of-archive block after the last member "
                                      f"({len(tar.getmembers())} read): truncated")
    while tar.fileobj.read(1 << 20):
        pass


def _hardlink_copy(archive: Path, m: _Member, source: Path | None, target: Path) -> None:
    if source is None or not source.is_file() or source.is_symlink():
        raise UnsafeArchive(
            f"{archive.name}: hardlink {m.info.name!r} -> {m.info.linkname!r} does not point to a "
            "file extracted before it; nothing extracted"
        )
    shutil.copy2(source, target)

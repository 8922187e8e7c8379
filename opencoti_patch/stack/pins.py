"""Pins added from the command line (`pin add`, `pin list`): resolve a source, record it in upstream.toml.

A new pin comes from exactly one place: a llama-cpp-python version (its sdist from the package
index, whose JSON names the URL and sha256), a git URL + commit, a tarball (URL or local file) or
a local folder. Archives are downloaded into the download cache with a progress bar (the helpers
of ``upstream``) and their sha256 is recorded; the llama.cpp commit is read from inside where it
can be: the sdist's submodule record (``.git/modules/vendor/llama.cpp/HEAD``, which the
``vendor/llama.cpp/.git`` gitdir file points at), a GitHub archive's pax comment, or a checkout's
HEAD. ``--commit`` names it otherwise.

The ``[pins.NAME]`` table is appended to upstream.toml as text, so the comments and order of the
file are kept; with ``force`` an existing table of that name is replaced in place. The new text
is parsed (``parse_upstream``) before it replaces the file.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import requests

from ..config import Settings
from ..errors import OpencotiError
from ..report import info
from ..safe_extract import ARCHIVE_READ_ERRORS, broken_archive, require_complete
from .gitrun import run_git
from .upstream import (
    LLAMA_CPP_GIT,
    Source,
    Upstream,
    download_to_cache,
    fetch_archive,
    load_upstream,
    parse_upstream,
    set_default_pin,
    sha256_file,
)

PYPI_PACKAGE = "llama-cpp-python"
PYPI_URL_ENV = "OPENCOTI_PYPI_URL"  # the package index's JSON API (a mirror, or a test server)
PYPI_URL = "https://pypi.org/pypi"
SDIST_SUBDIR = "vendor/llama.cpp"
SDIST_ENV = "OPENCOTI_SDIST"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
COMMIT_RE = re.compile(r"^[0-9a-fA-F]{7,40}$")
BARE_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
HEADER_RE = re.compile(r"^\s*\[\[?\s*(?P<key>[^\]]+?)\s*\]\]?\s*(#.*)?$")


@dataclass
class NewPin:
    """A pin about to be written: its upstream.toml keys and sources, in order."""

    name: str
    commit: str
    description: str
    sources: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- where a pin comes from --------------------------------------------------------------------


def check_pin_name(name: str) -> None:
    """A pin name is a git tag suffix (``upstream/NAME``) and a file name part (``manifest-NAME``)."""
    if not NAME_RE.match(name) or ".." in name or name.endswith((".", ".lock")):
        raise OpencotiError(f"pin name {name!r}: use letters, digits, '.', '_' and '-' "
                            "(e.g. the llama.cpp commit 4df29be4f, or the version 0.3.35)")


def check_commit(commit: str) -> str:
    if not COMMIT_RE.match(commit):
        raise OpencotiError(f"--commit {commit!r}: a llama.cpp commit is 7 to 40 hex digits")
    return commit.lower()


def pypi_sdist(version: str, timeout: float = 30) -> tuple[str, str]:
    """(url, sha256) of the llama-cpp-python sdist ``version`` from the package index's JSON API."""
    base = os.environ.get(PYPI_URL_ENV) or PYPI_URL
    url = f"{base.rstrip('/')}/{PYPI_PACKAGE}/{version}/json"
    try:
        resp = requests.get(url, timeout=timeout)
        if resp.status_code == 404:  # a mirror may serve only the project's JSON: its `releases`
            project = f"{base.rstrip('/')}/{PYPI_PACKAGE}/json"
            whole = requests.get(project, timeout=timeout)
            files = whole.json().get("releases", {}).get(version) if whole.status_code == 200 else None
            if not files:
                raise OpencotiError(f"{PYPI_PACKAGE} {version} is not on the package index ({url}: 404); "
                                    f"its versions: https://pypi.org/project/{PYPI_PACKAGE}/#history")
            url, data = project, {"urls": [dict(f, url=urljoin(project, f.get("url") or ""))
                                           for f in files]}
        else:
            resp.raise_for_status()
            data = resp.json()
    except requests.RequestException as exc:
        raise OpencotiError(f"asking the package index for {PYPI_PACKAGE} {version} failed ({exc}); "
                            f"offline, use --tarball FILE with the sdist") from exc
    except ValueError as exc:
        raise OpencotiError(f"{url}: not JSON ({exc})") from exc
    for entry in data.get("urls") or []:
        sha = (entry.get("digests") or {}).get("sha256")
        if entry.get("packagetype") == "sdist" and entry.get("url") and sha:
            return str(entry["url"]), str(sha)
    raise OpencotiError(f"{PYPI_PACKAGE} {version} has no sdist with a sha256 on the package index ({url})")


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

    ``subdir`` None: the sdist's ``vendor/llama.cpp`` when the archive is laid out like one (and
    is not llama.cpp itself), else the whole archive; '' is always the whole archive.
    """
    try:
        with tarfile.open(path, "r:*") as tar:
            files, dirs, _top = _git_files(tar)
            require_complete(tar, path)  # a pin records the sha256 of a whole archive only
            comment = str(tar.pax_headers.get("comment", ""))
    except ARCHIVE_READ_ERRORS as exc:
        raise broken_archive(path, exc) from exc
    if subdir is None:
        subdir = SDIST_SUBDIR if SDIST_SUBDIR in dirs and "ggml" not in dirs else ""
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
                 commit: str | None) -> NewPin:
    facts = archive_facts(archive, subdir)
    if not facts.has_subdir:
        raise OpencotiError(f"{archive.name} has no folder {subdir!r}; pass --subdir (the llama.cpp "
                            "folder inside the archive, '' for the whole archive)")
    notes = []
    if commit is None and facts.commit is None:
        raise OpencotiError(f"{archive.name}: no llama.cpp commit recorded inside; name it with "
                            "--commit SHA")
    if commit is not None and facts.commit is not None and not facts.commit.startswith(commit):
        raise OpencotiError(f"{archive.name} records llama.cpp {facts.commit} ({facts.found_in}), "
                            f"not --commit {commit}")
    if facts.commit is not None:
        notes.append(f"llama.cpp commit {facts.commit} read from {facts.found_in}")
    if facts.subdir:
        source["subdir"] = facts.subdir
    return NewPin(name, facts.commit or str(commit), "", [source], notes)


def pin_from_pypi(name: str, version: str, settings: Settings, subdir: str | None, commit: str | None,
                  progress: bool = True) -> NewPin:
    url, sha = pypi_sdist(version)
    sub = SDIST_SUBDIR if subdir is None else subdir
    src = Source(kind="sdist", url=url, sha256=sha, subdir=sub or None, env=SDIST_ENV)
    archive = fetch_archive(src, settings, progress)
    source = {"kind": "sdist", "url": url, "sha256": sha}
    pin = _archive_pin(name, archive, source, sub, commit)
    source["env"] = SDIST_ENV
    pin.sources.append({"kind": "git", "url": LLAMA_CPP_GIT, "commit": pin.commit})
    pin.description = f"llama.cpp {pin.commit[:9]} as vendored by {PYPI_PACKAGE} {version}"
    return pin


def pin_from_tarball(name: str, ref: str, settings: Settings, subdir: str | None, commit: str | None,
                     sha256: str | None = None, progress: bool = True) -> NewPin:
    local = Path(ref).expanduser()
    if "://" not in ref:
        if not local.is_file():
            raise OpencotiError(f"--tarball {ref}: no such file (or give a URL)")
        sha = sha256_file(local)
        if sha256 and sha != sha256.lower():
            raise OpencotiError(f"--tarball {ref}: sha256 is {sha}, not --sha256 {sha256}")
        source = {"kind": "tarball", "path": _relative_to_patches(local, settings), "sha256": sha}
        pin = _archive_pin(name, local, source, subdir, commit)
        pin.notes.append("a local file: others need it too (`--from FILE`), or record a url")
    else:
        if sha256:
            archive = fetch_archive(Source(kind="tarball", url=ref, sha256=sha256), settings, progress)
            sha = sha256.lower()
        else:
            archive, sha = download_to_cache(ref, settings, progress)
        pin = _archive_pin(name, archive, {"kind": "tarball", "url": ref, "sha256": sha}, subdir, commit)
    pin.description = f"llama.cpp {pin.commit[:9]} from {Source(kind='tarball', url=ref).filename}"
    return pin


def pin_from_git(name: str, url: str, commit: str, subdir: str | None) -> NewPin:
    source = {"kind": "git", "url": url, "commit": commit}
    if subdir:
        source["subdir"] = subdir
    return NewPin(name, commit, f"llama.cpp {commit[:9]} from {url}", [source])


def pin_from_dir(name: str, folder: Path, settings: Settings, subdir: str | None,
                 commit: str | None) -> NewPin:
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
                            "name it with --commit SHA")
    source = {"kind": "dir", "path": _relative_to_patches(folder, settings)}
    if subdir:
        source["subdir"] = subdir
    notes.append("a dir source has no sha256: the folder is taken as it is")
    pin_commit = found or str(commit)
    return NewPin(name, pin_commit, f"llama.cpp {pin_commit[:9]} from a local folder", [source], notes)


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
    lines = [f"[pins.{key}]", f"commit = {toml_string(pin.commit)}",
             f"description = {toml_string(pin.description)}", "strip = []"]
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
                     "description": pin.description, "sources": sources})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    width = max([len(r["name"]) for r in rows] + [4])
    cwidth = max([len(r["commit"]) for r in rows] + [6])
    out = [f"  {'name':<{width}}  {'commit':<{cwidth}}  sources (sha256)"]
    for r in rows:
        mark = "*" if r["default"] else " "
        for i, s in enumerate(r["sources"]):
            where = s.get("url") or s.get("path") or f"${s.get('env')}"
            extra = f" ({s['sha256'][:16]}…)" if s.get("sha256") else ""
            extra += f" @ {s['commit']}" if s.get("commit") else ""
            lead = (f"{mark} {r['name']:<{width}}  {r['commit']:<{cwidth}}" if i == 0
                    else " " * (width + cwidth + 4))
            out.append(f"{lead}  {s['kind']} {where}{extra}")
    out.append("(* = default)")
    return "\n".join(out)


def announce(pin: NewPin) -> None:
    for note in pin.notes:
        info(f"note: {note}")

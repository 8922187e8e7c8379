"""The vendored tree as a git repository: pristine backup, manifest, verify, restore, status, lock.

Layout of ``<tree>/.git``:

- branch ``opencoti``: the pristine upstream commit (tag ``upstream/<pin>``), then one commit per
  applied patch, each carrying the trailers ``Opencoti-Patch: NNNN-name.patch`` and
  ``Opencoti-Patch-Sha256: <sha256 of the patch file>``.
- ``opencoti/manifest-<pin>.json``: sha256 and mode of every upstream file (from disk, before git
  touched anything), and the git tree id of the upstream commit.
- ``opencoti/state.json``: the pin the tree is on; ``opencoti/txn``: present while an apply runs.

Before the backup there is no ``.git``: ``fetch`` records the pin it put there beside the tree
(``.<tree>.fetched.json``), and ``backup`` reads it. ``Tree`` owns all of it: the repository, its
state files, the fetch record and so the pin.

Every git call runs with the user's and system git config ignored, line-ending and filter
attributes off (``info/attributes``) and fixed identity/dates, so the backup and the patch commits
are byte-exact and the same on every machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import git

from ..config import (
    BRANCH,
    DEFAULT_AUTHOR,
    HASH_TRAILER,
    PATCH_TRAILER,
    STATE_DIR,
    TAG_PREFIX,
    UPSTREAM_AUTHOR,
    Settings,
)
from ..errors import CheckFailed, LockBusy, OpencotiError
from ..report import info
from .gitrun import GitResult, isolated_env
from .series import FIELD_RE, PatchHeader
from .upstream import Pin, Upstream, identity_text, materialize, sha256_file

ATTRIBUTES = "* -text -filter -ident -working-tree-encoding\n"
REPO_CONFIG = {
    "core.autocrlf": "false",
    "core.safecrlf": "false",
    "core.filemode": "true",
    "core.symlinks": "true",
    "core.compression": "1",
    "core.quotepath": "false",
    "gc.auto": "0",
    "advice.detachedHead": "false",
}
TRAILER_RE = re.compile(rf"^({PATCH_TRAILER}|{HASH_TRAILER}):[ \t]*(\S+)\s*$")


@dataclass(frozen=True)
class StackCommit:
    sha: str
    message: str
    patch: str | None  # Opencoti-Patch trailer (None: a commit not yet captured as a patch)
    patch_sha256: str | None

    @property
    def subject(self) -> str:
        return self.message.split("\n", 1)[0]


@dataclass
class TreeDiff:
    missing: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.changed or self.added)

    def summary(self) -> str:
        """Every path that differs, by kind (``--json`` has the same lists)."""
        kinds = (("missing", self.missing), ("changed", self.changed), ("added", self.added))
        parts = [f"{len(items)} {label}: {', '.join(items)}" for label, items in kinds if items]
        return "; ".join(parts) or "identical"


def split_author(author: str) -> tuple[str, str]:
    m = re.match(r"^\s*(.*?)\s*<([^>]*)>\s*$", author or DEFAULT_AUTHOR)
    if not m:
        return author.strip(), "unknown@invalid"
    return m.group(1) or m.group(2), m.group(2)


def commit_message(header: PatchHeader, patch: str | None = None, patch_sha: str | None = None) -> str:
    parts = [header.subject, ""]
    if header.description:
        parts += [header.description, ""]
    parts += [f"Upstream-Status: {header.upstream_status}", f"Feature: {header.feature}"]
    parts += [f"Test: {t}" for t in header.tests]
    if patch:
        parts.append(f"{PATCH_TRAILER}: {patch}")
    if patch_sha:
        parts.append(f"{HASH_TRAILER}: {patch_sha}")
    return "\n".join(parts) + "\n"


def parse_message(message: str, author: str = "") -> tuple[PatchHeader, str | None, str | None]:
    """(header, patch name, patch sha256) from a commit message written by :func:`commit_message`."""
    lines = message.rstrip("\n").split("\n")
    subject = lines[0].strip()
    fields: dict[str, str] = {}
    trailers: dict[str, str] = {}
    tests: list[str] = []
    body: list[str] = []
    for line in lines[1:]:
        t = TRAILER_RE.match(line)
        f = FIELD_RE.match(line)
        if t:
            trailers[t.group(1)] = t.group(2)
        elif f and f.group(1) == "Test":
            tests.append(f.group(2).strip())
        elif f and f.group(1) != "Patch-Filename":
            fields[f.group(1)] = f.group(2).strip()
        elif not f:
            body.append(line)
    kwargs: dict[str, str] = {}
    if "Upstream-Status" in fields:
        kwargs["upstream_status"] = fields["Upstream-Status"]
    if "Feature" in fields:
        kwargs["feature"] = fields["Feature"]
    header = PatchHeader(subject=subject, author=author, description="\n".join(body).strip(),
                         tests=tuple(t for t in tests if t), **kwargs)
    return header, trailers.get(PATCH_TRAILER), trailers.get(HASH_TRAILER)


def file_digest(path: Path) -> dict[str, str]:
    if path.is_symlink():
        return {"sha256": hashlib.sha256(os.fsencode(os.readlink(path))).hexdigest(), "mode": "120000"}
    mode = "100755" if os.stat(path).st_mode & stat.S_IXUSR else "100644"
    return {"sha256": sha256_file(path), "mode": mode}


def scan(root: Path) -> dict[str, dict[str, str]]:
    """sha256 + git mode of every file and symlink under ``root`` (the top-level .git excluded)."""
    files: dict[str, dict[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root and ".git" in dirnames:
            dirnames.remove(".git")
        if here == root and ".git" in filenames:
            filenames.remove(".git")
        for name in list(dirnames):
            if (here / name).is_symlink():
                dirnames.remove(name)
                filenames.append(name)
        for name in filenames:
            path = here / name
            files[path.relative_to(root).as_posix()] = file_digest(path)
    return dict(sorted(files.items()))


def compare(expected: dict[str, dict[str, str]], actual: dict[str, dict[str, str]]) -> TreeDiff:
    diff = TreeDiff()
    for path, meta in expected.items():
        if path not in actual:
            diff.missing.append(path)
        elif actual[path] != meta:
            diff.changed.append(path)
    diff.added = sorted(set(actual) - set(expected))
    return diff


class Tree:
    """The vendored llama.cpp tree at ``settings.tree``."""

    def __init__(self, settings: Settings, path: Path | None = None) -> None:
        self.settings = settings
        self.path = path or settings.tree

    # -- git plumbing --------------------------------------------------------------------------

    @property
    def git_dir(self) -> Path:
        return self.path / ".git"

    @property
    def state_dir(self) -> Path:
        return self.git_dir / STATE_DIR

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return isolated_env(extra)

    def git(
        self,
        *args: str,
        check: bool = True,
        binary: bool = False,
        stdin: Path | None = None,
        index: Path | None = None,
        work_tree: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> GitResult:
        extra = dict(env or {})
        if index is not None:
            extra["GIT_INDEX_FILE"] = str(index)
        if work_tree is not None:
            extra["GIT_WORK_TREE"] = str(work_tree)
            extra["GIT_DIR"] = str(self.git_dir)
        cmd = git.Git(str(self.path))
        fh = open(stdin, "rb") if stdin is not None else None  # noqa: SIM115
        try:
            rc, out, err = cmd.execute(
                ["git", *args],
                istream=fh,
                with_extended_output=True,
                with_exceptions=False,
                stdout_as_string=not binary,
                strip_newline_in_stdout=False,
                env=self.env(extra),
            )
        finally:
            if fh is not None:
                fh.close()
        result = GitResult(int(rc or 0), out if out is not None else "", str(err))
        if check and result.rc != 0:
            if "index.lock" in result.err:
                raise OpencotiError(self._index_lock_message())
            last = (result.err.strip().splitlines() or ["(no message)"])[-1]
            raise OpencotiError(f"git {' '.join(args[:3])} failed in {self.path}: {last}")
        return result

    @property
    def index_lock(self) -> Path:
        return self.git_dir / "index.lock"

    def _index_lock_message(self) -> str:
        return (f"{self.index_lock} exists: a git command is running in {self.path}, or one was killed. "
                f"If no git runs there, delete {self.index_lock} and retry")

    def recover_interrupted(self) -> Path | None:
        """Undo what a killed run (kill -9 mid-apply) left: its git index lock and a half-applied patch.

        Call it holding the tree lock (no other opencoti-patch run is working on the tree). The
        leftovers are saved under work/rescue/ first; returns that file (None: nothing to save).
        """
        if not self.is_repo():
            return None
        if not self.interrupted():
            if self.index_lock.exists():
                raise OpencotiError(self._index_lock_message())
            return None
        if self.index_lock.exists():
            self.index_lock.unlink()
            info(f"removed {self.index_lock}, left by an interrupted opencoti-patch run")
        saved = self.rescue("interrupted") if self.read_state().get("pin") and self.dirty() else None
        self.reset_hard("HEAD")
        self.txn_file.unlink(missing_ok=True)
        return saved

    def rev(self, ref: str) -> str | None:
        r = self.git("rev-parse", "--verify", "--quiet", ref + "^{commit}", check=False)
        return r.text.strip() or None if r.rc == 0 else None

    # -- state ---------------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.path.is_dir()

    def is_repo(self) -> bool:
        return (self.git_dir / "HEAD").is_file()

    def read_state(self) -> dict[str, Any]:
        path = self.state_dir / "state.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def write_state(self, **values: Any) -> None:
        state = self.read_state()
        state.update(values)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")

    @property
    def pin(self) -> str:
        pin = self.read_state().get("pin")
        if not pin:
            raise OpencotiError(f"{self.path} has no backup yet: run `{self.settings.command('backup')}` "
                                "first")
        return str(pin)

    @property
    def tag(self) -> str:
        return TAG_PREFIX + self.pin

    # -- fetch: the tree folder before it is a repository ------------------------------------------

    @property
    def fetch_record(self) -> Path:
        """Beside the tree: which pin ``fetch`` put there (``backup`` reads it)."""
        return self.path.parent / f".{self.path.name}.fetched.json"

    def fetch(self, pin: Pin, upstream: Upstream, from_file: Path | None = None, progress: bool = True,
              download_only: bool = False) -> str:
        """Put the pristine tree of ``pin`` at the tree folder and record the pin; returns the source."""
        used = materialize(pin, upstream, self.settings, self.path, from_file, progress=progress,
                           download_only=download_only)
        if not download_only:
            self.fetch_record.write_text(json.dumps({"pin": pin.name, "source": used}, indent=1) + "\n")
        return used

    def fetched_pin(self, upstream: Upstream, requested: str | None = None) -> Pin:
        """The pin to back the fetched tree up as: what fetch recorded, checked against ``requested``."""
        record = self.fetch_record
        fetched = json.loads(record.read_text()).get("pin") if record.is_file() else None
        if requested and fetched and requested != fetched:
            raise OpencotiError(f"{self.path} was fetched as pin {fetched}, not {requested}: remove it and "
                                f"fetch --pin {requested}, or back it up as {fetched}")
        return upstream.pin(requested or fetched)

    def require(self) -> None:
        if not self.exists():
            raise OpencotiError(f"no tree at {self.path}: run `{self.settings.command('fetch')}` "
                                "(or `prepare`)")
        if not self.is_repo() or not self.read_state().get("pin"):
            raise OpencotiError(f"{self.path} is not backed up yet: run `{self.settings.command('backup')}`")
        if self.rev(self.tag) is None:
            raise OpencotiError(f"{self.path}: backup tag {self.tag} is missing; the backup is damaged")

    def head(self) -> str:
        sha = self.rev("HEAD")
        if sha is None:
            raise OpencotiError(f"{self.path}: no HEAD commit")
        return sha

    # -- backup --------------------------------------------------------------------------------

    def manifest_path(self, pin: str) -> Path:
        return self.state_dir / f"manifest-{pin}.json"

    def manifest(self, pin: str | None = None) -> dict[str, Any]:
        pin = pin or self.pin
        path = self.manifest_path(pin)
        if not path.is_file():
            raise OpencotiError(f"manifest {path} is missing; the backup of {pin} cannot be proven")
        manifest: dict[str, Any] = json.loads(path.read_text())
        return manifest

    def _init_repo(self) -> None:
        self.git("init", "--quiet", "--initial-branch", BRANCH)
        for key, value in REPO_CONFIG.items():
            self.git("config", key, value)
        info_dir = self.git_dir / "info"
        info_dir.mkdir(parents=True, exist_ok=True)
        (info_dir / "attributes").write_text(ATTRIBUTES)
        (info_dir / "exclude").write_text("")

    def import_dir(self, src: Path, pin: Pin) -> str:
        """Commit the exact content of ``src`` as the parentless upstream commit of ``pin``.

        Everything is added regardless of the tree's own .gitignore files. Tags ``upstream/<pin>``
        and writes its manifest (scanned from disk first, then checked against what git stored).
        """
        files = scan(src)
        with tempfile.TemporaryDirectory(prefix="opencoti-index-") as tmp:
            index = Path(tmp) / "index"
            self.git("add", "--force", "--all", "--", ".", index=index, work_tree=src)
            tree = self.git("write-tree", index=index, work_tree=src).text.strip()
        uname, uemail = UPSTREAM_AUTHOR
        # a commit pin's message as it always was (its upstream commit id does not change)
        what = f"llama.cpp {pin.commit}" if pin.commit and not pin.release else pin.identity["identity"]
        message = f"upstream {pin.name} ({what})\n"
        if pin.description:
            message += f"\n{pin.description}\n"
        commit = self.commit_tree(tree, [], message, f"{uname} <{uemail}>")
        self.git("tag", "--force", pin.tag, commit)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        manifest = {"pin": pin.name, "commit": pin.commit, "release": pin.release,
                    "archive_sha256": pin.archive_sha256, "tree": tree, "upstream_commit": commit,
                    "files": files}
        self.manifest_path(pin.name).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        problems = self.verify_backup(pin.name)
        if problems:
            raise CheckFailed(f"backup of {pin.name} does not match the files on disk: {problems[0]}")
        return commit

    def create_backup(self, pin: Pin) -> str:
        """Make the freshly fetched tree a git repo whose first commit is upstream, exactly."""
        if not self.exists():
            raise OpencotiError(f"no tree at {self.path}: run `{self.settings.command('fetch')}` first")
        if (self.path / ".git").is_file():
            (self.path / ".git").unlink()  # the sdist's dangling gitdir file
        if self.is_repo():
            raise OpencotiError(f"{self.path} is already a git repository; use `backup --verify`")
        self._init_repo()
        commit = self.import_dir(self.path, pin)
        self.git("update-ref", f"refs/heads/{BRANCH}", commit)
        self.git("read-tree", commit)  # index = upstream; the worktree already is
        self.write_state(pin=pin.name, commit=pin.commit)
        return commit

    def identity(self, pin: str | None = None) -> dict[str, str | None]:
        """What the stored upstream of ``pin`` (default: the tree's) is: its llama.cpp commit, or its
        release and archive sha256 (recorded in its backup manifest), and that in words."""
        name = pin or self.pin
        path = self.manifest_path(name)
        manifest = json.loads(path.read_text()) if path.is_file() else {}
        commit = manifest.get("commit", self.read_state().get("commit") if name == self.pin else None)
        release, sha = manifest.get("release"), manifest.get("archive_sha256")
        return {"pin": name, "commit": commit, "release": release, "archive_sha256": sha,
                "identity": identity_text(commit, release, sha) if commit or release else "unknown"}

    def commit_tree(self, tree: str, parents: list[str], message: str, author: str) -> str:
        name, email = split_author(author)
        with tempfile.NamedTemporaryFile("w", suffix=".msg", delete=False, encoding="utf-8") as fh:
            fh.write(message if message.endswith("\n") else message + "\n")
        try:
            args = ["commit-tree", tree, "-F", fh.name]
            for parent in parents:
                args += ["-p", parent]
            env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email}
            return self.git(*args, env=env).text.strip()
        finally:
            os.unlink(fh.name)

    def blob_digests(self, ref: str) -> dict[str, dict[str, str]]:
        """sha256 + mode of every file in the git tree of ``ref``, from the object store."""
        listing = self.git("ls-tree", "-r", "-z", "--full-tree", ref).text
        entries = []
        for item in listing.split("\0"):
            if not item:
                continue
            meta, path = item.split("\t", 1)
            mode, kind, sha = meta.split()
            if kind == "blob":
                entries.append((path, mode, sha))
        result: dict[str, dict[str, str]] = {}
        with tempfile.NamedTemporaryFile("w", delete=False) as fh:
            fh.write("".join(sha + "\n" for _, _, sha in entries))
        try:
            out = self.git("cat-file", "--batch", stdin=Path(fh.name), binary=True).out
        finally:
            os.unlink(fh.name)
        assert isinstance(out, bytes)
        pos = 0
        for path, mode, _sha in entries:
            end = out.index(b"\n", pos)
            size = int(out[pos:end].split()[2])
            content = out[end + 1: end + 1 + size]
            pos = end + 1 + size + 1
            result[path] = {"sha256": hashlib.sha256(content).hexdigest(), "mode": mode}
        return result

    def verify_backup(self, pin: str | None = None) -> list[str]:
        """Problems with the stored pristine tree (empty: it is intact, byte for byte)."""
        pin = pin or self.pin
        manifest = self.manifest(pin)
        tag = TAG_PREFIX + pin
        if self.rev(tag) is None:
            return [f"tag {tag} is missing"]
        problems = []
        tree = self.git("rev-parse", f"{tag}^{{tree}}").text.strip()
        if tree != manifest["tree"]:
            problems.append(f"{tag} points at tree {tree}, the manifest recorded {manifest['tree']}")
        diff = compare(manifest["files"], self.blob_digests(tag))
        if not diff.clean:
            problems.append(f"stored upstream differs from the manifest: {diff.summary()}")
        return problems

    def verify_worktree(self, pin: str | None = None) -> TreeDiff:
        """How the files on disk differ from pristine upstream (by sha256 and mode)."""
        return compare(self.manifest(pin)["files"], scan(self.path))

    # -- working state -------------------------------------------------------------------------

    def dirty(self) -> list[str]:
        """Uncaptured edits: ``XY path`` for modified/added/deleted files (ignored files excepted)."""
        out = self.git("status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames").text
        return [item for item in out.split("\0") if item]

    def stack(self, rev: str = "HEAD") -> list[StackCommit]:
        """Commits from the pristine upstream to ``rev`` (default HEAD), oldest first."""
        tag = self.tag
        revs = self.git("rev-list", "--reverse", "--parents", f"{tag}..{rev}").text.split("\n")
        commits = []
        for line in filter(None, revs):
            sha, *parents = line.split()
            if len(parents) != 1:
                raise OpencotiError(f"{self.path}: commit {sha[:12]} is a merge; the stack must be linear")
            message = self.git("show", "-s", "--format=%B", sha).text
            _, patch, patch_sha = parse_message(message)
            commits.append(StackCommit(sha, message, patch, patch_sha))
        if commits and self.git("merge-base", "--is-ancestor", tag, rev, check=False).rc != 0:
            raise OpencotiError(f"{self.path}: {rev} is not on top of {tag}")
        return commits

    def author_of(self, sha: str) -> str:
        return self.git("show", "-s", "--format=%an <%ae>", sha).text.strip()

    def reset_hard(self, ref: str, ignored: bool = False) -> None:
        """Worktree and index to ``ref``; untracked files removed (ignored ones too if asked)."""
        self.git("reset", "--quiet", "--hard", ref)
        self.git("clean", "-ffdxq" if ignored else "-ffdq")

    def move_head(self, sha: str) -> None:
        """Point the branch at ``sha`` without touching index or worktree."""
        self.git("update-ref", "HEAD", sha)

    def commit_index(self, message: str, author: str, index: Path | None = None) -> str:
        tree = self.git("write-tree", index=index).text.strip()
        parent = self.rev("HEAD")
        commit = self.commit_tree(tree, [parent] if parent else [], message, author)
        self.move_head(commit)
        return commit

    def rescue(self, reason: str) -> Path | None:
        """Save uncaptured commits and edits as one patch under work/rescue/ (None: nothing to save)."""
        chunks: list[bytes] = []
        base = self.last_captured()
        if self.rev("HEAD") != base:
            out = self.git("format-patch", "--stdout", "--binary", f"{base}..HEAD", binary=True).out
            assert isinstance(out, bytes)
            chunks.append(out)
        if self.dirty():
            with tempfile.TemporaryDirectory(prefix="opencoti-index-") as tmp:
                index = Path(tmp) / "index"
                self.git("read-tree", "HEAD", index=index)
                self.git("add", "--all", "--", ".", index=index)
                out = self.git("diff", "--cached", "--binary", "--full-index", "HEAD", index=index,
                               binary=True).out
                assert isinstance(out, bytes)
                chunks.append(out)
        if not chunks:
            return None
        self.settings.rescue_dir.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        path = self.settings.rescue_dir / f"{stamp}-{reason}.patch"
        path.write_bytes(b"".join(chunks))
        return path

    def last_captured(self) -> str:
        """The newest commit that is the pristine upstream or a captured patch."""
        base = self.rev(self.tag) or ""
        for commit in self.stack():
            if commit.patch is None:
                break
            base = commit.sha
        return base

    def uncaptured_commits(self) -> list[StackCommit]:
        stack = self.stack()
        first = next((i for i, c in enumerate(stack) if c.patch is None), len(stack))
        return stack[first:]

    def guard_clean(self, action: str, force: bool) -> Path | None:
        """Refuse to let ``action`` overwrite uncaptured work; with ``force``, save it first."""
        self.refuse_interrupted(action)  # a half-applied patch is not work to capture or rescue
        dirty = self.dirty()
        loose = self.uncaptured_commits()
        if not dirty and not loose:
            return None
        what = []
        if dirty:
            what.append(f"{len(dirty)} edited file(s) ({', '.join(d[3:] for d in dirty)})")
        if loose:
            what.append(f"{len(loose)} commit(s) not captured as patches")
        if not force:
            raise OpencotiError(
                f"{self.path} has uncaptured work: {' and '.join(what)}; refusing to {action}. "
                f"Capture it with `{self.settings.command('snapshot')}`, or rerun with --force "
                f"(saves it to {self.settings.rescue_dir}/<timestamp>.patch first)"
            )
        saved = self.rescue(action.split()[0])
        self.reset_hard(self.last_captured())
        return saved

    # -- transactions --------------------------------------------------------------------------

    @property
    def txn_file(self) -> Path:
        return self.state_dir / "txn"

    def interrupted(self) -> bool:
        return self.txn_file.exists()

    def refuse_interrupted(self, action: str) -> None:
        """Refuse ``action`` while a killed run's transaction is open: the tree holds a half-applied
        patch, which is neither the series nor the user's work. ``apply`` (or ``restore``) recovers it."""
        if self.interrupted():
            cmd = self.settings.command
            raise OpencotiError(
                f"cannot {action}: an opencoti-patch run was killed while applying a patch ({self.txn_file} "
                f"is there) and {self.path} holds its half-applied files; `{cmd('apply')}` brings the tree "
                f"back (it saves them to {self.settings.rescue_dir}/ and applies the rest of the series), "
                f"or `{cmd('restore')}` (pristine upstream)"
            )

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """On any exception (Ctrl-C included) put the tree back at the last good commit."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.txn_file.write_text(self.head() + "\n")
        try:
            yield
        except BaseException:
            self.reset_hard("HEAD")
            self.txn_file.unlink(missing_ok=True)
            raise
        self.txn_file.unlink(missing_ok=True)


@contextmanager
def tree_lock(settings: Settings, wait: float | None = None) -> Iterator[None]:
    """Exclusive lock (fcntl.flock) on ``settings.lock_file``; waits up to ``wait`` seconds."""
    wait = settings.lock_wait if wait is None else wait
    path = settings.lock_file
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    raise LockBusy(
                        f"another opencoti-patch run (pid {holder}) is working on {settings.tree}; "
                        "wait for it or pass --lock-wait SECONDS"
                    ) from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)

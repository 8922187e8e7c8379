"""Apply, unapply and restore the series on the vendored tree (transactional).

Each patch becomes one commit (author and subject from its header, fixed dates, trailers naming
the patch file and its sha256), so re-applying an applied series is a no-op and a changed patch
file is detected and re-applied. Patches must apply exactly (no fuzz, no offset) unless ``--3way``
is asked for; on a failure the tree is put back at the last good patch and the failing patch, file
and hunk are named.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import DEFAULT_AUTHOR
from ..errors import CheckFailed, OpencotiError, PatchFailed
from ..report import render
from .gitrun import run_git
from .hunks import HunkFailure, check_exact
from .series import LINK_MODE, CorruptPatch, Patch, diff_patch, link_problem
from .tree import Tree, TreeDiff, commit_message

CLEAN, MERGED, CONFLICTED, FAILED = "clean", "merged", "conflicted", "failed"
AUTO = "auto-resolved"  # 3-way merge conflicted and every conflict block was resolved by a rule
APPLIED_OK = (CLEAN, MERGED, AUTO)

# A conflict resolver (``markers/resolve.py``, handed down by the CLI): (path, the file merged in
# diff3 style, the old upstream file, the new upstream file, whether the new tree has a name) -> (the
# text to write, the blocks it resolved, the blocks left); each block a dict with ``file``, ``lines``
# and ``rules`` (resolved) or ``why`` (left).
Resolver = Callable[[str, str, str, str, Callable[[str], bool]],
                    tuple[str, list[dict[str, Any]], list[dict[str, Any]]]]
APPLIED_RE = re.compile(r"^Applied patch to '(.+)' (cleanly|with conflicts)\.$")


@dataclass
class Outcome:
    patch: str
    status: str  # clean | merged | conflicted | failed | already | would-apply | popped
    files: list[str] = field(default_factory=list)
    detail: str = ""
    hunk: int | None = None
    line: int | None = None
    resolved: list[dict[str, Any]] = field(default_factory=list)  # conflict blocks a rule resolved
    left: list[dict[str, Any]] = field(default_factory=list)      # conflict blocks left to a person


@dataclass
class Report:
    pin: str
    outcomes: list[Outcome] = field(default_factory=list)
    popped: list[str] = field(default_factory=list)
    noop: bool = False
    dry_run: bool = False
    rescued: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def folder_reader(root: Path) -> Callable[[str], bytes | None]:
    """Current content of a file under ``root`` (a link: its target; None when absent)."""

    def read(path: str) -> bytes | None:
        full = root / path
        if full.is_symlink():
            return str(full.readlink()).encode()
        return full.read_bytes() if full.is_file() else None

    return read


def reader(tree: Tree, index: Path | None = None) -> Callable[[str], bytes | None]:
    """Current content of a tree file: from the worktree, or from ``index`` (a scratch index)."""

    def from_index(path: str) -> bytes | None:
        r = tree.git("cat-file", "blob", f":{path}", index=index, check=False, binary=True)
        return r.out if r.rc == 0 and isinstance(r.out, bytes) else None

    return folder_reader(tree.path) if index is None else from_index


def unmerged(tree: Tree, index: Path | None = None) -> list[str]:
    out = tree.git("diff", "--name-only", "--diff-filter=U", index=index, check=False).text
    return sorted(set(filter(None, out.splitlines())))


def apply_one(tree: Tree, patch: Patch, three_way: bool, index: Path | None = None,
              resolver: Resolver | None = None) -> Outcome:
    """Apply one patch to the index+worktree (or only to the scratch ``index``); no commit. With a
    ``resolver`` (worktree only), the conflict blocks of a 3-way merge it can resolve are resolved
    (each one listed in the outcome) and the rest are left with conflict markers."""
    where = ["--cached"] if index is not None else ["--index"]
    refuse_moved_links(tree, patch, index)
    failure = check_exact(patch, reader(tree, index))
    if failure is None:
        r = tree.git("apply", *where, "--whitespace=nowarn", str(patch.path), index=index, check=False)
        if r.rc == 0:
            return Outcome(patch.name, CLEAN, sorted(patch.paths))
        return Outcome(patch.name, FAILED, [], _git_reason(r.err))
    if not three_way:
        return Outcome(patch.name, FAILED, [failure.file], failure.reason, failure.hunk, failure.line)
    cached = ["--cached"] if index is not None else []
    r = tree.git("apply", "--3way", *cached, "--whitespace=nowarn", str(patch.path), index=index, check=False)
    merged = sorted({m.group(1) for ln in r.err.splitlines() if (m := APPLIED_RE.match(ln.strip()))})
    conflicts = unmerged(tree, index)
    detail = f"exact apply failed ({failure.file}: {failure.reason})"
    if r.rc == 0:
        return Outcome(patch.name, MERGED, merged or [failure.file], detail)
    if conflicts and resolver is not None and index is None:
        resolved, left, still = auto_resolve(tree, conflicts, resolver)
        if not still:
            return Outcome(patch.name, AUTO, sorted({*merged, *conflicts}), detail, resolved=resolved)
        return _conflicted(patch, still, conflicts, merged, failure, resolved, left)
    if conflicts:
        return _conflicted(patch, conflicts, conflicts, merged, failure)
    return Outcome(patch.name, FAILED, [failure.file],
                   f"{failure.reason}; no 3-way merge either: {_three_way_reason(r.err)}",
                   failure.hunk, failure.line)


def _conflicted(patch: Patch, files: list[str], conflicts: list[str], merged: list[str], failure: HunkFailure,
                resolved: list[dict[str, Any]] | None = None, left: list[dict[str, Any]] | None = None
                ) -> Outcome:
    """A conflicted outcome (``files`` still conflicted of git's ``conflicts``) whose detail, hunk and
    line are of the conflicted files: the first file the exact apply failed on may have merged cleanly
    (it is then named as merged, not as the failure)."""
    ours = failure.file in files
    detail = f"3-way merge conflicted in {', '.join(files)}"
    clean = [f for f in merged if f not in conflicts]
    if clean:
        detail += f"; merged cleanly: {', '.join(clean)}"
    if ours:
        detail += f" (exact apply failed at {failure.file}: {failure.reason})"
    return Outcome(patch.name, CONFLICTED, files, detail, failure.hunk if ours else None,
                   failure.line if ours else None, resolved=resolved or [], left=left or [])


def refuse_moved_links(tree: Tree, patch: Patch, index: Path | None = None) -> None:
    """A renamed or copied symbolic link keeps its target, which the diff does not show: refuse one
    that would point outside the tree (or into .git) from its new place (``series._check_link`` checks
    the links a diff writes)."""
    read = reader(tree, index)
    for fp in patch.files:
        if not fp.rename or fp.old_path is None or fp.new_path is None:
            continue
        staged = tree.git("ls-files", "-s", "--", fp.old_path, index=index, check=False).text
        data = read(fp.old_path) if staged.startswith(LINK_MODE + " ") else None
        target = data.decode("utf-8", "surrogateescape") if data is not None else None
        problem = link_problem(fp.new_path, target) if target is not None else None
        if problem:
            raise CorruptPatch(f"{patch.name}: refusing {fp.new_path} -> {target!r}: the symbolic link "
                               f"{fp.old_path} moved there is a link that {problem}")


def auto_resolve(tree: Tree, files: list[str], resolver: Resolver
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Re-merge each conflicted file from its index stages in diff3 style (base sections give the
    rules what our patch changed), let ``resolver`` resolve what it can, write the result; a file with
    nothing left is staged. Returns (resolved blocks, left blocks, files still conflicted)."""
    resolved: list[dict[str, Any]] = []
    left: list[dict[str, Any]] = []
    still: list[str] = []

    known = TreeNames(tree, "HEAD").has  # the new upstream + the patches so far

    with tempfile.TemporaryDirectory(prefix="opencoti-merge-") as tmp:
        for path in files:
            stages = []
            for n in (2, 1, 3):  # ours (the new upstream), base, theirs (with the patch)
                r = tree.git("cat-file", "blob", f":{n}:{path}", check=False, binary=True)
                if r.rc != 0 or not isinstance(r.out, bytes):
                    break
                stages.append(Path(tmp) / f"{n}")
                stages[-1].write_bytes(r.out)
            if len(stages) != 3:  # added or deleted on one side: not a text conflict for the rules
                still.append(path)
                continue
            r = tree.git("merge-file", "-p", "--diff3", "-L", "ours", "-L", "base", "-L", "theirs",
                         *map(str, stages), check=False, binary=True)
            if r.rc < 0 or not isinstance(r.out, bytes):
                still.append(path)
                continue
            ours, base = (st.read_bytes().decode("utf-8", "surrogateescape") for st in stages[:2])
            text, done, rest = resolver(path, r.out.decode("utf-8", "surrogateescape"), base, ours, known)
            (tree.path / path).write_bytes(text.encode("utf-8", "surrogateescape"))
            resolved += done
            left += rest
            if rest:
                still.append(path)
            else:
                tree.git("add", "--", path)
    return resolved, left, still


class TreeNames:
    """Which names a text file of ``rev`` has as a whole word (``git grep -w``), cached: ``has`` asks
    git for one name (stops at the first hit; a name the tree lacks costs a pass over it), ``having``
    for many: more than ``ONE_BY_ONE`` new ones and every word of the tree is read once instead."""

    ONE_BY_ONE = 8

    def __init__(self, tree: Tree, rev: str, only: tuple[str, ...] = ()) -> None:
        self.tree, self.rev, self.only = tree, rev, only  # only: pathspecs (default: every file)
        self.known: dict[str, bool] = {}
        self.words: set[bytes] | None = None

    def has(self, name: str) -> bool:
        if name not in self.known:
            if self.words is not None:
                self.known[name] = name.encode("utf-8", "surrogateescape") in self.words
            else:
                r = self.tree.git("grep", "-q", "-I", "-w", "-F", "-e", name, self.rev, "--", *self.only,
                                  check=False)
                self.known[name] = r.rc == 0
        return self.known[name]

    def having(self, names: Iterable[str]) -> set[str]:
        wanted = set(names)
        if self.words is None and len(wanted - self.known.keys()) > self.ONE_BY_ONE:
            r = self.tree.git("grep", "-h", "-I", "-o", "-E", "[A-Za-z0-9_]+", self.rev, "--", *self.only,
                              check=False, binary=True)  # the words -w sees: runs of word characters
            self.words = set(r.out.split(b"\n")) if isinstance(r.out, bytes) else set()
        return {n for n in wanted if self.has(n)}


def apply_to_folder(folder: Path, patch_file: Path) -> None:
    """Apply a diff exactly (no fuzz, no offset) to the plain files of ``folder`` (no repository:
    ``verify-identical --patch-file`` on an export): the in-memory check names a failing hunk, then
    git writes the files, with no repository above ``folder`` taken for the tree."""
    patch = diff_patch(patch_file.read_bytes(), patch_file.name, path=patch_file)
    failure = check_exact(patch, folder_reader(folder))
    if failure is not None:
        where = f" hunk #{failure.hunk} (line {failure.line})" if failure.hunk else ""
        raise PatchFailed(f"{patch_file} does not apply to {folder}: {failure.file}{where}: {failure.reason}")
    ceiling = {"GIT_CEILING_DIRECTORIES": str(folder.parent)}
    r = run_git(folder, "apply", "--whitespace=nowarn", str(patch_file.resolve()), env=ceiling)
    if r.rc != 0:
        raise PatchFailed(f"{patch_file} does not apply to {folder}: {_git_reason(r.err)}")


def _git_reason(err: str) -> str:
    lines = [ln.removeprefix("error: ").strip() for ln in err.splitlines() if ln.strip()]
    return "; ".join(lines[-2:]) or "git apply failed"


# what `git apply --3way` prints on the way that is not the reason it failed
_GIT_NOISE = re.compile(r"^(error: )?(Checking patch|Applied patch|Applying patch|Falling back"
                        r"|Performing three-way|patch failed:|.*: patch does not apply"
                        r"|.*: does not match index|U )")


def _three_way_reason(err: str) -> str:
    if "lacks the necessary blob" in err:
        return ("the patch's `index` lines name file versions this tree's history does not hold "
                "(it was not made against this upstream), so there is no common base to merge from")
    lines = [ln.strip() for ln in err.splitlines() if ln.strip() and not _GIT_NOISE.match(ln.strip())]
    return "; ".join(ln.removeprefix("error: ") for ln in lines[:2]) or "git found no way to merge it"


def commit_patch(tree: Tree, patch: Patch) -> str:
    message = commit_message(patch.header, patch.name, patch.sha256)
    return tree.commit_index(message, patch.header.author or DEFAULT_AUTHOR)


@contextlib.contextmanager
def scratch_index(tree: Tree, base: str) -> Iterator[Path]:
    """A throw-away index holding ``base``'s tree (the real index and worktree are not touched)."""
    with tempfile.TemporaryDirectory(prefix="opencoti-index-") as tmp:
        index = Path(tmp) / "index"
        tree.git("read-tree", base, index=index)
        yield index


def plan(tree: Tree, patches: list[Patch]) -> tuple[int, list[str]]:
    """How many applied patch commits match the series prefix, and which applied ones must go."""
    stack = [c for c in tree.stack() if c.patch is not None]
    keep = 0
    for commit, patch in zip(stack, patches, strict=False):
        if commit.patch != patch.name or commit.patch_sha256 != patch.sha256:
            break
        keep += 1
    return keep, [c.patch or "" for c in stack[keep:]]


def failure_message(tree: Tree, outcome: Outcome, patch: Patch, applied: int) -> str:
    return render(
        tree.settings.templates_dirs,
        "apply-failure.txt.j2",
        patch=outcome.patch,
        file=outcome.files[0] if outcome.files else "",
        hunk=outcome.hunk,
        line=outcome.line,
        reason=outcome.detail if outcome.status == FAILED
        else f"3-way merge conflicted in {', '.join(outcome.files)}",
        last_good=tree.stack()[-1].patch if applied else "",
        pin=tree.pin,
        applied=applied,
        tree=tree.path,
        patch_path=patch.path,
        cmd=tree.settings.command,
    )


def refuse_empty_series(tree: Tree, names: Sequence[str], action: str) -> None:
    """Refuse ``action`` when the series lists no patch while the tree carries applied ones: that
    series is not the tree's (another folder, or an emptied file), and acting on it would drop them."""
    if names:
        return
    applied = [c.patch for c in tree.stack() if c.patch is not None]
    if applied:
        shown = ", ".join(applied[:3]) + (", ..." if len(applied) > 3 else "")
        raise OpencotiError(
            f"cannot {action}: {tree.settings.series_file} lists no patch, but {tree.path} carries "
            f"{len(applied)} applied ({shown}): give the patches folder of that tree (--patches-dir, or "
            f"run from its project); to take the patches off the tree, `{tree.settings.command('unapply')}`"
        )


def apply_series(
    tree: Tree,
    patches: list[Patch],
    three_way: bool = False,
    dry_run: bool = False,
    force: bool = False,
    after_each: Callable[[Outcome], None] | None = None,
    resolver: Resolver | None = None,
) -> Report:
    """Bring the tree to "pristine + the whole series", one commit per patch."""
    tree.require()
    if not patches:
        refuse_empty_series(tree, [], "apply the series")
        raise OpencotiError(f"nothing to apply: {tree.settings.series_file} lists no patch (the first "
                            f"comes from `{tree.settings.command('snapshot --new NAME')}`)")
    report = Report(pin=tree.pin, dry_run=dry_run)
    if not dry_run:  # leftovers of a killed run (HEAD is its last good patch); whatever is there is kept
        saved = tree.recover_interrupted()
        report.rescued = str(saved) if saved else None
    refuse_during_rebase(tree, "apply the series")
    if dry_run:
        if tree.dirty() or tree.uncaptured_commits():
            raise OpencotiError(f"{tree.path} has uncaptured work; apply would refuse (see `status`)")
    else:
        rescued = tree.guard_clean("apply the series", force)
        report.rescued = str(rescued) if rescued else report.rescued
    keep, pop = plan(tree, patches)
    stack = [c for c in tree.stack() if c.patch is not None]
    base = stack[keep - 1].sha if keep else tree.rev(tree.tag) or ""
    report.popped = pop
    report.outcomes = [Outcome(p.name, "already") for p in patches[:keep]]
    todo = patches[keep:]
    if not todo and not pop:
        report.noop = True
        return report
    if dry_run:
        with scratch_index(tree, base) as index:
            for patch in todo:
                outcome = apply_one(tree, patch, three_way, index)
                report.outcomes.append(outcome)
                if outcome.status not in APPLIED_OK:
                    break
        return report
    if pop:
        tree.reset_hard(base)
    applied = keep
    for patch in todo:
        with tree.transaction():
            outcome = apply_one(tree, patch, three_way, resolver=resolver)
            if outcome.status in APPLIED_OK:
                commit_patch(tree, patch)
                applied += 1
            else:
                tree.reset_hard("HEAD")
            report.outcomes.append(outcome)
            if after_each is not None:
                after_each(outcome)
        if outcome.status not in APPLIED_OK:
            raise PatchFailed(failure_message(tree, outcome, patch, applied), report)
    return report


def unapply(tree: Tree, count: int | None = None, force: bool = False, dry_run: bool = False) -> list[str]:
    """Pop the top ``count`` patches (all when None); returns their names, top first."""
    tree.require()
    refuse_during_rebase(tree, "unapply")
    if not dry_run:
        tree.recover_interrupted()
        tree.guard_clean("unapply", force)
    stack = [c for c in tree.stack() if c.patch is not None]
    n = len(stack) if count is None else min(count, len(stack))
    if n <= 0:
        return []
    popped = [c.patch or "" for c in reversed(stack[len(stack) - n:])]
    if not dry_run:
        target = stack[len(stack) - n - 1].sha if len(stack) > n else tree.rev(tree.tag) or ""
        tree.reset_hard(target)
    return popped


def restore(tree: Tree, force: bool = False) -> tuple[TreeDiff, Path | None]:
    """Pristine upstream, byte for byte (added files deleted too, ignored ones included)."""
    tree.require()
    rescued = tree.recover_interrupted()  # a killed run's half-applied patch is not the user's work
    rescued = tree.guard_clean("restore", force) or rescued
    (tree.state_dir / "rebase.json").unlink(missing_ok=True)
    tree.reset_hard(tree.tag, ignored=True)
    tree.txn_file.unlink(missing_ok=True)
    diff = tree.verify_worktree()
    if not diff.clean:
        raise CheckFailed(f"restored tree still differs from the manifest: {diff.summary()}")
    return diff, rescued


# -- the rebase in progress (``rebase.py``), which apply and unapply refuse to act during --------


def rebase_state_path(tree: Tree) -> Path:
    return tree.state_dir / "rebase.json"


def rebase_state(tree: Tree) -> dict[str, Any] | None:
    """The rebase in progress: stopped at a conflict (``current``), or ``done`` and waiting for the
    snapshot that rewrites patches/ (until then it can still be aborted); None: no rebase."""
    path = rebase_state_path(tree)
    return json.loads(path.read_text()) if path.is_file() else None


def rebase_waiting(tree: Tree, state: dict[str, Any]) -> str:
    """Why ``state`` stops a command, and what to run."""
    cmd = tree.settings.command
    if state.get("done"):
        return (f"the rebase onto {state['to']} is done but patches/ still holds the patches against "
                f"{state['from']}: `{cmd('snapshot')}` rewrites them, or `{cmd('rebase --abort')}` "
                f"goes back to {state['from']}")
    current = (state.get("current") or {}).get("patch", "?")
    if state.get("names_stop"):
        return (f"a rebase onto {state['to']} is in progress ({current} stopped: marked regions git merged "
                f"name what upstream removed, {state['names_stop']}): check them and "
                f"`{cmd('rebase --continue')}`, or `--skip` / `--abort`")
    return (f"a rebase onto {state['to']} is in progress ({current} conflicted): resolve it and "
            f"`{cmd('rebase --continue')}`, or `--skip` / `--abort`")


def refuse_during_rebase(tree: Tree, action: str) -> None:
    state = rebase_state(tree)
    if state:
        raise OpencotiError(f"cannot {action}: {rebase_waiting(tree, state)}")

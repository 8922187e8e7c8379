"""Snapshot (alias refresh): write the vendored tree's changes back into the patch files.

The tree's branch is the truth: every commit above ``upstream/<pin>`` is one patch. Uncommitted
edits are folded into the top patch (``--top``; the default when they only touch files the top
patch already touches) or become a new patch (``--new NAME``); commits made in the tree without an
``Opencoti-Patch`` trailer become new patches (or fold into the top one with ``--top``).

Each patch file is rendered deterministically (template ``patch-header.j2``; zero From line, no
dates, no diffstat, no signature; ``git diff --full-index --binary --no-renames`` with the Myers
algorithm and every user/system git setting ignored), the commits are rewritten with the new
trailers, and the round trip is proven: the new series applied to the pristine upstream in a
scratch index gives the git tree hash of the edited tree, byte for byte.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import DEFAULT_AUTHOR, Settings
from ..errors import CheckFailed, OpencotiError
from .apply import (
    CLEAN,
    apply_one,
    rebase_state,
    rebase_waiting,
    refuse_empty_series,
    scratch_index,
)
from .pins import committed_series, keep_old_series
from .rebase import finish_rebase
from .series import (
    PatchHeader,
    check_name,
    next_name,
    parse_patch,
    read_series,
    render_patch,
    write_series,
)
from .tree import Tree, commit_message, parse_message
from .upstream import load_upstream, set_default_pin

SKIPPED_DIR = "skipped"  # patches/skipped/: the files of patches a rebase skipped, with a note each

DIFF_OPTIONS = (
    "--full-index", "--binary", "--no-renames", "--no-color", "--no-ext-diff", "--no-textconv",
    "--src-prefix=a/", "--dst-prefix=b/", "--diff-algorithm=myers", "--indent-heuristic",
    "--ignore-submodules=none",
)


@dataclass
class Entry:
    name: str | None  # None: a new patch, numbered from ``slug``
    header: PatchHeader
    tree: str  # git tree id after this patch
    slug: str | None = None


@dataclass
class RoundTrip:
    ok: bool
    expected: str
    actual: str
    differs: list[str] = field(default_factory=list)
    detail: str = ""


@dataclass
class SnapshotResult:
    series: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    folded_into: str | None = None
    stale: list[str] = field(default_factory=list)
    roundtrip: RoundTrip | None = None
    marked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # set aside in patches/skipped/ (a rebase skipped them)
    rebased_onto: str | None = None  # the done rebase this snapshot finished
    default_pin: str | None = None  # "NEW (was OLD)" when it moved upstream.toml's default to NEW
    old_series: str | None = None  # what became of the series the rebase's old pin had (pins.keep_old_series)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NewPatch:
    """What the user said about a patch being created (or the top one, with --top)."""

    name: str | None = None
    subject: str | None = None
    description: str | None = None
    feature: str | None = None
    upstream_status: str | None = None
    author: str | None = None
    tests: tuple[str, ...] | None = None  # the `Test:` lines (replacing the patch's own)
    patch: str | None = None  # edit the header of this applied patch (not the top one)
    into: str | None = None  # fold the edits into this applied patch, rewriting the ones above it

    def apply_to(self, header: PatchHeader) -> PatchHeader:
        changes: dict[str, object] = {k: v for k, v in (
            ("subject", self.subject), ("description", self.description), ("feature", self.feature),
            ("upstream_status", self.upstream_status), ("author", self.author), ("tests", self.tests),
        ) if v is not None}
        return replace(header, **changes)  # type: ignore[arg-type]


def _tree_of(tree: Tree, ref: str) -> str:
    return tree.git("rev-parse", f"{ref}^{{tree}}").text.strip()


def _worktree_tree(tree: Tree) -> str:
    """The git tree id of HEAD plus every uncaptured edit (real index and worktree untouched)."""
    with scratch_index(tree, "HEAD") as index:
        tree.git("add", "--all", "--", ".", index=index)
        return tree.git("write-tree", index=index).text.strip()


def _changed_paths(tree: Tree, a: str, b: str) -> set[str]:
    out = tree.git("diff-tree", "-r", "--name-only", "--no-renames", a, b).text
    return set(filter(None, out.splitlines()))


def _diff(tree: Tree, a: str, b: str) -> bytes:
    out = tree.git("diff", *DIFF_OPTIONS, a, b, binary=True).out
    assert isinstance(out, bytes)
    return out


def _entries(tree: Tree, new: NewPatch, top: bool) -> tuple[list[Entry], str | None]:
    """The patch stack as it should be captured, and the patch the edits were folded into."""
    entries: list[Entry] = []
    for commit in tree.stack():
        header, _, _ = parse_message(commit.message, tree.author_of(commit.sha))
        entries.append(Entry(commit.patch, header, _tree_of(tree, commit.sha), commit.subject))
    if new.patch is not None:  # a header edit of one applied patch; edits go where they would anyway
        at = next((i for i, e in enumerate(entries) if e.name == new.patch), None)
        if at is None:
            raise OpencotiError(f"--patch {new.patch}: not an applied patch of the tree")
        entries[at] = replace(entries[at], header=new.apply_to(entries[at].header))
        new = NewPatch()
    base = _tree_of(tree, tree.tag)
    final = _worktree_tree(tree)
    edited = final != (entries[-1].tree if entries else base)
    captured = [i for i, e in enumerate(entries) if e.name is not None]
    loose = [i for i, e in enumerate(entries) if e.name is None]
    if new.into is not None:
        return _fold_into(tree, entries[: captured[-1] + 1] if captured else [], new, base, final), new.into
    if top:
        if not captured:
            raise OpencotiError("no patch is applied, so there is no top patch: use --new NAME")
        last = captured[-1]
        entries = entries[: last + 1]
        entries[last] = Entry(entries[last].name, new.apply_to(entries[last].header), final)
        return entries, entries[last].name
    if new.name is not None:
        if edited:
            subject = new.subject or new.name.replace("-", " ")
            header = new.apply_to(PatchHeader(subject=subject, author=DEFAULT_AUTHOR))
            entries.append(Entry(None, header, final, new.name))
        elif len(loose) == 1:
            e = entries[loose[0]]
            entries[loose[0]] = Entry(None, new.apply_to(e.header), e.tree, new.name)
        else:
            raise OpencotiError(
                "--new NAME: there are no uncaptured edits (or one uncaptured commit) to put in it"
            )
        return entries, None
    if not edited:
        return entries, None
    if not captured or loose:
        raise OpencotiError(
            "uncaptured edits: say where they go, `snapshot --new NAME [--subject ...]` or `--top`"
        )
    top_entry = entries[-1]
    parent = entries[-2].tree if len(entries) > 1 else base
    own = _changed_paths(tree, parent, top_entry.tree)
    outside = sorted(_changed_paths(tree, top_entry.tree, final) - own)
    if outside:
        raise OpencotiError(
            f"the edits touch files the top patch {top_entry.name} does not ({', '.join(outside)}); "
            "use `snapshot --top` to fold them in anyway, or `--new NAME` for a new patch"
        )
    entries[-1] = Entry(top_entry.name, top_entry.header, final)
    return entries, top_entry.name


def _apply_in_scratch(tree: Tree, base: str, diff: bytes) -> tuple[str | None, str]:
    """The git tree of ``base`` with ``diff`` applied (context must match, no fuzz; git may find a hunk
    at another line), or None and git's reason."""
    with tempfile.TemporaryDirectory(prefix="opencoti-fold-") as tmp:
        patch = Path(tmp) / "edits.diff"
        patch.write_bytes(diff)
        with scratch_index(tree, base) as index:
            r = tree.git("apply", "--cached", "--whitespace=nowarn", str(patch), index=index, check=False)
            if r.rc != 0:
                lines = [ln.removeprefix("error: ").strip() for ln in r.err.splitlines() if ln.strip()]
                return None, "; ".join(lines[:2]) or "git apply failed"
            return tree.git("write-tree", index=index).text.strip(), ""


def _fold_into(tree: Tree, entries: list[Entry], new: NewPatch, base: str, final: str) -> list[Entry]:
    """``snapshot --into NAME``: the uncaptured edits (the tree as it is against the top patch, loose
    commits included) folded into applied patch NAME, and each patch above it re-applied on top, so
    that the last one gives the edited tree exactly; a clear refusal when that cannot be."""
    name = new.into
    at = next((i for i, e in enumerate(entries) if e.name == name), None)
    if at is None:
        applied = ", ".join(e.name or "" for e in entries) or "none"
        raise OpencotiError(f"--into {name}: not an applied patch of the tree (applied: {applied})")
    edits = _diff(tree, entries[-1].tree, final)
    if not edits:
        raise OpencotiError(f"--into {name}: there are no uncaptured edits to fold into it")
    above = [e.name or "" for e in entries[at + 1:]]
    folded, why = _apply_in_scratch(tree, entries[at].tree, edits)
    if folded is None:
        raise OpencotiError(f"--into {name}: the edits do not apply to the tree as {name} leaves it ({why}): "
                            f"they change what a patch above it ({', '.join(above)}) brought; fold them into "
                            "that patch, or `--top`")
    out = [*entries[:at], Entry(name, new.apply_to(entries[at].header), folded)]
    for before, e in zip(entries[at:], entries[at + 1:], strict=False):
        rebuilt, why = _apply_in_scratch(tree, out[-1].tree, _diff(tree, before.tree, e.tree))
        if rebuilt is None:
            raise OpencotiError(f"--into {name}: {e.name}, above it, no longer applies on top of the folded "
                                f"edits ({why}): the edits conflict with it; fold them into {e.name} (or a "
                                "patch above), or `--top`")
        out.append(Entry(e.name, e.header, rebuilt))
    if out[-1].tree != final:
        differs = ", ".join(sorted(_changed_paths(tree, out[-1].tree, final)))
        raise OpencotiError(f"--into {name}: with the edits in {name} the patches above it do not give the "
                            f"tree as edited (differs in {differs}): fold them into a patch above, or "
                            "`--top`")
    return out


def snapshot(
    tree: Tree,
    new: NewPatch | None = None,
    top: bool = False,
    check: bool = False,
    verify: bool = True,
) -> SnapshotResult:
    """Write the tree's patch commits (and edits) back into patches/: plan the entries, number the
    new ones, render them, then (unless ``check``) stage, prove and swap in, and rewrite the commits."""
    tree.require()
    tree.refuse_interrupted("snapshot --check" if check else "snapshot")
    rebasing = rebase_state(tree)
    if rebasing and not rebasing.get("done"):
        raise OpencotiError(f"cannot snapshot: {rebase_waiting(tree, rebasing)}")
    series = read_series(tree.settings.patches_dir)
    refuse_empty_series(tree, series, "snapshot --check" if check else "snapshot")
    applied_before = [c.patch for c in tree.stack() if c.patch is not None]
    dropped = [n for n in tree.read_state().get("dropped", []) if n not in applied_before]
    unapplied = [n for n in series if n not in applied_before and n not in dropped]
    if check and (tree.dirty() or tree.uncaptured_commits()):
        return SnapshotResult(series=series, stale=["uncaptured edits or commits in the tree"])
    entries, folded = _entries(tree, new or NewPatch(), top)
    if any(e.name is None for e in entries) and unapplied and not check:
        raise OpencotiError(
            f"{len(unapplied)} patch(es) of the series are not applied ({unapplied[0]}, ...): "
            f"`{tree.settings.command('apply')}` them before adding a patch"
        )
    result = SnapshotResult(folded_into=folded, created=_number_new(entries, series))
    rendered = _render(tree, entries, result)
    names = [e.name or "" for e, _ in rendered]
    result.removed = sorted(set(result.removed) | {n for n in applied_before if n not in names})
    result.skipped = [n for n in dropped if n not in names]
    result.series = names + [n for n in unapplied if n not in names]
    for e, data in rendered:
        path = tree.settings.patches_dir / (e.name or "")
        (result.unchanged if path.is_file() and path.read_bytes() == data else result.written).append(
            e.name or "")
    if check:
        result.stale = sorted(set(result.written) | set(result.removed) | set(result.skipped)
                              | ({"series"} if result.series != series else set()))
        return result
    final_tree = entries[-1].tree if entries else _tree_of(tree, tree.tag)
    # the series patches/ holds now fits the rebase's old pin: the project commit that holds it, if any
    old_head = committed_series(tree.settings.patches_dir, rebasing["from"]) if rebasing else None
    _stage_prove_and_swap(tree, rendered, result, final_tree, verify, rebasing)
    _rewrite_commits(tree, [e for e, _ in rendered])
    finished = finish_rebase(tree)
    if finished:
        result.rebased_onto = str(finished["to"])
        result.default_pin = _follow_default(tree, result.rebased_onto)
        if finished["from"] in load_upstream(tree.settings.upstream_file).pins:
            result.old_series = keep_old_series(tree.settings, str(finished["from"]), old_head)
    return result


def _follow_default(tree: Tree, pin: str) -> str | None:
    """patches/ now applies to ``pin``: make it upstream.toml's default, so `prepare` on a fresh
    checkout gets the upstream the patches were written against. Returns "NEW (was OLD)"."""
    path = tree.settings.upstream_file
    default = load_upstream(path).default
    if default == pin:
        return None
    set_default_pin(path, pin)
    return f"{pin} (was {default})"


def _skip_note(name: str, rebasing: dict[str, Any] | None) -> tuple[str, str]:
    """The note beside a set-aside patch file, and the comment that replaces it in the series."""
    if not rebasing:
        return (f"{name} was skipped in a rebase and set aside here by `snapshot`.\n",
                f"# {name}: skipped in a rebase; kept in {SKIPPED_DIR}/{name}")
    outcome = next((o for o in rebasing.get("outcomes", []) if o.get("patch") == name), {})
    files = ", ".join(outcome.get("files") or []) or "?"
    note = (f"{name} was skipped in `rebase --to {rebasing['to']}` (from {rebasing['from']}): it "
            f"conflicted in {files}.\n"
            f"`snapshot` took it out of the series and kept its file here, as it was against "
            f"{rebasing['from']}.\n"
            f"To bring it back, port it onto {rebasing['to']} in the tree (e.g. `git apply --3way` of "
            f"this file, or by hand) and capture it with `opencoti-patch snapshot --new NAME`.\n")
    return note, (f"# {name}: skipped in the rebase onto {rebasing['to']} (conflicted in {files}); "
                  f"kept in {SKIPPED_DIR}/{name}")


def _number_new(entries: list[Entry], series: list[str]) -> list[str]:
    """Give the new entries the next free NNNN-name; returns those names."""
    known = list(series) + [e.name for e in entries if e.name]
    created = []
    for e in entries:
        if e.name is None:
            e.name = next_name(known, e.slug or e.header.subject)
            check_name(e.name)
            known.append(e.name)
            created.append(e.name)
    return created


def _render(tree: Tree, entries: list[Entry], result: SnapshotResult) -> list[tuple[Entry, bytes]]:
    """Each entry's patch file bytes (header + its diff against the one before); an entry whose diff
    is empty goes to ``result.removed``."""
    rendered: list[tuple[Entry, bytes]] = []
    parent = _tree_of(tree, tree.tag)
    for e in entries:
        assert e.name is not None
        diff = _diff(tree, parent, e.tree)
        parent = e.tree
        if not diff:
            result.removed.append(e.name)
            continue
        e.header = replace(e.header, filename=e.name, author=e.header.author or DEFAULT_AUTHOR)
        rendered.append((e, render_patch(tree.settings.templates_dirs, e.header, diff)))
    return rendered


def _stage_prove_and_swap(tree: Tree, rendered: list[tuple[Entry, bytes]], result: SnapshotResult,
                          final_tree: str, verify: bool, rebasing: dict[str, Any] | None = None) -> None:
    """Render the new patches/ into a staging copy, prove the round trip from it, then swap it in.
    Skipped patches are moved to ``skipped/`` with a note, and leave a comment in the series."""
    patches_dir = tree.settings.patches_dir
    names = [e.name or "" for e, _ in rendered]
    with staged_patches_dir(patches_dir) as staging:
        for e, data in rendered:
            if (e.name or "") in result.written:
                (staging / (e.name or "")).write_bytes(data)
        for name in result.removed:
            if name not in names:
                (staging / name).unlink(missing_ok=True)
        comments = []
        for name in result.skipped:
            note, comment = _skip_note(name, rebasing)
            aside = staging / SKIPPED_DIR
            aside.mkdir(exist_ok=True)
            if (staging / name).is_file():
                (staging / name).replace(aside / name)
            (aside / f"{name}.note").write_text(note, encoding="utf-8")
            comments.append(comment)
        write_series(staging, result.series, tuple(comments))
        if verify:
            result.roundtrip = prove_round_trip(tree, names, staging, final_tree)
            if not result.roundtrip.ok:
                raise CheckFailed(
                    f"round trip failed: re-applying the series to {tree.tag} does not give the edited "
                    f"tree ({result.roundtrip.detail or ', '.join(result.roundtrip.differs)}); "
                    f"{patches_dir} was left as it was"
                )


def _rewrite_commits(tree: Tree, entries: list[Entry]) -> None:
    """One commit per patch above the pristine tag, carrying the trailers of the written files."""
    tree.write_state(dropped=[])
    commit = tree.rev(tree.tag) or ""
    for e in entries:
        patch = parse_patch(tree.settings.patches_dir / (e.name or ""))
        message = commit_message(e.header, e.name, patch.sha256)
        commit = tree.commit_tree(e.tree, [commit], message, e.header.author)
    tree.git("read-tree", commit)
    tree.move_head(commit)


@contextmanager
def staged_patches_dir(patches_dir: Path) -> Iterator[Path]:
    """A copy of ``patches_dir`` to change; it replaces ``patches_dir`` when the block succeeds.

    The swap is two renames in the same parent folder; on any error the staging copy is deleted
    and ``patches_dir`` is untouched.
    """
    parent = patches_dir.parent
    staging = Path(tempfile.mkdtemp(prefix=f".{patches_dir.name}.new-", dir=parent))
    old = parent / f".{patches_dir.name}.old-{staging.name.rsplit('-', 1)[-1]}"
    try:
        shutil.copytree(patches_dir, staging, symlinks=True, dirs_exist_ok=True)
        yield staging
        staging.chmod(patches_dir.stat().st_mode & 0o7777)
        patches_dir.rename(old)
        staging.rename(patches_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def prove_round_trip(tree: Tree, names: list[str], patches_dir: Path | None = None,
                     expected: str | None = None) -> RoundTrip:
    """Apply ``names`` (from ``patches_dir``) to the pristine tree in a scratch index; compare with
    the git tree ``expected`` (default: HEAD's)."""
    expected = expected or _tree_of(tree, "HEAD")
    patches_dir = patches_dir or tree.settings.patches_dir
    with scratch_index(tree, tree.tag) as index:
        for name in names:
            patch = parse_patch(patches_dir / name)
            outcome = apply_one(tree, patch, three_way=False, index=index)
            if outcome.status != CLEAN:
                return RoundTrip(False, expected, "", [], f"{name}: {outcome.detail}")
        actual = tree.git("write-tree", index=index).text.strip()
    if actual == expected:
        return RoundTrip(True, expected, actual)
    return RoundTrip(False, expected, actual, sorted(_changed_paths(tree, expected, actual)))


def stale_report(result: SnapshotResult, settings: Settings) -> str:
    if not result.stale:
        return "patches/ is up to date with the tree"
    return (f"patches/ is stale vs the tree: {', '.join(result.stale)} "
            f"(run `{settings.command('snapshot')}`)")


def summary(result: SnapshotResult, patches_dir: Path) -> str:
    lines = []
    if result.folded_into:
        lines.append(f"edits folded into {result.folded_into}")
    for label, items in (("created", result.created), ("written", result.written),
                         ("removed", result.removed), ("unchanged", result.unchanged)):
        if items:
            lines.append(f"{label}: {', '.join(items)}")
    if result.skipped:
        lines.append(f"set aside (skipped in the rebase): {', '.join(result.skipped)} -> "
                     f"{patches_dir / SKIPPED_DIR}/ (each with a .note), out of the series")
    lines.append(f"series: {len(result.series)} patch(es) in {patches_dir / 'series'}")
    rt = result.roundtrip
    if rt is not None:
        lines.append(f"round trip OK: pristine + series = tree {rt.actual[:12]} (byte-identical re-apply)")
    if result.rebased_onto:
        lines.append(f"the rebase onto {result.rebased_onto} is finished (patches/ is written against it)")
    if result.default_pin:
        lines.append(f"upstream.toml: default pin is now {result.default_pin}, the upstream the patches "
                     "apply to")
    if result.old_series:
        lines.append(result.old_series)
    if result.marked:
        lines.append(f"markers added in {', '.join(result.marked)}: capture them with `snapshot --top`")
    return "\n".join(lines)

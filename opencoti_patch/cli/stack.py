"""Click commands of the patch-stack core: fetch, backup, restore, apply, unapply, status,
snapshot (refresh), rebase, prepare. Registered in cli/main.py; the work lives in the stage modules.

Exit codes (docs/usage.md): 0 ok · 1 error · 2 usage · 3 patch failed/conflicted ·
4 check failed (stale, verify, round trip) · 5 lock busy · 130 interrupted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..config import Settings
from ..errors import CheckFailed, OpencotiError, PatchFailed
from ..markers.fix import fix_tree
from ..markers.resolve import check_added_regions, resolve_conflicts
from ..report import info, render
from ..stack import apply as apply_mod
from ..stack import bump as bump_mod
from ..stack import rebase as rebase_mod
from ..stack.capture import NewPatch, snapshot, stale_report, summary
from ..stack.series import load_series
from ..stack.status import status_data
from ..stack.tree import Tree, tree_lock
from ..stack.upstream import Upstream, load_upstream, set_default_pin
from .options import common_options, emit


def _upstream(settings: Settings) -> Upstream:
    return load_upstream(settings.upstream_file, settings.command)


def _outcome_lines(report: apply_mod.Report) -> str:
    lines: list[str] = []
    for o in report.outcomes:
        lines.append(f"  {o.status:<10} {o.patch}" + (f"  ({', '.join(o.files)})" if o.status in
                     ("merged", "conflicted", "failed", apply_mod.AUTO) and o.files else ""))
        lines += [f"      auto-resolved {r['file']}:{r['lines']} ({', '.join(r['rules'])}: {r['detail']})"
                  for r in o.resolved]
        lines += [f"      left          {x['file']}:{x['lines']}"
                  + (f" ({x['rule']})" if x.get("rule") else "") + f": {x['why']}" for x in o.left]
    return "\n".join(lines)


# -- fetch / backup / restore ------------------------------------------------------------------


@click.command("fetch")
@click.option("--pin", help="Pin name from upstream.toml (default: its `default`).")
@click.option("--from", "from_file", type=click.Path(exists=True, path_type=Path),
              help="Use this local archive (checked against the pin's sha256) or folder.")
@click.option("--download-only", is_flag=True, help="Only download and check the archive (cache).")
@common_options
def fetch_cmd(settings: Settings, pin: str | None, from_file: Path | None, download_only: bool) -> None:
    """Download (cached, sha256-checked) and extract the pinned llama.cpp into the tree folder.

    The tree must not exist yet. Archives are extracted safely (no absolute paths, `..`, escaping
    links or devices) and the sdist's dangling `.git` file is dropped. Next: `backup`.
    """
    up = _upstream(settings)
    p = up.pin(pin)
    with tree_lock(settings):
        used = Tree(settings).fetch(p, up, from_file, download_only=download_only)
    click.echo(f"pin {p.name}: {used}" + ("" if download_only else f" -> {settings.tree}"))


@click.command("backup")
@click.option("--pin", help="Pin the fetched tree is (default: the pin `fetch` put there, else "
                            "upstream.toml's default).")
@click.option("--verify", is_flag=True, help="Prove the stored pristine tree is intact (sha256 manifest).")
@click.option("--worktree", is_flag=True,
              help="With --verify: also require the files on disk to be pristine.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@common_options
def backup_cmd(settings: Settings, pin: str | None, verify: bool, worktree: bool, as_json: bool) -> None:
    """Make the fetched tree a git repo whose first commit is upstream exactly.

    Every file is added (regardless of the tree's .gitignore), the commit is tagged
    `upstream/<pin>` and a per-file sha256 manifest is written to .git/opencoti/, with the pin's
    identity (its llama.cpp commit, or its release and archive sha256). With --verify, check the
    stored upstream against the manifest (exit 4 on any difference).
    """
    tree = Tree(settings)
    with tree_lock(settings):
        if not verify:
            if tree.is_repo() and tree.read_state().get("pin"):
                if pin and pin != tree.pin and _upstream(settings).pin(pin).name != tree.pin:
                    raise OpencotiError(
                        f"{settings.tree} is backed up as pin {tree.pin}, not {pin}: "
                        f"`{settings.command('rebase --to ' + pin)}` moves it onto {pin}"
                    )
                click.echo(f"already backed up as {tree.tag}; use --verify to check it")
                return
            p = tree.fetched_pin(_upstream(settings), pin)
            commit = tree.create_backup(p)
            click.echo(f"backed up {settings.tree} as {p.tag} ({commit[:12]}; {p.identity['identity']}), "
                       f"manifest {tree.manifest_path(p.name)}")
            return
        tree.require()
        problems = tree.verify_backup()
        diff = tree.verify_worktree() if worktree else None
        identity = tree.identity()
        data = {"pin": tree.pin, "identity": identity, "backup_ok": not problems, "problems": problems,
                "worktree": None if diff is None else diff.__dict__}
        verdict = ("intact (every file matches its sha256)" if not problems
                   else "DAMAGED: " + "; ".join(problems))
        text = f"backup {tree.tag} ({identity['identity']}): {verdict}"
        if diff is not None:
            text += "\nworktree: " + ("pristine" if diff.clean else f"differs: {diff.summary()}")
        emit(data, as_json, text)
        if problems or (diff is not None and not diff.clean):
            summary_text = diff.summary() if diff else ""
            raise CheckFailed(problems[0] if problems else f"worktree is not pristine: {summary_text}")


@click.command("restore")
@click.option("--force", is_flag=True,
              help="Save uncaptured edits/commits to work/rescue/<timestamp>.patch, then restore.")
@common_options
def restore_cmd(settings: Settings, force: bool) -> None:
    """Put the tree back to pristine upstream, byte for byte (added files deleted too).

    Refuses when the tree has uncaptured edits unless --force. The result is checked against the
    sha256 manifest.
    """
    tree = Tree(settings)
    with tree_lock(settings):
        _, rescued = apply_mod.restore(tree, force)
    if rescued:
        info(f"uncaptured work saved to {rescued}")
    click.echo(f"restored {settings.tree} to {tree.tag} (verified against the manifest)")


# -- apply / unapply / status ------------------------------------------------------------------


def _apply_common(settings: Settings, three_way: bool, dry_run: bool, force: bool, as_json: bool,
                  patches_dir: Path | None = None, auto_resolve: bool = True) -> apply_mod.Report:
    tree = Tree(settings)
    patches = load_series(patches_dir or settings.patches_dir)
    with tree_lock(settings):
        try:
            report = apply_mod.apply_series(tree, patches, three_way=three_way, dry_run=dry_run,
                                            force=force,
                                            resolver=resolve_conflicts if auto_resolve else None)
        except PatchFailed as exc:
            if as_json and isinstance(exc.report, apply_mod.Report):
                emit(exc.report.as_dict(), True)
            raise
    if report.noop:
        text = f"already applied: all {len(patches)} patch(es) of the series are on {tree.tag}; nothing to do"
    else:
        head = "dry run: " if dry_run else ""
        text = f"{head}{len(report.outcomes)} patch(es) on {tree.tag}"
        if report.popped:
            text += f"\n  re-applying changed/removed patches: popped {', '.join(report.popped)}"
        text += "\n" + _outcome_lines(report)
    if report.rescued:
        info(f"uncaptured work saved to {report.rescued}")
    emit(report.as_dict(), as_json, text)
    if dry_run and any(o.status in ("failed", "conflicted") for o in report.outcomes):
        raise PatchFailed("dry run: the series would not apply")
    return report


@click.command("apply")
@click.option("--3way", "three_way", is_flag=True,
              help="Fall back to a 3-way merge when a patch does not apply exactly; report merges.")
@click.option("--dry-run", is_flag=True, help="Try the series in a scratch index; change nothing.")
@click.option("--force", is_flag=True,
              help="Save uncaptured edits to work/rescue/<timestamp>.patch, then apply.")
@click.option("--no-resolve", is_flag=True,
              help="With --3way: leave every conflict to a person (no marker-aware resolution).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@common_options
def apply_cmd(settings: Settings, three_way: bool, dry_run: bool, force: bool, no_resolve: bool,
              as_json: bool) -> None:
    """Apply patches/series in order, one commit per patch, no fuzz.

    Already-applied patches are skipped (a no-op when all are); a patch file that changed since it
    was applied is re-applied. On the first failure the tree is left clean at the last good patch
    and the patch, file and hunk are named (exit 3).
    """
    _apply_common(settings, three_way, dry_run, force, as_json, auto_resolve=not no_resolve)


@click.command("unapply")
@click.argument("count", required=False, type=click.IntRange(min=1))
@click.option("--force", is_flag=True, help="Save uncaptured edits to work/rescue/ first.")
@click.option("--dry-run", is_flag=True, help="Only say what would be popped.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@common_options
def unapply_cmd(settings: Settings, count: int | None, force: bool, dry_run: bool, as_json: bool) -> None:
    """Pop the top COUNT patches (all of them without COUNT)."""
    tree = Tree(settings)
    with tree_lock(settings):
        popped = apply_mod.unapply(tree, count, force, dry_run)
    verb = "would pop" if dry_run else "popped"
    text = f"{verb} {len(popped)} patch(es)" + "".join(f"\n  - {n}" for n in popped)
    text = text if popped else "no patch applied; nothing to do"
    emit({"popped": popped, "dry_run": dry_run}, as_json, text)


@click.command("status")
@click.option("--verify", is_flag=True, help="Also prove the backup intact (hashes every file).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@common_options
def status_cmd(settings: Settings, verify: bool, as_json: bool) -> None:
    """Show the pin and its identity (llama.cpp commit, or release + archive sha256), backup state,
    applied/unapplied patches and uncaptured edits."""
    data = status_data(settings, verify)
    emit(data, as_json, render(settings.templates_dirs, "status.txt.j2", cmd=settings.command, **data))


# -- snapshot / rebase / prepare ---------------------------------------------------------------


@click.command("snapshot")
@click.option("--top", is_flag=True, help="Fold edits (and uncaptured commits) into the top applied patch.")
@click.option("--new", "new_name", metavar="NAME", help="Put the edits in a new patch NNNN-NAME.patch.")
@click.option("--subject", help="Subject of the new (or, with --top, the top) patch.")
@click.option("--description", help="Description paragraph of the patch.")
@click.option("--feature", help="Feature flag gating it, e.g. 'sparse-attn (--sparse-attn, default off)'.")
@click.option("--upstream-status", help="Upstream-Status: Pending | Submitted [url] | Inappropriate [why].")
@click.option("--author", help="Author 'Name <email>' (default: opencoti <patches@opencoti.invalid>).")
@click.option("--test", "tests", multiple=True, metavar="CHECK",
              help="A `Test:` line of the header (repeatable; replaces the patch's own): `markers` or a "
                   "build target with its arguments, run by `check` after this patch.")
@click.option("--patch", "patch_name", metavar="NNNN-name.patch",
              help="Edit the header of this applied patch (instead of the top or a new one).")
@click.option("--into", "into", metavar="NNNN-name.patch",
              help="Fold the edits into this applied patch and rewrite the patches above it (refused when "
                   "one of them conflicts with the edits).")
@click.option("--check", is_flag=True, help="Write nothing; exit 4 when patches/ is stale vs the tree (CI).")
@click.option("--no-verify", is_flag=True, help="Skip the round-trip proof.")
@click.option("--mark", is_flag=True,
              help="Then add UPSTREAM_SYNC markers (like `markers --fix`); capture them with --top.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@common_options
def snapshot_cmd(settings: Settings, top: bool, new_name: str | None, subject: str | None,
                 description: str | None, feature: str | None, upstream_status: str | None,
                 author: str | None, tests: tuple[str, ...], patch_name: str | None, into: str | None,
                 check: bool, no_verify: bool, mark: bool, as_json: bool) -> None:
    """Write the tree's edits and commits back into patches/ (alias: refresh).

    Edits go into the top patch (--top, or by default when they only touch its files), a new one
    (--new NAME), or any applied patch (--into NNNN-name.patch: the patches above it are rewritten
    on top of it). Patch files are rendered deterministically, then the round trip is proven:
    pristine upstream + the series gives the edited tree's exact git tree hash.
    """
    if sum(map(bool, (top, new_name, patch_name, into))) > 1:
        raise click.UsageError("--top, --new, --patch and --into are exclusive")
    new = NewPatch(new_name, subject, description, feature, upstream_status, author,
                   tests=tests or None, patch=patch_name, into=into)
    tree = Tree(settings)
    with tree_lock(settings):
        result = snapshot(tree, new, top=top, check=check, verify=not no_verify)
        if mark and not check:
            fixed = fix_tree(tree.path, load_series(settings.patches_dir))
            result.marked = sorted({c.path for c in fixed.changes})
    if check:
        emit(result.as_dict(), as_json, stale_report(result, settings))
        if result.stale:
            raise CheckFailed("patches/ is stale vs the tree")
        return
    emit(result.as_dict(), as_json, summary(result, settings.patches_dir))


refresh_cmd = click.Command(
    "refresh", callback=snapshot_cmd.callback, params=snapshot_cmd.params,
    help="Alias of `snapshot`.", short_help="Alias of snapshot.",
)


@click.command("rebase")
@click.option("--to", "to_pin", metavar="PIN", help="Pin (from upstream.toml) to move the series onto.")
@click.option("--from", "from_file", type=click.Path(exists=True, path_type=Path),
              help="Local archive or folder for the new pin.")
@click.option("--continue", "cont", is_flag=True, help="Commit the resolved patch and go on.")
@click.option("--skip", is_flag=True, help="Drop the conflicted patch and go on.")
@click.option("--abort", is_flag=True, help="Go back to the old pin and stack.")
@click.option("--write-pin", is_flag=True, help="When done, make PIN upstream.toml's default.")
@click.option("--force", is_flag=True,
              help="Save uncaptured edits to work/rescue/ first (--to; --abort of a done rebase).")
@click.option("--no-resolve", is_flag=True,
              help="Leave every conflict to a person (no marker-aware resolution).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@common_options
def rebase_cmd(settings: Settings, to_pin: str | None, from_file: Path | None, cont: bool, skip: bool,
               abort: bool, write_pin: bool, force: bool, no_resolve: bool, as_json: bool) -> None:
    """Re-apply the series onto another upstream pin (3-way) and report each patch.

    Each patch is clean, merged (3-way, no conflict) or conflicted (files named). On a conflict
    the tree keeps the conflict markers: resolve, then `rebase --continue` (or --skip/--abort).
    A patch that applied also stops, as a conflict, when a marked region it adds names what the old
    upstream file has and the new upstream file and tree have nowhere (names-clean-merge).
    When done, `snapshot` rewrites the patch files against the new upstream.
    """
    if sum(map(bool, (to_pin, cont, skip, abort))) != 1:
        raise click.UsageError("give exactly one of --to PIN, --continue, --skip, --abort")
    tree = Tree(settings)
    patches = load_series(settings.patches_dir)
    resolver = None if no_resolve else resolve_conflicts
    with tree_lock(settings):
        if abort:
            aborted = rebase_mod.rebase_abort(tree, force)
            if aborted.get("rescued"):
                info(f"uncaptured work saved to {aborted['rescued']}")
            click.echo(f"rebase onto {aborted['to']} aborted; back on {aborted['from']} and its stack"
                       + (f"; upstream.toml's default pin is {aborted['default_restored']} again"
                          if aborted.get("default_restored") else ""))
            return
        if cont:
            report, pending = rebase_mod.rebase_continue(tree, patches, resolver, check_added_regions)
        elif skip:
            report, pending = rebase_mod.rebase_skip(tree, patches, resolver, check_added_regions)
        else:
            up = _upstream(settings)
            report, pending = rebase_mod.rebase(tree, patches, up.pin(to_pin), up, settings, from_file,
                                                force, resolver, check_added_regions)
    text = f"rebase onto {report.pin}:\n{_outcome_lines(report)}"
    if pending:
        text += "\n" + _stop_text(pending, f"`{settings.command('rebase --continue')}`")
    else:
        text += (f"\ndone; run `{settings.command('snapshot')}` to rewrite the patches against "
                 f"{report.pin} (until then `{settings.command('rebase --abort')}` goes back)")
        default = _upstream(settings).default
        if write_pin and default != report.pin:
            set_default_pin(settings.upstream_file, report.pin)
            text += f"\n{settings.upstream_file}: default pin is now {report.pin} (was {default})"
        elif default != report.pin:
            text += (f"\nnote: {report.pin} is not upstream.toml's default pin ({default}); `snapshot` "
                     f"makes it the default when it writes the patches (they then apply to {report.pin})")
    emit(report.as_dict() | {"pending": bool(pending)}, as_json, text)
    if pending:
        _raise_stop(pending)


def _stop_text(pending: dict[str, Any], then: str, others: str = "--skip / --abort") -> str:
    """What a person does at a rebase's stop (a conflict, or a names stop), then ``then`` (or ``others``)."""
    if pending.get("names_stop"):
        return (f"{pending['current']['patch']} applied, but git merged marked regions that name what "
                "the old upstream had and the new upstream and tree have nowhere "
                f"({pending['names_stop']}, listed above): check each region for the identifiers named (a "
                "member or API upstream renamed or dropped: port the code, not just its place); the step "
                f"is staged in the tree. Then {then} (commits the tree as it stands, also when you judge the "
                f"code right), or {others}")
    return f"resolve the conflicts in the tree, then {then} (or {others})"


def _raise_stop(pending: dict[str, Any]) -> None:
    current = pending["current"]
    if pending.get("names_stop"):
        raise PatchFailed(f"{current['patch']} stopped by the names check ({pending['names_stop']}) in "
                          f"{', '.join(current['files'])}: check the regions listed")
    raise PatchFailed(f"{current['patch']} {current['status']} in {', '.join(current['files'])}")


@click.command("bump")
@click.argument("pin")
@click.option("--from", "from_file", type=click.Path(exists=True, path_type=Path),
              help="Local archive or folder for the default pin, when the tree must be fetched first.")
@click.option("--no-resolve", is_flag=True,
              help="Leave every conflict to a person (no marker-aware resolution).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@common_options
def bump_cmd(settings: Settings, pin: str, from_file: Path | None, no_resolve: bool, as_json: bool) -> None:
    """Move the tree and patches/ onto PIN, going on from wherever an earlier run stopped.

    Run it again after each stop: it fetches and backs up the default pin where there is no tree,
    applies the series and rebases onto PIN, stops at a conflict (exit 3; resolve in the tree and run
    it again: it continues the rebase), writes the patches against PIN (`snapshot`; PIN becomes the
    default). On PIN already it applies patches/ where the tree lags; uncaptured edits are refused
    (`snapshot --into NNNN-name.patch` folds a fix into its patch). It never deletes the tree.
    `ci/rebuild.sh --to PIN` runs it, then checks and builds the series.
    """
    up = _upstream(settings)
    tree = Tree(settings)
    resolver = None if no_resolve else resolve_conflicts
    with tree_lock(settings):
        result = bump_mod.bump(tree, up.pin(pin), up, settings, from_file, resolver, check_added_regions)
    name = up.pin(pin).name
    text = f"bump onto {name}:\n" + "\n".join(f"  - {s}" for s in result.steps)
    if result.report is not None:
        text += f"\nrebase onto {result.report.pin}:\n{_outcome_lines(result.report)}"
    if result.pending is not None:
        again = f"run this again (`{settings.command('bump ' + name)}`, or `ci/rebuild.sh --to {name}`)"
        others = f"`{settings.command('rebase --skip')}` / `--abort`"
        text += "\n" + _stop_text(result.pending, again, others)
    elif result.snapshot is not None:
        text += "\n" + summary(result.snapshot, settings.patches_dir)
    if result.done:
        text += (f"\ndone: patches/ is written against {name}; next: `{settings.command('check')}` builds it "
                 "patch by patch")
    emit(result.as_dict(), as_json, text)
    if result.pending is not None:
        _raise_stop(result.pending)


@click.command("prepare")
@click.option("--pin", help="Pin name (default: upstream.toml's default).")
@click.option("--from", "from_file", type=click.Path(exists=True, path_type=Path),
              help="Local archive or folder for the pin.")
@click.option("--3way", "three_way", is_flag=True, help="Allow 3-way merges when applying.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report of the apply step.")
@common_options
def prepare_cmd(settings: Settings, pin: str | None, from_file: Path | None, three_way: bool,
                as_json: bool) -> None:
    """Fetch -> extract -> backup -> apply: the patched tree, ready to build. Idempotent."""
    up = _upstream(settings)
    tree = Tree(settings)
    with tree_lock(settings):
        p = tree.fetched_pin(up, pin) if tree.exists() and not tree.is_repo() else up.pin(pin)
        if not tree.exists():
            info(f"fetching {p.name}: {tree.fetch(p, up, from_file)}")
        if not tree.is_repo() or not tree.read_state().get("pin"):
            tree.create_backup(p)
            info(f"backed up as {p.tag}")
        elif tree.pin != p.name:
            rebasing = apply_mod.rebase_state(tree)
            if rebasing:
                raise OpencotiError(f"cannot prepare {p.name}: {apply_mod.rebase_waiting(tree, rebasing)}")
            raise OpencotiError(
                f"{settings.tree} is on pin {tree.pin}, not {p.name}: "
                f"`{settings.command('rebase --to ' + p.name)}` or remove the tree"
            )
        if not load_series(settings.patches_dir):  # a project before its first patch: nothing to apply yet
            apply_mod.refuse_empty_series(tree, [], "prepare")
            click.echo(f"{settings.tree} is {tree.tag}; {settings.series_file} lists no patch yet (the first "
                       f"comes from `{settings.command('snapshot --new NAME')}`)")
            return
    _apply_common(settings, three_way, False, False, as_json)


COMMANDS = [prepare_cmd, fetch_cmd, backup_cmd, apply_cmd, unapply_cmd, restore_cmd, status_cmd, snapshot_cmd,
            refresh_cmd, rebase_cmd, bump_cmd]

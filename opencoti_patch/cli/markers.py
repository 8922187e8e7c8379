"""Click command ``markers``: audit (or ``--fix``) the UPSTREAM_SYNC markers of the series."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..config import Settings
from ..errors import CheckFailed, OpencotiError, UsageProblem
from ..markers.audit import audit, format_report
from ..markers.fix import fix_tree
from ..report import info
from ..stack.apply import rebase_state
from ..stack.series import Patch, diff_patch, load_series
from ..stack.status import stale_against_series
from ..stack.tree import Tree, tree_lock
from .options import common_options


def whole_series_tree(settings: Settings) -> Path | None:
    """The default tree when it carries exactly the series (the exact check's input), else None:
    what `rebuild` requires too (stack/status.stale_against_series)."""
    tree = Tree(settings)
    if not tree.exists() or not tree.is_repo() or not tree.read_state().get("pin"):
        return None
    return None if stale_against_series(tree) else settings.tree


def _load(settings: Settings, diff_file: Path | None, feature: str | None) -> list[Patch]:
    try:
        if diff_file is not None:
            stdin = str(diff_file) == "-"
            data = sys.stdin.buffer.read() if stdin else diff_file.read_bytes()
            return [diff_patch(data, "stdin" if stdin else diff_file.name, feature)]
        patches = load_series(settings.patches_dir)
        if not patches:
            raise OpencotiError(f"{settings.series_file} lists no patch: nothing to audit (--diff FILE "
                                "audits a plain diff)")
        return patches
    except OSError as exc:
        raise OpencotiError(str(exc)) from exc


@click.command("markers")
@click.option("--json", "as_json", is_flag=True, help="print the regions and issues as JSON")
@click.option("--fix", is_flag=True,
              help="wrap unmarked changes in the tree in begin/end markers (then run snapshot)")
@click.option("--diff", "diff_file", type=click.Path(allow_dash=True, dir_okay=False, path_type=Path),
              help="audit this diff (e.g. `git diff upstream`) instead of the series; - = stdin")
@click.option("--feature", help="the feature of --diff (a bare diff has no Feature: header)")
@common_options
def markers_command(settings: Settings, as_json: bool, fix: bool, diff_file: Path | None,
                    feature: str | None) -> None:
    """Check that every change to an upstream file is inside UPSTREAM_SYNC markers.

    Lists every marked region (the map an upstream sync works from) and fails (exit 4) on
    unmarked changes, unmatched or nested begin/end and feature mismatches. The check is exact
    against --tree, else against the default tree when it carries the whole series; only when
    there is no such tree does it fall back to the patches alone (and says so).
    """
    patches = _load(settings, diff_file, feature)
    explicit = "--tree" in settings.path_args
    if explicit and not settings.tree.is_dir():
        raise OpencotiError(f"--tree {settings.tree}: no such folder")
    if fix:
        if not explicit and whole_series_tree(settings) is None:
            raise UsageProblem("--fix needs --tree (it edits the files of the tree)")
        with tree_lock(settings):
            Tree(settings).refuse_interrupted("markers --fix")
            result = fix_tree(settings.tree, patches)
        if as_json:
            click.echo(json.dumps(result.to_dict(), indent=2))
        else:
            for change in result.changes:
                click.echo(str(change))
            for issue in result.refused:
                click.echo(f"{issue}: refused")
            click.echo(format_report(result.report))
            if result.changes:
                click.echo(f"now run `{settings.command('snapshot')}` to capture the markers in the patches")
        if not result.ok:
            raise CheckFailed("markers --fix: some changes could not be marked (listed above)")
        return
    tree = settings.tree if explicit else (whole_series_tree(settings) if diff_file is None else None)
    if tree is None and not explicit:
        info(f"markers: no tree carrying the whole series at {settings.tree}: checking the patches "
             "alone (pass --tree for the exact check)")
    report = audit(patches, tree)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else format_report(report))
    if not report.ok:
        stale = _not_the_series(settings) if tree is not None and diff_file is None else ""
        raise CheckFailed(f"markers: {len(report.errors)} error(s) (listed above){stale}")


def _not_the_series(settings: Settings) -> str:
    """Why the managed tree the audit read does not carry patches/ (a rebase not yet snapshotted,
    uncaptured edits, ...), said so that the errors are read as that, with what to run; '' otherwise."""
    tree = Tree(settings)
    if not tree.is_repo() or not tree.read_state().get("pin"):
        return ""
    problems = stale_against_series(tree)
    if not problems:
        return ""
    rebasing = rebase_state(tree)
    cmd = settings.command
    first = (f"finish the rebase (`{cmd('rebase --continue')}`) and `{cmd('snapshot')}` first"
             if rebasing and not rebasing.get("done") else f"run `{cmd('snapshot')}` first (it writes the "
                                                           "tree's patches)")
    return (f"; but {settings.tree} does not carry patches/ ({'; '.join(problems)}) and the audit reads "
            f"each patch of patches/ in it, so the errors may be only that: {first}, then `markers` again")

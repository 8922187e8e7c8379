"""The upstream bump as one command that goes on from wherever an earlier run stopped (`bump PIN`,
the first stage of ``ci/rebuild.sh --to PIN``).

Each run looks at the tree and does the next step, until patches/ is written against PIN:

- no tree (or not backed up): fetch and back up the default pin;
- a rebase onto PIN stopped at a conflict: ``rebase --continue`` (the person resolved it in the tree;
  markers left are refused); it may stop again at a later patch;
- a rebase onto PIN done: ``snapshot`` (the patches are rewritten, PIN becomes the default);
- the tree on another pin, no rebase: apply its series (idempotent), then ``rebase --to PIN``;
- the tree on PIN, no rebase: nothing to move; patch files changed since they were applied are
  applied again; uncaptured edits (a fix after ``check`` failed) are refused, naming
  ``snapshot --into NNNN-name.patch``.

A rebase onto another pin in progress is refused. Nothing here deletes the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Settings
from ..errors import OpencotiError
from .apply import Report, Resolver, apply_series, rebase_state
from .capture import SnapshotResult, snapshot
from .rebase import NamesCheck, rebase, rebase_continue
from .series import load_series
from .status import stale_against_series
from .tree import Tree
from .upstream import Pin, Upstream


@dataclass
class BumpResult:
    pin: str
    steps: list[str] = field(default_factory=list)  # what this run did, in order
    report: Report | None = None  # the rebase's report when one ran (every patch so far)
    pending: dict[str, Any] | None = None  # the stop: a conflict or a names stop, for a person
    snapshot: SnapshotResult | None = None

    @property
    def done(self) -> bool:
        """patches/ is written against the pin and the tree carries it."""
        return self.pending is None

    def as_dict(self) -> dict[str, Any]:
        report = self.report.as_dict() if self.report else {"pin": self.pin, "outcomes": []}
        return report | {"steps": self.steps, "pending": self.pending is not None, "stopped": self.pending,
                         "snapshot": self.snapshot.as_dict() if self.snapshot else None, "done": self.done}


def _backed_up(tree: Tree) -> bool:
    return tree.is_repo() and bool(tree.read_state().get("pin"))


def _start(tree: Tree, upstream: Upstream, from_file: Path | None, result: BumpResult) -> None:
    """A tree of the default pin (fetched and backed up) where there is none yet."""
    pin = tree.fetched_pin(upstream) if tree.exists() else upstream.pin(None)
    if not tree.exists():
        tree.fetch(pin, upstream, from_file)
        result.steps.append(f"fetched {pin.name}")
    tree.create_backup(pin)
    result.steps.append(f"backed up {pin.name} ({pin.identity['identity']})")


def _on_pin(tree: Tree, resolver: Resolver | None, result: BumpResult) -> None:
    """The tree is on the pin with no rebase: patches/ is written against it; bring the tree to it."""
    settings = tree.settings
    dirty, loose = tree.dirty(), tree.uncaptured_commits()
    if dirty or loose:
        files = ", ".join(d[3:] for d in dirty) or f"{len(loose)} commit(s)"
        raise OpencotiError(
            f"{tree.path} is on {tree.pin} with uncaptured work ({files}): capture it into the patch it "
            f"fixes, `{settings.command('snapshot --into NNNN-name.patch')}` (or --top, --new NAME), "
            "then run this again")
    if stale_against_series(tree):
        report = apply_series(tree, load_series(settings.patches_dir), resolver=resolver)
        result.steps.append(f"applied patches/ on {tree.pin} ({len(report.outcomes)} patch(es))")
    else:
        result.steps.append(f"the tree is on {tree.pin} and carries patches/, written against it")


def bump(tree: Tree, pin: Pin, upstream: Upstream, settings: Settings, from_file: Path | None = None,
         resolver: Resolver | None = None, names_check: NamesCheck | None = None) -> BumpResult:
    """The next steps of moving the tree and patches/ onto ``pin`` (see the module); stops at a
    conflict (``result.pending``), else returns with patches/ written against ``pin``."""
    result = BumpResult(pin.name)
    if not _backed_up(tree):
        _start(tree, upstream, from_file, result)
    state = rebase_state(tree)
    if state and state["to"] != pin.name:
        cmd = settings.command
        raise OpencotiError(f"a rebase onto {state['to']} is in progress in {tree.path}, not onto "
                            f"{pin.name}: finish it (`{cmd('rebase --continue')}`, then `snapshot`) or "
                            f"`{cmd('rebase --abort')}`, then run this again")
    if state is None and tree.pin == pin.name:
        _on_pin(tree, resolver, result)
        return result
    patches = load_series(settings.patches_dir)
    if state is None:
        report = apply_series(tree, patches, resolver=resolver)
        if not report.noop:
            result.steps.append(f"applied the series on {tree.pin}")
        result.steps.append(f"rebase {tree.pin} -> {pin.name}")
        result.report, result.pending = rebase(tree, patches, pin, upstream, settings, None, False, resolver,
                                               names_check)
    elif not state.get("done"):
        current = (state.get("current") or {}).get("patch", "?")
        result.steps.append(f"rebase --continue ({current}, as resolved in the tree)")
        result.report, result.pending = rebase_continue(tree, patches, resolver, names_check)
    if result.pending is not None:
        return result
    result.snapshot = snapshot(tree)
    result.steps.append(f"snapshot: patches/ written against {pin.name}")
    return result


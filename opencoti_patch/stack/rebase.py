"""Rebase the series onto another upstream pin: 3-way, stopping at a conflict for a person
(``--continue``, ``--skip``, ``--abort``), with the names check that stops a step whose marked regions name
what upstream removed. The state of a rebase in progress, which apply and unapply refuse to act during,
lives in ``apply.py``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import TAG_PREFIX, Settings
from ..errors import CheckFailed, OpencotiError
from .apply import (
    APPLIED_OK,
    CONFLICTED,
    FAILED,
    Outcome,
    Report,
    Resolver,
    TreeNames,
    apply_one,
    commit_patch,
    rebase_state,
    rebase_state_path,
    rebase_waiting,
    refuse_during_rebase,
    refuse_empty_series,
)
from .series import Patch, parse_diff
from .tree import Tree
from .upstream import Pin, Upstream, load_upstream, materialize, set_default_pin

# A names check of a rebase step (``markers/resolve.check_added_regions``, handed down by the CLI):
# (path, the file as the step leaves it, the lines the step added to it (1-based), the file in the old
# pin or None, in the new pin or None, which of some names the new tree has, which the old pin's
# headers have) -> the marked regions it flags, each a dict with ``file``, ``lines``, ``names``, ``rule``,
# ``why``.
Having = Callable[[Iterable[str]], set[str]]
# where a fork-only file meets upstream: the headers it can include (what the old pin's tree has in
# them stands for the old file a fork-only file does not have; a local variable of some upstream .cpp
# the new tree dropped is no port)
HEADERS = ("*.h", "*.hh", "*.hpp", "*.cuh", "*.inl")
NamesCheck = Callable[[str, str, list[int], str | None, str | None, Having, Having], list[dict[str, Any]]]


def _blob(tree: Tree, spec: str) -> str | None:
    r = tree.git("cat-file", "blob", spec, check=False, binary=True)
    return r.out.decode("utf-8", "surrogateescape") if r.rc == 0 and isinstance(r.out, bytes) else None


def staged_additions(tree: Tree) -> dict[str, list[int]]:
    """Per file the index adds or changes against HEAD (one rebase step, staged): the lines it adds
    (1-based, in the staged file)."""
    r = tree.git("diff", "--cached", "-U0", "--no-color", "--no-ext-diff", "--no-renames", "--diff-filter=AM",
                 "HEAD", "--", binary=True)
    if not isinstance(r.out, bytes) or not r.out.strip():
        return {}
    added: dict[str, list[int]] = {}
    for fp in parse_diff(r.out, "the staged step"):
        lines = [n for h in fp.hunks for n, tag, _ in h.new_side() if tag == "+"]
        if fp.new_path and not fp.binary and lines:
            added[fp.new_path] = lines
    return added


def names_scan(tree: Tree, state: dict[str, Any], check: NamesCheck) -> list[dict[str, Any]]:
    """``check`` on each file the staged step adds lines to, against the rebase's old and new pins
    (``state``): the marked regions it flags (``names-clean-merge``)."""
    old, new = TAG_PREFIX + state["from"], TAG_PREFIX + state["to"]
    known, old_known = TreeNames(tree, "HEAD").having, TreeNames(tree, old, HEADERS).having
    flagged: list[dict[str, Any]] = []
    for path, lines in staged_additions(tree).items():
        text = _blob(tree, f":{path}")
        if text is not None:
            flagged += check(path, text, lines, _blob(tree, f"{old}:{path}"), _blob(tree, f"{new}:{path}"),
                             known, old_known)
    return flagged


def names_stop(tree: Tree, state: dict[str, Any], outcome: dict[str, Any], check: NamesCheck | None
               ) -> bool:
    """Run the names check on the staged step; when it flags regions, make the step a conflict for a
    person (``state["current"]``, saved; the step stays staged in the tree). True when it stopped."""
    flagged = names_scan(tree, state, check) if check is not None else []
    if not flagged:
        return False
    files = sorted({f["file"] for f in flagged})
    rule = flagged[0]["rule"]  # the check's rule name (names-clean-merge): the stop is named by it
    was = f"{outcome['status']}: {outcome['detail']}" if outcome.get("detail") else outcome["status"]
    state["current"] = outcome | {
        "status": CONFLICTED, "files": files, "left": flagged, "hunk": None, "line": None,
        "detail": f"{was}; {len(flagged)} marked region(s) name what upstream removed ({rule}): check them",
    }
    state["names_stop"] = rule
    _save_rebase(tree, state)
    return True


def finish_rebase(tree: Tree) -> dict[str, Any] | None:
    """The snapshot after a done rebase wrote patches/: the rebase is over (no abort any more)."""
    state = rebase_state(tree)
    if state and state.get("done"):
        rebase_state_path(tree).unlink()  # refs/opencoti/pre-rebase still names the old stack
        return state
    return None


def _save_rebase(tree: Tree, state: dict[str, Any]) -> None:
    rebase_state_path(tree).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def import_pin(
    tree: Tree, pin: Pin, upstream: Upstream, settings: Settings, from_file: Path | None = None
) -> None:
    """Make ``upstream/<pin>`` exist in the tree repo (fetching the pin's source if needed)."""
    if tree.rev(pin.tag) is not None and tree.manifest_path(pin.name).is_file():
        problems = tree.verify_backup(pin.name)
        if problems:
            raise CheckFailed(f"stored upstream {pin.name} is damaged: {problems[0]}")
        return
    scratch = settings.work_dir / f".import-{pin.name}"
    if scratch.exists():
        shutil.rmtree(scratch)
    try:
        materialize(pin, upstream, settings, scratch, from_file)
        tree.import_dir(scratch, pin)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def rebase(
    tree: Tree,
    patches: list[Patch],
    pin: Pin,
    upstream: Upstream,
    settings: Settings,
    from_file: Path | None = None,
    force: bool = False,
    resolver: Resolver | None = None,
    names_check: NamesCheck | None = None,
) -> tuple[Report, dict[str, Any] | None]:
    """Re-apply the series (3-way) on top of ``pin``; stops at the first conflict, resolvable. With
    ``names_check``, a step that applied (clean, merged, auto-resolved) whose marked regions name
    what upstream removed stops too, as a conflict (``names_stop``)."""
    tree.require()
    tree.refuse_interrupted(f"rebase onto {pin.name}")
    refuse_during_rebase(tree, f"rebase onto {pin.name}")
    refuse_empty_series(tree, [p.name for p in patches], f"rebase onto {pin.name}")
    if pin.name == tree.pin:
        raise OpencotiError(f"the tree is already on {pin.name}")
    tree.guard_clean("rebase", force)
    import_pin(tree, pin, upstream, settings, from_file)
    orig = tree.head()
    tree.git("update-ref", "refs/opencoti/pre-rebase", orig)
    state: dict[str, Any] = {
        "from": tree.pin, "to": pin.name, "orig": orig, "current": None, "done": False,
        "remaining": [p.name for p in patches], "outcomes": [],
        "dropped_before": tree.read_state().get("dropped", []),
        "from_commit": tree.read_state().get("commit"),
        "default_before": upstream.default,
    }
    tree.reset_hard(pin.tag, ignored=True)
    tree.write_state(pin=pin.name, commit=pin.commit)
    _save_rebase(tree, state)
    return _rebase_run(tree, patches, state, resolver, names_check)


def _rebase_run(
    tree: Tree, patches: list[Patch], state: dict[str, Any], resolver: Resolver | None = None,
    names_check: NamesCheck | None = None,
) -> tuple[Report, dict[str, Any] | None]:
    by_name = {p.name: p for p in patches}
    while state["remaining"]:
        name = state["remaining"][0]
        if name not in by_name:
            raise OpencotiError(f"{name} left the series during the rebase; `rebase --abort` and retry")
        outcome = apply_one(tree, by_name[name], three_way=True, resolver=resolver)
        if outcome.status in APPLIED_OK and names_stop(tree, state, asdict(outcome), names_check):
            return _rebase_report(tree, state), state
        if outcome.status in APPLIED_OK:
            commit_patch(tree, by_name[name])
            state["outcomes"].append(asdict(outcome))
            state["remaining"].pop(0)
            _save_rebase(tree, state)
            continue
        if outcome.status == FAILED:
            tree.reset_hard("HEAD")
        state["current"] = asdict(outcome)
        _save_rebase(tree, state)
        return _rebase_report(tree, state), state
    state["done"] = True  # kept until `snapshot` rewrites patches/: `--abort` still goes back
    _save_rebase(tree, state)
    return _rebase_report(tree, state), None


def _rebase_report(tree: Tree, state: dict[str, Any]) -> Report:
    report = Report(pin=state["to"], outcomes=[Outcome(**o) for o in state["outcomes"]])
    if state.get("current"):
        report.outcomes.append(Outcome(**state["current"]))
        report.outcomes += [Outcome(n, "pending") for n in state["remaining"][1:]]
    return report


def _conflicted_state(tree: Tree, step: str) -> dict[str, Any]:
    state = rebase_state(tree)
    if not state:
        raise OpencotiError(f"no rebase in progress (nothing to {step})")
    if state.get("done") or not state.get("current"):
        raise OpencotiError(f"nothing to {step}: {rebase_waiting(tree, state)}")
    return state


def rebase_continue(tree: Tree, patches: list[Patch], resolver: Resolver | None = None,
                    names_check: NamesCheck | None = None) -> tuple[Report, dict[str, Any] | None]:
    """Commit the person's resolution of the conflicted step and go on. After an ordinary conflict
    the names check runs on the whole step first (what git merged cleanly beside the conflicts) and
    may stop it once more; after a names stop the tree is taken as the person left it (fixed, or
    judged right)."""
    tree.refuse_interrupted("rebase --continue")
    state = _conflicted_state(tree, "continue")
    by_name = {p.name: p for p in patches}
    name = state["remaining"][0]
    marked = [f for f in (state["current"] or {}).get("files", [])
              if (tree.path / f).is_file() and re.search(rb"^<<<<<<< ", (tree.path / f).read_bytes(), re.M)]
    if marked:
        raise OpencotiError(f"conflict markers remain in {', '.join(marked)}; resolve them, then --continue")
    tree.git("add", "--all", "--", ".")
    if name not in by_name:
        raise OpencotiError(f"{name} is no longer in the series; `rebase --abort` and retry")
    if not tree.git("diff", "--cached", "--name-only", "HEAD").text.strip():
        raise OpencotiError(
            f"nothing to commit for {name}: make its changes by hand, or `rebase --skip` to drop it"
        )
    if not state.get("names_stop") and names_stop(tree, state, state["current"], names_check):
        return _rebase_report(tree, state), state
    commit_patch(tree, by_name[name])
    return _step_done(tree, patches, state, "resolved", resolver, names_check)


def _step_done(tree: Tree, patches: list[Patch], state: dict[str, Any], status: str,
               resolver: Resolver | None = None, names_check: NamesCheck | None = None
               ) -> tuple[Report, dict[str, Any] | None]:
    """Record the conflicted step as ``status`` (resolved, skipped) and go on with the rest."""
    state["outcomes"].append(dict(state["current"]) | {"status": status})
    state["remaining"].pop(0)
    state["current"] = None
    state.pop("names_stop", None)
    _save_rebase(tree, state)
    return _rebase_run(tree, patches, state, resolver, names_check)


def rebase_abort(tree: Tree, force: bool = False) -> dict[str, Any]:
    """Back to the old pin and stack (also after the last step, until `snapshot` wrote patches/);
    returns the state that was aborted (``rescued``: where ``force`` saved uncaptured work). Once the
    rebase is done, edits and commits on the rebased stack are the user's: refused unless ``force``
    (during a conflict the tree's edits are the resolution being aborted)."""
    tree.refuse_interrupted("rebase --abort")
    state = rebase_state(tree)
    if not state:
        raise OpencotiError("no rebase in progress (a rebase ends when `snapshot` has rewritten "
                            "patches/; after that, `rebase --to` the old pin)")
    if state.get("done"):
        rescued = tree.guard_clean(f"abort the rebase onto {state['to']}", force)
        state["rescued"] = str(rescued) if rescued else None
    tree.reset_hard(state["orig"], ignored=True)
    restored = {"commit": state["from_commit"]} if state.get("from_commit") else {}
    tree.write_state(pin=state["from"], dropped=state.get("dropped_before", []), **restored)
    rebase_state_path(tree).unlink(missing_ok=True)
    tree.git("update-ref", "-d", "refs/opencoti/pre-rebase", check=False)
    before = state.get("default_before")
    path = tree.settings.upstream_file
    if before and before != state["to"] and path.is_file() and load_upstream(path).default == state["to"]:
        set_default_pin(path, before)  # `--write-pin` had moved it
        state["default_restored"] = before
    return state


def rebase_skip(tree: Tree, patches: list[Patch], resolver: Resolver | None = None,
                names_check: NamesCheck | None = None) -> tuple[Report, dict[str, Any] | None]:
    """Drop the conflicted patch and go on; the next `snapshot` takes it out of the series and sets
    its file aside in patches/skipped/."""
    tree.refuse_interrupted("rebase --skip")
    state = _conflicted_state(tree, "skip")
    tree.reset_hard("HEAD")
    dropped = tree.read_state().get("dropped", [])
    tree.write_state(dropped=sorted({*dropped, state["current"]["patch"]}))
    return _step_done(tree, patches, state, "skipped", resolver, names_check)

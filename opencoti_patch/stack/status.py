"""What the tree carries against patches/: the data of `status`, and whether a build is stale."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import OpencotiError
from .apply import rebase_state, refuse_empty_series
from .series import parse_patch, read_series
from .tree import StackCommit, Tree
from .upstream import load_upstream


def status_data(settings: Settings, verify: bool = False) -> dict[str, Any]:
    tree = Tree(settings)
    try:
        project_pin: str | None = load_upstream(settings.upstream_file).default
    except OpencotiError:
        project_pin = None
    data: dict[str, Any] = {"tree": str(settings.tree), "exists": tree.exists(), "pin": None,
                            "project_pin": project_pin, "backup": "none", "applied": [],
                            "unapplied": [], "uncaptured_commits": [], "dirty": [],
                            "interrupted": False, "rebase": None, "identity": None}
    series = read_series(settings.patches_dir)
    if not tree.exists() or not tree.is_repo() or not tree.read_state().get("pin"):
        data["backup"] = f"none (run `{settings.command('backup')}`)" if tree.exists() else "none"
        data["unapplied"] = series
        return data
    data["pin"] = tree.pin
    data["identity"] = tree.identity()
    if tree.rev(tree.tag) is None:
        data["backup"] = f"DAMAGED: tag {tree.tag} missing"
        return data
    if verify:
        problems = tree.verify_backup()
        data["backup"] = f"{tree.tag}: " + ("verified intact" if not problems else "DAMAGED: " + problems[0])
    else:
        data["backup"] = f"{tree.tag} (manifest present; `backup --verify` to prove it)" \
            if tree.manifest_path(tree.pin).is_file() else f"{tree.tag} (manifest MISSING)"
    refuse_empty_series(tree, series, "show the status against it")
    data["applied"], data["uncaptured_commits"] = applied_patches(settings, tree.stack(), series)
    names = {a["name"] for a in data["applied"]}
    data["unapplied"] = [n for n in series if n not in names]
    data["dirty"] = tree.dirty()
    data["interrupted"] = tree.interrupted()
    rebasing = rebase_state(tree)
    if rebasing:
        current = rebasing.get("current") or {}
        skipped = [o["patch"] for o in rebasing.get("outcomes", []) if o.get("status") == "skipped"]
        data["rebase"] = {"to": rebasing["to"], "from": rebasing.get("from"), "current": current.get("patch"),
                          "files": current.get("files", []), "done": bool(rebasing.get("done")),
                          "skipped": skipped, "remaining": rebasing.get("remaining", [])[1:],
                          "names_stop": bool(rebasing.get("names_stop")), "left": current.get("left", [])}
    return data


def applied_patches(settings: Settings, stack: list[StackCommit], series: list[str]
                    ) -> tuple[list[dict[str, str]], list[str]]:
    """The patch commits of ``stack`` with their state against patches/ (``ok``, ``not in series``,
    ``file missing``, ``file changed since applied``), and the commits not captured as patches."""
    applied: list[dict[str, str]] = []
    loose: list[str] = []
    for c in stack:
        if c.patch is None:
            loose.append(f"{c.sha[:12]} {c.subject}")
            continue
        path = settings.patches_dir / c.patch
        state = "ok"
        if c.patch not in series:
            state = "not in series"
        elif not path.is_file():
            state = "file missing"
        elif parse_patch(path).sha256 != c.patch_sha256:
            state = "file changed since applied"
        applied.append({"name": c.patch, "state": state})
    return applied, loose


def stale_against_series(tree: Tree, rev: str | None = None) -> list[str]:
    """Why the tree's files (or, with ``rev``, that commit of the tree) are not exactly pristine +
    patches/series (empty: they are)."""
    settings = tree.settings
    series = read_series(settings.patches_dir) if settings.series_file.is_file() else []
    if rev is None:
        data = status_data(settings)
        applied, loose, dirty = data["applied"], data["uncaptured_commits"], data["dirty"]
        rebase = data["rebase"]
    else:
        if tree.rev(rev) is None:
            raise OpencotiError(f"--rev {rev}: no such commit in {tree.path}")
        try:
            stack = tree.stack(rev)
        except OpencotiError as exc:
            return [exc.message]
        applied, loose = applied_patches(settings, stack, series)
        dirty = []  # the commit is built, not the files on disk
        rebase = None  # a commit is what it is, whatever the tree is doing now
    names = [a["name"] for a in applied]
    problems = [f"{a['name']}: {a['state']}" for a in applied if a["state"] != "ok"]
    problems += [f"{n}: not applied" for n in series if n not in names]
    problems += [f"uncaptured commit {c}" for c in loose]
    if dirty:
        problems.append(f"{len(dirty)} uncaptured edit(s) ({', '.join(d.strip() for d in dirty)})")
    if names != series[: len(names)]:
        problems.append("the applied patches are not the series' order")
    if rebase:
        problems.append(f"a rebase onto {rebase['to']} is not finished (`snapshot` writes its "
                        "patches)" if rebase["done"] else
                        f"a rebase onto {rebase['to']} stopped at a conflict")
    return problems

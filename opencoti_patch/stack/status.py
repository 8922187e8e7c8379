"""What the tree carries against patches/: the data of `status`, and whether a build is stale."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import OpencotiError
from .apply import rebase_state
from .series import parse_patch, read_series
from .tree import Tree
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
                            "interrupted": False, "rebase": None}
    series = read_series(settings.patches_dir)
    if not tree.exists() or not tree.is_repo() or not tree.read_state().get("pin"):
        data["backup"] = f"none (run `{settings.command('backup')}`)" if tree.exists() else "none"
        data["unapplied"] = series
        return data
    data["pin"] = tree.pin
    if tree.rev(tree.tag) is None:
        data["backup"] = f"DAMAGED: tag {tree.tag} missing"
        return data
    if verify:
        problems = tree.verify_backup()
        data["backup"] = f"{tree.tag}: " + ("verified intact" if not problems else "DAMAGED: " + problems[0])
    else:
        data["backup"] = f"{tree.tag} (manifest present; `backup --verify` to prove it)" \
            if tree.manifest_path(tree.pin).is_file() else f"{tree.tag} (manifest MISSING)"
    by_name = {name: settings.patches_dir / name for name in series}
    stack = tree.stack()
    applied = []
    for c in stack:
        if c.patch is None:
            data["uncaptured_commits"].append(f"{c.sha[:12]} {c.subject}")
            continue
        state = "ok"
        if c.patch not in by_name:
            state = "not in series"
        elif not by_name[c.patch].is_file():
            state = "file missing"
        elif parse_patch(by_name[c.patch]).sha256 != c.patch_sha256:
            state = "file changed since applied"
        applied.append({"name": c.patch, "state": state})
    data["applied"] = applied
    names = {a["name"] for a in applied}
    data["unapplied"] = [n for n in series if n not in names]
    data["dirty"] = tree.dirty()
    data["interrupted"] = tree.interrupted()
    rebasing = rebase_state(tree)
    if rebasing:
        current = rebasing.get("current") or {}
        skipped = [o["patch"] for o in rebasing.get("outcomes", []) if o.get("status") == "skipped"]
        data["rebase"] = {"to": rebasing["to"], "from": rebasing.get("from"), "current": current.get("patch"),
                          "files": current.get("files", []), "done": bool(rebasing.get("done")),
                          "skipped": skipped, "remaining": rebasing.get("remaining", [])[1:]}
    return data


def stale_against_series(tree: Tree) -> list[str]:
    """Why the tree's files are not exactly pristine + patches/series (empty: they are)."""
    settings = tree.settings
    series = read_series(settings.patches_dir) if settings.series_file.is_file() else []
    data = status_data(settings)
    problems = [f"{a['name']}: {a['state']}" for a in data["applied"] if a["state"] != "ok"]
    problems += [f"{n}: not applied" for n in data["unapplied"]]
    problems += [f"uncaptured commit {c}" for c in data["uncaptured_commits"]]
    if data["dirty"]:
        problems.append(f"{len(data['dirty'])} uncaptured edit(s) ({data['dirty'][0].strip()}, ...)")
    if [a["name"] for a in data["applied"]] != series[: len(data["applied"])]:
        problems.append("the applied patches are not the series' order")
    if data["rebase"]:
        problems.append(f"a rebase onto {data['rebase']['to']} is not finished (`snapshot` writes its "
                        "patches)" if data["rebase"]["done"] else
                        f"a rebase onto {data['rebase']['to']} stopped at a conflict")
    return problems

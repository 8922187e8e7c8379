"""The CLI stays compatible: every command and option of the CLI before the house restructuring
(tests/cli_options_before_house.json, dumped from it) still exists, under the command line it had (the lab's
commands, now ``opencoti-patch lab ...``, also run under their former top-level names)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from opencoti_patch.cli import cli
from opencoti_patch.cli.main import FORMER_TOP_LEVEL
from opencoti_patch.lab.cli import lab_group

BEFORE = json.loads((Path(__file__).parent / "cli_options_before_house.json").read_text())


def resolve(path: str) -> click.Command | None:
    """The command that ``opencoti-patch PATH`` runs (None: no such command)."""
    cmd: click.Command | None = cli
    for word in [] if path == "<root>" else path.split():
        if not isinstance(cmd, click.Group):
            return None
        cmd = cmd.get_command(click.Context(cmd), word)
    return cmd


def flags(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")} | \
        {p.name or "" for p in cmd.params if isinstance(p, click.Argument)}


def test_every_command_and_option_of_before_still_exists() -> None:
    missing = {}
    for path, opts in BEFORE.items():
        cmd = resolve(path)
        if cmd is None or set(opts) - flags(cmd):
            missing[path] = sorted(set(opts) - (flags(cmd) if cmd else set()))
    assert missing == {}


def test_the_lab_is_one_group_and_its_former_names_are_not_listed() -> None:
    ctx = click.Context(cli)
    listed = cli.list_commands(ctx)
    assert listed[-1] == "lab" and not set(FORMER_TOP_LEVEL) & set(listed)
    for name in FORMER_TOP_LEVEL:
        assert resolve(name) is lab_group.commands[name]
    assert "lab" in cli.get_help(ctx) and "selector" not in cli.get_help(ctx).split("lab  ")[0]

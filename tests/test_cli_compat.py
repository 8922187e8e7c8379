"""The CLI stays compatible: every command and option of the CLI before the house restructuring
(tests/cli_options_before_house.json, dumped from it) still exists."""

from __future__ import annotations

import json
from pathlib import Path

import click

from opencoti_patch.cli import cli

BEFORE = json.loads((Path(__file__).parent / "cli_options_before_house.json").read_text())


def options(cmd: click.Command, prefix: str = "") -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            out.update(options(sub, f"{prefix} {name}".strip()))
    flags = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
    out[prefix or "<root>"] = flags | {p.name or "" for p in cmd.params if isinstance(p, click.Argument)}
    return out


def test_every_command_and_option_of_before_still_exists() -> None:
    now = options(cli)
    missing = {cmd: sorted(set(opts) - now.get(cmd, set())) for cmd, opts in BEFORE.items()}
    assert {cmd: opts for cmd, opts in missing.items() if opts or cmd not in now} == {}

"""Every command docs/usage.md documents exists and answers ``--help`` (exit 0, a usage line), and every
command of the CLI is documented there by its full name (``lab selector passkey``)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from opencoti_patch.cli import cli

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)  # a fenced block or a `span`
COMMAND_LINE = re.compile(r"opencoti-patch((?: [a-z][a-z0-9|-]*)+)")  # `opencoti-patch lab eval passkey|all`
WORDS = re.compile(r"[a-z][a-z0-9|-]*(?: [a-z][a-z0-9|-]*)*")  # a span's leading words: `pin list [--json]`


def command_path(words: list[str]) -> list[str]:
    """The longest prefix of ``words`` that names a command (``lab selector passkey``); [] when the first
    word names none."""
    cmd: click.Command = cli
    path: list[str] = []
    for word in words:
        sub = cmd.get_command(click.Context(cmd), word) if isinstance(cmd, click.Group) else None
        if sub is None:
            break
        cmd, path = sub, path + [word]
    return path


def expand(words: list[str]) -> list[list[str]]:
    """``lab eval passkey|fidelity|all`` -> one command each; the alternatives end the words."""
    for i, w in enumerate(words):
        if "|" in w:
            return [words[:i] + [alt] for alt in w.split("|") if alt]
    return [words]


def command_lines() -> list[list[str]]:
    """The words after every ``opencoti-patch`` in the code of docs/usage.md: each must name a command."""
    text = USAGE.read_text(encoding="utf-8")
    return [words for code in CODE.findall(text) for m in COMMAND_LINE.finditer(code)
            for words in expand(m.group(1).split())]


def named_commands() -> set[str]:
    """Every command the code of docs/usage.md names: its command lines, and the spans that start with a
    command's words (``pin list [--json]``, ``lab bench report RESULTS``)."""
    text = USAGE.read_text(encoding="utf-8")
    out = {" ".join(command_path(w)) for w in command_lines()}
    for code in CODE.findall(text):
        m = WORDS.match(code.strip("`"))
        if m:
            out |= {" ".join(command_path(w)) for w in expand(m.group(0).split())}
    return out - {""}


def named(words: list[str]) -> tuple[str, ...]:
    """The command ``words`` name, or all of them where they name none (a word after a group that is none of
    its commands, as in ``lab evall passkey``, names none)."""
    path = command_path(words)
    cmd = cli
    for w in path:
        cmd = cmd.get_command(click.Context(cmd), w)
    return tuple(words if not path or (isinstance(cmd, click.Group) and len(path) < len(words)) else path)


@pytest.mark.parametrize("words", sorted({named(w) for w in command_lines()}), ids=" ".join)
def test_a_documented_command_answers_help(words: tuple[str, ...]) -> None:
    assert command_path(list(words)) == list(words), \
        f"docs/usage.md: `opencoti-patch {' '.join(words)}`: no such command"
    res = CliRunner().invoke(cli, [*words, "--help"])
    assert res.exit_code == 0 and res.output.lower().startswith("usage: "), res.output


def leaves(cmd: click.Command, prefix: tuple[str, ...] = ()) -> list[str]:
    if isinstance(cmd, click.Group):
        return [x for name, sub in cmd.commands.items() for x in leaves(sub, (*prefix, name))]
    return [" ".join(prefix)]


def test_every_command_is_documented() -> None:
    missing = [c for c in leaves(cli) if c not in named_commands()]
    assert missing == [], f"not in docs/usage.md: {missing}"

"""The options every command shares, resolved into one ``Settings``; output helpers.

Every path option of every command comes in here: ``--tree``, ``--work-dir``, ``--patches-dir``,
``--lock-wait`` (``common_options``), and the path defaults of the other commands are derived
from the resolved ``Settings`` (never a machine's absolute path).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ..config import Settings
from ..errors import Interrupted

F = TypeVar("F", bound=Callable[..., Any])


def common_options(func: F) -> F:
    """--tree/--work-dir/--patches-dir/--lock-wait, resolved into a Settings passed as ``settings``."""

    @click.option("--tree", "tree_path", type=click.Path(file_okay=False, path_type=Path),
                  help="Vendored llama.cpp tree [env OPENCOTI_TREE; default <work-dir>/llama.cpp].")
    @click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
                  help="Work folder [env OPENCOTI_WORK; default ./work].")
    @click.option("--patches-dir", type=click.Path(file_okay=False, path_type=Path),
                  help="Folder with series, upstream.toml and the patches [env OPENCOTI_PATCHES].")
    @click.option("--lock-wait", type=float, default=None, metavar="SECONDS",
                  help="Wait this long for another run's lock instead of refusing at once.")
    @functools.wraps(func)
    def wrapper(tree_path: Path | None, work_dir: Path | None, patches_dir: Path | None,
                lock_wait: float | None, **kwargs: Any) -> Any:
        settings = Settings.resolve(tree=tree_path, work_dir=work_dir, patches_dir=patches_dir,
                                    lock_wait=lock_wait)
        try:
            return func(settings=settings, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted(
                "interrupted; the tree was put back at the last good patch "
                f"(`{settings.command('status')}`)"
            ) from None

    return wrapper  # type: ignore[return-value]


def option_group(*options: Callable[[F], F]) -> Callable[[F], F]:
    """The decorators ``options`` as one (options several commands share), applied so that ``--help`` lists
    them in the order given."""
    def apply(func: F) -> F:
        for option in reversed(options):
            func = option(func)
        return func

    return apply


class OrderedGroup(click.Group):
    """A command group whose help lists its commands in the order they were added (not by name)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


def emit(data: Any, as_json: bool, text: str | None = None) -> None:
    """Print ``data`` as JSON (``--json``) or ``text`` for humans."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    elif text:
        click.echo(text.rstrip("\n"))


def int_list(text: str) -> list[int]:
    """``"4096,8192"`` -> [4096, 8192] (a comma-separated option value)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc


def fraction_list(text: str) -> list[float]:
    """``"0.25,0.5"`` -> [0.25, 0.5]: shares of the context, each in (0, 1), at least one."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated fractions, got {text!r}") from exc
    if not out or any(not 0 < f < 1 for f in out):
        raise click.BadParameter("budgets are fractions of the context in (0, 1), e.g. 0.25,0.5")
    return out

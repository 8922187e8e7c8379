"""Command-line entry point: one click group; the commands live in one module per group."""

from __future__ import annotations

from typing import Any

import click

from .. import __version__
from ..errors import OpencotiError
from . import bench, build, loadtest, markers, multidevice, pin, quality, selector, stack


class _Failure(click.ClickException):
    """An ``OpencotiError`` as click prints it: one line on stderr, the documented exit code."""

    def __init__(self, error: OpencotiError) -> None:
        super().__init__(error.message)
        self.exit_code = error.exit_code


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OpencotiError as exc:
            raise _Failure(exc) from exc


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="opencoti-patch")
def cli() -> None:
    """Keep llama.cpp as pristine upstream + an ordered series of patches.

    Typical flow: fetch -> backup -> apply -> markers -> rebuild -> verify-identical.
    """


for _command in (markers.markers_command, *stack.COMMANDS, *pin.COMMANDS, *build.COMMANDS, *quality.COMMANDS,
                 loadtest.loadtest_command, *bench.COMMANDS, *selector.COMMANDS,
                 *multidevice.COMMANDS):
    cli.add_command(_command)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

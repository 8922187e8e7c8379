"""Command-line entry point: one click group; the toolkit's commands live in one module per group, the
lab's under one group of their own (``opencoti-patch lab ...``, :mod:`opencoti_patch.lab.cli`)."""

from __future__ import annotations

from typing import Any

import click

from .. import __version__
from ..errors import OpencotiError
from ..lab.cli import lab_group
from . import builds, markers, pin, stack
from .options import OrderedGroup

# the lab's commands were top-level before they became one group: those spellings still run (the command lines
# that docs/results records), listed nowhere
FORMER_TOP_LEVEL = ("eval", "selector", "bench", "loadtest", "multidevice")


class _Failure(click.ClickException):
    """An ``OpencotiError`` as click prints it: one line on stderr, the documented exit code."""

    def __init__(self, error: OpencotiError) -> None:
        super().__init__(error.message)
        self.exit_code = error.exit_code


class _Group(OrderedGroup):
    """Lists the toolkit's commands in the order a maintainer meets them, the lab as one group after them."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OpencotiError as exc:
            raise _Failure(exc) from exc

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in FORMER_TOP_LEVEL:
            return lab_group.commands.get(cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(n) for n in self.commands)
        with formatter.section("Commands"):
            formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in self.commands.items()
                                if cmd is not lab_group])
        with formatter.section("The sparse-attention lab (opencoti-patch lab --help)"):
            formatter.write_dl([("lab", ", ".join(lab_group.commands))])


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="opencoti-patch")
def cli() -> None:
    """Keep llama.cpp as pristine upstream + an ordered series of patches.

    Typical flow: prepare (fetch -> backup -> apply) -> markers -> rebuild -> verify-identical.
    """


for _command in (*stack.COMMANDS, *pin.COMMANDS, markers.markers_command, *builds.COMMANDS, lab_group):
    cli.add_command(_command)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

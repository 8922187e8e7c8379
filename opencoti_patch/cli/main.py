"""Command-line entry point: click commands only, the work lives in the stage modules."""

from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="opencoti-patch")
def cli() -> None:
    """Keep llama.cpp as pristine upstream + an ordered series of patches.

    Typical flow: fetch -> backup -> apply -> markers -> rebuild -> verify-identical.
    """


# Command modules register themselves here (one import + add_command line each).
# COMMANDS-BEGIN
from ..markers.audit import markers_command  # noqa: E402

cli.add_command(markers_command)
from .stack import COMMANDS as CORE_COMMANDS  # noqa: E402

for _command in CORE_COMMANDS:
    cli.add_command(_command)
from .build import COMMANDS as BUILD_COMMANDS  # noqa: E402

for _command in BUILD_COMMANDS:
    cli.add_command(_command)
from .quality import COMMANDS as EVAL_COMMANDS  # noqa: E402

for _command in EVAL_COMMANDS:
    cli.add_command(_command)
from .loadtest import loadtest_command  # noqa: E402

cli.add_command(loadtest_command)
from .bench import COMMANDS as BENCH_COMMANDS  # noqa: E402

for _command in BENCH_COMMANDS:
    cli.add_command(_command)
# COMMANDS-END


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

"""Command-line entry point: click commands only, the work lives in the stage modules."""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="opencoti-patch")
def cli() -> None:
    """Keep llama.cpp as pristine upstream + an ordered series of patches.

    Typical flow: fetch -> backup -> apply -> markers -> rebuild -> verify-identical.
    """


# Command modules register themselves here (one import + add_command line each).
# COMMANDS-BEGIN
# COMMANDS-END


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

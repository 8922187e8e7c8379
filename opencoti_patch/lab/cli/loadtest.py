"""Click command ``loadtest``: forwards its arguments to loadtest.py's own parser.

loadtest.py keeps an argparse front end so that it also runs where click is not installed
(``python3 -m opencoti_patch.lab.loadtest`` on a GPU host); this wrapper keeps one source of options.
"""

from __future__ import annotations

import sys

import click

from .. import loadtest


@click.command(
    "loadtest",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def loadtest_command(args: tuple[str, ...]) -> None:
    """Bounded serving load test of llama-server (dense vs sparse); --help for the options."""
    sys.exit(loadtest.main(list(args), prog="opencoti-patch loadtest"))

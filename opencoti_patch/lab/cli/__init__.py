"""Layer 8: the lab's click commands, one group: ``opencoti-patch lab <command>`` (click lives only in
cli/ folders)."""

from __future__ import annotations

import click

from ...cli.options import OrderedGroup
from . import bench, eval, loadtest, multidevice, selector


@click.group("lab", cls=OrderedGroup)
def lab_group() -> None:
    """The sparse-attention lab: measure the series' block selection (quality, speed, serving, devices)."""


for _command in (*eval.COMMANDS, *selector.COMMANDS, *bench.COMMANDS, *loadtest.COMMANDS,
                 *multidevice.COMMANDS):  # listed in this order
    lab_group.add_command(_command)

__all__ = ["lab_group"]

"""Layer 7 (toolkit): the click command line (click lives only in cli/ folders); ``main`` (layer 9) adds the
lab's group (``lab/cli/``, layer 8).

The package's face loads no command: ``cli`` and ``main`` come from :mod:`.main` when asked for, so that the
lab's commands can import the shared options (:mod:`.options`) without the entry point importing them back.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cli", "main"]


def main() -> None:
    """The ``opencoti-patch`` entry point."""
    from .main import main as run  # noqa: PLC0415

    run()


def __getattr__(name: str) -> Any:
    if name == "cli":
        from .main import cli  # noqa: PLC0415

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

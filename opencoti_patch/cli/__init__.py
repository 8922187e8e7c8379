"""Layer 7 (toolkit): the click command line (click lives only in cli/ folders); ``main`` (layer 9)
adds the lab's group (``lab/cli/``, layer 8)."""

from .main import cli, main

__all__ = ["cli", "main"]

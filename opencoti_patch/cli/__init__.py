"""Layer 5: the click command line (click lives only here)."""

from .main import cli, main

__all__ = ["cli", "main"]

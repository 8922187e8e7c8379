"""opencoti-patch: keep llama.cpp as pristine upstream plus an ordered patch series."""

__version__ = "0.1.0"

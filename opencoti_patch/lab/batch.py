"""The lab's programs (``lab/harness/``, C++): ``opencoti-harness-batch`` (many requests per process, dense
or sparse decode variants) and ``opencoti-qk-dump`` (the Q/K of a dense prefill), built against a llama.cpp
build by the toolkit's harness builder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..builds.harness import build_harness

LAB_HARNESS = Path(__file__).resolve().parent / "harness"
BATCH_EXE = "opencoti-harness-batch"
DUMP_EXE = "opencoti-qk-dump"


def build_lab_harness(llama_src: Path, llama_bin: Path, build_dir: Path,
                      targets: Sequence[str] = (BATCH_EXE,)) -> Path:
    """Build ``targets`` of the lab's programs against the build in ``llama_bin``; returns ``build_dir``."""
    return build_harness(llama_src, llama_bin, build_dir, targets=targets, source=LAB_HARNESS)

